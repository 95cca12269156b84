//! The executor protocol — claims, fencing, retries by failure class,
//! reconciliation, limits and authority on retry.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{
    DEBUG_LOG, MOVED_MS, Options, POLL_TIMEOUT, Server, attempt_of, generation, payment, s,
};

#[tokio::test]
async fn executor_claims_the_first_attempt_and_clients_cannot() {
    let srv = Server::fast().await;
    let params = payment(250);
    let t = srv
        .new_task("exec-1", "payment.release", params.clone())
        .await;
    let id = s(&t["id"]);

    // A client key may not claim.
    let r = srv
        .post(
            "/v1/attempts/claim",
            &srv.keys.acme,
            json!({"executor_id": "ex-1"}),
        )
        .await;
    r.assert_problem(403, "PERMISSION_DENIED");
    // Another tenant's executor sees nothing of acme's.
    let r = srv
        .post(
            "/v1/attempts/claim",
            &srv.keys.exec_other,
            json!({"executor_id": "ex-x", "max": 10}),
        )
        .await;
    assert_eq!(r.ok(200)["attempts"], json!([]));

    let a = srv.claim_one("payment.release", None).await;
    uuid::Uuid::parse_str(&s(&a["id"])).expect("attempt id is a UUID");
    assert_eq!(a["task_id"], json!(id));
    assert_eq!(a["number"], json!(1));
    assert_eq!(a["generation"], json!(1));
    assert_eq!(a["kind"], json!("execute"));
    assert_eq!(a["operation"], json!("payment.release"));
    assert_eq!(a["params"], params);
    assert_eq!(a["idempotency_key"], json!("exec-1"));
    assert!(a["lease_expires_at"].is_string());

    let t = srv.task(&id).await;
    assert_eq!(t["state"], json!("running"));
    assert_eq!(t["generation"], json!(1));
    assert_eq!(t["attempt_count"], json!(1));
    // Never leased twice.
    assert_eq!(
        srv.claim_op("payment.release", None).await,
        Vec::<Value>::new()
    );
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0]["state"], json!("leased"));
    assert_eq!(attempts[0]["executor_id"], json!("ex-1"));
    assert_eq!(attempts[0]["kind"], json!("execute"));
}

#[tokio::test]
async fn succeeded_report_delivers_once() {
    let srv = Server::fast().await;
    let params = payment(300);
    let t = srv
        .new_task("deliver-1", "payment.release", params.clone())
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let aid = s(&a["id"]);
    let result = json!({"payout_id": "po_123", "status": "paid"});
    let rep = json!({"generation": 1, "outcome": "succeeded", "result": result, "usage": 3, "external_txn_id": "bank-txn-9"});
    let r = srv.report(&aid, rep.clone()).await;
    let task = r.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("succeeded"));
    let d = &task["delivery"];
    assert_eq!(d["result"], result);
    assert_eq!(d["external_txn_id"], json!("bank-txn-9"));
    assert_eq!(d["charge"], task["contract"]["price"]);
    assert_eq!(d["charge"], json!(100));
    assert!(d["delivered_at"].is_string());
    assert_eq!(d["acknowledged_at"], Value::Null);
    assert_eq!(task["usage"], json!(3));

    // An exact repeat of the report answers 200 with the same task; a different one is 409.
    let again = srv.report(&aid, rep).await;
    assert_eq!(again.ok(200)["task"]["delivery"], task["delivery"]);
    let other = srv
        .report(
            &aid,
            json!({"generation": 1, "outcome": "failed", "failure_class": "transient"}),
        )
        .await;
    other.assert_problem(409, "ATTEMPT_ALREADY_REPORTED");
    let attempts = srv.attempts(&id).await;
    let ev = attempts[0]["evidence"].as_array().expect("evidence");
    assert_eq!(
        ev.len(),
        3,
        "applied, repeat and the refused different report are all evidence: {ev:?}"
    );
    assert_eq!(attempts[0]["state"], json!("succeeded"));
    assert_eq!(attempts[0]["external_txn_id"], json!("bank-txn-9"));
    assert_eq!(attempts[0]["usage"], json!(3));
    assert_eq!(
        srv.task(&id).await["delivery"],
        task["delivery"],
        "unchanged by the refused report"
    );

    // A replayed submit shows the delivery.
    let replay = srv.submit("deliver-1", "payment.release", params).await;
    let rv = replay.ok(201);
    assert_eq!(rv["meta"]["replayed"], json!(true));
    assert_eq!(rv["task"]["state"], json!("succeeded"));
    assert_eq!(rv["task"]["delivery"], task["delivery"]);

    // Delivery acknowledgment: idempotent, charge unchanged.
    let ack1 = srv
        .post(
            &format!("/v1/tasks/{id}/delivery/ack"),
            &srv.keys.acme,
            json!({}),
        )
        .await;
    let d1 = ack1.ok(200)["task"]["delivery"].clone();
    assert!(
        d1["acknowledged_at"].is_string(),
        "acknowledged_at set: {d1}"
    );
    assert_eq!(d1["charge"], json!(100));
    assert_eq!(d1["result"], result);
    let ack2 = srv
        .post(
            &format!("/v1/tasks/{id}/delivery/ack"),
            &srv.keys.acme,
            json!({}),
        )
        .await;
    let d2 = ack2.ok(200)["task"]["delivery"].clone();
    assert_eq!(d2, d1, "the same delivery record");
    // Nothing more to claim; only one attempt.
    assert_eq!(
        srv.claim_op("payment.release", None).await,
        Vec::<Value>::new()
    );
    assert_eq!(srv.attempts(&id).await.len(), 1);
    let delivered = srv
        .events(&id)
        .await
        .iter()
        .filter(|e| e["type"] == json!("delivered"))
        .count();
    assert_eq!(delivered, 1, "one delivery event");
}

