//! The idem server, assembled in one place: `idem serve`, the harness's
//! in-process servers (`idem-lab bench`, `idem-lab demo`) and the HTTP tests all run
//! the [`App`] built here, so they serve with the same parts, the same
//! connection limits and the same graceful shutdown (the shape of
//! zero-to-production's `Application::build`).
//!
//! [`App::build`] binds the listener and starts what a server runs beside
//! its router, in this order:
//! - the Prometheus recorder ([`idem_http::metrics_handle`]), before the
//!   sweeper's first tick, so that sweep's counts (after a restart, every
//!   lease that ran out meanwhile) are recorded too;
//! - the waiting hubs ([`AppState::start`]): the store's change
//!   notifications and the waiting claims' listener, before the first
//!   request waits on them;
//! - the sweeper ([`idem_store::sweeper::run_sweeper`]) every
//!   [`Options::sweep_interval`];
//! - the router: idem-http's API and, unless [`Options::console`] is `None`,
//!   the operator console under `/console` (SPEC §4 "Operator console"),
//!   with the sync-standby gate of [`Options::sync_standby`] (SPEC §5).
//!
//! [`App::run`] serves with [`idem_http::serve`] and [`Options::limits`]
//! until its shutdown future resolves, then drains: long-polling claims,
//! `Prefer: wait` and event streams answer or end at once
//! ([`AppState::drain`]), each open request is answered, the sweeper stops,
//! and the last commits are announced to the other instances
//! ([`Store::announced`]). Open requests that outlast
//! [`Options::shutdown_grace`] end the run with [`Stopped::GraceOutlasted`].
//!
//! What belongs to a process stays with it: resolving a listen address
//! given as a name, signals, stdout, the exit status, telemetry (`idem
//! serve` in `crates/idem/src/serve.rs`).

pub mod output;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use axum::Router;
use idem_core::config::Config;
use idem_http::{AppState, ServeLimits, SyncStandbyGate};
use idem_store::Store;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Default of [`Options::sweep_interval`] (`idem serve --sweep-interval-ms`).
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_millis(200);

/// The shortest sweep interval: a shorter [`Options::sweep_interval`] is
/// taken as this one (a sweep is a few queries; sweeping in a tight loop
/// would crowd out the requests).
pub const MIN_SWEEP_INTERVAL: Duration = Duration::from_millis(10);

/// Default of [`Options::shutdown_grace`] (`idem serve --shutdown-grace-ms`).
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// Where [`App::build`] takes its listener from.
#[derive(Debug)]
pub enum Listen {
    /// Bind this address (port 0: a free port the system picks).
    Addr(SocketAddr),
    /// Serve on this listener, already bound (`idem serve` binds the first
    /// address its `--listen` name resolves to).
    Bound(TcpListener),
}

