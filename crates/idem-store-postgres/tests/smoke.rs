//! End-to-end smoke test of the PostgreSQL backend against a real server
//! (`IDEM_TEST_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use idem_core::config::Config;
use idem_core::machine::Report;
use idem_core::model::{AttemptState, Outcome, Role, TaskState};
use idem_store::Store;
use idem_store::conformance::task_with_a_reported_attempt;
use idem_store::ops::{ClaimRequest, Submission, SubmitOutcome};
use idem_store_postgres::testing::{TestDatabase, fresh_database};
use idem_store_postgres::{PgOptions, connect};
use serde_json::json;
use uuid::Uuid;

async fn store() -> Store {
    idem_store_postgres::testing::fresh_store(PgOptions::default()).await
}

/// A store on a fresh database (and its URL) with a test clock, an admin key
/// of tenant `acme`, and one task submitted with it per idempotency key in
/// `keys`, fingerprint `fp`.
async fn seeded<K: AsRef<str>>(
    keys: &[K],
    fp: char,
) -> (TestDatabase, Store, idem_core::model::ApiKey) {
    let url = fresh_database().await;
    let mut options = PgOptions::default();
    options.clock = idem_store::Clock::test();
    let store = connect(&url, options).await.unwrap();
    let (key, _) = store
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    for k in keys {
        store
            .submit(submission("acme", k.as_ref(), key.id, fp))
            .await
            .unwrap();
    }
    (url, store, key)
}

