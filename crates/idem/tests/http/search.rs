//! `GET /v1/tasks` without `idempotency_key` (SPEC §4 "Task search"): tenant
//! isolation and exactly-once pages under concurrent submits, the 400s of bad
//! filters, the unchanged lookup by scope, `idem task list` and the SDK's
//! pages; and the answers that help: a conflict's `differing_fields`, a
//! terminal task's `meta.key_expires_at`.

use std::collections::{BTreeSet, HashMap};

use idem_client::{Client, TaskFilter, TaskState};
use serde_json::{Value, json};

use crate::support::{Options, Server};

/// The classes of the isolation test: the bundled two and a third one.
const CLASSES: [&str; 3] = ["payment.release", "generation.dispatch", "image.render"];
/// Tasks per tenant and class.
const PER_CLASS: usize = 500;

/// [`Options::moved`] with a third class, `image.render` (a copy of
/// `generation.dispatch`).
fn three_classes() -> Options {
    let mut opts = Options::moved();
    let bundled = idem_core::config::DEFAULT_TOML;
    let at = bundled
        .find("[operations.\"generation.dispatch\"]")
        .expect("the bundled generation.dispatch class");
    let third = bundled[at..].replace("generation.dispatch", "image.render");
    opts.config = Some(format!("{}\n{third}", opts.config.unwrap_or_default()));
    opts
}

fn params(class: &str, n: usize) -> Value {
    if class == "payment.release" {
        json!({"payee": format!("acct-{n}"), "amount": n + 1, "currency": "EUR"})
    } else {
        json!({"prompt": format!("take {n}"), "class": class})
    }
}

/// Submits `count` tasks per class as `key`, 32 at a time; keys `k%_…` for
/// even `n`, `kX…` for odd.
async fn seed(srv: &Server, key: &str, tag: &str, count: usize) {
    let mut set = tokio::task::JoinSet::new();
    for n in 0..count {
        for class in CLASSES {
            let ikey = if n % 2 == 0 {
                format!("k%_{tag}{class}-{n}")
            } else {
                format!("kX{tag}{class}-{n}")
            };
            let req = srv
                .submit_req(key)
                .header("Idempotency-Key", ikey)
                .body(json!({"operation": class, "params": params(class, n)}).to_string());
            set.spawn(crate::support::send(req));
            if set.len() >= 32 {
                set.join_next().await.unwrap().unwrap().ok(201);
            }
        }
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().ok(201);
    }
}

/// Every page of `query` as `key`: the tasks in order, checked newest first
/// without repeats, and the first `next_cursor`.
async fn walk(srv: &Server, key: &str, query: &str) -> (Vec<Value>, Option<String>) {
    let mut all: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    let mut first = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/tasks?{query}&cursor={c}"),
            None => format!("/v1/tasks?{query}"),
        };
        let page = srv.get(&path, key).await.ok(200).clone();
        all.extend(page["tasks"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_str() {
            Some(c) => {
                first = first.or(Some(c.to_owned()));
                cursor = Some(c.to_owned());
            }
            None => {
                assert_eq!(page["next_cursor"], Value::Null);
                break;
            }
        }
    }
    for w in all.windows(2) {
        let a = (w[0]["created_at"].as_str(), w[0]["id"].as_str());
        let b = (w[1]["created_at"].as_str(), w[1]["id"].as_str());
        assert!(a > b, "newest first without repeats: {a:?} then {b:?}");
    }
    (all, first)
}

