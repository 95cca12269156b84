//! Records: tasks, attempts, evidence, events and their states (SPEC §1, §3).
//!
//! A record carries two kinds of fields: the API fields of SPEC §4, which
//! serialize as the JSON contract, and control fields (`#[serde(skip)]`)
//! that only the store and the state machine see (tenant, compare-and-set
//! version, next attempt kind, wake-up times).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use uuid::Uuid;

use crate::contract::FrozenContract;

pub mod event;
pub use event::EventData;

/// A point in time as epoch milliseconds (UTC). Serialized as an RFC 3339
/// string with millisecond precision (e.g. `2026-11-29T22:47:35.123Z`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// Epoch milliseconds.
    pub fn ms(self) -> i64 {
        self.0
    }

    /// This instant plus `ms` milliseconds (saturating).
    pub fn plus_ms(self, ms: i64) -> Timestamp {
        Timestamp(self.0.saturating_add(ms))
    }

    /// RFC 3339 rendering (UTC, milliseconds). Out-of-range instants render
    /// as the raw millisecond count, which never happens for real clocks.
    pub fn to_rfc3339(self) -> String {
        self.with_rfc3339(str::to_owned)
    }

    /// Calls `f` with [`Timestamp::to_rfc3339`]'s text, for years 0000–9999
    /// from a stack buffer ([`Timestamp::rfc3339_bytes`]), else from
    /// [`Timestamp::to_rfc3339_slow`].
    fn with_rfc3339<R>(self, f: impl FnOnce(&str) -> R) -> R {
        match self.rfc3339_bytes() {
            // The buffer holds ASCII digits and separators only.
            Some(b) => match std::str::from_utf8(&b) {
                Ok(text) => f(text),
                Err(_) => f(&self.to_rfc3339_slow()),
            },
            None => f(&self.to_rfc3339_slow()),
        }
    }

    /// `YYYY-MM-DDTHH:MM:SS.mmmZ` (24 ASCII bytes) for years 0000–9999, the
    /// text [`Timestamp::to_rfc3339_slow`] gives for them, written without the
    /// format-description interpreter or an allocation: every answer carries
    /// several timestamps. `None` outside those years.
    fn rfc3339_bytes(self) -> Option<[u8; 24]> {
        let t =
            time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(self.0) * 1_000_000).ok()?;
        let year = u32::try_from(t.year()).ok().filter(|y| *y <= 9999)?;
        let mut b = *b"0000-00-00T00:00:00.000Z";
        let mut put = |at: usize, width: usize, mut v: u32| {
            for i in (at..at + width).rev() {
                // A digit: `v % 10` is below 10.
                b[i] = b'0' + (v % 10) as u8;
                v /= 10;
            }
        };
        put(0, 4, year);
        put(5, 2, u32::from(u8::from(t.month())));
        put(8, 2, u32::from(t.day()));
        put(11, 2, u32::from(t.hour()));
        put(14, 2, u32::from(t.minute()));
        put(17, 2, u32::from(t.second()));
        put(20, 3, u32::from(t.millisecond()));
        Some(b)
    }

    /// [`Timestamp::to_rfc3339`] through `time`'s format description: any
    /// year it can represent, or the raw millisecond count.
    fn to_rfc3339_slow(self) -> String {
        let nanos = i128::from(self.0) * 1_000_000;
        match time::OffsetDateTime::from_unix_timestamp_nanos(nanos) {
            Ok(t) => {
                let fmt = time::macros::format_description!(
                    "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
                );
                t.format(&fmt).unwrap_or_else(|_| self.0.to_string())
            }
            Err(_) => self.0.to_string(),
        }
    }

    /// Parses an RFC 3339 timestamp.
    ///
    /// # Errors
    /// Returns the parse error text when `s` is not RFC 3339.
    pub fn parse_rfc3339(s: &str) -> Result<Timestamp, String> {
        let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
            .map_err(|e| e.to_string())?;
        let ms = t.unix_timestamp_nanos() / 1_000_000;
        i64::try_from(ms).map(Timestamp).map_err(|e| e.to_string())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.with_rfc3339(|text| s.serialize_str(text))
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Timestamp::parse_rfc3339(&s).map_err(serde::de::Error::custom)
    }
}

/// Declares a string-valued enum with `as_str`, `Display` and `FromStr`, so
/// the same words appear in SQL columns, JSON and logs.
macro_rules! word_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $var:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($(#[$vm])* $var),+ }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$var),+];

            /// The wire and database spelling.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$var => $s),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownWord;
            fn from_str(s: &str) -> Result<Self, UnknownWord> {
                match s {
                    $($s => Ok($name::$var),)+
                    _ => Err(UnknownWord { kind: stringify!($name), word: s.to_owned() }),
                }
            }
        }
    };
}