/// `n` idempotency keys `{prefix}0…`.
fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn submission(tenant: &str, key: &str, api_key_id: Uuid, fp: char) -> Submission {
    let contract = Config::bundled()
        .unwrap()
        .contract("generation.dispatch")
        .unwrap();
    Submission {
        tenant: tenant.into(),
        operation: "generation.dispatch".into(),
        idempotency_key: key.into(),
        fingerprint: format!("sha256:{}", fp.to_string().repeat(64)),
        canonical_request: format!("{{\"prompt\":\"{fp}\"}}"),
        params: json!({"prompt": fp.to_string()}),
        contract: idem_core::contract::FrozenContract::new(contract).unwrap(),
        api_key_id,
        grant: None,
        traceparent: None,
        rate_limits: Vec::new(),
        concurrency_key: None,
        priority: 3,
        fairness_key: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submit_replay_conflict_claim_report() {
    let store = store().await;
    assert_eq!(store.kind(), "postgres");
    store.ping().await.unwrap();

    let (key, plain) = store
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    assert_eq!(store.authenticate(&plain).await.unwrap(), Some(key.clone()));
    assert_eq!(store.list_api_keys().await.unwrap(), vec![key.clone()]);

    let SubmitOutcome::Created(task) = store
        .submit(submission("acme", "k1", key.id, 'a'))
        .await
        .unwrap()
    else {
        panic!("expected a new task");
    };
    assert_eq!(task.state, TaskState::Queued);
    let stored = store
        .get_task(Some("acme"), task.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.params, task.params);
    assert_eq!(stored.contract, task.contract);
    assert_eq!(stored.control.tenant, "acme");
    assert!(
        store
            .get_task(Some("other"), task.id)
            .await
            .unwrap()
            .is_err()
    );

    match store
        .submit(submission("acme", "k1", key.id, 'a'))
        .await
        .unwrap()
    {
        SubmitOutcome::Replayed(t) => assert_eq!(t.id, task.id),
        other => panic!("expected a replay, got {other:?}"),
    }
    match store
        .submit(submission("acme", "k1", key.id, 'b'))
        .await
        .unwrap()
    {
        SubmitOutcome::Conflict { task: original } => assert_eq!(original.id, task.id),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(
        store
            .find_task("acme", "generation.dispatch", "k1")
            .await
            .unwrap()
            .unwrap()
            .id,
        task.id
    );

    let claimed = store
        .claim(ClaimRequest {
            tenant: "acme".into(),
            operations: vec!["generation.dispatch".into()],
            executor_id: "ex-1".into(),
            max: 4,
            lease_ms: Some(10_000),
            flow: Default::default(),
        })
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let attempt = &claimed[0].attempt;
    assert_eq!(attempt.generation, 1);
    assert_eq!(claimed[0].task.state, TaskState::Running);

    let hb = store
        .heartbeat("acme", attempt.id, 1, Some(3))
        .await
        .unwrap()
        .unwrap();
    assert!(hb.lease_expires_at >= attempt.lease_expires_at);
    assert!(
        store
            .heartbeat("acme", attempt.id, 0, None)
            .await
            .unwrap()
            .is_err()
    );

    let body = json!({"generation": 1, "outcome": "succeeded", "result": {"ok": true}, "usage": 7});
    let report = Report {
        generation: 1,
        outcome: Outcome::Succeeded,
        result: Some(json!({"ok": true})),
        failure_class: None,
        message: None,
        usage: Some(7),
        external_txn_id: Some("ext-1".into()),
        body,
    };
    let done = store
        .report("acme", attempt.id, report.clone())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.state, TaskState::Succeeded);
    let delivery = done.delivery.clone().unwrap();
    assert_eq!(delivery.charge, done.contract.price);
    // An exact repeat answers the same task.
    let again = store
        .report("acme", attempt.id, report)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.delivery, done.delivery);

    let attempts = store
        .list_attempts(Some("acme"), task.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].state, AttemptState::Succeeded);
    assert!(
        attempts[0].evidence.len() >= 2,
        "{:?}",
        attempts[0].evidence
    );
    let events = store
        .list_events(Some("acme"), task.id)
        .await
        .unwrap()
        .unwrap();
    assert!(events.len() >= 3);
    assert!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1));

    let acked = store
        .acknowledge_delivery("acme", task.id)
        .await
        .unwrap()
        .unwrap();
    assert!(acked.delivery.unwrap().acknowledged_at.is_some());

    // Nothing left to claim; a sweep finds nothing to do.
    let none = store
        .claim(ClaimRequest {
            tenant: "acme".into(),
            operations: vec!["generation.dispatch".into()],
            executor_id: "ex-1".into(),
            max: 1,
            lease_ms: None,
            flow: Default::default(),
        })
        .await
        .unwrap();
    assert!(none.is_empty());
    store.sweep(100).await.unwrap();

    let revoked = store.revoke_api_key(key.id).await.unwrap().unwrap();
    assert!(revoked.revoked_at.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_identical_submits_yield_one_task() {
    let store = store().await;
    let (key, _) = store
        .create_api_key("acme", Role::Client, None)
        .await
        .unwrap();
    let mut handles = Vec::new();
    for _ in 0..32 {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            store.submit(submission("acme", "same", key.id, 'c')).await
        }));
    }
    let mut created = 0;
    let mut ids = std::collections::BTreeSet::new();
    for h in handles {
        match h.await.unwrap().unwrap() {
            SubmitOutcome::Created(t) => {
                created += 1;
                ids.insert(t.id);
            }
            SubmitOutcome::Replayed(t) => {
                ids.insert(t.id);
            }
            SubmitOutcome::Conflict { .. } => panic!("same fingerprint must not conflict"),
            SubmitOutcome::KeyRevoked { .. } => panic!("the key is live"),
            SubmitOutcome::RateLimited { .. } => panic!("no rate limit is set"),
        }
    }
    assert_eq!(created, 1);
    assert_eq!(ids.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_lease_each_task_once() {
    let store = store().await;
    let (key, _) = store
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    for i in 0..20 {
        store
            .submit(submission("acme", &format!("k{i}"), key.id, 'd'))
            .await
            .unwrap();
    }
    let mut handles = Vec::new();
    for n in 0..8 {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let c = store
                    .claim(ClaimRequest {
                        tenant: "acme".into(),
                        operations: vec!["generation.dispatch".into()],
                        executor_id: format!("ex-{n}"),
                        max: 2,
                        lease_ms: None,
                        flow: Default::default(),
                    })
                    .await
                    .unwrap();
                if c.is_empty() {
                    return got;
                }
                got.extend(c.into_iter().map(|c| c.task.id));
            }
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    let unique: std::collections::BTreeSet<_> = all.iter().collect();
    assert_eq!(all.len(), 20);
    assert_eq!(unique.len(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_run_once_and_are_idempotent() {
    let url = fresh_database().await;
    let mut handles = Vec::new();
    for _ in 0..4 {
        let url = url.clone();
        handles.push(tokio::spawn(async move {
            idem_store_postgres::migrate(&url).await
        }));
    }
    let mut applied = Vec::new();
    for h in handles {
        applied.extend(h.await.unwrap().unwrap());
    }
    assert_eq!(applied, versions_from(1), "each migration once, in order");
    assert!(idem_store_postgres::migrate(&url).await.unwrap().is_empty());
    connect(&url, PgOptions::default()).await.unwrap();
}

#[tokio::test]
async fn unreachable_database_is_unavailable() {
    let err = connect("postgres://postgres@127.0.0.1:1/none", PgOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, idem_store::StoreError::Unavailable(m)
            if m.starts_with("PostgreSQL at 127.0.0.1:1 (database none) is unavailable: error connecting to server")),
        "{err:?}"
    );
}

/// The test helper's message for a server it cannot use is PostgreSQL's own,
/// with the fix.
#[tokio::test]
async fn the_test_helper_says_what_postgres_said_and_the_fix() {
    use idem_store_postgres::testing::{server_url, unreachable_server_message, with_database};
    let url = with_database(&server_url(), "idem_no_such_test_db");
    let e = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .map(|_| ())
        .unwrap_err();
    let msg = unreachable_server_message(&url, &e);
    assert!(
        msg.contains("database \"idem_no_such_test_db\" does not exist"),
        "{msg}"
    );
    let at = idem_store_postgres::testing::server_address();
    let (host, port) = at.rsplit_once(':').unwrap();
    assert!(
        msg.contains(&format!(
            "create it: `createdb -h {host} -p {port} -U postgres idem_no_such_test_db`"
        )),
        "{msg}"
    );
    assert!(!msg.contains("db error"), "{msg}");
}

/// A scratch database is dropped with its guard; a `fresh_store` keeps its
/// own until its last clone is dropped.
#[tokio::test]
async fn scratch_databases_are_dropped_with_their_guard() {
    let server = raw(&fresh_url_server()).await;
    let exists = async |name: &str| -> bool {
        server
            .query_one(
                "SELECT count(*) FROM pg_database WHERE datname = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    };
    let db = fresh_database().await;
    let name = db.name().to_owned();
    let store = connect(&db, PgOptions::default()).await.unwrap();
    assert!(exists(&name).await);
    drop(db);
    assert!(!exists(&name).await, "{name} was not dropped");
    drop(store);
    // A `fresh_store` keeps its database while any clone lives.
    let store = idem_store_postgres::testing::fresh_store(PgOptions::default()).await;
    let copy = store.clone();
    drop(store);
    copy.ping().await.unwrap();
}

async fn raw(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

fn claim_req(max: i64, lease_ms: Option<i64>) -> ClaimRequest {
    ClaimRequest {
        tenant: "acme".into(),
        operations: vec!["generation.dispatch".into()],
        executor_id: "ex".into(),
        max,
        lease_ms,
        flow: Default::default(),
    }
}

/// Text PostgreSQL cannot hold (a NUL character) is refused for good
/// (`Rejected`, HTTP 400), not reported as a corrupt store, and writes nothing.
#[tokio::test]
async fn text_postgres_cannot_hold_is_rejected() {
    let (_db, store, key) = seeded::<&str>(&[], 'n').await;
    store
        .submit(submission("acme", "nul", key.id, 'n'))
        .await
        .unwrap();
    let mut req = claim_req(1, None);
    req.executor_id = "w\0x".into();
    match store.claim(req).await {
        Err(idem_store::StoreError::Rejected(msg)) => assert!(msg.contains("22021"), "{msg}"),
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(
        store.claim(claim_req(1, None)).await.unwrap().len(),
        1,
        "the refused claim leased nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_expire_and_keys_are_released_by_the_sweeper() {
    let (url, store, key) = seeded::<&str>(&[], 'e').await;
    let SubmitOutcome::Created(task) = store
        .submit(submission("acme", "k", key.id, 'e'))
        .await
        .unwrap()
    else {
        panic!()
    };
    let claimed = store.claim(claim_req(1, Some(10_000))).await.unwrap();
    assert_eq!(claimed.len(), 1);
    // The database clock plus the store's offset decides: 9 s on, the lease holds.
    store.clock().advance(std::time::Duration::from_secs(9));
    assert_eq!(store.sweep(10).await.unwrap().expired, 0);
    store
        .clock()
        .advance(std::time::Duration::from_millis(1_001));
    let stats = store.sweep(10).await.unwrap();
    assert_eq!(stats.expired, 1);
    let t = store.get_task(None, task.id).await.unwrap().unwrap();
    assert!(
        matches!(t.state, TaskState::RetryWait | TaskState::Queued),
        "{:?}",
        t.state
    );
    // A stale report after expiry is kept as evidence and changes nothing.
    let stale = Report {
        generation: 1,
        outcome: Outcome::Succeeded,
        result: Some(json!({})),
        failure_class: None,
        message: None,
        usage: None,
        external_txn_id: None,
        body: json!({"late": true}),
    };
    assert!(
        store
            .report("acme", claimed[0].attempt.id, stale)
            .await
            .unwrap()
            .is_err()
    );
    let attempts = store.list_attempts(None, task.id).await.unwrap().unwrap();
    assert!(
        attempts[0]
            .evidence
            .iter()
            .any(|e| e.body == json!({"late": true}))
    );

    // Cancel the task (confirmed at once: no lease), then pretend retention passed.
    let (t, c) = store.cancel("acme", task.id).await.unwrap().unwrap();
    assert_eq!(t.state, TaskState::Cancelled, "{c:?}");
    let db = raw(&url).await;
    db.execute(
        "UPDATE tasks SET key_expires_at = 1 WHERE id = $1",
        &[&task.id],
    )
    .await
    .unwrap();
    assert_eq!(store.sweep(10).await.unwrap().keys_released, 1);
    assert_eq!(
        store.sweep(10).await.unwrap().keys_released,
        0,
        "a released key is released once"
    );
    match store
        .submit(submission("acme", "k", key.id, 'f'))
        .await
        .unwrap()
    {
        SubmitOutcome::Created(t2) => assert_ne!(t2.id, task.id),
        other => panic!("the key should be free again: {other:?}"),
    }
}

/// The database holds "once per distinct id" itself (SPEC §2.12): a second
/// row of a task's suspected second effect or effect report with the same
/// `external_txn_id`, `null` counted as one id, violates the unique
/// constraint, whatever a binary does; another id of the same task does not.
#[tokio::test]
async fn second_effects_and_effect_reports_are_unique_per_task_and_id() {
    let (url, _store, _) = seeded(&["se"], 's').await;
    let db = raw(&url).await;
    let task: Uuid = db
        .query_one("SELECT id FROM tasks", &[])
        .await
        .unwrap()
        .get(0);
    for (table, at) in [
        ("second_effects", "suspected_at"),
        ("effect_reports", "reported_at"),
    ] {
        let sql = format!(
            "INSERT INTO {table} (task_id, external_txn_id, generation, evidence, {at}) \
             VALUES ($1, $2, 1, 'stale_report', 0)"
        );
        let none: Option<&str> = None;
        db.execute(&sql, &[&task, &none]).await.unwrap();
        db.execute(&sql, &[&task, &Some("psp-1")]).await.unwrap();
        for txn in [None, Some("psp-1")] {
            let err = db.execute(&sql, &[&task, &txn]).await.unwrap_err();
            assert_eq!(
                err.code(),
                Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION),
                "{table} {txn:?}: {err:?}"
            );
        }
        db.execute(&sql, &[&task, &Some("null")]).await.unwrap();
    }
}

#[tokio::test]
async fn schema_guards_and_session_settings() {
    let (url, _store, _) = seeded(&["k"], 'g').await;
    let db = raw(&url).await;
    let err = db
        .execute("UPDATE events SET type = 'x'", &[])
        .await
        .unwrap_err();
    assert!(
        err.as_db_error().unwrap().message().contains("append-only"),
        "{err:?}"
    );
    assert!(db.execute("DELETE FROM events", &[]).await.is_err());
    let err =
        idem_store_postgres::map_pg_error(db.execute("DELETE FROM events", &[]).await.unwrap_err());
    assert!(matches!(err, idem_store::StoreError::Corrupt(_)), "{err:?}");
    // A task's api_key_id always names a key: key rows are revoked, never removed.
    for sql in [
        "DELETE FROM api_keys",
        "TRUNCATE api_keys CASCADE",
        "UPDATE api_keys SET id = gen_random_uuid()",
    ] {
        let err = db.execute(sql, &[]).await.unwrap_err();
        assert!(
            err.as_db_error()
                .unwrap()
                .message()
                .contains("never deleted"),
            "{sql}: {err:?}"
        );
    }
    assert!(
        db.execute("UPDATE api_keys SET revoked_at = 1", &[])
            .await
            .is_ok(),
        "revocation stays possible"
    );

    // Pool sessions carry idem's settings.
    let backend = idem_store_postgres::PgBackend::connect(&url, PgOptions::default())
        .await
        .unwrap();
    let client = backend.pool().get().await.unwrap();
    let row = client
        .query_one(
            "SELECT current_setting('synchronous_commit'), current_setting('statement_timeout'), \
             current_setting('idle_in_transaction_session_timeout'), current_setting('plan_cache_mode')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "on");
    assert_eq!(row.get::<_, String>(1), "10s");
    assert_eq!(row.get::<_, String>(2), "10s");
    assert_eq!(row.get::<_, String>(3), "force_generic_plan");
    let applied: i64 = client
        .query_one("SELECT count(*) FROM schema_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied, idem_store_postgres::MIGRATIONS.len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovers_after_connections_are_killed() {
    let (url, store, key) = seeded(&keys("k", 4), 'h').await;
    let db = raw(&fresh_url_server()).await;
    let dbname = url.rsplit('/').next().unwrap().to_owned();
    let killed: i64 = db
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&dbname],
        )
        .await
        .unwrap()
        .get(0);
    assert!(killed >= 1);
    // Every later operation succeeds: dead pooled connections are discarded.
    for i in 0..8 {
        let r = store
            .submit(submission("acme", &format!("k{i}"), key.id, 'h'))
            .await;
        assert!(r.is_ok(), "{r:?}");
    }
    store.ping().await.unwrap();
}

fn fresh_url_server() -> String {
    idem_store_postgres::testing::server_url()
}

/// Group commit must isolate faults: a submission the database refuses (here a
/// scope over the primary-key index row limit) fails alone; the submissions
/// batched with it still get their tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_submission_does_not_fail_its_batch() {
    let store = store().await;
    // Random hex does not compress below the 2704-byte index row limit.
    let huge_tenant: String = (0..250)
        .map(|_| Uuid::new_v4().simple().to_string())
        .collect();
    let (good, _) = store
        .create_api_key("acme", Role::Client, None)
        .await
        .unwrap();
    let (bad, _) = store
        .create_api_key(&huge_tenant, Role::Client, None)
        .await
        .unwrap();
    for round in 0..5 {
        let mut handles = Vec::new();
        for i in 0..24 {
            let s = store.clone();
            let sub = if i % 8 == 0 {
                submission(&huge_tenant, &format!("bad-{round}-{i}"), bad.id, 'b')
            } else {
                submission("acme", &format!("good-{round}-{i}"), good.id, 'g')
            };
            handles.push(tokio::spawn(
                async move { (i % 8 == 0, s.submit(sub).await) },
            ));
        }
        for h in handles {
            let (is_bad, res) = h.await.unwrap();
            if is_bad {
                assert!(res.is_err(), "round {round}: the oversized scope must fail");
            } else {
                assert!(
                    matches!(res, Ok(SubmitOutcome::Created(_))),
                    "round {round}: a good submission failed with its batch: {res:?}"
                );
            }
        }
    }
}

/// A TCP proxy in front of PostgreSQL that, when armed, swallows the server's
/// next `COMMIT` completion and closes that connection: the transaction
/// committed, the client never hears it (the outcome is unknown to idem).
mod lost_commit {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// `CommandComplete` with tag `COMMIT` (PostgreSQL protocol 3).
    const COMMIT_DONE: &[u8] = b"C\x00\x00\x00\x0bCOMMIT\x00";

    pub struct Proxy {
        pub port: u16,
        pub armed: Arc<AtomicBool>,
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        armed: Option<Arc<AtomicBool>>,
    ) {
        let mut buf = vec![0u8; 65536];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Some(armed) = &armed
                && buf[..n]
                    .windows(COMMIT_DONE.len())
                    .any(|w| w == COMMIT_DONE)
                && armed.swap(false, Ordering::SeqCst)
            {
                return;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let a = armed.clone();
        tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let a = a.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (ir, iw) = inbound.into_split();
                    let (or, ow) = outbound.into_split();
                    let up = tokio::spawn(pump(ir, ow, None));
                    pump(or, iw, Some(a)).await;
                    up.abort();
                });
            }
        });
        Proxy { port, armed }
    }
}

/// A batch whose COMMIT answer is lost must not tell the callers whose tasks it
/// created that they were replays: every caller gets `Created` or an error
/// (503, retry with the same key), never `Replayed` for a key nobody else sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lost_commit_answer_never_reports_a_new_key_as_replayed() {
    let url = fresh_database().await;
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) if h != "localhost" => h.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let proxy = lost_commit::start(format!("{host}:{port}").parse().unwrap()).await;
    let db = cfg.get_dbname().unwrap_or("test").to_owned();
    // Plain TCP: the proxy reads the protocol to find COMMIT answers.
    let via = format!(
        "postgres://postgres@127.0.0.1:{}/{db}?sslmode=disable",
        proxy.port
    );
    let store = connect(&via, PgOptions::default()).await.unwrap();
    let (key, _) = store
        .create_api_key("acme", Role::Client, None)
        .await
        .unwrap();
    let (mut errors, mut created) = (0, 0);
    for round in 0..10 {
        proxy.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut handles = Vec::new();
        for i in 0..40 {
            let st = store.clone();
            let s = submission("acme", &format!("lc-{round}-{i}"), key.id, 'a');
            handles.push(tokio::spawn(async move { st.submit(s).await }));
        }
        for h in handles {
            match h.await.unwrap() {
                Ok(SubmitOutcome::Created(_)) => created += 1,
                Ok(other) => panic!("round {round}: a new key answered {other:?}"),
                Err(_) => errors += 1,
            }
        }
    }
    assert!(errors > 0, "the proxy never swallowed a COMMIT answer");
    assert!(created > 0);
}

