//! The JSON documents of the HTTP API (SPEC §4) as the server reads and
//! writes them: request bodies, the lookup query and response envelopes,
//! each with its OpenAPI schema.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use idem_core::model::{
    Attempt, AttemptKind, Cancellation, Event, FailureClass, Outcome, Task, Timestamp,
};

/// `POST /v1/tasks` body.
#[derive(Debug, Deserialize, ToSchema)]
pub struct SubmitBody {
    /// Operation class, e.g. `payment.release`.
    pub operation: String,
    /// Request params (a JSON object); the class's material fields are fingerprinted.
    #[schema(value_type = Object)]
    pub params: Value,
}

/// Submit response metadata.
#[derive(Debug, Serialize, ToSchema)]
pub struct Meta {
    /// The request id (also in `X-Request-Id`).
    pub request_id: String,
    /// The idempotency key as parsed.
    pub idempotency_key: String,
    /// Whether this answer is a replay of an earlier acceptance.
    pub replayed: bool,
}

/// Submit response.
#[derive(Debug, Serialize, ToSchema)]
pub struct SubmitResponse {
    /// The task.
    pub task: Task,
    /// Metadata.
    pub meta: Meta,
}

/// `{"task": TASK}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TaskEnvelope {
    /// The task.
    pub task: Task,
}

/// `{"attempts": [...]}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AttemptsEnvelope {
    /// Attempts by number, each with its evidence.
    pub attempts: Vec<Attempt>,
}

/// `{"events": [...]}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventsEnvelope {
    /// Events by sequence number.
    pub events: Vec<Event>,
}

/// Cancel response.
#[derive(Debug, Serialize, ToSchema)]
pub struct CancelResponse {
    /// The task after the request.
    pub task: Task,
    /// The cancellation record (also in `task.cancellation`).
    pub cancellation: Cancellation,
}

/// Scope lookup query (both parameters are required: a missing one is 400
/// `INVALID_REQUEST`).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LookupQuery {
    /// Operation class.
    #[param(required = true, value_type = String)]
    pub operation: Option<String>,
    /// Idempotency key, as the submit's header carried it without the quotes
    /// (1–255 visible ASCII).
    #[param(required = true, value_type = String, pattern = "^[!-~]{1,255}$")]
    pub idempotency_key: Option<String>,
}

/// `POST /v1/attempts/claim` body.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ClaimBody {
    /// Executor id recorded on the attempt (1–200 characters, no control
    /// characters).
    #[schema(min_length = 1, max_length = 200)]
    pub executor_id: String,
    /// Operation classes to claim from; default: every class the key is granted.
    #[serde(default)]
    pub operations: Option<Vec<String>>,
    /// Attempts at most (1–100, default 1).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub max: Option<i64>,
    /// Lease length, ms: 100 ms to the class maximum; default: the class default.
    #[serde(default)]
    #[schema(minimum = 100)]
    pub lease_ms: Option<i64>,
    /// Long-poll: wait up to this many ms for work (0–30000, default 0; more
    /// is 400 `INVALID_REQUEST`).
    // No `maximum` in the schema on purpose: generated clients (schemathesis)
    // then pick waits of up to 30 s for most claims, and time out.
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

/// One leased attempt.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimedAttempt {
    /// Attempt id: pass it (or the task id) to the provider as its idempotency key.
    pub id: Uuid,
    /// Task id.
    pub task_id: Uuid,
    /// Attempt number.
    pub number: i64,
    /// Fencing generation: send it with every heartbeat and report.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: AttemptKind,
    /// Lease end.
    pub lease_expires_at: Timestamp,
    /// Operation class.
    pub operation: String,
    /// Task params.
    #[schema(value_type = Object)]
    pub params: Value,
    /// The client's idempotency key.
    pub idempotency_key: String,
}

/// Claim response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimResponse {
    /// Leased attempts (empty when nothing is due).
    pub attempts: Vec<ClaimedAttempt>,
}

/// Heartbeat body.
#[derive(Debug, Deserialize, ToSchema)]
pub struct HeartbeatBody {
    /// The generation the executor holds.
    pub generation: i64,
    /// The attempt's total usage so far.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub usage: Option<i64>,
}

/// Heartbeat response.
#[derive(Debug, Serialize, ToSchema)]
pub struct HeartbeatResponse {
    /// The extended lease end.
    pub lease_expires_at: Timestamp,
    /// A cancellation is pending: stop and report `cancelled` with usage.
    pub cancel_requested: bool,
}

/// Device acknowledgment body.
#[derive(Debug, Deserialize, ToSchema)]
pub struct AckBody {
    /// The generation the executor holds.
    pub generation: i64,
}

/// Report body.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ReportBody {
    /// The generation the executor holds.
    pub generation: i64,
    /// `succeeded`, `failed`, `unknown`, `cancelled`, `committed`, `not_committed`.
    pub outcome: Outcome,
    /// Result document (`succeeded`, `committed`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub result: Option<Value>,
    /// Required with `failed`: `transient`, `invalid_input`, `permission_denied`.
    #[serde(default)]
    pub failure_class: Option<FailureClass>,
    /// Free text.
    #[serde(default)]
    pub message: Option<String>,
    /// The attempt's total usage (integer units).
    #[serde(default)]
    #[schema(minimum = 0)]
    pub usage: Option<i64>,
    /// The external system's transaction id (1–200 characters, no control
    /// characters).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 200)]
    pub external_txn_id: Option<String>,
}

/// Liveness / readiness answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: String,
    /// `sqlite` or `postgres` (readiness only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}
