//! The data of an audit event, one type per [`EventKind`] (SPEC §2.10).
//!
//! An event's `data` is stored as JSON text next to its `type` column and
//! served as is by `GET /v1/tasks/{id}/events`, the tenant feed and the live
//! streams, so its form is fixed by the rows already written:
//!
//! - **Key order.** Each struct declares its fields in byte order of their
//!   names, because the stored objects were written from `serde_json::Value`
//!   maps (sorted keys: the workspace does not enable `preserve_order`).
//!   The corpus test of each store checks it.
//! - **Absent and `null`.** A field written as `null` when it has no value is
//!   an `Option<T>`; a field left out when it has none carries
//!   `skip_serializing_if`; a field that may be absent *or* `null`
//!   (`cancel_requested.active_attempt_id`, the store-rewind
//!   `ended_attempt_id`) is an `Option<Option<T>>` read through [`present`].
//! - **Which struct.** The `type` column, not the data, says which struct the
//!   data is: [`EventData::from_json`] and [`EventData::from_value`] dispatch
//!   on the [`EventKind`]; serializing writes the struct alone (no tag).
//! - **Another release's rows.** Every struct refuses unknown fields, so data
//!   written by a newer release with a field this one does not know (or an
//!   older one without a field it requires) is never cut down to what this
//!   release knows: it reads as [`EventData::Other`] and serializes to the
//!   same JSON value (`docs/operations.md`, "Upgrading": an older binary
//!   keeps serving while a newer one writes). A `type` this release does not
//!   know is refused where the row is read: [`EventKind`] is closed.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use uuid::Uuid;

use super::{
    AttemptKind, CancelStatus, EffectEvidence, EffectResolution, EventKind, EvidenceOutcome,
    Failure, FailureClass, Outcome, TaskState, Timestamp,
};

