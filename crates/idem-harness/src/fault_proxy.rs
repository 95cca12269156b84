//! A fault-injecting HTTP proxy between an executor (an SDK worker) and
//! `idem serve`, for tests of what an executor does when the network between
//! it and idem fails: every request is forwarded to the upstream idem unless
//! the rule of its route class says otherwise.
//!
//! - **Route classes** ([`RouteClass`]), by method and path: `POST
//!   /v1/attempts/claim` is `claim`; `POST /v1/attempts/{id}/heartbeat`,
//!   `…/report`, `…/release`, `…/ack` are `heartbeat`, `report`, `release`,
//!   `ack`; `POST /v1/tasks` is `submit`; anything else is `other`.
//! - **Modes** ([`Mode`]): `pass` forwards; `503` answers a problem
//!   ([`INJECTED_503_BODY`]) without forwarding; `503-overloaded` answers
//!   503 `OVERLOADED` with `Retry-After` ([`INJECTED_OVERLOADED_BODY`],
//!   [`INJECTED_RETRY_AFTER_S`]) without forwarding; `reset` reads the request
//!   head, forwards nothing and closes the TCP connection with an RST
//!   (`SO_LINGER` 0); `hang` forwards nothing and never answers, keeping the
//!   connection open until the client closes it; `drop-answer` forwards,
//!   waits for the upstream's whole answer and closes the client's connection
//!   without answering (the effect happened, its answer was lost); `413`
//!   answers 413 `PAYLOAD_TOO_LARGE` to a request whose body is over the
//!   rule's `max_bytes` (as a proxy with a smaller body limit than idem's
//!   would) and forwards the others.
//! - **Rules** ([`Rule`]): a mode, applied after the first `after` requests
//!   of the class passed (and, for `413`, `max_bytes`, default 0). Setting rules replaces all of them and restarts the
//!   `after` counts; a class without a rule passes.
//! - **Control**, on the proxy's own port and never forwarded: `PUT /__faults`
//!   with a JSON object mapping route class to rule (a mode string or
//!   `{"mode": M, "after": N, "max_bytes": B}`) answers 204, or 400 with nothing changed;
//!   `GET /__faults/counts` answers `{"<class>": {"forwarded": n, "faulted":
//!   n}, …}` for every class, counted since the proxy started (a request
//!   counts as faulted when any mode other than `pass` applied to it,
//!   `drop-answer` included, except a request `413` forwarded). Tests in Rust use [`FaultProxy::set_faults`] and
//!   [`FaultProxy::counts`] instead.
//!
//! The proxy is built on hyper's HTTP/1.1 server and client: each request is
//! forwarded on a new upstream connection (bodies streamed both ways, so
//! long-poll claims and event streams pass through), and a client whose
//! connection ends while its request is forwarded ends the upstream
//! connection too. The example `fault-proxy` runs it as a process for the SDK
//! suites in other languages.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// The body of the answer of mode [`Mode::Unavailable`], with status 503 and
/// `Content-Type: application/problem+json`: what idem answers when its store
/// is unavailable.
pub const INJECTED_503_BODY: &str =
    r#"{"type":"about:blank","title":"injected fault","status":503,"code":"STORE_UNAVAILABLE"}"#;

/// The body of the answer of mode [`Mode::Overloaded`], with status 503 and
/// `Content-Type: application/problem+json`.
pub const INJECTED_OVERLOADED_BODY: &str =
    r#"{"type":"about:blank","title":"injected fault","status":503,"code":"OVERLOADED"}"#;

/// The `Retry-After` of the answer of mode [`Mode::Overloaded`], seconds.
pub const INJECTED_RETRY_AFTER_S: u32 = 2;

/// The largest request body [`Mode::TooLarge`] reads before it answers 413
/// (bodies idem accepts are smaller), bytes.
const MAX_READ_BODY: usize = 8 * 1024 * 1024;

/// The path of the control endpoint that sets the rules (`PUT`).
pub const FAULTS_PATH: &str = "/__faults";

/// The path of the control endpoint that answers the counts (`GET`).
pub const COUNTS_PATH: &str = "/__faults/counts";

/// Largest `PUT /__faults` body read, bytes.
const MAX_CONTROL_BODY: usize = 64 * 1024;

/// The class of an API request a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteClass {
    /// `POST /v1/attempts/claim`.
    Claim,
    /// `POST /v1/attempts/{id}/heartbeat`.
    Heartbeat,
    /// `POST /v1/attempts/{id}/report`.
    Report,
    /// `POST /v1/attempts/{id}/release`.
    Release,
    /// `POST /v1/attempts/{id}/ack`.
    Ack,
    /// `POST /v1/tasks`.
    Submit,
    /// Every other request.
    Other,
}

