//! Shared executor pools (SPEC §2.13): a pool key claims the tasks of the
//! tenants it serves, acts on their attempts, and finds no other tenant's.

use serde_json::json;

use crate::support::*;

/// A key created with `--serves acme` claims acme's task and not other's,
/// heartbeats, acknowledges and reports acme's attempt, and gets 404 for
/// every action on other's attempt; `--serves` is refused on a client key.
#[tokio::test]
async fn a_pool_key_acts_for_the_tenants_it_serves_only() {
    let srv = Server::fast().await;
    let (ok, out, err) = srv.cli(&[
        "keys", "create", "--tenant", "pool", "--role", "executor", "--serves", "acme",
    ]);
    assert!(ok, "keys create --serves: {err}");
    let pool = out.trim().to_owned();
    let (refused, _, err) = srv.cli(&[
        "keys", "create", "--tenant", "pool", "--role", "client", "--serves", "acme",
    ]);
    assert!(!refused && err.contains("--serves"), "{err}");
    let other = srv
        .submit_as(
            &srv.keys.other,
            &ikey(),
            "generation.dispatch",
            generation("o"),
        )
        .await;
    other.ok(201);
    let mine = srv
        .new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let claimed = srv
        .post(
            "/v1/attempts/claim",
            &pool,
            json!({"executor_id": "pool-1", "max": 10}),
        )
        .await;
    let attempts = claimed.ok(200)["attempts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(attempts.len(), 1, "acme's task only: {attempts:?}");
    assert_eq!(attempts[0]["task_id"], mine["id"]);
    let a_id = s(&attempts[0]["id"]);
    srv.post(
        &format!("/v1/attempts/{a_id}/heartbeat"),
        &pool,
        json!({"generation": 1}),
    )
    .await
    .ok(200);
    // other's attempt, claimed by other's executor: 404 for the pool key.
    let theirs = srv
        .post(
            "/v1/attempts/claim",
            &srv.keys.exec_other,
            json!({"executor_id": "other-1", "max": 1}),
        )
        .await;
    let theirs = theirs.ok(200)["attempts"][0]["id"].clone();
    let o_id = s(&theirs);
    for (action, body) in [
        ("heartbeat", json!({"generation": 1})),
        ("ack", json!({"generation": 1})),
        ("release", json!({"generation": 1})),
        ("report", json!({"generation": 1, "outcome": "succeeded"})),
    ] {
        srv.post(&format!("/v1/attempts/{o_id}/{action}"), &pool, body)
            .await
            .assert_problem(404, "NOT_FOUND");
    }
    // A pool key of tenant other serving acme: other's attempt is not one
    // it serves either (its pool claims none of other's tasks).
    let (ok, out, err) = srv.cli(&[
        "keys", "create", "--tenant", "other", "--role", "executor", "--serves", "acme",
    ]);
    assert!(ok, "keys create --serves: {err}");
    let other_pool = out.trim().to_owned();
    for (action, body) in [
        ("heartbeat", json!({"generation": 1})),
        ("ack", json!({"generation": 1})),
        ("release", json!({"generation": 1})),
        ("report", json!({"generation": 1, "outcome": "succeeded"})),
    ] {
        srv.post(&format!("/v1/attempts/{o_id}/{action}"), &other_pool, body)
            .await
            .assert_problem(404, "NOT_FOUND");
    }
    let done = srv
        .post(
            &format!("/v1/attempts/{a_id}/report"),
            &pool,
            json!({"generation": 1, "outcome": "succeeded"}),
        )
        .await;
    assert_eq!(done.ok(200)["task"]["state"], "succeeded");
}