/// A malformed URL is a configuration error on every entry point: trying again
/// cannot help, so start-up must not wait for it.
#[tokio::test]
async fn malformed_url_is_a_configuration_error() {
    let bad = "postgres://postgres@127.0.0.1:notaport/test";
    assert!(matches!(
        idem_store_postgres::migrate(bad).await,
        Err(idem_store::StoreError::Config(_))
    ));
    assert!(matches!(
        connect(bad, PgOptions::default()).await,
        Err(idem_store::StoreError::Config(_))
    ));
}

/// A batch whose read-back fails (here a replayed task this binary cannot
/// decode, e.g. written by a newer one) commits nothing: the pipelined batch
/// commits only once every answer is decoded. Otherwise the lane, taking the
/// failure for "nothing written", would submit each again and answer the tasks
/// the batch had just created as replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_fails_after_its_inserts_commits_nothing() {
    let (url, store, key) = seeded(&["undecodable"], 'a').await;
    let db = raw(&url).await;
    db.batch_execute(
        "ALTER TABLE tasks DROP CONSTRAINT tasks_state_check; \
         UPDATE tasks SET state = 'paused' WHERE idempotency_key = 'undecodable'",
    )
    .await
    .unwrap();
    let out = store
        .submit_batch(vec![
            submission("acme", "direct", key.id, 'a'),
            submission("acme", "undecodable", key.id, 'a'),
        ])
        .await;
    assert!(out.is_err(), "{out:?}");
    let written: i64 = db
        .query_one(
            "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = 'direct'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, 0, "a failed batch writes nothing");
    // Through the submit lanes: the new keys batched with it are all created.
    for round in 0..5 {
        let mut handles = Vec::new();
        for i in 0..16 {
            let s = store.clone();
            let key_name = if i == 0 {
                "undecodable".to_owned()
            } else {
                format!("new-{round}-{i}")
            };
            let sub = submission("acme", &key_name, key.id, 'a');
            handles.push(tokio::spawn(async move { (i, s.submit(sub).await) }));
        }
        for h in handles {
            let (i, res) = h.await.unwrap();
            if i == 0 {
                assert!(res.is_err(), "the undecodable task cannot be answered");
            } else {
                assert!(
                    matches!(res, Ok(SubmitOutcome::Created(_))),
                    "round {round}: new-{i} answered {res:?}"
                );
            }
        }
    }
}

