//! How operations run on PostgreSQL: every operation in one READ COMMITTED
//! transaction (reads in autocommit) on a pooled connection, run again on
//! contention, within a deadline; submits, retries and authentications in
//! lanes that batch them ([`idem_store::batch`]). Each operation runs on a
//! tokio task of its own (the lanes, or the one [`idem_store::Store`]
//! spawns), so a caller that drops its future (client disconnect, HTTP
//! timeout) never interrupts a commit.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use idem_store::batch::{self, Queue};
use idem_store::contracts::StoredContracts;
use idem_store::ops::{
    Authenticate, Call, Operation, Runner, Submission, Submit, SubmitBatch, SubmitOutcome,
    SubmitPlan,
};
use idem_store::retries::Lane;
use idem_store::{Backend, BoxFuture, Clock, Op, Result, StoreError, retries};
use tokio::sync::mpsc;
use tokio_postgres::IsolationLevel;

use crate::announce::Announcer;
use crate::tx::Pipelined;
use crate::{AUTH_BATCH, LINGER_YIELDS, PgBackend, PgTx, SUBMIT_BATCH, error, map_pg_error};

const SUBMITS_STOPPED: &str = "the submit batcher has stopped";
const AUTHS_STOPPED: &str = "the authentication batcher has stopped";

/// Whether `client` came back from the pool, used before. The pool hands
/// out such a connection without a round trip (`RecyclingMethod::Fast`: it
/// drops only the connections it knows closed), so the server may have
/// ended its session since (a restart, `pg_terminate_backend`) without the
/// driver having seen it yet.
fn reused(client: &Object) -> bool {
    Object::metrics(client).recycle_count > 0
}

/// A connection from the pool; with `check`, one that answered an empty
/// query when it was reused ([`reused`]), for work whose first round trip may
/// commit and so cannot be run again after a failure (a pipelined submit
/// batch) and for the lanes' reads. A connection that fails the check is
/// closed and the next one is taken (at most [`CHECKS`] times, then a new
/// connection, which needs none).
async fn checked_client(pool: &Pool, check: bool) -> Result<Object> {
    for _ in 0..CHECKS {
        let client = pool.get().await.map_err(error::pool_error)?;
        if !check || !reused(&client) || client.simple_query("").await.is_ok() {
            return Ok(client);
        }
        drop(Object::take(client));
    }
    pool.get().await.map_err(error::pool_error)
}

/// Most reused connections [`checked_client`] tries before it takes one
/// more without its check.
const CHECKS: usize = 16;

/// The lane's held connection, or one from the pool when it has none (or it
/// was closed), checked when reused as [`checked_client`] says.
async fn lane_client<'h>(
    pool: &Pool,
    held: &'h mut Option<Object>,
    check: bool,
) -> Result<&'h mut Object> {
    if held.as_ref().is_some_and(|c| c.is_closed()) {
        *held = None;
    }
    if held.is_none() {
        *held = Some(checked_client(pool, check).await?);
    }
    held.as_mut()
        .ok_or_else(|| StoreError::Corrupt("lane connection vanished".into()))
}

/// Every request authenticates against the database (a revoked key is refused at
/// once); concurrent lookups share one `WHERE key_hash = ANY($1)` statement.
pub(crate) async fn auth_lane(
    pool: Pool,
    clock: Clock,
    deadline: Duration,
    queue: Arc<Queue<Call<Authenticate>>>,
) {
    let mut held = None;
    while let Some(batch) = queue
        .next_batch(AUTH_BATCH, LINGER_YIELDS, || held = None)
        .await
    {
        let hashes: Vec<String> = batch
            .iter()
            .map(|c| idem_store::hash_api_key(&c.op.plain))
            .collect();
        let found = within(deadline, async {
            match lane_client(&pool, &mut held, true).await {
                Ok(client) => {
                    PgTx::autocommit(client, &clock)
                        .api_keys_by_hashes(&hashes)
                        .await
                }
                Err(e) => Err(e),
            }
        })
        .await;
        if found.is_err() {
            forget(&mut held);
        }
        match found {
            Ok(keys) => {
                for (hash, call) in hashes.iter().zip(batch) {
                    call.answer(Ok(keys.get(hash).cloned()));
                }
            }
            Err(e) => {
                for call in batch {
                    call.answer(Err(e.clone()));
                }
            }
        }
    }
}