impl RouteClass {
    /// Every class, in the order of the counts.
    pub const ALL: [RouteClass; 7] = [
        RouteClass::Claim,
        RouteClass::Heartbeat,
        RouteClass::Report,
        RouteClass::Release,
        RouteClass::Ack,
        RouteClass::Submit,
        RouteClass::Other,
    ];

    /// The class of a request with `method` to `path` (the URI's path, no
    /// query).
    pub fn of(method: &Method, path: &str) -> RouteClass {
        if method != Method::POST {
            return RouteClass::Other;
        }
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match segments.as_slice() {
            ["v1", "tasks"] => RouteClass::Submit,
            ["v1", "attempts", "claim"] => RouteClass::Claim,
            ["v1", "attempts", id, action] if !id.is_empty() => match *action {
                "heartbeat" => RouteClass::Heartbeat,
                "report" => RouteClass::Report,
                "release" => RouteClass::Release,
                "ack" => RouteClass::Ack,
                _ => RouteClass::Other,
            },
            _ => RouteClass::Other,
        }
    }
}

/// What the proxy does with a request its rule applies to (module
/// documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Mode {
    /// `pass`: forward.
    #[default]
    #[serde(rename = "pass")]
    Pass,
    /// `503`: answer 503 with [`INJECTED_503_BODY`], forward nothing.
    #[serde(rename = "503")]
    Unavailable,
    /// `503-overloaded`: answer 503 with [`INJECTED_OVERLOADED_BODY`] and
    /// `Retry-After:` [`INJECTED_RETRY_AFTER_S`], forward nothing (what idem
    /// answers when no database connection came free in time).
    #[serde(rename = "503-overloaded")]
    Overloaded,
    /// `reset`: forward nothing, close the connection with an RST.
    #[serde(rename = "reset")]
    Reset,
    /// `hang`: forward nothing, never answer.
    #[serde(rename = "hang")]
    Hang,
    /// `drop-answer`: forward, then close the connection without answering.
    #[serde(rename = "drop-answer")]
    DropAnswer,
    /// `413`: answer 413 `PAYLOAD_TOO_LARGE` (naming the limit in `detail`
    /// and `max_bytes`) to a body over the rule's `max_bytes`, forward the
    /// others.
    #[serde(rename = "413")]
    TooLarge,
}

/// The rule of one route class: `mode` applies once `after` requests of the
/// class passed since the rules were set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(from = "RuleForm")]
pub struct Rule {
    /// What happens to the requests after the first `after`.
    pub mode: Mode,
    /// How many requests of the class pass before `mode` applies.
    pub after: u64,
    /// With [`Mode::TooLarge`]: the largest body forwarded, bytes.
    pub max_bytes: u64,
}

impl Rule {
    /// `mode` from the first request on.
    pub fn now(mode: Mode) -> Rule {
        Rule::after(0, mode)
    }

    /// `mode` once `after` requests passed.
    pub fn after(after: u64, mode: Mode) -> Rule {
        Rule {
            mode,
            after,
            max_bytes: 0,
        }
    }

    /// [`Mode::TooLarge`] for bodies over `max_bytes`, from the first request on.
    pub fn too_large(max_bytes: u64) -> Rule {
        Rule {
            max_bytes,
            ..Rule::now(Mode::TooLarge)
        }
    }
}

/// The two JSON forms of a rule: `"hang"` or `{"mode": "hang", "after": 1}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum RuleForm {
    Mode(Mode),
    Full {
        mode: Mode,
        #[serde(default)]
        after: u64,
        #[serde(default)]
        max_bytes: u64,
    },
}

impl From<RuleForm> for Rule {
    fn from(form: RuleForm) -> Rule {
        match form {
            RuleForm::Mode(mode) => Rule::now(mode),
            RuleForm::Full {
                mode,
                after,
                max_bytes,
            } => Rule {
                mode,
                after,
                max_bytes,
            },
        }
    }
}

/// The rules of every class at once; a class missing passes.
pub type Faults = BTreeMap<RouteClass, Rule>;

/// How many requests of one class were forwarded untouched and how many met
/// a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Counts {
    /// Requests forwarded under `pass` (their rule's `after` not yet reached,
    /// or no rule).
    pub forwarded: u64,
    /// Requests a mode other than `pass` applied to.
    pub faulted: u64,
}

/// The rules and counts shared by the proxy's connections.
#[derive(Debug, Default)]
struct Rules {
    faults: Faults,
    /// Requests of each class seen since `faults` were set (for `after`).
    seen: BTreeMap<RouteClass, u64>,
    counts: BTreeMap<RouteClass, Counts>,
}

