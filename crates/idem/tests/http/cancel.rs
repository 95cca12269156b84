//! Cancellation ordered against delivery, and device acknowledgments.

use serde_json::{Value, json};

use crate::support::{MOVED_MS, Server, generation, payment, s};

#[tokio::test]
async fn cancel_queued_is_confirmed_at_once_and_never_claimed() {
    let srv = Server::fast().await;
    let t = srv.new_task("c-q", "payment.release", payment(10)).await;
    let id = s(&t["id"]);
    let r = srv.cancel(&id).await;
    let body = r.ok(200).clone();
    let c = &body["cancellation"];
    assert_eq!(c["status"], json!("confirmed"));
    assert_eq!(c["fee"], t["contract"]["fees"]["cancel_before_start"]);
    assert_eq!(c["fee"], json!(0));
    assert!(c["requested_at"].is_string());
    assert!(c["confirmed_at"].is_string());
    assert_eq!(body["task"]["state"], json!("cancelled"));
    assert_eq!(body["task"]["cancellation"], *c);
    assert!(
        body["task"]["generation"].as_i64() > Some(0),
        "generation raised: {}",
        body["task"]
    );
    assert_eq!(
        srv.claim_op("payment.release", None).await,
        Vec::<Value>::new()
    );
    let now = srv.task(&id).await;
    assert_eq!(now["state"], json!("cancelled"));
    assert_eq!(now["attempt_count"], json!(0));
    // Cancelling twice returns the same record.
    let again = srv.cancel(&id).await;
    assert_eq!(again.ok(200)["cancellation"], *c);
    // A replayed submit shows the cancellation.
    let replay = srv.submit("c-q", "payment.release", payment(10)).await;
    assert_eq!(replay.ok(201)["task"]["cancellation"], *c);
}

#[tokio::test]
async fn cancel_running_is_requested_then_confirmed_by_the_executor() {
    let srv = Server::fast().await;
    let t = srv.new_task("c-run", "payment.release", payment(10)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let aid = s(&a["id"]);
    assert_eq!(a["generation"], json!(1));

    let hb = srv
        .heartbeat(&aid, json!({"generation": 1, "usage": 2}))
        .await;
    assert_eq!(hb.ok(200)["cancel_requested"], json!(false));

    let r = srv.cancel(&id).await;
    let body = r.ok(202).clone();
    let c = &body["cancellation"];
    assert_eq!(c["status"], json!("requested"));
    assert_eq!(c["fee"], Value::Null);
    assert_eq!(c["confirmed_at"], Value::Null);
    assert_eq!(
        body["task"]["state"],
        json!("running"),
        "a request is not a stop"
    );
    // Twice: the same record, still pending.
    let again = srv.cancel(&id).await;
    assert_eq!(again.ok(202)["cancellation"], *c);

    let hb = srv
        .heartbeat(&aid, json!({"generation": 1, "usage": 5}))
        .await;
    assert_eq!(hb.ok(200)["cancel_requested"], json!(true));

    let rep = srv
        .report(
            &aid,
            json!({"generation": 1, "outcome": "cancelled", "usage": 7}),
        )
        .await;
    let task = rep.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("cancelled"));
    let fees = &task["contract"]["fees"];
    let expected = fees["cancel_after_start_fixed"].as_i64().expect("fixed")
        + 7 * fees["usage_unit_price"].as_i64().expect("unit");
    assert_eq!(expected, 17);
    assert_eq!(task["cancellation"]["status"], json!("confirmed"));
    assert_eq!(task["cancellation"]["fee"], json!(expected));
    assert_eq!(task["cancellation"]["requested_at"], c["requested_at"]);
    assert_eq!(task["usage"], json!(7), "incurred usage is kept");
    assert!(
        task["generation"].as_i64() > Some(1),
        "generation raised: {task}"
    );
    assert_eq!(task["delivery"], Value::Null);

    // A later success from the retired attempt is stale; the task stays cancelled.
    let late = srv
        .report(
            &aid,
            json!({"generation": 1, "outcome": "succeeded", "result": {"too": "late"}}),
        )
        .await;
    late.assert_problem(409, "STALE_GENERATION");
    let now = srv.task(&id).await;
    assert_eq!(now["state"], json!("cancelled"));
    assert_eq!(now["delivery"], Value::Null);
    assert_eq!(now["cancellation"], task["cancellation"]);
    srv.heartbeat(&aid, json!({"generation": 1}))
        .await
        .assert_problem(409, "STALE_GENERATION");
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0]["state"], json!("cancelled"));
    assert_eq!(attempts[0]["usage"], json!(7));
    let ev = attempts[0]["evidence"].as_array().expect("evidence");
    assert!(
        ev.iter().any(|e| e["outcome"] == json!("succeeded")),
        "late report kept as evidence: {ev:?}"
    );
    // Cancel after confirmation: the same record.
    let third = srv.cancel(&id).await;
    assert_eq!(third.ok(200)["cancellation"], task["cancellation"]);
}

