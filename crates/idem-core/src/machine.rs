//! The task state machine (SPEC §2.4–2.10, §3; RETRY-01, CANCEL-01).
//!
//! Every transition is one function that takes the current records by
//! `&mut`, the time `now` (epoch ms, chosen by the store: the database clock
//! for PostgreSQL) and the input, changes the records in place and appends
//! the audit events to a [`Journal`]. A store runs each function inside one
//! transaction: it loads the rows, calls the function, and writes back every
//! record together with the journal, with a compare-and-set on the task's
//! version. A function that returns `Err` may still have changed the records
//! (a stale report is kept as evidence; an expired lease is expired first):
//! the store persists them all the same, then answers with the error.

use serde_json::Value;
use uuid::Uuid;

use crate::config::MIN_LEASE_MS;
use crate::contract::FrozenContract;
use crate::model::EventKind;
use crate::model::event as ev;
use crate::model::{
    AppliedReport, Attempt, AttemptKind, AttemptState, CancelStatus, Cancellation, Delivery,
    Disposition, EffectEvidence, EffectReport, Event, EventData, Evidence, EvidenceOutcome,
    Failure, FailureClass, Outcome, SecondEffect, Task, TaskControl, TaskState, Timestamp,
};

/// Whether old generations are refused (SPEC §2.4). Only the `broken-fencing`
/// feature, which exists so the chaos checker can prove it catches a broken
/// build, turns it off; no release build enables it.
const FENCING: bool = !cfg!(feature = "broken-fencing");

/// Whether an `unknown` outcome is reconciled before anything is repeated
/// (SPEC §2.5). Only the `broken-reconcile` feature, which exists so the model
/// checker (`idem-lab verify`) can prove it finds a repeat without reconciliation,
/// turns it off; no release build enables it.
const RECONCILE_UNKNOWN: bool = !cfg!(feature = "broken-reconcile");

/// Events (and evidence) produced by one transition, to be written in the
/// same transaction as the records (SPEC §2.10).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Journal {
    /// New events, in order, with their sequence numbers already assigned.
    pub events: Vec<Event>,
    /// New evidence rows, by attempt id.
    pub evidence: Vec<(Uuid, Evidence)>,
    /// New effect reports (a transaction id the task had not reported before).
    pub effect_reports: Vec<EffectReport>,
    /// Newly suspected second effects.
    pub second_effects: Vec<SecondEffect>,
    /// Second effects newly acknowledged (their acknowledgment set).
    pub acknowledged: Vec<SecondEffect>,
}

impl Journal {
    /// Appends an event to `task`'s history: assigns the next sequence number and
    /// touches `updated_at`.
    ///
    /// Every event is a transition's: after it, the task's effect reports are
    /// checked against its delivery or its end ([`Journal::raise_second_effects`]).
    pub fn record(&mut self, task: &mut Task, now: Timestamp, data: EventData) {
        task.control.event_seq += 1;
        task.updated_at = now;
        let kind = data.kind();
        self.events.push(Event {
            seq: task.control.event_seq,
            kind,
            at: now,
            data,
        });
        if !matches!(
            kind,
            EventKind::SecondEffectSuspected | EventKind::SecondEffectAcknowledged
        ) {
            self.raise_second_effects(task, now);
        }
    }

    /// Keeps an effect report (SPEC §2 "Second effects"): evidence that the
    /// external effect happened under `external_txn_id`. Only the first
    /// report of each distinct id (`null` counted as one) is kept; the
    /// transition's next event checks it against the delivery.
    fn effect_report(&mut self, task: &mut Task, report: EffectReport) {
        let reports = &mut task.control.effect_reports;
        if reports
            .iter()
            .any(|r| r.external_txn_id == report.external_txn_id)
        {
            return;
        }
        reports.push(report.clone());
        task.control.effect_report_count += 1;
        self.effect_reports.push(report);
    }

    /// Raises `second_effect_suspected` once per distinct transaction id
    /// (SPEC §2 "Second effects") for each effect report that shows an
    /// effect besides the delivered one: on a delivered task, a report whose
    /// id is not `null` and differs from the delivery's (a delivery without
    /// an id is compared with nothing); on a task that ended without delivery
    /// (`cancelled`, `failed`), every report, `null` id included.
    fn raise_second_effects(&mut self, task: &mut Task, now: Timestamp) {
        let delivered = task.delivery.as_ref().map(|d| d.external_txn_id.clone());
        let undelivered_end =
            delivered.is_none() && matches!(task.state, TaskState::Cancelled | TaskState::Failed);
        let raise: Vec<EffectReport> = task
            .control
            .effect_reports
            .iter()
            .filter(|r| {
                let shows = match &delivered {
                    Some(Some(d)) => r.external_txn_id.as_ref().is_some_and(|id| id != d),
                    Some(None) => false,
                    None => undelivered_end,
                };
                shows
                    && !task
                        .second_effects
                        .iter()
                        .any(|s| s.external_txn_id == r.external_txn_id)
            })
            .cloned()
            .collect();
        for r in raise {
            let effect = SecondEffect {
                external_txn_id: r.external_txn_id.clone(),
                attempt_id: r.attempt_id,
                generation: r.generation,
                evidence: r.evidence,
                suspected_at: now,
                acknowledgment: None,
            };
            task.second_effects.push(effect.clone());
            self.second_effects.push(effect);
            let data = EventData::SecondEffectSuspected(ev::SecondEffectSuspected {
                attempt_id: r.attempt_id,
                delivered_txn_id: delivered.clone().flatten(),
                evidence: r.evidence,
                external_txn_id: r.external_txn_id,
                generation: r.generation,
                state: task.state,
            });
            self.record(task, now, data);
        }
    }

    fn evidence(&mut self, attempt: &mut Attempt, ev: Evidence) {
        attempt.evidence.push(ev.clone());
        self.evidence.push((attempt.id, ev));
    }
}

