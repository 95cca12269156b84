//! `GET /v1/queues`: the caller's tenant's queues, one per operation class
//! with waiting tasks: how many a claim could lease now and how long they have
//! waited (SPEC §4 "Queues").

use axum::Json;
use axum::extract::State;
use idem_core::model::{Role, Timestamp};
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::problem::Problem;
use crate::{AppResult, St};

/// One operation class's waiting tasks.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Queue {
    /// Operation class.
    pub operation: String,
    /// Tasks a claim could lease now (`queued`, `retry_wait` or
    /// `reconciling`, due, no attempt holding a lease).
    pub depth: i64,
    /// The longest wait, ms since the task became claimable (`ready_at`).
    pub oldest_wait_ms: i64,
    /// The median wait, ms (nearest rank).
    pub wait_p50_ms: i64,
    /// The 99th-percentile wait, ms (nearest rank).
    pub wait_p99_ms: i64,
}

impl From<idem_store::ops::QueueStat> for Queue {
    fn from(q: idem_store::ops::QueueStat) -> Queue {
        Queue {
            operation: q.operation,
            depth: q.depth,
            oldest_wait_ms: q.oldest_wait_ms,
            wait_p50_ms: q.wait_p50_ms,
            wait_p99_ms: q.wait_p99_ms,
        }
    }
}

/// The answer of `GET /v1/queues`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct QueuesPage {
    /// The store's clock when the queues were read.
    pub now: Timestamp,
    /// The queues with waiting tasks, by class (classes with none are left
    /// out; a key limited to some classes sees only those).
    pub queues: Vec<Queue>,
}

/// The caller's tenant's queues: waiting tasks and their waits per class.
#[utoipa::path(get, path = "/v1/queues", tag = "tasks",
    responses((status = 200, body = QueuesPage), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, description = "an executor key", body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn list_queues(State(st): St, caller: Caller) -> AppResult<Json<QueuesPage>> {
    caller.require(Role::Client)?;
    let q = caller.store(&st).task_queues(&caller.0.tenant).await?;
    Ok(Json(QueuesPage {
        now: q.now,
        queues: q.queues.into_iter().map(Queue::from).collect(),
    }))
}
