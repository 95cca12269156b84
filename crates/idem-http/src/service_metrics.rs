//! The service's Prometheus metrics (docs/operations.md): the recorder and
//! its histogram buckets, the help text of every metric, the request
//! counters and latency histograms recorded around every route, and the
//! counters whose label values are all registered up front.

use axum::extract::Request;
use axum::response::Response;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::problem::{Problem, ProblemCode};
use crate::serve;

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
pub(crate) static SUBMITS: std::sync::LazyLock<LabelledCounter<8>> =
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
                "rate_limited",
            ],
        )
    });

/// `idem_submits_rate_limited_total`: new submits refused for a rate limit
/// (SPEC §8.1), by `tenant` and `operation` (docs/operations.md).
pub(crate) const SUBMITS_RATE_LIMITED: &str = "idem_submits_rate_limited_total";

/// Counts one submit refused for a rate limit in
/// [`SUBMITS_RATE_LIMITED`].
pub(crate) fn count_rate_limited(tenant: &str, operation: &str) {
    metrics::counter!(SUBMITS_RATE_LIMITED, "tenant" => tenant.to_owned(), "operation" => operation.to_owned())
        .increment(1);
}

/// `idem_reports_total` by `result` (docs/operations.md).
/// Counts one submit in `idem_submits_total` by its outcome: `Ok(replayed)`,
/// or the problem it was refused with (401 unauthenticated, 403 forbidden,
/// 422 `IDEMPOTENCY_CONFLICT` conflict, 429 `RATE_LIMITED` rate_limited, 5xx
/// error, any other 4xx invalid).
pub(crate) fn count_submit(res: Result<bool, &Problem>) {
    let outcome = match res {
        Ok(true) => "replayed",
        Ok(false) => "created",
        Err(p) if p.code == ProblemCode::IdempotencyConflict => "conflict",
        Err(p) if p.code == ProblemCode::RateLimited => "rate_limited",
        Err(p) if p.status == 401 => "unauthenticated",
        Err(p) if p.status == 403 => "forbidden",
        Err(p) if p.status >= 500 => "error",
        Err(_) => "invalid",
    };
    SUBMITS.increment(outcome);
}

pub(crate) static REPORTS: std::sync::LazyLock<LabelledCounter<3>> =
    std::sync::LazyLock::new(|| {
        LabelledCounter::register(
            "idem_reports_total",
            "result",
            ["applied", "stale", "refused"],
        )
    });

/// Time in queue, seconds, by operation class: observed once per lease.
pub(crate) const QUEUE_WAIT: &str = "idem_queue_wait_seconds";
/// Tasks waiting, by tenant and operation class: set when `/metrics` is read.
pub(crate) const QUEUE_DEPTH: &str = "idem_queue_depth";
/// The longest wait, seconds, by tenant and operation class: set when
/// `/metrics` is read.
pub(crate) const QUEUE_OLDEST_WAIT: &str = "idem_queue_oldest_wait_seconds";

/// How long `/metrics` waits for the queue depths before it answers with the
/// gauges as last read: metrics must answer when the store is overloaded.
pub(crate) const QUEUE_READ_WITHIN: std::time::Duration = std::time::Duration::from_millis(250);

/// Records the time `task` waited before `attempt` leased it: from the
/// moment it became claimable (`ready_at`) to the lease (`leased_at`).
pub(crate) fn record_queue_wait(
    task: &idem_core::model::Task,
    attempt: &idem_core::model::Attempt,
) {
    let waited_ms = attempt
        .leased_at
        .0
        .saturating_sub(task.control.ready_at.0)
        .max(0);
    #[allow(clippy::cast_precision_loss)] // ms well under 2^52
    let seconds = waited_ms as f64 / 1000.0;
    metrics::histogram!(QUEUE_WAIT, "operation" => task.operation.clone()).record(seconds);
}

/// Sets the queue gauges from every tenant's queue depths read at `now`
/// (`idem_store::Store::all_queue_depths`). A queue that emptied since the
/// last read is set to 0 rather than left at its last depth.
pub(crate) fn set_queue_depths(
    now: idem_core::model::Timestamp,
    depths: &[idem_store::ops::QueueDepth],
) {
    static SEEN: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (tenant, operation) in seen.iter() {
        if !depths
            .iter()
            .any(|d| &d.tenant == tenant && &d.operation == operation)
        {
            let labels = [("tenant", tenant.clone()), ("operation", operation.clone())];
            metrics::gauge!(QUEUE_DEPTH, &labels).set(0.0);
            metrics::gauge!(QUEUE_OLDEST_WAIT, &labels).set(0.0);
        }
    }
    seen.clear();
    for d in depths {
        let labels = [
            ("tenant", d.tenant.clone()),
            ("operation", d.operation.clone()),
        ];
        #[allow(clippy::cast_precision_loss)] // counts and ms well under 2^52
        {
            metrics::gauge!(QUEUE_DEPTH, &labels).set(d.depth as f64);
            let oldest_ms = now.0.saturating_sub(d.oldest_ready_at.0).max(0);
            metrics::gauge!(QUEUE_OLDEST_WAIT, &labels).set(oldest_ms as f64 / 1000.0);
        }
        seen.push((d.tenant.clone(), d.operation.clone()));
    }
}

/// Upper bounds (seconds) of the buckets every histogram is rendered with,
/// e.g. `idem_http_request_seconds`: from 0.5 ms to 60 s, past the 30 s
/// longest long-poll ([`crate::MAX_WAIT_MS`]), which lands in the 60 s bucket.
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

