//! `idem serve`: binding the listen address, the shutdown signals and their
//! grace period, and the server's run from start-up to its last log line.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::StoreArgs;
use crate::config::load_config;
use crate::store::{lock_sqlite_for_serve, log_store_location, open_store_waiting};
use crate::telemetry::Telemetry;
use idem_server::output::say;

/// SIGTERM and SIGINT (Ctrl-C), listened for from the moment this is made:
/// a signal that arrives before the server waits for one is not lost, and
/// does not end the process with the signal's default action either.
struct ShutdownSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    /// Installs the handlers.
    ///
    /// # Errors
    /// When the handlers cannot be installed.
    fn install() -> Result<ShutdownSignals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(ShutdownSignals {
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(ShutdownSignals {})
    }

    /// The next SIGTERM or SIGINT.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.int.recv() => {},
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Binds `listen` (`HOST:PORT`, HOST an IP address or a name): the first
/// address it resolves to that binds.
///
/// # Errors
/// A message naming `listen` when it does not resolve, or when none of its
/// addresses binds (with the last address's error).
async fn bind(listen: &str) -> Result<tokio::net::TcpListener> {
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .with_context(|| format!("--listen `{listen}` does not resolve to an address (expected HOST:PORT, e.g. 127.0.0.1:8787 or localhost:8787)"))?
        .collect();
    let mut last = None;
    for addr in &addrs {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some((addr, e)),
        }
    }
    match last {
        Some((addr, e)) => Err(e).with_context(|| format!("binding {addr} (--listen `{listen}`)")),
        None => bail!("--listen `{listen}` resolves to no address"),
    }
}

/// The operator console's flags of `idem serve` (SPEC §4 "Operator console").
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ConsoleArgs {
    /// Do not serve the operator console under `/console` (as
    /// `IDEM_CONSOLE=off`).
    #[arg(long)]
    no_console: bool,
    /// Whether the operator console is served under `/console`: `on` or `off`.
    #[arg(long = "console", env = "IDEM_CONSOLE", default_value = "on",
          value_parser = ["on", "off"])]
    console: String,
    /// How long a console session lasts after sign-in: seconds, or a number
    /// with `s`, `m` or `h` (`30m`, `8h`).
    #[arg(long, env = "IDEM_CONSOLE_SESSION_TTL", default_value = "8h",
          value_parser = parse_ttl)]
    console_session_ttl: Duration,
    /// Mark the console's session cookie `Secure` (sent over HTTPS only):
    /// set it when browsers reach idem over TLS, through a proxy that
    /// terminates it (`idem serve` itself speaks plain HTTP).
    #[arg(long, env = "IDEM_CONSOLE_SECURE_COOKIE")]
    console_secure_cookie: bool,
}

impl ConsoleArgs {
    /// The console's configuration, or `None` when it is turned off.
    pub(crate) fn config(&self) -> Option<idem_console::ConsoleConfig> {
        if self.no_console || self.console == "off" {
            return None;
        }
        Some(idem_console::ConsoleConfig {
            session_ttl: self.console_session_ttl,
            secure_cookie: self.console_secure_cookie,
            ..idem_console::ConsoleConfig::default()
        })
    }
}

/// A session length: whole seconds, or a whole number with the unit `s`,
/// `m` or `h`; from 1 minute to 30 days.
///
/// # Errors
/// A message naming the accepted forms.
fn parse_ttl(text: &str) -> std::result::Result<Duration, String> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, "s"),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: use seconds or e.g. 30m, 8h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        _ => {
            return Err(format!(
                "`{text}` is not a duration: use seconds or e.g. 30m, 8h"
            ));
        }
    };
    if !(60..=30 * 86_400).contains(&secs) {
        return Err(format!(
            "a console session lasts from 1 minute to 30 days, not `{text}`"
        ));
    }
    Ok(Duration::from_secs(secs))
}

/// How `serve` runs, from `idem serve`'s flags.
pub(crate) struct ServeArgs {
    pub(crate) listen: String,
    pub(crate) config: Option<PathBuf>,
    pub(crate) sweep_ms: u64,
    pub(crate) store_wait: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) header_timeout: Duration,
    pub(crate) body_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_connections: Option<u64>,
    /// `IDEM_REQUIRE_SYNC_STANDBY` (PostgreSQL only).
    pub(crate) require_sync_standby: bool,
    /// The operator console's configuration; `None`: not served.
    pub(crate) console: Option<idem_console::ConsoleConfig>,
}

