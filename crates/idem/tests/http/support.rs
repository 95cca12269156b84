//! A real `idem serve` child process per test, real HTTP with reqwest; or,
//! for tests that let a lease, backoff, deadline or retention pass, the same
//! server in the test process over a store with a test clock
//! ([`Server::in_process`]), which the test moves ([`Server::advance`])
//! instead of sleeping.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use reqwest::Method;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use tempfile::TempDir;

/// The attempt `id` in an attempts list (panics naming the list when it is not there).
pub fn attempt_of<'a>(attempts: &'a [Value], id: &str) -> &'a Value {
    attempts
        .iter()
        .find(|a| a["id"] == json!(id))
        .unwrap_or_else(|| panic!("attempt {id} not listed in {attempts:?}"))
}

/// The `idem` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_idem");

/// How long bounded polling loops wait at most.
pub const POLL_TIMEOUT: Duration = Duration::from_secs(10);

/// A `RUST_LOG` under which the server logs each connection's first bytes
/// ([`Server::wait_read_from`]), each long-poll claim that waits
/// ([`Server::wait_long_poll`]) and its info lines (`shutting down …`).
pub const DEBUG_LOG: &str = "info,idem_http=debug";

/// PostgreSQL pool size of servers started by [`Server::start_pg`] (several
/// instances and tests share one PostgreSQL with a limited `max_connections`).
pub const PG_POOL_SIZE: &str = "8";

/// How long leases, deadlines and backoffs last in an in-process test, ms:
/// far past [`POLL_TIMEOUT`], so they pass only when the test moves the
/// clock ([`Server::advance`]).
pub const MOVED_MS: i64 = 60_000;

/// A fast configuration as a TOML document: the bundled classes with short
/// backoffs (50 ms doubling to at most 200 ms), so retries are quick. Windows,
/// leases and fees are the bundled ones.
pub fn fast_toml() -> String {
    backoff_toml("50", "200")
}

/// The bundled classes with backoffs from `initial_ms` doubling to at most
/// `max_ms`, as a TOML document.
fn backoff_toml(initial_ms: &str, max_ms: &str) -> String {
    let overrides = ["PAYMENT_RELEASE", "GENERATION_DISPATCH"]
        .into_iter()
        .flat_map(|class| {
            [("INITIAL_MS", initial_ms), ("MAX_MS", max_ms)].map(|(field, value)| {
                (
                    format!("IDEM_OPERATIONS__{class}__RETRY__BACKOFF__{field}"),
                    value.to_owned(),
                )
            })
        });
    idem_core::config::Config::from_toml_with_env(idem_core::config::DEFAULT_TOML, overrides)
        .and_then(|c| c.to_toml())
        .expect("the fast configuration")
}

/// A response read to the end.
#[derive(Debug)]
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Headers.
    pub headers: HeaderMap,
    /// Body as text.
    pub text: String,
    /// Body as JSON (`Value::Null` when it is not JSON).
    pub json: Value,
}

impl Resp {
    /// A header as a string ("" when absent).
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    }

    /// The problem `code` member ("" when absent).
    pub fn code(&self) -> &str {
        self.json["code"].as_str().unwrap_or_default()
    }

    /// Asserts status, problem code, problem content type and `X-Request-Id`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "status; body: {}", self.text);
        assert_eq!(self.code(), code, "problem code; body: {}", self.text);
        assert_eq!(
            self.json["status"],
            json!(status),
            "problem status member: {}",
            self.text
        );
        assert!(
            self.header("content-type")
                .starts_with("application/problem+json"),
            "content-type {:?} of a problem",
            self.header("content-type")
        );
        assert!(
            !self.header("x-request-id").is_empty(),
            "X-Request-Id on a problem response"
        );
    }

    /// Asserts the status and returns the JSON body.
    #[track_caller]
    pub fn ok(&self, status: u16) -> &Value {
        assert_eq!(self.status, status, "status; body: {}", self.text);
        assert!(
            !self.header("x-request-id").is_empty(),
            "X-Request-Id missing"
        );
        &self.json
    }
}

