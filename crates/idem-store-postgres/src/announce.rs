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
//! gathers what is queued into a batch and sends it as ONE statement on a
//! connection of its own ([`ANNOUNCE_SQL`]: one notification per change, in
//! the payload form of the trigger, so binaries of the previous version read
//! them; one [`RESYNC_PAYLOAD`] instead when more than [`ANNOUNCE_MAX`]
//! changes are queued or one payload would exceed [`PAYLOAD_MAX`]). Each
//! announcement costs the database one transaction of its own and one in
//! every listening session (PostgreSQL reads the notification queue in a
//! transaction), so a batch is sent:
//!
//! - once no change has been queued for [`ANNOUNCE_QUIET`] (a lone change,
//!   and what it set off on this instance shortly after it: the lease of
//!   the waiter it woke, that attempt's report, go out in one announcement);
//! - under a steady stream of commits, [`ANNOUNCE_WITHIN`] after its first
//!   change when one of its changes that may make a task claimable was not
//!   taken here (leased or ended by a later change of the batch) within
//!   [`TAKEN_WITHIN`]: the other instances' waiters may have to claim it;
//! - else [`ANNOUNCE_TAKEN_WITHIN`] after its first change: this instance's
//!   waiters keep up with the stream, and the others have nothing to claim.
//!
//! A batch that is due while one of its claimable changes is younger than
//! [`TAKEN_WITHIN`] and none older waits for this instance's claims to take
//! them, until the youngest is that old, so that each lease goes out with
//! its change and no other instance's waiter runs a claim query for a task
//! taken here. Claimable changes queued during that wait go to the next
//! batch (with every later change of their tasks). So one instance takes the
//! notification lock at most once per [`ANNOUNCE_QUIET`], and under a
//! steady stream once per [`ANNOUNCE_WITHIN`] or [`ANNOUNCE_TAKEN_WITHIN`],
//! however many transactions it commits.
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

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use idem_core::model::EventKind;
#[cfg(doc)]
use idem_store::changes::CHANNEL;
use idem_store::changes::{Change, Publisher, RESYNC_PAYLOAD};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres_rustls::MakeRustlsConnect;
use uuid::Uuid;

/// How long the announcer waits for another change before it sends what it
/// gathered: a batch is announced once no change has been queued for this
/// long (or at [`ANNOUNCE_WITHIN`]). Each announcement is one short
/// transaction that takes the notification lock once (it writes no data, and
/// its session commits with `synchronous_commit = off`: a hint needs no
/// flush), and wakes every listening session (one more transaction each).
/// A lone change is heard on the other instances this much after its commit;
/// a local claim that commits within this of the submit it was woken by, and
/// a report within this of the claim, ride in the submit's announcement
/// (`REMOTE_DEFER` of idem-http counts on that; a claim up to
/// [`TAKEN_WITHIN`] after the submit rides too). [`Announcer::flushed`] cuts
/// the wait short.
pub const ANNOUNCE_QUIET: Duration = Duration::from_millis(20);

/// How long after its first change a batch is announced at the latest when
/// one of its changes that may make a task claimable was not taken here
/// (its task leased or ended by a later change of the batch) within
/// [`TAKEN_WITHIN`]: another instance's waiter may have to claim that task.
/// So also the most an instance delays such a change under a steady stream
/// (with `REMOTE_DEFER` of idem-http, 50 ms, the longest a task waits for a
/// claim when only other instances have waiters: 100 ms, plus the claim;
/// well within the 250 ms p99 of a held `Prefer: wait`, SPEC §4), and the
/// least time between two such announcements of one instance: at most 20 a
/// second.
pub const ANNOUNCE_WITHIN: Duration = Duration::from_millis(50);

/// How long after its first change a batch is announced at the latest when
/// every change of it that may make a task claimable was taken here: its
/// waiters took their tasks, so the other instances' waiters have nothing to
/// claim, and what the others are told (a held `Prefer: wait`, an event
/// stream, a lease that ends a deferred wake-up) may come later without
/// costing a claim query. Under a steady stream of tasks its own waiters
/// keep up with, an instance announces at most about 7 times a second (each
/// announcement costs a transaction in every listening session); a held
/// `Prefer: wait` on another instance hears a report at most this long (plus
/// [`TAKEN_WITHIN`]) after it, within SPEC §4's 250 ms p99.
pub const ANNOUNCE_TAKEN_WITHIN: Duration = Duration::from_millis(150);

