//! # idem-store
//!
//! The storage contract of idem and the one implementation of its operations.
//!
//! - [`Tx`]: the primitives a backend offers inside one database transaction
//!   (load a task with a row lock, compare-and-set update, insert attempt,
//!   append events, claim scan with `SKIP LOCKED` …). SQLite and PostgreSQL each
//!   implement it once.
//! - [`ops`]: every operation of the service (submit, claim, report, cancel,
//!   sweep …), one struct each with its typed reply, written once generically
//!   over [`Tx`] as "load → pure state machine ([`idem_core::machine`]) →
//!   write back with compare-and-set + journal"; one file per family, and the
//!   one [`ops::SubmitPlan`] every submit runs.
//! - [`batch`]: the group-commit batcher both backends use (gather, linger,
//!   fall back to one by one).
//! - [`feed`]: the tenant event feed's cursor and events (how a page never
//!   skips an event written by a concurrent transaction).
//! - [`changes`]: the committed changes every instance hears (PostgreSQL
//!   `LISTEN/NOTIFY`, in process on SQLite), which wake waiting requests.
//! - [`clock`]: the [`Clock`] a backend reads its time through (real time,
//!   or a test clock moved forward instead of sleeping).
//! - [`retries`]: which scopes this process saw bound, and the read-only
//!   answer of a retry.
//! - [`Backend`]: runs one [`Op`] in one transaction (retrying on serialization
//!   failures where the database asks for it) and answers through the op's
//!   reply channel.
//! - [`identity`]: the identity a store records of its database, and how
//!   it notices that the database went back in time.
//! - [`spans`]: idem's trace spans (request, store operation, attempt),
//!   built only when a subscriber asks for them.
//! - [`sweeper`]: the background sweep a server runs (lease expiry, backoff
//!   wake-ups, retention), its log lines and counters.
//! - [`Store`] (`store.rs`): the typed, cloneable handle the HTTP layer and
//!   the CLI use; all its methods.
//! - `conformance` (feature): the suite every backend must pass, unchanged.
//!
//! Correctness lives in the database: the scope `(tenant, operation,
//! idempotency_key)` is a primary key, attempts are unique per `(task,
//! generation)`, and every task write is `UPDATE … WHERE id = $1 AND version =
//! $2 AND generation = $3` (SPEC §2.1, §2.4).

use std::future::Future;
use std::pin::Pin;

use idem_core::machine::Rejection;
use idem_core::model::{ApiKey, Attempt, Event, Evidence, Task, Timestamp};
use uuid::Uuid;

pub mod batch;
pub mod changes;
pub mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod contracts;
pub mod feed;
mod guarded;
pub mod identity;
pub mod ops;
pub mod plan;
pub mod retries;
pub mod schema;
pub mod spans;
mod store;
pub mod sweeper;

pub use changes::{Change, Changes, Notice, Watch};
pub use clock::Clock;
pub use guarded::Guarded;
pub use ops::Op;
pub use retries::ScopeHints;
pub use schema::{Migration, SchemaVersion, SchemaWatch, schema_mismatch};
pub use store::Store;

/// Errors of the storage layer. Business refusals (conflict, stale generation …)
/// are not errors: they are part of each operation's output.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database cannot be reached or refused the work (HTTP 503 `UNAVAILABLE`).
    /// Nothing was written.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// Every connection the store may use was busy for as long as the
    /// operation may wait for one (PostgreSQL: the pool's wait timeout,
    /// `PgOptions::pool_timeout`): the store is healthy but saturated (HTTP
    /// 503 `OVERLOADED` with `Retry-After`, not `UNAVAILABLE`). Nothing was
    /// sent to the database, so nothing was written; the same request may
    /// succeed later.
    #[error("store overloaded: {0}")]
    Overloaded(String),
    /// A concurrent writer won a compare-and-set or the database reported a
    /// serialization failure or deadlock; the whole transaction may be retried.
    #[error("concurrent update, retry: {0}")]
    Contention(String),
    /// Stored data does not decode (a bug or manual tampering).
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// The migration step failed or the schema is newer than this binary.
    #[error("migration failed: {0}")]
    Migration(String),
    /// The store's address or options are invalid (e.g. a malformed
    /// PostgreSQL URL); trying again cannot help.
    #[error("invalid store configuration: {0}")]
    Config(String),
    /// The database refused this operation's values for good (PostgreSQL
    /// SQLSTATE class 54, "program limit exceeded", e.g. an index row larger
    /// than the index allows). Nothing was written; the same request can never
    /// succeed (HTTP 400 `INVALID_REQUEST`).
    #[error("the database refused the values: {0}")]
    Rejected(String),
}

