//! `idem-lab fairness`: starvation and cost of fair claims (SPEC §2.13,
//! docs/benchmarks.md "Fair claims").
//!
//! On one store (a temporary SQLite file, or a PostgreSQL database reached
//! through `--instances` connection pools, each standing for one `idem
//! serve` on that database), straight through the store's operations, or,
//! with `--http`, the starvation rounds alone over HTTP against real `idem
//! serve` processes ([`http`]):
//!
//! * starvation: tenant `a` queues `--flood` tasks, then, `--rounds` times,
//!   tenant `b` submits one task while `--claimers` claim loops (spread over
//!   the instances, each claiming one attempt at a time for a pool serving
//!   every tenant, and reporting it `succeeded`) drain `a`; each round
//!   records how many attempts were leased between `b`'s submit and the
//!   lease of `b`'s task. With `--values`, one tenant and two fairness key
//!   values instead of two tenants.
//! * cost (`--tenants 1,10,1000`): claim+report pairs per second of the
//!   claim loops for a pool whose tenants all have work.
//! * aging (`--aging-backlog N`): one tenant, the claim loops at full
//!   capacity on priority-5 tasks whose backlog is kept at `N` (one new
//!   priority-5 task per lease); then one priority-1 task: how long it
//!   waited, beside the queue's own delay (how long the priority-5 task
//!   submitted with it waited, and one submitted 4 × AGING_MS later).
//!   SPEC §2.13 bounds its wait by 4 × AGING_MS plus the later one's.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use idem_core::config::Config;
use idem_core::contract::FrozenContract;
use idem_core::fingerprint::canonical_request;
use idem_core::machine::Report;
use idem_core::model::{AllTenants, ApiKey, Outcome, Role, Serves};
use idem_store::Store;
use idem_store::flow::ClaimFlow;
use idem_store::ops::{ClaimRequest, Submission, SubmitOutcome};
use serde_json::json;
use uuid::Uuid;

pub mod http;

/// The class the runs use (the bundled configuration's safe class).
const CLASS: &str = "generation.dispatch";

/// What to run.
#[derive(Debug, Clone)]
pub struct FairnessOptions {
    /// `None`: a temporary SQLite store; `sqlite://path`; or a PostgreSQL URL.
    pub store: Option<String>,
    /// Connection pools on the one database (PostgreSQL only).
    pub instances: usize,
    /// Claim loops, spread over the instances.
    pub claimers: usize,
    /// Tasks of the flooding tenant (or value).
    pub flood: usize,
    /// Rounds of the single task.
    pub rounds: usize,
    /// Two fairness key values of one tenant instead of two tenants.
    pub values: bool,
    /// Tenant counts of the cost runs (empty: none).
    pub tenants: Vec<usize>,
    /// Seconds per cost run.
    pub seconds: u64,
    /// Tasks queued for a cost run, spread over its tenants (at least 20 each).
    pub cost_tasks: usize,
    /// The cost runs' pool serves every tenant (`Serves::All`) rather than
    /// the run's tenants by name; refused with more than one cost run, whose
    /// tasks would then be served by the next.
    pub pool_serves_all: bool,
    /// Priority-5 backlog of the aging run (0: no aging run).
    pub aging_backlog: usize,
    /// `Some`: the starvation rounds over HTTP against `idem serve`
    /// processes of this `idem` binary, one per instance (one on SQLite),
    /// instead of the store's operations in this process; no cost or aging
    /// run.
    pub idem_bin: Option<PathBuf>,
}

/// The figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FairnessReport {
    /// Leases between the single task's submit and its lease, per round.
    pub leases_before: Vec<u64>,
    /// Claim+report pairs per second by number of tenants with work.
    pub cost: Vec<(usize, f64)>,
    /// The aging run.
    pub aging: Option<Aging>,
}