/// Why a transition was refused. The records may still have changed (see module docs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The report or heartbeat carries a generation that no longer holds the
    /// lease (SPEC §2.4). HTTP 409 `STALE_GENERATION`; the report is kept as evidence.
    #[error("generation {presented} is stale; the task's current generation is {current}")]
    StaleGeneration {
        /// The generation the executor presented.
        presented: i64,
        /// The task's current generation.
        current: i64,
    },
    /// The attempt already has a different outcome. HTTP 409 `ATTEMPT_ALREADY_REPORTED`.
    #[error("attempt already reported `{existing}`; a different report is kept as evidence only")]
    AlreadyReported {
        /// The outcome already recorded.
        existing: Outcome,
    },
    /// The report does not fit the attempt (HTTP 400 `INVALID_REQUEST`, nothing stored).
    #[error("{0}")]
    InvalidReport(String),
    /// The task has no delivery to acknowledge (HTTP 409 `NOT_DELIVERED`).
    #[error("the task has no delivery yet")]
    NotDelivered,
    /// The task cannot be claimed now.
    #[error("the task is not claimable")]
    NotClaimable,
    /// A release of an attempt its device acknowledged: the command was
    /// sent, so the attempt started. HTTP 409 `ATTEMPT_ALREADY_REPORTED`.
    #[error("the attempt was acknowledged by its device: it started and cannot be released")]
    Acknowledged,
    /// A release of an attempt whose heartbeats recorded usage: it consumed
    /// something, so it started. HTTP 409 `ATTEMPT_ALREADY_REPORTED`.
    #[error("the attempt recorded usage {usage}: it started and cannot be released")]
    UsageRecorded {
        /// The attempt's usage total so far.
        usage: i64,
    },
}

/// What the store learned about the submitting key before a claim (SPEC §2.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authority {
    /// The key is active and still granted the operation class.
    Granted,
    /// The key was revoked or lost the grant.
    Revoked,
}

/// Input of [`accept`].
#[derive(Debug, Clone)]
pub struct NewTask {
    /// New task id (UUID v7).
    pub id: Uuid,
    /// Tenant.
    pub tenant: String,
    /// Operation class.
    pub operation: String,
    /// Idempotency key.
    pub idempotency_key: String,
    /// `sha256:<hex>` fingerprint.
    pub fingerprint: String,
    /// RFC 8785 canonical request.
    pub canonical_request: String,
    /// Params as submitted.
    pub params: Value,
    /// Contract frozen now.
    pub contract: FrozenContract,
    /// The submitting API key.
    pub api_key_id: Uuid,
    /// The key's grant at acceptance (its operation list; `None` = all), for the audit.
    pub grant: Option<Vec<String>>,
    /// The submit's W3C `traceparent`, if it carried one.
    pub traceparent: Option<crate::trace::TraceParent>,
    /// Claim priority 1–5 (SPEC §4).
    pub priority: i64,
    /// The class's fairness key value for these params (SPEC §2.13).
    pub fairness_key: Option<String>,
}

/// Accepts a new task: state `queued`, generation 0, event `task_submitted`
/// carrying the fingerprint, canonical request and acceptance decision (SPEC §2.10).
pub fn accept(new: NewTask, now: Timestamp) -> (Task, Journal) {
    let deadline_at = now.plus_ms(new.contract.retry.deadline_ms);
    let mut task = Task {
        id: new.id,
        operation: new.operation,
        idempotency_key: new.idempotency_key,
        fingerprint: new.fingerprint,
        params: new.params,
        state: TaskState::Queued,
        generation: 0,
        attempt_count: 0,
        usage: 0,
        contract: new.contract,
        cancellation: None,
        delivery: None,
        failure: None,
        created_at: now,
        updated_at: now,
        traceparent: new.traceparent,
        priority: new.priority,
        control: TaskControl {
            tenant: new.tenant,
            api_key_id: new.api_key_id,
            canonical_request: new.canonical_request,
            version: 0,
            event_seq: 0,
            execute_count: 0,
            attempts_granted: 0,
            next_kind: Some(AttemptKind::Execute),
            active_attempt_id: None,
            ready_at: now,
            deadline_at,
            terminal_at: None,
            key_expires_at: None,
            effect_reports: Vec::new(),
            effect_report_count: 0,
            concurrency_key: None,
            fairness_key: new.fairness_key,
        },
        second_effects: Vec::new(),
    };
    let mut j = Journal::default();
    let data = EventData::TaskSubmitted(ev::TaskSubmitted {
        canonical_request: task.control.canonical_request.clone(),
        decision: ev::Decision {
            accepted: true,
            api_key_id: new.api_key_id,
            config_version: task.contract.config_version.clone(),
            grant: new.grant,
        },
        fingerprint: task.fingerprint.clone(),
        idempotency_key: task.idempotency_key.clone(),
        // The full contract is on the task row, which never changes it; the
        // event names its version and price.
        price: task.contract.price,
    });
    j.record(&mut task, now, data);
    (task, j)
}

/// Whether a claim may lease `task` at `now`.
pub fn is_claimable(task: &Task, now: Timestamp) -> bool {
    let state_ok = matches!(
        task.state,
        TaskState::Queued | TaskState::Reconciling | TaskState::RetryWait
    );
    state_ok
        && task.control.active_attempt_id.is_none()
        && task.control.next_kind.is_some()
        && task.control.ready_at <= now
}

