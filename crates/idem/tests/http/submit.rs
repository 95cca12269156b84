//! Keys, submit, replay, conflict, scopes, validation, crash safety, audit, operations.

use std::collections::HashSet;

use reqwest::Method;
use reqwest::header::HeaderValue;
use serde_json::{Value, json};

use crate::support::{Server, generation, ikey, payment, s, send};

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test]
async fn keys_create_prints_one_line_and_the_store_holds_no_plain_key() {
    let srv = Server::start().await;
    let (ok, out, err) = srv.cli(&["keys", "create", "--tenant", "acme", "--role", "client"]);
    assert!(ok, "keys create: {err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one stdout line, got {out:?}");
    let plain = lines[0].trim();
    assert!(
        !plain.is_empty() && !plain.contains(char::is_whitespace),
        "plain key {plain:?}"
    );
    assert_eq!(out, format!("{plain}\n"), "nothing but the key on stdout");

    // The key works (so the store knows it, in some form).
    let r = srv
        .get("/v1/tasks/00000000-0000-0000-0000-000000000000", plain)
        .await;
    r.assert_problem(404, "NOT_FOUND");
    // And it is listed once, without its plain value.
    let (ok, list, _) = srv.cli(&["keys", "list"]);
    assert!(ok);
    assert!(!list.contains(plain), "keys list shows a plain key");
    assert_eq!(list.lines().count(), 5, "4 keys of the fixture + 1: {list}");
    for line in list.lines() {
        assert_eq!(
            line.split('\t').count(),
            6,
            "id tenant role ops created revoked: {line:?}"
        );
    }

    // No plain key bytes in the database or its WAL, for any key.
    let all = [
        plain.to_owned(),
        srv.keys.acme.clone(),
        srv.keys.other.clone(),
        srv.keys.exec.clone(),
    ];
    let mut files = 0;
    for suffix in ["", "-wal", "-journal", "-shm"] {
        let path = format!("{}{suffix}", srv.db_path().display());
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        files += 1;
        for k in &all {
            assert!(
                !contains(&bytes, k.as_bytes()),
                "{path} contains a plain API key"
            );
        }
    }
    assert!(files >= 1, "the database file exists");
}

#[tokio::test]
async fn submit_without_idempotency_key_is_missing() {
    let srv = Server::start().await;
    let req = srv
        .submit_req(&srv.keys.acme)
        .body(json!({"operation": "payment.release", "params": payment(100)}).to_string());
    send(req)
        .await
        .assert_problem(400, "IDEMPOTENCY_KEY_MISSING");
}

#[tokio::test]
async fn malformed_idempotency_keys_are_invalid_and_consume_nothing() {
    let srv = Server::start().await;
    let body = json!({"operation": "payment.release", "params": payment(100)}).to_string();
    let long = "a".repeat(256);
    let cases: Vec<(&str, Vec<HeaderValue>)> = vec![
        ("empty", vec![HeaderValue::from_static("")]),
        ("blank", vec![HeaderValue::from_static("   ")]),
        ("quoted empty", vec![HeaderValue::from_static("\"\"")]),
        (
            "256 bytes",
            vec![HeaderValue::from_str(&long).expect("header")],
        ),
        (
            "non-ASCII",
            vec![HeaderValue::from_bytes("k\u{e9}y".as_bytes()).expect("header")],
        ),
        ("inner space", vec![HeaderValue::from_static("a b")]),
        (
            "two lines",
            vec![
                HeaderValue::from_static("k1"),
                HeaderValue::from_static("k1"),
            ],
        ),
    ];
    for (name, values) in cases {
        let mut req = srv.submit_req(&srv.keys.acme).body(body.clone());
        for v in values {
            req = req.header("Idempotency-Key", v);
        }
        let r = send(req).await;
        assert_eq!(r.status, 400, "{name}: {}", r.text);
        r.assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
    }
    // 255 bytes is the longest valid key; k1 was never consumed by the two-line request.
    let max = "b".repeat(255);
    let t = srv.new_task(&max, "payment.release", payment(100)).await;
    assert_eq!(t["idempotency_key"], json!(max));
    srv.new_task("k1", "payment.release", payment(100)).await;
}

