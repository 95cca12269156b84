//! `POST /v1/attempts/{id}/release` against a real `idem serve`: an executor
//! gives back an attempt it never started, and the task is claimable again
//! at once, with the attempt kept `released`; the refusals a report has
//! (fencing, an attempt that started, another tenant's). And the release
//! idem makes itself: a claim whose client closed its connection before the
//! answer leaves no leased attempt behind, on SQLite and on PostgreSQL,
//! judged by reading the store; a claim whose answer was read releases
//! nothing.

use std::time::Duration;

use idem_store_postgres::testing::TestDatabase;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{DEBUG_LOG, Options, POLL_TIMEOUT, Server, attempt_of, payment, s};

/// A released attempt's task is `queued` and claimed again at once; the
/// attempt is listed `released` with one `attempt_released` event; an exact
/// repeat answers the same task; the old generation holds nothing.
#[tokio::test]
async fn released_attempt_is_kept_and_its_task_claimable_at_once() {
    let srv = Server::fast().await;
    let t = srv.new_task("rel-1", "payment.release", payment(10)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let a_id = s(&a["id"]);
    // Executors only; a body that is not `{"generation"}` is 400.
    srv.post(
        &format!("/v1/attempts/{a_id}/release"),
        &srv.keys.acme,
        json!({"generation": 1}),
    )
    .await
    .assert_problem(403, "PERMISSION_DENIED");
    for body in [json!({}), json!([1]), json!({"generation": "1"})] {
        srv.release(&a_id, body)
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    let r = srv.release(&a_id, json!({"generation": 1})).await;
    let task = r.ok(200)["task"].clone();
    assert_eq!(task["state"], json!("queued"));
    assert_eq!(task["generation"], json!(1));
    let again = srv.release(&a_id, json!({"generation": 1})).await;
    assert_eq!(
        again.ok(200)["task"],
        task,
        "an exact repeat answers the same"
    );
    let attempts = srv.attempts(&id).await;
    assert_eq!(attempt_of(&attempts, &a_id)["state"], json!("released"));
    assert_eq!(released_events(&srv, &id).await, 1);
    // Claimable at once: a claim with no wait gets it.
    let b = srv.claim_op("payment.release", None).await;
    assert_eq!(b.len(), 1, "the released task is claimable at once");
    assert_eq!(
        (&b[0]["kind"], &b[0]["generation"]),
        (&json!("execute"), &json!(2))
    );
    srv.report(
        &a_id,
        json!({"generation": 1, "outcome": "succeeded", "result": {}}),
    )
    .await
    .assert_problem(409, "STALE_GENERATION");
    let done = srv
        .report(
            &s(&b[0]["id"]),
            json!({"generation": 2, "outcome": "succeeded", "result": {"ok": true}}),
        )
        .await;
    assert_eq!(done.ok(200)["task"]["state"], json!("succeeded"));
}

/// Refused, nothing changed: an old generation (409 `STALE_GENERATION`), an
/// attempt that reported or that its device acknowledged (409
/// `ATTEMPT_ALREADY_REPORTED`), another tenant's or an unknown attempt (404).
#[tokio::test]
async fn release_is_refused_for_a_stale_started_or_foreign_attempt() {
    let srv = Server::fast().await;
    let t = srv.new_task("rel-2", "payment.release", payment(11)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", None).await;
    let a_id = s(&a["id"]);
    srv.release(&a_id, json!({"generation": 0}))
        .await
        .assert_problem(409, "STALE_GENERATION");
    srv.post(
        &format!("/v1/attempts/{a_id}/release"),
        &srv.keys.exec_other,
        json!({"generation": 1}),
    )
    .await
    .assert_problem(404, "NOT_FOUND");
    srv.release(&uuid::Uuid::new_v4().to_string(), json!({"generation": 1}))
        .await
        .assert_problem(404, "NOT_FOUND");
    srv.post(
        &format!("/v1/attempts/{a_id}/ack"),
        &srv.keys.exec,
        json!({"generation": 1}),
    )
    .await
    .ok(200);
    refused_as_started(&srv, &id, &a_id, ("acknowledged", "running")).await;
    srv.report(&a_id, json!({"generation": 1, "outcome": "unknown"}))
        .await
        .ok(200);
    refused_as_started(&srv, &id, &a_id, ("unknown", "reconciling")).await;
}

/// An attempt whose heartbeat recorded usage above 0 consumed something: it
/// started, so its release is refused (409 `ATTEMPT_ALREADY_REPORTED`) and
/// the lease stays its executor's; a heartbeat with usage 0 does not count.
#[tokio::test]
async fn release_is_refused_once_a_heartbeat_recorded_usage() {
    let srv = Server::fast().await;
    let t = srv.new_task("rel-3", "payment.release", payment(12)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one("payment.release", Some(10_000)).await;
    let a_id = s(&a["id"]);
    for usage in [0, 5] {
        srv.post(
            &format!("/v1/attempts/{a_id}/heartbeat"),
            &srv.keys.exec,
            json!({"generation": 1, "usage": usage}),
        )
        .await
        .ok(200);
    }
    refused_as_started(&srv, &id, &a_id, ("leased", "running")).await;
}

/// Asserts that the release of attempt `a_id` (generation 1) of task `id`
/// is refused as started (409 `ATTEMPT_ALREADY_REPORTED`) and left the
/// attempt and the task in `states`, with no `attempt_released` event.
async fn refused_as_started(srv: &Server, id: &str, a_id: &str, states: (&str, &str)) {
    srv.release(a_id, json!({"generation": 1}))
        .await
        .assert_problem(409, "ATTEMPT_ALREADY_REPORTED");
    let attempts = srv.attempts(id).await;
    assert_eq!(attempt_of(&attempts, a_id)["state"], json!(states.0));
    assert_eq!(srv.task(id).await["state"], json!(states.1));
    assert_eq!(released_events(srv, id).await, 0);
}

/// The number of `attempt_released` events of task `id`.
async fn released_events(srv: &Server, id: &str) -> usize {
    srv.events(id)
        .await
        .iter()
        .filter(|e| e["type"] == json!("attempt_released"))
        .count()
}

/// Which store a test's server runs on.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Backend {
    Sqlite,
    Postgres,
}

/// A server on `backend` that logs each connection's first bytes and end
/// ([`DEBUG_LOG`]), with its PostgreSQL database (dropped with it).
async fn server(backend: Backend) -> (Server, Option<TestDatabase>) {
    match backend {
        Backend::Sqlite => (
            Server::start_with(Options::fast().env("RUST_LOG", DEBUG_LOG)).await,
            None,
        ),
        Backend::Postgres => {
            let db = idem_store_postgres::testing::fresh_database().await;
            let keys = Server::create_keys(db.url());
            let srv = Server::start_pg(db.url(), &keys, &[("RUST_LOG", DEBUG_LOG)]).await;
            (srv, Some(db))
        }
    }
}

/// The attempts of `task_id`, read from the store itself (not from an answer
/// of the server under test): `(state, generation)` by number.
async fn stored_attempts(srv: &Server, backend: Backend, task_id: &str) -> Vec<(String, i64)> {
    let sql = "SELECT state, generation FROM attempts WHERE task_id = $1 ORDER BY number";
    match backend {
        Backend::Sqlite => {
            let conn = rusqlite::Connection::open(srv.db_path()).unwrap();
            let mut stmt = conn.prepare(&sql.replace("$1", "?1")).unwrap();
            stmt.query_map([task_id], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        }
        Backend::Postgres => {
            let client = pg_client(&srv.store()).await;
            let id: uuid::Uuid = task_id.parse().unwrap();
            client
                .query(sql, &[&id])
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect()
        }
    }
}

async fn pg_client(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// A transaction of the test's own that holds the store's attempts table
/// (SQLite: the database's write lock, `BEGIN IMMEDIATE`; PostgreSQL:
/// `LOCK TABLE attempts`), so that a claim query waits inside the store.
enum Blocker {
    Sqlite(rusqlite::Connection),
    Postgres(tokio_postgres::Client),
}

impl Blocker {
    async fn hold(srv: &Server, backend: Backend) -> Blocker {
        match backend {
            Backend::Sqlite => {
                let conn = rusqlite::Connection::open(srv.db_path()).unwrap();
                conn.execute_batch("BEGIN IMMEDIATE").unwrap();
                Blocker::Sqlite(conn)
            }
            Backend::Postgres => {
                let client = pg_client(&srv.store()).await;
                client
                    .batch_execute("BEGIN; LOCK TABLE attempts IN ACCESS EXCLUSIVE MODE")
                    .await
                    .unwrap();
                Blocker::Postgres(client)
            }
        }
    }

    /// Until the claim query of the request from `client` waits for this
    /// transaction. PostgreSQL shows it (a session waiting for a lock; not
    /// the sweeper's read of expired leases, which waits for it too);
    /// SQLite's writer waits inside `busy_timeout` (5 s) without a trace, so
    /// the test gives the request, once read, a moment to get there.
    async fn wait_for_claim(&self, srv: &Server, client: std::net::SocketAddr) {
        srv.wait_read_from(client).await;
        match self {
            Blocker::Sqlite(_) => tokio::time::sleep(Duration::from_millis(300)).await,
            Blocker::Postgres(c) => {
                let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
                loop {
                    let waiting: i64 = c
                        .query_one(
                            "SELECT count(*) FROM pg_stat_activity \
                              WHERE datname = current_database() AND wait_event_type = 'Lock' \
                                AND pid <> pg_backend_pid() \
                                AND query NOT LIKE '%a.lease_expires_at <=%'",
                            &[],
                        )
                        .await
                        .unwrap()
                        .get(0);
                    if waiting > 0 {
                        return;
                    }
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "no claim query waited for the lock within {POLL_TIMEOUT:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    async fn let_go(self) {
        match self {
            Blocker::Sqlite(conn) => conn.execute_batch("ROLLBACK").unwrap(),
            Blocker::Postgres(c) => c.batch_execute("ROLLBACK").await.unwrap(),
        }
    }
}

/// Opens a connection and sends a claim of `payment.release` by executor
/// `lp` (waiting up to `wait_ms`) as raw HTTP/1.1; nothing is read back.
async fn raw_claim(srv: &Server, wait_ms: u64) -> tokio::net::TcpStream {
    let addr = srv.url.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = json!({"executor_id": "lp", "operations": ["payment.release"], "wait_ms": wait_ms})
        .to_string();
    let request = format!(
        "POST /v1/attempts/claim HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        srv.keys.exec,
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    conn
}

/// A claim whose client closed its connection while the claim query ran in
/// the store (the request was dropped, the store committed the lease): the
/// attempt is released at once: the store holds it `released`, no attempt
/// of the task is leased, and the task is claimed again without waiting for
/// the lease to run out.
async fn a_claim_whose_client_left_mid_query_releases_its_lease(backend: Backend) {
    let (srv, _db) = server(backend).await;
    let t = srv.new_task("gone-1", "payment.release", payment(20)).await;
    let id = s(&t["id"]);
    let blocker = Blocker::hold(&srv, backend).await;
    let conn = raw_claim(&srv, 0).await;
    blocker
        .wait_for_claim(&srv, conn.local_addr().unwrap())
        .await;
    drop(conn);
    srv.wait_log("connection ended with an error").await;
    blocker.let_go().await;
    let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
    loop {
        let attempts = stored_attempts(&srv, backend, &id).await;
        if attempts == [("released".to_owned(), 1)] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{backend:?}: the lease of the claim nobody heard is not released: {attempts:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again = srv.claim_op("payment.release", None).await;
    assert_eq!(again.len(), 1, "claimable at once");
    assert_eq!(
        (s(&again[0]["task_id"]), &again[0]["generation"]),
        (id.clone(), &json!(2))
    );
    assert_eq!(
        stored_attempts(&srv, backend, &id).await,
        [("released".to_owned(), 1), ("leased".to_owned(), 2)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_client_left_mid_query_releases_its_lease_sqlite() {
    a_claim_whose_client_left_mid_query_releases_its_lease(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_client_left_mid_query_releases_its_lease_postgres() {
    a_claim_whose_client_left_mid_query_releases_its_lease(Backend::Postgres).await;
}

/// A long-poll claim whose client closed its connection before any work
/// came leases nothing: the task submitted afterwards is claimed at once by
/// another claim, with generation 1.
async fn a_long_poll_whose_client_left_leases_nothing(backend: Backend) {
    let (srv, _db) = server(backend).await;
    let conn = raw_claim(&srv, 30_000).await;
    srv.wait_long_poll().await;
    drop(conn);
    srv.wait_log("connection ended with an error").await;
    let t = srv.new_task("gone-2", "payment.release", payment(21)).await;
    let id = s(&t["id"]);
    let got = srv.claim_op("payment.release", None).await;
    assert_eq!(got.len(), 1, "claimable at once");
    assert_eq!(
        (s(&got[0]["task_id"]), &got[0]["generation"]),
        (id.clone(), &json!(1))
    );
    assert_eq!(
        stored_attempts(&srv, backend, &id).await,
        [("leased".to_owned(), 1)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_whose_client_left_leases_nothing_sqlite() {
    a_long_poll_whose_client_left_leases_nothing(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_whose_client_left_leases_nothing_postgres() {
    a_long_poll_whose_client_left_leases_nothing(Backend::Postgres).await;
}

/// A claim whose answer was read releases nothing: its attempt stays
/// leased (a heartbeat and the store agree) and the server logged no release.
async fn a_claim_answered_releases_nothing(backend: Backend) {
    let (srv, _db) = server(backend).await;
    let t = srv.new_task("kept-1", "payment.release", payment(22)).await;
    let id = s(&t["id"]);
    let mut conn = raw_claim(&srv, 30_000).await;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&answer).contains("\"traceparent\"") {
        let n = tokio::time::timeout(POLL_TIMEOUT, conn.read(&mut buf))
            .await
            .expect("the claim answers")
            .unwrap();
        assert!(n > 0, "the connection ended before the answer");
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let a_id = text
        .split("\"id\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("an attempt id")
        .to_owned();
    srv.heartbeat(&a_id, json!({"generation": 1})).await.ok(200);
    drop(conn);
    // A second request through the server orders after anything the first
    // one's end set off.
    srv.new_task("kept-2", "payment.release", payment(23)).await;
    srv.heartbeat(&a_id, json!({"generation": 1})).await.ok(200);
    assert_eq!(
        stored_attempts(&srv, backend, &id).await,
        [("leased".to_owned(), 1)]
    );
    assert!(
        !srv.log().contains("released an attempt"),
        "{backend:?}: an answered claim released its attempt:\n{}",
        srv.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_releases_nothing_sqlite() {
    a_claim_answered_releases_nothing(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_releases_nothing_postgres() {
    a_claim_answered_releases_nothing(Backend::Postgres).await;
}