#[tokio::test]
async fn expired_lease_on_safe_class_fences_the_old_generation() {
    let srv = Server::in_process().await;
    let t = srv
        .new_task("gen-fence", "generation.dispatch", generation("cat"))
        .await;
    let id = s(&t["id"]);
    let a1 = srv.claim_one("generation.dispatch", Some(MOVED_MS)).await;
    assert_eq!(a1["generation"], json!(1));
    let a1_id = s(&a1["id"]);
    srv.advance(MOVED_MS);
    // The background sweeper expires the lease: the task leaves `running` without any claim.
    let after = srv
        .wait_task(&id, "not running", |t| t["state"] != json!("running"))
        .await;
    assert!(
        after["state"] == json!("retry_wait") || after["state"] == json!("queued"),
        "safe class after an expired lease: {after}"
    );
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a1_id)["state"], json!("expired"));

    let a2 = srv.claim_one("generation.dispatch", None).await;
    assert_eq!(a2["number"], json!(2));
    assert_eq!(a2["generation"], json!(2));
    assert_eq!(a2["kind"], json!("execute"));
    assert_ne!(a2["id"], a1["id"]);
    let before = srv.task(&id).await;
    assert_eq!(before["state"], json!("running"));
    assert_eq!(before["generation"], json!(2));

    // Attempt 1's late success is refused and kept as evidence.
    let late = json!({"generation": 1, "outcome": "succeeded", "result": {"image": "late.png"}, "usage": 4});
    let r = srv.report(&a1_id, late.clone()).await;
    r.assert_problem(409, "STALE_GENERATION");
    let now = srv.task(&id).await;
    assert_eq!(now["state"], json!("running"));
    assert_eq!(now["generation"], json!(2));
    assert_eq!(now["delivery"], Value::Null);
    assert_eq!(now["usage"], before["usage"], "stale usage does not count");
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempts.len(), 2);
    let old = attempt_of(&attempts, &a1_id);
    assert_eq!(old["generation"], json!(1));
    assert_eq!(old["state"], json!("expired"));
    let ev = old["evidence"].as_array().expect("evidence array");
    assert!(
        ev.iter().any(|e| e["generation"] == json!(1)
            && e["outcome"] == json!("succeeded")
            && e["body"] == late),
        "the late report is evidence of attempt 1: {ev:?}"
    );
    assert!(ev.iter().all(|e| e["received_at"].is_string()));
    // Heartbeat and ack with generation 1 are refused as well.
    srv.heartbeat(&a1_id, json!({"generation": 1}))
        .await
        .assert_problem(409, "STALE_GENERATION");
    srv.post(
        &format!("/v1/attempts/{a1_id}/ack"),
        &srv.keys.exec,
        json!({"generation": 1}),
    )
    .await
    .assert_problem(409, "STALE_GENERATION");
    // Presenting the new generation on the old attempt does not help either.
    srv.report(
        &a1_id,
        json!({"generation": 2, "outcome": "succeeded", "result": {}}),
    )
    .await
    .assert_problem(409, "STALE_GENERATION");
    // The live attempt still works.
    let hb = srv
        .heartbeat(&s(&a2["id"]), json!({"generation": 2, "usage": 1}))
        .await;
    assert_eq!(hb.ok(200)["cancel_requested"], json!(false));
    let done = srv
        .report(
            &s(&a2["id"]),
            json!({"generation": 2, "outcome": "succeeded", "result": {"image": "a.png"}}),
        )
        .await;
    let task = done.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("succeeded"));
    assert_eq!(task["delivery"]["result"], json!({"image": "a.png"}));
    assert_eq!(task["delivery"]["charge"], json!(50));
}

