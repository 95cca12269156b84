//! `idem-lab bench-waiters`: what executors long-polling for work cost the
//! database and the submitters (SPEC §4, "Waiting executors at fleet
//! scale"), against real `idem serve` processes on one store.
//!
//! The run, in order (each phase on the same servers and database):
//!
//! 1. **idle**: no executor waits; database transactions per second over
//!    [`WaitersOptions::seconds`].
//! 2. **submits**: [`WaitersOptions::submits`] submits one after another,
//!    each sent when the previous one was answered; their latency. Their
//!    tasks are then claimed (without waiting) and reported.
//! 3. **waiting**: [`WaitersOptions::waiters`] executors long-poll
//!    (`POST /v1/attempts/claim` with `wait_ms`, sent again as soon as one
//!    is answered, as an executor's loop does) and no work arrives;
//!    transactions per second over the same length. Each waiter's first
//!    claim waits a share of `wait_ms` proportional to its number, so the
//!    waiters' claims run out spread over time, as a fleet's do, not all at
//!    the same instant.
//! 4. **submits with waiters**: the same sequential submits while the
//!    executors wait; their latency, and for each task the delay until a
//!    waiter's claim answer carried it. The waiter that claimed a task
//!    reports it `succeeded` and claims again, so no work piles up.
//!
//! Transactions are `xact_commit + xact_rollback` of the store's database in
//! `pg_stat_database`, read on a connection of the bench's own with one
//! simple query (one transaction) at each end of a phase; the opening
//! read's own transaction is subtracted. Run it on a database nothing else
//! uses. PostgreSQL publishes a session's counts when the session goes idle,
//! at most once a second and at the latest after 10 s idle, so every phase
//! starts [`STATS_SETTLE`] (or [`WaitersOptions::settle`]) after the work
//! before it ended. The servers'
//! listening sessions publish theirs at their round trip every 5 s; what
//! they left unpublished is read once at the end ([`Listeners`]). SQLite
//! stores have no such counts (`tx_per_s` is absent).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use idem_client::{Client, ReportBody};
use idem_core::config::Config;
use idem_core::model::Role;
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::bench::{MAX_LATENCY_US, latency_histogram};
use crate::server;
use stats::{PgStats, transactions_since};

mod render;
mod stats;

pub use render::render;

/// Longest `wait_ms` a claim may ask for (SPEC §4 `/v1/attempts/claim`), ms.
pub const MAX_WAIT_MS: u64 = 30_000;

/// Pause between the end of one phase's work and the start of the next
/// measured phase on PostgreSQL: a session publishes its transaction counts
/// to `pg_stat_database` at the latest 10 s after it went idle.
pub const STATS_SETTLE: Duration = Duration::from_secs(12);

/// How long the waiters may take to send their first claims.
const WARM_UP_LIMIT: Duration = Duration::from_secs(120);

/// Tenant of the run's keys and tasks.
const TENANT: &str = "bench-waiters";

/// The bench's operation classes are named this, then the class's number.
const CLASS_PREFIX: &str = "bench.wait.";

/// Options of a run.
#[derive(Debug, Clone)]
pub struct WaitersOptions {
    /// `postgres://…` (a database nothing else uses) or `sqlite://PATH`;
    /// `None`: a temporary SQLite file.
    pub store: Option<String>,
    /// Executors long-polling for work.
    pub waiters: usize,
    /// Operation classes the waiters spread over: waiter `i` claims class
    /// `i mod classes` only, and the submits cycle over the classes. 1: every
    /// waiter claims the same class, as a fleet of one kind of executor does.
    pub classes: usize,
    /// `idem serve` processes on the store (1 or 2; 2 needs PostgreSQL):
    /// waiter `i` polls instance `i mod instances`; every submit goes to the
    /// first instance.
    pub instances: usize,
    /// Length of each measured phase without submits, s.
    pub seconds: u64,
    /// Sequential submits per submit phase.
    pub submits: usize,
    /// Pause after each submit's answer before the next is sent, ms (0: at
    /// once). A pause longer than a task's claim and report keeps the
    /// executors' work on one task from overlapping the next submit.
    pub pause_ms: u64,
    /// `wait_ms` of a waiter's claims (its first claim waits a share of it), ms, 1–30 000.
    pub wait_ms: u64,
    /// On PostgreSQL, how long after the work before it a measured phase
    /// starts and a submit phase's count ends ([`STATS_SETTLE`] for figures
    /// that hold every session's transactions).
    pub settle: Duration,
    /// The `idem` binary to run as `idem serve`.
    pub idem_bin: PathBuf,
    /// Phase lines on stderr.
    pub progress: bool,
}

