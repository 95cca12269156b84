//! The records of the idem HTTP API (SPEC §4) as the client receives them,
//! as plain serde structs; the request bodies, envelopes and problem
//! document are `idem-api`'s, filled with these records.
//!
//! Field names are the SPEC's. Unknown fields are ignored so that a newer
//! server can add fields; unknown enum words decode as `Other` so that a newer
//! server can add states. Timestamps are kept as the RFC 3339 strings the
//! server sends. The server decodes what it receives strictly with its own
//! records (`idem-core`'s); these stay tolerant on purpose, which is why the
//! two sides do not share records.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

/// Declares a snake_case word enum with an `Other` catch-all, `as_str` and `Display`.
macro_rules! words {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $var:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vm])* $var,)+
            /// A word this client version does not know (sent by a newer server).
            #[serde(other)]
            Other,
        }

        impl $name {
            /// The wire spelling (`"other"` for [`Self::Other`]).
            pub fn as_str(self) -> &'static str {
                match self { $($name::$var => $s,)+ $name::Other => "other" }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

words! {
    /// Task state (SPEC §3).
    TaskState {
        /// Accepted, waiting for an attempt.
        Queued => "queued",
        /// An execute attempt holds a lease.
        Running => "running",
        /// Backing off before the next execute attempt.
        RetryWait => "retry_wait",
        /// The outcome of an earlier attempt is unknown; only reconcile attempts run.
        Reconciling => "reconciling",
        /// Delivered (terminal).
        Succeeded => "succeeded",
        /// Failed (terminal).
        Failed => "failed",
        /// Cancellation confirmed (terminal).
        Cancelled => "cancelled",
    }
}

impl TaskState {
    /// Whether the state is terminal (`succeeded`, `failed`, `cancelled`).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled
        )
    }
}

words! {
    /// Attempt state (SPEC §3).
    AttemptState {
        /// Holds a lease.
        Leased => "leased",
        /// A device gateway acknowledged the command (not completed).
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
    }
}

words! {
    /// What an attempt does.
    AttemptKind {
        /// Perform the effect.
        Execute => "execute",
        /// Ask the external system whether an earlier effect happened.
        Reconcile => "reconcile",
    }
}

words! {
    /// The outcome an executor reports (SPEC §4 `/report`).
    Outcome {
        /// Execute attempt: the effect happened.
        Succeeded => "succeeded",
        /// The attempt failed; needs a [`FailureClass`].
        Failed => "failed",
        /// The executor cannot tell whether the effect happened.
        Unknown => "unknown",
        /// Stopped on request of a pending cancellation.
        Cancelled => "cancelled",
        /// Reconcile attempt: the effect happened.
        Committed => "committed",
        /// Reconcile attempt: the effect did not happen.
        NotCommitted => "not_committed",
    }
}

words! {
    /// Why a task or attempt failed (SPEC §4 `failure.class`).
    FailureClass {
        /// Temporary transport or runtime failure.
        Transient => "transient",
        /// Invalid input: never retried automatically.
        InvalidInput => "invalid_input",
        /// Permission denied: never retried automatically.
        PermissionDenied => "permission_denied",
        /// The usage budget was used up.
        BudgetExhausted => "budget_exhausted",
        /// The deadline passed.
        DeadlineExceeded => "deadline_exceeded",
        /// The maximum number of attempts was used up.
        AttemptsExhausted => "attempts_exhausted",
    }
}

words! {
    /// Status of a cancellation (SPEC §4 `cancellation.status`).
    CancelStatus {
        /// Recorded; execution has not stopped yet.
        Requested => "requested",
        /// Cancellation won: the task is `cancelled`.
        Confirmed => "confirmed",
        /// Delivery won (or the task had already ended).
        TooLate => "too_late",
    }
}