/// A string that names no variant of the expected enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} `{word}`")]
pub struct UnknownWord {
    /// The enum that was expected.
    pub kind: &'static str,
    /// The word received.
    pub word: String,
}

word_enum! {
    /// Task state (SPEC §3). `succeeded`, `failed` and `cancelled` are terminal.
    TaskState {
        /// Accepted, waiting for its first (or next, after `not_committed`) attempt.
        Queued => "queued",
        /// An execute attempt holds a lease.
        Running => "running",
        /// Backing off before the next execute attempt (safe classes only).
        RetryWait => "retry_wait",
        /// The outcome of an earlier attempt is unknown; only reconcile attempts run.
        Reconciling => "reconciling",
        /// Delivered (terminal).
        Succeeded => "succeeded",
        /// Failed with a [`FailureClass`] (terminal).
        Failed => "failed",
        /// Cancellation confirmed (terminal).
        Cancelled => "cancelled",
    }
}

impl TaskState {
    /// Whether no transition leaves this state.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled
        )
    }
}

word_enum! {
    /// Attempt state (SPEC §3).
    AttemptState {
        /// Holds a lease; reports and heartbeats with its generation are accepted.
        Leased => "leased",
        /// A device gateway acknowledged the command; completion not yet observed.
        Acknowledged => "acknowledged",
        /// Reported `succeeded`.
        Succeeded => "succeeded",
        /// Reported `failed`.
        Failed => "failed",
        /// Reported `unknown`.
        Unknown => "unknown",
        /// The lease ran out without a report.
        Expired => "expired",
        /// Reported `cancelled`, or retired by a confirmed cancellation.
        Cancelled => "cancelled",
        /// A reconcile attempt found the effect committed.
        Committed => "committed",
        /// A reconcile attempt found the effect not committed.
        NotCommitted => "not_committed",
        /// Its executor released it before starting it (SPEC §4 `/release`):
        /// nothing ran, it counts against no limit, no reconcile follows.
        Released => "released",
    }
}

impl AttemptState {
    /// Whether the attempt still holds execution authority.
    pub fn is_active(self) -> bool {
        matches!(self, AttemptState::Leased | AttemptState::Acknowledged)
    }
}

word_enum! {
    /// What an attempt does.
    AttemptKind {
        /// Perform the effect.
        Execute => "execute",
        /// Ask the external system whether an earlier effect happened.
        Reconcile => "reconcile",
    }
}

word_enum! {
    /// What an executor reports for an attempt (SPEC §4 `/report`).
    Outcome {
        /// Execute attempt: the effect happened; carries the result.
        Succeeded => "succeeded",
        /// The attempt failed with a `failure_class`.
        Failed => "failed",
        /// Execute or reconcile attempt: the executor cannot tell whether the effect happened.
        Unknown => "unknown",
        /// Execute attempt: stopped on request of a cancellation, with usage.
        Cancelled => "cancelled",
        /// Reconcile attempt: the effect happened; carries the result.
        Committed => "committed",
        /// Reconcile attempt: the effect did not happen.
        NotCommitted => "not_committed",
    }
}

word_enum! {
    /// Why a task failed (SPEC §4 `failure.class`; seed retry table, RETRY-01).
    FailureClass {
        /// Temporary transport or runtime failure: retried only for safe classes.
        Transient => "transient",
        /// Never retried automatically.
        InvalidInput => "invalid_input",
        /// Never retried automatically; also the result of a revoked grant (SPEC §2.8).
        PermissionDenied => "permission_denied",
        /// Usage exceeded the contract's usage budget.
        BudgetExhausted => "budget_exhausted",
        /// The contract's deadline passed before the task could finish.
        DeadlineExceeded => "deadline_exceeded",
        /// The contract's maximum number of execute attempts was used up.
        AttemptsExhausted => "attempts_exhausted",
    }
}

impl FailureClass {
    /// Whether an executor may report this class (the others are decided by idem).
    pub fn is_reportable(self) -> bool {
        matches!(
            self,
            FailureClass::Transient | FailureClass::InvalidInput | FailureClass::PermissionDenied
        )
    }
}

word_enum! {
    /// Cancellation status (SPEC §4 `cancellation.status`).
    CancelStatus {
        /// Recorded; the running attempt has not stopped yet.
        Requested => "requested",
        /// Cancellation won: the task is `cancelled`.
        Confirmed => "confirmed",
        /// Delivery won (or the task had already ended): nothing was cancelled.
        TooLate => "too_late",
    }
}

