//! An SQLite store whose file is lost is never silently replaced: `serve`,
//! `migrate` and `keys create` refuse a path whose database file is missing
//! while its `-wal`, `-shm` or serve lock remain (naming them), so a
//! restart cannot answer a client's retry from a new, empty store and run
//! its payment again; only the operator brings the store back (restores the
//! file, or removes the leftovers to start empty on purpose). `serve`
//! refuses a file holding another application's tables; `migrate` refuses a
//! file a running server holds.

use std::process::{Command, Stdio};

use futures::StreamExt;
use serde_json::json;

use crate::support::{BIN, Server, cli_at, payment};

/// Runs `idem serve` on `store` expecting a refusal; returns its stderr.
fn serve_refused(store: &str) -> String {
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store])
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_CONFIG")
        .stdin(Stdio::null())
        .output()
        .expect("run idem serve");
    assert!(!out.status.success(), "serve started on {store}");
    assert!(out.stdout.is_empty(), "it never listened");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The tasks in the SQLite file at `path`.
fn tasks_in(path: &std::path::Path) -> i64 {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.query_row("SELECT count(*) FROM tasks", [], |r| r.get(0))
        .unwrap()
}

/// 1,000 acknowledged tasks; the database file is moved away under the
/// running server, which is then SIGKILLed: every command that could create
/// a store there refuses, naming the leftover write-ahead log, and creates
/// nothing; moved back by the operator, the store serves all 1,000 tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_file_was_removed_is_never_silently_replaced() {
    let mut srv = Server::fast().await;
    let submitted = futures::stream::iter(0..1000)
        .map(|i| {
            let srv = &srv;
            async move {
                srv.submit(&format!("lost-{i}"), "payment.release", payment(i + 1))
                    .await
                    .ok(201);
            }
        })
        .buffer_unordered(16)
        .count()
        .await;
    assert_eq!(submitted, 1000);
    let db = srv.db_path();
    let moved = db.with_extension("db.moved");
    std::fs::rename(&db, &moved).unwrap();
    srv.kill9();
    let wal = format!("{}-wal", db.display());
    assert!(
        std::path::Path::new(&wal).exists(),
        "the WAL outlives the server"
    );
    let store = srv.store();
    let err = serve_refused(&store);
    assert!(err.contains("is missing") && err.contains(&wal), "{err}");
    for args in [
        vec!["migrate"],
        vec!["keys", "create", "--tenant", "acme", "--role", "client"],
    ] {
        let (ok, out, err) = cli_at(&store, &args);
        assert!(!ok, "{args:?} succeeded: {out}");
        assert!(
            err.contains("is missing") && err.contains(&wal),
            "{args:?}: {err}"
        );
    }
    assert!(!db.exists(), "no command created a new store");
    // The operator restores the file: every acknowledged task is there.
    std::fs::rename(&moved, &db).unwrap();
    srv.restart();
    assert!(srv.is_running());
    let r = srv.submit("lost-7", "payment.release", payment(8)).await;
    assert_eq!(
        r.ok(201)["meta"]["replayed"],
        json!(true),
        "the retry replays"
    );
    srv.terminate();
    assert_eq!(tasks_in(&db), 1000);
}

/// After a stop the serve lock remains (SQLite's `-wal` and `-shm` may be
/// gone, if the last connection closed them) and still marks the store as
/// used: with the database file removed, serve refuses naming it. Removing
/// the leftovers is the operator's way to start empty on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_clean_stop_the_serve_lock_marks_a_used_store() {
    let mut srv = Server::fast().await;
    srv.submit("a", "payment.release", payment(1)).await.ok(201);
    assert!(srv.terminate().success());
    let db = srv.db_path();
    std::fs::remove_file(&db).unwrap();
    let lock = format!("{}.serve-lock", db.display());
    std::fs::remove_file(format!("{}-wal", db.display())).ok();
    std::fs::remove_file(format!("{}-shm", db.display())).ok();
    let err = serve_refused(&srv.store());
    assert!(err.contains(&lock), "{err}");
    std::fs::remove_file(&lock).unwrap();
    srv.restart();
    assert!(srv.is_running(), "an operator's empty start");
}

/// `serve` and `keys create` refuse a file holding tables that are not
/// idem's and leave it as it was; `idem migrate` adopts it when asked.
#[test]
fn serve_refuses_a_file_with_another_applications_tables() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("customers.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE customers (id INTEGER);")
        .unwrap();
    let store = format!("sqlite://{}", path.display());
    let err = serve_refused(&store);
    assert!(err.contains("not idem's (customers)"), "{err}");
    let (ok, _, err) = cli_at(
        &store,
        &["keys", "create", "--tenant", "t", "--role", "client"],
    );
    assert!(!ok && err.contains("not idem's"), "{err}");
    let version: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 0, "nothing was created");
    let (ok, _, err) = cli_at(&store, &["migrate"]);
    assert!(ok, "migrate adopts it: {err}");
}

/// `migrate` refuses a file a running `idem serve` holds; `keys create`
/// beside a running server on a current schema adds its key (a row, read
/// by the server as any writer's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_refuses_a_file_a_running_server_holds() {
    let srv = Server::fast().await;
    let (ok, _, err) = srv.cli(&["migrate"]);
    assert!(!ok && err.contains("a running `idem serve` holds"), "{err}");
    let (ok, key, err) = srv.cli(&["keys", "create", "--tenant", "acme", "--role", "client"]);
    assert!(ok, "{err}");
    let r = srv
        .submit_as(key.trim(), "beside", "payment.release", payment(1))
        .await;
    r.ok(201);
}