/// The API keys every server gets at start.
#[derive(Debug, Clone)]
pub struct Keys {
    /// Client of tenant `acme`.
    pub acme: String,
    /// Its key id.
    pub acme_id: String,
    /// Client of tenant `other`.
    pub other: String,
    /// Executor of tenant `acme`.
    pub exec: String,
    /// Executor of tenant `other`.
    pub exec_other: String,
}

/// How a server is started.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// TOML text of `--config` (none: the bundled configuration).
    pub config: Option<String>,
    /// Extra environment variables (e.g. `IDEM_OPERATIONS__…`).
    pub env: Vec<(String, String)>,
}

impl Options {
    /// The fast configuration.
    pub fn fast() -> Options {
        Options {
            config: Some(fast_toml()),
            env: Vec::new(),
        }
    }

    /// The configuration of in-process tests: the bundled classes with a
    /// fixed backoff of [`MOVED_MS`], which only a move of the clock lets pass.
    pub fn moved() -> Options {
        Options {
            config: Some(backoff_toml("60000", "60000")),
            env: Vec::new(),
        }
    }

    /// Adds an environment variable.
    pub fn env(mut self, name: &str, value: &str) -> Options {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// One `idem serve` child process over its own database in its own temporary directory.
pub struct Server {
    dir: TempDir,
    child: Option<Child>,
    _stdout: Option<BufReader<ChildStdout>>,
    opts: Options,
    /// A shared store (e.g. `postgres://…`); `None`: the SQLite file in `dir`.
    shared_store: Option<String>,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The HTTP client.
    pub http: reqwest::Client,
    /// Keys created before start.
    pub keys: Keys,
    /// The server runs in this process ([`Server::in_process`]).
    in_process: Option<InProcess>,
}

/// What a [`Server::in_process`] holds: the clock of its store and the
/// sender whose drop stops it.
struct InProcess {
    clock: idem_store::Clock,
    _stop: tokio::sync::watch::Sender<bool>,
    /// The PostgreSQL database of [`Server::in_process_pg`], dropped last.
    _db: Option<idem_store_postgres::testing::TestDatabase>,
}

impl Server {
    /// Starts a server with the bundled configuration.
    pub async fn start() -> Server {
        Server::start_with(Options::default()).await
    }

    /// Starts a server with the fast configuration.
    pub async fn fast() -> Server {
        Server::start_with(Options::fast()).await
    }

    /// Starts a server with `opts`.
    pub async fn start_with(opts: Options) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let keys = Server::create_keys(&store_url(dir.path()));
        Server::launch(dir, opts, None, keys)
    }

    /// Starts a server with `opts` on a copy of the SQLite file `db` (moved
    /// into a new temporary directory), whose API keys are `keys`.
    pub fn start_on_file(db: &Path, opts: Options, keys: Keys) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::rename(db, dir.path().join("idem.db")).expect("move the database file");
        Server::launch(dir, opts, None, keys)
    }

    /// Writes `opts`' configuration into `dir` and starts the server.
    fn launch(
        dir: tempfile::TempDir,
        opts: Options,
        shared_store: Option<String>,
        keys: Keys,
    ) -> Server {
        if let Some(text) = &opts.config {
            std::fs::write(dir.path().join("idem.toml"), text).expect("write config");
        }
        let http = http_client();
        let mut server = Server {
            dir,
            child: None,
            _stdout: None,
            opts,
            shared_store,
            url: String::new(),
            http,
            keys,
            in_process: None,
        };
        server.spawn();
        server
    }

    /// Starts the server in this process with [`Options::moved`]
    /// ([`Server::in_process_with`]).
    pub async fn in_process() -> Server {
        Server::in_process_with(Options::moved()).await
    }