word_enum! {
    /// The role of an API key (SPEC §4 Auth).
    Role {
        /// Submits, reads, cancels tasks.
        Client => "client",
        /// Claims attempts and reports on them.
        Executor => "executor",
        /// Everything a client and an executor may do, for its tenant.
        Admin => "admin",
    }
}

word_enum! {
    /// The type of an audit event (SPEC §2.10): which transition wrote it.
    EventKind {
        /// The task was accepted (carries the fingerprint, canonical request and decision).
        TaskSubmitted => "task_submitted",
        /// An attempt was leased to an executor.
        AttemptLeased => "attempt_leased",
        /// A heartbeat raised the attempt's usage total.
        UsageRecorded => "usage_recorded",
        /// A device gateway acknowledged the command.
        CommandAcknowledged => "command_acknowledged",
        /// A report with a different outcome arrived for an attempt that already has one.
        DuplicateReport => "duplicate_report",
        /// A report from an old generation or after the lease ended, kept as evidence.
        StaleReport => "stale_report",
        /// An execute attempt reported `succeeded`.
        CompletionObserved => "completion_observed",
        /// A reconcile attempt reported `committed` or `not_committed`.
        Reconciled => "reconciled",
        /// An attempt reported `failed`.
        AttemptFailed => "attempt_failed",
        /// An attempt reported `unknown`.
        OutcomeUnknown => "outcome_unknown",
        /// An attempt reported `cancelled`.
        AttemptCancelled => "attempt_cancelled",
        /// An attempt's lease ran out without a report.
        LeaseExpired => "lease_expired",
        /// An executor released an attempt it never started: the task is
        /// claimable again at once.
        AttemptReleased => "attempt_released",
        /// The result was recorded with its charge.
        Delivered => "delivered",
        /// A cancellation was recorded and waits for the running attempt.
        CancelRequested => "cancel_requested",
        /// A cancellation won: the task is `cancelled`.
        CancelConfirmed => "cancel_confirmed",
        /// A cancellation came after delivery or the end of the task.
        CancelTooLate => "cancel_too_late",
        /// The task failed (terminal).
        TaskFailed => "task_failed",
        /// Only reconcile attempts run until the outcome is known.
        ReconciliationRequired => "reconciliation_required",
        /// Another execute attempt may start (after a backoff, or at once).
        RetryScheduled => "retry_scheduled",
        /// A task whose backoff passed was queued again.
        TaskWoken => "task_woken",
        /// The client acknowledged the delivery.
        DeliveryAcknowledged => "delivery_acknowledged",
        /// The retention sweeper removed the task's idempotency key.
        KeyReleased => "key_released",
        /// An operator made a `retry_wait` task claimable at once (carries actor and reason).
        OperatorRetryNow => "operator_retry_now",
        /// An operator requested cancellation (carries actor and reason; the
        /// cancellation's own events follow).
        OperatorCancel => "operator_cancel",
        /// An operator settled a `reconciling` task's unknown outcome (carries
        /// actor, reason and outcome; `delivered` or the next step follows).
        OperatorResolved => "operator_resolved",
        /// An operator sent a `failed` task back to `queued` with one more
        /// execute attempt (carries actor and reason).
        OperatorRedriven => "operator_redriven",
        /// The evidence shows an external effect other than the delivered
        /// one (a second effect is suspected; carries the transaction id and
        /// the evidence that showed it).
        SecondEffectSuspected => "second_effect_suspected",
        /// An operator acknowledged a suspected second effect (carries actor,
        /// reason and resolution).
        SecondEffectAcknowledged => "second_effect_acknowledged",
    }
}

impl EventKind {
    /// Whether this event is written by the transition that makes a task
    /// terminal (`succeeded`, `failed`, `cancelled`): `delivered`,
    /// `task_failed`, `cancel_confirmed`. A live task stream ends after it
    /// (SPEC §4, "Live events").
    pub fn ends_task(self) -> bool {
        matches!(
            self,
            EventKind::Delivered | EventKind::TaskFailed | EventKind::CancelConfirmed
        )
    }

    /// Whether the transition that writes this event may leave its task
    /// claimable (`queued`, `reconciling` without a live attempt, or
    /// `retry_wait` whose backoff ends): a waiting executor of the task's
    /// class is woken for it (SPEC §4, "Waiting executors at fleet scale").
    /// Erring towards `true` costs a claim query; towards `false`, a wait
    /// until the claim's bounded re-check.
    pub fn may_make_claimable(self) -> bool {
        matches!(
            self,
            EventKind::TaskSubmitted
                | EventKind::RetryScheduled
                | EventKind::TaskWoken
                | EventKind::ReconciliationRequired
                | EventKind::LeaseExpired
                | EventKind::AttemptReleased
                | EventKind::Reconciled
                | EventKind::OperatorRetryNow
                | EventKind::OperatorRedriven
                | EventKind::OperatorResolved
        )
    }
}

