//! The payment story of `idem-lab demo`, told by an executor written with
//! `idem_client::worker` against a real `idem serve` and the fake provider of
//! examples/provider (`python3` on the PATH).
//!
//! ```sh
//! cargo build -p idem && cargo run -p idem-example-payments
//! ```
//!
//! It starts `idem serve` on a temporary SQLite store (binary: `$IDEM_BIN`,
//! else `${CARGO_TARGET_DIR:-target}/debug/idem`), creates a client and an executor key, starts the
//! provider (with a relay to idem that can lose answers), runs a worker whose
//! `payment.release` handler pays through the provider with the task id as
//! the provider's idempotency key, and plays four scenes, checking each. Exit
//! status 0 when every check held, 1 otherwise.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use idem_client::worker::{
    Context, Execution, Handler, HandlerError, HandlerFuture, Reconciliation, Worker,
};
use idem_client::{Client, SubmitRetry, TaskFilter};
use serde_json::{Value, json};
use uuid::Uuid;

const OPERATION: &str = "payment.release";

/// The checks made so far and the ones that failed.
#[derive(Default)]
struct Checks {
    failed: Vec<String>,
}

impl Checks {
    fn check(&mut self, ok: bool, what: &str) {
        println!("    {} {what}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            self.failed.push(what.to_owned());
        }
    }
}

fn short(id: impl ToString) -> String {
    let s = id.to_string();
    s[s.len().saturating_sub(8)..].to_owned()
}

/// The executor's handler: pays through the provider, idempotent by task id.
struct Payout {
    http: reqwest::Client,
    provider: String,
}

impl Payout {
    async fn pay(&self, ctx: &Context) -> Result<Execution, HandlerError> {
        let p = ctx.params();
        let body = json!({
            "payee": p["payee"], "amount": p["amount"], "currency": p["currency"],
            "reference": ctx.idempotency_key(),
        });
        let sent = self
            .http
            .post(format!("{}/payouts", self.provider))
            .header("Idempotency-Key", ctx.task_id().to_string())
            .json(&body)
            .send()
            .await;
        // No answer: the payout may have been committed; only a reconcile can tell.
        let answer = sent
            .map_err(|e| HandlerError::Unknown(format!("the provider's answer was lost: {e}")))?;
        if !answer.status().is_success() {
            return Err(HandlerError::Unknown(format!(
                "the provider answered {}",
                answer.status()
            )));
        }
        let payout: Value = answer
            .json()
            .await
            .map_err(|e| HandlerError::Unknown(format!("the provider's answer was cut: {e}")))?;
        let id = payout["id"].as_str().unwrap_or_default().to_owned();
        if p["hold_until_cancelled"] == json!(true) {
            // Scene (d): the money has moved; wait until idem tells us of the
            // cancel request, then finish anyway (it is too late to undo).
            let _ = tokio::time::timeout(Duration::from_secs(15), ctx.stopped()).await;
            println!(
                "    executor: cancel requested = {}, but payout {id} is already made; reporting it",
                ctx.cancel_requested()
            );
        }
        Ok(Execution::Succeeded {
            result: json!({"payout": id}),
            external_txn_id: Some(id),
            usage: None,
        })
    }

    async fn look_up(&self, ctx: &Context) -> Result<Reconciliation, HandlerError> {
        let answer = self
            .http
            .get(format!("{}/payouts/{}", self.provider, ctx.task_id()))
            .send()
            .await
            .map_err(|e| HandlerError::Transient(e.to_string()))?;
        if answer.status() == reqwest::StatusCode::NOT_FOUND {
            println!(
                "    executor: reconcile attempt {}: the provider has no payout for the task",
                ctx.number()
            );
            return Ok(Reconciliation::NotCommitted);
        }
        let payout: Value = answer
            .error_for_status()
            .map_err(|e| HandlerError::Transient(e.to_string()))?
            .json()
            .await
            .map_err(|e| HandlerError::Transient(e.to_string()))?;
        let id = payout["id"].as_str().unwrap_or_default().to_owned();
        println!(
            "    executor: reconcile attempt {}: the provider has payout {id}",
            ctx.number()
        );
        Ok(Reconciliation::Committed {
            result: json!({"payout": id}),
            external_txn_id: Some(id),
        })
    }
}

