//! The announcer: tells the other instances over the database what this
//! instance committed, after the commit and outside every data transaction
//! ([`idem_store::changes`]).
//!
//! A `NOTIFY` inside a data transaction makes PostgreSQL take one
//! database-wide lock at its commit, held until the commit record is flushed:
//! every notifying commit then waits for every other one (see the comment on
//! `PreCommit_Notify` in PostgreSQL's `src/backend/commands/async.c`). Here
//! the data transactions notify nothing (their sessions start with
//! `idem.notify = off`, migration 14); each transaction that wrote events
//! hands them to [`Announcer::committed`] once its `COMMIT` succeeded, which
//! publishes them in this process at once and queues them. One task per store
//! gathers what is queued into a batch until no change has been queued for
//! [`ANNOUNCE_QUIET`], or [`ANNOUNCE_WITHIN`] after the first change of the
//! batch, whichever comes first, and sends it as ONE statement on a
//! connection of its own ([`ANNOUNCE_SQL`]: one notification
//! per change, in the payload form of the trigger, so binaries of the
//! previous version read them; one [`RESYNC_PAYLOAD`] instead when more than
//! [`ANNOUNCE_MAX`] changes are queued or one payload would exceed
//! [`PAYLOAD_MAX`]). So one instance takes the notification lock at most
//! once per [`ANNOUNCE_QUIET`], and under a steady stream of commits once
//! per [`ANNOUNCE_WITHIN`], however many transactions it commits; and what
//! one commit sets off on this instance shortly after it (the lease of the
//! waiter it woke, that attempt's report) goes out with it: each
//! announcement costs the database one transaction of its own and one in
//! every listening session (PostgreSQL reads the notification queue in a
//! transaction), so a task submitted, claimed and reported with less than
//! [`ANNOUNCE_QUIET`] between one commit and the next costs one
//! announcement, not three.
//!
//! With `idem.notify=off` in the URL's options (a switch for benchmarks) the
//! store publishes its changes in this process only and announces nothing:
//! waiters on other instances then rely on their bounded re-check only.
//!
//! The listening connection of the same store skips notifications sent by
//! the announcer's session (its backend process id, [`OwnSession`]): those
//! changes were published here already.
//!
//! What is lost: the changes queued when the process stops, or when sending
//! fails twice in a row (the connection broke and a new one failed too).
//! Nobody is told; every waiter reads the store again on its own bounded
//! interval, as for any lost notification. [`Announcer::flushed`] waits until
//! what was queued before it has been sent (or given up), for a process that
//! exits right after writing (the CLI).

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

#[cfg(doc)]
use idem_store::changes::CHANNEL;
use idem_store::changes::{Change, Publisher, RESYNC_PAYLOAD};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres_rustls::MakeRustlsConnect;

/// How long the announcer waits for another change before it sends what it
/// gathered: a batch is announced once no change has been queued for this
/// long (or at [`ANNOUNCE_WITHIN`]). Each announcement is one short
/// transaction that takes the notification lock once (it writes no data, and
/// its session commits with `synchronous_commit = off`: a hint needs no
/// flush), and wakes every listening session (one more transaction each).
/// A lone change is heard on the other instances this much after its commit;
/// a local claim that commits within this of the submit it was woken by, and
/// a report within this of the claim, ride in the submit's announcement
/// (`REMOTE_DEFER` of idem-http counts on that). [`Announcer::flushed`] cuts
/// the wait short.
pub const ANNOUNCE_QUIET: Duration = Duration::from_millis(20);

/// The longest a change waits in a batch: a batch is announced at the latest
/// this long after its first change was queued, however steady the stream of
/// commits. So also the most an instance delays what it tells the others
/// (with `REMOTE_DEFER` of idem-http, 50 ms, the longest a task waits for a
/// claim when only other instances have waiters: 100 ms, plus the claim;
/// well within the 250 ms p99 of a held `Prefer: wait`, SPEC §4), and the
/// least time between two announcements of one instance under load: at most
/// 20 a second.
pub const ANNOUNCE_WITHIN: Duration = Duration::from_millis(50);

