//! # idem-client
//!
//! A typed async client (SDK) for the idem HTTP API (SPEC §4).
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_client::ClientError> {
//! use idem_client::{Client, SubmitRetry};
//! use serde_json::json;
//!
//! let client = Client::new("http://127.0.0.1:8787", "idem_…client key…")?;
//! let params = json!({"payee": "acct-42", "amount": 1250, "currency": "EUR"});
//! // The key names the business operation, not the HTTP attempt: on a timeout
//! // the same key is sent again, and after the retry budget the task is looked
//! // up by its scope instead of being submitted under a new key.
//! let submitted = client
//!     .submit_with_retry("payment.release", &params, "invoice-2026-0042", &SubmitRetry::default())
//!     .await?;
//! println!("task {} is {}", submitted.task.id, submitted.task.state);
//! # Ok(()) }
//! ```
//!
//! Clients submit, read and cancel tasks, and follow a task's events or the
//! tenant's event feed live (Server-Sent Events); executors claim attempts, heartbeat,
//! acknowledge and report. Errors are [`ClientError`]: an RFC 9457 problem
//! answered by idem (with its HTTP status and `code`), a timeout, a transport
//! failure, an undecodable answer, or an argument refused before sending.
//!
//! The executor runtime, [`worker::Worker`], keeps each attempt's lease on
//! its own clock: the lease is treated as lost at a local deadline, the
//! `lease_ms` idem last confirmed counted from when that claim or heartbeat
//! was *sent*, less max(500 ms, 10 %) ([`worker::lease`]). There, or at once
//! when a heartbeat is answered 401, 403, 404 or 409, the handler is told
//! ([`worker::Context::stopped`]) and must stop its effect: idem may hand the
//! task to another executor from then on, and a handler that ignores the
//! signal is on its own.

use std::time::Duration;

use reqwest::header::HeaderMap;
use reqwest::{Method, RequestBuilder, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use uuid::Uuid;

mod error;
mod events;
mod operator;
mod search;
mod types;
mod wait;
pub mod worker;

use error::api_error;
pub use error::{ClientError, Result};
pub use events::{EventStream, FeedEvent, FeedPage};
use idem_api::{AckBody, ClaimBody, ClaimResponse, HeartbeatBody, ReleaseBody, SubmitBody};
pub use idem_api::{EffectResolution, Problem, ProblemCode};
pub use search::{TaskFilter, TaskPage, TaskPages};
pub use types::{
    Attempt, AttemptKind, AttemptState, CancelStatus, Cancellation, ClaimedAttempt, Contract,
    Delivery, EffectAcknowledgment, Event, Evidence, Failure, FailureClass, HeartbeatAck, Outcome,
    ReportBody, SecondEffect, Task, TaskState,
};

/// Longest idempotency key idem accepts, in bytes (SPEC §4).
pub const MAX_KEY_LEN: usize = 255;

/// Default time limit of one HTTP request.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Answer to a submission.
#[derive(Debug, Clone, PartialEq)]
pub struct Submitted {
    /// The task (on a replay: its current state and, once delivered, its result).
    pub task: Task,
    /// Whether idem answered with an earlier acceptance (`Idempotent-Replayed: true`)
    /// rather than creating the task now. Also `true` when the task was found by a
    /// scope lookup in [`Client::submit_with_retry`].
    pub replayed: bool,
    /// HTTP status of the answer that produced `task` (201 for submit, 200 for a lookup).
    pub status: u16,
    /// `X-Request-Id` of that answer.
    pub request_id: Option<String>,
    /// HTTP submissions sent (1 for [`Client::submit`]).
    pub tries: u32,
    /// Whether the task was found by `GET /v1/tasks?operation=&idempotency_key=`
    /// after the retry budget was used up.
    pub looked_up: bool,
}

/// Answer to a cancel request.
#[derive(Debug, Clone, PartialEq)]
pub struct CancelResponse {
    /// 202 when recorded and pending, 200 when confirmed or `too_late`.
    pub status: u16,
    /// The task after the request.
    pub task: Task,
    /// The cancellation record.
    pub cancellation: Cancellation,
}

/// Retry budget of [`Client::submit_with_retry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitRetry {
    /// HTTP submissions at most (at least 1).
    pub max_tries: u32,
    /// Pause after the first failed try; doubled after each further one.
    pub initial_backoff: Duration,
    /// Upper bound of a pause (also caps a server's `Retry-After`).
    pub max_backoff: Duration,
}

impl Default for SubmitRetry {
    /// 4 tries, 200 ms × 2 ≤ 5 s.
    fn default() -> SubmitRetry {
        SubmitRetry {
            max_tries: 4,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// Checks an idempotency key against idem's rules (1–255 bytes of visible
/// ASCII, `0x21..=0x7E`) and renders it as an RFC 9651 sf-string: `"` + the key
/// with `\` and `"` escaped by a backslash + `"`.
///
/// # Errors
/// [`ClientError::InvalidArgument`] for a key idem would refuse.
pub fn sf_string(key: &str) -> Result<String> {
    if key.is_empty() {
        return Err(ClientError::InvalidArgument(
            "the idempotency key is empty".into(),
        ));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(ClientError::InvalidArgument(format!(
            "the idempotency key has {} bytes; at most {MAX_KEY_LEN} are allowed",
            key.len()
        )));
    }
    if let Some(c) = key.chars().find(|c| !('\x21'..='\x7e').contains(c)) {
        return Err(ClientError::InvalidArgument(format!(
            "the idempotency key contains {c:?}; only visible ASCII (0x21–0x7E) is allowed"
        )));
    }
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Ok(out)
}

/// What a successful answer carried besides its body.
struct Answer<T> {
    body: T,
    status: u16,
    replayed: bool,
    request_id: Option<String>,
}

/// A client of one idem service, authenticated by one API key.
///
/// Cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    api_key: String,
    timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base.as_str())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the service at `base_url` (e.g. `http://127.0.0.1:8787`,
    /// optionally with a path prefix) sending `Authorization: Bearer <api_key>`.
    /// Requests time out after [`DEFAULT_TIMEOUT`] (see [`Client::with_timeout`]).
    ///
    /// # Errors
    /// [`ClientError::InvalidArgument`] when `base_url` is not an http(s) URL.
    pub fn new(base_url: &str, api_key: impl Into<String>) -> Result<Client> {
        let mut base = Url::parse(base_url)
            .map_err(|e| ClientError::InvalidArgument(format!("base URL `{base_url}`: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(ClientError::InvalidArgument(format!(
                "base URL `{base_url}` must be http:// or https://"
            )));
        }
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        base.set_query(None);
        base.set_fragment(None);
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| ClientError::InvalidArgument(format!("HTTP client: {e}")))?;
        Ok(Client {
            http,
            base,
            api_key: api_key.into(),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The same client with another per-request time limit.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// The same client over a caller-built [`reqwest::Client`] (proxies, TLS, pools).
    #[must_use]
    pub fn with_http_client(mut self, http: reqwest::Client) -> Client {
        self.http = http;
        self
    }

    /// The same client authenticated by another API key (sharing the connection pool).
    #[must_use]
    pub fn with_api_key(&self, api_key: impl Into<String>) -> Client {
        let mut c = self.clone();
        c.api_key = api_key.into();
        c
    }

    /// The base URL requests are made against.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// The per-request time limit.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn url(&self, path: &str) -> Result<Url> {
        self.base
            .join(path)
            .map_err(|e| ClientError::InvalidArgument(format!("path `{path}`: {e}")))
    }

    fn request(&self, method: Method, url: Url) -> RequestBuilder {
        self.http
            .request(method, url)
            .bearer_auth(&self.api_key)
            .timeout(self.timeout)
    }

    async fn send<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<Answer<T>> {
        let res = rb.send().await.map_err(ClientError::from_reqwest)?;
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = res.bytes().await.map_err(ClientError::from_reqwest)?;
        let request_id = header_str(&headers, "x-request-id");
        if !status.is_success() {
            return Err(api_error(status, &headers, &bytes, request_id));
        }
        let body = serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode {
            status: status.as_u16(),
            message: e.to_string(),
        })?;
        Ok(Answer {
            body,
            status: status.as_u16(),
            replayed: header_str(&headers, "idempotent-replayed")
                .is_some_and(|v| v.eq_ignore_ascii_case("true")),
            request_id,
        })
    }

    async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        let url = self.url(path)?;
        Ok(self.send(self.request(Method::GET, url)).await?.body)
    }

    async fn post_json<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &(impl Serialize + ?Sized),
    ) -> Result<Answer<T>> {
        let url = self.url(path)?;
        self.send(self.request(Method::POST, url).json(body)).await
    }

    /// `POST /v1/tasks`: submits `params` for `operation` under `idempotency_key`
    /// (sent as an RFC 9651 sf-string, see [`sf_string`]). One HTTP request; see
    /// [`Client::submit_with_retry`] for the retrying form.
    ///
    /// # Errors
    /// 422 `IDEMPOTENCY_CONFLICT` when the key is bound to a different request
    /// (the problem's `task_id` names the original task); 400/401/403 for bad
    /// input or credentials; timeouts and transport failures.
    pub async fn submit(
        &self,
        operation: &str,
        params: &Value,
        idempotency_key: &str,
    ) -> Result<Submitted> {
        self.submit_inner(operation, params, idempotency_key, None, None)
            .await
    }

    /// [`Client::submit`] with a W3C `traceparent` header
    /// (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lowercase):
    /// idem keeps it on the task (`Task::traceparent`) and hands it to every
    /// executor that claims one of its attempts
    /// (`ClaimedAttempt::traceparent`), so their spans join the caller's
    /// trace. It is not part of the request's fingerprint: a retry with
    /// another `traceparent` is the same request, answered with the task as
    /// first accepted.
    ///
    /// # Errors
    /// As [`Client::submit`]; 400 `INVALID_REQUEST` for a malformed
    /// `traceparent` (nothing was created), [`ClientError::InvalidArgument`]
    /// for one that cannot be a header value at all.
    pub async fn submit_traced(
        &self,
        operation: &str,
        params: &Value,
        idempotency_key: &str,
        traceparent: &str,
    ) -> Result<Submitted> {
        self.submit_inner(operation, params, idempotency_key, Some(traceparent), None)
            .await
    }

    /// One submit: with a `traceparent` header when given, and `Prefer:
    /// wait=N` when `wait` is given ([`Client::submit_and_wait`]).
    pub(crate) async fn submit_inner(
        &self,
        operation: &str,
        params: &Value,
        idempotency_key: &str,
        traceparent: Option<&str>,
        wait: Option<Duration>,
    ) -> Result<Submitted> {
        let key = sf_string(idempotency_key)?;
        let url = self.url("v1/tasks")?;
        let mut rb = self
            .request(Method::POST, url)
            .header("idempotency-key", key)
            .json(&SubmitBody {
                operation: operation.to_owned(),
                params: params.clone(),
                priority: None,
            });
        if let Some(tp) = traceparent {
            let value = reqwest::header::HeaderValue::from_str(tp).map_err(|_| {
                ClientError::InvalidArgument(format!(
                    "the traceparent {tp:?} is not a header value (visible ASCII)"
                ))
            })?;
            rb = rb.header("traceparent", value);
        }
        let rb = wait::prefer(rb, wait, self.timeout);
        let answer: Answer<SubmitEnvelope> = self.send(rb).await?;
        Ok(Submitted {
            replayed: answer.replayed || answer.body.meta.replayed,
            task: answer.body.task,
            status: answer.status,
            request_id: answer.request_id,
            tries: 1,
            looked_up: false,
        })
    }

    /// Submits like [`Client::submit`], and on a timeout, transport failure or
    /// 5xx answer sends the SAME request with the SAME key again (pausing per
    /// `policy`, or as `Retry-After` says). When the budget is used up, the task
    /// is looked up by its scope (`operation`, `idempotency_key`): if an earlier
    /// try was committed although its answer was lost, that task is returned
    /// with `looked_up: true`, but only when its `params` equal `params` (a
    /// task of another request under this key would have been a 422 conflict;
    /// its params differ, and it is never returned as this request's). A new
    /// key is never invented: that could create a second task for one business
    /// operation.
    ///
    /// # Errors
    /// The first non-retryable error (e.g. 422 `IDEMPOTENCY_CONFLICT`), or the
    /// last retryable one when the lookup found no task, or a task with other
    /// params (then submit the same key again later: the answer is the replay
    /// or the conflict).
    pub async fn submit_with_retry(
        &self,
        operation: &str,
        params: &Value,
        idempotency_key: &str,
        policy: &SubmitRetry,
    ) -> Result<Submitted> {
        // Refuse a bad key before the first try rather than retrying it.
        sf_string(idempotency_key)?;
        let max_tries = policy.max_tries.max(1);
        let mut pause = policy.initial_backoff;
        let mut last = None;
        for tries in 1..=max_tries {
            match self.submit(operation, params, idempotency_key).await {
                Ok(mut s) => {
                    s.tries = tries;
                    return Ok(s);
                }
                Err(e) if e.is_retryable() => {
                    if tries < max_tries {
                        let wait = match &e {
                            ClientError::Api {
                                retry_after: Some(d),
                                ..
                            } => *d,
                            _ => pause,
                        };
                        tokio::time::sleep(wait.min(policy.max_backoff)).await;
                        pause = pause.saturating_mul(2).min(policy.max_backoff);
                    }
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        match self.find_task(operation, idempotency_key).await {
            // Only this request's own task: the scope may hold another
            // request's (a conflict the lost answers would have reported as
            // 422). Equal params give an equal fingerprint; anything else is
            // left to a later submit, which answers replay or conflict.
            Ok(task) if task.operation == operation && task.params == *params => Ok(Submitted {
                task,
                replayed: true,
                status: 200,
                request_id: None,
                tries: max_tries,
                looked_up: true,
            }),
            // `last` is always set here: every try failed retryably.
            Ok(_) => {
                Err(last
                    .unwrap_or_else(|| ClientError::InvalidArgument("no submit was tried".into())))
            }
            Err(lookup) => Err(last.unwrap_or(lookup)),
        }
    }

    /// `GET /v1/tasks/{id}`.
    ///
    /// # Errors
    /// 404 `NOT_FOUND` for no such task (or one of another tenant).
    pub async fn get_task(&self, task_id: Uuid) -> Result<Task> {
        let env: TaskEnvelope = self.get_json(&format!("v1/tasks/{task_id}")).await?;
        Ok(env.task)
    }

    /// `GET /v1/tasks?operation=&idempotency_key=`: the task of a scope, e.g.
    /// after a submission timed out.
    ///
    /// # Errors
    /// 404 `NOT_FOUND` when the scope has no task (nothing was committed).
    pub async fn find_task(&self, operation: &str, idempotency_key: &str) -> Result<Task> {
        // The query carries the key itself, as stored (not its header
        // encoding): a key that starts with `"` is sent as it is.
        let mut url = self.url("v1/tasks")?;
        url.query_pairs_mut()
            .append_pair("operation", operation)
            .append_pair("idempotency_key", idempotency_key);
        let env: TaskEnvelope = self.send(self.request(Method::GET, url)).await?.body;
        Ok(env.task)
    }

    /// `GET /v1/tasks/{id}/attempts`: every attempt, old ones included, with its evidence.
    ///
    /// # Errors
    /// 404 `NOT_FOUND` for no such task.
    pub async fn attempts(&self, task_id: Uuid) -> Result<Vec<Attempt>> {
        let env: AttemptsEnvelope = self
            .get_json(&format!("v1/tasks/{task_id}/attempts"))
            .await?;
        Ok(env.attempts)
    }

    /// `GET /v1/tasks/{id}/events`: the append-only event history.
    ///
    /// # Errors
    /// 404 `NOT_FOUND` for no such task.
    pub async fn events(&self, task_id: Uuid) -> Result<Vec<Event>> {
        let env: EventsEnvelope = self.get_json(&format!("v1/tasks/{task_id}/events")).await?;
        Ok(env.events)
    }

    /// `POST /v1/tasks/{id}/cancel`. A 202 answer means the request was recorded,
    /// not that execution stopped; 200 means confirmed or `too_late`.
    ///
    /// # Errors
    /// 404 `NOT_FOUND` for no such task.
    pub async fn cancel(&self, task_id: Uuid) -> Result<CancelResponse> {
        let a: Answer<CancelEnvelope> = self
            .post_json(&format!("v1/tasks/{task_id}/cancel"), &json!({}))
            .await?;
        Ok(CancelResponse {
            status: a.status,
            task: a.body.task,
            cancellation: a.body.cancellation,
        })
    }

    /// `POST /v1/tasks/{id}/delivery/ack`: acknowledges receipt of the delivery.
    /// Idempotent; never charges again.
    ///
    /// # Errors
    /// 409 `NOT_DELIVERED` before delivery; 404 for no such task.
    pub async fn ack_delivery(&self, task_id: Uuid) -> Result<Task> {
        let a: Answer<TaskEnvelope> = self
            .post_json(&format!("v1/tasks/{task_id}/delivery/ack"), &json!({}))
            .await?;
        Ok(a.body.task)
    }

    /// `POST /v1/attempts/claim` (executor key): leases up to `max` attempts of
    /// `operations` (empty slice: every class the key is granted) for
    /// `lease_ms` (`None`: the class default), waiting up to `wait_ms` for work.
    /// An empty list means nothing was due.
    ///
    /// # Errors
    /// 400 `INVALID_REQUEST` for out-of-range values; 403 without the executor role.
    pub async fn claim(
        &self,
        executor_id: &str,
        operations: &[&str],
        max: u32,
        lease_ms: Option<u64>,
        wait_ms: u64,
    ) -> Result<Vec<ClaimedAttempt>> {
        let body = ClaimBody {
            executor_id: executor_id.to_owned(),
            operations: (!operations.is_empty())
                .then(|| operations.iter().map(|o| (*o).to_owned()).collect()),
            max: Some(i64::from(max)),
            // Beyond i64 either way is out of range: 400 `INVALID_REQUEST`.
            lease_ms: lease_ms.map(|l| i64::try_from(l).unwrap_or(i64::MAX)),
            wait_ms: Some(wait_ms),
        };
        let url = self.url("v1/attempts/claim")?;
        let rb = self
            .request(Method::POST, url)
            .timeout(self.timeout + Duration::from_millis(wait_ms))
            .json(&body);
        let a: Answer<ClaimResponse<ClaimedAttempt>> = self.send(rb).await?;
        Ok(a.body.attempts)
    }

    /// `POST /v1/attempts/{id}/heartbeat`: extends the lease and reports usage so far.
    ///
    /// # Errors
    /// 409 `STALE_GENERATION` when this generation no longer holds the lease.
    pub async fn heartbeat(
        &self,
        attempt_id: Uuid,
        generation: i64,
        usage: Option<i64>,
    ) -> Result<HeartbeatAck> {
        let body = HeartbeatBody { generation, usage };
        let a: Answer<HeartbeatAck> = self
            .post_json(&format!("v1/attempts/{attempt_id}/heartbeat"), &body)
            .await?;
        Ok(a.body)
    }

    /// `POST /v1/attempts/{id}/ack`: a device gateway's "command acknowledged"
    /// (not completed; completion is a separate [`Client::report`]).
    ///
    /// # Errors
    /// 409 `STALE_GENERATION` when this generation no longer holds the lease.
    pub async fn ack(&self, attempt_id: Uuid, generation: i64) -> Result<Task> {
        let a: Answer<TaskEnvelope> = self
            .post_json(
                &format!("v1/attempts/{attempt_id}/ack"),
                &AckBody { generation },
            )
            .await?;
        Ok(a.body.task)
    }

    /// `POST /v1/attempts/{id}/report`: the attempt's outcome.
    ///
    /// # Errors
    /// 409 `STALE_GENERATION` (the report was kept as evidence but changed
    /// nothing), 409 `ATTEMPT_ALREADY_REPORTED`, 400 `INVALID_REQUEST`.
    pub async fn report(&self, attempt_id: Uuid, body: &ReportBody) -> Result<Task> {
        let a: Answer<TaskEnvelope> = self
            .post_json(&format!("v1/attempts/{attempt_id}/report"), body)
            .await?;
        Ok(a.body.task)
    }

    /// `POST /v1/attempts/{id}/release`: gives back an attempt this executor
    /// never started (e.g. one received after shutdown began); the task is
    /// claimable again at once and the attempt counts against no limit. An
    /// exact repeat answers the same.
    ///
    /// # Errors
    /// 409 `STALE_GENERATION` (an old generation or an expired lease), 409
    /// `ATTEMPT_ALREADY_REPORTED` (it was reported or acknowledged: it
    /// started), 404: in each case there is nothing left to release.
    pub async fn release(&self, attempt_id: Uuid, generation: i64) -> Result<Task> {
        let a: Answer<TaskEnvelope> = self
            .post_json(
                &format!("v1/attempts/{attempt_id}/release"),
                &ReleaseBody { generation },
            )
            .await?;
        Ok(a.body.task)
    }

    /// `GET /readyz`: whether the service and its store answer.
    ///
    /// # Errors
    /// 503 `UNAVAILABLE`, or a transport error when nothing listens.
    pub async fn ready(&self) -> Result<()> {
        let _: Value = self.get_json("readyz").await?;
        Ok(())
    }
}

fn header_str(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

type SubmitEnvelope = idem_api::SubmitResponse<Task>;
type TaskEnvelope = idem_api::TaskEnvelope<Task>;
type AttemptsEnvelope = idem_api::AttemptsEnvelope<Attempt>;
type EventsEnvelope = idem_api::EventsEnvelope<Event>;
type CancelEnvelope = idem_api::CancelResponse<Task, Cancellation>;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use reqwest::StatusCode;
    use reqwest::header::RETRY_AFTER;

    #[test]
    fn amounts_read_with_their_currency() {
        let task: Task = serde_json::from_value(serde_json::json!({
            "id": "01a24ab5-ee50-74ee-8e31-478895e0a1c6", "operation": "payment.release",
            "idempotency_key": "k", "fingerprint": "sha256:00", "params": {},
            "state": "succeeded", "generation": 1, "attempt_count": 1, "usage": 0,
            "contract": {"price": 100, "fees": {"currency": "KWD", "exponent": 3}},
            "cancellation": {"status": "too_late", "requested_at": "t", "fee": 100, "currency": "KWD"},
            "delivery": {"result": {}, "delivered_at": "t", "charge": 100, "currency": "KWD"},
            "created_at": "t", "updated_at": "t"
        }))
        .unwrap();
        assert_eq!(task.contract.currency(), Some(("KWD", 3)));
        assert_eq!(task.delivery.unwrap().currency.as_deref(), Some("KWD"));
        assert_eq!(task.cancellation.unwrap().currency.as_deref(), Some("KWD"));
        // A contract without a currency (or from a server that sends none).
        let contract: Contract =
            serde_json::from_value(serde_json::json!({"price": 50, "fees": {"price": 50}}))
                .unwrap();
        assert_eq!(contract.currency(), None);
    }

    #[test]
    fn keys_are_quoted_as_sf_strings() {
        assert_eq!(sf_string("abc").unwrap(), "\"abc\"");
        assert_eq!(sf_string("a\"b\\c").unwrap(), "\"a\\\"b\\\\c\"");
        for key in ["abc", "a\"b\\c", "\"lead", "x-1:2/3?=~", &"k".repeat(255)] {
            let quoted = sf_string(key).unwrap();
            let item = sfv::Parser::new(quoted.as_bytes())
                .parse::<sfv::Item>()
                .unwrap();
            assert!(item.params.is_empty());
            match item.bare_item {
                sfv::BareItem::String(s) => assert_eq!(s.as_str(), key),
                other => panic!("not a string: {other:?}"),
            }
        }
    }

    #[test]
    fn keys_idem_would_refuse_are_refused_before_sending() {
        for key in ["", "a b", "tab\t", "é", &"k".repeat(256)] {
            assert!(
                matches!(sf_string(key), Err(ClientError::InvalidArgument(_))),
                "{key:?}"
            );
        }
    }

    #[test]
    fn base_urls_keep_their_path_prefix() {
        let c = Client::new("http://127.0.0.1:8787", "k").unwrap();
        assert_eq!(
            c.url("v1/tasks").unwrap().as_str(),
            "http://127.0.0.1:8787/v1/tasks"
        );
        let c = Client::new("http://h/idem", "k").unwrap();
        assert_eq!(
            c.url("v1/tasks").unwrap().as_str(),
            "http://h/idem/v1/tasks"
        );
        assert!(Client::new("ftp://h", "k").is_err());
        assert!(Client::new("not a url", "k").is_err());
    }

    #[test]
    fn problems_carry_status_and_code() {
        let body = br#"{"type":"https://idem.dev/problems/idempotency-conflict","title":"Unprocessable Entity","status":422,"detail":"bound to another request","code":"IDEMPOTENCY_CONFLICT","task_id":"0192f0c4-0000-7000-8000-000000000001"}"#;
        let e = api_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            &HeaderMap::new(),
            body,
            None,
        );
        assert_eq!(e.status(), Some(422));
        assert_eq!(e.code(), Some("IDEMPOTENCY_CONFLICT"));
        assert!(e.problem().and_then(|p| p.task_id).is_some());
        assert!(!e.is_retryable());

        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, "1".parse().unwrap());
        let e = api_error(
            StatusCode::BAD_GATEWAY,
            &h,
            b"<html>bad gateway</html>",
            None,
        );
        assert_eq!(e.status(), Some(502));
        assert_eq!(e.code(), None);
        assert_eq!(e.problem().map(|p| p.code), Some(ProblemCode::Other));
        assert_eq!(
            e.problem().map(|p| p.detail.as_str()),
            Some("<html>bad gateway</html>")
        );
        assert!(e.is_retryable());
        assert!(
            matches!(e, ClientError::Api { retry_after: Some(d), .. } if d == Duration::from_secs(1))
        );
    }

    /// A code a newer server sends decodes as `Other`: the problem's status,
    /// detail and members are kept, and `code()` names no code.
    #[test]
    fn problems_with_new_codes_decode_as_other() {
        let body = br#"{"type":"https://idem.dev/problems/new","title":"Conflict","status":409,"detail":"a newer refusal","code":"SOME_NEW_CODE","current_generation":4}"#;
        let e = api_error(StatusCode::CONFLICT, &HeaderMap::new(), body, None);
        assert_eq!(e.code(), None);
        let p = e.problem().unwrap();
        assert_eq!(p.code, ProblemCode::Other);
        assert_eq!(
            (p.status, p.detail.as_str(), p.current_generation),
            (409, "a newer refusal", Some(4))
        );
    }

    #[test]
    fn documents_decode_and_tolerate_new_words() {
        let task: Task = serde_json::from_value(json!({
            "id": "0192f0c4-0000-7000-8000-000000000001", "operation": "payment.release",
            "idempotency_key": "k1", "fingerprint": "sha256:00", "params": {"amount": 1},
            "state": "some_future_state", "generation": 0, "attempt_count": 0, "usage": 0,
            "contract": {"price": 100, "retry": {}, "fees": {}, "config_version": "cfg-1"},
            "cancellation": null, "delivery": null, "failure": null,
            "created_at": "2026-01-01T00:00:00.000Z", "updated_at": "2026-01-01T00:00:00.000Z",
            "brand_new_field": true
        }))
        .unwrap();
        assert_eq!(task.state, TaskState::Other);
        let body = serde_json::to_value(
            ReportBody::failed(3, FailureClass::Transient, "boom").with_usage(2),
        )
        .unwrap();
        assert_eq!(
            body,
            json!({"generation": 3, "outcome": "failed", "failure_class": "transient", "message": "boom", "usage": 2})
        );
    }
}
