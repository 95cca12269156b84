//! `idem`: the product binary (SPEC §6): `serve`, `keys`, `task`, `migrate`,
//! `backup`, `gc`, `openapi`. The lab's commands (`demo`, `bench`,
//! `bench-console`, `bench-waiters`, `chaos`, `verify`) are `idem-lab`'s, in
//! idem-harness: this binary links neither the harness nor the model checker.
//!
//! This file holds the command line and runs each command; [`mod@serve`] runs the
//! server, [`store`] opens the store a command names, [`config`] loads the
//! operation classes, [`keys`] checks `keys create`'s arguments and
//! [`output`] writes to stdout and stderr.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use uuid::Uuid;

mod config;
mod keys;
mod output;
mod serve;
mod store;
mod task;
mod task_action;
mod task_text;
mod telemetry;

use idem_server::output::{say, say_strict, tell};
use keys::{key_to_create, pool_of};
use serve::{ServeArgs, serve};
use store::{is_postgres, log_store_location, open_existing_store, open_store};
use task::TaskCommand;

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
    /// Shift this process's clock by this many ms (testing clock skew only;
    /// a PostgreSQL store reads the database clock, which this does not shift).
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
        /// A request whose body is not complete this long after its headers is
        /// answered 408 and its connection closed, ms.
        #[arg(long, env = "IDEM_BODY_TIMEOUT_MS", default_value_t = 30_000,
              value_parser = clap::value_parser!(u64).range(1..))]
        body_timeout_ms: u64,
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
        /// Export idem's spans (each request, store operation and attempt)
        /// over OTLP/HTTP (protobuf) to this collector, e.g.
        /// `http://localhost:4318` (`/v1/traces` is added unless the URL ends
        /// with it). Unset: nothing is exported.
        #[arg(long, env = "IDEM_OTLP_ENDPOINT")]
        otlp_endpoint: Option<String>,
        /// PostgreSQL: answer `/readyz` and submits with 503 `NO_SYNC_STANDBY`
        /// while no synchronous standby is attached to the primary
        /// (`pg_stat_replication`, checked every second; the role needs
        /// `pg_monitor`). Refused with a SQLite store.
        #[arg(long, env = "IDEM_REQUIRE_SYNC_STANDBY", value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
        require_sync_standby: bool,
        #[command(flatten)]
        console: serve::ConsoleArgs,
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
    /// Inspect a task, list a tenant's tasks, or act on a task as an operator
    /// (store-level, any tenant).
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
    /// Copy an SQLite store to a new file while it serves (`VACUUM INTO`),
    /// check the copy (`PRAGMA integrity_check`) and mark it as a backup: a
    /// store started on it moves the tasks that may have started to
    /// reconcile-first. PostgreSQL: base backups with WAL archiving
    /// (docs/deployment.md, "Backups").
    Backup {
        /// The copy to write; must not exist.
        #[arg(long)]
        to: PathBuf,
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
        /// An executor key of a shared pool: `all` tenants, or a
        /// comma-separated list of tenants it claims for (SPEC §2.13);
        /// default: its own tenant only.
        #[arg(long)]
        serves: Option<String>,
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
    let cli = Cli::parse();
    let otlp_endpoint = match &cli.command {
        Command::Serve { otlp_endpoint, .. } => otlp_endpoint.as_deref(),
        _ => None,
    };
    let telemetry = telemetry::init(otlp_endpoint)?;
    run_command(cli, telemetry).await
}

