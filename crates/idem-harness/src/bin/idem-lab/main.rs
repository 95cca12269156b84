//! `idem-lab`: the lab's commands, beside the product binary `idem`:
//! `demo`, `bench`, `bench-console`, `bench-waiters`, `chaos` and `verify`
//! (docs/benchmarks.md, docs/chaos.md, docs/verification.md). They link the
//! harness and the model checker, which the product binary does not.
//!
//! `bench-console`, `bench-waiters`, `chaos` and `fairness --http` start `idem serve` child
//! processes from the `idem` binary [`IdemBin`] names: `--idem-bin` or
//! `IDEM_BIN`, else `idem` in this executable's directory (cargo builds both
//! into `target/<profile>/`; an install puts both in one directory).
//! `demo` and `bench` run their server inside this process.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

mod verify;

use idem_server::output::{say, say_raw, tell};

/// mimalloc, as in `idem`: `bench` and `demo` run the server inside this
/// process, and its figures are those of the product's allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "idem-lab",
    version,
    about = "idem's lab: demo, benchmarks, fault injection and model checking"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The `idem` binary whose `idem serve` processes a command starts.
#[derive(Args, Clone, Debug)]
struct IdemBin {
    /// The `idem` binary to start `idem serve` from; default: `idem` in the
    /// directory of this executable.
    #[arg(long = "idem-bin", env = "IDEM_BIN")]
    idem_bin: Option<PathBuf>,
}

