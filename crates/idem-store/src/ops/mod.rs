//! Every operation of idem, written once over [`Tx`].
//!
//! Each operation is a struct implementing [`Operation`]: its fields are the
//! request, [`Operation::Reply`] is its result, and [`Operation::run`] is one
//! transaction: load the rows (the task with a row lock), apply one pure
//! transition of [`idem_core::machine`], and write back the task with a
//! compare-and-set on `(version, generation)`, the attempt, the new evidence
//! and the new events. A refusal that must leave evidence (a stale report) is
//! committed and returned inside the reply.
//!
//! A backend receives an operation as an [`Op`]: one variant per operation,
//! each a [`Call`] carrying the operation and the channel of its typed reply.
//! It runs any `Op` through its own [`Runner`] (one transaction per operation,
//! or a savepoint in a shared one) with [`Op::run_with`], which hands back a
//! [`Pending`] answer to send once the transaction has committed, or to fail
//! when it did not.
//!
//! Families: [`keys`] (API keys), [`submit`] (submissions and the one
//! [`submit::SubmitPlan`]), [`claim`], [`rates`] (rate limits), [`attempts`] (heartbeats,
//! acknowledgments, reports, releases), [`keyed`] (a claim or report
//! whose executor key is checked in its transaction), [`tasks`] (reads, cancellation, delivery),
//! [`search`] (a tenant's tasks in pages), [`operator`] (an admin's
//! retry-now, cancel, resolve, redrive), [`feed`] (a task's history with its
//! state, the tenant feed), [`console`] (the operator console's sessions and
//! overview), [`sweep`] and [`identity`] (the store's identity check).

use std::future::Future;
use std::sync::Arc;

use idem_core::machine::Journal;
use idem_core::model::Task;
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::{Refusal, Result, StoreError, Tx};

pub mod attempts;
pub mod claim;
pub mod console;
pub mod feed;
pub mod identity;
pub mod keyed;
pub mod keys;
pub mod operator;
pub mod rates;
pub mod search;
pub mod submit;
pub mod sweep;
pub mod tasks;

pub use attempts::{Acknowledge, AttemptTenant, Heartbeat, Release, Report};
pub use claim::{Claim, ClaimFlow, ClaimRequest, Claimed};
pub use console::{
    AllQueueDepths, ConsoleSession, ConsoleSessionLookup, CreateConsoleSession, EndConsoleSession,
    Overview, OverviewQuery, QueueDepth, QueueStat, Queues, TaskCount, TaskOverview, TaskQueues,
};
pub use feed::{ReadFeed, TaskHistory};
pub use identity::{CheckIdentity, MarkRestored};
pub use keyed::{ClaimAs, ReportAs};
pub use keys::{Authenticate, CreateApiKey, ListApiKeys, RevokeApiKey};
pub use operator::{AcknowledgeSecondEffect, OperatorCancel, Redrive, Resolve, RetryNow};
pub use search::{CursorKey, SearchTasks, TaskCursor, TaskPage, TaskQuery};
pub use submit::{Submission, Submit, SubmitBatch, SubmitOutcome, SubmitPlan, is_same_request};
pub use sweep::{Sweep, SweepStats, TamperQueues};
pub use tasks::{
    AcknowledgeDelivery, Cancel, FindTask, GetTask, ListAttempts, ListEvents, ReadClock,
    SharedSecret,
};

/// One operation of the service, run as one transaction.
pub trait Operation: std::fmt::Debug + Send + Sync + Sized + 'static {
    /// What the operation answers (business refusals included).
    type Reply: std::fmt::Debug + Send + 'static;
    /// Whether the operation may write (SQLite sends these to its one writer;
    /// PostgreSQL runs them in a transaction, the others in autocommit).
    const WRITES: bool;
    /// Runs the operation inside the open transaction `tx`.
    ///
    /// # Errors
    /// Storage failures; the backend rolls back.
    fn run<T: Tx>(&self, tx: &mut T) -> impl Future<Output = Result<Self::Reply>> + Send;
}

/// An operation and where its reply goes (a command with its own response
/// channel).
#[derive(Debug)]
pub struct Call<O: Operation> {
    /// The operation.
    pub op: O,
    /// Where its reply goes, once its transaction has committed.
    pub reply: oneshot::Sender<Result<O::Reply>>,
}

impl<O: Operation> Call<O> {
    /// A call of `op` and the receiver of its reply.
    pub fn new(op: O) -> (Call<O>, oneshot::Receiver<Result<O::Reply>>) {
        let (reply, rx) = oneshot::channel();
        (Call { op, reply }, rx)
    }

    /// Runs the operation with `runner` and holds its answer.
    pub async fn run_with<R: Runner>(self, runner: &mut R) -> Pending {
        let result = runner.run(&self.op).await;
        Pending::new(self.reply, result)
    }

    /// Answers now (a caller that went away is not an error).
    pub fn answer(self, result: Result<O::Reply>) {
        let _ = self.reply.send(result);
    }
}