word_enum! {
    /// What a piece of evidence reports: the outcome of an executor's report,
    /// or `ack` for a device acknowledgment (SPEC §4 `/ack`).
    EvidenceOutcome {
        /// Reported `succeeded`.
        Succeeded => "succeeded",
        /// Reported `failed`.
        Failed => "failed",
        /// Reported `unknown`.
        Unknown => "unknown",
        /// Reported `cancelled`.
        Cancelled => "cancelled",
        /// Reported `committed`.
        Committed => "committed",
        /// Reported `not_committed`.
        NotCommitted => "not_committed",
        /// A device gateway's command acknowledgment.
        Ack => "ack",
    }
}

impl From<Outcome> for EvidenceOutcome {
    fn from(o: Outcome) -> EvidenceOutcome {
        match o {
            Outcome::Succeeded => EvidenceOutcome::Succeeded,
            Outcome::Failed => EvidenceOutcome::Failed,
            Outcome::Unknown => EvidenceOutcome::Unknown,
            Outcome::Cancelled => EvidenceOutcome::Cancelled,
            Outcome::Committed => EvidenceOutcome::Committed,
            Outcome::NotCommitted => EvidenceOutcome::NotCommitted,
        }
    }
}

word_enum! {
    /// What idem did with a piece of evidence (SPEC §2.4, RETRY-01).
    Disposition {
        /// It changed the attempt (and maybe the task).
        Applied => "applied",
        /// An exact repeat of what was applied: answered as before, nothing changed.
        Repeat => "repeat",
        /// Its generation no longer held the lease: nothing changed.
        StaleGeneration => "stale_generation",
        /// The attempt already had a different outcome: nothing changed.
        AlreadyReported => "already_reported",
    }
}

/// A cancellation record (SPEC §2.7, CANCEL-01).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Cancellation {
    /// `requested`, `confirmed` or `too_late`.
    pub status: CancelStatus,
    /// When the cancel request was recorded.
    pub requested_at: Timestamp,
    /// When it was settled (confirmed or found too late).
    pub confirmed_at: Option<Timestamp>,
    /// Fee in minor currency units, by the frozen contract; `null` while pending.
    pub fee: Option<i64>,
    /// ISO 4217 code of the fee's currency (the contract's `fees.currency`);
    /// `null` when the contract names none (minor units of no named currency).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(example = "EUR"))]
    pub currency: Option<String>,
}

/// The recorded final outcome handed to the client (SPEC §2.6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Delivery {
    /// The executor's (or reconciliation's) result document.
    pub result: Value,
    /// The external system's transaction id, when the executor gave one.
    pub external_txn_id: Option<String>,
    /// When the result was recorded.
    pub delivered_at: Timestamp,
    /// When the client acknowledged receipt (`/delivery/ack`).
    pub acknowledged_at: Option<Timestamp>,
    /// Charge in minor currency units: always the contract price, charged once.
    pub charge: i64,
    /// ISO 4217 code of the charge's currency (the contract's
    /// `fees.currency`); `null` when the contract names none.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(example = "EUR"))]
    pub currency: Option<String>,
}

/// Why a task failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Failure {
    /// The failure class.
    pub class: FailureClass,
    /// Human-readable detail.
    pub message: String,
}

/// Control fields of a task: seen by the store and the state machine, never
/// serialized into the API.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TaskControl {
    /// The owning tenant.
    pub tenant: String,
    /// The API key that submitted the task (checked again before every new attempt, SPEC §2.8).
    pub api_key_id: Uuid,
    /// The RFC 8785 canonical request that was fingerprinted.
    pub canonical_request: String,
    /// Compare-and-set version: raised by every write of the task row.
    pub version: i64,
    /// Sequence number of the newest event.
    pub event_seq: i64,
    /// Execute attempts started so far (counted against `max_attempts`).
    pub execute_count: i64,
    /// Execute attempts granted beyond the contract's `max_attempts`, one
    /// per operator redrive (`machine::operator::redrive`).
    pub attempts_granted: i64,
    /// Kind of the next attempt a claim would create.
    pub next_kind: Option<AttemptKind>,
    /// The attempt that currently holds the lease, if any.
    pub active_attempt_id: Option<Uuid>,
    /// Not claimable before this instant (backoff).
    pub ready_at: Timestamp,
    /// Execute attempts are not started after this instant.
    pub deadline_at: Timestamp,
    /// When the task became terminal.
    pub terminal_at: Option<Timestamp>,
    /// When its idempotency key may be removed (terminal + retention).
    pub key_expires_at: Option<Timestamp>,
    /// The effect reports the task's evidence holds, the first of each
    /// distinct `external_txn_id` (`null` counted as one), in the order
    /// received: what [`crate::machine`] compares with the delivery.
    pub effect_reports: Vec<EffectReport>,
    /// How many effect reports the task holds (the `tasks` row's
    /// `effect_report_count`, read with the task): a task loads its
    /// [`TaskControl::effect_reports`] and second effects only when it is
    /// above 0 (second effects come only from effect reports).
    pub effect_report_count: i64,
    /// The concurrency key read from `params` at submit under the class's
    /// `flow.concurrency_key` pointer (SPEC §8.2 "Concurrency caps"); with
    /// the tenant and operation it names the key's cap scope. `None`: no key.
    pub concurrency_key: Option<String>,
    /// The value at the class's `fairness_key` pointer in the params at
    /// acceptance (a string as is, other JSON as its canonical text), `None`
    /// when the class names no pointer or the params have no value there:
    /// claims serve the values of one tenant and class in turn (SPEC §2.13).
    pub fairness_key: Option<String>,
}

