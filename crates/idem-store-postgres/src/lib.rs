//! # idem-store-postgres
//!
//! The PostgreSQL backend of idem: many stateless idem instances over one
//! database (SPEC §5). It implements [`idem_store::Tx`] with
//! `tokio-postgres` through a `deadpool-postgres` pool, and
//! [`idem_store::Backend`] by running every [`Op`] as one READ COMMITTED
//! transaction.
//!
//! - Entry points: [`connect`] (pool + migrations, returns a [`Store`]) and
//!   [`migrate`] (migrations only, for `idem migrate`).
//! - Correctness lives in the database: the scope is the primary key of
//!   `idempotency_keys` (`INSERT … ON CONFLICT DO NOTHING`, then a separate
//!   `SELECT`, RUST-NOTES §4.3); every task write is a compare-and-set on
//!   `(version, generation)`; claims and sweeps lock with `FOR UPDATE SKIP
//!   LOCKED`; leases and backoff are decided by the database clock
//!   (`clock_timestamp()`), one clock for all instances.
//! - Errors: connection, pool and timeout failures are
//!   [`StoreError::Unavailable`]; serialization failures, deadlocks, unique
//!   violations and lost compare-and-sets are [`StoreError::Contention`] and
//!   are retried (whole transaction, bounded, jittered); undecodable rows and
//!   integrity violations are [`StoreError::Corrupt`].
//! - Each operation runs on its own tokio task, so a caller that drops the
//!   future (client disconnect, HTTP timeout) never interrupts a commit.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use idem_core::model::ApiKey;
use idem_store::ops::{Submission, SubmitOutcome};
use idem_store::{Backend, BoxFuture, Op, Output, Result, ScopeHints, Store, StoreError, ops};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_postgres::IsolationLevel;

mod error;
mod migrate;
mod target;
mod tls;
mod tx;

pub mod testing;

pub use error::map_pg_error;
pub use migrate::{MIGRATION_LOCK_TIMEOUT_MS, MIGRATIONS, migrate};
pub use target::{RootCerts, SslMode, Target};
pub use tx::PgTx;
use tx::Pipelined;

/// Pool and session settings of the PostgreSQL backend.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PgOptions {
    /// Connections at most (default 16).
    pub max_size: usize,
    /// How long to wait for a free connection, to open one, or to check one
    /// before reuse (default 5 s). Past it the operation is `Unavailable`.
    pub pool_timeout: Duration,
    /// `statement_timeout` of every session (default 10 s).
    pub statement_timeout: Duration,
    /// `idle_in_transaction_session_timeout` of every session (default 10 s):
    /// a stalled instance never holds row locks for long.
    pub idle_in_transaction_timeout: Duration,
    /// How many times a transaction that met contention (serialization failure,
    /// deadlock, lost compare-and-set) is run again (default 5).
    pub max_retries: u32,
    /// How long one operation, or one submit or authentication batch, may take
    /// end to end, retries included (default 30 s). Past it the callers get
    /// `Unavailable` and its connection is not used again. `statement_timeout`
    /// is enforced by the server, so it cannot end a wait on a link that went
    /// silent (a frozen proxy, a dropped route): this can.
    pub operation_timeout: Duration,
    /// Whether [`connect`] applies pending migrations (default `true`). With
    /// `false` it changes no schema and refuses a database whose schema is
    /// not this binary's: for tools that only read or administer a store.
    pub migrate: bool,
    /// Whether applying migrations may create idem's schema in a database that
    /// already holds other tables and no idem schema (default `false`: refused
    /// with [`StoreError::Migration`], so a mistyped URL cannot put idem's
    /// tables into an application's database; `idem migrate` sets it).
    pub allow_other_tables: bool,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            max_size: 16,
            pool_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(10),
            idle_in_transaction_timeout: Duration::from_secs(10),
            max_retries: 5,
            operation_timeout: Duration::from_secs(30),
            migrate: true,
            allow_other_tables: false,
        }
    }
}

