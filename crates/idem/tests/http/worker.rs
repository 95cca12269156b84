//! The Rust executor runtime (`idem_client::worker`) against a real idem:
//! leases kept by heartbeats, cancellation reaching a running handler,
//! reconcile before any repeat, lease loss, transient retries, shutdown.
//! Leases, backoffs and expiries that must pass run in process on a test
//! clock ([`Server::advance`]); the rest against `idem serve`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_client::Client;
use idem_client::worker::{
    Context, Execution, Handler, HandlerError, HandlerFuture, Reconciliation, Worker,
};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::support::{MOVED_MS, Server, generation, payment, s};

mod faults;

/// A handler whose behaviour is a closure of the call number (1-based,
/// counted per kind), recording each call as `(kind, task)`.
#[derive(Clone, Default)]
struct Scripted {
    calls: Arc<Mutex<Vec<(String, String)>>>,
    execute: Option<Arc<ExecFn>>,
    reconcile: Option<Arc<ReconcileFn>>,
}

type ExecFn = dyn Fn(usize, &Context) -> HandlerFuture<'_, Execution> + Send + Sync;
type ReconcileFn = dyn Fn(usize, &Context) -> HandlerFuture<'_, Reconciliation> + Send + Sync;

impl Scripted {
    fn record(&self, kind: &str, ctx: &Context) -> usize {
        let mut calls = self.calls.lock().unwrap();
        calls.push((kind.to_owned(), ctx.task_id().to_string()));
        calls.iter().filter(|(k, _)| k == kind).count()
    }
    fn kinds(&self) -> Vec<String> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }
}

impl Handler for Scripted {
    fn execute<'a>(&'a self, ctx: &'a Context) -> HandlerFuture<'a, Execution> {
        let n = self.record("execute", ctx);
        match &self.execute {
            Some(f) => f(n, ctx),
            None => Box::pin(async { Ok(Execution::succeeded(json!({"ok": true}))) }),
        }
    }
    fn reconcile<'a>(&'a self, ctx: &'a Context) -> HandlerFuture<'a, Reconciliation> {
        let n = self.record("reconcile", ctx);
        match &self.reconcile {
            Some(f) => f(n, ctx),
            None => Box::pin(async { Ok(Reconciliation::NotCommitted) }),
        }
    }
}