/// The contract frozen onto a task when it was accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contract {
    /// Price of a delivery, integer minor units.
    pub price: i64,
    /// Retry policy as the server sent it.
    #[serde(default)]
    pub retry: Value,
    /// Fee policy as the server sent it.
    #[serde(default)]
    pub fees: Value,
    /// Version of the configuration the contract came from.
    #[serde(default)]
    pub config_version: String,
}

impl Contract {
    /// The fee currency frozen into the contract: its ISO 4217 code
    /// (`fees.currency`) and minor-unit exponent (`fees.exponent`), or `None`
    /// when the contract names none (amounts are minor units of no named
    /// currency).
    pub fn currency(&self) -> Option<(&str, u32)> {
        let code = self.fees.get("currency")?.as_str()?;
        let exponent = self.fees.get("exponent")?.as_u64()?;
        Some((code, u32::try_from(exponent).ok()?))
    }
}

/// A cancellation record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancellation {
    /// `requested`, `confirmed` or `too_late`.
    pub status: CancelStatus,
    /// When the cancel request was recorded (RFC 3339).
    pub requested_at: String,
    /// When it was settled (RFC 3339), if it was.
    #[serde(default)]
    pub confirmed_at: Option<String>,
    /// Fee in minor units; `None` while pending.
    #[serde(default)]
    pub fee: Option<i64>,
    /// ISO 4217 code of the fee's currency (the contract's `fees.currency`);
    /// `None` when the contract names none (or from a server that does not send it).
    #[serde(default)]
    pub currency: Option<String>,
}

/// The recorded final outcome of a task, with its charge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Delivery {
    /// The result document.
    pub result: Value,
    /// The external system's transaction id, if the executor gave one.
    #[serde(default)]
    pub external_txn_id: Option<String>,
    /// When the result was recorded (RFC 3339).
    pub delivered_at: String,
    /// When the client acknowledged receipt (RFC 3339), if it did.
    #[serde(default)]
    pub acknowledged_at: Option<String>,
    /// Charge in minor units (the contract price, charged once).
    pub charge: i64,
    /// ISO 4217 code of the charge's currency (the contract's
    /// `fees.currency`); `None` when the contract names none.
    #[serde(default)]
    pub currency: Option<String>,
}

/// Why a task failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The failure class.
    pub class: FailureClass,
    /// Human-readable detail.
    #[serde(default)]
    pub message: String,
}

/// A task: the one durable logical operation an idempotency scope maps to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Task id.
    pub id: Uuid,
    /// Operation class, e.g. `payment.release`.
    pub operation: String,
    /// The idempotency key it was submitted with.
    pub idempotency_key: String,
    /// `sha256:<64 hex>` of the canonical request.
    pub fingerprint: String,
    /// The params as submitted.
    pub params: Value,
    /// Current state.
    pub state: TaskState,
    /// Fencing generation.
    pub generation: i64,
    /// Attempts of any kind created so far.
    pub attempt_count: i64,
    /// Usage units consumed by all attempts.
    pub usage: i64,
    /// The frozen contract.
    pub contract: Contract,
    /// The cancellation record, if a cancel was requested.
    #[serde(default)]
    pub cancellation: Option<Cancellation>,
    /// The delivery record, once delivered.
    #[serde(default)]
    pub delivery: Option<Delivery>,
    /// Why the task failed, if it did.
    #[serde(default)]
    pub failure: Option<Failure>,
    /// When the task was accepted (RFC 3339).
    pub created_at: String,
    /// When the task last changed (RFC 3339).
    pub updated_at: String,
    /// The W3C `traceparent` it was submitted with, if any
    /// ([`crate::Client::submit_traced`]).
    #[serde(default)]
    pub traceparent: Option<String>,
    /// The suspected second effects (SPEC §2.12), oldest first.
    #[serde(default)]
    pub second_effects: Vec<SecondEffect>,
}

