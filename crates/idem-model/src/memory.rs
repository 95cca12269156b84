//! The in-memory store: [`idem_store::Tx`] over the model's [`State`], so
//! that the model runs the operations of [`idem_store::ops`] themselves
//! (each `Operation::run`, as the SQLite writer runs it in a savepoint), not
//! a copy of them.
//!
//! Each method does what the SQL of the SQLite backend does on the rows the
//! state holds: the scope row is the primary key of its
//! `(tenant, operation, idempotency key)`, a task write is a compare-and-set
//! on `(version, generation)` that raises the version, attempts are unique
//! per task and number and per task and generation, and the scans (claimable
//! tasks, ended leases, due backoffs, keys past retention) filter and order
//! as their statements do. The state is the store's rows and nothing else:
//! events are not kept (no property reads the history), nor effect reports
//! and suspected second effects (detection and audit only: no property reads
//! them), and of the evidence only what the properties need (a stale report
//! kept, a repeat answered).
//!
//! Futures complete at once (nothing here waits), so [`run`] drives an
//! operation with `futures::executor::block_on`. A transaction is atomic at
//! the level of the model's step: the step runs on a copy of the state and
//! keeps none of it when the operation fails.
//!
//! Ids ([`Tx::new_id`]) count up from the largest id the store holds, so the
//! same records get the same ids whatever the wall clock, and ids handed out
//! later are larger (as UUID v7s are).

use std::collections::HashSet;

use idem_core::model::{
    ApiKey, Attempt, Disposition, EffectReport, Event, Evidence, EvidenceOutcome, SecondEffect,
    Task, TaskState, Timestamp,
};
use idem_store::feed::{FeedCursor, FeedRead};
use idem_store::identity::{DatabaseIdentity, RecordedIdentity, StoreIdentity};
use idem_store::ops::console::{ConsoleSession, ConsoleTx, QueueDepth, TaskCount};
use idem_store::ops::search::TaskSearch;
use idem_store::ops::{Operation, TaskQuery};
use idem_store::{Result, ScopeRow, StoreError, Tx};
use uuid::Uuid;

use crate::setup::{Setup, TENANTS, at};
use crate::state::{Scope, State, TaskRow};

/// A read the model never makes (search, console, the feed, event history,
/// shared secrets): the in-memory store does not hold what it needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not modelled by the in-memory store: {0}")]
pub struct NotModelled(pub &'static str);

impl From<NotModelled> for StoreError {
    fn from(e: NotModelled) -> StoreError {
        StoreError::Unavailable(e.to_string())
    }
}

fn not_modelled<T>(what: &'static str) -> Result<T> {
    Err(NotModelled(what).into())
}

/// One transaction over `state`.
pub struct MemTx<'a> {
    state: &'a mut State,
    setup: &'a Setup,
    /// The model's bound on attempts per task: tasks that have had this many
    /// are not offered to a claim (`None`: no bound, as in the drain).
    claim_bound: Option<i64>,
    /// The last id handed out.
    last_id: u128,
}

impl<'a> MemTx<'a> {
    /// A transaction over `state`; claims skip tasks with `claim_bound`
    /// attempts or more.
    pub fn new(state: &'a mut State, setup: &'a Setup, claim_bound: Option<i64>) -> MemTx<'a> {
        let last_id = state
            .tasks
            .iter()
            .flat_map(|r| std::iter::once(r.task.id).chain(r.attempts.iter().map(|a| a.id)))
            .map(|id| id.as_u128())
            .max()
            .unwrap_or(0);
        MemTx {
            state,
            setup,
            claim_bound,
            last_id,
        }
    }

    fn row(&mut self, task_id: Uuid) -> Result<&mut TaskRow> {
        self.state
            .tasks
            .iter_mut()
            .find(|r| r.task.id == task_id)
            .ok_or_else(|| StoreError::Corrupt(format!("no task {task_id}")))
    }

    fn api_key_record(&self, id: Uuid) -> Option<ApiKey> {
        let t = self.setup.api_keys.iter().position(|k| k.id == id)?;
        let mut key = self.setup.api_keys[t].clone();
        if self.state.revoked & (1 << t) != 0 {
            // The model keeps that a key is revoked, not when.
            key.revoked_at = Some(Timestamp(0));
        }
        Some(key)
    }
}