impl StoreError {
    /// Whether running the same transaction again may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Contention(_) | StoreError::Unavailable(_) | StoreError::Overloaded(_)
        )
    }
}

/// Result alias of this crate.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A boxed, sendable future (object-safe backends).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An idempotency-key row (the scope → task binding, SPEC §2.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeRow {
    /// Tenant.
    pub tenant: String,
    /// Operation class.
    pub operation: String,
    /// Idempotency key.
    pub idempotency_key: String,
    /// Fingerprint bound to the key.
    pub fingerprint: String,
    /// The task.
    pub task_id: Uuid,
}

/// A scope row found by [`Tx::scopes_with_tasks`] and the task it names
/// (`None`: the scope is free).
pub type ExistingScope = Option<(ScopeRow, Option<Task>)>;

/// The primitives of one database transaction. Every method runs inside the
/// transaction the backend opened for the current [`Op`]; nothing is visible to
/// others before the backend commits.
///
/// Times are epoch ms. All futures are `Send`.
pub trait Tx: Send + ops::search::TaskSearch + ops::console::ConsoleTx {
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
        subs: &[ops::Submission],
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

/// A database that runs [`Op`]s, each as one transaction (or one savepoint of
/// a transaction it shares with others, answered after the shared commit).
pub trait Backend: Send + Sync + 'static {
    /// Runs `op` and answers through its reply channel once its transaction
    /// committed (or with the error that rolled it back); retries
    /// [`StoreError::Contention`] a bounded number of times. The future may
    /// end before the answer is sent (the backend handed `op` to a writer or
    /// batcher of its own). Callers go through [`Store`], which runs writing
    /// operations on their own task unless [`Backend::runs_detached`], so a
    /// backend need not detach them again.
    fn execute(&self, op: Op) -> BoxFuture<'_, ()>;
    /// Whether `execute(op)` already runs to its commit or rollback when the
    /// caller's future is dropped (the backend hands `op` to a writer thread or
    /// batcher task of its own); [`Store`] then does not spawn a task for it.
    /// Default: `false`.
    fn runs_detached(&self, op: &Op) -> bool {
        let _ = op;
        false
    }
    /// Whether the database answers and holds a schema this binary serves
    /// (readiness; [`schema`]): a backend whose database another instance
    /// may migrate reads the schema again at most every
    /// [`schema::SCHEMA_RECHECK`] ([`SchemaWatch`]).
    fn ping(&self) -> BoxFuture<'_, Result<()>>;
    /// `sqlite` or `postgres`.
    fn kind(&self) -> &'static str;
    /// The clock this backend reads its time through (every [`Tx::now`]).
    fn clock(&self) -> &Clock;
    /// The committed changes of this database ([`changes`]).
    fn changes(&self) -> &changes::Changes;
    /// Resolves once every change this handle committed so far has been
    /// announced to the other instances over the database (or given up:
    /// [`changes`]); at once where nothing else listens (SQLite). A process
    /// that exits right after writing (the CLI) awaits it first.
    fn announced(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Business refusal of an operation (not a storage failure).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// No such task or attempt for this tenant (SPEC §4: existence is not leaked).
    #[error("not found")]
    NotFound,
    /// The state machine refused (stale generation, already reported, invalid report …).
    #[error(transparent)]
    Machine(#[from] Rejection),
    /// An operator action does not apply to the task as it is
    /// ([`idem_core::machine::operator`]); nothing changed.
    #[error(transparent)]
    Operator(#[from] idem_core::machine::operator::Refused),
}

/// SHA-256 hex of a plain API key: the only form in which keys are stored.
pub fn hash_api_key(plain: &str) -> String {
    hex::encode(api_key_digest(plain))
}

/// SHA-256 of a plain API key, 32 bytes: [`hash_api_key`] before its hex
/// encoding (a process's cache of authenticated keys is keyed by it).
pub fn api_key_digest(plain: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(plain.as_bytes()).into()
}

/// A new random plain API key: `idem_` and 64 hex digits (two UUID v4s: 256
/// bits from uuid's generator, minus the 12 fixed version/variant bits). With
/// uuid's `fast-rng` feature that generator is rand's `ThreadRng`, a ChaCha12
/// CSPRNG seeded from the operating system's RNG.
pub fn generate_api_key() -> String {
    let a = Uuid::new_v4();
    let b = Uuid::new_v4();
    format!("idem_{}{}", a.simple(), b.simple())
}
