//! Clients and executors: each planned operation's submits, replays and
//! cancel, and the executors that claim attempts and act out their planned
//! faults (crash, `unknown`, late or repeated reports) at the provider.

use super::*;

#[derive(Default)]
pub(super) struct RunLog {
    pub(super) submits: Vec<SubmitRecord>,
    pub(super) cancels: Vec<CancelRecord>,
    pub(super) suspects: Vec<SuspectReport>,
    pub(super) accepted_usage: HashMap<Uuid, i64>,
    pub(super) realized: BTreeMap<String, u64>,
    pub(super) unexpected: BTreeMap<String, u64>,
    pub(super) network: Vec<NetEpisodeRun>,
    /// When each 5xx answer came (`--failover-…`).
    pub(super) errors_5xx: Vec<Instant>,
    /// Attempts whose report was answered 200, and when.
    pub(super) accepted_reports: Vec<(Uuid, Instant)>,
    /// When the failover's steps happened.
    pub(super) failover: Option<FailoverTimes>,
    /// Transaction ids executors named in reports: true once a report naming
    /// it was answered (idem kept it as evidence), false while none was.
    pub(super) effect_reports: HashMap<String, bool>,
}

/// `faults_realized` key: a submit answered with a retryable error (timeout,
/// 5xx, transport) and sent again.
pub(super) const CLIENT_RETRY: &str = "client_retry_after_error";

/// `faults_realized` key: a claim, heartbeat or report answered with a
/// retryable error.
pub(super) const EXECUTOR_RETRY: &str = "executor_retry_after_error";

/// `faults_realized` key: a claim answered so late that the executor no
/// longer acts on it (its lease would run out in flight).
pub(super) const TOO_SLOW_TO_ACT: &str = "executor_too_slow_to_act";

/// `faults_realized` key: a report or heartbeat refused with 409
/// `STALE_GENERATION` (its attempt's lease had run out).
pub(super) const STALE_REFUSAL: &str = "stale_generation_refused";

pub(super) struct Ctx {
    pub(super) plan: Arc<Plan>,
    pub(super) targets: Targets,
    pub(super) provider: Provider,
    pub(super) log: Mutex<RunLog>,
    pub(super) stop: AtomicBool,
    pub(super) inflight: AtomicUsize,
    pub(super) ordinals: Mutex<HashMap<Uuid, [usize; 2]>>,
    /// Client operations dispatched so far (network episodes start by it).
    pub(super) dispatched: AtomicUsize,
    /// Network episodes started so far; `usize::MAX` once their runner ended.
    pub(super) episodes_started: AtomicUsize,
}

/// What became of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Accepted,
    Stale,
    AlreadyReported,
    Refused,
    NoAnswer,
}

