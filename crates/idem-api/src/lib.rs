//! The JSON documents of the idem HTTP API (SPEC §4) that the server
//! (`idem-http`) and the SDK (`idem-client`) both read or write, written once.
//!
//! - Request bodies: [`SubmitBody`], [`ClaimBody`], [`HeartbeatBody`],
//!   [`AckBody`], [`ReportBody`], and the operator actions' [`ReasonBody`]
//!   and [`ResolveBody`].
//! - Response documents that are not records of the store: [`Meta`] (of a
//!   submit), [`ClaimedAttempt`], [`HeartbeatResponse`], [`Health`].
//! - Envelopes around records: [`SubmitResponse`], [`TaskEnvelope`],
//!   [`TasksPage`], [`AttemptsEnvelope`], [`EventsEnvelope`], [`CancelResponse`],
//!   [`ClaimResponse`], and the tenant feed's [`FeedEvent`] and [`FeedPage`].
//! - The RFC 9457 [`Problem`] document and its [`ProblemCode`].
//!
//! The records (task, attempt, event, cancellation) and their words (task
//! state, attempt kind, outcome, failure class, timestamps) are not here: a
//! document that carries one is generic over it. The server fills the
//! parameters with `idem-core`'s records and words, which decode strictly
//! (a word idem does not know is refused); the SDK fills them with its own
//! tolerant records, whose words decode an unknown word as `Other` and whose
//! timestamps stay RFC 3339 text, so that a client keeps working against a
//! newer server. Strict where idem receives, tolerant where the client
//! receives: the asymmetry is deliberate, and why the records are not shared.
//!
//! [`ProblemCode`] is shared and tolerant itself: a code this version does
//! not know decodes as [`ProblemCode::Other`], which cannot be serialized, so
//! a server never sends it.
//!
//! With the `openapi` feature every document derives `utoipa::ToSchema`; the
//! generic ones name their schema after themselves (`TaskEnvelope`, not
//! `TaskEnvelope_Task`) when used through a type alias that fixes the
//! parameters, as `idem-http` does.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

mod feed;
mod operator;
mod problem;

pub use feed::{FeedEvent, FeedPage};
pub use operator::{
    AcknowledgeEffectBody, EffectResolution, ReasonBody, ResolveBody, ResolveOutcome,
};
pub use problem::{InvalidValue, Problem, ProblemCode};

/// `POST /v1/tasks` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SubmitBody {
    /// Operation class, e.g. `payment.release`.
    pub operation: String,
    /// Request params (a JSON object); the class's material fields are fingerprinted.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub params: Value,
    /// Claim priority, 1 (least urgent) to 5 (most urgent), within the
    /// class's `flow.priorities`; 3 when absent (raised or lowered into the
    /// class's range). Not part of the fingerprint: a retry with another
    /// priority replays the task as accepted (SPEC §2.13).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 5))]
    pub priority: Option<i64>,
}

/// Submit response metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Meta {
    /// The request id (also in `X-Request-Id`).
    pub request_id: String,
    /// The idempotency key as parsed.
    pub idempotency_key: String,
    /// Whether this answer is a replay of an earlier acceptance.
    pub replayed: bool,
    /// For a terminal task: when its idempotency key's retention ends (RFC
    /// 3339); a submit with the same key after it creates a new task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_expires_at: Option<String>,
}

/// Submit response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SubmitResponse<T> {
    /// The task.
    pub task: T,
    /// Metadata.
    pub meta: Meta,
}

/// `{"task": TASK}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TaskEnvelope<T> {
    /// The task.
    pub task: T,
}

/// `{"tasks": [...], "next_cursor": "…" | null}`: one page of a task search
/// (`GET /v1/tasks` without `idempotency_key`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TasksPage<T> {
    /// The tasks, newest first (`created_at`, then id, descending).
    pub tasks: Vec<T>,
    /// The `cursor` of the next page (opaque); `null` on the last page.
    pub next_cursor: Option<String>,
}

/// `{"attempts": [...]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AttemptsEnvelope<A> {
    /// Attempts by number, each with its evidence.
    pub attempts: Vec<A>,
}

/// `{"events": [...]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventsEnvelope<E> {
    /// Events by sequence number.
    pub events: Vec<E>,
}

/// Cancel response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CancelResponse<T, C> {
    /// The task after the request.
    pub task: T,
    /// The cancellation record (also in `task.cancellation`).
    pub cancellation: C,
}

/// `POST /v1/attempts/claim` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClaimBody {
    /// Executor id recorded on the attempt (1–200 characters, no control
    /// characters).
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 200))]
    pub executor_id: String,
    /// Operation classes to claim from; default: every class the key is granted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operations: Option<Vec<String>>,
    /// Attempts at most (1–100, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 100))]
    pub max: Option<i64>,
    /// Lease length, ms: 100 ms to the class maximum; default: the class default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 100))]
    pub lease_ms: Option<i64>,
    /// Long-poll: wait up to this many ms for work (0–30000, default 0; more
    /// is 400 `INVALID_REQUEST`).
    // No `maximum` in the schema on purpose: generated clients (schemathesis)
    // then pick waits of up to 30 s for most claims, and time out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
}

// `K` is the attempt kind's word, `T` the timestamp (not in the doc
// comment, which is the schema's description).
/// One leased attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClaimedAttempt<K, T> {
    /// Attempt id: pass it (or the task id) to the provider as its idempotency key.
    pub id: Uuid,
    /// Task id.
    pub task_id: Uuid,
    /// Attempt number.
    pub number: i64,
    /// Fencing generation: send it with every heartbeat and report.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: K,
    /// Lease end.
    pub lease_expires_at: T,
    /// The lease length granted, ms (the requested `lease_ms` or the class
    /// default, within the class's bounds): an executor counts its local
    /// lease deadline from the time it sent the claim.
    pub lease_ms: i64,
    /// Operation class.
    pub operation: String,
    /// Task params.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub params: Value,
    /// The client's idempotency key.
    pub idempotency_key: String,
    /// The W3C `traceparent` the task was submitted with (`null` when none):
    /// start the executor's spans as its children to join the submitter's
    /// trace.
    #[serde(default)]
    pub traceparent: Option<String>,
}

