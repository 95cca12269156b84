//! An executor runtime (SPEC §4, executor protocol): a [`Worker`] long-poll
//! claims attempts for the operation classes it has a [`Handler`] for, runs
//! each with a [`Context`], heartbeats it at a third of its lease with the
//! usage the handler recorded, tells the handler when a cancellation is
//! requested or the lease is lost, and reports the outcome once.
//!
//! What a handler's answer is reported as:
//!
//! | handler answer | report |
//! | --- | --- |
//! | `execute` → `Ok(Execution::Succeeded { … })` | `succeeded` (result, `external_txn_id`, usage) |
//! | `execute` → `Ok(Execution::Cancelled)` | `cancelled` (usage kept) |
//! | `Err(HandlerError::Transient)` / `InvalidInput` / `PermissionDenied` | `failed` with that class |
//! | `Err(HandlerError::Unknown)`, or a panic, in `execute` | `unknown`: a non-safe class is reconciled before anything repeats |
//! | `reconcile` → `Ok(Reconciliation::Committed { … })` / `NotCommitted` | `committed` / `not_committed` |
//! | any error or panic in `reconcile` | `failed` `transient`: another reconcile attempt follows, never an execute (SPEC §2) |
//!
//! **The lease is lost at the local deadline.** The worker counts each
//! attempt's lease on its own clock ([`lease`]): from the time the request
//! that last confirmed it (the claim, then each heartbeat) was *sent*, for
//! the `lease_ms` idem answered, less a margin of max(500 ms, 10 %). At that
//! deadline, unless a heartbeat answer moved it, the handler is told the
//! lease is lost ([`Context::lease_lost`], [`Context::stopped`]); a heartbeat
//! answered 401, 403, 404 or 409 tells it at once. From then on another
//! executor may be handed the task: a handler must stop its effect when told.
//! One that ignores the signal is on its own; whatever it returns is still
//! reported once, and idem keeps a late report as evidence only (a
//! `Cancelled` returned only because the lease was lost is not reported).
//! A claim that long-polled may have been sent long before idem granted the
//! lease: when less than half the lease is left by the local count, the
//! worker heartbeats once before it starts the handler and counts from that
//! heartbeat.
//!
//! **Free text is trimmed to idem's limits** (SPEC §7): a report's message to
//! [`MAX_MESSAGE_CHARS`] characters; a report refused for its size (413) is
//! sent again with its message cut further, never dropped.
//!
//! **Shutdown** (the future given to [`Worker::run`]) stops claiming at once
//! and lets running attempts finish within [`Worker::grace`]. A claim still
//! open then is kept while attempts run (closed at once when none does); an
//! attempt it brings is released unstarted ([`Client::release`]: the task is
//! claimable again at once), never run. Attempts still running
//! when the grace ends are abandoned: never reported, their leases run out.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use serde_json::Value;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use uuid::Uuid;

use crate::{AttemptKind, ClaimedAttempt, Client, ClientError, FailureClass, ReportBody, Task};

pub mod lease;
mod report;

pub use report::MAX_MESSAGE_CHARS;

/// A boxed future a [`Handler`] returns.
pub type HandlerFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, HandlerError>> + Send + 'a>>;

/// What an `execute` attempt ended with.
#[derive(Debug, Clone, PartialEq)]
pub enum Execution {
    /// The effect happened: report `succeeded`.
    Succeeded {
        /// The result delivered to the client.
        result: Value,
        /// The provider's transaction id, if any.
        external_txn_id: Option<String>,
        /// The usage total, when the handler did not record it with
        /// [`Context::record_usage`].
        usage: Option<i64>,
    },
    /// Stopped on a cancellation request before the effect: report `cancelled`.
    Cancelled,
}

impl Execution {
    /// `Succeeded` with `result` and nothing else.
    pub fn succeeded(result: Value) -> Execution {
        Execution::Succeeded {
            result,
            external_txn_id: None,
            usage: None,
        }
    }
}