/// The priority of a task whose submit named none (SPEC §4).
pub const DEFAULT_PRIORITY: i64 = 3;

fn default_priority() -> i64 {
    DEFAULT_PRIORITY
}

/// A task: the one durable logical operation a scope maps to (SPEC §4 TASK).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Task {
    /// Task id (UUID v7).
    pub id: Uuid,
    /// Operation class.
    pub operation: String,
    /// The client's idempotency key.
    pub idempotency_key: String,
    /// `sha256:<64 hex>` of the canonical request.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub fingerprint: String,
    /// The request params as submitted.
    pub params: Value,
    /// Current state.
    pub state: TaskState,
    /// Fencing generation: the newest attempt's, or more after a confirmed cancellation.
    pub generation: i64,
    /// Attempts of any kind created so far.
    pub attempt_count: i64,
    /// Usage units consumed by all attempts.
    pub usage: i64,
    /// The contract frozen at acceptance.
    #[cfg_attr(feature = "openapi", schema(value_type = crate::config::Contract))]
    pub contract: FrozenContract,
    /// The cancellation record, if a cancel was requested.
    pub cancellation: Option<Cancellation>,
    /// The delivery record, once delivered.
    pub delivery: Option<Delivery>,
    /// Why the task failed, if it did.
    pub failure: Option<Failure>,
    /// When the task was accepted.
    pub created_at: Timestamp,
    /// When the task row last changed.
    pub updated_at: Timestamp,
    /// The W3C `traceparent` the submit carried (SPEC §4), handed to every
    /// executor that claims an attempt; `null` when it carried none. Not part
    /// of the fingerprint: it never changes after acceptance.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, pattern = "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"))]
    pub traceparent: Option<crate::trace::TraceParent>,
    /// Claim priority, 1 (least urgent) to 5 (most urgent), 3 unless the
    /// submit named one (SPEC §4 `POST /v1/tasks`). Not part of the
    /// fingerprint: it never changes after acceptance.
    #[serde(default = "default_priority")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 5))]
    pub priority: i64,
    /// The suspected second effects (SPEC §2 "Second effects"): one per
    /// distinct `external_txn_id` the evidence shows besides the delivered
    /// one, oldest first, each with its acknowledgment once an operator gave one.
    #[serde(default)]
    pub second_effects: Vec<SecondEffect>,
    /// Control fields (not part of the API).
    #[serde(skip)]
    #[cfg_attr(feature = "openapi", schema(ignore))]
    pub control: TaskControl,
}

impl Task {
    /// Whether the task has a cancellation in `requested` status.
    pub fn cancel_pending(&self) -> bool {
        matches!(&self.cancellation, Some(c) if c.status == CancelStatus::Requested)
    }

    /// Execute attempts the task may start in all: its contract's
    /// `max_attempts` plus those operator redrives granted.
    pub fn execute_limit(&self) -> i64 {
        let granted = self.control.attempts_granted;
        self.contract.retry.max_attempts.saturating_add(granted)
    }
}

word_enum! {
    /// Which evidence showed an external effect (an effect report: an
    /// executor's `succeeded` or `committed`, or an operator's `committed`).
    EffectEvidence {
        /// A report from an old generation, kept as evidence.
        StaleReport => "stale_report",
        /// A report of the current generation after its lease ended.
        LateReport => "late_report",
        /// A report for an attempt that already had a different outcome.
        DuplicateReport => "duplicate_report",
        /// The report that was applied.
        AppliedReport => "applied_report",
        /// An operator's `resolve` with outcome `committed`.
        OperatorResolved => "operator_resolved",
    }
}

