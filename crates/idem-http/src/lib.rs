//! # idem-http
//!
//! The HTTP API of SPEC §4 as an axum [`Router`]: submit with an
//! `Idempotency-Key`, task reads, cancellation, delivery acknowledgment, the
//! executor protocol (claim, heartbeat, ack, report), health, readiness,
//! Prometheus metrics and the generated OpenAPI 3.1 document.
//!
//! Every error is an RFC 9457 problem ([`problem::Problem`]) with a stable
//! `code`; every response carries `X-Request-Id`.

// `Problem` (≈140 bytes) is the error of every handler; errors are the cold path,
// so boxing it would only add allocations to the code that reads it.
#![allow(clippy::result_large_err)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idem_core::config::Config;
use idem_store::Store;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::sync::Notify;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

mod api;
pub mod auth;
pub mod prepared;
pub mod problem;
mod serve;
mod service_metrics;

pub use api::wire::{ClaimBody, HeartbeatBody, ReportBody, SubmitBody};
use problem::Problem;
pub use serve::{
    ACCEPT_ERROR_PAUSE, CONNECTIONS_CLOSED, DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    RESERVED_DESCRIPTORS, ServeLimits, default_max_connections, open_file_limit, serve,
};

/// Request bodies above this many bytes get 413 `PAYLOAD_TOO_LARGE` (SPEC §4).
pub const BODY_LIMIT_BYTES: usize = 1024 * 1024;

/// Longest long-poll a claim may ask for, ms.
pub const MAX_WAIT_MS: u64 = 30_000;

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The store.
    pub store: Store,
    /// The configuration: operation classes and their contracts.
    pub config: Arc<Config>,
    /// Wakes long-polling claims when work may have appeared in this process.
    pub work: Arc<Notify>,
    /// The contract of each operation class, built once from `config` (its
    /// `config_version` is a SHA-256 of the whole configuration).
    pub contracts: Arc<std::collections::HashMap<String, idem_core::config::Contract>>,
    /// API keys authenticated by this process, for submits (see [`auth::KeyCache`]).
    pub keys: Arc<auth::KeyCache>,
    /// Submit bodies this process already read and fingerprinted (see
    /// [`prepared::PreparedBodies`]).
    pub prepared: Arc<prepared::PreparedBodies>,
    /// Set by [`AppState::drain`] when the server shuts down: long-polling
    /// claims answer at once instead of holding the shutdown for up to
    /// [`MAX_WAIT_MS`].
    draining: Arc<AtomicBool>,
}

impl AppState {
    /// New state over `store` and `config`.
    pub fn new(store: Store, config: Config) -> AppState {
        let contracts = config
            .operations
            .keys()
            .filter_map(|name| config.contract(name).map(|c| (name.clone(), c)))
            .collect();
        AppState {
            store,
            config: Arc::new(config),
            work: Arc::new(Notify::new()),
            contracts: Arc::new(contracts),
            keys: Arc::new(auth::KeyCache::default()),
            prepared: Arc::new(prepared::PreparedBodies::default()),
            draining: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Starts draining for a graceful shutdown: every waiting long-poll claim
    /// (`wait_ms`) answers now with what one more claim finds (often nothing),
    /// and later claims do not wait. Call it when the shutdown signal arrives,
    /// before the server stops taking requests, so the in-flight requests it
    /// waits for end promptly.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.work.notify_waiters();
    }

    /// Whether [`AppState::drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "idem", description = "A durable coordinator for duplicate-sensitive work: idempotency keys bound to request fingerprints, leased attempts with fencing generations, retries by failure class, reconciliation of unknown outcomes, cancellation ordered against delivery."),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags((name = "tasks", description = "Clients: submit and follow tasks"), (name = "attempts", description = "Executors: claim, heartbeat, acknowledge, report"), (name = "operations", description = "Health, readiness, metrics"))
)]
struct ApiDoc;

struct BearerAuth;

/// The two routes [`router`] serves outside [`api_router`], in the document.
#[derive(OpenApi)]
#[openapi(paths(metrics_doc, openapi_doc))]
struct ServedDocs;

/// Prometheus metrics (text exposition format 0.0.4; docs/operations.md).
#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "operations", security(()),
    responses((status = 200, body = String, content_type = "text/plain"), (status = 503, body = Problem, content_type = "application/problem+json")))]
#[allow(dead_code)]
fn metrics_doc() {}

