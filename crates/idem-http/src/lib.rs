//! # idem-http
//!
//! The HTTP API of SPEC §4 as an axum [`Router`]. Its routes:
//!
//! | route | handler |
//! | --- | --- |
//! | `POST /v1/tasks` (submit with an `Idempotency-Key`), `GET /v1/tasks` (lookup by scope, search) | `api::submit`, `api::search` |
//! | `GET /v1/tasks/{id}`, `…/attempts`, `…/events` (JSON or Server-Sent Events) | `api::tasks` |
//! | `POST /v1/tasks/{id}/cancel`, `POST /v1/tasks/{id}/delivery/ack` | `api::tasks` |
//! | `POST /v1/tasks/{id}/retry-now`, `…/resolve`, `…/redrive`, `…/second-effects/acknowledge` (admin) | `api::operator` |
//! | `GET /v1/events` (the tenant feed) | `api::events` |
//! | `POST /v1/attempts/claim`, `/v1/attempts/{id}/heartbeat`, `…/ack`, `…/report`, `…/release` | `api::attempts` |
//! | `GET /healthz`, `GET /readyz` | `api::health` |
//! | `GET /metrics` (Prometheus text), `GET /openapi.json` (OpenAPI 3.1) | [`router`] |
//!
//! Every error is an RFC 9457 problem ([`problem::Problem`]) with a stable
//! `code`; every response carries `X-Request-Id`.
//!
//! This file holds the shared state and the router; the handlers and their
//! documents live in `api`, the OpenAPI document's assembly in `openapi`, the
//! metrics in `service_metrics`, the connection loop in `serve`, long-poll
//! claims in `claims` and held waits in `wait`. The sweeper a server runs
//! beside it is [`idem_store::sweeper`]; the console's routes are
//! `idem-console`'s, merged by the binary.

// `Problem` (≈140 bytes) is the error of every handler; errors are the cold path,
// so boxing it would only add allocations to the code that reads it.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderName, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use idem_core::config::Config;
use idem_store::Store;
use tokio::sync::watch;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

mod api;
pub mod auth;
pub mod claims;
mod granted;
mod openapi;
pub mod prepared;
pub mod problem;
mod serve;
mod service_metrics;
pub mod wait;

pub use api::search::read_query as read_task_query;
pub use api::wire::{ClaimBody, HeartbeatBody, ReportBody, SubmitBody};
pub use openapi::{openapi, openapi_for};
use problem::{Problem, ProblemCode};
pub use serve::{
    ACCEPT_ERROR_PAUSE, CONNECTIONS_CLOSED, DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    RESERVED_DESCRIPTORS, ServeLimits, default_max_connections, open_file_limit, serve,
};
pub use service_metrics::{LATENCY_BUCKETS_SECONDS, metrics_handle};

/// Request bodies above this many bytes get 413 `PAYLOAD_TOO_LARGE` (SPEC §4).
pub const BODY_LIMIT_BYTES: usize = 1024 * 1024;

/// Longest long-poll a claim may ask for, ms.
pub const MAX_WAIT_MS: u64 = 30_000;

/// The W3C `traceparent` request header (a submit keeps it on its task; any
/// request's span continues it): a constant name, so a lookup hashes it
/// without parsing it first.
pub(crate) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The store.
    pub store: Store,
    /// The configuration: operation classes and their contracts.
    pub config: Arc<Config>,
    /// The long-poll claims waiting in this process ([`claims`]).
    pub claims: Arc<claims::ClaimHub>,
    /// The contract of each operation class, built once from `config` (its
    /// `config_version` is a SHA-256 of the whole configuration).
    pub contracts: Arc<std::collections::HashMap<String, idem_core::contract::FrozenContract>>,
    /// API keys authenticated by this process, for submits (see [`auth::KeyCache`]).
    pub keys: Arc<auth::KeyCache>,
    /// Submit bodies this process already read and fingerprinted (see
    /// [`prepared::PreparedBodies`]).
    pub prepared: Arc<prepared::PreparedBodies>,
    /// Set by [`AppState::drain`] when the server shuts down: long-polling
    /// claims, `Prefer: wait` and event streams answer or end at once
    /// instead of holding the shutdown.
    draining: Arc<watch::Sender<bool>>,
    /// With [`AppState::require_sync_standby`]: why writes are refused now
    /// (`None` while a synchronous standby is attached), read from a cached
    /// check, never the database.
    sync_standby: Option<SyncStandbyGate>,
}

/// Why submits are refused now, `None` while they are not: a cached reading
/// (`IDEM_REQUIRE_SYNC_STANDBY`: no synchronous standby attached).
pub type SyncStandbyGate = Arc<dyn Fn() -> Option<String> + Send + Sync>;

impl AppState {
    /// New state over `store` and `config`.
    pub fn new(store: Store, config: Config) -> AppState {
        let contracts = config
            .operations
            .keys()
            .filter_map(|name| {
                let contract = config.contract(name)?;
                // A contract holds numbers, strings and a JSON document: it serializes.
                let frozen = idem_core::contract::FrozenContract::new(contract).ok()?;
                Some((name.clone(), frozen))
            })
            .collect();
        AppState {
            store,
            config: Arc::new(config),
            claims: Arc::new(claims::ClaimHub::default()),
            contracts: Arc::new(contracts),
            keys: Arc::new(auth::KeyCache::default()),
            prepared: Arc::new(prepared::PreparedBodies::default()),
            draining: Arc::new(watch::Sender::new(false)),
            sync_standby: None,
        }
    }

