//! The listening connection: one session per instance that runs `LISTEN
//! idem_changes` and republishes each change the other instances announce
//! (`announce.rs`; the `events` trigger of migration 9 for binaries that keep
//! it on) into the store's [`Changes`] ([`idem_store::changes`]). It skips
//! what this store's own announcer sent ([`OwnSession`]: published here at
//! commit already), and a [`RESYNC_PAYLOAD`] tells every subscriber to read
//! again.
//!
//! It is opened on the first subscription (or [`Changes::start`]), outside
//! the pool (a pooled connection is reset and shared; this one stays in
//! `LISTEN`), and ends with the store. When it breaks, every subscriber is
//! told to resync once it listens again (what committed in between was not
//! heard), and it reconnects with a backoff of [`RECONNECT_MIN`] doubling to
//! [`RECONNECT_MAX`].
//!
//! A listening connection only receives, so a link that goes silent (a
//! dropped route, a frozen middlebox: no FIN, no RST) would look like a quiet
//! database for ever. Two checks end it:
//! - a round trip: every [`PING_EVERY`] the session sends [`PING_SQL`] on
//!   that connection; no answer within [`PING_TIMEOUT`] (or an error) ends
//!   the session as lost;
//! - TCP keepalive ([`KEEPALIVE_IDLE`], [`KEEPALIVE_INTERVAL`],
//!   [`KEEPALIVE_RETRIES`]), for a peer that is gone at the TCP level.
//!
//! The bound ([`SILENT_REPLACED_WITHIN`], 10 s): a silent listening
//! connection is given up at most [`PING_EVERY`] + [`PING_TIMEOUT`] (8 s)
//! after the link went silent, and a new one listens after the reconnect
//! backoff ([`RECONNECT_MIN`] for a first loss) and the connect, when a new
//! connection can reach the database. Meanwhile
//! waiters re-check the store on their own bounded interval (claims:
//! `CLAIM_RECHECK` of idem-http), and all of them re-check when the new
//! connection listens ([`idem_store::Notice::Resync`]).

use std::time::Duration;

use idem_store::changes::{CHANNEL, Change, Changes, Publisher, RESYNC_PAYLOAD};
use tokio::sync::watch;
use tokio_postgres::AsyncMessage;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::announce::OwnSession;

/// First wait before reconnecting a broken listening connection.
pub const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to reconnect it.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// How long a listening connection must have lasted for its loss to start
/// the reconnect backoff from [`RECONNECT_MIN`] again (a connection that
/// keeps breaking right after it listens backs off to [`RECONNECT_MAX`]).
pub const STABLE_AFTER: Duration = Duration::from_secs(10);
/// TCP keepalive idle time of the listening connection: with
/// [`KEEPALIVE_INTERVAL`] and [`KEEPALIVE_RETRIES`], a peer gone at the TCP
/// level is noticed within 30 + 3 × 5 = 45 s even if the round trip
/// ([`PING_EVERY`]) could not tell (the kernel gives up on the socket).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Time between two unanswered TCP keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered TCP keepalive probes after which the kernel drops the socket.
pub const KEEPALIVE_RETRIES: u32 = 3;
/// How often the listening session makes a round trip ([`PING_SQL`]) on its
/// connection. A silent link is noticed by TCP only where the far end is
/// gone; a middlebox that accepts bytes and forwards none is noticed only by
/// a query that gets no answer.
pub const PING_EVERY: Duration = Duration::from_secs(5);
/// How long the round trip may take before the connection counts as lost
/// (the query is trivial; a healthy but busy server answers it in
/// milliseconds, and a reconnect costs little: one connection and a resync).
pub const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// The bound on replacing a listening connection whose link went silent,
/// while a new connection can reach the database and the loss is the first
/// in a row: [`PING_EVERY`] + [`PING_TIMEOUT`] to notice, [`RECONNECT_MIN`]
/// of backoff, and up to 1.9 s to connect and listen again. A loss right
/// after another adds that one's backoff (at most [`RECONNECT_MAX`]).
pub const SILENT_REPLACED_WITHIN: Duration = Duration::from_secs(10);
/// The round trip's statement; its text names it in `pg_stat_activity`.
pub const PING_SQL: &str = "SELECT 1 /* idem listening connection */";

/// The store's changes and the signal that ends its listener: the listener
/// stops when this is dropped with the last clone of the backend.
#[derive(Debug)]
pub(crate) struct Listening {
    pub(crate) changes: Changes,
    _stop: watch::Sender<()>,
}

impl Listening {
    /// Changes whose listener connects with `cfg` and `tls` once started and
    /// skips what the session `own` names sent.
    pub(crate) fn new(
        mut cfg: tokio_postgres::Config,
        tls: MakeRustlsConnect,
        own: OwnSession,
    ) -> Listening {
        let (stop, stopped) = watch::channel(());
        cfg.keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(KEEPALIVE_INTERVAL)
            .keepalives_retries(KEEPALIVE_RETRIES);
        let changes = Changes::with_starter(move |publisher| {
            tokio::spawn(listen(cfg, tls, publisher, own, stopped));
        });
        Listening {
            changes,
            _stop: stop,
        }
    }
}

