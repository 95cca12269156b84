//! Operator actions (black box): retry-now, an
//! admin's cancel, resolve and redrive over HTTP, the SDK and `idem task`.
//! Each needs an admin key of the task's tenant (a client or executor key
//! gets 403, another tenant's admin 404) and a reason, records the key and
//! the reason in its event, refuses a state it does not apply to with 409
//! `INVALID_STATE`, and is ordered against an executor's report by the store.

use idem_client::Client;
use serde_json::{Value, json};

use crate::support::{Resp, Server, generation, payment, s};

const PAY: &str = "payment.release";
const GEN: &str = "generation.dispatch";

/// An in-process server with an admin key of `acme` and one of `other`:
/// `(server, acme admin id, acme admin key, other admin key)`.
async fn with_admins() -> (Server, String, String, String) {
    let srv = Server::in_process().await;
    let (id, admin) = srv.create_key("acme", "admin", None);
    let (_, other) = srv.create_key("other", "admin", None);
    (srv, id, admin, other)
}

async fn act(srv: &Server, key: &str, id: &str, action: &str, body: Value) -> Resp {
    srv.post(&format!("/v1/tasks/{id}/{action}"), key, body)
        .await
}

fn why() -> Value {
    json!({"reason": "provider dashboard checked (ticket OPS-7)"})
}

/// The newest event of `kind`, checked to carry the admin's key id and the reason.
fn recorded(events: &[Value], kind: &str, admin_id: &str) -> Value {
    let e = events
        .iter()
        .rev()
        .find(|e| e["type"] == json!(kind))
        .unwrap_or_else(|| panic!("no {kind} event: {events:?}"));
    assert_eq!(
        e["data"]["actor"],
        json!({"type": "api_key", "api_key_id": admin_id})
    );
    assert_eq!(e["data"]["reason"], why()["reason"]);
    e["data"].clone()
}

fn count(events: &[Value], kind: &str) -> usize {
    events.iter().filter(|e| e["type"] == json!(kind)).count()
}

/// A payment whose attempt reported `unknown`, and its leased reconcile attempt.
async fn reconciling(srv: &Server, ikey: &str) -> (String, Value) {
    let t = srv.new_task(ikey, PAY, payment(5)).await;
    let a = srv.claim_one(PAY, None).await;
    let gen_ = a["generation"].clone();
    srv.report(
        &s(&a["id"]),
        json!({"generation": gen_, "outcome": "unknown"}),
    )
    .await
    .ok(200);
    let r = srv.claim_one(PAY, None).await;
    assert_eq!(r["kind"], json!("reconcile"));
    (s(&t["id"]), r)
}

/// A payment whose one attempt failed `transient` (a non-safe class is not retried).
async fn failed_payment(srv: &Server, ikey: &str) -> (String, Value) {
    let t = srv.new_task(ikey, PAY, payment(5)).await;
    let a = srv.claim_one(PAY, None).await;
    let body =
        json!({"generation": a["generation"], "outcome": "failed", "failure_class": "transient"});
    let t2 = srv.report(&s(&a["id"]), body).await.ok(200)["task"].clone();
    assert_eq!(t2["state"], json!("failed"));
    (s(&t["id"]), a)
}

#[tokio::test]
async fn every_action_needs_an_admin_of_the_tasks_tenant_and_a_reason() {
    let (srv, _, admin, other_admin) = with_admins().await;
    let t = srv.new_task("perm-1", PAY, payment(5)).await;
    let id = s(&t["id"]);
    let bodies = [
        ("retry-now", why()),
        ("cancel", why()),
        (
            "resolve",
            json!({"outcome": "not_committed", "reason": "x"}),
        ),
        ("redrive", why()),
    ];
    for (action, body) in &bodies {
        act(&srv, &srv.keys.exec, &id, action, body.clone())
            .await
            .assert_problem(403, "PERMISSION_DENIED");
        if *action != "cancel" {
            // A client may cancel (without a reason), nothing else.
            act(&srv, &srv.keys.acme, &id, action, body.clone())
                .await
                .assert_problem(403, "PERMISSION_DENIED");
        }
        act(&srv, &other_admin, &id, action, body.clone())
            .await
            .assert_problem(404, "NOT_FOUND");
        let bad_reasons = [
            None,
            Some(json!("")),
            Some(json!("   ")),
            Some(json!("two\nlines")),
            Some(json!("x".repeat(501))),
            Some(json!(7)),
        ];
        for reason in bad_reasons {
            let mut b = body.clone();
            match reason {
                Some(r) => b["reason"] = r,
                None => {
                    b.as_object_mut().map(|o| o.remove("reason"));
                }
            }
            act(&srv, &admin, &id, action, b)
                .await
                .assert_problem(400, "INVALID_REQUEST");
        }
        let no_body = srv
            .call(
                reqwest::Method::POST,
                &format!("/v1/tasks/{id}/{action}"),
                Some(&admin),
                None,
            )
            .await;
        no_body.assert_problem(400, "INVALID_REQUEST");
    }
    // Nothing above changed the task.
    let now = srv.task(&id).await;
    assert_eq!(
        (now["state"].clone(), now["generation"].clone()),
        (json!("queued"), json!(0))
    );
    assert_eq!(srv.events(&id).await.len(), 1);
}