    /// What a claim by `key` of `operations` brings of the configuration
    /// (SPEC §8): the tenants its pool serves, the classes among
    /// `operations` with a fairness key, the tenants' weights, the caps of
    /// tenants and classes and the classes' attempt-start limits.
    pub fn claim_flow(
        &self,
        key: &idem_core::model::ApiKey,
        operations: &[String],
    ) -> idem_store::flow::ClaimFlow {
        idem_store::flow::ClaimFlow {
            serves: key.serves.clone(),
            fair_classes: operations
                .iter()
                .filter(|op| {
                    self.config
                        .operations
                        .get(op.as_str())
                        .is_some_and(|c| c.flow.fairness_key.is_some())
                })
                .cloned()
                .collect(),
            weights: self
                .config
                .tenants
                .iter()
                .map(|(t, s)| (t.clone(), s.weight))
                .collect(),
            tenant_caps: self
                .config
                .tenants
                .iter()
                .filter_map(|(t, s)| Some((t.clone(), s.cap?)))
                .collect(),
            classes: operations
                .iter()
                .filter_map(|op| {
                    let f = &self.config.operations.get(op)?.flow;
                    let caps = idem_store::caps::ClassCaps {
                        cap: f.cap,
                        tenant_cap: f.tenant_cap,
                        concurrency_key_cap: f.concurrency_key_cap,
                    };
                    (caps != idem_store::caps::ClassCaps::default()).then(|| (op.clone(), caps))
                })
                .collect(),
            starts_per_s: self.config.start_limits(),
        }
    }

    /// Makes `/readyz` and submits answer 503 `NO_SYNC_STANDBY` (with
    /// `Retry-After`, nothing written) while `gate` gives a reason (SPEC §5,
    /// `IDEM_REQUIRE_SYNC_STANDBY`). `gate` is called on every submit: it
    /// must read a cached value.
    pub fn require_sync_standby(&mut self, gate: SyncStandbyGate) {
        self.sync_standby = Some(gate);
    }

    /// Why submits are refused now ([`AppState::require_sync_standby`]).
    pub(crate) fn sync_standby_refusal(&self) -> Option<String> {
        self.sync_standby.as_ref().and_then(|gate| gate())
    }

    /// Starts draining for a graceful shutdown: every waiting long-poll claim
    /// (`wait_ms`) answers now with what one more claim finds (often nothing),
    /// every `Prefer: wait` answers with the task as it is, every event
    /// stream ends, and later requests do not wait. Call it when the shutdown
    /// signal arrives, before the server stops taking requests, so the
    /// in-flight requests it waits for end promptly.
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    /// Starts what waiting requests are woken by: the store's change
    /// notifications (on PostgreSQL its listening connection) and the
    /// waiting claims' listener ([`claims::ClaimHub::start`]). A server calls
    /// it before it takes requests; without it both start on first use.
    /// Needs a tokio runtime.
    pub fn start(&self) {
        self.store.changes().start();
        self.claims.start(&self.store);
    }

    /// Whether [`AppState::drain`] was called.
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Resolves once [`AppState::drain`] was called.
    pub async fn drained(&self) {
        let mut rx = self.draining.subscribe();
        let _ = rx.wait_for(|draining| *draining).await;
    }
}

fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(api::submit::submit_task, api::search::list_tasks))
        .routes(routes!(api::tasks::get_task))
        .routes(routes!(api::queues::list_queues))
        .routes(routes!(api::tasks::list_attempts))
        .routes(routes!(api::tasks::list_events))
        .routes(routes!(api::events::tenant_feed))
        .routes(routes!(api::tasks::cancel_task))
        .routes(routes!(api::tasks::acknowledge_delivery))
        .routes(routes!(api::operator::retry_now))
        .routes(routes!(api::operator::resolve))
        .routes(routes!(api::operator::redrive))
        .routes(routes!(api::operator::acknowledge_second_effect))
        .routes(routes!(api::attempts::claim))
        .routes(routes!(api::attempts::heartbeat))
        .routes(routes!(api::attempts::acknowledge))
        .routes(routes!(api::attempts::report))
        .routes(routes!(api::attempts::release))
        .routes(routes!(api::health::healthz))
        .routes(routes!(api::health::readyz))
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
        get(move |State(st): St| {
            let metrics = metrics.clone();
            async move {
                match metrics {
                    Some(h) => {
                        // The queue gauges from the store, given at most
                        // QUEUE_READ_WITHIN: a busy or failing store leaves
                        // them as last read and the rest still answers.
                        match tokio::time::timeout(
                            service_metrics::QUEUE_READ_WITHIN,
                            st.store.all_queue_depths(),
                        )
                        .await
                        {
                            Ok(Ok((now, depths))) => {
                                service_metrics::set_queue_depths(now, &depths)
                            }
                            Ok(Err(e)) => tracing::debug!(error = %e, "queue depths for /metrics"),
                            Err(_) => {
                                tracing::debug!("queue depths for /metrics: not read in time")
                            }
                        }
                        h.run_upkeep();
                        ([("content-type", "text/plain; version=0.0.4")], h.render())
                            .into_response()
                    }
                    None => Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        ProblemCode::Unavailable,
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
            ProblemCode::MethodNotAllowed,
            "method not allowed on this path",
        )
    })
    .with_state(state)
    // One `layer` call with every middleware, outermost first, as axum's
    // documentation recommends: `Router::layer` boxes each route again on
    // every call, and a request clones the boxes at every level.
    .layer(
        tower::ServiceBuilder::new()
            .layer(SetRequestIdLayer::new(request_id.clone(), MakeRequestUuid))
            .layer(PropagateRequestIdLayer::new(request_id))
            .layer(service_metrics::RecordRequestLayer)
            .layer(DefaultBodyLimit::max(BODY_LIMIT_BYTES)),
    )
}

/// Handler-facing alias.
pub(crate) type AppResult<T> = Result<T, Problem>;

/// Shared state extractor alias.
pub(crate) type St = State<AppState>;
