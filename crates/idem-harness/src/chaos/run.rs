//! The run: options, the drive from start to quiescence, the read-back of
//! every task, statistics, the rendered report and the verdict.

use super::*;

/// Options of a chaos run.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    /// Seed of the plan.
    pub seed: u64,
    /// Client operations.
    pub ops: usize,
    /// `sqlite://PATH` or `postgres://…`; `None`: a temporary SQLite file.
    pub store: Option<String>,
    /// The `idem` binary to run as `idem serve`.
    pub idem_bin: PathBuf,
    /// Concurrent client operations.
    pub clients: usize,
    /// Executor claim loops.
    pub executors: usize,
    /// Progress lines on stderr.
    pub progress: bool,
    /// Each instance in a network namespace of its own, with network faults
    /// on its database link (PostgreSQL only; root needed). See [`super::netns`].
    pub netns: bool,
    /// Shift of the second instance's wall clock at its first start, ms
    /// (the sign flips at each restart); 0: none. PostgreSQL only; from
    /// [`MIN_CLOCK_SKEW_MS`] to [`MAX_CLOCK_SKEW_MS`] in size.
    pub clock_skew_ms: i64,
    /// libfaketime for `clock_skew_ms`; `None`: the usual places.
    pub libfaketime: Option<PathBuf>,
    /// A database failover half-way through (PostgreSQL on a multi-host
    /// URL); the run's own server faults are then left out. See
    /// [`super::failover`].
    pub failover: Option<Failover>,
    /// Whether the provider deduplicates pay requests by task id.
    pub provider: ProviderMode,
    /// Executors that pay after their lease ran out ([`Plan::with_stale_payers`]);
    /// always with [`ProviderMode::NonDeduplicating`].
    pub stale_payers: bool,
}

/// Figures of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    /// Tasks of the run.
    pub tasks: usize,
    /// Delivered.
    pub succeeded: usize,
    /// Failed.
    pub failed: usize,
    /// Cancelled.
    pub cancelled: usize,
    /// Not terminal.
    pub open: usize,
    /// Attempts of any kind.
    pub attempts: usize,
    /// Execute attempts.
    pub execute_attempts: usize,
    /// Reconcile attempts.
    pub reconcile_attempts: usize,
    /// Reports kept as evidence with disposition `stale_generation`.
    pub stale_reports_kept: usize,
    /// Submissions (final answers after retries).
    pub submissions: usize,
    /// `201 created` answers.
    pub created: usize,
    /// Replays (including scope lookups).
    pub replays: usize,
    /// 422 conflicts.
    pub conflicts: usize,
    /// Submissions without an answer after all retries.
    pub no_answer: usize,
    /// Cancel answers.
    pub cancel_answers: usize,
    /// Effects in the provider's ledger.
    pub provider_effects: usize,
    /// Pay requests the provider deduplicated.
    pub provider_deduplicated: usize,
    /// Lookups at the provider.
    pub provider_lookups: u64,
    /// Unexpected answers by kind.
    pub unexpected: BTreeMap<String, u64>,
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    /// Seed.
    pub seed: u64,
    /// Client operations.
    pub ops: usize,
    /// `sqlite` or `postgres`.
    pub store: String,
    /// Server processes.
    pub servers: usize,
    /// Wall time, ms.
    pub elapsed_ms: u64,
    /// Violated checks, all invariants together.
    pub violations: u64,
    /// Injected faults by kind, as the seed planned them (deterministic).
    pub faults: BTreeMap<String, u64>,
    /// What happened in this run (depends on the interleaving).
    pub faults_realized: BTreeMap<String, u64>,
    /// Per invariant.
    pub invariants: Vec<InvariantResult>,
    /// With `--netns`: the namespaces and what each network episode did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkReport>,
    /// With `--clock-skew-ms`: the shifted instance and its clock checks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock_skew: Option<SkewReport>,
    /// With `--failover-kill`: what the failover did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover: Option<FailoverReport>,
    /// Figures.
    pub stats: Stats,
    /// Whether the provider deduplicated pay requests.
    pub provider: ProviderMode,
    /// Second effects at the provider against idem's
    /// `second_effect_suspected` events.
    pub second_effects: SecondEffects,
    /// The command that replays the same plan.
    pub reproduce: String,
}

