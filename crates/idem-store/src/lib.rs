//! # idem-store
//!
//! The storage contract of idem and the one implementation of its operations.
//!
//! - [`tx`]: the driver seam, below the operations. [`Tx`] is the primitives
//!   a backend offers inside one database transaction (load a task with a row
//!   lock, compare-and-set update, insert attempt, append events, claim scan
//!   with `SKIP LOCKED` …), with the search and console supertraits and the
//!   records they take. SQLite and PostgreSQL each implement it once.
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
use idem_core::model::Task;
use uuid::Uuid;

pub mod batch;
pub mod caps;
pub mod changes;
pub mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod contracts;
pub mod feed;
pub mod flow;
mod guarded;
pub mod identity;
pub mod ops;
pub mod plan;
pub mod retries;
pub mod schema;
pub mod spans;
mod store;
pub mod sweeper;
pub mod tx;

pub use changes::{Change, Changes, Notice, Watch};
pub use clock::Clock;
pub use flow::claim_rank;
pub use guarded::Guarded;
pub use ops::Op;
pub use retries::ScopeHints;
pub use schema::{Migration, SchemaVersion, SchemaWatch, schema_mismatch};
pub use store::Store;
pub use tx::Tx;

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