/// Runs one operation at a time, each in its own transaction or savepoint,
/// committing (or releasing the savepoint) before it returns; a backend's
/// connection, pool or writer.
pub trait Runner: Send {
    /// Runs `op` in one transaction (retrying contention as the backend does).
    ///
    /// # Errors
    /// Storage failures; nothing of `op` was written.
    fn run<O: Operation>(&mut self, op: &O) -> impl Future<Output = Result<O::Reply>> + Send;
}

/// An answer held until the transaction that produced it has committed:
/// [`Pending::send`] after the commit, [`Pending::fail`] when it did not.
pub struct Pending(Box<dyn Held>);

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Pending").field(&self.error()).finish()
    }
}

trait Held: Send {
    fn send(self: Box<Self>);
    fn fail(self: Box<Self>, e: StoreError);
    fn error(&self) -> Option<&StoreError>;
}

struct Answer<R> {
    reply: oneshot::Sender<Result<R>>,
    result: Result<R>,
}

impl<R: Send + 'static> Held for Answer<R> {
    fn send(self: Box<Self>) {
        let _ = self.reply.send(self.result);
    }
    fn fail(self: Box<Self>, e: StoreError) {
        let _ = self.reply.send(Err(e));
    }
    fn error(&self) -> Option<&StoreError> {
        self.result.as_ref().err()
    }
}

impl Pending {
    /// Holds `result` for `reply`.
    pub fn new<R: Send + 'static>(reply: oneshot::Sender<Result<R>>, result: Result<R>) -> Pending {
        Pending(Box::new(Answer { reply, result }))
    }
    /// Sends the held answer (after the commit).
    pub fn send(self) {
        self.0.send();
    }
    /// Answers `e` instead (the commit failed: nothing was written).
    pub fn fail(self, e: StoreError) {
        self.0.fail(e);
    }
    /// The held error, when the operation failed.
    pub fn error(&self) -> Option<&StoreError> {
        self.0.error()
    }
}