/// Waits until `h`'s handler holds an attempt: a task turns `running` when
/// the claim is granted, before the claim's answer reaches the worker.
async fn handler_started(h: &Scripted) {
    let asked = std::time::Instant::now();
    while h.kinds().is_empty() {
        assert!(asked.elapsed() < Duration::from_secs(30), "never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `worker` until the returned sender is set.
fn spawn(
    worker: Worker,
) -> (
    watch::Sender<bool>,
    tokio::task::JoinHandle<idem_client::Result<()>>,
) {
    let (stop, mut stopped) = watch::channel(false);
    let run = tokio::spawn(worker.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    (stop, run)
}

fn executor(srv: &Server) -> Client {
    Client::new(&srv.url, srv.keys.exec.clone()).unwrap()
}

async fn attempts(srv: &Server, id: &str) -> Vec<Value> {
    srv.attempts(id).await
}

/// A handler that runs for 3.5 leases keeps its one lease by heartbeats:
/// one attempt, generation 1, delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_the_lease_past_three_leases() {
    let srv = Server::fast().await;
    let h = Scripted {
        execute: Some(Arc::new(|_, ctx: &Context| {
            Box::pin(async move {
                ctx.record_usage(2);
                tokio::time::sleep(Duration::from_millis(4200)).await;
                Ok(Execution::succeeded(json!({"ok": 1})))
            })
        })),
        ..Scripted::default()
    };
    let (stop, run) = spawn(
        Worker::new(executor(&srv), "w-lease")
            .with_handler("generation.dispatch", h.clone())
            .with_lease_ms(1200),
    );
    let t = srv
        .new_task("wk-1", "generation.dispatch", generation("x"))
        .await;
    let done = srv.wait_state(&s(&t["id"]), "succeeded").await;
    assert_eq!(done["delivery"]["result"], json!({"ok": 1}));
    let a = attempts(&srv, &s(&t["id"])).await;
    assert_eq!(a.len(), 1, "one lease, kept: {a:?}");
    assert_eq!(a[0]["generation"], json!(1));
    assert_eq!(a[0]["usage"], json!(2));
    assert_eq!(h.kinds(), ["execute"]);
    stop.send_replace(true);
    run.await.unwrap().unwrap();
}

/// A lease under a second is refused before anything is claimed: its local
/// deadline (500 ms before its end) would come before the first heartbeat,
/// or at the claim's send time itself, and every attempt would be given
/// back unstarted and claimed again at once, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_too_short_for_its_margin_is_refused_before_any_claim() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("wk-short", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    for lease_ms in [100, 999] {
        let run = Worker::new(executor(&srv), "w-short")
            .with_handler("generation.dispatch", Scripted::default())
            .with_lease_ms(lease_ms)
            .run(std::future::pending());
        let err = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("refused at once, not run")
            .unwrap_err();
        assert!(
            matches!(err, idem_client::ClientError::InvalidArgument(_)),
            "{err}"
        );
    }
    assert_eq!(srv.task(&id).await["state"], json!("queued"));
    assert!(attempts(&srv, &id).await.is_empty(), "nothing was claimed");
}

/// A cancellation reaches a running handler with its next heartbeat; the
/// handler returns `Cancelled` and the task ends `cancelled`, its usage kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_reaches_the_running_handler() {
    let srv = Server::fast().await;
    let h = Scripted {
        execute: Some(Arc::new(|_, ctx: &Context| {
            Box::pin(async move {
                ctx.record_usage(7);
                ctx.stopped().await;
                assert!(ctx.cancel_requested() && !ctx.lease_lost());
                Ok(Execution::Cancelled)
            })
        })),
        ..Scripted::default()
    };
    let (stop, run) = spawn(
        Worker::new(executor(&srv), "w-cancel")
            .with_handler("generation.dispatch", h.clone())
            .with_lease_ms(1500),
    );
    let t = srv
        .new_task("wk-2", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    srv.wait_task(&id, "running", |t| t["state"] == json!("running"))
        .await;
    let r = srv.cancel(&id).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let done = srv.wait_state(&id, "cancelled").await;
    assert_eq!(done["state"], json!("cancelled"));
    let a = attempts(&srv, &id).await;
    assert_eq!(a[0]["usage"], json!(7), "{a:?}");
    stop.send_replace(true);
    run.await.unwrap().unwrap();
}

/// On `payment.release` (not safe to repeat), an error or a panic in
/// `execute` is reported `unknown`: a reconcile comes next, and the second
/// execute only after it found the effect not committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exception_in_execute_is_reconciled_before_another_execute() {
    let srv = Server::fast().await;
    let h = Scripted {
        execute: Some(Arc::new(|n, _ctx: &Context| {
            Box::pin(async move {
                match n {
                    1 => Err(HandlerError::Unknown("provider timed out".into())),
                    2 => panic!("the handler crashed"),
                    _ => Ok(Execution::succeeded(json!({"payout": "po"}))),
                }
            })
        })),
        ..Scripted::default()
    };
    let (stop, run) =
        spawn(Worker::new(executor(&srv), "w-unknown").with_handler("payment.release", h.clone()));
    let t = srv.new_task("wk-3", "payment.release", payment(30)).await;
    srv.wait_state(&s(&t["id"]), "succeeded").await;
    assert_eq!(
        h.kinds(),
        ["execute", "reconcile", "execute", "reconcile", "execute"]
    );
    stop.send_replace(true);
    run.await.unwrap().unwrap();
}