// The sweeper's counters, registered and described in `describe_metrics`,
// counted in `idem_store::sweeper::run_sweeper`.
use idem_store::sweeper::{KEYS_RELEASED, LEASES_EXPIRED, TASKS_WOKEN};

/// Gives every idem metric its `# HELP` text and lists every counter from
/// the start, at 0 (each label value of a labelled counter too), so a
/// dashboard or `rate()` sees a series before its first event rather than a
/// gap (docs/operations.md lists them).
fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        "idem_submits_total",
        Unit::Count,
        "Submissions (POST /v1/tasks) by outcome: created, replayed, conflict, unauthenticated, forbidden, invalid, error, rate_limited."
    );
    describe_counter!(
        SUBMITS_RATE_LIMITED,
        Unit::Count,
        "New submits refused 429 RATE_LIMITED by a rate limit of their tenant or class, by tenant and operation."
    );
    describe_counter!(
        idem_store::ops::rates::ATTEMPT_STARTS_THROTTLED,
        Unit::Count,
        "Leases a claim did not grant because the class's attempt_starts_per_s bucket had no token, by operation (the task stays queued)."
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
    describe_counter!(
        crate::problem::OVERLOADED_TOTAL,
        Unit::Count,
        "Requests that found every database connection busy for the pool's wait bound, by handled: refused (503 OVERLOADED), waited (a long-poll claim kept waiting)."
    );
    for handled in crate::problem::OVERLOAD_HANDLING {
        metrics::counter!(crate::problem::OVERLOADED_TOTAL, "handled" => handled).increment(0);
    }
    describe_counter!(
        crate::problem::STORE_UNAVAILABLE_TOTAL,
        Unit::Count,
        "Requests answered 503 UNAVAILABLE because the store failed."
    );
    metrics::counter!(crate::problem::STORE_UNAVAILABLE_TOTAL).increment(0);
    describe_counter!(
        idem_store::changes::SECOND_EFFECTS_SUSPECTED,
        Unit::Count,
        "Suspected second effects raised (evidence of an external effect other than the delivered one), by operation."
    );
    describe_histogram!(
        QUEUE_WAIT,
        Unit::Seconds,
        "Time in queue at lease, by operation: from when the task became claimable (ready_at) to its lease."
    );
    metrics::describe_gauge!(
        QUEUE_DEPTH,
        Unit::Count,
        "Tasks a claim could lease now, by tenant and operation (read from the store when /metrics is read)."
    );
    metrics::describe_gauge!(
        QUEUE_OLDEST_WAIT,
        Unit::Seconds,
        "The longest wait among the waiting tasks, by tenant and operation (read when /metrics is read)."
    );
    std::sync::LazyLock::force(&SUBMITS);
    std::sync::LazyLock::force(&REPORTS);
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

/// Counts and times every request the router answers ([`REQUEST_METRICS`]),
/// under its matched route (`unmatched` for the fallback's 404; a 405 under
/// the route it matched): a tower layer rather than `axum::middleware::from_fn`,
/// which boxes each request's future and clones the inner service for every
/// request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecordRequestLayer;

impl<S> tower::Layer<S> for RecordRequestLayer {
    type Service = RecordRequest<S>;

    fn layer(&self, inner: S) -> RecordRequest<S> {
        RecordRequest { inner }
    }
}

/// [`RecordRequestLayer`]'s service.
#[derive(Debug, Clone)]
pub(crate) struct RecordRequest<S> {
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
        let span = request_span(&req, path.as_ref());
        Recorded {
            started: std::time::Instant::now(),
            inner: self.inner.call(req),
            method,
            path,
            span,
        }
    }
}

/// The request's span ([`idem_store::spans`]): `METHOD ROUTE`, a server span
/// whose parent is the request's `traceparent` when it is valid (a malformed
/// one is ignored here; a submit refuses it). Disabled, and built from
/// nothing, while spans are off.
fn request_span(req: &Request, route: Option<&axum::extract::MatchedPath>) -> tracing::Span {
    if !idem_store::spans::enabled() {
        return tracing::Span::none();
    }
    let route = route.map_or("unmatched", |p| p.as_str());
    let span = tracing::info_span!(
        target: idem_store::spans::TARGET,
        "request",
        otel.name = %format_args!("{} {route}", req.method()),
        otel.kind = "server",
        http.request.method = %req.method(),
        http.route = route,
        url.path = req.uri().path(),
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let traceparent = idem_core::trace::TraceParent::from_header_values(
        req.headers()
            .get_all(crate::TRACEPARENT)
            .iter()
            .map(axum::http::HeaderValue::as_bytes),
    );
    if let Ok(Some(tp)) = traceparent {
        idem_store::spans::set_remote_parent(&span, &tp);
    }
    span
}

/// A request's answer on its way (axum's route future, which is `Unpin`):
/// recorded in [`REQUEST_METRICS`] when it is ready. Dropped before that (the
/// client went away), it records nothing.
pub(crate) struct Recorded<F> {
    inner: F,
    method: axum::http::Method,
    path: Option<axum::extract::MatchedPath>,
    started: std::time::Instant,
    /// The request's span, entered while the answer is worked on (disabled
    /// while spans are off).
    span: tracing::Span,
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
        let out = {
            let _entered = this.span.enter();
            std::task::ready!(std::pin::Pin::new(&mut this.inner).poll(cx))
        };
        if let Ok(res) = &out {
            if !this.span.is_disabled() {
                let status = res.status().as_u16();
                this.span.record("http.response.status_code", status);
                if status >= 500 {
                    this.span.record("otel.status_code", "ERROR");
                }
            }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{AppState, router};
    use idem_core::config::Config;

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
    /// and every request of a path in its histogram.
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