/// A claim walks `tasks_claim_rank` once per class and stops at its limit: no
/// sort of the tenant's backlog, whatever the backlog (migration 3). Checked on
/// the generic plan idem's sessions use, with a backlog of 2,000 tasks in two
/// classes, plus the answer: the oldest across both classes, a class listed
/// twice counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_walk_the_claim_index_instead_of_sorting_the_backlog() {
    let (url, store, _) = seeded(&keys("seed-", 20), 'c').await;
    let db = raw(&url).await;
    // A backlog in two classes, written straight from the seeded rows.
    db.batch_execute(
        "INSERT INTO tasks SELECT (md5(t.id::text || g)::uuid), t.tenant, \
           CASE WHEN g % 2 = 0 THEN 'payment.release' ELSE t.operation END, \
           t.idempotency_key || '-' || g, t.fingerprint, t.canonical_request, t.params, t.state, \
           t.generation, t.version, t.event_seq, t.attempt_count, t.execute_count, t.usage, \
           t.cancellation, t.delivery, t.failure, t.api_key_id, t.next_kind, \
           t.active_attempt_id, t.ready_at + g, t.deadline_at, t.terminal_at, t.key_expires_at, \
           t.created_at, t.updated_at, t.contract_id \
         FROM tasks t, generate_series(1, 100) g; ANALYZE tasks",
    )
    .await
    .unwrap();
    let backlog: i64 = db
        .query_one("SELECT count(*) FROM tasks", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(backlog, 2_020);
    // The plan idem's sessions use (generic), executed: each class's walk of
    // the claim index reads at most limit + 64 rows (not its 1,010-task
    // backlog), and only the rows returned are locked.
    let plan: Vec<String> = db
        .simple_query(&format!(
            "SET plan_cache_mode = force_generic_plan; \
             PREPARE claimable(text, text[], bigint, bigint) AS {}; \
             BEGIN; \
             EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) \
               EXECUTE claimable('acme', '{{generation.dispatch,payment.release}}', 9000000000000, 4); \
             SELECT 'locked ' || count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
               WHERE l.pid = pg_backend_pid() AND c.relname = 'tasks' AND l.mode = 'RowShareLock'; \
             SELECT 'row locks ' || count(*) FROM tasks t \
               WHERE t.xmax = txid_current()::text::xid; \
             ROLLBACK",
            idem_store_postgres::testing::CLAIMABLE_SQL
        ))
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect();
    let plan = plan.join("\n");
    let walks: Vec<u64> = plan
        .lines()
        .skip_while(|l| !l.contains("Index Scan using tasks_claim_rank"))
        .take(1)
        .filter_map(|l| {
            l.split("rows=")
                .nth(1)?
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(walks.len(), 1, "the claim walks tasks_claim_rank: {plan}");
    assert!(walks[0] <= 4 + 64, "a walk read {} rows: {plan}", walks[0]);
    assert!(
        plan.contains("row locks 4"),
        "a claim locks only the rows it returns: {plan}"
    );
    // The answer: the oldest ready tasks across both classes.
    let expected: Vec<Uuid> = db
        .query(
            "SELECT id FROM tasks WHERE tenant = 'acme' ORDER BY ready_at, id LIMIT 4",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let got = store
        .claim(ClaimRequest {
            tenant: "acme".into(),
            operations: vec![
                "payment.release".into(),
                "generation.dispatch".into(),
                "payment.release".into(),
            ],
            executor_id: "ex".into(),
            max: 4,
            lease_ms: None,
            flow: Default::default(),
        })
        .await
        .unwrap();
    let mut got: Vec<Uuid> = got.into_iter().map(|c| c.task.id).collect();
    let mut want = expected.clone();
    got.sort();
    want.sort();
    assert_eq!(got, want, "the oldest four across both classes, each once");
}

/// Brings the database at `url` to schema version 2 (migrations 1 and 2, as
/// the previous binary left it); returns a plain connection to it.
async fn schema_at_version_two(url: &str) -> tokio_postgres::Client {
    let db = raw(url).await;
    for m in &idem_store_postgres::MIGRATIONS[..2] {
        db.batch_execute(m.sql).await.unwrap();
    }
    db.batch_execute(
        "CREATE TABLE schema_migrations (version integer PRIMARY KEY, \
           applied_at timestamptz NOT NULL DEFAULT clock_timestamp()); \
         INSERT INTO schema_migrations (version) VALUES (1), (2)",
    )
    .await
    .unwrap();
    db
}

/// A database at schema 3 (each task's contract text in its row) migrates to
/// one `contracts` row per distinct contract, and every task reads back the
/// same; the store then writes and replays as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_three_tasks_keep_their_contracts_through_migration_four() {
    let (url, store, key) = seeded(&keys("k", 3), 'm').await;
    let mut other = submission("acme", "priced", key.id, 'm');
    let mut contract = (*other.contract).clone();
    contract.price += 1;
    other.contract = idem_core::contract::FrozenContract::new(contract).unwrap();
    store.submit(other).await.unwrap();
    let claimed = store.claim(claim_req(1, None)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let db = raw(&url).await;
    let ids: Vec<Uuid> = db
        .query("SELECT id FROM tasks ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids.len(), 4);
    let mut before = Vec::new();
    for id in &ids {
        before
            .push(serde_json::to_value(store.get_task(None, *id).await.unwrap().unwrap()).unwrap());
    }
    drop(store);
    // The tables as schema 3 kept them.
    db.batch_execute(
        "ALTER TABLE tasks ADD COLUMN contract text; \
         UPDATE tasks t SET contract = c.contract FROM contracts c WHERE c.id = t.contract_id; \
         ALTER TABLE tasks ALTER COLUMN contract SET NOT NULL, DROP COLUMN contract_id; \
         DROP TABLE contracts; \
         DELETE FROM schema_migrations WHERE version = 4",
    )
    .await
    .unwrap();
    assert_eq!(idem_store_postgres::migrate(&url).await.unwrap(), vec![4]);
    let rows: i64 = db
        .query_one("SELECT count(*) FROM contracts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 2, "one row per distinct contract");
    let store = connect(&url, PgOptions::default()).await.unwrap();
    for (id, was) in ids.iter().zip(&before) {
        let now = store.get_task(None, *id).await.unwrap().unwrap();
        assert_eq!(&serde_json::to_value(&now).unwrap(), was);
    }
    assert!(matches!(
        store
            .submit(submission("acme", "k0", key.id, 'm'))
            .await
            .unwrap(),
        SubmitOutcome::Replayed(_)
    ));
    assert!(matches!(
        store
            .submit(submission("acme", "new", key.id, 'm'))
            .await
            .unwrap(),
        SubmitOutcome::Created(_)
    ));
}

/// Migration 3 takes its table lock first, so an instance still running the
/// previous binary, holding claim row locks and then writing the task, waits
/// for nothing that waits for it: no deadlock, and the migration applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_three_does_not_deadlock_with_an_old_claim() {
    let url = fresh_database().await;
    // The schema as the previous binary left it. Row locks and writes take
    // their table locks whether or not rows match.
    schema_at_version_two(&url).await;
    let old = raw(&url).await;
    old.batch_execute("BEGIN").await.unwrap();
    old.batch_execute("SELECT id FROM tasks FOR UPDATE SKIP LOCKED")
        .await
        .unwrap();
    let u = url.clone();
    let migration = tokio::spawn(async move { idem_store_postgres::migrate(&u).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // The old instance writes on: it must not be chosen as a deadlock victim.
    old.batch_execute("UPDATE tasks SET version = version + 1")
        .await
        .unwrap();
    old.batch_execute("COMMIT").await.unwrap();
    assert_eq!(migration.await.unwrap().unwrap(), versions_from(3));
}

/// A migration that cannot get its table lock within
/// `MIGRATION_LOCK_TIMEOUT_MS` (a long transaction of an old instance holds
/// the table) gives up with a retryable error and applies nothing, instead of
/// making every later query on the table queue behind its lock request; once
/// that transaction ends, the migration applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_gives_up_on_a_held_table_lock_and_applies_later() {
    let url = fresh_database().await;
    let db = schema_at_version_two(&url).await;
    // A transaction that has read `tasks` and stays open (ACCESS SHARE, which
    // migration 3's ACCESS EXCLUSIVE waits for).
    let old = raw(&url).await;
    old.batch_execute("BEGIN; SELECT count(*) FROM tasks")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        idem_store_postgres::migrate(&url),
    )
    .await
    .expect("the migration gives up instead of waiting for the lock");
    let waited = started.elapsed();
    match &refused {
        Err(idem_store::StoreError::Unavailable(msg)) => {
            assert!(msg.contains("migration 3") && msg.contains("lock"), "{msg}")
        }
        other => panic!("expected a retryable lock timeout, got {other:?}"),
    }
    assert!(
        waited
            >= std::time::Duration::from_millis(u64::from(
                idem_store_postgres::MIGRATION_LOCK_TIMEOUT_MS
            )),
        "gave up after {waited:?}, before its lock timeout"
    );
    let versions: Vec<i32> = db
        .query(
            "SELECT version FROM schema_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, vec![1, 2], "nothing applied");
    let index: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE indexname = 'tasks_claim_order'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(index, 0, "migration 3 rolled back");
    old.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        idem_store_postgres::migrate(&url).await.unwrap(),
        versions_from(3)
    );
}

/// The advisory lock that serializes migrations (ASCII `idem_mig`).
const MIGRATION_LOCK: i64 = 0x6964_656d_5f6d_6967;

/// A store's session `statement_timeout` does not apply to its migrations:
/// start-up migrates on a pooled connection, and a migration may build an
/// index for longer than any request may take.
#[tokio::test]
async fn migrations_are_not_cut_by_the_sessions_statement_timeout() {
    let url = fresh_database().await;
    let mut opts = PgOptions::default();
    opts.statement_timeout = std::time::Duration::from_millis(1);
    connect(&url, opts)
        .await
        .expect("migrated despite a 1 ms statement_timeout");
    let db = raw(&url).await;
    let n: i64 = db
        .query_one("SELECT count(*) FROM schema_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, idem_store_postgres::MIGRATIONS.len() as i64);
}

/// Start-up waits for another instance that is migrating (it holds the
/// migration lock) for `MIGRATION_WAIT`, then answers `Unavailable` naming
/// that cause (so `idem serve` retries and, past IDEM_STORE_WAIT_MS, says
/// why); once the lock is free, it migrates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_waits_for_another_instances_migration_and_says_so() {
    let url = fresh_database().await;
    let other = raw(&url).await;
    other
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        connect(&url, PgOptions::default()),
    )
    .await
    .expect("start-up does not hang on the migration lock")
    .map(|_| ())
    .expect_err("the lock is held");
    assert!(
        matches!(&err, idem_store::StoreError::Unavailable(m) if m.contains("applying migrations")),
        "{err:?}"
    );
    assert!(started.elapsed() >= idem_store_postgres::MIGRATION_WAIT);
    // The other instance finishes within the wait: this one waits it out.
    let release = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        other
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await
            .unwrap();
        other
    });
    connect(&url, PgOptions::default())
        .await
        .expect("migrated once the lock was free");
    drop(release.await.unwrap());
}

/// A link to PostgreSQL that goes silent mid-operation (no error, no reset:
/// the server's `statement_timeout` cannot reach idem) ends in `Unavailable`
/// within `operation_timeout`, for reads, submits and pings alike, instead of
/// hanging until the operating system gives up on TCP; once the link is back,
/// the store works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_link_ends_in_unavailable_within_the_operation_timeout() {
    use std::sync::atomic::Ordering;
    let url = fresh_database().await;
    let proxy = SilencingProxy::start().await;
    let paused = std::sync::Arc::clone(&proxy.paused);
    let via = proxy.via(&url);
    let mut opts = PgOptions::default();
    opts.operation_timeout = std::time::Duration::from_secs(2);
    opts.pool_timeout = std::time::Duration::from_secs(1);
    let store = connect(&via, opts).await.unwrap();
    let (key, _) = store
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    let sub = |k: &str| submission("acme", k, key.id, 'a');
    let first = store.submit(sub("k1")).await.unwrap();
    let SubmitOutcome::Created(task) = first else {
        panic!("{first:?}")
    };
    // A read and a submit are in flight (waiting for a table lock) when the
    // link goes silent; the lock is then released, but the answers never
    // arrive.
    let locker = raw(&url).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE tasks, idempotency_keys IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let bound = std::time::Duration::from_secs(15);
    let started = std::time::Instant::now();
    let (s1, s2) = (store.clone(), store.clone());
    let id = task.id;
    let read = tokio::spawn(async move { s1.get_task(None, id).await });
    let sub2 = sub("k2");
    let write = tokio::spawn(async move { s2.submit(sub2).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    paused.store(true, Ordering::SeqCst);
    locker.batch_execute("COMMIT").await.unwrap();
    let read = tokio::time::timeout(bound, read)
        .await
        .expect("an in-flight read does not hang on a silent link")
        .unwrap();
    assert!(
        matches!(read, Err(idem_store::StoreError::Unavailable(_))),
        "{read:?}"
    );
    let write = tokio::time::timeout(bound, write)
        .await
        .expect("an in-flight submit does not hang on a silent link")
        .unwrap();
    assert!(
        matches!(write, Err(idem_store::StoreError::Unavailable(_))),
        "{write:?}"
    );
    let ping = tokio::time::timeout(bound, store.ping())
        .await
        .expect("a ping does not hang on a silent link");
    assert!(ping.is_err());
    assert!(started.elapsed() < bound, "{:?}", started.elapsed());
    paused.store(false, Ordering::SeqCst);
    // The link is back: new connections replace the dropped ones.
    let mut recovered = false;
    for _ in 0..50 {
        if store.get_task(None, task.id).await.is_ok() {
            recovered = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(recovered, "the store works again once the link is back");
    assert!(store.submit(sub("k3")).await.is_ok());
}

/// With `migrate: false` (the inspection commands) connecting changes no
/// schema: a database without idem's schema is refused and left empty; once
/// migrated, it opens.
#[tokio::test]
async fn connecting_without_migrating_refuses_a_foreign_database_and_changes_nothing() {
    let url = fresh_database().await;
    let mut opts = PgOptions::default();
    opts.migrate = false;
    let err = connect(&url, opts.clone())
        .await
        .map(|_| ())
        .expect_err("no idem schema");
    assert!(
        matches!(&err, idem_store::StoreError::Migration(m) if m.contains("not an idem database")),
        "{err:?}"
    );
    let db = raw(&url).await;
    let tables: i64 = db
        .query_one(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "nothing was created");
    idem_store_postgres::migrate(&url).await.unwrap();
    let store = connect(&url, opts).await.expect("a current schema opens");
    assert!(store.list_api_keys().await.unwrap().is_empty());
}

/// A role that may not create in the database's schema (PostgreSQL 15+ no
/// longer grants CREATE on `public` to every role) gets a migration error that
/// says what to change, and nothing is created.
#[tokio::test]
async fn a_role_without_create_is_told_what_to_grant() {
    let url = fresh_database().await;
    let admin = raw(&url).await;
    let role = format!("idem_r_{}", &Uuid::new_v4().simple().to_string()[..12]);
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; REVOKE CREATE ON SCHEMA public FROM PUBLIC"
        ))
        .await
        .unwrap();
    // The same server and database, as the new role.
    let (scheme, rest) = url.split_once("://").unwrap();
    let host_and_db = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let err = idem_store_postgres::migrate(&format!("{scheme}://{role}@{host_and_db}"))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("42501"), "{text}");
    assert!(text.contains("CREATE on its schema"), "{text}");
    assert!(text.contains("own the database"), "{text}");
    let tables: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0);
    // One statement each: DROP DATABASE cannot run in a transaction block.
    let server = raw(&fresh_url_server()).await;
    let db = url.rsplit('/').next().unwrap();
    for sql in [
        format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
        format!("DROP ROLE IF EXISTS {role}"),
    ] {
        server.batch_execute(&sql).await.unwrap();
    }
}