/// What a `reconcile` attempt found out.
#[derive(Debug, Clone, PartialEq)]
pub enum Reconciliation {
    /// The earlier effect happened: report `committed`.
    Committed {
        /// Its result.
        result: Value,
        /// The provider's transaction id, if any.
        external_txn_id: Option<String>,
    },
    /// It did not happen: report `not_committed` (the next execute may start).
    NotCommitted,
}

/// A handler's failure; each variant is a failure class (SPEC §3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Worth retrying after a backoff (safe classes only; a non-safe class fails).
    #[error("transient: {0}")]
    Transient(String),
    /// The request can never succeed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// Not allowed, and asking again will not help.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The handler cannot tell whether the effect happened (a timeout after
    /// sending to the provider, a crash mid-call).
    #[error("outcome unknown: {0}")]
    Unknown(String),
}

/// The code for one operation class.
pub trait Handler: Send + Sync + 'static {
    /// Performs the effect. Pass [`Context::task_id`] to the provider as its
    /// idempotency key, so a repeat of this task is one effect there too.
    fn execute<'a>(&'a self, ctx: &'a Context) -> HandlerFuture<'a, Execution>;
    /// Asks the provider whether an earlier execute of this task took effect.
    fn reconcile<'a>(&'a self, ctx: &'a Context) -> HandlerFuture<'a, Reconciliation>;
}

/// Why a running attempt should stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Running,
    CancelRequested,
    LeaseLost,
}

/// What a handler gets for one attempt.
#[derive(Debug)]
pub struct Context {
    attempt: ClaimedAttempt,
    client: Client,
    usage: Mutex<Option<i64>>,
    stop: watch::Sender<Stop>,
    /// The local lease deadline ([`lease`]), moved by each heartbeat answer.
    deadline: Mutex<Instant>,
}

impl Context {
    /// The task: pass its id to the provider as the provider's idempotency key.
    pub fn task_id(&self) -> Uuid {
        self.attempt.task_id
    }
    /// The attempt.
    pub fn attempt_id(&self) -> Uuid {
        self.attempt.id
    }
    /// The attempt's number (1 for the first).
    pub fn number(&self) -> i64 {
        self.attempt.number
    }
    /// The fencing generation this attempt holds.
    pub fn generation(&self) -> i64 {
        self.attempt.generation
    }
    /// `execute` or `reconcile`.
    pub fn kind(&self) -> &AttemptKind {
        &self.attempt.kind
    }
    /// The operation class.
    pub fn operation(&self) -> &str {
        &self.attempt.operation
    }
    /// The task's params.
    pub fn params(&self) -> &Value {
        &self.attempt.params
    }
    /// The client's idempotency key of the task.
    pub fn idempotency_key(&self) -> &str {
        &self.attempt.idempotency_key
    }
    /// The W3C `traceparent` the task was submitted with, if any: continue
    /// the trace in the handler's calls to the provider.
    pub fn traceparent(&self) -> Option<&str> {
        self.attempt.traceparent.as_deref()
    }
    /// The claimed attempt as idem sent it.
    pub fn attempt(&self) -> &ClaimedAttempt {
        &self.attempt
    }

    /// Records the usage total so far (sent with the next heartbeat and the report).
    pub fn record_usage(&self, total: i64) {
        if let Ok(mut usage) = self.usage.lock() {
            *usage = Some(total);
        }
    }

    /// The usage total recorded so far.
    pub fn usage(&self) -> Option<i64> {
        self.usage.lock().ok().and_then(|u| *u)
    }

    /// Whether a cancellation of the task was requested: stop before the
    /// effect if you can and return [`Execution::Cancelled`].
    pub fn cancel_requested(&self) -> bool {
        *self.stop.borrow() == Stop::CancelRequested
    }

    /// Whether this attempt lost its lease: its local lease deadline passed
    /// without a heartbeat answer moving it, or a heartbeat was answered 401,
    /// 403, 404 or 409. Another attempt may run; stop the effect. What this
    /// one reports is kept as evidence only.
    pub fn lease_lost(&self) -> bool {
        *self.stop.borrow() == Stop::LeaseLost
    }