/// Leases a new attempt of `task` to `executor_id` (SPEC §2.4, RETRY-01).
///
/// The attempt gets number `attempt_count + 1` and generation `generation + 1`.
/// Before an execute attempt the submitting key's authority, the deadline and
/// the attempt limit are checked; if one fails the task ends `failed` and
/// `Ok(None)` is returned. Reconcile attempts only ask the external system, so
/// they run even after a revocation (an unknown outcome must still be learned).
/// `lease_ms` is clamped to the contract's bounds; `None` uses the default.
///
/// # Errors
/// [`Rejection::NotClaimable`] when [`is_claimable`] is false.
pub fn claim(
    task: &mut Task,
    j: &mut Journal,
    attempt_id: Uuid,
    executor_id: &str,
    lease_ms: Option<i64>,
    authority: Authority,
    now: Timestamp,
) -> Result<Option<Attempt>, Rejection> {
    if !is_claimable(task, now) {
        return Err(Rejection::NotClaimable);
    }
    let kind = task.control.next_kind.unwrap_or(AttemptKind::Execute);
    if kind == AttemptKind::Execute {
        if authority == Authority::Revoked {
            fail(
                task,
                j,
                now,
                FailureClass::PermissionDenied,
                "the submitting API key was revoked or lost its grant before the next attempt (SPEC §2.8)",
            );
            return Ok(None);
        }
        if now >= task.control.deadline_at {
            fail(
                task,
                j,
                now,
                FailureClass::DeadlineExceeded,
                "deadline passed before the next attempt",
            );
            return Ok(None);
        }
        if task.control.execute_count >= task.execute_limit() {
            fail(
                task,
                j,
                now,
                FailureClass::AttemptsExhausted,
                "all execute attempts used",
            );
            return Ok(None);
        }
        task.control.execute_count += 1;
        task.state = TaskState::Running;
    } else {
        task.state = TaskState::Reconciling;
    }
    let lease = &task.contract.lease;
    let lease_ms = lease_ms
        .unwrap_or(lease.default_ms)
        .clamp(MIN_LEASE_MS, lease.max_ms.max(MIN_LEASE_MS));
    task.attempt_count += 1;
    task.generation += 1;
    task.control.active_attempt_id = Some(attempt_id);
    task.control.next_kind = None;
    let attempt = Attempt {
        id: attempt_id,
        task_id: task.id,
        number: task.attempt_count,
        generation: task.generation,
        kind,
        state: AttemptState::Leased,
        executor_id: executor_id.to_owned(),
        leased_at: now,
        lease_expires_at: now.plus_ms(lease_ms),
        usage: 0,
        external_txn_id: None,
        evidence: Vec::new(),
        lease_ms,
        report: None,
    };
    let data = EventData::AttemptLeased(ev::AttemptLeased {
        attempt_id: attempt.id,
        executor_id: executor_id.to_owned(),
        generation: attempt.generation,
        kind,
        lease_expires_at: attempt.lease_expires_at,
        number: attempt.number,
        retry_count: task.control.execute_count - 1,
    });
    j.record(task, now, data);
    Ok(Some(attempt))
}

/// Answer to a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatAck {
    /// The extended lease end.
    pub lease_expires_at: Timestamp,
    /// The length the lease was extended by, ms (the attempt's lease length).
    pub lease_ms: i64,
    /// Whether a cancellation is pending: the executor should stop and report `cancelled`.
    pub cancel_requested: bool,
}

/// Checks that `generation` still holds the lease of `attempt` (SPEC §2.4). If
/// the lease ran out by `now`, the expiry is applied first, so the caller is stale.
fn fence(
    task: &mut Task,
    attempt: &mut Attempt,
    j: &mut Journal,
    generation: i64,
    now: Timestamp,
) -> Result<(), Rejection> {
    let stale = Rejection::StaleGeneration {
        presented: generation,
        current: task.generation,
    };
    if !FENCING {
        return Ok(());
    }
    if generation != attempt.generation || generation != task.generation {
        return Err(stale);
    }
    if !attempt.state.is_active() || task.control.active_attempt_id != Some(attempt.id) {
        return Err(stale);
    }
    if now >= attempt.lease_expires_at {
        expire_lease(task, attempt, j, now);
        return Err(Rejection::StaleGeneration {
            presented: generation,
            current: task.generation,
        });
    }
    Ok(())
}

/// Largest usage total a task records: 2^53−1, so every integer idem
/// answers with is one its strict JSON reader accepts (I-JSON, RFC 7493 §2.2).
const MAX_USAGE: i64 = crate::json::MAX_SAFE_INTEGER as i64;

fn add_usage(task: &mut Task, attempt: &mut Attempt, usage: Option<i64>) {
    if let Some(u) = usage
        && u > attempt.usage
    {
        task.usage = task.usage.saturating_add(u - attempt.usage).min(MAX_USAGE);
        attempt.usage = u;
    }
}

/// Extends the lease of a live attempt by its lease length and records usage
/// (the attempt's total so far; the largest value counts), with a
/// `usage_recorded` event when the total rises.
///
/// # Errors
/// [`Rejection::StaleGeneration`] for an old generation or an expired lease.
pub fn heartbeat(
    task: &mut Task,
    attempt: &mut Attempt,
    j: &mut Journal,
    generation: i64,
    usage: Option<i64>,
    now: Timestamp,
) -> Result<HeartbeatAck, Rejection> {
    fence(task, attempt, j, generation, now)?;
    let before = attempt.usage;
    add_usage(task, attempt, usage);
    if attempt.usage != before {
        // The history holds usage (SPEC §2.10): a total raised by a heartbeat
        // is recorded when it is raised, not only with the report.
        let data = EventData::UsageRecorded(ev::UsageRecorded {
            attempt_id: attempt.id,
            generation,
            task_usage: task.usage,
            usage: attempt.usage,
        });
        j.record(task, now, data);
    }
    attempt.lease_expires_at = now.plus_ms(attempt.lease_ms);
    task.updated_at = now;
    Ok(HeartbeatAck {
        lease_expires_at: attempt.lease_expires_at,
        lease_ms: attempt.lease_ms,
        cancel_requested: task.cancel_pending(),
    })
}

