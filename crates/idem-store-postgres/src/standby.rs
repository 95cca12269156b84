//! Whether the primary has a synchronous standby attached, for servers that
//! must refuse writes without one (`IDEM_REQUIRE_SYNC_STANDBY`, SPEC §5).
//!
//! A commit that PostgreSQL acknowledged is safe from a failover only when a
//! synchronous standby confirmed it first (`synchronous_standby_names`,
//! `synchronous_commit = on` or `remote_apply`): without one attached, either
//! `synchronous_standby_names` is empty and commits are acknowledged by the
//! primary alone (a failover may lose them), or it is set and every commit
//! waits until a standby attaches. [`SyncStandbyWatch`] reads the primary's
//! `pg_stat_replication` on a connection of its own every `every` and keeps
//! the last reading, so a request reads a cached value, never the database.

use std::sync::Arc;
use std::time::Duration;

use idem_store::{Result, StoreError};
use tokio::sync::watch;

use crate::{PgOptions, error, session_config, tls};

/// How often [`SyncStandbyWatch`] reads `pg_stat_replication` by default.
pub const SYNC_STANDBY_CHECK_EVERY: Duration = Duration::from_secs(1);

/// The reading: one row, `synchronous_standby_names`, how many standbys are
/// synchronous (`sync_state` `sync` or `quorum`), and whether this role may
/// read `sync_state` (without `pg_read_all_stats` PostgreSQL shows it as
/// NULL).
pub const SYNC_STANDBY_SQL: &str = "SELECT current_setting('synchronous_standby_names'), \
     (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')), \
     pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') /* idem synchronous standby check */";

/// What the last check of the primary found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncStandby {
    /// This many standbys are synchronous (at least one).
    Attached(i64),
    /// None is; `synchronous_standby_names` as the primary has it (empty:
    /// commits do not wait for any standby).
    Missing {
        /// `synchronous_standby_names`.
        names: String,
    },
    /// The role may not read `pg_stat_replication.sync_state`.
    Unreadable,
    /// The check failed (the database is unreachable, or no server accepts
    /// writes): why.
    Unchecked(String),
}

impl SyncStandby {
    /// `None` when a synchronous standby is attached; otherwise why writes
    /// are refused, for `/readyz` and the 503's `detail`.
    pub fn refusal(&self) -> Option<String> {
        match self {
            SyncStandby::Attached(_) => None,
            SyncStandby::Missing { names } if names.trim().is_empty() => Some(
                "no synchronous standby is attached: synchronous_standby_names is empty on the \
                 primary, so a failover could lose acknowledged writes (IDEM_REQUIRE_SYNC_STANDBY)"
                    .into(),
            ),
            SyncStandby::Missing { names } => Some(format!(
                "no synchronous standby is attached (synchronous_standby_names = '{names}' on the \
                 primary, no standby in pg_stat_replication with sync_state sync or quorum) \
                 (IDEM_REQUIRE_SYNC_STANDBY)"
            )),
            SyncStandby::Unreadable => Some(
                "cannot tell whether a synchronous standby is attached: the store's role may not \
                 read pg_stat_replication.sync_state; grant it pg_monitor (or pg_read_all_stats) \
                 (IDEM_REQUIRE_SYNC_STANDBY)"
                    .into(),
            ),
            SyncStandby::Unchecked(why) => Some(format!(
                "cannot tell whether a synchronous standby is attached: {why} \
                 (IDEM_REQUIRE_SYNC_STANDBY)"
            )),
        }
    }
}

/// The last [`SyncStandby`] reading, renewed by a task of its own every
/// `every` until this is dropped.
#[derive(Debug)]
pub struct SyncStandbyWatch {
    state: watch::Receiver<SyncStandby>,
    _stop: Arc<watch::Sender<()>>,
}

impl SyncStandbyWatch {
    /// Reads the primary of `url` once, then every `every` on a connection
    /// of its own (it follows the primary as the pool does: the URL's hosts,
    /// `target_session_attrs`).
    ///
    /// # Errors
    /// [`StoreError::Config`] when `url` does not parse or its TLS settings
    /// cannot be used. An unreachable database is not an error: the reading
    /// is then [`SyncStandby::Unchecked`].
    pub async fn start(url: &str, every: Duration) -> Result<SyncStandbyWatch> {
        let (cfg, target, _) = session_config(url, &PgOptions::default())?;
        let tls = tls::connector(&target)?;
        let mut client = None;
        let first = check(&cfg, &tls, &mut client).await;
        let (tx, state) = watch::channel(first);
        let (stop, mut stopped) = watch::channel(());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stopped.changed() => return,
                    () = tokio::time::sleep(every) => {}
                }
                let now = check(&cfg, &tls, &mut client).await;
                tx.send_if_modified(|old| {
                    if *old == now {
                        return false;
                    }
                    match now.refusal() {
                        None => tracing::info!(?now, "a synchronous standby is attached"),
                        Some(why) => tracing::warn!(%why, "submits are refused"),
                    }
                    *old = now;
                    true
                });
            }
        });
        Ok(SyncStandbyWatch {
            state,
            _stop: Arc::new(stop),
        })
    }

    /// The last reading.
    pub fn current(&self) -> SyncStandby {
        self.state.borrow().clone()
    }

    /// A receiver of the readings (each change is sent).
    pub fn subscribe(&self) -> watch::Receiver<SyncStandby> {
        self.state.clone()
    }
}

/// One reading on `client` (connected first when `None`, dropped on error),
/// within the check's own bound.
async fn check(
    cfg: &tokio_postgres::Config,
    tls: &tokio_postgres_rustls::MakeRustlsConnect,
    client: &mut Option<tokio_postgres::Client>,
) -> SyncStandby {
    let bound = Duration::from_secs(3);
    let read = async {
        if client
            .as_ref()
            .is_none_or(tokio_postgres::Client::is_closed)
        {
            let (c, connection) = cfg
                .connect(tls.clone())
                .await
                .map_err(|e| StoreError::Unavailable(error::pg_error_text(&e)))?;
            tokio::spawn(connection);
            *client = Some(c);
        }
        let Some(c) = client.as_ref() else {
            return Err(StoreError::Unavailable("no connection".into()));
        };
        let row = c
            .query_one(SYNC_STANDBY_SQL, &[])
            .await
            .map_err(crate::map_pg_error)?;
        let names: String = row
            .try_get(0)
            .map_err(|e| error::corrupt("synchronous_standby_names", e))?;
        let attached: i64 = row
            .try_get(1)
            .map_err(|e| error::corrupt("pg_stat_replication", e))?;
        let readable: bool = row
            .try_get(2)
            .map_err(|e| error::corrupt("pg_has_role", e))?;
        Ok(match (attached, readable) {
            (n, _) if n > 0 => SyncStandby::Attached(n),
            (_, false) => SyncStandby::Unreadable,
            _ => SyncStandby::Missing { names },
        })
    };
    match tokio::time::timeout(bound, read).await {
        Ok(Ok(state)) => state,
        Ok(Err(e)) => {
            *client = None;
            SyncStandby::Unchecked(e.to_string())
        }
        Err(_) => {
            *client = None;
            SyncStandby::Unchecked(format!(
                "no answer from PostgreSQL within {} ms",
                bound.as_millis()
            ))
        }
    }
}