/// Runs the starvation rounds, then the cost runs.
///
/// # Errors
/// Store failures; a round whose task is not leased within [`ROUND_LIMIT`];
/// with [`FairnessOptions::idem_bin`], a cost or aging run asked for, or
/// what [`http::starvation`] returns.
pub async fn run(o: FairnessOptions) -> Result<FairnessReport> {
    let o = &o;
    if o.pool_serves_all && o.tenants.len() > 1 {
        bail!(
            "--pool-serves-all takes one --tenants value: a pool serving every tenant would serve \
             the tasks an earlier cost run left"
        );
    }
    if let Some(bin) = &o.idem_bin {
        if !o.tenants.is_empty() || o.aging_backlog > 0 {
            bail!(
                "--http runs the starvation rounds only; --tenants and --aging-backlog run without it"
            );
        }
        return Ok(FairnessReport {
            leases_before: http::starvation(o, bin).await?,
            cost: Vec::new(),
            aging: None,
        });
    }
    let (first, _dir, _path) = crate::server::open_store(o.store.as_deref()).await?;
    let mut stores = vec![first.clone()];
    if let Some(url) = o.store.as_deref().filter(|u| !u.starts_with("sqlite://")) {
        for _ in 1..o.instances.max(1) {
            stores.push(
                idem_store_postgres::connect(url, idem_store_postgres::PgOptions::default())
                    .await
                    .context("connecting to PostgreSQL")?,
            );
        }
    }
    let config = Config::bundled()?;
    let contract = FrozenContract::new(
        config
            .contract(CLASS)
            .context("the bundled configuration has no generation.dispatch")?,
    )?;
    let leases_before = if o.rounds > 0 {
        starvation(&stores, &contract, o).await?
    } else {
        Vec::new()
    };
    let mut cost = Vec::new();
    for &n in &o.tenants {
        cost.push((n, pairs_per_second(&stores, &contract, n, o).await?));
    }
    let aging = if o.aging_backlog > 0 {
        Some(aging(&stores, &contract, o).await?)
    } else {
        None
    };
    Ok(FairnessReport {
        leases_before,
        cost,
        aging,
    })
}

/// The report as lines of text: the rounds (median, max, each), the cost
/// runs, the aging run.
pub fn render(r: &FairnessReport) -> String {
    let mut sorted = r.leases_before.clone();
    sorted.sort_unstable();
    let max = sorted.last().copied().unwrap_or(0);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0);
    let mut out = format!(
        "leases between the single task's submit and its lease over {} rounds: median {median}, max {max}; each: {:?}\n",
        sorted.len(),
        r.leases_before
    );
    for (n, rate) in &r.cost {
        out += &format!("{n} tenants with work: {rate:.0} claim+report pairs/s\n");
    }
    if let Some(a) = r.aging {
        out += &format!(
            "aging: the priority-1 task waited {} ms; priority-5 tasks waited {} ms (submitted with it) and {} ms (submitted {} ms later); bound: {} ms\n",
            a.priority_1_ms,
            a.priority_5_ms,
            a.later_priority_5_ms,
            a.later_submitted_ms,
            a.later_submitted_ms + a.later_priority_5_ms
        );
    }
    out
}

fn flow(values: bool) -> ClaimFlow {
    ClaimFlow {
        serves: Some(Serves::All(AllTenants::All)),
        fair_classes: if values {
            vec![CLASS.to_owned()]
        } else {
            Vec::new()
        },
        ..ClaimFlow::default()
    }
}

async fn client(store: &Store, tenant: &str) -> Result<ApiKey> {
    Ok(store.create_api_key(tenant, Role::Client, None).await?.0)
}

fn submission(
    key: &ApiKey,
    contract: &FrozenContract,
    n: u64,
    value: Option<&str>,
) -> Result<Submission> {
    prioritised(key, contract, n, value, 3)
}

fn prioritised(
    key: &ApiKey,
    contract: &FrozenContract,
    n: u64,
    value: Option<&str>,
    priority: i64,
) -> Result<Submission> {
    let params = json!({"prompt": format!("fair {n}"), "steps": n});
    let canonical = canonical_request(CLASS, &params, &[])?;
    Ok(Submission {
        tenant: key.tenant.clone(),
        operation: CLASS.to_owned(),
        idempotency_key: format!("fair-{}", Uuid::new_v4()),
        fingerprint: canonical.fingerprint.to_string(),
        canonical_request: canonical.canonical,
        params,
        contract: contract.clone(),
        api_key_id: key.id,
        grant: None,
        traceparent: None,
        priority,
        fairness_key: value.map(str::to_owned),
        rate_limits: Vec::new(),
        concurrency_key: None,
    })
}

