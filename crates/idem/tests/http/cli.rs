//! The `idem` command line around the service: keys and start-up checks.

use std::io::Read;
use std::process::{Command, Stdio};

use serde_json::json;

use crate::support::{BIN, Server, cli_at, fast_toml, generation, ikey, send, store_url};

/// SPEC §6: `idem keys create --tenant T --role R` and "store-level commands take
/// `--store`": the flag is accepted after the subcommand, as documented.
#[tokio::test]
async fn keys_commands_take_store_after_the_subcommand() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = store_url(dir.path());
    let out = Command::new(BIN)
        .args([
            "keys", "create", "--tenant", "acme", "--role", "client", "--store", &store,
        ])
        .env_remove("IDEM_STORE")
        .output()
        .expect("run idem");
    assert!(
        out.status.success(),
        "`idem keys create ... --store URL` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    let list = Command::new(BIN)
        .args(["keys", "list", "--store", &store])
        .env_remove("IDEM_STORE")
        .output()
        .expect("run idem");
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&list.stdout).lines().count(), 1);
}

/// The writing end of a pipe whose reader is already gone: every write to it
/// fails with a broken pipe.
fn closed_pipe() -> std::io::PipeWriter {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer
}

/// A command whose reader has gone away (`idem openapi | head -1`, the
/// reader closed before the first write) ends quietly with its own status (0
/// here), not with a panic about a broken pipe.
#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    let writer = closed_pipe();
    let out = Command::new(BIN)
        .arg("openapi")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}

/// The plain key of `idem keys create` is shown once: when it cannot be
/// written (the reader went away), the command fails (exit 1) and says which
/// key to revoke, instead of passing an unusable key off as success.
#[test]
fn a_plain_key_nobody_received_fails_the_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = store_url(dir.path());
    let writer = closed_pipe();
    let out = Command::new(BIN)
        .args([
            "keys", "create", "--tenant", "acme", "--role", "client", "--store", &store,
        ])
        .env_remove("IDEM_STORE")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
    let list = Command::new(BIN)
        .args(["keys", "list", "--store", &store])
        .env_remove("IDEM_STORE")
        .output()
        .expect("run idem");
    let listed = String::from_utf8_lossy(&list.stdout);
    let id = listed.split('\t').next().unwrap_or_default().trim();
    assert!(!id.is_empty(), "the key was created: {listed}");
    assert!(
        err.contains(&format!("idem keys revoke {id}")),
        "names the key to revoke: {err}"
    );
}

/// A closed stderr (`idem keys revoke ID 2>&1 | head -0`) does not turn a
/// command's own status into a panic: the message is dropped, the status kept.
#[test]
fn messages_to_a_closed_stderr_keep_the_status() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = store_url(dir.path());
    let run = |args: &[&str]| {
        let writer = closed_pipe();
        Command::new(BIN)
            .args(args)
            .args(["--store", &store])
            .env_remove("IDEM_STORE")
            .stdout(Stdio::null())
            .stderr(writer)
            .status()
            .unwrap()
    };
    // `migrate` reports only on stderr, and succeeds.
    assert_eq!(run(&["migrate"]).code(), Some(0));
    // Revoking a key that does not exist fails: its error line is lost, its
    // status (1, not a panic's 101) is not.
    assert_eq!(
        run(&["keys", "revoke", "00000000-0000-0000-0000-000000000000"]).code(),
        Some(1)
    );
}