/// Claim response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClaimResponse<A> {
    /// Leased attempts (empty when nothing is due).
    pub attempts: Vec<A>,
}

/// Heartbeat body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeartbeatBody {
    /// The generation the executor holds.
    pub generation: i64,
    /// The attempt's total usage so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0))]
    pub usage: Option<i64>,
}

// `T` is the timestamp.
/// Heartbeat response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeartbeatResponse<T> {
    /// The extended lease end.
    pub lease_expires_at: T,
    /// The length the lease was just extended by, ms (the attempt's lease
    /// length, counted from the heartbeat's arrival): an executor counts its
    /// local lease deadline from the time it sent the heartbeat.
    pub lease_ms: i64,
    /// A cancellation is pending: stop and report `cancelled` with usage.
    pub cancel_requested: bool,
}

/// Release body: the executor gives back an attempt it never started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReleaseBody {
    /// The generation the executor holds.
    pub generation: i64,
}

/// Device acknowledgment body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AckBody {
    /// The generation the executor holds.
    pub generation: i64,
}

// `O` is the outcome's word, `F` the failure class's; build one with the
// constructors and the `with_*` methods.
/// Report body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// `default` on `failure_class` would otherwise ask `F: Default`.
#[serde(bound(deserialize = "O: Deserialize<'de>, F: Deserialize<'de>"))]
pub struct ReportBody<O, F> {
    /// The generation the executor holds.
    pub generation: i64,
    /// `succeeded`, `failed`, `unknown`, `cancelled`, `committed`, `not_committed`.
    pub outcome: O,
    /// Result document (`succeeded`, `committed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub result: Option<Value>,
    /// Required with `failed`: `transient`, `invalid_input`, `permission_denied`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_class: Option<F>,
    /// Free text (an error's message), at most 4,096 characters: a longer
    /// one is 400 `INVALID_REQUEST` and nothing is stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 4096))]
    pub message: Option<String>,
    /// The attempt's total usage (integer units).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0))]
    pub usage: Option<i64>,
    /// The external system's transaction id (1–200 characters, no control
    /// characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 200))]
    pub external_txn_id: Option<String>,
}

/// The outcomes a report names (SPEC §4 `/report`), for [`ReportBody`]'s
/// named constructors: implemented by a side's outcome word.
pub trait ReportOutcome: Sized {
    /// `succeeded`: an execute attempt's effect happened.
    const SUCCEEDED: Self;
    /// `failed`: needs a failure class.
    const FAILED: Self;
    /// `unknown`: the executor cannot tell whether the effect happened.
    const UNKNOWN: Self;
    /// `cancelled`: stopped on request of a pending cancellation.
    const CANCELLED: Self;
    /// `committed`: a reconcile attempt found the effect.
    const COMMITTED: Self;
    /// `not_committed`: a reconcile attempt found no effect.
    const NOT_COMMITTED: Self;
}

impl<O, F> ReportBody<O, F> {
    /// A report with only `generation` and `outcome`.
    pub fn new(generation: i64, outcome: O) -> Self {
        ReportBody {
            generation,
            outcome,
            result: None,
            failure_class: None,
            message: None,
            usage: None,
            external_txn_id: None,
        }
    }

    /// Sets the result document.
    #[must_use]
    pub fn with_result(mut self, result: Value) -> Self {
        self.result = Some(result);
        self
    }

    /// Sets the attempt's total usage.
    #[must_use]
    pub fn with_usage(mut self, usage: i64) -> Self {
        self.usage = Some(usage);
        self
    }

    /// Sets the external transaction id.
    #[must_use]
    pub fn with_external_txn_id(mut self, id: impl Into<String>) -> Self {
        self.external_txn_id = Some(id.into());
        self
    }

    /// Sets the free-text message.
    #[must_use]
    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = Some(message.into());
        self
    }
}

impl<O: ReportOutcome, F> ReportBody<O, F> {
    /// `succeeded` with a result (execute attempts).
    pub fn succeeded(generation: i64, result: Value) -> Self {
        ReportBody::new(generation, O::SUCCEEDED).with_result(result)
    }

    /// `committed` with the reconciled result (reconcile attempts).
    pub fn committed(generation: i64, result: Value) -> Self {
        ReportBody::new(generation, O::COMMITTED).with_result(result)
    }

    /// `not_committed` (reconcile attempts).
    pub fn not_committed(generation: i64) -> Self {
        ReportBody::new(generation, O::NOT_COMMITTED)
    }

    /// `failed` with its class and message.
    pub fn failed(generation: i64, class: F, message: impl Into<String>) -> Self {
        let mut r = ReportBody::new(generation, O::FAILED);
        r.failure_class = Some(class);
        r.message = Some(message.into());
        r
    }

    /// `unknown`: the executor cannot tell whether the effect happened.
    pub fn unknown(generation: i64) -> Self {
        ReportBody::new(generation, O::UNKNOWN)
    }

    /// `cancelled`: stopped on request of a pending cancellation.
    pub fn cancelled(generation: i64) -> Self {
        ReportBody::new(generation, O::CANCELLED)
    }
}

/// Liveness / readiness answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// `ok`.
    pub status: String,
    /// `sqlite` or `postgres` (readiness only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}