#[tokio::test]
async fn quoted_and_bare_key_name_the_same_task() {
    let srv = Server::start().await;
    let a = srv.submit("\"k1\"", "payment.release", payment(100)).await;
    let a = a.ok(201).clone();
    assert_eq!(a["task"]["idempotency_key"], json!("k1"));
    assert_eq!(a["meta"]["idempotency_key"], json!("k1"));
    assert_eq!(a["meta"]["replayed"], json!(false));
    let b = srv.submit("k1", "payment.release", payment(100)).await;
    assert_eq!(b.header("idempotent-replayed"), "true");
    let b = b.ok(201);
    assert_eq!(b["task"]["id"], a["task"]["id"]);
    assert_eq!(b["meta"]["replayed"], json!(true));
}

fn assert_rfc3339(v: &Value, what: &str) {
    let t = v
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {v}"));
    assert!(
        t.len() >= 20
            && t.as_bytes()[4] == b'-'
            && t.as_bytes()[10] == b'T'
            && (t.ends_with('Z') || t.contains('+')),
        "{what} is not RFC 3339: {t}"
    );
}

#[tokio::test]
async fn new_task_has_every_spec_field_and_exact_repeat_replays() {
    let srv = Server::start().await;
    let params = payment(1234);
    let r = srv.submit("pay-1", "payment.release", params.clone()).await;
    let body = r.ok(201).clone();
    assert!(
        r.header("idempotent-replayed").is_empty(),
        "no replay header on a new task"
    );
    let t = &body["task"];
    let id = s(&t["id"]);
    uuid::Uuid::parse_str(&id).expect("task id is a UUID");
    assert_eq!(r.header("location"), format!("/v1/tasks/{id}"));
    assert_eq!(t["operation"], json!("payment.release"));
    assert_eq!(t["idempotency_key"], json!("pay-1"));
    let fp = s(&t["fingerprint"]);
    let hex = fp
        .strip_prefix("sha256:")
        .unwrap_or_else(|| panic!("fingerprint {fp}"));
    assert_eq!(hex.len(), 64, "fingerprint {fp}");
    assert!(
        hex.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
        "fingerprint {fp}"
    );
    assert_eq!(t["params"], params);
    assert_eq!(t["state"], json!("queued"));
    assert_eq!(t["generation"], json!(0));
    assert_eq!(t["attempt_count"], json!(0));
    assert_eq!(t["usage"], json!(0));
    let c = &t["contract"];
    assert_eq!(c["price"], json!(100));
    assert!(c["retry"].is_object(), "contract.retry: {c}");
    assert_eq!(c["retry"]["safe"], json!(false));
    assert_eq!(c["retry"]["max_attempts"], json!(3));
    assert!(c["fees"].is_object(), "contract.fees: {c}");
    assert_eq!(c["fees"]["cancel_after_start_fixed"], json!(10));
    assert!(s(&c["config_version"]).len() > 3, "config_version: {c}");
    assert_eq!(t["cancellation"], Value::Null);
    assert_eq!(t["delivery"], Value::Null);
    assert_eq!(t["failure"], Value::Null);
    for f in ["cancellation", "delivery", "failure"] {
        assert!(t.get(f).is_some(), "{f} present (as null)");
    }
    assert_rfc3339(&t["created_at"], "created_at");
    assert_rfc3339(&t["updated_at"], "updated_at");
    assert_eq!(body["meta"]["replayed"], json!(false));
    assert_eq!(body["meta"]["idempotency_key"], json!("pay-1"));
    assert_eq!(body["meta"]["request_id"], json!(r.header("x-request-id")));

    // Exact repeat.
    let r2 = srv.submit("pay-1", "payment.release", params.clone()).await;
    let b2 = r2.ok(201);
    assert_eq!(r2.header("idempotent-replayed"), "true");
    assert_eq!(r2.header("location"), format!("/v1/tasks/{id}"));
    assert_eq!(b2["meta"]["replayed"], json!(true));
    assert_eq!(b2["task"], body["task"], "replay returns the original task");

    // Reordered keys and extra whitespace: same canonical request.
    let raw = "{ \"params\" : {\"currency\":\"EUR\",  \"amount\" : 1234 ,\n \"payee\":\"acct-bob-4711\"},\n  \"operation\":\"payment.release\" }";
    let r3 = send(
        srv.submit_req(&srv.keys.acme)
            .header("Idempotency-Key", "pay-1")
            .body(raw),
    )
    .await;
    let b3 = r3.ok(201);
    assert_eq!(r3.header("idempotent-replayed"), "true");
    assert_eq!(b3["task"]["id"], json!(id));
    assert_eq!(b3["meta"]["replayed"], json!(true));

    // A non-material field (payment.release fingerprints /payee /amount /currency only).
    let mut with_memo = params.clone();
    with_memo["memo"] = json!("thanks for lunch");
    let r4 = srv.submit("pay-1", "payment.release", with_memo).await;
    let b4 = r4.ok(201);
    assert_eq!(r4.header("idempotent-replayed"), "true");
    assert_eq!(b4["task"]["id"], json!(id));
    assert_eq!(b4["task"]["params"], params, "the original params stay");

    // Only one task exists for the scope, nothing started.
    let now = srv.task(&id).await;
    assert_eq!(now, body["task"]);
}

