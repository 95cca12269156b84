//! [`Store`]: the typed, cloneable handle the HTTP layer and the CLI use.
//! Every method builds one operation ([`crate::ops`]), hands it to the
//! backend with its reply channel and waits for the typed reply.

use std::sync::Arc;

use idem_core::machine::{HeartbeatAck, Report};
use idem_core::model::{ApiKey, Attempt, Cancellation, Event, Role, Serves, Task};
use serde_json::Value;
use uuid::Uuid;

use crate::ops::{
    self, Call, ClaimRequest, Claimed, Grant, Op, Operation, Submission, SubmitOutcome, SweepStats,
};
use tracing::Instrument;

use crate::{Backend, Clock, Refusal, Result, StoreError, spans};

/// The cloneable handle to a store.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    pub(crate) grant: Grant,
    /// [`Store::cursor_key`], once read: shared by every clone.
    cursor_key: Arc<tokio::sync::OnceCell<ops::CursorKey>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("kind", &self.backend.kind())
            .finish()
    }
}

impl Store {
    /// Wraps a backend.
    pub fn new(backend: impl Backend) -> Store {
        Store {
            backend: Arc::new(backend),
            grant: None,
            cursor_key: Arc::new(tokio::sync::OnceCell::new()),
        }
    }

    /// `sqlite` or `postgres`.
    pub fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// The clock this store decides leases, backoffs, deadlines and retention
    /// by; a test moves a test clock ([`Clock::advance`]) to let them pass.
    pub fn clock(&self) -> &Clock {
        self.backend.clock()
    }

    /// The committed changes of this store's database: subscribe to wait for
    /// a task or for work ([`crate::changes`]).
    pub fn changes(&self) -> &crate::Changes {
        self.backend.changes()
    }

    /// Resolves once every change committed through this store so far has
    /// been announced to the other instances ([`Backend::announced`]); call
    /// it before a process that wrote exits.
    pub async fn announced(&self) {
        self.backend.announced().await;
    }

    /// Readiness probe: the database answers and holds a schema this binary
    /// serves ([`crate::schema`]).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the database does not answer;
    /// [`StoreError::Migration`] naming both versions when its schema is one
    /// this binary cannot serve (another instance migrated it).
    pub async fn ping(&self) -> Result<()> {
        self.backend.ping().await
    }

    /// This store acting for a key limited to `operations` (`None`: all classes):
    /// every task read or change of another class answers [`Refusal::NotFound`].
    pub fn granted(&self, operations: Option<Vec<String>>) -> Store {
        let mut s = self.clone();
        s.grant = operations.map(Arc::new);
        s
    }

    /// Runs `op` in one transaction and waits for its reply.
    ///
    /// Writing operations run to their commit (or rollback) even when the
    /// caller is dropped, e.g. because the HTTP client disconnected (SPEC §7):
    /// on the backend's own writer or batcher when it has one
    /// ([`Backend::runs_detached`]), else on a task of their own.
    ///
    /// Within a span, and while spans are on, the call has a span of its own
    /// ([`spans`]).
    ///
    /// # Errors
    /// Storage failures only; refusals are in the reply.
    pub(crate) async fn call<O: Operation>(&self, op: O) -> Result<O::Reply>
    where
        Op: From<Call<O>>,
    {
        match spans::store_span::<O>(self.kind()) {
            None => self.run(op).await,
            // Boxed: the future of a call without a span holds none.
            Some(span) => Box::pin(self.run(op).instrument(span)).await,
        }
    }

    /// [`Store::call`] without its span.
    async fn run<O: Operation>(&self, op: O) -> Result<O::Reply>
    where
        Op: From<Call<O>>,
    {
        let (call, answer) = Call::new(op);
        let op = Op::from(call);
        if !O::WRITES || self.backend.runs_detached(&op) {
            self.backend.execute(op).await;
        } else {
            let backend = Arc::clone(&self.backend);
            tokio::spawn(async move { backend.execute(op).await });
        }
        answer
            .await
            .map_err(|_| StoreError::Unavailable("store task failed: no answer".into()))?
    }

    /// [`Store::call`] of an operation that may end attempts: emits their
    /// spans once its transaction committed ([`spans::attempts_ended`]) and
    /// answers its reply.
    ///
    /// # Errors
    /// As [`Store::call`].
    pub(crate) async fn call_ending<O, R>(&self, op: O) -> Result<R>
    where
        O: Operation<Reply = spans::Ending<R>>,
        Op: From<Call<O>>,
    {
        let out = self.call(op).await?;
        spans::attempts_ended(&out.ended);
        Ok(out.reply)
    }