#[tokio::test]
async fn cancel_after_delivery_is_too_late_with_the_charge() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("c-del", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let rep = srv
        .report(
            &s(&a["id"]),
            json!({"generation": 1, "outcome": "succeeded", "result": {"img": 1}}),
        )
        .await;
    let delivered = rep.ok(200)["task"].clone();
    let r = srv.cancel(&id).await;
    let body = r.ok(200).clone();
    assert_eq!(body["cancellation"]["status"], json!("too_late"));
    assert_eq!(body["cancellation"]["fee"], delivered["delivery"]["charge"]);
    assert_eq!(body["cancellation"]["fee"], json!(50));
    assert_eq!(body["task"]["state"], json!("succeeded"));
    assert_eq!(body["task"]["delivery"], delivered["delivery"]);
    assert_eq!(body["task"]["generation"], delivered["generation"]);
    let again = srv.cancel(&id).await;
    assert_eq!(again.ok(200)["cancellation"], body["cancellation"]);
}

#[tokio::test]
async fn cancel_requested_then_succeeded_is_too_late() {
    let srv = Server::fast().await;
    let t = srv.new_task("c-race", "payment.release", payment(10)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    srv.cancel(&id).await.ok(202);
    let rep = srv
        .report(
            &s(&a["id"]),
            json!({"generation": 1, "outcome": "succeeded", "result": {"paid": true}, "usage": 3}),
        )
        .await;
    let task = rep.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("succeeded"));
    assert_eq!(task["delivery"]["charge"], json!(100));
    assert_eq!(task["cancellation"]["status"], json!("too_late"));
    assert_eq!(task["cancellation"]["fee"], task["delivery"]["charge"]);
    let r = srv.cancel(&id).await;
    assert_eq!(r.ok(200)["cancellation"], task["cancellation"]);

    // The amounts stay integers of minor units, the currency the contract
    // froze beside them (SPEC §5 "Money"), in the answer and the events.
    assert_eq!(task["contract"]["fees"]["currency"], json!("EUR"));
    assert_eq!(task["contract"]["fees"]["exponent"], json!(2));
    assert_eq!(task["delivery"]["currency"], json!("EUR"));
    assert_eq!(task["cancellation"]["currency"], json!("EUR"));
    let events = srv.events(&id).await;
    for kind in ["delivered", "cancel_too_late"] {
        let e = events.iter().find(|e| e["type"] == kind).expect(kind);
        assert_eq!(e["data"]["currency"], json!("EUR"), "{e}");
    }
    // The CLI says the one charge, in euros, and that the fee is that charge.
    let (ok, out, err) = srv.cli(&["task", "show", &id, "--summary"]);
    assert!(ok, "{err}");
    assert!(out.contains("delivery: a charge of EUR 1.00"), "{out}");
    assert!(
        out.contains("cancellation: `too_late`: the cancellation fee is the delivery's charge, EUR 1.00, charged once (no second charge)"),
        "{out}"
    );
    assert_eq!(out.matches("EUR 1.00").count(), 2, "{out}");
    let (ok, out, err) = srv.cli(&["task", "list", "--tenant", "acme", "--table"]);
    assert!(ok, "{err}");
    let mut lines = out.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "ID",
            "OPERATION",
            "STATE",
            "PAYEE",
            "AMOUNT",
            "CHARGE",
            "FEE"
        ]
    );
    let row = lines
        .find(|l| l.starts_with(id.as_str()))
        .unwrap_or_default();
    assert!(
        row.contains("EUR 1.00") && row.ends_with("= charge"),
        "{out}"
    );
}

