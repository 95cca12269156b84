//! The model's state: an in-memory store of idem's real records, the
//! executors' local knowledge, the provider's ledger, the model clock and the
//! ghost fields the properties need (history a state alone would not show).
//!
//! Hashing: the checker deduplicates states by a 64-bit hash of the state
//! alone (stateright's fingerprint), so [`TaskRow`] hashes every field that a
//! transition of [`idem_core::machine`] or a property reads, and leaves out
//! only bookkeeping that none reads: the compare-and-set `version`, the event
//! sequence number, `updated_at`, `created_at`, `leased_at`, the failure's
//! message text and the result document (fixed per task by the model).
//! Ids are hashed by position, not value: a task by its index (the store
//! hands out ids in increasing order, so index order is id order), an
//! attempt by its number within its task. Two histories that reach the same
//! records with ids handed out in another order are one state to the
//! checker; nothing the store does depends on an id's value beyond that
//! order. Equality compares every field, so equal states always hash alike.

use std::hash::{Hash, Hasher};

use idem_core::model::{Attempt, AttemptKind, Outcome, Task};
use uuid::Uuid;

/// Milliseconds per tick of the model clock.
pub const TICK_MS: i64 = 100;

/// One task of the store, its attempts, what the evidence table holds about
/// it, and its ghost fields.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRow {
    /// Index of the idempotency key (scope) the task was accepted under.
    pub key: u8,
    /// The task record, as the store keeps it.
    pub task: Task,
    /// Its attempts in number order (attempt rows, without evidence).
    pub attempts: Vec<Attempt>,
    /// Evidence table: a report from an old generation or an ended lease was
    /// kept with disposition `stale_generation` (SPEC §2.4).
    pub stale_report_kept: bool,
    /// Ghost: an execute attempt was leased and nothing since has shown that
    /// its effect did not happen (an applied `failed` or `cancelled` report,
    /// a reconcile's `not_committed`, an operator's `not_committed`).
    pub effect_possible: bool,
    /// Ghost: how many times a delivery record was created for the task.
    pub deliveries: u8,
    /// Ghost: a pending cancellation became `too_late` because delivery won.
    pub cancel_lost_to_delivery: bool,
    /// Ghost: a pending cancellation (requested while an attempt ran) was confirmed.
    pub pending_cancel_confirmed: bool,
    /// Evidence table: an exact repeat of an applied report (its answer was
    /// lost) was kept with disposition `repeat` (SPEC §4 "Details").
    pub repeat_kept: bool,
}

impl TaskRow {
    /// Whether the task's class is declared safe to repeat (SPEC §2.5).
    pub fn safe(&self) -> bool {
        self.task.contract.retry.safe
    }

    /// The attempt holding id `id`.
    pub fn attempt_mut(&mut self, id: Uuid) -> Option<&mut Attempt> {
        self.attempts.iter_mut().find(|a| a.id == id)
    }
}

fn hash_attempt<H: Hasher>(a: &Attempt, h: &mut H) {
    a.number.hash(h);
    a.generation.hash(h);
    a.kind.hash(h);
    a.state.hash(h);
    a.executor_id.hash(h);
    a.lease_expires_at.hash(h);
    a.usage.hash(h);
    a.external_txn_id.hash(h);
    a.lease_ms.hash(h);
    a.evidence.len().hash(h);
    match &a.report {
        Some(r) => {
            r.outcome.hash(h);
            r.body.hash(h);
        }
        None => 0u8.hash(h),
    }
}

impl Hash for TaskRow {
    fn hash<H: Hasher>(&self, h: &mut H) {
        let t = &self.task;
        self.key.hash(h);
        t.operation.hash(h);
        t.fingerprint.hash(h);
        t.state.hash(h);
        t.generation.hash(h);
        t.attempt_count.hash(h);
        t.usage.hash(h);
        match &t.cancellation {
            Some(c) => {
                c.status.hash(h);
                c.requested_at.hash(h);
                c.confirmed_at.hash(h);
                c.fee.hash(h);
            }
            None => 0u8.hash(h),
        }
        match &t.delivery {
            Some(d) => {
                d.external_txn_id.hash(h);
                d.delivered_at.hash(h);
                d.acknowledged_at.hash(h);
                d.charge.hash(h);
            }
            None => 0u8.hash(h),
        }
        t.failure.as_ref().map(|f| f.class).hash(h);
        let c = &t.control;
        c.execute_count.hash(h);
        c.attempts_granted.hash(h);
        c.next_kind.hash(h);
        // The active attempt by its number.
        c.active_attempt_id
            .map(|id| self.attempts.iter().position(|a| a.id == id))
            .hash(h);
        c.ready_at.hash(h);
        c.deadline_at.hash(h);
        c.terminal_at.hash(h);
        c.key_expires_at.hash(h);
        self.attempts.len().hash(h);
        for a in &self.attempts {
            hash_attempt(a, h);
        }
        self.stale_report_kept.hash(h);
        self.repeat_kept.hash(h);
        self.effect_possible.hash(h);
        self.deliveries.hash(h);
        self.cancel_lost_to_delivery.hash(h);
        self.pending_cancel_confirmed.hash(h);
    }
}