/// A device gateway's "command acknowledged" (SPEC §2 "not promised"; CANCEL-01):
/// the attempt becomes `acknowledged`, the task stays `running`. Idempotent.
///
/// # Errors
/// [`Rejection::StaleGeneration`] for an old generation or an expired lease.
pub fn acknowledge(
    task: &mut Task,
    attempt: &mut Attempt,
    j: &mut Journal,
    generation: i64,
    body: Value,
    now: Timestamp,
) -> Result<(), Rejection> {
    let ack = |disposition| evidence(now, generation, EvidenceOutcome::Ack, body, disposition);
    if let Err(e) = fence(task, attempt, j, generation, now) {
        j.evidence(attempt, ack(Disposition::StaleGeneration));
        return Err(e);
    }
    if attempt.state == AttemptState::Leased {
        attempt.state = AttemptState::Acknowledged;
        j.evidence(attempt, ack(Disposition::Applied));
        let data = EventData::CommandAcknowledged(ev::CommandAcknowledged {
            attempt_id: attempt.id,
            generation,
        });
        j.record(task, now, data);
    } else {
        j.evidence(attempt, ack(Disposition::Repeat));
    }
    Ok(())
}

/// An executor gives back an attempt it never started (SPEC §4 `/release`):
/// a worker that is shutting down, or a claim whose answer never reached its
/// executor. Fenced like a report: `generation` must hold the live lease.
///
/// The attempt ends `released` and counts against no limit: an execute
/// attempt is taken off the execute count (`max_attempts`, and the count a
/// cancellation's fee reads). No reconcile follows, since nothing ran. The
/// task is claimable at once: an execute attempt's task is `queued` (or,
/// with a cancellation pending, `cancelled` with the fee of a task that never
/// started, unless an earlier execute attempt did); a reconcile attempt's
/// task stays `reconciling` with the reconcile due now. Event
/// `attempt_released`.
///
/// An exact repeat (the attempt is already `released` and `generation` is
/// its own: the executor's answer was lost) is answered `Ok` and changes
/// nothing.
///
/// # Errors
/// [`Rejection::AlreadyReported`] for an attempt with an outcome,
/// [`Rejection::Acknowledged`] for one its device acknowledged,
/// [`Rejection::UsageRecorded`] for one whose heartbeats recorded usage
/// above 0 (all three started); [`Rejection::StaleGeneration`] for an old generation or an
/// expired lease (the expiry is applied first).
pub fn release(
    task: &mut Task,
    attempt: &mut Attempt,
    j: &mut Journal,
    generation: i64,
    now: Timestamp,
) -> Result<(), Rejection> {
    if generation == attempt.generation {
        if attempt.state == AttemptState::Released {
            return Ok(());
        }
        if let Some(existing) = attempt.report.as_ref().map(|a| a.outcome) {
            return Err(Rejection::AlreadyReported { existing });
        }
        if attempt.state == AttemptState::Acknowledged {
            return Err(Rejection::Acknowledged);
        }
        if attempt.usage > 0 {
            return Err(Rejection::UsageRecorded {
                usage: attempt.usage,
            });
        }
    }
    fence(task, attempt, j, generation, now)?;
    attempt.state = AttemptState::Released;
    task.control.active_attempt_id = None;
    if attempt.kind == AttemptKind::Execute {
        task.control.execute_count = (task.control.execute_count - 1).max(0);
    }
    let data = EventData::AttemptReleased(ev::AttemptReleased {
        attempt_id: attempt.id,
        execute_count: task.control.execute_count,
        executor_id: attempt.executor_id.clone(),
        generation,
        kind: attempt.kind,
        number: attempt.number,
    });
    j.record(task, now, data);
    if attempt.kind == AttemptKind::Reconcile {
        // The unknown outcome it was to settle is still unknown, also with a
        // cancellation pending (SPEC §2.5, §2.7).
        task.state = TaskState::Reconciling;
        task.control.next_kind = Some(AttemptKind::Reconcile);
        task.control.ready_at = now;
    } else if task.cancel_pending() {
        confirm_cancel(task, j, now);
    } else {
        task.state = TaskState::Queued;
        task.control.next_kind = Some(AttemptKind::Execute);
        task.control.ready_at = now;
    }
    Ok(())
}

/// An executor's report (SPEC §4 `/report`).
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The generation the executor holds.
    pub generation: i64,
    /// What happened.
    pub outcome: Outcome,
    /// Result document (`succeeded`, `committed`).
    pub result: Option<Value>,
    /// Required with `failed`.
    pub failure_class: Option<FailureClass>,
    /// Free text, at most [`MAX_MESSAGE_CHARS`] characters (the entry
    /// point refuses a longer one).
    pub message: Option<String>,
    /// The attempt's total usage so far.
    pub usage: Option<i64>,
    /// The external system's transaction id.
    pub external_txn_id: Option<String>,
    /// The raw body, kept as evidence and used to detect exact repeats.
    pub body: Value,
}

/// Longest report `message` idem stores, in characters (Unicode scalar
/// values; SPEC §7): a stack trace's worth. A longer one is refused whole
/// (400, nothing stored), never cut by the server: an executor trims its
/// text to this before sending.
pub const MAX_MESSAGE_CHARS: usize = 4096;

fn evidence(
    now: Timestamp,
    generation: i64,
    outcome: EvidenceOutcome,
    body: Value,
    disposition: Disposition,
) -> Evidence {
    Evidence {
        received_at: now,
        generation,
        outcome,
        body,
        disposition,
    }
}

fn validate_report(attempt: &Attempt, r: &Report) -> Result<(), Rejection> {
    let bad = |m: &str| Err(Rejection::InvalidReport(m.to_owned()));
    let allowed = match attempt.kind {
        AttemptKind::Execute => matches!(
            r.outcome,
            Outcome::Succeeded | Outcome::Failed | Outcome::Unknown | Outcome::Cancelled
        ),
        AttemptKind::Reconcile => matches!(
            r.outcome,
            Outcome::Committed | Outcome::NotCommitted | Outcome::Failed | Outcome::Unknown
        ),
    };
    if !allowed {
        return Err(Rejection::InvalidReport(format!(
            "outcome `{}` does not apply to a `{}` attempt",
            r.outcome, attempt.kind
        )));
    }
    // Only the classes an executor observes may be reported, with any
    // outcome; the others are idem's own decisions.
    if r.failure_class.is_some_and(|c| !c.is_reportable()) {
        return bad("failure_class must be transient, invalid_input or permission_denied");
    }
    if r.outcome == Outcome::Failed && r.failure_class.is_none() {
        return bad("a `failed` report needs a `failure_class`");
    }
    if r.usage.is_some_and(|u| u < 0) {
        return bad("usage must not be negative");
    }
    Ok(())
}