impl Rules {
    /// The rule for the next request of `class`: its own once `after`
    /// requests passed, else `pass`. Counted unless it is `413`, which
    /// decides on the body ([`Rules::count`]).
    fn decide(&mut self, class: RouteClass) -> Rule {
        let seen = self.seen.entry(class).or_default();
        *seen += 1;
        let rule = match self.faults.get(&class) {
            Some(rule) if *seen > rule.after => *rule,
            _ => Rule::default(),
        };
        if rule.mode != Mode::TooLarge {
            self.count(class, rule.mode != Mode::Pass);
        }
        rule
    }

    /// Counts a request of `class` as `faulted` or forwarded.
    fn count(&mut self, class: RouteClass, faulted: bool) {
        let counts = self.counts.entry(class).or_default();
        if faulted {
            counts.faulted += 1;
        } else {
            counts.forwarded += 1;
        }
    }
}

#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    rules: Mutex<Rules>,
}

impl Shared {
    fn rules(&self) -> MutexGuard<'_, Rules> {
        // A panic while holding the lock leaves plain counters behind.
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_faults(&self, faults: Faults) {
        let mut rules = self.rules();
        rules.faults = faults;
        rules.seen.clear();
    }

    fn counts(&self) -> BTreeMap<RouteClass, Counts> {
        let rules = self.rules();
        RouteClass::ALL
            .iter()
            .map(|c| (*c, rules.counts.get(c).copied().unwrap_or_default()))
            .collect()
    }
}

/// A running proxy: serves until dropped (its accept loop and every
/// connection end then).
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Binds `listen` (port 0 for any) and forwards to `upstream`, every class
    /// passing until [`FaultProxy::set_faults`].
    ///
    /// # Errors
    /// Binding the listener.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            rules: Mutex::default(),
        });
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(FaultProxy { addr, shared, task })
    }

    /// The address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`, the base URL a client uses instead of idem's.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces every rule (a class missing passes) and restarts the `after`
    /// counts, as `PUT /__faults` does.
    pub fn set_faults(&self, faults: Faults) {
        self.shared.set_faults(faults);
    }

    /// The counts of every class since the proxy started, as `GET
    /// /__faults/counts` answers them.
    pub fn counts(&self) -> BTreeMap<RouteClass, Counts> {
        self.shared.counts()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    // Owned here so that aborting this task ends every connection.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, Arc::clone(&shared)));
                }
                Err(e) => {
                    // EMFILE and the like: pause instead of spinning.
                    eprintln!("fault-proxy: accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

/// How the service asks its connection to end before answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    /// An RST ([`Mode::Reset`]).
    Reset,
    /// A plain close (FIN) ([`Mode::DropAnswer`]).
    Quietly,
}

/// The client's TCP stream; dropped with `reset` set, it closes with an RST
/// (`SO_LINGER` 0 set just before the socket closes).
struct ClientStream {
    stream: TcpStream,
    reset: Arc<AtomicBool>,
}

impl Drop for ClientStream {
    fn drop(&mut self) {
        if self.reset.load(Ordering::SeqCst)
            && let Err(e) = self.stream.set_zero_linger()
        {
            eprintln!("fault-proxy: SO_LINGER: {e}");
        }
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

type ProxyBody = BoxBody<Bytes, hyper::Error>;

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    if let Err(e) = stream.set_nodelay(true) {
        eprintln!("fault-proxy: TCP_NODELAY: {e}");
    }
    let reset = Arc::new(AtomicBool::new(false));
    let io = TokioIo::new(ClientStream {
        stream,
        reset: Arc::clone(&reset),
    });
    let (close_tx, mut close_rx) = watch::channel(false);
    let closer = Arc::new(Closer {
        reset,
        close: close_tx,
    });
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let shared = Arc::clone(&shared);
        let closer = Arc::clone(&closer);
        async move { Ok::<_, Infallible>(handle(req, &shared, &closer).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
    // Either way `conn` and with it the stream are dropped: on a close asked
    // for, with a FIN or (`reset` set) an RST.
    tokio::select! {
        _ = conn => {}
        _ = close_rx.wait_for(|close| *close) => {}
    }
}

/// Ends a connection from its service: the stream closes once the
/// connection's task drops it.
struct Closer {
    reset: Arc<AtomicBool>,
    close: watch::Sender<bool>,
}

impl Closer {
    fn close(&self, how: Close) {
        self.reset.store(how == Close::Reset, Ordering::SeqCst);
        self.close.send_replace(true);
    }
}

async fn handle(req: Request<Incoming>, shared: &Shared, closer: &Closer) -> Response<ProxyBody> {
    let path = req.uri().path();
    if path == FAULTS_PATH || path == COUNTS_PATH {
        return control(req, shared).await;
    }
    let class = RouteClass::of(req.method(), path);
    let rule = shared.rules().decide(class);
    match rule.mode {
        Mode::Pass => match forward(shared.upstream, req).await {
            Ok(res) => res.map(BodyExt::boxed),
            Err(e) => problem(
                StatusCode::BAD_GATEWAY,
                &format!("fault-proxy: upstream: {e}"),
            ),
        },
        Mode::Unavailable => {
            let mut res = Response::new(full(Bytes::from_static(INJECTED_503_BODY.as_bytes())));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            res.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
            res
        }
        Mode::Overloaded => {
            let mut res = Response::new(full(Bytes::from_static(
                INJECTED_OVERLOADED_BODY.as_bytes(),
            )));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            res.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(INJECTED_RETRY_AFTER_S));
            res
        }
        Mode::Reset => {
            closer.close(Close::Reset);
            std::future::pending().await
        }
        Mode::Hang => std::future::pending().await,
        Mode::DropAnswer => {
            if let Ok(res) = forward(shared.upstream, req).await {
                // The whole answer, so that the effect is complete upstream.
                let _ = res.into_body().collect().await;
            }
            closer.close(Close::Quietly);
            std::future::pending().await
        }
        Mode::TooLarge => {
            let (head, body) = req.into_parts();
            let body = match Limited::new(body, MAX_READ_BODY).collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) => return problem(StatusCode::BAD_REQUEST, &format!("body: {e}")),
            };
            let over = u64::try_from(body.len()).unwrap_or(u64::MAX) > rule.max_bytes;
            shared.rules().count(class, over);
            if over {
                return too_large(rule.max_bytes);
            }
            match forward(shared.upstream, Request::from_parts(head, Full::new(body))).await {
                Ok(res) => res.map(BodyExt::boxed),
                Err(e) => problem(
                    StatusCode::BAD_GATEWAY,
                    &format!("fault-proxy: upstream: {e}"),
                ),
            }
        }
    }
}

/// idem's answer to a body over its limit, with `max_bytes` as the limit.
fn too_large(max_bytes: u64) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": "injected fault",
        "status": 413,
        "code": "PAYLOAD_TOO_LARGE",
        "detail": format!("the request body is over the limit of {max_bytes} bytes"),
        "max_bytes": max_bytes,
    });
    json_response(StatusCode::PAYLOAD_TOO_LARGE, &body)
}

