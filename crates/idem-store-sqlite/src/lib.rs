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
//! process owns the file); `clock_offset_ms` shifts it for tests.
//!
//! Pitfalls handled (RUST-NOTES §4.9): writes use `BEGIN IMMEDIATE` (a deferred
//! read-then-write transaction fails with `SQLITE_BUSY`), `foreign_keys=ON`
//! on every connection, short read transactions so checkpoints finish.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use idem_core::model::{
    ApiKey, Attempt, AttemptKind, AttemptState, Event, Evidence, Role, Task, TaskControl,
    TaskState, Timestamp,
};
use idem_store::{
    Backend, BoxFuture, ExistingScope, Op, Output, ScopeHints, ScopeRow, Store, StoreError, Tx, ops,
};
use rusqlite::{Connection, OptionalExtension, Row, params};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

/// Most operations the writer commits together.
pub const MAX_BATCH: usize = 256;

/// Reader connections opened next to the writer; at most this many reads run
/// at once (the others wait for a connection instead of opening one).
pub const READERS: usize = 4;

/// The schema migrations, in order; `PRAGMA user_version` counts those applied.
pub const MIGRATIONS: &[&str] = &[
    include_str!("../migrations/0001_init.sql"),
    include_str!("../migrations/0002_tasks_or_checks.sql"),
    include_str!("../migrations/0003_claim_order_index.sql"),
];

/// Options of the SQLite store.
#[derive(Debug, Clone, Copy, Default)]
pub struct SqliteOptions {
    /// Added to the system clock, ms (tests of clock skew; 0 in production).
    pub clock_offset_ms: i64,
}

type Reply = oneshot::Sender<Result<Output, StoreError>>;

struct Job {
    op: Op,
    reply: Reply,
}

/// The SQLite [`Backend`].
pub struct SqliteBackend {
    writer: mpsc::UnboundedSender<Job>,
    /// Submits whose scope was seen bound ([`ScopeHints`]) go to the retry
    /// reader thread ([`retry_reader_loop`]).
    retries: mpsc::UnboundedSender<Job>,
    hints: ScopeHints,
    readers: Arc<Mutex<Vec<Connection>>>,
    /// One permit per pooled reader connection.
    read_slots: Arc<tokio::sync::Semaphore>,
    path: PathBuf,
    options: SqliteOptions,
    watch: Arc<FileWatch>,
}

/// The database file as the store opened it: its path and (device, inode),
/// and whether it has been found removed or replaced since (then for good).
#[derive(Debug)]
pub struct FileWatch {
    path: PathBuf,
    /// (device, inode) of `path` at open; `None` where the platform has none.
    id: Option<(u64, u64)>,
    failed: OnceLock<StoreError>,
}

impl FileWatch {
    /// Takes the identity of the file at `path` now.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when `path` cannot be read (naming it).
    pub fn new(path: &Path) -> Result<FileWatch, StoreError> {
        Ok(FileWatch {
            path: path.to_path_buf(),
            id: file_id(path).map_err(|e| unavailable(format!("{}: {e}", path.display())))?,
            failed: OnceLock::new(),
        })
    }

    /// The error the store failed with, if it has (no system call).
    pub fn failed(&self) -> Option<StoreError> {
        self.failed.get().cloned()
    }

    /// Checks that the file at the path is still the one opened (one
    /// `stat`). The first time it is not, logs one ERROR line and marks the
    /// store failed.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]: `the SQLite store file PATH was removed
    /// …` or `… was replaced by another file …`, then the same for every later
    /// call; or, when the path cannot be read for another reason (permission),
    /// that error, without marking the store failed.
    pub fn check(&self) -> Result<(), StoreError> {
        if let Some(e) = self.failed.get() {
            return Err(e.clone());
        }
        let Some(opened) = self.id else {
            return Ok(());
        };
        let what = match file_id(&self.path) {
            Ok(Some(now)) if now == opened => return Ok(()),
            Ok(_) => "replaced by another file",
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "removed",
            Err(e) => {
                return Err(unavailable(format!(
                    "cannot check the SQLite store file {}: {e}",
                    self.path.display()
                )));
            }
        };
        let err = unavailable(format!(
            "the SQLite store file {} was {what} while idem had it open; every request is refused \
             (writes would go to a file no longer at that path, lost at the next restart): \
             restore the file if it was moved by mistake, then restart idem",
            self.path.display()
        ));
        if self.failed.set(err.clone()).is_ok()
            && let StoreError::Unavailable(message) = &err
        {
            tracing::error!("{message}");
        }
        Err(err)
    }
}