/// Task search over HTTP: 2 tenants × 3 classes × 500 tasks;
/// every combination of filters returns only the caller's tasks that match,
/// each task submitted before the walk exactly once, while a concurrent
/// writer submits more; tenant A's cursor used by tenant B shows none of A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn search_pages_only_the_callers_tasks_each_once() {
    let srv = Server::in_process_with(three_classes()).await;
    let tenants = [
        ("acme", srv.keys.acme.clone()),
        ("other", srv.keys.other.clone()),
    ];
    for (_, key) in &tenants {
        seed(&srv, key, "", PER_CLASS).await;
    }
    // Some of acme's tasks succeed with a provider transaction id.
    let claimed = srv
        .claim(json!({"executor_id": "ex", "operations": ["generation.dispatch"], "max": 20}))
        .await
        .ok(200)["attempts"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(claimed.len(), 20);
    for (i, a) in claimed.iter().enumerate() {
        let body = json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": true}, "external_txn_id": format!("txn-{i}")});
        srv.report(a["id"].as_str().unwrap(), body).await.ok(200);
    }
    // What each tenant holds before the walks: (id → task).
    let mut before: HashMap<&str, HashMap<String, Value>> = HashMap::new();
    for (tenant, key) in &tenants {
        let (all, _) = walk(&srv, key, "limit=200").await;
        assert_eq!(all.len(), 3 * PER_CLASS, "{tenant}'s tasks");
        before.insert(
            tenant,
            all.into_iter()
                .map(|t| (t["id"].as_str().unwrap().to_owned(), t))
                .collect(),
        );
    }

    let writer_srv_url = srv.url.clone();
    let writer_keys = [srv.keys.acme.clone(), srv.keys.other.clone()];
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let http = reqwest::Client::new();
    let writer = tokio::spawn(async move {
        let mut n = 0;
        while stopped.try_recv().is_err() {
            for key in &writer_keys {
                let r = http
                    .post(format!("{writer_srv_url}/v1/tasks"))
                    .bearer_auth(key)
                    .header("Idempotency-Key", format!("k%_late-{n}"))
                    .header("content-type", "application/json")
                    .body(json!({"operation": "image.render", "params": {"late": n}}).to_string())
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 201);
            }
            n += 1;
        }
        n
    });

    let mut queries = Vec::new();
    for states in ["", "state=queued&", "state=succeeded&state=running&"] {
        for op in ["", "operation=payment.release&", "operation=image.render&"] {
            for prefix in ["", "idempotency_key_prefix=k%25_&"] {
                queries.push(format!("{states}{op}{prefix}limit=150"));
            }
        }
    }
    queries.push("external_txn_id=txn-7".to_owned());
    for q in &queries {
        for (tenant, key) in &tenants {
            let (got, _) = walk(&srv, key, q).await;
            let ids: BTreeSet<&str> = got.iter().map(|t| t["id"].as_str().unwrap()).collect();
            assert_eq!(ids.len(), got.len(), "no task twice in {q}");
            let mine = &before[tenant];
            let other: &HashMap<String, Value> =
                &before[if *tenant == "acme" { "other" } else { "acme" }];
            for t in &got {
                let id = t["id"].as_str().unwrap();
                assert!(
                    !other.contains_key(id),
                    "{tenant} got another tenant's task in {q}"
                );
            }
            let matching = |t: &Value| {
                let state = t["state"].as_str().unwrap();
                let op = t["operation"].as_str().unwrap();
                let key = t["idempotency_key"].as_str().unwrap();
                (!q.contains("state=") || q.contains(&format!("state={state}&")))
                    && (!q.contains("operation=") || q.contains(&format!("operation={op}&")))
                    && (!q.contains("prefix") || key.starts_with("k%_"))
                    && (!q.contains("external_txn_id")
                        || t["delivery"]["external_txn_id"] == json!("txn-7"))
            };
            for t in &got {
                let id = t["id"].as_str().unwrap();
                let t = mine.get(id).unwrap_or(t);
                assert!(matching(t), "{id} does not match {q}: {t}");
            }
            for (id, t) in mine {
                if matching(t) {
                    assert!(
                        ids.contains(id.as_str()),
                        "{id} missing from {q} of {tenant}"
                    );
                }
            }
        }
    }
    // Tenant acme's cursor is refused to tenant other: a cursor is bound to
    // the tenant it was given to.
    let (_, cursor) = walk(&srv, &srv.keys.acme, "limit=200").await;
    srv.get(
        &format!("/v1/tasks?cursor={}", cursor.unwrap()),
        &srv.keys.other,
    )
    .await
    .assert_problem(400, "INVALID_REQUEST");
    let _ = &before;
    let _ = stop.send(());
    assert!(writer.await.unwrap() > 0, "the writer submitted meanwhile");
}