#[tokio::test]
async fn changed_material_field_is_a_deterministic_conflict() {
    let srv = Server::start().await;
    let original = srv.new_task("pay-2", "payment.release", payment(100)).await;
    let id = s(&original["id"]);
    let mut changed = payment(100);
    changed["amount"] = json!(999_999);
    changed["payee"] = json!("acct-mallory-secret");
    let r1 = srv
        .submit("pay-2", "payment.release", changed.clone())
        .await;
    r1.assert_problem(422, "IDEMPOTENCY_CONFLICT");
    assert_eq!(r1.json["task_id"], json!(id));
    assert!(
        r1.json.get("params").is_none(),
        "no params in the problem: {}",
        r1.text
    );
    assert!(
        !r1.text.contains("acct-bob-4711"),
        "original params leaked: {}",
        r1.text
    );
    assert!(
        !r1.text.contains("999999"),
        "request params echoed: {}",
        r1.text
    );
    let r2 = srv.submit("pay-2", "payment.release", changed).await;
    r2.assert_problem(422, "IDEMPOTENCY_CONFLICT");
    assert_eq!(r2.json, r1.json, "the same answer every time");
    // Only the amount changed: conflict too.
    let r3 = srv.submit("pay-2", "payment.release", payment(101)).await;
    r3.assert_problem(422, "IDEMPOTENCY_CONFLICT");
    assert_eq!(r3.json["task_id"], json!(id));
    // The original is unchanged.
    assert_eq!(srv.task(&id).await, original);
    // And an exact repeat still replays it.
    let r4 = srv.submit("pay-2", "payment.release", payment(100)).await;
    assert_eq!(r4.ok(201)["task"]["id"], json!(id));
}