/// What an executor knows about the attempt it holds (hashed without the
/// attempt's id: the task index and the number name it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Index of the task in the store.
    pub task: u8,
    /// The attempt id.
    pub attempt_id: Uuid,
    /// The attempt number (for traces).
    pub number: i64,
    /// The generation the claim granted (the fencing token it presents).
    pub generation: i64,
    /// Execute or reconcile.
    pub kind: AttemptKind,
    /// The lease end the executor last heard (claim or heartbeat), in ticks.
    pub lease_end: i64,
    /// Usage units the attempt consumed so far (1 once the effect was performed).
    pub usage: i64,
    /// Execute: the effect was performed at the provider.
    pub effect_done: bool,
    /// Execute: the device acknowledgment was sent.
    pub acknowledged: bool,
    /// Reconcile: what the provider's ledger said (`Some(true)`: the effect happened).
    pub observed: Option<bool>,
    /// A heartbeat answered that a cancellation is pending.
    pub cancel_heard: bool,
}

impl Hash for Held {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.task.hash(h);
        self.number.hash(h);
        self.generation.hash(h);
        self.kind.hash(h);
        self.lease_end.hash(h);
        self.usage.hash(h);
        self.effect_done.hash(h);
        self.acknowledged.hash(h);
        self.observed.hash(h);
        self.cancel_heard.hash(h);
    }
}

/// An executor: idle, holding one attempt, or sending a report again.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Executor {
    /// Ready to claim.
    Idle,
    /// Working on an attempt.
    Holding(Held),
    /// It sent this report and the answer was lost on the way back: it
    /// sends the same report again (SPEC §4 "Details").
    Repeating(Held, Reported),
}

impl Executor {
    /// The attempt the executor holds, if any.
    pub fn held(&self) -> Option<&Held> {
        match self {
            Executor::Idle => None,
            Executor::Holding(h) | Executor::Repeating(h, _) => Some(h),
        }
    }
}

/// A scope row of the store: the idempotency key (by its index in the
/// model's setup, which names tenant, class and key), the fingerprint it
/// was bound with, and the task it names (hashed by the task's index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// Index of the key in the model's setup.
    pub key: u8,
    /// The fingerprint bound to the key.
    pub fingerprint: String,
    /// The task the row names.
    pub task_id: Uuid,
}

/// A row of the store's `lease_slots` (SPEC §8.2 "Concurrency caps"):
/// slot `slot` of cap scope `scope`, held by the lease of `attempt_id` of
/// `task_id` (hashed by the task's index and the attempt's number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// The cap scope.
    pub scope: String,
    /// The slot number, below the cap.
    pub slot: i64,
    /// The task.
    pub task_id: Uuid,
    /// The attempt holding the lease.
    pub attempt_id: Uuid,
}

/// The provider's ledger for one task: idempotent, keyed by task id (the
/// executors pass it on as the provider's idempotency key, SPEC §2 "not
/// promised"). Reconcile attempts query it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Ledger {
    /// The effect happened (once).
    pub applied: bool,
    /// Requests the provider received for the task after its effect had
    /// happened (absorbed by its idempotency): each is a repeat of the effect.
    pub repeats: u8,
}

/// Bits of [`State::violations`]: transition checks that failed (a property
/// reads them).
pub mod violation {
    /// A replay or a conflict changed the store (SPEC §2.2, §2.3).
    pub const SUBMIT_CHANGED_STORE: u16 = 1;
    /// A call with an old generation (or a lease that no longer held) changed
    /// a task or attempt (SPEC §2.4).
    pub const STALE_CHANGED_STATE: u16 = 1 << 1;
    /// A task's generation went down (SPEC §2.4).
    pub const GENERATION_DECREASED: u16 = 1 << 2;
    /// A delivery record changed after it was made (SPEC §2.6).
    pub const DELIVERY_CHANGED: u16 = 1 << 3;
    /// A task's usage went down (SPEC §2.7, §2.10).
    pub const USAGE_DECREASED: u16 = 1 << 4;
    /// An execute attempt of a non-safe class was leased while an earlier
    /// effect may have happened unreconciled (SPEC §2.5).
    pub const REPEAT_WITHOUT_RECONCILE: u16 = 1 << 5;
    /// A submit to a taken scope was answered a replay for another request,
    /// or a conflict for the accepted request (SPEC §2.2, §2.3).
    pub const WRONG_SUBMIT_ANSWER: u16 = 1 << 6;
    /// An exact repeat of an applied report was not answered as the report
    /// was, or changed the task or attempt (SPEC §4 "Details").
    pub const REPEAT_CHANGED: u16 = 1 << 7;
    /// An operation failed with a storage error (the in-memory store has
    /// none, so an operation that fails there is wrong).
    pub const STORE_FAILED: u16 = 1 << 8;
}