/// The process's sweeper counts the leases it expired in `/metrics` (it
/// records nothing for an empty sweep): black-box, the counter is the
/// process's, with the shortest lease the API allows.
#[tokio::test]
async fn the_sweeper_counts_expired_leases() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("count-expiry", "generation.dispatch", generation("cat"))
        .await;
    let id = s(&t["id"]);
    srv.claim_one("generation.dispatch", Some(100)).await;
    srv.wait_task(&id, "not running", |t| t["state"] != json!("running"))
        .await;
    let deadline = std::time::Instant::now() + POLL_TIMEOUT;
    loop {
        let m = srv.call(reqwest::Method::GET, "/metrics", None, None).await;
        let expired = m
            .text
            .lines()
            .find_map(|l| l.strip_prefix("idem_leases_expired_total "))
            .map(str::trim)
            .map(str::to_owned);
        if expired.as_deref() == Some("1") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "idem_leases_expired_total should be 1, got {expired:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// On an in-process server: a non-safe task whose lease runs out is
/// reconciled.
async fn expire_into_reconciling(srv: &Server, ikey: &str) -> (String, Value) {
    let t = srv.new_task(ikey, "payment.release", payment(700)).await;
    let id = s(&t["id"]);
    let a1 = srv.claim_one("payment.release", Some(MOVED_MS)).await;
    assert_eq!(a1["kind"], json!("execute"));
    srv.advance(MOVED_MS);
    let t = srv
        .wait_task(&id, "not running", |t| t["state"] != json!("running"))
        .await;
    assert_eq!(
        t["state"],
        json!("reconciling"),
        "non-safe class after an expired lease: {t}"
    );
    (id, a1)
}

#[tokio::test]
async fn non_safe_expired_lease_reconciles_then_not_committed_executes_again() {
    let srv = Server::in_process().await;
    let (id, a1) = expire_into_reconciling(&srv, "rec-1").await;
    let r = srv.claim_one("payment.release", None).await;
    assert_eq!(r["kind"], json!("reconcile"));
    assert_eq!(r["number"], json!(2));
    assert_eq!(r["generation"], json!(2));
    assert_eq!(r["task_id"], json!(id));
    assert_eq!(srv.task(&id).await["state"], json!("reconciling"));
    // An execute outcome does not fit a reconcile attempt.
    srv.report(
        &s(&r["id"]),
        json!({"generation": 2, "outcome": "succeeded", "result": {}}),
    )
    .await
    .assert_problem(400, "INVALID_REQUEST");
    let rep = srv
        .report(
            &s(&r["id"]),
            json!({"generation": 2, "outcome": "not_committed"}),
        )
        .await;
    let t = rep.ok(200)["task"].clone();
    assert!(
        t["state"] == json!("queued") || t["state"] == json!("retry_wait"),
        "after not_committed: {t}"
    );
    let e = srv.claim_one("payment.release", None).await;
    assert_eq!(e["kind"], json!("execute"));
    assert_eq!(e["number"], json!(3));
    assert_eq!(e["generation"], json!(3));
    assert!(e["generation"].as_i64() > a1["generation"].as_i64());
    let done = srv
        .report(
            &s(&e["id"]),
            json!({"generation": 3, "outcome": "succeeded", "result": {"ok": true}}),
        )
        .await;
    assert_eq!(done.ok(200)["task"]["state"], json!("succeeded"));
    let attempts = srv.attempts(&id).await;
    let kinds: Vec<&Value> = attempts.iter().map(|a| &a["kind"]).collect();
    assert_eq!(
        kinds,
        vec![&json!("execute"), &json!("reconcile"), &json!("execute")]
    );
    let states: Vec<&Value> = attempts.iter().map(|a| &a["state"]).collect();
    assert_eq!(
        states,
        vec![
            &json!("expired"),
            &json!("not_committed"),
            &json!("succeeded")
        ]
    );
}

#[tokio::test]
async fn non_safe_expired_lease_reconciles_then_committed_delivers_without_executing() {
    let srv = Server::in_process().await;
    let (id, _) = expire_into_reconciling(&srv, "rec-2").await;
    let r = srv.claim_one("payment.release", None).await;
    assert_eq!(r["kind"], json!("reconcile"));
    assert_eq!(r["generation"], json!(2));
    let result = json!({"payout_id": "po_found"});
    let rep = srv
        .report(&s(&r["id"]), json!({"generation": 2, "outcome": "committed", "result": result, "external_txn_id": "bank-77"}))
        .await;
    let t = rep.ok(200)["task"].clone();
    assert_eq!(t["state"], json!("succeeded"));
    assert_eq!(t["delivery"]["result"], result);
    assert_eq!(t["delivery"]["external_txn_id"], json!("bank-77"));
    assert_eq!(t["delivery"]["charge"], json!(100));
    assert_eq!(
        srv.claim_op("payment.release", None).await,
        Vec::<Value>::new()
    );
    let attempts = srv.attempts(&id).await;
    assert_eq!(
        attempts.len(),
        2,
        "no further execute attempt: {attempts:?}"
    );
    assert_eq!(attempts[1]["state"], json!("committed"));
    assert_eq!(attempts[1]["external_txn_id"], json!("bank-77"));
}

#[tokio::test]
async fn unknown_report_reconciles_and_reconcile_failures_never_execute() {
    let srv = Server::in_process().await;
    let t = srv.new_task("unk-1", "payment.release", payment(5)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let r = srv
        .report(&s(&a["id"]), json!({"generation": 1, "outcome": "unknown"}))
        .await;
    assert_eq!(r.ok(200)["task"]["state"], json!("reconciling"));
    let r1 = srv.claim_one("payment.release", None).await;
    assert_eq!(r1["kind"], json!("reconcile"));
    let f = srv
        .report(
            &s(&r1["id"]),
            json!({"generation": 2, "outcome": "failed", "failure_class": "transient"}),
        )
        .await;
    assert_eq!(f.ok(200)["task"]["state"], json!("reconciling"));
    let r2 = srv.claim_one("payment.release", None).await;
    assert_eq!(
        r2["kind"],
        json!("reconcile"),
        "a failed reconcile leads to another reconcile"
    );
    assert_eq!(r2["generation"], json!(3));
    let attempts = srv.attempts(&id).await;
    let kinds: Vec<&Value> = attempts.iter().map(|a| &a["kind"]).collect();
    assert_eq!(
        kinds,
        vec![&json!("execute"), &json!("reconcile"), &json!("reconcile")]
    );
}

#[tokio::test]
async fn transient_failure_retries_only_safe_classes_after_backoff() {
    let srv = Server::in_process().await;
    // Safe class: retry_wait, then (in the background) queued, then attempt 2.
    let g = srv
        .new_task("tr-safe", "generation.dispatch", generation("dog"))
        .await;
    let gid = s(&g["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let r = srv
        .report(&s(&a["id"]), json!({"generation": 1, "outcome": "failed", "failure_class": "transient", "message": "GPU busy"}))
        .await;
    let t = r.ok(200)["task"].clone();
    assert_eq!(t["state"], json!("retry_wait"));
    assert_eq!(t["failure"], Value::Null);
    srv.advance(MOVED_MS);
    let woke = srv.wait_state(&gid, "queued").await;
    assert_eq!(woke["generation"], json!(1));
    let a2 = srv.claim_one("generation.dispatch", None).await;
    assert_eq!(a2["task_id"], json!(gid));
    assert_eq!(a2["number"], json!(2));
    assert_eq!(a2["generation"], json!(2));
    assert_eq!(a2["kind"], json!("execute"));

    // Non-safe class: failed, class transient, no retry.
    let p = srv
        .new_task("tr-unsafe", "payment.release", payment(9))
        .await;
    let pid = s(&p["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let r = srv
        .report(&s(&a["id"]), json!({"generation": 1, "outcome": "failed", "failure_class": "transient", "message": "timeout"}))
        .await;
    let t = r.ok(200)["task"].clone();
    assert_eq!(t["state"], json!("failed"));
    assert_eq!(t["failure"]["class"], json!("transient"));
    assert!(t["failure"]["message"].is_string());
    assert_eq!(
        srv.claim_op("payment.release", None).await,
        Vec::<Value>::new()
    );
    assert_eq!(srv.attempts(&pid).await.len(), 1);
}

#[tokio::test]
async fn invalid_input_and_permission_denied_are_never_retried() {
    let srv = Server::fast().await;
    for (op, params) in [
        ("payment.release", payment(1)),
        ("generation.dispatch", generation("x")),
    ] {
        for class in ["invalid_input", "permission_denied"] {
            let t = srv
                .new_task(&format!("nr-{op}-{class}"), op, params.clone())
                .await;
            let id = s(&t["id"]);
            let a = srv.claim_one(op, None).await;
            assert_eq!(a["task_id"], json!(id));
            let r = srv
                .report(
                    &s(&a["id"]),
                    json!({"generation": 1, "outcome": "failed", "failure_class": class}),
                )
                .await;
            let t = r.ok(200)["task"].clone();
            assert_eq!(t["state"], json!("failed"), "{op}/{class}");
            assert_eq!(t["failure"]["class"], json!(class), "{op}/{class}");
            assert_eq!(
                srv.claim_op(op, None).await,
                Vec::<Value>::new(),
                "{op}/{class}"
            );
        }
    }
}

#[tokio::test]
async fn malformed_reports_are_400_and_change_nothing() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("bad-rep", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let aid = s(&a["id"]);
    for body in [
        json!({"generation": 1, "outcome": "failed"}),
        json!({"generation": 1, "outcome": "failed", "failure_class": "budget_exhausted"}),
        json!({"generation": 1, "outcome": "failed", "failure_class": "cosmic_rays"}),
        json!({"generation": 1, "outcome": "exploded"}),
        json!({"generation": 1}),
        json!({"generation": 1, "outcome": "committed", "result": {}}),
        // A class idem decides itself, on any outcome (the document lists
        // only the reportable ones).
        json!({"generation": 1, "outcome": "succeeded", "result": {}, "failure_class": "budget_exhausted"}),
        json!({"generation": 1, "outcome": "unknown", "failure_class": "attempts_exhausted"}),
    ] {
        srv.report(&aid, body.clone())
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    let now = srv.task(&id).await;
    assert_eq!(now["state"], json!("running"));
    assert_eq!(now["generation"], json!(1));
}

#[tokio::test]
async fn max_attempts_exhausted() {
    let opts = Options::moved().env(
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__MAX_ATTEMPTS",
        "2",
    );
    let srv = Server::in_process_with(opts).await;
    let t = srv
        .new_task("max-1", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    assert_eq!(t["contract"]["retry"]["max_attempts"], json!(2));
    for n in 1..=2 {
        let a = srv.claim_one("generation.dispatch", None).await;
        assert_eq!(a["number"], json!(n));
        let r = srv
            .report(
                &s(&a["id"]),
                json!({"generation": n, "outcome": "failed", "failure_class": "transient"}),
            )
            .await;
        let t = r.ok(200)["task"].clone();
        if n == 1 {
            assert_eq!(t["state"], json!("retry_wait"));
        } else {
            assert_eq!(t["state"], json!("failed"));
            assert_eq!(t["failure"]["class"], json!("attempts_exhausted"));
        }
    }
    assert_eq!(
        srv.claim_op("generation.dispatch", None).await,
        Vec::<Value>::new()
    );
    assert_eq!(srv.attempts(&id).await.len(), 2);
}

#[tokio::test]
async fn usage_over_budget_is_budget_exhausted() {
    let opts = Options::fast().env(
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__USAGE_BUDGET",
        "10",
    );
    let srv = Server::start_with(opts).await;
    let t = srv
        .new_task("budget-1", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let r = srv
        .report(&s(&a["id"]), json!({"generation": 1, "outcome": "failed", "failure_class": "transient", "usage": 11}))
        .await;
    let t = r.ok(200)["task"].clone();
    assert_eq!(t["state"], json!("failed"));
    assert_eq!(t["failure"]["class"], json!("budget_exhausted"));
    assert_eq!(t["usage"], json!(11), "usage is kept");
    assert_eq!(srv.attempts(&id).await[0]["usage"], json!(11));
    assert_eq!(
        srv.claim_op("generation.dispatch", None).await,
        Vec::<Value>::new()
    );
}

#[tokio::test]
async fn no_attempt_starts_after_the_deadline() {
    // Retention (24 h) still covers request_retry + deadline + reconciliation.
    let opts = Options::moved().env(
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__DEADLINE_MS",
        &MOVED_MS.to_string(),
    );
    let srv = Server::in_process_with(opts).await;
    let t = srv
        .new_task("deadline-1", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    assert_eq!(t["contract"]["retry"]["deadline_ms"], json!(MOVED_MS));
    srv.advance(MOVED_MS + 1);
    // The first claim after the deadline starts nothing and fails the task.
    assert_eq!(
        srv.claim_op("generation.dispatch", None).await,
        Vec::<Value>::new()
    );
    let t = srv.wait_state(&id, "failed").await;
    assert_eq!(t["failure"]["class"], json!("deadline_exceeded"));
    assert_eq!(t["attempt_count"], json!(0));
    assert_eq!(srv.attempts(&id).await.len(), 0);
}

#[tokio::test]
async fn deadline_passing_between_attempts_fails_the_retry() {
    let opts = Options::moved().env(
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__DEADLINE_MS",
        &MOVED_MS.to_string(),
    );
    let srv = Server::in_process_with(opts).await;
    let t = srv
        .new_task("deadline-2", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    // The deadline passes while the lease (30 s) is kept alive.
    for _ in 0..3 {
        srv.advance(MOVED_MS / 3);
        srv.heartbeat(&s(&a["id"]), json!({"generation": 1}))
            .await
            .ok(200);
    }
    srv.advance(1);
    let r = srv
        .report(
            &s(&a["id"]),
            json!({"generation": 1, "outcome": "failed", "failure_class": "transient"}),
        )
        .await;
    let t = r.ok(200)["task"].clone();
    assert_eq!(t["state"], json!("failed"), "{t}");
    assert_eq!(t["failure"]["class"], json!("deadline_exceeded"));
    assert_eq!(srv.attempts(&id).await.len(), 1);
}

#[tokio::test]
async fn revoked_submitter_key_fails_the_retry_with_permission_denied() {
    let srv = Server::in_process().await;
    let (kid, key) = srv.create_key("acme", "client", Some("generation.dispatch"));
    let r = srv
        .submit_as(&key, "rev-1", "generation.dispatch", generation("x"))
        .await;
    let id = s(&r.ok(201)["task"]["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    assert_eq!(a["task_id"], json!(id));
    let rep = srv
        .report(
            &s(&a["id"]),
            json!({"generation": 1, "outcome": "failed", "failure_class": "transient"}),
        )
        .await;
    assert_eq!(rep.ok(200)["task"]["state"], json!("retry_wait"));
    srv.revoke_key(&kid);
    let (ok, list, _) = srv.cli(&["keys", "list"]);
    assert!(ok);
    let line = list
        .lines()
        .find(|l| l.starts_with(&kid))
        .expect("revoked key listed");
    assert_ne!(
        line.split('\t').nth(5),
        Some("-"),
        "revoked column set: {line}"
    );
    // The revoked key no longer authenticates.
    srv.get(&format!("/v1/tasks/{id}"), &key)
        .await
        .assert_problem(401, "UNAUTHENTICATED");

    // Claims never return a new attempt; the task ends failed permission_denied.
    srv.advance(MOVED_MS);
    let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
    let t = loop {
        let got = srv.claim_op("generation.dispatch", None).await;
        assert_eq!(got, Vec::<Value>::new(), "no new attempt after revocation");
        let t = srv.task(&id).await;
        if t["state"] == json!("failed") {
            break t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "task never failed: {t}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(t["failure"]["class"], json!("permission_denied"));
    assert_eq!(t["attempt_count"], json!(1));
    assert_eq!(srv.attempts(&id).await.len(), 1);
}

#[tokio::test]
async fn lease_ms_out_of_bounds_is_400() {
    let srv = Server::fast().await;
    srv.new_task("lease-1", "payment.release", payment(1)).await;
    for lease in [0, 50, 99, 300_001, 10_000_000] {
        let r = srv
            .claim(
                json!({"executor_id": "ex", "operations": ["payment.release"], "lease_ms": lease}),
            )
            .await;
        r.assert_problem(400, "INVALID_REQUEST");
    }
    // Nothing was leased by the refused claims; bounds themselves are fine.
    let a = srv.claim_op("payment.release", Some(300_000)).await;
    assert_eq!(a.len(), 1);
    srv.new_task("lease-2", "payment.release", payment(2)).await;
    assert_eq!(srv.claim_op("payment.release", Some(100)).await.len(), 1);
    // Other claim inputs; a due task stays unleased by every refused claim.
    srv.new_task("lease-3", "payment.release", payment(3)).await;
    for body in [
        json!({"executor_id": "", "operations": ["payment.release"]}),
        json!({"executor_id": "x".repeat(201), "operations": ["payment.release"]}),
        json!({"executor_id": "w\u{0}x", "operations": ["payment.release"]}),
        json!({"executor_id": "tab\there", "operations": ["payment.release"]}),
        json!({"executor_id": "ex", "operations": []}),
        json!({"executor_id": "ex", "operations": ["nope.op"]}),
        json!({"executor_id": "ex", "max": 0}),
        json!({"executor_id": "ex", "max": 101}),
    ] {
        srv.claim(body).await.assert_problem(400, "INVALID_REQUEST");
    }
    let a = srv.claim_op("payment.release", None).await;
    assert_eq!(a.len(), 1, "lease-3 was still due");
    // 200 characters of any script are an executor id.
    srv.new_task("lease-4", "payment.release", payment(4)).await;
    let long = "é".repeat(200);
    let r = srv
        .claim(json!({"executor_id": long, "operations": ["payment.release"]}))
        .await;
    assert_eq!(r.ok(200)["attempts"].as_array().map(Vec::len), Some(1));
}

/// A claim answers the lease length it granted (the requested one, or the
/// class default when none was asked), and a heartbeat the length it extended
/// the lease by: an executor counts its local lease deadline from them.
#[tokio::test]
async fn claim_and_heartbeat_answer_the_lease_length() {
    let srv = Server::fast().await;
    srv.new_task("lease-len-1", "payment.release", payment(1))
        .await;
    let a = srv.claim_op("payment.release", Some(100_000)).await;
    assert_eq!(a.len(), 1);
    assert_eq!(a[0]["lease_ms"], json!(100_000));
    let hb = srv
        .heartbeat(&s(&a[0]["id"]), json!({"generation": a[0]["generation"]}))
        .await;
    assert_eq!(hb.ok(200)["lease_ms"], json!(100_000));
    // Without `lease_ms` the class default (`payment.release`: 30 s) is granted.
    srv.new_task("lease-len-2", "payment.release", payment(2))
        .await;
    let a = srv.claim_op("payment.release", None).await;
    assert_eq!(a[0]["lease_ms"], json!(30_000));
}

/// `external_txn_id` is an identifier: 1–200 characters, no control
/// characters (a NUL could not even be stored on PostgreSQL). A report that
/// breaks this is a 400 that changes nothing and is not kept as evidence; the
/// attempt can still be reported.
#[tokio::test]
async fn report_external_txn_id_is_checked() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("txn-1", "generation.dispatch", generation("cat"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let a_id = s(&a["id"]);
    for txn in [
        json!(""),
        json!("\u{0}"),
        json!("a\nb"),
        json!("x".repeat(201)),
    ] {
        let r = srv
            .report(
                &a_id,
                json!({"generation": 1, "outcome": "succeeded", "result": {}, "external_txn_id": txn}),
            )
            .await;
        r.assert_problem(400, "INVALID_REQUEST");
    }
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a_id)["state"], json!("leased"));
    assert_eq!(attempt_of(&attempts, &a_id)["evidence"], json!([]));
    let r = srv
        .report(
            &a_id,
            json!({"generation": 1, "outcome": "succeeded", "result": {}, "external_txn_id": "txn-é-1"}),
        )
        .await;
    let task = &r.ok(200)["task"];
    assert_eq!(task["state"], json!("succeeded"));
    assert_eq!(task["delivery"]["external_txn_id"], json!("txn-é-1"));
}

/// A report's `message` is at most 4,096 characters (SPEC §7): one longer is
/// 400 naming the field and the limit, not kept as evidence, and the attempt
/// can still be reported; one of exactly 4,096 characters (of any script) is
/// stored whole.
#[tokio::test]
async fn report_message_over_its_limit_is_400_and_stores_nothing() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("msg-1", "generation.dispatch", generation("cat"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let a_id = s(&a["id"]);
    let failed = |message: String| json!({"generation": 1, "outcome": "failed", "failure_class": "invalid_input", "message": message});
    let r = srv.report(&a_id, failed("é".repeat(4097))).await;
    r.assert_problem(400, "INVALID_REQUEST");
    let detail = s(&r.json["detail"]);
    assert!(
        detail.contains("`message`") && detail.contains("4096"),
        "the detail names the field and its limit: {detail}"
    );
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a_id)["state"], json!("leased"));
    assert_eq!(attempt_of(&attempts, &a_id)["evidence"], json!([]));
    let longest = "é".repeat(4096);
    let task = srv.report(&a_id, failed(longest.clone())).await.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("failed"));
    assert_eq!(task["failure"]["message"], json!(longest));
}

/// A body over the 1 MiB limit is 413 whose problem names the limit in bytes
/// (`detail` and `max_bytes`); the report is not kept, and the same report
/// with its text cut is then applied.
#[tokio::test]
async fn report_over_the_body_limit_is_413_naming_the_limit() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("big-1", "generation.dispatch", generation("cat"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let a_id = s(&a["id"]);
    let unknown =
        |message: String| json!({"generation": 1, "outcome": "unknown", "message": message});
    let r = srv.report(&a_id, unknown("x".repeat(1024 * 1024))).await;
    r.assert_problem(413, "PAYLOAD_TOO_LARGE");
    assert_eq!(r.json["max_bytes"], json!(1_048_576));
    let detail = s(&r.json["detail"]);
    assert!(detail.contains("1048576 bytes"), "{detail}");
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a_id)["state"], json!("leased"));
    assert_eq!(attempt_of(&attempts, &a_id)["evidence"], json!([]));
    let task = srv.report(&a_id, unknown("x".repeat(4096))).await.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("reconciling"));
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a_id)["state"], json!("unknown"));
}

#[tokio::test]
async fn executor_key_limited_to_classes_claims_only_those() {
    let srv = Server::fast().await;
    let (_, gen_exec) = srv.create_key("acme", "executor", Some("generation.dispatch"));
    srv.new_task("lim-1", "payment.release", payment(1)).await;
    let r = srv
        .post(
            "/v1/attempts/claim",
            &gen_exec,
            json!({"executor_id": "g", "max": 10}),
        )
        .await;
    assert_eq!(r.ok(200)["attempts"], json!([]));
    let r = srv
        .post(
            "/v1/attempts/claim",
            &gen_exec,
            json!({"executor_id": "g", "operations": ["payment.release"]}),
        )
        .await;
    r.assert_problem(403, "PERMISSION_DENIED");
    srv.new_task("lim-2", "generation.dispatch", generation("x"))
        .await;
    let r = srv
        .post(
            "/v1/attempts/claim",
            &gen_exec,
            json!({"executor_id": "g", "max": 10}),
        )
        .await;
    let got = r.ok(200)["attempts"].as_array().expect("array").clone();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["operation"], json!("generation.dispatch"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_claim_returns_work_submitted_while_waiting() {
    let srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let claim = srv.long_poll_claim();
    srv.wait_long_poll().await;
    let t = srv
        .new_task("lp-1", "generation.dispatch", generation("x"))
        .await;
    let r = claim.await.expect("join");
    let got = r.ok(200)["attempts"].as_array().expect("array").clone();
    assert_eq!(got.len(), 1, "{}", r.text);
    assert_eq!(got[0]["task_id"], t["id"]);
    let r = srv
        .claim(json!({"executor_id": "lp", "wait_ms": 30001}))
        .await;
    r.assert_problem(400, "INVALID_REQUEST");
}

/// SIGTERM does not wait out a long-poll: the waiting claim answers 200 with
/// no attempts and the process exits cleanly, well before the claim's 30 s
/// `wait_ms` would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_a_long_poll_claim_at_once() {
    let mut srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let claim = srv.long_poll_claim();
    srv.wait_long_poll().await;
    let started = std::time::Instant::now();
    let status = tokio::task::block_in_place(|| srv.terminate());
    let r = claim.await.expect("join");
    assert!(status.success(), "exit status {status:?}");
    assert_eq!(r.ok(200)["attempts"], json!([]), "{}", r.text);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown waited {:?}: the long-poll held it",
        started.elapsed()
    );
}

/// A SIGTERM sent as soon as the server says it is listening is a graceful
/// shutdown (exit 0), not death by the signal (exit 143): the handlers are
/// installed before the "listening" line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_right_after_listening_exits_cleanly() {
    for _ in 0..3 {
        let mut srv = Server::fast().await;
        let status = tokio::task::block_in_place(|| srv.terminate());
        assert!(status.success(), "exit status {status:?}");
    }
}

/// A client that stops half-way through its request does not hold the
/// shutdown for ever: after `IDEM_SHUTDOWN_GRACE_MS` the process exits
/// (status 1); and a second SIGTERM exits at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_cannot_hold_the_shutdown() {
    use std::io::Write;
    let stall = async |srv: &Server| {
        let addr = srv.url.trim_start_matches("http://").to_owned();
        let mut conn = std::net::TcpStream::connect(addr).expect("connect");
        conn.write_all(b"POST /v1/attempts/claim HTTP/1.1\r\nHost: x\r\n")
            .expect("partial request");
        srv.wait_read_from(conn.local_addr().expect("the client's address"))
            .await;
        conn
    };
    // The grace period runs out.
    let mut srv = Server::start_with(
        Options::fast()
            .env("IDEM_SHUTDOWN_GRACE_MS", "1000")
            .env("RUST_LOG", DEBUG_LOG),
    )
    .await;
    let _conn = stall(&srv).await;
    srv.signal_term();
    let status = tokio::task::block_in_place(|| srv.exit_within(Duration::from_secs(15)));
    let status = status.expect("still running 15 s after SIGTERM with a 1 s grace period");
    assert_eq!(status.code(), Some(1), "{status:?}");
    // A second signal, well inside the default 20 s grace period.
    let mut srv = Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await;
    let _conn = stall(&srv).await;
    srv.signal_term();
    // The first signal was taken: the next one is a second signal.
    srv.wait_log("shutting down: answering open requests").await;
    srv.signal_term();
    let status = tokio::task::block_in_place(|| srv.exit_within(Duration::from_secs(10)));
    let status = status.expect("still running 10 s after a second SIGTERM");
    assert_eq!(status.code(), Some(1), "{status:?}");
}

/// Request bodies are JSON objects: the same fields as an array (which
/// serde's derived structs would read in order) are 400 and change nothing.
#[tokio::test]
async fn bodies_as_arrays_are_400_and_change_nothing() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("array-body", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    srv.claim(json!(["ex-1", ["generation.dispatch"], 1]))
        .await
        .assert_problem(400, "INVALID_REQUEST");
    assert_eq!(srv.task(&id).await["state"], json!("queued"));
    let a = srv.claim_one("generation.dispatch", None).await;
    srv.heartbeat(&s(&a["id"]), json!([1, 5]))
        .await
        .assert_problem(400, "INVALID_REQUEST");
    assert_eq!(srv.attempts(&id).await[0]["usage"], json!(0));
    srv.report(&s(&a["id"]), json!([1, "succeeded", {}]))
        .await
        .assert_problem(400, "INVALID_REQUEST");
    assert_eq!(srv.task(&id).await["state"], json!("running"));
}