#[tokio::test]
async fn retry_now_makes_a_backing_off_task_claimable_at_once() {
    let (srv, admin_id, admin, _) = with_admins().await;
    let t = srv.new_task("rn-1", GEN, generation("a")).await;
    let id = s(&t["id"]);
    act(&srv, &admin, &id, "retry-now", why())
        .await
        .assert_problem(409, "INVALID_STATE");
    let a = srv.claim_one(GEN, None).await;
    let body =
        json!({"generation": a["generation"], "outcome": "failed", "failure_class": "transient"});
    srv.report(&s(&a["id"]), body).await.ok(200);
    assert_eq!(srv.task(&id).await["state"], json!("retry_wait"));
    // The backoff (60 s of the test clock) has not passed.
    assert!(srv.claim_op(GEN, None).await.is_empty());
    let r = act(&srv, &admin, &id, "retry-now", why()).await;
    assert_eq!(r.ok(200)["task"]["state"], json!("queued"));
    let next = srv.claim_op(GEN, None).await;
    assert_eq!(next.len(), 1, "claimable at once");
    assert_eq!(next[0]["task_id"], json!(id));
    let events = srv.events(&id).await;
    let data = recorded(&events, "operator_retry_now", &admin_id);
    assert_eq!(data["state"], json!("retry_wait"));
}