/// This OpenAPI 3.1 document, listing this server's operation classes.
#[utoipa::path(get, path = "/openapi.json", operation_id = "openapi", tag = "operations", security(()),
    responses((status = 200, body = Object, content_type = "application/json")))]
#[allow(dead_code)]
fn openapi_doc() {}

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(api::submit::submit_task, api::tasks::lookup_task))
        .routes(routes!(api::tasks::get_task))
        .routes(routes!(api::tasks::list_attempts))
        .routes(routes!(api::tasks::list_events))
        .routes(routes!(api::tasks::cancel_task))
        .routes(routes!(api::tasks::acknowledge_delivery))
        .routes(routes!(api::attempts::claim))
        .routes(routes!(api::attempts::heartbeat))
        .routes(routes!(api::attempts::acknowledge))
        .routes(routes!(api::attempts::report))
        .routes(routes!(api::health::healthz))
        .routes(routes!(api::health::readyz))
}

/// The OpenAPI 3.1 document of this API, for any configuration (`operation`
/// is any string; [`router`] serves the document of its own configuration,
/// whose operation classes are listed, see [`openapi_for`]).
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = api_router().split_for_parts().1;
    doc.merge(ServedDocs::openapi());
    add_links(&mut doc);
    describe_responses(&mut doc);
    reportable_failure_classes(&mut doc);
    doc
}

/// A report's `failure_class` lists only the classes an executor may report
/// (`transient`, `invalid_input`, `permission_denied`;
/// [`idem_core::model::FailureClass::is_reportable`]): the others are decided
/// by idem, and a report naming one gets 400 `INVALID_REQUEST`. The task's own
/// `failure.class` keeps the whole `FailureClass` list.
fn reportable_failure_classes(doc: &mut utoipa::openapi::OpenApi) {
    use idem_core::model::FailureClass;
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Schema, Type};
    let Some(RefOr::T(Schema::Object(body))) = doc
        .components
        .as_mut()
        .and_then(|c| c.schemas.get_mut("ReportBody"))
    else {
        return;
    };
    let reportable = FailureClass::ALL
        .iter()
        .filter(|c| c.is_reportable())
        .map(|c| c.as_str());
    let class = ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(reportable))
        .description(Some(
            "Required with `failed`: `transient`, `invalid_input` or `permission_denied` (idem decides the other failure classes itself).",
        ));
    let nullable = OneOfBuilder::new()
        .item(class)
        .item(ObjectBuilder::new().schema_type(Type::Null))
        .build();
    body.properties.insert(
        "failure_class".to_owned(),
        RefOr::T(Schema::OneOf(nullable)),
    );
}

/// Gives every response without a description its status's reason phrase
/// (`Unauthorized`, `Service Unavailable` …): OpenAPI 3.1 §4.8.17 requires a
/// description on every Response Object.
fn describe_responses(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::RefOr;
    for item in doc.paths.paths.values_mut() {
        for op in [&mut item.get, &mut item.post].into_iter().flatten() {
            for (status, response) in &mut op.responses.responses {
                if let RefOr::T(r) = response
                    && r.description.trim().is_empty()
                {
                    r.description = status
                        .parse::<u16>()
                        .ok()
                        .and_then(|s| axum::http::StatusCode::from_u16(s).ok())
                        .and_then(|s| s.canonical_reason())
                        .unwrap_or("Response")
                        .to_owned();
                }
            }
        }
    }
}

/// [`openapi`] for a server configured with the operation classes
/// `classes`: the submit body's `operation`, the lookup's `operation` and the
/// claim's `operations` list them (`enum`), so a client generated from
/// `/openapi.json` knows what this server accepts.
pub fn openapi_for<'a>(classes: impl IntoIterator<Item = &'a str>) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{ArrayItems, Schema};
    let names: Vec<serde_json::Value> = classes.into_iter().map(Into::into).collect();
    let mut doc = openapi();
    let listed = |schema: &mut RefOr<Schema>| {
        if let RefOr::T(Schema::Object(o)) = schema {
            o.enum_values = Some(names.clone());
        }
    };
    if let Some(schemas) = doc.components.as_mut().map(|c| &mut c.schemas) {
        if let Some(RefOr::T(Schema::Object(body))) = schemas.get_mut("SubmitBody")
            && let Some(operation) = body.properties.get_mut("operation")
        {
            listed(operation);
        }
        if let Some(RefOr::T(Schema::Object(body))) = schemas.get_mut("ClaimBody")
            && let Some(RefOr::T(Schema::Array(list))) = body.properties.get_mut("operations")
            && let ArrayItems::RefOrSchema(item) = &mut list.items
        {
            listed(item);
        }
    }
    if let Some(lookup) = doc
        .paths
        .paths
        .get_mut("/v1/tasks")
        .and_then(|p| p.get.as_mut())
    {
        for param in lookup.parameters.iter_mut().flatten() {
            if let RefOr::T(param) = param
                && param.name == "operation"
                && let Some(schema) = param.schema.as_mut()
            {
                listed(schema);
            }
        }
    }
    doc
}