/// `idem task show|events|attempts` print what the API answers for the task,
/// as indented JSON all through (the contract included).
#[tokio::test]
async fn task_commands_print_the_task_as_indented_json() {
    let srv = Server::start().await;
    let created = srv
        .submit("show-1", "generation.dispatch", generation("a cat"))
        .await;
    let task = created.ok(201)["task"].clone();
    let id = task["id"].as_str().expect("task id").to_owned();
    let (ok, out, err) = srv.cli(&["task", "show", &id]);
    assert!(ok, "{err}");
    let shown: serde_json::Value = serde_json::from_str(&out).expect("task show prints JSON");
    assert_eq!(shown, task, "the task as the API answers it");
    assert!(
        out.lines().any(|l| l.trim() == "\"contract\": {"),
        "the contract is indented, not one compact line:\n{out}"
    );
    assert!(
        out.lines().all(|l| l.len() < 120),
        "no long compact line:\n{out}"
    );
    let (ok, out, err) = srv.cli(&["task", "events", &id]);
    assert!(ok, "{err}");
    let events: serde_json::Value = serde_json::from_str(&out).expect("task events prints JSON");
    assert_eq!(events[0]["type"], json!("task_submitted"), "{out}");
    let (ok, out, err) = srv.cli(&["task", "attempts", &id]);
    assert!(ok, "{err}");
    let attempts: serde_json::Value =
        serde_json::from_str(&out).expect("task attempts prints JSON");
    assert_eq!(attempts, json!([]), "no attempt yet");
}

#[tokio::test]
async fn keys_list_and_revoke() {
    let srv = Server::start().await;
    let (id, plain) = srv.create_key(
        "acme",
        "executor",
        Some("payment.release,generation.dispatch"),
    );
    let (ok, list, _) = srv.cli(&["keys", "list"]);
    assert!(ok);
    let line = list.lines().find(|l| l.starts_with(&id)).expect("listed");
    let cols: Vec<&str> = line.split('\t').collect();
    assert_eq!(cols.len(), 6, "{line}");
    assert_eq!(cols[1], "acme");
    assert_eq!(cols[2], "executor");
    assert!(
        cols[3].contains("payment.release") && cols[3].contains("generation.dispatch"),
        "{line}"
    );
    assert!(cols[4].contains('T'), "created is a timestamp: {line}");
    assert_eq!(cols[5], "-", "not revoked: {line}");
    let r = srv
        .post(
            "/v1/attempts/claim",
            &plain,
            serde_json::json!({"executor_id": "e"}),
        )
        .await;
    r.ok(200);
    srv.revoke_key(&id);
    let (_, list, _) = srv.cli(&["keys", "list"]);
    let line = list.lines().find(|l| l.starts_with(&id)).expect("listed");
    assert_ne!(line.split('\t').nth(5), Some("-"), "{line}");
    let r = srv
        .post(
            "/v1/attempts/claim",
            &plain,
            serde_json::json!({"executor_id": "e"}),
        )
        .await;
    r.assert_problem(401, "UNAUTHENTICATED");
    // Revoking an unknown id fails.
    let (ok, _, _) = srv.cli(&["keys", "revoke", &uuid::Uuid::new_v4().to_string()]);
    assert!(!ok);
}

/// A submitting key is cached by the server after its first submit, yet a
/// revocation (by the CLI, another process) refuses its very next submit: the
/// store checks the key inside the submit transaction. Neither a new key nor a
/// replay gets through, and nothing is written.
#[tokio::test]
async fn revoked_key_is_refused_on_its_next_submit_although_cached() {
    let srv = Server::start().await;
    let (id, plain) = srv.create_key("acme", "client", None);
    let first = ikey();
    for expect_replayed in [false, true] {
        let r = srv
            .submit_as(&plain, &first, "generation.dispatch", generation("a"))
            .await;
        assert_eq!(r.ok(201)["meta"]["replayed"], json!(expect_replayed));
    }
    srv.revoke_key(&id);
    let fresh = ikey();
    for key in [&fresh, &first] {
        let r = srv
            .submit_as(&plain, key, "generation.dispatch", generation("a"))
            .await;
        r.assert_problem(401, "UNAUTHENTICATED");
    }
    // Still refused once the server has dropped it from its cache.
    srv.submit_as(&plain, &fresh, "generation.dispatch", generation("a"))
        .await
        .assert_problem(401, "UNAUTHENTICATED");
    // Nothing was written for the refused new key: acme's other key finds the
    // first task, and no task under the refused key.
    let lookup = |k: &str| format!("/v1/tasks?operation=generation.dispatch&idempotency_key={k}");
    srv.get(&lookup(&first), &srv.keys.acme).await.ok(200);
    srv.get(&lookup(&fresh), &srv.keys.acme)
        .await
        .assert_problem(404, "NOT_FOUND");
}

