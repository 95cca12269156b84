//! The HTTP/1.1 accept loop of `idem serve`: the [`crate::router`] served on
//! hyper connections with the bounds of [`ServeLimits`].
//!
//! - **Request headers**: a connection whose request headers are not complete
//!   within [`ServeLimits::header_timeout`] is closed. The bound runs from the
//!   moment the connection is accepted (first request) or from the first byte
//!   of a later request, so a client sending a byte now and then cannot stretch
//!   it.
//! - **Request bodies**: a request whose body is not complete within
//!   [`ServeLimits::body_timeout`] of its headers gets 408
//!   `REQUEST_TIMEOUT` with `Connection: close`, and the connection closes
//!   once that is written; a body stalled after complete headers cannot
//!   hold a connection slot. The bound runs from the moment the headers were
//!   read, whatever the handler does meanwhile, and covers only reading the
//!   body: a handler that has read it may take as long as it needs.
//! - **Idle keep-alive**: a connection with no request in progress and no byte
//!   of a next one for [`ServeLimits::idle_timeout`] after its last response is
//!   closed. A request being handled (a long-poll claim, a slow store) has no
//!   bound here.
//! - **Open connections**: at most [`ServeLimits::max_connections`] at once; one
//!   accepted beyond that is closed at once (the client sees the connection
//!   end without an answer and may retry), so the process keeps descriptors
//!   for its store and files. Accept errors such as `EMFILE` pause the accept
//!   loop for [`ACCEPT_ERROR_PAUSE`] instead of spinning.
//!
//! hyper's own `header_read_timeout` is not used: it also bounds the wait for
//! the next request of a keep-alive connection, with the same duration, so the
//! two bounds could not differ.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::Instant;
use tower::ServiceExt;

/// Default of [`ServeLimits::header_timeout`] (`IDEM_HEADER_TIMEOUT_MS`).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Default of [`ServeLimits::body_timeout`] (`IDEM_BODY_TIMEOUT_MS`).
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Default of [`ServeLimits::idle_timeout`] (`IDEM_IDLE_TIMEOUT_MS`).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(75);

/// File descriptors [`default_max_connections`] leaves for other files
/// (SQLite's database, WAL and shared-memory files per connection, the
/// listener, logs, the runtime), on top of the database pool.
pub const RESERVED_DESCRIPTORS: u64 = 64;

/// How long the accept loop pauses after an accept error that is not the
/// client's (`EMFILE`, `ENFILE`, `ENOBUFS` …), before accepting again.
pub const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// The counter of connections the server closed, by `reason`:
/// `header_timeout`, `body_timeout`, `idle_timeout`, `over_capacity`.
pub const CONNECTIONS_CLOSED: &str = "idem_http_connections_closed_total";

/// The `reason` labels of [`CONNECTIONS_CLOSED`].
pub const CLOSE_REASONS: [&str; 4] = [HEADER_TIMEOUT, BODY_TIMEOUT, IDLE_TIMEOUT, OVER_CAPACITY];
const HEADER_TIMEOUT: &str = "header_timeout";
const BODY_TIMEOUT: &str = "body_timeout";
const IDLE_TIMEOUT: &str = "idle_timeout";
const OVER_CAPACITY: &str = "over_capacity";

/// The bounds of [`serve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Longest time a connection may take to send a request's complete
    /// headers (see the module documentation).
    pub header_timeout: Duration,
    /// Longest time a request's body may take to arrive once its headers
    /// were read (see the module documentation).
    pub body_timeout: Duration,
    /// Longest time a keep-alive connection may sit between requests.
    pub idle_timeout: Duration,
    /// Most connections open at once (at least 1).
    pub max_connections: usize,
}

impl ServeLimits {
    /// The default bounds, with [`default_max_connections`] for a database
    /// pool of `pool_size` connections.
    pub fn with_defaults(pool_size: usize) -> ServeLimits {
        ServeLimits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: default_max_connections(pool_size),
        }
    }
}

