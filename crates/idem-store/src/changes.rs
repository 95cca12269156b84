//! Committed changes: each event a transaction wrote, announced once the
//! transaction committed, to every instance over the same database (SPEC §4,
//! "Waiting" and "Live events").
//!
//! - PostgreSQL: the instance that committed a transaction publishes its
//!   events here right after `COMMIT`, and queues them for its announcer,
//!   which sends them to the other instances from a connection of its own,
//!   outside every data transaction: one statement once no change was
//!   queued for `ANNOUNCE_QUIET` (20 ms, idem-store-postgres), under a
//!   steady stream at most `ANNOUNCE_WITHIN` (50 ms) after the first change
//!   it carries when a task it announces was not leased there within
//!   `TAKEN_WITHIN` (30 ms), else at most `ANNOUNCE_TAKEN_WITHIN` (150 ms)
//!   after it, carrying all changes queued since the last (see
//!   idem-store-postgres's `announce` for the wait for a local lease), one
//!   `NOTIFY idem_changes` ([`CHANNEL`]) per change
//!   (payload [`Change::to_payload`]), or one [`RESYNC_PAYLOAD`] for a burst
//!   too large to name. Each instance keeps one listening connection,
//!   republishes here what the others announced, and skips what its own
//!   announcer sent (published already). Binaries whose sessions do not turn
//!   the `events` trigger off (`idem.notify`) still notify from inside each
//!   data transaction, in the same payload form.
//! - SQLite: one process writes, so the writer publishes the events of a
//!   batch here right after its `COMMIT`.
//!
//! A notification is a hint, never the truth: a waiter that wakes reads the
//! store again. A notification can be lost (the listening connection broke,
//! a receiver fell behind, or the process stopped or lost its announcing
//! connection between a `COMMIT` and the announcement): then either every
//! subscriber gets [`Notice::Resync`] and reads again, or nobody is told;
//! either way each waiter also reads again after a bounded interval of its
//! own, so a lost notification costs a late answer (at most that interval),
//! never a hung request.

use std::sync::{Arc, Mutex};

use idem_core::model::{Event, EventKind};
use tokio::sync::{broadcast, watch};
use uuid::Uuid;

/// The PostgreSQL notification channel changes are announced on.
pub const CHANNEL: &str = "idem_changes";

/// The payload of an announcement that names no change: changes were
/// committed that are not named (a burst larger than one announcement may
/// carry), so every subscriber reads again ([`Notice::Resync`]).
pub const RESYNC_PAYLOAD: &str = "resync";

/// Notices a subscriber may fall behind by before it is told to resync
/// ([`Notice::Resync`]) instead.
pub const BACKLOG: usize = 4096;

/// One committed event: whose, of which class, of which task, what kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The task's tenant.
    pub tenant: String,
    /// The task's operation class.
    pub operation: String,
    /// The task.
    pub task_id: Uuid,
    /// The event's type.
    pub kind: EventKind,
    /// How long after this event its task becomes claimable, ms, when the
    /// transition set a backoff (the event's `data.backoff_ms` above 0:
    /// `retry_scheduled`, `reconciliation_required`); `None`: at once, or not
    /// at all.
    pub due_in_ms: Option<u64>,
    /// Whether another instance committed it (heard on the listening
    /// connection) rather than this store handle (published at its commit).
    pub remote: bool,
}

impl Change {
    /// The change an event of `task_id` of `tenant` and `operation` is.
    pub fn of_event(tenant: String, operation: String, task_id: Uuid, event: &Event) -> Change {
        Change {
            tenant,
            operation,
            task_id,
            kind: event.kind,
            due_in_ms: event
                .data
                .backoff_ms()
                .and_then(|ms| u64::try_from(ms).ok())
                .filter(|ms| *ms > 0),
            remote: false,
        }
    }

    /// The payload announcing this change: the JSON array `[tenant,
    /// operation, task_id, type, backoff_ms]` (`backoff_ms`: [`Change::due_in_ms`]
    /// or null), the form the `events` trigger sends since migration 9, so
    /// that binaries of either kind read what the other announces.
    pub fn to_payload(&self) -> String {
        serde_json::json!([
            self.tenant,
            self.operation,
            self.task_id,
            self.kind.as_str(),
            self.due_in_ms
        ])
        .to_string()
    }