/// Declares [`EventData`] with one variant per kind and the dispatch by kind.
macro_rules! event_data {
    ($($(#[$m:meta])* $kind:ident($ty:ty),)+) => {
        /// The data of an audit event, typed by its [`EventKind`] (see the
        /// module docs for the JSON form).
        #[derive(Debug, Clone, PartialEq, Serialize)]
        #[serde(untagged)]
        pub enum EventData {
            $($(#[$m])* $kind($ty),)+
            /// Data that does not fit its kind's struct: written by another
            /// release of idem. Kept and served as it was stored.
            Other(Unrecognised),
        }

        impl EventData {
            /// The kind this data belongs to.
            pub fn kind(&self) -> EventKind {
                match self {
                    $(EventData::$kind(_) => EventKind::$kind,)+
                    EventData::Other(o) => o.kind,
                }
            }

            /// The data of a `kind` event from its stored JSON text.
            ///
            /// # Errors
            /// When `text` is not JSON at all (data of a known shape that does
            /// not fit `kind`'s struct is [`EventData::Other`], not an error).
            pub fn from_json(kind: EventKind, text: &str) -> Result<EventData, serde_json::Error> {
                let typed = match kind {
                    $(EventKind::$kind => typed::<$ty>(text).map(EventData::$kind),)+
                };
                match typed {
                    Some(data) => Ok(data),
                    None => serde_json::from_str(text)
                        .map(|value| EventData::Other(Unrecognised { kind, value })),
                }
            }

            /// The data of a `kind` event from a JSON value (as a document
            /// that embeds events carries it).
            pub fn from_value(kind: EventKind, value: Value) -> EventData {
                let typed = match kind {
                    $(EventKind::$kind => <$ty>::deserialize(&value).ok().map(EventData::$kind),)+
                };
                match typed {
                    Some(data) => data,
                    None => EventData::Other(Unrecognised { kind, value }),
                }
            }
        }
    };
}

/// `text` as a `T`, if it is one.
fn typed<T: DeserializeOwned>(text: &str) -> Option<T> {
    serde_json::from_str(text).ok()
}

event_data! {
    /// `task_submitted`.
    TaskSubmitted(TaskSubmitted),
    /// `attempt_leased`.
    AttemptLeased(AttemptLeased),
    /// `usage_recorded`.
    UsageRecorded(UsageRecorded),
    /// `command_acknowledged`.
    CommandAcknowledged(CommandAcknowledged),
    /// `duplicate_report`.
    DuplicateReport(DuplicateReport),
    /// `stale_report`.
    StaleReport(StaleReport),
    /// `completion_observed`: an execute attempt reported `succeeded`.
    CompletionObserved(ReportApplied),
    /// `reconciled`: a reconcile attempt reported `committed` or `not_committed`.
    Reconciled(ReportApplied),
    /// `attempt_failed`.
    AttemptFailed(ReportApplied),
    /// `outcome_unknown`.
    OutcomeUnknown(ReportApplied),
    /// `attempt_cancelled`.
    AttemptCancelled(ReportApplied),
    /// `lease_expired`.
    LeaseExpired(LeaseExpired),
    /// `attempt_released`.
    AttemptReleased(AttemptReleased),
    /// `delivered`.
    Delivered(Delivered),
    /// `cancel_requested`.
    CancelRequested(CancelRequested),
    /// `cancel_confirmed`.
    CancelConfirmed(CancelConfirmed),
    /// `cancel_too_late`.
    CancelTooLate(CancelTooLate),
    /// `task_failed`.
    TaskFailed(TaskFailed),
    /// `reconciliation_required`.
    ReconciliationRequired(ReconciliationRequired),
    /// `retry_scheduled`.
    RetryScheduled(RetryScheduled),
    /// `task_woken` (no details).
    TaskWoken(NoDetails),
    /// `delivery_acknowledged` (no details).
    DeliveryAcknowledged(NoDetails),
    /// `key_released`.
    KeyReleased(KeyReleased),
    /// `operator_retry_now`.
    OperatorRetryNow(OperatorRetryNow),
    /// `operator_cancel`.
    OperatorCancel(OperatorCancel),
    /// `operator_resolved`.
    OperatorResolved(OperatorResolved),
    /// `operator_redriven`.
    OperatorRedriven(OperatorRedriven),
    /// `second_effect_suspected`.
    SecondEffectSuspected(SecondEffectSuspected),
    /// `second_effect_acknowledged`.
    SecondEffectAcknowledged(SecondEffectAcknowledged),
}

impl EventData {
    /// The attempt the event is about (`attempt_id`), if it names one.
    pub fn attempt_id(&self) -> Option<Uuid> {
        match self {
            EventData::AttemptLeased(d) => Some(d.attempt_id),
            EventData::UsageRecorded(d) => Some(d.attempt_id),
            EventData::CommandAcknowledged(d) => Some(d.attempt_id),
            EventData::DuplicateReport(d) => Some(d.attempt_id),
            EventData::StaleReport(d) => Some(d.attempt_id),
            EventData::CompletionObserved(d)
            | EventData::Reconciled(d)
            | EventData::AttemptFailed(d)
            | EventData::OutcomeUnknown(d)
            | EventData::AttemptCancelled(d) => Some(d.attempt_id),
            EventData::LeaseExpired(d) => Some(d.attempt_id),
            EventData::AttemptReleased(d) => Some(d.attempt_id),
            EventData::SecondEffectSuspected(d) => d.attempt_id,
            _ => None,
        }
    }

    /// The generation the event names (`generation`): the attempt's, or the
    /// task's after the transition raised it.
    pub fn generation(&self) -> Option<i64> {
        match self {
            EventData::AttemptLeased(d) => Some(d.generation),
            EventData::UsageRecorded(d) => Some(d.generation),
            EventData::CommandAcknowledged(d) => Some(d.generation),
            EventData::StaleReport(d) => Some(d.generation),
            EventData::CompletionObserved(d)
            | EventData::Reconciled(d)
            | EventData::AttemptFailed(d)
            | EventData::OutcomeUnknown(d)
            | EventData::AttemptCancelled(d) => Some(d.generation),
            EventData::LeaseExpired(d) => Some(d.generation),
            EventData::AttemptReleased(d) => Some(d.generation),
            EventData::CancelConfirmed(d) => Some(d.generation),
            EventData::TaskFailed(d) => d.generation,
            EventData::ReconciliationRequired(d) => d.generation,
            EventData::RetryScheduled(d) => d.generation,
            EventData::OperatorResolved(d) => Some(d.generation),
            EventData::OperatorRedriven(d) => Some(d.generation),
            EventData::SecondEffectSuspected(d) => Some(d.generation),
            _ => None,
        }
    }

    /// Why the transition happened (`reason`): of a retry or a
    /// reconciliation (`store_rewound` after a store rewind), or the
    /// operator's reason of an operator action.
    pub fn reason(&self) -> Option<&str> {
        match self {
            EventData::ReconciliationRequired(d) => Some(&d.reason),
            EventData::RetryScheduled(d) => Some(&d.reason),
            EventData::OperatorRetryNow(d) => Some(&d.reason),
            EventData::OperatorCancel(d) => Some(&d.reason),
            EventData::OperatorResolved(d) => Some(&d.reason),
            EventData::OperatorRedriven(d) => Some(&d.reason),
            EventData::SecondEffectAcknowledged(d) => Some(&d.reason),
            _ => None,
        }
    }

    /// The wait before the task may be claimed again (`backoff_ms`) of a
    /// retry or a reconciliation, ms.
    pub fn backoff_ms(&self) -> Option<i64> {
        match self {
            EventData::ReconciliationRequired(d) => Some(d.backoff_ms),
            EventData::RetryScheduled(d) => Some(d.backoff_ms),
            _ => None,
        }
    }

    /// The attempt a store rewind ended (SPEC §2.11), named by the event
    /// that moved the task on.
    pub fn ended_attempt_id(&self) -> Option<Uuid> {
        let ended = match self {
            EventData::CancelConfirmed(d) => d.ended_attempt_id,
            EventData::TaskFailed(d) => d.ended_attempt_id,
            EventData::ReconciliationRequired(d) => d.ended_attempt_id,
            EventData::RetryScheduled(d) => d.ended_attempt_id,
            _ => None,
        };
        ended.flatten()
    }
}

/// Data this release cannot read as its kind's struct, kept as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Unrecognised {
    /// The event's kind (its `type` column).
    pub kind: EventKind,
    /// The data as stored.
    pub value: Value,
}

impl Serialize for Unrecognised {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.value.serialize(s)
    }
}

/// (De)serializes an `Option<Option<T>>` field that may be absent (`None`,
/// with `skip_serializing_if = "Option::is_none"` and `default`), `null`
/// (`Some(None)`) or a value (`Some(Some(v))`).
mod present {
    use super::*;

    /// Writes the inner option (`null` or the value).
    pub fn serialize<S: Serializer, T: Serialize>(
        v: &Option<Option<T>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match v {
            Some(inner) => inner.serialize(s),
            None => s.serialize_none(),
        }
    }

    /// Reads a present field: `null` is `Some(None)`.
    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<Option<T>>, D::Error> {
        Option::<T>::deserialize(d).map(Some)
    }
}

/// `task_submitted`: the acceptance, with what the scope and fingerprint were
/// decided on (SPEC §2.1–2.3, §2.8).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSubmitted {
    /// The RFC 8785 canonical request the fingerprint hashes.
    pub canonical_request: String,
    /// The acceptance decision.
    pub decision: Decision,
    /// `sha256:<hex>` fingerprint.
    pub fingerprint: String,
    /// The idempotency key.
    pub idempotency_key: String,
    /// The frozen contract's price, minor units.
    pub price: i64,
}

/// The acceptance decision in `task_submitted` (SPEC §2.8).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// Always `true`: a refused submit writes no task.
    pub accepted: bool,
    /// The submitting API key.
    pub api_key_id: Uuid,
    /// The configuration version the contract was frozen from.
    pub config_version: String,
    /// The key's operation grant at acceptance (`null` = all).
    pub grant: Option<Vec<String>>,
}