/// SPEC §4 "no or bad credentials → 401": a revoked key that the server had
/// cached gets 401 on a submit whatever else is wrong with the request (no
/// other refusal tells it anything), and so does a revoked executor key that
/// once tried to submit.
#[tokio::test]
async fn revoked_cached_key_is_401_even_for_a_bad_request() {
    let srv = Server::start().await;
    let (id, plain) = srv.create_key("acme", "client", Some("generation.dispatch"));
    let (eid, exec) = srv.create_key("acme", "executor", None);
    srv.submit_as(&plain, &ikey(), "generation.dispatch", generation("a"))
        .await
        .ok(201);
    srv.submit_as(&exec, &ikey(), "generation.dispatch", generation("a"))
        .await
        .assert_problem(403, "PERMISSION_DENIED");
    // While the key is live, a bad request is refused for what it is.
    send(
        srv.submit_req(&plain)
            .body(r#"{"operation": "generation.dispatch", "params": {}}"#),
    )
    .await
    .assert_problem(400, "IDEMPOTENCY_KEY_MISSING");
    srv.revoke_key(&id);
    srv.revoke_key(&eid);
    let mut wrong = Vec::new();
    let r = send(
        srv.submit_req(&plain)
            .body(r#"{"operation": "generation.dispatch", "params": {}}"#),
    )
    .await;
    wrong.push(("missing Idempotency-Key", r.status));
    let r = send(
        srv.submit_req(&plain)
            .header("Idempotency-Key", ikey())
            .body("{\"operation\":"),
    )
    .await;
    wrong.push(("bad JSON", r.status));
    let r = srv
        .submit_as(
            &plain,
            &ikey(),
            "payment.release",
            json!({"payee": "p", "amount": 1, "currency": "EUR"}),
        )
        .await;
    wrong.push(("ungranted operation", r.status));
    for _ in 0..2 {
        let r = srv
            .submit_as(&exec, &ikey(), "generation.dispatch", generation("a"))
            .await;
        wrong.push(("revoked executor key", r.status));
    }
    wrong.retain(|(_, status)| *status != 401);
    assert!(
        wrong.is_empty(),
        "a revoked key answered other than 401: {wrong:?}"
    );
}

/// SPEC §2.9: a configuration whose retention is shorter than
/// request_retry + deadline + reconciliation is refused at start-up.
#[tokio::test]
async fn serve_refuses_retention_shorter_than_the_windows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fast = fast_toml();
    let text = fast.replace("retention_ms = 86400000", "retention_ms = 7199999");
    assert_ne!(text, fast);
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, text).expect("write");
    let mut child = Command::new(BIN)
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--store", &store_url(dir.path())])
        .arg("--config")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out)
        .expect("read stdout");
    let status = child.wait().expect("wait");
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    assert!(
        !status.success(),
        "serve started with a too-short retention; stdout {out:?}"
    );
    assert!(!out.contains("listening"), "stdout {out:?}");
    assert!(err.contains("retention"), "the error names the rule: {err}");
    // request_retry + deadline + reconciliation = 3 h exactly is enough; the environment can fix it.
    let ok = Command::new(BIN)
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--store", &store_url(dir.path())])
        .arg("--config")
        .arg(&path)
        .env(
            "IDEM_OPERATIONS__GENERATION_DISPATCH__WINDOWS__RETENTION_MS",
            "10800000",
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let mut ok = ok.expect("spawn");
    let mut line = String::new();
    {
        use std::io::BufRead;
        let mut r = std::io::BufReader::new(ok.stdout.take().expect("stdout"));
        r.read_line(&mut line).expect("read");
    }
    let _ = ok.kill();
    let _ = ok.wait();
    assert!(
        line.starts_with("idem listening on http://"),
        "a retention equal to the windows starts: {line:?}"
    );
}