/// A phase without submits.
#[derive(Debug, Clone, Serialize)]
pub struct QuietPhase {
    /// How long it was measured, s.
    pub seconds: f64,
    /// Database transactions per second (`None` on SQLite).
    pub tx_per_s: Option<f64>,
    /// Claim answers the waiters received per second (each sent again at once).
    pub polls_per_s: f64,
}

/// Delays from a submit to the claim answer that carried its task.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimDelays {
    /// Tasks a waiter claimed.
    pub claimed: usize,
    /// Tasks no waiter claimed within `wait_ms` + 10 s of the last submit.
    pub unclaimed: usize,
    /// From the submit being sent to the claim answer arriving at the
    /// waiter: median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
    /// From the submit's answer arriving to the claim answer arriving (0
    /// when the claim answer came first): median, ms.
    pub after_answer_p50_ms: f64,
    /// 99th percentile of the same, ms.
    pub after_answer_p99_ms: f64,
}

/// A phase of sequential submits.
#[derive(Debug, Clone, Serialize)]
pub struct SubmitPhase {
    /// Submits sent.
    pub submits: usize,
    /// Submits not answered 201 (or not at all).
    pub failed: u64,
    /// Submit latency (request sent to answer read): median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
    /// Database transactions per submit: those from the first submit until
    /// [`WaitersOptions::settle`] after the last task was claimed (or the last submit,
    /// without waiters), less the rate of the quiet phase before it over the
    /// same time (`None` on SQLite).
    pub tx_per_submit: Option<f64>,
    /// Claim delays (`None` without waiters).
    pub claims: Option<ClaimDelays>,
}

/// What the servers' listening sessions (`LISTEN idem_changes`, one per
/// instance) left unpublished at the end of the run. Each runs a transaction
/// of its own for every batch of notifications it is woken for; PostgreSQL
/// 15 publishes a session's counts when it goes idle after a command, and a
/// listening session's only commands are its round trip
/// (`idem_store_postgres::notify::PING_SQL`, every 5 s): so the phases'
/// `tx_per_s` and `tx_per_submit` hold the listening sessions' transactions
/// up to their last round trip (each announcement costs its sender one
/// transaction and each listening session one), and what came after is read
/// here, at the end, by ending the listening sessions (`pg_terminate_backend`).
#[derive(Debug, Clone, Serialize)]
pub struct Listeners {
    /// Events committed in the run (rows of `events`), each announced by one
    /// notification.
    pub events: i64,
    /// The listening sessions' transactions since their last round trip,
    /// less what the rest ran meanwhile at the rate of the phase with
    /// waiters and no work (an estimate within a few transactions).
    pub tx: f64,
    /// `tx` ÷ (`events` × instances): 1 when every notification wakes a
    /// listener on its own, less when notifications arrive together.
    pub tx_per_event_per_instance: f64,
}

/// Whether the run meets the figures SPEC §4 sets for waiting executors.
#[derive(Debug, Clone, Serialize)]
pub struct Targets {
    /// Transactions per second while the waiters wait are under
    /// [`TX_PER_S_TARGET`] (`None` on SQLite).
    pub tx_per_s: Option<bool>,
    /// Submit p50 with waiters ÷ without.
    pub submit_p50_ratio: f64,
    /// `submit_p50_ratio` ≤ [`SUBMIT_P50_RATIO_TARGET`].
    pub submit_p50: bool,
    /// Claim delay p99 ≤ [`CLAIM_P99_TARGET_MS`] and no task unclaimed.
    pub claim_p99: bool,
}