/// Applies an executor's report (SPEC §2.4–2.7).
///
/// Order of checks: shape (400, nothing stored) → generation (stale → evidence,
/// 409) → earlier outcome (exact repeat → evidence, Ok; different → evidence,
/// 409) → lease expiry (expire, then stale) → `cancelled` with no pending
/// cancellation (400, nothing stored). Then, by outcome:
/// `succeeded`/`committed` deliver (a pending cancel becomes `too_late`);
/// `failed` confirms a pending cancel, else decides a retry by failure class;
/// `unknown` moves to `reconciling`; `cancelled` confirms the cancel;
/// `not_committed` confirms a pending cancel or queues a new execute attempt.
///
/// # Errors
/// [`Rejection::InvalidReport`], [`Rejection::StaleGeneration`], [`Rejection::AlreadyReported`].
pub fn report(
    task: &mut Task,
    attempt: &mut Attempt,
    j: &mut Journal,
    r: &Report,
    now: Timestamp,
) -> Result<(), Rejection> {
    validate_report(attempt, r)?;
    let outcome = EvidenceOutcome::from(r.outcome);
    // An exact repeat of the applied report (its answer was lost) is answered
    // as before, even after newer attempts exist (SPEC §4 "Details").
    if attempt.report.as_ref().is_some_and(|a| a.body == r.body) {
        j.evidence(
            attempt,
            evidence(
                now,
                r.generation,
                outcome,
                r.body.clone(),
                Disposition::Repeat,
            ),
        );
        return Ok(());
    }
    if FENCING && (r.generation != attempt.generation || r.generation != task.generation) {
        let e = Rejection::StaleGeneration {
            presented: r.generation,
            current: task.generation,
        };
        return Err(keep_stale_report(task, attempt, j, r, now, e));
    }
    if let Some(existing) = attempt.report.as_ref().map(|a| a.outcome) {
        j.evidence(
            attempt,
            evidence(
                now,
                r.generation,
                outcome,
                r.body.clone(),
                Disposition::AlreadyReported,
            ),
        );
        keep_effect_report(
            task,
            attempt.id,
            j,
            r,
            outcome,
            EffectEvidence::DuplicateReport,
            now,
        );
        let data = EventData::DuplicateReport(ev::DuplicateReport {
            attempt_id: attempt.id,
            existing,
            outcome,
        });
        j.record(task, now, data);
        return Err(Rejection::AlreadyReported { existing });
    }
    if let Err(e) = fence(task, attempt, j, r.generation, now) {
        return Err(keep_stale_report(task, attempt, j, r, now, e));
    }
    // Only meaningful as the answer to a pending cancellation. Checked once
    // the report is known to be current: a late `cancelled` from an old
    // generation or an expired lease is kept as evidence like any other
    // (SPEC §2.4), not refused as input.
    if r.outcome == Outcome::Cancelled && !task.cancel_pending() {
        return Err(Rejection::InvalidReport(
            "`cancelled` answers a pending cancellation, and none is pending".to_owned(),
        ));
    }
    add_usage(task, attempt, r.usage);
    attempt.report = Some(AppliedReport {
        outcome: r.outcome,
        body: r.body.clone(),
    });
    if r.external_txn_id.is_some() {
        attempt.external_txn_id.clone_from(&r.external_txn_id);
    }
    j.evidence(
        attempt,
        evidence(
            now,
            r.generation,
            outcome,
            r.body.clone(),
            Disposition::Applied,
        ),
    );
    keep_effect_report(
        task,
        attempt.id,
        j,
        r,
        outcome,
        EffectEvidence::AppliedReport,
        now,
    );
    task.control.active_attempt_id = None;
    let observed = ev::ReportApplied {
        attempt_id: attempt.id,
        external_txn_id: r.external_txn_id.clone(),
        failure_class: r.failure_class,
        generation: r.generation,
        kind: attempt.kind,
        message: r.message.clone(),
        outcome,
        usage: attempt.usage,
    };
    match r.outcome {
        Outcome::Succeeded | Outcome::Committed => {
            attempt.state = if r.outcome == Outcome::Succeeded {
                AttemptState::Succeeded
            } else {
                AttemptState::Committed
            };
            let data = if r.outcome == Outcome::Committed {
                EventData::Reconciled(observed)
            } else {
                EventData::CompletionObserved(observed)
            };
            j.record(task, now, data);
            let result = r.result.clone().unwrap_or(Value::Null);
            deliver(task, j, now, result, r.external_txn_id.clone());
        }
        Outcome::Failed => {
            attempt.state = AttemptState::Failed;
            j.record(task, now, EventData::AttemptFailed(observed));
            let class = r.failure_class.unwrap_or(FailureClass::Transient);
            let message = r.message.clone().unwrap_or_default();
            if attempt.kind == AttemptKind::Reconcile {
                // Only `committed` / `not_committed` settle an unknown outcome,
                // also when a cancellation is pending (SPEC §2.5, §2.7).
                schedule_reconcile(task, j, now, "reconcile attempt failed");
            } else if task.cancel_pending() {
                confirm_cancel(task, j, now);
            } else if class == FailureClass::Transient {
                retry_after_transient(task, j, now, &message);
            } else {
                fail(task, j, now, class, &message);
            }
        }
        Outcome::Unknown => {
            attempt.state = AttemptState::Unknown;
            j.record(task, now, EventData::OutcomeUnknown(observed));
            if RECONCILE_UNKNOWN || attempt.kind == AttemptKind::Reconcile {
                schedule_reconcile(task, j, now, "executor reported an unknown outcome");
            } else {
                next_execute(task, j, now, true, "executor reported an unknown outcome");
            }
        }
        Outcome::Cancelled => {
            attempt.state = AttemptState::Cancelled;
            j.record(task, now, EventData::AttemptCancelled(observed));
            confirm_cancel(task, j, now);
        }
        Outcome::NotCommitted => {
            attempt.state = AttemptState::NotCommitted;
            j.record(task, now, EventData::Reconciled(observed));
            if task.cancel_pending() {
                confirm_cancel(task, j, now);
            } else {
                // The execute attempt whose outcome was unknown failed
                // without effect: its retry waits the contract's backoff,
                // as a transient failure's does.
                next_execute(task, j, now, true, "reconciliation found nothing committed");
            }
        }
    }
    Ok(())
}