    /// Resolves once a cancellation is requested or the lease is lost
    /// (at the latest at [`Context::lease_deadline`]).
    pub async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|s| *s != Stop::Running).await;
    }

    /// The local lease deadline now (monotonic clock): the lease is treated
    /// as lost at this instant unless a heartbeat answer moves it ([`lease`]).
    pub fn lease_deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_deadline(&self, deadline: Instant) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = deadline;
    }

    /// Tells the handler the lease is lost (for good).
    fn lose_lease(&self) {
        self.stop.send_if_modified(|s| {
            let changed = *s != Stop::LeaseLost;
            *s = Stop::LeaseLost;
            changed
        });
    }

    /// Tells the handler a cancellation is requested (unless the lease is lost).
    fn request_cancel(&self) {
        self.stop.send_if_modified(|s| {
            let changed = *s == Stop::Running;
            if changed {
                *s = Stop::CancelRequested;
            }
            changed
        });
    }

    /// `POST /v1/attempts/{id}/ack`: a device gateway's "command
    /// acknowledged", separate from the completion the handler returns.
    ///
    /// # Errors
    /// As [`Client::ack`].
    pub async fn ack(&self) -> crate::Result<Task> {
        self.client
            .ack(self.attempt.id, self.attempt.generation)
            .await
    }
}

/// The executor runtime. Build with [`Worker::new`] and the `with_*` methods,
/// run with [`Worker::run`].
pub struct Worker {
    client: Client,
    executor_id: String,
    handlers: HashMap<String, Arc<dyn Handler>>,
    concurrency: usize,
    lease_ms: u64,
    grace: Duration,
    poll_wait_ms: u64,
    heartbeat_every: Option<Duration>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("executor_id", &self.executor_id)
            .field("operations", &self.handlers.keys().collect::<Vec<_>>())
            .field("concurrency", &self.concurrency)
            .field("lease_ms", &self.lease_ms)
            .finish()
    }
}

/// How long a claim long-polls by default, ms.
pub const POLL_WAIT_MS: u64 = 20_000;
/// How long a failed claim waits before the next, and the first wait between
/// report tries.
pub const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Report tries on transport errors and 5xx (a repeated report is idempotent);
/// also the release tries.
pub const REPORT_TRIES: u32 = 5;

/// A claim's answer to come.
type OpenClaim<'a> = Pin<Box<dyn Future<Output = crate::Result<Vec<ClaimedAttempt>>> + Send + 'a>>;

impl Worker {
    /// A worker claiming as `executor_id` through `client` (an executor key),
    /// one attempt at a time, with 30 s leases and a 30 s shutdown grace.
    pub fn new(client: Client, executor_id: impl Into<String>) -> Worker {
        Worker {
            client,
            executor_id: executor_id.into(),
            handlers: HashMap::new(),
            concurrency: 1,
            lease_ms: 30_000,
            grace: Duration::from_secs(30),
            poll_wait_ms: POLL_WAIT_MS,
            heartbeat_every: None,
        }
    }

    /// Handles `operation` with `handler`.
    pub fn with_handler(mut self, operation: impl Into<String>, handler: impl Handler) -> Worker {
        self.handlers.insert(operation.into(), Arc::new(handler));
        self
    }

    /// At most `n` attempts at once (at least 1, at most 100: a claim's `max`).
    pub fn with_concurrency(mut self, n: usize) -> Worker {
        self.concurrency = n.clamp(1, 100);
        self
    }

    /// The lease asked for each attempt, ms. Heartbeats go every third of
    /// the lease idem granted; the handler is told the lease is lost at its
    /// local deadline, max(500 ms, 10 %) before its end ([`lease`]), so a
    /// lease should be well above a second; [`Worker::run`] refuses one
    /// under [`lease::MIN_WORKER_LEASE_MS`].
    pub fn with_lease_ms(mut self, lease_ms: u64) -> Worker {
        self.lease_ms = lease_ms;
        self
    }

    /// How long a shutdown waits for running attempts.
    pub fn with_grace(mut self, grace: Duration) -> Worker {
        self.grace = grace;
        self
    }

    /// How long each claim long-polls, ms (at most 30 000).
    pub fn with_poll_wait_ms(mut self, wait_ms: u64) -> Worker {
        self.poll_wait_ms = wait_ms.min(30_000);
        self
    }

