//! The listening connection: one session per instance that runs `LISTEN
//! idem_changes` and republishes each notification the `events` trigger sends
//! (migration 8) into the store's [`Changes`] ([`idem_store::changes`]).
//!
//! It is opened on the first subscription (or [`Changes::start`]), outside
//! the pool (a pooled connection is reset and shared; this one stays in
//! `LISTEN`), and ends with the store. When it breaks, every subscriber is
//! told to resync once it listens again (what committed in between was not
//! heard), and it reconnects with a backoff of [`RECONNECT_MIN`] doubling to
//! [`RECONNECT_MAX`].

use std::time::Duration;

use idem_store::changes::{CHANNEL, Change, Changes, Publisher};
use tokio::sync::watch;
use tokio_postgres::AsyncMessage;
use tokio_postgres_rustls::MakeRustlsConnect;

/// First wait before reconnecting a broken listening connection.
pub const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to reconnect it.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// How long a listening connection must have lasted for its loss to start
/// the reconnect backoff from [`RECONNECT_MIN`] again (a connection that
/// keeps breaking right after it listens backs off to [`RECONNECT_MAX`]).
pub const STABLE_AFTER: Duration = Duration::from_secs(10);
/// TCP keepalive idle time of the listening connection: a link that went
/// silent is noticed (and the subscribers resynced) within about this long
/// plus the kernel's probes.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// The store's changes and the signal that ends its listener: the listener
/// stops when this is dropped with the last clone of the backend.
#[derive(Debug)]
pub(crate) struct Listening {
    pub(crate) changes: Changes,
    _stop: watch::Sender<()>,
}

impl Listening {
    /// Changes whose listener connects with `cfg` and `tls` once started.
    pub(crate) fn new(mut cfg: tokio_postgres::Config, tls: MakeRustlsConnect) -> Listening {
        let (stop, stopped) = watch::channel(());
        cfg.keepalives(true).keepalives_idle(KEEPALIVE_IDLE);
        let changes = Changes::with_starter(move |publisher| {
            tokio::spawn(listen(cfg, tls, publisher, stopped));
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
    mut stopped: watch::Receiver<()>,
) {
    let mut backoff = RECONNECT_MIN;
    let mut lost = false;
    loop {
        match session(&cfg, &tls, &publisher, &mut stopped, lost).await {
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
                if let Some(cause) = handle(m, publisher) {
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
    loop {
        tokio::select! {
            _ = stopped.changed() => return Ended::Stopped,
            m = std::future::poll_fn(|cx| connection.poll_message(cx)) => {
                if let Some(cause) = handle(m, publisher) {
                    return Ended::Lost(cause, Some(since.elapsed()));
                }
            }
        }
    }
}

/// Publishes a notification; `Some(cause)` when the connection ended.
fn handle(
    message: Option<Result<AsyncMessage, tokio_postgres::Error>>,
    publisher: &Publisher,
) -> Option<String> {
    match message {
        Some(Ok(AsyncMessage::Notification(n))) => {
            match Change::from_payload(n.payload()) {
                Some(change) => publisher.publish(change),
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
