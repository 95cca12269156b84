//! Every operation of idem, written once over [`Tx`].
//!
//! Each operation is one transaction: load the rows (the task with a row
//! lock), apply one pure transition of [`idem_core::machine`], and write back
//! the task with a compare-and-set on `(version, generation)`, the attempt, the
//! new evidence and the new events. A refusal that must leave evidence (a
//! stale report) is committed and returned inside the output.

use idem_core::config::Contract;
use idem_core::fingerprint::canonical_request;
use idem_core::machine::{self, Authority, HeartbeatAck, Journal, NewTask, Rejection, Report};
use idem_core::model::{ApiKey, Attempt, Cancellation, Event, Role, Task, Timestamp};
use serde_json::Value;
use uuid::Uuid;

use crate::{Refusal, Result, ScopeRow, Store, StoreError, Tx, generate_api_key, hash_api_key};

/// A submission that passed validation and fingerprinting (SPEC §4 `POST /v1/tasks`).
#[derive(Debug, Clone)]
pub struct Submission {
    /// Tenant of the authenticated key.
    pub tenant: String,
    /// Operation class (known to the configuration).
    pub operation: String,
    /// Parsed idempotency key.
    pub idempotency_key: String,
    /// `sha256:<hex>` of the canonical request.
    pub fingerprint: String,
    /// RFC 8785 canonical request.
    pub canonical_request: String,
    /// Params as submitted.
    pub params: Value,
    /// Contract to freeze if the task is new.
    pub contract: Contract,
    /// Submitting key.
    pub api_key_id: Uuid,
    /// The key's operation list at acceptance (`None` = all).
    pub grant: Option<Vec<String>>,
}

/// What a submission did (SPEC §2.1–2.3).
#[derive(Debug, Clone, PartialEq)]
pub enum SubmitOutcome {
    /// A new task was accepted.
    Created(Task),
    /// Same scope and fingerprint: the original task.
    Replayed(Task),
    /// Same scope, different fingerprint: nothing changed.
    Conflict {
        /// The original task.
        task_id: Uuid,
    },
    /// The submitting API key was revoked (or is gone) when the transaction
    /// checked it: nothing changed, and no replay or conflict was revealed
    /// (SPEC §4 Auth, `UNAUTHENTICATED`).
    KeyRevoked {
        /// The refused key.
        api_key_id: Uuid,
    },
}

/// A claim request (SPEC §4 `POST /v1/attempts/claim`).
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// Tenant of the executor key.
    pub tenant: String,
    /// Operation classes to claim from (already limited to the key's grant).
    pub operations: Vec<String>,
    /// Executor id, recorded on the attempt.
    pub executor_id: String,
    /// Attempts at most.
    pub max: i64,
    /// Lease length; `None` = the class default.
    pub lease_ms: Option<i64>,
}

/// A leased attempt with its task.
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    /// The new attempt.
    pub attempt: Attempt,
    /// Its task after the claim.
    pub task: Task,
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Leases expired.
    pub expired: usize,
    /// `retry_wait` tasks woken.
    pub woken: usize,
    /// Idempotency keys removed after retention.
    pub keys_released: usize,
}

