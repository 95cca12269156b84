//! The timeline drawn from histories the real store wrote (a SQLite store in
//! a temporary directory, moved by a test clock): lanes, stale evidence,
//! escaping, the description, and the bounds of empty and long histories.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use idem_core::config::{Backoff, Config, Contract};
use idem_core::contract::FrozenContract;
use idem_core::fingerprint::canonical_request;
use idem_core::machine::Report;
use idem_core::machine::operator::{Actor, By, Reason, Resolution};
use idem_core::model::{ApiKey, Attempt, Event, FailureClass, Outcome, Role, Task, Timestamp};
use idem_store::ops::{ClaimRequest, Submission, SubmitOutcome};
use idem_store::{Clock, Guarded, Store};
use idem_store_sqlite::{SqliteBackend, SqliteOptions};
use serde_json::{Value, json};

use super::*;

const TENANT: &str = "acme";
const NON_SAFE: &str = "payment.release";
const SAFE: &str = "generation.dispatch";
const SCRIPT: &str = "<script>alert(1)</script>";
const IMG: &str = "\"><img src=x onerror=alert(1)>";

/// A fresh store on a temporary file, with a test clock.
fn store() -> Store {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = SqliteOptions {
        clock: Clock::test(),
    };
    let backend = SqliteBackend::open(dir.path().join("idem.db"), options).expect("open store");
    Store::new(Guarded::new(backend, dir))
}

/// The bundled contract of `op` with a 10 s lease and short backoffs.
fn contract(op: &str) -> Contract {
    let mut c = Config::bundled()
        .expect("bundled config")
        .contract(op)
        .expect("class");
    c.lease.default_ms = 10_000;
    c.retry.backoff = Backoff {
        initial_ms: 10,
        multiplier: 1.0,
        max_ms: 10,
    };
    c
}

/// One tenant's client key on one store.
struct Ctx {
    store: Store,
    key: ApiKey,
}

impl Ctx {
    async fn new() -> Ctx {
        let store = store();
        let (key, _) = store
            .create_api_key(TENANT, Role::Client, None)
            .await
            .expect("key");
        Ctx { store, key }
    }

    async fn submit(&self, op: &str, idempotency_key: &str, params: Value, c: Contract) -> Task {
        let config = Config::bundled().expect("bundled config");
        let class = config.operations.get(op).expect("class");
        let canonical = canonical_request(op, &params, &class.fingerprint).expect("canonical");
        let s = Submission {
            tenant: TENANT.to_owned(),
            operation: op.to_owned(),
            idempotency_key: idempotency_key.to_owned(),
            fingerprint: canonical.fingerprint.to_string(),
            canonical_request: canonical.canonical,
            params,
            contract: FrozenContract::new(c).expect("frozen"),
            api_key_id: self.key.id,
            grant: None,
            traceparent: None,
            rate_limits: Vec::new(),
            concurrency_key: None,
            priority: 3,
            fairness_key: None,
        };
        match self.store.submit(s).await.expect("submit") {
            SubmitOutcome::Created(t) => t,
            other => panic!("expected a new task, got {other:?}"),
        }
    }

    async fn claim(&self, op: &str, executor: &str) -> Attempt {
        let req = ClaimRequest {
            tenant: TENANT.to_owned(),
            operations: vec![op.to_owned()],
            executor_id: executor.to_owned(),
            max: 1,
            lease_ms: None,
            flow: Default::default(),
        };
        let mut got = self.store.claim(req).await.expect("claim");
        assert_eq!(got.len(), 1, "one claimable attempt");
        got.remove(0).attempt
    }

    /// Applies `r` to `a`; refusals (stale, already reported) are the
    /// point of some calls and are not checked.
    async fn report(&self, a: &Attempt, r: Report) {
        self.store
            .report(TENANT, a.id, r)
            .await
            .expect("report reaches the store")
            .ok();
    }

    fn pass(&self, ms: u64) {
        self.store.clock().advance(Duration::from_millis(ms));
    }

    async fn sweep(&self) {
        self.store.sweep(100).await.expect("sweep");
    }

