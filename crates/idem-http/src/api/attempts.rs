//! The executor protocol: claim (with long-poll), heartbeat, device
//! acknowledgment, report and release of an attempt.

use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use idem_core::config::MIN_LEASE_MS;
use idem_core::machine::operator::{ExternalTxnId, is_short_text};
use idem_core::machine::{MAX_MESSAGE_CHARS, Report};
use idem_core::model::Role;
use idem_core::trace::TraceParent;
use idem_store::StoreError;
use idem_store::ops::ClaimRequest;
use serde_json::Value;

use super::extract::{IdPath, strict_body, strict_typed};
use super::wire::{
    AckBody, ClaimBody, ClaimResponse, ClaimedAttempt, HeartbeatBody, HeartbeatResponse,
    ReleaseBody, ReportBody, TaskEnvelope,
};
use super::{no_attempt, unknown_operation};
use crate::auth::Caller;
use crate::granted;
use crate::problem::{OVERLOADED_TOTAL, Problem};
use crate::service_metrics::REPORTS;
use crate::{AppResult, MAX_WAIT_MS, St};

/// How long a waiting claim that found the store overloaded
/// ([`StoreError::Overloaded`]) pauses before it asks for a connection again
/// (it already queued for one for the pool's wait bound).
pub const OVERLOADED_CLAIM_PAUSE: Duration = Duration::from_millis(100);

