//! `POST /v1/attempts/{id}/release` against a real `idem serve`: an executor
//! gives back an attempt it never started, and the task is claimable again
//! at once, with the attempt kept `released`; the refusals a report has
//! (fencing, an attempt that started, another tenant's).

use serde_json::{Value, json};

use crate::support::{Server, payment, s};

fn attempt_of<'a>(attempts: &'a [Value], id: &str) -> &'a Value {
    attempts
        .iter()
        .find(|a| a["id"] == json!(id))
        .unwrap_or_else(|| panic!("attempt {id} not listed in {attempts:?}"))
}

/// A released attempt's task is `queued` and claimed again at once; the
/// attempt is listed `released` with one `attempt_released` event; an exact
/// repeat answers the same task; the old generation holds nothing.
#[tokio::test]
async fn released_attempt_is_kept_and_its_task_claimable_at_once() {
    let srv = Server::fast().await;
    let t = srv.new_task("rel-1", "payment.release", payment(10)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let a_id = s(&a["id"]);
    // Executors only; a body that is not `{"generation"}` is 400.
    srv.post(
        &format!("/v1/attempts/{a_id}/release"),
        &srv.keys.acme,
        json!({"generation": 1}),
    )
    .await
    .assert_problem(403, "PERMISSION_DENIED");
    for body in [json!({}), json!([1]), json!({"generation": "1"})] {
        srv.release(&a_id, body)
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    let r = srv.release(&a_id, json!({"generation": 1})).await;
    let task = r.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("queued"));
    assert_eq!(task["generation"], json!(1));
    let again = srv.release(&a_id, json!({"generation": 1})).await;
    assert_eq!(
        again.ok(200)["task"],
        task,
        "an exact repeat answers the same"
    );
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a_id)["state"], json!("released"));
    let released = srv
        .events(&id)
        .await
        .iter()
        .filter(|e| e["type"] == json!("attempt_released"))
        .count();
    assert_eq!(released, 1);
    // Claimable at once: a claim with no wait gets it.
    let b = srv.claim_op("payment.release", None).await;
    assert_eq!(b.len(), 1, "the released task is claimable at once");
    assert_eq!(
        (&b[0]["kind"], &b[0]["generation"]),
        (&json!("execute"), &json!(2))
    );
    srv.report(
        &a_id,
        json!({"generation": 1, "outcome": "succeeded", "result": {}}),
    )
    .await
    .assert_problem(409, "STALE_GENERATION");
    let done = srv
        .report(
            &s(&b[0]["id"]),
            json!({"generation": 2, "outcome": "succeeded", "result": {"ok": true}}),
        )
        .await;
    assert_eq!(done.ok(200)["task"]["state"], json!("succeeded"));
}

/// Refused, nothing changed: an old generation (409 `STALE_GENERATION`), an
/// attempt that reported or that its device acknowledged (409
/// `ATTEMPT_ALREADY_REPORTED`), another tenant's or an unknown attempt (404).
#[tokio::test]
async fn release_is_refused_for_a_stale_started_or_foreign_attempt() {
    let srv = Server::fast().await;
    let t = srv.new_task("rel-2", "payment.release", payment(11)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let a_id = s(&a["id"]);
    srv.release(&a_id, json!({"generation": 0}))
        .await
        .assert_problem(409, "STALE_GENERATION");
    srv.post(
        &format!("/v1/attempts/{a_id}/release"),
        &srv.keys.exec_other,
        json!({"generation": 1}),
    )
    .await
    .assert_problem(404, "NOT_FOUND");
    srv.release(&uuid::Uuid::new_v4().to_string(), json!({"generation": 1}))
        .await
        .assert_problem(404, "NOT_FOUND");
    srv.post(
        &format!("/v1/attempts/{a_id}/ack"),
        &srv.keys.exec,
        json!({"generation": 1}),
    )
    .await
    .ok(200);
    srv.release(&a_id, json!({"generation": 1}))
        .await
        .assert_problem(409, "ATTEMPT_ALREADY_REPORTED");
    srv.report(&a_id, json!({"generation": 1, "outcome": "unknown"}))
        .await
        .ok(200);
    srv.release(&a_id, json!({"generation": 1}))
        .await
        .assert_problem(409, "ATTEMPT_ALREADY_REPORTED");
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a_id)["state"], json!("unknown"));
    assert_eq!(srv.task(&id).await["state"], json!("reconciling"));
}