/// A suspected second effect: evidence of an external effect besides the
/// delivered one (SPEC §4 TASK `second_effects`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecondEffect {
    /// The transaction id the evidence carried (`None`: none given).
    #[serde(default)]
    pub external_txn_id: Option<String>,
    /// The attempt the evidence is about (`None`: an operator's resolve without one).
    #[serde(default)]
    pub attempt_id: Option<Uuid>,
    /// The evidence's generation.
    pub generation: i64,
    /// `stale_report`, `late_report`, `duplicate_report`, `applied_report`
    /// or `operator_resolved` (a newer server may name others).
    pub evidence: String,
    /// When idem raised it (RFC 3339).
    pub suspected_at: String,
    /// The operator's acknowledgment, once given.
    #[serde(default)]
    pub acknowledgment: Option<EffectAcknowledgment>,
}

/// An operator's acknowledgment of a suspected second effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EffectAcknowledgment {
    /// `refund_issued`, `provider_deduplicated` or `false_alarm` (a newer
    /// server may name others).
    pub resolution: String,
    /// Why.
    pub reason: String,
    /// Who: `{"type": "api_key", "api_key_id"}` or `{"type": "cli", "user"}`.
    pub actor: Value,
    /// When (RFC 3339).
    pub acknowledged_at: String,
}

/// A report or acknowledgment received for an attempt, kept even when it changed nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// When idem received it (RFC 3339).
    pub received_at: String,
    /// The generation the executor presented.
    pub generation: i64,
    /// The reported outcome (or `ack`).
    pub outcome: String,
    /// The body as received.
    pub body: Value,
    /// What idem did with it (`applied`, `repeat`, `stale_generation`, …), when the server says.
    #[serde(default)]
    pub disposition: Option<String>,
}

/// One try at executing or reconciling a task, as listed by `GET /v1/tasks/{id}/attempts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// Attempt id.
    pub id: Uuid,
    /// 1-based number within the task.
    pub number: i64,
    /// Fencing generation.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: AttemptKind,
    /// Current state.
    pub state: AttemptState,
    /// The executor that claimed it.
    pub executor_id: String,
    /// When the lease was granted (RFC 3339).
    pub leased_at: String,
    /// When the lease ends (RFC 3339).
    pub lease_expires_at: String,
    /// Usage units consumed.
    pub usage: i64,
    /// The external system's transaction id, if reported.
    #[serde(default)]
    pub external_txn_id: Option<String>,
    /// Every report received for this attempt, applied or not.
    #[serde(default)]
    pub evidence: Vec<Evidence>,
}

/// One entry of a task's append-only event history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// 1-based sequence number within the task.
    pub seq: i64,
    /// Event type, e.g. `task_submitted`, `delivered`.
    #[serde(rename = "type")]
    pub kind: String,
    /// When it was written (RFC 3339).
    pub at: String,
    /// Event details.
    #[serde(default)]
    pub data: Value,
}

/// An attempt leased to an executor by `POST /v1/attempts/claim` (its
/// lease end kept as RFC 3339 text).
pub type ClaimedAttempt = idem_api::ClaimedAttempt<AttemptKind, String>;

/// Answer to a heartbeat (the extended lease end as RFC 3339 text).
pub type HeartbeatAck = idem_api::HeartbeatResponse<String>;

/// Body of `POST /v1/attempts/{id}/report`. Build one with the constructors
/// (`ReportBody::succeeded`, `failed`, …) and the `with_*` methods.
pub type ReportBody = idem_api::ReportBody<Outcome, FailureClass>;

impl idem_api::ReportOutcome for Outcome {
    const SUCCEEDED: Outcome = Outcome::Succeeded;
    const FAILED: Outcome = Outcome::Failed;
    const UNKNOWN: Outcome = Outcome::Unknown;
    const CANCELLED: Outcome = Outcome::Cancelled;
    const COMMITTED: Outcome = Outcome::Committed;
    const NOT_COMMITTED: Outcome = Outcome::NotCommitted;
}