word_enum! {
    /// How an operator settled a suspected second effect.
    EffectResolution {
        /// The second effect happened and was refunded.
        RefundIssued => "refund_issued",
        /// The provider deduplicated it: one effect only.
        ProviderDeduplicated => "provider_deduplicated",
        /// No second effect happened.
        FalseAlarm => "false_alarm",
    }
}

/// An effect report: evidence that the external effect happened, under the
/// transaction id it carried (control record; the rows behind search by
/// `external_txn_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectReport {
    /// The external system's transaction id (`null` when none was given).
    pub external_txn_id: Option<String>,
    /// The attempt reported on (for an operator's resolve: the attempt it retired, if any).
    pub attempt_id: Option<Uuid>,
    /// The report's generation (an operator's resolve: the raised one).
    pub generation: i64,
    /// Which evidence it is.
    pub evidence: EffectEvidence,
    /// When it was received.
    pub reported_at: Timestamp,
}

/// A suspected second effect of a task (SPEC §4 TASK `second_effects`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecondEffect {
    /// The transaction id the evidence carried (`null`: none given).
    pub external_txn_id: Option<String>,
    /// The attempt the evidence is about (`null` for an operator's resolve without one).
    pub attempt_id: Option<Uuid>,
    /// The evidence's generation.
    pub generation: i64,
    /// Which evidence showed it.
    pub evidence: EffectEvidence,
    /// When idem raised it.
    pub suspected_at: Timestamp,
    /// The operator's acknowledgment, once given.
    pub acknowledgment: Option<EffectAcknowledgment>,
}

/// An operator's acknowledgment of a suspected second effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EffectAcknowledgment {
    /// How it was settled.
    pub resolution: EffectResolution,
    /// Why (the operator's text).
    pub reason: String,
    /// Who acknowledged it.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub actor: event::Actor,
    /// When.
    pub acknowledged_at: Timestamp,
}

/// A report, heartbeat or acknowledgment received for an attempt, stored even
/// when it changes nothing (SPEC §2.4, RETRY-01: "retain late evidence").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Evidence {
    /// When idem received it.
    pub received_at: Timestamp,
    /// The generation the executor claimed to hold.
    pub generation: i64,
    /// The reported outcome (or `ack` for a device acknowledgment).
    pub outcome: EvidenceOutcome,
    /// The request body as received.
    pub body: Value,
    /// What idem did with it: `applied`, `repeat`, `stale_generation`, `already_reported`.
    pub disposition: Disposition,
}

/// One try at executing or reconciling a task (SPEC §1, RETRY-01).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Attempt {
    /// Attempt id (UUID v7); executors pass it on to providers.
    pub id: Uuid,
    /// The task.
    pub task_id: Uuid,
    /// 1-based number within the task.
    pub number: i64,
    /// Fencing generation, strictly increasing per task.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: AttemptKind,
    /// Current state.
    pub state: AttemptState,
    /// The executor that claimed it.
    pub executor_id: String,
    /// When the lease was granted.
    pub leased_at: Timestamp,
    /// When the lease runs out unless extended by a heartbeat.
    pub lease_expires_at: Timestamp,
    /// Usage units this attempt consumed (the largest value reported).
    pub usage: i64,
    /// The external system's transaction id, if reported.
    pub external_txn_id: Option<String>,
    /// Every report received for this attempt, applied or not.
    #[serde(default)]
    pub evidence: Vec<Evidence>,
    /// Lease length in ms used for heartbeat extensions (not in the API).
    #[serde(skip)]
    #[cfg_attr(feature = "openapi", schema(ignore))]
    pub lease_ms: i64,
    /// The applied report, for detecting exact repeats and naming the
    /// outcome already recorded (not in the API).
    #[serde(skip)]
    #[cfg_attr(feature = "openapi", schema(ignore))]
    pub report: Option<AppliedReport>,
}

/// The report applied to an attempt, as the state machine keeps it: its
/// outcome, and the body as received (an exact repeat of the body is
/// answered as the first was, SPEC §4 "Details"). Stores keep the body as
/// text in the attempt's `report` column and read the outcome back from it
/// with [`AppliedReport::from_body`].
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedReport {
    /// The outcome the report gave.
    pub outcome: Outcome,
    /// The request body as received (a JSON object with an `outcome` member).
    pub body: Value,
}

impl AppliedReport {
    /// The applied report whose body is `body`: its `outcome` member names
    /// the outcome.
    ///
    /// # Errors
    /// When `body` has no `outcome` member, or one that names no [`Outcome`]
    /// (a stored row no version of idem wrote).
    pub fn from_body(body: Value) -> Result<AppliedReport, serde_json::Error> {
        #[derive(Deserialize)]
        struct Head {
            outcome: Outcome,
        }
        let Head { outcome } = Head::deserialize(&body)?;
        Ok(AppliedReport { outcome, body })
    }
}

