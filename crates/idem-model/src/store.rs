//! The in-memory store: each function is one store transaction over the
//! model's [`State`], in the order of checks of `crates/idem-store/src/ops`
//! (which SQLite and PostgreSQL both run): load the records, call the real
//! transition of [`idem_core::machine`], write them back with the task's
//! version raised, and keep the evidence in the evidence table.
//!
//! | model transaction | store operation | machine function |
//! | --- | --- | --- |
//! | [`submit`] | `ops::submit::SubmitPlan` (scope row insert, then accept or read back) | [`machine::accept`] |
//! | [`claim`] | `ops::claim::Claim` (claimable tasks by `ready_at`, then id; authority read) | [`machine::claim`] |
//! | [`heartbeat`], [`acknowledge`], [`report`], [`release`] | `ops::attempts::{Heartbeat, Acknowledge, Report, Release}` (`on_attempt`: an invalid report writes nothing) | [`machine::heartbeat`], [`machine::acknowledge`], [`machine::report`], [`machine::release`] |
//! | [`cancel`], [`acknowledge_delivery`] | `ops::tasks::{Cancel, AcknowledgeDelivery}` (written when events were journaled) | [`machine::cancel`], [`machine::acknowledge_delivery`] |
//! | [`sweep`] | `ops::sweep::Sweep` (expire leases, wake backoffs, release keys) | [`machine::expire_lease`], [`machine::wake`], [`machine::release_key`] |
//! | [`operator`] | `ops::operator::{RetryNow, OperatorCancel, Resolve, Redrive}` | [`machine::operator`]'s four actions |

use std::fmt;

use idem_core::contract::FrozenContract;
use idem_core::fingerprint::canonical_request;
use idem_core::machine::operator::{self as op, Actor, By, Reason, Refused, Resolution};
use idem_core::machine::{self, Authority, Journal, NewTask, Rejection};
use idem_core::model::{AttemptKind, Disposition, EvidenceOutcome, Outcome, Timestamp};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::state::{Held, State, TICK_MS, TaskRow};

/// The model's store failed in a way no real store answers: the model's own
/// setup is wrong (a class missing from its configuration, params that do
/// not fingerprint). Never a finding about idem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The model's configuration does not parse or lacks a class.
    #[error("model configuration: {0}")]
    Config(String),
    /// A request of the model does not fingerprint.
    #[error("model request: {0}")]
    Request(String),
}

/// What a transaction answered, for traces.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// A new task was accepted.
    Created,
    /// Same scope and fingerprint: the original task.
    Replayed,
    /// Same scope, different fingerprint: nothing changed.
    Conflict,
    /// An attempt was leased.
    Leased {
        /// Attempt number.
        number: i64,
        /// Its generation.
        generation: i64,
        /// Its kind.
        kind: AttemptKind,
    },
    /// Claimable tasks ended instead of being leased (deadline, attempts).
    EndedInstead,
    /// Nothing was claimable.
    NothingClaimable,
    /// Accepted.
    Ok,
    /// A heartbeat's answer.
    Heartbeat {
        /// The lease end, in ticks.
        lease_end: i64,
        /// A cancellation is pending.
        cancel_requested: bool,
    },
    /// The state machine refused the call (its evidence may have been kept).
    Rejected(Rejection),
    /// An operator action was refused; nothing changed.
    Refused(Refused),
    /// The cancellation record after the call.
    Cancellation(idem_core::model::CancelStatus),
    /// The sweep's work.
    Swept {
        /// Leases expired.
        expired: usize,
        /// Backoffs woken.
        woken: usize,
        /// Keys released.
        released: usize,
    },
    /// Not a store call (the clock, a provider call, a crash).
    Local(&'static str),
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Created => f.write_str("201 created"),
            Answer::Replayed => f.write_str("replay of the original task"),
            Answer::Conflict => f.write_str("422 conflict: the key is bound to another request"),
            Answer::Leased {
                number,
                generation,
                kind,
            } => write!(
                f,
                "leased {kind} attempt #{number}, generation {generation}"
            ),
            Answer::EndedInstead => f.write_str("no attempt: the task ended at the claim"),
            Answer::NothingClaimable => f.write_str("nothing claimable"),
            Answer::Ok => f.write_str("ok"),
            Answer::Heartbeat {
                lease_end,
                cancel_requested,
            } => write!(
                f,
                "lease extended to t={lease_end}{}",
                if *cancel_requested {
                    ", cancellation requested"
                } else {
                    ""
                }
            ),
            Answer::Rejected(r) => write!(f, "refused: {r}"),
            Answer::Refused(r) => write!(f, "refused: {r}"),
            Answer::Cancellation(s) => write!(f, "cancellation {s}"),
            Answer::Swept {
                expired,
                woken,
                released,
            } => write!(
                f,
                "{expired} lease(s) expired, {woken} backoff(s) woken, {released} key(s) released"
            ),
            Answer::Local(s) => f.write_str(s),
        }
    }
}