/// Queues `n` tasks of `key` (with fairness key `value`) in batches.
async fn fill(
    store: &Store,
    key: &ApiKey,
    contract: &FrozenContract,
    n: usize,
    value: Option<&str>,
) -> Result<()> {
    let mut left = n;
    let mut i = 0u64;
    while left > 0 {
        let batch = left.min(500);
        let subs = (0..batch)
            .map(|_| {
                i += 1;
                submission(key, contract, i, value)
            })
            .collect::<Result<Vec<_>>>()?;
        store.submit_batch(subs).await?;
        left -= batch;
    }
    Ok(())
}

/// How long a round waits for the single task's lease before the run fails.
const ROUND_LIMIT: Duration = Duration::from_secs(10);

/// What the claim loops count: leases, and the watched task of the round
/// under way (shared by the in-process and the HTTP runs).
#[derive(Debug, Default)]
struct Tally {
    /// Leases so far, counted as the claim answers arrive.
    leased: AtomicU64,
    /// The round's single task, once it is submitted.
    watched: std::sync::Mutex<Option<Watched>>,
}

/// The watched task of a round.
#[derive(Debug)]
struct Watched {
    /// Its idempotency key.
    key: String,
    /// [`Tally::leased`] when it was submitted.
    at: u64,
    /// Leases between its submit and its own lease, once leased.
    before: Option<u64>,
}

impl Tally {
    /// Leases counted so far.
    fn leased(&self) -> u64 {
        self.leased.load(Ordering::SeqCst)
    }

    /// Counts one lease, of the task whose idempotency key is `key`.
    fn lease(&self, key: &str) {
        let count = self.leased.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(w) = self.watched().as_mut()
            && w.key == key
            && w.before.is_none()
        {
            w.before = Some(count - w.at - 1);
        }
    }

    fn watched(&self) -> std::sync::MutexGuard<'_, Option<Watched>> {
        self.watched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Watches `key` from the current lease count.
    fn watch(&self, key: String) {
        *self.watched() = Some(Watched {
            key,
            at: self.leased(),
            before: None,
        });
    }

    /// Leases before the watched task's own, once it is leased.
    fn before(&self) -> Option<u64> {
        self.watched().as_ref().and_then(|w| w.before)
    }
}

/// The starvation rounds, while claim loops count leases in `tally`:
/// `rounds` times, a new idempotency key is watched, `submit(round, key)`
/// submits the single task under it, and the round waits for its lease.
/// Returns the leases before it, per round.
///
/// # Errors
/// What `submit` returns; a task not leased within [`ROUND_LIMIT`].
async fn rounds(
    tally: &Tally,
    rounds: usize,
    mut submit: impl AsyncFnMut(usize, &str) -> Result<()>,
) -> Result<Vec<u64>> {
    let mut out = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let key = format!("fair-single-{}", Uuid::new_v4());
        // Watched from before the submit: a claim may lease it before the
        // submit's answer is back.
        tally.watch(key.clone());
        submit(round, &key).await?;
        let deadline = Instant::now() + ROUND_LIMIT;
        loop {
            if let Some(n) = tally.before() {
                out.push(n);
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "round {round}: the single task was not leased within {} s",
                    ROUND_LIMIT.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    Ok(out)
}

/// Claim loops until `stop`: each claims one attempt for the pool and
/// reports it, counting each lease in `tally`.
fn claim_loops(
    stores: &[Store],
    claimers: usize,
    tenant: &str,
    flow: &ClaimFlow,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<Result<()>>> {
    (0..claimers)
        .map(|i| {
            let store = stores[i % stores.len()].clone();
            let (stop, tally) = (stop.clone(), tally.clone());
            let flow = flow.clone();
            let tenant = tenant.to_owned();
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let got = store
                        .claim(ClaimRequest {
                            tenant: tenant.clone(),
                            operations: vec![CLASS.into()],
                            executor_id: format!("fair-{i}"),
                            max: 1,
                            lease_ms: Some(60_000),
                            flow: flow.clone(),
                        })
                        .await?;
                    if got.is_empty() {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        continue;
                    }
                    for c in got {
                        tally.lease(&c.task.idempotency_key);
                        let report = Report {
                            generation: c.attempt.generation,
                            outcome: Outcome::Succeeded,
                            result: None,
                            failure_class: None,
                            message: None,
                            usage: None,
                            external_txn_id: None,
                            body: json!({"generation": c.attempt.generation, "outcome": "succeeded"}),
                        };
                        let _ = store
                            .report(&c.task.control.tenant, c.attempt.id, report)
                            .await?;
                    }
                }
                Ok(())
            })
        })
        .collect()
}

