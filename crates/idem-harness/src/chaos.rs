//! `idem chaos`: a seeded, reproducible fault-injection run against real
//! `idem serve` processes, followed by a checker of the invariants of SPEC §2.
//!
//! What the seed fixes (the [`Plan`], identical for the same seed, operation
//! count and store kind):
//!
//! - clients: which operation class and idempotency key each operation uses
//!   (keys come from a small key space, so replays and conflicts happen), which
//!   first try runs into a tiny client timeout and is retried with the same key,
//!   which retries change a material field (must get 422 and never be paid), how
//!   many replays follow, and which operations cancel after how long;
//! - executors: per scope and per execute / reconcile attempt ordinal, whether
//!   the executor heartbeats, crashes before or after the effect, reports
//!   `unknown` (with or without the effect), fails `transient` or
//!   `invalid_input`, reports late after its lease ran out (must get 409
//!   `STALE_GENERATION`), or repeats its report and then sends a different one;
//! - servers: after which operation a server process is killed with SIGKILL
//!   (and restarted on the same store, on a new port), and — with PostgreSQL —
//!   when the idem connections are terminated with `pg_terminate_backend`.
//!
//! Which attempt meets which executor, and the exact interleaving, are left to
//! real concurrency; `faults_realized` reports what actually happened.
//!
//! The executors pay at an in-memory provider that is itself idempotent by task
//! id and answers lookups for reconciliation. An executor only moves money
//! within the first part of its lease and never after it reported, so every
//! payout is visible to any later reconciliation: a second pay request for a
//! non-safe task therefore means idem repeated an effect without reconciling.
//!
//! Afterwards faults stop, executors run until every task is terminal, and the
//! checker reads every task of the run's tenant (ids from the database, records
//! over HTTP) and verifies SPEC §2 against the event histories, the attempts
//! with their evidence, the clients' log of answers and the provider's ledger.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use idem_client::{
    Attempt, AttemptKind, AttemptState, CancelStatus, ClaimedAttempt, Client, ClientError, Event,
    FailureClass, HeartbeatAck, ReportBody, Task, TaskState,
};
use idem_core::config::{Config, ConfigError, DEFAULT_TOML};
use idem_core::model::Role;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::server;

/// Lease every executor asks for, ms.
pub const LEASE_MS: u64 = 800;

/// An executor only performs the effect this soon after it sent its claim, so
/// that the effect is committed before the lease can possibly expire.
const EFFECT_WITHIN: Duration = Duration::from_millis(300);

/// A late report is sent this long after the lease ran out.
const LATE_MARGIN: Duration = Duration::from_millis(150);

/// Per-request time limit of clients and executors.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a client keeps retrying one submission (same key) before it looks the scope up.
const CLIENT_PATIENCE: Duration = Duration::from_secs(30);

/// How long an executor keeps retrying one report through outages.
const REPORT_PATIENCE: Duration = Duration::from_secs(30);

/// How long the run waits for every task to become terminal after the faults stopped.
const QUIESCE_LIMIT: Duration = Duration::from_secs(120);

/// Attempts handled at once by all executors together.
const MAX_INFLIGHT: usize = 512;

/// How `idem chaos` changes the bundled classes for its servers: short leases
/// and backoffs, long windows (no key is removed during a run), one more
/// attempt for payouts. Environment-override form (`IDEM_OPERATIONS__…`).
pub const CHAOS_OVERRIDES: &[(&str, &str)] = &[
    ("IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__MAX_ATTEMPTS", "4"),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS",
        "20",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS",
        "200",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__DEADLINE_MS",
        "1800000",
    ),
    ("IDEM_OPERATIONS__PAYMENT_RELEASE__LEASE__DEFAULT_MS", "800"),
    ("IDEM_OPERATIONS__PAYMENT_RELEASE__LEASE__MAX_MS", "10000"),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__WINDOWS__REQUEST_RETRY_MS",
        "3600000",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__WINDOWS__RECONCILIATION_MS",
        "3600000",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__WINDOWS__RETENTION_MS",
        "10800000",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__INITIAL_MS",
        "20",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__MAX_MS",
        "200",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__DEADLINE_MS",
        "1800000",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__LEASE__DEFAULT_MS",
        "800",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__LEASE__MAX_MS",
        "10000",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__WINDOWS__RETENTION_MS",
        "10800000",
    ),
];

/// The configuration of `idem chaos`'s servers: the bundled classes with
/// [`CHAOS_OVERRIDES`].
///
/// # Errors
/// A [`ConfigError`] if the overrides no longer fit the
/// bundled configuration.
pub fn chaos_config() -> Result<Config, ConfigError> {
    Config::from_toml_with_env(
        DEFAULT_TOML,
        CHAOS_OVERRIDES
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    )
}

// ---------------------------------------------------------------------------
// The plan: everything the seed decides
// ---------------------------------------------------------------------------

/// The operation classes a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// `payment.release`: not safe to repeat; unknown outcomes are reconciled.
    Payment,
    /// `generation.dispatch`: safe to repeat.
    Generation,
}

impl Class {
    /// The operation class name.
    pub fn operation(self) -> &'static str {
        match self {
            Class::Payment => "payment.release",
            Class::Generation => "generation.dispatch",
        }
    }

    /// The class of an operation name.
    pub fn from_operation(op: &str) -> Option<Class> {
        match op {
            "payment.release" => Some(Class::Payment),
            "generation.dispatch" => Some(Class::Generation),
            _ => None,
        }
    }

    /// Whether the class is declared safe to repeat.
    pub fn is_safe(self) -> bool {
        self == Class::Generation
    }

    /// The material fields of `params` (what the fingerprint covers).
    pub fn material(self, params: &Value) -> Value {
        match self {
            Class::Payment => json!({
                "payee": params.get("payee"),
                "amount": params.get("amount"),
                "currency": params.get("currency"),
            }),
            Class::Generation => params.clone(),
        }
    }

    /// The request of operation `op` for `key`, with `change` added to a
    /// material field (0: the scope's usual request).
    pub fn params(self, key: u32, change: u32, op: usize) -> Value {
        let k = u64::from(key);
        match self {
            Class::Payment => json!({
                "payee": format!("acct-{}", k % 97),
                "amount": 100 + (k * 37) % 5000 + u64::from(change),
                "currency": "EUR",
                // Not material: differs between operations, replays all the same.
                "memo": format!("op-{op}"),
            }),
            Class::Generation => json!({
                "prompt": format!("frame {k}"),
                "steps": 20 + k % 10 + u64::from(change),
            }),
        }
    }
}

/// One client operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpPlan {
    /// Operation class.
    pub class: Class,
    /// Idempotency key number (the key is `k<n>`).
    pub key: u32,
    /// A changed material field (`Some(delta)`): the request must be refused with 422.
    pub changed: Option<u32>,
    /// The first try uses this tiny client timeout (ms) and is retried with the same key.
    pub first_timeout_ms: Option<u64>,
    /// Replays of the same request after the answer.
    pub replays: u8,
    /// Pause before each replay, ms.
    pub replay_delay_ms: u64,
    /// Cancel this long after the answer, ms.
    pub cancel_after_ms: Option<u64>,
}

impl OpPlan {
    /// The idempotency key.
    pub fn key_string(&self) -> String {
        format!("k{}", self.key)
    }
}

/// What an executor does with one execute attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecFault {
    /// Perform the effect and report `succeeded`.
    Clean,
    /// Crash before the effect (no report).
    CrashBeforeEffect,
    /// Perform the effect, then crash (no report).
    CrashAfterEffect,
    /// Perform the effect, then report `unknown`.
    UnknownAfterEffect,
    /// Report `unknown` without performing the effect.
    UnknownWithoutEffect,
    /// Report `failed` / `transient` without performing the effect.
    Transient,
    /// Report `failed` / `invalid_input` without performing the effect.
    Permanent,
    /// Perform the effect, sleep past the lease, then report `succeeded` (must be refused).
    LateReport,
    /// Report `succeeded`, repeat it exactly, then send a different outcome (must be refused).
    DuplicateReport,
}

impl ExecFault {
    /// Name of the fault kind in `faults`.
    pub fn name(self) -> &'static str {
        match self {
            ExecFault::Clean => "clean",
            ExecFault::CrashBeforeEffect => "executor_crash_before_effect",
            ExecFault::CrashAfterEffect => "executor_crash_after_effect",
            ExecFault::UnknownAfterEffect => "outcome_unknown_after_effect",
            ExecFault::UnknownWithoutEffect => "outcome_unknown_without_effect",
            ExecFault::Transient => "transient_failure",
            ExecFault::Permanent => "invalid_input_failure",
            ExecFault::LateReport => "stale_late_report",
            ExecFault::DuplicateReport => "duplicate_report",
        }
    }
}

/// What an executor does with one reconcile attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconFault {
    /// Look the effect up and report `committed` / `not_committed`.
    Clean,
    /// Crash (no report).
    Crash,
    /// Report `failed` / `transient`.
    Transient,
    /// Report `unknown`.
    Unknown,
    /// Look up, sleep past the lease, then report (must be refused).
    LateReport,
}

impl ReconFault {
    /// Name of the fault kind in `faults`.
    pub fn name(self) -> &'static str {
        match self {
            ReconFault::Clean => "clean",
            ReconFault::Crash => "reconcile_crash",
            ReconFault::Transient => "reconcile_transient_failure",
            ReconFault::Unknown => "reconcile_unknown",
            ReconFault::LateReport => "reconcile_stale_late_report",
        }
    }
}

/// One execute attempt's behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecStep {
    /// The fault.
    pub fault: ExecFault,
    /// Heartbeat (with half the usage) before the effect; a pending cancel is obeyed.
    pub heartbeat: bool,
    /// Usage units the attempt reports.
    pub usage: i64,
}

impl ExecStep {
    const CLEAN: ExecStep = ExecStep {
        fault: ExecFault::Clean,
        heartbeat: false,
        usage: 1,
    };
}

/// The executor behaviour for one scope: by ordinal of execute and of
/// reconcile attempts; attempts beyond the script behave cleanly.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Script {
    /// Execute attempts 1, 2, 3 …
    pub exec: Vec<ExecStep>,
    /// Reconcile attempts 1, 2 …
    pub recon: Vec<ReconFault>,
}