struct InflightGuard(Arc<Ctx>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Ctx {
    pub(super) fn log(&self) -> MutexGuard<'_, RunLog> {
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn realized(&self, kind: &str, n: u64) {
        *self.log().realized.entry(kind.to_owned()).or_default() += n;
    }

    pub(super) fn realized_count(&self, kind: &str) -> u64 {
        self.log().realized.get(kind).copied().unwrap_or(0)
    }

    /// Notes when a 5xx answer came.
    fn answered(&self, e: &ClientError) {
        if e.status().is_some_and(|s| s >= 500) {
            self.log().errors_5xx.push(Instant::now());
        }
    }

    fn unexpected(&self, what: &str, e: &ClientError) {
        let key = format!(
            "{what}: {} {}",
            e.status()
                .map_or_else(|| "transport".into(), |s| s.to_string()),
            e.code().unwrap_or("")
        );
        *self.log().unexpected.entry(key).or_default() += 1;
    }

    fn next_ordinal(&self, task_id: Uuid, kind: AttemptKind) -> usize {
        let mut m = self
            .ordinals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = m.entry(task_id).or_default();
        let i = usize::from(kind == AttemptKind::Reconcile);
        let n = e[i];
        e[i] += 1;
        n
    }

    fn accepted(class: Class, task: &Task, replayed: bool, looked_up: bool) -> SubmitAnswer {
        SubmitAnswer::Accepted {
            task_id: task.id,
            replayed,
            looked_up,
            material: class.material(&task.params),
            fingerprint: task.fingerprint.clone(),
            delivery: task.delivery.as_ref().map(|d| DeliverySeen {
                external_txn_id: d.external_txn_id.clone(),
                charge: d.charge,
                delivered_at: d.delivered_at.clone(),
            }),
        }
    }

    /// Submits with retries under the same key through outages; after the
    /// client's patience the scope is looked up.
    async fn submit(&self, class: Class, key: &str, params: &Value) -> SubmitAnswer {
        let deadline = Instant::now() + CLIENT_PATIENCE;
        let mut pause = Duration::from_millis(20);
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            let answer = ep.client.submit(class.operation(), params, key).await;
            if let Err(e) = &answer {
                self.answered(e);
            }
            match answer {
                Ok(s) => return Ctx::accepted(class, &s.task, s.replayed, false),
                Err(e) if e.code() == Some("IDEMPOTENCY_CONFLICT") => {
                    return SubmitAnswer::Conflict {
                        task_id: e.problem().and_then(|p| p.task_id),
                    };
                }
                Err(e) if e.is_retryable() => {
                    self.realized(CLIENT_RETRY, 1);
                    if Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(300));
                }
                Err(e) => {
                    self.unexpected("submit", &e);
                    return SubmitAnswer::Refused {
                        status: e.status().unwrap_or(0),
                        code: e.code().unwrap_or("").to_owned(),
                    };
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            let found = ep.client.find_task(class.operation(), key).await;
            if let Err(e) = &found {
                self.answered(e);
            }
            match found {
                Ok(t) => return Ctx::accepted(class, &t, true, true),
                Err(e) if e.status() == Some(404) => return SubmitAnswer::NoAnswer,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(_) => break,
            }
        }
        SubmitAnswer::NoAnswer
    }

    async fn cancel(&self, task_id: Uuid) -> Option<CancelStatus> {
        let deadline = Instant::now() + CLIENT_PATIENCE;
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            let answer = ep.client.cancel(task_id).await;
            if let Err(e) = &answer {
                self.answered(e);
            }
            match answer {
                Ok(r) => return Some(r.cancellation.status),
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    self.unexpected("cancel", &e);
                    return None;
                }
            }
        }
        None
    }

    /// Sends a report, retried through outages: one that names an effect
    /// (`external_txn_id`) until answered or [`EFFECT_REPORT_PATIENCE`], any
    /// other for [`REPORT_PATIENCE`].
    async fn report(&self, attempt_id: Uuid, body: &ReportBody) -> Sent {
        let sent = self.report_once(attempt_id, body).await;
        if let Some(txn) = &body.external_txn_id {
            let answered = matches!(sent, Sent::Accepted | Sent::Stale | Sent::AlreadyReported);
            let mut log = self.log();
            let e = log.effect_reports.entry(txn.clone()).or_default();
            *e = *e || answered;
        }
        sent
    }

    async fn report_once(&self, attempt_id: Uuid, body: &ReportBody) -> Sent {
        let patience = if body.external_txn_id.is_some() {
            EFFECT_REPORT_PATIENCE
        } else {
            REPORT_PATIENCE
        };
        let deadline = Instant::now() + patience;
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            let answer = ep.exec.report(attempt_id, body).await;
            if let Err(e) = &answer {
                self.answered(e);
            }
            match answer {
                Ok(_) => {
                    self.log()
                        .accepted_reports
                        .push((attempt_id, Instant::now()));
                    if let Some(u) = body.usage {
                        let mut log = self.log();
                        let e = log.accepted_usage.entry(attempt_id).or_default();
                        *e = (*e).max(u);
                    }
                    return Sent::Accepted;
                }
                Err(e) if e.code() == Some("STALE_GENERATION") => {
                    self.realized(STALE_REFUSAL, 1);
                    return Sent::Stale;
                }
                Err(e) if e.code() == Some("ATTEMPT_ALREADY_REPORTED") => {
                    return Sent::AlreadyReported;
                }
                Err(e) if e.is_retryable() => {
                    self.realized(EXECUTOR_RETRY, 1);
                    if Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                Err(e) => {
                    self.unexpected("report", &e);
                    return Sent::Refused;
                }
            }
        }
        Sent::NoAnswer
    }

    /// One heartbeat, retried through outages only while the effect may still be performed.
    async fn heartbeat(
        &self,
        attempt_id: Uuid,
        generation: i64,
        usage: i64,
        sent: Instant,
    ) -> Result<HeartbeatAck, Sent> {
        let deadline = sent + EFFECT_WITHIN;
        while let Some(ep) = self.targets.wait_pick(deadline).await {
            let answer = ep.exec.heartbeat(attempt_id, generation, Some(usage)).await;
            if let Err(e) = &answer {
                self.answered(e);
            }
            match answer {
                Ok(ack) => {
                    let mut log = self.log();
                    let e = log.accepted_usage.entry(attempt_id).or_default();
                    *e = (*e).max(usage);
                    return Ok(ack);
                }
                Err(e) if e.code() == Some("STALE_GENERATION") => {
                    self.realized(STALE_REFUSAL, 1);
                    return Err(Sent::Stale);
                }
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    self.realized(EXECUTOR_RETRY, 1);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    if !e.is_retryable() {
                        self.unexpected("heartbeat", &e);
                    }
                    return Err(Sent::NoAnswer);
                }
            }
        }
        Err(Sent::NoAnswer)
    }

    fn suspect(&self, ca: &ClaimedAttempt, kind: SuspectKind, sent: Sent) {
        if matches!(sent, Sent::NoAnswer | Sent::Refused) {
            return;
        }
        let accepted = sent == Sent::Accepted;
        self.realized(
            if accepted {
                "suspect_report_accepted"
            } else {
                "suspect_report_refused"
            },
            1,
        );
        self.log().suspects.push(SuspectReport {
            task_id: ca.task_id,
            attempt_id: ca.id,
            kind,
            accepted,
        });
    }
}