/// The (device, inode) of the file at `path` (following symbolic links, as
/// SQLite does when it opens it); `None` where the platform has none.
fn file_id(path: &Path) -> std::io::Result<Option<(u64, u64)>> {
    let meta = std::fs::metadata(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Ok(Some((meta.dev(), meta.ino())))
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        Ok(None)
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn db(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            StoreError::Contention(e.to_string())
        }
        Some(rusqlite::ErrorCode::ConstraintViolation) => StoreError::Contention(e.to_string()),
        _ => StoreError::Unavailable(e.to_string()),
    }
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
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
/// [`StoreError::Migration`] when a step fails or the file is newer than this binary.
pub fn migrate(conn: &mut Connection) -> Result<Vec<i64>, StoreError> {
    let mig = |e: rusqlite::Error| StoreError::Migration(e.to_string());
    // A migration may rebuild a table that others reference; foreign keys are
    // off while it runs (SQLite ignores the pragma inside a transaction) and
    // checked in full before the commit.
    conn.pragma_update(None, "foreign_keys", false)
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
    let current: i64 = tx
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(mig)?;
    let known = MIGRATIONS.len() as i64;
    if current > known {
        return Err(idem_store::schema_mismatch("store", current, known));
    }
    let mut applied = Vec::new();
    for (i, sql) in MIGRATIONS
        .iter()
        .enumerate()
        .skip(usize::try_from(current).unwrap_or(0))
    {
        let version = i as i64 + 1;
        tx.execute_batch(sql)
            .map_err(|e| migration_step_error(version, e))?;
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
/// [`StoreError::Migration`] when the file's schema is not this binary's
/// (`PRAGMA user_version` ≠ [`MIGRATIONS`]`.len()`: not an idem store, an
/// older one to `idem migrate` first, or a newer one);
/// [`StoreError::Unavailable`] when it cannot be opened.
pub fn open_existing(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Store, StoreError> {
    let path = path.as_ref();
    require_file_path(path)?;
    let version: i64 =
        Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| c.query_row("PRAGMA user_version", [], |r| r.get(0)))
            .map_err(|e| unavailable(format!("{}: {e}", path.display())))?;
    let known = MIGRATIONS.len() as i64;
    if version != known {
        return Err(idem_store::schema_mismatch("store", version, known));
    }
    Ok(Store::new(SqliteBackend::open_with(path, options, false)?))
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
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(unavailable)?;
        }
        let mut writer = open_connection(&path)?;
        let watch = Arc::new(FileWatch::new(&path)?);
        if migrate_schema {
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
        let (tx, rx) = mpsc::unbounded_channel();
        let writer_watch = Arc::clone(&watch);
        std::thread::Builder::new()
            .name("idem-sqlite-writer".into())
            .spawn(move || writer_loop(writer, rx, options, &writer_watch))
            .map_err(unavailable)?;
        let (retries, retry_rx) = mpsc::unbounded_channel();
        let writes = tx.clone();
        let retry_watch = Arc::clone(&watch);
        std::thread::Builder::new()
            .name("idem-sqlite-retries".into())
            .spawn(move || retry_reader_loop(retry_reader, retry_rx, writes, options, &retry_watch))
            .map_err(unavailable)?;
        Ok(SqliteBackend {
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

fn clock(options: SqliteOptions) -> Timestamp {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    Timestamp(ms.saturating_add(options.clock_offset_ms))
}

/// Runs a transaction-control statement (`BEGIN`, `SAVEPOINT`, `COMMIT` …)
/// through the connection's statement cache: parsed once, not per use.
fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// The writer thread: batches queued jobs into one IMMEDIATE transaction with a
/// savepoint per job, commits once, then answers.
fn writer_loop(
    mut conn: Connection,
    mut rx: mpsc::UnboundedReceiver<Job>,
    options: SqliteOptions,
    watch: &FileWatch,
) {
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    while next_batch(&mut rx, &mut batch) {
        run_batch(&mut conn, &mut batch, options, watch);
    }
}

/// Waits for the next job, then takes whatever else is queued, up to
/// [`MAX_BATCH`], into `batch`; `false` once every sender is gone.
fn next_batch(rx: &mut mpsc::UnboundedReceiver<Job>, batch: &mut Vec<Job>) -> bool {
    let Some(first) = rx.blocking_recv() else {
        return false;
    };
    batch.push(first);
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    true
}

/// The retry reader thread: answers submits whose scope was seen bound
/// ([`ScopeHints`]) in one read transaction per batch on its own
/// (`query_only`) connection, through [`ops::answer_retries`]: a replay or a
/// conflict without the write lock, a savepoint or an insert attempt, and
/// without waiting behind the writer. A submission that read cannot answer
/// (its key revoked, its scope not bound), or a batch whose read failed, goes
/// on to the writer (`writes`), which answers it as if it had never been here.
fn retry_reader_loop(
    mut conn: Connection,
    mut rx: mpsc::UnboundedReceiver<Job>,
    writes: mpsc::UnboundedSender<Job>,
    options: SqliteOptions,
    watch: &FileWatch,
) {
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    while next_batch(&mut rx, &mut batch) {
        let mut subs: Vec<ops::Submission> = Vec::with_capacity(batch.len());
        let mut replies: Vec<Reply> = Vec::with_capacity(batch.len());
        for job in batch.drain(..) {
            match job.op {
                Op::Submit(s) => {
                    subs.push(s);
                    replies.push(job.reply);
                }
                // Only submits are sent here; anything else is written.
                op => forward(
                    &writes,
                    Job {
                        op,
                        reply: job.reply,
                    },
                ),
            }
        }
        let mut answers = read_retries(&mut conn, &subs, options).into_iter();
        // Answers read from a file no longer at its path are not given.
        if let Err(e) = watch.check() {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
            continue;
        }
        for (sub, reply) in subs.into_iter().zip(replies) {
            match answers.next().flatten() {
                Some(outcome) => {
                    let _ = reply.send(Ok(Output::Submitted(outcome)));
                }
                None => forward(
                    &writes,
                    Job {
                        op: Op::Submit(sub),
                        reply,
                    },
                ),
            }
        }
    }
}

/// Hands `job` to the writer thread, or answers that it has stopped.
fn forward(writes: &mpsc::UnboundedSender<Job>, job: Job) {
    if let Err(mpsc::error::SendError(job)) = writes.send(job) {
        let _ = job
            .reply
            .send(Err(unavailable("the SQLite writer thread has stopped")));
    }
}

/// [`ops::answer_retries`] in one read transaction: one answer per submission
/// (`None`: go to the writer). When one row fails the whole read (it does not
/// decode), each submission is read on its own, so only that one goes to the
/// writer; after any other failure all of them do.
fn read_retries(
    conn: &mut Connection,
    subs: &[ops::Submission],
    options: SqliteOptions,
) -> Vec<Option<ops::SubmitOutcome>> {
    match read_retries_once(conn, subs, options) {
        Ok(answers) => answers,
        Err(StoreError::Corrupt(e)) if subs.len() > 1 => {
            tracing::debug!(error = %e, "reading retries failed; reading them one by one");
            subs.iter()
                .map(|s| {
                    read_retries_once(conn, std::slice::from_ref(s), options)
                        .ok()
                        .and_then(|mut a| a.pop())
                        .flatten()
                })
                .collect()
        }
        Err(e) => {
            tracing::debug!(error = %e, "reading retries failed; writing them instead");
            Vec::new()
        }
    }
}

/// One read transaction of [`ops::answer_retries`] ([`in_read_tx`]).
fn read_retries_once(
    conn: &mut Connection,
    subs: &[ops::Submission],
    options: SqliteOptions,
) -> Result<Vec<Option<ops::SubmitOutcome>>, StoreError> {
    in_read_tx(conn, options, |tx| {
        futures::executor::block_on(ops::answer_retries(tx, subs))
    })
}

/// Runs `f` in one read transaction on `conn`; a transaction that does not
/// end with `COMMIT` is rolled back, so none stays open (it would hold back
/// checkpoints, and the connection's next `BEGIN` would fail).
///
/// # Errors
/// `f`'s error, or [`StoreError`] when `BEGIN` or `COMMIT` fails.
fn in_read_tx<R>(
    conn: &mut Connection,
    options: SqliteOptions,
    f: impl FnOnce(&mut SqliteTx<'_>) -> Result<R, StoreError>,
) -> Result<R, StoreError> {
    control(conn, "BEGIN").map_err(db)?;
    let res = f(&mut SqliteTx {
        conn: &mut *conn,
        options,
    });
    if let Err(e) = control(conn, "COMMIT") {
        let _ = control(conn, "ROLLBACK");
        return Err(db(e));
    }
    res
}

/// Runs `batch` in one transaction and answers each job; every answer is
/// an error when the file was found removed or replaced ([`FileWatch::check`])
/// before the COMMIT (then rolled back) or after it.
fn run_batch(
    conn: &mut Connection,
    batch: &mut Vec<Job>,
    options: SqliteOptions,
    watch: &FileWatch,
) {
    if let Err(e) = watch.check() {
        for job in batch.drain(..) {
            let _ = job.reply.send(Err(e.clone()));
        }
        return;
    }
    if let Err(e) = control(conn, "BEGIN IMMEDIATE") {
        let err = db(e);
        for job in batch.drain(..) {
            let _ = job.reply.send(Err(err.clone()));
        }
        return;
    }
    let (ops, replies): (Vec<Op>, Vec<Reply>) = batch.drain(..).map(|j| (j.op, j.reply)).unzip();
    let mut results = Vec::with_capacity(ops.len());
    let mut submits: Vec<ops::Submission> = Vec::new();
    for op in ops {
        match op {
            Op::Submit(sub) => submits.push(sub),
            op => {
                run_submits(conn, std::mem::take(&mut submits), options, &mut results);
                if conn.is_autocommit() {
                    break;
                }
                results.push(run_in_savepoint(conn, &op, options));
                if conn.is_autocommit() {
                    break;
                }
            }
        }
    }
    if !conn.is_autocommit() {
        run_submits(conn, submits, options, &mut results);
    }
    // Some errors (SQLITE_FULL, SQLITE_IOERR, SQLITE_NOMEM …) roll back the
    // whole transaction, not only the savepoint: everything this batch did is
    // gone, and nothing more may run, or it would commit on its own.
    if conn.is_autocommit() {
        let cause = results
            .iter()
            .find_map(|r| r.as_ref().err())
            .map_or_else(|| "unknown error".to_owned(), ToString::to_string);
        let err = unavailable(format!(
            "the transaction was rolled back ({cause}); nothing was written"
        ));
        for reply in replies {
            let _ = reply.send(Err(err.clone()));
        }
        return;
    }
    // Checked again after the COMMIT: a file removed in between took this
    // batch with it, so it is not acknowledged.
    let checked = watch.check().and_then(|()| {
        control(conn, "COMMIT")
            .map_err(|e| unavailable(format!("commit failed, nothing written: {e}")))
    });
    if let Err(err) = checked.and_then(|()| watch.check()) {
        if !conn.is_autocommit() {
            let _ = control(conn, "ROLLBACK");
        }
        for reply in replies {
            let _ = reply.send(Err(err.clone()));
        }
        return;
    }
    for (reply, res) in replies.into_iter().zip(results) {
        let _ = reply.send(res);
    }
}

/// Runs queued submits that arrived one after another as one submit batch
/// ([`ops::submit_batch`]: one key check, the scope rows, then the tasks;
/// answered as if submitted one after another) in one savepoint, and pushes
/// one result per submit. When the batch fails as a whole, its savepoint is
/// rolled back and each submit runs alone in its own, so one bad submit fails
/// only itself.
fn run_submits(
    conn: &mut Connection,
    submits: Vec<ops::Submission>,
    options: SqliteOptions,
    results: &mut Vec<Result<Output, StoreError>>,
) {
    if submits.len() > 1 && control(conn, "SAVEPOINT op").is_ok() {
        let res = {
            let mut tx = SqliteTx {
                conn: &mut *conn,
                options,
            };
            futures::executor::block_on(ops::submit_batch(&mut tx, &submits))
        };
        match res {
            Ok(outcomes)
                if outcomes.len() == submits.len() && control(conn, "RELEASE op").is_ok() =>
            {
                results.extend(outcomes.into_iter().map(|o| Ok(Output::Submitted(o))));
                return;
            }
            // The error ended the whole transaction (see run_batch): keep it
            // as the cause, and run nothing alone.
            Err(e) if conn.is_autocommit() => {
                results.push(Err(e));
                return;
            }
            _ => {}
        }
        let _ = control(conn, "ROLLBACK TO op");
        let _ = control(conn, "RELEASE op");
    }
    for sub in submits {
        if conn.is_autocommit() {
            // The transaction is gone (see run_batch): run nothing alone.
            return;
        }
        results.push(run_in_savepoint(conn, &Op::Submit(sub), options));
    }
}

fn run_in_savepoint(
    conn: &mut Connection,
    op: &Op,
    options: SqliteOptions,
) -> Result<Output, StoreError> {
    control(conn, "SAVEPOINT op").map_err(db)?;
    let mut attempts = 0;
    loop {
        let res = {
            let mut tx = SqliteTx {
                conn: &mut *conn,
                options,
            };
            futures::executor::block_on(ops::run(&mut tx, op))
        };
        match res {
            Ok(out) => {
                control(conn, "RELEASE op").map_err(db)?;
                return Ok(out);
            }
            Err(e) => {
                if conn.is_autocommit() {
                    // The error ended the whole transaction (see run_batch).
                    return Err(e);
                }
                control(conn, "ROLLBACK TO op").map_err(db)?;
                attempts += 1;
                if matches!(e, StoreError::Contention(_)) && attempts < 3 {
                    continue;
                }
                control(conn, "RELEASE op").map_err(db)?;
                return Err(e);
            }
        }
    }
}

impl SqliteBackend {
    /// Runs a read-only `op` on a pooled reader connection (at most
    /// [`READERS`] at once) on the blocking pool.
    async fn read(&self, op: Op) -> Result<Output, StoreError> {
        let slot = Arc::clone(&self.read_slots)
            .acquire_owned()
            .await
            .map_err(unavailable)?;
        let readers = Arc::clone(&self.readers);
        let options = self.options;
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let res = read(&readers, &path, &op, options);
            drop(slot);
            res
        })
        .await
        .map_err(unavailable)?
    }
}

impl Backend for SqliteBackend {
    fn execute(&self, op: Op) -> BoxFuture<'_, Result<Output, StoreError>> {
        Box::pin(async move {
            if let Some(e) = self.watch.failed() {
                return Err(e);
            }
            if let Op::Submit(sub) = &op {
                let scope = self.hints.hash(sub);
                let seen = self.hints.seen(scope);
                let (reply, rx) = oneshot::channel();
                let job = Job { op, reply };
                let unsent = if seen {
                    // Should the retry reader be gone, the writer answers.
                    match self.retries.send(job) {
                        Ok(()) => None,
                        Err(mpsc::error::SendError(back)) => Some(back),
                    }
                } else {
                    Some(job)
                };
                if let Some(job) = unsent {
                    self.writer
                        .send(job)
                        .map_err(|_| unavailable("the SQLite writer thread has stopped"))?;
                }
                let out = rx
                    .await
                    .map_err(|_| unavailable("the SQLite writer thread has stopped"))?;
                // A scope not seen yet was written: remember it once answered.
                if !seen && let Ok(Output::Submitted(outcome)) = &out {
                    self.hints.remember(scope, outcome);
                }
                return out;
            }
            if op.writes() {
                let (reply, rx) = oneshot::channel();
                self.writer
                    .send(Job { op, reply })
                    .map_err(|_| unavailable("the SQLite writer thread has stopped"))?;
                // The writer finishes the transaction even if this future is dropped
                // (client disconnect): the commit path never depends on the caller.
                rx.await
                    .map_err(|_| unavailable("the SQLite writer thread has stopped"))?
            } else {
                self.read(op).await
            }
        })
    }

    /// Every writing operation runs on the writer thread, which commits or rolls
    /// back whether or not the caller still waits.
    fn runs_detached(&self, op: &Op) -> bool {
        op.writes()
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.watch.check()?;
            let readers = Arc::clone(&self.readers);
            let path = self.path.clone();
            tokio::task::spawn_blocking(move || {
                with_reader(&readers, &path, |c| {
                    c.query_row("SELECT 1", [], |_| Ok(())).map_err(db)
                })
            })
            .await
            .map_err(unavailable)?
        })
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }
}

fn with_reader<R>(
    readers: &Mutex<Vec<Connection>>,
    path: &Path,
    f: impl FnOnce(&mut Connection) -> Result<R, StoreError>,
) -> Result<R, StoreError> {
    let pooled = readers
        .lock()
        .map_err(|_| unavailable("reader pool poisoned"))?
        .pop();
    let mut conn = match pooled {
        Some(c) => c,
        None => {
            let c = open_connection(path)?;
            c.execute_batch("PRAGMA query_only = ON;")
                .map_err(unavailable)?;
            c
        }
    };
    let res = f(&mut conn);
    if let Ok(mut pool) = readers.lock()
        && pool.len() < READERS
    {
        pool.push(conn);
    }
    res
}

fn read(
    readers: &Mutex<Vec<Connection>>,
    path: &Path,
    op: &Op,
    options: SqliteOptions,
) -> Result<Output, StoreError> {
    with_reader(readers, path, |conn| {
        in_read_tx(conn, options, |tx| {
            futures::executor::block_on(ops::run(tx, op))
        })
    })
}

/// The open transaction on the writer (or a reader) connection.
struct SqliteTx<'a> {
    conn: &'a mut Connection,
    options: SqliteOptions,
}

fn to_json<T: Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(corrupt)
}

