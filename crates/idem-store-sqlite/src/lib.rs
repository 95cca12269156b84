//! # idem-store-sqlite
//!
//! The embedded default store: one SQLite file in WAL mode with
//! `synchronous=FULL`, one writer thread and a few reader connections.
//!
//! **Group commit.** Every writing [`Op`] goes to the single writer thread.
//! The thread takes whatever is queued (up to [`MAX_BATCH`] operations),
//! opens one `BEGIN IMMEDIATE` transaction, runs each operation inside its own
//! `SAVEPOINT` (an operation that fails is rolled back alone), commits once,
//! and only then answers every caller. So each acknowledged write is durable
//! (fsync at COMMIT), while concurrent submits share one fsync. Submits queued
//! one after another run together as one submit batch in one savepoint (one
//! key check; answered as if sent one after another), and one by one if that
//! batch fails. An error that ends the whole transaction (SQLITE_FULL …) stops
//! the batch: every caller hears that nothing was written. Reads run on
//! reader connections in parallel with the writer (WAL snapshots).
//!
//! **The file stays the file.** The (device, inode) of the database path is
//! taken when the store opens. Before and after each writer COMMIT, after
//! each retry-reader batch and on every [`Store::ping`] the path is checked
//! again ([`FileWatch`]); once the file has been removed or replaced (another
//! file renamed over it), the store has failed for good: that batch and every
//! later operation answer [`StoreError::Unavailable`] naming the path, and one
//! ERROR line is logged. So no write is acknowledged that went into a file no
//! longer at its path (lost at the next restart). Only a restart recovers.
//!
//! **Clock.** Leases and backoff are decided by this process's clock (one
//! process owns the file) plus the offset of [`SqliteOptions::clock`] (0 in
//! production; tests move a test clock forward instead of sleeping).
//!
//! Pitfalls handled: writes use `BEGIN IMMEDIATE` (a deferred
//! read-then-write transaction fails with `SQLITE_BUSY`), `foreign_keys=ON`
//! on every connection, short read transactions so checkpoints finish.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use idem_store::Migration;
use idem_store::ops::{Call, Submit};
use idem_store::{Clock, Op, ScopeHints, Store, StoreError, batch};
use rusqlite::Connection;
use tokio::sync::mpsc;

mod backup;
mod contracts;
mod tx;
mod watch;
mod writer;

pub use backup::{BackupReport, backup};
pub use watch::FileWatch;

pub use tx::CLAIMABLE_IN_CLASS;

/// Most operations the writer commits together.
pub const MAX_BATCH: usize = 256;

/// Reader connections opened next to the writer; at most this many reads run
/// at once (the others wait for a connection instead of opening one).
pub const READERS: usize = 4;

/// The schema migrations, in order (versions 1, 2, …; `idem_store::schema`:
/// expand/contract); `PRAGMA user_version` counts those applied. Versions 1
/// to 11 predate the rule and count as contract steps.
pub const MIGRATIONS: &[Migration] = &[
    Migration::contract(1, include_str!("../migrations/0001_init.sql")),
    Migration::contract(2, include_str!("../migrations/0002_tasks_or_checks.sql")),
    Migration::contract(3, include_str!("../migrations/0003_claim_order_index.sql")),
    Migration::contract(4, include_str!("../migrations/0004_contracts.sql")),
    Migration::contract(5, include_str!("../migrations/0005_task_search.sql")),
    Migration::contract(6, include_str!("../migrations/0006_event_feed.sql")),
    Migration::contract(7, include_str!("../migrations/0007_attempts_granted.sql")),
    Migration::contract(
        8,
        include_str!("../migrations/0008_change_notifications.sql"),
    ),
    Migration::contract(9, include_str!("../migrations/0009_change_backoffs.sql")),
    Migration::contract(10, include_str!("../migrations/0010_task_traceparent.sql")),
    Migration::contract(11, include_str!("../migrations/0011_console.sql")),
    Migration::expand(12, include_str!("../migrations/0012_shared_secrets.sql")),
    Migration::expand(13, include_str!("../migrations/0013_store_identity.sql")),
    Migration::expand(14, include_str!("../migrations/0014_second_effects.sql")),
    Migration::expand(15, include_str!("../migrations/0015_rate_limits.sql")),
    Migration::expand(16, include_str!("../migrations/0016_concurrency_caps.sql")),
    Migration::expand(17, include_str!("../migrations/0017_fair_claims.sql")),
];