/// One operation; each runs as one transaction.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Op {
    /// Create an API key (the plain key is returned once).
    CreateApiKey {
        /// Tenant.
        tenant: String,
        /// Role.
        role: Role,
        /// Operation limit (`None` = all classes).
        operations: Option<Vec<String>>,
    },
    /// Revoke an API key.
    RevokeApiKey {
        /// Key id.
        id: Uuid,
    },
    /// List API keys.
    ListApiKeys,
    /// Find an active or revoked key by its plain value.
    Authenticate {
        /// The bearer token.
        plain: String,
    },
    /// Submit a task.
    Submit(Submission),
    /// Submit several tasks in one transaction (a backend's group commit); the
    /// outcomes are those of submitting each in order.
    SubmitBatch(Vec<Submission>),
    /// Read a task (`tenant: None` = any tenant, for the operator CLI).
    GetTask {
        /// Tenant filter.
        tenant: Option<String>,
        /// Task id.
        id: Uuid,
    },
    /// Look a task up by scope.
    FindTask {
        /// Tenant.
        tenant: String,
        /// Operation class.
        operation: String,
        /// Idempotency key.
        idempotency_key: String,
    },
    /// Attempts of a task with evidence.
    ListAttempts {
        /// Tenant filter.
        tenant: Option<String>,
        /// Task id.
        task_id: Uuid,
    },
    /// Event history of a task.
    ListEvents {
        /// Tenant filter.
        tenant: Option<String>,
        /// Task id.
        task_id: Uuid,
    },
    /// Lease attempts.
    Claim(ClaimRequest),
    /// Extend a lease.
    Heartbeat {
        /// Tenant.
        tenant: String,
        /// Attempt.
        attempt_id: Uuid,
        /// Generation held.
        generation: i64,
        /// Attempt usage so far.
        usage: Option<i64>,
    },
    /// Device "command acknowledged".
    Acknowledge {
        /// Tenant.
        tenant: String,
        /// Attempt.
        attempt_id: Uuid,
        /// Generation held.
        generation: i64,
        /// Raw body (evidence).
        body: Value,
    },
    /// Report an outcome.
    Report {
        /// Tenant.
        tenant: String,
        /// Attempt.
        attempt_id: Uuid,
        /// The report.
        report: Report,
    },
    /// Request cancellation.
    Cancel {
        /// Tenant.
        tenant: String,
        /// Task.
        task_id: Uuid,
    },
    /// Acknowledge delivery.
    AcknowledgeDelivery {
        /// Tenant.
        tenant: String,
        /// Task.
        task_id: Uuid,
    },
    /// Expire leases, wake backoffs, remove keys past retention (at most `limit` each).
    Sweep {
        /// Batch size per kind.
        limit: i64,
    },
    /// `op` on behalf of a key limited to `operations`: tasks and attempts of other
    /// operation classes are [`Refusal::NotFound`] (SPEC §4: a key's grant).
    Granted {
        /// The classes the key may touch.
        operations: Vec<String>,
        /// The operation.
        op: Box<Op>,
    },
}

impl Op {
    /// Whether the operation may write (SQLite sends these to its one writer).
    pub fn writes(&self) -> bool {
        if let Op::Granted { op, .. } = self {
            return op.writes();
        }
        !matches!(
            self,
            Op::ListApiKeys
                | Op::Authenticate { .. }
                | Op::GetTask { .. }
                | Op::FindTask { .. }
                | Op::ListAttempts { .. }
                | Op::ListEvents { .. }
        )
    }
}

/// The answer of an [`Op`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Output {
    /// `CreateApiKey`.
    NewApiKey {
        /// Stored record.
        key: ApiKey,
        /// The plain key (shown once, never stored).
        plain: String,
    },
    /// `RevokeApiKey`, `Authenticate`.
    ApiKey(Option<ApiKey>),
    /// `ListApiKeys`.
    ApiKeys(Vec<ApiKey>),
    /// `Submit`.
    Submitted(SubmitOutcome),
    /// `SubmitBatch`, in request order.
    SubmittedBatch(Vec<SubmitOutcome>),
    /// `GetTask`, `FindTask`, `Report`, `AcknowledgeDelivery`, `Acknowledge`.
    Task(Result<Task, Refusal>),
    /// `ListAttempts`.
    Attempts(Result<Vec<Attempt>, Refusal>),
    /// `ListEvents`.
    Events(Result<Vec<Event>, Refusal>),
    /// `Claim`.
    Claimed(Vec<Claimed>),
    /// `Heartbeat`.
    Heartbeat(Result<HeartbeatAck, Refusal>),
    /// `Cancel`.
    Cancelled(Result<(Task, Cancellation), Refusal>),
    /// `Sweep`.
    Swept(SweepStats),
}

/// Runs `op` inside the open transaction `tx`.
///
/// # Errors
/// Storage failures; the backend rolls back.
pub async fn run<T: Tx>(tx: &mut T, op: &Op) -> Result<Output> {
    match op {
        Op::Granted { operations, op } => run_granted(tx, op, Some(operations)).await,
        op => run_granted(tx, op, None).await,
    }
}