    /// The three reads the task page makes.
    async fn read(&self, id: uuid::Uuid) -> (Task, Vec<Attempt>, Vec<Event>) {
        let task = self.store.get_task(Some(TENANT), id).await.expect("get");
        let attempts = self.store.list_attempts(Some(TENANT), id).await.expect("a");
        let events = self.store.list_events(Some(TENANT), id).await.expect("e");
        (
            task.expect("task"),
            attempts.expect("attempts"),
            events.expect("events"),
        )
    }
}

/// A report body in step with its fields, as the HTTP layer builds it.
fn report(generation: i64, outcome: Outcome) -> Report {
    Report {
        generation,
        outcome,
        result: None,
        failure_class: None,
        message: None,
        usage: None,
        external_txn_id: None,
        body: json!({"generation": generation, "outcome": outcome.as_str()}),
    }
}

fn with(mut r: Report, key: &str, v: Value) -> Report {
    match key {
        "result" => r.result = Some(v.clone()),
        "message" => r.message = v.as_str().map(str::to_owned),
        "usage" => r.usage = v.as_i64(),
        "external_txn_id" => r.external_txn_id = v.as_str().map(str::to_owned),
        "failure_class" => r.failure_class = v.as_str().and_then(|c| c.parse().ok()),
        _ => {}
    }
    if let Some(b) = r.body.as_object_mut() {
        b.insert(key.to_owned(), v);
    }
    r
}

/// The markup of the lane of `a`: from its `<g class="lane` to the next row.
fn lane_of<'a>(out: &'a str, a: &Attempt) -> &'a str {
    let at = out
        .find(&format!("data-attempt-id=\"{}\"", a.id))
        .expect("a lane for the attempt");
    let start = out[..at].rfind("<g class=\"lane").expect("lane start");
    let rest = &out[at..];
    let end = ["<g class=\"lane", "<g class=\"row"]
        .iter()
        .filter_map(|m| rest.find(m))
        .min()
        .map_or(out.len(), |e| at + e);
    &out[start..end]
}

fn attr(out: &str, name: &str) -> f64 {
    let key = format!(" {name}=\"");
    let at = out.find(&key).expect("attribute") + key.len();
    let len = out[at..].find('"').expect("closing quote");
    out[at..at + len].parse().expect("number")
}

fn assert_clean(out: &str) {
    assert!(!out.contains("style="), "no style attribute");
    assert!(!out.contains("<script"), "no script element");
    assert!(!out.contains("<img"), "no injected element");
    assert!(!out.contains("/>"), "every element closed explicitly");
    assert!(out.starts_with(
        "<svg class=\"timeline\" role=\"img\" aria-labelledby=\"timeline-title timeline-desc\""
    ));
    assert!(out.contains("<title id=\"timeline-title\">"));
    assert!(out.contains("<desc id=\"timeline-desc\">"));
}

