//! The operator console's reads and sessions (SPEC §4 "Operator console").
//!
//! - Sessions: a signed-in API key's session is a random token (32 bytes from
//!   the operating system's RNG, base64url without padding: 43 characters)
//!   held by the browser; the store keeps only its SHA-256 ([`hash_session_token`])
//!   with the tenant, the key, its role, and when it was made, runs out and was
//!   ended. A lookup ([`ConsoleSessionLookup`]) joins the API key, so a revoked
//!   key's sessions stop at once, on every instance over the database; times
//!   are the store's clock ([`crate::Tx::now`]).
//! - The overview ([`TaskOverview`]): a tenant's task counts by operation class
//!   and state, and the tasks that need a person, each list limited.

use idem_core::model::{ApiKey, Task, Timestamp};
use uuid::Uuid;

use super::{Grant, Operation};
use crate::{Result, StoreError, Tx};

pub use crate::tx::console::{ConsoleSession, ConsoleTx, QueueDepth, TaskCount};

/// Bytes of randomness in a session token.
pub const SESSION_TOKEN_BYTES: usize = 32;

/// Most expired sessions one sign-in removes (a bounded clean-up on the
/// write path: sessions never pile up past a sign-in's worth of work).
pub const SESSION_PURGE_BATCH: i64 = 100;

/// Most tasks one "needs attention" list of the overview holds.
pub const MAX_ATTENTION: i64 = 200;

/// A new session token: [`SESSION_TOKEN_BYTES`] bytes of the operating
/// system's RNG, base64url without padding.
///
/// # Errors
/// [`StoreError::Unavailable`] when the operating system's RNG fails.
pub fn generate_session_token() -> Result<String> {
    use base64::Engine;
    use rand::TryRngCore;
    let mut bytes = [0_u8; SESSION_TOKEN_BYTES];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| StoreError::Unavailable(format!("the system's random generator: {e}")))?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// SHA-256 hex of a session token: the only form in which it is stored.
pub fn hash_session_token(token: &str) -> String {
    crate::hash_api_key(token)
}

/// Create a session for an API key; replies with the session and its plain
/// token (given out once, never stored), or `None` when the key does not
/// exist or is revoked (read in the same transaction). Removes up to
/// [`SESSION_PURGE_BATCH`] sessions that ran out.
#[derive(Debug, Clone)]
pub struct CreateConsoleSession {
    /// The key that signed in.
    pub api_key_id: Uuid,
    /// How long the session lasts, ms (at least 1).
    pub ttl_ms: i64,
}

impl Operation for CreateConsoleSession {
    type Reply = Option<(ConsoleSession, String)>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let now = tx.now().await?;
        let key = match tx.api_key(self.api_key_id).await? {
            Some(k) if k.revoked_at.is_none() => k,
            _ => return Ok(None),
        };
        tx.purge_console_sessions(now, SESSION_PURGE_BATCH).await?;
        let token = generate_session_token()?;
        let session = ConsoleSession {
            tenant: key.tenant,
            api_key_id: key.id,
            role: key.role,
            created_at: now,
            expires_at: now.plus_ms(self.ttl_ms.max(1)),
            ended_at: None,
        };
        tx.insert_console_session(&session, &hash_session_token(&token))
            .await?;
        Ok(Some((session, token)))
    }
}

/// The active session a token names, with its API key (`None`: no such
/// session, or it ran out, was ended, or its key is revoked).
#[derive(Clone)]
pub struct ConsoleSessionLookup {
    /// The session token as the browser sent it.
    pub token: String,
}

impl std::fmt::Debug for ConsoleSessionLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleSessionLookup")
            .finish_non_exhaustive()
    }
}

impl Operation for ConsoleSessionLookup {
    type Reply = Option<(ConsoleSession, ApiKey)>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let now = tx.now().await?;
        tx.active_console_session(&hash_session_token(&self.token), now)
            .await
    }
}

/// End the session a token names; replies whether one was ended (`false`:
/// no such session, or already ended).
#[derive(Clone)]
pub struct EndConsoleSession {
    /// The session token as the browser sent it.
    pub token: String,
}

impl std::fmt::Debug for EndConsoleSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndConsoleSession").finish_non_exhaustive()
    }
}

