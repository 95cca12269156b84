//! Test support: a fresh, uniquely named database per test, dropped when the
//! test ends.
//!
//! The server is taken from `IDEM_TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); the role needs `CREATEDB`.
//! Databases are named `idem_t_<unix seconds>_<random>`; each is dropped when
//! its [`TestDatabase`] is (at the end of the test, also when it panics). Ones
//! created more than ten minutes ago that nobody is connected to (left by an
//! interrupted run) are dropped on the way, best effort.

use std::time::{SystemTime, UNIX_EPOCH};

use idem_store::{Guarded, Store};
use tokio_postgres::NoTls;

use crate::{PgBackend, PgOptions};

/// The SQL of a claim's scan (`Tx::claimable`), to check its plan.
pub const CLAIMABLE_SQL: &str = crate::tx::CLAIMABLE;

/// The default test server URL.
pub const DEFAULT_TEST_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The test server URL: `IDEM_TEST_PG_URL` when set; else
/// [`DEFAULT_TEST_URL`] when a server answers there; else the URL of a
/// throwaway cluster this process starts on first use ([`scratch_server`]),
/// so the suite runs on a machine with PostgreSQL installed but not running.
///
/// # Panics
/// When no server answers at the default address and no cluster can be
/// started (no PostgreSQL binaries: the message names the package).
pub fn server_url() -> String {
    if let Ok(url) = std::env::var("IDEM_TEST_PG_URL") {
        return url;
    }
    let default = std::net::SocketAddr::from(([127, 0, 0, 1], 5432));
    if std::net::TcpStream::connect_timeout(&default, std::time::Duration::from_millis(500)).is_ok()
    {
        return DEFAULT_TEST_URL.to_owned();
    }
    match scratch_server() {
        Ok(url) => url,
        Err(e) => panic!(
            "no PostgreSQL answers at 127.0.0.1:5432 and IDEM_TEST_PG_URL is unset, so the tests \
             start a throwaway cluster, which failed: {e}"
        ),
    }
}

/// `host:port` of the test server ([`server_url`]), as idem's messages name it.
///
/// # Panics
/// As [`server_url`], and when its URL does not parse.
pub fn server_address() -> String {
    let url = server_url();
    match crate::Target::of_url(&url) {
        Ok(t) => format!("{}:{}", t.host, t.port),
        Err(e) => panic!("the test server URL does not parse: {e}"),
    }
}

/// The URL of this process's throwaway PostgreSQL cluster, started on first
/// use: trust authentication, `127.0.0.1` on a free port, its data under the
/// system temp dir. A watcher process (started with it, in a session of its
/// own) stops it and removes its directory as soon as this process has ended,
/// however it ends (a test process's statics are never dropped).
///
/// # Errors
/// Why the cluster could not be made or started; without `initdb` and
/// `pg_ctl` (`IDEM_TEST_PG_BIN`, `pg_config --bindir`, or Debian's
/// `/usr/lib/postgresql/*/bin`), the package to install.
pub fn scratch_server() -> std::result::Result<String, String> {
    static SCRATCH: std::sync::OnceLock<std::result::Result<String, String>> =
        std::sync::OnceLock::new();
    SCRATCH
        .get_or_init(|| {
            let mut cluster = Cluster::new("idem-test-pg")?;
            let d = cluster.dir.display().to_string();
            let conf = format!(
                "\nlisten_addresses = '127.0.0.1'\nport = {}\n\
                 unix_socket_directories = '{d}/sock'\n\
                 fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n\
                 shared_buffers = 32MB\nmax_connections = 300\n",
                cluster.port
            );
            cluster.init_and_start(
                &conf,
                "local all all trust\nhost all all 127.0.0.1/32 trust\n",
            )?;
            cluster.stop_when_this_process_ends()?;
            let url = format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port);
            // Stopped by the watcher: dropping it here would stop it now.
            std::mem::forget(cluster);
            Ok(url)
        })
        .clone()
}

