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

pub use crate::tx::console::{ConsoleSession, ConsoleTx, TaskCount};

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
        Ok(Overview {
            now,
            counts,
            reconciling_long,
            failed_recent,
            cancel_requested,
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