/// The model's operation classes, scaled to the model clock (1 tick =
/// [`TICK_MS`] ms), checked by [`idem_core::config::Config::from_toml`] like
/// any configuration: `payment.release` is not safe to repeat (unknown
/// outcomes are reconciled), `generation.dispatch` is.
pub const MODEL_TOML: &str = r#"
[operations."payment.release"]
fingerprint = ["/amount"]
[operations."payment.release".retry]
safe = false
max_attempts = 2
backoff = { initial_ms = 100, multiplier = 2.0, max_ms = 400 }
deadline_ms = 300
usage_budget = 1
[operations."payment.release".lease]
default_ms = 200
max_ms = 200
[operations."payment.release".windows]
request_retry_ms = 0
reconciliation_ms = 0
retention_ms = 300
[operations."payment.release".fees]
price = 100
cancel_before_start = 0
cancel_after_start_fixed = 10
usage_unit_price = 1

[operations."generation.dispatch"]
fingerprint = ["/amount"]
[operations."generation.dispatch".retry]
safe = true
max_attempts = 2
backoff = { initial_ms = 100, multiplier = 2.0, max_ms = 400 }
deadline_ms = 300
usage_budget = 1
[operations."generation.dispatch".lease]
default_ms = 200
max_ms = 200
[operations."generation.dispatch".windows]
request_retry_ms = 0
reconciliation_ms = 0
retention_ms = 300
[operations."generation.dispatch".fees]
price = 50
cancel_before_start = 0
cancel_after_start_fixed = 5
usage_unit_price = 1
"#;

/// The non-safe class.
pub const UNSAFE_CLASS: &str = "payment.release";
/// The safe class.
pub const SAFE_CLASS: &str = "generation.dispatch";
/// The model's one tenant.
pub const TENANT: &str = "acme";

/// A request the model's clients send: a class and its params.
#[derive(Debug, Clone)]
pub struct Request {
    params: Value,
    fingerprint: String,
    canonical: String,
}

/// What the store needs that does not change during a run: the frozen
/// contracts and the two requests per key.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Per key: its class, its contract, the original request and a changed one.
    pub keys: Vec<KeySetup>,
    by: By,
}

/// One idempotency key of the model.
#[derive(Debug, Clone)]
pub struct KeySetup {
    /// The operation class.
    pub class: &'static str,
    /// The key as the client sends it.
    pub idempotency_key: String,
    contract: FrozenContract,
    original: Request,
    changed: Request,
}

