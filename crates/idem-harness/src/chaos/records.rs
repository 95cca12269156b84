//! What clients and executors saw: the answers to submits and cancels, the
//! reports the server must have refused (and whether it did), and the task
//! rows and records the checker reads (the [`CheckInput`]).

use super::*;

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
    /// Whether the provider deduplicated pay requests.
    pub provider: ProviderMode,
    /// Transaction ids executors named in reports to idem: true once a
    /// report naming it was answered (idem keeps it as evidence), false
    /// while only reports without an answer named it.
    pub effect_reports: HashMap<String, bool>,
}