fn from_json<T: DeserializeOwned>(s: &str) -> rusqlite::Result<T> {
    serde_json::from_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn word<T: std::str::FromStr>(s: &str) -> rusqlite::Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    s.parse().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn uuid(s: &str) -> rusqlite::Result<Uuid> {
    Uuid::parse_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn opt_json<T: DeserializeOwned>(s: Option<String>) -> rusqlite::Result<Option<T>> {
    s.as_deref().map(from_json).transpose()
}

const API_KEY_COLUMNS: &str = "id, tenant, role, operations, created_at, revoked_at";

fn api_key_row(r: &Row<'_>) -> rusqlite::Result<ApiKey> {
    Ok(ApiKey {
        id: uuid(&r.get::<_, String>(0)?)?,
        tenant: r.get(1)?,
        role: word::<Role>(&r.get::<_, String>(2)?)?,
        operations: opt_json(r.get(3)?)?,
        created_at: Timestamp(r.get(4)?),
        revoked_at: r.get::<_, Option<i64>>(5)?.map(Timestamp),
    })
}

/// The task columns, in the order [`task_row`] reads and `task_values` binds
/// them, each after `prefix` (`""`, or `"t."` for a join); a macro so that
/// statements are built at compile time (the task read runs on every replay).
macro_rules! task_columns {
    () => {
        task_columns!("")
    };
    ($prefix:literal) => {
        task_columns!(@ $prefix; id, tenant, operation, idempotency_key, fingerprint, canonical_request, params, state, generation, version, event_seq, attempt_count, execute_count, usage, contract, cancellation, delivery, failure, api_key_id, next_kind, active_attempt_id, ready_at, deadline_at, terminal_at, key_expires_at, created_at, updated_at)
    };
    (@ $prefix:literal; $first:ident $(, $col:ident)*) => {
        concat!($prefix, stringify!($first) $(, ", ", $prefix, stringify!($col))*)
    };
}

/// A scope row joined with its task: [`task_columns!`] (NULL when the task
/// row is missing), then the scope's fingerprint and task id.
const SCOPE_WITH_TASK: &str = concat!(
    "SELECT ",
    task_columns!("t."),
    ", k.fingerprint, k.task_id FROM idempotency_keys k \
     LEFT JOIN tasks t ON t.id = k.task_id \
     WHERE k.tenant = ?1 AND k.operation = ?2 AND k.idempotency_key = ?3"
);

/// Column `i` as text borrowed from the row (no copy before it is parsed).
fn text<'r>(r: &'r Row<'_>, i: usize) -> rusqlite::Result<&'r str> {
    r.get_ref(i)?.as_str().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e))
    })
}