/// The name of the database `url` names.
fn database_name(url: &str) -> String {
    url.rsplit('/').next().unwrap().to_owned()
}

/// Turns the database of `url` read-only for new sessions and cuts the
/// sessions it has, so that the store's next connections are read-only.
async fn make_read_only(url: &str) {
    let admin = raw(&fresh_url_server()).await;
    let dbname = database_name(url);
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{dbname}\" SET default_transaction_read_only = on"
        ))
        .await
        .unwrap();
    admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&dbname],
        )
        .await
        .unwrap();
}

/// A retry of a scope this store has seen bound is answered by one read, with
/// nothing written: with the database turned read-only under the running store
/// (new sessions only, so its connections are cut to pick it up), its retries
/// still replay and conflict, while a new key cannot be written. Through the
/// write path every one of them would fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_answered_without_writing() {
    let (url, store, key) = seeded(&keys("r", 2), 'a').await;
    make_read_only(&url).await;
    // The first use of a cut connection may fail; the next one opens a new,
    // read-only session.
    let mut replay = store.submit(submission("acme", "r0", key.id, 'a')).await;
    for _ in 0..5 {
        if replay.is_ok() {
            break;
        }
        replay = store.submit(submission("acme", "r0", key.id, 'a')).await;
    }
    assert!(
        matches!(replay, Ok(SubmitOutcome::Replayed(_))),
        "a retry is answered from what is committed: {replay:?}"
    );
    let conflict = store.submit(submission("acme", "r1", key.id, 'b')).await;
    assert!(
        matches!(conflict, Ok(SubmitOutcome::Conflict { .. })),
        "a changed retry is a conflict, read without writing: {conflict:?}"
    );
    let new = store.submit(submission("acme", "r2", key.id, 'a')).await;
    assert!(
        new.is_err(),
        "a new key must be written, which a read-only database refuses: {new:?}"
    );
    raw(&fresh_url_server())
        .await
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" RESET default_transaction_read_only",
            database_name(&url)
        ))
        .await
        .unwrap();
}

