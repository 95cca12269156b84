//! Submissions (SPEC §2.1–2.3 and §4 `POST /v1/tasks`) and [`SubmitPlan`],
//! the one sequence of statements every submit runs.
//!
//! A submit batch is one transaction of four steps, each one statement (or
//! one per row on a backend without multi-row statements):
//! 1. **keys checked**: the clock and which submitting API keys are live,
//!    read inside the writing transaction, so a key revoked before this check
//!    is refused by the database even when the HTTP layer had it cached; its
//!    submissions touch nothing and answer [`SubmitOutcome::KeyRevoked`];
//! 2. **scope rows**: `INSERT … ON CONFLICT DO NOTHING` of one row per
//!    submission, each naming a fresh task id: the unique constraint alone
//!    decides which submission gets a task; then the **rate limits**
//!    (step 2b): the winners that carry rate limits take a token
//!    of each of their buckets ([`super::rates::take_tokens`]); a winner
//!    refused for want of one has its scope row deleted again, so it writes
//!    nothing and the idempotency key stays free, and answers
//!    [`SubmitOutcome::RateLimited`] (SPEC §8.1). Replays and conflicts
//!    lost the scope row, so they are never charged nor refused;
//! 3. **accept winners**: the tasks of the rows this transaction inserted,
//!    with their `task_submitted` events;
//! 4. **read back**: the scope rows it did not insert, with their tasks, in a
//!    later statement (under READ COMMITTED a new statement has a new
//!    snapshot, so it sees the row that won, committed), and
//! 5. **answers**: created for the winners; for the others a replay when the
//!    fingerprint matches (or the request is the accepted one under its frozen
//!    contract), else a conflict.
//!
//! Two submissions of one scope in one batch behave as if sent one after the
//! other. [`SubmitPlan::run`] executes the plan over any [`Tx`]; a backend
//! may send the same statements another way (PostgreSQL pipelines them) by
//! calling the plan's steps itself, which still decide every answer.

use std::collections::HashSet;

use idem_core::fingerprint::canonical_request;
use idem_core::machine::{self, NewTask};
use idem_core::model::{Event, Task, Timestamp};
use uuid::Uuid;

use super::Operation;
use crate::{ExistingScope, Result, ScopeRow, StoreError, Tx};

pub use crate::tx::Submission;

/// What a submission did.
#[derive(Debug, Clone, PartialEq)]
pub enum SubmitOutcome {
    /// A new task was accepted.
    Created(Task),
    /// Same scope and fingerprint: the original task.
    Replayed(Task),
    /// Same scope, different fingerprint: nothing changed. The original
    /// task, as the submit's transaction read it (its contract names the
    /// material fields a conflict's answer compares).
    Conflict {
        /// The original task.
        task: Box<Task>,
    },
    /// The submitting API key was revoked (or is gone) when the transaction
    /// checked it: nothing changed, and no replay or conflict was revealed
    /// (SPEC §4 Auth, `UNAUTHENTICATED`).
    KeyRevoked {
        /// The refused key.
        api_key_id: Uuid,
    },
    /// A new task, refused for want of a token of one of its rate-limit
    /// buckets (SPEC §8.1): nothing was written and the idempotency key is
    /// still free.
    RateLimited {
        /// Milliseconds until every bucket of the submission has a token (>= 1).
        retry_after_ms: i64,
    },
}

/// Submit one task. Backends gather these into submit batches.
#[derive(Debug, Clone)]
pub struct Submit(pub Submission);

impl Operation for Submit {
    type Reply = SubmitOutcome;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<SubmitOutcome> {
        SubmitPlan::run(tx, std::slice::from_ref(&self.0))
            .await?
            .pop()
            .ok_or_else(|| StoreError::Corrupt("submit produced no outcome".into()))
    }
}

/// Submit several tasks in one transaction; the outcomes, in request order,
/// are those of submitting each in order.
#[derive(Debug, Clone)]
pub struct SubmitBatch(pub Vec<Submission>);

