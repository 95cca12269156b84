//! Params schemas (a payment that does not match its class's schema
//! is 400 naming the failing pointer and consumes no key) and messages that say
//! what to do (unknown operation, a generation never issued, the three 404s,
//! `keys create --config`). Every check reads the message text.

use std::process::{Command, Stdio};

use reqwest::Method;
use serde_json::json;

use crate::support::{BIN, Server, cli_at, ikey, payment, s, send};

/// Sends `body` as it is (bytes, not re-encoded) with idempotency key `key`.
async fn submit_raw(srv: &Server, key: &str, body: &str) -> crate::support::Resp {
    send(
        srv.submit_req(&srv.keys.acme)
            .header("Idempotency-Key", key)
            .body(body.to_owned()),
    )
    .await
}

fn detail(r: &crate::support::Resp) -> String {
    r.json["detail"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn payments_that_break_the_schema_are_400_naming_the_pointer_and_keep_the_key() {
    let srv = Server::start().await;
    let cases = [
        (
            r#"{"payee":"acct-1","amount":100}"#,
            "/params/currency",
            r#""currency" is a required property"#,
        ),
        (
            r#"{"payee":"acct-1","amount":-5,"currency":"EUR"}"#,
            "/params/amount",
            "-5 is less than the minimum of 1",
        ),
        (
            r#"{"payee":"acct-1","amount":1.5,"currency":"EUR"}"#,
            "/params/amount",
            r#"1.5 is not of type "integer""#,
        ),
        (
            r#"{"payee":"","amount":100,"currency":"EUR"}"#,
            "/params/payee",
            r#""" is shorter than 1 character"#,
        ),
        (
            r#"{"payee":"acct-1","amount":100,"currency":"eur"}"#,
            "/params/currency",
            r#""eur" does not match "^[A-Z]{3}$""#,
        ),
    ];
    for (params, pointer, message) in cases {
        let key = ikey();
        let body = format!(r#"{{"operation":"payment.release","params":{params}}}"#);
        // Twice: the second try (same bytes) is refused the same way.
        for _ in 0..2 {
            let r = submit_raw(&srv, &key, &body).await;
            r.assert_problem(400, "INVALID_REQUEST");
            assert_eq!(
                detail(&r),
                format!(
                    "`params` do not match the params_schema of `payment.release`: {pointer}: {message}; nothing was created, and this Idempotency-Key holds no task of this operation"
                ),
                "{params}"
            );
            assert_eq!(
                r.json["errors"],
                json!([{"pointer": pointer, "message": message}]),
                "{params}"
            );
        }
        // Nothing was created under the scope …
        srv.get(
            &format!("/v1/tasks?operation=payment.release&idempotency_key={key}"),
            &srv.keys.acme,
        )
        .await
        .assert_problem(404, "NOT_FOUND");
        // … and the same key then creates a task with a valid body.
        srv.new_task(&key, "payment.release", payment(100)).await;
    }

    // Several violations are all listed, in the detail and in `errors`.
    let r = submit_raw(
        &srv,
        &ikey(),
        r#"{"operation":"payment.release","params":{"amount":0}}"#,
    )
    .await;
    r.assert_problem(400, "INVALID_REQUEST");
    let pointers: Vec<&str> = r.json["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["pointer"].as_str().unwrap())
        .collect();
    for p in ["/params/payee", "/params/currency", "/params/amount"] {
        assert!(pointers.contains(&p), "{p} in {pointers:?}");
        assert!(detail(&r).contains(&format!("{p}: ")), "{}", detail(&r));
    }

    // `1.0` is an integer in JSON Schema, and the fingerprint equates it with
    // `1`: accepted, and the same request as `1`. Members outside the schema
    // are allowed.
    let key = ikey();
    let r = submit_raw(
        &srv,
        &key,
        r#"{"operation":"payment.release","params":{"payee":"acct-1","amount":1.0,"currency":"EUR","memo":"x"}}"#,
    )
    .await;
    let task = r.ok(201)["task"].clone();
    let again = submit_raw(
        &srv,
        &key,
        r#"{"operation":"payment.release","params":{"payee":"acct-1","amount":1,"currency":"EUR"}}"#,
    )
    .await;
    assert_eq!(again.ok(201)["meta"]["replayed"], json!(true));
    assert_eq!(again.json["task"]["id"], task["id"]);
    // The schema is frozen into the task's contract; a class without one has none.
    assert_eq!(
        task["contract"]["params_schema"]["required"],
        json!(["payee", "amount", "currency"])
    );
    assert_eq!(
        task["contract"]["params_schema"]["properties"]["currency"]["pattern"],
        json!("^[A-Z]{3}$")
    );
    let g = srv
        .new_task(&ikey(), "generation.dispatch", json!({"prompt": "x"}))
        .await;
    assert!(g["contract"].get("params_schema").is_none(), "{g}");
}

#[test]
fn a_schema_that_does_not_compile_refuses_start_up_naming_the_class() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    let text = idem_core::config::DEFAULT_TOML.replace(
        r#"properties.amount = { type = "integer""#,
        r#"properties.amount = { type = "whole""#,
    );
    assert_ne!(text, idem_core::config::DEFAULT_TOML);
    std::fs::write(&config, text).unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--store", &store])
        .arg("--config")
        .arg(&config)
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_CONFIG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("operation class `payment.release`: params_schema does not compile:"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "it never listened");
}

#[tokio::test]
async fn an_unknown_operation_lists_the_configured_classes() {
    let srv = Server::start().await;
    let want = "unknown operation `payment.refund`; configured classes: generation.dispatch, payment.release";
    let r = srv.submit(&ikey(), "payment.refund", json!({})).await;
    r.assert_problem(400, "INVALID_REQUEST");
    assert_eq!(detail(&r), want);
    let r = srv
        .get(
            "/v1/tasks?operation=payment.refund&idempotency_key=k",
            &srv.keys.acme,
        )
        .await;
    r.assert_problem(400, "INVALID_REQUEST");
    assert_eq!(detail(&r), want);
    let r = srv
        .claim(json!({"executor_id": "e", "operations": ["payment.refund"]}))
        .await;
    r.assert_problem(400, "INVALID_REQUEST");
    assert_eq!(detail(&r), want);
}

#[tokio::test]
async fn a_generation_newer_than_the_tasks_says_it_was_never_issued() {
    let srv = Server::start().await;
    let task = srv
        .new_task(&ikey(), "generation.dispatch", json!({"prompt": "x"}))
        .await;
    let a = srv.claim_one("generation.dispatch", None).await;
    assert_eq!(a["generation"], json!(1));
    let id = s(&a["id"]);
    let never = "generation 7 is newer than the task's current generation 1: it was never issued; nothing changed, and a report is kept as evidence";
    let r = srv.heartbeat(&id, json!({"generation": 7})).await;
    r.assert_problem(409, "STALE_GENERATION");
    assert_eq!(detail(&r), never);
    assert_eq!(r.json["current_generation"], json!(1));
    let r = srv
        .report(
            &id,
            json!({"generation": 7, "outcome": "succeeded", "result": {}}),
        )
        .await;
    r.assert_problem(409, "STALE_GENERATION");
    assert_eq!(detail(&r), never);
    // An older generation still says it no longer holds the lease.
    let r = srv.heartbeat(&id, json!({"generation": 0})).await;
    r.assert_problem(409, "STALE_GENERATION");
    assert_eq!(
        detail(&r),
        "generation 0 no longer holds the lease (current 1); nothing changed, and a report is kept as evidence"
    );
    // Nothing changed: the live generation still works.
    srv.heartbeat(&id, json!({"generation": 1})).await.ok(200);
    assert_eq!(srv.task(&s(&task["id"])).await["state"], json!("running"));
}

#[tokio::test]
async fn the_three_404s_say_which() {
    let srv = Server::start().await;
    // An unknown path.
    let r = srv
        .call(Method::GET, "/v1/taskz?x=1", Some(&srv.keys.acme), None)
        .await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(detail(&r), "no such path: GET /v1/taskz");
    // An id that is not a UUID, for a task and for an attempt.
    let r = srv.get("/v1/tasks/order-42", &srv.keys.acme).await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(detail(&r), "`order-42` is not a task id (a UUID)");
    let r = srv
        .post(
            "/v1/attempts/nope/heartbeat",
            &srv.keys.exec,
            json!({"generation": 1}),
        )
        .await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(detail(&r), "`nope` is not an attempt id (a UUID)");
    // No such task: the same text for a task of another tenant.
    let mine = srv.new_task(&ikey(), "payment.release", payment(5)).await;
    let mine = s(&mine["id"]);
    let r = srv.get(&format!("/v1/tasks/{mine}"), &srv.keys.other).await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(detail(&r), format!("no task {mine} for this tenant"));
    let nobody = uuid::Uuid::new_v4();
    for path in [
        format!("/v1/tasks/{nobody}"),
        format!("/v1/tasks/{nobody}/events"),
    ] {
        let r = srv.get(&path, &srv.keys.acme).await;
        r.assert_problem(404, "NOT_FOUND");
        assert_eq!(detail(&r), format!("no task {nobody} for this tenant"));
    }
    let r = srv.cancel(&nobody.to_string()).await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(detail(&r), format!("no task {nobody} for this tenant"));
    let r = srv
        .heartbeat(&nobody.to_string(), json!({"generation": 1}))
        .await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(detail(&r), format!("no attempt {nobody} for this tenant"));
    // A scope with no task.
    let r = srv
        .get(
            "/v1/tasks?operation=payment.release&idempotency_key=none-yet",
            &srv.keys.acme,
        )
        .await;
    r.assert_problem(404, "NOT_FOUND");
    assert_eq!(
        detail(&r),
        "no task of `payment.release` with Idempotency-Key `none-yet` for this tenant"
    );
}

/// `keys create` checks `--operations` against `--config` (as `serve` takes
/// it), not only against `IDEM_CONFIG`.
#[test]
fn keys_create_checks_operations_against_its_config_option() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let config = dir.path().join("devices.toml");
    let text =
        idem_core::config::DEFAULT_TOML.replace("\"generation.dispatch\"", "\"device.command\"");
    std::fs::write(&config, text).unwrap();
    let config = config.display().to_string();
    let create = |extra: &[&str]| {
        let mut args = vec![
            "keys",
            "create",
            "--tenant",
            "acme",
            "--role",
            "client",
            "--operations",
            "device.command",
        ];
        args.extend_from_slice(extra);
        cli_at(&store, &args)
    };
    let (ok, _, err) = create(&["--config", &config]);
    assert!(ok, "{err}");
    assert!(!err.contains("warning"), "{err}");
    let (ok, _, err) = create(&[]);
    assert!(ok, "{err}");
    assert!(
        err.contains(
            "warning: `device.command` is not an operation class of the bundled configuration"
        ),
        "{err}"
    );
    let other = dir.path().join("bundled.toml");
    std::fs::write(&other, idem_core::config::DEFAULT_TOML).unwrap();
    let (ok, _, err) = create(&["--config", &other.display().to_string()]);
    assert!(ok, "{err}");
    assert!(
        err.contains(&format!(
            "warning: `device.command` is not an operation class of the configuration {}",
            other.display()
        )),
        "{err}"
    );
}