#[tokio::test]
async fn scopes_are_per_tenant_and_operation_and_never_leak() {
    let srv = Server::start().await;
    let a = srv
        .new_task("shared-key", "payment.release", payment(100))
        .await;
    let a_id = s(&a["id"]);
    // Same key, other tenant: a different task, even with other params (no conflict).
    let rb = srv
        .submit_as(&srv.keys.other, "shared-key", "payment.release", payment(5))
        .await;
    let b = rb.ok(201);
    assert_eq!(b["meta"]["replayed"], json!(false));
    let b_id = s(&b["task"]["id"]);
    assert_ne!(a_id, b_id);
    // Same key, other operation class of the same tenant: a different task.
    let c = srv
        .new_task("shared-key", "generation.dispatch", generation("x"))
        .await;
    assert_ne!(s(&c["id"]), a_id);
    assert_ne!(s(&c["id"]), b_id);

    // Tenant other cannot see tenant acme's task, by id or by scope.
    for path in [
        format!("/v1/tasks/{a_id}"),
        format!("/v1/tasks/{a_id}/attempts"),
        format!("/v1/tasks/{a_id}/events"),
    ] {
        srv.get(&path, &srv.keys.other)
            .await
            .assert_problem(404, "NOT_FOUND");
    }
    // Scope lookup: each tenant sees its own task.
    let q = "/v1/tasks?operation=payment.release&idempotency_key=shared-key";
    let mine = srv.get(q, &srv.keys.acme).await;
    assert_eq!(mine.ok(200)["task"]["id"], json!(a_id));
    let theirs = srv.get(q, &srv.keys.other).await;
    assert_eq!(theirs.ok(200)["task"]["id"], json!(b_id));
    // A scope only acme has is 404 for other, exactly like a scope nobody has.
    let only_acme = "/v1/tasks?operation=generation.dispatch&idempotency_key=shared-key";
    let r = srv.get(only_acme, &srv.keys.other).await;
    r.assert_problem(404, "NOT_FOUND");
    let nobody = srv
        .get(
            "/v1/tasks?operation=generation.dispatch&idempotency_key=nobody",
            &srv.keys.other,
        )
        .await;
    nobody.assert_problem(404, "NOT_FOUND");
    // The details differ only by the key they name.
    assert_eq!(
        r.json["detail"]
            .as_str()
            .map(|d| d.replace("`shared-key`", "`nobody`")),
        nobody.json["detail"].as_str().map(str::to_owned),
        "no existence leak in the detail"
    );
    // A random id is the same 404.
    let rnd = srv
        .get(
            &format!("/v1/tasks/{}", uuid::Uuid::new_v4()),
            &srv.keys.other,
        )
        .await;
    rnd.assert_problem(404, "NOT_FOUND");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_identical_submits_yield_exactly_one_task() {
    let srv = Server::start().await;
    for round in 0..20 {
        let key = ikey();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let req = srv
                .submit_req(&srv.keys.acme)
                .header("Idempotency-Key", key.clone())
                .body(
                    json!({"operation": "payment.release", "params": payment(round + 1)})
                        .to_string(),
                );
            set.spawn(send(req));
        }
        let mut ids = HashSet::new();
        let mut fresh = 0;
        while let Some(r) = set.join_next().await {
            let r = r.expect("join");
            assert_eq!(r.status, 201, "round {round}: {}", r.text);
            ids.insert(s(&r.json["task"]["id"]));
            if r.json["meta"]["replayed"] == json!(false) {
                fresh += 1;
                assert!(r.header("idempotent-replayed").is_empty());
            } else {
                assert_eq!(r.header("idempotent-replayed"), "true");
            }
        }
        assert_eq!(ids.len(), 1, "round {round}: task ids {ids:?}");
        assert_eq!(fresh, 1, "round {round}: exactly one non-replayed answer");
        let q = format!("/v1/tasks?operation=payment.release&idempotency_key={key}");
        let found = srv.get(&q, &srv.keys.acme).await;
        assert!(ids.contains(&s(&found.ok(200)["task"]["id"])));
    }
}