impl Setup {
    /// The setup of `classes` (one per key, in key order).
    ///
    /// # Errors
    /// [`SetupError`] when the model's configuration or requests are wrong.
    pub fn new(classes: &[&'static str]) -> Result<Setup, SetupError> {
        let config = idem_core::config::Config::from_toml(MODEL_TOML)
            .map_err(|e| SetupError::Config(e.to_string()))?;
        let mut keys = Vec::new();
        for (i, class) in classes.iter().enumerate() {
            let contract = config
                .contract(class)
                .ok_or_else(|| SetupError::Config(format!("no class {class}")))?;
            let material = contract.fingerprint.clone().unwrap_or_default();
            let contract =
                FrozenContract::new(contract).map_err(|e| SetupError::Config(e.to_string()))?;
            let request = |amount: i64| -> Result<Request, SetupError> {
                let params = json!({"amount": amount, "payee": format!("payee-{i}")});
                let c = canonical_request(class, &params, &material)
                    .map_err(|e| SetupError::Request(e.to_string()))?;
                Ok(Request {
                    params,
                    fingerprint: c.fingerprint.to_string(),
                    canonical: c.canonical,
                })
            };
            keys.push(KeySetup {
                class,
                idempotency_key: format!("key-{i}"),
                contract,
                original: request(100)?,
                changed: request(200)?,
            });
        }
        let reason =
            Reason::parse("model checking").map_err(|e| SetupError::Config(e.to_string()))?;
        Ok(Setup {
            keys,
            by: By {
                actor: Actor::Cli {
                    user: "model".to_owned(),
                },
                reason,
            },
        })
    }
}

/// The instant of tick `t`.
pub fn at(t: i64) -> Timestamp {
    Timestamp(t * TICK_MS)
}

/// The tick of instant `ts` (rounded up: a lease ending inside a tick has ended at the next).
pub fn tick_of(ts: Timestamp) -> i64 {
    (ts.0 + TICK_MS - 1).div_euclid(TICK_MS)
}

/// Task id of the task at `index`.
pub fn task_id(index: usize) -> Uuid {
    Uuid::from_u128(index as u128 + 1)
}

/// Attempt id of attempt `number` of the task at `index`.
pub fn attempt_id(index: usize, number: i64) -> Uuid {
    Uuid::from_u128(((index as u128 + 1) << 64) | number as u128)
}

/// Writes what a transition journaled: the task's version is raised (the
/// compare-and-set of `persist`), evidence goes to the evidence table.
fn persist(row: &mut TaskRow, j: &Journal) {
    row.task.control.version += 1;
    for (_, ev) in &j.evidence {
        if ev.disposition == Disposition::StaleGeneration && ev.outcome != EvidenceOutcome::Ack {
            row.stale_report_kept = true;
        }
    }
    // Attempt rows are stored (and loaded) without their evidence.
    for a in &mut row.attempts {
        a.evidence.clear();
    }
}

/// `POST /v1/tasks` with key `key`, the original request or a changed one
/// (SPEC §2.1–2.3): the scope row decides; a taken scope answers a replay or
/// a conflict and writes nothing.
pub fn submit(s: &mut State, setup: &Setup, key: u8, changed: bool, now: i64) -> Answer {
    let Some(k) = setup.keys.get(usize::from(key)) else {
        return Answer::Local("no such key");
    };
    let req = if changed { &k.changed } else { &k.original };
    if let Some(i) = s.scope(key) {
        return if s.tasks[i].task.fingerprint == req.fingerprint {
            Answer::Replayed
        } else {
            Answer::Conflict
        };
    }
    let index = s.tasks.len();
    let (task, j) = machine::accept(
        NewTask {
            id: task_id(index),
            tenant: TENANT.to_owned(),
            operation: k.class.to_owned(),
            idempotency_key: k.idempotency_key.clone(),
            fingerprint: req.fingerprint.clone(),
            canonical_request: req.canonical.clone(),
            params: req.params.clone(),
            contract: k.contract.clone(),
            api_key_id: Uuid::from_u128(0xC11E),
            grant: None,
            traceparent: None,
        },
        at(now),
    );
    let mut row = TaskRow {
        key,
        task,
        attempts: Vec::new(),
        key_held: true,
        stale_report_kept: false,
        effect_possible: false,
        deliveries: 0,
        cancel_lost_to_delivery: false,
        pending_cancel_confirmed: false,
    };
    persist(&mut row, &j);
    s.tasks.push(row);
    s.ledger.push(Default::default());
    Answer::Created
}

/// `POST /v1/attempts/claim` by `executor` (max 1, any class): the claimable
/// tasks oldest `ready_at` first (then id); a candidate that ends at the
/// claim (deadline, attempts) is written and the next one tried. Tasks for
/// which `allowed` is false are not offered (the model's attempt bound).
pub fn claim(
    s: &mut State,
    executor: usize,
    now: i64,
    allowed: impl Fn(&TaskRow) -> bool,
) -> Answer {
    let mut candidates: Vec<usize> = (0..s.tasks.len())
        .filter(|&i| machine::is_claimable(&s.tasks[i].task, at(now)) && allowed(&s.tasks[i]))
        .collect();
    candidates.sort_by_key(|&i| (s.tasks[i].task.control.ready_at, s.tasks[i].task.id));
    let mut ended = false;
    for i in candidates {
        let row = &mut s.tasks[i];
        let mut j = Journal::default();
        let id = attempt_id(i, row.task.attempt_count + 1);
        let executor_id = format!("executor-{executor}");
        match machine::claim(
            &mut row.task,
            &mut j,
            id,
            &executor_id,
            None,
            Authority::Granted,
            at(now),
        ) {
            Ok(Some(attempt)) => {
                let held = Held {
                    task: i as u8,
                    attempt_id: attempt.id,
                    number: attempt.number,
                    generation: attempt.generation,
                    kind: attempt.kind,
                    lease_end: tick_of(attempt.lease_expires_at),
                    usage: 0,
                    effect_done: false,
                    acknowledged: false,
                    observed: None,
                    cancel_heard: false,
                };
                let answer = Answer::Leased {
                    number: attempt.number,
                    generation: attempt.generation,
                    kind: attempt.kind,
                };
                row.attempts.push(attempt);
                persist(row, &j);
                s.executors[executor] = crate::state::Executor::Holding(held);
                return answer;
            }
            Ok(None) => {
                persist(row, &j);
                ended = true;
            }
            Err(_) => {}
        }
    }
    if ended {
        Answer::EndedInstead
    } else {
        Answer::NothingClaimable
    }
}

/// `on_attempt` of `ops::attempts`: loads the task and the attempt, applies
/// `f`, and writes both unless `f` refused the input as invalid.
fn on_attempt<R>(
    s: &mut State,
    held: &Held,
    now: i64,
    f: impl FnOnce(
        &mut idem_core::model::Task,
        &mut idem_core::model::Attempt,
        &mut Journal,
        Timestamp,
    ) -> Result<R, Rejection>,
) -> Result<R, Rejection> {
    let Some(row) = s.tasks.get_mut(usize::from(held.task)) else {
        return Err(Rejection::InvalidReport("no such task".to_owned()));
    };
    let Some(pos) = row.attempts.iter().position(|a| a.id == held.attempt_id) else {
        return Err(Rejection::InvalidReport("no such attempt".to_owned()));
    };
    let mut task = row.task.clone();
    let mut attempt = row.attempts[pos].clone();
    let mut j = Journal::default();
    let res = f(&mut task, &mut attempt, &mut j, at(now));
    if let Err(Rejection::InvalidReport(_)) = res {
        return res;
    }
    row.task = task;
    row.attempts[pos] = attempt;
    persist(row, &j);
    res
}

/// `POST /v1/attempts/{id}/heartbeat` with the held generation and usage.
pub fn heartbeat(s: &mut State, held: &Held, now: i64) -> Answer {
    match on_attempt(s, held, now, |t, a, j, n| {
        machine::heartbeat(t, a, j, held.generation, Some(held.usage), n)
    }) {
        Ok(ack) => Answer::Heartbeat {
            lease_end: tick_of(ack.lease_expires_at),
            cancel_requested: ack.cancel_requested,
        },
        Err(e) => Answer::Rejected(e),
    }
}

/// `POST /v1/attempts/{id}/ack`: a device's "command acknowledged".
pub fn acknowledge(s: &mut State, held: &Held, now: i64) -> Answer {
    let body = json!({"generation": held.generation});
    match on_attempt(s, held, now, |t, a, j, n| {
        machine::acknowledge(t, a, j, held.generation, body, n)
    }) {
        Ok(()) => Answer::Ok,
        Err(e) => Answer::Rejected(e),
    }
}

/// `POST /v1/attempts/{id}/release`: the executor gives back an attempt it
/// never started.
pub fn release(s: &mut State, held: &Held, now: i64) -> Answer {
    match on_attempt(s, held, now, |t, a, j, n| {
        machine::release(t, a, j, held.generation, n)
    }) {
        Ok(()) => Answer::Ok,
        Err(e) => Answer::Rejected(e),
    }
}

/// What an executor reports (SPEC §4 `/report`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reported {
    /// `succeeded` with the result (execute).
    Succeeded,
    /// `failed` / `transient`.
    FailedTransient,
    /// `failed` / `invalid_input`.
    FailedInvalidInput,
    /// `unknown`.
    Unknown,
    /// `cancelled` (execute, answering a pending cancellation).
    Cancelled,
    /// `committed` with the result (reconcile: the ledger has the effect).
    Committed,
    /// `not_committed` (reconcile: the ledger has no effect).
    NotCommitted,
}

