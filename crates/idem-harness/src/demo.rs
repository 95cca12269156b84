//! `idem demo`: the seeds' payment case, end to end over HTTP, as a readable report.
//!
//! An agent releases a payment through idem; executors carry it out at a
//! simulated payout provider. The scenes show what idem promises when things go
//! wrong, and each one checks the promise:
//!
//! - (a) the agent's answer is lost, it retries with the same key: one task, one payout, one charge;
//! - (b) a retry with a changed amount or payee: 422 `IDEMPOTENCY_CONFLICT`, nothing executed;
//! - (c) an executor pays and crashes before reporting: the lease expires, the task is
//!   reconciled against the provider, the recorded payout is delivered, nothing is paid twice;
//! - (d) a stale executor's late report after its lease expired: 409 `STALE_GENERATION`,
//!   kept as evidence, no effect;
//! - (e) a cancellation that loses to delivery (`too_late`, fee = charge) and one that wins
//!   (`confirmed`, generation raised, a later report of the retired attempt refused).
//!
//! Finally the records of every task are audited against the provider's ledger.
//!
//! The demo runs against an in-process idem on a temporary SQLite store, or
//! against a running one (`--url` with a client and an executor key of one
//! tenant that has no other pending `payment.release` work).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_client::{
    AttemptKind, AttemptState, CancelStatus, ClaimedAttempt, Client, ClientError, ReportBody,
    SubmitRetry, Task, TaskState,
};
use idem_core::config::{Config, DEFAULT_TOML};
use idem_core::model::Role;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// The operation class the demo uses.
const OPERATION: &str = "payment.release";

/// Lease of an executor that is about to crash or stall, ms.
const SHORT_LEASE_MS: u64 = 300;

/// Lease of a healthy executor, ms.
const NORMAL_LEASE_MS: u64 = 10_000;

/// The agent's per-request time limit.
const AGENT_TIMEOUT: Duration = Duration::from_millis(500);

/// How long the demo waits for background work (lease expiry, claims).
const PATIENCE: Duration = Duration::from_secs(10);

/// What to run the demo against.
#[derive(Debug, Clone, Default)]
pub struct DemoOptions {
    /// A running idem (`http://host:port`); `None`: an in-process server on a temporary SQLite store.
    pub url: Option<String>,
    /// Client (or admin) API key for `url`.
    pub client_key: Option<String>,
    /// Executor (or admin) API key for `url`, of the same tenant as `client_key`.
    pub executor_key: Option<String>,
    /// Print each line of the report to stdout as soon as it is written.
    pub echo: bool,
}

/// The invariants the demo checks (SPEC §2, seeds IDEM-01, RETRY-01, CANCEL-01).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// One scope (tenant, operation, key) maps to exactly one task.
    OneScopeOneTask,
    /// A retry with a changed request is refused and executes nothing.
    ConflictExecutedNothing,
    /// At most one payout, one delivery and one charge per task.
    OneDeliveryOneCharge,
    /// After an unknown outcome nothing is paid again before reconciliation.
    ReconcileBeforeRepeat,
    /// A report from an old generation is kept as evidence and changes nothing.
    StaleChangesNothing,
    /// Cancellation and delivery never both win.
    CancelOrDeliverNeverBoth,
}

impl Invariant {
    /// Every invariant, in report order.
    pub const ALL: [Invariant; 6] = [
        Invariant::OneScopeOneTask,
        Invariant::ConflictExecutedNothing,
        Invariant::OneDeliveryOneCharge,
        Invariant::ReconcileBeforeRepeat,
        Invariant::StaleChangesNothing,
        Invariant::CancelOrDeliverNeverBoth,
    ];

    /// A short plain-language statement.
    pub fn title(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "one idempotency key, one task",
            Invariant::ConflictExecutedNothing => {
                "a changed request under the same key executes nothing"
            }
            Invariant::OneDeliveryOneCharge => "at most one payout, delivery and charge per task",
            Invariant::ReconcileBeforeRepeat => {
                "no repeat payment without reconciliation after an unknown outcome"
            }
            Invariant::StaleChangesNothing => {
                "a stale executor's report is kept but changes nothing"
            }
            Invariant::CancelOrDeliverNeverBoth => "cancellation and delivery never both win",
        }
    }
}

/// One checked expectation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The invariant it supports.
    pub invariant: Invariant,
    /// The scene that checked it (`a` … `e`, or `audit`).
    pub scene: String,
    /// Whether it held.
    pub passed: bool,
    /// What was expected, in plain words.
    pub expectation: String,
}

/// The outcome of a demo run.
#[derive(Debug, Clone, Default)]
pub struct DemoReport {
    /// Whether every check held and every scene finished.
    pub passed: bool,
    /// The report, line by line, as printed.
    pub lines: Vec<String>,
    /// Every check made.
    pub checks: Vec<Check>,
    /// Scenes that could not finish, with the reason.
    pub errors: Vec<String>,
}

/// Runs the demo and returns its report (also printed when `opts.echo`).
///
/// # Errors
/// Only when the demo cannot start (no server, missing keys). Failed checks and
/// scenes that break off are reported in [`DemoReport`] instead.
pub async fn run(opts: DemoOptions) -> Result<DemoReport> {
    let target = Target::open(&opts).await?;
    let mut demo = Demo::new(&opts, &target).await?;
    demo.header(&target);

    let scenes: [(&str, &str); 5] = [
        (
            "a",
            "Lost answer: the agent times out and retries with the same key",
        ),
        ("b", "A retry with a changed amount or payee"),
        ("c", "The executor pays, then crashes before reporting"),
        ("d", "A stale executor reports after its lease ran out"),
        ("e", "Cancellation racing delivery"),
    ];
    for (id, title) in scenes {
        demo.begin(id, title);
        let res = match id {
            "a" => demo.scene_a().await,
            "b" => demo.scene_b().await,
            "c" => demo.scene_c().await,
            "d" => demo.scene_d().await,
            _ => demo.scene_e().await,
        };
        demo.end(res);
    }
    demo.begin("audit", "Audit of every task against the provider's ledger");
    let res = demo.audit().await;
    demo.end(res);
    demo.cleanup().await;
    demo.summary();
    drop(target);
    Ok(demo.report)
}

// ---------------------------------------------------------------------------
// The simulated payout provider
// ---------------------------------------------------------------------------

/// A payout recorded by the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Payout {
    txn: String,
    payee: String,
    amount: i64,
    currency: String,
    attempt_id: Uuid,
}

impl Payout {
    fn result(&self) -> Value {
        json!({
            "status": "paid",
            "payout_txn": self.txn,
            "payee": self.payee,
            "amount": self.amount,
            "currency": self.currency,
        })
    }
}

#[derive(Debug, Default)]
struct Ledger {
    /// Money moved, keyed by the idempotency key the executor passes: the task id.
    payouts: BTreeMap<Uuid, Payout>,
    /// Every pay request: (task, attempt, whether money moved).
    pay_requests: Vec<(Uuid, Uuid, bool)>,
    /// Every lookup by task id.
    lookups: Vec<Uuid>,
}