/// `attempt_leased`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttemptLeased {
    /// The new attempt.
    pub attempt_id: Uuid,
    /// The executor holding the lease.
    pub executor_id: String,
    /// The attempt's (and task's) new generation.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: AttemptKind,
    /// When the lease ends.
    pub lease_expires_at: Timestamp,
    /// The attempt's number (1-based, every kind counted).
    pub number: i64,
    /// Execute attempts before this one (`execute_count − 1`).
    pub retry_count: i64,
}

/// `usage_recorded`: a heartbeat raised the attempt's usage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageRecorded {
    /// The attempt.
    pub attempt_id: Uuid,
    /// The heartbeat's generation.
    pub generation: i64,
    /// The task's usage total.
    pub task_usage: i64,
    /// The attempt's usage total.
    pub usage: i64,
}

/// `command_acknowledged`: a device acknowledged the attempt's command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandAcknowledged {
    /// The attempt.
    pub attempt_id: Uuid,
    /// The acknowledgment's generation.
    pub generation: i64,
}

/// `duplicate_report`: a different outcome for an attempt that has one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DuplicateReport {
    /// The attempt.
    pub attempt_id: Uuid,
    /// The outcome already applied.
    pub existing: Outcome,
    /// The outcome this report carried.
    pub outcome: EvidenceOutcome,
}