/// An execute attempt whose lease runs out (payment: the outcome is
/// unknown), a reconcile attempt that reports unknown, a third that finds
/// the payment committed; the first attempt's late report is stale evidence;
/// the client acknowledges the delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciled_payment_with_stale_evidence() {
    let c = Ctx::new().await;
    let params = json!({"payee": SCRIPT, "amount": 1000, "currency": "EUR", "memo": IMG});
    let task = c.submit(NON_SAFE, IMG, params, contract(NON_SAFE)).await;
    let executor = format!("exec-{SCRIPT}");
    let a1 = c.claim(NON_SAFE, &executor).await;
    c.pass(1_000);
    c.store
        .heartbeat(TENANT, a1.id, a1.generation, Some(3))
        .await
        .expect("heartbeat")
        .expect("live lease");
    c.pass(10_001);
    c.sweep().await;
    let a2 = c.claim(NON_SAFE, "reconciler-1").await;
    c.pass(5);
    let late = with(
        report(1, Outcome::Succeeded),
        "result",
        json!({"x": SCRIPT}),
    );
    c.report(&a1, late).await;
    c.pass(5);
    let unknown = with(report(2, Outcome::Unknown), "message", json!(IMG));
    c.report(&a2, unknown).await;
    c.pass(20);
    c.sweep().await;
    let a3 = c.claim(NON_SAFE, "reconciler-2").await;
    c.pass(5);
    let committed = with(
        report(3, Outcome::Committed),
        "result",
        json!({"note": SCRIPT}),
    );
    let committed = with(committed, "external_txn_id", json!("txn-42"));
    c.report(&a3, committed).await;
    c.store
        .acknowledge_delivery(TENANT, task.id)
        .await
        .expect("ack")
        .expect("delivered");
    let (task, attempts, events) = c.read(task.id).await;
    assert_eq!(task.state.as_str(), "succeeded");
    let now = Timestamp(task.updated_at.0 + 60_000);
    let out = svg(&task, &attempts, &events, now).into_string();
    assert_clean(&out);

    assert_eq!(
        out.matches("<g class=\"lane ").count(),
        3,
        "one lane per attempt"
    );
    for (a, kind) in [(&a1, "execute"), (&a2, "reconcile"), (&a3, "reconcile")] {
        let tag = format!(
            "data-attempt-id=\"{}\" data-number=\"{}\" data-generation=\"{}\" data-kind=\"{kind}\"",
            a.id, a.number, a.generation
        );
        assert!(out.contains(&tag), "lane of attempt {}: {tag}", a.number);
    }
    let first = lane_of(&out, &a1);
    assert!(first.contains("<g class=\"marker stale\""), "{first}");
    assert!(first.contains(">stale succeeded</text>"), "{first}");
    assert!(first.contains("<g class=\"marker heartbeat\""), "{first}");
    assert!(first.contains(">usage 3</text>"), "{first}");
    assert!(first.contains(">lease expired</text>"), "{first}");
    assert!(
        first.contains("exec-&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{first}"
    );
    assert!(
        !lane_of(&out, &a2).contains("stale"),
        "only the fenced-out report is stale"
    );
    assert!(lane_of(&out, &a2).contains(">unknown</text>"));
    assert!(lane_of(&out, &a3).contains("marker report outcome-committed"));
    assert!(
        out.contains(">delivered · charge "),
        "delivery with its charge"
    );
    assert!(out.contains(">delivery acknowledged</text>"));
    assert!(out.contains("external transaction id txn-42"));
    assert!(out.contains("key expires"), "the key's expiry");
    assert!(out.contains("&lt;script&gt;"), "data shown as text");
    assert!(
        out.contains("&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"),
        "{out}"
    );

    let desc = &out[out.find("<desc").unwrap()..out.find("</desc>").unwrap()];
    for part in [
        "3 attempts",
        "attempt 1 generation 1 execute lease expired",
        "attempt 2 generation 2 reconcile reported unknown",
        "attempt 3 generation 3 reconcile reconciled committed",
        "stale succeeded from attempt 1 generation 1",
        "delivered, charge",
        "acknowledged",
        "state succeeded",
    ] {
        assert!(desc.contains(part), "desc has `{part}`: {desc}");
    }
}

/// Cancellation against delivery: requested while the attempt runs, then
/// the attempt delivers: too late, with the charge as its fee. And a queued
/// task's cancellation, confirmed at once with its fee.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_too_late_and_confirmed() {
    let c = Ctx::new().await;
    let t = c
        .submit(
            NON_SAFE,
            "pay-1",
            json!({"payee": "a", "amount": 5, "currency": "EUR"}),
            contract(NON_SAFE),
        )
        .await;
    let a = c.claim(NON_SAFE, "exec-1").await;
    c.pass(10);
    c.store
        .cancel(TENANT, t.id)
        .await
        .expect("cancel")
        .expect("recorded");
    c.pass(10);
    let done = with(report(1, Outcome::Succeeded), "result", json!({"ok": true}));
    c.report(&a, done).await;
    let (task, attempts, events) = c.read(t.id).await;
    let out = svg(&task, &attempts, &events, task.updated_at).into_string();
    assert_clean(&out);
    assert!(out.contains(">cancel requested</text>"));
    assert!(out.contains("marker cancel-too-late"));
    // One charge: the fee of a cancellation that lost to delivery is named
    // as the delivery's charge, never as a second amount.
    assert!(out.contains(">too late: fee is the charge</text>"), "{out}");
    assert!(
        out.contains("fee: the delivery&#39;s charge, not a second charge")
            || out.contains("fee: the delivery's charge, not a second charge"),
        "{out}"
    );
    assert!(
        out.contains("cancellation too late, its fee the delivery"),
        "{out}"
    );
    assert!(
        !out.contains(&format!("fee {}", task.contract.price)),
        "no second amount beside the charge: {out}"
    );

    let q = c
        .submit(
            NON_SAFE,
            "pay-2",
            json!({"payee": "b", "amount": 6, "currency": "EUR"}),
            contract(NON_SAFE),
        )
        .await;
    c.store
        .cancel(TENANT, q.id)
        .await
        .expect("cancel")
        .expect("recorded");
    let (task, attempts, events) = c.read(q.id).await;
    let out = svg(&task, &attempts, &events, task.updated_at).into_string();
    assert_clean(&out);
    assert!(out.contains("marker cancel-confirmed"));
    assert!(out.contains(">cancelled · fee "));
    assert!(out.contains("No attempts yet"), "0 attempts render");
    assert_eq!(out.matches("<g class=\"lane ").count(), 0);
}