/// Retries read together are isolated as writes are: a scope whose task row no
/// longer decodes fails its own retries, never the healthy replays that share
/// its read, and those are still answered without a write: the database is
/// read-only here, so a healthy retry sent on to the write path would fail too
/// (neither the read's error answering the whole batch, nor the whole batch
/// sent on to the write path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_unreadable_task_fails_only_its_own_retries() {
    let n = 32;
    let (url, store, key) = seeded(&keys("k", n), 'a').await;
    raw(&url)
        .await
        .batch_execute(
            "INSERT INTO contracts (id, contract) VALUES (sha256('broken'), '{\"broken\":'); \
             UPDATE tasks SET contract_id = sha256('broken') WHERE idempotency_key = 'k0'",
        )
        .await
        .unwrap();
    make_read_only(&url).await;
    // The first use of a cut connection may fail; the next one is read-only.
    for _ in 0..5 {
        if store
            .submit(submission("acme", "k1", key.id, 'a'))
            .await
            .is_ok()
        {
            break;
        }
    }
    for _ in 0..10 {
        let mut replays = Vec::new();
        for i in 0..n {
            let s = store.clone();
            let id = key.id;
            replays.push(tokio::spawn(async move {
                (
                    i,
                    s.submit(submission("acme", &format!("k{i}"), id, 'a'))
                        .await,
                )
            }));
        }
        for h in replays {
            let (i, res) = h.await.unwrap();
            if i == 0 {
                assert!(res.is_err(), "the unreadable task fails: {res:?}");
            } else {
                assert!(
                    matches!(res, Ok(SubmitOutcome::Replayed(_))),
                    "k{i} replays whatever shares its read: {res:?}"
                );
            }
        }
    }
}

/// A word no version of idem writes, read back from an attempt's report, an
/// evidence row or an event row, is a `Corrupt` store error (not a panic, not
/// a default); the words idem writes read back as the enums they came from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_words_in_stored_rows_are_corrupt() {
    let url = fresh_database().await;
    let store = connect(&url, PgOptions::default()).await.unwrap();
    let (task, attempt) = task_with_a_reported_attempt(&store).await;

    let db = raw(&url).await;
    let corrupt = |e: idem_store::StoreError| matches!(e, idem_store::StoreError::Corrupt(_));
    for report in [r#"{"generation": 1}"#, r#"{"outcome": "nope"}"#] {
        db.execute(
            "UPDATE attempts SET report = $2 WHERE id = $1",
            &[&attempt, &report],
        )
        .await
        .unwrap();
        let err = store.list_attempts(None, task).await.unwrap_err();
        assert!(corrupt(err), "report {report}");
    }
    db.execute(
        "UPDATE attempts SET report = '{\"outcome\": \"unknown\"}' WHERE id = $1",
        &[&attempt],
    )
    .await
    .unwrap();
    db.execute(
        "INSERT INTO evidence (task_id, attempt_id, received_at, generation, outcome, body, disposition) \
         VALUES ($1, $2, 0, 1, 'unknown', '{}', 'nope')",
        &[&task, &attempt],
    )
    .await
    .unwrap();
    assert!(corrupt(store.list_attempts(None, task).await.unwrap_err()));
    db.execute(
        "INSERT INTO events (task_id, seq, type, at, data, tenant, operation) \
         VALUES ($1, 1000, 'nope', 0, '{}', 'acme', 'payment.release')",
        &[&task],
    )
    .await
    .unwrap();
    assert!(corrupt(store.list_events(None, task).await.unwrap_err()));
}

/// This binary's migration versions from `first` on, in order.
fn versions_from(first: i32) -> Vec<i32> {
    idem_store_postgres::MIGRATIONS
        .iter()
        .map(|m| m.version)
        .filter(|v| *v >= first)
        .collect()
}