/// `stale_report`: a report from an old generation or after the lease ended,
/// kept as evidence (SPEC §2.4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaleReport {
    /// The attempt.
    pub attempt_id: Uuid,
    /// The task's generation when the report came.
    pub current_generation: i64,
    /// The generation the report presented.
    pub generation: i64,
    /// The outcome it carried.
    pub outcome: Outcome,
}

/// An applied report: `completion_observed`, `reconciled`, `attempt_failed`,
/// `outcome_unknown`, `attempt_cancelled`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportApplied {
    /// The attempt.
    pub attempt_id: Uuid,
    /// The external system's transaction id, if reported.
    pub external_txn_id: Option<String>,
    /// The reported failure class (`failed` only).
    pub failure_class: Option<FailureClass>,
    /// The report's generation.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: AttemptKind,
    /// The reported message, if any.
    pub message: Option<String>,
    /// The reported outcome.
    pub outcome: EvidenceOutcome,
    /// The attempt's usage total.
    pub usage: i64,
}

/// `lease_expired`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseExpired {
    /// The attempt.
    pub attempt_id: Uuid,
    /// Its generation.
    pub generation: i64,
    /// The lease end that passed.
    pub lease_expires_at: Timestamp,
}

/// `attempt_released`: an attempt given back before it started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttemptReleased {
    /// The attempt.
    pub attempt_id: Uuid,
    /// The task's execute count after the release.
    pub execute_count: i64,
    /// The executor that held it.
    pub executor_id: String,
    /// The release's generation.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: AttemptKind,
    /// The attempt's number.
    pub number: i64,
}

/// `delivered` (SPEC §2.6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Delivered {
    /// The charge, minor units.
    pub charge: i64,
    /// ISO 4217 code of the amount's currency (the contract's
    /// `fees.currency`): `Some(None)` is `null` (the contract names none);
    /// `None` is absent, in events recorded before idem carried it.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub currency: Option<Option<String>>,
    /// The external system's transaction id, if known.
    pub external_txn_id: Option<String>,
}

/// `cancel_requested`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequested {
    /// The attempt running when it was requested: absent when nothing ran
    /// (the cancellation is confirmed at once), `null` for a running or
    /// reconciling task without a live attempt.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub active_attempt_id: Option<Option<Uuid>>,
}