/// Most changes one announcement names: as many as a subscriber may fall
/// behind by before it is told to resync anyway
/// ([`idem_store::changes::BACKLOG`]). More queued at once are announced as
/// one [`RESYNC_PAYLOAD`].
pub const ANNOUNCE_MAX: usize = idem_store::changes::BACKLOG;

/// Longest payload one notification carries, bytes: PostgreSQL refuses
/// 8000 and more (`NOTIFY`, "payload string too long").
pub const PAYLOAD_MAX: usize = 7999;

/// How long sending one announcement (connecting included) may take before
/// its connection counts as lost.
pub const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(3);

/// The announcement: one notification on [`CHANNEL`] per payload of `$1`
/// (identical payloads in one transaction are delivered once).
pub const ANNOUNCE_SQL: &str = "SELECT pg_notify('idem_changes', p) FROM unnest($1::text[]) AS p";

/// The backend process id of the announcer's session (0: none), shared with
/// the listening connection, which skips what that session sent.
#[derive(Debug, Clone, Default)]
pub(crate) struct OwnSession {
    pid: Arc<AtomicI32>,
    /// No announcer: the `events` trigger notifies from every data session,
    /// this store's included, and this store's changes are heard only on
    /// the listening connection, among the others' (none can be told apart,
    /// so each counts as this instance's: [`idem_store::Change::remote`]
    /// false).
    pub(crate) trigger: bool,
}

impl OwnSession {
    /// For a store whose sessions leave the `events` trigger on.
    pub(crate) fn trigger() -> OwnSession {
        OwnSession {
            pid: Arc::default(),
            trigger: true,
        }
    }

    /// Whether a notification from backend process `pid` was this store's.
    pub(crate) fn sent(&self, pid: i32) -> bool {
        pid != 0 && self.pid.load(Ordering::SeqCst) == pid
    }

    fn set(&self, pid: i32) {
        self.pid.store(pid, Ordering::SeqCst);
    }
}

enum Queued {
    /// The events of one committed transaction.
    Changes(Vec<Change>),
    /// Answered once everything queued before it has been sent or given up.
    Flush(oneshot::Sender<()>),
}

/// Publishes committed changes in this process and queues them for the other
/// instances (see the module doc). The task ends, after sending what is
/// queued, once every clone is dropped.
#[derive(Debug, Clone)]
pub(crate) struct Announcer {
    /// `None`: the `events` trigger notifies instead (`idem.notify=on` in
    /// the URL's options), and the listening connection hears every change,
    /// this store's included.
    publisher: Option<Publisher>,
    /// `None`: nothing is announced (the trigger notifies, or
    /// `idem.notify=off` in the URL's options turned notifications off).
    queue: Option<mpsc::UnboundedSender<Queued>>,
}

/// Who tells the other instances what one instance committed: the store
/// URL's `idem.notify` option (`-c idem.notify=…` in `options`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Notifications {
    /// Absent: the announcer, after commit (this module).
    Announced,
    /// `idem.notify=on`: the `events` trigger inside every data
    /// transaction, as binaries before migration 14 did; the store
    /// announces nothing itself. A fallback, and the comparison point of
    /// docs/benchmarks.md: each notifying commit takes PostgreSQL's
    /// notification lock.
    Trigger,
    /// `idem.notify=off`: none. For benchmarks (the figure without any
    /// notification cost): this store's changes are published in its own
    /// process only, and waiters on other instances rely on their bounded
    /// re-check only.
    Off,
}

impl Announcer {
    /// An announcer whose task sends on connections made with `cfg` and
    /// `tls`; `own` learns each session's process id.
    pub(crate) fn start(
        cfg: tokio_postgres::Config,
        tls: MakeRustlsConnect,
        publisher: Publisher,
        own: OwnSession,
    ) -> Announcer {
        let (queue, queued) = mpsc::unbounded_channel();
        tokio::spawn(announce(cfg, tls, queued, own));
        Announcer {
            publisher: Some(publisher),
            queue: Some(queue),
        }
    }