impl Handler for Payout {
    fn execute<'a>(&'a self, ctx: &'a Context) -> HandlerFuture<'a, Execution> {
        Box::pin(self.pay(ctx))
    }
    fn reconcile<'a>(&'a self, ctx: &'a Context) -> HandlerFuture<'a, Reconciliation> {
        Box::pin(self.look_up(ctx))
    }
}

/// A child process, killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` with its output in `log` and waits until `count` lines
/// containing `marker` appeared; answers the URL ending each.
fn start(
    cmd: &mut Command,
    log: &Path,
    marker: &str,
    count: usize,
) -> Result<(Running, Vec<String>)> {
    let out = std::fs::File::create(log)?;
    let child = cmd
        .stdout(Stdio::from(out.try_clone()?))
        .stderr(Stdio::from(out))
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let mut running = Running(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let text = std::fs::read_to_string(log)?;
        let urls: Vec<String> = text
            .lines()
            .filter(|l| l.contains(marker))
            .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("http://")))
            .map(str::to_owned)
            .collect();
        if urls.len() >= count {
            return Ok((running, urls));
        }
        if running.0.try_wait()?.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("{cmd:?} did not start: {}", std::fs::read_to_string(log)?)
}

struct Stage {
    agent: Client,
    http: reqwest::Client,
    provider: String,
}