/// The schema of the database on `conn`: `PRAGMA user_version` and the
/// highest `compatible_from` recorded in `schema_migrations`; a newest
/// version recorded without one (applied by a binary older than the
/// expand/contract rule) counts as a contract step, its own version.
///
/// # Errors
/// SQLite's, when it cannot be read (e.g. not a database file).
fn read_schema(conn: &Connection) -> rusqlite::Result<idem_store::SchemaVersion> {
    let found: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    let recorded: Option<i64> = conn
        .query_row(
            "SELECT max(compatible_from) FROM schema_migrations
              WHERE EXISTS (SELECT 1 FROM schema_migrations WHERE version = ?1)",
            [found],
            |r| r.get(0),
        )
        .or_else(|e| match e {
            rusqlite::Error::SqliteFailure(_, Some(ref m)) if m.contains("no such table") => {
                Ok(None)
            }
            other => Err(other),
        })?;
    Ok(idem_store::SchemaVersion {
        found,
        compatible_from: recorded.unwrap_or(found),
    })
}

/// Options of the SQLite store.
#[derive(Debug, Clone, Default)]
pub struct SqliteOptions {
    /// The clock leases, backoffs, deadlines and retention are decided by:
    /// this process's clock plus its offset ([`Clock::real`] in production,
    /// a test clock in tests).
    pub clock: Clock,
}

/// The SQLite [`Backend`].
pub struct SqliteBackend {
    writer: mpsc::UnboundedSender<Op>,
    /// Submits whose scope was seen bound ([`ScopeHints`]) go to the retry
    /// reader thread (`writer::retry_reader_loop`).
    retries: mpsc::UnboundedSender<Call<Submit>>,
    hints: ScopeHints,
    readers: Arc<Mutex<Vec<Connection>>>,
    /// One permit per pooled reader connection.
    read_slots: Arc<tokio::sync::Semaphore>,
    path: PathBuf,
    options: SqliteOptions,
    /// The database file as opened; checked around every commit.
    watch: Arc<FileWatch>,
    /// The writer publishes each committed batch's events here.
    changes: idem_store::Changes,
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// Refuses a `path` that names no lasting database file: an empty path (SQLite
/// opens a private temporary file), `:memory:`, or a `file:` URI (rusqlite
/// opens URIs, so `file::memory:` or `?mode=memory` would give each connection
/// its own empty in-memory database, which vanishes with it).
///
/// # Errors
/// [`StoreError::Unavailable`] naming what a store path must be.
pub fn require_file_path(path: &Path) -> Result<(), StoreError> {
    let name = path.to_string_lossy();
    let name = name.trim();
    if name.is_empty() || name == ":memory:" || name.starts_with("file:") {
        return Err(StoreError::Unavailable(format!(
            "the SQLite store needs a file path, e.g. sqlite://./idem-data/idem.db (got `{name}`: empty paths, :memory: and file: URIs are not stores)"
        )));
    }
    Ok(())
}

/// The files that belong to the store at `path` besides the database file
/// itself: SQLite's write-ahead log and shared-memory index, and the lock
/// `idem serve` holds (which outlives the server).
pub fn companion_files(path: &Path) -> [std::path::PathBuf; 3] {
    let with = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        std::path::PathBuf::from(name)
    };
    [with("-wal"), with("-shm"), with(".serve-lock")]
}

/// Refuses to create a store at `path` when its database file is missing
/// but another of its files ([`companion_files`]) exists: the file was
/// removed or moved after the store was used. A new, empty store there
/// would silently forget every acknowledged task and key, so a client's
/// retry would run its payment again, and SQLite would discard the leftover
/// write-ahead log (which may hold the last commits). Only an operator can
/// bring such a store back: restore the file, or remove the leftovers to
/// start empty on purpose. Nothing is created or changed.
///
/// `idem serve` checks this before it makes its lock file; opening a store
/// checks the write-ahead log and shared-memory files only
/// ([`refuse_lost_journal`]), since the lock may be the opener's own.
///
/// # Errors
/// [`StoreError::Config`] naming the missing file and the files found.
pub fn refuse_lost_store(path: &Path) -> Result<(), StoreError> {
    refuse_leftovers(path, 3)
}