/// Answers the submits whose scope [`idem_store::ScopeHints`] has seen bound:
/// each batch with one read on the lane's connection ([`retries::answer`],
/// one statement), through [`retries::answer_batch`]: what the read cannot
/// answer goes on to the submit lanes (`writes`).
pub(crate) async fn retry_lane(
    pool: Pool,
    clock: Clock,
    deadline: Duration,
    queue: Arc<Queue<Call<Submit>>>,
    writes: mpsc::UnboundedSender<Call<Submit>>,
) {
    let mut held = None;
    while let Some(batch) = queue
        .next_batch(SUBMIT_BATCH, LINGER_YIELDS, || held = None)
        .await
    {
        let mut read = LaneReads {
            pool: &pool,
            clock: &clock,
            held: &mut held,
            deadline,
        };
        retries::answer_batch(batch, &mut read, |call| {
            if let Err(mpsc::error::SendError(call)) = writes.send(call) {
                call.answer(Err(StoreError::Unavailable(SUBMITS_STOPPED.into())));
            }
        })
        .await;
    }
}

/// Writes each batch of queued submits as one pipelined transaction
/// ([`Pipelined`]), and one by one when the batch failed in a way one
/// submission may have caused (a row over an index limit: nothing written).
/// When the database or the connection failed (possibly while committing: the
/// outcome is unknown), every caller gets 503 and retries with its key, which
/// then answers created-or-replayed truthfully: submitting each again here
/// would report a task this batch created as a replay, and would wait out the
/// pool timeout once per submission.
pub(crate) async fn submit_lane(
    pool: Pool,
    clock: Clock,
    max_retries: u32,
    deadline: Duration,
    queue: Arc<Queue<Call<Submit>>>,
    stored: Arc<StoredContracts>,
    announcer: Announcer,
) {
    let mut held = None;
    while let Some(batch) = queue
        .next_batch(SUBMIT_BATCH, LINGER_YIELDS, || held = None)
        .await
    {
        let (subs, replies): (Vec<Submission>, Vec<_>) =
            batch.into_iter().map(|c| (c.op.0, c.reply)).unzip();
        let mut run = LaneSubmits {
            pool: &pool,
            clock: &clock,
            held: &mut held,
            max_retries,
            deadline,
            stored: &stored,
            announcer: &announcer,
        };
        let results = batch::or_one_by_one(&subs, &mut run, |e| !e.is_retryable()).await;
        for (reply, result) in replies.into_iter().zip(results) {
            let _ = reply.send(result);
        }
    }
}

/// Answers retries with one statement on the lane's connection
/// ([`retries::answer`]), within `deadline`.
struct LaneReads<'a> {
    pool: &'a Pool,
    clock: &'a Clock,
    held: &'a mut Option<Object>,
    deadline: Duration,
}

impl batch::RunBatch<Submission> for LaneReads<'_> {
    type Out = Option<SubmitOutcome>;
    async fn run(&mut self, subs: &[Submission]) -> Result<Vec<Option<SubmitOutcome>>> {
        let res = within(self.deadline, async {
            let client = lane_client(self.pool, self.held, true).await?;
            retries::answer(&mut PgTx::autocommit(client, self.clock), subs).await
        })
        .await;
        if res.is_err() {
            forget(self.held);
        }
        res
    }
}

/// Writes a submit batch pipelined on the lane's connection.
struct LaneSubmits<'a> {
    pool: &'a Pool,
    clock: &'a Clock,
    held: &'a mut Option<Object>,
    max_retries: u32,
    deadline: Duration,
    /// The contracts the database is known to hold.
    stored: &'a StoredContracts,
    /// Told what each committed batch wrote.
    announcer: &'a Announcer,
}

impl batch::RunBatch<Submission> for LaneSubmits<'_> {
    type Out = SubmitOutcome;
    async fn run(&mut self, subs: &[Submission]) -> Result<Vec<SubmitOutcome>> {
        run_held_within(
            self.pool,
            self.held,
            self.max_retries,
            self.deadline,
            &Pipelined(subs, self.clock, self.stored, self.announcer),
        )
        .await
    }
}