async fn run_granted<T: Tx>(tx: &mut T, op: &Op, grant: Option<&[String]>) -> Result<Output> {
    let scope = |tenant: Option<&str>| Access {
        tenant: tenant.map(str::to_owned),
        grant,
    };
    Ok(match op {
        Op::Granted { .. } => return Err(StoreError::Corrupt("nested Op::Granted".into())),
        Op::CreateApiKey {
            tenant,
            role,
            operations,
        } => {
            let now = tx.now().await?;
            let plain = generate_api_key();
            let key = ApiKey {
                id: Uuid::now_v7(),
                tenant: tenant.clone(),
                role: *role,
                operations: operations.clone(),
                created_at: now,
                revoked_at: None,
            };
            tx.insert_api_key(&key, &hash_api_key(&plain)).await?;
            Output::NewApiKey { key, plain }
        }
        Op::RevokeApiKey { id } => {
            let now = tx.now().await?;
            Output::ApiKey(tx.revoke_api_key(*id, now).await?)
        }
        Op::ListApiKeys => Output::ApiKeys(tx.list_api_keys().await?),
        Op::Authenticate { plain } => {
            Output::ApiKey(tx.api_key_by_hash(&hash_api_key(plain)).await?)
        }
        Op::Submit(s) => {
            let mut outcomes = submit_batch(tx, std::slice::from_ref(s)).await?;
            match outcomes.pop() {
                Some(o) => Output::Submitted(o),
                None => return Err(StoreError::Corrupt("submit produced no outcome".into())),
            }
        }
        Op::SubmitBatch(subs) => Output::SubmittedBatch(submit_batch(tx, subs).await?),
        Op::GetTask { tenant, id } => {
            Output::Task(owned_task(tx, *id, &scope(tenant.as_deref()), false).await?)
        }
        Op::FindTask {
            tenant,
            operation,
            idempotency_key,
        } => {
            let task = match tx.scope(tenant, operation, idempotency_key).await? {
                Some(row) => owned_task(tx, row.task_id, &scope(Some(tenant)), false).await?,
                None => Err(Refusal::NotFound),
            };
            Output::Task(task)
        }
        Op::ListAttempts { tenant, task_id } => Output::Attempts(
            match owned_task(tx, *task_id, &scope(tenant.as_deref()), false).await? {
                Ok(_) => Ok(tx.attempts(*task_id).await?),
                Err(e) => Err(e),
            },
        ),
        Op::ListEvents { tenant, task_id } => Output::Events(
            match owned_task(tx, *task_id, &scope(tenant.as_deref()), false).await? {
                Ok(_) => Ok(tx.events(*task_id).await?),
                Err(e) => Err(e),
            },
        ),
        Op::Claim(req) => Output::Claimed(claim(tx, req).await?),
        Op::Heartbeat {
            tenant,
            attempt_id,
            generation,
            usage,
        } => Output::Heartbeat(
            on_attempt(
                tx,
                &scope(Some(tenant)),
                *attempt_id,
                |task, attempt, j, now| {
                    machine::heartbeat(task, attempt, j, *generation, *usage, now)
                },
            )
            .await?
            .map(|(_, ack)| ack),
        ),
        Op::Acknowledge {
            tenant,
            attempt_id,
            generation,
            body,
        } => Output::Task(
            on_attempt(
                tx,
                &scope(Some(tenant)),
                *attempt_id,
                |task, attempt, j, now| {
                    machine::acknowledge(task, attempt, j, *generation, body.clone(), now)
                },
            )
            .await?
            .map(|(task, ())| task),
        ),
        Op::Report {
            tenant,
            attempt_id,
            report,
        } => Output::Task(
            on_attempt(
                tx,
                &scope(Some(tenant)),
                *attempt_id,
                |task, attempt, j, now| machine::report(task, attempt, j, report, now),
            )
            .await?
            .map(|(task, ())| task),
        ),
        Op::Cancel { tenant, task_id } => Output::Cancelled(
            on_task(tx, &scope(Some(tenant)), *task_id, |task, j, now| {
                Ok(machine::cancel(task, j, now))
            })
            .await?,
        ),
        Op::AcknowledgeDelivery { tenant, task_id } => Output::Task(
            on_task(tx, &scope(Some(tenant)), *task_id, |task, j, now| {
                machine::acknowledge_delivery(task, j, now)
            })
            .await?
            .map(|(task, ())| task),
        ),
        Op::Sweep { limit } => Output::Swept(sweep(tx, *limit).await?),
    })
}

/// Who may see a task: its tenant (`None` = any, for the operator CLI) and,
/// for a key limited to some operation classes, those classes.
struct Access<'a> {
    tenant: Option<String>,
    grant: Option<&'a [String]>,
}

impl Access<'_> {
    fn sees(&self, t: &Task) -> bool {
        self.tenant
            .as_deref()
            .is_none_or(|tn| tn == t.control.tenant)
            && self
                .grant
                .is_none_or(|ops| ops.iter().any(|o| o == &t.operation))
    }
}

async fn owned_task<T: Tx>(
    tx: &mut T,
    id: Uuid,
    access: &Access<'_>,
    lock: bool,
) -> Result<Result<Task, Refusal>> {
    Ok(match tx.task(id, lock).await? {
        Some(t) if access.sees(&t) => Ok(t),
        _ => Err(Refusal::NotFound),
    })
}