    /// Decodes the payload of a PostgreSQL notification: the JSON array
    /// `[tenant, operation, task_id, type, backoff_ms]` the `events` trigger
    /// builds (migration 9; `backoff_ms` is the event's `data.backoff_ms` or
    /// null), or the `[tenant, operation, task_id, type]` of migration 8 (no
    /// backoff known); [`Change::remote`]. `None` for anything else.
    pub fn from_payload(payload: &str) -> Option<Change> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Payload {
            WithBackoff(String, String, Uuid, String, Option<u64>),
            Plain(String, String, Uuid, String),
        }
        let (tenant, operation, task_id, kind, backoff_ms) =
            match serde_json::from_str(payload).ok()? {
                Payload::WithBackoff(t, o, id, k, b) => (t, o, id, k, b),
                Payload::Plain(t, o, id, k) => (t, o, id, k, None),
            };
        Some(Change {
            tenant,
            operation,
            task_id,
            kind: kind.parse().ok()?,
            due_in_ms: backoff_ms.filter(|ms| *ms > 0),
            remote: true,
        })
    }
}

/// What a subscriber hears.
#[derive(Debug, Clone)]
pub enum Notice {
    /// An event committed.
    Change(Arc<Change>),
    /// Notices may have been lost: read again whatever you wait for.
    Resync,
}

type Starter = Box<dyn FnOnce() + Send>;

/// The changes of one store: a broadcast of [`Notice`]s. A backend that has
/// to listen for them (PostgreSQL) registers a starter that runs on the first
/// [`Changes::subscribe`] or [`Changes::start`], so a store that nobody waits
/// on keeps no listening connection.
pub struct Changes {
    sender: broadcast::Sender<Notice>,
    starter: Mutex<Option<Starter>>,
    /// Whether every change committed from now on is heard (the listener
    /// listens); set by [`Publisher::resync`].
    heard: Arc<watch::Sender<bool>>,
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Changes")
            .field("subscribers", &self.sender.receiver_count())
            .finish()
    }
}

impl Default for Changes {
    fn default() -> Self {
        Changes::new()
    }
}

impl Changes {
    /// Changes published in this process only (SQLite).
    pub fn new() -> Changes {
        Changes {
            sender: broadcast::Sender::new(BACKLOG),
            starter: Mutex::new(None),
            heard: Arc::new(watch::Sender::new(true)),
        }
    }

    /// Changes whose publisher `start` sets going: it runs once, on the first
    /// [`Changes::subscribe`] or [`Changes::start`], inside the caller's
    /// tokio runtime, and gets the [`Publisher`] to publish with.
    pub fn with_starter(start: impl FnOnce(Publisher) + Send + 'static) -> Changes {
        let changes = Changes::new();
        changes.heard.send_replace(false);
        let publisher = changes.publisher();
        if let Ok(mut slot) = changes.starter.lock() {
            *slot = Some(Box::new(move || start(publisher)));
        }
        changes
    }

    /// A handle that publishes into these changes.
    pub fn publisher(&self) -> Publisher {
        Publisher {
            sender: self.sender.clone(),
            heard: Arc::clone(&self.heard),
        }
    }

    /// Runs the starter if it has not run yet (a server calls it at start-up,
    /// so its first waiter does not wait for the listening connection).
    pub fn start(&self) {
        let starter = match self.starter.lock() {
            Ok(mut slot) => slot.take(),
            Err(_) => None,
        };
        if let Some(start) = starter {
            start();
        }
    }

    /// A new subscription: every notice published from now on.
    pub fn subscribe(&self) -> Watch {
        self.start();
        Watch {
            receiver: self.sender.subscribe(),
        }
    }

    /// Publishes `change` to every subscriber.
    pub fn publish(&self, change: Change) {
        self.publisher().publish(change);
    }

    /// Starts the publisher if needed and resolves once every change that
    /// commits from then on will be heard (at once in process; once the
    /// listening connection listens on PostgreSQL, which may take as long as
    /// the database is unreachable).
    pub async fn heard(&self) {
        self.start();
        let mut rx = self.heard.subscribe();
        let _ = rx.wait_for(|heard| *heard).await;
    }
}

/// Publishes into a [`Changes`] (cloneable, for a listener task).
#[derive(Debug, Clone)]
pub struct Publisher {
    sender: broadcast::Sender<Notice>,
    heard: Arc<watch::Sender<bool>>,
}

/// Suspected second effects this process committed, by `operation`
/// (counter; SPEC §2 "Second effects").
pub const SECOND_EFFECTS_SUSPECTED: &str = "idem_second_effects_suspected_total";