impl Operation for EndConsoleSession {
    type Reply = bool;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<bool> {
        let now = tx.now().await?;
        tx.end_console_session(&hash_session_token(&self.token), now)
            .await
    }
}

/// What the overview asks for: its thresholds, ms, and list size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverviewQuery {
    /// A `reconciling` task unchanged for longer than this needs a person.
    pub reconciling_for_ms: i64,
    /// A `failed` task that failed within this window needs a person.
    pub failed_within_ms: i64,
    /// Most tasks per list (1–[`MAX_ATTENTION`], clamped).
    pub limit: i64,
}

/// A tenant's overview (read in one transaction, at `now`).
#[derive(Debug, Clone, PartialEq)]
pub struct Overview {
    /// The store's clock when it was read.
    pub now: Timestamp,
    /// Task counts by operation class and state (pairs with no task left out).
    pub counts: Vec<TaskCount>,
    /// `reconciling` tasks unchanged for longer than the threshold, longest
    /// unchanged first.
    pub reconciling_long: Vec<Task>,
    /// Tasks that failed within the window, most recent first.
    pub failed_recent: Vec<Task>,
    /// Tasks whose cancellation is requested and not yet settled, oldest first.
    pub cancel_requested: Vec<Task>,
    /// The tenant's queues with waiting tasks, by class.
    pub queues: Vec<QueueStat>,
}

/// One queue's waiting tasks at a moment: how many, and how long they have
/// waited (ms since each became claimable, `ready_at`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct QueueStat {
    /// Operation class.
    pub operation: String,
    /// Tasks a claim could lease now.
    pub depth: i64,
    /// The longest wait, ms.
    pub oldest_wait_ms: i64,
    /// The median wait, ms (nearest rank).
    pub wait_p50_ms: i64,
    /// The 99th-percentile wait, ms (nearest rank).
    pub wait_p99_ms: i64,
}

/// The 0-based position, in ascending `ready_at` order, of the task whose
/// wait is the `per_mille`/1000 quantile of `depth` waits (nearest rank: the
/// wait that `per_mille`/1000 of the waits are at most). Waits ascend as
/// `ready_at` descends, so rank r (1-based, by wait) is position
/// `depth - r`.
fn quantile_position(depth: i64, per_mille: i64) -> i64 {
    let rank = (depth * per_mille + 999) / 1000;
    (depth - rank.max(1)).max(0)
}

/// `tenant`'s queues in `operations` (all classes when `None`) at `now`.
async fn queue_stats<T: Tx>(
    tx: &mut T,
    tenant: &str,
    operations: Option<&[String]>,
    now: Timestamp,
) -> Result<Vec<QueueStat>> {
    let depths = tx.queue_depths(Some(tenant), operations, now).await?;
    let mut out = Vec::with_capacity(depths.len());
    for d in depths {
        let wait = |at: Option<Timestamp>| at.map_or(0, |at| now.0.saturating_sub(at.0).max(0));
        let p50 = tx
            .queue_ready_at(tenant, &d.operation, now, quantile_position(d.depth, 500))
            .await?;
        let p99 = tx
            .queue_ready_at(tenant, &d.operation, now, quantile_position(d.depth, 990))
            .await?;
        out.push(QueueStat {
            operation: d.operation,
            depth: d.depth,
            oldest_wait_ms: wait(Some(d.oldest_ready_at)),
            wait_p50_ms: wait(p50),
            wait_p99_ms: wait(p99),
        });
    }
    Ok(out)
}

/// Read a tenant's queues (`GET /v1/queues`).
#[derive(Debug, Clone)]
pub struct TaskQueues {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant: a key limited to some classes sees only those.
    pub grant: Grant,
}

/// A tenant's queues at a moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queues {
    /// The store's clock when they were read.
    pub now: Timestamp,
    /// The queues with waiting tasks, by class.
    pub queues: Vec<QueueStat>,
}

impl Operation for TaskQueues {
    type Reply = Queues;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Queues> {
        let now = tx.now().await?;
        let ops = self.grant.as_deref().map(Vec::as_slice);
        let queues = queue_stats(tx, &self.tenant, ops, now).await?;
        Ok(Queues { now, queues })
    }
}