#[tokio::test]
async fn an_admins_cancel_is_the_clients_with_actor_and_reason() {
    let (srv, admin_id, admin, _) = with_admins().await;
    let t = srv.new_task("ac-1", PAY, payment(5)).await;
    let id = s(&t["id"]);
    let r = act(&srv, &admin, &id, "cancel", why()).await;
    let body = r.ok(200).clone();
    assert_eq!(body["cancellation"]["status"], json!("confirmed"));
    assert_eq!(body["task"]["state"], json!("cancelled"));
    let events = srv.events(&id).await;
    recorded(&events, "operator_cancel", &admin_id);
    assert_eq!(count(&events, "cancel_confirmed"), 1);
    // A client's cancel still needs no body and answers the same record.
    let again = srv.cancel(&id).await;
    assert_eq!(again.ok(200)["cancellation"], body["cancellation"]);

    // Running: requested; delivery then wins, as for a client.
    let t = srv.new_task("ac-2", PAY, payment(5)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one(PAY, None).await;
    let r = act(&srv, &admin, &id, "cancel", why()).await;
    assert_eq!(r.ok(202)["cancellation"]["status"], json!("requested"));
    let done = srv
        .report(
            &s(&a["id"]),
            json!({"generation": a["generation"], "outcome": "succeeded", "result": {}}),
        )
        .await;
    let task = done.ok(200)["task"].clone();
    assert_eq!(task["cancellation"]["status"], json!("too_late"));
    assert_eq!(task["cancellation"]["fee"], task["delivery"]["charge"]);
}

#[tokio::test]
async fn resolve_delivers_once_and_fences_the_reconcile_attempt() {
    let (srv, admin_id, admin, _) = with_admins().await;
    let queued = srv.new_task("rs-0", PAY, payment(5)).await;
    let body = json!({"outcome": "committed", "result": {"paid": true}, "external_txn_id": "psp-9", "reason": why()["reason"]});
    act(&srv, &admin, &s(&queued["id"]), "resolve", body.clone())
        .await
        .assert_problem(409, "INVALID_STATE");
    srv.cancel(&s(&queued["id"])).await.ok(200);

    let (id, r) = reconciling(&srv, "rs-1").await;
    for bad in [
        json!({"outcome": "committed", "reason": "x"}),
        json!({"outcome": "not_committed", "result": {}, "reason": "x"}),
        json!({"outcome": "not_committed", "external_txn_id": "t", "reason": "x"}),
        json!({"outcome": "maybe", "reason": "x"}),
        json!({"outcome": "committed", "result": {}, "external_txn_id": "", "reason": "x"}),
    ] {
        act(&srv, &admin, &id, "resolve", bad)
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    let done = act(&srv, &admin, &id, "resolve", body.clone()).await;
    let task = done.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("succeeded"));
    assert_eq!(task["delivery"]["result"], json!({"paid": true}));
    assert_eq!(task["delivery"]["external_txn_id"], json!("psp-9"));
    assert_eq!(task["delivery"]["charge"], task["contract"]["price"]);
    // The reconcile attempt reports after the resolve: stale evidence.
    let late = srv
        .report(
            &s(&r["id"]),
            json!({"generation": r["generation"], "outcome": "committed", "result": {"paid": "twice"}}),
        )
        .await;
    late.assert_problem(409, "STALE_GENERATION");
    act(&srv, &admin, &id, "resolve", body)
        .await
        .assert_problem(409, "INVALID_STATE");
    let events = srv.events(&id).await;
    let data = recorded(&events, "operator_resolved", &admin_id);
    assert_eq!(data["outcome"], json!("committed"));
    assert_eq!(data["retired_attempt_id"], r["id"]);
    assert_eq!(count(&events, "delivered"), 1);
    assert_eq!(srv.task(&id).await["delivery"], task["delivery"]);
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempts[1]["state"], json!("expired"));
    assert_eq!(
        attempts[1]["evidence"][0]["disposition"],
        json!("stale_generation")
    );

    // not_committed: the next execute attempt starts.
    let (id, _) = reconciling(&srv, "rs-2").await;
    let body = json!({"outcome": "not_committed", "reason": why()["reason"]});
    let t = act(&srv, &admin, &id, "resolve", body).await.ok(200)["task"].clone();
    assert_eq!(t["state"], json!("queued"));
    let next = srv.claim_one(PAY, None).await;
    assert_eq!(
        (next["task_id"].clone(), next["kind"].clone()),
        (json!(id), json!("execute"))
    );
}

#[tokio::test]
async fn redrive_grants_one_more_attempt_and_a_payment_delivers_once() {
    let (srv, admin_id, admin, _) = with_admins().await;
    let (id, a) = failed_payment(&srv, "rd-1").await;
    let t = act(&srv, &admin, &id, "redrive", why()).await.ok(200)["task"].clone();
    assert_eq!(t["state"], json!("queued"));
    assert_eq!(t["failure"], Value::Null);
    let data = recorded(&srv.events(&id).await, "operator_redriven", &admin_id);
    assert_eq!(data["failure"]["class"], json!("transient"));
    assert_eq!(
        data["execute_limit"],
        json!(t["contract"]["retry"]["max_attempts"].as_i64().unwrap() + 1)
    );
    let b = srv.claim_one(PAY, None).await;
    assert_eq!(
        (b["task_id"].clone(), b["number"].clone()),
        (json!(id), json!(2))
    );
    let done = srv
        .report(
            &s(&b["id"]),
            json!({"generation": b["generation"], "outcome": "succeeded", "result": {"ok": 1}}),
        )
        .await;
    let task = done.ok(200)["task"].clone();
    assert_eq!(task["delivery"]["charge"], task["contract"]["price"]);
    // The first attempt's late success changes nothing.
    let late = srv
        .report(
            &s(&a["id"]),
            json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": 2}}),
        )
        .await;
    assert_eq!(late.status, 409, "{}", late.text);
    let events = srv.events(&id).await;
    assert_eq!(count(&events, "delivered"), 1, "delivered once");
    assert_eq!(srv.task(&id).await["delivery"], task["delivery"]);
    act(&srv, &admin, &id, "redrive", why())
        .await
        .assert_problem(409, "INVALID_STATE");

    // invalid_input is never redriven; nor is a cancelled task.
    let t = srv.new_task("rd-2", PAY, payment(5)).await;
    let a = srv.claim_one(PAY, None).await;
    let body = json!({"generation": a["generation"], "outcome": "failed", "failure_class": "invalid_input"});
    srv.report(&s(&a["id"]), body).await.ok(200);
    act(&srv, &admin, &s(&t["id"]), "redrive", why())
        .await
        .assert_problem(409, "INVALID_STATE");
    let t = srv.new_task("rd-3", PAY, payment(5)).await;
    srv.cancel(&s(&t["id"])).await.ok(200);
    act(&srv, &admin, &s(&t["id"]), "redrive", why())
        .await
        .assert_problem(409, "INVALID_STATE");

    // The submitting key revoked: refused, the task stays failed.
    let (id, _) = failed_payment(&srv, "rd-4").await;
    srv.revoke_key(&srv.keys.acme_id);
    act(&srv, &admin, &id, "redrive", why())
        .await
        .assert_problem(409, "SUBMITTER_REVOKED");
    let t = srv.get(&format!("/v1/tasks/{id}"), &admin).await;
    assert_eq!(t.ok(200)["task"]["state"], json!("failed"));
}