    /// The heartbeat interval (default: a third of the lease). Longer than
    /// the lease lets leases run out: for tests of lease loss.
    pub fn with_heartbeat_every(mut self, every: Duration) -> Worker {
        self.heartbeat_every = Some(every);
        self
    }

    /// The shutdown grace ([`Worker::with_grace`]).
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// Claims and runs attempts until `shutdown` resolves, then lets running
    /// attempts finish within the grace and returns. Claim failures (idem
    /// unreachable, 503) are retried after [`RETRY_PAUSE`], or the answer's
    /// `Retry-After` when longer (503 `OVERLOADED`). A claim open when
    /// `shutdown` resolves is kept while attempts run (closed at once when
    /// none does); an attempt it brings is released, never run. Attempts
    /// still running when the grace ends are abandoned, unreported.
    ///
    /// # Errors
    /// [`ClientError::InvalidArgument`] when no handler was given or the
    /// lease is under [`lease::MIN_WORKER_LEASE_MS`] (nothing is claimed);
    /// a claim refused for good (401, 403, 400) ends the run with its error.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> crate::Result<()> {
        if self.handlers.is_empty() {
            return Err(ClientError::InvalidArgument(
                "a worker needs at least one handler".into(),
            ));
        }
        if self.lease_ms < lease::MIN_WORKER_LEASE_MS {
            return Err(ClientError::InvalidArgument(format!(
                "a worker's lease must be at least {} ms (its local deadline is 500 ms before \
                 the lease ends and must come after the first heartbeat); {} ms was asked",
                lease::MIN_WORKER_LEASE_MS,
                self.lease_ms
            )));
        }
        let worker = Arc::new(self);
        let mut operations: Vec<&str> = worker.handlers.keys().map(String::as_str).collect();
        operations.sort_unstable();
        let slots = Arc::new(Semaphore::new(worker.concurrency));
        let mut running = JoinSet::new();
        tokio::pin!(shutdown);
        let mut claim: Option<OpenClaim<'_>> = None;
        let ended = loop {
            while running.try_join_next().is_some() {}
            let free = slots.available_permits();
            if free == 0 {
                tokio::select! {
                    () = &mut shutdown => break Ok(()),
                    _ = running.join_next() => continue,
                }
            }
            let sent = Instant::now();
            let mut open: OpenClaim<'_> = Box::pin(worker.client.claim(
                &worker.executor_id,
                &operations,
                u32::try_from(free).unwrap_or(1),
                Some(worker.lease_ms),
                worker.poll_wait_ms,
            ));
            let claimed = tokio::select! {
                // A claim answered as the shutdown comes is released, not run.
                biased;
                () = &mut shutdown => {
                    claim = Some(open);
                    break Ok(());
                }
                claimed = &mut open => claimed,
            };
            match claimed {
                Ok(attempts) => {
                    for attempt in attempts {
                        let worker = Arc::clone(&worker);
                        match Arc::clone(&slots).try_acquire_owned() {
                            Ok(permit) => running.spawn(async move {
                                worker.run_attempt(attempt, sent).await;
                                drop(permit);
                            }),
                            // More than asked for: give it back unstarted.
                            Err(_) => running.spawn(async move { worker.release(&attempt).await }),
                        };
                    }
                }
                Err(e) if e.is_retryable() => {
                    // At least as long as idem asked (`Retry-After` of a 503
                    // `OVERLOADED` or `UNAVAILABLE`).
                    let pause = e.retry_after().unwrap_or_default().max(RETRY_PAUSE);
                    tokio::select! {
                        () = &mut shutdown => break Ok(()),
                        () = tokio::time::sleep(pause) => {}
                    }
                }
                Err(e) => break Err(e),
            }
        };
        // The open claim is kept while attempts run (it is dropped, closing
        // its connection, once none does); what it brings is released,
        // including an answer already in when the shutdown came.
        if running.is_empty()
            && let Some(answered) = claim.as_mut().and_then(|c| c.now_or_never())
        {
            claim = None;
            for attempt in answered.unwrap_or_default() {
                let worker = Arc::clone(&worker);
                running.spawn(async move { worker.release(&attempt).await });
            }
        }
        let finish = async {
            loop {
                let attempts_run = !running.is_empty();
                let answer = async {
                    match claim.as_mut() {
                        Some(c) if attempts_run => c.await,
                        _ => std::future::pending().await,
                    }
                };
                tokio::select! {
                    answered = answer => {
                        claim = None;
                        for attempt in answered.unwrap_or_default() {
                            let worker = Arc::clone(&worker);
                            running.spawn(async move { worker.release(&attempt).await });
                        }
                    }
                    joined = running.join_next() => {
                        if joined.is_none() {
                            break;
                        }
                    }
                }
            }
        };
        if tokio::time::timeout(worker.grace, finish).await.is_err() {
            running.abort_all();
        }
        ended
    }

    /// Runs one attempt, claimed by a request sent at `sent`, to its report.
    async fn run_attempt(&self, attempt: ClaimedAttempt, sent: Instant) {
        let Some(handler) = self.handlers.get(&attempt.operation).cloned() else {
            self.release(&attempt).await;
            return;
        };
        let lease = lease::lease_length(attempt.lease_ms);
        let ctx = Context {
            deadline: Mutex::new(lease::local_deadline(sent, attempt.lease_ms)),
            attempt,
            client: self.client.clone(),
            usage: Mutex::new(None),
            stop: watch::Sender::new(Stop::Running),
        };
        if ctx
            .lease_deadline()
            .saturating_duration_since(Instant::now())
            < lease / 2
        {
            // A long poll's send time may lie long before the grant: count
            // from a heartbeat's instead.
            heartbeat_once(&ctx, lease / 3).await;
            if ctx.lease_lost() {
                return;
            }
        }
        if ctx.lease_deadline() <= Instant::now() {
            // Not confirmed in time: never started, so given back.
            self.release(&ctx.attempt).await;
            return;
        }
        let every = self.heartbeat_every.unwrap_or(lease / 3);
        let keeper = keep_lease(&ctx, lease, every);
        let work = run_handler(handler.as_ref(), &ctx);
        tokio::pin!(keeper, work);
        // The keeper ends only when the lease is lost; the handler runs on.
        let body = tokio::select! {
            body = &mut work => body,
            () = &mut keeper => work.await,
        };
        let Some(body) = body else {
            // Stopped by the lost lease with no outcome of its own.
            return;
        };
        let body = match ctx.usage() {
            Some(u) => body.with_usage(u),
            None => body,
        };
        self.report(&ctx, report::trimmed(body)).await;
    }

    /// Reports once; repeats the same report on transport errors and 5xx,
    /// and with its message cut further while it is refused for its size.
    async fn report(&self, ctx: &Context, mut body: ReportBody) {
        let mut pause = RETRY_PAUSE;
        let mut tries = 0;
        while tries < REPORT_TRIES {
            match self.client.report(ctx.attempt_id(), &body).await {
                Ok(_) => return,
                Err(e) if e.code() == Some("STALE_GENERATION") => {
                    // Kept by idem as evidence; nothing else to do.
                    return;
                }
                Err(e) if e.status() == Some(413) => match report::cut_further(&body) {
                    Some(cut) => body = cut,
                    // Nothing left to cut: the lease runs out.
                    None => return,
                },
                Err(e) if e.is_retryable() => {
                    tries += 1;
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                Err(_) => return,
            }
        }
    }

    /// Gives `attempt` back unstarted ([`Client::release`]):
    /// repeated on transport errors and 5xx; 404 and 409 mean there is
    /// nothing to give back (the lease already ran out or was taken).
    async fn release(&self, attempt: &ClaimedAttempt) {
        let mut pause = RETRY_PAUSE;
        for _ in 0..REPORT_TRIES {
            match self.client.release(attempt.id, attempt.generation).await {
                Err(e) if e.is_retryable() => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                // Released, nothing to release, or refused: its lease runs out.
                _ => return,
            }
        }
    }
}