/// A fault injected into the infrastructure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerFault {
    /// SIGKILL server process `server`, then restart it on the same store.
    Kill {
        /// Index of the server process.
        server: usize,
    },
    /// Terminate every PostgreSQL connection of the idem processes.
    PgTerminate,
}

/// Everything a seed decides. Equal seeds (with equal `ops` and store kind) give equal plans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The seed.
    pub seed: u64,
    /// Server processes (1 on SQLite, 2 on PostgreSQL).
    pub servers: usize,
    /// Client operations, in dispatch order.
    pub ops: Vec<OpPlan>,
    /// Executor behaviour per scope used by `ops`.
    pub scripts: BTreeMap<(Class, u32), Script>,
    /// `(operation index, fault)`: the fault is injected when that operation is dispatched.
    pub server_faults: Vec<(usize, ServerFault)>,
}

fn weighted<T: Copy>(rng: &mut StdRng, table: &[(T, u32)]) -> T {
    let total: u32 = table.iter().map(|(_, w)| *w).sum();
    let mut x = rng.random_range(0..total.max(1));
    for (v, w) in table {
        if x < *w {
            return *v;
        }
        x -= *w;
    }
    table[0].0
}

const FIRST_EXEC: &[(ExecFault, u32)] = &[
    (ExecFault::Clean, 46),
    (ExecFault::CrashBeforeEffect, 6),
    (ExecFault::CrashAfterEffect, 8),
    (ExecFault::UnknownAfterEffect, 7),
    (ExecFault::UnknownWithoutEffect, 4),
    (ExecFault::Transient, 8),
    (ExecFault::Permanent, 2),
    (ExecFault::LateReport, 11),
    (ExecFault::DuplicateReport, 8),
];

const LATER_EXEC: &[(ExecFault, u32)] = &[
    (ExecFault::Clean, 70),
    (ExecFault::CrashBeforeEffect, 4),
    (ExecFault::CrashAfterEffect, 5),
    (ExecFault::UnknownAfterEffect, 5),
    (ExecFault::UnknownWithoutEffect, 2),
    (ExecFault::Transient, 5),
    (ExecFault::Permanent, 1),
    (ExecFault::LateReport, 5),
    (ExecFault::DuplicateReport, 3),
];

const RECON: &[(ReconFault, u32)] = &[
    (ReconFault::Clean, 60),
    (ReconFault::Crash, 12),
    (ReconFault::Transient, 10),
    (ReconFault::Unknown, 8),
    (ReconFault::LateReport, 10),
];

impl Plan {
    /// The plan of `seed` for `ops` operations on SQLite (`postgres: false`) or PostgreSQL.
    pub fn new(seed: u64, ops: usize, postgres: bool) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let keyspace = u32::try_from((ops / 4).max(8)).unwrap_or(u32::MAX);
        let mut plan_ops = Vec::with_capacity(ops);
        for _ in 0..ops {
            let class = if rng.random_bool(0.8) {
                Class::Payment
            } else {
                Class::Generation
            };
            let key = rng.random_range(0..keyspace);
            let changed = rng.random_bool(0.07).then(|| rng.random_range(1..=9));
            let first_timeout_ms = rng.random_bool(0.08).then(|| rng.random_range(1..=15));
            let replays = weighted(&mut rng, &[(0u8, 55), (1, 30), (2, 15)]);
            let replay_delay_ms = rng.random_range(0..200);
            // Half of the cancels race the first attempt, half come later.
            let cancel_after_ms = rng.random_bool(0.12).then(|| {
                if rng.random_bool(0.5) {
                    rng.random_range(0..15)
                } else {
                    rng.random_range(15..400)
                }
            });
            plan_ops.push(OpPlan {
                class,
                key,
                changed,
                first_timeout_ms,
                replays,
                replay_delay_ms,
                cancel_after_ms,
            });
        }
        let scopes: BTreeSet<(Class, u32)> = plan_ops.iter().map(|o| (o.class, o.key)).collect();
        let mut scripts = BTreeMap::new();
        for scope in scopes {
            let exec = (0..3)
                .map(|i| ExecStep {
                    fault: weighted(&mut rng, if i == 0 { FIRST_EXEC } else { LATER_EXEC }),
                    heartbeat: rng.random_bool(0.5),
                    usage: rng.random_range(1..=20),
                })
                .collect();
            let recon = (0..2).map(|_| weighted(&mut rng, RECON)).collect();
            scripts.insert(scope, Script { exec, recon });
        }
        let servers = if postgres { 2 } else { 1 };
        let lo = ops / 20;
        let hi = (ops * 9 / 10).max(lo + 1);
        let mut server_faults = Vec::new();
        for _ in 0..(ops / 400).max(3) {
            let at = rng.random_range(lo..hi);
            let server = rng.random_range(0..servers);
            server_faults.push((at, ServerFault::Kill { server }));
        }
        if postgres {
            for _ in 0..(ops / 300).max(3) {
                server_faults.push((rng.random_range(lo..hi), ServerFault::PgTerminate));
            }
        }
        server_faults.sort_by_key(|(at, _)| *at);
        Plan {
            seed,
            servers,
            ops: plan_ops,
            scripts,
            server_faults,
        }
    }

    /// Injected faults by kind, as planned (identical for identical plans).
    pub fn fault_counts(&self) -> BTreeMap<String, u64> {
        let mut m: BTreeMap<String, u64> = BTreeMap::new();
        let mut add = |k: &str, n: u64| {
            if n > 0 {
                *m.entry(k.to_owned()).or_default() += n;
            }
        };
        for op in &self.ops {
            add("client_timeout", u64::from(op.first_timeout_ms.is_some()));
            add("changed_payload", u64::from(op.changed.is_some()));
            add("retry_same_key", u64::from(op.replays));
            add("cancel", u64::from(op.cancel_after_ms.is_some()));
        }
        for s in self.scripts.values() {
            for step in &s.exec {
                if step.fault != ExecFault::Clean {
                    add(step.fault.name(), 1);
                }
            }
            for r in &s.recon {
                if *r != ReconFault::Clean {
                    add(r.name(), 1);
                }
            }
        }
        for (_, f) in &self.server_faults {
            match f {
                ServerFault::Kill { .. } => add("server_sigkill", 1),
                ServerFault::PgTerminate => add("pg_terminate_backend", 1),
            }
        }
        m
    }
}

// ---------------------------------------------------------------------------
// The external provider with its own idempotent ledger
// ---------------------------------------------------------------------------

/// An effect the provider performed (a payout, or a rendered job).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Effect {
    /// The provider's idempotency key: the task id.
    pub task_id: Uuid,
    /// The attempt whose executor performed it.
    pub attempt_id: Uuid,
    /// Operation class.
    pub class: Class,
    /// The material fields the provider acted on.
    pub material: Value,
    /// The provider's transaction id.
    pub txn: String,
}

/// One request to perform an effect.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EffectRequest {
    /// Task id (idempotency key).
    pub task_id: Uuid,
    /// Requesting attempt.
    pub attempt_id: Uuid,
    /// Whether this request moved money (false: the ledger already had it).
    pub moved: bool,
}

#[derive(Debug, Default)]
struct Ledger {
    effects: HashMap<Uuid, Effect>,
    requests: Vec<EffectRequest>,
    lookups: u64,
}

/// The provider: performs an effect at most once per task id, answers lookups.
#[derive(Debug, Clone, Default)]
pub struct Provider(Arc<Mutex<Ledger>>);

impl Provider {
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Performs the effect of `params` for `task_id` once; a repeat returns the recorded one.
    pub fn perform(&self, task_id: Uuid, attempt_id: Uuid, class: Class, params: &Value) -> Effect {
        let mut l = self.ledger();
        if let Some(e) = l.effects.get(&task_id).cloned() {
            l.requests.push(EffectRequest {
                task_id,
                attempt_id,
                moved: false,
            });
            return e;
        }
        let prefix = if class == Class::Payment {
            "pay"
        } else {
            "gen"
        };
        let e = Effect {
            task_id,
            attempt_id,
            class,
            material: class.material(params),
            txn: format!("{prefix}-{}", l.effects.len() + 1),
        };
        l.effects.insert(task_id, e.clone());
        l.requests.push(EffectRequest {
            task_id,
            attempt_id,
            moved: true,
        });
        e
    }

    /// What the provider knows about `task_id` (for reconcile attempts).
    pub fn lookup(&self, task_id: Uuid) -> Option<Effect> {
        let mut l = self.ledger();
        l.lookups += 1;
        l.effects.get(&task_id).cloned()
    }

    fn snapshot(&self) -> (Vec<Effect>, Vec<EffectRequest>, u64) {
        let l = self.ledger();
        let mut effects: Vec<Effect> = l.effects.values().cloned().collect();
        effects.sort_by_key(|e| e.task_id);
        (effects, l.requests.clone(), l.lookups)
    }
}

fn effect_result(e: &Effect) -> Value {
    let status = if e.class == Class::Payment {
        "paid"
    } else {
        "rendered"
    };
    json!({"status": status, "txn": e.txn, "material": e.material})
}

// ---------------------------------------------------------------------------
// What clients and executors saw
// ---------------------------------------------------------------------------

/// A delivery as a replay answer showed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliverySeen {
    /// External transaction id.
    pub external_txn_id: Option<String>,
    /// Charge.
    pub charge: i64,
    /// When it was delivered.
    pub delivered_at: String,
}

/// The final answer a client got for one submission (after its retries).
#[derive(Debug, Clone, PartialEq)]
pub enum SubmitAnswer {
    /// 201 (new or replay), or the task found by a scope lookup.
    Accepted {
        /// Task id.
        task_id: Uuid,
        /// Marked as a replay.
        replayed: bool,
        /// Found by `GET /v1/tasks?operation=&idempotency_key=` after the retries.
        looked_up: bool,
        /// Material fields of the task's params as answered.
        material: Value,
        /// The task's fingerprint as answered.
        fingerprint: String,
        /// The delivery, if the answer carried one.
        delivery: Option<DeliverySeen>,
    },
    /// 422 `IDEMPOTENCY_CONFLICT`.
    Conflict {
        /// The original task the problem names.
        task_id: Option<Uuid>,
    },
    /// Another error status.
    Refused {
        /// HTTP status.
        status: u16,
        /// Problem code.
        code: String,
    },
    /// No answer within the client's patience, and no task under the scope.
    NoAnswer,
}