/// Runs a chaos session and checks it. SIGINT (Ctrl-C) or SIGTERM ends the
/// run with an error after its servers, forwarders and network namespaces
/// are removed.
///
/// # Errors
/// When the options do not fit together, the servers or the network cannot
/// be started, the skewed clock is not in effect, or the records cannot be
/// read. Violations are reported in [`ChaosReport`], not as errors.
pub async fn run(opts: ChaosOptions) -> Result<ChaosReport> {
    tokio::select! {
        r = run_to_end(opts) => r,
        signal = interrupted() => Err(anyhow!(
            "interrupted by {signal}: the run's servers, forwarders and network namespaces are removed"
        )),
    }
}

/// Waits for SIGINT or SIGTERM; never returns when neither can be watched.
pub async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

/// The database address a PostgreSQL URL names (one TCP host).
async fn pg_address(url: &str) -> Result<std::net::SocketAddr> {
    let cfg: tokio_postgres::Config = url.parse().context("parsing the PostgreSQL URL")?;
    let host = match cfg.get_hosts() {
        [tokio_postgres::config::Host::Tcp(h)] => h.clone(),
        _ => bail!("--netns needs a PostgreSQL URL with one TCP host, got `{url}`"),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    tokio::net::lookup_host((host.as_str(), port))
        .await
        .with_context(|| format!("resolving {host}:{port}"))?
        .next()
        .with_context(|| format!("{host}:{port} resolves to no address"))
}

/// `url` with its host and port replaced by `addr`.
fn store_url_via(url: &str, addr: std::net::SocketAddr) -> Result<String> {
    let mut u = url::Url::parse(url).context("parsing the PostgreSQL URL")?;
    u.set_host(Some(&addr.ip().to_string()))
        .with_context(|| format!("setting the host of `{url}`"))?;
    u.set_port(Some(addr.port()))
        .map_err(|()| anyhow!("setting the port of `{url}`"))?;
    Ok(u.into())
}

#[allow(clippy::too_many_lines)]
async fn run_to_end(opts: ChaosOptions) -> Result<ChaosReport> {
    if opts.ops == 0 || opts.clients == 0 || opts.executors == 0 {
        bail!("--ops, --clients and --executors must be positive");
    }
    let started = Instant::now();
    let postgres = opts
        .store
        .as_deref()
        .is_some_and(|s| s.starts_with("postgres://") || s.starts_with("postgresql://"));
    if opts.netns && !postgres {
        bail!(
            "--netns needs a PostgreSQL store (--store postgres://…): the namespaced instances reach it through the run's forwarders"
        );
    }
    let skew_lib = if opts.clock_skew_ms == 0 {
        None
    } else {
        if !postgres {
            bail!(
                "--clock-skew-ms needs a PostgreSQL store (--store postgres://…): two instances sharing the database clock"
            );
        }
        check_clock_skew(opts.clock_skew_ms)?;
        Some(find_libfaketime(opts.libfaketime.as_deref())?)
    };
    let mut plan = Plan::new(opts.seed, opts.ops, postgres);
    if opts.netns {
        plan = plan.with_network();
    }
    if opts.clock_skew_ms != 0 {
        plan = plan.with_clock_skew(opts.clock_skew_ms);
    }
    let stale_payers = opts.stale_payers || opts.provider == ProviderMode::NonDeduplicating;
    if stale_payers {
        plan = plan.with_stale_payers();
    }
    if opts.failover.is_some() {
        if !postgres {
            bail!("--failover-kill needs a PostgreSQL store (--store postgres://HOST1,HOST2/…)");
        }
        // Every 5xx answer is then the failover's.
        plan.server_faults.clear();
    }
    let plan = Arc::new(plan);
    let dir = tempfile::Builder::new().prefix("idem-chaos-").tempdir()?;
    let (store_url, db) = match &opts.store {
        None => {
            let p = dir.path().join("idem.db");
            (format!("sqlite://{}", p.display()), Db::Sqlite(p))
        }
        Some(u) if u.starts_with("sqlite://") => (
            u.clone(),
            Db::Sqlite(PathBuf::from(u.trim_start_matches("sqlite://"))),
        ),
        Some(u) if postgres => (u.clone(), Db::connect_pg(u).await?),
        Some(u) => {
            bail!("--store must start with sqlite://, postgres:// or postgresql://, got `{u}`")
        }
    };
    let db = Arc::new(db);
    // Built before any server starts; dropped (namespaces removed) after they stop.
    let network = if opts.netns {
        let upstream = pg_address(&store_url).await?;
        let (net, leftovers) = netns::Network::create(plan.servers, upstream, opts.seed).await?;
        if opts.progress && !leftovers.is_empty() {
            eprintln!(
                "chaos: removed network namespaces of runs that no longer live: {}",
                leftovers.join(", ")
            );
        }
        Some((net, leftovers))
    } else {
        None
    };
    let placements = (0..plan.servers)
        .map(|i| match &network {
            Some((net, _)) => {
                let link = net.links.get(i).context("a link per instance")?;
                Ok(Placement {
                    prefix: link.exec_prefix(),
                    listen: format!("{}:0", link.ns_addr),
                    store_url: store_url_via(&store_url, link.forwarder.addr)?,
                })
            }
            None => Ok(Placement {
                prefix: Vec::new(),
                listen: "127.0.0.1:0".to_owned(),
                store_url: store_url.clone(),
            }),
        })
        .collect::<Result<Vec<_>>>()?;
    // A tenant of its own: the run's tasks are told apart from anything else in the store.
    let tenant = format!(
        "chaos-{}-{}",
        opts.seed,
        &Uuid::new_v4().simple().to_string()[..8]
    );
    let (client_key, exec_key) = {
        let (store, _tmp, _path) = server::open_store(Some(&store_url)).await?;
        let (_, c) = store.create_api_key(&tenant, Role::Client, None).await?;
        let (_, e) = store.create_api_key(&tenant, Role::Executor, None).await?;
        (c, e)
    };
    let config = dir.path().join("chaos.toml");
    std::fs::write(&config, chaos_config()?.to_toml()?)?;
    // Only this machine's loopback and the run's own namespaces are addressed.
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .no_proxy()
        .build()?;
    let servers = Arc::new(Servers {
        bin: opts.idem_bin.clone(),
        config,
        dir: dir.path().to_path_buf(),
        placements,
        skew: skew_lib.map(|lib| Skew::new(opts.clock_skew_ms, lib)),
        http: http.clone(),
        slots: (0..plan.servers)
            .map(|_| tokio::sync::Mutex::new(None))
            .collect(),
    });
    let ctx = Arc::new(Ctx {
        plan: plan.clone(),
        targets: Targets {
            slots: RwLock::new(vec![None; plan.servers]),
            rr: AtomicUsize::new(0),
            http,
            client_key,
            exec_key,
        },
        provider: Provider::new(opts.provider),
        log: Mutex::new(RunLog::default()),
        stop: AtomicBool::new(false),
        inflight: AtomicUsize::new(0),
        ordinals: Mutex::new(HashMap::new()),
        dispatched: AtomicUsize::new(0),
        episodes_started: AtomicUsize::new(0),
    });
    let links = network
        .as_ref()
        .map(|(net, _)| net.links.clone())
        .unwrap_or_default();
    let result = drive(&opts, &ctx, &servers, &db, &tenant, links).await;
    servers.stop_all().await;
    let network = network.map(|(net, leftovers)| {
        let links = net
            .links
            .iter()
            .enumerate()
            .map(|(i, l)| LinkReport::of(i, l))
            .collect();
        drop(net);
        (links, leftovers)
    });
    let (db_tasks, tasks) = result?;

    let (effects, effect_requests, provider_lookups) = ctx.provider.snapshot();
    let log = std::mem::take(&mut *ctx.log());
    let input = CheckInput {
        tasks,
        db_tasks,
        submits: log.submits,
        cancels: log.cancels,
        suspects: log.suspects,
        accepted_usage: log.accepted_usage,
        effects,
        effect_requests,
        provider: opts.provider,
        effect_reports: log.effect_reports,
    };
    // After a failover to an asynchronous standby the invariants hold for
    // what the promoted database has; what it lost is counted apart.
    let (survived, loss) = match &opts.failover {
        Some(f) => {
            let (kept, loss) = split_losses(&input);
            ((!f.expect_no_loss).then_some(kept), Some(loss))
        }
        None => (None, None),
    };
    let invariants = check(survived.as_ref().unwrap_or(&input));
    let second_effects = second_effects(survived.as_ref().unwrap_or(&input));
    let failover = match (&opts.failover, loss) {
        (Some(f), Some(loss)) => Some(failover_report(
            f,
            log.failover,
            &log.errors_5xx,
            &input,
            &log.accepted_reports,
            loss,
        )?),
        _ => None,
    };
    let violations = invariants.iter().map(|r| r.violations).sum::<u64>()
        + failover.as_ref().map_or(0, FailoverReport::violations);
    let stats = stats(&input, provider_lookups, log.unexpected);
    let mut reproduce = format!("idem-lab chaos --seed {} --ops {}", opts.seed, opts.ops);
    if let Some(s) = &opts.store {
        reproduce.push_str(&format!(" --store {s}"));
    }
    if opts.provider != ProviderMode::Deduplicating {
        reproduce.push_str(&format!(" --provider {}", opts.provider.name()));
    } else if stale_payers {
        reproduce.push_str(" --stale-payers");
    }
    if opts.netns {
        reproduce.push_str(" --netns");
    }
    if opts.clock_skew_ms != 0 {
        reproduce.push_str(&format!(" --clock-skew-ms {}", opts.clock_skew_ms));
    }
    if let Some(f) = &opts.failover {
        reproduce.push_str(&format!(
            " --failover-kill '{}' --failover-promote '{}' --failover-delay-ms {} --failover-bound-ms {}{}",
            f.kill,
            f.promote,
            f.delay.as_millis(),
            f.bound.as_millis(),
            if f.expect_no_loss { "" } else { " --failover-async" }
        ));
    }
    let clock_skew = servers.skew.as_ref().map(|s| SkewReport {
        instance: SKEWED_SERVER,
        skew_ms: s.ms,
        libfaketime: s.lib.display().to_string(),
        checks: s
            .checks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone(),
    });
    Ok(ChaosReport {
        seed: opts.seed,
        ops: opts.ops,
        store: if postgres { "postgres" } else { "sqlite" }.to_owned(),
        servers: plan.servers,
        elapsed_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        violations,
        faults: plan.fault_counts(),
        faults_realized: log.realized,
        invariants,
        network: network.map(|(links, leftovers_removed)| NetworkReport {
            links,
            leftovers_removed,
            episodes: log.network,
        }),
        clock_skew,
        failover,
        stats,
        provider: opts.provider,
        second_effects,
        reproduce,
    })
}

/// The load, the faults, the quiescence and the read-back.
async fn drive(
    opts: &ChaosOptions,
    ctx: &Arc<Ctx>,
    servers: &Arc<Servers>,
    db: &Arc<Db>,
    tenant: &str,
    links: Vec<Arc<netns::Link>>,
) -> Result<(Vec<DbTask>, Vec<TaskRecord>)> {
    let started = Instant::now();
    for i in 0..ctx.plan.servers {
        let url = servers.restart(i, false).await?;
        ctx.targets.set(i, Some(&url))?;
    }
    let executors: Vec<_> = (0..opts.executors)
        .map(|n| tokio::spawn(executor_loop(ctx.clone(), n)))
        .collect();
    let sem = Arc::new(Semaphore::new(opts.clients));
    let mut ops = JoinSet::new();
    let mut faults = JoinSet::new();
    if !ctx.plan.network.is_empty() {
        faults.spawn(run_episodes(ctx.clone(), links, started));
    }
    let mut next_fault = 0;
    let n = ctx.plan.ops.len();
    let step = (n / 10).max(1);
    for i in 0..n {
        if i == n / 2
            && let Some(f) = &opts.failover
        {
            faults.spawn(run_failover(ctx.clone(), f.clone()));
        }
        while let Some((at, fault)) = ctx.plan.server_faults.get(next_fault)
            && *at <= i
        {
            faults.spawn(inject(ctx.clone(), servers.clone(), db.clone(), *fault));
            next_fault += 1;
        }
        episode_gate(ctx, i).await;
        let permit = sem.clone().acquire_owned().await?;
        let c = ctx.clone();
        ops.spawn(async move {
            run_op(c, i).await;
            drop(permit);
        });
        ctx.dispatched.store(i + 1, Ordering::SeqCst);
        while ops.try_join_next().is_some() {}
        if opts.progress && (i + 1) % step == 0 {
            eprintln!(
                "chaos: {}/{n} operations started ({:.1} s)",
                i + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    while ops.join_next().await.is_some() {}
    while let Some(r) = faults.join_next().await {
        r??;
    }
    if opts.progress {
        eprintln!(
            "chaos: all operations answered ({:.1} s); faults stop, waiting for every task to settle",
            started.elapsed().as_secs_f64()
        );
    }
    let quiesce = Instant::now();
    let (mut fewest, mut settled_at, mut told) = (usize::MAX, quiesce, quiesce);
    loop {
        let rows = db.list(tenant).await?;
        let open = rows.iter().filter(|r| !is_terminal_word(&r.state)).count();
        let now = Instant::now();
        if open < fewest {
            (fewest, settled_at) = (open, now);
        }
        if open == 0
            || now.duration_since(settled_at) >= QUIESCE_STALL
            || now.duration_since(quiesce) >= QUIESCE_LIMIT
        {
            break;
        }
        if opts.progress && now.duration_since(told) >= Duration::from_secs(15) {
            told = now;
            eprintln!(
                "chaos: {open} tasks not terminal yet ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    ctx.stop.store(true, Ordering::SeqCst);
    for h in executors {
        let _ = h.await;
    }
    let drained = Instant::now() + EFFECT_REPORT_PATIENCE + Duration::from_secs(5);
    while ctx.inflight.load(Ordering::SeqCst) > 0 && Instant::now() < drained {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let db_tasks = db.list(tenant).await?;
    if opts.progress {
        eprintln!(
            "chaos: reading {} tasks back ({:.1} s)",
            db_tasks.len(),
            started.elapsed().as_secs_f64()
        );
    }
    let tasks = read_back(ctx, &db_tasks).await?;
    Ok((db_tasks, tasks))
}

async fn read_one(ep: &Endpoint, id: Uuid) -> Result<TaskRecord> {
    let mut last = None;
    for _ in 0..10 {
        let got = async {
            let task = ep.client.get_task(id).await?;
            let attempts = ep.client.attempts(id).await?;
            let events = ep.client.events(id).await?;
            Ok::<_, ClientError>(TaskRecord {
                task,
                attempts,
                events,
            })
        }
        .await;
        match got {
            Ok(mut r) => {
                r.attempts.sort_by_key(|a| a.number);
                r.events.sort_by_key(|e| e.seq);
                return Ok(r);
            }
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Err(anyhow!(
        "reading task {id}: {}",
        last.map_or_else(String::new, |e| e.to_string())
    ))
}

async fn read_back(ctx: &Ctx, db_tasks: &[DbTask]) -> Result<Vec<TaskRecord>> {
    let ep = ctx.targets.pick().context("no server is up to read from")?;
    let sem = Arc::new(Semaphore::new(16));
    let mut set = JoinSet::new();
    for t in db_tasks {
        let ep = ep.clone();
        let id = t.id;
        let permit = sem.clone().acquire_owned().await?;
        set.spawn(async move {
            let r = read_one(&ep, id).await;
            drop(permit);
            r
        });
    }
    let mut out = Vec::with_capacity(db_tasks.len());
    while let Some(r) = set.join_next().await {
        out.push(r??);
    }
    out.sort_by_key(|r| r.task.id);
    Ok(out)
}

fn stats(input: &CheckInput, provider_lookups: u64, unexpected: BTreeMap<String, u64>) -> Stats {
    let mut s = Stats {
        tasks: input.tasks.len(),
        provider_effects: input.effects.len(),
        provider_deduplicated: input.effect_requests.iter().filter(|r| !r.moved).count(),
        provider_lookups,
        cancel_answers: input.cancels.len(),
        submissions: input.submits.len(),
        unexpected,
        ..Stats::default()
    };
    for r in &input.tasks {
        match r.task.state {
            TaskState::Succeeded => s.succeeded += 1,
            TaskState::Failed => s.failed += 1,
            TaskState::Cancelled => s.cancelled += 1,
            _ => s.open += 1,
        }
        s.attempts += r.attempts.len();
        for a in &r.attempts {
            match a.kind {
                AttemptKind::Execute => s.execute_attempts += 1,
                AttemptKind::Reconcile => s.reconcile_attempts += 1,
                AttemptKind::Other => {}
            }
            s.stale_reports_kept += a
                .evidence
                .iter()
                .filter(|e| e.disposition.as_deref() == Some("stale_generation"))
                .count();
        }
    }
    for sub in &input.submits {
        match &sub.answer {
            SubmitAnswer::Accepted {
                replayed,
                looked_up,
                ..
            } => {
                if *replayed || *looked_up {
                    s.replays += 1;
                } else {
                    s.created += 1;
                }
            }
            SubmitAnswer::Conflict { .. } => s.conflicts += 1,
            SubmitAnswer::NoAnswer => s.no_answer += 1,
            SubmitAnswer::Refused { .. } => {}
        }
    }
    s
}

fn counts_line(m: &BTreeMap<String, u64>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The human-readable summary.
pub fn render(r: &ChaosReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "idem-lab chaos: seed {}, {} operations, {} store, {} server process(es), {:.1} s",
        r.seed,
        r.ops,
        r.store,
        r.servers,
        r.elapsed_ms as f64 / 1000.0
    );
    let _ = writeln!(
        out,
        "faults planned by the seed: {}",
        counts_line(&r.faults)
    );
    let _ = writeln!(
        out,
        "realized in this run:       {}",
        counts_line(&r.faults_realized)
    );
    let s = &r.stats;
    let _ = writeln!(
        out,
        "tasks {}: {} succeeded, {} failed, {} cancelled, {} open; attempts {} ({} execute, {} reconcile); {} stale reports kept",
        s.tasks,
        s.succeeded,
        s.failed,
        s.cancelled,
        s.open,
        s.attempts,
        s.execute_attempts,
        s.reconcile_attempts,
        s.stale_reports_kept
    );
    let _ = writeln!(
        out,
        "submissions {}: {} created, {} replays, {} conflicts, {} without answer; {} cancel answers; provider: {} effects, {} deduplicated requests, {} lookups",
        s.submissions,
        s.created,
        s.replays,
        s.conflicts,
        s.no_answer,
        s.cancel_answers,
        s.provider_effects,
        s.provider_deduplicated,
        s.provider_lookups
    );
    if !s.unexpected.is_empty() {
        let _ = writeln!(out, "unexpected answers: {}", counts_line(&s.unexpected));
    }
    let e = &r.second_effects;
    let _ = writeln!(
        out,
        "second effects ({} provider): {} real ({} beside a delivery, {} of tasks ended without delivery; {} tasks with several effects); {} reported to idem, {} never reported (idem cannot see them), {} only in unanswered reports; idem raised {}: {} misses, {} false alarms",
        r.provider.name(),
        e.real,
        e.beside_delivery,
        e.without_delivery,
        e.tasks_with_several_effects,
        e.reported,
        e.unreported,
        e.unanswered,
        e.raised,
        e.misses,
        e.false_alarms
    );
    if let Some(n) = &r.network {
        render_network(&mut out, n);
    }
    if let Some(f) = &r.failover {
        render_failover(&mut out, f);
    }
    if let Some(k) = &r.clock_skew {
        let checks = k
            .checks
            .iter()
            .map(|c| {
                format!(
                    "start {}: {:+} ms intended, {:+} ms seen",
                    c.start, c.intended_ms, c.observed_ms
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            out,
            "clock skew: instance {} under {} (Date header vs this clock): {checks}",
            k.instance, k.libfaketime
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<38} {:<9} {:>9} {:>10}  statement",
        "invariant", "spec", "checked", "violations"
    );
    for i in &r.invariants {
        let _ = writeln!(
            out,
            "{:<38} {:<9} {:>9} {:>10}  {}",
            i.name, i.spec, i.checked, i.violations, i.title
        );
        for e in &i.examples {
            let _ = writeln!(out, "    ! {e}");
        }
    }
    let _ = writeln!(out);
    if r.violations == 0 {
        let _ = writeln!(out, "PASS: 0 violations");
    } else {
        let _ = writeln!(
            out,
            "FAIL: {} violations; reproduce with: {}",
            r.violations, r.reproduce
        );
    }
    out
}

fn render_network(out: &mut String, n: &NetworkReport) {
    use std::fmt::Write as _;
    let _ = writeln!(out);
    for l in &n.links {
        let _ = writeln!(
            out,
            "instance {}: namespace {}, listens on {}, veth host side {}, database via {}",
            l.instance, l.namespace, l.instance_addr, l.host, l.forwarder
        );
    }
    let _ = writeln!(
        out,
        "{:<28} {:>4} {:>7} {:>8} {:>8} {:>8} {:>8} {:>12} {:>8} {:>9} {:>6}",
        "network episode",
        "inst",
        "at op",
        "start s",
        "lasted",
        "dropped",
        "delayed",
        "db conn o/f",
        "retries",
        "late claim",
        "stale"
    );
    for e in &n.episodes {
        let what = match e.fault {
            NetFault::Partition => "partition".to_owned(),
            NetFault::Delay {
                delay_ms,
                jitter_ms,
            } => format!("delay {delay_ms}±{jitter_ms} ms"),
            NetFault::Loss { percent } => format!("loss {percent} %"),
        };
        let _ = writeln!(
            out,
            "{:<28} {:>4} {:>7} {:>8.1} {:>7.1}s {:>8} {:>8} {:>12} {:>8} {:>9} {:>6}",
            what,
            e.instance,
            e.started_at_op,
            e.started_at_ms as f64 / 1000.0,
            e.duration_ms as f64 / 1000.0,
            e.packets_dropped,
            e.chunks_delayed,
            format!(
                "{}/{}",
                e.db_connections_open_at_start, e.db_connections_failed
            ),
            e.retries_after_error,
            e.claims_too_late,
            e.stale_refusals
        );
    }
}

/// `Err` (exit code 1) when the run found a violation, naming the seed.
///
/// # Errors
/// When `report.violations > 0`.
pub fn verdict(report: &ChaosReport) -> Result<()> {
    if report.violations == 0 {
        Ok(())
    } else {
        Err(anyhow!(
            "{} invariant violation(s); reproduce with: {}",
            report.violations,
            report.reproduce
        ))
    }
}