/// [`refuse_lost_store`] counting only SQLite's own `-wal` and `-shm` files.
///
/// # Errors
/// As [`refuse_lost_store`].
pub fn refuse_lost_journal(path: &Path) -> Result<(), StoreError> {
    refuse_leftovers(path, 2)
}

/// Refuses when `path` is missing and one of the first `count` of its
/// [`companion_files`] exists.
fn refuse_leftovers(path: &Path, count: usize) -> Result<(), StoreError> {
    if path.exists() {
        return Ok(());
    }
    let left: Vec<String> = companion_files(path)
        .iter()
        .take(count)
        .filter(|f| f.exists())
        .map(|f| f.display().to_string())
        .collect();
    if left.is_empty() {
        return Ok(());
    }
    Err(StoreError::Config(format!(
        "the SQLite store {} is missing but {} of it remain{}: the database file was removed or \
         moved after the store was used. idem does not create a new, empty store in its place \
         (every acknowledged task and key would be gone, and retries would run again). Restore \
         the file from a backup or where it was moved; to start an empty store on purpose, \
         remove {} first",
        path.display(),
        left.join(", "),
        if left.len() == 1 { "s" } else { "" },
        left.join(" and ")
    )))
}

/// Refuses a database file without idem's schema (`user_version` 0) that
/// already holds tables: a store opened by `serve` or `keys create` never
/// creates idem's tables next to another application's; `idem migrate`
/// (which calls [`migrate_file`]) does, when asked to.
fn refuse_foreign_tables(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let mig = |e: rusqlite::Error| StoreError::Migration(e.to_string());
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(mig)?;
    if version != 0 {
        return Ok(());
    }
    let mut stmt = conn
        .prepare(
            "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' \
             ORDER BY name",
        )
        .map_err(mig)?;
    let names = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .and_then(Iterator::collect::<Result<Vec<String>, _>>)
        .map_err(mig)?;
    if names.is_empty() {
        return Ok(());
    }
    let mut listed = names.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 5 {
        listed.push_str(", …");
    }
    Err(StoreError::Migration(format!(
        "the SQLite file {} already holds {} table(s) that are not idem's ({listed}) and no idem \
         schema; refusing to create idem's tables next to them. Check the store path; if this \
         file really is meant for idem, run `idem migrate` with the same --store first",
        path.display(),
        names.len()
    )))
}

/// Opens `path` with idem's pragmas; `busy_timeout` comes first so that
/// switching a file to WAL waits for another opener instead of failing.
fn open_connection(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open(path).map_err(unavailable)?;
    conn.execute_batch(
        "PRAGMA busy_timeout = 5000;
         PRAGMA journal_mode = WAL;
         PRAGMA synchronous = FULL;
         PRAGMA foreign_keys = ON;",
    )
    .map_err(unavailable)?;
    // Query planner stability guarantee: plans never depend on the values
    // bound to a statement. Without it SQLite reads bound values to decide
    // whether a partial index of `tasks` applies, and re-prepares such a
    // statement each time a value changes (the scope-with-task join did so on
    // every step). idem's partial indexes are all selected by literals.
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )
    .map_err(unavailable)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// Applies the versioned migrations (`PRAGMA user_version`) inside `BEGIN
/// IMMEDIATE` and returns the versions it applied, ascending (1-based, as
/// `user_version`; empty when the schema was up to date).
///
/// # Errors
/// [`StoreError::Migration`] when a step fails or the file is newer than
/// this binary and not declared compatible with it (a compatible newer file
/// is left as it is: nothing applied).
pub fn migrate(conn: &mut Connection) -> Result<Vec<i64>, StoreError> {
    let mig = |e: rusqlite::Error| StoreError::Migration(e.to_string());
    // A migration may rebuild a table that others reference; foreign keys are
    // off while it runs (SQLite ignores the pragma inside a transaction) and
    // checked in full before the commit.
    conn.pragma_update(None, "foreign_keys", false)
        .map_err(mig)?;
    // Migration 4 keys each existing contract text by its content id.
    conn.create_scalar_function(
        "idem_contract_id",
        1,
        rusqlite::functions::FunctionFlags::SQLITE_UTF8
            | rusqlite::functions::FunctionFlags::SQLITE_DETERMINISTIC,
        |ctx| {
            let text = ctx
                .get_raw(0)
                .as_str()
                .map_err(|e| rusqlite::Error::UserFunctionError(Box::new(e)))?;
            Ok(idem_core::contract::ContractId::of(text)
                .as_bytes()
                .to_vec())
        },
    )
    .map_err(mig)?;
    let res = migrate_in_transaction(conn);
    let on = conn.pragma_update(None, "foreign_keys", true).map_err(mig);
    let applied = res?;
    on?;
    Ok(applied)
}