/// Sends `req` to `upstream` on a new connection; the answer's body streams
/// from it.
async fn forward<B>(
    upstream: SocketAddr,
    req: Request<B>,
) -> Result<Response<Incoming>, ForwardError>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(upstream).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        // Ends once the answer is read or the request is given up.
        let _ = conn.await;
    });
    Ok(sender.send_request(req).await?)
}

#[derive(Debug, thiserror::Error)]
enum ForwardError {
    #[error("connect: {0}")]
    Connect(#[from] io::Error),
    #[error("{0}")]
    Http(#[from] hyper::Error),
}

async fn control(req: Request<Incoming>, shared: &Shared) -> Response<ProxyBody> {
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::PUT, FAULTS_PATH) => {
            let body = match Limited::new(req.into_body(), MAX_CONTROL_BODY)
                .collect()
                .await
            {
                Ok(body) => body.to_bytes(),
                Err(e) => return problem(StatusCode::BAD_REQUEST, &format!("body: {e}")),
            };
            match serde_json::from_slice::<Faults>(&body) {
                Ok(faults) => {
                    shared.set_faults(faults);
                    let mut res = Response::new(full(Bytes::new()));
                    *res.status_mut() = StatusCode::NO_CONTENT;
                    res
                }
                Err(e) => problem(StatusCode::BAD_REQUEST, &format!("rules: {e}")),
            }
        }
        (Method::GET, COUNTS_PATH) => match serde_json::to_vec(&shared.counts()) {
            Ok(body) => {
                let mut res = Response::new(full(Bytes::from(body)));
                res.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                res
            }
            Err(e) => problem(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        },
        _ => problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "control: PUT /__faults or GET /__faults/counts",
        ),
    }
}

fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes).map_err(|never| match never {}).boxed()
}

fn problem(status: StatusCode, detail: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": "fault-proxy",
        "status": status.as_u16(),
        "detail": detail,
    });
    json_response(status, &body)
}

/// `body` as an `application/problem+json` answer with `status`.
fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<ProxyBody> {
    let mut res = Response::new(full(Bytes::from(body.to_string())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    res
}

#[cfg(test)]
mod tests;