/// One submission by a client.
#[derive(Debug, Clone, PartialEq)]
pub struct SubmitRecord {
    /// Operation index.
    pub op: usize,
    /// Operation class.
    pub class: Class,
    /// Idempotency key.
    pub key: String,
    /// Material fields of the request sent.
    pub material: Value,
    /// What came back.
    pub answer: SubmitAnswer,
}

/// A cancel answer a client got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CancelRecord {
    /// Task.
    pub task_id: Uuid,
    /// The cancellation status answered.
    pub status: CancelStatus,
}

/// A report the server must refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SuspectKind {
    /// Sent after the attempt's lease ran out.
    Late,
    /// A different outcome after the attempt was already reported.
    Conflicting,
}

/// A report the server must have refused, and whether it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuspectReport {
    /// Task.
    pub task_id: Uuid,
    /// Attempt.
    pub attempt_id: Uuid,
    /// Why it must be refused.
    pub kind: SuspectKind,
    /// Whether the server accepted it (a violation).
    pub accepted: bool,
}

/// A task row of the run's tenant, read from the database directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbTask {
    /// Task id.
    pub id: Uuid,
    /// Operation class.
    pub operation: String,
    /// Idempotency key.
    pub idempotency_key: String,
    /// State.
    pub state: String,
}

/// A task with its attempts (and evidence) and event history, as idem serves them.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRecord {
    /// The task.
    pub task: Task,
    /// Its attempts, by number.
    pub attempts: Vec<Attempt>,
    /// Its events, by sequence number.
    pub events: Vec<Event>,
}

/// Everything the checker looks at.
#[derive(Debug, Clone, Default)]
pub struct CheckInput {
    /// Every task of the run, read over HTTP.
    pub tasks: Vec<TaskRecord>,
    /// Every task row of the run's tenant in the database.
    pub db_tasks: Vec<DbTask>,
    /// Every submission's final answer.
    pub submits: Vec<SubmitRecord>,
    /// Every cancel answer.
    pub cancels: Vec<CancelRecord>,
    /// Reports that must have been refused.
    pub suspects: Vec<SuspectReport>,
    /// Largest usage per attempt that a heartbeat or report got accepted with.
    pub accepted_usage: HashMap<Uuid, i64>,
    /// The provider's ledger.
    pub effects: Vec<Effect>,
    /// Every request to the provider to perform an effect.
    pub effect_requests: Vec<EffectRequest>,
}

// ---------------------------------------------------------------------------
// The checker
// ---------------------------------------------------------------------------

/// The invariants the checker verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// §2.1–2.2: one scope, one task; replays name it.
    OneScopeOneTask,
    /// §2.3: a conflicting request is refused and never executed.
    ConflictExecutesNothing,
    /// §2.4: no state change from an old generation.
    Fencing,
    /// §2.5: reconciliation before any repeat after an unknown outcome; no automatic retry of permanent failures.
    ReconcileBeforeRepeat,
    /// §2.6: at most one delivery, one charge and one payout per task; idem and the provider agree.
    OneDeliveryOneCharge,
    /// §2.7: cancellation and delivery never both win.
    CancelOrDeliver,
    /// §2.7: usage is kept (task total = attempts), fees follow it.
    UsageKept,
    /// §2.10: the event history is complete and gap-free.
    Audit,
    /// Every task reached a terminal state after the faults stopped.
    Settled,
}

impl Invariant {
    /// Every invariant, in report order.
    pub const ALL: [Invariant; 9] = [
        Invariant::OneScopeOneTask,
        Invariant::ConflictExecutesNothing,
        Invariant::Fencing,
        Invariant::ReconcileBeforeRepeat,
        Invariant::OneDeliveryOneCharge,
        Invariant::CancelOrDeliver,
        Invariant::UsageKept,
        Invariant::Audit,
        Invariant::Settled,
    ];

    /// Machine name.
    pub fn name(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "one_scope_one_task",
            Invariant::ConflictExecutesNothing => "conflict_executes_nothing",
            Invariant::Fencing => "no_state_change_from_old_generation",
            Invariant::ReconcileBeforeRepeat => "reconcile_before_repeat",
            Invariant::OneDeliveryOneCharge => "one_delivery_one_charge",
            Invariant::CancelOrDeliver => "cancel_xor_delivery",
            Invariant::UsageKept => "usage_kept",
            Invariant::Audit => "audit_history_complete",
            Invariant::Settled => "all_tasks_settled",
        }
    }

    /// SPEC section.
    pub fn spec(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "§2.1-2.2",
            Invariant::ConflictExecutesNothing => "§2.3",
            Invariant::Fencing => "§2.4",
            Invariant::ReconcileBeforeRepeat => "§2.5",
            Invariant::OneDeliveryOneCharge => "§2.6",
            Invariant::CancelOrDeliver | Invariant::UsageKept => "§2.7",
            Invariant::Audit => "§2.10",
            Invariant::Settled => "liveness",
        }
    }

    /// Plain statement.
    pub fn title(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "one task per scope; every answer names it",
            Invariant::ConflictExecutesNothing => {
                "a changed request is refused and never executed or paid"
            }
            Invariant::Fencing => "reports of old generations change no state",
            Invariant::ReconcileBeforeRepeat => {
                "no repeat after an unknown outcome without not_committed"
            }
            Invariant::OneDeliveryOneCharge => "at most one delivery, charge and payout per task",
            Invariant::CancelOrDeliver => "cancellation and delivery never both win",
            Invariant::UsageKept => "usage is kept and fees follow it",
            Invariant::Audit => "event history complete and gap-free",
            Invariant::Settled => "every task terminal after the run",
        }
    }
}

/// The result of one invariant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InvariantResult {
    /// Machine name.
    pub name: &'static str,
    /// SPEC section.
    pub spec: &'static str,
    /// Plain statement.
    pub title: &'static str,
    /// Individual checks made.
    pub checked: u64,
    /// Checks that failed.
    pub violations: u64,
    /// Up to 8 failed checks, described.
    pub examples: Vec<String>,
}

#[derive(Default)]
struct Findings(BTreeMap<Invariant, (u64, u64, Vec<String>)>);

impl Findings {
    fn ok(&mut self, inv: Invariant, cond: bool, why: impl FnOnce() -> String) {
        let e = self.0.entry(inv).or_default();
        e.0 += 1;
        if !cond {
            e.1 += 1;
            if e.2.len() < 8 {
                e.2.push(why());
            }
        }
    }

    fn results(mut self) -> Vec<InvariantResult> {
        Invariant::ALL
            .iter()
            .map(|inv| {
                let (checked, violations, examples) = self.0.remove(inv).unwrap_or_default();
                InvariantResult {
                    name: inv.name(),
                    spec: inv.spec(),
                    title: inv.title(),
                    checked,
                    violations,
                    examples,
                }
            })
            .collect()
    }
}

/// A task or attempt id as printed in findings (the full id: UUID v7 prefixes
/// are timestamps shared by the whole run; `idem task show ID` takes it as is).
fn short(id: Uuid) -> String {
    id.to_string()
}

fn event_attempt(e: &Event) -> Option<Uuid> {
    e.data
        .get("attempt_id")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
}

fn event_generation(e: &Event) -> Option<i64> {
    e.data.get("generation").and_then(Value::as_i64)
}

fn applied_reports(a: &Attempt) -> Vec<&idem_client::Evidence> {
    a.evidence
        .iter()
        .filter(|e| e.disposition.as_deref() == Some("applied") && e.outcome != "ack")
        .collect()
}