    /// Starts the server in this process: `idem_server::App` (as `idem
    /// serve` assembles it, console included) on 127.0.0.1:0 with the sweeper
    /// every 50 ms (as `--sweep-interval-ms 50`) over a SQLite store in its
    /// own temporary directory opened with a test clock;
    /// `opts`' configuration with its `IDEM_OPERATIONS__…` variables applied
    /// (others are ignored). Stopped when dropped. The CLI helpers work on its
    /// store; the process helpers (signals, restart, log) do not apply.
    pub async fn in_process_with(opts: Options) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = idem_store::Clock::test();
        let store = idem_store_sqlite::open(
            dir.path().join("idem.db"),
            idem_store_sqlite::SqliteOptions {
                clock: clock.clone(),
            },
        )
        .expect("open the SQLite store");
        let keys = keys_in(&store).await;
        Server::in_process_over(dir, keys, store, clock, None, opts).await
    }

    /// [`Server::in_process`] over a fresh PostgreSQL database (dropped with
    /// the server) whose clock is a test clock.
    pub async fn in_process_pg() -> Server {
        let db = idem_store_postgres::testing::fresh_database().await;
        let clock = idem_store::Clock::test();
        let mut options = idem_store_postgres::PgOptions::default();
        options.clock = clock.clone();
        options.max_size = 8;
        let store = idem_store_postgres::connect(&db, options)
            .await
            .expect("open the PostgreSQL store");
        let keys = keys_in(&store).await;
        let dir = tempfile::tempdir().expect("tempdir");
        Server::in_process_over(dir, keys, store, clock, Some(db), Options::moved()).await
    }

    /// Serves `store` (with `keys`, on `clock`) in this process.
    async fn in_process_over(
        dir: TempDir,
        keys: Keys,
        store: idem_store::Store,
        clock: idem_store::Clock,
        db: Option<idem_store_postgres::testing::TestDatabase>,
        opts: Options,
    ) -> Server {
        let text = opts
            .config
            .clone()
            .unwrap_or_else(|| idem_core::config::DEFAULT_TOML.to_owned());
        let config = idem_core::config::Config::from_toml_with_env(&text, opts.env.clone())
            .expect("the configuration");
        let options = idem_server::Options {
            sweep_interval: Duration::from_millis(50),
            ..idem_server::Options::default()
        };
        let app = idem_server::App::build(store, config, options)
            .await
            .expect("build the server");
        let url = app.url();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(app.run(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        }));
        Server {
            dir,
            child: None,
            _stdout: None,
            opts,
            url,
            http: http_client(),
            keys,
            shared_store: db.as_ref().map(|db| db.url().to_owned()),
            in_process: Some(InProcess {
                clock,
                _stop: stop,
                _db: db,
            }),
        }
    }

    /// Moves the clock of an in-process server's store forward by `ms`
    /// (leases, backoffs, deadlines and retention pass; the sweeper acts on
    /// its next tick).
    ///
    /// # Panics
    /// On a server that runs as a child process (its clock is real time).
    pub fn advance(&self, ms: i64) {
        let Some(p) = &self.in_process else {
            panic!("Server::advance needs a server started with Server::in_process");
        };
        p.clock
            .advance(Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
    }

    /// Creates the standard keys ([`Keys`]) in the store at `store`.
    pub fn create_keys(store: &str) -> Keys {
        let made = create_keys_at(store, &STANDARD_KEYS);
        keys_of(made)
    }

    /// Starts a server with the fast configuration over a shared store
    /// (`postgres://…`, already migrated, `keys` created in it), with the
    /// extra environment `extra_env` (e.g. `IDEM_CLOCK_OFFSET_MS`). Several
    /// servers started this way on one URL share one database.
    pub async fn start_pg(store: &str, keys: &Keys, extra_env: &[(&str, &str)]) -> Server {
        let mut opts = Options::fast().env("IDEM_PG_POOL_SIZE", PG_POOL_SIZE);
        for (k, v) in extra_env {
            opts = opts.env(k, v);
        }
        let dir = tempfile::tempdir().expect("tempdir");
        Server::launch(dir, opts, Some(store.to_owned()), keys.clone())
    }

    /// The `--store` URL of this server.
    pub fn store(&self) -> String {
        self.shared_store
            .clone()
            .unwrap_or_else(|| store_url(self.dir.path()))
    }

    /// Whether the child process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The database file.
    pub fn db_path(&self) -> PathBuf {
        self.dir.path().join("idem.db")
    }

    /// What the server wrote to stderr so far (its log; `RUST_LOG` is
    /// `warn` unless the options set it).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Waits until the server has read the first bytes of the connection
    /// from `client` (its debug line, logged with `RUST_LOG` at
    /// [`DEBUG_LOG`]): from then on a shutdown waits for the request they
    /// start.
    pub async fn wait_read_from(&self, client: std::net::SocketAddr) {
        self.wait_log(&format!("first bytes of a connection read peer={client}"))
            .await;
    }

    /// Waits until a long-poll claim ([`Server::long_poll_claim`]) found
    /// nothing and waits for work (its debug line, logged with `RUST_LOG` at
    /// [`DEBUG_LOG`]).
    pub async fn wait_long_poll(&self) {
        self.wait_log("claim waiting for work executor_id=lp").await;
    }

    /// Polls the log until a line contains `what` (bounded by
    /// [`POLL_TIMEOUT`]).
    pub async fn wait_log(&self, what: &str) {
        let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
        while !self.log().lines().any(|l| l.contains(what)) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no log line with {what:?} within {POLL_TIMEOUT:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--store")
            .arg(self.store())
            .arg("--sweep-interval-ms")
            .arg("50");
        if self.opts.config.is_some() {
            cmd.arg("--config").arg(self.dir.path().join("idem.toml"));
        }
        cmd.env_remove("IDEM_CONFIG")
            .env_remove("IDEM_STORE")
            .env("IDEM_LISTEN", "127.0.0.1:0")
            .env("RUST_LOG", "warn");
        for (k, v) in &self.opts.env {
            cmd.env(k, v);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.log"))
            .expect("server log");
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(log);
        let mut child = cmd.spawn().expect("spawn idem serve");
        let mut out = BufReader::new(child.stdout.take().expect("stdout piped"));
        let mut line = String::new();
        out.read_line(&mut line).expect("read the listening line");
        let Some(addr) = line.trim().strip_prefix("idem listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            let log =
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
            panic!("unexpected first stdout line {line:?}; server log:\n{log}");
        };
        self.url = addr.to_owned();
        self.child = Some(child);
        self._stdout = Some(out);
    }

    /// Kills the server with SIGKILL (no graceful shutdown).
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL");
            let _ = child.wait();
        }
        self._stdout = None;
    }

    /// Sends SIGTERM (a graceful shutdown) and waits for the process to end;
    /// returns its exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal_term();
        let mut child = self.child.take().expect("server running");
        self._stdout = None;
        child.wait().expect("wait for the server")
    }

    /// Sends SIGTERM without waiting.
    pub fn signal_term(&self) {
        let child = self.child.as_ref().expect("server running");
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success(), "kill -TERM failed");
    }

    /// Waits up to `limit` for the process to end; `None` (after SIGKILL)
    /// when it was still running.
    pub fn exit_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let started = std::time::Instant::now();
        let mut child = self.child.take().expect("server running");
        self._stdout = None;
        while started.elapsed() < limit {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Starts the server again on the same database file (new port).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Stops the server and starts it again on the same database file with other options
    /// (e.g. a changed configuration).
    pub fn restart_with(&mut self, opts: Options) {
        self.kill9();
        if let Some(text) = &opts.config {
            std::fs::write(self.dir.path().join("idem.toml"), text).expect("write config");
        }
        self.opts = opts;
        self.spawn();
    }

    /// Runs the CLI against this server's store; returns (status ok, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (bool, String, String) {
        cli_at(&self.store(), args)
    }

    /// Creates a key; returns (id, plain key).
    pub fn create_key(
        &self,
        tenant: &str,
        role: &str,
        operations: Option<&str>,
    ) -> (String, String) {
        create_key_at(&self.store(), tenant, role, operations)
    }

    /// Revokes a key by id.
    pub fn revoke_key(&self, id: &str) {
        let (ok, _, err) = self.cli(&["keys", "revoke", id]);
        assert!(ok, "keys revoke failed: {err}");
    }

    /// Sends a request. `key`: bearer key; `body`: JSON.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> Resp {
        let mut req = self.http.request(method, format!("{}{path}", self.url));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        send(req).await
    }

    /// `GET path` with `key`.
    pub async fn get(&self, path: &str, key: &str) -> Resp {
        self.call(Method::GET, path, Some(key), None).await
    }

    /// `POST path` with `key` and a JSON body.
    pub async fn post(&self, path: &str, key: &str, body: Value) -> Resp {
        self.call(Method::POST, path, Some(key), Some(body)).await
    }

    /// A submit request builder with the acme client key.
    pub fn submit_req(&self, key: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}/v1/tasks", self.url))
            .bearer_auth(key)
            .header("content-type", "application/json")
    }

    /// Submits `operation` with `params` under idempotency key `ikey` as `key`.
    pub async fn submit_as(&self, key: &str, ikey: &str, operation: &str, params: Value) -> Resp {
        let req = self
            .submit_req(key)
            .header("Idempotency-Key", ikey)
            .body(json!({"operation": operation, "params": params}).to_string());
        send(req).await
    }

    /// Submits as the acme client.
    pub async fn submit(&self, ikey: &str, operation: &str, params: Value) -> Resp {
        self.submit_as(&self.keys.acme, ikey, operation, params)
            .await
    }

    /// Submits as acme and asserts a new task (201, not replayed); returns the task.
    pub async fn new_task(&self, ikey: &str, operation: &str, params: Value) -> Value {
        let r = self.submit(ikey, operation, params).await;
        let v = r.ok(201);
        assert_eq!(
            v["meta"]["replayed"],
            json!(false),
            "expected a new task: {}",
            r.text
        );
        v["task"].clone()
    }

    /// `GET /v1/tasks/{id}` as acme; returns the task.
    pub async fn task(&self, id: &str) -> Value {
        let r = self.get(&format!("/v1/tasks/{id}"), &self.keys.acme).await;
        r.ok(200)["task"].clone()
    }

    /// Attempts of a task as acme.
    pub async fn attempts(&self, id: &str) -> Vec<Value> {
        let r = self
            .get(&format!("/v1/tasks/{id}/attempts"), &self.keys.acme)
            .await;
        r.ok(200)["attempts"]
            .as_array()
            .expect("attempts array")
            .clone()
    }

    /// Events of a task as acme.
    pub async fn events(&self, id: &str) -> Vec<Value> {
        let r = self
            .get(&format!("/v1/tasks/{id}/events"), &self.keys.acme)
            .await;
        r.ok(200)["events"]
            .as_array()
            .expect("events array")
            .clone()
    }

    /// Claims with the acme executor key and `body`.
    pub async fn claim(&self, body: Value) -> Resp {
        self.post("/v1/attempts/claim", &self.keys.exec, body).await
    }

    /// Starts a 30 s long-poll claim of `generation.dispatch` in the
    /// background; its answer comes when work appears (or the server drains).
    pub fn long_poll_claim(&self) -> tokio::task::JoinHandle<Resp> {
        let req = self
            .http
            .post(format!("{}/v1/attempts/claim", self.url))
            .bearer_auth(&self.keys.exec)
            .json(&json!({"executor_id": "lp", "operations": ["generation.dispatch"], "wait_ms": 30000}));
        tokio::spawn(send(req))
    }

    /// Claims one attempt of `operation` (optional lease); returns the attempts list.
    pub async fn claim_op(&self, operation: &str, lease_ms: Option<i64>) -> Vec<Value> {
        let mut body = json!({"executor_id": "ex-1", "operations": [operation], "max": 1});
        if let Some(l) = lease_ms {
            body["lease_ms"] = json!(l);
        }
        let r = self.claim(body).await;
        r.ok(200)["attempts"]
            .as_array()
            .expect("attempts array")
            .clone()
    }

    /// Claims until an attempt of `operation` is returned (bounded); returns
    /// it. On an in-process server a try that finds nothing moves the clock
    /// by [`MOVED_MS`] (past a backoff of [`Options::moved`]) and claims
    /// again at once, so a backoff passes by the clock, not by waiting.
    pub async fn claim_one(&self, operation: &str, lease_ms: Option<i64>) -> Value {
        let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
        loop {
            let got = self.claim_op(operation, lease_ms).await;
            if let Some(a) = got.into_iter().next() {
                return a;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no attempt of {operation} became claimable within {POLL_TIMEOUT:?}"
            );
            if self.in_process.is_some() {
                self.advance(MOVED_MS);
            } else {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    }

    /// Reports on attempt `id` with the acme executor key.
    pub async fn report(&self, attempt_id: &str, body: Value) -> Resp {
        self.post(
            &format!("/v1/attempts/{attempt_id}/report"),
            &self.keys.exec,
            body,
        )
        .await
    }

    /// Releases attempt `id` with the acme executor key.
    pub async fn release(&self, attempt_id: &str, body: Value) -> Resp {
        self.post(
            &format!("/v1/attempts/{attempt_id}/release"),
            &self.keys.exec,
            body,
        )
        .await
    }

    /// Heartbeat on attempt `id`.
    pub async fn heartbeat(&self, attempt_id: &str, body: Value) -> Resp {
        self.post(
            &format!("/v1/attempts/{attempt_id}/heartbeat"),
            &self.keys.exec,
            body,
        )
        .await
    }

    /// Cancels task `id` as acme.
    pub async fn cancel(&self, id: &str) -> Resp {
        self.post(
            &format!("/v1/tasks/{id}/cancel"),
            &self.keys.acme,
            json!({}),
        )
        .await
    }

    /// Polls `GET /v1/tasks/{id}` until `pred` holds (bounded); returns the task.
    pub async fn wait_task(&self, id: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
        loop {
            let t = self.task(id).await;
            if pred(&t) {
                return t;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "task {id} did not reach `{what}` within {POLL_TIMEOUT:?}; last: {t}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Polls until the task's state is `state`.
    pub async fn wait_state(&self, id: &str, state: &str) -> Value {
        self.wait_task(id, state, |t| t["state"] == json!(state))
            .await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The HTTP client of a [`Server`].
fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("reqwest client")
}

/// Reads a response fully.
pub async fn send(req: reqwest::RequestBuilder) -> Resp {
    let res = req.send().await.expect("HTTP request");
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let text = res.text().await.expect("response body");
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    Resp {
        status,
        headers,
        text,
        json,
    }
}

/// `sqlite://<dir>/idem.db`.
pub fn store_url(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("idem.db").display())
}

/// Runs the CLI with `IDEM_STORE` set; returns (success, stdout, stderr).
pub fn cli_at(store: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("IDEM_STORE", store)
        .env("RUST_LOG", "warn")
        .env_remove("IDEM_CONFIG")
        .output()
        .expect("run idem");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The standard keys ([`Keys`]) as (tenant, role): acme client, other
/// client, acme executor, other executor.
const STANDARD_KEYS: [(&str, &str, Option<&str>); 4] = [
    ("acme", "client", None),
    ("other", "client", None),
    ("acme", "executor", None),
    ("other", "executor", None),
];

/// [`Keys`] from the (id, plain key) pairs of [`STANDARD_KEYS`], in order.
fn keys_of(made: Vec<(String, String)>) -> Keys {
    let [(acme_id, acme), (_, other), (_, exec), (_, exec_other)]: [(String, String); 4] =
        made.try_into().expect("four standard keys");
    Keys {
        acme,
        acme_id,
        other,
        exec,
        exec_other,
    }
}

/// Creates the standard keys ([`Keys`]) in `store`.
pub async fn keys_in(store: &idem_store::Store) -> Keys {
    let mut made = Vec::new();
    for (tenant, role, operations) in STANDARD_KEYS {
        made.push(key_in(store, tenant, role, operations).await);
    }
    keys_of(made)
}

/// Creates a key in `store` with `Store::create_api_key`, as `idem keys
/// create` does; `operations` comma-separated as its `--operations`.
/// Returns (id, plain key).
pub async fn key_in(
    store: &idem_store::Store,
    tenant: &str,
    role: &str,
    operations: Option<&str>,
) -> (String, String) {
    let role: idem_core::model::Role = role.parse().expect("client, executor or admin");
    let operations = operations.map(|ops| ops.split(',').map(|o| o.trim().to_owned()).collect());
    let (key, plain) = store
        .create_api_key(tenant, role, operations)
        .await
        .expect("create an API key");
    (key.id.to_string(), plain)
}

/// Creates the keys `specs` (tenant, role, operations) in the store at
/// `store` (`sqlite://PATH` or `postgres://…`, opened and migrated as `idem
/// keys create` opens it, then closed); returns their (id, plain key) in
/// order. The store is opened on a runtime of its own on another thread, so
/// that synchronous and asynchronous test code can call it alike.
fn create_keys_at(store: &str, specs: &[(&str, &str, Option<&str>)]) -> Vec<(String, String)> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime to create keys on");
                runtime.block_on(async {
                    let opened = open_store_at(store).await;
                    let mut made = Vec::new();
                    for (tenant, role, operations) in specs {
                        made.push(key_in(&opened, tenant, role, *operations).await);
                    }
                    made
                })
            })
            .join()
            .expect("creating keys")
    })
}