/// `cancel_confirmed` (SPEC §2.7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelConfirmed {
    /// ISO 4217 code of the amount's currency (the contract's
    /// `fees.currency`): `Some(None)` is `null` (the contract names none);
    /// `None` is absent, in events recorded before idem carried it.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub currency: Option<Option<String>>,
    /// The attempt a store rewind ended (only when a rewind confirmed it).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub ended_attempt_id: Option<Option<Uuid>>,
    /// The fee, minor units.
    pub fee: i64,
    /// The task's generation, raised to retire every attempt.
    pub generation: i64,
    /// The store identities of a rewind (only when a rewind confirmed it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<Value>,
    /// The task's usage total.
    pub usage: i64,
}

/// `cancel_too_late`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelTooLate {
    /// ISO 4217 code of the amount's currency (the contract's
    /// `fees.currency`): `Some(None)` is `null` (the contract names none);
    /// `None` is absent, in events recorded before idem carried it.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub currency: Option<Option<String>>,
    /// The fee: the delivery's charge, or 0.
    pub fee: i64,
    /// The terminal state found, when the task had already ended (absent when
    /// a delivery overtook a pending cancellation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TaskState>,
    /// Always `too_late`.
    pub status: CancelStatus,
}

/// `task_failed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskFailed {
    /// The failure class.
    pub class: FailureClass,
    /// The attempt a store rewind ended (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub ended_attempt_id: Option<Option<Uuid>>,
    /// The task's generation (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// Human-readable detail.
    pub message: String,
    /// The store identities of a rewind (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<Value>,
}

/// `reconciliation_required` (SPEC §2.5, §2.11).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconciliationRequired {
    /// Wait before the next reconcile attempt, ms.
    pub backoff_ms: i64,
    /// The attempt a store rewind ended, `null` if none was live (only after
    /// a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub ended_attempt_id: Option<Option<Uuid>>,
    /// The task's raised generation (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// When a reconcile attempt may be claimed.
    pub ready_at: Timestamp,
    /// Why (`store_rewound` after a rewind).
    pub reason: String,
    /// The store identities of a rewind (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<Value>,
}

/// `retry_scheduled` (SPEC §2.5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryScheduled {
    /// Backoff before the next execute attempt, ms (0: queued at once).
    pub backoff_ms: i64,
    /// The attempt a store rewind ended (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "present")]
    pub ended_attempt_id: Option<Option<Uuid>>,
    /// The task's raised generation (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// When the backoff ends (absent when queued at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_at: Option<Timestamp>,
    /// Why.
    pub reason: String,
    /// The store identities of a rewind (only after a rewind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<Value>,
}

/// The data of an event that carries none (`{}`): `task_woken`,
/// `delivery_acknowledged`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoDetails {}

/// `key_released` (SPEC §2.9).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyReleased {
    /// The idempotency key released.
    pub idempotency_key: String,
}

/// `operator_retry_now`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorRetryNow {
    /// Who acted.
    pub actor: Actor,
    /// When the backoff would have ended.
    pub ready_at: Timestamp,
    /// Why.
    pub reason: String,
    /// The task's state before the action.
    pub state: TaskState,
}

/// `operator_cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorCancel {
    /// Who acted.
    pub actor: Actor,
    /// Why.
    pub reason: String,
    /// The task's state before the action.
    pub state: TaskState,
}

/// `operator_resolved`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorResolved {
    /// Who acted.
    pub actor: Actor,
    /// The external system's transaction id given with `committed`.
    pub external_txn_id: Option<String>,
    /// The task's raised generation.
    pub generation: i64,
    /// `committed` or `not_committed`.
    pub outcome: Outcome,
    /// Why.
    pub reason: String,
    /// The live attempt the action retired, if any.
    pub retired_attempt_id: Option<Uuid>,
    /// The task's state before the action.
    pub state: TaskState,
}