/// Work that runs on one connection as one transaction.
pub(crate) trait Work: Sync {
    /// Its result.
    type Out: Send;
    /// Whether a reused connection answers an empty query before this work
    /// runs on it ([`checked_client`]): work whose first round trip may
    /// commit. Work whose first round trip writes nothing runs again on a
    /// new connection when that round trip fails on a reused one instead
    /// ([`Generic`]), which costs the database nothing when the connection
    /// is sound.
    const CHECK_REUSED: bool;
    /// Runs it on `client` and commits.
    fn run_on(&self, client: &mut Object) -> impl Future<Output = Result<Self::Out>> + Send;
}

/// An operation, run through [`Operation::run`]: reads in autocommit (one
/// round trip per statement, no BEGIN/COMMIT: each statement of a READ
/// COMMITTED transaction takes its own snapshot anyway), writes in one READ
/// COMMITTED transaction whose events go to the announcer once it
/// committed; on the backend's clock. With a pool, a read that fails with
/// [`StoreError::Unavailable`] on a reused connection ([`reused`]), or a
/// write whose `BEGIN` does, runs again once on a connection from the pool:
/// neither wrote anything.
struct Generic<'o, O>(&'o O, &'o Clock, &'o Announcer, Option<&'o Pool>);

impl<O: Operation> Generic<'_, O> {
    /// Replaces `client`, whose session failed before anything was written,
    /// with one from the pool (when there is a pool and `client` was reused:
    /// a new connection that fails does not fail for a stale session).
    async fn replaced(&self, client: &mut Object) -> Result<bool> {
        let Some(pool) = self.3.filter(|_| reused(client)) else {
            return Ok(false);
        };
        let fresh = checked_client(pool, false).await?;
        drop(Object::take(std::mem::replace(client, fresh)));
        Ok(true)
    }
}

impl<O: Operation> Work for Generic<'_, O> {
    type Out = O::Reply;
    const CHECK_REUSED: bool = false;
    async fn run_on(&self, client: &mut Object) -> Result<O::Reply> {
        if !O::WRITES {
            let res = self.0.run(&mut PgTx::autocommit(client, self.1)).await;
            return match res {
                Err(StoreError::Unavailable(_)) if self.replaced(client).await? => {
                    self.0.run(&mut PgTx::autocommit(client, self.1)).await
                }
                res => res,
            };
        }
        let failed = match begin(client).await {
            Ok(tx) => return self.write(tx).await,
            Err(e) => e,
        };
        if !matches!(failed, StoreError::Unavailable(_)) || !self.replaced(client).await? {
            return Err(failed);
        }
        let tx = begin(client).await?;
        self.write(tx).await
    }
}

/// `BEGIN ISOLATION LEVEL READ COMMITTED` on `client`.
async fn begin(client: &mut Object) -> Result<deadpool_postgres::Transaction<'_>> {
    client
        .build_transaction()
        .isolation_level(IsolationLevel::ReadCommitted)
        .start()
        .await
        .map_err(map_pg_error)
}