/// An operator settles a reconciling payment; the retired reconcile
/// attempt's later report is stale; the reason (markup) is shown as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_resolution() {
    let c = Ctx::new().await;
    let t = c
        .submit(
            NON_SAFE,
            "pay-3",
            json!({"payee": "c", "amount": 7, "currency": "EUR"}),
            contract(NON_SAFE),
        )
        .await;
    let a1 = c.claim(NON_SAFE, "exec-1").await;
    c.report(&a1, report(1, Outcome::Unknown)).await;
    let a2 = c.claim(NON_SAFE, "reconciler").await;
    let by = By {
        actor: Actor::ApiKey(c.key.id),
        reason: Reason::parse(&format!("bank says paid {SCRIPT}")).expect("reason"),
    };
    let resolution = Resolution::Committed {
        result: json!({"paid": true}),
        external_txn_id: Some("txn-7".to_owned()),
    };
    c.pass(10);
    c.store
        .resolve(Some(TENANT), t.id, by, resolution)
        .await
        .expect("resolve")
        .expect("resolved");
    c.pass(10);
    c.report(&a2, report(2, Outcome::NotCommitted)).await;
    let (task, attempts, events) = c.read(t.id).await;
    let out = svg(&task, &attempts, &events, task.updated_at).into_string();
    assert_clean(&out);
    assert!(
        out.contains(">operator: resolved committed</text>"),
        "{out}"
    );
    assert!(out.contains("bank says paid &lt;script&gt;"));
    assert!(lane_of(&out, &a2).contains(">stale not_committed</text>"));
    assert!(out.contains("resolved committed by an operator"));
}

/// A live task: the axis runs to `now`, the lease bar is live, a `now`
/// line is drawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_task_runs_to_now() {
    let c = Ctx::new().await;
    let t = c
        .submit(
            SAFE,
            "gen-1",
            json!({"prompt": "a lighthouse", "steps": 3}),
            contract(SAFE),
        )
        .await;
    let a = c.claim(SAFE, "gpu-7").await;
    let (task, attempts, events) = c.read(t.id).await;
    let now = Timestamp(a.leased_at.0 + 60_000);
    let out = svg(&task, &attempts, &events, now).into_string();
    assert_clean(&out);
    assert!(out.contains("<g class=\"now\">"));
    assert!(out.contains("lease state-leased live"));
    assert!(out.contains(&format!("data-axis-end=\"{}\"", now.0)));
    assert!(out.contains("holds the lease"));
}