impl Operation for SubmitBatch {
    type Reply = Vec<SubmitOutcome>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Vec<SubmitOutcome>> {
        SubmitPlan::run(tx, &self.0).await
    }
}

/// A submit batch between its steps (see the module doc): built from the
/// submissions, narrowed to the live keys' by [`SubmitPlan::check_keys`],
/// then turned into [`Accepted`] by the scope rows won.
#[derive(Debug)]
pub struct SubmitPlan<'s> {
    subs: &'s [Submission],
    /// The distinct submitting keys, sorted.
    keys: Vec<Uuid>,
    /// Indices into `subs` of the submissions still in the plan (all until
    /// [`SubmitPlan::check_keys`] refuses some).
    live: Vec<usize>,
    /// One scope row per `live` submission, each naming a fresh task id
    /// (UUID v7) that becomes the task's id if the row wins.
    rows: Vec<ScopeRow>,
    /// Submissions refused for a rate limit, with the ms until a token
    /// ([`SubmitPlan::charge_rates`]).
    refused: Vec<(usize, i64)>,
}

impl<'s> SubmitPlan<'s> {
    /// The plan of `subs`, every key assumed live, each scope row naming a
    /// fresh UUID v7.
    pub fn new(subs: &'s [Submission]) -> SubmitPlan<'s> {
        SubmitPlan::with_ids(subs, Uuid::now_v7)
    }

    /// The plan of `subs`, every key assumed live, each scope row naming
    /// the next id of `new_id` (in request order; [`Tx::new_id`]).
    pub fn with_ids(subs: &'s [Submission], mut new_id: impl FnMut() -> Uuid) -> SubmitPlan<'s> {
        let mut keys: Vec<Uuid> = subs.iter().map(|s| s.api_key_id).collect();
        keys.sort_unstable();
        keys.dedup();
        SubmitPlan {
            subs,
            keys,
            live: (0..subs.len()).collect(),
            rows: subs.iter().map(|s| scope_row(s, new_id())).collect(),
            refused: Vec::new(),
        }
    }

    /// Runs the plan in the open transaction `tx`, one step after the other;
    /// one outcome per submission, in request order.
    ///
    /// # Errors
    /// Any [`StoreError`] of the statements; [`StoreError::Contention`] when a
    /// taken scope row vanished before it was read back (retry the batch).
    pub async fn run<T: Tx>(tx: &mut T, subs: &[Submission]) -> Result<Vec<SubmitOutcome>> {
        let mut plan = SubmitPlan::with_ids(subs, || tx.new_id());
        let (now, live) = tx.now_and_live_api_keys(plan.keys()).await?;
        plan.check_keys(&live);
        let mut won = if plan.scope_rows().is_empty() {
            Vec::new()
        } else {
            tx.insert_scopes(plan.scope_rows()).await?
        };
        plan.charge_rates(tx, &mut won, now).await?;
        let accepted = plan.accept(&won, now)?;
        let (tasks, events) = accepted.new_tasks();
        if !tasks.is_empty() {
            tx.insert_tasks_with_events(tasks, events).await?;
        }
        let existing = if accepted.taken().is_empty() {
            Vec::new()
        } else {
            let mut existing = tx.scopes_with_tasks(accepted.taken()).await?;
            super::scopes_with_second_effects(tx, &mut existing).await?;
            existing
        };
        accepted.answer_all(existing)
    }

    /// Step 1: the distinct submitting keys, sorted (the argument of
    /// [`Tx::now_and_live_api_keys`]).
    pub fn keys(&self) -> &[Uuid] {
        &self.keys
    }

    /// Step 1's answer: keeps only the submissions whose key is in `live`
    /// (the others answer [`SubmitOutcome::KeyRevoked`]); `true` when every
    /// key was live, so the scope rows are those the plan started with.
    pub fn check_keys(&mut self, live: &HashSet<Uuid>) -> bool {
        if self.keys.iter().all(|k| live.contains(k)) {
            return true;
        }
        let subs = self.subs;
        let kept: Vec<(usize, ScopeRow)> = self
            .live
            .iter()
            .copied()
            .zip(std::mem::take(&mut self.rows))
            .filter(|(i, _)| live.contains(&subs[*i].api_key_id))
            .collect();
        (self.live, self.rows) = kept.into_iter().unzip();
        false
    }

    /// Whether a submission carries rate limits (a backend that cannot run
    /// [`SubmitPlan::charge_rates`] between its steps runs such a batch with
    /// [`SubmitPlan::run`]).
    pub fn has_rate_limits(subs: &[Submission]) -> bool {
        subs.iter().any(|s| !s.rate_limits.is_empty())
    }

    /// Step 2b: the winners (`won`, as step 2 answered) that carry rate
    /// limits take their tokens at `now` (ms); each one refused has its
    /// scope row deleted, leaves the plan and answers
    /// [`SubmitOutcome::RateLimited`], as does a later submission of the
    /// same scope in the batch (it would be new as well). `won` is
    /// narrowed to the submissions left.
    ///
    /// # Errors
    /// Any [`StoreError`] of the statements; [`StoreError::Corrupt`] when
    /// `won` does not have one entry per row.
    pub async fn charge_rates<T: Tx>(
        &mut self,
        tx: &mut T,
        won: &mut Vec<bool>,
        now: Timestamp,
    ) -> Result<()> {
        if won.len() != self.rows.len() {
            return Err(StoreError::Corrupt(format!(
                "{} scope rows answered for {}",
                won.len(),
                self.rows.len()
            )));
        }
        let subs = self.subs;
        let charged: Vec<usize> = (0..self.rows.len())
            .filter(|&j| won[j] && !subs[self.live[j]].rate_limits.is_empty())
            .collect();
        if charged.is_empty() {
            return Ok(());
        }
        let wanted: Vec<&[(String, idem_core::flow::RateLimit)]> = charged
            .iter()
            .map(|&j| subs[self.live[j]].rate_limits.as_slice())
            .collect();
        let taken = super::rates::take_tokens(tx, &wanted, now).await?;
        let mut drop_rows: Vec<(usize, i64)> = Vec::new();
        for (&j, t) in charged.iter().zip(taken) {
            if let Err(wait_ms) = t {
                tx.delete_scope(self.rows[j].task_id).await?;
                drop_rows.push((j, wait_ms));
                // Later submissions of this scope in the batch lost to the
                // deleted row: they are new submissions too.
                let scope = subs[self.live[j]].scope();
                drop_rows.extend(
                    (j + 1..self.rows.len())
                        .filter(|&k| !won[k] && subs[self.live[k]].scope() == scope)
                        .map(|k| (k, wait_ms)),
                );
            }
        }
        if drop_rows.is_empty() {
            return Ok(());
        }
        let mut keep = vec![true; self.rows.len()];
        for (j, wait_ms) in drop_rows {
            if std::mem::replace(&mut keep[j], false) {
                self.refused.push((self.live[j], wait_ms));
            }
        }
        let mut k = keep.iter();
        self.live.retain(|_| k.next().copied().unwrap_or(true));
        let mut k = keep.iter();
        self.rows.retain(|_| k.next().copied().unwrap_or(true));
        let mut k = keep.iter();
        won.retain(|_| k.next().copied().unwrap_or(true));
        Ok(())
    }

    /// Step 2: the scope rows to insert, in request order (of the
    /// submissions still in the plan).
    pub fn scope_rows(&self) -> &[ScopeRow] {
        &self.rows
    }

    /// Step 2's answer: `won[i]` tells whether this transaction inserted
    /// `scope_rows()[i]`. The winners become tasks accepted at `now` (the
    /// transaction's clock, ms) with their `task_submitted` events.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when `won` does not have one entry per row.
    pub fn accept(self, won: &[bool], now: Timestamp) -> Result<Accepted<'s>> {
        if won.len() != self.rows.len() {
            return Err(StoreError::Corrupt(format!(
                "{} scope rows answered for {}",
                won.len(),
                self.rows.len()
            )));
        }
        let mut created = Vec::new();
        let mut events = Vec::new();
        let mut taken = Vec::new();
        for ((&i, row), &won) in self.live.iter().zip(&self.rows).zip(won) {
            let s = &self.subs[i];
            if won {
                let (mut task, j) = machine::accept(
                    NewTask {
                        id: row.task_id,
                        tenant: s.tenant.clone(),
                        operation: s.operation.clone(),
                        idempotency_key: s.idempotency_key.clone(),
                        fingerprint: s.fingerprint.clone(),
                        canonical_request: s.canonical_request.clone(),
                        params: s.params.clone(),
                        contract: s.contract.clone(),
                        api_key_id: s.api_key_id,
                        grant: s.grant.clone(),
                        traceparent: s.traceparent.clone(),
                        priority: s.priority,
                        fairness_key: s.fairness_key.clone(),
                    },
                    now,
                );
                task.control.concurrency_key = s.concurrency_key.clone();
                created.push(task);
                events.push(j.events);
            } else {
                taken.push(s.scope());
            }
        }
        Ok(Accepted {
            subs: self.subs,
            live: self.live,
            won: won.to_vec(),
            created,
            events,
            taken,
            refused: self.refused,
        })
    }

    /// The plan of a read that writes nothing (answering retries): every
    /// live submission's scope is read back as if taken.
    pub fn read_only(self) -> Accepted<'s> {
        Accepted {
            subs: self.subs,
            taken: self.live.iter().map(|&i| self.subs[i].scope()).collect(),
            won: vec![false; self.live.len()],
            live: self.live,
            created: Vec::new(),
            events: Vec::new(),
            refused: self.refused,
        }
    }
}

