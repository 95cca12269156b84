//! # idem-console
//!
//! The operator console (SPEC §4 "Operator console"): server-rendered HTML
//! pages under `/console`, served by `idem serve` next to the API, over the
//! same store and configuration ([`idem_http::AppState`]).
//!
//! - [`session`]: sign-in with an API key makes a server-side session (a
//!   random token in an `HttpOnly`, `SameSite=Strict` cookie; only its
//!   SHA-256 is stored, [`idem_store::ops::console`]); every state-changing
//!   form carries a CSRF token derived from the session token.
//! - [`pages`]: sign-in, the overview, the search (the filters and errors of
//!   `GET /v1/tasks`), the task page with its live updates (SSE woken by the
//!   store's change notifications) and the admins' actions (the store
//!   operations of the API's operator actions).
//! - [`timeline`]: the task's story drawn as an SVG picture.
//! - [`html`]: the page layout and the helpers every page shares; every value
//!   is escaped by `maud`, every URL built with `form_urlencoded`.
//! - [`shown`]: every HTML answer shows invisible and bidirectional control
//!   characters of its data as visible escapes (`⟨U+202E⟩`).
//!
//! Every response under `/console` carries a Content-Security-Policy without
//! inline script or style ([`CSP`]) and `nosniff`, `same-origin` referrer and
//! `no-store` headers ([`security_headers`]); static files are embedded in the
//! binary.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use axum::routing::{get, post};

pub mod html;
pub mod pages;
pub mod session;
pub mod shown;
pub mod timeline;

mod error;
#[cfg(test)]
mod tests;

pub use error::ConsoleError;

/// The Content-Security-Policy of every console response: scripts, styles
/// and connections from the console's own origin only, no inline script or
/// style, forms posting only to it, no framing.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// The longest form body a console page posts, bytes (a resolve's result
/// document is the largest: the API's limit).
pub const FORM_LIMIT_BYTES: usize = idem_http::BODY_LIMIT_BYTES;

/// How the console runs (from `idem serve`'s flags).
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// How long a session lasts after sign-in (`IDEM_CONSOLE_SESSION_TTL`,
    /// default 8 h).
    pub session_ttl: Duration,
    /// Whether the session cookie is `Secure` (sent over HTTPS only): set
    /// when the console is reached over TLS (a terminating proxy in front of
    /// `idem serve`).
    pub secure_cookie: bool,
    /// How long a `reconciling` task stays unchanged before the overview
    /// lists it as needing a person (default 15 min; a page's
    /// `?reconciling_after=` seconds overrides it).
    pub reconciling_after: Duration,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            session_ttl: DEFAULT_SESSION_TTL,
            secure_cookie: false,
            reconciling_after: Duration::from_secs(15 * 60),
        }
    }
}

/// The default session length: 8 hours.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

/// The console's handlers' state: the API's state (store, configuration,
/// drain signal) and the console's configuration.
#[derive(Clone)]
pub struct ConsoleState {
    /// The API's shared state.
    pub app: idem_http::AppState,
    /// The console's configuration.
    pub config: Arc<ConsoleConfig>,
}

/// The console's routes, all under `/console`, with their security headers
/// (also on the 404 of an unknown console path). Merge it into the API's
/// router: `idem_http::router(app.clone()).merge(idem_console::router(app, config))`.
pub fn router(app: idem_http::AppState, config: ConsoleConfig) -> Router {
    let state = ConsoleState {
        app,
        config: Arc::new(config),
    };
    // `/console/` (with the slash) is not matched by the nest below: its own
    // route, with the same headers, so the API's fallback never answers it.
    let slash = Router::new()
        .route("/console/", get(pages::root))
        .with_state(state.clone())
        .layer(axum::middleware::map_response(security_headers))
        .layer(axum::middleware::map_response(shown::html_answer));
    let console = Router::new()
        .route("/", get(pages::root))
        .route(
            "/sign-in",
            get(pages::sign_in::form_page).post(pages::sign_in::sign_in),
        )
        .route("/sign-out", post(pages::sign_in::sign_out))
        .route("/overview", get(pages::overview::overview))
        .route("/tasks", get(pages::search::search))
        .route("/tasks/{id}", get(pages::task::page))
        .route("/tasks/{id}/fragment", get(pages::task::fragment))
        .route("/tasks/{id}/live", get(pages::live::live))
        .route("/tasks/{id}/actions/{action}", post(pages::actions::act))
        .route("/static/console.css", get(pages::statics::css))
        .route("/static/console.js", get(pages::statics::js))
        .fallback(pages::not_found)
        .method_not_allowed_fallback(pages::method_not_allowed)
        .with_state(state)
        .layer(
            tower::ServiceBuilder::new()
                .layer(axum::middleware::map_response(security_headers))
                .layer(axum::middleware::map_response(shown::html_answer))
                .layer(DefaultBodyLimit::max(FORM_LIMIT_BYTES)),
        );
    Router::new().nest("/console", console).merge(slash)
}

/// Adds the console's security headers to `res`: [`CSP`], `nosniff`,
/// `Referrer-Policy: same-origin`, and `Cache-Control: no-store` unless the
/// handler set a cache policy of its own (static files).
pub async fn security_headers(mut res: Response) -> Response {
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}
