//! Rate limits over HTTP (SPEC §8.1): 429 `RATE_LIMITED` with `Retry-After`
//! for a new task over its tenant's limit, replays answered as usual, the
//! refused key accepted later as a new task; attempt starts throttled per
//! class. One token per 100 s, so only the test clock refills a bucket.

use serde_json::json;

use crate::support::{Options, Server, payment};

/// Options with `extra` TOML appended to the in-process configuration.
fn with(extra: &str) -> Options {
    let mut opts = Options::moved();
    opts.config = Some(format!("{}\n{extra}\n", opts.config.unwrap_or_default()));
    opts
}

#[tokio::test]
async fn a_new_task_over_the_tenants_limit_is_429_and_its_key_stays_free() {
    let srv = Server::in_process_with(with(
        "[tenants.acme]\nsubmits_per_s = 0.01\nsubmits_burst = 1",
    ))
    .await;
    srv.new_task("k1", "payment.release", payment(100)).await;
    let r = srv.submit("k2", "payment.release", payment(200)).await;
    r.assert_problem(429, "RATE_LIMITED");
    let after: u64 = r
        .header("retry-after")
        .parse()
        .expect("Retry-After seconds");
    assert!((1..=100).contains(&after), "Retry-After {after}");
    // A replay and a conflict are answered as usual with the bucket empty.
    let replay = srv.submit("k1", "payment.release", payment(100)).await;
    assert_eq!(replay.ok(201)["meta"]["replayed"], json!(true));
    srv.submit("k1", "payment.release", payment(999))
        .await
        .assert_problem(422, "IDEMPOTENCY_CONFLICT");
    // The refused key holds nothing.
    let found = srv
        .get(
            "/v1/tasks?idempotency_key=k2&operation=payment.release",
            &srv.keys.acme,
        )
        .await;
    assert_eq!(found.status, 404, "{}", found.text);
    // Another tenant has no limit of its own.
    let other = srv
        .submit_as(&srv.keys.other, "k2", "payment.release", payment(200))
        .await;
    other.ok(201);
    srv.advance(100_000);
    srv.new_task("k2", "payment.release", payment(200)).await;
    srv.submit("k3", "payment.release", payment(300))
        .await
        .assert_problem(429, "RATE_LIMITED");
}

#[tokio::test]
async fn a_claim_starts_at_most_the_classes_attempt_starts() {
    let srv = Server::in_process_with(with(
        "[operations.\"payment.release\".flow]\nattempt_starts_per_s = 0.01",
    ))
    .await;
    for k in ["a", "b"] {
        srv.new_task(k, "payment.release", payment(100)).await;
    }
    let body = json!({"executor_id": "ex-1", "operations": ["payment.release"], "max": 2});
    let first = srv.claim(body.clone()).await;
    assert_eq!(first.ok(200)["attempts"].as_array().map(Vec::len), Some(1));
    let second = srv.claim(body.clone()).await;
    assert_eq!(second.ok(200)["attempts"].as_array().map(Vec::len), Some(0));
    srv.advance(100_000);
    let third = srv.claim(body).await;
    assert_eq!(third.ok(200)["attempts"].as_array().map(Vec::len), Some(1));
}