pub(super) async fn run_op(ctx: Arc<Ctx>, i: usize) {
    let op = ctx.plan.ops[i].clone();
    let key = op.key_string();
    let params = op.class.params(op.key, op.changed.unwrap_or(0), i);
    let material = op.class.material(&params);
    let record = |answer: SubmitAnswer| SubmitRecord {
        op: i,
        class: op.class,
        key: key.clone(),
        material: material.clone(),
        answer,
    };
    if let Some(ms) = op.first_timeout_ms
        && let Some(ep) = ctx.targets.pick()
    {
        let c = ep.client.with_timeout(Duration::from_millis(ms));
        match c.submit(op.class.operation(), &params, &key).await {
            Ok(s) => {
                let a = Ctx::accepted(op.class, &s.task, s.replayed, false);
                ctx.log().submits.push(record(a));
            }
            Err(e) if e.code() == Some("IDEMPOTENCY_CONFLICT") => {
                let a = SubmitAnswer::Conflict {
                    task_id: e.problem().and_then(|p| p.task_id),
                };
                ctx.log().submits.push(record(a));
            }
            Err(e) if e.is_timeout() => ctx.realized("client_timeout", 1),
            Err(_) => {}
        }
    }
    let answer = ctx.submit(op.class, &key, &params).await;
    let task_id = match &answer {
        SubmitAnswer::Accepted { task_id, .. } => Some(*task_id),
        _ => None,
    };
    ctx.log().submits.push(record(answer));
    if let (Some(ms), Some(id)) = (op.cancel_after_ms, task_id) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        if let Some(status) = ctx.cancel(id).await {
            ctx.realized(&format!("cancel_answered_{status}"), 1);
            ctx.log().cancels.push(CancelRecord {
                task_id: id,
                status,
            });
        }
    }
    for _ in 0..op.replays {
        tokio::time::sleep(Duration::from_millis(op.replay_delay_ms)).await;
        let a = ctx.submit(op.class, &key, &params).await;
        ctx.log().submits.push(record(a));
    }
}