#[tokio::test]
async fn a_class_without_a_currency_says_minor_units() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("c-minor", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    assert!(t["contract"]["fees"].get("currency").is_none(), "{t}");
    let a = srv.claim_one("generation.dispatch", None).await;
    let task = srv
        .report(
            &s(&a["id"]),
            json!({"generation": 1, "outcome": "succeeded", "result": {"img": 1}}),
        )
        .await
        .ok(200)["task"]
        .clone();
    assert_eq!(task["delivery"]["charge"], json!(50));
    assert_eq!(task["delivery"]["currency"], Value::Null);
    let events = srv.events(&id).await;
    let delivered = events
        .iter()
        .find(|e| e["type"] == "delivered")
        .expect("delivered");
    assert_eq!(delivered["data"]["currency"], Value::Null, "{delivered}");
    let (ok, out, err) = srv.cli(&["task", "show", &id, "--summary"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("delivery: a charge of 50 minor units"),
        "{out}"
    );
}

#[tokio::test]
async fn failed_report_with_a_pending_cancel_confirms_it() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("c-fail", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    srv.cancel(&id).await.ok(202);
    let rep = srv
        .report(
            &s(&a["id"]),
            json!({"generation": 1, "outcome": "failed", "failure_class": "transient", "usage": 4}),
        )
        .await;
    let task = rep.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("cancelled"));
    assert_eq!(task["cancellation"]["status"], json!("confirmed"));
    assert_eq!(task["cancellation"]["fee"], json!(5 + 4));
    assert_eq!(
        srv.claim_op("generation.dispatch", None).await,
        Vec::<Value>::new()
    );
}

#[tokio::test]
async fn expired_lease_with_pending_cancel_on_safe_class_confirms() {
    let srv = Server::in_process().await;
    let t = srv
        .new_task("c-exp", "generation.dispatch", generation("x"))
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", Some(MOVED_MS)).await;
    let hb = srv
        .heartbeat(&s(&a["id"]), json!({"generation": 1, "usage": 3}))
        .await;
    hb.ok(200);
    srv.cancel(&id).await.ok(202);
    srv.advance(MOVED_MS);
    let t = srv
        .wait_task(&id, "not running", |t| t["state"] != json!("running"))
        .await;
    assert_eq!(t["state"], json!("cancelled"));
    assert_eq!(t["cancellation"]["status"], json!("confirmed"));
    assert_eq!(t["cancellation"]["fee"], json!(5 + 3));
    assert_eq!(t["usage"], json!(3));
    assert!(t["generation"].as_i64() > Some(1));
    assert_eq!(
        srv.claim_op("generation.dispatch", None).await,
        Vec::<Value>::new()
    );
}

#[tokio::test]
async fn expired_lease_with_pending_cancel_on_non_safe_class_reconciles_first() {
    let srv = Server::in_process().await;
    // Committed: delivery wins.
    let t = srv
        .new_task("c-exp-1", "payment.release", payment(10))
        .await;
    let id = s(&t["id"]);
    srv.claim_one("payment.release", Some(MOVED_MS)).await;
    srv.cancel(&id).await.ok(202);
    srv.advance(MOVED_MS);
    let t = srv
        .wait_task(&id, "not running", |t| t["state"] != json!("running"))
        .await;
    assert_eq!(t["state"], json!("reconciling"), "{t}");
    assert_eq!(t["cancellation"]["status"], json!("requested"));
    let r = srv.claim_one("payment.release", None).await;
    assert_eq!(r["kind"], json!("reconcile"));
    let rep = srv
        .report(
            &s(&r["id"]),
            json!({"generation": r["generation"], "outcome": "committed", "result": {"paid": 1}}),
        )
        .await;
    let task = rep.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("succeeded"));
    assert_eq!(task["cancellation"]["status"], json!("too_late"));
    assert_eq!(task["cancellation"]["fee"], json!(100));

    // Not committed: the cancellation is confirmed, nothing executes again.
    let t = srv
        .new_task("c-exp-2", "payment.release", payment(11))
        .await;
    let id = s(&t["id"]);
    srv.claim_one("payment.release", Some(MOVED_MS)).await;
    srv.cancel(&id).await.ok(202);
    srv.advance(MOVED_MS);
    srv.wait_state(&id, "reconciling").await;
    let r = srv.claim_one("payment.release", None).await;
    assert_eq!(r["kind"], json!("reconcile"));
    let rep = srv
        .report(
            &s(&r["id"]),
            json!({"generation": r["generation"], "outcome": "not_committed"}),
        )
        .await;
    let task = rep.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("cancelled"));
    assert_eq!(task["cancellation"]["status"], json!("confirmed"));
    assert_eq!(task["cancellation"]["fee"], json!(10));
    assert_eq!(
        srv.claim_op("payment.release", None).await,
        Vec::<Value>::new()
    );
    assert_eq!(srv.attempts(&id).await.len(), 2);
}

