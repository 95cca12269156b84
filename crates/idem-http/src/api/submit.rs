//! `POST /v1/tasks`: the submit handler, the checks and fingerprint of a
//! submission before the store sees it, and the answer with its headers.

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::key::parse_header_values;
use idem_core::model::{Role, Task};
use idem_core::schema::SchemaError;
use idem_core::submit::{SubmitBodyError, check_schema, read_submit};
use idem_core::trace::TraceParent;
use idem_store::ops::{Submission, SubmitOutcome};
use serde::Serialize;

use super::extract::body_bytes;
use super::unknown_operation;
use super::wire::{Meta, SubmitBody, SubmitResponse};
use crate::auth::{Caller, SubmitCaller};
use crate::problem::{Problem, ProblemCode};
use crate::service_metrics::count_submit;
use crate::{AppResult, St};

fn request_id(headers: &HeaderMap) -> String {
    // A client's id may carry bytes beyond visible ASCII (obs-text); the
    // header is echoed as sent, and the body gets it with U+FFFD for bytes
    // that are not UTF-8 rather than not at all.
    headers
        .get("x-request-id")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default()
}

/// Submit a task with an `Idempotency-Key` (SPEC §2.1–2.3, IDEM-01).
#[utoipa::path(post, path = "/v1/tasks", tag = "tasks",
    params(
        ("Idempotency-Key" = String, Header, description = "RFC 9651 sf-string (\"abc\") or bare token; the key is 1–255 visible ASCII", pattern = "^(\"[!-~]{1,255}\"|[!-~]{1,255})$"),
        ("traceparent" = Option<String>, Header, description = "W3C Trace Context `traceparent` (version-traceid-parentid-flags, lowercase hex; not version ff, not an all-zero id): kept on the task and handed to executors with each claimed attempt; not part of the fingerprint", pattern = "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"),
        ("Prefer" = Option<String>, Header, description = "`wait=N`: hold the answer (a replay's too) until the task is terminal or N seconds (at most 60) passed (RFC 7240)"),
    ),
    request_body = SubmitBody,
    responses(
        (status = 201, description = "Accepted, or a replay (`Idempotent-Replayed: true`)", body = SubmitResponse,
            headers(
                ("Location" = String, description = "`/v1/tasks/{id}` of the task"),
                ("Idempotent-Replayed" = String, description = "`true` when the answer is a replay of an earlier submit (absent otherwise)"),
                ("Preference-Applied" = String, description = "`wait=N` when a `wait` preference was honoured"),
            )),
        (status = 400, description = "IDEMPOTENCY_KEY_MISSING, IDEMPOTENCY_KEY_INVALID, INVALID_REQUEST (also a malformed `traceparent`)", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 413, body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "IDEMPOTENCY_CONFLICT: same scope, different fingerprint", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "RATE_LIMITED: a new task over a rate limit of its tenant or class (SPEC §8.1); nothing was created and the Idempotency-Key is still free",
            headers(("Retry-After" = u32, description = "Seconds (>= 1) until the limit admits a new task")),
            body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "UNAVAILABLE, OVERLOADED, NO_SYNC_STANDBY (with `Retry-After`)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn submit_task(
    State(st): St,
    caller: SubmitCaller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Response> {
    let res = submit_inner(&st, &caller, &headers, body).await;
    count_submit(res.as_ref().map(|(_, replayed)| *replayed));
    res.map(|(r, _)| r)
}

async fn submit_inner(
    st: &crate::AppState,
    submitter: &SubmitCaller,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<(Response, bool)> {
    // Kept (a reference count) to name a conflict's differing fields.
    let raw = body.as_ref().ok().cloned();
    let (submission, schema_refusal) =
        match prepare_submission(st, &submitter.caller, headers, body) {
            Ok(v) => v,
            // Refused before the store saw it: a cached key is confirmed first, so
            // a revoked key learns nothing but 401.
            Err(p) => return Err(submitter.confirm(st, p).await),
        };
    // Refused before the store sees it: nothing written, nothing replayed.
    if let Some(why) = st.sync_standby_refusal() {
        return Err(Problem::no_sync_standby(&why));
    }
    let key = submission.idempotency_key.clone();
    let operation = submission.operation.clone();
    let outcome = match schema_refusal {
        None => st.store.submit(submission).await?,
        Some(refusal) => retry_of_accepted(st, submitter, headers, &submission, refusal).await?,
    };
    let (task, replayed) = match outcome {
        SubmitOutcome::Created(t) => (t, false),
        SubmitOutcome::Replayed(t) => (t, true),
        SubmitOutcome::Conflict { task } => {
            let task_id = task.id;
            let mut p = Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ProblemCode::IdempotencyConflict,
                format!(
                    "this Idempotency-Key is bound to task {task_id} with a different request fingerprint; nothing was changed"
                ),
            );
            p.task_id = Some(task_id);
            p.differing_fields = conflict_fields(&task, raw.as_deref());
            return Err(p);
        }
        SubmitOutcome::KeyRevoked { .. } => {
            st.keys.remove(&submitter.token_hash);
            return Err(Problem::unauthenticated("this API key was revoked"));
        }
        SubmitOutcome::RateLimited { retry_after_ms } => {
            crate::service_metrics::count_rate_limited(&submitter.caller.0.tenant, &operation);
            return Err(Problem::rate_limited(retry_after_ms));
        }
    };
    let wait = crate::wait::wait_preference(headers);
    let task = match wait {
        Some(seconds) => {
            crate::wait::until_terminal(st, &st.store, &submitter.caller.0.tenant, task, seconds)
                .await?
        }
        None => task,
    };
    let location = format!("/v1/tasks/{}", task.id);
    let body = SubmitResponse {
        meta: Meta {
            request_id: request_id(headers),
            idempotency_key: key,
            replayed,
            key_expires_at: task
                .control
                .key_expires_at
                .filter(|_| task.state.is_terminal())
                .map(|t| t.to_rfc3339()),
        },
        task,
    };
    let mut res = json_response(StatusCode::CREATED, &body)?;
    if let Ok(v) = HeaderValue::from_str(&location) {
        res.headers_mut().insert(header::LOCATION, v);
    }
    if replayed {
        res.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    if let Some(seconds) = wait {
        crate::wait::applied(res.headers_mut(), seconds);
    }
    Ok((res, replayed))
}

/// The answer to a submit whose params do not match the class's current
/// `params_schema`: the schema a task was accepted under is frozen with its
/// contract (SPEC §5), so when the scope already holds a task of the same
/// request (as a submit judges it: [`idem_store::ops::is_same_request`]) the
/// retry is its replay, and a different request is the usual conflict; only
/// a scope that holds no task gets `refusal` (400), and nothing is created.
///
/// # Errors
/// `refusal`; 401 for a cached key revoked since; 503 when the store fails.
async fn retry_of_accepted(
    st: &crate::AppState,
    submitter: &SubmitCaller,
    headers: &HeaderMap,
    s: &Submission,
    refusal: Problem,
) -> AppResult<SubmitOutcome> {
    if submitter.is_cached() {
        submitter.recheck(st, headers).await?;
    }
    match st
        .store
        .find_task(&s.tenant, &s.operation, &s.idempotency_key)
        .await?
    {
        Ok(task) if idem_store::ops::is_same_request(&task, s) => Ok(SubmitOutcome::Replayed(task)),
        Ok(task) => Ok(SubmitOutcome::Conflict {
            task: Box::new(task),
        }),
        Err(_) => Err(refusal),
    }
}

/// The JSON Pointers of the material fields in which the request `body`
/// differs from the one `task` was accepted with, under the material pointers
/// frozen in its contract ([`idem_core::fingerprint::differing_fields`]);
/// `None` when the body has no `params` to compare.
fn conflict_fields(task: &Task, body: Option<&[u8]>) -> Option<Vec<String>> {
    let body = idem_core::json::parse_strict(body?).ok()?;
    let material = task.contract.fingerprint.as_deref().unwrap_or_default();
    let fields =
        idem_core::fingerprint::differing_fields(&task.params, body.get("params")?, material);
    Some(fields.iter().map(|p| p.as_str().to_owned()).collect())
}

/// `value` as an `application/json` response with `status`, serialised once
/// into a buffer sized for a whole task (axum's `Json` starts at 128 bytes and
/// regrows, copying, about three times for a 1 KB task).
///
/// # Errors
/// A 500 problem when `value` cannot be serialised (not expected for the API's
/// own types).
fn json_response<T: Serialize>(status: StatusCode, value: &T) -> AppResult<Response> {
    let mut buf = Vec::with_capacity(2048);
    serde_json::to_writer(&mut buf, value).map_err(|e| {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ProblemCode::Internal,
            format!("could not serialise the answer: {e}"),
        )
    })?;
    Ok((
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        buf,
    )
        .into_response())
}

/// Validates and fingerprints a submit (role, `Idempotency-Key`, strict body,
/// operation class, grant, RFC 8785 canonical request); returns the submission
/// for the store, and the 400 its params get from the class's current
/// `params_schema`, if they do not match it (a retry of an accepted request
/// is answered all the same: [`retry_of_accepted`]).
fn prepare_submission(
    st: &crate::AppState,
    caller: &Caller,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<(Submission, Option<Problem>)> {
    caller.require(Role::Client)?;
    let key = parse_header_values(
        headers
            .get_all("idempotency-key")
            .iter()
            .map(HeaderValue::as_bytes),
    )
    .map_err(Problem::from)?;
    let traceparent = TraceParent::from_header_values(
        headers
            .get_all(crate::TRACEPARENT)
            .iter()
            .map(HeaderValue::as_bytes),
    )
    .map_err(|e| Problem::invalid(format!("{e}; nothing was created")))?;
    let bytes = body_bytes(body)?;
    let (prepared, schema_refusal) = match st.prepared.get(caller.0.id, &bytes) {
        Some(p) => {
            // What the caller may do is checked on every request.
            caller.require_grant(&p.operation)?;
            (p, None)
        }
        None => {
            let (p, schema_refusal) = prepare_body(st, &bytes)?;
            let p = std::sync::Arc::new(p);
            caller.require_grant(&p.operation)?;
            // Kept only once every check passed for this key.
            if schema_refusal.is_none() {
                st.prepared
                    .insert(caller.0.id, &bytes, std::sync::Arc::clone(&p));
            }
            (p, schema_refusal)
        }
    };
    let contract = st
        .contracts
        .get(&prepared.operation)
        .cloned()
        .ok_or_else(|| unknown_operation(st, &prepared.operation))?;
    let flow = st
        .config
        .operations
        .get(&prepared.operation)
        .map(|c| &c.flow)
        .ok_or_else(|| unknown_operation(st, &prepared.operation))?;
    let priority = idem_core::submit::priority_of(prepared.priority, flow.priority_range())
        .map_err(Problem::invalid)?;
    let fairness_key = flow.fairness_value(&prepared.params);
    let submission = Submission {
        tenant: caller.0.tenant.clone(),
        operation: prepared.operation.clone(),
        idempotency_key: key.as_str().to_owned(),
        fingerprint: prepared.fingerprint.clone(),
        canonical_request: prepared.canonical_request.clone(),
        params: prepared.params.clone(),
        contract,
        api_key_id: caller.0.id,
        grant: caller.0.operations.clone(),
        traceparent,
        rate_limits: st
            .config
            .submit_limits(&caller.0.tenant, &prepared.operation),
        // SPEC §8.2 "Concurrency caps": read at submit, kept on the task.
        concurrency_key: st
            .config
            .operations
            .get(&prepared.operation)
            .and_then(|c| c.flow.concurrency_key.as_ref())
            .and_then(|p| idem_core::flow::concurrency_key(p, &prepared.params)),
        priority,
        fairness_key,
    };
    Ok((submission, schema_refusal))
}

/// A submit body read under the strict JSON rules, its operation class
/// checked against the configuration and its request fingerprinted
/// (IDEM-02, RFC 8785; [`idem_core::submit::read_submit`]), with the 400
/// its params get from the class's `params_schema` if they do not match it
/// ([`idem_core::submit::check_schema`]): a pure function of the bytes and
/// the configuration, so a result without that refusal may be kept
/// ([`crate::prepared`]).
///
/// # Errors
/// 400 `INVALID_REQUEST` for a body that is not strict JSON of the submit
/// shape, an unknown operation, params that are not an object, or params the
/// class cannot fingerprint.
fn prepare_body(
    st: &crate::AppState,
    bytes: &[u8],
) -> AppResult<(crate::prepared::PreparedBody, Option<Problem>)> {
    let refuse = |e| match e {
        SubmitBodyError::UnknownOperation { operation } => unknown_operation(st, &operation),
        SubmitBodyError::Schema { operation, error } => schema_problem(&operation, error),
        other => Problem::invalid(other.to_string()),
    };
    let prepared = read_submit(&st.config, bytes).map_err(refuse)?;
    let schema_refusal = check_schema(&st.config, &prepared).err().map(refuse);
    let body = crate::prepared::PreparedBody {
        operation: prepared.operation,
        params: prepared.params,
        fingerprint: prepared.canonical.fingerprint.to_string(),
        canonical_request: prepared.canonical.canonical,
        priority: prepared.priority,
    };
    Ok((body, schema_refusal))
}

/// The problem for params that do not match their class's schema: 400
/// `INVALID_REQUEST` whose `detail` names each failing pointer and whose
/// `errors` lists them (SPEC §5 `params_schema`).
fn schema_problem(operation: &str, e: SchemaError) -> Problem {
    match &e {
        SchemaError::Mismatch { violations, .. } => {
            let mut p = Problem::invalid(format!(
                "`params` do not match the params_schema of `{operation}`: {e}; nothing was created, and this Idempotency-Key holds no task of this operation"
            ));
            p.errors = Some(
                violations
                    .iter()
                    .map(|v| idem_api::InvalidValue {
                        pointer: v.pointer.clone(),
                        message: v.message.clone(),
                    })
                    .collect(),
            );
            p
        }
        SchemaError::Compile(_) => {
            tracing::error!(error = %e, operation, "params schema does not compile");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ProblemCode::Internal,
                "internal error",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// `meta.request_id` carries a client's id even when it is not visible
    /// ASCII, as the echoed header does.
    #[test]
    fn request_id_keeps_ids_beyond_ascii() {
        let mut headers = HeaderMap::new();
        assert_eq!(request_id(&headers), "");
        headers.insert("x-request-id", HeaderValue::from_static("req-1"));
        assert_eq!(request_id(&headers), "req-1");
        headers.insert(
            "x-request-id",
            HeaderValue::from_bytes("req-café".as_bytes()).unwrap(),
        );
        assert_eq!(request_id(&headers), "req-café");
        headers.insert(
            "x-request-id",
            HeaderValue::from_bytes(b"req-\xff").unwrap(),
        );
        assert_eq!(request_id(&headers), "req-\u{fffd}");
    }
}