/// Stops `loops` and waits for them: the first loop's error, else `out`.
async fn stopped<T>(
    stop: &AtomicBool,
    loops: Vec<tokio::task::JoinHandle<Result<()>>>,
    out: Result<T>,
) -> Result<T> {
    stop.store(true, Ordering::SeqCst);
    for l in loops {
        l.await??;
    }
    out
}

async fn starvation(
    stores: &[Store],
    contract: &FrozenContract,
    o: &FairnessOptions,
) -> Result<Vec<u64>> {
    let store = &stores[0];
    let run = Uuid::new_v4().simple().to_string();
    let a = client(store, &format!("a-{}", &run[..8])).await?;
    let b = if o.values {
        a.clone()
    } else {
        client(store, &format!("b-{}", &run[..8])).await?
    };
    let (va, vb) = if o.values {
        (Some("value-a"), Some("value-b"))
    } else {
        (None, None)
    };
    fill(store, &a, contract, o.flood, va).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let loops = claim_loops(
        stores,
        o.claimers.max(1),
        "pool",
        &flow(o.values),
        stop.clone(),
        tally.clone(),
    );
    let out = rounds(&tally, o.rounds, async |round, key| {
        let mut s = submission(&b, contract, 1_000_000 + round as u64, vb)?;
        s.idempotency_key = key.to_owned();
        if !matches!(store.submit(s).await?, SubmitOutcome::Created(_)) {
            bail!("the single task was not created");
        }
        Ok(())
    })
    .await;
    stopped(&stop, loops, out).await
}

async fn pairs_per_second(
    stores: &[Store],
    contract: &FrozenContract,
    tenants: usize,
    o: &FairnessOptions,
) -> Result<f64> {
    let store = &stores[0];
    let run = Uuid::new_v4().simple().to_string();
    // Enough work that no tenant runs dry during the run; the pool serves
    // this run's tenants only (what earlier runs left is not theirs).
    // 0 tenants: one tenant claimed by its own (ordinary) key, no turns.
    let per = (o.cost_tasks / tenants.max(1)).max(20);
    let mut list = Vec::new();
    for t in 0..tenants.max(1) {
        let key = client(store, &format!("cost-{}-{t}", &run[..8])).await?;
        fill(store, &key, contract, per, None).await?;
        list.push(key.tenant);
    }
    let claimer = if tenants == 0 {
        list[0].clone()
    } else {
        "pool".to_owned()
    };
    let served = ClaimFlow {
        serves: (tenants > 0).then_some(if o.pool_serves_all {
            Serves::All(AllTenants::All)
        } else {
            Serves::Tenants(list)
        }),
        ..ClaimFlow::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let loops = claim_loops(
        stores,
        o.claimers.max(1),
        &claimer,
        &served,
        stop.clone(),
        tally.clone(),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let from = tally.leased();
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(o.seconds.max(1))).await;
    let done = tally.leased() - from;
    let rate = done as f64 / start.elapsed().as_secs_f64();
    stopped(&stop, loops, Ok(rate)).await
}

/// The waits of the aging run, ms from each task's submit to its lease.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Aging {
    /// The priority-1 task.
    pub priority_1_ms: u64,
    /// The priority-5 task submitted with it: the queue's delay then.
    pub priority_5_ms: u64,
    /// When a priority-5 task was submitted after them, ms after their
    /// submit: 4 × AGING_MS, or a poll (20 ms) more.
    pub later_submitted_ms: u64,
    /// That task's wait: the queue's delay when the priority-1 task's rank
    /// comes up. SPEC §2.13: the priority-1 task is leased before it, so it
    /// waits at most `later_submitted_ms` plus this.
    pub later_priority_5_ms: u64,
}