/// An append-only audit event (SPEC §2.10).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "EventRecord")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Event {
    /// 1-based, gap-free sequence within the task.
    pub seq: i64,
    /// Event type, e.g. `task_submitted`, `attempt_leased`, `delivered`.
    #[serde(rename = "type")]
    pub kind: EventKind,
    /// When it was written.
    pub at: Timestamp,
    /// Event details.
    // Typed by `kind` ([`EventData`]); its JSON is the stored text. (A doc
    // line here would change the OpenAPI description.)
    #[cfg_attr(feature = "openapi", schema(value_type = Value))]
    pub data: EventData,
}

/// An [`Event`] as read from JSON: the data is typed by the `type` member.
#[derive(Deserialize)]
struct EventRecord {
    seq: i64,
    #[serde(rename = "type")]
    kind: EventKind,
    at: Timestamp,
    data: Value,
}

impl From<EventRecord> for Event {
    fn from(r: EventRecord) -> Event {
        Event {
            seq: r.seq,
            kind: r.kind,
            at: r.at,
            data: EventData::from_value(r.kind, r.data),
        }
    }
}

/// A stored API key (the plain key is never stored, only its SHA-256 hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiKey {
    /// Key id (UUID).
    pub id: Uuid,
    /// Owning tenant.
    pub tenant: String,
    /// Role.
    pub role: Role,
    /// Operation classes the key is limited to; `None` means all.
    pub operations: Option<Vec<String>>,
    /// The tenants an executor key of a shared pool claims for (SPEC §2.13);
    /// `None`: its own tenant only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serves: Option<Serves>,
    /// When it was created.
    pub created_at: Timestamp,
    /// When it was revoked, if it was.
    pub revoked_at: Option<Timestamp>,
}

/// The tenants a pool executor key serves (SPEC §2.13).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum Serves {
    /// Every tenant (`"all"`).
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "all"))]
    All(AllTenants),
    /// These tenants (the key's own tenant only when listed).
    Tenants(Vec<String>),
}

/// The word `all` of [`Serves::All`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum AllTenants {
    /// Every tenant.
    All,
}

impl Serves {
    /// Whether `tenant` is served.
    pub fn serves(&self, tenant: &str) -> bool {
        match self {
            Serves::All(_) => true,
            Serves::Tenants(list) => list.iter().any(|t| t == tenant),
        }
    }

    /// Parses the CLI's and the store's text: `all`, or tenants separated by
    /// commas (none empty).
    pub fn parse(text: &str) -> Option<Serves> {
        let text = text.trim();
        if text == "all" {
            return Some(Serves::All(AllTenants::All));
        }
        let list: Vec<String> = text.split(',').map(|t| t.trim().to_owned()).collect();
        if list.iter().any(String::is_empty) {
            return None;
        }
        Some(Serves::Tenants(list))
    }

    /// The text [`Serves::parse`] reads.
    pub fn text(&self) -> String {
        match self {
            Serves::All(_) => "all".to_owned(),
            Serves::Tenants(list) => list.join(","),
        }
    }
}

impl ApiKey {
    /// Whether the key claims for `tenant`: its own tenant, or one its
    /// pool serves (SPEC §2.13).
    pub fn serves_tenant(&self, tenant: &str) -> bool {
        match &self.serves {
            None => self.tenant == tenant,
            Some(s) => s.serves(tenant),
        }
    }

    /// Whether the key is active and granted `operation` (SPEC §2.8).
    pub fn grants(&self, operation: &str) -> bool {
        self.revoked_at.is_none()
            && self
                .operations
                .as_ref()
                .is_none_or(|ops| ops.iter().any(|o| o == operation))
    }

