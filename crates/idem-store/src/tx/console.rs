//! The console's records a backend stores and counts, and [`ConsoleTx`]
//! ([`crate::ops::console`] runs the console's operations over it).

use std::future::Future;

use idem_core::model::{ApiKey, Role, Task, TaskState, Timestamp};
use uuid::Uuid;

use crate::Result;

/// A console session as stored (its token is not: only its hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleSession {
    /// The signed-in key's tenant.
    pub tenant: String,
    /// The signed-in key.
    pub api_key_id: Uuid,
    /// The key's role at sign-in.
    pub role: Role,
    /// When the session was made.
    pub created_at: Timestamp,
    /// When it runs out (exclusive): a lookup at or after it finds nothing.
    pub expires_at: Timestamp,
    /// When it was ended by sign-out, if it was.
    pub ended_at: Option<Timestamp>,
}

/// A tenant's task count in one operation class and state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskCount {
    /// Operation class.
    pub operation: String,
    /// State.
    pub state: TaskState,
    /// How many tasks.
    pub count: i64,
}

/// A queue: the tasks of one tenant and operation class that a claim could
/// lease now (`queued`, `retry_wait` or `reconciling`, due, no attempt
/// holding a lease), counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDepth {
    /// Tenant.
    pub tenant: String,
    /// Operation class.
    pub operation: String,
    /// Tasks waiting.
    pub depth: i64,
    /// The earliest `ready_at` among them (epoch ms): the longest wait.
    pub oldest_ready_at: Timestamp,
}

/// The primitives of the console a backend offers inside a transaction (a
/// supertrait of [`crate::Tx`], implemented in each backend's own console
/// module). Times are epoch ms.
pub trait ConsoleTx: Send {
    /// Inserts a session under the SHA-256 hex of its token.
    fn insert_console_session(
        &mut self,
        session: &ConsoleSession,
        token_hash: &str,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Removes up to `limit` sessions that ran out before `before`; how many.
    fn purge_console_sessions(
        &mut self,
        before: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<u64>> + Send;
    /// The session whose token hashes to `token_hash` with its API key, when
    /// the session is not ended, runs out after `now`, and its key is not
    /// revoked.
    fn active_console_session(
        &mut self,
        token_hash: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<Option<(ConsoleSession, ApiKey)>>> + Send;
    /// Sets `ended_at` of the session whose token hashes to `token_hash` if
    /// unset; whether a session was ended.
    fn end_console_session(
        &mut self,
        token_hash: &str,
        at: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;
    /// `tenant`'s task counts by operation class and state (classes of
    /// `operations` only, when given); pairs with no task are left out. One
    /// `GROUP BY` over the `(tenant, operation, state, …)` search index.
    fn task_counts(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
    ) -> impl Future<Output = Result<Vec<TaskCount>>> + Send;
    /// The queues with at least one waiting task at `now` ([`QueueDepth`]):
    /// `tenant`'s when given, else every tenant's (the metrics), in classes of
    /// `operations` when given; ordered by tenant, then class.
    fn queue_depths(
        &mut self,
        tenant: Option<&str>,
        operations: Option<&[String]>,
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<QueueDepth>>> + Send;
    /// The `ready_at` (epoch ms) of the waiting task of `tenant`'s queue of
    /// `operation` at 0-based position `rank` in `ready_at` order at `now`;
    /// `None` past the end. Walks the claim-order index up to `rank`.
    fn queue_ready_at(
        &mut self,
        tenant: &str,
        operation: &str,
        now: Timestamp,
        rank: i64,
    ) -> impl Future<Output = Result<Option<Timestamp>>> + Send;
    /// Up to `limit` of `tenant`'s `reconciling` tasks last changed before
    /// `unchanged_since`, longest unchanged first.
    fn stale_reconciling(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        unchanged_since: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Task>>> + Send;
    /// Up to `limit` of `tenant`'s `failed` tasks that became terminal at or
    /// after `since`, most recent first.
    fn failed_since(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        since: Timestamp,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Task>>> + Send;
    /// Up to `limit` of `tenant`'s non-terminal tasks with a cancellation
    /// record (one in `requested` status: a confirmed or too-late one makes
    /// or finds the task terminal), oldest first.
    fn cancel_requested(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Task>>> + Send;
}
