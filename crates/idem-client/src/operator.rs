//! The operator actions (SPEC §4 "Operator actions") for an `admin` key:
//! each takes the reason recorded with the key's id in the action's event
//! (1–500 characters, no control characters; else 400 `INVALID_REQUEST`).
//! A client or executor key gets 403 `PERMISSION_DENIED`; another tenant's
//! task 404 `NOT_FOUND`; a task in a state the action does not apply to 409
//! `INVALID_STATE`, and nothing changes.

use idem_api::{AcknowledgeEffectBody, EffectResolution, ReasonBody, ResolveBody, ResolveOutcome};
use serde_json::Value;
use uuid::Uuid;

use crate::{Answer, CancelEnvelope, CancelResponse, Client, Result, Task, TaskEnvelope};

fn reason(reason: &str) -> ReasonBody {
    ReasonBody {
        reason: reason.to_owned(),
    }
}

impl Client {
    /// `POST /v1/tasks/{id}/retry-now`: a `retry_wait` task becomes claimable at once.
    ///
    /// # Errors
    /// 409 `INVALID_STATE` when the task is not `retry_wait`; see the module docs.
    pub async fn retry_now(&self, task_id: Uuid, why: &str) -> Result<Task> {
        let a: Answer<TaskEnvelope> = self
            .post_json(&format!("v1/tasks/{task_id}/retry-now"), &reason(why))
            .await?;
        Ok(a.body.task)
    }

    /// `POST /v1/tasks/{id}/cancel` with a reason: an admin's cancellation,
    /// the same transition and answers as [`Client::cancel`].
    ///
    /// # Errors
    /// 400 without a valid reason; see the module docs.
    pub async fn operator_cancel(&self, task_id: Uuid, why: &str) -> Result<CancelResponse> {
        let a: Answer<CancelEnvelope> = self
            .post_json(&format!("v1/tasks/{task_id}/cancel"), &reason(why))
            .await?;
        Ok(CancelResponse {
            status: a.status,
            task: a.body.task,
            cancellation: a.body.cancellation,
        })
    }

    /// `POST /v1/tasks/{id}/resolve` with `committed`: the effect of a
    /// `reconciling` task happened; `result` is delivered once, with its charge.
    ///
    /// # Errors
    /// 409 `INVALID_STATE` when the task is not `reconciling`; see the module docs.
    pub async fn resolve_committed(
        &self,
        task_id: Uuid,
        result: Value,
        external_txn_id: Option<&str>,
        why: &str,
    ) -> Result<Task> {
        self.resolve(
            task_id,
            &ResolveBody {
                outcome: ResolveOutcome::Committed,
                result: Some(result),
                external_txn_id: external_txn_id.map(str::to_owned),
                reason: why.to_owned(),
            },
        )
        .await
    }

    /// `POST /v1/tasks/{id}/resolve` with `not_committed`: the effect of a
    /// `reconciling` task did not happen; the next execute attempt may start.
    ///
    /// # Errors
    /// 409 `INVALID_STATE` when the task is not `reconciling`; see the module docs.
    pub async fn resolve_not_committed(&self, task_id: Uuid, why: &str) -> Result<Task> {
        self.resolve(
            task_id,
            &ResolveBody {
                outcome: ResolveOutcome::NotCommitted,
                result: None,
                external_txn_id: None,
                reason: why.to_owned(),
            },
        )
        .await
    }

    async fn resolve(&self, task_id: Uuid, body: &ResolveBody) -> Result<Task> {
        let a: Answer<TaskEnvelope> = self
            .post_json(&format!("v1/tasks/{task_id}/resolve"), body)
            .await?;
        Ok(a.body.task)
    }

    /// `POST /v1/tasks/{id}/redrive`: a `failed` task (`transient`,
    /// `attempts_exhausted`, `deadline_exceeded`, `budget_exhausted`) returns
    /// to `queued` with one more execute attempt and a new deadline.
    ///
    /// # Errors
    /// 409 `INVALID_STATE` for another state or failure class, 409
    /// `SUBMITTER_REVOKED` when the submitting key was revoked; see the module docs.
    pub async fn redrive(&self, task_id: Uuid, why: &str) -> Result<Task> {
        let a: Answer<TaskEnvelope> = self
            .post_json(&format!("v1/tasks/{task_id}/redrive"), &reason(why))
            .await?;
        Ok(a.body.task)
    }

    /// `POST /v1/tasks/{id}/second-effects/acknowledge`: records how the
    /// suspected second effect with `external_txn_id` (`None`: the one
    /// reported without an id) was settled, and why. The task does not
    /// change otherwise; an acknowledged effect answers its acknowledgment.
    ///
    /// # Errors
    /// 404 `NOT_FOUND` when the task has no such suspected second effect;
    /// see the module docs.
    pub async fn acknowledge_second_effect(
        &self,
        task_id: Uuid,
        external_txn_id: Option<&str>,
        resolution: EffectResolution,
        why: &str,
    ) -> Result<Task> {
        let body = AcknowledgeEffectBody {
            external_txn_id: external_txn_id.map(str::to_owned),
            resolution,
            reason: why.to_owned(),
        };
        let a: Answer<TaskEnvelope> = self
            .post_json(
                &format!("v1/tasks/{task_id}/second-effects/acknowledge"),
                &body,
            )
            .await?;
        Ok(a.body.task)
    }
}