/// The aging run (see the module doc): the priority-1 task's wait and the
/// wait of the priority-5 task submitted with it, ms.
async fn aging(stores: &[Store], contract: &FrozenContract, o: &FairnessOptions) -> Result<Aging> {
    let store = &stores[0];
    let run = Uuid::new_v4().simple().to_string();
    let key = client(store, &format!("aging-{}", &run[..8])).await?;
    let mut n = 0u64;
    let mut p5 = Vec::with_capacity(o.aging_backlog);
    for _ in 0..o.aging_backlog {
        n += 1;
        p5.push(prioritised(&key, contract, n, None, 5)?);
    }
    store.submit_batch(p5).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let loops = claim_loops(
        stores,
        o.claimers.max(1),
        &key.tenant,
        &ClaimFlow::default(),
        stop.clone(),
        tally.clone(),
    );
    // Full capacity: one new priority-5 task per lease keeps the backlog.
    let mut topped = 0u64;
    let top_up = async |n: &mut u64, topped: &mut u64| -> Result<()> {
        let now = tally.leased();
        let batch: Vec<Submission> = (*topped..now)
            .map(|_| {
                *n += 1;
                prioritised(&key, contract, *n, None, 5)
            })
            .collect::<Result<_>>()?;
        *topped = now;
        if !batch.is_empty() {
            store.submit_batch(batch).await?;
        }
        Ok(())
    };
    let warm = Instant::now() + Duration::from_secs(3);
    while Instant::now() < warm {
        top_up(&mut n, &mut topped).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The priority-1 task and a priority-5 task, submitted together.
    let low = prioritised(&key, contract, 9_000_001, None, 1)?;
    let high = prioritised(&key, contract, 9_000_002, None, 5)?;
    let (low_key, high_key) = (low.idempotency_key.clone(), high.idempotency_key.clone());
    let sent = Instant::now();
    store.submit_batch(vec![low, high]).await?;
    // The priority-5 task submitted 4 × AGING_MS later ranks right after
    // the priority-1 task: the queue's delay then is the bound's.
    let later_due = sent + Duration::from_millis(4 * idem_store::flow::AGING_MS.unsigned_abs());
    let mut later: Option<(String, Instant)> = None;
    let (mut low_at, mut high_at, mut later_at) = (None, None, None);
    let deadline = sent + Duration::from_secs(600);
    while low_at.is_none() || high_at.is_none() || later_at.is_none() {
        if Instant::now() > deadline {
            stop.store(true, Ordering::SeqCst);
            bail!("the aging run's tasks were not leased within 600 s");
        }
        top_up(&mut n, &mut topped).await?;
        if later.is_none() && Instant::now() >= later_due {
            let s = prioritised(&key, contract, 9_000_003, None, 5)?;
            let k = s.idempotency_key.clone();
            let at = Instant::now();
            store.submit_batch(vec![s]).await?;
            later = Some((k, at));
        }
        for (k, from, at) in [
            (Some(&low_key), Some(sent), &mut low_at),
            (Some(&high_key), Some(sent), &mut high_at),
            (
                later.as_ref().map(|l| &l.0),
                later.as_ref().map(|l| l.1),
                &mut later_at,
            ),
        ] {
            if let (Some(k), Some(from)) = (k, from)
                && at.is_none()
                && let Ok(t) = store.find_task(&key.tenant, CLASS, k).await?
                && t.attempt_count > 0
            {
                *at = Some(from.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ms = |d: Option<Duration>| d.map_or(0, |d| d.as_millis() as u64);
    let figures = Aging {
        priority_1_ms: ms(low_at),
        priority_5_ms: ms(high_at),
        later_submitted_ms: ms(later.map(|(_, at)| at.duration_since(sent))),
        later_priority_5_ms: ms(later_at),
    };
    stopped(&stop, loops, Ok(figures)).await
}