/// Runs the handler of `ctx`'s attempt and maps its answer to a report;
/// `None` for a `Cancelled` returned after the lease was lost with no
/// cancellation requested (an outcome the handler did not reach).
async fn run_handler(handler: &dyn Handler, ctx: &Context) -> Option<ReportBody> {
    let generation = ctx.generation();
    let body = match ctx.kind() {
        AttemptKind::Reconcile => {
            let found = AssertUnwindSafe(handler.reconcile(ctx))
                .catch_unwind()
                .await;
            match found {
                Ok(Ok(Reconciliation::Committed {
                    result,
                    external_txn_id,
                })) => with_txn(ReportBody::committed(generation, result), external_txn_id),
                Ok(Ok(Reconciliation::NotCommitted)) => ReportBody::not_committed(generation),
                Ok(Err(e)) => {
                    ReportBody::failed(generation, FailureClass::Transient, e.to_string())
                }
                Err(_) => ReportBody::failed(
                    generation,
                    FailureClass::Transient,
                    "the reconcile handler panicked",
                ),
            }
        }
        _ => {
            let done = AssertUnwindSafe(handler.execute(ctx)).catch_unwind().await;
            match done {
                Ok(Ok(Execution::Succeeded {
                    result,
                    external_txn_id,
                    usage,
                })) => {
                    if let Some(u) = usage {
                        ctx.record_usage(u);
                    }
                    with_txn(ReportBody::succeeded(generation, result), external_txn_id)
                }
                Ok(Ok(Execution::Cancelled)) => {
                    if ctx.lease_lost() {
                        return None;
                    }
                    ReportBody::cancelled(generation)
                }
                Ok(Err(HandlerError::Transient(m))) => {
                    ReportBody::failed(generation, FailureClass::Transient, m)
                }
                Ok(Err(HandlerError::InvalidInput(m))) => {
                    ReportBody::failed(generation, FailureClass::InvalidInput, m)
                }
                Ok(Err(HandlerError::PermissionDenied(m))) => {
                    ReportBody::failed(generation, FailureClass::PermissionDenied, m)
                }
                Ok(Err(HandlerError::Unknown(m))) => {
                    ReportBody::unknown(generation).with_message(m)
                }
                Err(_) => ReportBody::unknown(generation).with_message("the handler panicked"),
            }
        }
    };
    Some(body)
}