    /// An announcer that does nothing: the trigger notifies.
    pub(crate) fn trigger() -> Announcer {
        Announcer {
            publisher: None,
            queue: None,
        }
    }

    /// An announcer that publishes in this process and announces nothing
    /// ([`Notifications::Off`]).
    pub(crate) fn silent(publisher: Publisher) -> Announcer {
        Announcer {
            publisher: Some(publisher),
            queue: None,
        }
    }

    /// The events of a transaction that committed: published here, queued
    /// for the others.
    pub(crate) fn committed(&self, changes: Vec<Change>) {
        let Some(publisher) = &self.publisher else {
            return;
        };
        if changes.is_empty() {
            return;
        }
        for change in &changes {
            publisher.publish(change.clone());
        }
        if let Some(queue) = &self.queue {
            let _ = queue.send(Queued::Changes(changes));
        }
    }

    /// Resolves once every change queued before the call has been announced,
    /// or given up (see the module doc).
    pub(crate) async fn flushed(&self) {
        let Some(queue) = &self.queue else { return };
        let (done, answered) = oneshot::channel();
        if queue.send(Queued::Flush(done)).is_ok() {
            let _ = answered.await;
        }
    }
}

/// The announcing connection and its driver.
struct Session {
    client: tokio_postgres::Client,
    statement: tokio_postgres::Statement,
}