impl Stage {
    async fn fault(&self, doc: Value) -> Result<()> {
        self.http
            .post(format!("{}/faults", self.provider))
            .json(&doc)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    async fn ledger(&self) -> Result<Value> {
        Ok(self
            .http
            .get(format!("{}/ledger", self.provider))
            .send()
            .await?
            .json()
            .await?)
    }

    async fn payouts_for(&self, task: Uuid) -> Result<Vec<Value>> {
        let ledger = self.ledger().await?;
        let key = task.to_string();
        Ok(ledger["payouts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["key"] == json!(key))
            .cloned()
            .collect())
    }
}

async fn story(s: &Stage, checks: &mut Checks) -> Result<()> {
    let wait = Duration::from_secs(20);
    // (a) The answer is lost; the same request with the same key names the same task.
    println!("(a) A payout submitted, its answer lost, retried with the same key");
    let params = json!({"payee": "acct-alice", "amount": 1250, "currency": "EUR"});
    s.fault(json!({"drop_link_responses": 1})).await?;
    let policy = SubmitRetry {
        max_tries: 4,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
    };
    let a = s
        .agent
        .submit_with_retry(OPERATION, &params, "invoice-A", &policy)
        .await?;
    let task = s.agent.wait_task(a.task.id, wait).await?;
    println!(
        "    agent: released EUR 12.50 to acct-alice under key invoice-A; the first answer was lost, {} tries in all: task {}, replayed = {}, {}",
        a.tries,
        short(a.task.id),
        a.replayed,
        task.state
    );
    let found = s.agent.find_task(OPERATION, "invoice-A").await?;
    checks.check(
        a.tries >= 2 && a.replayed && !a.looked_up,
        "the retry was answered with the same task, replayed",
    );
    checks.check(
        found.id == a.task.id && task.state.to_string() == "succeeded",
        "the key names that one task, succeeded",
    );
    checks.check(
        s.payouts_for(a.task.id).await?.len() == 1,
        "the provider paid once",
    );

    // (b) The same key with a changed payee is refused.
    println!("(b) The same key with the payee changed");
    let mut other = params.clone();
    other["payee"] = json!("acct-mallory");
    match s.agent.submit(OPERATION, &other, "invoice-A").await {
        Ok(_) => checks.check(false, "a changed payee is refused"),
        Err(e) => {
            let problem = e.problem();
            let differing = problem.and_then(|p| p.differing_fields.clone());
            println!(
                "    agent: refused {} {}, task {}, differing in {:?}",
                e.status().unwrap_or(0),
                e.code().unwrap_or("?"),
                problem.and_then(|p| p.task_id).map_or("?".into(), short),
                differing.clone().unwrap_or_default()
            );
            checks.check(
                e.code() == Some("IDEMPOTENCY_CONFLICT")
                    && differing == Some(vec!["/payee".to_owned()])
                    && problem.and_then(|p| p.task_id) == Some(a.task.id),
                "refused with IDEMPOTENCY_CONFLICT naming the task, differing in /payee",
            );
        }
    }
    checks.check(
        s.payouts_for(a.task.id).await?.len() == 1,
        "the provider's ledger is unchanged",
    );

    // (c) The provider commits, its answer is lost: unknown outcome, reconcile, delivered once.
    println!("(c) The provider commits but its answer is lost");
    s.fault(json!({"drop_response_after_commit": ["invoice-C"]}))
        .await?;
    let c = s
        .agent
        .submit(
            OPERATION,
            &json!({"payee": "acct-bob", "amount": 4200, "currency": "EUR"}),
            "invoice-C",
        )
        .await?;
    let task = s.agent.wait_task(c.task.id, wait).await?;
    let attempts = s.agent.attempts(task.id).await?;
    let kinds: Vec<String> = attempts
        .iter()
        .map(|x| format!("{}:{}", x.kind, x.state))
        .collect();
    let paid = s.payouts_for(task.id).await?;
    let txn = task
        .delivery
        .as_ref()
        .and_then(|d| d.external_txn_id.clone());
    println!(
        "    agent: task {} is {}, attempts {}, delivered transaction {}",
        short(task.id),
        task.state,
        kinds.join(", "),
        txn.clone().unwrap_or_else(|| "none".into())
    );
    checks.check(
        attempts
            .iter()
            .map(|x| x.kind.to_string())
            .collect::<Vec<_>>()
            == ["execute", "reconcile"],
        "the lost answer led to a reconcile, not to a second execute",
    );
    checks.check(
        task.state.to_string() == "succeeded"
            && paid.len() == 1
            && txn.is_some()
            && paid.first().map(|p| p["id"].clone()) == txn.map(Value::from),
        "the reconcile found the payout: delivered once, one payout in the ledger",
    );

    // (d) A cancel that loses to delivery.
    println!("(d) A cancel that arrives while the payout is being made");
    let d = s
        .agent
        .submit(
            OPERATION,
            &json!({"payee": "acct-carol", "amount": 990, "currency": "EUR", "hold_until_cancelled": true}),
            "invoice-D",
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(15);
    while s.payouts_for(d.task.id).await?.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cancel = s.agent.cancel(d.task.id).await?;
    println!(
        "    agent: the provider has paid; cancel → {} {}",
        cancel.status, cancel.cancellation.status
    );
    let task = s.agent.wait_task(d.task.id, wait).await?;
    let events: Vec<String> = s
        .agent
        .events(task.id)
        .await?
        .into_iter()
        .map(|e| e.kind)
        .collect();
    let too_late = task.cancellation.as_ref().map(|c| c.status.to_string());
    let charge = task.delivery.as_ref().map(|d| d.charge);
    println!(
        "    agent: task {} is {}, cancellation {}, delivery charge {}, events {}",
        short(task.id),
        task.state,
        too_late.clone().unwrap_or_else(|| "none".into()),
        charge.map_or("none".into(), |c| c.to_string()),
        events.join(", ")
    );
    checks.check(
        cancel.status == 202 && cancel.cancellation.status.to_string() == "requested",
        "the cancel was recorded while the attempt ran",
    );
    checks.check(
        task.state.to_string() == "succeeded"
            && too_late.as_deref() == Some("too_late")
            && events.iter().any(|e| e == "cancel_too_late"),
        "delivery won: the cancellation is too_late (cancel_too_late)",
    );
    checks.check(
        charge == Some(task.contract.price)
            && events.iter().filter(|e| *e == "delivered").count() == 1
            && s.payouts_for(task.id).await?.len() == 1,
        "delivered once, charged the contract price, one payout",
    );

    // The ledger: one payout per task, none for a refused request.
    let ledger = s.ledger().await?;
    let payouts = ledger["payouts"].as_array().cloned().unwrap_or_default();
    let tasks = s
        .agent
        .task_pages(TaskFilter {
            operation: Some(OPERATION.into()),
            ..TaskFilter::default()
        })
        .collect_all()
        .await?;
    println!(
        "Ledger: {} payouts for {} tasks, {} pay requests, {} lookups, {} answers dropped",
        payouts.len(),
        tasks.len(),
        ledger["pay_requests"],
        ledger["lookups"],
        ledger["dropped"]
    );
    checks.check(
        payouts.len() == tasks.len()
            && tasks.iter().all(|t| {
                payouts
                    .iter()
                    .filter(|p| p["key"] == json!(t.id.to_string()))
                    .count()
                    == 1
            }),
        "exactly one payout per task",
    );
    Ok(())
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn create_key(idem: &Path, store: &str, role: &str) -> Result<String> {
    let out = Command::new(idem)
        .args([
            "keys", "create", "--tenant", "acme", "--role", role, "--store", store,
        ])
        .output()?;
    if !out.status.success() {
        bail!("idem keys create: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// `idem-example-payments worker`: only the executor, for
/// scripts/cross-language.sh. Reads `IDEM_URL`, `IDEM_EXECUTOR_KEY`,
/// `PROVIDER_URL`, `EXECUTOR_ID` (and `LEASE_MS`); runs until SIGTERM or SIGINT.
async fn worker_only() -> Result<std::process::ExitCode> {
    let var = |name: &str| std::env::var(name).with_context(|| format!("${name}"));
    let executor_id = var("EXECUTOR_ID").unwrap_or_else(|_| "payouts-rs".into());
    let lease_ms = var("LEASE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let worker = Worker::new(
        Client::new(&var("IDEM_URL")?, var("IDEM_EXECUTOR_KEY")?)?,
        executor_id.clone(),
    )
    .with_handler(
        OPERATION,
        Payout {
            http,
            provider: var("PROVIDER_URL")?,
        },
    )
    .with_concurrency(8)
    .with_lease_ms(lease_ms)
    .with_poll_wait_ms(1000)
    .with_grace(Duration::from_secs(5));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    println!("worker {executor_id} running");
    worker
        .run(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        })
        .await?;
    println!("worker {executor_id} stopped");
    Ok(std::process::ExitCode::SUCCESS)
}

#[tokio::main]
async fn main() -> Result<std::process::ExitCode> {
    if std::env::args().nth(1).as_deref() == Some("worker") {
        return worker_only().await;
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| repo().join("target"), |t| repo().join(t));
    let idem =
        std::env::var_os("IDEM_BIN").map_or_else(|| target.join("debug/idem"), PathBuf::from);
    let dir = tempfile::Builder::new()
        .prefix("idem-example-rs-")
        .tempdir()?;
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let (_server, urls) = start(
        Command::new(&idem)
            .args(["serve", "--listen", "127.0.0.1:0", "--store", &store])
            .args(["--sweep-interval-ms", "50"])
            .env(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS",
                "50",
            )
            .env(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS",
                "200",
            ),
        &dir.path().join("idem.log"),
        "idem listening on",
        1,
    )
    .with_context(|| format!("idem serve ({})", idem.display()))?;
    let idem_url = urls.first().cloned().unwrap_or_default();
    let client_key = create_key(&idem, &store, "client")?;
    let executor_key = create_key(&idem, &store, "executor")?;
    let (_provider, urls) = start(
        Command::new("python3")
            .arg(repo().join("examples/provider/provider.py"))
            .args(["--link-to", &idem_url]),
        &dir.path().join("provider.log"),
        "listening on",
        2,
    )?;
    let (provider, link) = (urls[0].clone(), urls[1].clone());
    println!("idem at {idem_url}, provider at {provider}, the agent's lossy link at {link}");

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let worker = Worker::new(Client::new(&idem_url, executor_key)?, "payouts-rs")
        .with_handler(
            OPERATION,
            Payout {
                http: http.clone(),
                provider: provider.clone(),
            },
        )
        .with_concurrency(4)
        .with_lease_ms(3000)
        .with_poll_wait_ms(1000);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));
    // The agent talks to idem through the relay that can lose answers.
    let stage = Stage {
        agent: Client::new(&link, client_key)?,
        http,
        provider,
    };
    let mut checks = Checks::default();
    let told = story(&stage, &mut checks).await;
    let _ = stop.send(());
    let _ = running.await;
    told?;
    if checks.failed.is_empty() {
        println!("Every check held.");
        Ok(std::process::ExitCode::SUCCESS)
    } else {
        println!(
            "{} check(s) failed: {:?}",
            checks.failed.len(),
            checks.failed
        );
        Ok(std::process::ExitCode::FAILURE)
    }
}