/// OpenAPI links (3.1 §4.8.20): the task a submit answers with is the `id` of
/// the task's own operations, and a claimed attempt's `id` that of the
/// attempt's, so a client (or schemathesis's stateful phase) can follow them.
fn add_links(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::link::Link;
    let mut link = |path: &str, status: &str, source: &str, targets: &[(&str, &str)]| {
        let Some(RefOr::T(response)) = doc
            .paths
            .paths
            .get_mut(path)
            .and_then(|p| p.post.as_mut())
            .and_then(|op| op.responses.responses.get_mut(status))
        else {
            return;
        };
        for (name, operation_id) in targets {
            let to = Link::builder()
                .operation_id(*operation_id)
                .parameter("id", source)
                .build();
            response.links.insert((*name).to_owned(), RefOr::T(to));
        }
    };
    link(
        "/v1/tasks",
        "201",
        "$response.body#/task/id",
        &[
            ("GetTask", "get_task"),
            ("ListAttempts", "list_attempts"),
            ("ListEvents", "list_events"),
            ("CancelTask", "cancel_task"),
            ("AcknowledgeDelivery", "acknowledge_delivery"),
        ],
    );
    link(
        "/v1/attempts/claim",
        "200",
        "$response.body#/attempts/0/id",
        &[
            ("Heartbeat", "heartbeat"),
            ("Acknowledge", "acknowledge"),
            ("Report", "report"),
        ],
    );
}

/// Upper bounds (seconds) of the buckets every histogram is rendered with,
/// e.g. `idem_http_request_seconds`: from 0.5 ms to 60 s, past the 30 s
/// longest long-poll ([`MAX_WAIT_MS`]), which lands in the 60 s bucket.
pub const LATENCY_BUCKETS_SECONDS: [f64; 17] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
    30.0, 60.0,
];

/// Installs the global Prometheus recorder once and returns its handle
/// (`None` when another recorder was installed first).
///
/// Histograms are rendered as Prometheus histograms (`_bucket{le=…}`,
/// `_sum`, `_count`, buckets [`LATENCY_BUCKETS_SECONDS`]), not summaries:
/// buckets add up across instances and over any range a query asks for,
/// where a summary's quantiles are per process and fall to 0 once its
/// sliding window holds no sample.
pub fn metrics_handle() -> Option<PrometheusHandle> {
    static HANDLE: std::sync::OnceLock<Option<PrometheusHandle>> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(&LATENCY_BUCKETS_SECONDS)
                .and_then(PrometheusBuilder::install_recorder)
                .ok();
            if handle.is_some() {
                describe_metrics();
            }
            handle
        })
        .clone()
}

/// The sweeper's counters (registered and described in [`describe_metrics`],
/// counted in [`run_sweeper`]).
const LEASES_EXPIRED: &str = "idem_leases_expired_total";
const TASKS_WOKEN: &str = "idem_tasks_woken_total";
const KEYS_RELEASED: &str = "idem_keys_released_total";