    /// Creates an API key; returns the record and the plain key.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn create_api_key(
        &self,
        tenant: &str,
        role: Role,
        operations: Option<Vec<String>>,
    ) -> Result<(ApiKey, String)> {
        self.create_pool_key(tenant, role, operations, None).await
    }

    /// Creates an API key that serves `serves` (a shared executor pool,
    /// SPEC §2.13; `None`: its own tenant); returns the record and the plain key.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn create_pool_key(
        &self,
        tenant: &str,
        role: Role,
        operations: Option<Vec<String>>,
        serves: Option<Serves>,
    ) -> Result<(ApiKey, String)> {
        self.call(ops::CreateApiKey {
            tenant: tenant.to_owned(),
            role,
            operations,
            serves,
        })
        .await
    }

    /// Revokes an API key; `None` when no such key.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn revoke_api_key(&self, id: Uuid) -> Result<Option<ApiKey>> {
        self.call(ops::RevokeApiKey { id }).await
    }

    /// Lists API keys, oldest first.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn list_api_keys(&self) -> Result<Vec<ApiKey>> {
        self.call(ops::ListApiKeys).await
    }

    /// Finds the key a bearer token names (revoked keys included; check `revoked_at`).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn authenticate(&self, plain: &str) -> Result<Option<ApiKey>> {
        self.call(ops::Authenticate {
            plain: plain.to_owned(),
        })
        .await
    }

    /// Submits a task (SPEC §2.1–2.3). A submit touches only its own scope,
    /// whose operation the caller names (the HTTP layer refuses an ungranted
    /// one first), so the grant does not apply.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn submit(&self, s: Submission) -> Result<SubmitOutcome> {
        self.call(ops::Submit(s)).await
    }

    /// Submits several tasks in one transaction; the outcomes, in request
    /// order, are those of submitting each in order.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); nothing of the batch was written.
    pub async fn submit_batch(&self, subs: Vec<Submission>) -> Result<Vec<SubmitOutcome>> {
        self.call(ops::SubmitBatch(subs)).await
    }

    /// Reads a task of `tenant` (`None`: any tenant).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn get_task(&self, tenant: Option<&str>, id: Uuid) -> Result<Result<Task, Refusal>> {
        self.call(ops::GetTask {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            id,
        })
        .await
    }

    /// Looks a task up by scope.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn find_task(
        &self,
        tenant: &str,
        operation: &str,
        idempotency_key: &str,
    ) -> Result<Result<Task, Refusal>> {
        self.call(ops::FindTask {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            operation: operation.to_owned(),
            idempotency_key: idempotency_key.to_owned(),
        })
        .await
    }

    /// One page of `tenant`'s tasks matching `query`, newest first, in the
    /// classes this store's grant allows ([`ops::search`]).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn search_tasks(&self, tenant: &str, query: ops::TaskQuery) -> Result<ops::TaskPage> {
        self.call(ops::SearchTasks {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            query,
        })
        .await
    }

    /// The key that seals and opens task-search cursors
    /// ([`ops::CursorKey`]): the store's shared secret
    /// [`ops::search::CURSOR_SECRET`], made (32 bytes of the operating
    /// system's RNG) by whichever instance needs it first, read once per
    /// store handle and its clones.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); the operating system's RNG failing.
    pub async fn cursor_key(&self) -> Result<ops::CursorKey> {
        let key = self
            .cursor_key
            .get_or_try_init(|| async {
                use rand::TryRngCore;
                let mut candidate = [0_u8; 32];
                rand::rngs::OsRng
                    .try_fill_bytes(&mut candidate)
                    .map_err(|e| {
                        StoreError::Unavailable(format!("the system's random generator: {e}"))
                    })?;
                let secret = self
                    .call(ops::SharedSecret {
                        name: ops::search::CURSOR_SECRET.to_owned(),
                        candidate,
                    })
                    .await?;
                ops::CursorKey::new(&secret)
            })
            .await?;
        Ok(key.clone())
    }

    /// The store's clock now, epoch ms: the time it decides leases,
    /// backoffs, deadlines and retention by (on PostgreSQL the database clock,
    /// `clock_timestamp()`, not this process's), for a reader that shows time left.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn now(&self) -> Result<idem_core::model::Timestamp> {
        self.call(ops::ReadClock).await
    }

    /// Attempts of a task, with evidence.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn list_attempts(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
    ) -> Result<Result<Vec<Attempt>, Refusal>> {
        self.call(ops::ListAttempts {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
        })
        .await
    }

    /// Event history of a task.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn list_events(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
    ) -> Result<Result<Vec<Event>, Refusal>> {
        self.call(ops::ListEvents {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
        })
        .await
    }

    /// A task with its whole event history, read together (for a live task
    /// stream, SPEC §4, "Live events").
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn task_history(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
    ) -> Result<Result<(Task, Vec<Event>), Refusal>> {
        self.call(ops::TaskHistory {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
        })
        .await
    }

    /// Up to `limit` (1–[`ops::feed::MAX_FEED_PAGE`]) events of `tenant`'s
    /// feed after `after`, of the classes this store's grant allows
    /// ([`crate::feed`]: none is ever skipped or repeated by a reader that
    /// resumes from the last cursor it read); a cursor ahead of the feed's
    /// head is refused (the cursor a client sends).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); [`crate::feed::CursorAhead`] in the
    /// value.
    pub async fn read_feed(
        &self,
        tenant: &str,
        after: crate::feed::FeedCursor,
        limit: i64,
    ) -> Result<Result<Vec<crate::feed::FeedEvent>, crate::feed::CursorAhead>> {
        self.call(ops::ReadFeed {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            after,
            limit,
        })
        .await
    }

    /// [`Store::read_feed`] after a cursor this feed gave out (a reader
    /// resuming from the last event it read).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); [`StoreError::Corrupt`] when
    /// `after` is ahead of the feed's head, which a cursor the feed gave out
    /// can only be if the database lost events it had served (e.g. restored
    /// from an older backup).
    pub async fn feed(
        &self,
        tenant: &str,
        after: crate::feed::FeedCursor,
        limit: i64,
    ) -> Result<Vec<crate::feed::FeedEvent>> {
        self.read_feed(tenant, after, limit).await?.map_err(|e| {
            StoreError::Corrupt(format!(
                "feed cursor {} is ahead of the feed's head: the database lost events it served",
                e.0
            ))
        })
    }

    /// Leases up to `req.max` attempts (`req.operations` already limited to
    /// the key's grant).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn claim(&self, req: ClaimRequest) -> Result<Vec<Claimed>> {
        self.call(ops::Claim(req)).await
    }

    /// [`Store::claim`] by the executor key `key`, checked in the claim's
    /// transaction ([`ops::ClaimAs`]): `None`, nothing leased, when that key
    /// is revoked or gone.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn claim_as(&self, key: Uuid, req: ClaimRequest) -> Result<Option<Vec<Claimed>>> {
        self.call(ops::ClaimAs { key, req }).await
    }

    /// The tenant of an attempt's task; `None` when there is no such attempt
    /// (SPEC §2.13: what a pool key checks against the tenants it serves).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn attempt_tenant(&self, attempt_id: Uuid) -> Result<Option<String>> {
        self.call(ops::AttemptTenant { attempt_id }).await
    }

    /// Extends a lease.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn heartbeat(
        &self,
        tenant: &str,
        attempt_id: Uuid,
        generation: i64,
        usage: Option<i64>,
    ) -> Result<Result<HeartbeatAck, Refusal>> {
        self.call(ops::Heartbeat {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            attempt_id,
            generation,
            usage,
        })
        .await
    }

    /// Device acknowledgment of a command.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn acknowledge(
        &self,
        tenant: &str,
        attempt_id: Uuid,
        generation: i64,
        body: Value,
    ) -> Result<Result<Task, Refusal>> {
        self.call(ops::Acknowledge {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            attempt_id,
            generation,
            body,
        })
        .await
    }

    /// Releases an attempt its executor never started (SPEC §4 `/release`).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn release(
        &self,
        tenant: &str,
        attempt_id: Uuid,
        generation: i64,
    ) -> Result<Result<Task, Refusal>> {
        self.call_ending(ops::Release {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            attempt_id,
            generation,
        })
        .await
    }

    /// Applies a report.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn report(
        &self,
        tenant: &str,
        attempt_id: Uuid,
        report: Report,
    ) -> Result<Result<Task, Refusal>> {
        self.call_ending(ops::Report {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            attempt_id,
            report,
        })
        .await
    }

    /// [`Store::report`] by the executor key `key`, checked in the report's
    /// transaction ([`ops::ReportAs`]): `None`, nothing written, when that
    /// key is revoked or gone.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn report_as(
        &self,
        key: Uuid,
        tenant: &str,
        attempt_id: Uuid,
        report: Report,
    ) -> Result<Option<std::result::Result<Task, Refusal>>> {
        self.call_ending(ops::ReportAs {
            key,
            report: ops::Report {
                tenant: tenant.to_owned(),
                grant: self.grant.clone(),
                attempt_id,
                report,
            },
        })
        .await
    }

    /// Requests cancellation.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn cancel(
        &self,
        tenant: &str,
        task_id: Uuid,
    ) -> Result<Result<(Task, Cancellation), Refusal>> {
        self.call(ops::Cancel {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            task_id,
        })
        .await
    }

    /// Acknowledges delivery.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); business refusals are in the value.
    pub async fn acknowledge_delivery(
        &self,
        tenant: &str,
        task_id: Uuid,
    ) -> Result<Result<Task, Refusal>> {
        self.call(ops::AcknowledgeDelivery {
            tenant: tenant.to_owned(),
            grant: self.grant.clone(),
            task_id,
        })
        .await
    }

    /// Checks the store's identity (SPEC §2.11, [`crate::identity`]): records
    /// it on first use; when the database went back in time (another
    /// PostgreSQL timeline or system, an SQLite file restored from a backup)
    /// records the new one and moves every task that may have started to
    /// reconcile-first, in one transaction. A server runs it at start and
    /// with every sweep; a writing CLI command before it writes.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]); nothing was written.
    pub async fn check_identity(&self) -> Result<crate::identity::IdentityCheck> {
        let check = self
            .call_ending(ops::CheckIdentity {
                fresh_epoch: Uuid::new_v4(),
            })
            .await?;
        if let crate::identity::IdentityCheck::Rewound {
            from,
            to,
            restored,
            tasks,
        } = &check
        {
            tracing::warn!(
                from_epoch = %from.epoch,
                to_epoch = %to.epoch,
                from_timeline = ?from.timeline,
                to_timeline = ?to.timeline,
                from_system = ?from.system_identifier,
                to_system = ?to.system_identifier,
                restored_backup = restored,
                tasks,
                "the store went back in time: tasks that may have started were moved to reconcile-first"
            );
        }
        Ok(check)
    }

    /// Marks the store as restored from a backup ([`ops::MarkRestored`]):
    /// the next [`Store::check_identity`] rewinds.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn mark_restored(&self) -> Result<bool> {
        self.call(ops::MarkRestored).await
    }

    /// One sweep: expire leases, wake backoffs, remove keys past retention.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn sweep(&self, limit: i64) -> Result<SweepStats> {
        self.sweep_from(limit, None).await
    }

    /// [`Store::sweep`] whose walk for missing claim queues starts after
    /// `queues_after` (the previous sweep's
    /// [`SweepStats::queues_walked_to`]).
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    pub async fn sweep_from(
        &self,
        limit: i64,
        queues_after: Option<crate::flow::QueuePair>,
    ) -> Result<SweepStats> {
        self.call_ending(ops::Sweep {
            limit,
            queues_after,
        })
        .await
    }

    /// Parks every claim queue of `tenant`'s class `operation`
    /// ([`ops::TamperQueues`]), waiting tasks or not. For the conformance
    /// suite.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    #[cfg(feature = "conformance")]
    pub async fn park_queues(&self, tenant: &str, operation: &str) -> Result<usize> {
        self.call(ops::TamperQueues {
            tenant: tenant.to_owned(),
            operation: operation.to_owned(),
            how: crate::flow::QueueTamper::Park,
        })
        .await
    }

    /// Deletes every claim queue of `tenant`'s class `operation`
    /// ([`ops::TamperQueues`]): the state a binary of a schema before the
    /// claim queues leaves its tasks in. For the conformance suite.
    ///
    /// # Errors
    /// Storage failures ([`StoreError`]).
    #[cfg(feature = "conformance")]
    pub async fn forget_queues(&self, tenant: &str, operation: &str) -> Result<usize> {
        self.call(ops::TamperQueues {
            tenant: tenant.to_owned(),
            operation: operation.to_owned(),
            how: crate::flow::QueueTamper::Forget,
        })
        .await
    }
}
