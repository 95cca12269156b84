//! The driver seam: [`Tx`], the primitives a backend offers inside one
//! database transaction, with its supertraits ([`search::TaskSearch`],
//! [`console::ConsoleTx`]) and the records their methods take. The
//! operations ([`crate::ops`]) are written over it; it names nothing of
//! them.

use std::future::Future;

use idem_core::contract::FrozenContract;
use idem_core::model::{
    ApiKey, Attempt, EffectReport, Event, Evidence, SecondEffect, Task, Timestamp,
};
use idem_core::trace::TraceParent;
use serde_json::Value;
use uuid::Uuid;

use crate::flow::{ClaimQueue, QueuePair};
use crate::{ExistingScope, Result, ScopeRow, feed, identity};
use console::ConsoleTx;
use search::TaskSearch;

pub mod console;
pub mod search;

/// A submission that passed validation and fingerprinting.
#[derive(Debug, Clone)]
pub struct Submission {
    /// Tenant of the authenticated key.
    pub tenant: String,
    /// Operation class (known to the configuration).
    pub operation: String,
    /// Parsed idempotency key.
    pub idempotency_key: String,
    /// `sha256:<hex>` of the canonical request.
    pub fingerprint: String,
    /// RFC 8785 canonical request.
    pub canonical_request: String,
    /// Params as submitted.
    pub params: Value,
    /// Contract to freeze if the task is new.
    pub contract: FrozenContract,
    /// Submitting key.
    pub api_key_id: Uuid,
    /// The key's operation list at acceptance (`None` = all).
    pub grant: Option<Vec<String>>,
    /// The W3C `traceparent` the submit carried: kept on a new task, not part
    /// of the fingerprint (a replay answers the task as it was accepted).
    pub traceparent: Option<TraceParent>,
    /// The rate-limit buckets a new task of this submission takes a token
    /// from, as `(scope, limit)` (SPEC §8.1; empty = none): a replay or a
    /// conflict takes none.
    pub rate_limits: Vec<(String, idem_core::flow::RateLimit)>,
    /// The concurrency key read from `params` under the class's
    /// `flow.concurrency_key` pointer (SPEC §8.2 "Concurrency caps"), kept
    /// on a new task; `None`: no key.
    pub concurrency_key: Option<String>,
    /// Claim priority 1–5, within the class's range (SPEC §4; checked by
    /// the HTTP layer).
    pub priority: i64,
    /// The class's fairness key value for these params (SPEC §2.13).
    pub fairness_key: Option<String>,
}

impl Submission {
    /// The scope `(tenant, operation, idempotency key)`.
    pub fn scope(&self) -> (String, String, String) {
        (
            self.tenant.clone(),
            self.operation.clone(),
            self.idempotency_key.clone(),
        )
    }
}

/// The primitives of one database transaction. Every method runs inside the
/// transaction the backend opened for the current [`Op`]; nothing is visible to
/// others before the backend commits.
///
/// Times are epoch ms. All futures are `Send`.
pub trait Tx: Send + TaskSearch + ConsoleTx {
    /// A fresh id for a row this transaction may insert (a task named by its
    /// scope row, an attempt, an API key). The databases' default is a UUID
    /// v7 (time-ordered, random below the millisecond); an in-memory store
    /// may answer deterministic ids instead, so that the same history gives
    /// the same records.
    fn new_id(&mut self) -> Uuid {
        Uuid::now_v7()
    }

    /// The clock that decides leases and backoff: the database clock for
    /// PostgreSQL, the process clock for SQLite (single process), each plus
    /// the offset of the backend's [`Clock`].
    fn now(&mut self) -> impl Future<Output = Result<Timestamp>> + Send;