/// How a listening session ended.
enum Ended {
    /// The store was dropped.
    Stopped,
    /// The connection failed or closed, after listening for this long
    /// (`None`: it never listened).
    Lost(String, Option<Duration>),
}

async fn listen(
    cfg: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    publisher: Publisher,
    own: OwnSession,
    mut stopped: watch::Receiver<()>,
) {
    let mut backoff = RECONNECT_MIN;
    let mut lost = false;
    loop {
        match session(&cfg, &tls, &publisher, &own, &mut stopped, lost).await {
            Ended::Stopped => return,
            Ended::Lost(cause, lasted) => {
                if lasted.is_some_and(|d| d >= STABLE_AFTER) {
                    backoff = RECONNECT_MIN;
                }
                lost = true;
                publisher.deaf();
                tracing::warn!(%cause, retry_in_ms = backoff.as_millis() as u64,
                    "change notifications: the listening connection is lost; waiters re-check the store until it is back");
            }
        }
        tokio::select! {
            _ = stopped.changed() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(RECONNECT_MAX);
    }
}

/// One listening connection, from connect to its end; `lost`: an earlier
/// one was lost (its return is logged).
async fn session(
    cfg: &tokio_postgres::Config,
    tls: &MakeRustlsConnect,
    publisher: &Publisher,
    own: &OwnSession,
    stopped: &mut watch::Receiver<()>,
    lost: bool,
) -> Ended {
    let connect = cfg.connect(tls.clone());
    let (client, mut connection) = tokio::select! {
        _ = stopped.changed() => return Ended::Stopped,
        c = connect => match c {
            Ok(c) => c,
            Err(e) => return Ended::Lost(e.to_string(), None),
        },
    };
    let statement = format!("LISTEN {CHANNEL}");
    let listen = client.batch_execute(&statement);
    tokio::pin!(listen);
    // The connection must be driven for `LISTEN` to complete.
    loop {
        tokio::select! {
            _ = stopped.changed() => return Ended::Stopped,
            done = &mut listen => match done {
                Ok(()) => break,
                Err(e) => return Ended::Lost(e.to_string(), None),
            },
            m = std::future::poll_fn(|cx| connection.poll_message(cx)) => {
                if let Some(cause) = handle(m, publisher, own) {
                    return Ended::Lost(cause, None);
                }
            }
        }
    }
    // What committed while nobody listened was not heard.
    publisher.resync();
    if lost {
        tracing::info!("change notifications: listening again; waiters re-checked the store");
    }
    let since = tokio::time::Instant::now();
    let mut ping_at = tokio::time::interval_at(since + PING_EVERY, PING_EVERY);
    ping_at.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The round trip in flight, bounded by `PING_TIMEOUT`; it completes only
    // while the connection is driven, below.
    let mut ping = None;
    loop {
        tokio::select! {
            _ = stopped.changed() => return Ended::Stopped,
            m = std::future::poll_fn(|cx| connection.poll_message(cx)) => {
                if let Some(cause) = handle(m, publisher, own) {
                    return Ended::Lost(cause, Some(since.elapsed()));
                }
            }
            _ = ping_at.tick(), if ping.is_none() => {
                ping = Some(Box::pin(tokio::time::timeout(
                    PING_TIMEOUT,
                    client.simple_query(PING_SQL),
                )));
            }
            answered = async {
                match ping.as_mut() {
                    Some(in_flight) => in_flight.await,
                    None => std::future::pending().await,
                }
            } => {
                ping = None;
                let cause = match answered {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => format!("the round trip failed: {e}"),
                    Err(_) => format!(
                        "no answer to a round trip within {} ms (the link went silent)",
                        PING_TIMEOUT.as_millis()
                    ),
                };
                return Ended::Lost(cause, Some(since.elapsed()));
            }
        }
    }
}

/// Publishes a notification (unless this store's announcer sent it);
/// `Some(cause)` when the connection ended.
fn handle(
    message: Option<Result<AsyncMessage, tokio_postgres::Error>>,
    publisher: &Publisher,
    own: &OwnSession,
) -> Option<String> {
    match message {
        Some(Ok(AsyncMessage::Notification(n))) => {
            if own.sent(n.process_id()) {
                return None;
            }
            if n.payload() == RESYNC_PAYLOAD {
                publisher.resync();
                return None;
            }
            match Change::from_payload(n.payload()) {
                Some(mut change) => {
                    change.remote = !own.trigger;
                    publisher.publish(change);
                }
                None => tracing::warn!(
                    payload = n.payload(),
                    "change notifications: a payload this binary cannot read (is the schema newer?); waiters re-check the store on their own"
                ),
            }
            None
        }
        Some(Ok(_)) => None,
        Some(Err(e)) => Some(e.to_string()),
        None => Some("the server closed the connection".into()),
    }
}