/// Thirty attempts (transient failures on a safe class until the attempts
/// run out) render, every lane [`LANE_H`] high, the picture no taller than
/// its rows, the description bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_attempts_stay_within_their_lanes() {
    let c = Ctx::new().await;
    let mut k = contract(SAFE);
    k.retry.max_attempts = 30;
    let t = c
        .submit(SAFE, "gen-30", json!({"prompt": "many", "steps": 1}), k)
        .await;
    let long = format!("{} {SCRIPT}", "x".repeat(300));
    for g in 1..=30 {
        let a = c.claim(SAFE, &format!("gpu-{g}-{}", "y".repeat(60))).await;
        let r = with(
            report(g, Outcome::Failed),
            "failure_class",
            json!("transient"),
        );
        c.report(&a, with(r, "message", json!(long))).await;
        c.pass(20);
        c.sweep().await;
    }
    let (task, attempts, events) = c.read(t.id).await;
    assert_eq!(attempts.len(), 30);
    assert_eq!(
        task.failure.as_ref().map(|f| f.class),
        Some(FailureClass::AttemptsExhausted)
    );
    let out = svg(&task, &attempts, &events, task.updated_at).into_string();
    assert_clean(&out);
    assert_eq!(out.matches("<g class=\"lane ").count(), 30);
    let height = attr(&out, "height");
    assert!(
        height <= AXIS_H + BOTTOM_PAD + 32.0 * LANE_H,
        "height {height}"
    );
    for a in &attempts {
        let lane = lane_of(&out, a);
        assert!(
            lane.contains(&format!("height=\"{}\"", n(LANE_H))),
            "{lane}"
        );
        let shown = truncate(&format!("executor {}", a.executor_id), GUTTER_CHARS);
        assert!(shown.ends_with('…'), "{shown}");
        assert!(
            lane.contains(&format!("{shown}</text>")),
            "executor id truncated: {lane}"
        );
        assert!(lane.contains(&a.executor_id), "full executor id in a title");
    }
    assert!(
        out.contains(&format!("{} &lt;script&gt;", "x".repeat(300))),
        "full message kept in a title"
    );
    let desc = &out[out.find("<desc").unwrap()..out.find("</desc>").unwrap()];
    assert!(
        desc.contains("30 attempts; attempts 1 to 25: 25 reported failed"),
        "{desc}"
    );
    assert!(desc.contains("failed: attempts_exhausted"), "{desc}");
    assert!(desc.len() < 1_000, "bounded description: {desc}");
}

/// Marks of one instant are pushed apart: at least [`MIN_GAP`] between
/// glyphs, and labels on one line never overlap.
#[test]
fn coinciding_marks_stay_legible() {
    let scale = Scale::new((0, 1_000));
    let marks = (0..8)
        .map(|i| {
            Mark::new(Timestamp(500), i, Shape::Dot, "x")
                .label(&format!("label number {i}"))
                .title("t", &[])
        })
        .collect();
    let row = Row::place(marks, &scale);
    let spots: Vec<Spot> = row.marks.iter().map(|(_, s)| *s).collect();
    for w in spots.windows(2) {
        assert!(w[1].x - w[0].x >= MIN_GAP - 1e-9, "{spots:?}");
    }
    for line in 0..2 {
        let on: Vec<(f64, f64)> = row
            .marks
            .iter()
            .filter(|(_, s)| s.line == line)
            .map(|(m, s)| {
                let half = label_width(m.label.as_deref().unwrap_or("")) / 2.0;
                (s.label_x - half, s.label_x + half)
            })
            .collect();
        for w in on.windows(2) {
            assert!(w[1].0 >= w[0].1, "labels overlap on line {line}: {on:?}");
        }
    }
    assert!(row.extent >= spots[7].x);
    assert!(
        spots.iter().all(|s| s.labelled),
        "every essential label shows"
    );
}

/// Crowded optional labels (retries, heartbeats) are left out rather than
/// moving their marks away from their instants; the tooltips stay.
#[test]
fn crowded_optional_labels_give_way() {
    let scale = Scale::new((0, 10_000));
    let marks = (0..40)
        .map(|i| {
            Mark::new(Timestamp(i * 10), i, Shape::Dot, "retry")
                .label("retry in 10 ms")
                .optional()
                .title("another execute attempt may start", &[])
        })
        .collect();
    let row = Row::place(marks, &scale);
    assert!(row.marks.iter().any(|(_, s)| s.labelled));
    assert!(row.marks.iter().any(|(_, s)| !s.labelled));
    for (m, s) in &row.marks {
        let drift = s.x - scale.x(m.at.0);
        assert!(drift <= MAX_DRIFT + 1e-9, "{drift}");
    }
    let out = row
        .marks
        .iter()
        .map(|(m, s)| marker(m, s, 0.0).into_string());
    let out: String = out.collect();
    assert_eq!(
        out.matches("<title>").count(),
        40,
        "every mark keeps its tooltip"
    );
}

