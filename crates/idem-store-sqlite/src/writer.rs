//! The writer thread (group commit), the reader connections and the retry
//! reader thread, and the [`Backend`] that routes operations to them.

use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use idem_store::batch::{self, Queue};
use idem_store::changes::Publisher;
use idem_store::ops::{
    Call, Operation, Pending, Runner, Submission, Submit, SubmitOutcome, SubmitPlan,
};
use idem_store::retries::Lane;
use idem_store::{Backend, BoxFuture, Change, Clock, Op, StoreError, retries};
use rusqlite::Connection;
use tokio::sync::mpsc;

use crate::tx::{SqliteTx, db};
use crate::{
    FileWatch, MAX_BATCH, READERS, SqliteBackend, SqliteOptions, open_connection, unavailable,
};

const WRITER_STOPPED: &str = "the SQLite writer thread has stopped";

/// Runs SQLite work written as a future: every statement runs synchronously,
/// so the future is ready on its first poll (no executor is entered, so this
/// may run inside one).
fn ready<R>(work: impl Future<Output = Result<R, StoreError>>) -> Result<R, StoreError> {
    work.now_or_never()
        .unwrap_or_else(|| Err(StoreError::Corrupt("SQLite work did not complete".into())))
}

/// Runs a transaction-control statement (`BEGIN`, `SAVEPOINT`, `COMMIT` …)
/// through the connection's statement cache: parsed once, not per use.
fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// The writer thread: takes each batch of queued operations
/// ([`Queue::next_batch`]) and runs it as one transaction ([`run_batch`]).
pub(crate) fn writer_loop(
    mut conn: Connection,
    queue: &Queue<Op>,
    options: &SqliteOptions,
    watch: &FileWatch,
    changes: &Publisher,
) {
    while let Some(batch) = futures::executor::block_on(queue.next_batch(MAX_BATCH, 0, || {})) {
        for change in run_batch(&mut conn, batch, options, watch) {
            changes.publish(change);
        }
    }
}

/// The retry reader thread: answers submits whose scope was seen bound
/// ([`idem_store::ScopeHints`]) in one read transaction per batch on its own
/// (`query_only`) connection, through [`retries::answer_batch`]: a replay or
/// a conflict without the write lock, a savepoint or an insert attempt, and
/// without waiting behind the writer. What that read cannot answer goes on
/// to the writer (`writes`), which answers it as if it had never been here.
/// Answers read from a file no longer at its path ([`FileWatch`]) are not
/// given: the read fails as unavailable.
pub(crate) fn retry_reader_loop(
    mut conn: Connection,
    queue: &Queue<Call<Submit>>,
    writes: &mpsc::UnboundedSender<Op>,
    options: &SqliteOptions,
    watch: &FileWatch,
) {
    while let Some(batch) = futures::executor::block_on(queue.next_batch(MAX_BATCH, 0, || {})) {
        let mut read = RetryReads {
            conn: &mut conn,
            options,
            watch,
        };
        futures::executor::block_on(retries::answer_batch(batch, &mut read, |call| {
            forward(writes, Op::Submit(call));
        }));
    }
}

/// Answers retries in one read transaction ([`retries::answer`]).
struct RetryReads<'c> {
    conn: &'c mut Connection,
    options: &'c SqliteOptions,
    watch: &'c FileWatch,
}

impl batch::RunBatch<Submission> for RetryReads<'_> {
    type Out = Option<SubmitOutcome>;
    async fn run(&mut self, subs: &[Submission]) -> Result<Vec<Option<SubmitOutcome>>, StoreError> {
        let answers = in_read_tx(self.conn, self.options, |tx| {
            ready(retries::answer(tx, subs))
        })?;
        self.watch.check()?;
        Ok(answers)
    }
}

/// Hands `op` to the writer thread, or answers that it has stopped.
fn forward(writes: &mpsc::UnboundedSender<Op>, op: Op) {
    if let Err(mpsc::error::SendError(op)) = writes.send(op) {
        op.fail(unavailable(WRITER_STOPPED));
    }
}