/// A payout provider that is itself idempotent: a second pay request with the
/// same task id returns the recorded payout and never pays twice.
#[derive(Debug, Clone, Default)]
struct Provider(Arc<Mutex<Ledger>>);

impl Provider {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Pays `params` once per task id. Returns the payout and whether money moved now.
    fn pay(&self, task_id: Uuid, attempt_id: Uuid, params: &Value) -> (Payout, bool) {
        let mut l = self.ledger();
        if let Some(p) = l.payouts.get(&task_id).cloned() {
            l.pay_requests.push((task_id, attempt_id, false));
            return (p, false);
        }
        let p = Payout {
            txn: format!("pay-{:04}", l.payouts.len() + 1),
            payee: params["payee"].as_str().unwrap_or("?").to_owned(),
            amount: params["amount"].as_i64().unwrap_or(0),
            currency: params["currency"].as_str().unwrap_or("?").to_owned(),
            attempt_id,
        };
        l.payouts.insert(task_id, p.clone());
        l.pay_requests.push((task_id, attempt_id, true));
        (p, true)
    }

    /// What the provider knows about a task id (used by reconcile attempts).
    fn lookup(&self, task_id: Uuid) -> Option<Payout> {
        let mut l = self.ledger();
        l.lookups.push(task_id);
        l.payouts.get(&task_id).cloned()
    }

    fn payout(&self, task_id: Uuid) -> Option<Payout> {
        self.ledger().payouts.get(&task_id).cloned()
    }

    /// Times money moved for `task_id`.
    fn money_moved(&self, task_id: Uuid) -> usize {
        self.ledger()
            .pay_requests
            .iter()
            .filter(|(t, _, moved)| *t == task_id && *moved)
            .count()
    }

    fn pay_requests(&self, task_id: Uuid) -> usize {
        self.ledger()
            .pay_requests
            .iter()
            .filter(|(t, _, _)| *t == task_id)
            .count()
    }

    fn lookups(&self, task_id: Uuid) -> usize {
        self.ledger()
            .lookups
            .iter()
            .filter(|t| **t == task_id)
            .count()
    }

    fn total_pay_requests(&self) -> usize {
        self.ledger().pay_requests.len()
    }

    fn total_payouts(&self) -> usize {
        self.ledger().payouts.len()
    }
}

// ---------------------------------------------------------------------------
// Where idem runs, and a link that can lose answers
// ---------------------------------------------------------------------------

/// An in-process idem: stops when dropped (the temporary store is removed with it).
struct InProcess {
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

/// The idem the demo talks to.
struct Target {
    url: String,
    client_key: String,
    executor_key: String,
    description: String,
    _server: Option<InProcess>,
}

impl Target {
    async fn open(opts: &DemoOptions) -> Result<Target> {
        if let Some(url) = &opts.url {
            let (Some(client_key), Some(executor_key)) = (&opts.client_key, &opts.executor_key)
            else {
                bail!(
                    "--url needs --client-key and --executor-key (keys of one tenant, e.g. from `idem keys create --tenant demo --role client`)"
                );
            };
            return Ok(Target {
                url: url.trim_end_matches('/').to_owned(),
                client_key: client_key.clone(),
                executor_key: executor_key.clone(),
                description: format!("the running service at {url}"),
                _server: None,
            });
        }
        let dir = tempfile::tempdir().context("creating a temporary directory")?;
        let path = dir.path().join("idem.db");
        let store =
            tokio::task::spawn_blocking(move || idem_store_sqlite::open(path, Default::default()))
                .await?
                .context("opening the temporary SQLite store")?;
        let ops = Some(vec![OPERATION.to_owned()]);
        let (_, client_key) = store
            .create_api_key("demo", Role::Client, ops.clone())
            .await?;
        let (_, executor_key) = store.create_api_key("demo", Role::Executor, ops).await?;
        let overrides = [
            ("IDEM_OPERATIONS__PAYMENT_RELEASE__LEASE__DEFAULT_MS", "300"),
            (
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS",
                "50",
            ),
            (
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS",
                "1000",
            ),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let config = Config::from_toml_with_env(DEFAULT_TOML, overrides)?;
        let state = idem_http::AppState::new(store.clone(), config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let (sweep_stop, sweep_stopped) = oneshot::channel::<()>();
        tokio::spawn(idem_http::run_sweeper(
            store,
            state.work.clone(),
            Duration::from_millis(50),
            async move {
                let _ = sweep_stopped.await;
            },
        ));
        let app = idem_http::router(state);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                    let _ = sweep_stop.send(());
                })
                .await;
        });
        Ok(Target {
            description: format!(
                "an in-process server at {url} (temporary SQLite store, sweeper every 50 ms)"
            ),
            url,
            client_key,
            executor_key,
            _server: Some(InProcess {
                stop: Some(stop),
                server: Some(server),
                _dir: dir,
            }),
        })
    }
}

#[derive(Clone)]
struct LinkState {
    upstream: String,
    http: reqwest::Client,
    /// Lose the answer of the next `POST /v1/tasks`.
    lose_next_submit: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
}

