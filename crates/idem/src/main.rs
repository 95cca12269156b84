//! `idem`: the one binary (SPEC §6): `serve`, `keys`, `task`, `migrate`, `gc`, `demo`, `bench`, `chaos`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use idem_core::config::Config;
use idem_core::model::Role;
use idem_store::Store;
use uuid::Uuid;

/// mimalloc instead of the system allocator: the request path allocates many
/// small, short-lived buffers (JSON, headers, SQL values), and SQLite's
/// per-statement scratch tables map and unmap fresh pages under glibc malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The default store: an embedded SQLite file (SPEC §5).
const DEFAULT_STORE: &str = "sqlite://./idem-data/idem.db";

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "A durable coordinator for duplicate-sensitive work"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct StoreArgs {
    /// `sqlite://PATH` or `postgres://user@host:port/db`.
    #[arg(long, env = "IDEM_STORE", default_value = DEFAULT_STORE, global = true)]
    store: String,
    /// Shift this process's clock by this many ms (testing clock skew only).
    #[arg(
        long,
        env = "IDEM_CLOCK_OFFSET_MS",
        default_value_t = 0,
        hide = true,
        allow_hyphen_values = true,
        global = true
    )]
    clock_offset_ms: i64,
    /// PostgreSQL pool size (connections per instance).
    #[arg(long, env = "IDEM_PG_POOL_SIZE", default_value_t = 16, global = true)]
    pg_pool_size: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service.
    Serve {
        /// `HOST:PORT` to listen on; HOST is an IP address or a name (the first
        /// address it resolves to that binds is used); port 0 picks a free port
        /// (the address is logged).
        #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:8787")]
        listen: String,
        /// TOML configuration of operation classes; default: the bundled one.
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
        /// How often leases are expired, backoffs woken and keys removed, ms.
        #[arg(long, env = "IDEM_SWEEP_INTERVAL_MS", default_value_t = 200)]
        sweep_interval_ms: u64,
        /// How long start-up keeps retrying a store that is unavailable
        /// (database starting, connections terminated), ms; 0 fails at once.
        #[arg(long, env = "IDEM_STORE_WAIT_MS", default_value_t = 30_000)]
        store_wait_ms: u64,
        /// After SIGTERM or Ctrl-C, how long open requests may take before the
        /// process exits anyway (status 1), ms; a second signal exits at once.
        #[arg(long, env = "IDEM_SHUTDOWN_GRACE_MS", default_value_t = 20_000)]
        shutdown_grace_ms: u64,
        /// A connection whose request headers are not complete this long after
        /// it opened (or after the first byte of a later request) is closed, ms.
        #[arg(long, env = "IDEM_HEADER_TIMEOUT_MS", default_value_t = 30_000,
              value_parser = clap::value_parser!(u64).range(1..))]
        header_timeout_ms: u64,
        /// A keep-alive connection with no request for this long after its last
        /// answer is closed, ms.
        #[arg(long, env = "IDEM_IDLE_TIMEOUT_MS", default_value_t = 75_000,
              value_parser = clap::value_parser!(u64).range(1..))]
        idle_timeout_ms: u64,
        /// Most connections open at once; one more is closed as soon as it is
        /// accepted. Default: the soft open-file limit less 64 and the
        /// PostgreSQL pool size.
        #[arg(long, env = "IDEM_MAX_CONNECTIONS",
              value_parser = clap::value_parser!(u64).range(1..))]
        max_connections: Option<u64>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Manage API keys (store-level).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Inspect a task (store-level, any tenant).
    Task {
        #[command(subcommand)]
        command: TaskCommand,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Apply database migrations and exit.
    Migrate {
        #[command(flatten)]
        store: StoreArgs,
    },
    /// One sweep: expire leases, wake backoffs, remove keys past retention.
    Gc {
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Print the OpenAPI document.
    Openapi,
    /// The payment-release scenario end to end over HTTP against a simulated payout provider, as a readable report (exit 1 if a check fails).
    Demo {
        /// A running idem; default: an in-process server on a temporary SQLite store.
        #[arg(long)]
        url: Option<String>,
        /// Client API key for --url.
        #[arg(long, env = "IDEM_CLIENT_KEY")]
        client_key: Option<String>,
        /// Executor API key for --url (same tenant as the client key, no other pending work).
        #[arg(long, env = "IDEM_EXECUTOR_KEY")]
        executor_key: Option<String>,
    },
    /// Submit throughput and latency over HTTP against a raw-database baseline (same run).
    Bench {
        /// Modes, comma-separated: new, replay, conflict, storm, mixed, floor (the replay
        /// load against a static handler in this process on loopback, also with --url:
        /// the machine's HTTP ceiling).
        #[arg(long, value_delimiter = ',', default_value = "new,replay")]
        mode: Vec<idem_harness::bench::Mode>,
        /// Concurrent clients.
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Requests per mode.
        #[arg(long, default_value_t = 5000)]
        count: usize,
        /// A running idem; default: an in-process server.
        #[arg(long)]
        url: Option<String>,
        /// Client API key for --url.
        #[arg(long, env = "IDEM_API_KEY")]
        api_key: Option<String>,
        /// Store of the in-process server (default: a temporary SQLite file).
        #[arg(long = "bench-store")]
        bench_store: Option<String>,
        /// Skip the raw-database baseline.
        #[arg(long)]
        no_baseline: bool,
        /// Threads of the load generator, each with its own event loop (wrk's -t).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
        load_threads: u16,
        /// One JSON object per mode on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Seeded fault injection (client retries, executor crashes, stale reports, SIGKILLed
    /// servers, terminated PostgreSQL connections), then a check of every SPEC §2 invariant
    /// (exit 1 on a violation, naming the seed).
    Chaos {
        /// Seed of the fault plan: the same seed injects the same faults.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Client operations.
        #[arg(long, default_value_t = 3000)]
        ops: usize,
        /// `sqlite://PATH` or `postgres://…` (a fresh database); default: a temporary SQLite file.
        #[arg(long)]
        store: Option<String>,
        /// Client operations in flight at once.
        #[arg(long, default_value_t = 128)]
        clients: usize,
        /// Executor claim loops.
        #[arg(long, default_value_t = 6)]
        executors: usize,
        /// One JSON object on stdout (`violations`, `faults`, `invariants`, …).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Create a key; prints the plain key (once) and nothing else on stdout.
    Create {
        /// Tenant the key belongs to.
        #[arg(long)]
        tenant: String,
        /// `client`, `executor` or `admin`.
        #[arg(long)]
        role: String,
        /// Comma-separated operation classes the key is limited to (default: all).
        #[arg(long, value_delimiter = ',')]
        operations: Option<Vec<String>>,
        /// TOML configuration `--operations` is checked against, as `serve`
        /// takes it; default: the bundled one.
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Revoke a key by id.
    Revoke {
        /// Key id.
        id: Uuid,
    },
    /// One line per key: id, tenant, role, operations, created, revoked.
    List,
}

#[derive(Subcommand)]
enum TaskCommand {
    /// The task as JSON.
    Show {
        /// Task id.
        id: Uuid,
    },
    /// The event history as JSON.
    Events {
        /// Task id.
        id: Uuid,
    },
    /// Attempts with evidence as JSON.
    Attempts {
        /// Task id.
        id: Uuid,
    },
}

/// Opens a store that must already exist: inspection commands never create a
/// database at a mistyped path.
async fn open_existing_store(args: &StoreArgs) -> Result<Store> {
    if let Some(path) = args.store.strip_prefix("sqlite://")
        && !std::path::Path::new(path).exists()
    {
        bail!(
            "no idem database at {path} (check --store / IDEM_STORE; `idem migrate` or `idem serve` creates one)"
        );
    }
    // Reading or administering a store never creates or upgrades its schema.
    open_store_with(args, false).await
}

/// Opens the store of `args`, creating it and applying pending migrations.
async fn open_store(args: &StoreArgs) -> Result<Store> {
    open_store_with(args, true).await
}

/// Opens the store of `args`; with `migrate` false it changes no schema and
/// refuses one that is not this binary's.
async fn open_store_with(args: &StoreArgs, migrate: bool) -> Result<Store> {
    if let Some(path) = args.store.strip_prefix("sqlite://") {
        let options = idem_store_sqlite::SqliteOptions {
            clock_offset_ms: args.clock_offset_ms,
        };
        let path = path.to_owned();
        return tokio::task::spawn_blocking(move || {
            if migrate {
                idem_store_sqlite::open(path, options)
            } else {
                idem_store_sqlite::open_existing(path, options)
            }
        })
        .await?
        .context("opening the SQLite store");
    }
    if is_postgres(&args.store) {
        let mut options =
            idem_store_postgres::PgOptions::default().with_max_size(args.pg_pool_size);
        options.migrate = migrate;
        return idem_store_postgres::connect(&args.store, options)
            .await
            .context("connecting to PostgreSQL");
    }
    bail!(
        "--store must start with sqlite://, postgres:// or postgresql://, got `{}`",
        args.store
    )
}

/// Whether `store` is a PostgreSQL URL (`postgres://` or `postgresql://`).
fn is_postgres(store: &str) -> bool {
    store.starts_with("postgres://") || store.starts_with("postgresql://")
}

/// Logs where the data of `args` goes, before it is opened: the SQLite file's
/// absolute path, or PostgreSQL's host, port, database, role and `sslmode`
/// (never the password).
///
/// # Errors
/// A PostgreSQL URL that does not parse or names no database (refused before
/// anything is connected), a store that is neither SQLite nor PostgreSQL.
fn log_store_location(args: &StoreArgs) -> Result<()> {
    if let Some(path) = args.store.strip_prefix("sqlite://") {
        let absolute =
            std::path::absolute(path).map_or_else(|_| path.to_owned(), |p| p.display().to_string());
        tracing::info!(store = "sqlite", path = %absolute, "store: SQLite file {absolute}");
        return Ok(());
    }
    if is_postgres(&args.store) {
        let target = idem_store_postgres::Target::of_url(&args.store)
            .context("reading the PostgreSQL store URL")?;
        tracing::info!(
            store = "postgres",
            host = %target.host,
            port = target.port,
            database = %target.database,
            user = %target.user.as_deref().unwrap_or("-"),
            sslmode = %target.ssl_mode.as_str(),
            "store: PostgreSQL database {} at {}:{}",
            target.database,
            target.host,
            target.port
        );
        return Ok(());
    }
    bail!(
        "--store must start with sqlite://, postgres:// or postgresql://, got `{}`",
        args.store
    )
}

fn load_config(path: Option<&PathBuf>) -> Result<Config> {
    if path.is_none() {
        tracing::info!(
            "no --config / IDEM_CONFIG given: using the bundled configuration (examples/idem.toml)"
        );
    }
    let overrides = operation_overrides();
    if !overrides.is_empty() {
        let names: Vec<&str> = overrides.iter().map(|(k, _)| k.as_str()).collect();
        tracing::info!(
            overrides = %names.join(", "),
            "configuration overridden from the environment"
        );
    }
    config_from(path, overrides)
}

/// The configuration at `path` (else the bundled one) with the
/// `IDEM_OPERATIONS__…` overrides of the environment applied.
fn read_config(path: Option<&PathBuf>) -> Result<Config> {
    config_from(path, operation_overrides())
}

/// The `IDEM_OPERATIONS__…` variables of the environment, sorted by name.
fn operation_overrides() -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("IDEM_OPERATIONS__"))
        .collect();
    vars.sort();
    vars
}

/// The configuration at `path` (else the bundled one) with `overrides` applied.
fn config_from(path: Option<&PathBuf>, overrides: Vec<(String, String)>) -> Result<Config> {
    let config = match path {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Config::from_toml_with_env(&text, overrides)?
        }
        None => Config::from_toml_with_env(idem_core::config::DEFAULT_TOML, overrides)?,
    };
    Ok(config)
}

/// Checks the arguments of `keys create` before anything is opened: the role,
/// the tenant (1–128 visible ASCII characters: it is part of every scope's
/// primary key) and the operation classes (trimmed; none empty; a warning for
/// each the configuration at `config`, else the bundled one, does not
/// define). Returns them ready to store.
///
/// # Errors
/// A message naming the refused argument.
fn key_to_create(
    tenant: &str,
    role: &str,
    operations: Option<&[String]>,
    config: Option<&PathBuf>,
) -> Result<(String, Role, Option<Vec<String>>)> {
    let role: Role = role
        .parse()
        .map_err(|e| anyhow::anyhow!("{e}: use client, executor or admin"))?;
    if tenant.is_empty()
        || tenant.len() > 128
        || !tenant.bytes().all(|b| (0x21..=0x7e).contains(&b))
    {
        bail!("--tenant must be 1–128 visible ASCII characters");
    }
    let operations =
        operations.map(|ops| ops.iter().map(|o| o.trim().to_owned()).collect::<Vec<_>>());
    if let Some(ops) = &operations {
        if ops.iter().any(String::is_empty) {
            bail!("--operations lists an empty class name");
        }
        warn_unknown_classes(ops, config);
    }
    Ok((tenant.to_owned(), role, operations))
}

/// Warns (on stderr) about each of `ops` that the configuration at `path`
/// (`--config` / `IDEM_CONFIG`, as `idem serve` takes it; else the bundled
/// one) does not define: a key limited to it can submit nothing until the
/// server's configuration has it. Only a warning, since the server may run
/// with another configuration.
fn warn_unknown_classes(ops: &[String], path: Option<&PathBuf>) {
    let config = match read_config(path) {
        Ok(config) => config,
        Err(e) => {
            tell(format_args!(
                "warning: the configuration does not load ({e:#}); the operation classes were not checked"
            ));
            return;
        }
    };
    let source = path.map_or_else(
        || "the bundled configuration".to_owned(),
        |p| format!("the configuration {}", p.display()),
    );
    for op in ops.iter().filter(|o| !config.operations.contains_key(*o)) {
        tell(format_args!(
            "warning: `{op}` is not an operation class of {source}; this key cannot submit it until the server's configuration defines it"
        ));
    }
}

/// SIGTERM and SIGINT (Ctrl-C), listened for from the moment this is made:
/// a signal that arrives before the server waits for one is not lost, and
/// does not end the process with the signal's default action either.
struct ShutdownSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    /// Installs the handlers.
    ///
    /// # Errors
    /// When the handlers cannot be installed.
    fn install() -> Result<ShutdownSignals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(ShutdownSignals {
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(ShutdownSignals {})
    }

    /// The next SIGTERM or SIGINT.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.int.recv() => {},
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Prints `v` as indented JSON. It goes through a [`serde_json::Value`] first:
/// a task's contract is serialized as embedded raw JSON (compact), which
/// `to_string_pretty` would copy as it is instead of indenting.
fn print_json(v: &impl serde::Serialize) -> Result<()> {
    say(serde_json::to_string_pretty(&serde_json::to_value(v)?)?)
}

/// Writes `text` and a newline to stdout ([`say_raw`]).
///
/// # Errors
/// Any write error but a broken pipe.
fn say(text: impl std::fmt::Display) -> Result<()> {
    say_raw(format_args!("{text}\n"))
}

/// Writes `text` to stdout, for the commands' output. A reader that has gone
/// away (`idem task events ID | head`) is not an error: the rest of the output
/// is dropped and the command still ends with its own status (a chaos run
/// with violations still exits 1), instead of the panic `println!` gives on a
/// broken pipe.
///
/// # Errors
/// Any write error but a broken pipe.
fn say_raw(text: impl std::fmt::Display) -> Result<()> {
    match write_stdout(text) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

/// Writes `text` and a newline to stdout, and fails on every write error, a
/// broken pipe included: for output that must not be lost without a word (a
/// plain API key, shown once).
///
/// # Errors
/// Any write error.
fn say_strict(text: impl std::fmt::Display) -> std::io::Result<()> {
    write_stdout(format_args!("{text}\n"))
}

/// Writes `text` to stdout and flushes it: the one place that writes there.
fn write_stdout(text: impl std::fmt::Display) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    write!(out, "{text}").and_then(|()| out.flush())
}

/// Writes `text` and a newline to stderr, for messages to the operator. A
/// write error (a reader of stderr that has gone away) is ignored, so the
/// command still ends with its own status, instead of the panic `eprintln!`
/// gives.
fn tell(text: impl std::fmt::Display) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{text}").and_then(|()| err.flush());
}

/// Opens the store, retrying while it is unavailable (the database is starting,
/// or its connections were terminated during start-up) for at most `wait`;
/// invalid configuration and migration errors fail at once, and so does an
/// embedded SQLite file (nothing to wait for).
async fn open_store_waiting(args: &StoreArgs, wait: Duration) -> Result<Store> {
    if args.store.starts_with("sqlite://") {
        return open_store(args).await;
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut backoff = Duration::from_millis(100);
    loop {
        // One try may hang (packets dropped after the handshake): bounded by
        // what is left of the wait, and by at least the pool timeout.
        let budget = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .max(Duration::from_secs(5));
        let err = match tokio::time::timeout(budget, open_store(args)).await {
            Ok(Ok(store)) => return Ok(store),
            Ok(Err(e)) => e,
            Err(_) => anyhow::Error::new(idem_store::StoreError::Unavailable(format!(
                "no answer from the database within {} ms",
                budget.as_millis()
            ))),
        };
        let unavailable = matches!(
            err.downcast_ref::<idem_store::StoreError>(),
            Some(idem_store::StoreError::Unavailable(_))
        );
        let now = tokio::time::Instant::now();
        if !unavailable || wait.is_zero() {
            return Err(err);
        }
        if now >= deadline {
            return Err(err.context(format!(
                "gave up after retrying for {} ms (IDEM_STORE_WAIT_MS)",
                wait.as_millis()
            )));
        }
        // The last try comes at the deadline itself.
        let pause = backoff.min(deadline - now);
        tracing::warn!(error = %format!("{err:#}"), retry_in_ms = pause.as_millis() as u64, "store unavailable at start-up; retrying");
        tokio::time::sleep(pause).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Holds an exclusive lock on `<file>.serve-lock` next to an SQLite store for
/// as long as the returned file lives: one `idem serve` per SQLite file (its
/// single writer and its process clock decide; docs/architecture.md). Other
/// commands (`keys`, `task`, `gc`) do not take it. `None` for PostgreSQL.
fn lock_sqlite_for_serve(args: &StoreArgs) -> Result<Option<std::fs::File>> {
    let Some(path) = args.store.strip_prefix("sqlite://") else {
        return Ok(None);
    };
    // Checked before the lock file is made next to it.
    idem_store_sqlite::require_file_path(std::path::Path::new(path))
        .context("opening the SQLite store")?;
    let lock_path = format!("{path}.serve-lock");
    if let Some(dir) = std::path::Path::new(&lock_path).parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {lock_path}"))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "another `idem serve` is already running on {path} (it holds {lock_path}); \
             run one per SQLite file, or use PostgreSQL for several instances"
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {lock_path}"))
        }
    }
}

/// Binds `listen` (`HOST:PORT`, HOST an IP address or a name): the first
/// address it resolves to that binds.
///
/// # Errors
/// A message naming `listen` when it does not resolve, or when none of its
/// addresses binds (with the last address's error).
async fn bind(listen: &str) -> Result<tokio::net::TcpListener> {
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .with_context(|| format!("--listen `{listen}` does not resolve to an address (expected HOST:PORT, e.g. 127.0.0.1:8787 or localhost:8787)"))?
        .collect();
    let mut last = None;
    for addr in &addrs {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some((addr, e)),
        }
    }
    match last {
        Some((addr, e)) => Err(e).with_context(|| format!("binding {addr} (--listen `{listen}`)")),
        None => bail!("--listen `{listen}` resolves to no address"),
    }
}

/// How `serve` runs, from `idem serve`'s flags.
struct ServeArgs {
    listen: String,
    config: Option<PathBuf>,
    sweep_ms: u64,
    store_wait: Duration,
    shutdown_grace: Duration,
    header_timeout: Duration,
    idle_timeout: Duration,
    max_connections: Option<u64>,
}

async fn serve(args: ServeArgs, store_args: StoreArgs) -> Result<()> {
    let ServeArgs {
        listen,
        config,
        sweep_ms,
        store_wait,
        shutdown_grace,
        header_timeout,
        idle_timeout,
        max_connections,
    } = args;
    let config = load_config(config.as_ref())?;
    log_store_location(&store_args)?;
    let _serve_lock = lock_sqlite_for_serve(&store_args)?;
    let store = open_store_waiting(&store_args, store_wait).await?;
    let version = config.version();
    let state = idem_http::AppState::new(store.clone(), config);
    let work = state.work.clone();
    let draining = state.clone();
    // Before "listening" is printed: whoever starts us may signal from then on.
    let mut signals = ShutdownSignals::install()?;
    let listener = bind(&listen).await?;
    let addr = listener.local_addr()?;
    let pool = if store.kind() == "postgres" {
        store_args.pg_pool_size
    } else {
        0
    };
    let limits = idem_http::ServeLimits {
        header_timeout,
        idle_timeout,
        max_connections: max_connections.map_or_else(
            || idem_http::default_max_connections(pool),
            |n| usize::try_from(n).unwrap_or(usize::MAX),
        ),
    };
    tracing::info!(
        header_timeout_ms = header_timeout.as_millis() as u64,
        idle_timeout_ms = idle_timeout.as_millis() as u64,
        max_connections = limits.max_connections,
        open_file_limit = idem_http::open_file_limit(),
        "connection limits"
    );
    tracing::info!(%addr, store = store.kind(), config_version = %version, "idem listening on http://{addr}");
    say(format_args!("idem listening on http://{addr}"))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // The metrics recorder before the sweeper's first tick (at once), so that
    // sweep's counts (after a restart, every lease that ran out meanwhile) are
    // recorded too; the router would install it only later.
    let _ = idem_http::metrics_handle();
    let sweeper = tokio::spawn(idem_http::run_sweeper(
        store,
        work,
        Duration::from_millis(sweep_ms.max(10)),
        async move {
            let mut rx = stop_rx;
            let _ = rx.wait_for(|stop| *stop).await;
        },
    ));
    let (signalled, first_signal) = tokio::sync::oneshot::channel::<ShutdownSignals>();
    // After the first signal: a second one, or the grace period running out,
    // ends the process even if a request is still open (a client that stopped
    // sending half-way would otherwise hold it for ever). Nothing is
    // half-written either way: an unfinished transaction rolls back.
    tokio::spawn(async move {
        let Ok(mut signals) = first_signal.await else {
            return;
        };
        tokio::select! {
            () = signals.next() => {
                tracing::warn!("second signal: exiting without waiting for open requests");
            }
            () = tokio::time::sleep(shutdown_grace) => {
                tracing::warn!(grace_ms = shutdown_grace.as_millis() as u64, "open requests outlasted the shutdown grace period: exiting");
            }
        }
        tracing::warn!("{STOPPED_CUT}");
        std::process::exit(1);
    });
    idem_http::serve(listener, idem_http::router(state), limits, async move {
        signals.next().await;
        tracing::info!("shutting down: answering open requests");
        // Long-polling claims answer now, so the shutdown does not wait
        // out their `wait_ms`.
        draining.drain();
        let _ = signalled.send(signals);
    })
    .await?;
    let _ = stop_tx.send(true);
    let _ = sweeper.await;
    tracing::info!("{STOPPED}");
    Ok(())
}

/// The last line `serve` logs after a graceful shutdown (info).
const STOPPED: &str = "idem stopped";

/// The last line `serve` logs when a second signal or the grace period ends
/// it with open requests (warn; exit status 1).
const STOPPED_CUT: &str = "idem stopped with requests still open (exit status 1)";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One readable line (with its causes), whatever RUST_BACKTRACE says.
            tell(format_args!("error: {e:#}"));
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A log line that cannot be written (stderr closed) is dropped; the
        // default reports that with `eprintln!`, which panics on a closed stderr.
        .log_internal_errors(false)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Serve {
            listen,
            config,
            sweep_interval_ms,
            store_wait_ms,
            shutdown_grace_ms,
            header_timeout_ms,
            idle_timeout_ms,
            max_connections,
            store,
        } => {
            let args = ServeArgs {
                listen,
                config,
                sweep_ms: sweep_interval_ms,
                store_wait: Duration::from_millis(store_wait_ms),
                shutdown_grace: Duration::from_millis(shutdown_grace_ms),
                header_timeout: Duration::from_millis(header_timeout_ms),
                idle_timeout: Duration::from_millis(idle_timeout_ms),
                max_connections,
            };
            serve(args, store).await
        }
        Command::Keys { command, store } => {
            log_store_location(&store)?;
            // A refused `keys create` must not create the database first.
            let create = match &command {
                KeysCommand::Create {
                    tenant,
                    role,
                    operations,
                    config,
                } => Some(key_to_create(
                    tenant,
                    role,
                    operations.as_deref(),
                    config.as_ref(),
                )?),
                _ => None,
            };
            let store = match command {
                KeysCommand::Create { .. } => open_store(&store).await?,
                _ => open_existing_store(&store).await?,
            };
            match command {
                KeysCommand::Create { .. } => {
                    let Some((tenant, role, operations)) = create else {
                        bail!("no key to create");
                    };
                    let (key, plain) = store.create_api_key(&tenant, role, operations).await?;
                    tell(format_args!(
                        "created API key {} for tenant {} (role {}); the plain key is shown once",
                        key.id, key.tenant, key.role
                    ));
                    // Shown once: a plain key nobody received must not pass for
                    // success (exit 1, and the way out).
                    say_strict(plain).with_context(|| {
                        format!(
                            "API key {id} was created but its plain key could not be written to stdout; \
                             revoke it (idem keys revoke {id}) and create another",
                            id = key.id
                        )
                    })?;
                }
                KeysCommand::Revoke { id } => match store.revoke_api_key(id).await? {
                    Some(k) => tell(format_args!("revoked {}", k.id)),
                    None => bail!("no API key {id}"),
                },
                KeysCommand::List => {
                    for k in store.list_api_keys().await? {
                        let ops = k.operations.map_or_else(|| "*".to_owned(), |o| o.join(","));
                        let revoked = k
                            .revoked_at
                            .map_or_else(|| "-".to_owned(), |t| t.to_rfc3339());
                        say(format_args!(
                            "{}\t{}\t{}\t{}\t{}\t{}",
                            k.id,
                            k.tenant,
                            k.role,
                            ops,
                            k.created_at.to_rfc3339(),
                            revoked
                        ))?;
                    }
                }
            }
            Ok(())
        }
        Command::Task { command, store } => {
            let store = open_existing_store(&store).await?;
            match command {
                TaskCommand::Show { id } => print_json(
                    &store
                        .get_task(None, id)
                        .await?
                        .map_err(|_| anyhow::anyhow!("no task {id}"))?,
                ),
                TaskCommand::Events { id } => print_json(
                    &store
                        .list_events(None, id)
                        .await?
                        .map_err(|_| anyhow::anyhow!("no task {id}"))?,
                ),
                TaskCommand::Attempts { id } => print_json(
                    &store
                        .list_attempts(None, id)
                        .await?
                        .map_err(|_| anyhow::anyhow!("no task {id}"))?,
                ),
            }
        }
        Command::Migrate { store } => {
            log_store_location(&store)?;
            let (kind, applied, known) = if let Some(path) = store.store.strip_prefix("sqlite://") {
                let path = path.to_owned();
                let applied =
                    tokio::task::spawn_blocking(move || idem_store_sqlite::migrate_file(path))
                        .await?
                        .context("migrating the SQLite store")?;
                (
                    "sqlite",
                    applied.iter().map(i64::to_string).collect::<Vec<_>>(),
                    idem_store_sqlite::MIGRATIONS.len().to_string(),
                )
            } else if is_postgres(&store.store) {
                let applied = idem_store_postgres::migrate(&store.store)
                    .await
                    .context("migrating the PostgreSQL store")?;
                let known = idem_store_postgres::MIGRATIONS
                    .iter()
                    .map(|(v, _)| *v)
                    .max()
                    .unwrap_or(0);
                (
                    "postgres",
                    applied.iter().map(i32::to_string).collect(),
                    known.to_string(),
                )
            } else {
                bail!(
                    "--store must start with sqlite://, postgres:// or postgresql://, got `{}`",
                    store.store
                )
            };
            if applied.is_empty() {
                tell(format_args!(
                    "{kind} schema is up to date at version {known}; nothing to apply"
                ));
            } else {
                tell(format_args!(
                    "{kind}: applied migration(s) {}; schema now at version {known}",
                    applied.join(", ")
                ));
            }
            Ok(())
        }
        Command::Gc { store } => {
            let s = open_existing_store(&store).await?;
            let stats = s.sweep(10_000).await?;
            say(format_args!(
                "expired {} leases, woke {} tasks, released {} idempotency keys",
                stats.expired, stats.woken, stats.keys_released
            ))?;
            Ok(())
        }
        Command::Bench {
            mode,
            concurrency,
            count,
            url,
            api_key,
            bench_store,
            no_baseline,
            load_threads,
            json,
        } => {
            let run = idem_harness::bench::run(idem_harness::bench::BenchOptions {
                modes: mode,
                concurrency,
                count,
                url,
                api_key,
                store: bench_store,
                no_baseline,
                progress: !json,
                load_threads: usize::from(load_threads),
            });
            // Ctrl-C drops the run, and with it the in-process server and its
            // temporary store, instead of killing the process where it stands.
            let results = tokio::select! {
                results = run => results?,
                _ = tokio::signal::ctrl_c() => bail!("interrupted; no figures"),
            };
            if json {
                for r in &results {
                    say(serde_json::to_string(r)?)?;
                }
            } else {
                say_raw(idem_harness::bench::render(&results))?;
            }
            let failed: Vec<String> = results
                .iter()
                .filter(|r| r.unexpected > 0)
                .map(|r| format!("{}: {} of {}", r.mode, r.unexpected, r.requests))
                .collect();
            if !failed.is_empty() {
                bail!(
                    "requests not answered with the mode's expected status ({}); see `bad` and \
                     `statuses`: these figures do not measure idem",
                    failed.join(", ")
                );
            }
            Ok(())
        }
        Command::Demo {
            url,
            client_key,
            executor_key,
        } => {
            let report = idem_harness::demo::run(idem_harness::demo::DemoOptions {
                url,
                client_key,
                executor_key,
                echo: true,
            })
            .await?;
            idem_harness::demo::verdict(&report)
        }
        Command::Chaos {
            seed,
            ops,
            store,
            clients,
            executors,
            json,
        } => {
            let report = idem_harness::chaos::run(idem_harness::chaos::ChaosOptions {
                seed,
                ops,
                store,
                idem_bin: std::env::current_exe().context("locating the idem binary")?,
                clients,
                executors,
                progress: !json,
            })
            .await?;
            if json {
                say(serde_json::to_string(&report)?)?;
            } else {
                say_raw(idem_harness::chaos::render(&report))?;
            }
            idem_harness::chaos::verdict(&report)
        }
        Command::Openapi => {
            say(serde_json::to_string_pretty(&idem_http::openapi())?)?;
            Ok(())
        }
    }
}