fn with_txn(body: ReportBody, external_txn_id: Option<String>) -> ReportBody {
    match external_txn_id {
        Some(id) => body.with_external_txn_id(id),
        None => body,
    }
}

/// Keeps `ctx`'s lease (of length `lease`) by a heartbeat every `every`
/// until it is lost: at the local deadline, or on a heartbeat answered 401,
/// 403, 404 or 409 ([`lease`]). Returns once the handler was told.
async fn keep_lease(ctx: &Context, lease: Duration, every: Duration) {
    let mut next = Instant::now() + every;
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(ctx.lease_deadline()) => {
                ctx.lose_lease();
                return;
            }
            () = tokio::time::sleep_until(next) => {}
        }
        let now = Instant::now();
        next = now + every;
        let left = ctx.lease_deadline().saturating_duration_since(now);
        heartbeat_once(ctx, (lease / 3).min(left)).await;
        if ctx.lease_lost() {
            return;
        }
    }
}

/// One heartbeat, given up after `limit` (while the handler runs: min(lease/3,
/// time left to the local deadline)): an answer moves the deadline (counted
/// from the send time) and passes on a cancellation request; 401, 403, 404
/// or 409 loses the lease; any other failure leaves the deadline where it
/// was.
async fn heartbeat_once(ctx: &Context, limit: Duration) {
    let sent = Instant::now();
    let beat = ctx
        .client
        .heartbeat(ctx.attempt_id(), ctx.generation(), ctx.usage());
    match tokio::time::timeout(limit, beat).await {
        Ok(Ok(ack)) => {
            if ctx.lease_lost() {
                return;
            }
            ctx.set_deadline(lease::local_deadline(sent, ack.lease_ms));
            if ack.cancel_requested {
                ctx.request_cancel();
            }
        }
        Ok(Err(e)) if lease::lease_is_gone(&e) => ctx.lose_lease(),
        // Failed or timed out: the deadline stands; the next beat tries again.
        Ok(Err(_)) | Err(_) => {}
    }
}