fn migrate_in_transaction(conn: &mut Connection) -> Result<Vec<i64>, StoreError> {
    let mig = |e: rusqlite::Error| StoreError::Migration(e.to_string());
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(mig)?;
    let schema = read_schema(&tx).map_err(mig)?;
    let current = schema.found;
    let known = MIGRATIONS.len() as i64;
    if current > known {
        // Newer than this binary: served as it is if declared compatible,
        // never migrated by a binary that does not know its steps.
        schema.check("store", known)?;
        return Ok(Vec::new());
    }
    if current < known {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                 version         INTEGER PRIMARY KEY,
                 compatible_from INTEGER NOT NULL
             ) STRICT",
        )
        .map_err(mig)?;
    }
    let mut applied = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| i64::from(m.version) > current) {
        let version = i64::from(m.version);
        tx.execute_batch(m.sql)
            .map_err(|e| migration_step_error(version, e))?;
        tx.execute(
            "INSERT OR REPLACE INTO schema_migrations (version, compatible_from) VALUES (?1, ?2)",
            [
                m.version,
                idem_store::schema::recorded_compatible_from(MIGRATIONS, m.version),
            ],
        )
        .map_err(mig)?;
        tx.pragma_update(None, "user_version", version)
            .map_err(mig)?;
        applied.push(version);
    }
    // Checked only when a migration ran (a full scan of every reference).
    let violations: i64 = if current < known {
        tx.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| {
            r.get(0)
        })
        .map_err(mig)?
    } else {
        0
    };
    if violations > 0 {
        return Err(StoreError::Migration(format!(
            "{violations} foreign key violations after migrating; nothing was changed"
        )));
    }
    tx.commit().map_err(mig)?;
    Ok(applied)
}

/// A failed migration step, named by its version, with SQLite's message and
/// where in the migration it failed, not the migration's whole text (which
/// rusqlite's syntax errors carry).
fn migration_step_error(version: i64, e: rusqlite::Error) -> StoreError {
    let what = match e {
        rusqlite::Error::SqlInputError { msg, offset, .. } => {
            format!("{msg} (at byte {offset} of the migration)")
        }
        other => other.to_string(),
    };
    StoreError::Migration(format!("migration {version}: {what}"))
}

/// Opens (creating if needed) the database file at `path` and applies its
/// pending migrations, without starting a store; returns the versions applied
/// (see [`migrate`]). For `idem migrate`.
///
/// # Errors
/// [`StoreError::Unavailable`] when the file cannot be opened; [`StoreError::Migration`].
pub fn migrate_file(path: impl AsRef<Path>) -> Result<Vec<i64>, StoreError> {
    let path = path.as_ref();
    require_file_path(path)?;
    refuse_lost_store(path)?;
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(unavailable)?;
    }
    migrate(&mut open_connection(path)?)
}