/// Inspection commands never create a database at a mistyped path.
#[test]
fn inspection_commands_refuse_a_missing_sqlite_database() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("idem.db");
    let store = format!("sqlite://{}", path.display());
    for args in [
        vec!["keys", "list"],
        vec!["task", "show", "01a229bb-66a5-706b-ac34-0e114ade8e02"],
        vec!["gc"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(&args)
            .arg("--store")
            .arg(&store)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no idem database"), "{args:?}: {err}");
        assert!(!path.exists(), "{args:?} created {}", path.display());
    }
}

/// Inspection and administration commands never create or upgrade a schema:
/// pointed at a file that is not an idem store (or at a PostgreSQL database
/// without idem's schema), they refuse it and leave it as it was.
#[test]
fn inspection_commands_leave_a_foreign_database_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("customers.db");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE customers (id INTEGER);")
            .unwrap();
    }
    let store = format!("sqlite://{}", path.display());
    for args in [
        vec!["keys", "list"],
        vec!["task", "show", "01a229bb-66a5-706b-ac34-0e114ade8e02"],
        vec!["gc"],
    ] {
        let (ok, _, err) = cli_at(&store, &args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains("not an idem store"), "{args:?}: {err}");
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(tables, vec!["customers".to_owned()], "no table was added");
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 0);
}

/// `keys create --operations` warns about a class the configuration does not
/// define (the key is still created: the server may run another
/// configuration) and refuses an empty class name.
#[test]
fn keys_create_warns_about_unknown_operation_classes() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let run = |ops: &str| {
        cli_at(
            &store,
            &[
                "keys",
                "create",
                "--tenant",
                "acme",
                "--role",
                "client",
                "--operations",
                ops,
            ],
        )
    };
    let (ok, out, err) = run("payment.release,paymnet.release");
    assert!(ok, "{err}");
    assert!(
        err.contains("warning: `paymnet.release` is not an operation class"),
        "{err}"
    );
    assert!(!err.contains("`payment.release` is not"), "{err}");
    assert!(out.starts_with("idem_"));
    let (ok, _, err) = run("payment.release,");
    assert!(!ok);
    assert!(err.contains("empty class name"));
}

/// A SQLite "store" that names no lasting file (an empty path, `:memory:`, a
/// `file:` URI, which rusqlite would open as one private database per
/// connection) is refused by `migrate` and by `serve`: otherwise `migrate`
/// would report migrations applied to a database that vanishes, and `serve`
/// would start and answer 503 "no such table" to everything.
#[test]
fn sqlite_stores_without_a_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for store in [
        "sqlite://",
        "sqlite://:memory:",
        "sqlite://file::memory:",
        "sqlite://file:x.db?mode=memory",
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["migrate", "--store", store])
            .current_dir(dir.path())
            .env_remove("IDEM_STORE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "migrate {store}: {err}");
        assert!(err.contains("needs a file path"), "migrate {store}: {err}");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["serve", "--listen", "127.0.0.1:0", "--store", store])
            .current_dir(dir.path())
            .env_remove("IDEM_STORE")
            .env_remove("IDEM_CONFIG")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "serve {store}: {err}");
        assert!(err.contains("needs a file path"), "serve {store}: {err}");
    }
    let made: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(made.is_empty(), "nothing is created: {made:?}");
}

/// A refused `keys create` creates no database (its arguments are checked
/// before the store is opened, which would create it), and the
/// operation classes are stored trimmed.
#[test]
fn keys_create_checks_its_arguments_before_opening_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new").join("idem.db");
    let store = format!("sqlite://{}", path.display());
    let create = |args: &[&str]| {
        let mut all = vec!["keys", "create", "--tenant", "acme"];
        all.extend_from_slice(args);
        cli_at(&store, &all)
    };
    for args in [
        vec!["--role", "client", "--operations", ""],
        vec!["--role", "client", "--operations", "payment.release,"],
        vec!["--role", "bogus"],
    ] {
        let (ok, _, _) = create(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(
            !path.exists(),
            "{args:?} was refused, yet created {}",
            path.display()
        );
    }
    let (ok, _, err) = create(&[
        "--role",
        "client",
        "--operations",
        "payment.release, generation.dispatch",
    ]);
    assert!(ok, "{err}");
    assert!(
        !err.contains("warning"),
        "both classes exist once trimmed: {err}"
    );
    let (_, listed, _) = cli_at(&store, &["keys", "list"]);
    assert!(
        listed.contains("payment.release,generation.dispatch"),
        "stored trimmed: {listed}"
    );
}