/// The contract stored as `json` ([`idem_store::decode_contract`]).
fn contract(json: &str) -> rusqlite::Result<idem_core::config::Contract> {
    idem_store::decode_contract(json).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(14, rusqlite::types::Type::Text, Box::new(e))
    })
}

/// Columns [`task_row`] reads: [`task_columns!`], 0 to 26.
const TASK_COLUMN_COUNT: usize = 27;

fn task_row(r: &Row<'_>) -> rusqlite::Result<Task> {
    Ok(Task {
        id: uuid(text(r, 0)?)?,
        operation: r.get(2)?,
        idempotency_key: r.get(3)?,
        fingerprint: r.get(4)?,
        params: from_json(text(r, 6)?)?,
        state: word::<TaskState>(text(r, 7)?)?,
        generation: r.get(8)?,
        attempt_count: r.get(11)?,
        usage: r.get(13)?,
        contract: contract(text(r, 14)?)?,
        cancellation: opt_json(r.get(15)?)?,
        delivery: opt_json(r.get(16)?)?,
        failure: opt_json(r.get(17)?)?,
        created_at: Timestamp(r.get(25)?),
        updated_at: Timestamp(r.get(26)?),
        control: TaskControl {
            tenant: r.get(1)?,
            canonical_request: r.get(5)?,
            version: r.get(9)?,
            event_seq: r.get(10)?,
            execute_count: r.get(12)?,
            api_key_id: uuid(text(r, 18)?)?,
            next_kind: r
                .get::<_, Option<String>>(19)?
                .as_deref()
                .map(word::<AttemptKind>)
                .transpose()?,
            active_attempt_id: r
                .get::<_, Option<String>>(20)?
                .as_deref()
                .map(uuid)
                .transpose()?,
            ready_at: Timestamp(r.get(21)?),
            deadline_at: Timestamp(r.get(22)?),
            terminal_at: r.get::<_, Option<i64>>(23)?.map(Timestamp),
            key_expires_at: r.get::<_, Option<i64>>(24)?.map(Timestamp),
        },
    })
}