/// 20 rounds over HTTP: a reconcile attempt's `committed` report and an
/// admin's `not_committed` resolve, sent at once: exactly one applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_and_a_report_sent_at_once_apply_exactly_one() {
    let (srv, _, admin, _) = with_admins().await;
    for round in 0..20 {
        let (id, r) = reconciling(&srv, &format!("race-{round}")).await;
        let rid = s(&r["id"]);
        let report = srv.report(
            &rid,
            json!({"generation": r["generation"], "outcome": "committed", "result": {}}),
        );
        let body = json!({"outcome": "not_committed", "reason": "race"});
        let resolve = act(&srv, &admin, &id, "resolve", body);
        let (reported, resolved) = tokio::join!(report, resolve);
        match (reported.status, resolved.status) {
            (200, 409) => assert_eq!(resolved.code(), "INVALID_STATE"),
            (409, 200) => assert_eq!(reported.code(), "STALE_GENERATION"),
            other => panic!(
                "round {round}: exactly one must apply: {other:?} {} {}",
                reported.text, resolved.text
            ),
        }
        let events = srv.events(&id).await;
        assert_eq!(
            count(&events, "reconciled") + count(&events, "operator_resolved"),
            1
        );
        if srv.task(&id).await["state"] == json!("queued") {
            srv.cancel(&id).await.ok(200);
        }
    }
}