/// Runs the command; `serve` stops `telemetry`'s span export when it stops.
async fn run_command(cli: Cli, telemetry: telemetry::Telemetry) -> Result<()> {
    match cli.command {
        Command::Serve {
            listen,
            config,
            sweep_interval_ms,
            store_wait_ms,
            shutdown_grace_ms,
            header_timeout_ms,
            body_timeout_ms,
            idle_timeout_ms,
            max_connections,
            otlp_endpoint: _,
            require_sync_standby,
            console,
            store,
        } => {
            let args = ServeArgs {
                listen,
                config,
                sweep_ms: sweep_interval_ms,
                store_wait: Duration::from_millis(store_wait_ms),
                shutdown_grace: Duration::from_millis(shutdown_grace_ms),
                header_timeout: Duration::from_millis(header_timeout_ms),
                body_timeout: Duration::from_millis(body_timeout_ms),
                idle_timeout: Duration::from_millis(idle_timeout_ms),
                max_connections,
                require_sync_standby,
                console: console.config(),
            };
            serve(args, store, telemetry).await
        }
        Command::Keys { command, store } => {
            log_store_location(&store)?;
            // A refused `keys create` must not create the database first.
            let create = match &command {
                KeysCommand::Create {
                    tenant,
                    role,
                    operations,
                    serves,
                    config,
                } => Some((
                    key_to_create(tenant, role, operations.as_deref(), config.as_ref())?,
                    pool_of(role, serves.as_deref())?,
                )),
                _ => None,
            };
            let store = match command {
                KeysCommand::Create { .. } => {
                    store::refuse_sqlite_change_under_serve(&store, false)?;
                    open_store(&store).await?
                }
                _ => open_existing_store(&store).await?,
            };
            match command {
                KeysCommand::Create { .. } => {
                    let Some(((tenant, role, operations), serves)) = create else {
                        bail!("no key to create");
                    };
                    let (key, plain) = store
                        .create_pool_key(&tenant, role, operations, serves)
                        .await?;
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
                        // A pool key adds the tenants it serves.
                        let serves = k
                            .serves
                            .map_or_else(String::new, |s| format!("\tserves={}", s.text()));
                        say(format_args!(
                            "{}\t{}\t{}\t{}\t{}\t{}{}",
                            k.id,
                            k.tenant,
                            k.role,
                            ops,
                            k.created_at.to_rfc3339(),
                            revoked,
                            serves
                        ))?;
                    }
                }
            }
            Ok(())
        }
        Command::Task { command, store } => {
            let store = open_existing_store(&store).await?;
            let done = task::run(&store, command).await;
            // Other instances' waiters hear of what the action changed.
            store.announced().await;
            done
        }
        Command::Migrate { store } => {
            log_store_location(&store)?;
            store::refuse_sqlite_change_under_serve(&store, true)?;
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
                    .map(|m| m.version)
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
        Command::Backup { to, store } => {
            if is_postgres(&store.store) {
                bail!(
                    "idem backup copies SQLite stores; back a PostgreSQL store up with the \
                     database's own tools: a base backup (pg_basebackup) with WAL archiving, \
                     restored to a point in time (docs/deployment.md, \"Backups\"). A store \
                     restored that way is on a new timeline, and idem moves the tasks that may \
                     have started to reconcile-first when it finds it"
                );
            }
            let Some(path) = store.store.strip_prefix("sqlite://") else {
                bail!(
                    "--store must start with sqlite://, postgres:// or postgresql://, got `{}`",
                    store.store
                );
            };
            let source = PathBuf::from(path);
            let target = to.clone();
            let report =
                tokio::task::spawn_blocking(move || idem_store_sqlite::backup(&source, &target))
                    .await?
                    .with_context(|| format!("backing up {path} to {}", to.display()))?;
            say(format_args!(
                "backed up {path} to {}: {} tasks, {} bytes, schema version {}; copied in {} ms, \
                 integrity_check ok in {} ms; marked as a backup (a store opened on it moves the \
                 tasks that may have started to reconcile-first)",
                report.path.display(),
                report.tasks,
                report.bytes,
                report.schema_version,
                report.copy_ms,
                report.check_ms
            ))?;
            Ok(())
        }
        Command::Gc { store } => {
            let s = open_existing_store(&store).await?;
            s.check_identity()
                .await
                .context("checking the store's identity")?;
            let stats = s.sweep(10_000).await?;
            say(format_args!(
                "expired {} leases, woke {} tasks, released {} idempotency keys",
                stats.expired, stats.woken, stats.keys_released
            ))?;
            Ok(())
        }
        Command::Openapi => {
            say(serde_json::to_string_pretty(&idem_http::openapi())?)?;
            Ok(())
        }
    }
}