impl PgOptions {
    /// Sets [`PgOptions::max_size`].
    pub fn with_max_size(mut self, max_size: usize) -> Self {
        self.max_size = max_size.max(1);
        self
    }
}

/// The PostgreSQL [`Backend`]: a connection pool.
#[derive(Debug, Clone)]
pub struct PgBackend {
    pool: Pool,
    max_retries: u32,
    /// [`PgOptions::operation_timeout`].
    operation_timeout: Duration,
    /// Submits wait here for the next batch (group commit, see [`SUBMIT_BATCH`]).
    submits: mpsc::UnboundedSender<PendingSubmit>,
    /// Authentications wait here for the next lookup (see [`AUTH_BATCH`]).
    auths: mpsc::UnboundedSender<PendingAuth>,
    /// Submits of scopes seen bound wait here for a read ([`RETRY_LANES`]).
    retries: mpsc::UnboundedSender<PendingSubmit>,
    /// Which scopes were seen bound; `None` without a retry lane.
    hints: Option<ScopeHints>,
}

/// How long [`connect`] waits for another instance that is applying
/// migrations before it answers [`StoreError::Unavailable`] (start-up retries,
/// for up to `IDEM_STORE_WAIT_MS`, so the error it ends with names the cause).
pub const MIGRATION_WAIT: Duration = Duration::from_secs(2);

/// Most submissions one transaction accepts together. Concurrent submits are
/// queued and written by [`SUBMIT_LANES`] batchers: each takes what is queued
/// (up to this many), writes all scope rows, tasks and events with one
/// multi-row statement each, commits once (`synchronous_commit=on`) and only
/// then answers every caller. A lone submit is a batch of one.
pub const SUBMIT_BATCH: usize = 64;

/// Batches in flight at once. Two, measured on the project's 2-core machine
/// (docs/benchmarks.md, sixth session): new keys at 0.98–1.07× pgbench with
/// two lanes against 0.81–0.93× with four and 0.79–0.90× with eight, in
/// alternating runs; fewer lanes make larger batches, and a larger batch
/// costs PostgreSQL less per key. One lane measured 0.93–0.95×.
pub const SUBMIT_LANES: usize = 2;

/// Readers of retries in flight at once: submits whose scope this process has
/// seen bound ([`ScopeHints`]) are answered by one read each batch, on a lane
/// of its own, so they neither wait behind writes nor make batches of new keys
/// smaller. One, measured on the project's 2-core machine (docs/benchmarks.md,
/// eleventh session): one lane gathers what two shared, so its batches are
/// larger, and PostgreSQL spent 17–20 µs of CPU per replay against 23–27 µs
/// with two (`scripts/cpu-per-request.sh`, two alternating pairs, 10–12 % more
/// replays answered; three alternating `idem bench --mode replay` pairs gave
/// +8 %, +17 % and −3 %). Four lanes answered fewer replays than two. None
/// in a pool of fewer than 8 connections, where every submit is written.
pub const RETRY_LANES: usize = 1;

type PendingSubmit = (Submission, oneshot::Sender<Result<SubmitOutcome>>);

/// An authentication waiting for the next lookup batch: the SHA-256 hex of the
/// bearer token and where to answer.
type PendingAuth = (String, oneshot::Sender<Result<Option<ApiKey>>>);

/// How many times a batcher yields to the runtime to let more work join a batch.
const LINGER_YIELDS: usize = 4;

/// Most authentications one lookup answers together.
pub const AUTH_BATCH: usize = 128;

