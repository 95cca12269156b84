//! Operator actions (SPEC §4 "Operator actions"): what an `admin` key, or
//! the `idem task` command line acting on the store, may do to a task that
//! automation left waiting: make a backoff end now (`retry_now`), cancel
//! (`cancel`), settle an unknown outcome by hand (`resolve`) and send a
//! failed task back to the queue (`redrive`).
//!
//! Each is one transition like any other of [`super`]: it takes the loaded
//! records, changes them in place and journals its events; the store writes
//! them in one transaction with a compare-and-set on the task's version and
//! generation, so an action and an executor's report on the same task are
//! ordered by the database and exactly one of two conflicting transitions
//! applies. Every action records who acted ([`Actor`]) and why ([`Reason`])
//! in its `operator_*` event (SPEC §2.10). An action on a task in a state it
//! does not apply to changes nothing and is [`Refused::InvalidState`]
//! (HTTP 409 `INVALID_STATE`).

use serde_json::Value;

use super::{Authority, Journal, confirm_cancel, deliver, next_execute};
use crate::model::event::{
    OperatorCancel, OperatorRedriven, OperatorResolved, OperatorRetryNow, SecondEffectAcknowledged,
};
use crate::model::{
    Attempt, AttemptState, Cancellation, EffectAcknowledgment, EffectEvidence, EffectReport,
    EffectResolution, EventData, FailureClass, Outcome, SecondEffect, Task, TaskState, Timestamp,
};

/// Longest [`Reason`], in characters.
pub const MAX_REASON_CHARS: usize = 500;

/// Why an operator acted, as recorded in the action's event: 1 to
/// [`MAX_REASON_CHARS`] characters, at least one of them visible (not white
/// space, not a format character of Unicode category Cf such as U+200B ZERO
/// WIDTH SPACE or U+FEFF: a reason must show something in a log or a
/// console), no control characters (they would hide text there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason(String);

/// Why a text is not a [`Reason`] (HTTP 400 `INVALID_REQUEST`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReasonError {
    /// Empty, or only white space and format characters (Cf).
    #[error(
        "`reason` must say why the operator acts: it has no visible character (only white space or invisible format characters such as U+200B)"
    )]
    NothingVisible,
    /// Over [`MAX_REASON_CHARS`].
    #[error("`reason` has {chars} characters; at most {MAX_REASON_CHARS} are kept")]
    TooLong {
        /// Its length in characters.
        chars: usize,
    },
    /// Holds a control character (line breaks included).
    #[error("`reason` must not contain control characters (U+0000–U+001F, U+007F–U+009F)")]
    Control,
}

/// Whether `c` shows in a text: not white space (Unicode `White_Space`),
/// not a control character (Cc) and not a format character (Cf: zero-width
/// spaces and joiners, the byte-order mark, bidirectional marks, soft
/// hyphens, tags …). The category comes from `unicode-general-category`
/// (Unicode 16.0): std has no general-category lookup.
fn is_visible(c: char) -> bool {
    use unicode_general_category::{GeneralCategory, get_general_category};
    !c.is_whitespace() && !c.is_control() && get_general_category(c) != GeneralCategory::Format
}