/// Runs `f` in one read transaction on `conn`; a transaction that does not
/// end with `COMMIT` is rolled back, so none stays open (it would hold back
/// checkpoints, and the connection's next `BEGIN` would fail).
///
/// # Errors
/// `f`'s error, or [`StoreError`] when `BEGIN` or `COMMIT` fails.
fn in_read_tx<R>(
    conn: &mut Connection,
    options: &SqliteOptions,
    f: impl FnOnce(&mut SqliteTx<'_>) -> Result<R, StoreError>,
) -> Result<R, StoreError> {
    control(conn, "BEGIN").map_err(db)?;
    let res = f(&mut SqliteTx {
        conn: &mut *conn,
        options,
        notes: Vec::new(),
    });
    if let Err(e) = control(conn, "COMMIT") {
        let _ = control(conn, "ROLLBACK");
        return Err(db(e));
    }
    res
}

/// Runs `work` in a savepoint of the writer's open transaction, again (at
/// most three times in all) when it meets [`StoreError::Contention`]; a
/// failed run is rolled back to the savepoint, so it leaves nothing. When an
/// error ended the whole transaction (SQLITE_FULL, SQLITE_IOERR …;
/// `conn.is_autocommit()` afterwards), that error is returned at once. The
/// events of a run that was released are added to `notes`.
fn in_savepoint<R>(
    conn: &mut Connection,
    options: &SqliteOptions,
    notes: &mut Vec<Change>,
    mut work: impl FnMut(&mut SqliteTx<'_>) -> Result<R, StoreError>,
) -> Result<R, StoreError> {
    control(conn, "SAVEPOINT op").map_err(db)?;
    let mut attempts = 0;
    loop {
        let mut tx = SqliteTx {
            conn: &mut *conn,
            options,
            notes: Vec::new(),
        };
        let res = work(&mut tx);
        let written = std::mem::take(&mut tx.notes);
        match res {
            Ok(out) => {
                control(conn, "RELEASE op").map_err(db)?;
                notes.extend(written);
                return Ok(out);
            }
            Err(e) => {
                if conn.is_autocommit() {
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

/// Each operation in a savepoint of the writer's transaction ([`in_savepoint`]).
struct Savepoints<'c> {
    conn: &'c mut Connection,
    options: &'c SqliteOptions,
    notes: &'c mut Vec<Change>,
}

impl Runner for Savepoints<'_> {
    async fn run<O: Operation>(&mut self, op: &O) -> Result<O::Reply, StoreError> {
        in_savepoint(self.conn, self.options, self.notes, |tx| ready(op.run(tx)))
    }
}

/// Each operation in a read transaction of its own ([`in_read_tx`]).
struct Reads<'c> {
    conn: &'c mut Connection,
    options: &'c SqliteOptions,
}

impl Runner for Reads<'_> {
    async fn run<O: Operation>(&mut self, op: &O) -> Result<O::Reply, StoreError> {
        in_read_tx(self.conn, self.options, |tx| ready(op.run(tx)))
    }
}

/// Runs one batch of the writer: one `BEGIN IMMEDIATE` transaction, each
/// operation in its own savepoint (submits queued one after another together,
/// [`run_submits`]), one `COMMIT`, and only then every answer; returns the
/// events it committed (none when nothing was). When the
/// commit fails, or an error ended the whole transaction, every caller hears
/// that nothing was written; so does every caller when the file was found
/// removed or replaced ([`FileWatch::check`]) before the batch, before its
/// `COMMIT` (then rolled back) or after it.
pub(crate) fn run_batch(
    conn: &mut Connection,
    batch: Vec<Op>,
    options: &SqliteOptions,
    watch: &FileWatch,
) -> Vec<Change> {
    if let Err(e) = watch.check() {
        for op in batch {
            op.fail(e.clone());
        }
        return Vec::new();
    }
    if let Err(e) = control(conn, "BEGIN IMMEDIATE") {
        let err = db(e);
        for op in batch {
            op.fail(err.clone());
        }
        return Vec::new();
    }
    let mut notes: Vec<Change> = Vec::new();
    let mut done: Vec<Pending> = Vec::with_capacity(batch.len());
    let mut submits: Vec<Call<Submit>> = Vec::new();
    let mut ended: Option<StoreError> = None;
    let mut not_run: Vec<Op> = Vec::new();
    for op in batch {
        if ended.is_some() {
            not_run.push(op);
            continue;
        }
        match op {
            Op::Submit(call) => submits.push(call),
            op => {
                run_submits(
                    conn,
                    std::mem::take(&mut submits),
                    options,
                    &mut done,
                    &mut ended,
                    &mut notes,
                );
                if ended.is_some() {
                    not_run.push(op);
                    continue;
                }
                let pending = futures::executor::block_on(op.run_with(&mut Savepoints {
                    conn: &mut *conn,
                    options,
                    notes: &mut notes,
                }));
                if conn.is_autocommit() {
                    ended = Some(
                        pending
                            .error()
                            .cloned()
                            .unwrap_or_else(|| unavailable("the transaction ended unexpectedly")),
                    );
                }
                done.push(pending);
            }
        }
    }
    if ended.is_none() {
        run_submits(
            conn,
            std::mem::take(&mut submits),
            options,
            &mut done,
            &mut ended,
            &mut notes,
        );
    }
    // Some errors (SQLITE_FULL, SQLITE_IOERR, SQLITE_NOMEM …) roll back the
    // whole transaction, not only the savepoint: everything this batch did is
    // gone, and nothing more may run, or it would commit on its own.
    let failed = match ended {
        Some(cause) => Some(unavailable(format!(
            "the transaction was rolled back ({cause}); nothing was written"
        ))),
        // Checked again after the COMMIT: a file removed in between took this
        // batch with it, so it is not acknowledged.
        None => watch
            .check()
            .and_then(|()| {
                control(conn, "COMMIT")
                    .map_err(|e| unavailable(format!("commit failed, nothing written: {e}")))
            })
            .and_then(|()| watch.check())
            .err()
            .inspect(|_| {
                if !conn.is_autocommit() {
                    let _ = control(conn, "ROLLBACK");
                }
            }),
    };
    match failed {
        Some(err) => {
            for pending in done {
                pending.fail(err.clone());
            }
            for op in not_run {
                op.fail(err.clone());
            }
            for call in submits {
                call.answer(Err(err.clone()));
            }
            Vec::new()
        }
        None => {
            for pending in done {
                pending.send();
            }
            notes
        }
    }
}

/// Runs submits that were queued one after another as one submit batch
/// ([`SubmitPlan`]: one key check, the scope rows, then the tasks; answered
/// as if submitted one after another) in one savepoint, and pushes one held
/// answer per submit. When the batch fails as a whole, each submit runs
/// alone in its own savepoint ([`batch::or_one_by_one`]), so one bad submit
/// fails only itself. When an error ends the whole transaction, it is kept in
/// `ended` and nothing more runs.
fn run_submits(
    conn: &mut Connection,
    calls: Vec<Call<Submit>>,
    options: &SqliteOptions,
    done: &mut Vec<Pending>,
    ended: &mut Option<StoreError>,
    notes: &mut Vec<Change>,
) {
    if calls.is_empty() {
        return;
    }
    let (subs, replies): (Vec<Submission>, Vec<_>) =
        calls.into_iter().map(|c| (c.op.0, c.reply)).unzip();
    let mut run = SubmitsInSavepoint {
        conn,
        options,
        ended,
        notes,
    };
    let results = futures::executor::block_on(batch::or_one_by_one(&subs, &mut run, |_| true));
    for (reply, result) in replies.into_iter().zip(results) {
        done.push(Pending::new(reply, result));
    }
}

/// Runs a submit batch's [`SubmitPlan`] in one savepoint ([`in_savepoint`]);
/// once an error ended the whole transaction, keeps it in `ended` and runs
/// nothing more.
struct SubmitsInSavepoint<'a> {
    conn: &'a mut Connection,
    options: &'a SqliteOptions,
    ended: &'a mut Option<StoreError>,
    notes: &'a mut Vec<Change>,
}

impl batch::RunBatch<Submission> for SubmitsInSavepoint<'_> {
    type Out = SubmitOutcome;
    async fn run(&mut self, subs: &[Submission]) -> Result<Vec<SubmitOutcome>, StoreError> {
        if let Some(e) = &*self.ended {
            return Err(e.clone());
        }
        let res = in_savepoint(self.conn, self.options, self.notes, |tx| {
            ready(SubmitPlan::run(tx, subs))
        });
        if let Err(e) = &res
            && self.conn.is_autocommit()
        {
            *self.ended = Some(e.clone());
        }
        res
    }
}

impl SqliteBackend {
    /// Runs a read-only `op` on a pooled reader connection (at most
    /// [`READERS`] at once) on the blocking pool.
    async fn read(&self, op: Op) {
        let slot = match Arc::clone(&self.read_slots).acquire_owned().await {
            Ok(slot) => slot,
            Err(e) => return op.fail(unavailable(e)),
        };
        let readers = Arc::clone(&self.readers);
        let options = self.options.clone();
        let path = self.path.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let mut conn = match reader(&readers, &path) {
                Ok(conn) => conn,
                Err(e) => return op.fail(e),
            };
            let pending = futures::executor::block_on(op.run_with(&mut Reads {
                conn: &mut conn,
                options: &options,
            }));
            give_back(&readers, conn);
            drop(slot);
            pending.send();
        })
        .await;
    }

    /// Hands a writing `op` to the writer thread.
    fn write(&self, op: Op) {
        forward(&self.writer, op);
    }

    /// A submit, routed by [`retries::route`]: the retry reader or the
    /// writer.
    async fn submit(&self, call: Call<Submit>) {
        let send = |inner: Call<Submit>, lane| match lane {
            Lane::Retry => {
                // Should the retry reader be gone, the writer answers.
                if let Err(mpsc::error::SendError(back)) = self.retries.send(inner) {
                    self.write(Op::Submit(back));
                }
            }
            Lane::Write => self.write(Op::Submit(inner)),
        };
        retries::route(Some(&self.hints), call, send, || {
            unavailable(WRITER_STOPPED)
        })
        .await;
    }
}