impl Reported {
    /// The outcome word.
    pub fn outcome(self) -> Outcome {
        match self {
            Reported::Succeeded => Outcome::Succeeded,
            Reported::FailedTransient | Reported::FailedInvalidInput => Outcome::Failed,
            Reported::Unknown => Outcome::Unknown,
            Reported::Cancelled => Outcome::Cancelled,
            Reported::Committed => Outcome::Committed,
            Reported::NotCommitted => Outcome::NotCommitted,
        }
    }

    fn failure_class(self) -> Option<idem_core::model::FailureClass> {
        use idem_core::model::FailureClass;
        match self {
            Reported::FailedTransient => Some(FailureClass::Transient),
            Reported::FailedInvalidInput => Some(FailureClass::InvalidInput),
            _ => None,
        }
    }
}

impl fmt::Display for Reported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.failure_class() {
            Some(c) => write!(f, "failed ({c})"),
            None => write!(f, "{}", self.outcome()),
        }
    }
}

/// The report `held` sends for `what`: the body an executor posts, and the
/// machine's [`machine::Report`] parsed from it.
pub fn report_of(held: &Held, what: Reported) -> machine::Report {
    let outcome = what.outcome();
    let delivers = matches!(what, Reported::Succeeded | Reported::Committed);
    let result = delivers.then(|| json!({"receipt": format!("r-{}", held.task)}));
    let external_txn_id = delivers.then(|| format!("txn-{}", held.task));
    let mut body = json!({
        "generation": held.generation,
        "outcome": outcome,
        "usage": held.usage,
    });
    if let Some(c) = what.failure_class() {
        body["failure_class"] = json!(c);
    }
    if let Some(r) = &result {
        body["result"] = r.clone();
        body["external_txn_id"] = json!(external_txn_id);
    }
    machine::Report {
        generation: held.generation,
        outcome,
        result,
        failure_class: what.failure_class(),
        message: None,
        usage: Some(held.usage),
        external_txn_id,
        body,
    }
}