/// Lease attempts (executors). Never leases one attempt twice; optional
/// long-poll. Attempts whose answer cannot be handed to the connection (the
/// client is gone) are released at once.
#[utoipa::path(post, path = "/v1/attempts/claim", tag = "attempts", request_body = ClaimBody,
    responses((status = 200, body = ClaimResponse), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn claim(
    State(st): St,
    crate::auth::ClaimCaller(cached): crate::auth::ClaimCaller,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Response> {
    match claim_inner(&st, &cached, body).await {
        // A key from the cache is confirmed before any other refusal, so a
        // revoked key learns nothing but 401.
        Err(p) if p.status < 500 && p.status != 401 => Err(cached.confirm(&st, p).await),
        answer => answer,
    }
}

async fn claim_inner(
    st: &crate::AppState,
    cached: &crate::auth::SubmitCaller,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Response> {
    let caller = &cached.caller;
    caller.require(Role::Executor)?;
    let body: ClaimBody = strict_typed(body)?;
    if !is_short_text(&body.executor_id) {
        return Err(Problem::invalid(
            "`executor_id` must be 1–200 characters, none of them a control character",
        ));
    }
    let operations: Vec<String> = match body.operations {
        Some(ops) => {
            if ops.is_empty() {
                return Err(Problem::invalid("`operations` must not be empty"));
            }
            for op in &ops {
                if !st.config.operations.contains_key(op) {
                    return Err(unknown_operation(st, op));
                }
                caller.require_grant(op)?;
            }
            ops
        }
        None => st
            .config
            .operations
            .keys()
            .filter(|op| caller.0.grants(op))
            .cloned()
            .collect(),
    };
    let max = body.max.unwrap_or(1);
    if !(1..=100).contains(&max) {
        return Err(Problem::invalid("`max` must be 1–100"));
    }
    if let Some(lease) = body.lease_ms {
        let limit = operations
            .iter()
            .filter_map(|op| st.config.operations.get(op))
            .map(|c| c.lease.max_ms)
            .min()
            .unwrap_or(MIN_LEASE_MS);
        if lease < MIN_LEASE_MS || lease > limit {
            return Err(Problem::invalid(format!(
                "`lease_ms` must be {MIN_LEASE_MS}–{limit}"
            )));
        }
    }
    let wait_ms = body.wait_ms.unwrap_or(0);
    if wait_ms > MAX_WAIT_MS {
        return Err(Problem::invalid(format!(
            "`wait_ms` must be 0–{MAX_WAIT_MS}"
        )));
    }
    let req = ClaimRequest {
        tenant: caller.0.tenant.clone(),
        operations: operations.clone(),
        executor_id: body.executor_id,
        max,
        lease_ms: body.lease_ms,
        flow: st.claim_flow(&caller.0, &operations),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
    // A claim that may wait takes a seat among this instance's waiting claims
    // (`crate::claims`): it queries only when woken or when its group is not
    // known to be empty.
    let seat = (wait_ms > 0 && !req.operations.is_empty()).then(|| {
        st.claims.join(
            &st.store,
            &req.tenant,
            req.flow.serves.as_ref(),
            &req.operations,
        )
    });
    // Whether the claim has found nothing once and waits (logged once).
    let mut waiting = false;
    // Whether the key must be asked of the database before the next claim
    // query: a key from the cache, or one that may have been revoked while
    // the claim waited.
    let mut unconfirmed = cached.is_cached();
    loop {
        // Whether this round's claim found the store overloaded (it then
        // tries again at once, unless its deadline has passed).
        let mut overloaded = false;
        // The leases of `claimed`, released unless the answer reaches the
        // connection (`crate::granted`).
        let (claimed, granted) = match &seat {
            _ if req.operations.is_empty() => (Vec::new(), None),
            None => {
                let key = unconfirmed.then_some(cached.caller.0.id);
                match granted::claim(&st.store, req.clone(), key).await? {
                    Some((claimed, granted)) => (claimed, Some(granted)),
                    None => return Err(cached.revoked(st)),
                }
            }
            Some(seat) => {
                let turn = seat.begin();
                if turn.claim {
                    // The key's check, when due, is part of the claim's
                    // transaction.
                    let recheck = unconfirmed || waiting;
                    let key = recheck.then_some(cached.caller.0.id);
                    match granted::claim(&st.store, req.clone(), key).await {
                        Ok(Some((claimed, granted))) => {
                            if recheck {
                                unconfirmed = false;
                            }
                            seat.end(turn, claimed.len(), max as usize);
                            (claimed, Some(granted))
                        }
                        Ok(None) => return Err(cached.revoked(st)),
                        // No connection came free in time: the claim keeps
                        // waiting within its `wait_ms` (it claimed nothing)
                        // and tries again after a pause, or answers empty at
                        // its deadline; its group is not marked empty.
                        Err(StoreError::Overloaded(_)) => {
                            overloaded = true;
                            (Vec::new(), None)
                        }
                        Err(e) => return Err(e.into()),
                    }
                } else {
                    (Vec::new(), None)
                }
            }
        };
        if overloaded {
            tracing::debug!(executor_id = %req.executor_id,
                "claim found the store overloaded; it keeps waiting");
            metrics::counter!(OVERLOADED_TOTAL, "handled" => "waited").increment(1);
            let pause = tokio::time::Instant::now() + OVERLOADED_CLAIM_PAUSE;
            tokio::select! {
                () = tokio::time::sleep_until(pause.min(deadline)) => {}
                () = st.drained() => {}
            }
        }
        let done = !claimed.is_empty() || tokio::time::Instant::now() >= deadline;
        if done || st.is_draining() {
            metrics::counter!("idem_attempts_leased_total").increment(claimed.len() as u64);
            for c in &claimed {
                crate::service_metrics::record_queue_wait(&c.task, &c.attempt);
            }
            let attempts = claimed
                .into_iter()
                .map(|c| ClaimedAttempt {
                    id: c.attempt.id,
                    task_id: c.task.id,
                    number: c.attempt.number,
                    generation: c.attempt.generation,
                    kind: c.attempt.kind,
                    lease_expires_at: c.attempt.lease_expires_at,
                    lease_ms: c.attempt.lease_ms,
                    operation: c.task.operation,
                    params: c.task.params,
                    idempotency_key: c.task.idempotency_key,
                    traceparent: c.task.traceparent.map(TraceParent::into_string),
                })
                .collect();
            let answer = Json(ClaimResponse { attempts });
            return Ok(match granted {
                Some(granted) => granted::answer_with(answer, granted),
                None => answer.into_response(),
            });
        }
        if overloaded {
            continue;
        }
        if !waiting {
            waiting = true;
            tracing::debug!(executor_id = %req.executor_id, wait_ms, "claim waiting for work");
        }
        // Without a seat (no class granted) only the deadline or a drain ends it.
        let woken = async {
            match &seat {
                Some(seat) => seat.woken().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = woken => {}
            () = tokio::time::sleep_until(deadline) => {}
            () = st.drained() => {}
        }
    }
}

/// Extend a lease; learn whether a cancellation is pending.
#[utoipa::path(post, path = "/v1/attempts/{id}/heartbeat", tag = "attempts", params(("id" = String, Path, description = "attempt id")), request_body = HeartbeatBody,
    responses((status = 200, body = HeartbeatResponse), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "STALE_GENERATION", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn heartbeat(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<HeartbeatResponse>> {
    caller.require(Role::Executor)?;
    let attempt_id = id;
    let body: HeartbeatBody = strict_typed(body)?;
    if body.usage.is_some_and(|u| u < 0) {
        return Err(Problem::invalid("usage must not be negative"));
    }
    let tenant = acting_tenant(&st, &caller.0, attempt_id).await?;
    let ack = caller
        .store(&st)
        .heartbeat(&tenant, attempt_id, body.generation, body.usage)
        .await?
        .map_err(|r| Problem::refused(r, no_attempt(attempt_id)))?;
    Ok(Json(HeartbeatResponse {
        lease_expires_at: ack.lease_expires_at,
        lease_ms: ack.lease_ms,
        cancel_requested: ack.cancel_requested,
    }))
}

/// Device gateway: the command was acknowledged (not completed). The task stays `running`.
#[utoipa::path(post, path = "/v1/attempts/{id}/ack", tag = "attempts", params(("id" = String, Path, description = "attempt id")), request_body = AckBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "STALE_GENERATION", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn acknowledge(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Executor)?;
    let attempt_id = id;
    let (raw, body): (Value, AckBody) = strict_body(body)?;
    let tenant = acting_tenant(&st, &caller.0, attempt_id).await?;
    let task = caller
        .store(&st)
        .acknowledge(&tenant, attempt_id, body.generation, raw)
        .await?
        .map_err(|r| Problem::refused(r, no_attempt(attempt_id)))?;
    Ok(Json(TaskEnvelope { task }))
}

/// Report an attempt's outcome. Stale generations are kept as evidence and answered 409.
#[utoipa::path(post, path = "/v1/attempts/{id}/report", tag = "attempts", params(("id" = String, Path, description = "attempt id")), request_body = ReportBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "STALE_GENERATION or ATTEMPT_ALREADY_REPORTED", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn report(
    State(st): St,
    crate::auth::ClaimCaller(cached): crate::auth::ClaimCaller,
    id: Result<IdPath, Problem>,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    match report_inner(&st, &cached, id, body).await {
        // A key from the cache is confirmed before any other refusal, so a
        // revoked key learns nothing but 401.
        Err(p) if p.status < 500 && p.status != 401 => Err(cached.confirm(&st, p).await),
        answer => answer,
    }
}

async fn report_inner(
    st: &crate::AppState,
    cached: &crate::auth::SubmitCaller,
    id: Result<IdPath, Problem>,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    let caller = &cached.caller;
    caller.require(Role::Executor)?;
    let IdPath(attempt_id) = id?;
    let (raw, body): (Value, ReportBody) = strict_body(body)?;
    if let Some(t) = body.external_txn_id.as_deref() {
        ExternalTxnId::parse(t).map_err(|e| Problem::invalid(e.to_string()))?;
    }
    if let Some(chars) = body
        .message
        .as_deref()
        .map(|m| m.chars().count())
        .filter(|&n| n > MAX_MESSAGE_CHARS)
    {
        return Err(Problem::invalid(format!(
            "`message` has {chars} characters; at most {MAX_MESSAGE_CHARS} are stored (trim it and report again)"
        )));
    }
    let report = Report {
        generation: body.generation,
        outcome: body.outcome,
        result: body.result,
        failure_class: body.failure_class,
        message: body.message,
        usage: body.usage,
        external_txn_id: body.external_txn_id,
        body: raw,
    };
    let tenant = acting_tenant(st, &caller.0, attempt_id).await?;
    // A key from the cache is checked in the report's own transaction.
    let store = caller.store(st);
    let res = if cached.is_cached() {
        match store
            .report_as(caller.0.id, &tenant, attempt_id, report)
            .await?
        {
            Some(res) => res,
            None => return Err(cached.revoked(st)),
        }
    } else {
        store.report(&tenant, attempt_id, report).await?
    };
    let label = match &res {
        Ok(_) => "applied",
        Err(idem_store::Refusal::Machine(idem_core::machine::Rejection::StaleGeneration {
            ..
        })) => "stale",
        Err(_) => "refused",
    };
    REPORTS.increment(label);
    let task = res.map_err(|r| Problem::refused(r, no_attempt(attempt_id)))?;
    Ok(Json(TaskEnvelope { task }))
}

/// Give back an attempt the executor never started (a worker shutting down):
/// the task is claimable again at once, the attempt kept `released`, counted
/// against no limit and never reconciled. Fenced by generation like a report;
/// an exact repeat answers 200 again.
#[utoipa::path(post, path = "/v1/attempts/{id}/release", tag = "attempts", params(("id" = String, Path, description = "attempt id")), request_body = ReleaseBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "STALE_GENERATION (an old generation or an expired lease), or ATTEMPT_ALREADY_REPORTED (the attempt was reported, acknowledged or recorded usage: it started)", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn release(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Executor)?;
    let attempt_id = id;
    let body: ReleaseBody = strict_typed(body)?;
    let tenant = acting_tenant(&st, &caller.0, attempt_id).await?;
    let task = caller
        .store(&st)
        .release(&tenant, attempt_id, body.generation)
        .await?
        .map_err(|r| Problem::refused(r, no_attempt(attempt_id)))?;
    Ok(Json(TaskEnvelope { task }))
}

/// The tenant an executor key acts for on `attempt_id` (SPEC §2.13): its
/// own; for a pool key, the attempt's tenant when the pool serves it.
///
/// # Errors
/// 404 `NOT_FOUND` for a pool key and an attempt of a tenant the pool does
/// not serve, its key's own tenant included (the pool claims none of its
/// tasks), or no attempt at all; a store failure as its problem.
async fn acting_tenant(
    st: &crate::AppState,
    key: &idem_core::model::ApiKey,
    attempt_id: uuid::Uuid,
) -> AppResult<String> {
    if key.serves.is_none() {
        return Ok(key.tenant.clone());
    }
    match st.store.attempt_tenant(attempt_id).await? {
        Some(t) if key.serves_tenant(&t) => Ok(t),
        _ => Err(Problem::not_found(no_attempt(attempt_id)())),
    }
}
