//! Server processes, endpoints and the database: the `idem serve` children
//! (killed with SIGKILL and restarted on the same store), the endpoints clients
//! and executors spread over, and the database read for the run's task ids.

use super::*;

/// Where and how one instance runs.
pub(super) struct Placement {
    /// Program and arguments it runs under (`ip netns exec NS`); empty: directly.
    pub(super) prefix: Vec<String>,
    /// `--listen` address.
    pub(super) listen: String,
    /// `--store` URL (with `--netns`: its forwarder's address).
    pub(super) store_url: String,
}

/// The `idem serve` child processes.
pub(super) struct Servers {
    pub(super) bin: PathBuf,
    pub(super) config: PathBuf,
    pub(super) dir: PathBuf,
    pub(super) placements: Vec<Placement>,
    /// The shifted clock of [`SKEWED_SERVER`] (`--clock-skew-ms`).
    pub(super) skew: Option<Skew>,
    /// The HTTP client that reads the skewed instance's `Date` after each start.
    pub(super) http: reqwest::Client,
    pub(super) slots: Vec<tokio::sync::Mutex<Option<Child>>>,
}

impl Servers {
    async fn spawn(&self, idx: usize) -> Result<(Child, String)> {
        let place = self
            .placements
            .get(idx)
            .with_context(|| format!("no server {idx}"))?;
        let args: Vec<std::ffi::OsString> = vec![
            "--store".into(),
            place.store_url.clone().into(),
            "--config".into(),
            self.config.clone().into(),
            "--sweep-interval-ms".into(),
            "50".into(),
        ];
        let skewed = self.skew.as_ref().filter(|_| idx == SKEWED_SERVER);
        let (start, offset, env) = skewed.map_or((0, 0, Vec::new()), Skew::next_start);
        let log = self.dir.join(format!("server-{idx}.log"));
        let how = server::ServeCommand {
            bin: &self.bin,
            prefix: &place.prefix,
            listen: &place.listen,
            env: &env,
        };
        let (child, url) = server::spawn_serve_in(how, &args, &log, "warn")
            .await
            .with_context(|| format!("server {idx}"))?;
        if let Some(skew) = skewed {
            skew.verify(&self.http, &url, start, offset).await?;
        }
        Ok((child, url))
    }

    /// Starts (or, after a SIGKILL, restarts) server `idx`; returns its URL.
    pub(super) async fn restart(&self, idx: usize, kill_first: bool) -> Result<String> {
        let mut slot = self.slots[idx].lock().await;
        if kill_first && let Some(mut c) = slot.take() {
            // tokio's kill() is SIGKILL on unix, then waits for the exit.
            let _ = c.kill().await;
        }
        let (child, url) = self.spawn(idx).await?;
        *slot = Some(child);
        Ok(url)
    }

    pub(super) async fn stop_all(&self) {
        for s in &self.slots {
            if let Some(mut c) = s.lock().await.take() {
                let _ = c.kill().await;
            }
        }
    }
}

#[derive(Clone)]
pub(super) struct Endpoint {
    pub(super) client: Client,
    pub(super) exec: Client,
}

/// The live servers' endpoints; clients and executors follow restarts.
pub(super) struct Targets {
    pub(super) slots: RwLock<Vec<Option<Endpoint>>>,
    pub(super) rr: AtomicUsize,
    pub(super) http: reqwest::Client,
    pub(super) client_key: String,
    pub(super) exec_key: String,
}

impl Targets {
    pub(super) fn set(&self, idx: usize, url: Option<&str>) -> Result<()> {
        let ep = match url {
            Some(u) => Some(Endpoint {
                client: Client::new(u, self.client_key.clone())?
                    .with_http_client(self.http.clone())
                    .with_timeout(REQUEST_TIMEOUT),
                exec: Client::new(u, self.exec_key.clone())?
                    .with_http_client(self.http.clone())
                    .with_timeout(REQUEST_TIMEOUT),
            }),
            None => None,
        };
        let mut slots = self
            .slots
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(s) = slots.get_mut(idx) {
            *s = ep;
        }
        Ok(())
    }