/// `POST /v1/attempts/{id}/report`.
pub fn report(s: &mut State, held: &Held, what: Reported, now: i64) -> Answer {
    let r = report_of(held, what);
    match on_attempt(s, held, now, |t, a, j, n| machine::report(t, a, j, &r, n)) {
        Ok(()) => Answer::Ok,
        Err(e) => Answer::Rejected(e),
    }
}

/// `on_task` of `ops::tasks`: applies `f` and writes when it journaled.
fn on_task<R>(
    s: &mut State,
    index: usize,
    now: i64,
    f: impl FnOnce(&mut idem_core::model::Task, &mut Journal, Timestamp) -> R,
) -> Option<R> {
    let row = s.tasks.get_mut(index)?;
    let mut task = row.task.clone();
    let mut j = Journal::default();
    let r = f(&mut task, &mut j, at(now));
    if !j.events.is_empty() {
        row.task = task;
        persist(row, &j);
    }
    Some(r)
}

/// `POST /v1/tasks/{id}/cancel` by the client.
pub fn cancel(s: &mut State, index: usize, now: i64) -> Answer {
    match on_task(s, index, now, machine::cancel) {
        Some(c) => Answer::Cancellation(c.status),
        None => Answer::Local("no such task"),
    }
}

/// `POST /v1/tasks/{id}/delivery/ack` by the client.
pub fn acknowledge_delivery(s: &mut State, index: usize, now: i64) -> Answer {
    match on_task(s, index, now, machine::acknowledge_delivery) {
        Some(Ok(())) => Answer::Ok,
        Some(Err(e)) => Answer::Rejected(e),
        None => Answer::Local("no such task"),
    }
}