/// Keeps report `r` of attempt `attempt_id` as an effect report
/// ([`Journal::effect_report`]) when `outcome` says the effect happened.
fn keep_effect_report(
    task: &mut Task,
    attempt_id: Uuid,
    j: &mut Journal,
    r: &Report,
    outcome: EvidenceOutcome,
    evidence: EffectEvidence,
    now: Timestamp,
) {
    if is_effect(outcome) {
        j.effect_report(
            task,
            EffectReport {
                external_txn_id: r.external_txn_id.clone(),
                attempt_id: Some(attempt_id),
                generation: r.generation,
                evidence,
                reported_at: now,
            },
        );
    }
}

/// Whether evidence with `outcome` reports that the external effect
/// happened: `succeeded` or `committed` (an effect report).
fn is_effect(outcome: EvidenceOutcome) -> bool {
    matches!(
        outcome,
        EvidenceOutcome::Succeeded | EvidenceOutcome::Committed
    )
}

/// Keeps a refused report as evidence with a `stale_report` event (RETRY-01:
/// "retain late evidence; reject state changes from an old generation").
fn keep_stale_report(
    task: &mut Task,
    attempt: &mut Attempt,
    j: &mut Journal,
    r: &Report,
    now: Timestamp,
    e: Rejection,
) -> Rejection {
    let outcome = r.outcome;
    // The report's own generation still current: its lease ended (late);
    // else a newer generation holds the task (stale).
    let late = r.generation == attempt.generation && r.generation == task.generation;
    let kind = if late {
        EffectEvidence::LateReport
    } else {
        EffectEvidence::StaleReport
    };
    keep_effect_report(task, attempt.id, j, r, outcome.into(), kind, now);
    j.evidence(
        attempt,
        evidence(
            now,
            r.generation,
            outcome.into(),
            r.body.clone(),
            Disposition::StaleGeneration,
        ),
    );
    let data = EventData::StaleReport(ev::StaleReport {
        attempt_id: attempt.id,
        current_generation: task.generation,
        generation: r.generation,
        outcome,
    });
    j.record(task, now, data);
    e
}

/// Expires the lease of `attempt` (the lease end passed without a report).
///
/// Reconcile attempt → another reconcile. Pending cancel: safe class → confirmed,
/// non-safe → reconcile first. Otherwise safe class → retry decision as for a
/// transient failure; non-safe → `reconciling` (SPEC §2.5: the outcome is unknown).
pub fn expire_lease(task: &mut Task, attempt: &mut Attempt, j: &mut Journal, now: Timestamp) {
    if !attempt.state.is_active() {
        return;
    }
    attempt.state = AttemptState::Expired;
    if task.control.active_attempt_id == Some(attempt.id) {
        task.control.active_attempt_id = None;
    }
    let data = EventData::LeaseExpired(ev::LeaseExpired {
        attempt_id: attempt.id,
        generation: attempt.generation,
        lease_expires_at: attempt.lease_expires_at,
    });
    j.record(task, now, data);
    if task.state.is_terminal() {
        return;
    }
    let safe = task.contract.retry.safe;
    if attempt.kind == AttemptKind::Reconcile {
        schedule_reconcile(task, j, now, "reconcile lease expired");
    } else if task.cancel_pending() {
        if safe {
            confirm_cancel(task, j, now);
        } else {
            schedule_reconcile(
                task,
                j,
                now,
                "lease expired with a cancellation pending on a non-safe class",
            );
        }
    } else if safe {
        retry_after_transient(task, j, now, "lease expired without a report");
    } else {
        schedule_reconcile(
            task,
            j,
            now,
            "lease expired without a report on a non-safe class",
        );
    }
}

