//! Suspected second effects (SPEC §2 "Second effects") black box: a
//! duplicate `succeeded` report on a task that ended without delivery shows
//! in the task answer's `second_effects`, its `second_effect_suspected`
//! event in the task's events and on the tenant feed's stream, in
//! `idem_second_effects_suspected_total`, and in search by its
//! `external_txn_id` and by `second_effect`; an admin of the task's tenant
//! acknowledges it once (403 for other roles, 404 for another tenant or an
//! unknown id, 400 for a bad body, nothing changed), also with `idem task
//! acknowledge-effect`.

use std::time::Duration;

use futures::StreamExt;
use idem_client::Client;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::{POLL_TIMEOUT, Server, payment, s};

const PAY: &str = "payment.release";

/// The ids of the tasks a search with `query` finds for `key`.
async fn found(srv: &Server, key: &str, query: &str) -> Vec<String> {
    let page = srv.get(&format!("/v1/tasks?{query}"), key).await;
    page.ok(200)["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .map(|t| s(&t["id"]))
        .collect()
}

/// A payment whose one attempt failed `transient` (the task failed), then
/// reported `succeeded` with `txn`: (task id, attempt).
async fn failed_then_succeeded(srv: &Server, ikey: &str, txn: &str) -> (String, Value) {
    let t = srv.new_task(ikey, PAY, payment(5)).await;
    let a = srv.claim_one(PAY, None).await;
    let failed =
        json!({"generation": a["generation"], "outcome": "failed", "failure_class": "transient"});
    srv.report(&s(&a["id"]), failed).await.ok(200);
    let succeeded = json!({
        "generation": a["generation"], "outcome": "succeeded",
        "result": {"ok": true}, "external_txn_id": txn,
    });
    srv.report(&s(&a["id"]), succeeded)
        .await
        .assert_problem(409, "ATTEMPT_ALREADY_REPORTED");
    (s(&t["id"]), a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_effect_is_shown_streamed_counted_searched_and_acknowledged() {
    let srv = Server::fast().await;
    let (admin_id, admin) = srv.create_key("acme", "admin", None);
    let (_, other_admin) = srv.create_key("other", "admin", None);
    let feed = Client::new(&srv.url, &srv.keys.acme).expect("client");
    let mut stream = feed.feed_stream(None).await.expect("feed stream");
    let (id, a) = failed_then_succeeded(&srv, "se-1", "psp-1").await;

    let task = srv.task(&id).await;
    let effects = task["second_effects"].clone();
    assert_eq!(
        effects,
        json!([{
            "external_txn_id": "psp-1",
            "attempt_id": a["id"],
            "generation": a["generation"],
            "evidence": "duplicate_report",
            "suspected_at": effects[0]["suspected_at"],
            "acknowledgment": null,
        }])
    );
    let events = srv.events(&id).await;
    let e = events
        .iter()
        .find(|e| e["type"] == json!("second_effect_suspected"))
        .expect("a second_effect_suspected event");
    assert_eq!(
        e["data"],
        json!({
            "attempt_id": a["id"],
            "delivered_txn_id": null,
            "evidence": "duplicate_report",
            "external_txn_id": "psp-1",
            "generation": a["generation"],
            "state": "failed",
        })
    );
    // The tenant feed's stream carries it.
    loop {
        let next = tokio::time::timeout(POLL_TIMEOUT, stream.next())
            .await
            .expect("a feed event within the poll timeout")
            .expect("the stream goes on")
            .expect("a decoded event");
        if next.event.kind == "second_effect_suspected" {
            assert_eq!(next.task_id.to_string(), id);
            break;
        }
    }
    // Counted by the process that raised it.
    let deadline = Instant::now() + POLL_TIMEOUT;
    loop {
        let m = srv.call(reqwest::Method::GET, "/metrics", None, None).await;
        let count = m
            .text
            .lines()
            .find_map(|l| {
                l.strip_prefix(
                    "idem_second_effects_suspected_total{operation=\"payment.release\"} ",
                )
            })
            .map(|v| v.trim().to_owned());
        if count.as_deref() == Some("1") {
            break;
        }
        assert!(Instant::now() < deadline, "counter is {count:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for q in [
        "external_txn_id=psp-1",
        "second_effect=suspected",
        "second_effect=unacknowledged",
    ] {
        assert_eq!(
            found(&srv, &srv.keys.acme, q).await,
            vec![id.clone()],
            "{q}"
        );
        assert!(
            found(&srv, &srv.keys.other, q).await.is_empty(),
            "{q}: other tenant"
        );
    }
    srv.get("/v1/tasks?second_effect=maybe", &srv.keys.acme)
        .await
        .assert_problem(400, "INVALID_REQUEST");

    // The acknowledgment.
    let path = format!("/v1/tasks/{id}/second-effects/acknowledge");
    let good = json!({"external_txn_id": "psp-1", "resolution": "refund_issued", "reason": "refunded, ticket OPS-9"});
    for key in [&srv.keys.acme, &srv.keys.exec] {
        srv.post(&path, key, good.clone())
            .await
            .assert_problem(403, "PERMISSION_DENIED");
    }
    srv.post(&path, &other_admin, good.clone())
        .await
        .assert_problem(404, "NOT_FOUND");
    srv.post(
        &format!("/v1/tasks/{}/second-effects/acknowledge", uuid::Uuid::nil()),
        &admin,
        good.clone(),
    )
    .await
    .assert_problem(404, "NOT_FOUND");
    for unknown in [json!("psp-2"), Value::Null] {
        let mut b = good.clone();
        b["external_txn_id"] = unknown;
        srv.post(&path, &admin, b)
            .await
            .assert_problem(404, "NOT_FOUND");
    }
    let bad = [
        json!({"external_txn_id": "psp-1", "resolution": "refunded", "reason": "x"}),
        json!({"external_txn_id": "psp-1", "reason": "x"}),
        json!({"resolution": "false_alarm", "reason": "x"}),
        json!({"external_txn_id": "", "resolution": "false_alarm", "reason": "x"}),
        json!({"external_txn_id": "psp-1", "resolution": "false_alarm", "reason": "  "}),
        json!({"external_txn_id": "psp-1", "resolution": "false_alarm"}),
    ];
    for b in bad {
        srv.post(&path, &admin, b.clone())
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    assert_eq!(srv.events(&id).await.len(), events.len(), "nothing changed");
    let acked = srv.post(&path, &admin, good.clone()).await.ok(200).clone();
    let ack = acked["task"]["second_effects"][0]["acknowledgment"].clone();
    assert_eq!(ack["resolution"], json!("refund_issued"));
    assert_eq!(ack["reason"], json!("refunded, ticket OPS-9"));
    assert_eq!(
        ack["actor"],
        json!({"type": "api_key", "api_key_id": admin_id})
    );
    assert_eq!(
        acked["task"]["state"],
        json!("failed"),
        "the task does not change"
    );
    let after = srv.events(&id).await;
    assert_eq!(after.len(), events.len() + 1);
    let last = after.last().expect("an event");
    assert_eq!(last["type"], json!("second_effect_acknowledged"));
    assert_eq!(
        last["data"],
        json!({
            "actor": {"type": "api_key", "api_key_id": admin_id},
            "external_txn_id": "psp-1",
            "reason": "refunded, ticket OPS-9",
            "resolution": "refund_issued",
            "state": "failed",
        })
    );
    // Idempotent: the same answer, nothing written.
    let mut other = good.clone();
    other["resolution"] = json!("false_alarm");
    let again = srv.post(&path, &admin, other).await.ok(200).clone();
    assert_eq!(
        again["task"]["second_effects"],
        acked["task"]["second_effects"]
    );
    assert_eq!(srv.events(&id).await.len(), after.len());
    assert!(
        found(&srv, &srv.keys.acme, "second_effect=unacknowledged")
            .await
            .is_empty()
    );
    assert_eq!(
        found(&srv, &srv.keys.acme, "second_effect=suspected").await,
        vec![id]
    );
}

/// `idem task acknowledge-effect` acknowledges as the command line, names
/// the effect without an id with `--without-id`, and refuses an unknown one.
#[tokio::test]
async fn the_cli_acknowledges_a_second_effect() {
    let srv = Server::fast().await;
    let t = srv.new_task("se-cli", PAY, payment(5)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one(PAY, None).await;
    let failed =
        json!({"generation": a["generation"], "outcome": "failed", "failure_class": "transient"});
    srv.report(&s(&a["id"]), failed).await.ok(200);
    let succeeded =
        json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": true}});
    srv.report(&s(&a["id"]), succeeded)
        .await
        .assert_problem(409, "ATTEMPT_ALREADY_REPORTED");
    let (ok, _, err) = srv.cli(&[
        "task",
        "acknowledge-effect",
        &id,
        "--external-txn-id",
        "nope",
        "--resolution",
        "false_alarm",
        "--reason",
        "checked",
        "--actor",
        "ops-1",
    ]);
    assert!(!ok, "an unknown second effect is refused");
    assert!(err.contains("no suspected second effect"), "{err}");
    let (ok, out, err) = srv.cli(&[
        "task",
        "acknowledge-effect",
        &id,
        "--without-id",
        "--resolution",
        "provider_deduplicated",
        "--reason",
        "provider shows one",
        "--actor",
        "ops-1",
    ]);
    assert!(ok, "{err}");
    let answer: Value = serde_json::from_str(&out).expect("JSON");
    let ack = &answer["second_effect"]["acknowledgment"];
    assert_eq!(ack["actor"], json!({"type": "cli", "user": "ops-1"}));
    assert_eq!(ack["resolution"], json!("provider_deduplicated"));
    assert_eq!(answer["second_effect"]["external_txn_id"], Value::Null);
    let task = srv.task(&id).await;
    assert_eq!(task["second_effects"][0]["acknowledgment"], *ack);
}

/// The SDK reads `second_effects`, searches with `second_effect`, and
/// acknowledges with an admin key (404 for an id the task does not have).
#[tokio::test]
async fn the_sdk_reads_searches_and_acknowledges_second_effects() {
    let srv = Server::fast().await;
    let (_, admin) = srv.create_key("acme", "admin", None);
    let (id, _) = failed_then_succeeded(&srv, "se-sdk", "psp-7").await;
    let task_id: uuid::Uuid = id.parse().expect("uuid");
    let client = Client::new(&srv.url, &srv.keys.acme).expect("client");
    let task = client.get_task(task_id).await.expect("task");
    assert_eq!(task.second_effects.len(), 1);
    assert_eq!(
        task.second_effects[0].external_txn_id.as_deref(),
        Some("psp-7")
    );
    assert_eq!(task.second_effects[0].evidence, "duplicate_report");
    let filter = idem_client::TaskFilter {
        second_effect: Some("unacknowledged".into()),
        ..Default::default()
    };
    let page = client.list_tasks(&filter, None).await.expect("search");
    assert_eq!(
        page.tasks.iter().map(|t| t.id).collect::<Vec<_>>(),
        vec![task_id]
    );
    let admin = Client::new(&srv.url, &admin).expect("admin client");
    let err = admin
        .acknowledge_second_effect(
            task_id,
            None,
            idem_client::EffectResolution::FalseAlarm,
            "x",
        )
        .await
        .expect_err("no second effect without an id");
    assert_eq!(err.problem().map(|p| p.status), Some(404), "{err:?}");
    let acked = admin
        .acknowledge_second_effect(
            task_id,
            Some("psp-7"),
            idem_client::EffectResolution::ProviderDeduplicated,
            "provider shows one charge",
        )
        .await
        .expect("acknowledged");
    let ack = acked.second_effects[0].acknowledgment.clone().expect("ack");
    assert_eq!(ack.resolution, "provider_deduplicated");
    assert_eq!(ack.reason, "provider shows one charge");
    assert!(
        client
            .list_tasks(&filter, None)
            .await
            .expect("search")
            .tasks
            .is_empty()
    );
}