impl Reason {
    /// `text` as a reason, unchanged.
    ///
    /// # Errors
    /// [`ReasonError`] when it breaks one of the rules of [`Reason`].
    pub fn parse(text: &str) -> Result<Reason, ReasonError> {
        if !text.chars().any(is_visible) {
            return Err(ReasonError::NothingVisible);
        }
        let chars = text.chars().count();
        if chars > MAX_REASON_CHARS {
            return Err(ReasonError::TooLong { chars });
        }
        if text.chars().any(char::is_control) {
            return Err(ReasonError::Control);
        }
        Ok(Reason(text.to_owned()))
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Longest identifier-like text ([`is_short_text`]), in characters.
pub const MAX_SHORT_TEXT_CHARS: usize = 200;

/// Whether `s` is an identifier-like text: 1 to [`MAX_SHORT_TEXT_CHARS`]
/// characters (Unicode scalar values), none of them a control character. The
/// rule of `executor_id`, `external_txn_id` and an operator's actor name
/// (SPEC §7); a NUL could not even be stored on PostgreSQL.
pub fn is_short_text(s: &str) -> bool {
    !s.is_empty() && s.chars().count() <= MAX_SHORT_TEXT_CHARS && !s.chars().any(char::is_control)
}

/// An external system's transaction id, as a report, a resolution or a
/// search names it: an identifier-like text ([`is_short_text`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalTxnId(String);

/// Why a text is not an [`ExternalTxnId`] (HTTP 400 `INVALID_REQUEST`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`external_txn_id` must be 1–200 characters, none of them a control character")]
pub struct ExternalTxnIdError;

impl ExternalTxnId {
    /// `text` as a transaction id, unchanged.
    ///
    /// # Errors
    /// [`ExternalTxnIdError`] when it is empty, longer than
    /// [`MAX_SHORT_TEXT_CHARS`] or holds a control character.
    pub fn parse(text: &str) -> Result<ExternalTxnId, ExternalTxnIdError> {
        if is_short_text(text) {
            Ok(ExternalTxnId(text.to_owned()))
        } else {
            Err(ExternalTxnIdError)
        }
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The text, owned.
    pub fn into_string(self) -> String {
        self.0
    }
}

pub use crate::model::event::{Actor, ActorKind, ActorRecord, ActorRecordError};

/// Who acts and why: what every action records in its event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct By {
    /// Who.
    pub actor: Actor,
    /// Why.
    pub reason: Reason,
}

/// Why an operator action was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// The action does not apply to the task as it is (HTTP 409 `INVALID_STATE`).
    #[error("{0}")]
    InvalidState(String),
    /// A redrive whose task's submitting API key was revoked or no longer
    /// grants the task's class (SPEC §2.8; HTTP 409 `SUBMITTER_REVOKED`).
    #[error(
        "the API key that submitted this task was revoked or is no longer granted `{operation}`; the task cannot be redriven (submit it again with a key that is)"
    )]
    SubmitterRevoked {
        /// The task's operation class.
        operation: String,
    },
    /// An acknowledgment of a second effect the task does not have
    /// (HTTP 404 `NOT_FOUND`).
    #[error("task {task_id} has no suspected second effect with `external_txn_id` {txn}")]
    NoSecondEffect {
        /// The task.
        task_id: uuid::Uuid,
        /// The id asked for, as JSON (`"…"` or `null`).
        txn: String,
    },
}

fn invalid(action: &str, task: &Task, applies_to: &str) -> Refused {
    Refused::InvalidState(format!(
        "`{action}` applies to a task in {applies_to}; task {} is `{}`",
        task.id, task.state
    ))
}

/// `POST /v1/tasks/{id}/retry-now`: a `retry_wait` task becomes claimable at
/// once (`queued`, ready now), as if its backoff had passed. Event
/// `operator_retry_now` with the backoff's end it replaced (`ready_at`).
///
/// # Errors
/// [`Refused::InvalidState`] for any other state.
pub fn retry_now(task: &mut Task, j: &mut Journal, now: Timestamp, by: &By) -> Result<(), Refused> {
    if task.state != TaskState::RetryWait {
        return Err(invalid("retry-now", task, "`retry_wait`"));
    }
    let data = EventData::OperatorRetryNow(OperatorRetryNow {
        actor: by.actor.clone(),
        ready_at: task.control.ready_at,
        reason: by.reason.as_str().to_owned(),
        state: task.state,
    });
    task.state = TaskState::Queued;
    task.control.ready_at = now;
    j.record(task, now, data);
    Ok(())
}

/// `POST /v1/tasks/{id}/cancel` by an operator: the client's cancellation
/// ([`super::cancel`], the same cancel-versus-delivery transition and fee
/// policy), preceded by an `operator_cancel` event with actor and reason.
/// It applies in every state, as a client's does (a terminal task answers
/// `too_late`); a task that already has a cancellation record answers that
/// record and nothing is written.
pub fn cancel(task: &mut Task, j: &mut Journal, now: Timestamp, by: &By) -> Cancellation {
    if task.cancellation.is_none() {
        let data = EventData::OperatorCancel(OperatorCancel {
            actor: by.actor.clone(),
            reason: by.reason.as_str().to_owned(),
            state: task.state,
        });
        j.record(task, now, data);
    }
    super::cancel(task, j, now)
}

/// The outcome an operator found at the external system.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// The effect happened: deliver `result` once, with the contract's charge.
    Committed {
        /// The result document (as a reconcile attempt's `result`).
        result: Value,
        /// The external system's transaction id, when the operator has one.
        external_txn_id: Option<String>,
    },
    /// The effect did not happen: the next execute attempt may start.
    NotCommitted,
}

/// What an operator found at the external system, as a resolve request
/// names it (`outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResolveOutcome {
    /// The effect happened.
    Committed,
    /// The effect did not happen.
    NotCommitted,
}

/// Why a resolve request is not a [`Resolution`] (HTTP 400
/// `INVALID_REQUEST`; the console and the command line show the same text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResolutionError {
    /// `committed` without a result (or with `null`).
    #[error("`committed` needs the `result` to deliver (a JSON document, not null)")]
    NoResult,
    /// `not_committed` with a result or a transaction id.
    #[error("`not_committed` delivers nothing: give neither `result` nor `external_txn_id`")]
    NotCommittedDeliversNothing,
    /// A transaction id that is not an [`ExternalTxnId`].
    #[error(transparent)]
    ExternalTxnId(#[from] ExternalTxnIdError),
}