    /// Whether the key may act in `role` (admin may act as any role).
    pub fn has_role(&self, role: Role) -> bool {
        self.role == role || self.role == Role::Admin
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `all` (spaces around it or not) is every tenant; a list is trimmed
    /// per name and refuses an empty one.
    #[test]
    fn serves_reads_all_and_lists() {
        assert_eq!(Serves::parse(" all "), Some(Serves::All(AllTenants::All)));
        assert_eq!(
            Serves::parse("acme, globex"),
            Some(Serves::Tenants(vec!["acme".into(), "globex".into()]))
        );
        assert_eq!(Serves::parse("acme,,globex"), None);
        assert_eq!(Serves::parse(""), None);
    }

    proptest! {
        /// The direct rendering is the format description's text, byte for
        /// byte, over years 0000–9999 and either side of them (where it
        /// hands over to the format description), and JSON carries it too.
        #[test]
        fn rfc3339_rendering_matches_the_format_description(
            ms in prop_oneof![
                -62_167_219_200_000i64..253_402_300_800_000,
                -62_300_000_000_000i64..-62_167_219_200_000,
                253_402_300_800_000i64..253_500_000_000_000,
                Just(i64::MIN),
                Just(i64::MAX),
            ]
        ) {
            let t = Timestamp(ms);
            let slow = t.to_rfc3339_slow();
            prop_assert_eq!(t.to_rfc3339(), slow.clone());
            prop_assert_eq!(serde_json::to_string(&t).ok(), Some(format!("\"{slow}\"")));
        }
    }

    /// Every millisecond and second digit, leap days, the epoch and the ends
    /// of the years the direct rendering covers.
    #[test]
    fn rfc3339_rendering_matches_at_the_edges() {
        let mut cases = vec![
            0,
            -1,
            951_782_400_000,     // 2000-02-29
            253_402_300_799_999, // 9999-12-31T23:59:59.999Z
            253_402_300_800_000, // 10000-01-01
            -62_167_219_200_000, // 0000-01-01
            -62_167_219_200_001, // the millisecond before
        ];
        cases.extend((0..1000).map(|ms| 1_795_000_059_000 + ms));
        cases.extend((0..60).map(|s| 1_795_000_000_000 + s * 1000 + 7));
        for ms in cases {
            let t = Timestamp(ms);
            assert_eq!(t.to_rfc3339(), t.to_rfc3339_slow(), "{ms}");
        }
    }

    #[test]
    fn timestamps_round_trip_through_rfc3339() {
        let t = Timestamp(1_795_000_000_123);
        let s = t.to_rfc3339();
        assert!(s.ends_with(".123Z"), "{s}");
        assert_eq!(Timestamp::parse_rfc3339(&s), Ok(t));
    }

    #[test]
    fn words_round_trip() {
        for s in TaskState::ALL {
            assert_eq!(s.as_str().parse::<TaskState>(), Ok(*s));
        }
        for s in Outcome::ALL {
            assert_eq!(s.as_str().parse::<Outcome>(), Ok(*s));
        }
        assert!("nope".parse::<Outcome>().is_err());
    }

    /// JSON carries each word as `as_str` spells it (the database's text),
    /// and decodes it back; an unknown word does not decode.
    #[test]
    fn serde_spells_words_as_the_database_does() {
        fn check<T>(all: &[T], as_str: fn(T) -> &'static str)
        where
            T: Copy + PartialEq + fmt::Debug + Serialize + serde::de::DeserializeOwned,
        {
            for w in all {
                let json = serde_json::to_value(w).unwrap();
                assert_eq!(json, Value::String(as_str(*w).to_owned()));
                assert_eq!(serde_json::from_value::<T>(json).unwrap(), *w);
            }
            assert!(serde_json::from_value::<T>(Value::String("nope".into())).is_err());
        }
        check(TaskState::ALL, TaskState::as_str);
        check(AttemptState::ALL, AttemptState::as_str);
        check(AttemptKind::ALL, AttemptKind::as_str);
        check(Outcome::ALL, Outcome::as_str);
        check(FailureClass::ALL, FailureClass::as_str);
        check(CancelStatus::ALL, CancelStatus::as_str);
        check(Role::ALL, Role::as_str);
        check(EventKind::ALL, EventKind::as_str);
        check(EvidenceOutcome::ALL, EvidenceOutcome::as_str);
        check(Disposition::ALL, Disposition::as_str);
        for o in Outcome::ALL {
            assert_eq!(EvidenceOutcome::from(*o).as_str(), o.as_str());
        }
    }

    #[test]
    fn applied_reports_read_their_outcome_from_the_body() {
        let body = serde_json::json!({"generation": 1, "outcome": "not_committed", "usage": 2});
        let r = AppliedReport::from_body(body.clone()).unwrap();
        assert_eq!((r.outcome, r.body), (Outcome::NotCommitted, body));
        for bad in [
            serde_json::json!({"generation": 1}),
            serde_json::json!({"outcome": "nope"}),
            serde_json::json!("succeeded"),
        ] {
            assert!(AppliedReport::from_body(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn grants_follow_revocation_and_operation_limits() {
        let mut k = ApiKey {
            id: Uuid::nil(),
            tenant: "acme".into(),
            role: Role::Client,
            operations: Some(vec!["payment.release".into()]),
            created_at: Timestamp(0),
            revoked_at: None,
            serves: None,
        };
        assert!(k.grants("payment.release"));
        assert!(!k.grants("generation.dispatch"));
        k.revoked_at = Some(Timestamp(1));
        assert!(!k.grants("payment.release"));
    }
}