async fn announce(
    cfg: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    mut queued: mpsc::UnboundedReceiver<Queued>,
    own: OwnSession,
) {
    let mut session: Option<Session> = None;
    while let Some(first) = queued.recv().await {
        let mut changes = Vec::new();
        let mut flushes = Vec::new();
        let take = |q: Queued, changes: &mut Vec<Change>, flushes: &mut Vec<_>| match q {
            Queued::Changes(c) => changes.extend(c),
            Queued::Flush(done) => flushes.push(done),
        };
        let first_at = Instant::now();
        let mut last_at = first_at;
        take(first, &mut changes, &mut flushes);
        // The batch gathers until `send_at`, unless a flush asks for it (or
        // the store is gone).
        loop {
            let before = changes.len();
            while let Ok(q) = queued.try_recv() {
                take(q, &mut changes, &mut flushes);
            }
            if changes.len() > before {
                last_at = Instant::now();
            }
            if !flushes.is_empty() || changes.is_empty() {
                break;
            }
            tokio::select! {
                q = queued.recv() => match q {
                    Some(q) => {
                        if matches!(q, Queued::Changes(_)) {
                            last_at = Instant::now();
                        }
                        take(q, &mut changes, &mut flushes);
                    }
                    None => break,
                },
                () = tokio::time::sleep_until(send_at(first_at, last_at)) => break,
            }
        }
        if !changes.is_empty() {
            let payloads = payloads(&changes);
            if let Err(cause) = send(&cfg, &tls, &mut session, &own, &payloads).await {
                tracing::warn!(%cause, changes = changes.len(),
                    "change notifications: an announcement was not sent; waiters on other instances re-check the store on their own");
            }
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

/// When a batch whose first change was queued at `first` and its latest at
/// `last` is announced: [`ANNOUNCE_QUIET`] after the latest, at most
/// [`ANNOUNCE_WITHIN`] after the first.
fn send_at(first: Instant, last: Instant) -> Instant {
    (last + ANNOUNCE_QUIET).min(first + ANNOUNCE_WITHIN)
}

/// The payloads announcing `changes`: one per change, or one
/// [`RESYNC_PAYLOAD`] for too many or too long.
fn payloads(changes: &[Change]) -> Vec<String> {
    if changes.len() > ANNOUNCE_MAX {
        return vec![RESYNC_PAYLOAD.to_owned()];
    }
    let named: Vec<String> = changes.iter().map(Change::to_payload).collect();
    if named.iter().any(|p| p.len() > PAYLOAD_MAX) {
        return vec![RESYNC_PAYLOAD.to_owned()];
    }
    named
}

/// Sends one announcement on the held session, or on a new one when there is
/// none or the held one failed.
async fn send(
    cfg: &tokio_postgres::Config,
    tls: &MakeRustlsConnect,
    session: &mut Option<Session>,
    own: &OwnSession,
    payloads: &[String],
) -> Result<(), String> {
    if let Some(held) = session.as_ref() {
        match tokio::time::timeout(
            ANNOUNCE_TIMEOUT,
            held.client.execute(&held.statement, &[&payloads]),
        )
        .await
        {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => tracing::debug!(error = %e, "announcing connection failed; reconnecting"),
            Err(_) => tracing::debug!("announcing connection silent; reconnecting"),
        }
        own.set(0);
        *session = None;
    }
    let sent = tokio::time::timeout(ANNOUNCE_TIMEOUT, async {
        let fresh = open(cfg, tls, own).await?;
        fresh
            .client
            .execute(&fresh.statement, &[&payloads])
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(fresh)
    })
    .await;
    match sent {
        Ok(Ok(fresh)) => {
            *session = Some(fresh);
            Ok(())
        }
        Ok(Err(cause)) => {
            own.set(0);
            Err(cause)
        }
        Err(_) => {
            own.set(0);
            Err(format!(
                "no answer within {} ms",
                ANNOUNCE_TIMEOUT.as_millis()
            ))
        }
    }
}

/// A new announcing session: connected, `synchronous_commit` off, its
/// process id told to `own` before it sends anything.
async fn open(
    cfg: &tokio_postgres::Config,
    tls: &MakeRustlsConnect,
    own: &OwnSession,
) -> Result<Session, String> {
    let (client, connection) = cfg.connect(tls.clone()).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "announcing connection closed");
        }
    });
    client
        .batch_execute("SET synchronous_commit = off")
        .await
        .map_err(|e| e.to_string())?;
    let row = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| e.to_string())?;
    let pid: i32 = row.try_get(0).map_err(|e| e.to_string())?;
    own.set(pid);
    let statement = client
        .prepare(ANNOUNCE_SQL)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Session { client, statement })
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::model::EventKind;

    fn change(tenant: &str) -> Change {
        Change {
            tenant: tenant.into(),
            operation: "payout".into(),
            task_id: uuid::Uuid::nil(),
            kind: EventKind::TaskSubmitted,
            due_in_ms: None,
            remote: false,
        }
    }

    #[test]
    fn the_announcement_goes_to_the_channel_the_instances_listen_on() {
        assert!(ANNOUNCE_SQL.contains(&format!("'{}'", idem_store::changes::CHANNEL)));
    }

    #[test]
    fn a_batch_goes_once_quiet_or_at_its_cap() {
        let first = Instant::now();
        let ms = Duration::from_millis;
        // A lone change, and one that followed within the quiet time.
        assert_eq!(send_at(first, first), first + ANNOUNCE_QUIET);
        assert_eq!(
            send_at(first, first + ms(12)),
            first + ms(12) + ANNOUNCE_QUIET
        );
        // A steady stream: at the cap.
        assert_eq!(
            send_at(first, first + ANNOUNCE_WITHIN - ms(5)),
            first + ANNOUNCE_WITHIN
        );
    }

    #[test]
    fn each_change_is_named_unless_too_many_or_too_long() {
        let named = payloads(&[change("a"), change("b")]);
        assert_eq!(named.len(), 2);
        assert_eq!(
            Change::from_payload(&named[1]).map(|c| c.tenant),
            Some("b".into())
        );
        let many = vec![change("a"); ANNOUNCE_MAX + 1];
        assert_eq!(payloads(&many), [RESYNC_PAYLOAD]);
        assert_eq!(payloads(&many[..ANNOUNCE_MAX]).len(), ANNOUNCE_MAX);
        let long = change(&"t".repeat(PAYLOAD_MAX));
        assert_eq!(payloads(&[change("a"), long]), [RESYNC_PAYLOAD]);
    }
}
