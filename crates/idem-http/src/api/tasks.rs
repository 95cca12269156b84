//! Client reads and actions on a task: lookup by scope, the task, its
//! attempts and events, cancellation, delivery acknowledgment.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_api::ReasonBody;
use idem_core::model::Role;

use super::extract::{IdPath, strict_typed};
use super::wire::{AttemptsEnvelope, CancelResponse, EventsEnvelope, LookupQuery, TaskEnvelope};
use super::{no_task, unknown_operation};
use crate::auth::Caller;
use crate::problem::Problem;
use crate::{AppResult, St};

/// Look a task up by scope after a timeout (`GET /v1/tasks` with
/// `idempotency_key`, documented with the search: [`super::search::list_tasks`]).
pub async fn lookup_task(
    State(st): St,
    caller: Caller,
    q: Result<Query<LookupQuery>, QueryRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Client)?;
    let Query(q) = q.map_err(|e| Problem::invalid(e.body_text()))?;
    let (Some(operation), Some(key)) = (q.operation, q.idempotency_key) else {
        return Err(Problem::invalid(
            "both `operation` and `idempotency_key` are required",
        ));
    };
    // The query carries the key itself (as stored), not its header encoding.
    let key = idem_core::key::IdempotencyKey::new(&key).map_err(Problem::from)?;
    if !st.config.operations.contains_key(&operation) {
        // As a submit answers it: a class this server does not know is a bad
        // request, not a task that does not exist.
        return Err(unknown_operation(&st, &operation));
    }
    caller.require_grant(&operation)?;
    let task = caller
        .store(&st)
        .find_task(&caller.0.tenant, &operation, key.as_str())
        .await?
        .map_err(|r| {
            Problem::refused(r, || {
                format!(
                    "no task of `{operation}` with Idempotency-Key `{}` for this tenant",
                    crate::problem::shorten(key.as_str())
                )
            })
        })?;
    Ok(Json(TaskEnvelope { task }))
}

/// Read a task. With `Prefer: wait=N` (RFC 7240; N seconds, at most 60) the
/// answer waits until the task is terminal or N seconds passed, and carries
/// `Preference-Applied: wait=N`.
#[utoipa::path(get, path = "/v1/tasks/{id}", tag = "tasks", params(("id" = String, Path, description = "task id"), ("Prefer" = Option<String>, Header, description = "`wait=N`: hold the answer until the task is terminal or N seconds (at most 60) passed (RFC 7240)")),
    responses((status = 200, body = TaskEnvelope, headers(("Preference-Applied" = String, description = "`wait=N` when a `wait` preference was honoured"))), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn get_task(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    headers: HeaderMap,
) -> AppResult<Response> {
    caller.require(Role::Client)?;
    let store = caller.store(&st);
    let task = store
        .get_task(Some(&caller.0.tenant), id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    let Some(seconds) = crate::wait::wait_preference(&headers) else {
        return Ok(Json(TaskEnvelope { task }).into_response());
    };
    let task = crate::wait::until_terminal(&st, &store, &caller.0.tenant, task, seconds).await?;
    let mut res = Json(TaskEnvelope { task }).into_response();
    crate::wait::applied(res.headers_mut(), seconds);
    Ok(res)
}

/// Attempts of a task with their evidence.
#[utoipa::path(get, path = "/v1/tasks/{id}/attempts", tag = "tasks", params(("id" = String, Path, description = "task id")),
    responses((status = 200, body = AttemptsEnvelope), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn list_attempts(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
) -> AppResult<Json<AttemptsEnvelope>> {
    caller.require(Role::Client)?;
    let attempts = caller
        .store(&st)
        .list_attempts(Some(&caller.0.tenant), id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(AttemptsEnvelope { attempts }))
}

/// The append-only event history of a task; with `Accept: text/event-stream`
/// a live stream of it (`id:` = `seq`, resumable with `Last-Event-ID`) that
/// ends after the event that made the task terminal (SPEC §4, "Live events").
#[utoipa::path(get, path = "/v1/tasks/{id}/events", tag = "tasks", params(("id" = String, Path, description = "task id"), ("Last-Event-ID" = Option<String>, Header, description = "with `Accept: text/event-stream`: the `seq` of the last event received; the stream starts after it")),
    responses((status = 200, description = "The history, or with `Accept: text/event-stream` a stream of `Event` documents (`id:` = `seq`)", content((EventsEnvelope = "application/json"), (String = "text/event-stream"))), (status = 204, description = "`Accept: text/event-stream` on a terminal task with no event after `Last-Event-ID`: nothing more will come"), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn list_events(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    headers: HeaderMap,
) -> AppResult<Response> {
    caller.require(Role::Client)?;
    if super::events::wants_stream(&headers) {
        return super::events::task_stream(st, &caller, id, &headers).await;
    }
    let events = caller
        .store(&st)
        .list_events(Some(&caller.0.tenant), id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(EventsEnvelope { events }).into_response())
}

/// Request cancellation (SPEC §2.7, CANCEL-01): 202 when recorded and pending, 200 when settled.
/// A client key's body is not read. An admin key must send `{"reason"}`: its
/// cancel is the same transition, with an `operator_cancel` event recording
/// the key and the reason (SPEC §4 "Operator actions").
#[utoipa::path(post, path = "/v1/tasks/{id}/cancel", tag = "tasks", params(("id" = String, Path, description = "task id")), request_body(content = Option<ReasonBody>, description = "Required of an admin key (`{\"reason\"}`); a client key's body is not read."),
    responses((status = 200, description = "confirmed or too_late", body = CancelResponse), (status = 202, description = "requested", body = CancelResponse), (status = 400, description = "an admin key's body has no valid `reason`", body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn cancel_task(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Response> {
    caller.require(Role::Client)?;
    let store = caller.store(&st);
    let tenant = &caller.0.tenant;
    let answer = if caller.0.role == Role::Admin {
        let body: ReasonBody = strict_typed(body)?;
        let by = super::operator::operator(&caller, &body.reason)?;
        store.operator_cancel(Some(tenant), id, by).await?
    } else {
        store.cancel(tenant, id).await?
    };
    let (task, cancellation) = answer.map_err(|r| Problem::refused(r, no_task(id)))?;
    let status = if cancellation.status == idem_core::model::CancelStatus::Requested {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(CancelResponse { task, cancellation })).into_response())
}

/// Acknowledge receipt of the delivery (idempotent; never charges again).
#[utoipa::path(post, path = "/v1/tasks/{id}/delivery/ack", tag = "tasks", params(("id" = String, Path, description = "task id")),
    responses((status = 200, body = TaskEnvelope), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "NOT_DELIVERED", body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn acknowledge_delivery(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Client)?;
    let task = caller
        .store(&st)
        .acknowledge_delivery(&caller.0.tenant, id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(TaskEnvelope { task }))
}