const ATTEMPT_COLUMNS: &str = "id, task_id, number, generation, kind, state, executor_id, leased_at, lease_expires_at, \
     lease_ms, usage, external_txn_id, report";

fn attempt_row(r: &Row<'_>) -> rusqlite::Result<Attempt> {
    Ok(Attempt {
        id: uuid(&r.get::<_, String>(0)?)?,
        task_id: uuid(&r.get::<_, String>(1)?)?,
        number: r.get(2)?,
        generation: r.get(3)?,
        kind: word::<AttemptKind>(&r.get::<_, String>(4)?)?,
        state: word::<AttemptState>(&r.get::<_, String>(5)?)?,
        executor_id: r.get(6)?,
        leased_at: Timestamp(r.get(7)?),
        lease_expires_at: Timestamp(r.get(8)?),
        lease_ms: r.get(9)?,
        usage: r.get(10)?,
        external_txn_id: r.get(11)?,
        report: opt_json(r.get(12)?)?,
        evidence: Vec::new(),
    })
}

fn decode(e: rusqlite::Error) -> StoreError {
    match e {
        rusqlite::Error::FromSqlConversionFailure(..) | rusqlite::Error::InvalidColumnType(..) => {
            corrupt(e)
        }
        other => db(other),
    }
}

impl SqliteTx<'_> {
    fn ids(&mut self, sql: &str, params: impl rusqlite::Params) -> Result<Vec<Uuid>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql).map_err(db)?;
        let rows = stmt
            .query_map(params, |r| uuid(&r.get::<_, String>(0)?))
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }
}

/// The claimable tasks of tenant `?1` in class `?2` ready at `?3` (ms), oldest
/// first (`ready_at`, then `id`), at most `?4`: an ordered walk of the partial
/// index `tasks_claim_order`, whose predicate it repeats word for word.
pub const CLAIMABLE_IN_CLASS: &str = "SELECT id, ready_at FROM tasks WHERE tenant = ?1 AND operation = ?2 \
     AND active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') \
     AND ready_at <= ?3 \
     ORDER BY ready_at, id LIMIT ?4";