/// Opens (creating if needed) the store at `path`, runs migrations and starts the writer thread.
///
/// # Errors
/// [`StoreError::Unavailable`] when the file cannot be opened; [`StoreError::Migration`].
pub fn open(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Store, StoreError> {
    Ok(Store::new(SqliteBackend::open(path, options)?))
}

/// Opens the existing store at `path` without changing its schema: for tools
/// that only read or administer a store (`idem task`, `idem keys list`,
/// `idem gc` …), so that pointing one at the wrong file, or running a newer
/// binary to inspect a store, never creates tables or upgrades it.
///
/// # Errors
/// [`StoreError::Migration`] when this binary does not serve the file's
/// schema (not an idem store, an older one to `idem migrate` first, or a
/// newer one not declared compatible: [`idem_store::SchemaVersion::check`]);
/// [`StoreError::Unavailable`] when it cannot be opened.
pub fn open_existing(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Store, StoreError> {
    let path = path.as_ref();
    require_file_path(path)?;
    Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .and_then(|c| read_schema(&c))
        .map_err(|e| unavailable(format!("{}: {e}", path.display())))?
        .check("store", MIGRATIONS.len() as i64)?;
    Ok(Store::new(SqliteBackend::open_with(path, options, false)?))
}

/// The schema version of the existing database file at `path` (`PRAGMA
/// user_version`: the migrations applied; 0 for a file without idem's
/// schema), read without creating or changing anything.
///
/// # Errors
/// [`StoreError::Unavailable`] when the file cannot be opened or read.
pub fn schema_version(path: &Path) -> Result<i64, StoreError> {
    Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .and_then(|c| c.query_row("PRAGMA user_version", [], |r| r.get(0)))
        .map_err(|e| unavailable(format!("{}: {e}", path.display())))
}

impl SqliteBackend {
    /// See [`open`].
    ///
    /// # Errors
    /// As [`open`].
    pub fn open(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteBackend, StoreError> {
        SqliteBackend::open_with(path, options, true)
    }

    /// [`SqliteBackend::open`], applying pending migrations only if `migrate`.
    fn open_with(
        path: impl AsRef<Path>,
        options: SqliteOptions,
        migrate_schema: bool,
    ) -> Result<SqliteBackend, StoreError> {
        let path = path.as_ref().to_path_buf();
        require_file_path(&path)?;
        refuse_lost_journal(&path)?;
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(unavailable)?;
        }
        let mut writer = open_connection(&path)?;
        let watch = Arc::new(FileWatch::new(&path)?);
        if migrate_schema {
            refuse_foreign_tables(&writer, &path)?;
            migrate(&mut writer)?;
        }
        let mut readers = Vec::with_capacity(READERS);
        for _ in 0..READERS {
            let r = open_connection(&path)?;
            r.execute_batch("PRAGMA query_only = ON;")
                .map_err(unavailable)?;
            readers.push(r);
        }
        let retry_reader = open_connection(&path)?;
        retry_reader
            .execute_batch("PRAGMA query_only = ON;")
            .map_err(unavailable)?;
        let (tx, rx) = batch::queue();
        let writer_watch = Arc::clone(&watch);
        let writer_options = options.clone();
        let changes = idem_store::Changes::new();
        let publisher = changes.publisher();
        std::thread::Builder::new()
            .name("idem-sqlite-writer".into())
            .spawn(move || {
                writer::writer_loop(writer, &rx, &writer_options, &writer_watch, &publisher)
            })
            .map_err(unavailable)?;
        let (retries, retry_rx) = batch::queue();
        let writes = tx.clone();
        let retry_watch = Arc::clone(&watch);
        let retry_options = options.clone();
        std::thread::Builder::new()
            .name("idem-sqlite-retries".into())
            .spawn(move || {
                writer::retry_reader_loop(
                    retry_reader,
                    &retry_rx,
                    &writes,
                    &retry_options,
                    &retry_watch,
                )
            })
            .map_err(unavailable)?;
        Ok(SqliteBackend {
            changes,
            writer: tx,
            retries,
            hints: ScopeHints::new(),
            readers: Arc::new(Mutex::new(readers)),
            read_slots: Arc::new(tokio::sync::Semaphore::new(READERS)),
            path,
            options,
            watch,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The watch over the database file ([`FileWatch`]).
    pub fn watch(&self) -> &FileWatch {
        &self.watch
    }
}

/// The statement and parameters of one search page ([`idem_store::ops::search`])
/// for `tenant`, to look at its plan (`EXPLAIN QUERY PLAN`; docs/benchmarks.md).
#[doc(hidden)]
pub fn search_page_sql(
    tenant: &str,
    q: &idem_store::ops::TaskQuery,
) -> (String, Vec<rusqlite::types::Value>) {
    tx::search::page_sql(tenant, None, q)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]

    use super::*;

    #[test]
    fn migrations_are_numbered_in_order_and_declare_their_compatibility() {
        assert_eq!(idem_store::schema::check_declarations(MIGRATIONS), Ok(()));
    }
    use idem_core::model::Role;
    use idem_store::conformance::submission;
    use idem_store::ops::{self, ListApiKeys, SubmitOutcome};
    use serde_json::json;
    use writer::run_batch;

    /// A store in a temporary directory with one client key of tenant `t`:
    /// the directory (kept alive), the file, the store, and a function making a
    /// `generation.dispatch` submission of that key under idempotency key `k`
    /// with `prompt`.
    async fn seeded() -> (
        tempfile::TempDir,
        PathBuf,
        Store,
        impl Fn(&str, &str) -> ops::Submission,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idem.db");
        let store = open(&path, SqliteOptions::default()).unwrap();
        let (key, _) = store.create_api_key("t", Role::Client, None).await.unwrap();
        let contract = idem_core::config::Config::bundled()
            .unwrap()
            .contract("generation.dispatch")
            .unwrap();
        let sub = move |k: &str, prompt: &str| {
            submission(
                "t",
                "generation.dispatch",
                k,
                json!({"prompt": prompt, "model": "v2", "steps": 30}),
                contract.clone(),
                &key,
            )
        };
        (dir, path, store, sub)
    }

    /// `(tasks, idempotency keys)` stored in the file.
    fn tasks_and_scopes(conn: &Connection) -> (i64, i64) {
        conn.query_row(
            "SELECT (SELECT count(*) FROM tasks), (SELECT count(*) FROM idempotency_keys)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    }

    /// Runs `subs` as one writer batch; their outcomes, in order.
    fn submit_in_one_batch<const N: usize>(
        writer: &mut Connection,
        subs: [ops::Submission; N],
    ) -> [Result<SubmitOutcome, StoreError>; N] {
        let mut batch = Vec::with_capacity(N);
        let answers = subs.map(|s| {
            let (call, rx) = Call::new(ops::Submit(s));
            batch.push(Op::Submit(call));
            rx
        });
        let watch = FileWatch::new(Path::new(writer.path().unwrap())).unwrap();
        run_batch(writer, batch, &SqliteOptions::default(), &watch);
        answers.map(|mut rx| rx.try_recv().expect("answered"))
    }

    /// An error that ends the whole transaction (here SQLITE_FULL) in the
    /// middle of a writer batch: nothing runs after it (each submit "alone"
    /// would have committed on its own), every caller is told that nothing was
    /// written, and nothing was.
    #[tokio::test]
    async fn a_transaction_ended_by_the_database_writes_nothing() {
        let (_dir, path, _store, sub) = seeded().await;
        let mut writer = open_connection(&path).unwrap();
        let pages: i64 = writer
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .unwrap();
        writer
            .execute_batch(&format!("PRAGMA max_page_count = {}", pages + 2))
            .unwrap();
        let big = "z".repeat(3000);
        for singles in [false, true] {
            let (mut batch, mut answers, mut lists) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..4 {
                let (call, r) = Call::new(ops::Submit(sub(&format!("k{i}"), &format!("{big}{i}"))));
                batch.push(Op::Submit(call));
                answers.push(r);
                if singles {
                    // A non-submit between submits: each submit runs alone.
                    let (call, r) = Call::new(ListApiKeys);
                    batch.push(Op::ListApiKeys(call));
                    lists.push(r);
                }
            }
            let watch = FileWatch::new(&path).unwrap();
            run_batch(&mut writer, batch, &SqliteOptions::default(), &watch);
            let errors = answers
                .iter_mut()
                .map(|r| r.try_recv().unwrap().expect_err("disk full"))
                .chain(
                    lists
                        .iter_mut()
                        .map(|r| r.try_recv().unwrap().expect_err("disk full")),
                );
            for e in errors {
                assert!(e.to_string().contains("nothing was written"), "{e}");
                assert!(e.to_string().contains("full"), "the cause is named: {e}");
            }
            assert!(writer.is_autocommit());
            assert_eq!(
                tasks_and_scopes(&open_connection(&path).unwrap()),
                (0, 0),
                "singles: {singles}"
            );
        }
    }

    /// Points task `id` at a new contract row holding `text` (under an id
    /// no contract has, so no process has decoded it).
    fn give_contract(conn: &Connection, id: uuid::Uuid, text: &str) {
        let contract_id = [*id.as_bytes(), *id.as_bytes()].concat();
        conn.execute(
            "INSERT INTO contracts (id, contract) VALUES (?1, ?2)",
            rusqlite::params![contract_id, text],
        )
        .unwrap();
        conn.execute(
            "UPDATE tasks SET contract_id = ?1 WHERE id = ?2",
            rusqlite::params![contract_id, id.to_string()],
        )
        .unwrap();
    }

    /// Submits queued one after another run as one batch on the writer; when
    /// that batch fails (here: a replay whose stored task does not decode),
    /// it is rolled back and each submit runs alone, so only the bad one
    /// fails and the others are created once and committed.
    #[tokio::test]
    async fn queued_submits_run_as_one_batch_and_fail_alone() {
        let (_dir, path, store, sub_as) = seeded().await;
        let sub = |k: &str| sub_as(k, k);
        let SubmitOutcome::Created(bad) = store.submit(sub("bad")).await.unwrap() else {
            panic!("first submit must create");
        };
        let conn = open_connection(&path).unwrap();
        give_contract(&conn, bad.id, "not json");
        drop(conn);

        // A batch of good submits only: one savepoint, all created.
        let mut writer = open_connection(&path).unwrap();
        let [a, b, a_again] = submit_in_one_batch(&mut writer, [sub("a"), sub("b"), sub("a")]);
        let SubmitOutcome::Created(a) = a.unwrap() else {
            panic!("a must be created");
        };
        assert!(matches!(b.unwrap(), SubmitOutcome::Created(_)));
        match a_again.unwrap() {
            SubmitOutcome::Replayed(t) => assert_eq!(t.id, a.id, "in-batch replay"),
            other => panic!("second a: {other:?}"),
        }

        // A batch with the undecodable replay in the middle.
        let [c, bad, d] = submit_in_one_batch(&mut writer, [sub("c"), sub("bad"), sub("d")]);
        let SubmitOutcome::Created(c) = c.unwrap() else {
            panic!("c must be created");
        };
        assert!(bad.is_err(), "the bad replay fails");
        assert!(matches!(d.unwrap(), SubmitOutcome::Created(_)));

        // Committed once: c replays, and every scope has exactly one task.
        match store.submit(sub("c")).await.unwrap() {
            SubmitOutcome::Replayed(t) => assert_eq!(t.id, c.id),
            other => panic!("c again: {other:?}"),
        }
        assert_eq!(tasks_and_scopes(&writer), (5, 5), "bad, a, b, c, d");
    }

    /// A retry of a scope this store has seen bound is answered by the retry
    /// reader, without the write lock: while another connection holds that
    /// lock (`BEGIN IMMEDIATE`), the retry still replays and a changed retry
    /// is still a conflict. Through the writer each would wait out
    /// `busy_timeout` and fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retries_are_answered_without_the_write_lock() {
        let (_dir, path, store, sub) = seeded().await;
        let SubmitOutcome::Created(task) = store.submit(sub("k", "a")).await.unwrap() else {
            panic!("a new key creates its task");
        };
        let lock = open_connection(&path).unwrap();
        lock.execute_batch("BEGIN IMMEDIATE").unwrap();
        match store.submit(sub("k", "a")).await {
            Ok(SubmitOutcome::Replayed(t)) => assert_eq!(t.id, task.id),
            other => panic!("the retry replays while the write lock is held: {other:?}"),
        }
        match store.submit(sub("k", "b")).await {
            Ok(SubmitOutcome::Conflict { task: original }) => assert_eq!(original.id, task.id),
            other => panic!("the changed retry is a conflict: {other:?}"),
        }
        lock.execute_batch("ROLLBACK").unwrap();
        let fresh = store.submit(sub("other", "a")).await;
        assert!(
            matches!(fresh, Ok(SubmitOutcome::Created(_))),
            "a new key is written once the lock is gone: {fresh:?}"
        );
    }

    /// A task row that no longer decodes fails its own retries only: the
    /// healthy retries that share its read are read again on their own and
    /// still replay without the writer, which another connection's write lock
    /// blocks here (through the writer they would wait out `busy_timeout`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreadable_task_does_not_send_its_neighbours_to_the_writer() {
        let (_dir, path, store, sub) = seeded().await;
        let mut tasks = Vec::new();
        for k in ["bad", "good"] {
            let SubmitOutcome::Created(t) = store.submit(sub(k, "a")).await.unwrap() else {
                panic!("a new key creates its task");
            };
            tasks.push(t);
        }
        let lock = open_connection(&path).unwrap();
        give_contract(&lock, tasks[0].id, "{");
        lock.execute_batch("BEGIN IMMEDIATE").unwrap();
        let mut subs = vec![sub("bad", "a")];
        subs.extend((0..8).map(|_| sub("good", "a")));
        let answers = futures::future::join_all(subs.into_iter().map(|s| store.submit(s))).await;
        lock.execute_batch("ROLLBACK").unwrap();
        assert!(
            answers[0].is_err(),
            "the unreadable task fails: {:?}",
            answers[0]
        );
        for a in &answers[1..] {
            match a {
                Ok(SubmitOutcome::Replayed(t)) => assert_eq!(t.id, tasks[1].id),
                other => panic!("a healthy retry replays beside it: {other:?}"),
            }
        }
    }

    /// The message of a store whose file is gone, with `what` happened.
    fn gone(path: &Path, what: &str) -> String {
        format!(
            "store unavailable: the SQLite store file {} was {what} while idem had it open; every request is refused \
             (writes would go to a file no longer at that path, lost at the next restart): \
             restore the file if it was moved by mistake, then restart idem",
            path.display()
        )
    }

    /// A store whose file was removed under it refuses pings, submits,
    /// sweeps and reads with a message naming the path, and keeps refusing
    /// after the path holds a file again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_removed_file_fails_the_store_for_good() {
        let (_dir, path, store, sub) = seeded().await;
        let SubmitOutcome::Created(task) = store.submit(sub("before", "a")).await.unwrap() else {
            panic!("a new key creates its task");
        };
        store.ping().await.unwrap();
        std::fs::remove_file(&path).unwrap();
        let want = gone(&path, "removed");
        assert_eq!(store.ping().await.unwrap_err().to_string(), want);
        assert_eq!(
            store
                .submit(sub("after", "a"))
                .await
                .unwrap_err()
                .to_string(),
            want
        );
        assert_eq!(store.sweep(10).await.unwrap_err().to_string(), want);
        assert_eq!(
            store.get_task(None, task.id).await.unwrap_err().to_string(),
            want
        );
        std::fs::write(&path, b"").unwrap();
        assert_eq!(store.ping().await.unwrap_err().to_string(), want);
    }

    /// A file renamed over the store's path (same name, another inode) is a
    /// replaced store: the next write batch is refused before its COMMIT and
    /// the replacement is left as it was.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replaced_file_fails_the_store_and_is_not_written() {
        let (dir, path, store, sub) = seeded().await;
        let other = dir.path().join("other.db");
        std::fs::copy(&path, &other).unwrap();
        let before = std::fs::read(&other).unwrap();
        std::fs::rename(&other, &path).unwrap();
        let want = gone(&path, "replaced by another file");
        assert_eq!(
            store
                .submit(sub("after", "a"))
                .await
                .unwrap_err()
                .to_string(),
            want
        );
        assert_eq!(store.ping().await.unwrap_err().to_string(), want);
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }

    /// Removing the write-ahead log under a running store (committed pages
    /// not yet checkpointed live only there) fails the store as a removed
    /// database file does: nothing more is acknowledged.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_removed_wal_fails_the_store() {
        let (_dir, path, store, sub) = seeded().await;
        let SubmitOutcome::Created(_) = store.submit(sub("before", "a")).await.unwrap() else {
            panic!("a new key creates its task");
        };
        store.ping().await.unwrap();
        let mut wal = path.clone().into_os_string();
        wal.push("-wal");
        std::fs::remove_file(&wal).unwrap();
        let err = store
            .submit(sub("after", "a"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("-wal removed"), "{err}");
        assert!(
            store
                .ping()
                .await
                .unwrap_err()
                .to_string()
                .contains("-wal removed")
        );
    }
}
