//! Operator actions (SPEC §4 "Operator actions"): an `admin` key of the
//! task's tenant makes a backoff end now, settles an unknown outcome by hand
//! and sends a failed task back to the queue; each with a required `reason`,
//! recorded with the key's id in the action's event. An admin's cancel is in
//! [`super::tasks::cancel_task`].
//!
//! Order of answers: 401 (no key) → 403 `PERMISSION_DENIED` (a client or
//! executor key) → 400 `INVALID_REQUEST` (the body, the reason) → 404
//! `NOT_FOUND` (no such task for this tenant and grant) → 409
//! `INVALID_STATE` / `SUBMITTER_REVOKED` (nothing changed). Acknowledging a
//! second effect the task does not have is 404 `NOT_FOUND`.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use idem_api::{AcknowledgeEffectBody, ReasonBody, ResolveBody, ResolveOutcome};
use idem_core::machine::operator::{self as machine, Actor, By, ExternalTxnId, Reason, Resolution};
use idem_core::model::{EffectResolution, Role};

use super::extract::{IdPath, strict_body, strict_typed};
use super::no_task;
use super::wire::TaskEnvelope;
use crate::auth::Caller;
use crate::problem::Problem;
use crate::{AppResult, St};

/// The caller (an admin key) acting for `reason`, or 400 `INVALID_REQUEST`.
pub(super) fn operator(caller: &Caller, reason: &str) -> AppResult<By> {
    let reason = Reason::parse(reason).map_err(|e| Problem::invalid(e.to_string()))?;
    Ok(By {
        actor: Actor::ApiKey(caller.0.id),
        reason,
    })
}

/// Make a `retry_wait` task claimable at once (admin).
#[utoipa::path(post, path = "/v1/tasks/{id}/retry-now", tag = "operator", params(("id" = String, Path, description = "task id")), request_body = ReasonBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "INVALID_STATE: the task is not `retry_wait`", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn retry_now(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Admin)?;
    let body: ReasonBody = strict_typed(body)?;
    let by = operator(&caller, &body.reason)?;
    let task = caller
        .store(&st)
        .retry_now(Some(&caller.0.tenant), id, by)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(TaskEnvelope { task }))
}

/// Settle a `reconciling` task's unknown outcome by hand (admin): `committed`
/// delivers `result` once with its charge, `not_committed` lets the next
/// execute attempt start; a live reconcile attempt is fenced off.
#[utoipa::path(post, path = "/v1/tasks/{id}/resolve", tag = "operator", params(("id" = String, Path, description = "task id")), request_body = ResolveBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "INVALID_STATE: the task is not `reconciling`", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn resolve(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Admin)?;
    let body: ResolveBody = strict_typed(body)?;
    let resolution = resolution(&body)?;
    let by = operator(&caller, &body.reason)?;
    let task = caller
        .store(&st)
        .resolve(Some(&caller.0.tenant), id, by, resolution)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(TaskEnvelope { task }))
}

/// The resolution a body asks for, or 400 ([`Resolution::parse`]'s rules).
fn resolution(body: &ResolveBody) -> AppResult<Resolution> {
    let outcome = match body.outcome {
        ResolveOutcome::Committed => machine::ResolveOutcome::Committed,
        ResolveOutcome::NotCommitted => machine::ResolveOutcome::NotCommitted,
    };
    Resolution::parse(
        outcome,
        body.result.clone(),
        body.external_txn_id.as_deref(),
    )
    .map_err(|e| Problem::invalid(e.to_string()))
}

/// Send a `failed` task back to `queued` with one more execute attempt and a
/// new deadline (admin). Only failures of class `transient`,
/// `attempts_exhausted`, `deadline_exceeded` or `budget_exhausted`; the
/// submitting key must still be live and granted the class.
#[utoipa::path(post, path = "/v1/tasks/{id}/redrive", tag = "operator", params(("id" = String, Path, description = "task id")), request_body = ReasonBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "INVALID_STATE (not `failed`, a failure class that is not redriven, a cancellation record, a released key) or SUBMITTER_REVOKED", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn redrive(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Admin)?;
    let body: ReasonBody = strict_typed(body)?;
    let by = operator(&caller, &body.reason)?;
    let task = caller
        .store(&st)
        .redrive(Some(&caller.0.tenant), id, by)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(TaskEnvelope { task }))
}

/// Acknowledge a suspected second effect (admin): record how it was settled
/// (`refund_issued`, `provider_deduplicated`, `false_alarm`), why, and by
/// whom. Detection and audit only: the task's state, delivery and charge do
/// not change. Idempotent: an acknowledged effect answers its acknowledgment
/// and nothing is written.
#[utoipa::path(post, path = "/v1/tasks/{id}/second-effects/acknowledge", tag = "operator", params(("id" = String, Path, description = "task id")), request_body = AcknowledgeEffectBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, description = "NOT_FOUND: no such task for this tenant and grant, or the task has no suspected second effect with this `external_txn_id`", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn acknowledge_second_effect(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Admin)?;
    let (value, body): (_, AcknowledgeEffectBody) = strict_body(body)?;
    if value.get("external_txn_id").is_none() {
        return Err(Problem::invalid(
            "body: `external_txn_id` is required (`null` names the second effect reported without an id)",
        ));
    }
    let txn = body
        .external_txn_id
        .as_deref()
        .map(ExternalTxnId::parse)
        .transpose()
        .map_err(|e| Problem::invalid(e.to_string()))?
        .map(ExternalTxnId::into_string);
    let resolution = match body.resolution {
        idem_api::EffectResolution::RefundIssued => EffectResolution::RefundIssued,
        idem_api::EffectResolution::ProviderDeduplicated => EffectResolution::ProviderDeduplicated,
        idem_api::EffectResolution::FalseAlarm => EffectResolution::FalseAlarm,
    };
    let by = operator(&caller, &body.reason)?;
    let (task, _) = caller
        .store(&st)
        .acknowledge_second_effect(Some(&caller.0.tenant), id, by, txn, resolution)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(TaskEnvelope { task }))
}
