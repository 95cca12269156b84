//! `idem`: the one binary (SPEC §6): `serve`, `keys`, `task`, `migrate`, `gc`, `demo`, `bench`, `bench-console`,
//! `bench-waiters`, `chaos`, `verify`.
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
mod telemetry;
mod verify;

use keys::key_to_create;
use output::{say, say_raw, say_strict, tell};
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
    /// Model-check the protocol: explore every interleaving of clients,
    /// executors (crashes, late reports), the sweeper, the clock, a provider and
    /// an operator within the bounds, over the real state machine, and check the
    /// invariants of SPEC §2 (exit 1 with a step-by-step trace on a counterexample).
    Verify(verify::VerifyArgs),
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
    /// How fast the console's pages answer with a large tenant (a real `idem serve`): seeds
    /// --tasks tasks through the API in every state, signs an admin in, and fetches each page
    /// --rounds times one request at a time; p50, p99 and max per page.
    BenchConsole {
        /// `postgres://…`, a database nothing else uses, or `sqlite://PATH` (a new file);
        /// default: a temporary SQLite file.
        #[arg(long)]
        store: Option<String>,
        /// Tasks seeded in the tenant.
        #[arg(long, default_value_t = 100_000)]
        tasks: usize,
        /// Requests per page.
        #[arg(long, default_value_t = 300)]
        rounds: usize,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// What executors long-polling for work cost (real `idem serve` processes): database
    /// transactions per second with no waiter and with --waiters waiting, sequential submit
    /// latency without and with them, and the delay until a waiter claims a submitted task.
    /// Exit 1 when a submit, claim or report failed or a task was never claimed.
    BenchWaiters {
        /// `postgres://…`, a database nothing else uses (transactions are counted per
        /// database; the figures need PostgreSQL), or `sqlite://PATH`; default: a temporary
        /// SQLite file.
        #[arg(long)]
        store: Option<String>,
        /// Executors long-polling at once (one connection each; the open-file limit must
        /// exceed this by 256).
        #[arg(long, default_value_t = 1000)]
        waiters: usize,
        /// Operation classes the waiters spread over (waiter i claims class i mod N, the
        /// submits cycle over them); 1: every waiter claims the same class.
        #[arg(long, default_value_t = 1)]
        classes: usize,
        /// `idem serve` processes the waiters spread over (2 needs PostgreSQL); submits go
        /// to the first.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
        instances: u8,
        /// Length of each phase without submits (no waiters; waiters and no work), s.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Sequential submits per submit phase (without and with waiters).
        #[arg(long, default_value_t = 1000)]
        submits: usize,
        /// Pause after each submit's answer before the next, ms (0: at once; longer than a
        /// task's claim and report, the executors' work does not overlap the next submit).
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
        /// `wait_ms` of each waiter's claims, ms (1–30000).
        #[arg(long, default_value_t = 30_000)]
        wait_ms: u64,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Seeded fault injection (client retries, executor crashes, stale reports, SIGKILLed
    /// servers, terminated PostgreSQL connections; network partitions, delays and loss with
    /// --netns; a skewed clock with --clock-skew-ms), then a check of every SPEC §2 invariant
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
        /// Run each server in a network namespace of its own and partition,
        /// delay and thin its database link (PostgreSQL store; root, `ip`
        /// and `nft` needed). See docs/chaos.md.
        #[arg(long)]
        netns: bool,
        /// Only check that this machine can run `--netns` (exit 0) or say
        /// why not (exit 1); runs nothing else.
        #[arg(long)]
        netns_check: bool,
        /// Shift the second server's wall clock by this many ms (±, flipping
        /// at each restart) under libfaketime (PostgreSQL store; 5000 to
        /// 86400000, one day, in size).
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        clock_skew_ms: i64,
        /// libfaketime for `--clock-skew-ms`; default: the usual install paths.
        #[arg(long)]
        libfaketime: Option<PathBuf>,
        /// A database failover half-way through the operations (PostgreSQL on
        /// a multi-host URL): this shell command kills the primary, then
        /// `--failover-promote` promotes the standby. The run's own server
        /// faults are left out; 5xx answers must fall between the kill and
        /// the promotion plus `--failover-bound-ms`, and every acknowledged
        /// submit and report must be in the promoted database
        /// (`scripts/failover.sh`).
        #[arg(long, requires = "failover_promote")]
        failover_kill: Option<String>,
        /// Shell command that promotes the standby (returns once it accepts writes).
        #[arg(long, requires = "failover_kill")]
        failover_promote: Option<String>,
        /// Pause between the kill and the promotion, ms.
        #[arg(long, default_value_t = 1000)]
        failover_delay_ms: u64,
        /// How long after the promotion 5xx answers may still come, ms.
        #[arg(long, default_value_t = 5000)]
        failover_bound_ms: u64,
        /// The standby is asynchronous: acknowledged writes missing afterwards
        /// are counted, not violations.
        #[arg(long)]
        failover_async: bool,
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

/// Runs a bench to its report and prints it: one JSON object with `json`,
/// else `render`'s table. Ctrl-C drops the run, and with it the servers
/// (killed) and the temporary files, instead of killing the process where
/// it stands.
async fn bench_report<R: serde::Serialize>(
    run: impl std::future::Future<Output = Result<R>>,
    json: bool,
    render: fn(&R) -> String,
) -> Result<R> {
    let report = tokio::select! {
        report = run => report?,
        _ = tokio::signal::ctrl_c() => bail!("interrupted; no figures"),
    };
    if json {
        say(serde_json::to_string(&report)?)?;
    } else {
        say_raw(render(&report))?;
    }
    Ok(report)
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
                KeysCommand::Create { .. } => {
                    store::refuse_sqlite_change_under_serve(&store, false)?;
                    open_store(&store).await?
                }
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
        Command::BenchWaiters {
            store,
            waiters,
            classes,
            instances,
            seconds,
            submits,
            pause_ms,
            wait_ms,
            json,
        } => {
            let run = idem_harness::waiters::run(idem_harness::waiters::WaitersOptions {
                store,
                waiters,
                classes,
                instances: usize::from(instances),
                seconds,
                submits,
                pause_ms,
                wait_ms,
                idem_bin: std::env::current_exe().context("locating the idem binary")?,
                progress: !json,
            });
            let report = bench_report(run, json, idem_harness::waiters::render).await?;
            let lost = report
                .submits_with_waiters
                .claims
                .as_ref()
                .map_or(0, |c| c.unclaimed);
            let failed = report.submits.failed
                + report.submits_with_waiters.failed
                + report.failed_polls
                + report.failed_reports;
            if failed > 0 || lost > 0 {
                bail!(
                    "{failed} submits, claims or reports failed and {lost} tasks were never \
                     claimed: these figures do not measure idem"
                );
            }
            Ok(())
        }
        Command::BenchConsole {
            store,
            tasks,
            rounds,
            json,
        } => {
            let run = idem_harness::console_bench::run(
                idem_harness::console_bench::ConsoleBenchOptions {
                    store,
                    tasks,
                    rounds,
                    idem_bin: std::env::current_exe().context("locating the idem binary")?,
                    progress: !json,
                },
            );
            bench_report(run, json, idem_harness::console_bench::render).await?;
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
            netns,
            netns_check,
            clock_skew_ms,
            libfaketime,
            failover_kill,
            failover_promote,
            failover_delay_ms,
            failover_bound_ms,
            failover_async,
        } => {
            if netns_check {
                tokio::task::spawn_blocking(idem_harness::chaos::netns::probe).await??;
                say("network namespaces: available (ip netns, veth, nftables)")?;
                return Ok(());
            }
            let report = idem_harness::chaos::run(idem_harness::chaos::ChaosOptions {
                seed,
                ops,
                store,
                idem_bin: std::env::current_exe().context("locating the idem binary")?,
                clients,
                executors,
                progress: !json,
                netns,
                clock_skew_ms,
                libfaketime,
                failover: failover_kill.zip(failover_promote).map(|(kill, promote)| {
                    idem_harness::chaos::Failover {
                        kill,
                        promote,
                        delay: Duration::from_millis(failover_delay_ms),
                        bound: Duration::from_millis(failover_bound_ms),
                        expect_no_loss: !failover_async,
                    }
                }),
            })
            .await?;
            if json {
                say(serde_json::to_string(&report)?)?;
            } else {
                say_raw(idem_harness::chaos::render(&report))?;
            }
            idem_harness::chaos::verdict(&report)
        }
        Command::Verify(args) => verify::verify(args).await,
        Command::Openapi => {
            say(serde_json::to_string_pretty(&idem_http::openapi())?)?;
            Ok(())
        }
    }
}