impl Resolution {
    /// The resolution a request asks for: `committed` needs a `result` (not
    /// `null`) and takes an optional [`ExternalTxnId`]; `not_committed`
    /// takes neither.
    ///
    /// # Errors
    /// [`ResolutionError`] naming the rule broken.
    pub fn parse(
        outcome: ResolveOutcome,
        result: Option<Value>,
        external_txn_id: Option<&str>,
    ) -> Result<Resolution, ResolutionError> {
        let result = result.filter(|r| !r.is_null());
        match outcome {
            ResolveOutcome::Committed => {
                let Some(result) = result else {
                    return Err(ResolutionError::NoResult);
                };
                let external_txn_id = external_txn_id
                    .map(ExternalTxnId::parse)
                    .transpose()?
                    .map(ExternalTxnId::into_string);
                Ok(Resolution::Committed {
                    result,
                    external_txn_id,
                })
            }
            ResolveOutcome::NotCommitted => {
                if result.is_some() || external_txn_id.is_some() {
                    return Err(ResolutionError::NotCommittedDeliversNothing);
                }
                Ok(Resolution::NotCommitted)
            }
        }
    }
}

/// `POST /v1/tasks/{id}/resolve`: a manual reconciliation of a `reconciling`
/// task, the transition a reconcile attempt's `committed` / `not_committed`
/// report takes (SPEC §2.5): `committed` delivers once with its charge (a
/// pending cancellation becomes `too_late`); `not_committed` confirms a
/// pending cancellation, else queues the next execute attempt within the
/// attempts, deadline and budget of the contract (or fails the task on the
/// limit it reached).
///
/// The generation is raised first, so a live reconcile attempt (`active`,
/// the task's active attempt when one holds the lease) is fenced off: it is
/// ended (`expired`, its lease end set to `now`), and its later report or
/// heartbeat is kept as stale evidence (409 `STALE_GENERATION`). Event
/// `operator_resolved` with `outcome`, `external_txn_id` and the attempt it
/// retired (`retired_attempt_id`).
///
/// # Errors
/// [`Refused::InvalidState`] for any state but `reconciling`.
pub fn resolve(
    task: &mut Task,
    active: Option<&mut Attempt>,
    j: &mut Journal,
    now: Timestamp,
    by: &By,
    resolution: Resolution,
) -> Result<(), Refused> {
    if task.state != TaskState::Reconciling {
        return Err(invalid("resolve", task, "`reconciling`"));
    }
    let retired = task.control.active_attempt_id;
    if let Some(a) = active.filter(|a| Some(a.id) == retired && a.state.is_active()) {
        a.state = AttemptState::Expired;
        a.lease_expires_at = now;
    }
    task.control.active_attempt_id = None;
    task.generation += 1;
    let (outcome, txn) = match &resolution {
        Resolution::Committed {
            external_txn_id, ..
        } => (Outcome::Committed, external_txn_id.clone()),
        Resolution::NotCommitted => (Outcome::NotCommitted, None),
    };
    if outcome == Outcome::Committed {
        j.effect_report(
            task,
            EffectReport {
                external_txn_id: txn.clone(),
                attempt_id: retired,
                generation: task.generation,
                evidence: EffectEvidence::OperatorResolved,
                reported_at: now,
            },
        );
    }
    let data = EventData::OperatorResolved(OperatorResolved {
        actor: by.actor.clone(),
        external_txn_id: txn,
        generation: task.generation,
        outcome,
        reason: by.reason.as_str().to_owned(),
        retired_attempt_id: retired,
        state: task.state,
    });
    j.record(task, now, data);
    match resolution {
        Resolution::Committed {
            result,
            external_txn_id,
        } => deliver(task, j, now, result, external_txn_id),
        Resolution::NotCommitted if task.cancel_pending() => confirm_cancel(task, j, now),
        Resolution::NotCommitted => next_execute(
            task,
            j,
            now,
            false,
            "an operator resolved the outcome as not committed",
        ),
    }
    Ok(())
}

/// Failure classes a redrive applies to: those where trying again can help.
/// `invalid_input` and `permission_denied` would fail the same way.
pub const REDRIVABLE: &[FailureClass] = &[
    FailureClass::Transient,
    FailureClass::AttemptsExhausted,
    FailureClass::DeadlineExceeded,
    FailureClass::BudgetExhausted,
];