/// The whole model state.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// Model clock, ticks of [`TICK_MS`].
    pub clock: i64,
    /// The store's tasks, in the order they were inserted.
    pub tasks: Vec<TaskRow>,
    /// The store's scope rows (SPEC §2.1), in the order they were inserted.
    pub scopes: Vec<Scope>,
    /// The store's API keys: bit `t` is set once tenant `t`'s key is revoked.
    pub revoked: u8,
    /// The executors.
    pub executors: Vec<Executor>,
    /// The provider's ledger, by task index.
    pub ledger: Vec<Ledger>,
    /// Executor crashes still allowed.
    pub crashes_left: u8,
    /// Operator actions (key revocations included) still allowed.
    pub operator_left: u8,
    /// Report answers that may still be lost.
    pub lost_left: u8,
    /// Ghost: transition checks that failed ([`violation`] bits).
    pub violations: u16,
    /// The store's cap slots, ordered by scope and slot.
    pub slots: Vec<Slot>,
}

impl Hash for State {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.clock.hash(h);
        self.tasks.hash(h);
        self.scopes.len().hash(h);
        for sc in &self.scopes {
            sc.key.hash(h);
            sc.fingerprint.hash(h);
            self.task_index(sc.task_id).hash(h);
        }
        self.revoked.hash(h);
        self.executors.hash(h);
        self.ledger.hash(h);
        self.crashes_left.hash(h);
        self.operator_left.hash(h);
        self.lost_left.hash(h);
        self.violations.hash(h);
        self.slots.len().hash(h);
        for s in &self.slots {
            s.scope.hash(h);
            s.slot.hash(h);
            let task = self.task_index(s.task_id);
            task.hash(h);
            task.and_then(|i| {
                self.tasks[i]
                    .attempts
                    .iter()
                    .position(|a| a.id == s.attempt_id)
            })
            .hash(h);
        }
    }
}

impl State {
    /// The task holding scope `key` (its scope row), if any.
    pub fn scope(&self, key: u8) -> Option<usize> {
        let sc = self.scopes.iter().find(|sc| sc.key == key)?;
        self.task_index(sc.task_id)
    }

    /// Whether a scope row names the task at `index`.
    pub fn key_held(&self, index: usize) -> bool {
        self.tasks
            .get(index)
            .is_some_and(|r| self.scopes.iter().any(|sc| sc.task_id == r.task.id))
    }

    /// The index of the task with id `id`.
    pub fn task_index(&self, id: Uuid) -> Option<usize> {
        self.tasks.iter().position(|r| r.task.id == id)
    }
}

/// What an executor reports (SPEC §4 `/report`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reported {
    /// `succeeded` with the result (execute).
    Succeeded,
    /// `failed` / `transient`.
    FailedTransient,
    /// `failed` / `invalid_input`.
    FailedInvalidInput,
    /// `unknown`.
    Unknown,
    /// `cancelled` (execute, answering a pending cancellation).
    Cancelled,
    /// `committed` with the result (reconcile: the ledger has the effect).
    Committed,
    /// `not_committed` (reconcile: the ledger has no effect).
    NotCommitted,
}

impl Reported {
    /// The outcome word.
    pub fn outcome(self) -> Outcome {
        match self {
            Reported::Succeeded => Outcome::Succeeded,
            Reported::FailedTransient | Reported::FailedInvalidInput => Outcome::Failed,
            Reported::Unknown => Outcome::Unknown,
            Reported::Cancelled => Outcome::Cancelled,
            Reported::Committed => Outcome::Committed,
            Reported::NotCommitted => Outcome::NotCommitted,
        }
    }

    pub(crate) fn failure_class(self) -> Option<idem_core::model::FailureClass> {
        use idem_core::model::FailureClass;
        match self {
            Reported::FailedTransient => Some(FailureClass::Transient),
            Reported::FailedInvalidInput => Some(FailureClass::InvalidInput),
            _ => None,
        }
    }
}

impl TaskRow {
    /// Whether a call left the task and its attempts as they were in `before`: every task
    /// field a transition decides (state, generation, usage, cancellation,
    /// delivery, failure, next attempt, readiness) and every attempt; the
    /// evidence it kept aside.
    pub fn unchanged_from(&self, before: &TaskRow) -> bool {
        let (a, b) = (&before.task, &self.task);
        let same_task = a.state == b.state
            && a.generation == b.generation
            && a.usage == b.usage
            && a.cancellation == b.cancellation
            && a.delivery == b.delivery
            && a.failure == b.failure
            && a.control.next_kind == b.control.next_kind
            && a.control.active_attempt_id == b.control.active_attempt_id
            && a.control.ready_at == b.control.ready_at
            && a.control.execute_count == b.control.execute_count;
        same_task
            && before.attempts.len() == self.attempts.len()
            && before.attempts.iter().zip(&self.attempts).all(|(a, b)| {
                a.state == b.state
                    && a.usage == b.usage
                    && a.lease_expires_at == b.lease_expires_at
                    && a.report == b.report
            })
    }
}