impl Tx for SqliteTx<'_> {
    async fn now(&mut self) -> Result<Timestamp, StoreError> {
        Ok(clock(self.options))
    }

    async fn insert_api_key(&mut self, key: &ApiKey, hash: &str) -> Result<(), StoreError> {
        let ops = key.operations.as_ref().map(to_json).transpose()?;
        self.conn
            .prepare_cached("INSERT INTO api_keys (id, tenant, role, operations, key_hash, created_at, revoked_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)")
            .and_then(|mut s| {
                s.execute(params![
                    key.id.to_string(),
                    key.tenant,
                    key.role.as_str(),
                    ops,
                    hash,
                    key.created_at.0,
                    key.revoked_at.map(|t| t.0)
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn api_key_by_hash(&mut self, hash: &str) -> Result<Option<ApiKey>, StoreError> {
        let sql = format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE key_hash = ?1");
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| s.query_row([hash], api_key_row).optional())
            .map_err(decode)
    }

    async fn api_key(&mut self, id: Uuid) -> Result<Option<ApiKey>, StoreError> {
        let sql = format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1");
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| s.query_row([id.to_string()], api_key_row).optional())
            .map_err(decode)
    }

    async fn revoke_api_key(
        &mut self,
        id: Uuid,
        at: Timestamp,
    ) -> Result<Option<ApiKey>, StoreError> {
        self.conn
            .prepare_cached(
                "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
            )
            .and_then(|mut s| s.execute(params![id.to_string(), at.0]))
            .map_err(db)?;
        self.api_key(id).await
    }

    async fn list_api_keys(&mut self) -> Result<Vec<ApiKey>, StoreError> {
        let sql = format!("SELECT {API_KEY_COLUMNS} FROM api_keys ORDER BY created_at, id");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db)?;
        let rows = stmt.query_map([], api_key_row).map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    async fn insert_scope(&mut self, row: &ScopeRow) -> Result<bool, StoreError> {
        let n = self
            .conn
            .prepare_cached(
                "INSERT INTO idempotency_keys (tenant, operation, idempotency_key, fingerprint, task_id) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
            )
            .and_then(|mut s| {
                s.execute(params![
                    row.tenant,
                    row.operation,
                    row.idempotency_key,
                    row.fingerprint,
                    row.task_id.to_string()
                ])
            })
            .map_err(db)?;
        Ok(n == 1)
    }

    async fn scope(
        &mut self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<Option<ScopeRow>, StoreError> {
        self.conn
            .prepare_cached(
                "SELECT fingerprint, task_id FROM idempotency_keys \
                 WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
            )
            .and_then(|mut s| {
                s.query_row(params![tenant, operation, key], |r| {
                    Ok(ScopeRow {
                        tenant: tenant.to_owned(),
                        operation: operation.to_owned(),
                        idempotency_key: key.to_owned(),
                        fingerprint: r.get(0)?,
                        task_id: uuid(&r.get::<_, String>(1)?)?,
                    })
                })
                .optional()
            })
            .map_err(decode)
    }

    /// One statement per scope (the scope row joined with its task) instead
    /// of the default's two; same rows, same snapshot (one transaction).
    async fn scopes_with_tasks(
        &mut self,
        scopes: &[(String, String, String)],
    ) -> Result<Vec<ExistingScope>, StoreError> {
        let mut stmt = self.conn.prepare_cached(SCOPE_WITH_TASK).map_err(decode)?;
        let mut out = Vec::with_capacity(scopes.len());
        for (tenant, operation, key) in scopes {
            let found = stmt
                .query_row(params![tenant, operation, key], |r| {
                    let row = ScopeRow {
                        tenant: tenant.clone(),
                        operation: operation.clone(),
                        idempotency_key: key.clone(),
                        fingerprint: r.get(TASK_COLUMN_COUNT)?,
                        task_id: uuid(text(r, TASK_COLUMN_COUNT + 1)?)?,
                    };
                    // No task row joined: `t.id` is NULL.
                    let task = match r.get_ref(0)? {
                        rusqlite::types::ValueRef::Null => None,
                        _ => Some(task_row(r)?),
                    };
                    Ok((row, task))
                })
                .optional()
                .map_err(decode)?;
            out.push(found);
        }
        Ok(out)
    }

    async fn delete_scope(&mut self, task_id: Uuid) -> Result<(), StoreError> {
        self.conn
            .prepare_cached("DELETE FROM idempotency_keys WHERE task_id = ?1")
            .and_then(|mut s| s.execute([task_id.to_string()]))
            .map_err(db)?;
        Ok(())
    }

    async fn insert_task(&mut self, t: &Task) -> Result<(), StoreError> {
        let values = task_values(t)?;
        self.conn
            .prepare_cached(concat!(
                "INSERT INTO tasks (",
                task_columns!(),
                ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, \
                 ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27)"
            ))
            .and_then(|mut s| s.execute(rusqlite::params_from_iter(values.iter())))
            .map_err(db)?;
        Ok(())
    }

    async fn task(&mut self, id: Uuid, _lock: bool) -> Result<Option<Task>, StoreError> {
        // The writer holds the only write transaction (BEGIN IMMEDIATE): rows are locked.
        self.conn
            .prepare_cached(concat!(
                "SELECT ",
                task_columns!(),
                " FROM tasks WHERE id = ?1"
            ))
            .and_then(|mut s| s.query_row([id.to_string()], task_row).optional())
            .map_err(decode)
    }

    async fn update_task(
        &mut self,
        t: &Task,
        expected_version: i64,
        expected_generation: i64,
    ) -> Result<(), StoreError> {
        let values = task_values(t)?;
        let n = self
            .conn
            .prepare_cached(
                "UPDATE tasks SET state = ?8, generation = ?9, version = version + 1, event_seq = ?11, \
                 attempt_count = ?12, execute_count = ?13, usage = ?14, cancellation = ?16, delivery = ?17, \
                 failure = ?18, next_kind = ?20, active_attempt_id = ?21, ready_at = ?22, terminal_at = ?24, \
                 key_expires_at = ?25, updated_at = ?27 \
                 WHERE id = ?1 AND version = ?28 AND generation = ?29",
            )
            .and_then(|mut s| {
                let mut all = values;
                all.push(expected_version.into());
                all.push(expected_generation.into());
                // Parameters 2..7, 10, 15, 19, 23, 26 are the immutable columns: bound, unused.
                s.execute(rusqlite::params_from_iter(all.iter()))
            })
            .map_err(db)?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "task {} changed concurrently",
                t.id
            )))
        }
    }

    async fn insert_attempt(&mut self, a: &Attempt) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO attempts ({ATTEMPT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
        );
        let report = a.report.as_ref().map(to_json).transpose()?;
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| {
                s.execute(params![
                    a.id.to_string(),
                    a.task_id.to_string(),
                    a.number,
                    a.generation,
                    a.kind.as_str(),
                    a.state.as_str(),
                    a.executor_id,
                    a.leased_at.0,
                    a.lease_expires_at.0,
                    a.lease_ms,
                    a.usage,
                    a.external_txn_id,
                    report
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn update_attempt(&mut self, a: &Attempt) -> Result<(), StoreError> {
        let report = a.report.as_ref().map(to_json).transpose()?;
        let n = self
            .conn
            .prepare_cached(
                "UPDATE attempts SET state = ?3, lease_expires_at = ?4, usage = ?5, external_txn_id = ?6, report = ?7 \
                 WHERE id = ?1 AND generation = ?2",
            )
            .and_then(|mut s| {
                s.execute(params![
                    a.id.to_string(),
                    a.generation,
                    a.state.as_str(),
                    a.lease_expires_at.0,
                    a.usage,
                    a.external_txn_id,
                    report
                ])
            })
            .map_err(db)?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "attempt {} changed concurrently",
                a.id
            )))
        }
    }

    async fn attempt(&mut self, id: Uuid) -> Result<Option<Attempt>, StoreError> {
        let sql = format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE id = ?1");
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| s.query_row([id.to_string()], attempt_row).optional())
            .map_err(decode)
    }

    async fn attempts(&mut self, task_id: Uuid) -> Result<Vec<Attempt>, StoreError> {
        let sql =
            format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE task_id = ?1 ORDER BY number");
        let mut attempts = {
            let mut stmt = self.conn.prepare_cached(&sql).map_err(db)?;
            let rows = stmt
                .query_map([task_id.to_string()], attempt_row)
                .map_err(db)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)?
        };
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT attempt_id, received_at, generation, outcome, body, disposition FROM evidence \
                 WHERE task_id = ?1 ORDER BY id",
            )
            .map_err(db)?;
        let rows = stmt
            .query_map([task_id.to_string()], |r| {
                Ok((
                    uuid(&r.get::<_, String>(0)?)?,
                    Evidence {
                        received_at: Timestamp(r.get(1)?),
                        generation: r.get(2)?,
                        outcome: r.get(3)?,
                        body: from_json(&r.get::<_, String>(4)?)?,
                        disposition: r.get(5)?,
                    },
                ))
            })
            .map_err(db)?;
        for row in rows {
            let (attempt_id, ev) = row.map_err(decode)?;
            if let Some(a) = attempts.iter_mut().find(|a| a.id == attempt_id) {
                a.evidence.push(ev);
            }
        }
        Ok(attempts)
    }

    async fn insert_evidence(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        ev: &Evidence,
    ) -> Result<(), StoreError> {
        let body = to_json(&ev.body)?;
        self.conn
            .prepare_cached(
                "INSERT INTO evidence (task_id, attempt_id, received_at, generation, outcome, body, disposition) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    task_id.to_string(),
                    attempt_id.to_string(),
                    ev.received_at.0,
                    ev.generation,
                    ev.outcome,
                    body,
                    ev.disposition
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn insert_events(&mut self, task_id: Uuid, events: &[Event]) -> Result<(), StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "INSERT INTO events (task_id, seq, type, at, data) VALUES (?1, ?2, ?3, ?4, ?5)",
            )
            .map_err(db)?;
        let id = task_id.to_string();
        for e in events {
            let data = to_json(&e.data)?;
            stmt.execute(params![id, e.seq, e.kind, e.at.0, data])
                .map_err(db)?;
        }
        Ok(())
    }

    async fn events(&mut self, task_id: Uuid) -> Result<Vec<Event>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT seq, type, at, data FROM events WHERE task_id = ?1 ORDER BY seq",
            )
            .map_err(db)?;
        let rows = stmt
            .query_map([task_id.to_string()], |r| {
                Ok(Event {
                    seq: r.get(0)?,
                    kind: r.get(1)?,
                    at: Timestamp(r.get(2)?),
                    data: from_json(&r.get::<_, String>(3)?)?,
                })
            })
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    async fn claimable(
        &mut self,
        tenant: &str,
        operations: &[String],
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        // One ordered walk of `tasks_claim_order` per distinct class, each
        // stopping at the limit, then the oldest across classes (migration 3):
        // a claim's cost follows its limit, not the backlog.
        let mut classes: Vec<&str> = operations.iter().map(String::as_str).collect();
        classes.sort_unstable();
        classes.dedup();
        let mut stmt = self.conn.prepare_cached(CLAIMABLE_IN_CLASS).map_err(db)?;
        let mut found: Vec<(i64, String)> = Vec::new();
        for class in classes {
            let rows = stmt
                .query_map(params![tenant, class, now.0, limit], |r| {
                    Ok((r.get::<_, i64>(1)?, r.get::<_, String>(0)?))
                })
                .map_err(db)?;
            for row in rows {
                found.push(row.map_err(decode)?);
            }
        }
        found.sort_unstable();
        found.truncate(usize::try_from(limit).unwrap_or(0));
        found
            .into_iter()
            .map(|(_, id)| uuid(&id).map_err(decode))
            .collect()
    }

    async fn expired_leases(
        &mut self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<(Uuid, Uuid)>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT task_id, id FROM attempts WHERE state IN ('leased', 'acknowledged') AND lease_expires_at <= ?1 \
                 ORDER BY lease_expires_at LIMIT ?2",
            )
            .map_err(db)?;
        let rows = stmt
            .query_map(params![now.0, limit], |r| {
                Ok((
                    uuid(&r.get::<_, String>(0)?)?,
                    uuid(&r.get::<_, String>(1)?)?,
                ))
            })
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    async fn due_wakeups(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>, StoreError> {
        self.ids(
            "SELECT id FROM tasks WHERE state = 'retry_wait' AND ready_at <= ?1 ORDER BY ready_at LIMIT ?2",
            params![now.0, limit],
        )
    }

    async fn expired_scopes(
        &mut self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        self.ids(
            "SELECT t.id FROM tasks t JOIN idempotency_keys k ON k.task_id = t.id \
             WHERE t.key_expires_at IS NOT NULL AND t.key_expires_at <= ?1 ORDER BY t.key_expires_at LIMIT ?2",
            params![now.0, limit],
        )
    }
}