/// Opens (and migrates) the store at `store`, with a pool of one connection
/// for PostgreSQL, and checks its identity, as `idem keys create` does.
async fn open_store_at(store: &str) -> idem_store::Store {
    let opened = match store.strip_prefix("sqlite://") {
        Some(path) => {
            idem_store_sqlite::open(path, Default::default()).expect("open the SQLite store")
        }
        None => {
            let options = idem_store_postgres::PgOptions::default().with_max_size(1);
            idem_store_postgres::connect(store, options)
                .await
                .expect("open the PostgreSQL store")
        }
    };
    opened
        .check_identity()
        .await
        .expect("check the store's identity");
    opened
}

/// Creates a key in the store at `store` (see [`create_keys_at`]); returns
/// (id, plain key).
pub fn create_key_at(
    store: &str,
    tenant: &str,
    role: &str,
    operations: Option<&str>,
) -> (String, String) {
    create_keys_at(store, &[(tenant, role, operations)])
        .pop()
        .expect("one key")
}

/// Payment params.
pub fn payment(amount: i64) -> Value {
    json!({"payee": "acct-bob-4711", "amount": amount, "currency": "EUR"})
}

/// Generation params.
pub fn generation(prompt: &str) -> Value {
    json!({"prompt": prompt, "model": "m1", "steps": 20})
}

/// A fresh unique idempotency key.
pub fn ikey() -> String {
    format!("key-{}", uuid::Uuid::new_v4())
}

/// A JSON string field.
pub fn s(v: &Value) -> String {
    v.as_str()
        .unwrap_or_else(|| panic!("expected a string, got {v}"))
        .to_owned()
}