/// Moves a task to reconcile-first after its store went back in time (SPEC
/// §2.11): the store found itself on another PostgreSQL timeline or system,
/// or an SQLite file restored from a backup, so writes it acknowledged after
/// the restore point are gone, among them leases it granted. `store` says
/// which identity the store had recorded and which it found; it is copied
/// into the event.
///
/// Every non-terminal task may have had an attempt leased after the restore
/// point (a task the store shows `queued` or `retry_wait` may have been
/// claimed since), so:
/// - terminal task: unchanged (`false`);
/// - retry-safe class, no active attempt (`queued`, `retry_wait`): unchanged
///   (`false`): its next execute attempt is allowed whatever ran before;
/// - otherwise the active attempt, if any, ends (`expired`) and the
///   generation is raised, so a report from before is stale evidence; then
///   a class that is not retry-safe, and any task already `reconciling`, is
///   moved to `reconciling` with a reconcile attempt ready now
///   (`reconciliation_required`, reason `store_rewound`); a retry-safe class
///   with a pending cancellation is cancelled (`cancel_confirmed`), else its
///   next execute attempt is scheduled at once (`retry_scheduled`, reason
///   `store_rewound`) within its limits (`task_failed` past them).
///
/// The event's data holds `store`, `ended_attempt_id` (the attempt ended,
/// or `null`) and the raised `generation`.
///
/// `attempt` is the task's active attempt when it has one. Returns whether
/// anything changed.
pub fn store_rewound(
    task: &mut Task,
    attempt: Option<&mut Attempt>,
    j: &mut Journal,
    now: Timestamp,
    store: &Value,
) -> bool {
    if task.state.is_terminal() {
        return false;
    }
    let safe = task.contract.retry.safe;
    let active =
        attempt.filter(|a| a.state.is_active() && task.control.active_attempt_id == Some(a.id));
    if safe && active.is_none() && task.state != TaskState::Reconciling {
        return false;
    }
    let ended = active.map(|a| {
        a.state = AttemptState::Expired;
        a.id
    });
    task.control.active_attempt_id = None;
    task.generation += 1;
    if !safe || task.state == TaskState::Reconciling {
        task.state = TaskState::Reconciling;
        task.control.next_kind = Some(AttemptKind::Reconcile);
        task.control.ready_at = now;
        let data = EventData::ReconciliationRequired(ev::ReconciliationRequired {
            backoff_ms: 0,
            ended_attempt_id: Some(ended),
            generation: Some(task.generation),
            ready_at: now,
            reason: STORE_REWOUND.to_owned(),
            store: Some(store.clone()),
        });
        j.record(task, now, data);
    } else {
        let first = j.events.len();
        if task.cancel_pending() {
            confirm_cancel(task, j, now);
        } else {
            next_execute(task, j, now, false, STORE_REWOUND);
        }
        // The event that settled it says why, as `reconciliation_required`
        // does above.
        let store = Some(store.clone());
        match j.events.get_mut(first).map(|e| &mut e.data) {
            Some(EventData::RetryScheduled(d)) => {
                (d.store, d.ended_attempt_id) = (store, Some(ended));
                d.generation.get_or_insert(task.generation);
            }
            Some(EventData::TaskFailed(d)) => {
                (d.store, d.ended_attempt_id) = (store, Some(ended));
                d.generation.get_or_insert(task.generation);
            }
            Some(EventData::CancelConfirmed(d)) => {
                (d.store, d.ended_attempt_id) = (store, Some(ended));
            }
            _ => {}
        }
    }
    true
}

/// The `reason` of the event [`store_rewound`] records.
pub const STORE_REWOUND: &str = "store_rewound";

/// Requests cancellation (SPEC §2.7, CANCEL-01). Idempotent: a second request
/// returns the existing record unchanged.
///
/// Queued or backing off (nothing running) → confirmed at once; running or
/// reconciling → `requested`; delivered → `too_late` with the delivery's charge
/// as fee; failed → `too_late` with fee 0.
pub fn cancel(task: &mut Task, j: &mut Journal, now: Timestamp) -> Cancellation {
    if let Some(c) = &task.cancellation {
        return c.clone();
    }
    match task.state {
        TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled => {
            let fee = task.delivery.as_ref().map_or(0, |d| d.charge);
            task.cancellation = Some(Cancellation {
                status: CancelStatus::TooLate,
                requested_at: now,
                confirmed_at: Some(now),
                fee: Some(fee),
                currency: task.contract.fees.currency.clone(),
            });
            let data = EventData::CancelTooLate(ev::CancelTooLate {
                fee,
                currency: Some(task.contract.fees.currency.clone()),
                state: Some(task.state),
                status: CancelStatus::TooLate,
            });
            j.record(task, now, data);
        }
        TaskState::Queued | TaskState::RetryWait => {
            task.cancellation = Some(Cancellation {
                status: CancelStatus::Requested,
                requested_at: now,
                confirmed_at: None,
                fee: None,
                currency: task.contract.fees.currency.clone(),
            });
            let data = ev::CancelRequested {
                active_attempt_id: None,
            };
            j.record(task, now, EventData::CancelRequested(data));
            confirm_cancel(task, j, now);
        }
        TaskState::Running | TaskState::Reconciling => {
            task.cancellation = Some(Cancellation {
                status: CancelStatus::Requested,
                requested_at: now,
                confirmed_at: None,
                fee: None,
                currency: task.contract.fees.currency.clone(),
            });
            let data = ev::CancelRequested {
                active_attempt_id: Some(task.control.active_attempt_id),
            };
            j.record(task, now, EventData::CancelRequested(data));
        }
    }
    task.cancellation.clone().unwrap_or(Cancellation {
        status: CancelStatus::Requested,
        requested_at: now,
        confirmed_at: None,
        fee: None,
        currency: task.contract.fees.currency.clone(),
    })
}

/// Moves a `retry_wait` task whose backoff has passed back to `queued`.
/// Returns whether anything changed.
pub fn wake(task: &mut Task, j: &mut Journal, now: Timestamp) -> bool {
    if task.state == TaskState::RetryWait && task.control.ready_at <= now {
        task.state = TaskState::Queued;
        j.record(task, now, EventData::TaskWoken(ev::NoDetails {}));
        true
    } else {
        false
    }
}

/// Records the client's delivery acknowledgment (SPEC §2.6). Idempotent: the
/// delivery record and its charge never change.
///
/// # Errors
/// [`Rejection::NotDelivered`] when nothing was delivered.
pub fn acknowledge_delivery(
    task: &mut Task,
    j: &mut Journal,
    now: Timestamp,
) -> Result<(), Rejection> {
    let Some(d) = task.delivery.as_mut() else {
        return Err(Rejection::NotDelivered);
    };
    if d.acknowledged_at.is_none() {
        d.acknowledged_at = Some(now);
        j.record(task, now, EventData::DeliveryAcknowledged(ev::NoDetails {}));
    }
    Ok(())
}

/// Records that the retention sweeper removed the task's idempotency key (SPEC §2.9).
/// Clears `key_expires_at`, so the sweeper never looks at the task again.
pub fn release_key(task: &mut Task, j: &mut Journal, now: Timestamp) {
    task.control.key_expires_at = None;
    let data = EventData::KeyReleased(ev::KeyReleased {
        idempotency_key: task.idempotency_key.clone(),
    });
    j.record(task, now, data);
}