/// `operator_redriven`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorRedriven {
    /// Who acted.
    pub actor: Actor,
    /// Execute attempts granted beyond the contract's, now.
    pub attempts_granted: i64,
    /// The task's new deadline.
    pub deadline_at: Timestamp,
    /// Execute attempts made so far.
    pub execute_count: i64,
    /// The task's execute limit, now.
    pub execute_limit: i64,
    /// The failure the task had.
    pub failure: Option<Failure>,
    /// The task's raised generation.
    pub generation: i64,
    /// Why.
    pub reason: String,
    /// The task's state before the action (`failed`).
    pub state: TaskState,
}

/// `second_effect_suspected`: the evidence shows an external effect other
/// than the delivered one (SPEC §2 "Second effects").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecondEffectSuspected {
    /// The attempt the evidence is about (`null`: an operator's resolve that retired none).
    pub attempt_id: Option<Uuid>,
    /// The delivery's transaction id (`null`: not delivered, or delivered without one).
    pub delivered_txn_id: Option<String>,
    /// Which evidence showed the effect.
    pub evidence: EffectEvidence,
    /// The transaction id the evidence carried (`null`: none given).
    pub external_txn_id: Option<String>,
    /// The evidence's generation.
    pub generation: i64,
    /// The task's state when it was raised.
    pub state: TaskState,
}

/// `second_effect_acknowledged`: an operator settled a suspected second effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecondEffectAcknowledged {
    /// Who acted.
    pub actor: Actor,
    /// The suspected effect's transaction id (`null`: the one without an id).
    pub external_txn_id: Option<String>,
    /// Why.
    pub reason: String,
    /// How it was settled.
    pub resolution: EffectResolution,
    /// The task's state (unchanged by the action).
    pub state: TaskState,
}

#[cfg(test)]
mod tests;

/// Who performed an operator action. In an event's `actor` member:
/// `{"api_key_id": "…", "type": "api_key"}` or `{"type": "cli", "user": "…"}`
/// (keys in byte order, as every event's data; see [`ActorRecord`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "ActorRecord", try_from = "ActorRecord")]
pub enum Actor {
    /// An `admin` API key, over HTTP.
    ApiKey(Uuid),
    /// The `idem task …` command line acting on the store directly, as this
    /// operating-system user (`$USER`, else `$LOGNAME`, else `unknown`).
    Cli {
        /// The user name.
        user: String,
    },
}

/// The JSON form of an [`Actor`]: one object whose `type` says which of the
/// other members it has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorRecord {
    /// The admin key (`api_key` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_id: Option<Uuid>,
    /// `api_key` or `cli`.
    #[serde(rename = "type")]
    pub kind: ActorKind,
    /// The operating-system user (`cli` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// The `type` of an [`ActorRecord`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActorKind {
    /// An `admin` API key.
    ApiKey,
    /// The command line.
    Cli,
}

/// An [`ActorRecord`] whose members do not fit its `type`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an `api_key` actor has `api_key_id` alone, a `cli` actor `user` alone")]
pub struct ActorRecordError;

impl From<Actor> for ActorRecord {
    fn from(actor: Actor) -> ActorRecord {
        match actor {
            Actor::ApiKey(id) => ActorRecord {
                api_key_id: Some(id),
                kind: ActorKind::ApiKey,
                user: None,
            },
            Actor::Cli { user } => ActorRecord {
                api_key_id: None,
                kind: ActorKind::Cli,
                user: Some(user),
            },
        }
    }
}

impl TryFrom<ActorRecord> for Actor {
    type Error = ActorRecordError;

    fn try_from(r: ActorRecord) -> Result<Actor, ActorRecordError> {
        match (r.kind, r.api_key_id, r.user) {
            (ActorKind::ApiKey, Some(id), None) => Ok(Actor::ApiKey(id)),
            (ActorKind::Cli, None, Some(user)) => Ok(Actor::Cli { user }),
            _ => Err(ActorRecordError),
        }
    }
}
