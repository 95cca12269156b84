//! Handlers of SPEC §4, each documented for the OpenAPI document.

use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::config::MIN_LEASE_MS;
use idem_core::fingerprint::canonical_request;
use idem_core::key::parse_header_values;
use idem_core::machine::Report;
use idem_core::model::{
    Attempt, AttemptKind, Cancellation, Event, FailureClass, Outcome, Role, Task, Timestamp,
};
use idem_core::schema::SchemaError;
use idem_store::ops::{ClaimRequest, Submission, SubmitOutcome};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::auth::{Caller, SubmitCaller};
use crate::problem::Problem;
use crate::{AppResult, BODY_LIMIT_BYTES, MAX_WAIT_MS, St};

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

/// Reads a JSON body strictly (duplicate keys, unsafe integers, depth > 64 → 400)
/// and decodes it into `T`.
fn strict_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> AppResult<(Value, T)> {
    let value = strict_value(body)?;
    let typed = serde_json::from_value(value.clone())
        .map_err(|e| Problem::invalid(format!("body: {e}")))?;
    Ok((value, typed))
}

/// [`strict_body`] for a handler that needs only the typed body (no copy of
/// the parsed document is kept).
fn strict_typed<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> AppResult<T> {
    strict_typed_bytes(&body_bytes(body)?)
}

/// `bytes` read under the strict JSON rules into `T`, or a 400 problem.
fn strict_typed_bytes<T: DeserializeOwned>(bytes: &[u8]) -> AppResult<T> {
    serde_json::from_value(strict_value_bytes(bytes)?)
        .map_err(|e| Problem::invalid(format!("body: {e}")))
}

/// The body read under the strict JSON rules (RUST-NOTES §4 item 11), or the
/// problem: 413 over [`BODY_LIMIT_BYTES`], 400 otherwise.
fn strict_value(body: Result<Bytes, BytesRejection>) -> AppResult<Value> {
    strict_value_bytes(&body_bytes(body)?)
}

/// `bytes` read under the strict JSON rules, or a 400 problem.
fn strict_value_bytes(bytes: &[u8]) -> AppResult<Value> {
    idem_core::json::parse_strict(bytes).map_err(|e| Problem::invalid(e.to_string()))
}

/// The body's bytes, or the problem: 413 over [`BODY_LIMIT_BYTES`], 400 when
/// it could not be read.
fn body_bytes(body: Result<Bytes, BytesRejection>) -> AppResult<Bytes> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Problem::too_large(BODY_LIMIT_BYTES)
        } else {
            Problem::invalid(e.body_text())
        }
    })
}

/// A task or attempt id from the path; anything that is not a UUID (including
/// bytes that are not UTF-8) is a 404 problem saying so (`` `x` is not a task
/// id (a UUID)``).
pub struct IdPath(pub Uuid);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdPath {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Problem> {
        let what = if parts.uri.path().starts_with("/v1/attempts/") {
            "an attempt id"
        } else {
            "a task id"
        };
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| Problem::not_found(format!("the path's id is not {what} (a UUID)")))?;
        Uuid::parse_str(&raw).map(IdPath).map_err(|_| {
            Problem::not_found(format!(
                "`{}` is not {what} (a UUID)",
                crate::problem::shorten(&raw)
            ))
        })
    }
}

/// The 404 detail for task `id`, the same whether it does not exist or
/// belongs to another tenant or to a class the key is not granted.
fn no_task(id: Uuid) -> impl FnOnce() -> String {
    move || format!("no task {id} for this tenant")
}

/// The 404 detail for attempt `id` (as [`no_task`]).
fn no_attempt(id: Uuid) -> impl FnOnce() -> String {
    move || format!("no attempt {id} for this tenant")
}

