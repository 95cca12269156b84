//! Waiting for a result (SPEC §4, "Waiting"): `Prefer: wait=N` on a task read
//! and on a submit (a replay's too) holds the answer until the task is
//! terminal or N seconds passed, answers with `Preference-Applied`, and ends at
//! once when the server shuts down; the same wake-up serves long-poll claims.
//! Across instances on PostgreSQL: `multi_pg`.

use std::time::Duration;

use serde_json::json;

use crate::support::{DEBUG_LOG, Options, Resp, Server, generation, s, send};

/// `GET /v1/tasks/{id}` with `Prefer: wait=N`, in the background.
fn held_read(srv: &Server, id: &str, prefer: &str) -> tokio::task::JoinHandle<Resp> {
    let req = srv
        .http
        .get(format!("{}/v1/tasks/{id}", srv.url))
        .bearer_auth(&srv.keys.acme)
        .header("prefer", prefer.to_owned());
    tokio::spawn(send(req))
}

/// Claims the task's attempt and reports it succeeded.
async fn deliver(srv: &Server, task_id: &str) {
    let a = srv.claim_one("generation.dispatch", None).await;
    assert_eq!(a["task_id"], json!(task_id));
    let r = srv
        .report(
            &s(&a["id"]),
            json!({"generation": a["generation"], "outcome": "succeeded", "result": {"url": "u"}}),
        )
        .await;
    r.ok(200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_read_answers_with_the_delivered_task() {
    let srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let t = srv
        .new_task("w-1", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let held = held_read(&srv, &id, "wait=30");
    srv.wait_log(&format!("task wait holding task_id={id}"))
        .await;
    assert!(!held.is_finished(), "the read waits for the task to end");
    deliver(&srv, &id).await;
    let r = held.await.expect("join");
    assert_eq!(r.ok(200)["task"]["state"], json!("succeeded"), "{}", r.text);
    assert_eq!(r.header("preference-applied"), "wait=30");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_read_runs_out_with_the_task_as_it_is() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("w-2", "generation.dispatch", generation("x"))
        .await;
    let started = std::time::Instant::now();
    let r = held_read(&srv, &s(&t["id"]), "wait=1").await.expect("join");
    assert_eq!(r.ok(200)["task"]["state"], json!("queued"), "{}", r.text);
    assert_eq!(r.header("preference-applied"), "wait=1");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "answered before the wait ran out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_task_is_answered_at_once_and_the_wait_is_capped_at_60() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("w-3", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    deliver(&srv, &id).await;
    let r = held_read(&srv, &id, "respond-async, wait=600")
        .await
        .expect("join");
    assert_eq!(r.ok(200)["task"]["state"], json!("succeeded"));
    assert_eq!(r.header("preference-applied"), "wait=60");
    // A `wait` that is not a number of seconds is ignored (RFC 7240 §2).
    for prefer in ["wait=soon", "wait=-1", "wait=1.5", "return=minimal"] {
        let r = held_read(&srv, &id, prefer).await.expect("join");
        r.ok(200);
        assert_eq!(r.header("preference-applied"), "", "{prefer}");
    }
    // Another tenant's task is still a 404, waited for or not.
    let req = srv
        .http
        .get(format!("{}/v1/tasks/{id}", srv.url))
        .bearer_auth(&srv.keys.other)
        .header("prefer", "wait=5");
    send(req).await.assert_problem(404, "NOT_FOUND");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_and_its_replay_wait_for_the_result() {
    let srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let submit = |key: &'static str| {
        let req = srv
            .submit_req(&srv.keys.acme)
            .header("Idempotency-Key", key)
            .header("prefer", "wait=30")
            .body(
                json!({"operation": "generation.dispatch", "params": generation("x")}).to_string(),
            );
        tokio::spawn(send(req))
    };
    let first = submit("w-4");
    let a = srv.claim_one("generation.dispatch", None).await;
    let id = s(&a["task_id"]);
    srv.wait_log(&format!("task wait holding task_id={id}"))
        .await;
    let replay = submit("w-4");
    // Both wait: the first and the replay are held on the same task.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while srv
        .log()
        .matches(&format!("task wait holding task_id={id}"))
        .count()
        < 2
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replay is not held"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = srv
        .report(
            &s(&a["id"]),
            json!({"generation": a["generation"], "outcome": "succeeded", "result": {"url": "u"}}),
        )
        .await;
    r.ok(200);
    for (held, replayed) in [(first, false), (replay, true)] {
        let r = held.await.expect("join");
        let v = r.ok(201);
        assert_eq!(v["task"]["state"], json!("succeeded"), "{}", r.text);
        assert_eq!(v["meta"]["replayed"], json!(replayed));
        assert!(v["meta"]["key_expires_at"].is_string(), "{}", r.text);
        assert_eq!(r.header("preference-applied"), "wait=30");
    }
}

/// SIGTERM ends a held wait at once: the read answers with the task as it is
/// and the process exits cleanly, long before the 60 s wait would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_a_held_wait_at_once() {
    let mut srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let t = srv
        .new_task("w-5", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let held = held_read(&srv, &id, "wait=60");
    srv.wait_log(&format!("task wait holding task_id={id}"))
        .await;
    let started = std::time::Instant::now();
    let status = tokio::task::block_in_place(|| srv.terminate());
    let r = held.await.expect("join");
    assert!(status.success(), "exit status {status:?}");
    assert_eq!(r.ok(200)["task"]["state"], json!("queued"), "{}", r.text);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown waited {:?}: the held read held it",
        started.elapsed()
    );
}

/// Waiting claims of one class are woken by work of their class only, one
/// per task: with three claims waiting for `payment.release` and one for
/// `generation.dispatch`, a generation task goes to the generation waiter
/// and the payment waiters keep waiting until payment tasks come, each
/// taking one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_task_wakes_a_waiter_of_its_class() {
    let srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let waiter = |executor: &str, op: &str| {
        let req = srv
            .http
            .post(format!("{}/v1/attempts/claim", srv.url))
            .bearer_auth(&srv.keys.exec)
            .json(&json!({"executor_id": executor, "operations": [op], "wait_ms": 30000}));
        tokio::spawn(send(req))
    };
    let payers: Vec<_> = (0..3)
        .map(|i| waiter(&format!("pay-{i}"), "payment.release"))
        .collect();
    let generator = waiter("gen", "generation.dispatch");
    for name in ["pay-0", "pay-1", "pay-2", "gen"] {
        srv.wait_log(&format!("claim waiting for work executor_id={name}"))
            .await;
    }
    let g = srv
        .new_task("w-6", "generation.dispatch", generation("x"))
        .await;
    let r = generator.await.expect("join");
    let got = r.ok(200)["attempts"].as_array().expect("array").clone();
    assert_eq!(got.len(), 1, "{}", r.text);
    assert_eq!(got[0]["task_id"], g["id"]);
    assert!(
        payers.iter().all(|p| !p.is_finished()),
        "no payment work yet"
    );
    let mut submitted = Vec::new();
    for i in 0..3 {
        let t = srv
            .new_task(
                &format!("w-7-{i}"),
                "payment.release",
                crate::support::payment(10 + i),
            )
            .await;
        submitted.push(t["id"].clone());
    }
    let mut claimed = Vec::new();
    for p in payers {
        let r = p.await.expect("join");
        let got = r.ok(200)["attempts"].as_array().expect("array").clone();
        assert_eq!(got.len(), 1, "each waiter takes one task: {}", r.text);
        claimed.push(got[0]["task_id"].clone());
    }
    claimed.sort_by_key(|v| v.to_string());
    submitted.sort_by_key(|v| v.to_string());
    assert_eq!(claimed, submitted);
}

/// A task that becomes claimable only after a backoff (here a reconcile
/// repeated 1 s after a failed one) wakes a waiting claim when the backoff
/// has passed: the claim, waiting 3 s, gets it without waiting for the
/// group's 5 s re-check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_claim_is_woken_when_a_backoff_ends() {
    let srv = Server::start_with(
        Options::fast()
            .env(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS",
                "1000",
            )
            .env(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS",
                "1000",
            )
            .env("RUST_LOG", DEBUG_LOG),
    )
    .await;
    let t = srv
        .new_task("w-8", "payment.release", crate::support::payment(40))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    srv.report(
        &s(&a["id"]),
        json!({"generation": a["generation"], "outcome": "unknown"}),
    )
    .await
    .ok(200);
    let r = srv.claim_one("payment.release", None).await;
    assert_eq!(r["kind"], json!("reconcile"));
    srv.report(
        &s(&r["id"]),
        json!({"generation": r["generation"], "outcome": "failed", "failure_class": "transient"}),
    )
    .await
    .ok(200);
    let req = srv
        .http
        .post(format!("{}/v1/attempts/claim", srv.url))
        .bearer_auth(&srv.keys.exec)
        .json(&json!({"executor_id": "due", "operations": ["payment.release"], "wait_ms": 3000}));
    let r = send(req).await;
    let got = r.ok(200)["attempts"].as_array().expect("array").clone();
    assert_eq!(got.len(), 1, "woken when the backoff ended: {}", r.text);
    assert_eq!(got[0]["task_id"], json!(id));
    assert_eq!(got[0]["kind"], json!("reconcile"));
}

/// A key revoked while its claim waits gets no work: woken by a task, the
/// claim answers 401 and leases nothing; the task waits for another executor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_key_was_revoked_while_it_waited_leases_nothing() {
    let srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let (key_id, key) = srv.create_key("acme", "executor", None);
    let req = srv
        .http
        .post(format!("{}/v1/attempts/claim", srv.url))
        .bearer_auth(&key)
        .json(&json!({"executor_id": "revoked", "operations": ["generation.dispatch"], "wait_ms": 30000}));
    let held = tokio::spawn(send(req));
    srv.wait_log("claim waiting for work executor_id=revoked")
        .await;
    tokio::task::block_in_place(|| srv.revoke_key(&key_id));
    let t = srv
        .new_task("w-9", "generation.dispatch", generation("x"))
        .await;
    let r = held.await.expect("join");
    r.assert_problem(401, "UNAUTHENTICATED");
    let id = s(&t["id"]);
    assert_eq!(srv.task(&id).await["state"], json!("queued"));
    assert!(srv.attempts(&id).await.is_empty());
}