impl<O: Operation> Generic<'_, O> {
    /// Runs the operation in `tx` and commits; its changes go to the
    /// announcer once committed.
    async fn write(&self, tx: deadpool_postgres::Transaction<'_>) -> Result<O::Reply> {
        let mut pg = PgTx::new(tx, self.1);
        let res = self.0.run(&mut pg).await;
        let changes = pg.take_changes();
        let Some(tx) = pg.into_inner() else {
            return Err(StoreError::Corrupt(
                "a writing operation lost its transaction".into(),
            ));
        };
        match res {
            Ok(out) => {
                tx.commit().await.map_err(map_pg_error)?;
                self.2.committed(changes);
                Ok(out)
            }
            Err(e) => {
                // Best effort: dropping the transaction rolls back as well.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }
}

impl Work for Pipelined<'_> {
    type Out = Vec<SubmitOutcome>;
    const CHECK_REUSED: bool = true;
    /// The submit plan pipelined; a batch with a revoked key runs as an
    /// ordinary transaction instead (it refuses that key's submissions only),
    /// as does a batch with rate limits (their tokens are taken between the
    /// scope rows and the tasks: [`SubmitPlan::charge_rates`]).
    async fn run_on(&self, client: &mut Object) -> Result<Vec<SubmitOutcome>> {
        if !SubmitPlan::has_rate_limits(self.0) {
            let mut pg = PgTx::autocommit(client, self.1);
            if let Some(outcomes) = pg.submit_pipelined(self.0, self.2).await? {
                self.3.committed(pg.take_changes());
                return Ok(outcomes);
            }
        }
        Generic(&SubmitBatch(self.0.to_vec()), self.1, self.3, None)
            .run_on(client)
            .await
    }
}

/// Runs `work` on the held connection (taken from the pool when there is
/// none), again after a short backoff on contention, at most `max_retries`
/// times. After contention or a refused value the connection goes back to the
/// pool, which checks it before reuse; after [`StoreError::Unavailable`] (the
/// connection closed, the server shutting down (`57P01`), a server that no
/// longer accepts writes (`25006`, as after a failover), a timeout) it is
/// closed instead ([`forget`]): such a connection can pass the pool's check
/// and fail again, and the next one the pool opens looks for the primary
/// among the URL's hosts.
async fn run_held<W: Work>(
    pool: &Pool,
    held: &mut Option<Object>,
    max_retries: u32,
    work: &W,
) -> Result<W::Out> {
    let mut retries = 0u32;
    loop {
        let res = match lane_client(pool, held, W::CHECK_REUSED).await {
            Ok(client) => work.run_on(client).await,
            Err(e) => Err(e),
        };
        match res {
            Ok(out) => return Ok(out),
            Err(StoreError::Contention(msg)) if retries < max_retries => {
                *held = None;
                retries += 1;
                tracing::debug!(retries, %msg, "contention; running the transaction again");
                tokio::time::sleep(backoff(retries)).await;
            }
            Err(e) => {
                if matches!(e, StoreError::Unavailable(_)) {
                    forget(held);
                } else {
                    *held = None;
                }
                return Err(e);
            }
        }
    }
}

/// [`run_held`] within `deadline`; after a failure the held connection is not
/// used again ([`forget`]). A lane passes its own `held`, kept across batches.
async fn run_held_within<W: Work>(
    pool: &Pool,
    held: &mut Option<Object>,
    max_retries: u32,
    deadline: Duration,
    work: &W,
) -> Result<W::Out> {
    let res = within(deadline, run_held(pool, held, max_retries, work)).await;
    if res.is_err() {
        forget(held);
    }
    res
}

/// `work`, or [`StoreError::Unavailable`] once `deadline` has passed (the
/// work is dropped: a write's outcome is then unknown, as after a lost
/// connection, and its caller retries with the same key).
pub(crate) async fn within<T>(
    deadline: Duration,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(deadline, work)
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "no answer from PostgreSQL within {} ms; the connection was dropped \
             (a write's outcome is unknown: retry with the same idempotency key)",
                deadline.as_millis()
            )))
        })
}

/// Drops `held` without giving it back to the pool: after an error or a
/// missed deadline the connection may be mid-transaction or dead, and is
/// closed instead of being checked and reused.
fn forget(held: &mut Option<Object>) {
    if let Some(conn) = held.take() {
        drop(Object::take(conn));
    }
}

/// A jittered pause before retry number `n` (1-based): up to 2, 4, 8, 16, 32 ms …
/// capped at 100 ms, at least half of it.
fn backoff(n: u32) -> Duration {
    let cap_us: u64 = (1_000u64 << n.min(7)).min(100_000);
    // Random bits from the OS RNG (through UUID v4; no extra dependency).
    let r = (uuid::Uuid::new_v4().as_u128() & u128::from(u64::MAX)) as u64;
    Duration::from_micros(cap_us / 2 + r % (cap_us / 2 + 1))
}

/// Each operation on a connection of its own from the pool.
struct Pooled {
    pool: Pool,
    clock: Clock,
    announcer: Announcer,
    max_retries: u32,
    deadline: Duration,
}

impl Runner for Pooled {
    async fn run<O: Operation>(&mut self, op: &O) -> Result<O::Reply> {
        let mut held = None;
        run_held_within(
            &self.pool,
            &mut held,
            self.max_retries,
            self.deadline,
            &Generic(op, &self.clock, &self.announcer, Some(&self.pool)),
        )
        .await
    }
}