impl Default for Listen {
    /// `127.0.0.1:0`.
    fn default() -> Self {
        Listen::Addr(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
    }
}

/// How [`App::build`] assembles the server. `Options::default()` is `idem
/// serve`'s defaults on `127.0.0.1:0`.
pub struct Options {
    /// The listener (default: bind `127.0.0.1:0`).
    pub listen: Listen,
    /// Connection bounds of [`idem_http::serve`] (default:
    /// [`ServeLimits::with_defaults`] for no database pool).
    pub limits: ServeLimits,
    /// How often the sweeper expires leases, wakes backoffs and removes keys
    /// past retention (default [`DEFAULT_SWEEP_INTERVAL`]; at least
    /// [`MIN_SWEEP_INTERVAL`]).
    pub sweep_interval: Duration,
    /// The operator console's configuration; `None`: not served (default:
    /// served, with [`idem_console::ConsoleConfig::default`]).
    pub console: Option<idem_console::ConsoleConfig>,
    /// With a gate: `/readyz` and submits answer 503 `NO_SYNC_STANDBY`
    /// while it gives a reason ([`AppState::require_sync_standby`]; default
    /// none).
    pub sync_standby: Option<SyncStandbyGate>,
    /// How long open requests may take after the shutdown future resolved
    /// before [`App::run`] returns [`Stopped::GraceOutlasted`] (default
    /// [`DEFAULT_SHUTDOWN_GRACE`]).
    pub shutdown_grace: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            listen: Listen::default(),
            limits: ServeLimits::with_defaults(0),
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
            console: Some(idem_console::ConsoleConfig::default()),
            sync_standby: None,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}

/// Why the server could not be built or stopped serving.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppError {
    /// [`Listen::Addr`] did not bind (in use, not an address of this host,
    /// a privileged port).
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The listener has no local address (it was closed).
    #[error("reading the listener's address: {0}")]
    LocalAddr(#[source] std::io::Error),
    /// Serving ended with an error.
    #[error("serving HTTP: {0}")]
    Serve(#[source] std::io::Error),
}

/// How [`App::run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Stopped {
    /// Every open request was answered, the sweeper stopped and the last
    /// commits were announced.
    Drained,
    /// The drain (open requests, the sweeper's last sweep, the
    /// announcement) had not ended [`Options::shutdown_grace`] after the
    /// shutdown began; what was open is left running (a process exits: an
    /// unfinished transaction rolls back).
    GraceOutlasted,
}

/// A built server: bound, its hubs and sweeper running, not yet serving.
/// Dropped without [`App::run`], it stops its sweeper.
pub struct App {
    state: AppState,
    router: Router,
    listener: TcpListener,
    addr: SocketAddr,
    limits: ServeLimits,
    console: Option<idem_console::ConsoleConfig>,
    shutdown_grace: Duration,
    sweeper: JoinHandle<()>,
    /// Sends `true` (or is dropped) to stop the sweeper.
    stop_sweeper: watch::Sender<bool>,
}

impl App {
    /// Binds the listener and starts the recorder, the waiting hubs and the
    /// sweeper of a server over `store` with `config` (the module
    /// documentation gives the order and why). Logs the connection limits
    /// (info). Needs a tokio runtime.
    ///
    /// # Errors
    /// [`AppError::Bind`] when [`Listen::Addr`] does not bind,
    /// [`AppError::LocalAddr`] when the listener has no address.
    pub async fn build(store: Store, config: Config, options: Options) -> Result<App, AppError> {
        let Options {
            listen,
            limits,
            sweep_interval,
            console,
            sync_standby,
            shutdown_grace,
        } = options;
        let listener = match listen {
            Listen::Addr(addr) => TcpListener::bind(addr)
                .await
                .map_err(|source| AppError::Bind { addr, source })?,
            Listen::Bound(listener) => listener,
        };
        let addr = listener.local_addr().map_err(AppError::LocalAddr)?;
        let mut state = AppState::new(store.clone(), config);
        if let Some(gate) = sync_standby {
            state.require_sync_standby(gate);
        }
        tracing::info!(
            header_timeout_ms = limits.header_timeout.as_millis() as u64,
            body_timeout_ms = limits.body_timeout.as_millis() as u64,
            idle_timeout_ms = limits.idle_timeout.as_millis() as u64,
            max_connections = limits.max_connections,
            open_file_limit = idem_http::open_file_limit(),
            "connection limits"
        );
        let _ = idem_http::metrics_handle();
        state.start();
        let (stop_sweeper, stop) = watch::channel(false);
        let sweeper = tokio::spawn(idem_store::sweeper::run_sweeper(
            store,
            sweep_interval.max(MIN_SWEEP_INTERVAL),
            async move {
                let mut stop = stop;
                // A dropped sender (an `App` never run) stops it too.
                let _ = stop.wait_for(|stop| *stop).await;
            },
        ));
        let api = idem_http::router(state.clone());
        let router = match &console {
            Some(c) => api.merge(idem_console::router(state.clone(), c.clone())),
            None => api,
        };
        Ok(App {
            state,
            router,
            listener,
            addr,
            limits,
            console,
            shutdown_grace,
            sweeper,
            stop_sweeper,
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL, `http://ADDR` (e.g. `http://127.0.0.1:41234`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The state its handlers share (store, configuration, hubs).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// The store it serves.
    pub fn store(&self) -> &Store {
        &self.state.store
    }

    /// Serves until `shutdown` resolves, then drains (module
    /// documentation). Logs `operator console on http://ADDR/console` (info)
    /// when the console is served, and `shutting down: answering open
    /// requests` (info) when `shutdown` resolves.
    ///
    /// # Errors
    /// [`AppError::Serve`] when serving ends with an error.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<Stopped, AppError> {
        let App {
            state,
            router,
            listener,
            addr,
            limits,
            console,
            shutdown_grace,
            sweeper,
            stop_sweeper,
        } = self;
        if let Some(c) = &console {
            tracing::info!(
                session_ttl_s = c.session_ttl.as_secs(),
                secure_cookie = c.secure_cookie,
                "operator console on http://{addr}/console"
            );
        }
        let draining = state.clone();
        let (began, shutdown_began) = oneshot::channel::<()>();
        let serving = idem_http::serve(listener, router, limits, async move {
            shutdown.await;
            tracing::info!("shutting down: answering open requests");
            // Long-polling claims, `Prefer: wait` and event streams answer or
            // end now, so the shutdown does not wait them out.
            draining.drain();
            let _ = began.send(());
        });
        let drained = async move {
            serving.await.map_err(AppError::Serve)?;
            let _ = stop_sweeper.send(true);
            let _ = sweeper.await;
            // The last commits reach the other instances' waiters.
            state.store.announced().await;
            Ok(Stopped::Drained)
        };
        let grace_over = async move {
            match shutdown_began.await {
                Ok(()) => tokio::time::sleep(shutdown_grace).await,
                // Serving ended before a shutdown began: `drained` answers.
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            drained = drained => drained,
            () = grace_over => Ok(Stopped::GraceOutlasted),
        }
    }
}

#[cfg(test)]
mod tests;