/// `POST /v1/tasks/{id}/redrive`: a `failed` task whose failure class is
/// [`REDRIVABLE`] goes back to `queued`, claimable now, with one more
/// execute attempt granted (`attempts_granted` + 1, so its limit is the
/// contract's `max_attempts` plus the grants) and a new deadline of the
/// frozen contract's `deadline_ms` from `now`. Its failure is cleared, and so
/// are `terminal_at` and `key_expires_at`: the idempotency key's retention
/// starts again when the task next ends (SPEC §2.9). The generation is raised.
/// Event `operator_redriven` with the failure it cleared, the new deadline
/// and the execute limit.
///
/// `authority` is the submitting API key's, read in the same transaction
/// (SPEC §2.8: checked again before the task may run again).
///
/// # Errors
/// [`Refused::InvalidState`] for any state but `failed`, for the failure
/// classes `invalid_input` and `permission_denied`, for a task with a
/// cancellation record (its client asked to stop it), and for a task whose
/// idempotency key retention already released (a new submit may own the
/// scope); [`Refused::SubmitterRevoked`] when `authority` is
/// [`Authority::Revoked`].
pub fn redrive(
    task: &mut Task,
    j: &mut Journal,
    now: Timestamp,
    by: &By,
    authority: Authority,
) -> Result<(), Refused> {
    if task.state != TaskState::Failed {
        return Err(invalid("redrive", task, "`failed`"));
    }
    let failure = task.failure.clone();
    let class = failure.as_ref().map(|f| f.class);
    if !class.is_some_and(|c| REDRIVABLE.contains(&c)) {
        return Err(Refused::InvalidState(format!(
            "`redrive` applies to a task that failed `transient`, `attempts_exhausted`, `deadline_exceeded` or `budget_exhausted`; task {} failed `{}`, which would fail again",
            task.id,
            class.map_or("unknown", FailureClass::as_str)
        )));
    }
    if task.cancellation.is_some() {
        return Err(Refused::InvalidState(format!(
            "task {} has a cancellation record: its client asked to stop it, so it is not redriven",
            task.id
        )));
    }
    if task.control.key_expires_at.is_none() {
        return Err(Refused::InvalidState(format!(
            "the idempotency key of task {} was released by retention (a new submit may own its scope), so it is not redriven",
            task.id
        )));
    }
    if authority == Authority::Revoked {
        return Err(Refused::SubmitterRevoked {
            operation: task.operation.clone(),
        });
    }
    task.state = TaskState::Queued;
    task.failure = None;
    task.generation += 1;
    task.control.attempts_granted += 1;
    task.control.next_kind = Some(crate::model::AttemptKind::Execute);
    task.control.ready_at = now;
    task.control.deadline_at = now.plus_ms(task.contract.retry.deadline_ms);
    task.control.terminal_at = None;
    task.control.key_expires_at = None;
    let data = EventData::OperatorRedriven(OperatorRedriven {
        actor: by.actor.clone(),
        attempts_granted: task.control.attempts_granted,
        deadline_at: task.control.deadline_at,
        execute_count: task.control.execute_count,
        execute_limit: task.execute_limit(),
        failure,
        generation: task.generation,
        reason: by.reason.as_str().to_owned(),
        state: TaskState::Failed,
    });
    j.record(task, now, data);
    Ok(())
}

/// `POST /v1/tasks/{id}/second-effects/acknowledge`: an operator records
/// how the suspected second effect with `external_txn_id` (`None`: the one
/// without an id) was settled. Detection and audit only: the task's state,
/// delivery and charge do not change. Event `second_effect_acknowledged`
/// with actor, reason and resolution. Idempotent: an effect already
/// acknowledged answers its acknowledgment and nothing is written.
///
/// Returns the second effect with its acknowledgment.
///
/// # Errors
/// [`Refused::NoSecondEffect`] when the task has no such suspected effect.
pub fn acknowledge_second_effect(
    task: &mut Task,
    j: &mut Journal,
    now: Timestamp,
    by: &By,
    external_txn_id: Option<&str>,
    resolution: EffectResolution,
) -> Result<SecondEffect, Refused> {
    let task_id = task.id;
    let Some(effect) = task
        .second_effects
        .iter_mut()
        .find(|s| s.external_txn_id.as_deref() == external_txn_id)
    else {
        return Err(Refused::NoSecondEffect {
            task_id,
            txn: external_txn_id.map_or_else(|| "null".to_owned(), |t| format!("{t:?}")),
        });
    };
    if effect.acknowledgment.is_some() {
        return Ok(effect.clone());
    }
    effect.acknowledgment = Some(EffectAcknowledgment {
        resolution,
        reason: by.reason.as_str().to_owned(),
        actor: by.actor.clone(),
        acknowledged_at: now,
    });
    let effect = effect.clone();
    j.acknowledged.push(effect.clone());
    let data = EventData::SecondEffectAcknowledged(SecondEffectAcknowledged {
        actor: by.actor.clone(),
        external_txn_id: effect.external_txn_id.clone(),
        reason: by.reason.as_str().to_owned(),
        resolution,
        state: task.state,
    });
    j.record(task, now, data);
    Ok(effect)
}

#[cfg(test)]
mod tests;