fn failure_class(a: &Attempt) -> Option<String> {
    applied_reports(a)
        .first()
        .and_then(|e| e.body.get("failure_class"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// Checks every invariant against the run's records.
pub fn check(input: &CheckInput) -> Vec<InvariantResult> {
    let mut f = Findings::default();
    let by_id: HashMap<Uuid, &TaskRecord> = input.tasks.iter().map(|r| (r.task.id, r)).collect();

    // §2.1: one task per scope in the database.
    let mut db_scopes: BTreeMap<(&str, &str), Vec<Uuid>> = BTreeMap::new();
    for t in &input.db_tasks {
        db_scopes
            .entry((&t.operation, &t.idempotency_key))
            .or_default()
            .push(t.id);
    }
    for ((op, key), ids) in &db_scopes {
        f.ok(Invariant::OneScopeOneTask, ids.len() == 1, || {
            format!("scope {op}/{key} has {} tasks in the store", ids.len())
        });
    }
    for t in &input.db_tasks {
        f.ok(Invariant::Audit, by_id.contains_key(&t.id), || {
            format!("task {} is in the database but not served", short(t.id))
        });
    }

    // Client answers, per scope.
    let mut scopes: BTreeMap<(&str, &str), Vec<&SubmitRecord>> = BTreeMap::new();
    for s in &input.submits {
        scopes
            .entry((s.class.operation(), &s.key))
            .or_default()
            .push(s);
    }
    let mut deliveries_seen: HashMap<Uuid, Vec<&DeliverySeen>> = HashMap::new();
    for ((op, key), recs) in &scopes {
        let class = recs[0].class;
        let mut named = BTreeSet::new();
        let mut created = 0;
        for s in recs {
            match &s.answer {
                SubmitAnswer::Accepted {
                    task_id,
                    replayed,
                    looked_up,
                    delivery,
                    ..
                } => {
                    named.insert(*task_id);
                    if !replayed && !looked_up {
                        created += 1;
                    }
                    if let Some(d) = delivery {
                        deliveries_seen.entry(*task_id).or_default().push(d);
                    }
                }
                SubmitAnswer::Conflict { task_id: Some(id) } => {
                    named.insert(*id);
                }
                _ => {}
            }
        }
        f.ok(Invariant::OneScopeOneTask, named.len() <= 1, || {
            format!(
                "scope {op}/{key}: answers named {} different tasks",
                named.len()
            )
        });
        f.ok(Invariant::OneScopeOneTask, created <= 1, || {
            format!("scope {op}/{key}: {created} answers said `created` (not a replay)")
        });
        let db_ids = db_scopes.get(&(*op, *key)).cloned().unwrap_or_default();
        for id in &named {
            f.ok(Invariant::OneScopeOneTask, db_ids.contains(id), || {
                format!(
                    "scope {op}/{key}: an answer named task {} which the store does not hold under it",
                    short(*id)
                )
            });
        }
        let stored = db_ids.first().and_then(|id| by_id.get(id));
        let stored_material = stored.map(|r| class.material(&r.task.params));
        for s in recs {
            match &s.answer {
                SubmitAnswer::Accepted {
                    task_id,
                    looked_up,
                    material,
                    ..
                } => {
                    if !looked_up {
                        f.ok(
                            Invariant::ConflictExecutesNothing,
                            &s.material == material,
                            || {
                                format!(
                                    "op {}: a request with other material fields ({}) was answered with task {} ({material})",
                                    s.op,
                                    s.material,
                                    short(*task_id)
                                )
                            },
                        );
                    }
                    if let Some(m) = &stored_material {
                        f.ok(Invariant::ConflictExecutesNothing, m == material, || {
                            format!(
                                "task {}: accepted params changed from {material} to {m}",
                                short(*task_id)
                            )
                        });
                    }
                }
                SubmitAnswer::Conflict { .. } => {
                    if let Some(m) = &stored_material {
                        f.ok(Invariant::ConflictExecutesNothing, &s.material != m, || {
                            format!(
                                "op {}: the scope's own request was refused as a conflict",
                                s.op
                            )
                        });
                    }
                }
                _ => {}
            }
        }
    }

    // The provider's ledger.
    let effects: HashMap<Uuid, &Effect> = input.effects.iter().map(|e| (e.task_id, e)).collect();
    for e in &input.effects {
        match by_id.get(&e.task_id) {
            Some(r) => {
                let m = e.class.material(&r.task.params);
                f.ok(Invariant::ConflictExecutesNothing, m == e.material, || {
                    format!(
                        "task {}: the provider acted on {} but the accepted request is {m}",
                        short(e.task_id),
                        e.material
                    )
                });
            }
            None => f.ok(Invariant::OneScopeOneTask, false, || {
                format!(
                    "the provider acted for task {} which idem does not serve",
                    short(e.task_id)
                )
            }),
        }
    }
    let mut requests: HashMap<Uuid, (BTreeSet<Uuid>, u64)> = HashMap::new();
    for r in &input.effect_requests {
        let e = requests.entry(r.task_id).or_default();
        e.0.insert(r.attempt_id);
        e.1 += u64::from(r.moved);
    }
    for (task_id, (attempts, moved)) in &requests {
        f.ok(Invariant::OneDeliveryOneCharge, *moved <= 1, || {
            format!("task {}: money moved {moved} times", short(*task_id))
        });
        let safe = by_id
            .get(task_id)
            .and_then(|r| Class::from_operation(&r.task.operation))
            .is_some_and(Class::is_safe);
        if !safe {
            f.ok(Invariant::ReconcileBeforeRepeat, attempts.len() <= 1, || {
                format!(
                    "task {}: {} attempts asked the provider to pay (a repeat without reconciliation)",
                    short(*task_id),
                    attempts.len()
                )
            });
        }
    }

    // Reports that must have been refused.
    for s in &input.suspects {
        f.ok(Invariant::Fencing, !s.accepted, || {
            let what = match s.kind {
                SuspectKind::Late => "a report sent after the lease ran out",
                SuspectKind::Conflicting => "a different second report",
            };
            format!(
                "task {} attempt {}: {what} was accepted",
                short(s.task_id),
                short(s.attempt_id)
            )
        });
    }

    let mut cancels: HashMap<Uuid, Vec<CancelStatus>> = HashMap::new();
    for c in &input.cancels {
        cancels.entry(c.task_id).or_default().push(c.status);
    }
    for rec in &input.tasks {
        let id = rec.task.id;
        check_task(
            rec,
            effects.get(&id).copied(),
            &input.accepted_usage,
            deliveries_seen.get(&id).map_or(&[][..], Vec::as_slice),
            cancels.get(&id).map_or(&[][..], Vec::as_slice),
            &mut f,
        );
    }
    f.results()
}

#[allow(clippy::too_many_lines)]
fn check_task(
    rec: &TaskRecord,
    effect: Option<&Effect>,
    accepted_usage: &HashMap<Uuid, i64>,
    deliveries_seen: &[&DeliverySeen],
    cancels: &[CancelStatus],
    f: &mut Findings,
) {
    let t = &rec.task;
    let s = short(t.id);
    let Some(class) = Class::from_operation(&t.operation) else {
        return;
    };
    let safe = class.is_safe();
    let attempts = &rec.attempts;
    let events = &rec.events;
    let count = |kind: &str| events.iter().filter(|e| e.kind == kind).count();
    let confirmed = t
        .cancellation
        .as_ref()
        .is_some_and(|c| c.status == CancelStatus::Confirmed);

    // Liveness.
    f.ok(Invariant::Settled, t.state.is_terminal(), || {
        format!("task {s} is still {} after the run quiesced", t.state)
    });

    // §2.10: audit.
    f.ok(
        Invariant::Audit,
        events
            .iter()
            .zip(1..)
            .all(|(e, n): (&Event, i64)| e.seq == n),
        || {
            format!(
                "task {s}: event sequence numbers are not 1..{}",
                events.len()
            )
        },
    );
    f.ok(
        Invariant::Audit,
        events.first().is_some_and(|e| {
            e.kind == "task_submitted"
                && e.data.get("fingerprint").and_then(Value::as_str) == Some(&t.fingerprint)
        }),
        || format!("task {s}: history does not start with its task_submitted event"),
    );
    let leased: HashMap<Uuid, Option<i64>> = events
        .iter()
        .filter(|e| e.kind == "attempt_leased")
        .filter_map(|e| event_attempt(e).map(|a| (a, event_generation(e))))
        .collect();
    for a in attempts {
        f.ok(
            Invariant::Audit,
            leased.get(&a.id) == Some(&Some(a.generation)),
            || {
                format!(
                    "task {s}: attempt {} has no attempt_leased event with its generation",
                    a.number
                )
            },
        );
    }
    f.ok(
        Invariant::Audit,
        t.delivery.is_none() || count("delivered") > 0,
        || format!("task {s}: delivery without a delivered event"),
    );
    f.ok(
        Invariant::Audit,
        !confirmed || count("cancel_confirmed") > 0,
        || format!("task {s}: confirmed cancellation without a cancel_confirmed event"),
    );
    let stale_evidence = attempts
        .iter()
        .flat_map(|a| &a.evidence)
        .filter(|e| e.disposition.as_deref() == Some("stale_generation") && e.outcome != "ack")
        .count();
    f.ok(
        Invariant::Audit,
        stale_evidence == count("stale_report"),
        || {
            format!(
                "task {s}: {stale_evidence} stale reports kept as evidence but {} stale_report events",
                count("stale_report")
            )
        },
    );

    // §2.4: fencing, from the attempts and their evidence …
    f.ok(
        Invariant::Fencing,
        attempts.first().is_none_or(|a| a.number == 1),
        || format!("task {s}: attempt numbers do not start at 1"),
    );
    for w in attempts.windows(2) {
        f.ok(
            Invariant::Fencing,
            w[1].number == w[0].number + 1 && w[1].generation > w[0].generation,
            || {
                format!(
                    "task {s}: attempt {} (generation {}) follows attempt {} (generation {})",
                    w[1].number, w[1].generation, w[0].number, w[0].generation
                )
            },
        );
    }
    let last_gen = attempts.last().map_or(0, |a| a.generation);
    f.ok(Invariant::Fencing, t.generation >= last_gen, || {
        format!(
            "task {s}: generation {} below its newest attempt's {last_gen}",
            t.generation
        )
    });
    if confirmed && !attempts.is_empty() {
        f.ok(Invariant::Fencing, t.generation > last_gen, || {
            format!("task {s}: the confirmed cancellation did not raise the generation")
        });
    }
    for a in attempts {
        let applied = applied_reports(a);
        f.ok(Invariant::Fencing, applied.len() <= 1, || {
            format!(
                "task {s}: attempt {} has {} applied reports",
                a.number,
                applied.len()
            )
        });
        for e in applied {
            f.ok(Invariant::Fencing, e.generation == a.generation, || {
                format!(
                    "task {s}: attempt {} (generation {}) applied a report of generation {}",
                    a.number, a.generation, e.generation
                )
            });
        }
        if matches!(a.state, AttemptState::Leased | AttemptState::Acknowledged) {
            f.ok(
                Invariant::Fencing,
                !t.state.is_terminal() && attempts.last().is_some_and(|l| l.id == a.id),
                || {
                    format!(
                        "task {s}: attempt {} still holds a lease while the task is {} with {} attempts",
                        a.number,
                        t.state,
                        attempts.len()
                    )
                },
            );
        }
    }
    // … and from the event history: every state change comes from the current
    // generation's live attempt, nothing changes after a terminal transition.
    let mut current = 0i64;
    let mut active: Option<Uuid> = None;
    let mut terminal: Option<&str> = None;
    let mut executes_before_cancel = 0;
    let mut execute_count = 0;
    for e in events {
        let aid = event_attempt(e);
        let g = event_generation(e);
        match e.kind.as_str() {
            "attempt_leased" => {
                let g = g.unwrap_or(-1);
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: attempt leased (event {}) after the task was {}",
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                f.ok(Invariant::Fencing, active.is_none(), || {
                    format!(
                        "task {s}: attempt leased (event {}) while another attempt held the lease",
                        e.seq
                    )
                });
                f.ok(Invariant::Fencing, g > current, || {
                    format!(
                        "task {s}: attempt leased with generation {g}, not above {current} (event {})",
                        e.seq
                    )
                });
                current = current.max(g);
                active = aid;
                if e.data.get("kind").and_then(Value::as_str) == Some("execute") {
                    execute_count += 1;
                }
            }
            "lease_expired" if active.is_some() && active == aid => active = None,
            "completion_observed"
            | "reconciled"
            | "attempt_failed"
            | "outcome_unknown"
            | "attempt_cancelled" => {
                f.ok(
                    Invariant::Fencing,
                    aid.is_some() && aid == active && g == Some(current),
                    || {
                        format!(
                            "task {s}: {} (event {}) applied a report of generation {} of attempt {} while generation {current} {} held the lease",
                            e.kind,
                            e.seq,
                            g.map_or_else(|| "?".into(), |g| g.to_string()),
                            aid.map_or_else(|| "?".into(), short),
                            active.map_or_else(|| "(no attempt)".into(), short),
                        )
                    },
                );
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: {} (event {}) after the task was {}",
                        e.kind,
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                active = None;
            }
            "cancel_confirmed" => {
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: cancellation confirmed after the task was {}",
                        terminal.unwrap_or("?")
                    )
                });
                if let Some(g) = g {
                    f.ok(Invariant::Fencing, g > current, || {
                        format!("task {s}: cancellation set generation {g}, not above {current}")
                    });
                    current = current.max(g);
                }
                terminal = Some("cancelled");
                active = None;
                executes_before_cancel = execute_count;
            }
            "delivered" => {
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: delivered (event {}) after the task was {}",
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                terminal = Some("delivered");
            }
            "task_failed" => {
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: failed (event {}) after the task was {}",
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                terminal = Some("failed");
            }
            _ => {}
        }
    }
    f.ok(Invariant::Fencing, t.generation == current, || {
        format!(
            "task {s}: generation {} but its history says {current}",
            t.generation
        )
    });

    // §2.5: reconciliation before any repeat; failure classes decide retries.
    for w in attempts.windows(2) {
        let (p, c) = (&w[0], &w[1]);
        let must_reconcile = match (p.kind, p.state) {
            (AttemptKind::Execute, AttemptState::Unknown) => true,
            (AttemptKind::Execute, AttemptState::Expired) => !safe,
            (AttemptKind::Reconcile, st) => st != AttemptState::NotCommitted,
            _ => false,
        };
        f.ok(
            Invariant::ReconcileBeforeRepeat,
            !(must_reconcile && c.kind == AttemptKind::Execute),
            || {
                format!(
                    "task {s}: execute attempt {} follows {} attempt {} ({}) without not_committed",
                    c.number, p.kind, p.number, p.state
                )
            },
        );
        f.ok(
            Invariant::ReconcileBeforeRepeat,
            !matches!(
                p.state,
                AttemptState::Succeeded | AttemptState::Committed | AttemptState::Cancelled
            ),
            || {
                format!(
                    "task {s}: attempt {} follows attempt {} which ended the task ({})",
                    c.number, p.number, p.state
                )
            },
        );
        if p.kind == AttemptKind::Execute && p.state == AttemptState::Failed {
            let class_name = failure_class(p).unwrap_or_default();
            let never = class_name == FailureClass::InvalidInput.as_str()
                || class_name == FailureClass::PermissionDenied.as_str()
                || (!safe && class_name == FailureClass::Transient.as_str());
            f.ok(Invariant::ReconcileBeforeRepeat, !never, || {
                format!(
                    "task {s}: attempt {} retried a `{class_name}` failure of attempt {} automatically",
                    c.number, p.number
                )
            });
        }
    }

    // §2.6: one delivery, one charge; idem and the provider agree.
    f.ok(
        Invariant::OneDeliveryOneCharge,
        count("delivered") <= 1,
        || format!("task {s}: {} delivered events", count("delivered")),
    );
    f.ok(
        Invariant::OneDeliveryOneCharge,
        t.delivery.is_some() == (t.state == TaskState::Succeeded),
        || {
            format!(
                "task {s}: state {} with delivery {}",
                t.state,
                t.delivery.is_some()
            )
        },
    );
    if let Some(d) = &t.delivery {
        f.ok(
            Invariant::OneDeliveryOneCharge,
            d.charge == t.contract.price,
            || {
                format!(
                    "task {s}: charged {} instead of the price {}",
                    d.charge, t.contract.price
                )
            },
        );
        match effect {
            Some(e) => f.ok(
                Invariant::OneDeliveryOneCharge,
                d.external_txn_id.as_deref() == Some(e.txn.as_str()),
                || {
                    format!(
                        "task {s}: delivered transaction {:?} but the provider recorded {}",
                        d.external_txn_id, e.txn
                    )
                },
            ),
            None => f.ok(Invariant::OneDeliveryOneCharge, false, || {
                format!("task {s}: delivered without any effect at the provider")
            }),
        }
        if let Some(c) = &t.cancellation
            && c.status == CancelStatus::TooLate
        {
            f.ok(
                Invariant::OneDeliveryOneCharge,
                c.fee == Some(d.charge),
                || {
                    format!(
                        "task {s}: cancel too late after delivery with fee {:?}, not the charge {}",
                        c.fee, d.charge
                    )
                },
            );
        }
        for seen in deliveries_seen {
            f.ok(
                Invariant::OneDeliveryOneCharge,
                seen.external_txn_id == d.external_txn_id
                    && seen.charge == d.charge
                    && seen.delivered_at == d.delivered_at,
                || {
                    format!(
                        "task {s}: a replay answered another delivery record than the final one"
                    )
                },
            );
        }
    } else {
        f.ok(
            Invariant::OneDeliveryOneCharge,
            deliveries_seen.is_empty(),
            || format!("task {s}: a replay showed a delivery the task no longer has"),
        );
    }
    if let Some(e) = effect
        && !safe
        && t.state.is_terminal()
    {
        f.ok(
            Invariant::OneDeliveryOneCharge,
            t.delivery.is_some(),
            || {
                format!(
                    "task {s}: the provider paid {} but the task ended {} without delivery",
                    e.txn, t.state
                )
            },
        );
    }

    // §2.7: cancellation and delivery never both.
    f.ok(
        Invariant::CancelOrDeliver,
        !(confirmed && t.delivery.is_some()),
        || format!("task {s}: both cancelled (confirmed) and delivered"),
    );
    f.ok(
        Invariant::CancelOrDeliver,
        confirmed == (t.state == TaskState::Cancelled),
        || {
            format!(
                "task {s}: state {} with cancellation {:?}",
                t.state,
                t.cancellation.as_ref().map(|c| c.status)
            )
        },
    );
    f.ok(
        Invariant::CancelOrDeliver,
        count("delivered") == 0 || count("cancel_confirmed") == 0,
        || format!("task {s}: history has both delivered and cancel_confirmed"),
    );
    if !safe && confirmed {
        f.ok(Invariant::CancelOrDeliver, effect.is_none(), || {
            format!("task {s}: cancelled although the provider paid it")
        });
    }
    for c in cancels {
        match c {
            CancelStatus::Confirmed => {
                f.ok(
                    Invariant::CancelOrDeliver,
                    t.state == TaskState::Cancelled,
                    || {
                        format!(
                            "task {s}: a cancel was answered `confirmed` but the task ended {}",
                            t.state
                        )
                    },
                );
            }
            CancelStatus::TooLate => {
                f.ok(
                    Invariant::CancelOrDeliver,
                    t.state != TaskState::Cancelled,
                    || format!("task {s}: a cancel was answered `too_late` but the task ended cancelled"),
                );
            }
            _ => {}
        }
    }

    // §2.7: usage kept.
    let sum: i64 = attempts.iter().map(|a| a.usage).sum();
    f.ok(Invariant::UsageKept, t.usage == sum, || {
        format!("task {s}: usage {} but its attempts used {sum}", t.usage)
    });
    for a in attempts {
        if let Some(u) = accepted_usage.get(&a.id) {
            f.ok(Invariant::UsageKept, a.usage >= *u, || {
                format!(
                    "task {s}: attempt {} shows usage {} though {u} was accepted",
                    a.number, a.usage
                )
            });
        }
    }
    if confirmed && let Some(ev) = events.iter().find(|e| e.kind == "cancel_confirmed") {
        let usage = ev.data.get("usage").and_then(Value::as_i64);
        f.ok(Invariant::UsageKept, usage == Some(t.usage), || {
            format!(
                "task {s}: cancellation recorded usage {usage:?} but the task has {}",
                t.usage
            )
        });
        let fee = |k: &str| t.contract.fees.get(k).and_then(Value::as_i64);
        let expected = if executes_before_cancel == 0 {
            fee("cancel_before_start")
        } else {
            fee("cancel_after_start_fixed")
                .zip(fee("usage_unit_price"))
                .map(|(fixed, unit)| fixed + t.usage * unit)
        };
        if let Some(expected) = expected {
            let got = t.cancellation.as_ref().and_then(|c| c.fee);
            f.ok(Invariant::UsageKept, got == Some(expected), || {
                format!("task {s}: cancellation fee {got:?}, the frozen fees say {expected}")
            });
        }
    }
}