/// Runs the server until SIGTERM or SIGINT, then stops gracefully: open
/// requests are answered, the sweeper stops, `telemetry` sends the spans it
/// still holds, and [`STOPPED`] is the last line logged.
///
/// # Errors
/// A configuration, store or listen address that does not work at start-up.
pub(crate) async fn serve(
    args: ServeArgs,
    store_args: StoreArgs,
    telemetry: Telemetry,
) -> Result<()> {
    let ServeArgs {
        listen,
        config,
        sweep_ms,
        store_wait,
        shutdown_grace,
        header_timeout,
        body_timeout,
        idle_timeout,
        max_connections,
        require_sync_standby,
        console,
    } = args;
    let config = load_config(config.as_ref())?;
    log_store_location(&store_args)?;
    if require_sync_standby && !crate::store::is_postgres(&store_args.store) {
        bail!("IDEM_REQUIRE_SYNC_STANDBY needs a PostgreSQL store (a SQLite store has no standby)");
    }
    let _serve_lock = lock_sqlite_for_serve(&store_args)?;
    let store = open_store_waiting(&store_args, store_wait).await?;
    let version = config.version();
    let sync_standby = if require_sync_standby {
        let watch = Arc::new(
            idem_store_postgres::SyncStandbyWatch::start(
                &store_args.store,
                idem_store_postgres::standby::SYNC_STANDBY_CHECK_EVERY,
            )
            .await
            .context("checking for a synchronous standby")?,
        );
        match watch.current().refusal() {
            None => tracing::info!(standby = ?watch.current(), "a synchronous standby is attached"),
            Some(why) => {
                tracing::warn!(%why, "submits are refused until a synchronous standby is attached")
            }
        }
        let gate: idem_http::SyncStandbyGate = Arc::new(move || watch.current().refusal());
        Some(gate)
    } else {
        None
    };
    // Before "listening" is printed: whoever starts us may signal from then on.
    let mut signals = ShutdownSignals::install()?;
    let listener = bind(&listen).await?;
    let pool = if store.kind() == "postgres" {
        store_args.pg_pool_size
    } else {
        0
    };
    let limits = idem_http::ServeLimits {
        header_timeout,
        body_timeout,
        idle_timeout,
        max_connections: max_connections.map_or_else(
            || idem_http::default_max_connections(pool),
            |n| usize::try_from(n).unwrap_or(usize::MAX),
        ),
    };
    let app = idem_server::App::build(
        store.clone(),
        config,
        idem_server::Options {
            listen: idem_server::Listen::Bound(listener),
            limits,
            sweep_interval: Duration::from_millis(sweep_ms),
            console,
            sync_standby,
            shutdown_grace,
        },
    )
    .await?;
    let addr = app.addr();
    tracing::info!(%addr, store = store.kind(), config_version = %version, "idem listening on http://{addr}");
    say(format_args!("idem listening on http://{addr}"))?;
    let (signalled, first_signal) = tokio::sync::oneshot::channel::<ShutdownSignals>();
    // After the first signal: a second one, or the grace period running out
    // (`Stopped::GraceOutlasted`), ends the process even if a request is
    // still open (a client that stopped sending half-way would otherwise
    // hold it for ever). Nothing is half-written either way: an unfinished
    // transaction rolls back.
    tokio::spawn(async move {
        let Ok(mut signals) = first_signal.await else {
            return;
        };
        signals.next().await;
        tracing::warn!("second signal: exiting without waiting for open requests");
        tracing::warn!("{STOPPED_CUT}");
        std::process::exit(1);
    });
    let stopped = app
        .run(async move {
            signals.next().await;
            let _ = signalled.send(signals);
        })
        .await?;
    if stopped == idem_server::Stopped::GraceOutlasted {
        tracing::warn!(
            grace_ms = shutdown_grace.as_millis() as u64,
            "open requests outlasted the shutdown grace period: exiting"
        );
        tracing::warn!("{STOPPED_CUT}");
        std::process::exit(1);
    }
    telemetry.shutdown().await;
    tracing::info!("{STOPPED}");
    Ok(())
}

/// The last line `serve` logs after a graceful shutdown (info).
const STOPPED: &str = "idem stopped";

/// The last line `serve` logs when a second signal or the grace period ends
/// it with open requests (warn; exit status 1).
const STOPPED_CUT: &str = "idem stopped with requests still open (exit status 1)";