fn deliver(
    task: &mut Task,
    j: &mut Journal,
    now: Timestamp,
    result: Value,
    external_txn_id: Option<String>,
) {
    let charge = task.contract.price;
    task.delivery = Some(Delivery {
        result,
        external_txn_id: external_txn_id.clone(),
        delivered_at: now,
        acknowledged_at: None,
        charge,
        currency: task.contract.fees.currency.clone(),
    });
    task.state = TaskState::Succeeded;
    let data = EventData::Delivered(ev::Delivered {
        charge,
        currency: Some(task.contract.fees.currency.clone()),
        external_txn_id,
    });
    j.record(task, now, data);
    if let Some(c) = task.cancellation.as_mut()
        && c.status == CancelStatus::Requested
    {
        c.status = CancelStatus::TooLate;
        c.confirmed_at = Some(now);
        c.fee = Some(charge);
        let data = EventData::CancelTooLate(ev::CancelTooLate {
            fee: charge,
            currency: Some(task.contract.fees.currency.clone()),
            state: None,
            status: CancelStatus::TooLate,
        });
        j.record(task, now, data);
    }
    terminal(task, now);
}

fn confirm_cancel(task: &mut Task, j: &mut Journal, now: Timestamp) {
    let fees = &task.contract.fees;
    let fee = if task.control.execute_count == 0 {
        fees.cancel_before_start
    } else {
        fees.after_start(task.usage)
    };
    let requested_at = task.cancellation.as_ref().map_or(now, |c| c.requested_at);
    task.cancellation = Some(Cancellation {
        status: CancelStatus::Confirmed,
        requested_at,
        confirmed_at: Some(now),
        fee: Some(fee),
        currency: task.contract.fees.currency.clone(),
    });
    task.state = TaskState::Cancelled;
    // Retire all execution authority (CANCEL-01).
    task.generation += 1;
    let data = EventData::CancelConfirmed(ev::CancelConfirmed {
        ended_attempt_id: None,
        fee,
        currency: Some(task.contract.fees.currency.clone()),
        generation: task.generation,
        store: None,
        usage: task.usage,
    });
    j.record(task, now, data);
    terminal(task, now);
}

fn fail(task: &mut Task, j: &mut Journal, now: Timestamp, class: FailureClass, message: &str) {
    task.state = TaskState::Failed;
    task.failure = Some(Failure {
        class,
        message: message.to_owned(),
    });
    let data = EventData::TaskFailed(ev::TaskFailed {
        class,
        ended_attempt_id: None,
        generation: None,
        message: message.to_owned(),
        store: None,
    });
    j.record(task, now, data);
    terminal(task, now);
}

fn terminal(task: &mut Task, now: Timestamp) {
    task.control.terminal_at = Some(now);
    task.control.key_expires_at = Some(now.plus_ms(task.contract.windows.retention_ms));
    task.control.next_kind = None;
    task.control.active_attempt_id = None;
}

fn schedule_reconcile(task: &mut Task, j: &mut Journal, now: Timestamp, reason: &str) {
    let first = task.state != TaskState::Reconciling;
    task.state = TaskState::Reconciling;
    task.control.next_kind = Some(AttemptKind::Reconcile);
    let backoff_ms = if first {
        0
    } else {
        task.contract.retry.backoff.initial_ms
    };
    task.control.ready_at = now.plus_ms(backoff_ms);
    let data = EventData::ReconciliationRequired(ev::ReconciliationRequired {
        backoff_ms,
        ended_attempt_id: None,
        generation: None,
        ready_at: task.control.ready_at,
        reason: reason.to_owned(),
        store: None,
    });
    j.record(task, now, data);
}

fn retry_after_transient(task: &mut Task, j: &mut Journal, now: Timestamp, message: &str) {
    if !task.contract.retry.safe {
        fail(task, j, now, FailureClass::Transient, message);
        return;
    }
    next_execute(task, j, now, true, message);
}

/// Decides whether another execute attempt may start: attempts, deadline, budget
/// (SPEC §2.5). `backoff` waits in `retry_wait`; otherwise the task is queued at once.
fn next_execute(task: &mut Task, j: &mut Journal, now: Timestamp, backoff: bool, reason: &str) {
    let retry = &task.contract.retry;
    // The failure says which limit ended the task, then what the last attempt
    // reported (an executor may report a failure without a message).
    let ended = |limit: String| {
        if reason.is_empty() {
            limit
        } else {
            format!("{limit}; last attempt: {reason}")
        }
    };
    if task.control.execute_count >= task.execute_limit() {
        // Only execute attempts count against the limit; reconcile attempts
        // (and the attempt numbers they take) never do.
        let message = ended(format!(
            "all {} execute attempts used",
            task.execute_limit()
        ));
        fail(task, j, now, FailureClass::AttemptsExhausted, &message);
    } else if now >= task.control.deadline_at {
        let message = ended("deadline passed".to_owned());
        fail(task, j, now, FailureClass::DeadlineExceeded, &message);
    } else if task.usage > retry.usage_budget {
        let message = ended(format!(
            "usage {} over the budget of {}",
            task.usage, retry.usage_budget
        ));
        fail(task, j, now, FailureClass::BudgetExhausted, &message);
    } else if backoff {
        let delay = retry.backoff.delay_ms(task.control.execute_count + 1);
        task.state = TaskState::RetryWait;
        task.control.next_kind = Some(AttemptKind::Execute);
        task.control.ready_at = now.plus_ms(delay);
        let data = EventData::RetryScheduled(ev::RetryScheduled {
            backoff_ms: delay,
            ended_attempt_id: None,
            generation: None,
            ready_at: Some(task.control.ready_at),
            reason: reason.to_owned(),
            store: None,
        });
        j.record(task, now, data);
    } else {
        task.state = TaskState::Queued;
        task.control.next_kind = Some(AttemptKind::Execute);
        task.control.ready_at = now;
        let data = EventData::RetryScheduled(ev::RetryScheduled {
            backoff_ms: 0,
            ended_attempt_id: None,
            generation: None,
            ready_at: None,
            reason: reason.to_owned(),
            store: None,
        });
        j.record(task, now, data);
    }
}

pub mod operator;
#[cfg(test)]
mod tests;