/// Every tenant's queue depths (the `idem_queue_depth` and
/// `idem_queue_oldest_wait_seconds` gauges): one `GROUP BY`.
#[derive(Debug, Clone)]
pub struct AllQueueDepths;

impl Operation for AllQueueDepths {
    type Reply = (Timestamp, Vec<QueueDepth>);
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<(Timestamp, Vec<QueueDepth>)> {
        let now = tx.now().await?;
        Ok((now, tx.queue_depths(None, None, now).await?))
    }
}

/// Read a tenant's overview: counts and the three "needs attention" lists.
#[derive(Debug, Clone)]
pub struct TaskOverview {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant: a key limited to some classes sees only those.
    pub grant: Grant,
    /// Thresholds and list size.
    pub query: OverviewQuery,
}

impl Operation for TaskOverview {
    type Reply = Overview;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Overview> {
        let now = tx.now().await?;
        let ops = self.grant.as_deref().map(Vec::as_slice);
        let q = &self.query;
        let limit = q.limit.clamp(1, MAX_ATTENTION);
        let counts = tx.task_counts(&self.tenant, ops).await?;
        let reconciling_long = tx
            .stale_reconciling(
                &self.tenant,
                ops,
                Timestamp(now.0.saturating_sub(q.reconciling_for_ms.max(0))),
                limit,
            )
            .await?;
        let failed_recent = tx
            .failed_since(
                &self.tenant,
                ops,
                Timestamp(now.0.saturating_sub(q.failed_within_ms.max(0))),
                limit,
            )
            .await?;
        let mut cancel_requested = tx.cancel_requested(&self.tenant, ops, limit).await?;
        cancel_requested.retain(Task::cancel_pending);
        let queues = queue_stats(tx, &self.tenant, ops, now).await?;
        Ok(Overview {
            now,
            counts,
            reconciling_long,
            failed_recent,
            cancel_requested,
            queues,
        })
    }
}

impl crate::Store {
    /// Creates a console session for key `api_key_id` lasting `ttl_ms`;
    /// the session and its plain token, or `None` when the key does not exist
    /// or is revoked.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn create_console_session(
        &self,
        api_key_id: Uuid,
        ttl_ms: i64,
    ) -> Result<Option<(ConsoleSession, String)>> {
        self.call(CreateConsoleSession { api_key_id, ttl_ms }).await
    }

    /// The active session `token` names, with its key.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn console_session(&self, token: &str) -> Result<Option<(ConsoleSession, ApiKey)>> {
        self.call(ConsoleSessionLookup {
            token: token.to_owned(),
        })
        .await
    }

    /// Ends the session `token` names; whether one was ended.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn end_console_session(&self, token: &str) -> Result<bool> {
        self.call(EndConsoleSession {
            token: token.to_owned(),
        })
        .await
    }

    /// `tenant`'s queues, in the classes this store's grant allows.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn task_queues(&self, tenant: &str) -> Result<Queues> {
        self.call(TaskQueues {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
        })
        .await
    }

    /// Every tenant's queue depths with the store's clock (the metrics).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn all_queue_depths(&self) -> Result<(Timestamp, Vec<QueueDepth>)> {
        self.call(AllQueueDepths).await
    }

    /// `tenant`'s overview, in the classes this store's grant allows.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn task_overview(&self, tenant: &str, query: OverviewQuery) -> Result<Overview> {
        self.call(TaskOverview {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            query,
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::quantile_position;

    /// Positions in ascending `ready_at` order (0 = the longest wait).
    #[test]
    fn quantiles_count_by_nearest_rank_from_the_shortest_wait() {
        assert_eq!(quantile_position(1, 500), 0);
        assert_eq!(quantile_position(1, 990), 0);
        // Waits 1..=4 (ready_at descending): the median is the 2nd shortest.
        assert_eq!(quantile_position(4, 500), 2);
        assert_eq!(quantile_position(4, 990), 0);
        assert_eq!(quantile_position(100, 990), 1);
        assert_eq!(quantile_position(100, 500), 50);
        assert_eq!(quantile_position(0, 500), 0);
    }
}