/// Waits for the first queued item, then takes whatever else is queued, up to
/// `max`; `None` once the backend is gone. The lock lets several lanes share
/// one queue without splitting a burst item by item. `held` is the lane's
/// connection: kept while work is already queued, given back to the pool before
/// the lane waits.
async fn next_batch<T>(
    queue: &Mutex<mpsc::UnboundedReceiver<T>>,
    max: usize,
    held: &mut Option<Object>,
) -> Option<Vec<T>> {
    let mut rx = match queue.try_lock() {
        Ok(rx) if !rx.is_empty() => rx,
        other => {
            drop(other);
            *held = None;
            queue.lock().await
        }
    };
    let first = rx.recv().await?;
    let mut batch = vec![first];
    // Drain what is queued; then let the runtime run once more (requests being
    // parsed may be about to enqueue) and keep going while that brought more.
    for _ in 0..LINGER_YIELDS {
        let before = batch.len();
        while batch.len() < max {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        if batch.len() >= max {
            break;
        }
        tokio::task::yield_now().await;
        if batch.len() == before && rx.is_empty() {
            break;
        }
    }
    Some(batch)
}

/// The lane's held connection, or a fresh one from the pool when it has none
/// (or it was closed).
async fn lane_client<'h>(pool: &Pool, held: &'h mut Option<Object>) -> Result<&'h mut Object> {
    if held.as_ref().is_some_and(|c| c.is_closed()) {
        *held = None;
    }
    if held.is_none() {
        *held = Some(pool.get().await.map_err(error::pool_error)?);
    }
    held.as_mut()
        .ok_or_else(|| StoreError::Corrupt("lane connection vanished".into()))
}