#[tokio::test]
async fn cancel_of_another_tenants_task_is_not_found() {
    let srv = Server::fast().await;
    let t = srv
        .new_task("c-other", "payment.release", payment(10))
        .await;
    let id = s(&t["id"]);
    let r = srv
        .post(
            &format!("/v1/tasks/{id}/cancel"),
            &srv.keys.other,
            json!({}),
        )
        .await;
    r.assert_problem(404, "NOT_FOUND");
    let r = srv
        .post(
            &format!("/v1/tasks/{id}/delivery/ack"),
            &srv.keys.other,
            json!({}),
        )
        .await;
    r.assert_problem(404, "NOT_FOUND");
    let now = srv.task(&id).await;
    assert_eq!(now, t, "unchanged");
    let rnd = srv
        .post(
            &format!("/v1/tasks/{}/cancel", uuid::Uuid::new_v4()),
            &srv.keys.acme,
            json!({}),
        )
        .await;
    rnd.assert_problem(404, "NOT_FOUND");
    // An executor of the other tenant cannot report on acme's attempt either.
    let a = srv.claim_one("payment.release", None).await;
    let r = srv
        .post(
            &format!("/v1/attempts/{}/report", s(&a["id"])),
            &srv.keys.exec_other,
            json!({"generation": 1, "outcome": "succeeded", "result": {}}),
        )
        .await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(srv.task(&id).await["state"], json!("running"));
}

#[tokio::test]
async fn device_ack_then_completion_are_two_events() {
    let srv = Server::fast().await;
    let t = srv
        .new_task(
            "dev-1",
            "generation.dispatch",
            json!({"device": "valve-7", "command": "open"}),
        )
        .await;
    let id = s(&t["id"]);
    let a = srv.claim_one("generation.dispatch", None).await;
    let aid = s(&a["id"]);
    let ack = srv
        .post(
            &format!("/v1/attempts/{aid}/ack"),
            &srv.keys.exec,
            json!({"generation": 1}),
        )
        .await;
    assert_eq!(ack.ok(200)["task"]["state"], json!("running"));
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempts[0]["state"], json!("acknowledged"));
    let task = srv.task(&id).await;
    assert_eq!(task["state"], json!("running"));
    assert_eq!(task["delivery"], Value::Null);
    let events = srv.events(&id).await;
    let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert!(types.contains(&"command_acknowledged"), "events: {types:?}");
    assert!(!types.contains(&"completion_observed"), "events: {types:?}");
    // Ack again: idempotent, one event.
    srv.post(
        &format!("/v1/attempts/{aid}/ack"),
        &srv.keys.exec,
        json!({"generation": 1}),
    )
    .await
    .ok(200);
    // Acknowledged attempts still heartbeat.
    srv.heartbeat(&aid, json!({"generation": 1})).await.ok(200);

    let rep = srv
        .report(
            &aid,
            json!({"generation": 1, "outcome": "succeeded", "result": {"observed": "open"}}),
        )
        .await;
    assert_eq!(rep.ok(200)["task"]["state"], json!("succeeded"));
    let events = srv.events(&id).await;
    let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(
        types
            .iter()
            .filter(|t| **t == "command_acknowledged")
            .count(),
        1,
        "events: {types:?}"
    );
    let ack_pos = types.iter().position(|t| *t == "command_acknowledged");
    let done_pos = types.iter().position(|t| *t == "completion_observed");
    assert!(done_pos.is_some(), "events: {types:?}");
    assert!(
        ack_pos < done_pos,
        "acknowledged before completion: {types:?}"
    );
    let seqs: Vec<i64> = events.iter().filter_map(|e| e["seq"].as_i64()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "increasing seq: {seqs:?}"
    );
    assert_eq!(srv.attempts(&id).await[0]["state"], json!("succeeded"));
}