/// Runs `op` as one transaction over `state` (the model's step holds a copy
/// and drops it when the operation fails).
///
/// # Errors
/// What the operation's transaction failed with.
pub fn run<O: Operation>(
    state: &mut State,
    setup: &Setup,
    claim_bound: Option<i64>,
    op: &O,
) -> Result<O::Reply> {
    futures::executor::block_on(op.run(&mut MemTx::new(state, setup, claim_bound)))
}

/// An attempt as its row stores it: without evidence (the evidence table
/// holds that).
fn row_of(a: &Attempt) -> Attempt {
    let mut a = a.clone();
    a.evidence.clear();
    a
}

impl Tx for MemTx<'_> {
    fn new_id(&mut self) -> Uuid {
        self.last_id += 1;
        Uuid::from_u128(self.last_id)
    }

    async fn now(&mut self) -> Result<Timestamp> {
        Ok(at(self.state.clock))
    }

    async fn shared_secret(
        &mut self,
        _name: &str,
        _candidate: &[u8; 32],
        _now: Timestamp,
    ) -> Result<Vec<u8>> {
        not_modelled("shared secrets")
    }

    async fn insert_api_key(&mut self, _key: &ApiKey, _hash: &str) -> Result<()> {
        not_modelled("creating API keys (the model's keys are fixed)")
    }

    async fn api_key_by_hash(&mut self, _hash: &str) -> Result<Option<ApiKey>> {
        not_modelled("authentication")
    }

    async fn api_key(&mut self, id: Uuid) -> Result<Option<ApiKey>> {
        Ok(self.api_key_record(id))
    }

    async fn revoke_api_key(&mut self, id: Uuid, _at: Timestamp) -> Result<Option<ApiKey>> {
        let Some(t) = self.setup.api_keys.iter().position(|k| k.id == id) else {
            return Ok(None);
        };
        self.state.revoked |= 1 << t;
        Ok(self.api_key_record(id))
    }

    async fn list_api_keys(&mut self) -> Result<Vec<ApiKey>> {
        let ids: Vec<Uuid> = self.setup.api_keys.iter().map(|k| k.id).collect();
        Ok(ids
            .into_iter()
            .filter_map(|id| self.api_key_record(id))
            .collect())
    }

    async fn insert_scope(&mut self, row: &ScopeRow) -> Result<bool> {
        let key = self
            .setup
            .key_index(&row.tenant, &row.operation, &row.idempotency_key)
            .ok_or_else(|| StoreError::Corrupt(format!("no model key {row:?}")))?;
        if self.state.scopes.iter().any(|sc| sc.key == key) {
            return Ok(false);
        }
        self.state.scopes.push(Scope {
            key,
            fingerprint: row.fingerprint.clone(),
            task_id: row.task_id,
        });
        Ok(true)
    }

    async fn scope(
        &mut self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<Option<ScopeRow>> {
        let Some(k) = self.setup.key_index(tenant, operation, key) else {
            return Ok(None);
        };
        Ok(self
            .state
            .scopes
            .iter()
            .find(|sc| sc.key == k)
            .map(|sc| ScopeRow {
                tenant: tenant.to_owned(),
                operation: operation.to_owned(),
                idempotency_key: key.to_owned(),
                fingerprint: sc.fingerprint.clone(),
                task_id: sc.task_id,
            }))
    }

    async fn lock_rate(&mut self, _scope: &str) -> Result<i64> {
        not_modelled("rate limits")
    }

    async fn set_rate(&mut self, _scope: &str, _tat_us: i64) -> Result<()> {
        not_modelled("rate limits")
    }

    async fn take_slots(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        slots: &[idem_store::caps::CapSlot],
    ) -> Result<Option<usize>> {
        for (i, s) in slots.iter().enumerate() {
            // A slot whose attempt no longer holds its task's lease is free.
            let tasks = &self.state.tasks;
            self.state.slots.retain(|row| {
                row.scope != s.scope
                    || tasks.iter().any(|r| {
                        r.task.id == row.task_id
                            && r.task.control.active_attempt_id == Some(row.attempt_id)
                    })
            });
            let taken = |n: i64| {
                self.state
                    .slots
                    .iter()
                    .any(|row| row.scope == s.scope && row.slot == n)
            };
            let free = (0..s.cap).find(|&n| !taken(n));
            match free {
                Some(slot) => {
                    self.state.slots.push(crate::state::Slot {
                        scope: s.scope.clone(),
                        slot,
                        task_id,
                        attempt_id,
                    });
                    self.state
                        .slots
                        .sort_by(|a, b| (&a.scope, a.slot).cmp(&(&b.scope, b.slot)));
                }
                None => {
                    self.state
                        .slots
                        .retain(|row| !(row.task_id == task_id && row.attempt_id == attempt_id));
                    return Ok(Some(i));
                }
            }
        }
        Ok(None)
    }

    async fn free_slots(&mut self, task_id: Uuid, keep: Option<Uuid>) -> Result<()> {
        self.state
            .slots
            .retain(|row| row.task_id != task_id || Some(row.attempt_id) == keep);
        Ok(())
    }

    async fn delete_scope(&mut self, task_id: Uuid) -> Result<()> {
        self.state.scopes.retain(|sc| sc.task_id != task_id);
        Ok(())
    }

    async fn insert_task(&mut self, task: &Task) -> Result<()> {
        if self.state.task_index(task.id).is_some() {
            return Err(StoreError::Corrupt(format!("task {} exists", task.id)));
        }
        let key = self
            .setup
            .key_index(&task.control.tenant, &task.operation, &task.idempotency_key)
            .ok_or_else(|| StoreError::Corrupt(format!("no model key for task {}", task.id)))?;
        self.state.tasks.push(TaskRow {
            key,
            task: task.clone(),
            attempts: Vec::new(),
            stale_report_kept: false,
            effect_possible: false,
            deliveries: 0,
            cancel_lost_to_delivery: false,
            pending_cancel_confirmed: false,
            repeat_kept: false,
        });
        self.state.ledger.push(Default::default());
        Ok(())
    }

    async fn task(&mut self, id: Uuid, _lock: bool) -> Result<Option<Task>> {
        Ok(self
            .state
            .tasks
            .iter()
            .find(|r| r.task.id == id)
            .map(|r| r.task.clone()))
    }

    async fn update_task(
        &mut self,
        task: &Task,
        expected_version: i64,
        expected_generation: i64,
    ) -> Result<()> {
        let row = self.row(task.id)?;
        if row.task.control.version != expected_version
            || row.task.generation != expected_generation
        {
            return Err(StoreError::Contention(format!(
                "task {} changed concurrently",
                task.id
            )));
        }
        row.task = task.clone();
        // Not modelled (see `effects`): kept out of the state, so the
        // state space is the protocol's alone.
        row.task.second_effects.clear();
        row.task.control.effect_reports.clear();
        row.task.control.version = expected_version + 1;
        Ok(())
    }

    async fn insert_attempt(&mut self, attempt: &Attempt) -> Result<()> {
        let row = self.row(attempt.task_id)?;
        if row
            .attempts
            .iter()
            .any(|a| a.number == attempt.number || a.generation == attempt.generation)
        {
            return Err(StoreError::Contention(format!(
                "attempt #{} of task {} exists",
                attempt.number, attempt.task_id
            )));
        }
        row.attempts.push(row_of(attempt));
        Ok(())
    }

    async fn update_attempt(&mut self, attempt: &Attempt) -> Result<()> {
        let row = self.row(attempt.task_id)?;
        let stored = row
            .attempt_mut(attempt.id)
            .ok_or_else(|| StoreError::Corrupt(format!("no attempt {}", attempt.id)))?;
        *stored = row_of(attempt);
        Ok(())
    }

    async fn attempt(&mut self, id: Uuid) -> Result<Option<Attempt>> {
        Ok(self
            .state
            .tasks
            .iter()
            .flat_map(|r| &r.attempts)
            .find(|a| a.id == id)
            .cloned())
    }

    async fn attempts(&mut self, task_id: Uuid) -> Result<Vec<Attempt>> {
        Ok(self.row(task_id)?.attempts.clone())
    }

    async fn insert_evidence(
        &mut self,
        task_id: Uuid,
        _attempt_id: Uuid,
        ev: &Evidence,
    ) -> Result<()> {
        let row = self.row(task_id)?;
        match ev.disposition {
            Disposition::StaleGeneration if ev.outcome != EvidenceOutcome::Ack => {
                row.stale_report_kept = true;
            }
            Disposition::Repeat => row.repeat_kept = true,
            _ => {}
        }
        Ok(())
    }

    async fn effects(&mut self, task_id: Uuid) -> Result<(Vec<EffectReport>, Vec<SecondEffect>)> {
        // Effect reports and second effects are not kept (no property reads
        // them: detection and audit only); the task must exist.
        self.row(task_id).map(|_| (Vec::new(), Vec::new()))
    }

    async fn insert_effect_report(&mut self, task_id: Uuid, _r: &EffectReport) -> Result<()> {
        self.row(task_id).map(|_| ())
    }

    async fn insert_second_effect(&mut self, task_id: Uuid, _s: &SecondEffect) -> Result<()> {
        self.row(task_id).map(|_| ())
    }

    async fn acknowledge_second_effect(&mut self, task_id: Uuid, _s: &SecondEffect) -> Result<()> {
        self.row(task_id).map(|_| ())
    }

    async fn insert_events(&mut self, task_id: Uuid, _events: &[Event]) -> Result<()> {
        // Events are not kept; the task must exist, as the foreign key asks.
        self.row(task_id).map(|_| ())
    }

    async fn events(&mut self, _task_id: Uuid) -> Result<Vec<Event>> {
        not_modelled("event history")
    }

    async fn feed(
        &mut self,
        _tenant: &str,
        _operations: Option<&[String]>,
        _after: FeedCursor,
        _limit: i64,
    ) -> Result<FeedRead> {
        not_modelled("the event feed")
    }

    async fn claimable(
        &mut self,
        tenant: &str,
        operations: &[String],
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>> {
        let classes: HashSet<&str> = operations.iter().map(String::as_str).collect();
        let bound = self.claim_bound;
        let mut found: Vec<(i64, Uuid)> = self
            .state
            .tasks
            .iter()
            .map(|r| &r.task)
            .filter(|t| {
                t.control.tenant == tenant
                    && classes.contains(t.operation.as_str())
                    && t.control.active_attempt_id.is_none()
                    && matches!(
                        t.state,
                        TaskState::Queued | TaskState::RetryWait | TaskState::Reconciling
                    )
                    && t.control.ready_at <= now
                    && bound.is_none_or(|b| t.attempt_count < b)
            })
            .map(|t| (idem_store::claim_rank(t), t.id))
            .collect();
        found.sort_unstable();
        found.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(found.into_iter().map(|(_, id)| id).collect())
    }

    async fn expired_leases(&mut self, now: Timestamp, limit: i64) -> Result<Vec<(Uuid, Uuid)>> {
        let mut found: Vec<(Timestamp, Uuid, Uuid)> = self
            .state
            .tasks
            .iter()
            .flat_map(|r| &r.attempts)
            .filter(|a| a.state.is_active() && a.lease_expires_at <= now)
            .map(|a| (a.lease_expires_at, a.task_id, a.id))
            .collect();
        found.sort_by_key(|f| f.0);
        found.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(found.into_iter().map(|(_, t, a)| (t, a)).collect())
    }

    async fn due_wakeups(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>> {
        let mut found: Vec<(Timestamp, Uuid)> = self
            .state
            .tasks
            .iter()
            .map(|r| &r.task)
            .filter(|t| t.state == TaskState::RetryWait && t.control.ready_at <= now)
            .map(|t| (t.control.ready_at, t.id))
            .collect();
        found.sort_by_key(|f| f.0);
        found.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(found.into_iter().map(|(_, id)| id).collect())
    }

    async fn expired_scopes(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>> {
        let mut found: Vec<(Timestamp, Uuid)> = self
            .state
            .scopes
            .iter()
            .filter_map(|sc| {
                let t = &self.state.tasks[self.state.task_index(sc.task_id)?].task;
                let expires = t.control.key_expires_at?;
                (expires <= now).then_some((expires, t.id))
            })
            .collect();
        found.sort_by_key(|f| f.0);
        found.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(found.into_iter().map(|(_, id)| id).collect())
    }

    // The store's identity (the rewind after a database went back in time)
    // is not modelled: the model's store never changes database, so its
    // identity is always current and nothing is recorded.

    async fn database_identity(&mut self) -> Result<Option<DatabaseIdentity>> {
        Ok(None)
    }

    async fn recorded_identity(&mut self) -> Result<Option<RecordedIdentity>> {
        Ok(None)
    }

    async fn record_identity(
        &mut self,
        _expected: Option<&StoreIdentity>,
        _new: &StoreIdentity,
    ) -> Result<bool> {
        not_modelled("recording the store's identity")
    }

    async fn mark_restored(&mut self) -> Result<bool> {
        not_modelled("marking a store restored")
    }

    async fn identity_is_current(&mut self) -> Result<bool> {
        Ok(true)
    }

    async fn unfinished_tasks(&mut self, _after: Option<Uuid>, _limit: i64) -> Result<Vec<Uuid>> {
        not_modelled("the rewind's walk over unfinished tasks")
    }
}

impl TaskSearch for MemTx<'_> {
    async fn search_tasks(
        &mut self,
        _tenant: &str,
        _operations: Option<&[String]>,
        _q: &TaskQuery,
    ) -> Result<Vec<Task>> {
        not_modelled("task search")
    }
}

impl ConsoleTx for MemTx<'_> {
    async fn insert_console_session(
        &mut self,
        _session: &ConsoleSession,
        _token_hash: &str,
    ) -> Result<()> {
        not_modelled("console sessions")
    }

    async fn purge_console_sessions(&mut self, _before: Timestamp, _limit: i64) -> Result<u64> {
        not_modelled("console sessions")
    }

    async fn active_console_session(
        &mut self,
        _token_hash: &str,
        _now: Timestamp,
    ) -> Result<Option<(ConsoleSession, ApiKey)>> {
        not_modelled("console sessions")
    }

    async fn end_console_session(&mut self, _token_hash: &str, _at: Timestamp) -> Result<bool> {
        not_modelled("console sessions")
    }

    async fn task_counts(
        &mut self,
        _tenant: &str,
        _operations: Option<&[String]>,
    ) -> Result<Vec<TaskCount>> {
        not_modelled("the console overview")
    }

    async fn queue_depths(
        &mut self,
        _tenant: Option<&str>,
        _operations: Option<&[String]>,
        _now: Timestamp,
    ) -> Result<Vec<QueueDepth>> {
        not_modelled("the console overview")
    }

    async fn queue_ready_at(
        &mut self,
        _tenant: &str,
        _operation: &str,
        _now: Timestamp,
        _rank: i64,
    ) -> Result<Option<Timestamp>> {
        not_modelled("the console overview")
    }

    async fn stale_reconciling(
        &mut self,
        _tenant: &str,
        _operations: Option<&[String]>,
        _unchanged_since: Timestamp,
        _limit: i64,
    ) -> Result<Vec<Task>> {
        not_modelled("the console overview")
    }

    async fn failed_since(
        &mut self,
        _tenant: &str,
        _operations: Option<&[String]>,
        _since: Timestamp,
        _limit: i64,
    ) -> Result<Vec<Task>> {
        not_modelled("the console overview")
    }

    async fn cancel_requested(
        &mut self,
        _tenant: &str,
        _operations: Option<&[String]>,
        _limit: i64,
    ) -> Result<Vec<Task>> {
        not_modelled("the console overview")
    }
}

/// The tenant name of tenant index `t`.
pub fn tenant_name(t: u8) -> &'static str {
    TENANTS[usize::from(t) % TENANTS.len()]
}