// ---------------------------------------------------------------------------
// Server processes, endpoints and the database
// ---------------------------------------------------------------------------

/// The `idem serve` child processes.
struct Servers {
    bin: PathBuf,
    store_url: String,
    config: PathBuf,
    dir: PathBuf,
    slots: Vec<tokio::sync::Mutex<Option<Child>>>,
}

impl Servers {
    async fn spawn(&self, idx: usize) -> Result<(Child, String)> {
        let log_path = self.dir.join(format!("server-{idx}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--store")
            .arg(&self.store_url)
            .arg("--config")
            .arg(&self.config)
            .arg("--sweep-interval-ms")
            .arg("50");
        for (k, _) in std::env::vars() {
            if k.starts_with("IDEM_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        let stdout = child.stdout.take().context("no stdout of the server")?;
        let mut lines = BufReader::new(stdout).lines();
        let found = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(url) = line.strip_prefix("idem listening on ") {
                    return Some(url.trim().to_owned());
                }
            }
            None
        })
        .await;
        match found {
            Ok(Some(url)) => {
                tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
                Ok((child, url))
            }
            _ => {
                let _ = child.kill().await;
                let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: String = tail
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                bail!("server {idx} did not start listening; its log ends:\n{tail}")
            }
        }
    }

    /// Starts (or, after a SIGKILL, restarts) server `idx`; returns its URL.
    async fn restart(&self, idx: usize, kill_first: bool) -> Result<String> {
        let mut slot = self.slots[idx].lock().await;
        if kill_first && let Some(mut c) = slot.take() {
            // tokio's kill() is SIGKILL on unix, then waits for the exit.
            let _ = c.kill().await;
        }
        let (child, url) = self.spawn(idx).await?;
        *slot = Some(child);
        Ok(url)
    }

    async fn stop_all(&self) {
        for s in &self.slots {
            if let Some(mut c) = s.lock().await.take() {
                let _ = c.kill().await;
            }
        }
    }
}

#[derive(Clone)]
struct Endpoint {
    client: Client,
    exec: Client,
}

/// The live servers' endpoints; clients and executors follow restarts.
struct Targets {
    slots: RwLock<Vec<Option<Endpoint>>>,
    rr: AtomicUsize,
    http: reqwest::Client,
    client_key: String,
    exec_key: String,
}