impl PgBackend {
    /// A submit, routed by [`retries::route`]: the retry lane or the submit
    /// lanes.
    async fn submit(&self, call: Call<Submit>) {
        let send = |inner: Call<Submit>, lane| {
            let queue = match lane {
                Lane::Retry => &self.retries,
                Lane::Write => &self.submits,
            };
            if let Err(mpsc::error::SendError(inner)) = queue.send(inner) {
                inner.answer(Err(StoreError::Unavailable(SUBMITS_STOPPED.into())));
            }
        };
        retries::route(self.hints.as_ref(), call, send, || {
            StoreError::Unavailable(SUBMITS_STOPPED.into())
        })
        .await;
    }
}

/// The end-to-end deadline of an identity check ([`Op::CheckIdentity`]),
/// whose rewind of every unfinished task runs in one transaction (about
/// 0.8 ms per task on a loaded 2-core machine: 16 s for 20,000), in place
/// of [`crate::PgOptions::operation_timeout`] when that is shorter.
const REWIND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl Backend for PgBackend {
    fn execute(&self, op: Op) -> BoxFuture<'_, ()> {
        match op {
            Op::Authenticate(call) => {
                if let Err(mpsc::error::SendError(call)) = self.auths.send(call) {
                    call.answer(Err(StoreError::Unavailable(AUTHS_STOPPED.into())));
                }
                Box::pin(async {})
            }
            Op::Submit(call) => Box::pin(self.submit(call)),
            // A submit batch is pipelined, as the submit lanes write theirs.
            Op::SubmitBatch(call) => Box::pin(async move {
                let res = run_held_within(
                    &self.pool,
                    &mut None,
                    self.max_retries,
                    self.operation_timeout,
                    &Pipelined(&call.op.0, &self.clock, &self.stored, &self.announcer),
                )
                .await;
                call.answer(res);
            }),
            // A rewind moves every unfinished task in one transaction
            // (SPEC §2.11), about 1 ms per task: it may take longer than
            // any other operation, and claims lease nothing until it
            // commits, so it is not cut at the operation deadline.
            Op::CheckIdentity(call) => Box::pin(async move {
                let mut runner = Pooled {
                    pool: self.pool.clone(),
                    clock: self.clock.clone(),
                    announcer: self.announcer.clone(),
                    max_retries: self.max_retries,
                    deadline: self.operation_timeout.max(REWIND_TIMEOUT),
                };
                call.run_with(&mut runner).await.send();
            }),
            // `Store` already runs writing operations on their own task, so a
            // dropped caller never cuts a transaction (or its COMMIT) short.
            op => Box::pin(async move {
                let mut runner = Pooled {
                    pool: self.pool.clone(),
                    clock: self.clock.clone(),
                    announcer: self.announcer.clone(),
                    max_retries: self.max_retries,
                    deadline: self.operation_timeout,
                };
                op.run_with(&mut runner).await.send();
            }),
        }
    }

    /// Submits are answered by the submit lanes, tasks of their own: a dropped
    /// caller never cuts a batch short.
    fn runs_detached(&self, op: &Op) -> bool {
        matches!(op, Op::Submit(_))
    }

    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(within(self.operation_timeout, async move {
            let client = self.pool.get().await.map_err(error::pool_error)?;
            let Some(cached) = self.schema.fresh(&self.clock) else {
                // Reading the schema is the round trip that shows the
                // database answers.
                let verdict = crate::migrate::check(&**client).await;
                if matches!(verdict, Err(StoreError::Unavailable(_))) {
                    let _ = Object::take(client);
                }
                return self.schema.record(&self.clock, verdict);
            };
            let answered = client.simple_query("SELECT 1").await;
            if answered.is_err() {
                let _ = Object::take(client);
            }
            answered.map_err(map_pg_error)?;
            cached
        }))
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn clock(&self) -> &Clock {
        &self.clock
    }

    fn changes(&self) -> &idem_store::Changes {
        &self.listening.changes
    }

    fn announced(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.announcer.flushed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded() {
        for n in 1..20 {
            let d = backoff(n);
            assert!(d <= Duration::from_millis(100), "{d:?}");
            assert!(d >= Duration::from_micros(500), "{d:?}");
        }
    }
}