    /// The shared secret `name`: the stored one, or `candidate` stored now
    /// when there is none (`INSERT … ON CONFLICT DO NOTHING`, then a read,
    /// so concurrent first uses agree on one value).
    fn shared_secret(
        &mut self,
        name: &str,
        candidate: &[u8; 32],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<u8>>> + Send;

    /// Inserts an API key with the SHA-256 hex of its plain value.
    fn insert_api_key(
        &mut self,
        key: &ApiKey,
        hash: &str,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Finds a key by the SHA-256 hex of its plain value.
    fn api_key_by_hash(
        &mut self,
        hash: &str,
    ) -> impl Future<Output = Result<Option<ApiKey>>> + Send;
    /// Finds a key by id.
    fn api_key(&mut self, id: Uuid) -> impl Future<Output = Result<Option<ApiKey>>> + Send;
    /// Sets `revoked_at` if unset; returns the key.
    fn revoke_api_key(
        &mut self,
        id: Uuid,
        at: Timestamp,
    ) -> impl Future<Output = Result<Option<ApiKey>>> + Send;
    /// All keys, oldest first.
    fn list_api_keys(&mut self) -> impl Future<Output = Result<Vec<ApiKey>>> + Send;

    /// `INSERT … ON CONFLICT DO NOTHING` of a scope row; `true` when this call inserted it.
    fn insert_scope(&mut self, row: &ScopeRow) -> impl Future<Output = Result<bool>> + Send;
    /// The scope row, in a new statement (new snapshot under READ COMMITTED).
    fn scope(
        &mut self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<ScopeRow>>> + Send;
    /// Removes the scope row of a task (retention sweeper, SPEC §2.9).
    fn delete_scope(&mut self, task_id: Uuid) -> impl Future<Output = Result<()>> + Send;

    /// Locks the rate-limit bucket `scope` until commit, creating it when
    /// missing (`INSERT … ON CONFLICT DO UPDATE … RETURNING`, so concurrent
    /// first uses wait on one row), and answers its theoretical arrival
    /// time (µs since the epoch; 0 for a bucket never used).
    fn lock_rate(&mut self, scope: &str) -> impl Future<Output = Result<i64>> + Send;
    /// Writes the theoretical arrival time (µs) of the bucket `scope`,
    /// locked by [`Tx::lock_rate`] in this transaction.
    fn set_rate(&mut self, scope: &str, tat_us: i64) -> impl Future<Output = Result<()>> + Send;

    /// Inserts a new task row.
    fn insert_task(&mut self, task: &Task) -> impl Future<Output = Result<()>> + Send;

    /// Inserts several scope rows (`INSERT … ON CONFLICT DO NOTHING`); answers, per
    /// row and in order, whether this call inserted it. Backends may override the
    /// default (one row at a time) with one multi-row statement.
    fn insert_scopes(
        &mut self,
        rows: &[ScopeRow],
    ) -> impl Future<Output = Result<Vec<bool>>> + Send {
        async move {
            let mut inserted = Vec::with_capacity(rows.len());
            for row in rows {
                inserted.push(self.insert_scope(row).await?);
            }
            Ok(inserted)
        }
    }

    /// The clock ([`Tx::now`]) and, of `ids`, the API keys that exist and are
    /// not revoked, read inside this transaction: a submit's key is checked where
    /// its task is written, so a revoked key is refused by the database even if
    /// the HTTP layer had it cached. Backends may override the default (the
    /// clock, then one key at a time) with one statement.
    fn now_and_live_api_keys(
        &mut self,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<(Timestamp, std::collections::HashSet<Uuid>)>> + Send {
        async move {
            let now = self.now().await?;
            let mut live = std::collections::HashSet::new();
            for id in ids {
                if live.contains(id) {
                    continue;
                }
                if let Some(key) = self.api_key(*id).await?
                    && key.revoked_at.is_none()
                {
                    live.insert(*id);
                }
            }
            Ok((now, live))
        }
    }

    /// Inserts new tasks, each with its events (`events[i]` belongs to
    /// `tasks[i]`). Backends may override the default (one task, then its
    /// events, at a time) with one statement.
    fn insert_tasks_with_events(
        &mut self,
        tasks: &[Task],
        events: &[Vec<Event>],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for (task, events) in tasks.iter().zip(events) {
                self.insert_task(task).await?;
                self.insert_events(task.id, events).await?;
                self.open_queues(task).await?;
            }
            Ok(())
        }
    }

    /// For each submission, in order, its scope row and the task it names
    /// when its API key is live; `None` when its key is revoked (or gone) or
    /// its scope is free. For answering retries without a write
    /// ([`retries::answer`]). Backends may override the default (the key
    /// check, then [`Tx::scopes_with_tasks`] of the live keys' scopes) with
    /// one statement.
    fn live_scopes_with_tasks(
        &mut self,
        subs: &[Submission],
    ) -> impl Future<Output = Result<Vec<ExistingScope>>> + Send {
        async move {
            let mut keys: Vec<Uuid> = subs.iter().map(|s| s.api_key_id).collect();
            keys.sort_unstable();
            keys.dedup();
            let (_, live) = self.now_and_live_api_keys(&keys).await?;
            let asked: Vec<usize> = (0..subs.len())
                .filter(|&i| live.contains(&subs[i].api_key_id))
                .collect();
            let scopes: Vec<(String, String, String)> =
                asked.iter().map(|&i| subs[i].scope()).collect();
            let found = if scopes.is_empty() {
                Vec::new()
            } else {
                self.scopes_with_tasks(&scopes).await?
            };
            let mut out: Vec<ExistingScope> = vec![None; subs.len()];
            for (i, f) in asked.into_iter().zip(found) {
                out[i] = f;
            }
            Ok(out)
        }
    }

    /// For each `(tenant, operation, key)`, its scope row and the task it names,
    /// read in new statements (default: one scope at a time).
    fn scopes_with_tasks(
        &mut self,
        scopes: &[(String, String, String)],
    ) -> impl Future<Output = Result<Vec<ExistingScope>>> + Send {
        async move {
            let mut out = Vec::with_capacity(scopes.len());
            for (tenant, operation, key) in scopes {
                let found = match self.scope(tenant, operation, key).await? {
                    Some(row) => {
                        let task = self.task(row.task_id, false).await?;
                        Some((row, task))
                    }
                    None => None,
                };
                out.push(found);
            }
            Ok(out)
        }
    }

    /// Loads a task; `lock` takes a row lock until commit (`FOR UPDATE`).
    fn task(&mut self, id: Uuid, lock: bool) -> impl Future<Output = Result<Option<Task>>> + Send;
    /// Writes every column of `task` where the stored row still has `expected_version`
    /// and `expected_generation` (compare-and-set; the fence is in the write itself).
    ///
    /// # Errors
    /// [`StoreError::Contention`] when no row matched.
    fn update_task(
        &mut self,
        task: &Task,
        expected_version: i64,
        expected_generation: i64,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Inserts a new attempt (unique per task and number, and per task and generation).
    fn insert_attempt(&mut self, attempt: &Attempt) -> impl Future<Output = Result<()>> + Send;
    /// Writes an attempt's mutable columns (state, lease end, usage, external txn id, report).
    fn update_attempt(&mut self, attempt: &Attempt) -> impl Future<Output = Result<()>> + Send;
    /// Loads an attempt without its evidence.
    fn attempt(&mut self, id: Uuid) -> impl Future<Output = Result<Option<Attempt>>> + Send;
    /// All attempts of a task with their evidence, by number.
    fn attempts(&mut self, task_id: Uuid) -> impl Future<Output = Result<Vec<Attempt>>> + Send;
    /// Appends evidence.
    fn insert_evidence(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        ev: &Evidence,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Appends events (primary key `(task_id, seq)`: a concurrent writer cannot interleave).
    fn insert_events(
        &mut self,
        task_id: Uuid,
        events: &[Event],
    ) -> impl Future<Output = Result<()>> + Send;
    /// The effect reports (the first of each distinct `external_txn_id`, in
    /// the order received) and the suspected second effects (oldest first)
    /// of a task.
    fn effects(
        &mut self,
        task_id: Uuid,
    ) -> impl Future<Output = Result<(Vec<EffectReport>, Vec<SecondEffect>)>> + Send;
    /// The suspected second effects of each task of `task_ids` (oldest
    /// first within a task), as `(task id, effect)` pairs: for answering
    /// many tasks at once (a search page, replayed submissions). Backends may
    /// override the default (one [`Tx::effects`] per task) with one statement.
    fn second_effects_of(
        &mut self,
        task_ids: &[Uuid],
    ) -> impl Future<Output = Result<Vec<(Uuid, SecondEffect)>>> + Send {
        async move {
            let mut out = Vec::new();
            for &id in task_ids {
                let (_, effects) = self.effects(id).await?;
                out.extend(effects.into_iter().map(|e| (id, e)));
            }
            Ok(out)
        }
    }
    /// Records an effect report (unique per task and `external_txn_id`,
    /// `null` counted as one id: a second insert fails).
    fn insert_effect_report(
        &mut self,
        task_id: Uuid,
        report: &EffectReport,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Records a suspected second effect (unique per task and
    /// `external_txn_id`, `null` counted as one id: a second insert fails).
    fn insert_second_effect(
        &mut self,
        task_id: Uuid,
        effect: &SecondEffect,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Writes the acknowledgment of a suspected second effect not yet
    /// acknowledged.
    ///
    /// # Errors
    /// [`StoreError::Contention`] when it has none to take (already
    /// acknowledged, or absent).
    fn acknowledge_second_effect(
        &mut self,
        task_id: Uuid,
        effect: &SecondEffect,
    ) -> impl Future<Output = Result<()>> + Send;
    /// The event history of a task, by sequence.
    fn events(&mut self, task_id: Uuid) -> impl Future<Output = Result<Vec<Event>>> + Send;
    /// Up to `limit` events of `tenant` after `after` in feed order, of the
    /// classes in `operations` (`None`: all), each with its cursor; only
    /// events before which no other can still appear ([`feed`]: below the
    /// snapshot's xmin on PostgreSQL, committed on SQLite); with the feed's
    /// head as the same read saw it ([`feed::FeedHead`]). Run outside a
    /// writing transaction (its own id would hold the horizon back).
    fn feed(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        after: feed::FeedCursor,
        limit: i64,
    ) -> impl Future<Output = Result<feed::FeedRead>> + Send;

    /// Takes, for the lease of `attempt_id` of `task_id`, one free slot
    /// `0..cap` of each of `slots` (SPEC §8.2 "Concurrency caps",
    /// [`crate::caps`]): first removes the scope's slots whose attempt no
    /// longer holds its task's lease (left by a binary that did not free
    /// them), then inserts the lowest free slot (`INSERT … ON CONFLICT DO
    /// NOTHING`). Answers the index in `slots` of the first scope with no
    /// free slot (or whose slot a concurrent transaction took first), having
    /// removed the slots this call took; `None` when every slot was taken.
    fn take_slots(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        slots: &[crate::caps::CapSlot],
    ) -> impl Future<Output = Result<Option<usize>>> + Send;
    /// Removes the slots of `task_id` held by any attempt but `keep` (the
    /// task's active attempt after the write; `None`: all of them): run with
    /// every task write, so a lease's slots go in the transaction that ends it.
    fn free_slots(
        &mut self,
        task_id: Uuid,
        keep: Option<Uuid>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Up to `limit` claimable task ids of `tenant` in `operations`, oldest `ready_at`
    /// first, locked for this transaction and skipping rows other transactions hold
    /// (`FOR UPDATE SKIP LOCKED`).
    fn claimable(
        &mut self,
        tenant: &str,
        operations: &[String],
        now: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
    /// Fair claims (SPEC §2.13): up to `limit` unparked tenant queues of
    /// `operations` whose tenant `tenants` lists (`None`: every tenant), lowest
    /// turn first (then tenant, class). `locked`: each locked for this
    /// transaction, skipping queues other claims hold (`FOR UPDATE SKIP
    /// LOCKED`); otherwise read without a lock. The default (a store without
    /// fair claims) has none.
    fn claim_queues(
        &mut self,
        tenants: Option<&[String]>,
        operations: &[String],
        limit: i64,
        locked: bool,
    ) -> impl Future<Output = Result<Vec<ClaimQueue>>> + Send {
        let _ = (tenants, operations, limit, locked);
        async { Ok(Vec::new()) }
    }
    /// Up to `limit` unparked fairness key value queues of `tenant` and
    /// `operation`, lowest turn first, locked as [`Tx::claim_queues`] says.
    fn value_queues(
        &mut self,
        tenant: &str,
        operation: &str,
        limit: i64,
        locked: bool,
    ) -> impl Future<Output = Result<Vec<ClaimQueue>>> + Send {
        let _ = (tenant, operation, limit, locked);
        async { Ok(Vec::new()) }
    }
    /// Up to `limit` claimable task ids of the value queue `queue` (tasks of
    /// its tenant and class with its fairness key value), lowest claim rank
    /// first, locked (`FOR UPDATE SKIP LOCKED`) as [`Tx::claimable`].
    fn claimable_with_value(
        &mut self,
        queue: &ClaimQueue,
        now: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send {
        let _ = (queue, now, limit);
        async { Ok(Vec::new()) }
    }
    /// Whether `queue` has a task waiting to be claimed, ready or not (a task
    /// in backoff keeps its queue in the turn order).
    fn queue_waits(&mut self, queue: &ClaimQueue) -> impl Future<Output = Result<bool>> + Send {
        let _ = queue;
        async { Ok(false) }
    }
    /// Sets the turn of `queue` (a row this transaction locked); `None` parks
    /// it (out of the turn order until a task of it waits again).
    fn set_turn(
        &mut self,
        queue: &ClaimQueue,
        turn: Option<i64>,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (queue, turn);
        async { Ok(()) }
    }
    /// The highest turn of `queue`'s level (the tenant queues of its class,
    /// or the value queues of its tenant and class), unparked; `queue`'s own
    /// when it is the only one.
    fn last_turn(&mut self, queue: &ClaimQueue) -> impl Future<Output = Result<i64>> + Send {
        async { Ok(queue.turn) }
    }
    /// Opens the queues of `task`, which waits to be claimed: its tenant's
    /// queue of its class and, with a fairness key, its value's; each
    /// inserted, or unparked, at the lowest unparked turn of its level. A
    /// queue in the turn order is left as it is (nothing written).
    fn open_queues(&mut self, task: &Task) -> impl Future<Output = Result<()>> + Send {
        let _ = task;
        async { Ok(()) }
    }
    /// Unparks up to `limit` parked queues that have a task waiting (those
    /// whose task was written while a claim parked the queue); how many.
    fn unpark_waiting(&mut self, limit: i64) -> impl Future<Output = Result<usize>> + Send {
        let _ = limit;
        async { Ok(0) }
    }
    /// Inserts the missing tenant queues: walks up to `limit` (tenant,
    /// class) pairs with a task in the claimable states, in (tenant,
    /// operation) order from after `after` (`None`: from the first), and
    /// for each with a task waiting to be claimed but no tenant queue (tasks
    /// a binary of a schema before the claim queues accepted or wrote: it
    /// writes no queue rows) inserts the tenant's queue of the class at the
    /// lowest unparked turn of its level ([`Tx::open_queues`]' rule).
    /// Answers how many it inserted and the last pair walked when the walk
    /// stopped at `limit` (`None`: it reached the last pair). A value's
    /// queue is not needed to claim its tasks (a claim takes the tasks no
    /// value queue holds from their tenant's queue). Cost: one index probe
    /// of the tasks and one of `claim_turns` per pair walked, whatever the
    /// backlog.
    fn open_missing_queues(
        &mut self,
        after: Option<&QueuePair>,
        limit: i64,
    ) -> impl Future<Output = Result<(usize, Option<QueuePair>)>> + Send {
        let _ = (after, limit);
        async { Ok((0, None)) }
    }
    /// Parks or deletes every claim queue of `tenant`'s class `operation`
    /// (its tenant's and its values'), as `how` says. For the conformance
    /// suite; how many queues it changed.
    fn tamper_queues(
        &mut self,
        tenant: &str,
        operation: &str,
        how: crate::flow::QueueTamper,
    ) -> impl Future<Output = Result<usize>> + Send {
        let _ = (tenant, operation, how);
        async { Ok(0) }
    }

    /// Up to `limit` `(task, attempt)` pairs whose active lease ended before `now`
    /// (locked, skipping locked rows).
    fn expired_leases(
        &mut self,
        now: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<(Uuid, Uuid)>>> + Send;
    /// Up to `limit` `retry_wait` task ids whose backoff has passed (locked, skip locked).
    fn due_wakeups(
        &mut self,
        now: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
    /// Up to `limit` task ids whose scope row is past retention (locked, skip locked).
    fn expired_scopes(
        &mut self,
        now: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send;

    /// What the database says about itself now ([`identity`]): PostgreSQL's
    /// system identifier and the timeline the primary writes on; `None` on
    /// SQLite, whose identity is only the recorded one.
    fn database_identity(
        &mut self,
    ) -> impl Future<Output = Result<Option<identity::DatabaseIdentity>>> + Send;
    /// The identity row, not locked (a check that finds it unchanged writes
    /// nothing, not even a row lock; [`Tx::record_identity`] is the
    /// compare-and-set); `None` before one is recorded.
    fn recorded_identity(
        &mut self,
    ) -> impl Future<Output = Result<Option<identity::RecordedIdentity>>> + Send;
    /// Records `new` (and clears `restored`): with `expected` `None` only if
    /// no identity is recorded (`INSERT … ON CONFLICT DO NOTHING`), else only
    /// if the recorded epoch is still `expected.epoch` (compare-and-set).
    /// Answers whether this call wrote it.
    fn record_identity(
        &mut self,
        expected: Option<&identity::StoreIdentity>,
        new: &identity::StoreIdentity,
    ) -> impl Future<Output = Result<bool>> + Send;
    /// Marks the recorded identity as a restored backup's (`restored`): the
    /// next identity check records a new epoch and rewinds. Answers whether
    /// an identity was recorded to mark.
    fn mark_restored(&mut self) -> impl Future<Output = Result<bool>> + Send;
    /// Whether leases may be granted: no identity is recorded, or the
    /// recorded one is the database's now and not a restored backup's. A
    /// claim made between a failover and the identity check that follows it
    /// leases nothing, so no task is re-executed before it was rewound.
    fn identity_is_current(&mut self) -> impl Future<Output = Result<bool>> + Send;
    /// Up to `limit` ids of tasks that are not terminal, after `after` in id
    /// order (all tenants).
    fn unfinished_tasks(
        &mut self,
        after: Option<Uuid>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
}