impl Targets {
    fn set(&self, idx: usize, url: Option<&str>) -> Result<()> {
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

    fn pick(&self) -> Option<Endpoint> {
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

    async fn wait_pick(&self, deadline: Instant) -> Option<Endpoint> {
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

enum Db {
    Sqlite(PathBuf),
    Pg(tokio_postgres::Client),
}

impl Db {
    async fn connect_pg(url: &str) -> Result<Db> {
        let mut cfg: tokio_postgres::Config = url.parse().context("parsing the PostgreSQL URL")?;
        cfg.application_name("idem-chaos");
        let (client, conn) = cfg
            .connect(tokio_postgres::NoTls)
            .await
            .context("connecting to PostgreSQL")?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Db::Pg(client))
    }

    async fn list(&self, tenant: &str) -> Result<Vec<DbTask>> {
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
            Db::Pg(c) => {
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
    async fn terminate_idem_connections(&self) -> Result<u64> {
        match self {
            Db::Sqlite(_) => Ok(0),
            Db::Pg(c) => {
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

fn is_terminal_word(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled")
}

// ---------------------------------------------------------------------------
// Clients and executors
// ---------------------------------------------------------------------------

#[derive(Default)]
struct RunLog {
    submits: Vec<SubmitRecord>,
    cancels: Vec<CancelRecord>,
    suspects: Vec<SuspectReport>,
    accepted_usage: HashMap<Uuid, i64>,
    realized: BTreeMap<String, u64>,
    unexpected: BTreeMap<String, u64>,
}

struct Ctx {
    plan: Arc<Plan>,
    targets: Targets,
    provider: Provider,
    log: Mutex<RunLog>,
    stop: AtomicBool,
    inflight: AtomicUsize,
    ordinals: Mutex<HashMap<Uuid, [usize; 2]>>,
}

/// What became of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Accepted,
    Stale,
    AlreadyReported,
    Refused,
    NoAnswer,
}

struct InflightGuard(Arc<Ctx>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Ctx {
    fn log(&self) -> MutexGuard<'_, RunLog> {
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn realized(&self, kind: &str, n: u64) {
        *self.log().realized.entry(kind.to_owned()).or_default() += n;
    }

    fn unexpected(&self, what: &str, e: &ClientError) {
        let key = format!(
            "{what}: {} {}",
            e.status()
                .map_or_else(|| "transport".into(), |s| s.to_string()),
            e.code().unwrap_or("")
        );
        *self.log().unexpected.entry(key).or_default() += 1;
    }

    fn next_ordinal(&self, task_id: Uuid, kind: AttemptKind) -> usize {
        let mut m = self
            .ordinals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = m.entry(task_id).or_default();
        let i = usize::from(kind == AttemptKind::Reconcile);
        let n = e[i];
        e[i] += 1;
        n
    }

    fn accepted(class: Class, task: &Task, replayed: bool, looked_up: bool) -> SubmitAnswer {
        SubmitAnswer::Accepted {
            task_id: task.id,
            replayed,
            looked_up,
            material: class.material(&task.params),
            fingerprint: task.fingerprint.clone(),
            delivery: task.delivery.as_ref().map(|d| DeliverySeen {
                external_txn_id: d.external_txn_id.clone(),
                charge: d.charge,
                delivered_at: d.delivered_at.clone(),
            }),
        }
    }

    /// Submits with retries under the same key through outages; after the
    /// client's patience the scope is looked up.
    async fn submit(&self, class: Class, key: &str, params: &Value) -> SubmitAnswer {
        let deadline = Instant::now() + CLIENT_PATIENCE;
        let mut pause = Duration::from_millis(20);
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            match ep.client.submit(class.operation(), params, key).await {
                Ok(s) => return Ctx::accepted(class, &s.task, s.replayed, false),
                Err(e) if e.code() == Some("IDEMPOTENCY_CONFLICT") => {
                    return SubmitAnswer::Conflict {
                        task_id: e.problem().and_then(|p| p.task_id),
                    };
                }
                Err(e) if e.is_retryable() => {
                    self.realized("client_retry_after_error", 1);
                    if Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(300));
                }
                Err(e) => {
                    self.unexpected("submit", &e);
                    return SubmitAnswer::Refused {
                        status: e.status().unwrap_or(0),
                        code: e.code().unwrap_or("").to_owned(),
                    };
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            match ep.client.find_task(class.operation(), key).await {
                Ok(t) => return Ctx::accepted(class, &t, true, true),
                Err(e) if e.status() == Some(404) => return SubmitAnswer::NoAnswer,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(_) => break,
            }
        }
        SubmitAnswer::NoAnswer
    }

    async fn cancel(&self, task_id: Uuid) -> Option<CancelStatus> {
        let deadline = Instant::now() + CLIENT_PATIENCE;
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            match ep.client.cancel(task_id).await {
                Ok(r) => return Some(r.cancellation.status),
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    self.unexpected("cancel", &e);
                    return None;
                }
            }
        }
        None
    }

    async fn report(&self, attempt_id: Uuid, body: &ReportBody) -> Sent {
        let deadline = Instant::now() + REPORT_PATIENCE;
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            match ep.exec.report(attempt_id, body).await {
                Ok(_) => {
                    if let Some(u) = body.usage {
                        let mut log = self.log();
                        let e = log.accepted_usage.entry(attempt_id).or_default();
                        *e = (*e).max(u);
                    }
                    return Sent::Accepted;
                }
                Err(e) if e.code() == Some("STALE_GENERATION") => return Sent::Stale,
                Err(e) if e.code() == Some("ATTEMPT_ALREADY_REPORTED") => {
                    return Sent::AlreadyReported;
                }
                Err(e) if e.is_retryable() => {
                    if Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                Err(e) => {
                    self.unexpected("report", &e);
                    return Sent::Refused;
                }
            }
        }
        Sent::NoAnswer
    }

    /// One heartbeat, retried through outages only while the effect may still be performed.
    async fn heartbeat(
        &self,
        attempt_id: Uuid,
        generation: i64,
        usage: i64,
        sent: Instant,
    ) -> Result<HeartbeatAck, Sent> {
        let deadline = sent + EFFECT_WITHIN;
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            match ep.exec.heartbeat(attempt_id, generation, Some(usage)).await {
                Ok(ack) => {
                    let mut log = self.log();
                    let e = log.accepted_usage.entry(attempt_id).or_default();
                    *e = (*e).max(usage);
                    return Ok(ack);
                }
                Err(e) if e.code() == Some("STALE_GENERATION") => return Err(Sent::Stale),
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    if !e.is_retryable() {
                        self.unexpected("heartbeat", &e);
                    }
                    return Err(Sent::NoAnswer);
                }
            }
        }
        Err(Sent::NoAnswer)
    }

    fn suspect(&self, ca: &ClaimedAttempt, kind: SuspectKind, sent: Sent) {
        if matches!(sent, Sent::NoAnswer | Sent::Refused) {
            return;
        }
        let accepted = sent == Sent::Accepted;
        self.realized(
            if accepted {
                "suspect_report_accepted"
            } else {
                "suspect_report_refused"
            },
            1,
        );
        self.log().suspects.push(SuspectReport {
            task_id: ca.task_id,
            attempt_id: ca.id,
            kind,
            accepted,
        });
    }
}

async fn run_op(ctx: Arc<Ctx>, i: usize) {
    let op = ctx.plan.ops[i].clone();
    let key = op.key_string();
    let params = op.class.params(op.key, op.changed.unwrap_or(0), i);
    let material = op.class.material(&params);
    let record = |answer: SubmitAnswer| SubmitRecord {
        op: i,
        class: op.class,
        key: key.clone(),
        material: material.clone(),
        answer,
    };
    if let Some(ms) = op.first_timeout_ms
        && let Some(ep) = ctx.targets.pick()
    {
        let c = ep.client.with_timeout(Duration::from_millis(ms));
        match c.submit(op.class.operation(), &params, &key).await {
            Ok(s) => {
                let a = Ctx::accepted(op.class, &s.task, s.replayed, false);
                ctx.log().submits.push(record(a));
            }
            Err(e) if e.code() == Some("IDEMPOTENCY_CONFLICT") => {
                let a = SubmitAnswer::Conflict {
                    task_id: e.problem().and_then(|p| p.task_id),
                };
                ctx.log().submits.push(record(a));
            }
            Err(e) if e.is_timeout() => ctx.realized("client_timeout", 1),
            Err(_) => {}
        }
    }
    let answer = ctx.submit(op.class, &key, &params).await;
    let task_id = match &answer {
        SubmitAnswer::Accepted { task_id, .. } => Some(*task_id),
        _ => None,
    };
    ctx.log().submits.push(record(answer));
    if let (Some(ms), Some(id)) = (op.cancel_after_ms, task_id) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        if let Some(status) = ctx.cancel(id).await {
            ctx.realized(&format!("cancel_answered_{status}"), 1);
            ctx.log().cancels.push(CancelRecord {
                task_id: id,
                status,
            });
        }
    }
    for _ in 0..op.replays {
        tokio::time::sleep(Duration::from_millis(op.replay_delay_ms)).await;
        let a = ctx.submit(op.class, &key, &params).await;
        ctx.log().submits.push(record(a));
    }
}

async fn executor_loop(ctx: Arc<Ctx>, n: usize) {
    let id = format!("chaos-exec-{n}");
    while !ctx.stop.load(Ordering::SeqCst) {
        if ctx.inflight.load(Ordering::SeqCst) >= MAX_INFLIGHT {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let Some(ep) = ctx.targets.pick() else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let sent = Instant::now();
        match ep.exec.claim(&id, &[], 8, Some(LEASE_MS), 100).await {
            Ok(list) => {
                let received = Instant::now();
                for ca in list {
                    ctx.inflight.fetch_add(1, Ordering::SeqCst);
                    let c = ctx.clone();
                    tokio::spawn(async move {
                        let _guard = InflightGuard(c.clone());
                        handle_attempt(&c, ca, sent, received).await;
                    });
                }
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(30)).await,
        }
    }
}

async fn handle_attempt(ctx: &Ctx, ca: ClaimedAttempt, sent: Instant, received: Instant) {
    let Some(class) = Class::from_operation(&ca.operation) else {
        return;
    };
    let key: Option<u32> = ca
        .idempotency_key
        .strip_prefix('k')
        .and_then(|k| k.parse().ok());
    let script = key.and_then(|k| ctx.plan.scripts.get(&(class, k)));
    let ordinal = ctx.next_ordinal(ca.task_id, ca.kind);
    match ca.kind {
        AttemptKind::Execute => {
            let step = script
                .and_then(|s| s.exec.get(ordinal))
                .copied()
                .unwrap_or(ExecStep::CLEAN);
            execute(ctx, &ca, class, step, sent, received).await;
        }
        AttemptKind::Reconcile => {
            let fault = script
                .and_then(|s| s.recon.get(ordinal))
                .copied()
                .unwrap_or(ReconFault::Clean);
            reconcile(ctx, &ca, fault, received).await;
        }
        AttemptKind::Other => {}
    }
}

async fn execute(
    ctx: &Ctx,
    ca: &ClaimedAttempt,
    class: Class,
    step: ExecStep,
    sent: Instant,
    received: Instant,
) {
    let g = ca.generation;
    if step.fault != ExecFault::Clean {
        ctx.realized(step.fault.name(), 1);
    }
    let mut anchor = received;
    if step.heartbeat {
        match ctx.heartbeat(ca.id, g, step.usage / 2, sent).await {
            Ok(ack) if ack.cancel_requested => {
                ctx.realized("executor_obeyed_cancel", 1);
                let body = ReportBody::cancelled(g).with_usage(step.usage / 2);
                ctx.report(ca.id, &body).await;
                return;
            }
            Ok(_) => anchor = Instant::now(),
            Err(Sent::Stale) => {
                ctx.realized("executor_lost_lease", 1);
                return;
            }
            Err(_) => {}
        }
    }
    let usage = step.usage;
    match step.fault {
        ExecFault::CrashBeforeEffect => return,
        ExecFault::Transient => {
            let body = ReportBody::failed(g, FailureClass::Transient, "provider timed out")
                .with_usage(usage);
            ctx.report(ca.id, &body).await;
            return;
        }
        ExecFault::Permanent => {
            let body = ReportBody::failed(g, FailureClass::InvalidInput, "payee account closed")
                .with_usage(usage);
            ctx.report(ca.id, &body).await;
            return;
        }
        ExecFault::UnknownWithoutEffect => {
            ctx.report(ca.id, &ReportBody::unknown(g).with_usage(usage))
                .await;
            return;
        }
        _ => {}
    }
    if sent.elapsed() > EFFECT_WITHIN {
        // Too close to the lease end to act safely: behave as a crash before the effect.
        ctx.realized("executor_too_slow_to_act", 1);
        return;
    }
    let e = ctx.provider.perform(ca.task_id, ca.id, class, &ca.params);
    let body = ReportBody::succeeded(g, effect_result(&e))
        .with_usage(usage)
        .with_external_txn_id(e.txn.clone());
    match step.fault {
        ExecFault::CrashAfterEffect => {}
        ExecFault::UnknownAfterEffect => {
            ctx.report(ca.id, &ReportBody::unknown(g).with_usage(usage))
                .await;
        }
        ExecFault::LateReport => {
            tokio::time::sleep_until(
                (anchor + Duration::from_millis(LEASE_MS) + LATE_MARGIN).into(),
            )
            .await;
            let s = ctx.report(ca.id, &body).await;
            ctx.suspect(ca, SuspectKind::Late, s);
        }
        ExecFault::DuplicateReport => {
            if ctx.report(ca.id, &body).await == Sent::Accepted {
                let again = ctx.report(ca.id, &body).await;
                if again != Sent::Accepted {
                    ctx.realized("exact_repeat_report_refused", 1);
                }
                let other = ReportBody::failed(g, FailureClass::Transient, "second thoughts")
                    .with_usage(usage);
                let s = ctx.report(ca.id, &other).await;
                ctx.suspect(ca, SuspectKind::Conflicting, s);
            }
        }
        _ => {
            ctx.report(ca.id, &body).await;
        }
    }
}

async fn reconcile(ctx: &Ctx, ca: &ClaimedAttempt, fault: ReconFault, received: Instant) {
    let g = ca.generation;
    if fault != ReconFault::Clean {
        ctx.realized(fault.name(), 1);
    }
    match fault {
        ReconFault::Crash => {}
        ReconFault::Transient => {
            let body = ReportBody::failed(g, FailureClass::Transient, "provider lookup failed")
                .with_usage(1);
            ctx.report(ca.id, &body).await;
        }
        ReconFault::Unknown => {
            ctx.report(ca.id, &ReportBody::unknown(g).with_usage(1))
                .await;
        }
        ReconFault::Clean | ReconFault::LateReport => {
            let body = match ctx.provider.lookup(ca.task_id) {
                Some(e) => {
                    ReportBody::committed(g, effect_result(&e)).with_external_txn_id(e.txn.clone())
                }
                None => ReportBody::not_committed(g),
            }
            .with_usage(1);
            if fault == ReconFault::LateReport {
                tokio::time::sleep_until(
                    (received + Duration::from_millis(LEASE_MS) + LATE_MARGIN).into(),
                )
                .await;
                let s = ctx.report(ca.id, &body).await;
                ctx.suspect(ca, SuspectKind::Late, s);
            } else {
                ctx.report(ca.id, &body).await;
            }
        }
    }
}

async fn inject(
    ctx: Arc<Ctx>,
    servers: Arc<Servers>,
    db: Arc<Db>,
    fault: ServerFault,
) -> Result<()> {
    match fault {
        ServerFault::Kill { server } => {
            ctx.targets.set(server, None)?;
            let url = servers.restart(server, true).await?;
            ctx.realized("server_sigkill", 1);
            ctx.targets.set(server, Some(&url))?;
        }
        ServerFault::PgTerminate => {
            let n = db.terminate_idem_connections().await?;
            ctx.realized("pg_terminate_backend", 1);
            ctx.realized("pg_connections_terminated", n);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------

/// Options of a chaos run.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    /// Seed of the plan.
    pub seed: u64,
    /// Client operations.
    pub ops: usize,
    /// `sqlite://PATH` or `postgres://…`; `None`: a temporary SQLite file.
    pub store: Option<String>,
    /// The `idem` binary to run as `idem serve`.
    pub idem_bin: PathBuf,
    /// Concurrent client operations.
    pub clients: usize,
    /// Executor claim loops.
    pub executors: usize,
    /// Progress lines on stderr.
    pub progress: bool,
}

/// Figures of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    /// Tasks of the run.
    pub tasks: usize,
    /// Delivered.
    pub succeeded: usize,
    /// Failed.
    pub failed: usize,
    /// Cancelled.
    pub cancelled: usize,
    /// Not terminal.
    pub open: usize,
    /// Attempts of any kind.
    pub attempts: usize,
    /// Execute attempts.
    pub execute_attempts: usize,
    /// Reconcile attempts.
    pub reconcile_attempts: usize,
    /// Reports kept as evidence with disposition `stale_generation`.
    pub stale_reports_kept: usize,
    /// Submissions (final answers after retries).
    pub submissions: usize,
    /// `201 created` answers.
    pub created: usize,
    /// Replays (including scope lookups).
    pub replays: usize,
    /// 422 conflicts.
    pub conflicts: usize,
    /// Submissions without an answer after all retries.
    pub no_answer: usize,
    /// Cancel answers.
    pub cancel_answers: usize,
    /// Effects in the provider's ledger.
    pub provider_effects: usize,
    /// Pay requests the provider deduplicated.
    pub provider_deduplicated: usize,
    /// Lookups at the provider.
    pub provider_lookups: u64,
    /// Unexpected answers by kind.
    pub unexpected: BTreeMap<String, u64>,
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    /// Seed.
    pub seed: u64,
    /// Client operations.
    pub ops: usize,
    /// `sqlite` or `postgres`.
    pub store: String,
    /// Server processes.
    pub servers: usize,
    /// Wall time, ms.
    pub elapsed_ms: u64,
    /// Violated checks, all invariants together.
    pub violations: u64,
    /// Injected faults by kind, as the seed planned them (deterministic).
    pub faults: BTreeMap<String, u64>,
    /// What happened in this run (depends on the interleaving).
    pub faults_realized: BTreeMap<String, u64>,
    /// Per invariant.
    pub invariants: Vec<InvariantResult>,
    /// Figures.
    pub stats: Stats,
    /// The command that replays the same plan.
    pub reproduce: String,
}

/// Runs a chaos session and checks it.
///
/// # Errors
/// When the servers cannot be started or the records cannot be read.
/// Violations are reported in [`ChaosReport`], not as errors.
#[allow(clippy::too_many_lines)]
pub async fn run(opts: ChaosOptions) -> Result<ChaosReport> {
    if opts.ops == 0 || opts.clients == 0 || opts.executors == 0 {
        bail!("--ops, --clients and --executors must be positive");
    }
    let started = Instant::now();
    let postgres = opts
        .store
        .as_deref()
        .is_some_and(|s| s.starts_with("postgres://") || s.starts_with("postgresql://"));
    let plan = Arc::new(Plan::new(opts.seed, opts.ops, postgres));
    let dir = tempfile::Builder::new().prefix("idem-chaos-").tempdir()?;
    let (store_url, db) = match &opts.store {
        None => {
            let p = dir.path().join("idem.db");
            (format!("sqlite://{}", p.display()), Db::Sqlite(p))
        }
        Some(u) if u.starts_with("sqlite://") => (
            u.clone(),
            Db::Sqlite(PathBuf::from(u.trim_start_matches("sqlite://"))),
        ),
        Some(u) if postgres => (u.clone(), Db::connect_pg(u).await?),
        Some(u) => {
            bail!("--store must start with sqlite://, postgres:// or postgresql://, got `{u}`")
        }
    };
    let db = Arc::new(db);
    // A tenant of its own: the run's tasks are told apart from anything else in the store.
    let tenant = format!(
        "chaos-{}-{}",
        opts.seed,
        &Uuid::new_v4().simple().to_string()[..8]
    );
    let (client_key, exec_key) = {
        let (store, _tmp, _path) = server::open_store(Some(&store_url)).await?;
        let (_, c) = store.create_api_key(&tenant, Role::Client, None).await?;
        let (_, e) = store.create_api_key(&tenant, Role::Executor, None).await?;
        (c, e)
    };
    let config = dir.path().join("chaos.toml");
    std::fs::write(&config, chaos_config()?.to_toml()?)?;
    let servers = Arc::new(Servers {
        bin: opts.idem_bin.clone(),
        store_url: store_url.clone(),
        config,
        dir: dir.path().to_path_buf(),
        slots: (0..plan.servers)
            .map(|_| tokio::sync::Mutex::new(None))
            .collect(),
    });
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()?;
    let ctx = Arc::new(Ctx {
        plan: plan.clone(),
        targets: Targets {
            slots: RwLock::new(vec![None; plan.servers]),
            rr: AtomicUsize::new(0),
            http,
            client_key,
            exec_key,
        },
        provider: Provider::default(),
        log: Mutex::new(RunLog::default()),
        stop: AtomicBool::new(false),
        inflight: AtomicUsize::new(0),
        ordinals: Mutex::new(HashMap::new()),
    });
    let result = drive(&opts, &ctx, &servers, &db, &tenant).await;
    servers.stop_all().await;
    let (db_tasks, tasks) = result?;

    let (effects, effect_requests, provider_lookups) = ctx.provider.snapshot();
    let log = std::mem::take(&mut *ctx.log());
    let input = CheckInput {
        tasks,
        db_tasks,
        submits: log.submits,
        cancels: log.cancels,
        suspects: log.suspects,
        accepted_usage: log.accepted_usage,
        effects,
        effect_requests,
    };
    let invariants = check(&input);
    let violations = invariants.iter().map(|r| r.violations).sum();
    let stats = stats(&input, provider_lookups, log.unexpected);
    let mut reproduce = format!("idem chaos --seed {} --ops {}", opts.seed, opts.ops);
    if let Some(s) = &opts.store {
        reproduce.push_str(&format!(" --store {s}"));
    }
    Ok(ChaosReport {
        seed: opts.seed,
        ops: opts.ops,
        store: if postgres { "postgres" } else { "sqlite" }.to_owned(),
        servers: plan.servers,
        elapsed_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        violations,
        faults: plan.fault_counts(),
        faults_realized: log.realized,
        invariants,
        stats,
        reproduce,
    })
}

/// The load, the faults, the quiescence and the read-back.
async fn drive(
    opts: &ChaosOptions,
    ctx: &Arc<Ctx>,
    servers: &Arc<Servers>,
    db: &Arc<Db>,
    tenant: &str,
) -> Result<(Vec<DbTask>, Vec<TaskRecord>)> {
    let started = Instant::now();
    for i in 0..ctx.plan.servers {
        let url = servers.restart(i, false).await?;
        ctx.targets.set(i, Some(&url))?;
    }
    let executors: Vec<_> = (0..opts.executors)
        .map(|n| tokio::spawn(executor_loop(ctx.clone(), n)))
        .collect();
    let sem = Arc::new(Semaphore::new(opts.clients));
    let mut ops = JoinSet::new();
    let mut faults = JoinSet::new();
    let mut next_fault = 0;
    let n = ctx.plan.ops.len();
    let step = (n / 10).max(1);
    for i in 0..n {
        while let Some((at, fault)) = ctx.plan.server_faults.get(next_fault)
            && *at <= i
        {
            faults.spawn(inject(ctx.clone(), servers.clone(), db.clone(), *fault));
            next_fault += 1;
        }
        let permit = sem.clone().acquire_owned().await?;
        let c = ctx.clone();
        ops.spawn(async move {
            run_op(c, i).await;
            drop(permit);
        });
        while ops.try_join_next().is_some() {}
        if opts.progress && (i + 1) % step == 0 {
            eprintln!(
                "chaos: {}/{n} operations started ({:.1} s)",
                i + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    while ops.join_next().await.is_some() {}
    while let Some(r) = faults.join_next().await {
        r??;
    }
    if opts.progress {
        eprintln!(
            "chaos: all operations answered ({:.1} s); faults stop, waiting for every task to settle",
            started.elapsed().as_secs_f64()
        );
    }
    let quiet = Instant::now() + QUIESCE_LIMIT;
    loop {
        let rows = db.list(tenant).await?;
        let open = rows.iter().filter(|r| !is_terminal_word(&r.state)).count();
        if open == 0 || Instant::now() >= quiet {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    ctx.stop.store(true, Ordering::SeqCst);
    for h in executors {
        let _ = h.await;
    }
    let drained = Instant::now() + REPORT_PATIENCE + Duration::from_secs(5);
    while ctx.inflight.load(Ordering::SeqCst) > 0 && Instant::now() < drained {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let db_tasks = db.list(tenant).await?;
    if opts.progress {
        eprintln!(
            "chaos: reading {} tasks back ({:.1} s)",
            db_tasks.len(),
            started.elapsed().as_secs_f64()
        );
    }
    let tasks = read_back(ctx, &db_tasks).await?;
    Ok((db_tasks, tasks))
}

async fn read_one(ep: &Endpoint, id: Uuid) -> Result<TaskRecord> {
    let mut last = None;
    for _ in 0..10 {
        let got = async {
            let task = ep.client.get_task(id).await?;
            let attempts = ep.client.attempts(id).await?;
            let events = ep.client.events(id).await?;
            Ok::<_, ClientError>(TaskRecord {
                task,
                attempts,
                events,
            })
        }
        .await;
        match got {
            Ok(mut r) => {
                r.attempts.sort_by_key(|a| a.number);
                r.events.sort_by_key(|e| e.seq);
                return Ok(r);
            }
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Err(anyhow!(
        "reading task {id}: {}",
        last.map_or_else(String::new, |e| e.to_string())
    ))
}

async fn read_back(ctx: &Ctx, db_tasks: &[DbTask]) -> Result<Vec<TaskRecord>> {
    let ep = ctx.targets.pick().context("no server is up to read from")?;
    let sem = Arc::new(Semaphore::new(16));
    let mut set = JoinSet::new();
    for t in db_tasks {
        let ep = ep.clone();
        let id = t.id;
        let permit = sem.clone().acquire_owned().await?;
        set.spawn(async move {
            let r = read_one(&ep, id).await;
            drop(permit);
            r
        });
    }
    let mut out = Vec::with_capacity(db_tasks.len());
    while let Some(r) = set.join_next().await {
        out.push(r??);
    }
    out.sort_by_key(|r| r.task.id);
    Ok(out)
}

fn stats(input: &CheckInput, provider_lookups: u64, unexpected: BTreeMap<String, u64>) -> Stats {
    let mut s = Stats {
        tasks: input.tasks.len(),
        provider_effects: input.effects.len(),
        provider_deduplicated: input.effect_requests.iter().filter(|r| !r.moved).count(),
        provider_lookups,
        cancel_answers: input.cancels.len(),
        submissions: input.submits.len(),
        unexpected,
        ..Stats::default()
    };
    for r in &input.tasks {
        match r.task.state {
            TaskState::Succeeded => s.succeeded += 1,
            TaskState::Failed => s.failed += 1,
            TaskState::Cancelled => s.cancelled += 1,
            _ => s.open += 1,
        }
        s.attempts += r.attempts.len();
        for a in &r.attempts {
            match a.kind {
                AttemptKind::Execute => s.execute_attempts += 1,
                AttemptKind::Reconcile => s.reconcile_attempts += 1,
                AttemptKind::Other => {}
            }
            s.stale_reports_kept += a
                .evidence
                .iter()
                .filter(|e| e.disposition.as_deref() == Some("stale_generation"))
                .count();
        }
    }
    for sub in &input.submits {
        match &sub.answer {
            SubmitAnswer::Accepted {
                replayed,
                looked_up,
                ..
            } => {
                if *replayed || *looked_up {
                    s.replays += 1;
                } else {
                    s.created += 1;
                }
            }
            SubmitAnswer::Conflict { .. } => s.conflicts += 1,
            SubmitAnswer::NoAnswer => s.no_answer += 1,
            SubmitAnswer::Refused { .. } => {}
        }
    }
    s
}

fn counts_line(m: &BTreeMap<String, u64>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The human-readable summary.
pub fn render(r: &ChaosReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "idem chaos: seed {}, {} operations, {} store, {} server process(es), {:.1} s",
        r.seed,
        r.ops,
        r.store,
        r.servers,
        r.elapsed_ms as f64 / 1000.0
    );
    let _ = writeln!(
        out,
        "faults planned by the seed: {}",
        counts_line(&r.faults)
    );
    let _ = writeln!(
        out,
        "realized in this run:       {}",
        counts_line(&r.faults_realized)
    );
    let s = &r.stats;
    let _ = writeln!(
        out,
        "tasks {}: {} succeeded, {} failed, {} cancelled, {} open; attempts {} ({} execute, {} reconcile); {} stale reports kept",
        s.tasks,
        s.succeeded,
        s.failed,
        s.cancelled,
        s.open,
        s.attempts,
        s.execute_attempts,
        s.reconcile_attempts,
        s.stale_reports_kept
    );
    let _ = writeln!(
        out,
        "submissions {}: {} created, {} replays, {} conflicts, {} without answer; {} cancel answers; provider: {} effects, {} deduplicated requests, {} lookups",
        s.submissions,
        s.created,
        s.replays,
        s.conflicts,
        s.no_answer,
        s.cancel_answers,
        s.provider_effects,
        s.provider_deduplicated,
        s.provider_lookups
    );
    if !s.unexpected.is_empty() {
        let _ = writeln!(out, "unexpected answers: {}", counts_line(&s.unexpected));
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<38} {:<9} {:>9} {:>10}  statement",
        "invariant", "spec", "checked", "violations"
    );
    for i in &r.invariants {
        let _ = writeln!(
            out,
            "{:<38} {:<9} {:>9} {:>10}  {}",
            i.name, i.spec, i.checked, i.violations, i.title
        );
        for e in &i.examples {
            let _ = writeln!(out, "    ! {e}");
        }
    }
    let _ = writeln!(out);
    if r.violations == 0 {
        let _ = writeln!(out, "PASS: 0 violations");
    } else {
        let _ = writeln!(
            out,
            "FAIL: {} violations; reproduce with: {}",
            r.violations, r.reproduce
        );
    }
    out
}

/// `Err` (exit code 1) when the run found a violation, naming the seed.
///
/// # Errors
/// When `report.violations > 0`.
pub fn verdict(report: &ChaosReport) -> Result<()> {
    if report.violations == 0 {
        Ok(())
    } else {
        Err(anyhow!(
            "{} invariant violation(s); reproduce with: {}",
            report.violations,
            report.reproduce
        ))
    }
}

#[cfg(test)]
mod tests;