/// The scope row of `s`, naming the fresh task id `task_id`.
fn scope_row(s: &Submission, task_id: Uuid) -> ScopeRow {
    ScopeRow {
        tenant: s.tenant.clone(),
        operation: s.operation.clone(),
        idempotency_key: s.idempotency_key.clone(),
        fingerprint: s.fingerprint.clone(),
        task_id,
    }
}

/// A submit batch after its scope rows (steps 3–5 of the module doc).
#[derive(Debug)]
pub struct Accepted<'s> {
    subs: &'s [Submission],
    live: Vec<usize>,
    won: Vec<bool>,
    created: Vec<Task>,
    events: Vec<Vec<Event>>,
    taken: Vec<(String, String, String)>,
    refused: Vec<(usize, i64)>,
}

impl Accepted<'_> {
    /// Step 3: the new tasks and their events (`events[i]` belongs to
    /// `tasks[i]`), to insert.
    pub fn new_tasks(&self) -> (&[Task], &[Vec<Event>]) {
        (&self.created, &self.events)
    }

    /// Step 4: the scopes to read back, in request order
    /// ([`Tx::scopes_with_tasks`]).
    pub fn taken(&self) -> &[(String, String, String)] {
        &self.taken
    }

    /// Step 5: one answer per submission, in request order, from `existing`
    /// (one per [`Accepted::taken`] entry). `None` for a submission whose
    /// scope row was gone when it was read (released by retention in
    /// between): that one must be submitted again.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when a scope row points at a missing task or
    /// `existing` does not line up.
    pub fn answer(self, existing: Vec<ExistingScope>) -> Result<Vec<Option<SubmitOutcome>>> {
        if existing.len() != self.taken.len() {
            return Err(StoreError::Corrupt(format!(
                "{} scopes read back for {}",
                existing.len(),
                self.taken.len()
            )));
        }
        let mut out: Vec<Option<SubmitOutcome>> = self
            .subs
            .iter()
            .map(|s| {
                Some(SubmitOutcome::KeyRevoked {
                    api_key_id: s.api_key_id,
                })
            })
            .collect();
        for &(i, retry_after_ms) in &self.refused {
            out[i] = Some(SubmitOutcome::RateLimited { retry_after_ms });
        }
        let mut existing = existing.into_iter();
        let mut fresh = self.created.into_iter();
        for (&i, won) in self.live.iter().zip(self.won) {
            let s = &self.subs[i];
            out[i] = if won {
                Some(SubmitOutcome::Created(fresh.next().ok_or_else(|| {
                    StoreError::Corrupt("batch lost a created task".into())
                })?))
            } else {
                match existing.next().flatten() {
                    None => None,
                    Some((row, Some(task))) if row.fingerprint != s.fingerprint => {
                        // Fingerprinted under material fields the configuration
                        // changed since the task was accepted, the same request
                        // is still the same request: the original task.
                        if same_request_as_accepted(&task, s) {
                            Some(SubmitOutcome::Replayed(task))
                        } else {
                            Some(SubmitOutcome::Conflict {
                                task: Box::new(task),
                            })
                        }
                    }
                    Some((_, Some(task))) => Some(SubmitOutcome::Replayed(task)),
                    Some((row, None)) => {
                        return Err(StoreError::Corrupt(format!(
                            "scope row points at missing task {}",
                            row.task_id
                        )));
                    }
                }
            };
        }
        Ok(out)
    }

    /// [`Accepted::answer`] on the write path, where every submission must be
    /// answered.
    ///
    /// # Errors
    /// As [`Accepted::answer`]; [`StoreError::Contention`] when a scope row
    /// vanished before it was read back (the batch rolls back and runs again).
    pub fn answer_all(self, existing: Vec<ExistingScope>) -> Result<Vec<SubmitOutcome>> {
        self.answer(existing)?
            .into_iter()
            .map(|o| o.ok_or_else(|| StoreError::Contention("scope row vanished; retry".into())))
            .collect()
    }
}