impl Publisher {
    /// Publishes `change`; nothing happens without subscribers. A
    /// `second_effect_suspected` this process committed (not one heard from
    /// another instance) is counted in [`SECOND_EFFECTS_SUSPECTED`] here,
    /// where every committed event of every transition passes once.
    pub fn publish(&self, change: Change) {
        if !change.remote && change.kind == EventKind::SecondEffectSuspected {
            metrics::counter!(SECOND_EFFECTS_SUSPECTED, "operation" => change.operation.clone())
                .increment(1);
        }
        if self.sender.receiver_count() > 0 {
            let _ = self.sender.send(Notice::Change(Arc::new(change)));
        }
    }

    /// Tells every subscriber that notices may have been lost; call it when
    /// every change from now on is heard again (see [`Changes::heard`]).
    pub fn resync(&self) {
        self.heard.send_replace(true);
        let _ = self.sender.send(Notice::Resync);
    }

    /// Changes are not heard until the next [`Publisher::resync`].
    pub fn deaf(&self) {
        self.heard.send_replace(false);
    }
}

/// A subscription ([`Changes::subscribe`]).
#[derive(Debug)]
pub struct Watch {
    receiver: broadcast::Receiver<Notice>,
}

impl Watch {
    /// The next notice. A subscriber that fell more than [`BACKLOG`] notices
    /// behind gets [`Notice::Resync`]; once the changes are gone (the store
    /// was dropped) this never returns, and the caller's own bound ends its
    /// wait.
    pub async fn next(&mut self) -> Notice {
        match self.receiver.recv().await {
            Ok(notice) => notice,
            Err(broadcast::error::RecvError::Lagged(_)) => Notice::Resync,
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_of_the_trigger_decode_and_others_do_not() {
        let id = Uuid::nil();
        let c =
            Change::from_payload(&format!(r#"["t1","payout","{id}","delivered",null]"#)).unwrap();
        assert_eq!(c.tenant, "t1");
        assert_eq!(c.operation, "payout");
        assert_eq!(c.kind, EventKind::Delivered);
        assert_eq!(c.due_in_ms, None);
        let c = Change::from_payload(&format!(r#"["t1","payout","{id}","retry_scheduled",250]"#))
            .unwrap();
        assert_eq!(c.due_in_ms, Some(250));
        let c = Change::from_payload(&format!(r#"["t1","payout","{id}","retry_scheduled",0]"#))
            .unwrap();
        assert_eq!(c.due_in_ms, None);
        let c = Change::from_payload(&format!(r#"["t1","payout","{id}","task_woken"]"#)).unwrap();
        assert_eq!((c.kind, c.due_in_ms), (EventKind::TaskWoken, None));
        assert!(Change::from_payload(r#"["t1","payout","x","delivered",null]"#).is_none());
        assert!(Change::from_payload(&format!(r#"["t1","payout","{id}","nope",null]"#)).is_none());
        assert!(Change::from_payload("{}").is_none());
    }

    #[test]
    fn payloads_announced_decode_to_the_same_change() {
        for (kind, due_in_ms) in [
            (EventKind::TaskSubmitted, None),
            (EventKind::RetryScheduled, Some(250)),
        ] {
            let change = Change {
                tenant: "t\"1".into(),
                operation: "payout".into(),
                task_id: Uuid::new_v4(),
                kind,
                due_in_ms,
                remote: true,
            };
            assert_eq!(Change::from_payload(&change.to_payload()), Some(change));
        }
        assert!(Change::from_payload(RESYNC_PAYLOAD).is_none());
    }

    #[tokio::test]
    async fn subscribers_hear_changes_and_the_starter_runs_once() {
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let changes = Changes::with_starter(move |_| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
        let mut a = changes.subscribe();
        let mut b = changes.subscribe();
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        let change = Change {
            tenant: "t".into(),
            operation: "op".into(),
            task_id: Uuid::nil(),
            kind: EventKind::TaskSubmitted,
            due_in_ms: None,
            remote: false,
        };
        changes.publish(change.clone());
        for w in [&mut a, &mut b] {
            match w.next().await {
                Notice::Change(c) => assert_eq!(*c, change),
                Notice::Resync => panic!("expected the change"),
            }
        }
    }

    #[tokio::test]
    async fn a_subscriber_that_falls_behind_is_told_to_resync() {
        let changes = Changes::new();
        let mut w = changes.subscribe();
        for _ in 0..=BACKLOG {
            changes.publish(Change {
                tenant: "t".into(),
                operation: "op".into(),
                task_id: Uuid::nil(),
                kind: EventKind::TaskSubmitted,
                due_in_ms: None,
                remote: false,
            });
        }
        assert!(matches!(w.next().await, Notice::Resync));
    }
}