/// Gives every idem metric its `# HELP` text and lists every counter from
/// the start, at 0 (each label value of a labelled counter too), so a
/// dashboard or `rate()` sees a series before its first event rather than a
/// gap (docs/operations.md lists them).
fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        "idem_submits_total",
        Unit::Count,
        "Submissions (POST /v1/tasks) by outcome: created, replayed, conflict, unauthenticated, forbidden, invalid, error."
    );
    describe_counter!(
        "idem_reports_total",
        Unit::Count,
        "Executor reports by result: applied, stale (an old generation's, kept as evidence), refused."
    );
    describe_counter!(
        "idem_http_requests_total",
        Unit::Count,
        "HTTP requests by method, matched route and status."
    );
    describe_histogram!(
        "idem_http_request_seconds",
        Unit::Seconds,
        "HTTP request latency by matched route, until the answer's head is ready."
    );
    describe_counter!(
        serve::CONNECTIONS_CLOSED,
        Unit::Count,
        "Connections idem closed: header_timeout (request headers not complete in time), idle_timeout (no request in time after the last answer), over_capacity (closed at accept: IDEM_MAX_CONNECTIONS open)."
    );
    for reason in serve::CLOSE_REASONS {
        metrics::counter!(serve::CONNECTIONS_CLOSED, "reason" => reason).increment(0);
    }
    std::sync::LazyLock::force(&service_metrics::SUBMITS);
    std::sync::LazyLock::force(&service_metrics::REPORTS);
    for (name, help) in [
        (
            "idem_attempts_leased_total",
            "Attempts handed out by claims.",
        ),
        (LEASES_EXPIRED, "Leases the sweeper found expired."),
        (TASKS_WOKEN, "retry_wait tasks whose backoff passed."),
        (
            KEYS_RELEASED,
            "Idempotency keys removed after their retention.",
        ),
    ] {
        describe_counter!(name, Unit::Count, help);
        metrics::counter!(name).increment(0);
    }
}

/// The whole service as a router.
pub fn router(state: AppState) -> Router {
    let api = api_router().split_for_parts().0;
    let doc = Arc::new(openapi_for(
        state.config.operations.keys().map(String::as_str),
    ));
    let metrics = metrics_handle();
    let request_id = HeaderName::from_static("x-request-id");
    api.route(
        "/openapi.json",
        get(move || {
            let doc = Arc::clone(&doc);
            async move { axum::Json(doc.as_ref().clone()) }
        }),
    )
    .route(
        "/metrics",
        get(move || {
            let metrics = metrics.clone();
            async move {
                match metrics {
                    Some(h) => {
                        h.run_upkeep();
                        ([("content-type", "text/plain; version=0.0.4")], h.render())
                            .into_response()
                    }
                    None => Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "UNAVAILABLE",
                        "metrics recorder not installed",
                    )
                    .into_response(),
                }
            }
        }),
    )
    .fallback(
        |method: axum::http::Method, uri: axum::http::Uri| async move {
            Problem::not_found(format!(
                "no such path: {method} {}",
                problem::shorten(uri.path())
            ))
        },
    )
    .method_not_allowed_fallback(|| async {
        Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "METHOD_NOT_ALLOWED",
            "method not allowed on this path",
        )
    })
    .with_state(state)
    // One `layer` call with every middleware, outermost first, as axum's
    // documentation recommends: `Router::layer` boxes each route again on
    // every call, and a request clones the boxes at every level (a replay
    // made about 15 box clones with four calls, 3 with one: callgrind).
    .layer(
        tower::ServiceBuilder::new()
            .layer(SetRequestIdLayer::new(request_id.clone(), MakeRequestUuid))
            .layer(PropagateRequestIdLayer::new(request_id))
            .layer(RecordRequestLayer)
            .layer(DefaultBodyLimit::max(BODY_LIMIT_BYTES)),
    )
}

/// Counts and times every request the router answers ([`REQUEST_METRICS`]),
/// under its matched route (`unmatched` for the fallback's 404; a 405 under
/// the route it matched): a tower layer rather than `axum::middleware::from_fn`,
/// which boxes each request's future and clones the inner service for every
/// request.
#[derive(Debug, Clone, Copy)]
struct RecordRequestLayer;

impl<S> tower::Layer<S> for RecordRequestLayer {
    type Service = RecordRequest<S>;

    fn layer(&self, inner: S) -> RecordRequest<S> {
        RecordRequest { inner }
    }
}

/// [`RecordRequestLayer`]'s service.
#[derive(Debug, Clone)]
struct RecordRequest<S> {
    inner: S,
}

impl<S> tower::Service<Request> for RecordRequest<S>
where
    S: tower::Service<Request, Response = Response>,
    S::Future: Unpin,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Recorded<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Recorded<S::Future> {
        let method = req.method().clone();
        // The matched route (an `Arc<str>` inside: cloning it allocates
        // nothing); the layer wraps each route, so routing has run.
        let path = req
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .cloned();
        Recorded {
            started: std::time::Instant::now(),
            inner: self.inner.call(req),
            method,
            path,
        }
    }
}

/// A request's answer on its way (axum's route future, which is `Unpin`):
/// recorded in [`REQUEST_METRICS`] when it is ready. Dropped before that (the
/// client went away), it records nothing.
struct Recorded<F> {
    inner: F,
    method: axum::http::Method,
    path: Option<axum::extract::MatchedPath>,
    started: std::time::Instant,
}