/// Expand/contract (docs/operations.md, "Upgrading"): each migration's
/// `compatible_from` is recorded next to its version; a binary serves a newer
/// schema declared compatible with its own (at start-up, migrating or not,
/// without touching it), refuses one declared incompatible naming both
/// versions, and a running store's readiness turns to that refusal within
/// `SCHEMA_RECHECK` of the schema changing under it.
#[tokio::test]
async fn a_newer_schema_is_served_only_while_declared_compatible() {
    let url = fresh_database().await;
    let mut options = PgOptions::default();
    options.clock = idem_store::Clock::test();
    let running = connect(&url, options.clone()).await.unwrap();
    let db = raw(&url).await;
    let recorded: Vec<(i32, Option<i32>)> = db
        .query(
            "SELECT version, compatible_from FROM schema_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // An expand step records what the schema it declares compatible is
    // served by, so expand steps in a row keep the last contract step's.
    let migrations = idem_store_postgres::MIGRATIONS;
    let declared: Vec<(i32, Option<i32>)> = migrations
        .iter()
        .map(|m| {
            let from = idem_store::schema::recorded_compatible_from(migrations, m.version);
            (m.version, Some(from))
        })
        .collect();
    assert_eq!(recorded, declared);
    let known = declared.last().unwrap().0;
    let future = known + 1;

    // A later release's expand step: this binary serves it as it is.
    db.execute(
        "INSERT INTO schema_migrations (version, compatible_from) VALUES ($1, $2)",
        &[&future, &known],
    )
    .await
    .unwrap();
    for migrate in [true, false] {
        let mut o = options.clone();
        o.migrate = migrate;
        connect(&url, o).await.unwrap().ping().await.unwrap();
    }
    let rows: i64 = db
        .query_one("SELECT count(*) FROM schema_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, i64::from(future), "nothing applied or removed");
    running.ping().await.unwrap();

    // Its contract step: refused at start-up, and by the running store's
    // readiness once it reads the schema again.
    db.execute(
        "UPDATE schema_migrations SET compatible_from = version WHERE version = $1",
        &[&future],
    )
    .await
    .unwrap();
    let both = |e: &str| {
        assert!(
            e.contains(&format!("version {future}"))
                && e.contains(&format!("this binary's {known}")),
            "{e}"
        );
    };
    for migrate in [true, false] {
        let mut o = options.clone();
        o.migrate = migrate;
        let e = connect(&url, o).await.err().unwrap();
        assert!(matches!(e, idem_store::StoreError::Migration(_)), "{e}");
        both(&e.to_string());
    }
    running.ping().await.unwrap();
    running.clock().advance(idem_store::schema::SCHEMA_RECHECK);
    let e = running.ping().await.unwrap_err();
    assert!(matches!(e, idem_store::StoreError::Migration(_)), "{e}");
    both(&e.to_string());

    // A database migrated only by binaries older than the rule (no
    // `compatible_from` column): its newest version counts as a contract
    // step, and the next migration adds the column.
    let url = fresh_database().await;
    let db = schema_at_version_two(&url).await;
    connect(&url, PgOptions::default()).await.unwrap();
    let old: Vec<Option<i32>> = db
        .query(
            "SELECT compatible_from FROM schema_migrations WHERE version <= 2 ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        old,
        vec![None, None],
        "rows of older binaries stay as written"
    );
}

/// A TCP proxy to the test server that can go silent as a frozen middlebox
/// or a dropped route does (no FIN, no RST; the kernel keeps acknowledging
/// bytes, keepalive probes too): while [`SilencingProxy::paused`] every
/// connection holds what it reads and forwards it once resumed;
/// [`SilencingProxy::silence_open`] makes the connections open at that
/// moment drop everything for good, while connections opened later pass.
struct SilencingProxy {
    port: u16,
    /// While set, no connection forwards anything (held until cleared).
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The connections opened so far: each one's "silent for good" switch.
    open: std::sync::Arc<std::sync::Mutex<Vec<std::sync::Arc<std::sync::atomic::AtomicBool>>>>,
    /// `host:port` of the test server
    /// (`idem_store_postgres::testing::server_address`).
    upstream: String,
}

impl SilencingProxy {
    async fn start() -> SilencingProxy {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let upstream = idem_store_postgres::testing::server_address();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy_port = listener.local_addr().unwrap().port();
        let paused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (registry, target, pause) = (
            std::sync::Arc::clone(&open),
            upstream.clone(),
            std::sync::Arc::clone(&paused),
        );
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let silent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                registry
                    .lock()
                    .unwrap()
                    .push(std::sync::Arc::clone(&silent));
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(ri) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(wo) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                    ),
                    (Box::new(ro), Box::new(wi)),
                ] {
                    let (silent, pause) = (
                        std::sync::Arc::clone(&silent),
                        std::sync::Arc::clone(&pause),
                    );
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            while pause.load(Ordering::SeqCst) {
                                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            }
                            if silent.load(Ordering::SeqCst) {
                                continue;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        SilencingProxy {
            port: proxy_port,
            paused,
            open,
            upstream,
        }
    }

    /// `url` with the test server's address replaced by the proxy's.
    fn via(&self, url: &str) -> String {
        let via = url.replace(&self.upstream, &format!("127.0.0.1:{}", self.port));
        assert_ne!(via, url, "the test database URL names {}", self.upstream);
        via
    }

    /// Every connection open now goes silent for good.
    fn silence_open(&self) {
        for silent in self.open.lock().unwrap().iter() {
            silent.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// The next change `watch` hears within `limit` (resyncs skipped), if any.
async fn next_change(
    watch: &mut idem_store::Watch,
    limit: std::time::Duration,
) -> Option<idem_store::Change> {
    tokio::time::timeout(limit, async {
        loop {
            if let idem_store::Notice::Change(c) = watch.next().await {
                return (*c).clone();
            }
        }
    })
    .await
    .ok()
}

/// A listening connection whose link goes silent (no FIN, no RST) is
/// noticed by its round trip and replaced within
/// `notify::SILENT_REPLACED_WITHIN`: a new session listens (seen in
/// `pg_stat_activity`) and a change committed by another instance reaches
/// the subscribers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_listening_connection_is_replaced_within_its_bound() {
    use idem_store_postgres::notify::{PING_SQL, SILENT_REPLACED_WITHIN};
    let url = fresh_database().await;
    let proxy = SilencingProxy::start().await;
    let writer = connect(&url, PgOptions::default()).await.unwrap();
    let listener = connect(&proxy.via(&url), PgOptions::default())
        .await
        .unwrap();
    let mut watch = listener.changes().subscribe();
    listener.changes().heard().await;
    let (key, _) = writer
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    writer
        .submit(submission("acme", "before", key.id, 'a'))
        .await
        .unwrap();
    let limit = std::time::Duration::from_secs(10);
    assert!(
        next_change(&mut watch, limit).await.is_some(),
        "heard before"
    );
    let activity = raw(&url).await;
    let silent_at: std::time::SystemTime = activity
        .query_one("SELECT now()", &[])
        .await
        .unwrap()
        .get(0);
    let started = std::time::Instant::now();
    proxy.silence_open();
    let slack = std::time::Duration::from_secs(5);
    loop {
        let fresh: i64 = activity
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND backend_start > $1
                   AND query IN ('LISTEN idem_changes', $2)",
                &[&silent_at, &PING_SQL],
            )
            .await
            .unwrap()
            .get(0);
        if fresh > 0 {
            break;
        }
        assert!(
            started.elapsed() < SILENT_REPLACED_WITHIN + slack,
            "no new listening session within {:?}",
            SILENT_REPLACED_WITHIN + slack
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let replaced = started.elapsed();
    listener.changes().heard().await;
    let sent = std::time::Instant::now();
    writer
        .submit(submission("acme", "after", key.id, 'b'))
        .await
        .unwrap();
    let heard = next_change(&mut watch, limit).await;
    eprintln!(
        "listening connection replaced {replaced:?} after its link went silent; a change heard {:?} after its submit",
        sent.elapsed()
    );
    let heard = heard.expect("a change committed after the replacement is heard");
    assert_eq!(heard.tenant, "acme");
}

/// A session that `LISTEN`s on `idem_changes` and hands over each
/// notification as (sending backend's process id, payload).
async fn raw_listener(url: &str) -> tokio::sync::mpsc::UnboundedReceiver<(i32, String)> {
    let (client, mut conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let listen = client.batch_execute("LISTEN idem_changes");
        tokio::pin!(listen);
        let mut ready_tx = Some(ready_tx);
        loop {
            tokio::select! {
                done = &mut listen, if ready_tx.is_some() => {
                    done.unwrap();
                    let _ = ready_tx.take().map(|r| r.send(()));
                }
                m = std::future::poll_fn(|cx| conn.poll_message(cx)) => match m {
                    Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                        if tx.send((n.process_id(), n.payload().to_owned())).is_err() {
                            return;
                        }
                    }
                    Some(Ok(_)) => {}
                    _ => return,
                },
            }
        }
    });
    ready.await.unwrap();
    rx
}

/// The notifications `rx` receives within `limit` until `done` holds for
/// what was received.
async fn notifications_until(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(i32, String)>,
    limit: std::time::Duration,
    done: impl Fn(&[(i32, String)]) -> bool,
) -> Vec<(i32, String)> {
    let mut got = Vec::new();
    let _ = tokio::time::timeout(limit, async {
        while !done(&got) {
            match rx.recv().await {
                Some(n) => got.push(n),
                None => return,
            }
        }
    })
    .await;
    got
}

/// Data transactions notify nothing: each committed change is announced
/// once, after its commit, by the store's announcer session alone (one
/// process id for a submit batch, a claim and a report, which commit on
/// several pooled connections), and another instance hears every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_are_announced_once_each_from_outside_the_data_transactions() {
    let url = fresh_database().await;
    let writer = connect(&url, PgOptions::default()).await.unwrap();
    let other = connect(&url, PgOptions::default()).await.unwrap();
    let mut heard = other.changes().subscribe();
    other.changes().heard().await;
    let mut rx = raw_listener(&url).await;
    let (key, _) = writer
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    let mut submits = Vec::new();
    for k in keys("ann", 8) {
        let w = writer.clone();
        submits.push(tokio::spawn(async move {
            w.submit(submission("acme", &k, key.id, 'a')).await.unwrap()
        }));
    }
    for s in submits {
        s.await.unwrap();
    }
    let claimed = writer.claim(claim_req(1, None)).await.unwrap();
    let attempt = claimed[0].attempt.id;
    let report = Report {
        generation: claimed[0].attempt.generation,
        outcome: Outcome::Succeeded,
        result: Some(json!({"ok": true})),
        failure_class: None,
        message: None,
        usage: Some(1),
        external_txn_id: None,
        body: json!({"outcome": "succeeded"}),
    };
    writer
        .report("acme", attempt, report)
        .await
        .unwrap()
        .unwrap();
    writer.announced().await;
    // 8 submitted, 1 leased, 1 delivered (at least: a report may write more).
    let limit = std::time::Duration::from_secs(10);
    let got = notifications_until(&mut rx, limit, |got| {
        got.iter().any(|(_, p)| p.contains("\"delivered\"")) && got.len() >= 10
    })
    .await;
    let submitted = got
        .iter()
        .filter(|(_, p)| p.contains("\"task_submitted\""))
        .count();
    assert_eq!(submitted, 8, "each submit announced once: {got:?}");
    let senders: std::collections::BTreeSet<i32> = got.iter().map(|(pid, _)| *pid).collect();
    assert_eq!(senders.len(), 1, "one announcing session: {got:?}");
    let mut kinds = Vec::new();
    while kinds.len() < got.len() {
        match next_change(&mut heard, limit).await {
            Some(c) => kinds.push(c.kind),
            None => break,
        }
    }
    assert_eq!(
        kinds.len(),
        got.len(),
        "the other instance heard each change"
    );
}

/// An instance hears what it committed once: published at commit, and its
/// listening connection skips its own announcer's notification, while it
/// hears what another instance commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_hears_its_own_changes_once() {
    let url = fresh_database().await;
    let a = connect(&url, PgOptions::default()).await.unwrap();
    let b = connect(&url, PgOptions::default()).await.unwrap();
    let mut heard = a.changes().subscribe();
    a.changes().heard().await;
    let (key, _) = a.create_api_key("acme", Role::Admin, None).await.unwrap();
    let SubmitOutcome::Created(mine) = a
        .submit(submission("acme", "mine", key.id, 'a'))
        .await
        .unwrap()
    else {
        panic!("created")
    };
    a.announced().await;
    // Announced after a's announcement committed, so a's listening
    // connection receives it after a's own.
    let SubmitOutcome::Created(theirs) = b
        .submit(submission("acme", "theirs", key.id, 'b'))
        .await
        .unwrap()
    else {
        panic!("created")
    };
    let limit = std::time::Duration::from_secs(10);
    let first = next_change(&mut heard, limit).await.unwrap();
    assert_eq!(first.task_id, mine.id);
    let second = next_change(&mut heard, limit).await.unwrap();
    assert_eq!(
        second.task_id, theirs.id,
        "a's own change was heard a second time"
    );
}

/// Sessions that do not turn it off (binaries of the previous version,
/// `psql`) still notify through the `events` trigger; sessions with
/// `idem.notify = off` do not.
#[tokio::test]
async fn the_events_trigger_notifies_unless_the_session_turns_it_off() {
    let (url, store, _key) = seeded(&["t"], 'a').await;
    // The submit's announcement is sent before anything listens here.
    store.announced().await;
    let mut rx = raw_listener(&url).await;
    let old = raw(&url).await;
    let insert = "INSERT INTO events (task_id, seq, type, at, data, tenant, operation) \
                  SELECT id, $1, $2, 0, '{}', tenant, operation FROM tasks LIMIT 1";
    old.batch_execute("SET idem.notify = off").await.unwrap();
    old.execute(insert, &[&100i64, &"task_woken"])
        .await
        .unwrap();
    old.batch_execute("RESET idem.notify").await.unwrap();
    old.execute(insert, &[&101i64, &"cancel_requested"])
        .await
        .unwrap();
    let got = notifications_until(&mut rx, std::time::Duration::from_secs(10), |g| {
        !g.is_empty()
    })
    .await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].1.contains("\"cancel_requested\""), "{got:?}");
}