impl Backend for SqliteBackend {
    fn execute(&self, op: Op) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(e) = self.watch.failed() {
                return op.fail(e);
            }
            match op {
                Op::Submit(call) => self.submit(call).await,
                // The writer finishes the transaction even if the caller is
                // dropped (client disconnect): the commit path never depends on it.
                op if op.writes() => self.write(op),
                op => self.read(op).await,
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
                let conn = reader(&readers, &path)?;
                let res = conn.query_row("SELECT 1", [], |_| Ok(())).map_err(db);
                give_back(&readers, conn);
                res
            })
            .await
            .map_err(unavailable)?
        })
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn clock(&self) -> &Clock {
        &self.options.clock
    }

    fn changes(&self) -> &idem_store::Changes {
        &self.changes
    }
}

/// A pooled reader connection, or a new one when the pool is empty.
fn reader(readers: &Mutex<Vec<Connection>>, path: &Path) -> Result<Connection, StoreError> {
    let pooled = readers
        .lock()
        .map_err(|_| unavailable("reader pool poisoned"))?
        .pop();
    match pooled {
        Some(c) => Ok(c),
        None => {
            let c = open_connection(path)?;
            c.execute_batch("PRAGMA query_only = ON;")
                .map_err(unavailable)?;
            Ok(c)
        }
    }
}

/// Returns `conn` to the pool (unless it is full).
fn give_back(readers: &Mutex<Vec<Connection>>, conn: Connection) {
    if let Ok(mut pool) = readers.lock()
        && pool.len() < READERS
    {
        pool.push(conn);
    }
}