    pub(super) fn pick(&self) -> Option<Endpoint> {
        let slots = self
            .slots
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let live: Vec<&Endpoint> = slots.iter().flatten().collect();
        if live.is_empty() {
            return None;
        }
        let n = self.rr.fetch_add(1, Ordering::Relaxed);
        Some(live[n % live.len()].clone())
    }

    pub(super) async fn wait_pick(&self, deadline: Instant) -> Option<Endpoint> {
        loop {
            if let Some(e) = self.pick() {
                return Some(e);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The run's own view of the store. PostgreSQL: a connection that is
/// opened again when it was lost, through the URL's hosts (after a failover,
/// on the promoted standby).
pub(super) enum Db {
    Sqlite(PathBuf),
    Pg(
        Box<tokio_postgres::Config>,
        tokio::sync::Mutex<Option<Arc<tokio_postgres::Client>>>,
    ),
}

impl Db {
    pub(super) async fn connect_pg(url: &str) -> Result<Db> {
        let mut cfg: tokio_postgres::Config = url.parse().context("parsing the PostgreSQL URL")?;
        cfg.application_name("idem-chaos");
        let db = Db::Pg(Box::new(cfg), tokio::sync::Mutex::new(None));
        db.pg().await?;
        Ok(db)
    }

    /// The PostgreSQL connection, opened again when it was closed.
    async fn pg(&self) -> Result<Arc<tokio_postgres::Client>> {
        let Db::Pg(cfg, held) = self else {
            bail!("not a PostgreSQL store");
        };
        let mut held = held.lock().await;
        if let Some(c) = held.as_ref().filter(|c| !c.is_closed()) {
            return Ok(Arc::clone(c));
        }
        let (client, conn) = cfg
            .connect(tokio_postgres::NoTls)
            .await
            .context("connecting to PostgreSQL")?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let client = Arc::new(client);
        *held = Some(Arc::clone(&client));
        Ok(client)
    }

    pub(super) async fn list(&self, tenant: &str) -> Result<Vec<DbTask>> {
        match self {
            Db::Sqlite(path) => {
                let path = path.clone();
                let tenant = tenant.to_owned();
                tokio::task::spawn_blocking(move || -> Result<Vec<DbTask>> {
                    let c = rusqlite::Connection::open_with_flags(
                        &path,
                        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                    )?;
                    c.busy_timeout(Duration::from_secs(10))?;
                    let mut st = c.prepare(
                        "SELECT id, operation, idempotency_key, state FROM tasks WHERE tenant = ?1",
                    )?;
                    let rows = st.query_map(rusqlite::params![tenant], |r| {
                        Ok((
                            r.get::<_, String>(0)?,
                            r.get::<_, String>(1)?,
                            r.get::<_, String>(2)?,
                            r.get::<_, String>(3)?,
                        ))
                    })?;
                    let mut out = Vec::new();
                    for row in rows {
                        let (id, operation, idempotency_key, state) = row?;
                        out.push(DbTask {
                            id: id.parse()?,
                            operation,
                            idempotency_key,
                            state,
                        });
                    }
                    Ok(out)
                })
                .await?
            }
            Db::Pg(..) => {
                let c = self.pg().await?;
                let rows = c
                    .query(
                        "SELECT id, operation, idempotency_key, state FROM tasks WHERE tenant = $1",
                        &[&tenant],
                    )
                    .await?;
                Ok(rows
                    .iter()
                    .map(|r| DbTask {
                        id: r.get(0),
                        operation: r.get(1),
                        idempotency_key: r.get(2),
                        state: r.get(3),
                    })
                    .collect())
            }
        }
    }

    /// Terminates every connection of the idem server processes; returns how many.
    pub(super) async fn terminate_idem_connections(&self) -> Result<u64> {
        match self {
            Db::Sqlite(_) => Ok(0),
            Db::Pg(..) => {
                let c = self.pg().await?;
                let row = c
                    .query_one(
                        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                         WHERE application_name = 'idem' AND datname = current_database() AND pid <> pg_backend_pid()",
                        &[],
                    )
                    .await?;
                Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
            }
        }
    }
}

pub(super) fn is_terminal_word(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled")
}