/// 400 `INVALID_REQUEST` for an operation class this configuration does not
/// define, listing the ones it does.
fn unknown_operation(st: &crate::AppState, operation: &str) -> Problem {
    let classes: Vec<&str> = st.config.operations.keys().map(String::as_str).collect();
    Problem::invalid(format!(
        "unknown operation `{}`; configured classes: {}",
        crate::problem::shorten(operation),
        classes.join(", ")
    ))
}

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
    params(("Idempotency-Key" = String, Header, description = "RFC 9651 sf-string (\"abc\") or bare token; the key is 1–255 visible ASCII", pattern = "^(\"[!-~]{1,255}\"|[!-~]{1,255})$")),
    request_body = SubmitBody,
    responses(
        (status = 201, description = "Accepted, or a replay (`Idempotent-Replayed: true`)", body = SubmitResponse,
            headers(
                ("Location" = String, description = "`/v1/tasks/{id}` of the task"),
                ("Idempotent-Replayed" = String, description = "`true` when the answer is a replay of an earlier submit (absent otherwise)"),
            )),
        (status = 400, description = "IDEMPOTENCY_KEY_MISSING, IDEMPOTENCY_KEY_INVALID, INVALID_REQUEST", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 413, body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "IDEMPOTENCY_CONFLICT: same scope, different fingerprint", body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
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

/// Counts one submit in `idem_submits_total` by its outcome: `Ok(replayed)`,
/// or the problem it was refused with (401 unauthenticated, 403 forbidden,
/// 422 `IDEMPOTENCY_CONFLICT` conflict, 5xx error, any other 4xx invalid).
pub(crate) fn count_submit(res: Result<bool, &Problem>) {
    let outcome = match res {
        Ok(true) => "replayed",
        Ok(false) => "created",
        Err(p) if p.code == "IDEMPOTENCY_CONFLICT" => "conflict",
        Err(p) if p.status == 401 => "unauthenticated",
        Err(p) if p.status == 403 => "forbidden",
        Err(p) if p.status >= 500 => "error",
        Err(_) => "invalid",
    };
    SUBMITS.increment(outcome);
}

/// One counter's handle for each value of one label, registered with the
/// recorder once instead of on every increment, so every value is listed, at
/// 0, from the start. The handles are taken when [`crate::metrics_handle`]
/// installs the recorder (`idem serve` calls it before anything counts); a
/// static first used before any recorder is installed would hold no-op
/// handles for the life of the process.
pub(crate) struct LabelledCounter<const N: usize> {
    handles: [(&'static str, metrics::Counter); N],
}

impl<const N: usize> LabelledCounter<N> {
    /// `name{label="v"}` for each `v` of `values`.
    fn register(name: &'static str, label: &'static str, values: [&'static str; N]) -> Self {
        LabelledCounter {
            handles: values.map(|v| (v, metrics::counter!(name, label => v))),
        }
    }

    /// Adds one to the series whose label is `value`. A value not registered
    /// is not counted (every caller passes one of the registered values; a
    /// debug build asserts it).
    pub(crate) fn increment(&self, value: &str) {
        let found = self.handles.iter().find(|(v, _)| *v == value);
        debug_assert!(found.is_some(), "unregistered label value {value}");
        if let Some((_, counter)) = found {
            counter.increment(1);
        }
    }
}

/// `idem_submits_total` by `outcome` (docs/operations.md).
pub(crate) static SUBMITS: std::sync::LazyLock<LabelledCounter<7>> =
    std::sync::LazyLock::new(|| {
        LabelledCounter::register(
            "idem_submits_total",
            "outcome",
            [
                "replayed",
                "created",
                "conflict",
                "unauthenticated",
                "forbidden",
                "error",
                "invalid",
            ],
        )
    });

/// `idem_reports_total` by `result` (docs/operations.md).
pub(crate) static REPORTS: std::sync::LazyLock<LabelledCounter<3>> =
    std::sync::LazyLock::new(|| {
        LabelledCounter::register(
            "idem_reports_total",
            "result",
            ["applied", "stale", "refused"],
        )
    });

async fn submit_inner(
    st: &crate::AppState,
    submitter: &SubmitCaller,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<(Response, bool)> {
    let submission = match prepare_submission(st, &submitter.caller, headers, body) {
        Ok(v) => v,
        // Refused before the store saw it: a cached key is confirmed first, so
        // a revoked key learns nothing but 401.
        Err(p) => return Err(submitter.confirm(st, p).await),
    };
    let key = submission.idempotency_key.clone();
    let outcome = st.store.submit(submission).await?;
    let (task, replayed) = match outcome {
        SubmitOutcome::Created(t) => {
            st.work.notify_waiters();
            (t, false)
        }
        SubmitOutcome::Replayed(t) => (t, true),
        SubmitOutcome::Conflict { task_id } => {
            let mut p = Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "IDEMPOTENCY_CONFLICT",
                format!(
                    "this Idempotency-Key is bound to task {task_id} with a different request fingerprint; nothing was changed"
                ),
            );
            p.task_id = Some(task_id);
            return Err(p);
        }
        SubmitOutcome::KeyRevoked { .. } => {
            st.keys.remove(&submitter.token_hash);
            return Err(Problem::unauthenticated("this API key was revoked"));
        }
    };
    let location = format!("/v1/tasks/{}", task.id);
    let body = SubmitResponse {
        meta: Meta {
            request_id: request_id(headers),
            idempotency_key: key,
            replayed,
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
    Ok((res, replayed))
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
            "INTERNAL",
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
/// for the store.
fn prepare_submission(
    st: &crate::AppState,
    caller: &Caller,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Submission> {
    caller.require(Role::Client)?;
    let key = parse_header_values(
        headers
            .get_all("idempotency-key")
            .iter()
            .map(HeaderValue::as_bytes),
    )
    .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, e.problem_code(), e.to_string()))?;
    let bytes = body_bytes(body)?;
    let prepared = match st.prepared.get(caller.0.id, &bytes) {
        Some(p) => {
            // What the caller may do is checked on every request.
            caller.require_grant(&p.operation)?;
            p
        }
        None => {
            let p = std::sync::Arc::new(prepare_body(st, &bytes)?);
            caller.require_grant(&p.operation)?;
            // Kept only once every check passed for this key.
            st.prepared
                .insert(caller.0.id, &bytes, std::sync::Arc::clone(&p));
            p
        }
    };
    let contract = st
        .contracts
        .get(&prepared.operation)
        .cloned()
        .ok_or_else(|| unknown_operation(st, &prepared.operation))?;
    Ok(Submission {
        tenant: caller.0.tenant.clone(),
        operation: prepared.operation.clone(),
        idempotency_key: key.as_str().to_owned(),
        fingerprint: prepared.fingerprint.clone(),
        canonical_request: prepared.canonical_request.clone(),
        params: prepared.params.clone(),
        contract,
        api_key_id: caller.0.id,
        grant: caller.0.operations.clone(),
    })
}

/// A submit body read under the strict JSON rules, its operation class
/// checked against the configuration and its request fingerprinted
/// (IDEM-02, RFC 8785): a pure function of the bytes and the configuration,
/// so its result may be kept ([`crate::prepared`]).
///
/// # Errors
/// 400 `INVALID_REQUEST` for a body that is not strict JSON of the submit
/// shape, an unknown operation, params that are not an object, or params the
/// class cannot fingerprint.
fn prepare_body(st: &crate::AppState, bytes: &[u8]) -> AppResult<crate::prepared::PreparedBody> {
    let body: SubmitBody = strict_typed_bytes(bytes)?;
    let Some(class) = st.config.operations.get(&body.operation) else {
        return Err(unknown_operation(st, &body.operation));
    };
    if !body.params.is_object() {
        return Err(Problem::invalid("`params` must be a JSON object"));
    }
    if let Some(schema) = &class.params_schema {
        schema
            .validate(&body.params)
            .map_err(|e| schema_problem(&body.operation, e))?;
    }
    let canonical = canonical_request(&body.operation, &body.params, &class.fingerprint)
        .map_err(|e| Problem::invalid(e.to_string()))?;
    Ok(crate::prepared::PreparedBody {
        operation: body.operation,
        params: body.params,
        fingerprint: canonical.fingerprint.to_string(),
        canonical_request: canonical.canonical,
    })
}

/// The problem for params that do not match their class's schema: 400
/// `INVALID_REQUEST` whose `detail` names each failing pointer and whose
/// `errors` lists them (SPEC §5 `params_schema`).
fn schema_problem(operation: &str, e: SchemaError) -> Problem {
    match &e {
        SchemaError::Mismatch { violations, .. } => {
            let mut p = Problem::invalid(format!(
                "`params` do not match the params_schema of `{operation}`: {e}; nothing was created and the Idempotency-Key was not used"
            ));
            p.errors = Some(
                violations
                    .iter()
                    .map(|v| crate::problem::InvalidValue {
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
                "INTERNAL",
                "internal error",
            )
        }
    }
}

/// Look a task up by scope after a timeout.
#[utoipa::path(get, path = "/v1/tasks", tag = "tasks", params(LookupQuery),
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
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
    let key = idem_core::key::IdempotencyKey::new(&key)
        .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, e.problem_code(), e.to_string()))?;
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

/// Read a task.
#[utoipa::path(get, path = "/v1/tasks/{id}", tag = "tasks", params(("id" = String, Path, description = "task id")),
    responses((status = 200, body = TaskEnvelope), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn get_task(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Client)?;
    let task = caller
        .store(&st)
        .get_task(Some(&caller.0.tenant), id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(TaskEnvelope { task }))
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

/// The append-only event history of a task.
#[utoipa::path(get, path = "/v1/tasks/{id}/events", tag = "tasks", params(("id" = String, Path, description = "task id")),
    responses((status = 200, body = EventsEnvelope), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn list_events(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
) -> AppResult<Json<EventsEnvelope>> {
    caller.require(Role::Client)?;
    let events = caller
        .store(&st)
        .list_events(Some(&caller.0.tenant), id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    Ok(Json(EventsEnvelope { events }))
}

/// Request cancellation (SPEC §2.7, CANCEL-01): 202 when recorded and pending, 200 when settled.
#[utoipa::path(post, path = "/v1/tasks/{id}/cancel", tag = "tasks", params(("id" = String, Path, description = "task id")),
    responses((status = 200, description = "confirmed or too_late", body = CancelResponse), (status = 202, description = "requested", body = CancelResponse), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn cancel_task(State(st): St, caller: Caller, IdPath(id): IdPath) -> AppResult<Response> {
    caller.require(Role::Client)?;
    let (task, cancellation) = caller
        .store(&st)
        .cancel(&caller.0.tenant, id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
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

/// Lease attempts (executors). Never leases one attempt twice; optional long-poll.
#[utoipa::path(post, path = "/v1/attempts/claim", tag = "attempts", request_body = ClaimBody,
    responses((status = 200, body = ClaimResponse), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn claim(
    State(st): St,
    caller: Caller,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<ClaimResponse>> {
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
                    return Err(unknown_operation(&st, op));
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
        operations,
        executor_id: body.executor_id,
        max,
        lease_ms: body.lease_ms,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
    loop {
        let notified = st.work.notified();
        let claimed = if req.operations.is_empty() {
            Vec::new()
        } else {
            st.store.claim(req.clone()).await?
        };
        if !claimed.is_empty() || tokio::time::Instant::now() >= deadline || st.is_draining() {
            metrics::counter!("idem_attempts_leased_total").increment(claimed.len() as u64);
            let attempts = claimed
                .into_iter()
                .map(|c| ClaimedAttempt {
                    id: c.attempt.id,
                    task_id: c.task.id,
                    number: c.attempt.number,
                    generation: c.attempt.generation,
                    kind: c.attempt.kind,
                    lease_expires_at: c.attempt.lease_expires_at,
                    operation: c.task.operation,
                    params: c.task.params,
                    idempotency_key: c.task.idempotency_key,
                })
                .collect();
            return Ok(Json(ClaimResponse { attempts }));
        }
        // Other instances' work is not notified here: poll at least every 100 ms.
        let nap = deadline.min(tokio::time::Instant::now() + Duration::from_millis(100));
        let _ = tokio::time::timeout_at(nap, notified).await;
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
    let ack = caller
        .store(&st)
        .heartbeat(&caller.0.tenant, attempt_id, body.generation, body.usage)
        .await?
        .map_err(|r| Problem::refused(r, no_attempt(attempt_id)))?;
    Ok(Json(HeartbeatResponse {
        lease_expires_at: ack.lease_expires_at,
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
    let task = caller
        .store(&st)
        .acknowledge(&caller.0.tenant, attempt_id, body.generation, raw)
        .await?
        .map_err(|r| Problem::refused(r, no_attempt(attempt_id)))?;
    Ok(Json(TaskEnvelope { task }))
}

/// Report an attempt's outcome. Stale generations are kept as evidence and answered 409.
#[utoipa::path(post, path = "/v1/attempts/{id}/report", tag = "attempts", params(("id" = String, Path, description = "attempt id")), request_body = ReportBody,
    responses((status = 200, body = TaskEnvelope), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, body = Problem, content_type = "application/problem+json"), (status = 409, description = "STALE_GENERATION or ATTEMPT_ALREADY_REPORTED", body = Problem, content_type = "application/problem+json"), (status = 413, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn report(
    State(st): St,
    caller: Caller,
    IdPath(id): IdPath,
    body: Result<Bytes, BytesRejection>,
) -> AppResult<Json<TaskEnvelope>> {
    caller.require(Role::Executor)?;
    let attempt_id = id;
    let (raw, body): (Value, ReportBody) = strict_body(body)?;
    if body
        .external_txn_id
        .as_deref()
        .is_some_and(|t| !is_short_text(t))
    {
        return Err(Problem::invalid(
            "`external_txn_id` must be 1–200 characters, none of them a control character",
        ));
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
    let res = caller
        .store(&st)
        .report(&caller.0.tenant, attempt_id, report)
        .await?;
    let label = match &res {
        Ok(_) => "applied",
        Err(idem_store::Refusal::Machine(idem_core::machine::Rejection::StaleGeneration {
            ..
        })) => "stale",
        Err(_) => "refused",
    };
    REPORTS.increment(label);
    let task = res.map_err(|r| Problem::refused(r, no_attempt(attempt_id)))?;
    if !task.state.is_terminal() {
        st.work.notify_waiters();
    }
    Ok(Json(TaskEnvelope { task }))
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()), responses((status = 200, body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        store: None,
    })
}

/// Readiness: the store answers.
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()), responses((status = 200, body = Health), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn readyz(State(st): St) -> AppResult<Json<Health>> {
    st.store.ping().await?;
    Ok(Json(Health {
        status: "ok".into(),
        store: Some(st.store.kind().into()),
    }))
}

/// Whether `s` is an identifier-like text field: 1–200 characters (Unicode
/// scalar values), none of them a control character (`executor_id`,
/// `external_txn_id`; a NUL could not even be stored on PostgreSQL).
fn is_short_text(s: &str) -> bool {
    !s.is_empty() && s.chars().count() <= 200 && !s.chars().any(char::is_control)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// `meta.request_id` carries a client's id even when it is not visible
    /// ASCII (breaker: it was "" while the header was echoed).
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