/// `url` with its database name replaced by `db` (URL form only).
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let rest = &base[scheme_end..];
    let authority = rest.split_once('/').map_or(rest, |(a, _)| a);
    let mut out = format!("{}{authority}/{db}", &base[..scheme_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// A scratch database on the test server: derefs to its URL; dropping it drops
/// the database (`DROP DATABASE … WITH (FORCE)`, which also ends the sessions
/// still connected to it), so keep it alive as long as the test uses the
/// database.
#[derive(Debug)]
pub struct TestDatabase {
    /// The database's URL.
    url: String,
    /// The database's name.
    name: String,
    /// The URL of the server's maintenance database, to drop it from.
    server: String,
}

impl TestDatabase {
    /// The database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl std::ops::Deref for TestDatabase {
    type Target = String;

    fn deref(&self) -> &String {
        &self.url
    }
}

impl AsRef<str> for TestDatabase {
    fn as_ref(&self) -> &str {
        &self.url
    }
}

impl std::fmt::Display for TestDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

impl Drop for TestDatabase {
    /// Drops the database from a thread of its own, with a runtime of its own:
    /// `drop` cannot await, and it may run on a runtime that is blocked here.
    fn drop(&mut self) {
        let server = self.server.clone();
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        let done = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok((client, connection)) = tokio_postgres::connect(&server, NoTls).await else {
                    return;
                };
                let conn = tokio::spawn(connection);
                let _ = client.batch_execute(&sql).await;
                drop(client);
                let _ = conn.await;
            });
        });
        let _ = done.join();
    }
}