/// Whether the request comparison is broken on purpose: every request of the
/// task's operation is taken for the accepted one, so a changed request under
/// a taken scope is answered as a replay (SPEC §2.3 broken). Only the
/// `broken-same-request` feature sets it, which exists so the model checker
/// can show it finds the break (`idem-lab verify`); no release build enables it.
const BROKEN_SAME_REQUEST: bool = cfg!(feature = "broken-same-request");

/// Whether `s` is the request `task` was accepted with, as a submit to its
/// scope judges it: the same fingerprint, or the same request under the
/// material fields frozen in its contract (`same_request_as_accepted`).
/// `true` answers `s` with a replay of `task`, `false` with a conflict.
pub fn is_same_request(task: &Task, s: &Submission) -> bool {
    task.fingerprint == s.fingerprint || same_request_as_accepted(task, s)
}

/// Whether `s`, whose fingerprint differs from `task`'s (the one its scope
/// was bound with), is nevertheless the request the task was accepted with: the
/// same operation, and the same fingerprint when computed under the material
/// fields frozen in the task's contract (RFC 8785, so `1250`, `1250.0` and
/// `1.25e3` are one number). A task accepted before its contract froze the
/// fields is compared by its whole canonical params instead. Only reached when
/// the fingerprints differ, which under an unchanged configuration means the
/// requests differ; so this never turns a different request into a replay.
fn same_request_as_accepted(task: &Task, s: &Submission) -> bool {
    if task.operation != s.operation {
        return false;
    }
    if BROKEN_SAME_REQUEST {
        return true;
    }
    match &task.contract.fingerprint {
        Some(material) => canonical_request(&s.operation, &s.params, material)
            .is_ok_and(|c| c.fingerprint.to_string() == task.fingerprint),
        None => match (
            canonical_request(&s.operation, &s.params, &[]),
            canonical_request(&task.operation, &task.params, &[]),
        ) {
            (Ok(a), Ok(b)) => a.canonical == b.canonical,
            _ => false,
        },
    }
}