/// Bad filter values are 400 `INVALID_REQUEST`; a key limited to one class
/// sees only it and is refused another (403); the lookup by scope answers
/// as before.
#[tokio::test]
async fn search_refuses_bad_filters_and_keeps_the_lookup() {
    let srv = Server::in_process().await;
    let t = srv
        .new_task("k-1", "generation.dispatch", json!({"prompt": "a"}))
        .await;
    srv.new_task(
        "k-2",
        "payment.release",
        json!({"payee": "p", "amount": 5, "currency": "EUR"}),
    )
    .await;
    for bad in [
        "state=done",
        "created_after=yesterday",
        "created_before=2026-12-01",
        "limit=0",
        "limit=201",
        "cursor=abc",
        "cursor=0000000000000000000000000000000000000000000000zz",
        "states=queued",
        "limit=1&limit=2",
    ] {
        srv.get(&format!("/v1/tasks?{bad}"), &srv.keys.acme)
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    let page = srv.get("/v1/tasks?limit=1", &srv.keys.acme).await;
    let page = page.ok(200);
    assert_eq!(page["tasks"].as_array().unwrap().len(), 1);
    let next = page["next_cursor"].as_str().unwrap().to_owned();
    let rest = srv
        .get(&format!("/v1/tasks?limit=1&cursor={next}"), &srv.keys.acme)
        .await;
    assert_eq!(rest.ok(200)["tasks"][0]["id"], t["id"]);
    assert_eq!(rest.json["next_cursor"], Value::Null);
    // A cursor edited into another well-formed one (its first 16 hex digits
    // zeroed: an earlier instant) is refused, not answered with an empty
    // last page: only cursors the server gave out are read.
    let zeroed = format!("{}{}", "0".repeat(16), &next[16..]);
    let forged = srv
        .get(
            &format!("/v1/tasks?limit=1&cursor={zeroed}"),
            &srv.keys.acme,
        )
        .await;
    forged.assert_problem(400, "INVALID_REQUEST");
    assert!(
        forged.text.contains("not one this server handed out"),
        "{}",
        forged.text
    );
    // `idem task list` reads the store's own cursors.
    let (ok, out, err) = srv.cli(&[
        "task", "list", "--tenant", "acme", "--limit", "1", "--cursor", &next,
    ]);
    assert!(ok, "{err}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed["tasks"][0]["id"], t["id"]);
    let (ok, _, err) = srv.cli(&["task", "list", "--tenant", "acme", "--cursor", &zeroed]);
    assert!(
        !ok && err.contains("not one this server handed out"),
        "{err}"
    );

    let (_, limited) = srv.create_key("acme", "client", Some("generation.dispatch"));
    let page = srv.get("/v1/tasks", &limited).await;
    let tasks = page.ok(200)["tasks"].as_array().unwrap().clone();
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0]["operation"], "generation.dispatch");
    srv.get("/v1/tasks?operation=payment.release", &limited)
        .await
        .assert_problem(403, "PERMISSION_DENIED");
    srv.get("/v1/tasks?operation=no.such", &srv.keys.acme)
        .await
        .assert_problem(400, "INVALID_REQUEST");

    // The lookup by scope, unchanged.
    let found = srv
        .get(
            "/v1/tasks?operation=generation.dispatch&idempotency_key=k-1",
            &srv.keys.acme,
        )
        .await;
    assert_eq!(found.ok(200)["task"]["id"], t["id"]);
    srv.get("/v1/tasks?idempotency_key=k-1", &srv.keys.acme)
        .await
        .assert_problem(400, "INVALID_REQUEST");
    srv.get(
        "/v1/tasks?operation=generation.dispatch&idempotency_key=k-9",
        &srv.keys.acme,
    )
    .await
    .assert_problem(404, "NOT_FOUND");
    // Another tenant sees nothing of acme's.
    let theirs = srv.get("/v1/tasks", &srv.keys.other).await;
    assert_eq!(theirs.ok(200)["tasks"], json!([]));

    // `idem task list` with the same filters, through the store.
    let (ok, out, err) = srv.cli(&[
        "task", "list", "--tenant", "acme", "--state", "queued", "--limit", "1",
    ]);
    assert!(ok, "task list: {err}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed["tasks"].as_array().unwrap().len(), 1);
    assert!(listed["next_cursor"].is_string());
    let (ok, _, err) = srv.cli(&["task", "list", "--tenant", "acme", "--state", "done"]);
    assert!(!ok && err.contains("unknown state"), "{err}");

    // The SDK walks the pages.
    let c = Client::new(&srv.url, srv.keys.acme.clone()).unwrap();
    let filter = TaskFilter {
        states: vec![TaskState::Queued],
        limit: Some(1),
        ..TaskFilter::default()
    };
    let all = c.task_pages(filter).collect_all().await.unwrap();
    assert_eq!(all.len(), 2);
    assert!(all[0].created_at >= all[1].created_at);
}

/// A conflict names the material fields that differ (JSON Pointers, never
/// values); a terminal task's replay carries `meta.key_expires_at`.
#[tokio::test]
async fn conflict_names_differing_fields_and_terminal_meta_has_key_expiry() {
    let srv = Server::in_process().await;
    let original =
        json!({"payee": "acct-secret-payee", "amount": 100, "currency": "EUR", "memo": "a"});
    srv.new_task("pay-1", "payment.release", original.clone())
        .await;
    let changed =
        json!({"payee": "acct-secret-payee", "amount": 250, "currency": "EUR", "memo": "b"});
    let r = srv.submit("pay-1", "payment.release", changed).await;
    r.assert_problem(422, "IDEMPOTENCY_CONFLICT");
    assert_eq!(r.json["differing_fields"], json!(["/amount"]));
    for secret in ["250", "100", "acct-secret-payee"] {
        assert!(
            !r.text.contains(secret),
            "the conflict answer leaks {secret}: {}",
            r.text
        );
    }
    // All params material (generation.dispatch): nested fields by pointer.
    srv.new_task(
        "gen-1",
        "generation.dispatch",
        json!({"opts": {"size": [1, 2]}, "prompt": "x"}),
    )
    .await;
    let r = srv
        .submit(
            "gen-1",
            "generation.dispatch",
            json!({"opts": {"size": [1, 3], "seed": 4}, "prompt": "x"}),
        )
        .await;
    r.assert_problem(422, "IDEMPOTENCY_CONFLICT");
    assert_eq!(
        r.json["differing_fields"],
        json!(["/opts/seed", "/opts/size/1"])
    );

    // A replay of a queued task has no key_expires_at; of a terminal one, it has.
    let r = srv
        .submit(
            "gen-1",
            "generation.dispatch",
            json!({"opts": {"size": [1, 2]}, "prompt": "x"}),
        )
        .await;
    assert!(
        r.ok(201)["meta"].get("key_expires_at").is_none(),
        "{}",
        r.text
    );
    let a = srv.claim_one("generation.dispatch", None).await;
    let body =
        json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": true}});
    srv.report(a["id"].as_str().unwrap(), body).await.ok(200);
    let r = srv
        .submit(
            "gen-1",
            "generation.dispatch",
            json!({"opts": {"size": [1, 2]}, "prompt": "x"}),
        )
        .await;
    let v = r.ok(201);
    let expires = v["meta"]["key_expires_at"]
        .as_str()
        .expect("key_expires_at");
    assert!(
        expires > v["task"]["updated_at"].as_str().unwrap(),
        "{expires}"
    );
}

/// `GET /v1/tasks?external_txn_id=txn` as acme's client.
async fn by_txn(srv: &Server, txn: &str) -> crate::support::Resp {
    let mut url = reqwest::Url::parse(&format!("{}/v1/tasks", srv.url)).unwrap();
    url.query_pairs_mut().append_pair("external_txn_id", txn);
    crate::support::send(srv.http.get(url).bearer_auth(&srv.keys.acme)).await
}

/// The `external_txn_id` filter takes what a report takes (SPEC §7: 1–200
/// characters, none of them a control character) and answers the same on
/// every store: the task whose attempt reported a 200-character id is found
/// by it; a NUL, another control character, 201 characters or an empty id
/// is 400 `INVALID_REQUEST` naming the rule.
async fn external_txn_id_filter_takes_what_a_report_takes(srv: Server) {
    let task = srv
        .new_task(
            &crate::support::ikey(),
            "payment.release",
            crate::support::payment(5),
        )
        .await;
    let a = srv.claim_one("payment.release", None).await;
    let txn = format!("tx-{}", "é".repeat(197));
    assert_eq!(txn.chars().count(), 200);
    srv.report(
        &crate::support::s(&a["id"]),
        json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": true}, "external_txn_id": txn}),
    )
    .await
    .ok(200);
    let found = by_txn(&srv, &txn).await;
    let tasks = found.ok(200)["tasks"].as_array().unwrap().clone();
    assert_eq!(tasks.len(), 1, "{}", found.text);
    assert_eq!(tasks[0]["id"], task["id"]);
    assert_eq!(by_txn(&srv, "tx-none").await.ok(200)["tasks"], json!([]));
    for bad in [
        "\0".to_owned(),
        "tx\u{1}".to_owned(),
        "tx\u{7f}".to_owned(),
        "tx\u{85}".to_owned(),
        format!("{txn}x"),
        String::new(),
    ] {
        let r = by_txn(&srv, &bad).await;
        r.assert_problem(400, "INVALID_REQUEST");
        assert!(
            r.json["detail"]
                .as_str()
                .unwrap()
                .contains("`external_txn_id` must be 1–200 characters"),
            "{bad:?}: {}",
            r.text
        );
    }
}

#[tokio::test]
async fn external_txn_id_filter_takes_what_a_report_takes_sqlite() {
    external_txn_id_filter_takes_what_a_report_takes(Server::fast().await).await;
}

#[tokio::test]
async fn external_txn_id_filter_takes_what_a_report_takes_postgres() {
    let db = idem_store_postgres::testing::fresh_database().await;
    let keys = Server::create_keys(db.url());
    let srv = Server::start_pg(db.url(), &keys, &[]).await;
    external_txn_id_filter_takes_what_a_report_takes(srv).await;
}