/// Creates an empty database on the test server; it is dropped with the
/// returned guard. Safe to call from tests running in parallel.
///
/// # Panics
/// When the test server cannot be reached or refuses `CREATE DATABASE`, with
/// PostgreSQL's own message and what to do about it: this is a test helper, and
/// a test without its database cannot run.
pub async fn fresh_database() -> TestDatabase {
    let server = server_url();
    let (client, connection) = match tokio_postgres::connect(&server, NoTls).await {
        Ok(c) => c,
        Err(e) => panic!("{}", unreachable_server_message(&server, &e)),
    };
    let conn = tokio::spawn(connection);
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = format!(
        "idem_t_{secs}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    if let Err(e) = client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
    {
        panic!(
            "CREATE DATABASE {name} failed on the test PostgreSQL at {}: {} \
             (the role in IDEM_TEST_PG_URL needs CREATEDB)",
            crate::Target::of_url(&server).map_or_else(|_| server.clone(), |t| t.to_string()),
            crate::error::pg_error_text(&e)
        );
    }
    drop_stale(&client, secs).await;
    drop(client);
    let _ = conn.await;
    TestDatabase {
        url: with_database(&server, &name),
        name,
        server,
    }
}

/// What [`fresh_database`] says when it cannot connect to the test server at
/// `server`: PostgreSQL's own message and the fix.
pub fn unreachable_server_message(server: &str, e: &tokio_postgres::Error) -> String {
    let target = crate::Target::of_url(server).ok();
    let at = target
        .as_ref()
        .map_or_else(|| server.to_owned(), |t| t.to_string());
    let text = crate::error::pg_error_text(e);
    let fix = match (e.code(), &target) {
        (Some(code), Some(t)) if *code == tokio_postgres::error::SqlState::INVALID_CATALOG_NAME => {
            format!(
                "create it: `createdb -h {} -p {} -U {} {}`",
                t.host,
                t.port,
                t.user.as_deref().unwrap_or("postgres"),
                t.database
            )
        }
        _ => "start PostgreSQL there or point IDEM_TEST_PG_URL at a server whose role has CREATEDB"
            .to_owned(),
    };
    format!("cannot connect to the test PostgreSQL at {at} (IDEM_TEST_PG_URL): {text}; {fix}")
}

/// A [`Store`] on a [`fresh_database`], connected with `options`; the database
/// is dropped once the last clone of the store is.
///
/// # Panics
/// As [`fresh_database`], and when connecting fails.
pub async fn fresh_store(options: PgOptions) -> Store {
    let db = fresh_database().await;
    let backend = match PgBackend::connect(&db, options).await {
        Ok(b) => b,
        Err(e) => panic!("connecting to the fresh database {}: {e}", db.name()),
    };
    Store::new(Guarded::new(backend, db))
}

/// A throwaway PostgreSQL cluster of this process's own: its directory under
/// the system temp dir (data, socket, log), a free port on `127.0.0.1`.
/// Stopped and removed on drop.
///
/// Needs `initdb` and `pg_ctl` ([`pg_bin`]); as root it runs them as
/// `postgres` (`runuser`), since PostgreSQL refuses to run as root.
#[derive(Debug)]
struct Cluster {
    /// Everything of the cluster: data, socket, log (and certificates).
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    /// Whether the server was started (and must be stopped).
    started: bool,
    /// Whether commands run through `runuser -u postgres`.
    as_postgres: bool,
    /// The port it listens on.
    port: u16,
}

impl Cluster {
    /// A directory `<temp>/<prefix>-<random>` and a free port; nothing
    /// initialised yet.
    fn new(prefix: &str) -> std::result::Result<Cluster, String> {
        let bin = pg_bin()?;
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("sock")).map_err(|e| format!("{}: {e}", dir.display()))?;
        let as_postgres = std::process::Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("finding a free port: {e}"))?
            .port();
        Ok(Cluster {
            dir,
            bin,
            started: false,
            as_postgres,
            port,
        })
    }

    /// `initdb` (role `postgres`, trust), `conf` appended to
    /// `postgresql.conf`, `hba` as `pg_hba.conf`, then `pg_ctl start`.
    fn init_and_start(&mut self, conf: &str, hba: &str) -> std::result::Result<(), String> {
        if self.as_postgres {
            run(std::process::Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&self.dir))?;
        }
        let data = self.dir.join("data");
        run(self.pg_command("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        ]))?;
        append(&data.join("postgresql.conf"), conf)?;
        std::fs::write(data.join("pg_hba.conf"), hba)
            .map_err(|e| format!("writing pg_hba.conf: {e}"))?;
        self.start()
    }

    /// `pg_ctl start` on the data directory (`<dir>/data`).
    fn start(&mut self) -> std::result::Result<(), String> {
        let data = self.dir.join("data");
        run(self
            .pg_command("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "60", "start"]))
        .map_err(|e| {
            let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
            format!("{e}\n{log}")
        })?;
        self.started = true;
        Ok(())
    }

    /// Starts a watcher, in a session of its own so that it outlives this
    /// process and its process group, that waits for this process to end,
    /// then stops the cluster (`-m immediate`) and removes its directory.
    fn stop_when_this_process_ends(&self) -> std::result::Result<(), String> {
        let stop = self.pg_command("pg_ctl");
        let mut argv: Vec<String> = std::iter::once(stop.get_program())
            .chain(stop.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        argv.extend([
            "-D".into(),
            self.dir.join("data").display().to_string(),
            "-m".into(),
            "immediate".into(),
            "-w".into(),
            "stop".into(),
        ]);
        let script = "while kill -0 \"$0\" 2>/dev/null; do sleep 0.2; done; dir=$1; shift; \"$@\"; rm -rf \"$dir\"";
        std::process::Command::new("setsid")
            .arg("sh")
            .arg("-c")
            .arg(script)
            .arg(std::process::id().to_string())
            .arg(&self.dir)
            .args(&argv)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map(drop)
            .map_err(|e| format!("starting the cluster's watcher (setsid sh): {e}"))
    }

    /// A command of PostgreSQL's `bin` directory, as `postgres` when root.
    fn pg_command(&self, tool: &str) -> std::process::Command {
        let path = self.bin.join(tool);
        if self.as_postgres {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            std::process::Command::new(path)
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.started {
            let _ = self
                .pg_command("pg_ctl")
                .arg("-D")
                .arg(self.dir.join("data"))
                .args(["-m", "immediate", "-w", "stop"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A primary and a streaming standby made from it (`pg_basebackup -R`), two
/// throwaway clusters on `127.0.0.1` (ports of their own, data under the
/// system temp dir), for failover tests. With `synchronous`, the primary's
/// `postgresql.conf` says `synchronous_standby_names = '*'` (a commit waits
/// for the standby), and the standby inherits that line, as a base backup
/// does. Both are stopped and removed on drop.
#[derive(Debug)]
pub struct StandbyPair {
    primary: Cluster,
    standby: Cluster,
}

impl StandbyPair {
    /// Initialises and starts the primary, then the standby, and waits until
    /// the standby streams (and, with `synchronous`, is the synchronous one).
    ///
    /// # Errors
    /// Which step failed, with the tool's output.
    pub fn start(synchronous: bool) -> std::result::Result<StandbyPair, String> {
        let mut primary = Cluster::new("idem-test-primary")?;
        let mut standby = Cluster::new("idem-test-standby")?;
        let conf = |c: &Cluster| {
            format!(
                "\nlisten_addresses = '127.0.0.1'\nport = {}\n\
                 unix_socket_directories = '{}/sock'\n\
                 fsync = off\nfull_page_writes = off\n\
                 shared_buffers = 32MB\nmax_connections = 100\n",
                c.port,
                c.dir.display()
            )
        };
        let sync = if synchronous {
            "synchronous_standby_names = '*'\n"
        } else {
            ""
        };
        primary.init_and_start(
            &format!("{}{sync}", conf(&primary)),
            "local all all trust\nhost all all 127.0.0.1/32 trust\n\
             host replication all 127.0.0.1/32 trust\n",
        )?;
        if standby.as_postgres {
            run(std::process::Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&standby.dir))?;
        }
        run(standby
            .pg_command("pg_basebackup")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-R", "-X", "stream"])
            .args(["--no-sync", "--checkpoint=fast"])
            .args(["-p", &primary.port.to_string(), "-D"])
            .arg(standby.dir.join("data")))?;
        // The later line wins: the standby's own port and socket directory.
        append(&standby.dir.join("data/postgresql.conf"), &conf(&standby))?;
        standby.start()?;
        let pair = StandbyPair { primary, standby };
        let wanted = if synchronous { "sync" } else { "async" };
        for _ in 0..300 {
            if pair.psql(
                pair.primary.port,
                "SELECT sync_state FROM pg_stat_replication",
            )? == wanted
            {
                return Ok(pair);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Err(format!("the standby did not become {wanted} within 15 s"))
    }

    /// The primary's port.
    pub fn primary_port(&self) -> u16 {
        self.primary.port
    }

    /// The standby's port.
    pub fn standby_port(&self) -> u16 {
        self.standby.port
    }

    /// `postgres://postgres@127.0.0.1:P,127.0.0.1:S/{database}?target_session_attrs=read-write`:
    /// both hosts, the primary first.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// Runs `sql` with `psql` on the cluster at `port` (database `postgres`)
    /// and returns its unaligned, tuples-only output, trimmed.
    ///
    /// # Errors
    /// psql's output when it fails.
    pub fn psql(&self, port: u16, sql: &str) -> std::result::Result<String, String> {
        self.psql_in(port, "postgres", sql)
    }

    /// As [`StandbyPair::psql`], in `database`.
    ///
    /// # Errors
    /// psql's output when it fails.
    pub fn psql_in(
        &self,
        port: u16,
        database: &str,
        sql: &str,
    ) -> std::result::Result<String, String> {
        let out = std::process::Command::new(self.primary.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-U", "postgres", "-d", database, "-XAtq"])
            .args(["-p", &port.to_string(), "-v", "ON_ERROR_STOP=1", "-c", sql])
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| format!("psql: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "psql -c {sql:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Kills the primary's postmaster and every process of it with SIGKILL
    /// (a crash: nothing is flushed or shut down cleanly; the kernel closes
    /// their sockets).
    ///
    /// # Errors
    /// The postmaster's pid cannot be read, or `kill` fails.
    pub fn kill_primary(&mut self) -> std::result::Result<(), String> {
        let pid_file = self.primary.dir.join("data/postmaster.pid");
        let text = std::fs::read_to_string(&pid_file)
            .map_err(|e| format!("{}: {e}", pid_file.display()))?;
        let pid = text.lines().next().unwrap_or_default().trim().to_owned();
        let children = std::process::Command::new("ps")
            .args(["-o", "pid=", "--ppid", &pid])
            .output()
            .map_err(|e| format!("ps: {e}"))?;
        let children = String::from_utf8_lossy(&children.stdout).into_owned();
        run(std::process::Command::new("kill")
            .arg("-9")
            .arg(&pid)
            .args(children.split_whitespace()))?;
        self.primary.started = false;
        Ok(())
    }

    /// Promotes the standby (`pg_ctl promote -w`: returns once it accepts
    /// writes). With `drop_sync_names` it then clears the
    /// `synchronous_standby_names` it inherited (`ALTER SYSTEM` and a
    /// reload), as a failover manager does when no standby is left:
    /// otherwise every commit on it waits for a standby that does not exist.
    ///
    /// # Errors
    /// The tool's output.
    pub fn promote(&self, drop_sync_names: bool) -> std::result::Result<(), String> {
        run(self
            .standby
            .pg_command("pg_ctl")
            .arg("-D")
            .arg(self.standby.dir.join("data"))
            .args(["-w", "-t", "60", "promote"]))?;
        if drop_sync_names {
            self.psql(
                self.standby.port,
                "ALTER SYSTEM SET synchronous_standby_names = ''",
            )?;
            self.psql(self.standby.port, "SELECT pg_reload_conf()")?;
        }
        Ok(())
    }
}

/// PostgreSQL's `bin` directory: `IDEM_TEST_PG_BIN`, else `pg_config
/// --bindir`, else the newest of Debian's `/usr/lib/postgresql/*/bin`; it
/// must hold `initdb`.
///
/// # Errors
/// None of them has `initdb`: which package to install.
pub fn pg_bin() -> std::result::Result<std::path::PathBuf, String> {
    let debian = || {
        let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .collect();
        dirs.sort();
        dirs.pop()
    };
    let bin = std::env::var_os("IDEM_TEST_PG_BIN")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            let out = std::process::Command::new("pg_config")
                .arg("--bindir")
                .output()
                .ok()?;
            let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            (out.status.success() && !text.is_empty()).then(|| text.into())
        })
        .filter(|b: &std::path::PathBuf| b.join("initdb").exists())
        .or_else(debian)
        .filter(|b| b.join("initdb").exists());
    bin.ok_or_else(|| {
        "no PostgreSQL server binaries (initdb, pg_ctl) were found (IDEM_TEST_PG_BIN, \
         pg_config --bindir, /usr/lib/postgresql/*/bin): install them, e.g. Debian's \
         `postgresql` package (apt-get install postgresql), or point IDEM_TEST_PG_URL at a \
         running server"
            .to_owned()
    })
}

/// A throwaway PostgreSQL cluster with TLS on, for the TLS tests: its own data
/// directory under the system temp dir, listening on `127.0.0.1` and
/// `127.0.0.2` on a free port, `ssl=on` with a server certificate (for
/// `localhost` and `127.0.0.1`, not `127.0.0.2`) signed by a CA made here, and
/// a `pg_hba.conf` that accepts TLS connections only (`hostssl`, trust), so a
/// plain one is refused with PostgreSQL's own "no pg_hba.conf entry … no
/// encryption". Stopped and removed on drop (also when the test panics).
///
/// Needs `initdb` and `pg_ctl` ([`pg_bin`]) and the `openssl` CLI; as root it
/// runs them as `postgres` (`runuser`).
#[derive(Debug)]
pub struct TlsCluster {
    cluster: Cluster,
    /// The port it listens on.
    pub port: u16,
    /// The CA that signed the server's certificate (PEM).
    pub ca: std::path::PathBuf,
    /// Another CA, which did not (PEM).
    pub wrong_ca: std::path::PathBuf,
}

impl TlsCluster {
    /// Makes the certificates, initialises the cluster and starts it.
    ///
    /// # Errors
    /// Which step failed, with the tool's output.
    pub fn start() -> std::result::Result<TlsCluster, String> {
        let cluster = Cluster::new("idem-tls-pg")?;
        let mut tls = TlsCluster {
            port: cluster.port,
            ca: cluster.dir.join("ca.pem"),
            wrong_ca: cluster.dir.join("wrong-ca.pem"),
            cluster,
        };
        tls.make_certificates()?;
        let d = tls.cluster.dir.display();
        let conf = format!(
            "\nlisten_addresses = '127.0.0.1,127.0.0.2'\nport = {}\n\
             unix_socket_directories = '{d}/sock'\nssl = on\n\
             ssl_cert_file = '{d}/server.crt'\nssl_key_file = '{d}/server.key'\n\
             fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n\
             shared_buffers = 16MB\nmax_connections = 60\n",
            tls.port
        );
        tls.cluster.init_and_start(
            &conf,
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostssl all all 127.0.0.2/32 trust\n",
        )?;
        Ok(tls)
    }

    /// `postgres://postgres@{host}:{port}/{database}?{query}`.
    pub fn url(&self, host: &str, database: &str, query: &str) -> String {
        format!(
            "postgres://postgres@{host}:{}/{database}?{query}",
            self.port
        )
    }

    /// Creates an empty database `name` on this cluster (over TLS, not
    /// verified: the cluster is this process's own).
    ///
    /// # Errors
    /// PostgreSQL's message.
    pub async fn create_database(&self, name: &str) -> std::result::Result<(), String> {
        let url = self.url("127.0.0.1", "postgres", "sslmode=require");
        let (cfg, target) = crate::target::parse(&url).map_err(|e| e.to_string())?;
        let tls = crate::tls::connector(&target).map_err(|e| e.to_string())?;
        let (client, connection) = cfg
            .connect(tls)
            .await
            .map_err(|e| crate::error::pg_error_text(&e))?;
        let conn = tokio::spawn(connection);
        let res = client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .map_err(|e| crate::error::pg_error_text(&e));
        drop(client);
        let _ = conn.await;
        res
    }

    /// The CA, the server's key and certificate (SAN `localhost`,
    /// `127.0.0.1`), and the wrong CA, as P-256 keys (fast to make).
    fn make_certificates(&self) -> std::result::Result<(), String> {
        let d = &self.cluster.dir;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for (name, cn) in [("ca", "idem test CA"), ("wrong-ca", "idem wrong CA")] {
            run(std::process::Command::new("openssl")
                .args(["req", "-x509"])
                .args(ec)
                .arg("-keyout")
                .arg(d.join(format!("{name}.key")))
                .arg("-out")
                .arg(d.join(format!("{name}.pem")))
                .args(["-days", "2", "-subj", &format!("/CN={cn}")])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]))?;
        }
        run(std::process::Command::new("openssl")
            .arg("req")
            .args(ec)
            .arg("-keyout")
            .arg(d.join("server.key"))
            .arg("-out")
            .arg(d.join("server.csr"))
            .args(["-subj", "/CN=localhost"]))?;
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName = DNS:localhost, IP:127.0.0.1\nbasicConstraints = CA:FALSE\n\
             keyUsage = critical, digitalSignature\nextendedKeyUsage = serverAuth\n",
        )
        .map_err(|e| format!("writing server.ext: {e}"))?;
        run(std::process::Command::new("openssl")
            .args(["x509", "-req", "-days", "2", "-set_serial", "2"])
            .arg("-in")
            .arg(d.join("server.csr"))
            .arg("-CA")
            .arg(d.join("ca.pem"))
            .arg("-CAkey")
            .arg(d.join("ca.key"))
            .arg("-out")
            .arg(d.join("server.crt"))
            .arg("-extfile")
            .arg(d.join("server.ext")))?;
        // PostgreSQL refuses a key others can read.
        run(std::process::Command::new("chmod")
            .arg("600")
            .arg(d.join("server.key")))?;
        Ok(())
    }
}

/// Runs `cmd`; its output in the error when it fails.
fn run(cmd: &mut std::process::Command) -> std::result::Result<(), String> {
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// Appends `text` to the file at `path`.
fn append(path: &std::path::Path, text: &str) -> std::result::Result<(), String> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Drops test databases created more than ten minutes ago (best effort: a database
/// still in use, or being dropped by another test, is left alone).
async fn drop_stale(client: &tokio_postgres::Client, now_secs: u64) {
    let Ok(rows) = client
        .query(
            "SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_t\\_%'",
            &[],
        )
        .await
    else {
        return;
    };
    for row in rows {
        let Ok(name) = row.try_get::<_, String>(0) else {
            continue;
        };
        let created = name
            .strip_prefix("idem_t_")
            .and_then(|rest| rest.split('_').next())
            .and_then(|s| s.parse::<u64>().ok());
        if created.is_some_and(|c| c + 600 < now_secs) {
            let _ = client
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))
                .await;
        }
    }
}

/// The statement and parameters of one search page ([`idem_store::ops::search`])
/// for `tenant`, to look at its plan (`EXPLAIN`; docs/benchmarks.md).
pub fn search_page_sql(
    tenant: &str,
    q: &idem_store::ops::TaskQuery,
) -> (
    String,
    Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>,
) {
    crate::tx::search::page_sql(tenant, None, q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_name_is_replaced() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/test", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
        assert_eq!(
            with_database("postgresql://u:p@h/db?sslmode=disable", "x"),
            "postgresql://u:p@h/x?sslmode=disable"
        );
    }
}
