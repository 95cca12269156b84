//! The contract is frozen at acceptance (SPEC §1 "contract", CANCEL-01 "the
//! frozen acceptance and fee policy"): changing the fees in the configuration
//! and restarting changes what new tasks are charged, never existing ones, and
//! the config version is recorded on each task.

use serde_json::json;

use crate::support::{Options, Server};

#[tokio::test]
async fn fee_change_applies_to_new_tasks_only() {
    let mut s = Server::start_with(Options::fast()).await;
    let old = s
        .new_task(
            "fees-old",
            "payment.release",
            json!({"payee": "p", "amount": 1, "currency": "EUR"}),
        )
        .await;
    let old_id = old["id"].as_str().unwrap().to_owned();
    let old_version = old["contract"]["config_version"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(old["contract"]["price"], 100);

    s.restart_with(
        Options::fast()
            .env("IDEM_OPERATIONS__PAYMENT_RELEASE__FEES__PRICE", "250")
            .env(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__FEES__CANCEL_AFTER_START_FIXED",
                "40",
            ),
    );
    let new = s
        .new_task(
            "fees-new",
            "payment.release",
            json!({"payee": "p", "amount": 2, "currency": "EUR"}),
        )
        .await;
    let new_id = new["id"].as_str().unwrap().to_owned();
    assert_eq!(new["contract"]["price"], 250);
    assert_ne!(
        new["contract"]["config_version"].as_str().unwrap(),
        old_version
    );
    // The old task still shows its frozen contract after the restart.
    assert_eq!(s.task(&old_id).await["contract"]["price"], 100);

    // Deliver both: each is charged by its own contract.
    for (id, price) in [(&old_id, 100), (&new_id, 250)] {
        let attempts = s.claim_op("payment.release", Some(10_000)).await;
        assert_eq!(attempts.len(), 1);
        let a = &attempts[0];
        let tid = a["task_id"].as_str().unwrap().to_owned();
        let body =
            json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": true}});
        s.report(a["id"].as_str().unwrap(), body).await.ok(200);
        let t = s.task(&tid).await;
        let expected = if &tid == id {
            price
        } else if price == 100 {
            250
        } else {
            100
        };
        assert_eq!(t["delivery"]["charge"], expected, "task {tid}");
        assert_eq!(t["delivery"]["charge"], t["contract"]["price"]);
    }
    // The acceptance event records each task's config version.
    for (id, version) in [
        (&old_id, old_version.clone()),
        (
            &new_id,
            new["contract"]["config_version"]
                .as_str()
                .unwrap()
                .to_owned(),
        ),
    ] {
        let events = s.events(id).await;
        assert_eq!(events[0]["type"], "task_submitted");
        assert_eq!(
            events[0]["data"]["decision"]["config_version"],
            version.as_str()
        );
    }

    // Cancellation fees follow the frozen contract too.
    let a = s
        .new_task(
            "fees-cancel-new",
            "payment.release",
            json!({"payee": "q", "amount": 3, "currency": "EUR"}),
        )
        .await;
    let claimed = s.claim_one("payment.release", Some(10_000)).await;
    assert_eq!(claimed["task_id"], a["id"]);
    s.cancel(a["id"].as_str().unwrap()).await;
    let body = json!({"generation": claimed["generation"], "outcome": "cancelled", "usage": 5});
    s.report(claimed["id"].as_str().unwrap(), body)
        .await
        .ok(200);
    let t = s.task(a["id"].as_str().unwrap()).await;
    assert_eq!(t["cancellation"]["fee"], 40 + 5);
}

/// The material fields a request was fingerprinted by are frozen in its
/// task's contract like the fees. After the configuration's fields change, a
/// retry is still judged by the rule its task was accepted under: the same
/// request (whatever immaterial fields or number spellings it carries, RFC
/// 8785) replays, a request that differs in a field that was material stays a
/// conflict.
#[tokio::test]
async fn a_retry_is_judged_by_the_fingerprint_fields_frozen_at_acceptance() {
    let mut s = Server::start_with(Options::fast()).await;
    let params = json!({"payee": "p", "amount": 7, "currency": "EUR", "memo": "x"});
    let first = s
        .new_task("order-9-payout", "payment.release", params.clone())
        .await;
    assert_eq!(
        first["contract"]["fingerprint"],
        json!(["/payee", "/amount", "/currency"])
    );
    s.restart_with(Options::fast().env(
        "IDEM_OPERATIONS__PAYMENT_RELEASE__FINGERPRINT",
        r#"["/payee","/amount"]"#,
    ));
    for retry in [
        params.clone(),
        json!({"payee": "p", "amount": 7, "currency": "EUR", "memo": "y"}),
        json!({"payee": "p", "amount": 7.0, "currency": "EUR"}),
        json!({"currency": "EUR", "amount": 7e0, "payee": "p"}),
    ] {
        let again = s
            .submit("order-9-payout", "payment.release", retry.clone())
            .await;
        assert_eq!(again.status, 201, "{retry}: {}", again.text);
        assert_eq!(again.header("idempotent-replayed"), "true", "{retry}");
        let again = again.ok(201);
        assert_eq!(again["meta"]["replayed"], json!(true));
        assert_eq!(again["task"]["id"], first["id"]);
    }
    // Currency was material when the task was accepted.
    for other in [
        json!({"payee": "p", "amount": 7, "currency": "USD"}),
        json!({"payee": "p", "amount": 8, "currency": "EUR"}),
    ] {
        s.submit("order-9-payout", "payment.release", other)
            .await
            .assert_problem(422, "IDEMPOTENCY_CONFLICT");
    }
    // A new task is fingerprinted, and its fields frozen, by the new rule.
    let new = s
        .new_task("order-10-payout", "payment.release", params)
        .await;
    assert_eq!(new["contract"]["fingerprint"], json!(["/payee", "/amount"]));
}

/// The schema a task was accepted under is frozen with its contract on the
/// retry path too: after the class's schema is tightened (here `amount` at
/// most 100), a retry of the accepted request replays (201, replayed) though
/// its body no longer matches, a different request under that key is the
/// usual conflict, and a new key with the same body gets 400 that creates
/// nothing.
#[tokio::test]
async fn a_retry_replays_after_the_schema_was_tightened() {
    let mut s = Server::start_with(Options::fast()).await;
    let params = json!({"payee": "p", "amount": 500, "currency": "EUR"});
    let first = s
        .new_task("order-11-payout", "payment.release", params.clone())
        .await;
    s.restart_with(Options::fast().env(
        "IDEM_OPERATIONS__PAYMENT_RELEASE__PARAMS_SCHEMA",
        r#"{ type = "object", required = ["payee", "amount", "currency"], properties = { amount = { type = "integer", maximum = 100 } } }"#,
    ));
    let again = s
        .submit("order-11-payout", "payment.release", params.clone())
        .await;
    assert_eq!(
        again.header("idempotent-replayed"),
        "true",
        "{}",
        again.text
    );
    let again = again.ok(201);
    assert_eq!(again["meta"]["replayed"], json!(true));
    assert_eq!(again["task"]["id"], first["id"]);
    s.submit(
        "order-11-payout",
        "payment.release",
        json!({"payee": "q", "amount": 500, "currency": "EUR"}),
    )
    .await
    .assert_problem(422, "IDEMPOTENCY_CONFLICT");
    let fresh = s.submit("order-12-payout", "payment.release", params).await;
    fresh.assert_problem(400, "INVALID_REQUEST");
    assert!(
        fresh.json["detail"].as_str().unwrap().ends_with(
            "nothing was created, and this Idempotency-Key holds no task of this operation"
        ),
        "{}",
        fresh.text
    );
    s.get(
        "/v1/tasks?operation=payment.release&idempotency_key=order-12-payout",
        &s.keys.acme,
    )
    .await
    .assert_problem(404, "NOT_FOUND");
}

/// Params are kept in the form they are fingerprinted in (RFC 8785): an
/// integral amount written `1250.0` is answered, stored and handed to the
/// executor as the integer `1250`, and a retry spelling it `1.25e3` replays
/// with `1250`.
#[tokio::test]
async fn integral_numbers_are_kept_and_handed_out_as_integers() {
    let s = Server::start_with(Options::fast()).await;
    let body = r#"{"operation":"payment.release","params":{"payee":"p","amount":1250.0,"currency":"EUR","fx":{"rate":1e0,"legs":[2.50,3.0E+1]}}}"#;
    let sent = s
        .http
        .post(format!("{}/v1/tasks", s.url))
        .bearer_auth(&s.keys.acme)
        .header("idempotency-key", "\"canon-1\"")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(sent.status().as_u16(), 201);
    let text = sent.text().await.unwrap();
    assert!(
        text.contains(r#""amount":1250,"#)
            && text.contains(r#""rate":1}"#)
            && text.contains(r#""legs":[2.5,30]"#),
        "{text}"
    );
    let claimed = s.claim_one("payment.release", None).await;
    assert_eq!(
        claimed["params"]["amount"].as_i64(),
        Some(1250),
        "{claimed}"
    );
    assert_eq!(claimed["params"]["fx"]["legs"], json!([2.5, 30]));
    let retry = s
        .submit(
            "canon-1",
            "payment.release",
            serde_json::from_str(
                r#"{"payee":"p","amount":1.25e3,"currency":"EUR","fx":{"legs":[2.5,30],"rate":1}}"#,
            )
            .unwrap(),
        )
        .await;
    assert_eq!(
        retry.header("idempotent-replayed"),
        "true",
        "{}",
        retry.text
    );
    assert_eq!(retry.json["task"]["params"]["amount"].as_i64(), Some(1250));
}