/// Most database transactions per second waiting executors may cost.
pub const TX_PER_S_TARGET: f64 = 50.0;
/// Most a sequential submit's p50 may grow with executors waiting (×).
pub const SUBMIT_P50_RATIO_TARGET: f64 = 1.5;
/// Longest p99 delay from a submit to its task's claim, ms.
pub const CLAIM_P99_TARGET_MS: f64 = 100.0;

/// Figures of a run.
#[derive(Debug, Clone, Serialize)]
pub struct WaitersReport {
    /// `postgres` or `sqlite`.
    pub store: String,
    /// Waiting executors.
    pub waiters: usize,
    /// Operation classes they spread over.
    pub classes: usize,
    /// `idem serve` processes.
    pub instances: usize,
    /// `wait_ms` of the waiters' claims, ms.
    pub wait_ms: u64,
    /// Pause between sequential submits, ms.
    pub pause_ms: u64,
    /// No waiter, no work.
    pub idle: QuietPhase,
    /// Sequential submits, no waiter.
    pub submits: SubmitPhase,
    /// The waiters wait, no work.
    pub waiting: QuietPhase,
    /// Sequential submits while the waiters wait.
    pub submits_with_waiters: SubmitPhase,
    /// Claims the waiters sent that failed (transport or HTTP error).
    pub failed_polls: u64,
    /// Reports of claimed tasks that failed.
    pub failed_reports: u64,
    /// The listening sessions' transactions (`None` on SQLite).
    pub listeners: Option<Listeners>,
    /// The run against SPEC §4's figures.
    pub targets: Targets,
}

/// What the waiters share with the run.
#[derive(Debug, Default)]
struct Shared {
    /// Waiters that sent their first claim.
    started: AtomicUsize,
    /// Claim answers received.
    answered: AtomicU64,
    /// Claims that failed.
    failed_polls: AtomicU64,
    /// Reports that failed.
    failed_reports: AtomicU64,
    /// Tasks claimed, with when the claim answer carrying each arrived.
    claimed: Mutex<HashMap<Uuid, Instant>>,
}