/// Declares [`Op`], one variant per operation, with its conversions and the
/// one `match` that runs any of them.
macro_rules! operations {
    ($($(#[$m:meta])* $name:ident,)*) => {
        /// One operation with its reply channel.
        #[derive(Debug)]
        #[non_exhaustive]
        pub enum Op {
            $($(#[$m])* $name(Call<$name>),)*
        }

        $(impl From<Call<$name>> for Op {
            fn from(call: Call<$name>) -> Op {
                Op::$name(call)
            }
        })*

        impl Op {
            /// Whether the operation may write ([`Operation::WRITES`]).
            pub fn writes(&self) -> bool {
                match self {
                    $(Op::$name(_) => <$name as Operation>::WRITES,)*
                }
            }

            /// Runs the operation with `runner`; its answer, to send once
            /// the transaction has committed.
            pub async fn run_with<R: Runner>(self, runner: &mut R) -> Pending {
                match self {
                    $(Op::$name(call) => call.run_with(runner).await,)*
                }
            }

            /// Answers `e` without running the operation.
            pub fn fail(self, e: StoreError) {
                match self {
                    $(Op::$name(call) => call.answer(Err(e)),)*
                }
            }
        }
    };
}

operations! {
    /// [`CreateApiKey`].
    CreateApiKey,
    /// [`RevokeApiKey`].
    RevokeApiKey,
    /// [`ListApiKeys`].
    ListApiKeys,
    /// [`Authenticate`].
    Authenticate,
    /// [`Submit`]: backends send these to their submit batcher.
    Submit,
    /// [`SubmitBatch`].
    SubmitBatch,
    /// [`ReadClock`].
    ReadClock,
    /// [`SharedSecret`].
    SharedSecret,
    /// [`GetTask`].
    GetTask,
    /// [`FindTask`].
    FindTask,
    /// [`ListAttempts`].
    ListAttempts,
    /// [`ListEvents`].
    ListEvents,
    /// [`SearchTasks`].
    SearchTasks,
    /// [`TaskHistory`].
    TaskHistory,
    /// [`ReadFeed`].
    ReadFeed,
    /// [`Claim`].
    Claim,
    /// [`ClaimAs`].
    ClaimAs,
    /// [`AttemptTenant`].
    AttemptTenant,
    /// [`Heartbeat`].
    Heartbeat,
    /// [`Acknowledge`].
    Acknowledge,
    /// [`Report`].
    Report,
    /// [`ReportAs`].
    ReportAs,
    /// [`Release`].
    Release,
    /// [`Cancel`].
    Cancel,
    /// [`AcknowledgeDelivery`].
    AcknowledgeDelivery,
    /// [`Sweep`].
    Sweep,
    /// [`TamperQueues`].
    TamperQueues,
    /// [`CheckIdentity`].
    CheckIdentity,
    /// [`MarkRestored`].
    MarkRestored,
    /// [`RetryNow`].
    RetryNow,
    /// [`OperatorCancel`].
    OperatorCancel,
    /// [`Resolve`].
    Resolve,
    /// [`Redrive`].
    Redrive,
    /// [`AcknowledgeSecondEffect`].
    AcknowledgeSecondEffect,
    /// [`CreateConsoleSession`].
    CreateConsoleSession,
    /// [`ConsoleSessionLookup`].
    ConsoleSessionLookup,
    /// [`EndConsoleSession`].
    EndConsoleSession,
    /// [`TaskOverview`].
    TaskOverview,
    /// [`TaskQueues`].
    TaskQueues,
    /// [`AllQueueDepths`].
    AllQueueDepths,
}

/// The operation classes a key is limited to (`None`: all), shared by the
/// operations run on its behalf: tasks and attempts of other classes are
/// [`Refusal::NotFound`] (SPEC §4: a key's grant).
pub type Grant = Option<Arc<Vec<String>>>;

/// Who may see a task: its tenant (`None` = any, for the operator CLI) and,
/// for a key limited to some operation classes, those classes.
pub(crate) struct Access<'a> {
    pub(crate) tenant: Option<&'a str>,
    pub(crate) grant: &'a Grant,
}

impl<'a> Access<'a> {
    /// The caller's tenant (`None`: any tenant) and grant.
    pub(crate) fn new(tenant: Option<&'a str>, grant: &'a Grant) -> Self {
        Self { tenant, grant }
    }

    fn sees(&self, t: &Task) -> bool {
        self.tenant.is_none_or(|tn| tn == t.control.tenant)
            && self
                .grant
                .as_deref()
                .is_none_or(|ops| ops.iter().any(|o| o == &t.operation))
    }
}

/// The task `id` when `access` sees it; `lock` takes its row lock.
pub(crate) async fn owned_task<T: Tx>(
    tx: &mut T,
    id: Uuid,
    access: &Access<'_>,
    lock: bool,
) -> Result<Result<Task, Refusal>> {
    Ok(match load_task(tx, id, lock).await? {
        Some(t) if access.sees(&t) => Ok(t),
        _ => Err(Refusal::NotFound),
    })
}

/// The task `id` with its effect reports and suspected second effects (what
/// a transition of [`idem_core::machine`] compares); `lock` takes its row lock.
/// A task without effect reports (`effect_report_count` 0, read with the
/// task) has neither, and costs no second read.
pub(crate) async fn load_task<T: Tx>(tx: &mut T, id: Uuid, lock: bool) -> Result<Option<Task>> {
    let Some(mut task) = tx.task(id, lock).await? else {
        return Ok(None);
    };
    if task.control.effect_report_count > 0 {
        let (reports, effects) = tx.effects(id).await?;
        task.control.effect_reports = reports;
        task.second_effects = effects;
    }
    Ok(Some(task))
}

/// Fills the suspected second effects of `tasks` (read without them) in one
/// [`Tx::second_effects_of`] of those with effect reports; tasks without
/// any (`effect_report_count` 0, the common case) cost no read.
pub async fn with_second_effects<'t, T: Tx>(
    tx: &mut T,
    tasks: impl IntoIterator<Item = &'t mut Task>,
) -> Result<()> {
    let mut tasks: Vec<&mut Task> = tasks
        .into_iter()
        .filter(|t| t.control.effect_report_count > 0)
        .collect();
    if tasks.is_empty() {
        return Ok(());
    }
    // A batch may name one task twice (two submissions of one scope).
    let mut ids: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
    ids.sort_unstable();
    ids.dedup();
    for (id, effect) in tx.second_effects_of(&ids).await? {
        for t in tasks.iter_mut().filter(|t| t.id == id) {
            t.second_effects.push(effect.clone());
        }
    }
    Ok(())
}

/// [`with_second_effects`] of the tasks of scopes read without them
/// ([`Tx::scopes_with_tasks`], [`Tx::live_scopes_with_tasks`]): a replay
/// answers the task as it is, its second effects included.
pub async fn scopes_with_second_effects<T: Tx>(
    tx: &mut T,
    existing: &mut [crate::ExistingScope],
) -> Result<()> {
    let tasks = existing
        .iter_mut()
        .filter_map(|e| e.as_mut().and_then(|(_, t)| t.as_mut()));
    with_second_effects(tx, tasks).await
}

/// Writes the task (compare-and-set against what was loaded) and the journal.
pub(crate) async fn persist<T: Tx>(
    tx: &mut T,
    task: &Task,
    loaded: (i64, i64),
    j: &Journal,
) -> Result<()> {
    tx.update_task(task, loaded.0, loaded.1).await?;
    // A lease's cap slots go with it (SPEC §8.2 "Concurrency caps"): every
    // transition that ends an attempt's lease writes the task here.
    tx.free_slots(task.id, task.control.active_attempt_id)
        .await?;
    if crate::flow::waits(task) {
        // Its claim queues may have been parked while it was leased or
        // ended (SPEC §2.13).
        tx.open_queues(task).await?;
    }
    if !j.events.is_empty() {
        tx.insert_events(task.id, &j.events).await?;
    }
    for (attempt_id, ev) in &j.evidence {
        tx.insert_evidence(task.id, *attempt_id, ev).await?;
    }
    for r in &j.effect_reports {
        tx.insert_effect_report(task.id, r).await?;
    }
    for s in &j.second_effects {
        tx.insert_second_effect(task.id, s).await?;
    }
    for s in &j.acknowledged {
        tx.acknowledge_second_effect(task.id, s).await?;
    }
    Ok(())
}