/// A forwarding HTTP proxy between the agent and idem that can lose an answer:
/// the request reaches idem and is processed, but the answer is held back
/// until the agent has given up waiting.
struct FlakyLink {
    url: String,
    lose_next_submit: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Drop for FlakyLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FlakyLink {
    async fn start(upstream: &str) -> Result<FlakyLink> {
        let state = LinkState {
            upstream: upstream.to_owned(),
            http: reqwest::Client::new(),
            lose_next_submit: Arc::new(AtomicBool::new(false)),
            lost: Arc::new(AtomicBool::new(false)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let lose_next_submit = Arc::clone(&state.lose_next_submit);
        let lost = Arc::clone(&state.lost);
        let app = axum::Router::new().fallback(forward).with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FlakyLink {
            url,
            lose_next_submit,
            lost,
            task,
        })
    }

    /// Loses the answer to the next submission.
    fn arm(&self) {
        self.lost.store(false, Ordering::SeqCst);
        self.lose_next_submit.store(true, Ordering::SeqCst);
    }

    /// Whether an answer was lost since [`FlakyLink::arm`].
    fn lost_one(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

async fn forward(State(s): State<LinkState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, idem_http::BODY_LIMIT_BYTES * 2).await else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut rb = s
        .http
        .request(parts.method.clone(), format!("{}{path}", s.upstream));
    for (name, value) in &parts.headers {
        if name != header::HOST && name != header::CONTENT_LENGTH && name != header::CONNECTION {
            rb = rb.header(name, value);
        }
    }
    let upstream = match rb.body(bytes).send().await {
        Ok(r) => r,
        Err(_) => return StatusCode::BAD_GATEWAY.into_response(),
    };
    let status = upstream.status();
    let headers: HeaderMap = upstream.headers().clone();
    let body = upstream.bytes().await.unwrap_or_default();
    let is_submit = parts.method == axum::http::Method::POST && parts.uri.path() == "/v1/tasks";
    if is_submit && s.lose_next_submit.swap(false, Ordering::SeqCst) {
        // idem has committed and answered; the answer never reaches the agent.
        s.lost.store(true, Ordering::SeqCst);
        tokio::time::sleep(AGENT_TIMEOUT * 4).await;
        return StatusCode::GATEWAY_TIMEOUT.into_response();
    }
    let mut res = Response::new(Body::from(body));
    *res.status_mut() = status;
    for (name, value) in &headers {
        if name != header::TRANSFER_ENCODING
            && name != header::CONNECTION
            && name != header::CONTENT_LENGTH
        {
            res.headers_mut().append(name, value.clone());
        }
    }
    res
}

// ---------------------------------------------------------------------------
// The demo
// ---------------------------------------------------------------------------

struct Demo {
    /// The agent (client key), through the flaky link, with a short timeout:
    /// used for submissions, always with [`Client::submit_with_retry`].
    agent: Client,
    /// The agent through the same link with a patient timeout (cancel, acknowledge,
    /// conflicting submissions), so that a slow machine does not fail the demo.
    agent_patient: Client,
    /// The same client key, direct (reads that must not be lost).
    reader: Client,
    /// The executors' key.
    exec: Client,
    link: FlakyLink,
    provider: Provider,
    run_id: String,
    echo: bool,
    report: DemoReport,
    scene: String,
    scene_first_check: usize,
    /// Every task this run created.
    tasks: Vec<Uuid>,
    /// Tasks whose outcome became unknown (expired execute lease).
    unknown_outcome: Vec<Uuid>,
}

/// Report lines are wrapped at this many columns.
const WIDTH: usize = 100;

/// Word-wraps `text` to `width` columns: the first line starts with `first`, the others with `rest`.
fn wrap(text: &str, width: usize, first: &str, rest: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = first.to_owned();
    let mut empty = true;
    for word in text.split_whitespace() {
        if !empty && current.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::replace(&mut current, rest.to_owned()));
            empty = true;
        }
        if !empty {
            current.push(' ');
        }
        current.push_str(word);
        empty = false;
    }
    lines.push(current);
    lines
}

/// "once", "twice", "3 times".
fn times(n: usize) -> String {
    match n {
        1 => "once".into(),
        2 => "twice".into(),
        n => format!("{n} times"),
    }
}

/// "1 request", "2 requests".
fn count(n: usize, noun: &str) -> String {
    match (n, noun.strip_suffix('y')) {
        (1, _) => format!("1 {noun}"),
        (_, Some(stem)) => format!("{n} {stem}ies"),
        _ => format!("{n} {noun}s"),
    }
}

/// Last 8 characters of an id (UUID v7 ids share their leading, time-based digits).
fn short(id: Uuid) -> String {
    let s = id.simple().to_string();
    format!("…{}", &s[s.len() - 8..])
}

/// An amount of integer minor units of `currency` (cents for EUR), as
/// `EUR 12.50 (1250 minor units)`.
fn money(amount: i64, currency: &str) -> String {
    format!(
        "{currency} {}.{:02} ({amount} minor units)",
        amount / 100,
        amount % 100
    )
}

/// The `currency` of a payment's params (`?` when it has none).
fn currency_of(params: &serde_json::Value) -> &str {
    params["currency"].as_str().unwrap_or("?")
}

/// What idem charged for a delivery, with units: `a charge of EUR 1.00 (100
/// minor units)`. idem's fees are integer minor units of no named currency
/// (SPEC §5); the demo reads them in the payment's currency.
fn charge(amount: Option<i64>, currency: &str) -> String {
    amount.map_or_else(
        || "no charge".to_owned(),
        |c| format!("a charge of {}", money(c, currency)),
    )
}

/// A cancellation's fee, with units: `a cancellation fee of EUR 0.14 (14
/// minor units)` (as [`charge`]).
fn cancel_fee(amount: Option<i64>, currency: &str) -> String {
    amount.map_or_else(
        || "no cancellation fee".to_owned(),
        |f| format!("a cancellation fee of {}", money(f, currency)),
    )
}

fn status_of(r: &Result<impl Sized, ClientError>) -> String {
    match r {
        Ok(_) => "200".into(),
        Err(e) => describe_error(e),
    }
}

fn describe_error(e: &ClientError) -> String {
    match (e.status(), e.code()) {
        (Some(s), Some(c)) => format!("{s} {c}"),
        (Some(s), None) => format!("HTTP {s}"),
        _ if e.is_timeout() => "a timeout".into(),
        _ => {
            let mut chain = String::from("a transport error");
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                let _ = write!(chain, ": {s}");
                source = s.source();
            }
            chain
        }
    }
}

/// The fields of a task that a report, cancel or submission may change (not
/// `updated_at`, which moves whenever an audit event is appended).
fn material(t: &Task) -> Value {
    json!({
        "state": t.state, "generation": t.generation, "attempt_count": t.attempt_count,
        "usage": t.usage, "params": t.params, "fingerprint": t.fingerprint,
        "delivery": t.delivery, "cancellation": t.cancellation, "failure": t.failure,
    })
}

impl Demo {
    async fn new(opts: &DemoOptions, target: &Target) -> Result<Demo> {
        let reader = Client::new(&target.url, target.client_key.clone())?
            .with_timeout(Duration::from_secs(10));
        let exec = Client::new(&target.url, target.executor_key.clone())?
            .with_timeout(Duration::from_secs(10));
        reader
            .ready()
            .await
            .with_context(|| format!("idem at {} is not ready", target.url))?;
        let link = FlakyLink::start(&target.url).await?;
        let agent_patient = Client::new(&link.url, target.client_key.clone())?
            .with_timeout(Duration::from_secs(10));
        let agent = agent_patient.clone().with_timeout(AGENT_TIMEOUT);
        let run_id = Uuid::new_v4().simple().to_string();
        Ok(Demo {
            agent,
            agent_patient,
            reader,
            exec,
            link,
            provider: Provider::default(),
            run_id: format!("demo-{}", &run_id[..8]),
            echo: opts.echo,
            report: DemoReport::default(),
            scene: String::new(),
            scene_first_check: 0,
            tasks: Vec::new(),
            unknown_outcome: Vec::new(),
        })
    }

    // --- output -----------------------------------------------------------

    fn line(&mut self, s: impl Into<String>) {
        let s = s.into();
        if self.echo {
            // A closed stdout (e.g. `idem demo | head`) must not end the run.
            use std::io::Write as _;
            let _ = writeln!(std::io::stdout().lock(), "{s}");
        }
        self.report.lines.push(s);
    }

    /// One sentence of the current scene's paragraph, wrapped at [`WIDTH`] columns.
    fn say(&mut self, s: impl Into<String>) {
        for l in wrap(&s.into(), WIDTH, "    ", "      ") {
            self.line(l);
        }
    }

    fn check(&mut self, invariant: Invariant, passed: bool, expectation: impl Into<String>) {
        self.report.checks.push(Check {
            invariant,
            scene: self.scene.clone(),
            passed,
            expectation: expectation.into(),
        });
    }

    fn header(&mut self, target: &Target) {
        self.line(
            "idem demo: releasing a payment safely when networks, executors and clients misbehave",
        );
        self.line(format!("  idem      {}", target.description));
        self.line("  provider  a simulated payout provider that is itself idempotent by task id");
        self.line(format!(
            "  agent     an HTTP client with a {} ms timeout, behind a link that can lose answers",
            AGENT_TIMEOUT.as_millis()
        ));
        self.line(format!(
            "  (keys of this run start with {}; ids are shortened to their last 8 characters)",
            self.run_id
        ));
    }