impl Shared {
    fn claimed(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Instant>> {
        self.claimed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The operation class numbered `i`.
fn class(i: usize) -> String {
    format!("{CLASS_PREFIX}{i}")
}

/// The servers' configuration: `classes` classes named [`class`], each the
/// bundled `generation.dispatch` class (no params schema, every field
/// material).
///
/// # Errors
/// If the bundled configuration has no `generation.dispatch` class.
pub fn waiters_config(classes: usize) -> Result<Config> {
    let bundled = Config::bundled()?;
    let template = bundled
        .operations
        .get("generation.dispatch")
        .context("the bundled configuration has no generation.dispatch class")?;
    Ok(Config {
        operations: (0..classes.max(1))
            .map(|i| (class(i), template.clone()))
            .collect(),
        tenants: Default::default(),
    })
}

/// Writes a phase line to stderr when `on`.
fn progress(on: bool, line: std::fmt::Arguments<'_>) {
    if on {
        let _ = writeln!(std::io::stderr(), "bench-waiters: {line}");
    }
}

/// Runs the bench.
///
/// # Errors
/// Bad options, too low an open-file limit, a server that does not start,
/// the store or `pg_stat_database` unreachable, or waiters that cannot
/// start.
#[allow(clippy::too_many_lines)]
pub async fn run(opts: WaitersOptions) -> Result<WaitersReport> {
    check_options(&opts)?;
    let dir = tempfile::Builder::new()
        .prefix("idem-bench-waiters-")
        .tempdir()?;
    let store_url = match &opts.store {
        Some(u) => u.clone(),
        None => format!("sqlite://{}", dir.path().join("idem.db").display()),
    };
    let postgres = store_url.starts_with("postgres://") || store_url.starts_with("postgresql://");
    if !postgres && !store_url.starts_with("sqlite://") {
        bail!("--store must start with sqlite://, postgres:// or postgresql://, got `{store_url}`");
    }
    if !postgres && opts.instances > 1 {
        bail!("--instances 2 needs a PostgreSQL store (one process serves a SQLite file)");
    }
    let config_path = dir.path().join("waiters.toml");
    std::fs::write(&config_path, waiters_config(opts.classes)?.to_toml()?)?;
    let (client_key, executor_key) = {
        let (store, _tmp, _path) = server::open_store(Some(&store_url)).await?;
        let (_, c) = store.create_api_key(TENANT, Role::Client, None).await?;
        let (_, e) = store.create_api_key(TENANT, Role::Executor, None).await?;
        (c, e)
    };
    let stats = match postgres {
        true => Some(PgStats::connect(&store_url).await?),
        false => None,
    };
    let mut children = Vec::new();
    let mut urls = Vec::new();
    for i in 0..opts.instances {
        let args: Vec<OsString> = vec![
            "--store".into(),
            store_url.clone().into(),
            "--config".into(),
            config_path.clone().into(),
        ];
        let log = dir.path().join(format!("server-{i}.log"));
        let (child, url) = server::spawn_serve(&opts.idem_bin, &args, &log, "warn")
            .await
            .with_context(|| format!("instance {i}"))?;
        progress(opts.progress, format_args!("instance {i} on {url}"));
        children.push(child);
        urls.push(url);
    }
    let submitter = Client::new(&urls[0], client_key.clone())?;
    let salt = Uuid::new_v4().simple().to_string();
    let shared = Arc::new(Shared::default());
    let settle = if postgres {
        opts.settle
    } else {
        Duration::from_secs(1)
    };

    tokio::time::sleep(settle).await;
    progress(
        opts.progress,
        format_args!("idle, no waiters: {} s", opts.seconds),
    );
    let idle = quiet_phase(stats.as_ref(), opts.seconds, &shared).await?;
    progress(
        opts.progress,
        format_args!("{} sequential submits, no waiters", opts.submits),
    );
    let submits = submit_phase(
        &submitter,
        &opts,
        &format!("{salt}-alone"),
        stats.as_ref(),
        idle.tx_per_s,
        None,
    )
    .await?;

    // The tasks of the submits without waiters are claimed and reported
    // before the waiters start: claimed by the waiters, they would end the
    // waiters' first claims all at once and leave them in step.
    let drained = drain(&Client::new(&urls[0], executor_key.clone())?, opts.classes).await?;
    progress(
        opts.progress,
        format_args!("{drained} queued tasks claimed and reported"),
    );
    tokio::time::sleep(settle).await;
    progress(
        opts.progress,
        format_args!(
            "starting {} waiters over {} instance(s)",
            opts.waiters, opts.instances
        ),
    );
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(None)
        .build()?;
    let executors: Vec<Client> = urls
        .iter()
        .map(|u| {
            Ok(Client::new(u, executor_key.clone())?
                .with_http_client(http.clone())
                .with_timeout(Duration::from_secs(30)))
        })
        .collect::<Result<_>>()?;
    let mut waiters = JoinSet::new();
    for i in 0..opts.waiters {
        let client = executors[i % executors.len()].clone();
        // Spread over (0, wait_ms]: the first claims run out one after another.
        let first_wait = ((i as u64 + 1) * opts.wait_ms / opts.waiters as u64).max(1);
        waiters.spawn(waiter(
            i,
            client,
            class(i % opts.classes),
            first_wait,
            opts.wait_ms,
            Arc::clone(&shared),
        ));
    }
    let warm_up = Instant::now();
    while shared.started.load(Ordering::Relaxed) < opts.waiters {
        if warm_up.elapsed() > WARM_UP_LIMIT {
            bail!(
                "after {} s, {} of {} waiters had sent a claim",
                WARM_UP_LIMIT.as_secs(),
                shared.started.load(Ordering::Relaxed),
                opts.waiters
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(settle).await;
    progress(
        opts.progress,
        format_args!("{} waiters, no work: {} s", opts.waiters, opts.seconds),
    );
    let waiting = quiet_phase(stats.as_ref(), opts.seconds, &shared).await?;
    progress(
        opts.progress,
        format_args!(
            "{} sequential submits, {} waiters",
            opts.submits, opts.waiters
        ),
    );
    let submits_with_waiters = submit_phase(
        &submitter,
        &opts,
        &format!("{salt}-waiters"),
        stats.as_ref(),
        waiting.tx_per_s,
        Some(&shared),
    )
    .await?;
    let listeners = match &stats {
        Some(s) => Some(
            s.listeners(opts.instances, waiting.tx_per_s.unwrap_or_default())
                .await?,
        ),
        None => None,
    };
    waiters.abort_all();
    while waiters.join_next().await.is_some() {}
    drop(children);

    let submit_p50_ratio = submits_with_waiters.p50_ms / submits.p50_ms.max(f64::MIN_POSITIVE);
    let targets = Targets {
        tx_per_s: waiting.tx_per_s.map(|t| t < TX_PER_S_TARGET),
        submit_p50_ratio,
        submit_p50: submit_p50_ratio <= SUBMIT_P50_RATIO_TARGET,
        claim_p99: submits_with_waiters
            .claims
            .as_ref()
            .is_some_and(|c| c.unclaimed == 0 && c.p99_ms <= CLAIM_P99_TARGET_MS),
    };
    Ok(WaitersReport {
        store: if postgres { "postgres" } else { "sqlite" }.to_owned(),
        waiters: opts.waiters,
        classes: opts.classes,
        instances: opts.instances,
        wait_ms: opts.wait_ms,
        pause_ms: opts.pause_ms,
        idle,
        submits,
        waiting,
        submits_with_waiters,
        failed_polls: shared.failed_polls.load(Ordering::Relaxed),
        failed_reports: shared.failed_reports.load(Ordering::Relaxed),
        listeners,
        targets,
    })
}

/// Refuses options the run cannot honour, and open-file limits too low for
/// the waiters' connections (this process and each server inherit it).
fn check_options(opts: &WaitersOptions) -> Result<()> {
    if opts.waiters == 0 || opts.submits == 0 || opts.seconds == 0 {
        bail!("--waiters, --submits and --seconds must be positive");
    }
    if opts.classes == 0 || opts.classes > opts.waiters {
        bail!("--classes must be 1–{} (the waiters)", opts.waiters);
    }
    if !(1..=2).contains(&opts.instances) {
        bail!("--instances must be 1 or 2");
    }
    if !(1..=MAX_WAIT_MS).contains(&opts.wait_ms) {
        bail!("--wait-ms must be 1–{MAX_WAIT_MS}");
    }
    // A connection per waiter here, and the same on the servers between them.
    let needed = opts.waiters as u64 + 256;
    if let Some(limit) = idem_http::open_file_limit()
        && limit < needed
    {
        bail!(
            "the open-file limit is {limit}; {} waiters need at least {needed} (raise it: ulimit -n {needed})",
            opts.waiters
        );
    }
    let per_instance = opts.waiters.div_ceil(opts.instances) + 16;
    let room = idem_http::default_max_connections(16);
    if room < per_instance {
        bail!(
            "an instance would accept {room} connections (open-file limit less its reserve); \
             {per_instance} are needed: raise ulimit -n"
        );
    }
    Ok(())
}

/// One waiting executor: claims one attempt of `operation` with
/// `wait_ms` (the first claim `first_wait_ms`), again as soon as a claim is
/// answered; reports each claimed attempt `succeeded` before claiming
/// again. Runs until aborted.
async fn waiter(
    i: usize,
    client: Client,
    operation: String,
    first_wait_ms: u64,
    wait_ms: u64,
    shared: Arc<Shared>,
) {
    let executor_id = format!("bench-waiter-{i}");
    let operations = [operation.as_str()];
    let mut wait = first_wait_ms;
    shared.started.fetch_add(1, Ordering::Relaxed);
    loop {
        match client.claim(&executor_id, &operations, 1, None, wait).await {
            Ok(attempts) => {
                let at = Instant::now();
                shared.answered.fetch_add(1, Ordering::Relaxed);
                for a in attempts {
                    shared.claimed().entry(a.task_id).or_insert(at);
                    let report = ReportBody::succeeded(a.generation, json!({"by": executor_id}));
                    if client.report(a.id, &report).await.is_err() {
                        shared.failed_reports.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Err(_) => {
                shared.failed_polls.fetch_add(1, Ordering::Relaxed);
                // A failing server is not hammered by a thousand loops.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        wait = wait_ms;
    }
}

/// Claims (without waiting) and reports `succeeded` every queued attempt
/// of the bench's `classes` classes; returns how many.
///
/// # Errors
/// When a claim or a report fails.
async fn drain(client: &Client, classes: usize) -> Result<usize> {
    let names: Vec<String> = (0..classes).map(class).collect();
    let operations: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut drained = 0;
    loop {
        let attempts = client
            .claim("bench-drain", &operations, 100, None, 0)
            .await
            .context("claiming the queued tasks")?;
        if attempts.is_empty() {
            return Ok(drained);
        }
        for a in attempts {
            let report = ReportBody::succeeded(a.generation, json!({"by": "bench-drain"}));
            client
                .report(a.id, &report)
                .await
                .context("reporting a queued task")?;
            drained += 1;
        }
    }
}

/// Measures `seconds` of whatever runs: transactions and claim answers per second.
async fn quiet_phase(stats: Option<&PgStats>, seconds: u64, shared: &Shared) -> Result<QuietPhase> {
    let opened = match stats {
        Some(s) => Some(s.transactions().await?),
        None => None,
    };
    let answered = shared.answered.load(Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let tx = match (stats, opened) {
        (Some(s), Some(o)) => Some(transactions_since(s, o).await?),
        _ => None,
    };
    let elapsed = started.elapsed().as_secs_f64();
    let polls = shared.answered.load(Ordering::Relaxed) - answered;
    Ok(QuietPhase {
        seconds: elapsed,
        tx_per_s: tx.map(|t| t / elapsed),
        polls_per_s: polls as f64 / elapsed,
    })
}

/// Sends `opts.submits` submits one after another (keys `{tag}-{i}`,
/// classes in turn) and measures their latency; with `shared` (waiters
/// running), waits until each task was claimed and measures the delays.
/// `quiet_tx_per_s` is the rate the phase's transactions are counted above.
async fn submit_phase(
    client: &Client,
    opts: &WaitersOptions,
    tag: &str,
    stats: Option<&PgStats>,
    quiet_tx_per_s: Option<f64>,
    shared: Option<&Shared>,
) -> Result<SubmitPhase> {
    let opened = match stats {
        Some(s) => Some(s.transactions().await?),
        None => None,
    };
    let started = Instant::now();
    let mut latency = latency_histogram()?;
    let mut failed = 0u64;
    // Task id, when its submit was sent, when its answer arrived.
    let mut sent: Vec<(Uuid, Instant, Instant)> = Vec::with_capacity(opts.submits);
    for i in 0..opts.submits {
        let operation = class(i % opts.classes);
        let params = json!({"n": i, "phase": tag});
        let key = format!("{tag}-{i}");
        let at = Instant::now();
        match client.submit(&operation, &params, &key).await {
            Ok(s) if s.status == 201 => {
                let answered = Instant::now();
                record(&mut latency, answered - at);
                sent.push((s.task.id, at, answered));
            }
            _ => failed += 1,
        }
        if opts.pause_ms > 0 {
            tokio::time::sleep(Duration::from_millis(opts.pause_ms)).await;
        }
    }
    let claims = match shared {
        Some(shared) => Some(claim_delays(opts, shared, &sent).await?),
        None => None,
    };
    let tx_per_submit = match (stats, opened, quiet_tx_per_s) {
        (Some(s), Some(o), Some(quiet)) => {
            tokio::time::sleep(opts.settle).await;
            let tx = transactions_since(s, o).await?;
            let beyond = tx - quiet * started.elapsed().as_secs_f64();
            Some(beyond / opts.submits as f64)
        }
        _ => None,
    };
    let ms = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
    Ok(SubmitPhase {
        submits: opts.submits,
        failed,
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        max_ms: latency.max() as f64 / 1000.0,
        tx_per_submit,
        claims,
    })
}

/// Waits until every task of `sent` was claimed, or `wait_ms` + 10 s passed
/// since the last was submitted, and measures the delays.
async fn claim_delays(
    opts: &WaitersOptions,
    shared: &Shared,
    sent: &[(Uuid, Instant, Instant)],
) -> Result<ClaimDelays> {
    let limit = Duration::from_millis(opts.wait_ms) + Duration::from_secs(10);
    let last = Instant::now();
    loop {
        let all = {
            let claimed = shared.claimed();
            sent.iter().all(|(id, _, _)| claimed.contains_key(id))
        };
        if all || last.elapsed() > limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut from_sent = latency_histogram()?;
    let mut from_answer = latency_histogram()?;
    let mut unclaimed = 0;
    {
        let claimed = shared.claimed();
        for (id, at, answered) in sent {
            match claimed.get(id) {
                Some(c) => {
                    record(&mut from_sent, c.saturating_duration_since(*at));
                    record(&mut from_answer, c.saturating_duration_since(*answered));
                }
                None => unclaimed += 1,
            }
        }
    }
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    Ok(ClaimDelays {
        claimed: sent.len() - unclaimed,
        unclaimed,
        p50_ms: ms(&from_sent, 0.5),
        p99_ms: ms(&from_sent, 0.99),
        max_ms: from_sent.max() as f64 / 1000.0,
        after_answer_p50_ms: ms(&from_answer, 0.5),
        after_answer_p99_ms: ms(&from_answer, 0.99),
    })
}

/// Records `d` in µs, within the histogram's bounds.
fn record(h: &mut Histogram<u64>, d: Duration) {
    let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    let _ = h.record(us.clamp(1, MAX_LATENCY_US));
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The bench's configuration has the classes it names, each a valid
    /// class without a params schema, and reads back from its TOML.
    #[test]
    fn the_waiters_configuration_has_its_classes() {
        let c = waiters_config(3).unwrap();
        let names: Vec<&str> = c.operations.keys().map(String::as_str).collect();
        assert_eq!(names, ["bench.wait.0", "bench.wait.1", "bench.wait.2"]);
        assert!(c.operations.values().all(|o| o.params_schema.is_none()));
        let back = Config::from_toml(&c.to_toml().unwrap()).unwrap();
        assert_eq!(back, c);
    }

    fn opts() -> WaitersOptions {
        WaitersOptions {
            store: None,
            waiters: 10,
            classes: 1,
            instances: 1,
            seconds: 1,
            submits: 1,
            pause_ms: 0,
            wait_ms: 30_000,
            settle: STATS_SETTLE,
            idem_bin: PathBuf::from("idem"),
            progress: false,
        }
    }

    /// Options outside their ranges are refused before anything starts.
    #[test]
    fn options_out_of_range_are_refused() {
        assert!(check_options(&opts()).is_ok());
        for bad in [
            WaitersOptions {
                waiters: 0,
                ..opts()
            },
            WaitersOptions {
                classes: 0,
                ..opts()
            },
            WaitersOptions {
                classes: 11,
                ..opts()
            },
            WaitersOptions {
                instances: 3,
                ..opts()
            },
            WaitersOptions {
                wait_ms: 0,
                ..opts()
            },
            WaitersOptions {
                wait_ms: 30_001,
                ..opts()
            },
            WaitersOptions {
                submits: 0,
                ..opts()
            },
            WaitersOptions {
                seconds: 0,
                ..opts()
            },
        ] {
            assert!(check_options(&bad).is_err(), "{bad:?}");
        }
    }
}