#[tokio::test]
async fn the_sdk_and_the_command_line_act_as_operators() {
    let (srv, admin_id, admin, _) = with_admins().await;
    let c = Client::new(&srv.url, admin.clone()).unwrap();
    let (id, _) = reconciling(&srv, "sdk-1").await;
    let task_id = id.parse().unwrap();
    let t = c
        .resolve_committed(task_id, json!({"paid": true}), Some("psp-1"), "dashboard")
        .await
        .unwrap();
    assert_eq!(t.delivery.map(|d| d.charge), Some(t.contract.price));
    let err = c.redrive(task_id, "again").await.unwrap_err();
    assert!(err.to_string().contains("INVALID_STATE"), "{err}");
    let client = Client::new(&srv.url, srv.keys.acme.clone()).unwrap();
    let err = client.retry_now(task_id, "no").await.unwrap_err();
    assert!(err.to_string().contains("PERMISSION_DENIED"), "{err}");
    let events = srv.events(&id).await;
    assert_eq!(
        events
            .iter()
            .rev()
            .find(|e| e["type"] == json!("operator_resolved"))
            .unwrap()["data"]["actor"]["api_key_id"],
        json!(admin_id)
    );

    // `idem task redrive` on the store, recorded as the command line's user.
    let (id, _) = failed_payment(&srv, "cli-1").await;
    let (ok, out, err) = srv.cli(&["task", "redrive", &id, "--reason", "provider back up"]);
    assert!(ok, "{err}");
    let task: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(task["state"], json!("queued"));
    let e = srv.events(&id).await;
    let data = &e.last().unwrap()["data"];
    assert_eq!(data["actor"]["type"], json!("cli"));
    assert_eq!(data["reason"], json!("provider back up"));
    // The actor is the account of the process's uid, not `$USER`, which a
    // `docker exec` or `kubectl exec` leaves unset and anyone can set.
    assert_eq!(data["actor"]["user"], json!(account_of_this_uid()));
    let (ok, _, err) = srv.cli(&["task", "redrive", &id, "--reason", "again"]);
    assert!(
        !ok && err.contains("applies to a task in `failed`"),
        "{err}"
    );
    let (ok, _, err) = srv.cli(&["task", "retry-now", &id, "--reason", ""]);
    assert!(!ok && err.contains("reason"), "{err}");
    let (ok, out, err) = srv.cli(&["task", "cancel", &id, "--reason", "client asked by phone"]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["cancellation"]["status"], json!("confirmed"));
    // With `$USER` and `$LOGNAME` unset or forged: still the uid's account;
    // an explicit `--actor` is recorded as given, and a bad one changes nothing.
    let (id, _) = failed_payment(&srv, "cli-actor").await;
    let mut cmd = std::process::Command::new(crate::support::BIN);
    let out = cmd
        .args(["task", "redrive", &id, "--reason", "from a container"])
        .env("IDEM_STORE", srv.store())
        .env("RUST_LOG", "warn")
        .env_remove("IDEM_CONFIG")
        .env_remove("LOGNAME")
        .env("USER", "someone-else")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let e = srv.events(&id).await;
    assert_eq!(
        e.last().unwrap()["data"]["actor"]["user"],
        json!(account_of_this_uid())
    );
    let (ok, _, err) = srv.cli(&[
        "task",
        "cancel",
        &id,
        "--reason",
        "r",
        "--actor",
        "bad\u{1b}actor",
    ]);
    assert!(!ok && err.contains("--actor"), "{err}");
    let before = srv.events(&id).await.len();
    let (ok, _, err) = srv.cli(&[
        "task",
        "cancel",
        &id,
        "--reason",
        "phoned",
        "--actor",
        "alice@ops",
    ]);
    assert!(ok, "{err}");
    let e = srv.events(&id).await;
    assert!(e.len() > before);
    let cancel = e
        .iter()
        .rev()
        .find(|e| e["data"]["actor"]["type"] == json!("cli"))
        .unwrap();
    assert_eq!(cancel["data"]["actor"]["user"], json!("alice@ops"));
    let (id, _) = reconciling(&srv, "cli-2").await;
    let (ok, out, err) = srv.cli(&[
        "task",
        "resolve",
        &id,
        "--outcome",
        "not_committed",
        "--reason",
        "nothing at the PSP",
    ]);
    assert!(ok, "{err}");
    let task: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(task["state"], json!("queued"));
}

/// A reason must show something: one made only of white space and format
/// characters (Unicode category Cf: zero-width space, byte-order mark, word
/// joiner, soft hyphen …) is 400 `INVALID_REQUEST` on every action and
/// changes nothing; one visible character among them is enough.
#[tokio::test]
async fn a_reason_needs_a_visible_character() {
    let (srv, admin_id, admin, _) = with_admins().await;
    let t = srv.new_task("inv-1", PAY, payment(5)).await;
    let id = s(&t["id"]);
    let invisible = [
        "\u{200B}",
        "\u{FEFF}",
        " \u{200B}\u{2060} ",
        "\u{00AD}\u{200D}\u{200E}",
        "\u{3000}\u{00A0}",
    ];
    for action in ["retry-now", "cancel", "resolve", "redrive"] {
        for reason in invisible {
            let mut body = json!({"reason": reason});
            if action == "resolve" {
                body["outcome"] = json!("not_committed");
            }
            let r = act(&srv, &admin, &id, action, body).await;
            r.assert_problem(400, "INVALID_REQUEST");
            assert!(
                r.json["detail"].as_str().unwrap().contains("visible"),
                "{action} {reason:?}: {}",
                r.text
            );
        }
    }
    let now = srv.task(&id).await;
    assert_eq!(now["state"], json!("queued"));
    assert_eq!(srv.events(&id).await.len(), 1);
    // One visible character among format characters is a reason.
    let r = act(
        &srv,
        &admin,
        &id,
        "cancel",
        json!({"reason": "\u{200B}ok\u{FEFF}"}),
    )
    .await;
    r.ok(200);
    let events = srv.events(&id).await;
    let e = events
        .iter()
        .find(|e| e["type"] == json!("operator_cancel"))
        .expect("operator_cancel");
    assert_eq!(
        e["data"]["actor"],
        json!({"type": "api_key", "api_key_id": admin_id})
    );
    assert_eq!(e["data"]["reason"], json!("\u{200B}ok\u{FEFF}"));
}

/// The account name of this process's effective uid, from the password
/// database (`id -un`).
fn account_of_this_uid() -> String {
    let out = std::process::Command::new("id")
        .arg("-un")
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}