impl<F, E> std::future::Future for Recorded<F>
where
    F: std::future::Future<Output = Result<Response, E>> + Unpin,
{
    type Output = Result<Response, E>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        let out = std::task::ready!(std::pin::Pin::new(&mut this.inner).poll(cx));
        if let Ok(res) = &out {
            REQUEST_METRICS.record(
                &this.method,
                this.path.as_ref().map_or("unmatched", |p| p.as_str()),
                res.status().as_u16(),
                this.started.elapsed().as_secs_f64(),
            );
        }
        std::task::Poll::Ready(out)
    }
}

/// The handles of `idem_http_requests_total` (by method, path, status) and
/// `idem_http_request_seconds` (by path), registered with the recorder the
/// first time their labels are seen. A request then costs a read lock and a
/// lookup instead of a registration (label strings, key hashing) per metric.
/// Paths are the router's matched routes (or `unmatched`), so the set stays
/// as small as the API.
static REQUEST_METRICS: std::sync::LazyLock<RequestMetrics> =
    std::sync::LazyLock::new(RequestMetrics::default);

#[derive(Default)]
struct RequestMetrics {
    by_path: std::sync::RwLock<std::collections::HashMap<Box<str>, PathMetrics>>,
}

/// One path's latency histogram and its request counters.
struct PathMetrics {
    seconds: metrics::Histogram,
    totals: Vec<(axum::http::Method, u16, metrics::Counter)>,
}

impl PathMetrics {
    /// The counter of `method` and `status`, if registered.
    fn total(&self, method: &axum::http::Method, status: u16) -> Option<&metrics::Counter> {
        self.totals
            .iter()
            .find(|(m, s, _)| m == method && *s == status)
            .map(|(_, _, c)| c)
    }
}

impl RequestMetrics {
    /// Counts one request and records its latency (`seconds`).
    fn record(&self, method: &axum::http::Method, path: &str, status: u16, seconds: f64) {
        // A poisoned lock only means a panic elsewhere while registering: the
        // map is whole either way.
        {
            let paths = self.by_path.read().unwrap_or_else(|e| e.into_inner());
            if let Some(m) = paths.get(path)
                && let Some(total) = m.total(method, status)
            {
                total.increment(1);
                m.seconds.record(seconds);
                return;
            }
        }
        let mut paths = self.by_path.write().unwrap_or_else(|e| e.into_inner());
        let m = paths.entry(path.into()).or_insert_with(|| PathMetrics {
            seconds: metrics::histogram!("idem_http_request_seconds", "path" => path.to_owned()),
            totals: Vec::new(),
        });
        let total = match m.total(method, status) {
            Some(total) => total.clone(),
            None => {
                let total = metrics::counter!(
                    "idem_http_requests_total",
                    "method" => method.to_string(),
                    "path" => path.to_owned(),
                    "status" => status.to_string()
                );
                m.totals.push((method.clone(), status, total.clone()));
                total
            }
        };
        total.increment(1);
        m.seconds.record(seconds);
    }
}

/// Runs one sweep (lease expiry, backoff wake-ups, retention) every `every` until
/// `shutdown` resolves. Errors are retried on the next tick and logged (WARN
/// `sweep failed`) when they differ from the previous sweep's, so a store that
/// stays down (or a SQLite file removed under it, which fails every sweep)
/// logs one line, not one per tick; the first sweep that works again logs
/// `sweeps work again` (INFO).
pub async fn run_sweeper(
    store: Store,
    work: Arc<Notify>,
    every: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut failing: Option<String> = None;
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = tick.tick() => {}
        }
        match store.sweep(500).await {
            Ok(s) => {
                if failing.take().is_some() {
                    tracing::info!("sweeps work again");
                }
                if s.expired + s.woken > 0 {
                    work.notify_waiters();
                }
                // Only what happened: the series exist (at 0) from start-up
                // (`metrics_handle`), not from the first sweep.
                for (name, n) in [
                    (LEASES_EXPIRED, s.expired),
                    (TASKS_WOKEN, s.woken),
                    (KEYS_RELEASED, s.keys_released),
                ] {
                    if n > 0 {
                        metrics::counter!(name).increment(n as u64);
                    }
                }
            }
            Err(e) => {
                let message = e.to_string();
                if failing.as_ref() != Some(&message) {
                    tracing::warn!(error = %message, "sweep failed");
                    failing = Some(message);
                }
            }
        }
    }
}