/// `idem migrate` says which migrations it applied, and on a second run that
/// there was nothing to apply.
#[test]
fn migrate_reports_what_it_applied() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!(
        "sqlite://{}",
        dir.path().join("data").join("idem.db").display()
    );
    let run = || {
        let (ok, _, err) = cli_at(&store, &["migrate"]);
        assert!(ok, "{err}");
        err
    };
    let known = idem_store_sqlite::MIGRATIONS.len();
    let all: Vec<String> = (1..=known).map(|v| v.to_string()).collect();
    let first = run();
    assert!(
        first.contains(&format!(
            "applied migration(s) {}; schema now at version {known}",
            all.join(", ")
        )),
        "first run: {first}"
    );
    let second = run();
    assert!(
        second.contains(&format!("up to date at version {known}; nothing to apply")),
        "second run: {second}"
    );
}

/// One `idem serve` per SQLite file: a second one on the same file refuses to
/// start and names the lock; once the first is gone, a new one starts; the
/// store commands still work while a server runs.
#[tokio::test]
async fn second_serve_on_one_sqlite_file_is_refused() {
    let mut srv = Server::fast().await;
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--store", &srv.store()])
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_CONFIG")
        .stdin(Stdio::null())
        .output()
        .expect("run idem serve");
    assert!(!out.status.success(), "a second serve must not start");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already running"), "stderr: {err}");
    assert!(out.stdout.is_empty(), "it never listened");
    let (ok, stdout, stderr) = srv.cli(&["keys", "list"]);
    assert!(ok, "keys list beside a running server: {stderr}");
    assert!(!stdout.is_empty());
    // After a crash the lock goes with the process.
    srv.restart();
    assert!(srv.is_running());
}

/// An executor key is cached by the server after its first claim, yet a
/// revocation (by the CLI, another process) refuses its very next report
/// with 401, whatever else is wrong with it, and writes nothing: the report's
/// transaction checks the key. Its next claim is refused too.
#[tokio::test]
async fn revoked_executor_key_is_refused_on_its_next_report_although_cached() {
    let srv = Server::start().await;
    let (id, exec) = srv.create_key("acme", "executor", None);
    let task = srv
        .new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let claim = json!({"executor_id": "ex-r", "operations": ["generation.dispatch"], "max": 1});
    let r = srv.post("/v1/attempts/claim", &exec, claim.clone()).await;
    let attempt = r.ok(200)["attempts"][0].clone();
    let (attempt_id, fence) = (attempt["id"].as_str().unwrap(), &attempt["generation"]);
    srv.revoke_key(&id);
    let report = format!("/v1/attempts/{attempt_id}/report");
    srv.post(
        &report,
        &exec,
        json!({"generation": fence, "outcome": "nonsense"}),
    )
    .await
    .assert_problem(401, "UNAUTHENTICATED");
    srv.post(
        &report,
        &exec,
        json!({"generation": fence, "outcome": "succeeded"}),
    )
    .await
    .assert_problem(401, "UNAUTHENTICATED");
    srv.post("/v1/attempts/claim", &exec, claim)
        .await
        .assert_problem(401, "UNAUTHENTICATED");
    let id = task["id"].as_str().unwrap();
    assert_eq!(srv.task(id).await["state"], json!("running"));
    // The acme executor key (live) reports it.
    srv.report(
        attempt_id,
        json!({"generation": fence, "outcome": "succeeded"}),
    )
    .await
    .ok(200);
}