/// Writes the task (compare-and-set against what was loaded) and the journal.
async fn persist<T: Tx>(tx: &mut T, task: &Task, loaded: (i64, i64), j: &Journal) -> Result<()> {
    tx.update_task(task, loaded.0, loaded.1).await?;
    if !j.events.is_empty() {
        tx.insert_events(task.id, &j.events).await?;
    }
    for (attempt_id, ev) in &j.evidence {
        tx.insert_evidence(task.id, *attempt_id, ev).await?;
    }
    Ok(())
}

/// Submits `subs` in one transaction (SPEC §2.1–2.3): scope rows first, all at
/// once (`INSERT … ON CONFLICT DO NOTHING`); the winners become tasks with their
/// `task_submitted` events; every other submission reads the scope row in a new
/// statement and is a replay (same fingerprint) or a conflict. Two submissions
/// of one scope in the same batch behave as if sent one after the other.
///
/// The steps between the statements are the pure functions [`submitting_keys`],
/// [`scope_rows`], [`accept_winners`], [`taken_scopes`] and [`answer_batch`], so
/// a backend may send the same statements another way (PostgreSQL pipelines
/// them) and still answer exactly as this does.
///
/// Returns one outcome per submission, in request order.
///
/// # Errors
/// Any [`StoreError`] of the statements; [`StoreError::Contention`] when a
/// taken scope row vanished before it was read (retry the batch).
pub async fn submit_batch<T: Tx>(tx: &mut T, subs: &[Submission]) -> Result<Vec<SubmitOutcome>> {
    // The submitting keys are checked here, in the transaction that writes: a
    // key revoked before this check is refused even when the HTTP layer had it
    // cached, and its submissions touch nothing.
    let ids = submitting_keys(subs);
    let (now, live) = tx.now_and_live_api_keys(&ids).await?;
    if live.len() < ids.len() {
        let (ok, refused): (Vec<_>, Vec<_>) = subs
            .iter()
            .enumerate()
            .partition(|(_, s)| live.contains(&s.api_key_id));
        let kept: Vec<Submission> = ok.iter().map(|(_, s)| (*s).clone()).collect();
        let mut done = submit_live(tx, &kept, now).await?.into_iter();
        let mut outcomes: Vec<Option<SubmitOutcome>> = vec![None; subs.len()];
        for (i, s) in refused {
            outcomes[i] = Some(SubmitOutcome::KeyRevoked {
                api_key_id: s.api_key_id,
            });
        }
        for (i, _) in ok {
            outcomes[i] = done.next();
        }
        return outcomes
            .into_iter()
            .map(|o| o.ok_or_else(|| StoreError::Corrupt("batch lost an outcome".into())))
            .collect();
    }
    submit_live(tx, subs, now).await
}