/// The soft open-file limit of this process (`RLIMIT_NOFILE`); `None` when
/// it is unlimited or unknown.
pub fn open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The default connection cap: the soft open-file limit
/// ([`open_file_limit`]) less [`RESERVED_DESCRIPTORS`] and `pool_size` (the
/// database pool's connections), at least 1; 65 536 when the limit is
/// unlimited or unknown.
pub fn default_max_connections(pool_size: usize) -> usize {
    match open_file_limit() {
        Some(limit) => {
            let room = limit
                .saturating_sub(RESERVED_DESCRIPTORS)
                .saturating_sub(pool_size as u64)
                .max(1);
            usize::try_from(room).unwrap_or(usize::MAX)
        }
        None => 65_536,
    }
}

/// Serves `router` on `listener` over HTTP/1.1 with `limits` until
/// `shutdown` resolves; then stops accepting, lets each connection finish
/// the request it is answering (idle ones close at once) and returns when
/// every connection has closed.
///
/// # Errors
/// None today: accept errors are logged and the loop goes on (the type
/// leaves room for errors that end serving).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let slots = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                tracing::error!(error = %e, pause_ms = ACCEPT_ERROR_PAUSE.as_millis() as u64, "accepting a connection failed; pausing the accept loop");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            metrics::counter!(CONNECTIONS_CLOSED, "reason" => OVER_CAPACITY).increment(1);
            tracing::debug!(max_connections = max, "connection refused: too many open");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let stop = stop_rx.clone();
        tokio::spawn(async move {
            serve_connection(stream, peer, router, limits, stop).await;
            drop(slot);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection holds a slot until it has closed.
    let _ = slots.acquire_many(max as u32).await;
    Ok(())
}

/// Errors of `accept` that concern one client's connection only.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection until it closes, a bound of `limits` runs out, or
/// (after `stop`) its request in progress is answered.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: ServeLimits,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new(limits));
    let io = TokioIo::new(Watched {
        io: stream,
        activity: Arc::clone(&activity),
        unread: Some(peer),
    });
    let in_service = Arc::clone(&activity);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let request = InFlight::begin(Arc::clone(&in_service));
        let router = router.clone();
        let timed_out = Arc::new(AtomicBool::new(false));
        let req = req.map(|body| {
            axum::body::Body::new(BodyDeadline {
                body,
                deadline: Box::pin(tokio::time::sleep(limits.body_timeout)),
                timed_out: Arc::clone(&timed_out),
                ended: false,
            })
        });
        async move {
            let mut res = router.oneshot(req).await?;
            if timed_out.load(Ordering::Relaxed) {
                metrics::counter!(CONNECTIONS_CLOSED, "reason" => BODY_TIMEOUT).increment(1);
                tracing::debug!(
                    body_timeout_ms = limits.body_timeout.as_millis() as u64,
                    "request body not complete in time; closing the connection"
                );
                res = body_timeout_answer(limits.body_timeout);
            }
            Ok::<_, Infallible>(res.map(|body| Tracked {
                body,
                _request: request,
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    // Bounded by `Activity` instead (module documentation).
    builder.header_read_timeout(None);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            res = conn.as_mut() => {
                if let Err(e) = res {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            reason = activity.expired() => {
                metrics::counter!(CONNECTIONS_CLOSED, "reason" => reason).increment(1);
                tracing::debug!(reason, "connection closed");
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Where a connection is between requests, and the deadline that applies.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Reading a request's headers: closed at `deadline` (`header_timeout`).
    Head { deadline: Instant },
    /// `requests` requests being answered: no deadline.
    Busy { requests: usize },
    /// Waiting for the next request: closed at `deadline` (`idle_timeout`)
    /// unless a byte of it arrives first.
    Idle { deadline: Instant },
}

/// A connection's [`Phase`], changed by its IO ([`Watched`]) and its
/// requests ([`InFlight`]), watched by [`Activity::expired`].
#[derive(Debug)]
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
    limits: ServeLimits,
}

impl Activity {
    /// A connection just accepted: its first request's headers are due
    /// within `header_timeout`.
    fn new(limits: ServeLimits) -> Activity {
        Activity {
            phase: Mutex::new(Phase::Head {
                deadline: Instant::now() + limits.header_timeout,
            }),
            changed: Notify::new(),
            limits,
        }
    }

    fn update(&self, f: impl FnOnce(&mut Phase) -> bool) {
        // A poisoned lock only means a panic elsewhere; the phase is whole.
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if f(&mut phase) {
            self.changed.notify_one();
        }
    }

    /// Bytes arrived: on an idle connection they start a request, whose
    /// headers are now due within `header_timeout`.
    fn read_some(&self) {
        self.update(|phase| match *phase {
            Phase::Idle { .. } => {
                *phase = Phase::Head {
                    deadline: Instant::now() + self.limits.header_timeout,
                };
                true
            }
            _ => false,
        });
    }

    /// A request's headers were read: it is being answered.
    fn request_started(&self) {
        self.update(|phase| {
            *phase = match *phase {
                Phase::Busy { requests } => Phase::Busy {
                    requests: requests + 1,
                },
                _ => Phase::Busy { requests: 1 },
            };
            true
        });
    }

    /// A request's answer was written (or abandoned): with none left, the
    /// connection is idle.
    fn request_ended(&self) {
        self.update(|phase| {
            *phase = match *phase {
                Phase::Busy { requests } if requests > 1 => Phase::Busy {
                    requests: requests - 1,
                },
                _ => Phase::Idle {
                    deadline: Instant::now() + self.limits.idle_timeout,
                },
            };
            true
        });
    }

    /// Resolves when the connection's deadline has passed, with the reason
    /// (`header_timeout` or `idle_timeout`).
    async fn expired(&self) -> &'static str {
        loop {
            let phase = *self.phase.lock().unwrap_or_else(|e| e.into_inner());
            let (deadline, reason) = match phase {
                Phase::Head { deadline } => (deadline, HEADER_TIMEOUT),
                Phase::Idle { deadline } => (deadline, IDLE_TIMEOUT),
                Phase::Busy { .. } => {
                    self.changed.notified().await;
                    continue;
                }
            };
            if Instant::now() >= deadline {
                return reason;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                () = self.changed.notified() => {}
            }
        }
    }
}

/// A request being answered, from its headers until its response body is
/// written or dropped.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn begin(activity: Arc<Activity>) -> InFlight {
        activity.request_started();
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// A response body that keeps its request [`InFlight`] until hyper has
/// written it to the end (or dropped it).
struct Tracked {
    body: axum::body::Body,
    _request: InFlight,
}

impl http_body::Body for Tracked {
    type Data = <axum::body::Body as http_body::Body>::Data;
    type Error = <axum::body::Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The answer to a request whose body was not complete within `bound`:
/// 408 `REQUEST_TIMEOUT` with `Connection: close` (hyper closes the
/// connection once it is written).
fn body_timeout_answer(bound: Duration) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut res = crate::problem::Problem::new(
        axum::http::StatusCode::REQUEST_TIMEOUT,
        crate::problem::ProblemCode::RequestTimeout,
        format!(
            "the request body was not complete within {} ms of its headers (IDEM_BODY_TIMEOUT_MS); nothing was done",
            bound.as_millis()
        ),
    )
    .into_response();
    res.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    res
}

/// The error a request body ends with when [`ServeLimits::body_timeout`]
/// passed before its end.
#[derive(Debug, thiserror::Error)]
#[error("the request body was not complete in time")]
struct BodyTimedOut;

/// A request body that must end before `deadline`: once it passes, reading
/// ends with [`BodyTimedOut`] and `timed_out` is set, so the connection
/// answers 408 whatever the handler made of the error.
struct BodyDeadline {
    body: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timed_out: Arc<AtomicBool>,
    /// The body ended (its deadline no longer applies).
    ended: bool,
}

impl http_body::Body for BodyDeadline {
    type Data = axum::body::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.body).poll_frame(cx) {
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => {
                if self.body.is_end_stream() {
                    self.ended = true;
                }
                Poll::Ready(Some(frame.map_err(Into::into)))
            }
            Poll::Pending => {
                if self.deadline.as_mut().poll(cx).is_ready() {
                    self.ended = true;
                    self.timed_out.store(true, Ordering::Relaxed);
                    return Poll::Ready(Some(Err(Box::new(BodyTimedOut))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A connection's socket, telling its [`Activity`] when bytes arrive.
struct Watched {
    io: TcpStream,
    activity: Arc<Activity>,
    /// The client's address until the connection's first bytes are read
    /// (then logged at debug: from there on a graceful shutdown waits for
    /// the request they start).
    unread: Option<SocketAddr>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let res = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(res, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            if let Some(peer) = self.unread.take() {
                tracing::debug!(%peer, "first bytes of a connection read");
            }
            self.activity.read_some();
        }
        res
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