/// How long a batch that is due waits for this instance's claims to take
/// its claimable changes (at most this long after the youngest was queued),
/// so that each lease goes out with its change and no other instance runs
/// a claim query for the task ([`ANNOUNCE_WITHIN`]). A local claim woken by
/// a change commits a few ms after it; one that did not within this time
/// may not come (no waiter of this instance was free), and the others hear
/// the change.
pub const TAKEN_WITHIN: Duration = Duration::from_millis(30);

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
    queued: mpsc::UnboundedReceiver<Queued>,
    own: OwnSession,
) {
    let mut session: Option<Session> = None;
    let mut gatherer = Gatherer::new(queued);
    while let Some((changes, flushes)) = gatherer.next().await {
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

/// Gathers what is queued into batches (see the module doc).
struct Gatherer {
    queued: mpsc::UnboundedReceiver<Queued>,
    /// Transactions held back from the batch sent last
    /// ([`holds_back`]): the next batch starts with them.
    carried: VecDeque<(Instant, Vec<Change>)>,
    /// Every sender is gone.
    closed: bool,
}

impl Gatherer {
    fn new(queued: mpsc::UnboundedReceiver<Queued>) -> Gatherer {
        Gatherer {
            queued,
            carried: VecDeque::new(),
            closed: false,
        }
    }

    /// The next batch to send, once it is due, and the flushes answered
    /// once it was sent; `None` when every sender is gone and all was
    /// sent.
    async fn next(&mut self) -> Option<(Vec<Change>, Vec<oneshot::Sender<()>>)> {
        let mut batch = Batch::default();
        let mut flushes = Vec::new();
        let take = |q: Queued, batch: &mut Batch, flushes: &mut Vec<_>| match q {
            Queued::Changes(c) => batch.add(c, Instant::now()),
            Queued::Flush(done) => flushes.push(done),
        };
        if self.carried.is_empty() {
            if self.closed {
                return None;
            }
            take(self.queued.recv().await?, &mut batch, &mut flushes);
        }
        for (at, changes) in self.carried.drain(..) {
            batch.add(changes, at);
        }
        // The batch gathers until it is due, unless a flush asks for it (or
        // the store is gone).
        while !self.closed {
            while let Ok(q) = self.queued.try_recv() {
                take(q, &mut batch, &mut flushes);
            }
            if !flushes.is_empty() || batch.changes.is_empty() {
                break;
            }
            tokio::select! {
                q = self.queued.recv() => match q {
                    Some(q) => take(q, &mut batch, &mut flushes),
                    None => self.closed = true,
                },
                () = tokio::time::sleep_until(batch.send_at()) => break,
            }
        }
        // Due: held while this instance's claims may still take its
        // claimable changes ([`Batch::hold_until`]). What is queued meanwhile
        // joins it, but for what [`holds_back`] keeps for the next.
        while flushes.is_empty() && !self.closed {
            let Some(until) = batch.hold_until(Instant::now()) else {
                break;
            };
            tokio::select! {
                q = self.queued.recv() => match q {
                    Some(Queued::Changes(c)) => {
                        if holds_back(&c, &self.carried) {
                            self.carried.push_back((Instant::now(), c));
                        } else {
                            batch.add(c, Instant::now());
                        }
                    }
                    Some(Queued::Flush(done)) => flushes.push(done),
                    None => self.closed = true,
                },
                () = tokio::time::sleep_until(until) => break,
            }
        }
        // A flush answers for everything queued before it; so does the end.
        if !flushes.is_empty() || self.closed {
            for (at, changes) in self.carried.drain(..) {
                batch.add(changes, at);
            }
        }
        Some((batch.changes, flushes))
    }
}

/// A batch being gathered (see the module doc).
#[derive(Debug, Default)]
struct Batch {
    changes: Vec<Change>,
    /// When its first and its latest transaction were queued (`None`: empty).
    first: Option<Instant>,
    last: Option<Instant>,
    /// Its changes that may make a task claimable
    /// ([`EventKind::may_make_claimable`]) and were not *taken here*: no
    /// later change of the batch leased or ended their task. The task, and
    /// when the change was queued, oldest first. A change with a backoff
    /// ([`Change::due_in_ms`]) is not taken in its batch.
    untaken: Vec<(Uuid, Instant)>,
}

impl Batch {
    /// Adds the changes of one transaction, queued at `at`: no earlier than
    /// any added before (the gatherer adds in the order it dequeued, held
    /// back transactions first).
    fn add(&mut self, changes: Vec<Change>, at: Instant) {
        if changes.is_empty() {
            return;
        }
        for c in &changes {
            if c.kind == EventKind::AttemptLeased || c.kind.ends_task() {
                self.untaken.retain(|(task, _)| *task != c.task_id);
            } else if c.kind.may_make_claimable() {
                self.untaken.push((c.task_id, at));
            }
        }
        self.first.get_or_insert(at);
        self.last = Some(at);
        self.changes.extend(changes);
    }

    /// When the batch is due: [`ANNOUNCE_QUIET`] after its latest change;
    /// [`ANNOUNCE_WITHIN`] after its first once one of its claimable changes
    /// was not taken here within [`TAKEN_WITHIN`] (the other instances'
    /// waiters may have to claim it); [`ANNOUNCE_TAKEN_WITHIN`] after its
    /// first; whichever comes first. An empty batch, and one that names
    /// [`ANNOUNCE_MAX`] changes, is due at once.
    fn send_at(&self) -> Instant {
        let (Some(first), Some(last)) = (self.first, self.last) else {
            return Instant::now();
        };
        if self.changes.len() >= ANNOUNCE_MAX {
            return first;
        }
        let mut at = (last + ANNOUNCE_QUIET).min(first + ANNOUNCE_TAKEN_WITHIN);
        if let Some(&(_, oldest)) = self.untaken.first() {
            at = at.min((first + ANNOUNCE_WITHIN).max(oldest + TAKEN_WITHIN));
        }
        at
    }

    /// Once due at `now`: until when the batch waits for this instance's
    /// claims to take its claimable changes, so that each lease goes out
    /// with its change and no other instance's waiter runs a claim query
    /// for the task. `None`, send now: every claimable change was taken, or
    /// one was not taken within [`TAKEN_WITHIN`] (this instance may have no
    /// waiter free for it: the others must hear it now). Else until the
    /// youngest is [`TAKEN_WITHIN`] old.
    fn hold_until(&self, now: Instant) -> Option<Instant> {
        let (&(_, oldest), &(_, youngest)) = (self.untaken.first()?, self.untaken.last()?);
        if now >= oldest + TAKEN_WITHIN {
            return None;
        }
        Some(youngest + TAKEN_WITHIN)
    }
}

/// Whether the `changes` of a transaction queued while a batch is held go
/// to the next batch instead: those that may make a task claimable (under a
/// steady stream of them the hold would never end), and those of a task
/// with changes `carried` there already (each task's changes are announced
/// in the order they were committed).
fn holds_back(changes: &[Change], carried: &VecDeque<(Instant, Vec<Change>)>) -> bool {
    changes.iter().any(|c| {
        c.kind.may_make_claimable()
            || carried
                .iter()
                .any(|(_, k)| k.iter().any(|k| k.task_id == c.task_id))
    })
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

    fn of(task: u128, kind: EventKind) -> Vec<Change> {
        vec![Change {
            task_id: Uuid::from_u128(task),
            kind,
            ..change("t")
        }]
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_lone_change_goes_once_quiet() {
        let t0 = Instant::now();
        let mut batch = Batch::default();
        batch.add(of(1, EventKind::TaskSubmitted), t0);
        assert_eq!(batch.send_at(), t0 + ANNOUNCE_QUIET);
        // The lease of the waiter it woke, within the quiet time: one
        // announcement for both.
        batch.add(of(1, EventKind::AttemptLeased), t0 + ms(8));
        assert_eq!(batch.send_at(), t0 + ms(8) + ANNOUNCE_QUIET);
        assert_eq!(
            batch.hold_until(batch.send_at()),
            None,
            "the task was taken"
        );
    }

    #[test]
    fn a_stream_taken_here_goes_at_the_longer_cap() {
        let t0 = Instant::now();
        let mut batch = Batch::default();
        for i in 0..20u64 {
            let at = t0 + ms(i * 7);
            batch.add(of(u128::from(i), EventKind::TaskSubmitted), at);
            batch.add(of(u128::from(i), EventKind::AttemptLeased), at + ms(3));
            batch.add(of(u128::from(i), EventKind::Delivered), at + ms(5));
        }
        assert_eq!(batch.send_at(), t0 + ANNOUNCE_TAKEN_WITHIN);
        assert_eq!(batch.hold_until(t0 + ANNOUNCE_TAKEN_WITHIN), None);
        // As many changes as one announcement names: due at once.
        let mut batch = Batch::default();
        batch.add(vec![change("t"); ANNOUNCE_MAX], t0);
        assert_eq!(batch.send_at(), t0);
    }

    #[test]
    fn a_claimable_change_not_taken_here_goes_within_the_short_cap() {
        let t0 = Instant::now();
        let mut batch = Batch::default();
        // A stream of submits nobody here claims.
        for i in 0..20u64 {
            batch.add(of(u128::from(i), EventKind::TaskSubmitted), t0 + ms(i * 7));
        }
        assert_eq!(batch.send_at(), t0 + ANNOUNCE_WITHIN);
        assert_eq!(
            batch.hold_until(t0 + ANNOUNCE_WITHIN),
            None,
            "the oldest was not taken within TAKEN_WITHIN: no hold"
        );
        // The first taken, the ones after it not.
        let mut batch = Batch::default();
        batch.add(of(1, EventKind::TaskSubmitted), t0);
        batch.add(of(1, EventKind::AttemptLeased), t0 + ms(10));
        for i in 2..20u64 {
            batch.add(of(u128::from(i), EventKind::TaskSubmitted), t0 + ms(i * 5));
        }
        assert_eq!(batch.send_at(), t0 + ANNOUNCE_WITHIN);
        // A change with a backoff is not taken in its batch.
        let mut batch = Batch::default();
        batch.add(
            vec![Change {
                due_in_ms: Some(250),
                ..of(1, EventKind::RetryScheduled).remove(0)
            }],
            t0,
        );
        batch.add(of(9, EventKind::Delivered), t0 + ms(15));
        batch.add(of(8, EventKind::Delivered), t0 + ms(30));
        batch.add(of(7, EventKind::Delivered), t0 + ms(45));
        assert_eq!(batch.send_at(), t0 + ANNOUNCE_WITHIN);
    }

    #[test]
    fn a_due_batch_waits_for_the_claims_of_its_young_changes() {
        let t0 = Instant::now();
        let mut batch = Batch::default();
        for i in 0..10u64 {
            let at = t0 + ms(i * 15);
            batch.add(of(u128::from(i), EventKind::TaskSubmitted), at);
            batch.add(of(u128::from(i), EventKind::AttemptLeased), at + ms(4));
        }
        // The last submit, its claim on its way at the cap.
        let last = t0 + ANNOUNCE_TAKEN_WITHIN - ms(2);
        batch.add(of(99, EventKind::TaskSubmitted), last);
        assert_eq!(batch.send_at(), t0 + ANNOUNCE_TAKEN_WITHIN);
        assert_eq!(batch.hold_until(batch.send_at()), Some(last + TAKEN_WITHIN));
        // Meanwhile: another submit goes to the next batch; the lease joins.
        let carried = VecDeque::from([(last, of(100, EventKind::TaskSubmitted))]);
        assert!(holds_back(
            &of(100, EventKind::TaskSubmitted),
            &VecDeque::new()
        ));
        assert!(
            holds_back(&of(100, EventKind::AttemptLeased), &carried),
            "a task's changes keep their order"
        );
        assert!(!holds_back(&of(99, EventKind::AttemptLeased), &carried));
        batch.add(of(99, EventKind::AttemptLeased), last + ms(5));
        assert_eq!(batch.hold_until(last + ms(5)), None, "taken: sent now");
        // Not taken within TAKEN_WITHIN: sent then.
        let mut batch = Batch::default();
        batch.add(of(1, EventKind::TaskSubmitted), t0);
        assert_eq!(
            batch.hold_until(t0 + ANNOUNCE_QUIET),
            Some(t0 + TAKEN_WITHIN)
        );
        assert_eq!(batch.hold_until(t0 + TAKEN_WITHIN), None);
    }

    /// `(task, kind)` of each change.
    fn named(changes: &[Change]) -> Vec<(u128, EventKind)> {
        changes
            .iter()
            .map(|c| (c.task_id.as_u128(), c.kind))
            .collect()
    }

    /// The gatherer's next batch and its flushes; a batch must come.
    async fn next_batch(gatherer: &mut Gatherer) -> (Vec<Change>, Vec<oneshot::Sender<()>>) {
        match gatherer.next().await {
            Some(batch) => batch,
            None => panic!("a batch"),
        }
    }

    /// Queues `changes` on `queue` `after` the start, on the paused clock.
    fn queue_at(queue: &mpsc::UnboundedSender<Queued>, after: u64, changes: Vec<Change>) {
        let queue = queue.clone();
        tokio::spawn(async move {
            tokio::time::sleep(ms(after)).await;
            let _ = queue.send(Queued::Changes(changes));
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_batch_takes_the_lease_and_leaves_the_next_submit_for_the_next() {
        let (queue, queued) = mpsc::unbounded_channel();
        let mut gatherer = Gatherer::new(queued);
        let t0 = Instant::now();
        queue_at(&queue, 0, of(1, EventKind::TaskSubmitted));
        // Due at 20 ms (quiet), held for the lease of task 1; task 2's
        // submit comes first and waits for the next batch, and so does its
        // lease (a task's changes keep their order).
        queue_at(&queue, 22, of(2, EventKind::TaskSubmitted));
        queue_at(&queue, 25, of(1, EventKind::AttemptLeased));
        queue_at(&queue, 27, of(2, EventKind::AttemptLeased));
        let (first, _) = next_batch(&mut gatherer).await;
        assert_eq!(
            named(&first),
            [(1, EventKind::TaskSubmitted), (1, EventKind::AttemptLeased)]
        );
        assert_eq!(t0.elapsed(), ms(25), "sent once the lease came");
        let (second, _) = next_batch(&mut gatherer).await;
        assert_eq!(
            named(&second),
            [(2, EventKind::TaskSubmitted), (2, EventKind::AttemptLeased)]
        );
        assert_eq!(t0.elapsed(), ms(27) + ANNOUNCE_QUIET);
        // A change nobody here takes: held TAKEN_WITHIN, then sent alone.
        let t1 = Instant::now();
        queue_at(&queue, 0, of(3, EventKind::TaskSubmitted));
        let (third, _) = next_batch(&mut gatherer).await;
        assert_eq!(named(&third), [(3, EventKind::TaskSubmitted)]);
        assert_eq!(t1.elapsed(), TAKEN_WITHIN);
        drop(queue);
        assert!(gatherer.next().await.is_none(), "every sender gone");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_taken_here_is_announced_at_the_longer_cap_and_one_not_taken_at_the_short() {
        let (queue, queued) = mpsc::unbounded_channel();
        let mut gatherer = Gatherer::new(queued);
        // A submit every 7 ms, each leased 3 ms later, for 1 s.
        for i in 0..143u64 {
            queue_at(&queue, i * 7, of(u128::from(i), EventKind::TaskSubmitted));
            queue_at(
                &queue,
                i * 7 + 3,
                of(u128::from(i), EventKind::AttemptLeased),
            );
        }
        let t0 = Instant::now();
        let (mut sent, mut heard) = (Vec::new(), 0);
        while heard < 286 {
            let (changes, _) = next_batch(&mut gatherer).await;
            assert!(
                named(&changes).chunks(2).all(|p| p.len() == 2
                    && p[0].0 == p[1].0
                    && p[1].1 == EventKind::AttemptLeased),
                "each submit goes out with its lease"
            );
            heard += changes.len();
            sent.push(t0.elapsed());
        }
        // ANNOUNCE_TAKEN_WITHIN after each batch's first submit; the last
        // once quiet.
        assert_eq!(sent, [150, 304, 458, 612, 766, 920, 1017].map(ms).to_vec());
        // Submits nobody here claims: ANNOUNCE_WITHIN after each batch's first.
        let t1 = Instant::now();
        for i in 0..60u64 {
            queue_at(
                &queue,
                i * 7,
                of(1000 + u128::from(i), EventKind::TaskSubmitted),
            );
        }
        let mut sent = Vec::new();
        while sent.len() < 5 {
            next_batch(&mut gatherer).await;
            sent.push(t1.elapsed());
        }
        assert_eq!(sent, [50, 106, 162, 218, 274].map(ms).to_vec());
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_sends_what_was_held_back_too() {
        let (queue, queued) = mpsc::unbounded_channel();
        let mut gatherer = Gatherer::new(queued);
        queue_at(&queue, 0, of(1, EventKind::TaskSubmitted));
        queue_at(&queue, 21, of(2, EventKind::TaskSubmitted));
        let (done, answered) = oneshot::channel();
        let flush = queue.clone();
        tokio::spawn(async move {
            tokio::time::sleep(ms(23)).await;
            let _ = flush.send(Queued::Flush(done));
        });
        let (changes, flushes) = next_batch(&mut gatherer).await;
        assert_eq!(
            named(&changes),
            [(1, EventKind::TaskSubmitted), (2, EventKind::TaskSubmitted)]
        );
        for f in flushes {
            let _ = f.send(());
        }
        assert!(answered.await.is_ok());
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