/// The distinct API keys that submit `subs`, sorted (the argument of
/// [`Tx::now_and_live_api_keys`]).
pub fn submitting_keys(subs: &[Submission]) -> Vec<Uuid> {
    let mut ids: Vec<Uuid> = subs.iter().map(|s| s.api_key_id).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// One scope row per submission, in request order, each naming a fresh task id
/// (UUID v7) that becomes the task's id if this row wins the unique constraint.
pub fn scope_rows(subs: &[Submission]) -> Vec<ScopeRow> {
    subs.iter()
        .map(|s| ScopeRow {
            tenant: s.tenant.clone(),
            operation: s.operation.clone(),
            idempotency_key: s.idempotency_key.clone(),
            fingerprint: s.fingerprint.clone(),
            task_id: Uuid::now_v7(),
        })
        .collect()
}

/// The tasks (with their `task_submitted` events) of the submissions whose scope
/// row this transaction inserted (`won[i]`), accepted at `now` (database clock,
/// ms): only the unique constraint decides who gets a task.
pub fn accept_winners(
    subs: &[Submission],
    rows: &[ScopeRow],
    won: &[bool],
    now: Timestamp,
) -> (Vec<Task>, Vec<Vec<Event>>) {
    let mut created: Vec<Task> = Vec::new();
    let mut events: Vec<Vec<Event>> = Vec::new();
    for ((s, row), won) in subs.iter().zip(rows).zip(won) {
        if !won {
            continue;
        }
        let (task, j) = machine::accept(
            NewTask {
                id: row.task_id,
                tenant: s.tenant.clone(),
                operation: s.operation.clone(),
                idempotency_key: s.idempotency_key.clone(),
                fingerprint: s.fingerprint.clone(),
                canonical_request: s.canonical_request.clone(),
                params: s.params.clone(),
                contract: s.contract.clone(),
                api_key_id: s.api_key_id,
                grant: s.grant.clone(),
            },
            now,
        );
        created.push(task);
        events.push(j.events);
    }
    (created, events)
}

/// The scopes `(tenant, operation, idempotency key)` of the submissions that found
/// their scope taken, in request order: read them in a new statement (READ
/// COMMITTED gives it a fresh snapshot; RUST-NOTES §4.3).
pub fn taken_scopes(subs: &[Submission], won: &[bool]) -> Vec<(String, String, String)> {
    subs.iter()
        .zip(won)
        .filter(|(_, won)| !**won)
        .map(|(s, _)| {
            (
                s.tenant.clone(),
                s.operation.clone(),
                s.idempotency_key.clone(),
            )
        })
        .collect()
}

/// Answers every submission in request order: `created` (in order) for the
/// winners, and for the others the scope read back (`existing`, one per
/// [`taken_scopes`] entry): a replay when the fingerprint matches, else a
/// conflict. `None` for a submission whose scope row was gone when it was read
/// (released by retention in between): that one must be submitted again.
///
/// # Errors
/// [`StoreError::Corrupt`] when a scope row points at a missing task or the
/// inputs do not line up.
pub fn answer_batch(
    subs: &[Submission],
    won: &[bool],
    created: Vec<Task>,
    existing: Vec<crate::ExistingScope>,
) -> Result<Vec<Option<SubmitOutcome>>> {
    let mut existing = existing.into_iter();
    let mut fresh = created.into_iter();
    let mut outcomes = Vec::with_capacity(subs.len());
    for (s, won) in subs.iter().zip(won) {
        let outcome = if *won {
            Some(SubmitOutcome::Created(fresh.next().ok_or_else(|| {
                StoreError::Corrupt("batch lost a created task".into())
            })?))
        } else {
            match existing.next().flatten() {
                None => None,
                Some((row, task)) if row.fingerprint != s.fingerprint => match task {
                    // Fingerprinted under material fields the configuration
                    // changed since the task was accepted, the same request
                    // is still the same request: the original task (IDEM-01).
                    Some(task) if same_request_as_accepted(&task, s) => {
                        Some(SubmitOutcome::Replayed(task))
                    }
                    _ => Some(SubmitOutcome::Conflict {
                        task_id: row.task_id,
                    }),
                },
                Some((_, Some(task))) => Some(SubmitOutcome::Replayed(task)),
                Some((row, None)) => {
                    return Err(StoreError::Corrupt(format!(
                        "scope row points at missing task {}",
                        row.task_id
                    )));
                }
            }
        };
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// Whether `s`, whose fingerprint differs from `task`'s (the one its scope
/// was bound with), is nevertheless the request the task was accepted with: the
/// same operation, and the same fingerprint when computed under the material
/// fields frozen in the task's contract (RFC 8785, so `1250`, `1250.0` and
/// `1.25e3` are one number). A task accepted before the fields were frozen is
/// compared by its whole canonical params instead. Only reached when the
/// fingerprints differ, which under an unchanged configuration means the
/// requests differ; so this never turns a different request into a replay.
fn same_request_as_accepted(task: &Task, s: &Submission) -> bool {
    if task.operation != s.operation {
        return false;
    }
    match &task.contract.fingerprint {
        Some(material) => canonical_request(&s.operation, &s.params, material)
            .is_ok_and(|c| c.fingerprint.to_string() == task.fingerprint),
        None => match (
            canonical_request(&s.operation, &s.params, &[]),
            canonical_request(&task.operation, &task.params, &[]),
        ) {
            (Ok(a), Ok(b)) => a.canonical == b.canonical,
            _ => false,
        },
    }
}

/// Answers retries without writing: for each submission, in order, `Some`
/// replay or conflict when its API key is live and its scope row is bound
/// (exactly as [`submit_batch`] answers a taken scope, through
/// [`answer_batch`]), `None` when its key is revoked or its scope is not bound
/// (never, or released by retention): those must go through [`submit_batch`],
/// which refuses the key or creates the task. Reads only; a backend runs it
/// in one read transaction for a batch of submits whose scopes it has seen
/// bound ([`crate::ScopeHints`]).
///
/// # Errors
/// Any [`StoreError`] of the reads; [`StoreError::Corrupt`] when a scope row
/// names a missing task.
pub async fn answer_retries<T: Tx>(
    tx: &mut T,
    subs: &[Submission],
) -> Result<Vec<Option<SubmitOutcome>>> {
    let ids = submitting_keys(subs);
    let (_, live) = tx.now_and_live_api_keys(&ids).await?;
    if live.len() == ids.len() {
        let not_won = vec![false; subs.len()];
        let existing = tx.scopes_with_tasks(&taken_scopes(subs, &not_won)).await?;
        return answer_batch(subs, &not_won, Vec::new(), existing);
    }
    // A key was revoked (rare): answer the live keys' submissions only.
    let asked: Vec<usize> = (0..subs.len())
        .filter(|&i| live.contains(&subs[i].api_key_id))
        .collect();
    let asked_subs: Vec<Submission> = asked.iter().map(|&i| subs[i].clone()).collect();
    let not_won = vec![false; asked_subs.len()];
    let existing = tx
        .scopes_with_tasks(&taken_scopes(&asked_subs, &not_won))
        .await?;
    let answers = answer_batch(&asked_subs, &not_won, Vec::new(), existing)?;
    let mut out: Vec<Option<SubmitOutcome>> = vec![None; subs.len()];
    for (i, answer) in asked.into_iter().zip(answers) {
        out[i] = answer;
    }
    Ok(out)
}

/// [`submit_batch`] once every submitting key has been checked live.
async fn submit_live<T: Tx>(
    tx: &mut T,
    subs: &[Submission],
    now: Timestamp,
) -> Result<Vec<SubmitOutcome>> {
    if subs.is_empty() {
        return Ok(Vec::new());
    }
    let rows = scope_rows(subs);
    let won = tx.insert_scopes(&rows).await?;
    // Tasks and events only for the scope rows this transaction inserted (the
    // unique constraint decided); the others are answered from what is stored.
    let (created, events) = accept_winners(subs, &rows, &won, now);
    tx.insert_tasks_with_events(&created, &events).await?;
    let existing = tx.scopes_with_tasks(&taken_scopes(subs, &won)).await?;
    answer_batch(subs, &won, created, existing)?
        .into_iter()
        .map(|o| o.ok_or_else(|| StoreError::Contention("scope row vanished; retry".into())))
        .collect()
}

async fn claim<T: Tx>(tx: &mut T, req: &ClaimRequest) -> Result<Vec<Claimed>> {
    let now = tx.now().await?;
    let max = req.max.max(1);
    let mut out = Vec::new();
    // Candidates that end instead of being leased (deadline passed, key revoked,
    // attempts used up) leave the claimable set, so scan again until `max` are
    // leased or nothing is left; bounded so one claim stays short. Each round
    // that ended candidates reads twice as many (up to CLAIM_SCAN_MAX), so a
    // backlog of dead tasks is cleared in one claim instead of starving the
    // due tasks behind it, while a claim that finds work at once still reads
    // (and, on PostgreSQL, locks) only 2 × max candidates.
    let mut limit = max.saturating_mul(2);
    for _ in 0..8 {
        let ids = tx
            .claimable(&req.tenant, &req.operations, now, limit)
            .await?;
        if ids.is_empty() {
            break;
        }
        let mut ended = 0;
        for id in ids {
            if out.len() as i64 >= max {
                return Ok(out);
            }
            let Some(mut task) = tx.task(id, true).await? else {
                continue;
            };
            let loaded = (task.control.version, task.generation);
            let authority = match tx.api_key(task.control.api_key_id).await? {
                Some(k) if k.grants(&task.operation) => Authority::Granted,
                _ => Authority::Revoked,
            };
            let mut j = Journal::default();
            let attempt_id = Uuid::now_v7();
            match machine::claim(
                &mut task,
                &mut j,
                attempt_id,
                &req.executor_id,
                req.lease_ms,
                authority,
                now,
            ) {
                Ok(Some(attempt)) => {
                    tx.insert_attempt(&attempt).await?;
                    persist(tx, &task, loaded, &j).await?;
                    out.push(Claimed { attempt, task });
                }
                Ok(None) => {
                    persist(tx, &task, loaded, &j).await?;
                    ended += 1;
                }
                Err(_) => {}
            }
        }
        if out.len() as i64 >= max || ended == 0 {
            break;
        }
        limit = limit.saturating_mul(2).min(CLAIM_SCAN_MAX.max(max));
    }
    Ok(out)
}

/// Most candidates one round of a claim reads once earlier rounds found
/// candidates that ended instead (8 rounds: up to about 250 ended per claim).
const CLAIM_SCAN_MAX: i64 = 64;

/// Loads attempt and task (task locked first, then the attempt reloaded), checks
/// the tenant, applies `f`, and persists everything unless `f` refused the input
/// as invalid (which changes nothing).
async fn on_attempt<T: Tx, R>(
    tx: &mut T,
    access: &Access<'_>,
    attempt_id: Uuid,
    f: impl FnOnce(&mut Task, &mut Attempt, &mut Journal, Timestamp) -> Result<R, Rejection>,
) -> Result<Result<(Task, R), Refusal>> {
    let Some(a) = tx.attempt(attempt_id).await? else {
        return Ok(Err(Refusal::NotFound));
    };
    let mut task = match owned_task(tx, a.task_id, access, true).await? {
        Ok(t) => t,
        Err(e) => return Ok(Err(e)),
    };
    let Some(mut attempt) = tx.attempt(attempt_id).await? else {
        return Ok(Err(Refusal::NotFound));
    };
    let now = tx.now().await?;
    let loaded = (task.control.version, task.generation);
    let before = attempt.clone();
    let mut j = Journal::default();
    let res = f(&mut task, &mut attempt, &mut j, now);
    if let Err(Rejection::InvalidReport(_)) = res {
        return Ok(res.map(|r| (task, r)).map_err(Refusal::from));
    }
    if attempt != before {
        tx.update_attempt(&attempt).await?;
    }
    persist(tx, &task, loaded, &j).await?;
    Ok(res.map(|r| (task, r)).map_err(Refusal::from))
}

async fn on_task<T: Tx, R>(
    tx: &mut T,
    access: &Access<'_>,
    task_id: Uuid,
    f: impl FnOnce(&mut Task, &mut Journal, Timestamp) -> Result<R, Rejection>,
) -> Result<Result<(Task, R), Refusal>> {
    let mut task = match owned_task(tx, task_id, access, true).await? {
        Ok(t) => t,
        Err(e) => return Ok(Err(e)),
    };
    let now = tx.now().await?;
    let loaded = (task.control.version, task.generation);
    let mut j = Journal::default();
    let res = f(&mut task, &mut j, now);
    if !j.events.is_empty() {
        persist(tx, &task, loaded, &j).await?;
    }
    Ok(res.map(|r| (task, r)).map_err(Refusal::from))
}

async fn sweep<T: Tx>(tx: &mut T, limit: i64) -> Result<SweepStats> {
    let now = tx.now().await?;
    let mut stats = SweepStats::default();
    for (task_id, attempt_id) in tx.expired_leases(now, limit).await? {
        let (Some(mut task), Some(mut attempt)) =
            (tx.task(task_id, true).await?, tx.attempt(attempt_id).await?)
        else {
            continue;
        };
        if !attempt.state.is_active() || attempt.lease_expires_at > now {
            continue;
        }
        let loaded = (task.control.version, task.generation);
        let mut j = Journal::default();
        machine::expire_lease(&mut task, &mut attempt, &mut j, now);
        tx.update_attempt(&attempt).await?;
        persist(tx, &task, loaded, &j).await?;
        stats.expired += 1;
    }
    for task_id in tx.due_wakeups(now, limit).await? {
        let Some(mut task) = tx.task(task_id, true).await? else {
            continue;
        };
        let loaded = (task.control.version, task.generation);
        let mut j = Journal::default();
        if machine::wake(&mut task, &mut j, now) {
            persist(tx, &task, loaded, &j).await?;
            stats.woken += 1;
        }
    }
    for task_id in tx.expired_scopes(now, limit).await? {
        let Some(mut task) = tx.task(task_id, true).await? else {
            continue;
        };
        if !task.state.is_terminal() || task.control.key_expires_at.is_none_or(|t| t > now) {
            continue;
        }
        let loaded = (task.control.version, task.generation);
        let mut j = Journal::default();
        tx.delete_scope(task_id).await?;
        machine::release_key(&mut task, &mut j, now);
        persist(tx, &task, loaded, &j).await?;
        stats.keys_released += 1;
    }
    Ok(stats)
}

fn mismatch(o: &Output) -> StoreError {
    StoreError::Corrupt(format!(
        "backend answered with the wrong output kind: {o:?}"
    ))
}

macro_rules! typed {
    ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $out:ty { $op:expr } $pat:pat => $val:expr) => {
        $(#[$m])*
        ///
        /// # Errors
        /// Storage failures ([`StoreError`]); business refusals are in the value.
        pub async fn $name(&self, $($arg: $ty),*) -> Result<$out> {
            match self.execute($op).await? {
                $pat => Ok($val),
                other => Err(mismatch(&other)),
            }
        }
    };
}

impl Store {
    /// This store acting for a key limited to `operations` (`None`: all classes):
    /// every task read or change of another class answers [`Refusal::NotFound`].
    pub fn granted(&self, operations: Option<Vec<String>>) -> Store {
        let mut s = self.clone();
        s.grant = operations.map(std::sync::Arc::new);
        s
    }

    typed!(/// Creates an API key; returns the record and the plain key.
        fn create_api_key(tenant: &str, role: Role, operations: Option<Vec<String>>) -> (ApiKey, String) {
            Op::CreateApiKey { tenant: tenant.to_owned(), role, operations }
        } Output::NewApiKey { key, plain } => (key, plain));
    typed!(/// Revokes an API key; `None` when no such key.
        fn revoke_api_key(id: Uuid) -> Option<ApiKey> { Op::RevokeApiKey { id } } Output::ApiKey(k) => k);
    typed!(/// Lists API keys.
        fn list_api_keys() -> Vec<ApiKey> { Op::ListApiKeys } Output::ApiKeys(k) => k);
    typed!(/// Finds the key a bearer token names (revoked keys included; check `revoked_at`).
        fn authenticate(plain: &str) -> Option<ApiKey> { Op::Authenticate { plain: plain.to_owned() } } Output::ApiKey(k) => k);
    typed!(/// Submits a task (SPEC §2.1–2.3).
        fn submit(s: Submission) -> SubmitOutcome { Op::Submit(s) } Output::Submitted(o) => o);
    typed!(/// Reads a task of `tenant` (`None`: any tenant).
        fn get_task(tenant: Option<&str>, id: Uuid) -> Result<Task, Refusal> {
            Op::GetTask { tenant: tenant.map(str::to_owned), id }
        } Output::Task(t) => t);
    typed!(/// Looks a task up by scope.
        fn find_task(tenant: &str, operation: &str, idempotency_key: &str) -> Result<Task, Refusal> {
            Op::FindTask { tenant: tenant.to_owned(), operation: operation.to_owned(), idempotency_key: idempotency_key.to_owned() }
        } Output::Task(t) => t);
    typed!(/// Attempts of a task, with evidence.
        fn list_attempts(tenant: Option<&str>, task_id: Uuid) -> Result<Vec<Attempt>, Refusal> {
            Op::ListAttempts { tenant: tenant.map(str::to_owned), task_id }
        } Output::Attempts(a) => a);
    typed!(/// Event history of a task.
        fn list_events(tenant: Option<&str>, task_id: Uuid) -> Result<Vec<Event>, Refusal> {
            Op::ListEvents { tenant: tenant.map(str::to_owned), task_id }
        } Output::Events(e) => e);
    typed!(/// Leases up to `req.max` attempts.
        fn claim(req: ClaimRequest) -> Vec<Claimed> { Op::Claim(req) } Output::Claimed(c) => c);
    typed!(/// Extends a lease.
        fn heartbeat(tenant: &str, attempt_id: Uuid, generation: i64, usage: Option<i64>) -> Result<HeartbeatAck, Refusal> {
            Op::Heartbeat { tenant: tenant.to_owned(), attempt_id, generation, usage }
        } Output::Heartbeat(h) => h);
    typed!(/// Device acknowledgment of a command.
        fn acknowledge(tenant: &str, attempt_id: Uuid, generation: i64, body: Value) -> Result<Task, Refusal> {
            Op::Acknowledge { tenant: tenant.to_owned(), attempt_id, generation, body }
        } Output::Task(t) => t);
    typed!(/// Applies a report.
        fn report(tenant: &str, attempt_id: Uuid, report: Report) -> Result<Task, Refusal> {
            Op::Report { tenant: tenant.to_owned(), attempt_id, report }
        } Output::Task(t) => t);
    typed!(/// Requests cancellation.
        fn cancel(tenant: &str, task_id: Uuid) -> Result<(Task, Cancellation), Refusal> {
            Op::Cancel { tenant: tenant.to_owned(), task_id }
        } Output::Cancelled(c) => c);
    typed!(/// Acknowledges delivery.
        fn acknowledge_delivery(tenant: &str, task_id: Uuid) -> Result<Task, Refusal> {
            Op::AcknowledgeDelivery { tenant: tenant.to_owned(), task_id }
        } Output::Task(t) => t);
    typed!(/// One sweep: expire leases, wake backoffs, remove keys past retention.
        fn sweep(limit: i64) -> SweepStats { Op::Sweep { limit } } Output::Swept(s) => s);
}