/// Every request authenticates against the database (a revoked key is refused at
/// once); concurrent lookups share one `WHERE key_hash = ANY($1)` statement.
async fn auth_lane(
    pool: Pool,
    deadline: Duration,
    queue: Arc<Mutex<mpsc::UnboundedReceiver<PendingAuth>>>,
) {
    let mut held = None;
    while let Some(batch) = next_batch(&queue, AUTH_BATCH, &mut held).await {
        let hashes: Vec<String> = batch.iter().map(|(h, _)| h.clone()).collect();
        let found = within(deadline, async {
            match lane_client(&pool, &mut held).await {
                Ok(client) => PgTx::autocommit(client).api_keys_by_hashes(&hashes).await,
                Err(e) => Err(e),
            }
        })
        .await;
        if found.is_err() {
            forget(&mut held);
        }
        match found {
            Ok(keys) => {
                for (hash, reply) in batch {
                    let _ = reply.send(Ok(keys.get(&hash).cloned()));
                }
            }
            Err(e) => {
                for (_, reply) in batch {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// Answers the submits whose scope [`ScopeHints`] has seen bound: each batch
/// with one read on the lane's connection ([`PgTx::answer_retries`]). A
/// submission that read cannot answer (its scope row is gone or its key
/// revoked) goes on to the submit lanes (`writes`), which answer it as if it
/// had never been here. When the database fails the read (`Unavailable`, 503:
/// retry with the same key), every caller of the batch gets that error; after
/// any other failure (a row that does not decode) each submission is read on
/// its own, and only those that still fail go on to the submit lanes, which
/// fail them alone.
async fn retry_lane(
    pool: Pool,
    deadline: Duration,
    queue: Arc<Mutex<mpsc::UnboundedReceiver<PendingSubmit>>>,
    writes: mpsc::UnboundedSender<PendingSubmit>,
) {
    let mut held = None;
    while let Some(batch) = next_batch(&queue, SUBMIT_BATCH, &mut held).await {
        let (subs, replies): (Vec<Submission>, Vec<_>) = batch.into_iter().unzip();
        let answers = match read_retries(&pool, &mut held, &subs, deadline).await {
            Ok(answers) if answers.len() == subs.len() => answers,
            Ok(_) => vec![None; subs.len()],
            // The database failed the read (or missed the deadline): the write
            // path would meet the same, after waiting as long again. Every
            // caller gets the error (503) and retries with its key.
            Err(e) if e.is_retryable() => {
                forget(&mut held);
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
                continue;
            }
            // One row failed the whole read (it does not decode): read each
            // submission on its own, so only that one goes on to the submit
            // lanes (which fail it alone) and the others are still answered
            // without a write.
            Err(e) => {
                tracing::debug!(error = %e, "reading retries failed; reading them one by one");
                let mut answers = Vec::with_capacity(subs.len());
                for sub in &subs {
                    let one =
                        read_retries(&pool, &mut held, std::slice::from_ref(sub), deadline).await;
                    answers.push(one.ok().and_then(|mut a| a.pop()).flatten());
                }
                answers
            }
        };
        for ((sub, reply), answer) in subs.into_iter().zip(replies).zip(answers) {
            match answer {
                Some(outcome) => {
                    let _ = reply.send(Ok(outcome));
                }
                None => {
                    if let Err(mpsc::error::SendError((_, reply))) = writes.send((sub, reply)) {
                        let _ = reply.send(Err(StoreError::Unavailable(
                            "the submit batcher has stopped".into(),
                        )));
                    }
                }
            }
        }
    }
}

/// [`PgTx::answer_retries`] on the lane's connection, within `deadline`.
async fn read_retries(
    pool: &Pool,
    held: &mut Option<Object>,
    subs: &[Submission],
    deadline: Duration,
) -> Result<Vec<Option<SubmitOutcome>>> {
    within(deadline, async {
        let client = lane_client(pool, held).await?;
        PgTx::autocommit(client).answer_retries(subs).await
    })
    .await
}

async fn submit_lane(
    pool: Pool,
    max_retries: u32,
    deadline: Duration,
    queue: Arc<Mutex<mpsc::UnboundedReceiver<PendingSubmit>>>,
) {
    let mut held = None;
    while let Some(batch) = next_batch(&queue, SUBMIT_BATCH, &mut held).await {
        let (subs, replies): (Vec<Submission>, Vec<_>) = batch.into_iter().unzip();
        let op = Op::SubmitBatch(subs);
        let res = PgBackend::run_held_within(&pool, &mut held, &op, max_retries, deadline).await;
        match res {
            Ok(Output::SubmittedBatch(outcomes)) if outcomes.len() == replies.len() => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Ok(_) => {
                for reply in replies {
                    let _ = reply.send(Err(StoreError::Corrupt(
                        "submit batch answered the wrong shape".into(),
                    )));
                }
            }
            // The database or the connection failed (possibly while committing:
            // the outcome is unknown): every caller gets 503 and retries with its
            // key, which then answers created-or-replayed truthfully. Submitting
            // each again here would report a task this batch created as a replay,
            // and would wait out the pool timeout once per submission.
            Err(e) if replies.len() == 1 || e.is_retryable() => {
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
            Err(_) => {
                // One submission's values failed the batch (e.g. a row over an
                // index limit, nothing written): submit each on its own so only
                // that one fails. (`op` is the batch built above; were it not,
                // the dropped replies would answer "batcher stopped".)
                let subs = match op {
                    Op::SubmitBatch(subs) => subs,
                    _ => Vec::new(),
                };
                for (sub, reply) in subs.into_iter().zip(replies) {
                    let one = PgBackend::run(
                        pool.clone(),
                        Op::SubmitBatch(vec![sub]),
                        max_retries,
                        deadline,
                    )
                    .await;
                    let answer = match one {
                        Ok(Output::SubmittedBatch(mut outcomes)) if outcomes.len() == 1 => {
                            outcomes.pop().ok_or_else(|| {
                                StoreError::Corrupt("submit answered no outcome".into())
                            })
                        }
                        Ok(_) => Err(StoreError::Corrupt(
                            "submit batch answered the wrong shape".into(),
                        )),
                        Err(e) => Err(e),
                    };
                    let _ = reply.send(answer);
                }
            }
        }
    }
}

/// Connects to `url` (`postgres://user@host:port/db`), applies pending
/// migrations and returns the store.
///
/// # Errors
/// [`StoreError::Config`] when `url` does not parse or the server refuses the
/// connection for good (unknown role or database, wrong password),
/// [`StoreError::Unavailable`] when the database cannot be reached (yet),
/// [`StoreError::Migration`] when the schema cannot be brought up to date.
pub async fn connect(url: &str, options: PgOptions) -> Result<Store> {
    Ok(Store::new(PgBackend::connect(url, options).await?))
}

/// The tokio-postgres configuration of `url` with idem's session settings
/// added, and where it points.
fn session_config(url: &str, options: &PgOptions) -> Result<(tokio_postgres::Config, Target)> {
    let (mut cfg, target) = target::parse(url)?;
    // Generic plans: idem's statements are point and range lookups on indexed
    // columns whose best plan does not depend on the values, and with array
    // parameters (`unnest`, `= ANY`) PostgreSQL otherwise re-plans the submit
    // key check and the replay read-back on every execution (custom plans look
    // cheaper because they know the array length). Replays: +10 % (benchmarks.md).
    let ours = format!(
        "-c synchronous_commit=on -c plan_cache_mode=force_generic_plan \
         -c statement_timeout={} -c idle_in_transaction_session_timeout={}",
        options.statement_timeout.as_millis(),
        options.idle_in_transaction_timeout.as_millis(),
    );
    let all = match cfg.get_options() {
        Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {ours}"),
        _ => ours,
    };
    cfg.options(all);
    if cfg.get_application_name().is_none() {
        cfg.application_name("idem");
    }
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(options.pool_timeout);
    }
    Ok((cfg, target))
}

impl PgBackend {
    /// Builds the pool, checks that the database answers and applies pending
    /// migrations.
    ///
    /// # Errors
    /// As [`connect`].
    pub async fn connect(url: &str, options: PgOptions) -> Result<PgBackend> {
        let (cfg, target) = session_config(url, &options)?;
        let manager = Manager::from_config(
            cfg,
            tls::connector(&target)?,
            ManagerConfig {
                // `Verified` runs an empty query before a pooled connection is
                // reused, so connections broken by a server restart are dropped
                // and replaced instead of failing the next operation.
                recycling_method: RecyclingMethod::Verified,
            },
        );
        let pool = Pool::builder(manager)
            .runtime(Runtime::Tokio1)
            .max_size(options.max_size.max(1))
            .wait_timeout(Some(options.pool_timeout))
            .create_timeout(Some(options.pool_timeout))
            .recycle_timeout(Some(options.pool_timeout))
            .build()
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot build the connection pool: {e}"))
            })?;
        {
            let mut client = pool
                .get()
                .await
                .map_err(|e| error::connect_error(e, &target))?;
            if options.migrate {
                migrate::apply(
                    &mut client,
                    Some(MIGRATION_WAIT),
                    options.allow_other_tables,
                    &target,
                )
                .await?;
            } else {
                migrate::check(&client).await?;
            }
        }
        let (submits, rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Mutex::new(rx));
        // Lanes hold a connection while work is queued: at most half the pool.
        for _ in 0..SUBMIT_LANES.min((options.max_size / 2).max(1)) {
            tokio::spawn(submit_lane(
                pool.clone(),
                options.max_retries,
                options.operation_timeout,
                Arc::clone(&queue),
            ));
        }
        let (retries, rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Mutex::new(rx));
        // … the retry lane from a pool of 8 up, none under 8 (retries
        // are then written by the submit lanes, as any submit) …
        let retry_lanes = RETRY_LANES.min(options.max_size / 8);
        for _ in 0..retry_lanes {
            tokio::spawn(retry_lane(
                pool.clone(),
                options.operation_timeout,
                Arc::clone(&queue),
                submits.clone(),
            ));
        }
        let (auths, rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Mutex::new(rx));
        // … and the authentication lanes at most a quarter: from a pool of 8 up,
        // at least three connections (eleven of the default 16) stay free for
        // claims, reports and reads.
        for _ in 0..2.min((options.max_size / 4).max(1)) {
            tokio::spawn(auth_lane(
                pool.clone(),
                options.operation_timeout,
                Arc::clone(&queue),
            ));
        }
        Ok(PgBackend {
            pool,
            max_retries: options.max_retries,
            operation_timeout: options.operation_timeout,
            submits,
            auths,
            retries,
            hints: (retry_lanes > 0).then(ScopeHints::new),
        })
    }

    /// The connection pool (for metrics and operator tooling).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Runs `op` on `client`: reads in autocommit, writes in one READ COMMITTED
    /// transaction; a submit batch pipelined ([`PgTx::submit_pipelined`]).
    async fn run_on(client: &mut Object, op: &Op) -> Result<Output> {
        match op {
            Op::SubmitBatch(subs) => Ok(Output::SubmittedBatch(
                PgBackend::submit_on(client, subs).await?,
            )),
            _ => PgBackend::run_tx(client, op).await,
        }
    }

    /// A submit batch pipelined; a batch with a revoked key runs as an ordinary
    /// transaction instead (it refuses that key's submissions only).
    async fn submit_on(client: &mut Object, subs: &[Submission]) -> Result<Vec<SubmitOutcome>> {
        let done = PgTx::autocommit(client).submit_pipelined(subs).await?;
        match done {
            Pipelined::Committed(outcomes) => Ok(outcomes),
            Pipelined::KeyRevoked => PgBackend::submit_tx(client, subs.to_vec()).await,
        }
    }

    /// `subs` through the generic path, in one ordinary transaction.
    async fn submit_tx(client: &mut Object, subs: Vec<Submission>) -> Result<Vec<SubmitOutcome>> {
        match PgBackend::run_tx(client, &Op::SubmitBatch(subs)).await? {
            Output::SubmittedBatch(outcomes) => Ok(outcomes),
            _ => Err(StoreError::Corrupt(
                "submit batch answered the wrong shape".into(),
            )),
        }
    }

    /// Runs `op` through [`ops::run`]: reads in autocommit, writes in one READ
    /// COMMITTED transaction.
    async fn run_tx(client: &mut Object, op: &Op) -> Result<Output> {
        if !op.writes() {
            // Reads run in autocommit: one round trip per statement, no BEGIN/COMMIT.
            return ops::run(&mut PgTx::autocommit(client), op).await;
        }
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(map_pg_error)?;
        let mut pg = PgTx::new(tx);
        let res = ops::run(&mut pg, op).await;
        let Some(tx) = pg.into_inner() else {
            return Err(StoreError::Corrupt(
                "a writing operation lost its transaction".into(),
            ));
        };
        match res {
            Ok(out) => {
                tx.commit().await.map_err(map_pg_error)?;
                Ok(out)
            }
            Err(e) => {
                // Best effort: dropping the transaction rolls back as well.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// Runs `op` on the held connection (taken from the pool when there is
    /// none), again after a short backoff on contention, at most `max_retries`
    /// times; after any error the connection goes back to the pool, which checks
    /// it before reuse. A lane passes its own `held`, kept across batches.
    async fn run_held(
        pool: &Pool,
        held: &mut Option<Object>,
        op: &Op,
        max_retries: u32,
    ) -> Result<Output> {
        let mut retries = 0u32;
        loop {
            let res = match lane_client(pool, held).await {
                Ok(client) => PgBackend::run_on(client, op).await,
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
                    *held = None;
                    return Err(e);
                }
            }
        }
    }

    /// [`PgBackend::run_held_within`] on a connection taken from the pool for
    /// this operation only.
    async fn run(pool: Pool, op: Op, max_retries: u32, deadline: Duration) -> Result<Output> {
        PgBackend::run_held_within(&pool, &mut None, &op, max_retries, deadline).await
    }

    /// [`PgBackend::run_held`] within `deadline`; after a failure the held
    /// connection is not used again ([`forget`]).
    async fn run_held_within(
        pool: &Pool,
        held: &mut Option<Object>,
        op: &Op,
        max_retries: u32,
        deadline: Duration,
    ) -> Result<Output> {
        let res = within(deadline, PgBackend::run_held(pool, held, op, max_retries)).await;
        if res.is_err() {
            forget(held);
        }
        res
    }
}

/// `work`, or [`StoreError::Unavailable`] once `deadline` has passed (the
/// work is dropped: a write's outcome is then unknown, as after a lost
/// connection, and its caller retries with the same key).
async fn within<T>(deadline: Duration, work: impl Future<Output = Result<T>>) -> Result<T> {
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

impl Backend for PgBackend {
    fn execute(&self, op: Op) -> BoxFuture<'_, Result<Output>> {
        let max_retries = self.max_retries;
        if let Op::Authenticate { plain } = &op {
            let hash = idem_store::hash_api_key(plain);
            return Box::pin(async move {
                let (reply, answer) = oneshot::channel();
                self.auths.send((hash, reply)).map_err(|_| {
                    StoreError::Unavailable("the authentication batcher has stopped".into())
                })?;
                let key = answer.await.map_err(|_| {
                    StoreError::Unavailable("the authentication batcher has stopped".into())
                })??;
                Ok(Output::ApiKey(key))
            });
        }
        if let Op::Submit(sub) = op {
            return Box::pin(async move {
                let (reply, answer) = oneshot::channel();
                // A scope not seen yet is written, and remembered once answered.
                let unseen = self.hints.as_ref().and_then(|h| {
                    let scope = h.hash(&sub);
                    (!h.seen(scope)).then_some((h, scope))
                });
                let queue = if self.hints.is_some() && unseen.is_none() {
                    &self.retries
                } else {
                    &self.submits
                };
                queue.send((sub, reply)).map_err(|_| {
                    StoreError::Unavailable("the submit batcher has stopped".into())
                })?;
                let outcome = answer.await.map_err(|_| {
                    StoreError::Unavailable("the submit batcher has stopped".into())
                })??;
                if let Some((hints, scope)) = unseen {
                    hints.remember(scope, &outcome);
                }
                Ok(Output::Submitted(outcome))
            });
        }
        // `Store::execute` already runs writing operations on their own task, so a
        // dropped caller never cuts a transaction (or its COMMIT) short.
        Box::pin(PgBackend::run(
            self.pool.clone(),
            op,
            max_retries,
            self.operation_timeout,
        ))
    }

    /// Submits are answered by the submit lanes, tasks of their own: a dropped
    /// caller never cuts a batch short.
    fn runs_detached(&self, op: &Op) -> bool {
        matches!(op, Op::Submit(_))
    }

    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(within(self.operation_timeout, async move {
            let client = self.pool.get().await.map_err(error::pool_error)?;
            let answered = client.simple_query("SELECT 1").await;
            if answered.is_err() {
                let _ = Object::take(client);
            }
            answered.map_err(map_pg_error)?;
            Ok(())
        }))
    }

    fn kind(&self) -> &'static str {
        "postgres"
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

    #[test]
    fn session_options_are_appended() {
        let (cfg, _) = session_config(
            "postgres://u@localhost:5432/db?options=-c%20search_path%3Dx",
            &PgOptions::default(),
        )
        .unwrap();
        let o = cfg.get_options().unwrap();
        assert!(o.starts_with("-c search_path=x "), "{o}");
        assert!(o.contains("synchronous_commit=on"), "{o}");
        assert!(o.contains("statement_timeout=10000"), "{o}");
        assert!(o.contains("plan_cache_mode=force_generic_plan"), "{o}");
    }
}