/// One sweep (`ops::sweep::Sweep`): expire the leases that ended, oldest
/// first; wake the backoffs that passed; release the keys past retention.
pub fn sweep(s: &mut State, now: i64) -> Answer {
    let t = at(now);
    let mut expired: Vec<(Timestamp, usize, usize)> = Vec::new();
    for (i, row) in s.tasks.iter().enumerate() {
        for (p, a) in row.attempts.iter().enumerate() {
            if a.state.is_active() && a.lease_expires_at <= t {
                expired.push((a.lease_expires_at, i, p));
            }
        }
    }
    expired.sort();
    let (mut n_expired, mut woken, mut released) = (0, 0, 0);
    for (_, i, p) in expired {
        let row = &mut s.tasks[i];
        let mut j = Journal::default();
        let mut attempt = row.attempts[p].clone();
        machine::expire_lease(&mut row.task, &mut attempt, &mut j, t);
        row.attempts[p] = attempt;
        persist(row, &j);
        n_expired += 1;
    }
    let mut due: Vec<(Timestamp, usize)> = s
        .tasks
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            r.task.state == idem_core::model::TaskState::RetryWait && r.task.control.ready_at <= t
        })
        .map(|(i, r)| (r.task.control.ready_at, i))
        .collect();
    due.sort();
    for (_, i) in due {
        let row = &mut s.tasks[i];
        let mut j = Journal::default();
        if machine::wake(&mut row.task, &mut j, t) {
            persist(row, &j);
            woken += 1;
        }
    }
    for row in &mut s.tasks {
        let due = row.key_held
            && row.task.state.is_terminal()
            && row.task.control.key_expires_at.is_some_and(|k| k <= t);
        if due {
            let mut j = Journal::default();
            row.key_held = false;
            machine::release_key(&mut row.task, &mut j, t);
            persist(row, &j);
            released += 1;
        }
    }
    Answer::Swept {
        expired: n_expired,
        woken,
        released,
    }
}

/// An operator action (SPEC §4 "Operator actions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperatorAction {
    /// `retry-now` of a `retry_wait` task.
    RetryNow,
    /// `cancel`.
    Cancel,
    /// `resolve` of a `reconciling` task as the provider's ledger says.
    Resolve,
    /// `redrive` of a `failed` task.
    Redrive,
}

impl fmt::Display for OperatorAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OperatorAction::RetryNow => "retry-now",
            OperatorAction::Cancel => "cancel",
            OperatorAction::Resolve => "resolve",
            OperatorAction::Redrive => "redrive",
        })
    }
}

/// Runs `action` on the task at `index` as `ops::operator` does. A resolve
/// says what the provider's ledger holds (`committed` when the effect
/// happened), as an operator who looked would.
pub fn operator(
    s: &mut State,
    setup: &Setup,
    index: usize,
    action: OperatorAction,
    now: i64,
) -> Answer {
    let by = &setup.by;
    let t = at(now);
    let applied = s.ledger.get(index).is_some_and(|l| l.applied);
    let Some(row) = s.tasks.get_mut(index) else {
        return Answer::Local("no such task");
    };
    let mut task = row.task.clone();
    let mut j = Journal::default();
    let res = match action {
        OperatorAction::RetryNow => op::retry_now(&mut task, &mut j, t, by),
        OperatorAction::Cancel => {
            let c = op::cancel(&mut task, &mut j, t, by);
            if !j.events.is_empty() {
                row.task = task;
                persist(row, &j);
            }
            return Answer::Cancellation(c.status);
        }
        OperatorAction::Resolve => {
            let active = task.control.active_attempt_id;
            let pos = active.and_then(|id| row.attempts.iter().position(|a| a.id == id));
            let mut attempt = pos.map(|p| row.attempts[p].clone());
            let resolution = if applied {
                Resolution::Committed {
                    result: json!({"receipt": format!("r-{index}")}),
                    external_txn_id: Some(format!("txn-{index}")),
                }
            } else {
                Resolution::NotCommitted
            };
            let res = op::resolve(&mut task, attempt.as_mut(), &mut j, t, by, resolution);
            if res.is_ok()
                && let (Some(p), Some(a)) = (pos, attempt)
            {
                row.attempts[p] = a;
            }
            res
        }
        OperatorAction::Redrive => op::redrive(&mut task, &mut j, t, by, Authority::Granted),
    };
    match res {
        Ok(()) => {
            row.task = task;
            persist(row, &j);
            Answer::Ok
        }
        Err(e) => Answer::Refused(e),
    }
}