    fn begin(&mut self, id: &str, title: &str) {
        self.scene = id.to_owned();
        self.scene_first_check = self.report.checks.len();
        self.line(String::new());
        if id.len() == 1 {
            self.line(format!("({id}) {title}"));
        } else {
            self.line(title.to_owned());
        }
    }

    fn end(&mut self, res: Result<()>) {
        let checks = &self.report.checks[self.scene_first_check..];
        let failed: Vec<String> = checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.expectation.clone())
            .collect();
        let total = checks.len();
        if let Err(e) = res {
            let msg = format!("scene ({}) could not finish: {e:#}", self.scene);
            self.say(format!("FAIL: {msg}"));
            self.report.errors.push(msg);
        }
        if failed.is_empty() {
            if total > 0 {
                self.say(format!("PASS ({total} checks)"));
            }
        } else {
            self.say(format!(
                "FAIL: {} of {total} checks did not hold:",
                failed.len()
            ));
            for f in failed {
                self.say(format!("  expected: {f}"));
            }
        }
    }

    // --- helpers ----------------------------------------------------------

    fn key(&self, name: &str) -> String {
        format!("{}-{name}", self.run_id)
    }

    async fn submit_new(&mut self, key: &str, params: &Value) -> Result<Task> {
        let s = self
            .reader
            .submit(OPERATION, params, key)
            .await
            .with_context(|| format!("submitting {key}"))?;
        self.tasks.push(s.task.id);
        Ok(s.task)
    }

    /// Claims the next attempt, which must belong to `task_id`.
    async fn claim(&self, executor: &str, task_id: Uuid, lease_ms: u64) -> Result<ClaimedAttempt> {
        let started = Instant::now();
        loop {
            let got = self
                .exec
                .claim(executor, &[OPERATION], 1, Some(lease_ms), 2_000)
                .await
                .context("claiming an attempt")?;
            if let Some(a) = got.into_iter().next() {
                if a.task_id != task_id {
                    bail!(
                        "claimed an attempt of task {} instead of {}: the tenant has other pending payment.release work; run the demo with keys of a dedicated tenant",
                        a.task_id,
                        task_id
                    );
                }
                return Ok(a);
            }
            if started.elapsed() > PATIENCE {
                bail!("no attempt of task {} became available", short(task_id));
            }
        }
    }

    /// Polls until the task is in `state`; returns it and the time waited.
    async fn wait_for(&self, task_id: Uuid, state: TaskState) -> Result<(Task, Duration)> {
        let started = Instant::now();
        loop {
            let t = self.reader.get_task(task_id).await?;
            if t.state == state {
                return Ok((t, started.elapsed()));
            }
            if started.elapsed() > PATIENCE {
                bail!(
                    "task {} stayed `{}` instead of becoming `{state}`",
                    short(task_id),
                    t.state
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    // --- scenes -------------------------------------------------------------

    async fn scene_a(&mut self) -> Result<()> {
        let key = self.key("invoice-A");
        let params =
            json!({"payee": "acct-alice", "amount": 1250, "currency": "EUR", "memo": "invoice A"});
        self.say(format!(
            "The agent asks idem to release {} to acct-alice under the idempotency key {key}.",
            money(1250, "EUR")
        ));
        self.link.arm();
        let policy = SubmitRetry {
            max_tries: 4,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        };
        let first = self
            .agent
            .submit_with_retry(OPERATION, &params, &key, &policy)
            .await
            .context("the agent's submission")?;
        let task_id = first.task.id;
        self.tasks.push(task_id);
        let lost = self.link.lost_one();
        self.say(format!(
            "idem accepted it, but the answer was lost on the way back: the agent timed out after {} ms and sent the same request with the same key.",
            AGENT_TIMEOUT.as_millis()
        ));
        self.say(format!(
            "The retry was answered {} with Idempotent-Replayed: {}, naming task {}, the one the first request created ({} HTTP tries in all).",
            first.status,
            first.replayed,
            short(task_id),
            first.tries
        ));
        self.check(
            Invariant::OneScopeOneTask,
            lost && first.tries >= 2,
            "the first answer was lost and the agent retried",
        );
        self.check(
            Invariant::OneScopeOneTask,
            first.status == 201 && first.replayed && !first.looked_up,
            "the retry is answered 201 with Idempotent-Replayed: true",
        );

        let a = self.claim("executor-1", task_id, NORMAL_LEASE_MS).await?;
        let (payout, moved) = self.provider.pay(a.task_id, a.id, &a.params);
        let done = self
            .exec
            .report(
                a.id,
                &ReportBody::succeeded(a.generation, payout.result())
                    .with_external_txn_id(payout.txn.clone()),
            )
            .await
            .context("reporting success")?;
        self.say(format!(
            "executor-1 claimed attempt {} (generation {}), paid {} at the provider (transaction {}) and reported succeeded: 200, task {}.",
            a.number, a.generation, money(payout.amount, &payout.currency), payout.txn, done.state
        ));
        self.check(
            Invariant::OneDeliveryOneCharge,
            moved && done.state == TaskState::Succeeded,
            "the first execution pays and delivers",
        );

        let again = self
            .agent
            .submit_with_retry(OPERATION, &params, &key, &policy)
            .await
            .context("the agent's later retry")?;
        let delivered_charge = again.task.delivery.as_ref().map(|d| d.charge);
        let txn = again
            .task
            .delivery
            .as_ref()
            .and_then(|d| d.external_txn_id.clone());
        self.say(format!(
            "Later the agent sends the same request once more: {} again, replayed, same task {}, now {} with {} for the delivery and the recorded transaction {}.",
            again.status,
            short(again.task.id),
            again.task.state,
            charge(delivered_charge, currency_of(&again.task.params)),
            txn.clone().unwrap_or_else(|| "none".into())
        ));
        let ack1 = self.agent_patient.ack_delivery(task_id).await;
        let ack2 = self.agent_patient.ack_delivery(task_id).await;
        let same_ack = match (&ack1, &ack2) {
            (Ok(x), Ok(y)) => {
                x.delivery == y.delivery
                    && y.delivery
                        .as_ref()
                        .is_some_and(|d| d.acknowledged_at.is_some())
            }
            _ => false,
        };
        self.say(format!(
            "Its delivery acknowledgment is sent twice, as if the first answer had been lost: {} and {}, one unchanged delivery record.",
            status_of(&ack1),
            status_of(&ack2)
        ));
        let found = self.reader.find_task(OPERATION, &key).await?;
        self.say(format!(
            "Looking the key up (GET /v1/tasks?operation=payment.release&idempotency_key=…) finds task {}.",
            short(found.id)
        ));
        let events = self.reader.events(task_id).await?;
        let delivered = events.iter().filter(|e| e.kind == "delivered").count();
        self.say(format!(
            "The provider moved money {} for this task; idem recorded {} with {}.",
            times(self.provider.money_moved(task_id)),
            count(delivered, "delivery"),
            charge(delivered_charge, currency_of(&again.task.params))
        ));
        self.say("Invariant: one key names one business operation, so every retry returns the same task and the payment happens once.");
        self.check(
            Invariant::OneScopeOneTask,
            again.task.id == task_id
                && found.id == task_id
                && again.replayed
                && again.status == 201,
            "every retry and the lookup return the same task",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            self.provider.money_moved(task_id) == 1
                && delivered == 1
                && delivered_charge == Some(again.task.contract.price)
                && txn.as_deref() == Some(payout.txn.as_str())
                && again.task.attempt_count == 1,
            "one attempt, one payout, one delivery charged the contract price",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            same_ack,
            "a repeated delivery acknowledgment returns the same record",
        );
        Ok(())
    }

    async fn scene_b(&mut self) -> Result<()> {
        let key = self.key("invoice-A");
        let before = self.reader.find_task(OPERATION, &key).await?;
        let pays_before = self.provider.total_pay_requests();
        let base =
            json!({"payee": "acct-alice", "amount": 1250, "currency": "EUR", "memo": "invoice A"});
        let mut bigger = base.clone();
        bigger["amount"] = json!(125_000);
        let mut other_payee = base.clone();
        other_payee["payee"] = json!("acct-mallory");

        let r1 = self.agent_patient.submit(OPERATION, &bigger, &key).await;
        let r1_again = self.agent_patient.submit(OPERATION, &bigger, &key).await;
        let r2 = self
            .agent_patient
            .submit(OPERATION, &other_payee, &key)
            .await;
        let describe = |r: &Result<idem_client::Submitted, ClientError>| match r {
            Ok(s) => format!("{} (task {})", s.status, short(s.task.id)),
            Err(e) => describe_error(e),
        };
        self.say(format!(
            "The agent reuses key {key} with the amount changed to {}: {}. Sent again: {}.",
            money(125_000, "EUR"),
            describe(&r1),
            describe(&r1_again)
        ));
        self.say(format!(
            "The same key with the payee changed to acct-mallory: {}.",
            describe(&r2)
        ));
        let conflict = |r: &Result<idem_client::Submitted, ClientError>| match r {
            Err(e) => {
                e.status() == Some(422)
                    && e.code() == Some("IDEMPOTENCY_CONFLICT")
                    && e.problem().and_then(|p| p.task_id) == Some(before.id)
                    && e.problem()
                        .is_some_and(|p| !p.detail.contains("acct-alice"))
            }
            Ok(_) => false,
        };
        let names = match &r1 {
            Err(e) => e
                .problem()
                .and_then(|p| p.task_id)
                .map_or("no task".into(), short),
            Ok(_) => "no task".into(),
        };
        self.say(format!(
            "The problem names the original task ({names}) but none of its parameters; the answer is the same each time."
        ));
        let deterministic = match (&r1, &r1_again) {
            (Err(a), Err(b)) => a.problem() == b.problem(),
            _ => false,
        };
        let after = self.reader.get_task(before.id).await?;
        let found = self.reader.find_task(OPERATION, &key).await?;
        let unchanged = after == before;
        self.say(format!(
            "Afterwards task {} is {} with its original amount {} and payee {}; the provider received {}.",
            short(after.id),
            if unchanged { "untouched" } else { "CHANGED" },
            money(after.params["amount"].as_i64().unwrap_or(0), currency_of(&after.params)),
            after.params["payee"].as_str().unwrap_or("?"),
            match self.provider.total_pay_requests() - pays_before {
                0 => "no new payment request".to_owned(),
                n => count(n, "new payment request"),
            }
        ));
        self.say("Invariant: a key is bound to its request's fingerprint (payee, amount, currency); a changed request is rejected, never executed or treated as the approved one.");
        self.check(
            Invariant::ConflictExecutedNothing,
            conflict(&r1) && conflict(&r1_again),
            "a changed amount is refused with 422 IDEMPOTENCY_CONFLICT naming the original task",
        );
        self.check(
            Invariant::ConflictExecutedNothing,
            conflict(&r2),
            "a changed payee is refused with 422 IDEMPOTENCY_CONFLICT naming the original task",
        );
        self.check(
            Invariant::ConflictExecutedNothing,
            deterministic,
            "the same conflicting request gets the same problem every time",
        );
        self.check(
            Invariant::ConflictExecutedNothing,
            unchanged && self.provider.total_pay_requests() == pays_before,
            "the original task and the provider's ledger are unchanged",
        );
        self.check(
            Invariant::OneScopeOneTask,
            found.id == before.id,
            "the key still maps to the original task",
        );
        Ok(())
    }

    async fn scene_c(&mut self) -> Result<()> {
        let key = self.key("invoice-C");
        let params = json!({"payee": "acct-bob", "amount": 4200, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        self.say(format!(
            "The agent releases {} to acct-bob (key {key}): 201, task {}.",
            money(4200, "EUR"),
            short(task.id)
        ));
        let a = self
            .claim("executor-crashy", task.id, SHORT_LEASE_MS)
            .await?;
        let (payout, moved) = self.provider.pay(a.task_id, a.id, &a.params);
        self.say(format!(
            "executor-crashy claims attempt {} (generation {}, lease {SHORT_LEASE_MS} ms), pays at the provider (transaction {}) and crashes before it can report.",
            a.number, a.generation, payout.txn
        ));
        self.unknown_outcome.push(task.id);
        let (t, waited) = self.wait_for(task.id, TaskState::Reconciling).await?;
        let attempts = self.reader.attempts(task.id).await?;
        let executes = attempts
            .iter()
            .filter(|x| x.kind == AttemptKind::Execute)
            .count();
        self.say(format!(
            "idem cannot know whether the money moved. When the lease ran out (seen after {} ms) it marked attempt {} `{}` and moved the task to `{}`, starting no new payment attempt.",
            waited.as_millis(),
            a.number,
            attempts.first().map_or("?".into(), |x| x.state.to_string()),
            t.state
        ));
        let r = self
            .claim("executor-reconciler", task.id, NORMAL_LEASE_MS)
            .await?;
        let found = self.provider.lookup(r.task_id);
        let report = match &found {
            Some(p) => {
                ReportBody::committed(r.generation, p.result()).with_external_txn_id(p.txn.clone())
            }
            None => ReportBody::not_committed(r.generation),
        };
        let done = self.exec.report(r.id, &report).await?;
        self.say(format!(
            "executor-reconciler claims attempt {} of kind `{}` (generation {}), looks the task id up at the provider, finds transaction {} and reports {}: 200, task {}.",
            r.number,
            r.kind,
            r.generation,
            found.as_ref().map_or("none".into(), |p| p.txn.clone()),
            report.outcome,
            done.state
        ));
        let delivery_txn = done
            .delivery
            .as_ref()
            .and_then(|d| d.external_txn_id.clone());
        self.say(format!(
            "The agent now reads task {}: {} with {} for the delivery, transaction {}. The provider received {} and {} for it, and paid {}.",
            short(done.id),
            done.state,
            charge(done.delivery.as_ref().map(|d| d.charge), currency_of(&done.params)),
            delivery_txn.clone().unwrap_or_else(|| "none".into()),
            count(self.provider.pay_requests(task.id), "payment request"),
            count(self.provider.lookups(task.id), "lookup"),
            times(self.provider.money_moved(task.id))
        ));
        self.say("Invariant: after an unknown outcome idem reconciles with the provider before anything is repeated; a committed effect is delivered, not paid again.");
        self.check(
            Invariant::ReconcileBeforeRepeat,
            moved && t.state == TaskState::Reconciling && executes == 1,
            "an expired lease of a payment leads to `reconciling`, not to a new execute attempt",
        );
        self.check(
            Invariant::ReconcileBeforeRepeat,
            r.kind == AttemptKind::Reconcile && r.generation > a.generation,
            "the next attempt is a reconcile attempt with a higher generation",
        );
        self.check(
            Invariant::ReconcileBeforeRepeat,
            self.provider.pay_requests(task.id) == 1 && self.provider.lookups(task.id) == 1,
            "the provider is asked once to pay and once to look up, never to pay again",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            done.state == TaskState::Succeeded
                && delivery_txn.as_deref() == Some(payout.txn.as_str())
                && done.delivery.as_ref().map(|d| d.charge) == Some(done.contract.price)
                && self.provider.money_moved(task.id) == 1,
            "the reconciled payout is delivered once, charged the contract price",
        );
        Ok(())
    }

    async fn scene_d(&mut self) -> Result<()> {
        let key = self.key("invoice-D");
        let params = json!({"payee": "acct-carol", "amount": 990, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        self.say(format!(
            "The agent releases {} to acct-carol (key {key}): 201, task {}.",
            money(990, "EUR"),
            short(task.id)
        ));
        let slow = self.claim("executor-slow", task.id, SHORT_LEASE_MS).await?;
        self.say(format!(
            "executor-slow claims attempt {} (generation {}, lease {SHORT_LEASE_MS} ms), then loses its network before calling the provider.",
            slow.number, slow.generation
        ));
        self.unknown_outcome.push(task.id);
        let (_, waited) = self.wait_for(task.id, TaskState::Reconciling).await?;
        let r = self
            .claim("executor-reconciler", task.id, NORMAL_LEASE_MS)
            .await?;
        let found = self.provider.lookup(r.task_id);
        let report = match &found {
            Some(p) => {
                ReportBody::committed(r.generation, p.result()).with_external_txn_id(p.txn.clone())
            }
            None => ReportBody::not_committed(r.generation),
        };
        let after_reconcile = self.exec.report(r.id, &report).await?;
        self.say(format!(
            "The lease ran out (seen after {} ms); reconcile attempt {} (generation {}) found no payout at the provider and reported {}: 200, task {}.",
            waited.as_millis(),
            r.number,
            r.generation,
            report.outcome,
            after_reconcile.state
        ));
        let b = self.claim("executor-2", task.id, NORMAL_LEASE_MS).await?;
        let (payout, _) = self.provider.pay(b.task_id, b.id, &b.params);
        let done = self
            .exec
            .report(
                b.id,
                &ReportBody::succeeded(b.generation, payout.result())
                    .with_external_txn_id(payout.txn.clone()),
            )
            .await?;
        self.say(format!(
            "Only now may the payment be tried again: executor-2 claims attempt {} (generation {}), pays (transaction {}) and reports succeeded: 200, task {}.",
            b.number, b.generation, payout.txn, done.state
        ));
        // The stale executor comes back: it pays (the provider answers with the
        // recorded payout) and reports success with its old generation.
        let (late, moved) = self.provider.pay(slow.task_id, slow.id, &slow.params);
        let stale = self
            .exec
            .report(
                slow.id,
                &ReportBody::succeeded(slow.generation, late.result())
                    .with_external_txn_id(late.txn.clone()),
            )
            .await;
        let current = stale
            .as_ref()
            .err()
            .and_then(|e| e.problem())
            .and_then(|p| p.current_generation);
        self.say(format!(
            "Then executor-slow comes back. Its payment request returns the provider's recorded transaction {} ({}), and its late `succeeded` report with generation {} gets {}{}.",
            late.txn,
            if moved { "money moved AGAIN" } else { "no money moved" },
            slow.generation,
            status_of(&stale),
            current.map_or(String::new(), |g| format!(" (current generation {g})"))
        ));
        let after = self.reader.get_task(task.id).await?;
        let attempts = self.reader.attempts(task.id).await?;
        let kept = attempts.iter().find(|x| x.id == slow.id).is_some_and(|x| {
            x.evidence.iter().any(|e| {
                e.generation == slow.generation
                    && e.outcome == "succeeded"
                    && e.disposition
                        .as_deref()
                        .is_none_or(|d| d == "stale_generation")
            })
        });
        let listing = attempts
            .iter()
            .map(|x| format!("{} {} gen {} {}", x.number, x.kind, x.generation, x.state))
            .collect::<Vec<_>>()
            .join("; ");
        self.say(format!(
            "GET /v1/tasks/{}/attempts still lists every attempt ({listing}); the late report {} attempt {}. The task is {}: {}, transaction {}.",
            short(task.id),
            if kept { "is kept as evidence (stale_generation) on" } else { "is MISSING from the evidence of" },
            slow.number,
            if material(&after) == material(&done) { "unchanged" } else { "CHANGED" },
            after.state,
            after
                .delivery
                .as_ref()
                .and_then(|d| d.external_txn_id.clone())
                .unwrap_or_else(|| "none".into())
        ));
        self.say("Invariant: every attempt has a new id and a higher generation; a superseded executor's output is kept as evidence but cannot replace the authorised result.");
        self.check(
            Invariant::StaleChangesNothing,
            matches!(&stale, Err(e) if e.status() == Some(409) && e.code() == Some("STALE_GENERATION")),
            "a report with an old generation is refused with 409 STALE_GENERATION",
        );
        self.check(
            Invariant::StaleChangesNothing,
            kept,
            "the late report is visible as evidence in /attempts",
        );
        self.check(
            Invariant::StaleChangesNothing,
            material(&after) == material(&done),
            "the late report changes nothing in the task",
        );
        self.check(
            Invariant::ReconcileBeforeRepeat,
            r.kind == AttemptKind::Reconcile
                && report.outcome == idem_client::Outcome::NotCommitted
                && b.kind == AttemptKind::Execute
                && b.generation > r.generation
                && r.generation > slow.generation,
            "a new execute attempt starts only after reconciliation found nothing committed",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            !moved && self.provider.money_moved(task.id) == 1,
            "the provider paid this task once although asked twice",
        );
        Ok(())
    }

    async fn scene_e(&mut self) -> Result<()> {
        // Delivery wins.
        let key = self.key("invoice-E1");
        let params = json!({"payee": "acct-dave", "amount": 5000, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        let a = self.claim("executor-1", task.id, NORMAL_LEASE_MS).await?;
        let (payout, _) = self.provider.pay(a.task_id, a.id, &a.params);
        let cancel = self.agent_patient.cancel(task.id).await?;
        self.say(format!(
            "Task {}, {} to acct-dave: executor-1 has just paid (transaction {}) when the agent asks to cancel: {} with status `{}` (recorded, not yet decided).",
            short(task.id),
            money(5000, "EUR"),
            payout.txn,
            cancel.status,
            cancel.cancellation.status
        ));
        let done = self
            .exec
            .report(
                a.id,
                &ReportBody::succeeded(a.generation, payout.result())
                    .with_external_txn_id(payout.txn.clone()),
            )
            .await?;
        let again = self.agent_patient.cancel(task.id).await?;
        let c = done.cancellation.clone();
        let delivered_charge = done.delivery.as_ref().map(|d| d.charge);
        self.say(format!(
            "The executor's success report arrives first: task {} with {} for the delivery. The cancellation became `{}` with {}, equal to the delivery's charge (after delivery a cancellation costs the full price); asking again answers {} `{}`.",
            done.state,
            charge(delivered_charge, currency_of(&done.params)),
            c.as_ref().map_or("none".into(), |c| c.status.to_string()),
            cancel_fee(c.as_ref().and_then(|c| c.fee), currency_of(&done.params)),
            again.status,
            again.cancellation.status
        ));
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            cancel.status == 202 && cancel.cancellation.status == CancelStatus::Requested,
            "a cancel request while running is recorded (202 `requested`)",
        );
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            done.state == TaskState::Succeeded
                && c.as_ref().is_some_and(|c| c.status == CancelStatus::TooLate && c.fee == delivered_charge)
                && delivered_charge == Some(done.contract.price)
                && again.status == 200
                && again.cancellation.status == CancelStatus::TooLate,
            "when delivery wins, the cancellation is `too_late` and its fee is the delivery's charge",
        );

        // Cancellation wins.
        let key = self.key("invoice-E2");
        let params = json!({"payee": "acct-erin", "amount": 7500, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        let a = self.claim("executor-1", task.id, NORMAL_LEASE_MS).await?;
        let hb1 = self.exec.heartbeat(a.id, a.generation, Some(3)).await?;
        let cancel = self.agent_patient.cancel(task.id).await?;
        let hb2 = self.exec.heartbeat(a.id, a.generation, Some(4)).await?;
        self.say(format!(
            "Task {}, {} to acct-erin: executor-1 is still preparing (heartbeat: cancel requested = {}) when the agent cancels: {} `{}`. The next heartbeat says cancel requested = {}.",
            short(task.id),
            money(7500, "EUR"),
            hb1.cancel_requested,
            cancel.status,
            cancel.cancellation.status,
            hb2.cancel_requested
        ));
        let stopped = self
            .exec
            .report(a.id, &ReportBody::cancelled(a.generation).with_usage(4))
            .await?;
        let c = stopped.cancellation.clone();
        let fees = &stopped.contract.fees;
        let expected_fee = fees["cancel_after_start_fixed"].as_i64().unwrap_or(0)
            + 4 * fees["usage_unit_price"].as_i64().unwrap_or(0);
        self.say(format!(
            "The executor stops without paying and reports cancelled with 4 usage units: task {}, cancellation `{}` with {}: the fixed fee plus 4 units × the unit price, and no delivery charge; generation raised from {} to {}.",
            stopped.state,
            c.as_ref().map_or("none".into(), |c| c.status.to_string()),
            cancel_fee(c.as_ref().and_then(|c| c.fee), currency_of(&stopped.params)),
            a.generation,
            stopped.generation
        ));
        let late = self
            .exec
            .report(
                a.id,
                &ReportBody::succeeded(a.generation, json!({"status": "paid"})),
            )
            .await;
        let after = self.reader.get_task(task.id).await?;
        self.say(format!(
            "A delayed `succeeded` message from the retired attempt gets {}; the task stays {}, with no payout at the provider.",
            status_of(&late),
            after.state
        ));
        self.say("Invariant: cancellation and delivery are ordered by one atomic transition, exactly one wins; a confirmed cancellation retires the executor's authority and keeps its usage.");
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            !hb1.cancel_requested && hb2.cancel_requested && cancel.status == 202,
            "the running executor learns of the pending cancellation from its heartbeat",
        );
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            stopped.state == TaskState::Cancelled
                && c.as_ref().is_some_and(|c| {
                    c.status == CancelStatus::Confirmed && c.fee == Some(expected_fee)
                })
                && stopped.delivery.is_none()
                && stopped.usage == 4
                && stopped.generation > a.generation,
            "a confirmed cancellation raises the generation, keeps usage and charges the frozen fee",
        );
        self.check(
            Invariant::StaleChangesNothing,
            matches!(&late, Err(e) if e.status() == Some(409) && e.code() == Some("STALE_GENERATION"))
                && material(&after) == material(&stopped),
            "a report from the retired attempt is refused with 409 STALE_GENERATION and changes nothing",
        );
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            self.provider.payout(task.id).is_none(),
            "nothing was paid for the cancelled task",
        );
        Ok(())
    }

    /// Checks every task of the run against the provider's ledger.
    async fn audit(&mut self) -> Result<()> {
        let mut delivered = 0;
        let mut cancelled = 0;
        let mut bad: BTreeMap<Invariant, Vec<String>> = BTreeMap::new();
        for id in self.tasks.clone() {
            let t = self.reader.get_task(id).await?;
            let attempts = self.reader.attempts(id).await?;
            let events = self.reader.events(id).await?;
            let payout = self.provider.payout(id);
            let deliveries = events.iter().filter(|e| e.kind == "delivered").count();
            if t.delivery.is_some() {
                delivered += 1;
            }
            let confirmed = t
                .cancellation
                .as_ref()
                .is_some_and(|c| c.status == CancelStatus::Confirmed);
            if confirmed {
                cancelled += 1;
            }
            let mut fail = |inv: Invariant, why: String| {
                bad.entry(inv)
                    .or_default()
                    .push(format!("{} {why}", short(id)));
            };
            // One payout, one delivery, one charge; the provider and idem agree.
            if self.provider.money_moved(id) > 1 || deliveries > 1 {
                fail(
                    Invariant::OneDeliveryOneCharge,
                    "was paid or delivered twice".into(),
                );
            }
            match (&payout, &t.delivery) {
                (Some(p), Some(d)) if d.external_txn_id.as_deref() != Some(p.txn.as_str()) => {
                    fail(
                        Invariant::OneDeliveryOneCharge,
                        "delivered another transaction than the provider paid".into(),
                    );
                }
                (Some(_), None) if t.state.is_terminal() => {
                    fail(
                        Invariant::OneDeliveryOneCharge,
                        "was paid but never delivered".into(),
                    );
                }
                (None, Some(_)) => {
                    fail(
                        Invariant::OneDeliveryOneCharge,
                        "was delivered without a payout".into(),
                    );
                }
                _ => {}
            }
            if t.delivery
                .as_ref()
                .is_some_and(|d| d.charge != t.contract.price)
            {
                fail(
                    Invariant::OneDeliveryOneCharge,
                    "was charged other than its price".into(),
                );
            }
            // After an expired or unknown execute attempt, only a reconcile attempt
            // may follow, and an execute attempt only after `not_committed`.
            let mut previous: Option<(AttemptKind, AttemptState)> = None;
            for a in &attempts {
                if let Some((kind, state)) = previous {
                    let uncertain = kind == AttemptKind::Execute
                        && matches!(state, AttemptState::Expired | AttemptState::Unknown);
                    if a.kind == AttemptKind::Execute
                        && (uncertain
                            || (kind == AttemptKind::Reconcile
                                && state != AttemptState::NotCommitted))
                    {
                        fail(
                            Invariant::ReconcileBeforeRepeat,
                            format!(
                                "started execute attempt {} without reconciliation",
                                a.number
                            ),
                        );
                    }
                }
                previous = Some((a.kind, a.state));
            }
            if attempts
                .windows(2)
                .any(|w| w[1].generation <= w[0].generation)
            {
                fail(
                    Invariant::StaleChangesNothing,
                    "has attempts whose generations do not increase".into(),
                );
            }
            if confirmed && (t.delivery.is_some() || payout.is_some()) {
                fail(
                    Invariant::CancelOrDeliverNeverBoth,
                    "was both cancelled and delivered or paid".into(),
                );
            }
        }
        let n = self.tasks.len();
        self.say(format!(
            "idem's records of all {n} tasks of this run (task, attempts, events) were compared with the provider's ledger: {}, {}, {}.",
            count(self.provider.total_payouts(), "payout"),
            count(delivered, "delivery"),
            count(cancelled, "confirmed cancellation")
        ));
        for inv in [
            Invariant::OneDeliveryOneCharge,
            Invariant::ReconcileBeforeRepeat,
            Invariant::StaleChangesNothing,
            Invariant::CancelOrDeliverNeverBoth,
        ] {
            let problems = bad.remove(&inv).unwrap_or_default();
            if !problems.is_empty() {
                self.say(format!("Problem: {}", problems.join("; ")));
            }
            let expectation = match inv {
                Invariant::OneDeliveryOneCharge => {
                    "every payout is delivered once, with the provider's transaction, at the contract price"
                }
                Invariant::ReconcileBeforeRepeat => {
                    "no task started a new execute attempt after an unknown outcome without `not_committed`"
                }
                Invariant::StaleChangesNothing => {
                    "attempt generations strictly increase within every task"
                }
                _ => "no task is both cancelled and delivered or paid",
            };
            self.check(
                inv,
                problems.is_empty(),
                format!("{expectation} (all {n} tasks)"),
            );
        }
        Ok(())
    }

    /// Cancels any task this run left unfinished (after a failed scene), so that
    /// a shared tenant is not left with pending work.
    async fn cleanup(&mut self) {
        for id in self.tasks.clone() {
            if let Ok(t) = self.reader.get_task(id).await
                && !t.state.is_terminal()
            {
                let _ = self.reader.cancel(id).await;
            }
        }
    }

    fn summary(&mut self) {
        self.line(String::new());
        self.line("Invariants checked");
        let width = Invariant::ALL
            .iter()
            .map(|i| i.title().len())
            .max()
            .unwrap_or(0);
        let scenes_width = 14;
        self.line(format!(
            "  {:<width$}  {:>6}  {:<scenes_width$}  result",
            "invariant", "checks", "checked in"
        ));
        let mut all_ok = self.report.errors.is_empty();
        for inv in Invariant::ALL {
            let checks: Vec<&Check> = self
                .report
                .checks
                .iter()
                .filter(|c| c.invariant == inv)
                .collect();
            let failed = checks.iter().filter(|c| !c.passed).count();
            let mut scenes: Vec<&str> = checks.iter().map(|c| c.scene.as_str()).collect();
            scenes.dedup();
            let ok = failed == 0 && !checks.is_empty();
            all_ok &= ok;
            let result = if checks.is_empty() {
                "FAIL (not checked)".to_owned()
            } else if ok {
                "PASS".to_owned()
            } else {
                format!("FAIL ({failed} failed)")
            };
            let line = format!(
                "  {:<width$}  {:>6}  {:<scenes_width$}  {result}",
                inv.title(),
                checks.len(),
                scenes.join(",")
            );
            self.line(line);
        }
        let total = self.report.checks.len();
        let failed = self.report.checks.iter().filter(|c| !c.passed).count();
        let mut last = String::new();
        if all_ok {
            let _ = write!(last, "Result: PASS, all {total} checks held.");
        } else {
            let _ = write!(
                last,
                "Result: FAIL, {failed} of {total} checks did not hold"
            );
            if !self.report.errors.is_empty() {
                let _ = write!(last, " and {} scene(s) broke off", self.report.errors.len());
            }
            last.push('.');
        }
        self.line(last);
        self.report.passed = all_ok;
    }
}

impl std::fmt::Display for DemoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

/// Turns the report's verdict into a process result: `Err` when a check failed.
///
/// # Errors
/// When the demo did not pass.
pub fn verdict(report: &DemoReport) -> Result<()> {
    if report.passed {
        Ok(())
    } else {
        Err(anyhow!(
            "the demo found {} failed check(s) and {} broken scene(s)",
            report.checks.iter().filter(|c| !c.passed).count(),
            report.errors.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn provider_pays_once_per_task() {
        let p = Provider::default();
        let task = Uuid::now_v7();
        let params = json!({"payee": "x", "amount": 5, "currency": "EUR"});
        let (first, moved) = p.pay(task, Uuid::now_v7(), &params);
        let (second, moved_again) = p.pay(task, Uuid::now_v7(), &params);
        assert!(moved && !moved_again);
        assert_eq!(first, second);
        assert_eq!(p.money_moved(task), 1);
        assert_eq!(p.pay_requests(task), 2);
        assert_eq!(p.lookup(task), Some(first));
        assert_eq!(p.lookup(Uuid::now_v7()), None);
    }

    #[test]
    fn ids_and_money_read_well() {
        let id = Uuid::parse_str("0192f0c4-0000-7000-8000-00000000abcd").unwrap();
        assert_eq!(short(id), "…0000abcd");
        assert_eq!(money(1250, "EUR"), "EUR 12.50 (1250 minor units)");
        assert_eq!(money(5, "EUR"), "EUR 0.05 (5 minor units)");
        assert_eq!(
            charge(Some(100), "EUR"),
            "a charge of EUR 1.00 (100 minor units)"
        );
        assert_eq!(charge(None, "EUR"), "no charge");
        assert_eq!(
            cancel_fee(Some(14), "EUR"),
            "a cancellation fee of EUR 0.14 (14 minor units)"
        );
        assert_eq!(cancel_fee(None, "EUR"), "no cancellation fee");
        assert_eq!(count(2, "delivery"), "2 deliveries");
        assert_eq!(count(1, "payout"), "1 payout");
        let lines = wrap("one two three four", 12, "  ", "    ");
        assert_eq!(lines, ["  one two", "    three", "    four"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_demo_passes_in_process() {
        let report = run(DemoOptions::default()).await.unwrap();
        println!("{report}");
        assert!(report.passed, "{report}");
        // Amounts, charges and fees carry their units and say which is which.
        let text = report
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for said in [
            "release EUR 12.50 (1250 minor units) to acct-alice",
            "1 delivery with a charge of EUR 1.00 (100 minor units)",
            "`too_late` with a cancellation fee of EUR 1.00 (100 minor units), equal to the delivery's charge",
            "`confirmed` with a cancellation fee of EUR 0.14 (14 minor units): the fixed fee plus 4 units",
        ] {
            assert!(text.contains(said), "{said:?} in {text}");
        }
    }
}