/// The lease runs out (the clock moves past it): the next heartbeat answers
/// 409, the handler is told, and its late result is kept as evidence only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_told_and_the_late_result_is_evidence_only() {
    let srv = Server::in_process().await;
    let (told_tx, mut told) = watch::channel(false);
    let told_tx = Arc::new(told_tx);
    let h = Scripted {
        execute: Some(Arc::new(move |_, ctx: &Context| {
            let told_tx = Arc::clone(&told_tx);
            Box::pin(async move {
                ctx.stopped().await;
                told_tx.send_replace(ctx.lease_lost());
                Ok(Execution::succeeded(json!({"late": true})))
            })
        })),
        ..Scripted::default()
    };
    let (stop, run) = spawn(
        Worker::new(executor(&srv), "w-lost")
            .with_handler("generation.dispatch", h.clone())
            .with_lease_ms(MOVED_MS as u64)
            .with_heartbeat_every(Duration::from_millis(50)),
    );
    let t = srv
        .new_task("wk-4", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    handler_started(&h).await;
    stop.send_replace(true);
    srv.advance(MOVED_MS + 1_000);
    tokio::time::timeout(Duration::from_secs(20), told.wait_for(|t| *t))
        .await
        .expect("the handler is told within 20 s")
        .unwrap();
    run.await.unwrap().unwrap();
    let a = attempts(&srv, &id).await;
    let evidence = a[0]["evidence"].as_array().unwrap();
    assert_eq!(evidence.len(), 1, "{a:?}");
    assert_eq!(evidence[0]["outcome"], json!("succeeded"));
    assert_eq!(
        evidence[0]["disposition"],
        json!("stale_generation"),
        "{a:?}"
    );
    let task = srv.task(&id).await;
    assert_ne!(
        task["state"],
        json!("succeeded"),
        "a late result changes nothing"
    );
}

/// `transient` on `generation.dispatch` is retried after its backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_retried_after_the_backoff() {
    let srv = Server::in_process().await;
    let h = Scripted {
        execute: Some(Arc::new(|n, _ctx: &Context| {
            Box::pin(async move {
                if n == 1 {
                    Err(HandlerError::Transient("rate limited".into()))
                } else {
                    Ok(Execution::succeeded(json!({"url": "u"})))
                }
            })
        })),
        ..Scripted::default()
    };
    let (stop, run) = spawn(
        Worker::new(executor(&srv), "w-transient")
            .with_handler("generation.dispatch", h.clone())
            .with_poll_wait_ms(200),
    );
    let t = srv
        .new_task("wk-5", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    srv.wait_state(&id, "retry_wait").await;
    assert_eq!(h.kinds(), ["execute"], "nothing before the backoff passes");
    srv.advance(MOVED_MS);
    srv.wait_state(&id, "succeeded").await;
    assert_eq!(h.kinds(), ["execute", "execute"]);
    stop.send_replace(true);
    run.await.unwrap().unwrap();
}

/// Shutdown stops claiming at once, lets the running attempt finish and
/// returns within the grace; work submitted afterwards stays queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_claims_nothing_more_and_returns_within_the_grace() {
    let srv = Server::fast().await;
    let h = Scripted {
        execute: Some(Arc::new(|_, _ctx: &Context| {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok(Execution::succeeded(json!({"ok": true})))
            })
        })),
        ..Scripted::default()
    };
    let (stop, run) = spawn(
        Worker::new(executor(&srv), "w-stop")
            .with_handler("generation.dispatch", h.clone())
            .with_grace(Duration::from_secs(5)),
    );
    let t = srv
        .new_task("wk-6", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    handler_started(&h).await;
    let started = std::time::Instant::now();
    stop.send_replace(true);
    run.await.unwrap().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        srv.task(&id).await["state"],
        json!("succeeded"),
        "the running attempt finished"
    );
    let later = srv
        .new_task("wk-7", "generation.dispatch", generation("y"))
        .await;
    assert_eq!(srv.task(&s(&later["id"])).await["state"], json!("queued"));
    assert!(attempts(&srv, &s(&later["id"])).await.is_empty());
    assert_eq!(h.kinds(), ["execute"]);
}
