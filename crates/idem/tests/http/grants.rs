//! A key limited to some operation classes (`--operations`) can neither read
//! nor change tasks and attempts of other classes (SPEC §4 Auth: "a list of
//! operation classes it is limited to"); those answer 404 (existence is not
//! leaked), and a lookup naming an ungranted class answers 403.

use serde_json::json;

use crate::support::Server;

#[tokio::test]
async fn limited_keys_cannot_touch_other_classes() {
    let s = Server::fast().await;
    let (_, pay_exec) = s.create_key("acme", "executor", Some("payment.release"));
    let (_, gen_client) = s.create_key("acme", "client", Some("generation.dispatch"));

    let dispatch = s
        .new_task("g1", "generation.dispatch", json!({"prompt": "x"}))
        .await;
    let pay = s
        .new_task(
            "order-42-payout",
            "payment.release",
            json!({"payee": "p", "amount": 5, "currency": "EUR"}),
        )
        .await;
    let gen_id = dispatch["id"].as_str().unwrap();
    let pay_id = pay["id"].as_str().unwrap();

    // An executor of acme (all classes) holds the generation attempt.
    let a = s.claim_one("generation.dispatch", Some(10_000)).await;
    let aid = a["id"].as_str().unwrap();
    let g = a["generation"].clone();
    // The payment-only executor may not heartbeat, ack, report or release it.
    for (path, body) in [
        (
            format!("/v1/attempts/{aid}/release"),
            json!({"generation": g}),
        ),
        (
            format!("/v1/attempts/{aid}/heartbeat"),
            json!({"generation": g}),
        ),
        (format!("/v1/attempts/{aid}/ack"), json!({"generation": g})),
        (
            format!("/v1/attempts/{aid}/report"),
            json!({"generation": g, "outcome": "succeeded", "result": {"forged": true}}),
        ),
    ] {
        s.post(&path, &pay_exec, body)
            .await
            .assert_problem(404, "NOT_FOUND");
    }
    let t = s.task(gen_id).await;
    assert_eq!(t["state"], "running");
    assert_eq!(t["delivery"], serde_json::Value::Null);
    // Nor claim generation work.
    let r = s
        .post(
            "/v1/attempts/claim",
            &pay_exec,
            json!({"executor_id": "e", "operations": ["generation.dispatch"]}),
        )
        .await;
    r.assert_problem(403, "PERMISSION_DENIED");

    // The generation-only client may not see or cancel the payment.
    for path in [
        format!("/v1/tasks/{pay_id}"),
        format!("/v1/tasks/{pay_id}/events"),
        format!("/v1/tasks/{pay_id}/attempts"),
    ] {
        s.get(&path, &gen_client)
            .await
            .assert_problem(404, "NOT_FOUND");
    }
    s.post(
        &format!("/v1/tasks/{pay_id}/cancel"),
        &gen_client,
        json!({}),
    )
    .await
    .assert_problem(404, "NOT_FOUND");
    s.get(
        "/v1/tasks?operation=payment.release&idempotency_key=order-42-payout",
        &gen_client,
    )
    .await
    .assert_problem(403, "PERMISSION_DENIED");
    assert_eq!(
        s.task(pay_id).await["cancellation"],
        serde_json::Value::Null
    );
    // Its own class works.
    s.get(&format!("/v1/tasks/{gen_id}"), &gen_client)
        .await
        .ok(200);
}

#[tokio::test]
async fn bearer_scheme_is_case_insensitive_and_bad_ids_are_problems() {
    let s = Server::fast().await;
    let t = s
        .new_task("k", "generation.dispatch", json!({"p": 1}))
        .await;
    let id = t["id"].as_str().unwrap();
    for scheme in ["BEARER", "bEaReR", "Bearer\t"] {
        let r = s
            .http
            .get(format!("{}/v1/tasks/{id}", s.url))
            .header(
                "Authorization",
                format!("{scheme} {}", s.keys.acme).replace("\t ", "\t"),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "scheme {scheme:?}");
    }
    for path in [
        "/v1/tasks/%ff",
        "/v1/tasks/not-a-uuid/events",
        "/v1/tasks/%ff/cancel",
    ] {
        let r = s
            .http
            .get(format!("{}{path}", s.url))
            .bearer_auth(&s.keys.acme)
            .send()
            .await
            .unwrap();
        let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(
            r.status() == 404 || r.status() == 405,
            "{path}: {}",
            r.status()
        );
        assert_eq!(ct, "application/problem+json", "{path}");
    }
}

/// The server keeps what a submit body yielded (its fingerprint) by its exact
/// bytes, so a retry skips that work. The same bytes from another caller are
/// still that caller's request: its grant is checked, and its tenant is its
/// own scope.
#[tokio::test]
async fn the_same_body_bytes_are_judged_per_caller() {
    let s = Server::fast().await;
    let (_, gen_client) = s.create_key("acme", "client", Some("generation.dispatch"));
    let params = json!({"payee": "p", "amount": 5, "currency": "EUR"});
    let first = s
        .new_task("order-7-payout", "payment.release", params.clone())
        .await;
    // Byte for byte the same request, first as acme again: a replay.
    let again = s
        .submit("order-7-payout", "payment.release", params.clone())
        .await;
    let again = again.ok(201);
    assert_eq!(again["meta"]["replayed"], json!(true));
    assert_eq!(again["task"]["id"], first["id"]);
    // From a key not granted payment.release: refused, nothing revealed.
    s.submit_as(
        &gen_client,
        "order-7-payout",
        "payment.release",
        params.clone(),
    )
    .await
    .assert_problem(403, "PERMISSION_DENIED");
    // From another tenant: its own scope, so a new task of its own.
    let other = s
        .submit_as(&s.keys.other, "order-7-payout", "payment.release", params)
        .await;
    let other = other.ok(201);
    assert_eq!(other["meta"]["replayed"], json!(false));
    assert_ne!(other["task"]["id"], first["id"]);
}