/// Every task column in `task_columns!()` order, as SQL values.
fn task_values(t: &Task) -> Result<Vec<rusqlite::types::Value>, StoreError> {
    use rusqlite::types::Value as V;
    let text = |s: &str| V::Text(s.to_owned());
    let opt_text = |s: Option<String>| s.map_or(V::Null, V::Text);
    let opt_int = |i: Option<i64>| i.map_or(V::Null, V::Integer);
    let c = &t.control;
    Ok(vec![
        V::Text(t.id.to_string()),
        text(&c.tenant),
        text(&t.operation),
        text(&t.idempotency_key),
        text(&t.fingerprint),
        text(&c.canonical_request),
        V::Text(to_json(&t.params)?),
        text(t.state.as_str()),
        V::Integer(t.generation),
        V::Integer(c.version),
        V::Integer(c.event_seq),
        V::Integer(t.attempt_count),
        V::Integer(c.execute_count),
        V::Integer(t.usage),
        V::Text(idem_core::model::contract_json(&t.contract).map_err(corrupt)?),
        opt_text(t.cancellation.as_ref().map(to_json).transpose()?),
        opt_text(t.delivery.as_ref().map(to_json).transpose()?),
        opt_text(t.failure.as_ref().map(to_json).transpose()?),
        V::Text(c.api_key_id.to_string()),
        opt_text(c.next_kind.map(|k| k.as_str().to_owned())),
        opt_text(c.active_attempt_id.map(|id| id.to_string())),
        V::Integer(c.ready_at.0),
        V::Integer(c.deadline_at.0),
        opt_int(c.terminal_at.map(|t| t.0)),
        opt_int(c.key_expires_at.map(|t| t.0)),
        V::Integer(t.created_at.0),
        V::Integer(t.updated_at.0),
    ])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]

    use super::*;
    use idem_store::conformance::submission;
    use idem_store::ops::SubmitOutcome;
    use serde_json::json;

    fn job(op: Op) -> (Job, oneshot::Receiver<Result<Output, StoreError>>) {
        let (reply, rx) = oneshot::channel();
        (Job { op, reply }, rx)
    }

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
            let (j, rx) = job(Op::Submit(s));
            batch.push(j);
            rx
        });
        let watch = FileWatch::new(Path::new(writer.path().unwrap())).unwrap();
        run_batch(writer, &mut batch, SqliteOptions::default(), &watch);
        answers.map(|mut rx| match rx.try_recv().expect("answered") {
            Ok(Output::Submitted(o)) => Ok(o),
            Ok(other) => panic!("unexpected output {other:?}"),
            Err(e) => Err(e),
        })
    }

    /// An error that ends the whole transaction (here SQLITE_FULL) in the
    /// middle of a writer batch: nothing runs after it (each submit "alone"
    /// would have committed on its own), every caller is told that nothing was
    /// written, and nothing was (breaker: 1 task and scope were left behind
    /// while all four callers heard "nothing written").
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
            let (mut batch, mut answers) = (Vec::new(), Vec::new());
            for i in 0..4 {
                let (j, r) = job(Op::Submit(sub(&format!("k{i}"), &format!("{big}{i}"))));
                batch.push(j);
                answers.push(r);
                if singles {
                    // A non-submit between submits: each submit runs alone.
                    let (j, r) = job(Op::ListApiKeys);
                    batch.push(j);
                    answers.push(r);
                }
            }
            let watch = FileWatch::new(&path).unwrap();
            run_batch(&mut writer, &mut batch, SqliteOptions::default(), &watch);
            for r in &mut answers {
                let e = r.try_recv().unwrap().expect_err("disk full");
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
        conn.execute(
            "UPDATE tasks SET contract = 'not json' WHERE id = ?1",
            [bad.id.to_string()],
        )
        .unwrap();
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
            Ok(SubmitOutcome::Conflict { task_id }) => assert_eq!(task_id, task.id),
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
    /// blocks here (found by a breaker review: the whole batch went to the
    /// writer and waited out `busy_timeout`).
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
        lock.execute(
            "UPDATE tasks SET contract = '{' WHERE id = ?1",
            [tasks[0].id.to_string()],
        )
        .unwrap();
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

    /// The cost of one check ([`FileWatch::check`], a `stat`), against one
    /// writer batch of one submit (BEGIN IMMEDIATE … COMMIT with fsync):
    /// run with `--nocapture` to see the figures; it asserts only that two
    /// checks per batch stay under 5 % of it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_check_costs_little_beside_a_commit() {
        let (_dir, path, store, sub) = seeded().await;
        let watch = FileWatch::new(&path).unwrap();
        let n = 20_000;
        let started = std::time::Instant::now();
        for _ in 0..n {
            watch.check().unwrap();
        }
        let check = started.elapsed() / n;
        let m = 200;
        let started = std::time::Instant::now();
        for i in 0..m {
            store.submit(sub(&format!("cost-{i}"), "a")).await.unwrap();
        }
        let batch = started.elapsed() / m;
        println!("one file check: {check:?}; one submit batch: {batch:?}");
        assert!(check * 2 * 20 < batch, "check {check:?}, batch {batch:?}");
    }
}