#[tokio::test]
async fn invalid_bodies_are_400_and_do_not_consume_the_key() {
    let srv = Server::start().await;
    let deep_params = {
        // params itself nested 65 deep: {"a": [[[...]]]}
        let inner = format!("{}{}", "[".repeat(64), "]".repeat(64));
        format!("{{\"a\":{inner}}}")
    };
    let cases: Vec<(&str, String)> = vec![
        ("bad JSON", "{\"operation\":\"payment.release\",".to_owned()),
        ("not JSON", "hello".to_owned()),
        (
            "duplicate keys in params",
            r#"{"operation":"payment.release","params":{"payee":"a","amount":1,"amount":2,"currency":"EUR"}}"#.to_owned(),
        ),
        (
            "duplicate top-level keys",
            r#"{"operation":"payment.release","operation":"payment.release","params":{"payee":"a","amount":1,"currency":"EUR"}}"#.to_owned(),
        ),
        (
            "unsafe integer",
            r#"{"operation":"payment.release","params":{"payee":"a","amount":9007199254740993,"currency":"EUR"}}"#.to_owned(),
        ),
        (
            "negative unsafe integer",
            r#"{"operation":"payment.release","params":{"payee":"a","amount":-9007199254740993,"currency":"EUR"}}"#.to_owned(),
        ),
        ("nesting 65 in params", format!("{{\"operation\":\"generation.dispatch\",\"params\":{deep_params}}}")),
        ("params array", r#"{"operation":"payment.release","params":[1,2]}"#.to_owned()),
        ("params string", r#"{"operation":"payment.release","params":"x"}"#.to_owned()),
        ("params missing", r#"{"operation":"payment.release"}"#.to_owned()),
        (
            "the fields as an array",
            r#"["payment.release",{"payee":"a","amount":1,"currency":"EUR"}]"#.to_owned(),
        ),
        ("unknown operation", r#"{"operation":"payment.refund","params":{}}"#.to_owned()),
    ];
    for (name, body) in cases {
        let key = ikey();
        let r = send(
            srv.submit_req(&srv.keys.acme)
                .header("Idempotency-Key", key.clone())
                .body(body),
        )
        .await;
        assert_eq!(r.status, 400, "{name}: {}", r.text);
        r.assert_problem(400, "INVALID_REQUEST");
        let ok = srv.submit(&key, "payment.release", payment(7)).await;
        let v = ok.ok(201);
        assert_eq!(
            v["meta"]["replayed"],
            json!(false),
            "{name}: the key was consumed"
        );
    }
    // A body nested exactly 64 deep (params 63) is accepted.
    let ok_params = format!("{{\"a\":{}{}}}", "[".repeat(62), "]".repeat(62));
    let body = format!("{{\"operation\":\"generation.dispatch\",\"params\":{ok_params}}}");
    let r = send(
        srv.submit_req(&srv.keys.acme)
            .header("Idempotency-Key", ikey())
            .body(body),
    )
    .await;
    r.ok(201);
    // The largest safe integer is accepted.
    let r = srv
        .submit(&ikey(), "payment.release", payment(9_007_199_254_740_991))
        .await;
    r.ok(201);

    // Over 1 MiB: 413, key not consumed.
    let key = ikey();
    let big = json!({"operation": "generation.dispatch", "params": {"blob": "x".repeat(1024 * 1024 + 16)}}).to_string();
    let r = send(
        srv.submit_req(&srv.keys.acme)
            .header("Idempotency-Key", key.clone())
            .body(big),
    )
    .await;
    r.assert_problem(413, "PAYLOAD_TOO_LARGE");
    assert_eq!(r.json["max_bytes"], json!(1_048_576));
    let ok = srv
        .submit(&key, "generation.dispatch", generation("small"))
        .await;
    assert_eq!(ok.ok(201)["meta"]["replayed"], json!(false));
}

#[tokio::test]
async fn auth_failures_are_problems_and_consume_no_key() {
    let srv = Server::start().await;
    let body = json!({"operation": "payment.release", "params": payment(1)}).to_string();
    let none = send(
        srv.http
            .post(format!("{}/v1/tasks", srv.url))
            .header("Idempotency-Key", "auth-k")
            .body(body.clone()),
    )
    .await;
    none.assert_problem(401, "UNAUTHENTICATED");
    let bad = send(
        srv.submit_req("idem_not_a_key")
            .header("Idempotency-Key", "auth-k")
            .body(body.clone()),
    )
    .await;
    bad.assert_problem(401, "UNAUTHENTICATED");
    let exec = send(
        srv.submit_req(&srv.keys.exec)
            .header("Idempotency-Key", "auth-k")
            .body(body),
    )
    .await;
    exec.assert_problem(403, "PERMISSION_DENIED");
    srv.new_task("auth-k", "payment.release", payment(1)).await;
}

#[tokio::test]
async fn kill9_after_201_keeps_the_task() {
    let mut srv = Server::start().await;
    let t = srv
        .new_task("crash-1", "payment.release", payment(4242))
        .await;
    srv.kill9();
    srv.restart();
    let r = srv
        .submit("crash-1", "payment.release", payment(4242))
        .await;
    let v = r.ok(201);
    assert_eq!(r.header("idempotent-replayed"), "true");
    assert_eq!(v["meta"]["replayed"], json!(true));
    assert_eq!(v["task"]["id"], t["id"]);
    assert_eq!(v["task"]["fingerprint"], t["fingerprint"]);
    // Still a conflict for a different request.
    srv.submit("crash-1", "payment.release", payment(1))
        .await
        .assert_problem(422, "IDEMPOTENCY_CONFLICT");
}

#[tokio::test]
async fn events_record_the_acceptance_decision() {
    let srv = Server::start().await;
    let t = srv
        .new_task("audit-1", "payment.release", payment(10))
        .await;
    let events = srv.events(&s(&t["id"])).await;
    let first = events.first().expect("at least one event");
    assert_eq!(first["type"], json!("task_submitted"));
    assert_eq!(first["seq"], json!(1));
    assert!(first["at"].is_string());
    assert_eq!(first["data"]["fingerprint"], t["fingerprint"]);
    assert_eq!(
        first["data"]["decision"]["api_key_id"],
        json!(srv.keys.acme_id)
    );
    assert_eq!(
        first["data"]["decision"]["config_version"],
        t["contract"]["config_version"]
    );
}

/// A fresh server's `/metrics`, before any submit, claim, report or sweep
/// that counts: every idem counter is listed at 0 (each label value of a
/// labelled one too), and each metric has its `# HELP` and `# TYPE` lines.
#[tokio::test]
async fn metrics_list_every_counter_at_zero_with_help_from_the_start() {
    let srv = Server::start().await;
    let m = srv.call(Method::GET, "/metrics", None, None).await;
    m.ok(200);
    let value = |series: &str| -> Option<f64> {
        m.text
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    };
    let mut series: Vec<String> = [
        "created",
        "replayed",
        "conflict",
        "unauthenticated",
        "forbidden",
        "invalid",
        "error",
        "rate_limited",
    ]
    .iter()
    .map(|o| format!("idem_submits_total{{outcome=\"{o}\"}}"))
    .collect();
    series.extend(
        ["applied", "stale", "refused"]
            .iter()
            .map(|r| format!("idem_reports_total{{result=\"{r}\"}}")),
    );
    series.extend(
        [
            "idem_attempts_leased_total",
            "idem_leases_expired_total",
            "idem_tasks_woken_total",
            "idem_keys_released_total",
        ]
        .map(String::from),
    );
    for s in &series {
        assert_eq!(value(s), Some(0.0), "{s} at 0 in:\n{}", m.text);
    }
    for (name, kind) in [
        ("idem_submits_total", "counter"),
        ("idem_reports_total", "counter"),
        ("idem_attempts_leased_total", "counter"),
        ("idem_leases_expired_total", "counter"),
        ("idem_tasks_woken_total", "counter"),
        ("idem_keys_released_total", "counter"),
    ] {
        for line in [format!("# HELP {name} "), format!("# TYPE {name} {kind}")] {
            assert!(
                m.text.lines().any(|l| l.starts_with(&line)),
                "no `{line}` in:\n{}",
                m.text
            );
        }
    }
    // The request metrics appear with their first request (the one above).
    let again = srv.call(Method::GET, "/metrics", None, None).await;
    again.ok(200);
    for line in [
        "# HELP idem_http_requests_total ",
        "# TYPE idem_http_requests_total counter",
        "# HELP idem_http_request_seconds ",
        "# TYPE idem_http_request_seconds histogram",
    ] {
        assert!(
            again.text.lines().any(|l| l.starts_with(line)),
            "no `{line}` in:\n{}",
            again.text
        );
    }
    // And a submit counts under its outcome, the others staying at 0.
    srv.submit("zero-1", "payment.release", payment(1))
        .await
        .ok(201);
    let after = srv.call(Method::GET, "/metrics", None, None).await;
    after.ok(200);
    let count = |series: &str| -> Option<f64> {
        after
            .text
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    };
    assert_eq!(count("idem_submits_total{outcome=\"created\"}"), Some(1.0));
    assert_eq!(count("idem_submits_total{outcome=\"replayed\"}"), Some(0.0));
}

#[tokio::test]
async fn request_ids_problem_types_and_operational_endpoints() {
    let srv = Server::start().await;
    // A submit first, so the submit counter exists.
    let created = srv.submit("ops-1", "payment.release", payment(1)).await;
    created.ok(201);
    let replay = srv.submit("ops-1", "payment.release", payment(1)).await;
    replay.ok(201);
    assert_ne!(
        created.header("x-request-id"),
        replay.header("x-request-id"),
        "a new request id per request"
    );

    for path in ["/healthz", "/readyz"] {
        let r = srv.call(Method::GET, path, None, None).await;
        r.ok(200);
    }
    // Refused credentials count too (README walk-through: a missing or
    // unknown key never reached the counter), and a 403 is `forbidden`.
    let bad = srv
        .submit_as("idem_not_a_key", "ops-2", "payment.release", payment(2))
        .await;
    assert_eq!(bad.status, 401);
    let none = send(
        srv.http
            .post(format!("{}/v1/tasks", srv.url))
            .header("Idempotency-Key", "ops-3")
            .header("content-type", "application/json")
            .body(json!({"operation": "payment.release", "params": payment(3)}).to_string()),
    )
    .await;
    assert_eq!(none.status, 401);
    let exec = srv
        .submit_as(&srv.keys.exec, "ops-4", "payment.release", payment(4))
        .await;
    assert_eq!(exec.status, 403);
    let m = srv.call(Method::GET, "/metrics", None, None).await;
    m.ok(200);
    let count = |outcome: &str| -> u64 {
        let series = format!("idem_submits_total{{outcome=\"{outcome}\"}} ");
        m.text
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in metrics: {}", m.text))
    };
    assert_eq!(count("created"), 1);
    assert_eq!(count("replayed"), 1);
    assert_eq!(count("unauthenticated"), 2);
    assert_eq!(count("forbidden"), 1);
    let o = srv.call(Method::GET, "/openapi.json", None, None).await;
    let doc = o.ok(200);
    assert!(
        s(&doc["openapi"]).starts_with("3.1"),
        "openapi version {}",
        doc["openapi"]
    );
    assert!(doc["paths"]["/v1/tasks"].is_object(), "documents /v1/tasks");
    // The served document lists this server's operation classes …
    let classes = doc["components"]["schemas"]["SubmitBody"]["properties"]["operation"]["enum"]
        .as_array()
        .unwrap_or_else(|| {
            panic!(
                "no operation enum: {}",
                doc["components"]["schemas"]["SubmitBody"]
            )
        });
    assert!(
        classes.contains(&serde_json::json!("payment.release")),
        "{classes:?}"
    );
    assert_eq!(
        doc["components"]["schemas"]["ClaimBody"]["properties"]["operations"]["items"]["enum"]
            .as_array()
            .map(Vec::len),
        Some(classes.len())
    );
    // … the lookup's and the search's query parameters, all optional (the
    // lookup's two are required together) …
    let params = doc["paths"]["/v1/tasks"]["get"]["parameters"]
        .as_array()
        .unwrap();
    for name in ["operation", "idempotency_key", "state", "limit", "cursor"] {
        assert!(params.iter().any(|p| p["name"] == name), "{name}");
    }
    for p in params {
        assert_eq!(p["in"], "query", "{p}");
        assert_eq!(p["required"], false, "{p}");
    }
    // … and links from a submit's task id to the task's own operations.
    assert_eq!(
        doc["paths"]["/v1/tasks"]["post"]["responses"]["201"]["links"]["GetTask"]["parameters"]["id"],
        "$response.body#/task/id"
    );

    // Problems: 404 (unknown task, unknown route), 400, 401, 422 all carry X-Request-Id.
    srv.get(
        &format!("/v1/tasks/{}", uuid::Uuid::new_v4()),
        &srv.keys.acme,
    )
    .await
    .assert_problem(404, "NOT_FOUND");
    srv.get("/v1/tasks/not-a-uuid", &srv.keys.acme)
        .await
        .assert_problem(404, "NOT_FOUND");
    srv.call(Method::GET, "/no/such/route", None, None)
        .await
        .assert_problem(404, "NOT_FOUND");
    send(srv.submit_req(&srv.keys.acme).body("{}"))
        .await
        .assert_problem(400, "IDEMPOTENCY_KEY_MISSING");
    srv.call(Method::GET, "/v1/tasks/x", None, None)
        .await
        .assert_problem(401, "UNAUTHENTICATED");
    // A lookup needs both parameters (without `idempotency_key` it is a search).
    srv.get("/v1/tasks?idempotency_key=k1", &srv.keys.acme)
        .await
        .assert_problem(400, "INVALID_REQUEST");
    // A class this server does not know is a bad request, as on submit.
    srv.get(
        "/v1/tasks?operation=payment.refund&idempotency_key=k1",
        &srv.keys.acme,
    )
    .await
    .assert_problem(400, "INVALID_REQUEST");

    // A client-chosen X-Request-Id is echoed.
    let mine = send(
        srv.http
            .get(format!("{}/healthz", srv.url))
            .header("x-request-id", "req-abc-123"),
    )
    .await;
    assert_eq!(mine.header("x-request-id"), "req-abc-123");
}