impl IdemBin {
    /// The binary, as an absolute path (the child processes may run in
    /// another directory or network namespace): `--idem-bin` (`IDEM_BIN`),
    /// else `idem` beside this executable.
    ///
    /// # Errors
    /// This executable's path is unknown, or no file is there.
    fn path(&self) -> Result<PathBuf> {
        let path = match &self.idem_bin {
            Some(path) => path.clone(),
            None => {
                let exe = std::env::current_exe().context("locating the idem-lab binary")?;
                exe.with_file_name(format!("idem{}", std::env::consts::EXE_SUFFIX))
            }
        };
        std::fs::canonicalize(&path).with_context(|| {
            format!(
                "no idem binary at {}: build it (cargo build -p idem, the same profile as \
                 idem-lab) or name one with --idem-bin or IDEM_BIN",
                path.display()
            )
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Model-check the protocol: explore every interleaving of clients,
    /// executors (crashes, late reports), the sweeper, the clock, a provider and
    /// an operator within the bounds, over the real state machine, and check the
    /// invariants of SPEC §2 (exit 1 with a step-by-step trace on a counterexample).
    Verify(verify::VerifyArgs),
    /// Fair claims (SPEC §2.13): leases between a tenant's single task and its
    /// lease while another tenant's flood drains, per round, for a pool
    /// serving every tenant; then claim+report pairs per second by number of
    /// tenants with work (docs/benchmarks.md, "Fair claims").
    Fairness {
        /// Store: a PostgreSQL URL, `sqlite://path`; default a temporary SQLite file.
        #[arg(long)]
        store: Option<String>,
        /// Connection pools on the one PostgreSQL database, each standing for one `idem serve`;
        /// with --http, `idem serve` processes (SQLite: one).
        #[arg(long, default_value_t = 2)]
        instances: usize,
        /// The starvation rounds over HTTP against `idem serve` child processes on the store
        /// (submits, claims and reports through the API) instead of the store's operations in
        /// this process; no cost or aging run.
        #[arg(long)]
        http: bool,
        /// The figures as one JSON object on stdout.
        #[arg(long)]
        json: bool,
        /// Claim loops (one attempt per claim, reported `succeeded`), spread over the instances.
        #[arg(long, default_value_t = 8)]
        claimers: usize,
        /// Tasks of the flooding tenant (or value).
        #[arg(long, default_value_t = 50_000)]
        flood: usize,
        /// Rounds of the single task.
        #[arg(long, default_value_t = 50)]
        rounds: usize,
        /// Two fairness key values of one tenant instead of two tenants.
        #[arg(long)]
        values: bool,
        /// Tenant counts of the cost runs, comma-separated (none: no cost run;
        /// 0: one tenant claimed by its own key, which keeps no turns).
        #[arg(long, value_delimiter = ',')]
        tenants: Vec<usize>,
        /// Seconds per cost run.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Tasks queued for each cost run, spread over its tenants (at least 20 each).
        #[arg(long, default_value_t = 20_000)]
        cost_tasks: usize,
        /// The cost runs' pool serves every tenant (`--serves all`: one --tenants value, on a
        /// database of its own) rather than the run's tenants by name.
        #[arg(long)]
        pool_serves_all: bool,
        /// Priority-5 backlog of the aging run, kept full (0: no aging run).
        #[arg(long, default_value_t = 0)]
        aging_backlog: usize,
        #[command(flatten)]
        idem: IdemBin,
    },
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
        /// Admin API key for --url (same tenant): scene (f) acknowledges the
        /// suspected second effect with it; without it that step is left out.
        #[arg(long, env = "IDEM_ADMIN_KEY")]
        admin_key: Option<String>,
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
        #[command(flatten)]
        idem: IdemBin,
    },
    /// Rate limits where replays are free (docs/benchmarks.md "Rate limits"): an in-process
    /// server whose tenant may create --per-s new tasks per second gets --load × that for
    /// --seconds (50 % new keys, 40 % replays, 10 % conflicts); then every refused key is
    /// submitted again. Exit 1 when a replay or conflict was not answered as usual, a 429
    /// lacked Retry-After, or a refused key was not accepted as new later.
    BenchRates {
        /// The tenant's limit, new tasks per second.
        #[arg(long, default_value_t = 50.0)]
        per_s: f64,
        /// Offered submits as a multiple of --per-s.
        #[arg(long, default_value_t = 3.0)]
        load: f64,
        /// Length of the load, seconds.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Store of the in-process server (default: a temporary SQLite file).
        #[arg(long = "bench-store")]
        bench_store: Option<String>,
        /// The figures as one JSON object.
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
        /// On PostgreSQL, how long after the work before it each measured phase starts
        /// (and a submit phase's count ends), ms: a session publishes its transaction
        /// counts at the latest 10 s after it went idle, so a shorter wait gives counts
        /// that may miss the latest work's.
        #[arg(long, default_value_t = 12_000)]
        settle_ms: u64,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        idem: IdemBin,
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
        /// The provider executors pay at: `deduplicating` (by task id) or
        /// `non-deduplicating` (every pay request a new effect with a new
        /// transaction id; implies --stale-payers). See docs/chaos.md.
        #[arg(long, value_enum, default_value_t = idem_harness::chaos::ProviderMode::Deduplicating)]
        provider: idem_harness::chaos::ProviderMode,
        /// Executors cut off from idem past their lease that pay anyway and
        /// then report (refused, kept as evidence, raised by idem as
        /// suspected second effects where the provider's ledger has two).
        #[arg(long)]
        stale_payers: bool,
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
        #[command(flatten)]
        idem: IdemBin,
    },
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
    // On SIGTERM or SIGINT the command is dropped, not the process cut
    // short: its `idem serve` children (spawned `kill_on_drop`) and temp
    // dirs go with it.
    let outcome = tokio::select! {
        res = run() => res,
        signal = idem_harness::chaos::interrupted() => Err(anyhow::anyhow!(
            "stopped by {signal}; the servers and files it started are gone"
        )),
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One readable line (with its causes), whatever RUST_BACKTRACE says.
            tell(format_args!("error: {e:#}"));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Installs the log output `idem` gives its commands (stderr, `RUST_LOG`,
/// default `info`; idem's span target off), then runs the command.
async fn run() -> Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        .add_directive(
            format!("{}=off", idem_store::spans::TARGET)
                .parse()
                .context("the span target's log directive")?,
        );
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A log line that cannot be written (stderr closed) is dropped; the
        // default reports that with `eprintln!`, which panics on a closed
        // stderr.
        .log_internal_errors(false)
        .init();
    match cli.command {
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
        Command::BenchRates {
            per_s,
            load,
            seconds,
            bench_store,
            json,
        } => {
            let r = idem_harness::rate_bench::run(idem_harness::rate_bench::RateBenchOptions {
                per_s,
                load,
                seconds,
                store: bench_store,
            })
            .await?;
            if json {
                say(serde_json::to_string(&r)?)?;
            } else {
                say_raw(idem_harness::rate_bench::render(&r))?;
            }
            if r.unexpected > 0
                || r.retry_after_missing > 0
                || r.replays.0 != r.replays.1
                || r.conflicts.0 != r.conflicts.1
                || r.retried.0 != r.retried.1
            {
                bail!("rate limits: an answer was not as SPEC §8.1 says");
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
            settle_ms,
            json,
            idem,
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
                settle: Duration::from_millis(settle_ms),
                idem_bin: idem.path()?,
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
            idem,
        } => {
            let run = idem_harness::console_bench::run(
                idem_harness::console_bench::ConsoleBenchOptions {
                    store,
                    tasks,
                    rounds,
                    idem_bin: idem.path()?,
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
            admin_key,
        } => {
            let report = idem_harness::demo::run(idem_harness::demo::DemoOptions {
                url,
                client_key,
                executor_key,
                admin_key,
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
            provider,
            stale_payers,
            netns,
            netns_check,
            clock_skew_ms,
            libfaketime,
            failover_kill,
            failover_promote,
            failover_delay_ms,
            failover_bound_ms,
            failover_async,
            idem,
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
                idem_bin: idem.path()?,
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
                provider,
                stale_payers,
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
        Command::Fairness {
            store,
            instances,
            http,
            json,
            claimers,
            flood,
            rounds,
            values,
            tenants,
            seconds,
            cost_tasks,
            pool_serves_all,
            aging_backlog,
            idem,
        } => {
            let idem_bin = if http { Some(idem.path()?) } else { None };
            let run = idem_harness::fairness::run(idem_harness::fairness::FairnessOptions {
                store,
                instances,
                claimers,
                flood,
                rounds,
                values,
                tenants,
                seconds,
                cost_tasks,
                pool_serves_all,
                aging_backlog,
                idem_bin,
            });
            bench_report(run, json, idem_harness::fairness::render).await?;
            Ok(())
        }
    }
}