pub(super) async fn executor_loop(ctx: Arc<Ctx>, n: usize) {
    let id = format!("chaos-exec-{n}");
    while !ctx.stop.load(Ordering::SeqCst) {
        if ctx.inflight.load(Ordering::SeqCst) >= MAX_INFLIGHT {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let Some(ep) = ctx.targets.pick() else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let sent = Instant::now();
        match ep.exec.claim(&id, &[], 8, Some(LEASE_MS), 100).await {
            Ok(list) => {
                let received = Instant::now();
                for ca in list {
                    ctx.inflight.fetch_add(1, Ordering::SeqCst);
                    let c = ctx.clone();
                    tokio::spawn(async move {
                        let _guard = InflightGuard(c.clone());
                        handle_attempt(&c, ca, sent, received).await;
                    });
                }
            }
            Err(e) => {
                ctx.answered(&e);
                if e.is_retryable() {
                    ctx.realized(EXECUTOR_RETRY, 1);
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
    }
}

async fn handle_attempt(ctx: &Ctx, ca: ClaimedAttempt, sent: Instant, received: Instant) {
    let Some(class) = Class::from_operation(&ca.operation) else {
        return;
    };
    let key: Option<u32> = ca
        .idempotency_key
        .strip_prefix('k')
        .and_then(|k| k.parse().ok());
    let script = key.and_then(|k| ctx.plan.scripts.get(&(class, k)));
    let ordinal = ctx.next_ordinal(ca.task_id, ca.kind);
    match ca.kind {
        AttemptKind::Execute => {
            let step = script
                .and_then(|s| s.exec.get(ordinal))
                .copied()
                .unwrap_or(ExecStep::CLEAN);
            execute(ctx, &ca, class, step, sent, received).await;
        }
        AttemptKind::Reconcile => {
            let fault = script
                .and_then(|s| s.recon.get(ordinal))
                .copied()
                .unwrap_or(ReconFault::Clean);
            reconcile(ctx, &ca, fault, received).await;
        }
        AttemptKind::Other => {}
    }
}

async fn execute(
    ctx: &Ctx,
    ca: &ClaimedAttempt,
    class: Class,
    step: ExecStep,
    sent: Instant,
    received: Instant,
) {
    let g = ca.generation;
    if step.fault != ExecFault::Clean {
        ctx.realized(step.fault.name(), 1);
    }
    let mut anchor = received;
    if step.heartbeat {
        match ctx.heartbeat(ca.id, g, step.usage / 2, sent).await {
            Ok(ack) if ack.cancel_requested => {
                ctx.realized("executor_obeyed_cancel", 1);
                let body = ReportBody::cancelled(g).with_usage(step.usage / 2);
                ctx.report(ca.id, &body).await;
                return;
            }
            Ok(_) => anchor = Instant::now(),
            Err(Sent::Stale) => {
                ctx.realized("executor_lost_lease", 1);
                return;
            }
            Err(_) => {}
        }
    }
    let usage = step.usage;
    match step.fault {
        ExecFault::CrashBeforeEffect => return,
        ExecFault::Transient => {
            let body = ReportBody::failed(g, FailureClass::Transient, "provider timed out")
                .with_usage(usage);
            ctx.report(ca.id, &body).await;
            return;
        }
        ExecFault::Permanent => {
            let body = ReportBody::failed(g, FailureClass::InvalidInput, "payee account closed")
                .with_usage(usage);
            ctx.report(ca.id, &body).await;
            return;
        }
        ExecFault::UnknownWithoutEffect => {
            ctx.report(ca.id, &ReportBody::unknown(g).with_usage(usage))
                .await;
            return;
        }
        _ => {}
    }
    if let ExecFault::StalePay { after_ms } = step.fault {
        stale_pay(ctx, ca, class, usage, received, after_ms).await;
        return;
    }
    if sent.elapsed() > EFFECT_WITHIN {
        // Too close to the lease end to act safely: behave as a crash before the effect.
        ctx.realized(TOO_SLOW_TO_ACT, 1);
        return;
    }
    let e = ctx.provider.perform(
        ca.task_id,
        ca.id,
        &ca.idempotency_key,
        class,
        &ca.params,
        true,
    );
    if let ExecFault::StaleRepay { after_ms } = step.fault {
        // The provider's answer is lost: the executor pays again later.
        stale_pay(ctx, ca, class, usage, received, after_ms).await;
        return;
    }
    let body = ReportBody::succeeded(g, effect_result(&e))
        .with_usage(usage)
        .with_external_txn_id(e.txn.clone());
    match step.fault {
        ExecFault::CrashAfterEffect => {}
        ExecFault::UnknownAfterEffect => {
            ctx.report(ca.id, &ReportBody::unknown(g).with_usage(usage))
                .await;
        }
        ExecFault::LateReport => {
            tokio::time::sleep_until(
                (anchor + Duration::from_millis(LEASE_MS) + LATE_MARGIN).into(),
            )
            .await;
            let s = ctx.report(ca.id, &body).await;
            ctx.suspect(ca, SuspectKind::Late, s);
        }
        ExecFault::DuplicateReport => {
            if ctx.report(ca.id, &body).await == Sent::Accepted {
                let again = ctx.report(ca.id, &body).await;
                if again != Sent::Accepted {
                    ctx.realized("exact_repeat_report_refused", 1);
                }
                let other = ReportBody::failed(g, FailureClass::Transient, "second thoughts")
                    .with_usage(usage);
                let s = ctx.report(ca.id, &other).await;
                ctx.suspect(ca, SuspectKind::Conflicting, s);
            }
        }
        _ => {
            ctx.report(ca.id, &body).await;
        }
    }
}

/// An executor cut off from idem past its lease pays anyway, `after_ms`
/// after the lease ran out, then reports `succeeded` with the transaction id
/// until answered: idem must refuse it (409 `STALE_GENERATION`) and keep it
/// as evidence.
async fn stale_pay(
    ctx: &Ctx,
    ca: &ClaimedAttempt,
    class: Class,
    usage: i64,
    received: Instant,
    after_ms: u64,
) {
    let lease_end = received + Duration::from_millis(LEASE_MS) + LATE_MARGIN;
    tokio::time::sleep_until((lease_end + Duration::from_millis(after_ms)).into()).await;
    let e = ctx.provider.perform(
        ca.task_id,
        ca.id,
        &ca.idempotency_key,
        class,
        &ca.params,
        false,
    );
    let body = ReportBody::succeeded(ca.generation, effect_result(&e))
        .with_usage(usage)
        .with_external_txn_id(e.txn.clone());
    let s = ctx.report(ca.id, &body).await;
    ctx.suspect(ca, SuspectKind::Late, s);
}

async fn reconcile(ctx: &Ctx, ca: &ClaimedAttempt, fault: ReconFault, received: Instant) {
    let g = ca.generation;
    if fault != ReconFault::Clean {
        ctx.realized(fault.name(), 1);
    }
    match fault {
        ReconFault::Crash => {}
        ReconFault::Transient => {
            let body = ReportBody::failed(g, FailureClass::Transient, "provider lookup failed")
                .with_usage(1);
            ctx.report(ca.id, &body).await;
        }
        ReconFault::Unknown => {
            ctx.report(ca.id, &ReportBody::unknown(g).with_usage(1))
                .await;
        }
        ReconFault::Clean | ReconFault::LateReport => {
            let body = match ctx.provider.lookup(ca.task_id) {
                Some(e) => {
                    ReportBody::committed(g, effect_result(&e)).with_external_txn_id(e.txn.clone())
                }
                None => ReportBody::not_committed(g),
            }
            .with_usage(1);
            if fault == ReconFault::LateReport {
                tokio::time::sleep_until(
                    (received + Duration::from_millis(LEASE_MS) + LATE_MARGIN).into(),
                )
                .await;
                let s = ctx.report(ca.id, &body).await;
                ctx.suspect(ca, SuspectKind::Late, s);
            } else {
                ctx.report(ca.id, &body).await;
            }
        }
    }
}

pub(super) async fn inject(
    ctx: Arc<Ctx>,
    servers: Arc<Servers>,
    db: Arc<Db>,
    fault: ServerFault,
) -> Result<()> {
    match fault {
        ServerFault::Kill { server } => {
            ctx.targets.set(server, None)?;
            let url = servers.restart(server, true).await?;
            ctx.realized("server_sigkill", 1);
            ctx.targets.set(server, Some(&url))?;
        }
        ServerFault::PgTerminate => {
            let n = db.terminate_idem_connections().await?;
            ctx.realized("pg_terminate_backend", 1);
            ctx.realized("pg_connections_terminated", n);
        }
    }
    Ok(())
}