/// The sweep unparks only the claim queues it holds (SPEC §2.13): a parked
/// value queue with a waiting task whose tenant queue is in the turn order
/// is unparked while another transaction holds that tenant queue's row (as
/// a submit of that value does, between its two queue rows), instead of
/// waiting for it (a submit then waiting for the value row the sweep holds
/// would deadlock with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sweep_unparks_a_value_queue_while_its_tenant_queue_is_held() {
    let (url, store, key) = seeded(&[] as &[&str], 'a').await;
    let mut s = submission("acme", "valued", key.id, 'a');
    s.fairness_key = Some("x".into());
    assert!(matches!(
        store.submit(s).await.unwrap(),
        SubmitOutcome::Created(_)
    ));
    let (client, conn) = tokio_postgres::connect(url.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(
            "UPDATE claim_turns SET parked = true WHERE tenant = 'acme' AND fairness_key = '=x'",
        )
        .await
        .unwrap();
    client
        .batch_execute(
            "BEGIN; SELECT 1 FROM claim_turns WHERE tenant = 'acme' AND fairness_key = '' FOR UPDATE",
        )
        .await
        .unwrap();
    let swept = tokio::time::timeout(std::time::Duration::from_secs(10), store.sweep(100))
        .await
        .expect("the sweep waits for no row lock of a queue it does not unpark")
        .unwrap();
    assert_eq!(swept.unparked, 1, "{swept:?}");
    client.batch_execute("COMMIT").await.unwrap();
    let parked: bool = client
        .query_one(
            "SELECT parked FROM claim_turns WHERE tenant = 'acme' AND fairness_key = '=x'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!parked);
}