/// Handler-facing alias.
pub(crate) type AppResult<T> = Result<T, Problem>;

/// Shared state extractor alias.
pub(crate) type St = State<AppState>;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Request latency is a Prometheus histogram with the documented buckets
    /// (operations.md), so instances can be summed; a summary would print
    /// `quantile` lines instead.
    #[test]
    fn request_latency_is_a_histogram_with_buckets() {
        let handle = metrics_handle().unwrap();
        metrics::histogram!("idem_http_request_seconds", "path" => "/test/histogram").record(0.003);
        let text = handle.render();
        let ours: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("path=\"/test/histogram\""))
            .collect();
        // A line of this series that starts with `prefix`, contains `label`
        // and ends with the value `value`.
        let has = |prefix: &str, label: &str, value: &str| {
            ours.iter().any(|l| {
                l.starts_with(prefix) && l.contains(label) && l.ends_with(&format!(" {value}"))
            })
        };
        let bucket = "idem_http_request_seconds_bucket{";
        assert!(has(bucket, "le=\"0.005\"", "1"), "{ours:?}");
        assert!(has(bucket, "le=\"0.0025\"", "0"), "{ours:?}");
        assert!(has("idem_http_request_seconds_count{", "", "1"), "{ours:?}");
        assert!(!ours.iter().any(|l| l.contains("quantile=")), "{ours:?}");
    }

    /// The value of series `name{labels}` in the exposition `text` (0 when
    /// it is not there yet).
    fn value(text: &str, name: &str, labels: &str) -> u64 {
        let prefix = format!("{name}{{{labels}}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |v| v.trim().parse().unwrap())
    }

    /// Every request through the router is counted under its matched route
    /// (`unmatched` for the fallback) and timed, by [`RecordRequestLayer`].
    #[tokio::test]
    async fn the_router_counts_requests_by_matched_route() {
        use tower::ServiceExt;

        let handle = metrics_handle().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store =
            idem_store_sqlite::open(dir.path().join("idem.db"), Default::default()).unwrap();
        let app = router(AppState::new(store, Config::bundled().unwrap()));
        let health = r#"method="GET",path="/healthz",status="200""#;
        let not_allowed = r#"method="DELETE",path="/healthz",status="405""#;
        let unmatched = r#"method="GET",path="unmatched",status="404""#;
        let before = handle.render();
        for (method, uri) in [
            ("GET", "/healthz"),
            ("GET", "/healthz"),
            ("GET", "/no/such/route"),
            ("DELETE", "/healthz"),
            ("GET", "/healthz"),
        ] {
            let req = Request::builder()
                .method(method)
                .uri(uri)
                .body(axum::body::Body::empty())
                .unwrap();
            app.clone().oneshot(req).await.unwrap();
        }
        let after = handle.render();
        let grew =
            |name: &str, labels: &str| value(&after, name, labels) - value(&before, name, labels);
        let total = "idem_http_requests_total";
        assert_eq!(grew(total, health), 3, "{after}");
        assert_eq!(grew(total, not_allowed), 1, "{after}");
        assert_eq!(grew(total, unmatched), 1, "{after}");
        let timed = r#"path="/healthz""#;
        assert_eq!(grew("idem_http_request_seconds_count", timed), 4, "{after}");
    }

    /// The cached handles count each (method, path, status) on its own line
    /// and every request of a path in its histogram, as registering on every
    /// request did.
    #[test]
    fn request_metrics_count_each_label_set() {
        let handle = metrics_handle().unwrap();
        let m = RequestMetrics::default();
        let path = "/test/counted";
        m.record(&axum::http::Method::GET, path, 200, 0.001);
        m.record(&axum::http::Method::GET, path, 200, 0.001);
        m.record(&axum::http::Method::POST, path, 200, 0.001);
        m.record(&axum::http::Method::GET, path, 404, 0.001);
        let text = handle.render();
        let line = |method: &str, status: &str| {
            format!(
                "idem_http_requests_total{{method=\"{method}\",path=\"{path}\",status=\"{status}\"}}"
            )
        };
        assert!(
            text.contains(&format!("{} 2\n", line("GET", "200"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} 1\n", line("POST", "200"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} 1\n", line("GET", "404"))),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "idem_http_request_seconds_count{{path=\"{path}\"}} 4\n"
            )),
            "{text}"
        );
    }
}