#[test]
fn ticks_and_durations_read_well() {
    let t0 = 1_795_000_000_000; // 2026-11-18T…Z
    let scale = Scale::new((t0, t0 + 90_000));
    let ticks = ticks(&scale);
    assert!(
        ticks.at.len() >= 2 && ticks.at.len() <= MAX_TICKS,
        "{:?}",
        ticks.at
    );
    let step = ticks.at[1] - ticks.at[0];
    assert!(STEPS.contains(&step) && step >= 1_000, "{step}");
    assert!(ticks.at.iter().all(|t| t % step == 0), "on whole steps");
    assert!(ticks.at.windows(2).all(|w| w[1] - w[0] == step));
    assert_eq!(ticks.label(t0 + 20_000).len(), 8, "HH:MM:SS");
    let days = Scale::new((t0, t0 + 3 * 86_400_000));
    let ticks = super::ticks(&days);
    assert!(
        ticks.label(ticks.at[0]).contains('-'),
        "dated labels over days"
    );
    assert_eq!(duration(850), "850 ms");
    assert_eq!(duration(12_500), "12.5 s");
    assert_eq!(duration(250_000), "4 min 10 s");
    assert_eq!(truncate("abcdef", 4), "abc…");
}

/// Writes a sample page to `$IDEM_TIMELINE_SAMPLE` (for looking at the
/// picture in a browser); does nothing without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_page() {
    let Ok(path) = std::env::var("IDEM_TIMELINE_SAMPLE") else {
        return;
    };
    let c = Ctx::new().await;
    let params = json!({"payee": SCRIPT, "amount": 1000, "currency": "EUR", "memo": IMG});
    let task = c
        .submit(NON_SAFE, "payout-2026-0042", params, contract(NON_SAFE))
        .await;
    let a1 = c.claim(NON_SAFE, "payments-worker-7f3c").await;
    for u in 1..=4 {
        c.pass(2_000);
        c.store
            .heartbeat(TENANT, a1.id, 1, Some(u * 3))
            .await
            .expect("hb")
            .ok();
    }
    c.pass(10_001);
    c.sweep().await;
    let a2 = c.claim(NON_SAFE, "reconciler-1").await;
    c.pass(5);
    c.report(
        &a1,
        with(report(1, Outcome::Succeeded), "result", json!({"x": 1})),
    )
    .await;
    c.pass(3_000);
    c.report(
        &a2,
        with(
            report(2, Outcome::Unknown),
            "message",
            json!("bank timeout"),
        ),
    )
    .await;
    c.pass(20);
    c.sweep().await;
    let a3 = c.claim(NON_SAFE, "reconciler-2").await;
    c.pass(1_500);
    let committed = with(
        report(3, Outcome::Committed),
        "result",
        json!({"note": "paid"}),
    );
    c.report(&a3, with(committed, "external_txn_id", json!("txn-42")))
        .await;
    c.pass(4_000);
    c.store
        .acknowledge_delivery(TENANT, task.id)
        .await
        .expect("ack")
        .ok();
    let (task, attempts, events) = c.read(task.id).await;
    let mut body = svg(&task, &attempts, &events, task.updated_at).into_string();
    let mut k = contract(SAFE);
    k.retry.max_attempts = 12;
    let t = c
        .submit(SAFE, "gen-12", json!({"prompt": "many", "steps": 1}), k)
        .await;
    for g in 1..=12 {
        let a = c.claim(SAFE, &format!("gpu-{g}")).await;
        c.pass(700);
        if g == 12 {
            break;
        }
        let r = with(
            report(g, Outcome::Failed),
            "failure_class",
            json!("transient"),
        );
        c.report(&a, with(r, "message", json!("out of memory")))
            .await;
        c.pass(20);
        c.sweep().await;
    }
    c.store.cancel(TENANT, t.id).await.expect("cancel").ok();
    c.pass(300);
    let (task, attempts, events) = c.read(t.id).await;
    let now = Timestamp(task.updated_at.0 + 2_000);
    body.push_str(&svg(&task, &attempts, &events, now).into_string());
    let css = include_str!("../../static/timeline.css");
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><title>t</title><style>{css}</style></head><body><main><div class=\"timeline-scroll\">{body}</div></main></body></html>"
    );
    std::fs::write(path, page).expect("write sample");
}
