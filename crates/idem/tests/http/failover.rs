//! Failover on PostgreSQL (SPEC §5, docs/deployment.md): `idem serve` on a
//! multi-host URL over a primary and a streaming standby (throwaway clusters
//! each test makes and removes) follows the promoted standby without a
//! restart, and `IDEM_REQUIRE_SYNC_STANDBY` refuses submits while no
//! synchronous standby is attached.

use std::time::Duration;

use idem_store_postgres::testing::StandbyPair;
use reqwest::Method;
use serde_json::json;

use crate::support::{DEBUG_LOG, Resp, Server, generation, payment, s, send};

/// Submits until the answer is not a 503 `UNAVAILABLE` (at most 20 s,
/// 100 ms apart); returns it.
async fn submit_through_failover(srv: &Server, key: &str) -> Resp {
    for _ in 0..200 {
        let r = srv
            .submit(key, "generation.dispatch", generation(key))
            .await;
        if r.status != 503 {
            return r;
        }
        r.assert_problem(503, "UNAVAILABLE");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{key}: still 503 20 s after the promotion:\n{}", srv.log());
}

/// A task read held with `Prefer: wait` and a long-poll claim, both waiting
/// when the primary is killed (SIGKILL): a submit meanwhile answers 503
/// `UNAVAILABLE`; once the standby is promoted the same server (no restart)
/// accepts submits, the long-poll claim gets the new task, and the held read
/// answers with the task delivered on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_waits_and_long_polls_carry_on_across_a_failover() {
    let mut pair = StandbyPair::start(true).unwrap();
    pair.psql(pair.primary_port(), "CREATE DATABASE idem")
        .unwrap();
    let url = pair.url("idem");
    let keys = Server::create_keys(&url);
    let srv = Server::start_pg(&url, &keys, &[("RUST_LOG", DEBUG_LOG)]).await;
    let t = srv.new_task("pay-1", "payment.release", payment(5)).await;
    let id = s(&t["id"]);
    let held = tokio::spawn(send(
        srv.http
            .get(format!("{}/v1/tasks/{id}", srv.url))
            .bearer_auth(&srv.keys.acme)
            .header("prefer", "wait=30"),
    ));
    srv.wait_log(&format!("task wait holding task_id={id}"))
        .await;
    let long_poll = srv.long_poll_claim();
    srv.wait_long_poll().await;

    pair.kill_primary().unwrap();
    srv.submit("between", "generation.dispatch", generation("b"))
        .await
        .assert_problem(503, "UNAVAILABLE");
    pair.promote(true).unwrap();

    let created = submit_through_failover(&srv, "after").await;
    let new_id = s(&created.ok(201)["task"]["id"]);
    let claimed = long_poll.await.unwrap();
    let attempts = claimed.ok(200)["attempts"].as_array().unwrap().clone();
    assert_eq!(attempts.len(), 1, "{}", claimed.text);
    assert_eq!(attempts[0]["task_id"], json!(new_id));

    // The promotion started a new timeline: the task queued before it is
    // reconciled first (SPEC §2.11), then delivered by the reconciliation.
    let a = srv.claim_one("payment.release", None).await;
    assert_eq!(a["task_id"], json!(id));
    assert_eq!(a["kind"], json!("reconcile"), "{a}");
    srv.report(
        &s(&a["id"]),
        json!({"generation": a["generation"], "outcome": "committed", "result": {"ok": true}}),
    )
    .await
    .ok(200);
    let answered = held.await.unwrap();
    assert_eq!(
        answered.ok(200)["task"]["state"],
        json!("succeeded"),
        "{}",
        answered.text
    );
}

/// `IDEM_REQUIRE_SYNC_STANDBY` with an asynchronous standby: `/readyz` and
/// submits answer 503 `NO_SYNC_STANDBY` (with `Retry-After`) naming the
/// cause, and nothing is written; once the primary makes the standby
/// synchronous, within the check's interval both are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_sync_standby_refuses_submits_until_one_is_attached() {
    let pair = StandbyPair::start(false).unwrap();
    pair.psql(pair.primary_port(), "CREATE DATABASE idem")
        .unwrap();
    let url = pair.url("idem");
    let keys = Server::create_keys(&url);
    let srv = Server::start_pg(&url, &keys, &[("IDEM_REQUIRE_SYNC_STANDBY", "true")]).await;

    let ready = srv.call(Method::GET, "/readyz", None, None).await;
    ready.assert_problem(503, "NO_SYNC_STANDBY");
    assert!(
        ready.json["detail"]
            .as_str()
            .unwrap()
            .contains("synchronous_standby_names is empty"),
        "{}",
        ready.text
    );
    let refused = srv
        .submit("sync-1", "generation.dispatch", generation("x"))
        .await;
    refused.assert_problem(503, "NO_SYNC_STANDBY");
    assert_eq!(refused.header("retry-after"), "2");
    let written = pair
        .psql_in(
            pair.primary_port(),
            "idem",
            "SELECT count(*) FROM idempotency_keys",
        )
        .unwrap();
    assert_eq!(written, "0");

    pair.psql(
        pair.primary_port(),
        "ALTER SYSTEM SET synchronous_standby_names = '*'",
    )
    .unwrap();
    pair.psql(pair.primary_port(), "SELECT pg_reload_conf()")
        .unwrap();
    let mut status = 0;
    for _ in 0..100 {
        status = srv.call(Method::GET, "/readyz", None, None).await.status;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 200, "{}", srv.log());
    srv.submit("sync-1", "generation.dispatch", generation("x"))
        .await
        .ok(201);
}
