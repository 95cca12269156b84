//! Schema migrations on SQLite: a file written by an older schema opens under
//! this binary with every row intact, and the rebuilt `tasks` table keeps its
//! constraints and claim index.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use idem_core::model::{Role, TaskState};
use idem_store::conformance::{contract, params, submission};
use idem_store::ops::{ClaimRequest, SubmitOutcome};
use idem_store_sqlite::MIGRATIONS;
use rusqlite::Connection;

const SAFE: &str = "generation.dispatch";
const NON_SAFE: &str = "payment.release";

fn claim(operation: &str, executor: &str, max: i64) -> ClaimRequest {
    ClaimRequest {
        tenant: "acme".into(),
        operations: vec![operation.into()],
        executor_id: executor.into(),
        max,
        lease_ms: Some(60_000),
        flow: Default::default(),
    }
}

fn user_version(path: &std::path::Path) -> i64 {
    Connection::open(path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_file_migrates_to_latest_with_rows_and_constraints_intact() {
    older_file_migrates_to_latest(1).await;
}

/// Schema 3 kept each task's contract text in its row; migration 4 moves each
/// distinct text to `contracts` and every task reads back the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v3_file_migrates_its_contracts_to_rows_of_their_own() {
    older_file_migrates_to_latest(3).await;
}

/// Rows written by this binary, copied into a file at schema `version` (each
/// task's contract as its own text, as schemas before 4 kept it), open under
/// this binary with every row intact and the rebuilt `tasks` table's
/// constraints and claim index in place.
async fn older_file_migrates_to_latest(version: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let latest = dir.path().join("latest.db");
    let old = dir.path().join(format!("v{version}.db"));

    // Rows written by the store: a key, a queued task, a running task with its attempt.
    let store = idem_store_sqlite::open(&latest, Default::default()).expect("open");
    let (key, _) = store
        .create_api_key("acme", Role::Client, None)
        .await
        .expect("key");
    let mut ids = Vec::new();
    for (i, op) in [NON_SAFE, SAFE].iter().enumerate() {
        let s = submission(
            "acme",
            op,
            &format!("k-{i}"),
            params(op, i as u64),
            contract(op),
            &key,
        );
        match store.submit(s).await.expect("submit") {
            SubmitOutcome::Created(t) => ids.push(t.id),
            other => panic!("expected a new task, got {other:?}"),
        }
    }
    let claimed = store.claim(claim(NON_SAFE, "e1", 1)).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    let mut before = Vec::new();
    for id in &ids {
        before.push(
            store
                .get_task(None, *id)
                .await
                .expect("read")
                .expect("task"),
        );
    }
    drop(store);

    // The same rows in a file at schema `version`.
    {
        let conn = Connection::open(&old).unwrap();
        for m in &MIGRATIONS[..version] {
            conn.execute_batch(m.sql).unwrap();
        }
        conn.pragma_update(None, "user_version", version as i64)
            .unwrap();
        conn.execute("ATTACH DATABASE ?1 AS latest", [latest.to_str().unwrap()])
            .unwrap();
        for table in [
            "api_keys",
            "tasks",
            "idempotency_keys",
            "attempts",
            "evidence",
            "events",
        ] {
            let mut stmt = conn
                .prepare(&format!(
                    "SELECT name FROM pragma_table_info('{table}', 'latest')"
                ))
                .unwrap();
            // Columns later migrations add (at the end of the table) have no
            // place in the older file.
            let older: Vec<String> = conn
                .prepare(&format!(
                    "SELECT name FROM pragma_table_info('{table}', 'main')"
                ))
                .unwrap()
                .query_map([], |r| r.get::<_, String>(0))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            let columns: Vec<String> = stmt
                .query_map([], |r| r.get::<_, String>(0))
                .unwrap()
                .map(Result::unwrap)
                .filter(|c| c == "contract_id" || older.contains(c))
                .map(|c| match c.as_str() {
                    "contract_id" => {
                        "(SELECT c.contract FROM latest.contracts c WHERE c.id = t.contract_id)"
                            .to_owned()
                    }
                    other => format!("t.{other}"),
                })
                .collect();
            conn.execute_batch(&format!(
                "INSERT INTO main.{table} SELECT {} FROM latest.{table} t",
                columns.join(", ")
            ))
            .unwrap();
        }
    }
    assert_eq!(user_version(&old), version as i64);

    // Opening migrates; every row reads back the same.
    let store = idem_store_sqlite::open(&old, Default::default()).expect("open older file");
    assert_eq!(user_version(&old), MIGRATIONS.len() as i64);
    let contracts: i64 = Connection::open(&old)
        .unwrap()
        .query_row("SELECT count(*) FROM contracts", [], |r| r.get(0))
        .unwrap();
    assert_eq!(contracts, 2, "one row per distinct contract");
    for (id, was) in ids.iter().zip(&before) {
        let now = store
            .get_task(None, *id)
            .await
            .expect("read")
            .expect("task");
        assert_eq!(
            serde_json::to_value(&now).unwrap(),
            serde_json::to_value(was).unwrap()
        );
        assert_eq!(
            store
                .list_events(None, *id)
                .await
                .expect("events")
                .expect("own")
                .len() as i64,
            now.control.event_seq
        );
    }
    // Migration 6 gave the copied events their tenant, class and positions:
    // the feed holds every one, each task's in `seq` order.
    let feed = store
        .feed("acme", idem_store::feed::FeedCursor::START, 100)
        .await
        .expect("feed");
    let mut expected = 0;
    for (id, was) in ids.iter().zip(&before) {
        let seqs: Vec<i64> = feed
            .iter()
            .filter(|e| e.task_id == *id)
            .map(|e| e.event.seq)
            .collect();
        assert_eq!(seqs, (1..=was.control.event_seq).collect::<Vec<_>>());
        assert!(
            feed.iter()
                .filter(|e| e.task_id == *id)
                .all(|e| e.operation == was.operation)
        );
        expected += seqs.len();
    }
    assert_eq!(feed.len(), expected);
    assert_eq!(
        store
            .list_attempts(None, ids[0])
            .await
            .expect("attempts")
            .expect("own")
            .len(),
        1
    );

    // The rebuilt table still works: replay, claim through the index, and the
    // unique scope and state checks still refuse what they refused.
    let replay = submission(
        "acme",
        NON_SAFE,
        "k-0",
        params(NON_SAFE, 0),
        contract(NON_SAFE),
        &key,
    );
    assert!(matches!(
        store.submit(replay).await.expect("replay"),
        SubmitOutcome::Replayed(t) if t.id == ids[0]
    ));
    let claimed = store.claim(claim(SAFE, "e2", 5)).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].task.id, ids[1]);
    assert_eq!(claimed[0].task.state, TaskState::Running);
    drop(store);

    let conn = Connection::open(&old).unwrap();
    conn.pragma_update(None, "foreign_keys", true).unwrap();
    let bad_state = conn.execute(
        "UPDATE tasks SET state = 'bogus' WHERE id = ?1",
        [ids[0].to_string()],
    );
    assert!(bad_state.is_err(), "the state check survived the rebuild");
    let plan: String = conn
        .query_row(
            "EXPLAIN QUERY PLAN SELECT id FROM tasks WHERE tenant = 'acme' AND operation = 'x' \
             AND active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') \
             AND ready_at <= 0",
            [],
            |r| r.get(3),
        )
        .unwrap();
    assert!(plan.contains("USING INDEX"), "claim plan: {plan}");
    let rank_index: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = 'tasks_claim_rank'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(rank_index, 1, "the claim rank index survived the rebuild");
    // A claim walks the index in claim order: no sort of the backlog.
    let mut stmt = conn
        .prepare(&format!(
            "EXPLAIN QUERY PLAN {}",
            idem_store_sqlite::CLAIMABLE_IN_CLASS
        ))
        .unwrap();
    let claim_plan: Vec<String> = stmt
        .query_map(rusqlite::params!["acme", "x", 0, 4], |r| r.get(3))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    let claim_plan = claim_plan.join("\n");
    assert!(
        claim_plan.contains("tasks_claim_rank") && !claim_plan.contains("TEMP B-TREE"),
        "claim plan: {claim_plan}"
    );
    let orphans: i64 = conn
        .query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(orphans, 0);
}

/// Opening an up-to-date file migrates nothing and so scans nothing: a stray
/// row (written with foreign keys off by some other tool) does not stop the
/// store from opening.
#[tokio::test]
async fn up_to_date_file_opens_without_a_foreign_key_scan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idem.db");
    drop(idem_store_sqlite::open(&path, Default::default()).expect("create"));
    {
        let conn = Connection::open(&path).unwrap();
        conn.pragma_update(None, "foreign_keys", false).unwrap();
        conn.execute(
            "INSERT INTO events (task_id, seq, type, at, data, tenant, operation, position) \
             VALUES ('no-such-task', 1, 'x', 0, '{}', 'acme', 'x', 1)",
            [],
        )
        .unwrap();
        let orphans: i64 = conn
            .query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(orphans, 1);
    }
    let store = idem_store_sqlite::open(&path, Default::default()).expect("reopen");
    assert!(store.list_api_keys().await.expect("read").is_empty());
}

/// A migration that fails names its version and SQLite's reason, leaves the
/// file as it was, and does not quote the whole migration back.
#[test]
fn a_failed_migration_names_its_version_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idem.db");
    {
        // Some other tool's table where migration 1 creates `api_keys`.
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE api_keys (x INTEGER);")
            .unwrap();
    }
    let err = idem_store_sqlite::migrate_file(&path).expect_err("migration 1 cannot run");
    let idem_store::StoreError::Migration(msg) = &err else {
        panic!("expected a migration error, got {err:?}");
    };
    assert!(msg.starts_with("migration 1: "), "{msg}");
    assert!(msg.contains("api_keys"), "{msg}");
    assert!(
        !msg.contains("CREATE TABLE tasks"),
        "the migration's text is not quoted back: {msg}"
    );
    assert_eq!(user_version(&path), 0, "nothing applied");
    let conn = Connection::open(&path).unwrap();
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'tasks'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tables, 0, "migration 1 rolled back");
}

/// `open_existing` (the inspection commands) changes no schema: it refuses a
/// file that is not an idem store or is older than this binary, and leaves
/// it as it was; a current store opens.
#[tokio::test]
async fn open_existing_refuses_other_schemas_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let foreign = dir.path().join("foreign.db");
    Connection::open(&foreign)
        .unwrap()
        .execute_batch("CREATE TABLE customers (id INTEGER);")
        .unwrap();
    let Err(idem_store::StoreError::Migration(msg)) =
        idem_store_sqlite::open_existing(&foreign, Default::default())
    else {
        panic!("a foreign file opened");
    };
    assert!(msg.contains("not an idem store"), "{msg}");
    assert_eq!(user_version(&foreign), 0);
    let older = dir.path().join("v1.db");
    {
        let conn = Connection::open(&older).unwrap();
        conn.execute_batch(MIGRATIONS[0].sql).unwrap();
        conn.pragma_update(None, "user_version", 1).unwrap();
    }
    let Err(idem_store::StoreError::Migration(msg)) =
        idem_store_sqlite::open_existing(&older, Default::default())
    else {
        panic!("an older store opened");
    };
    assert!(msg.contains("idem migrate"), "{msg}");
    assert_eq!(user_version(&older), 1, "not upgraded");
    let current = dir.path().join("idem.db");
    drop(idem_store_sqlite::open(&current, Default::default()).expect("create"));
    let store = idem_store_sqlite::open_existing(&current, Default::default()).expect("current");
    assert!(store.list_api_keys().await.expect("read").is_empty());
}

/// Expand/contract (docs/operations.md, "Upgrading"): each migration's
/// `compatible_from` is recorded in `schema_migrations`; a newer file
/// declared compatible with this binary opens (migrating or not) and is left
/// as it is, and one declared incompatible is refused naming both versions.
#[tokio::test]
async fn a_newer_file_opens_only_while_declared_compatible() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idem.db");
    drop(idem_store_sqlite::open(&path, Default::default()).expect("create"));
    let conn = Connection::open(&path).unwrap();
    let recorded: Vec<(i64, i64)> = conn
        .prepare("SELECT version, compatible_from FROM schema_migrations ORDER BY version")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let declared: Vec<(i64, i64)> = MIGRATIONS
        .iter()
        .map(|m| {
            let from = idem_store::schema::recorded_compatible_from(MIGRATIONS, m.version);
            (i64::from(m.version), i64::from(from))
        })
        .collect();
    assert_eq!(recorded, declared);
    let known = MIGRATIONS.len() as i64;
    let future = known + 1;

    // A later release's expand step.
    conn.execute(
        "INSERT INTO schema_migrations (version, compatible_from) VALUES (?1, ?2)",
        [future, known],
    )
    .unwrap();
    conn.pragma_update(None, "user_version", future).unwrap();
    drop(idem_store_sqlite::open_existing(&path, Default::default()).expect("compatible"));
    drop(idem_store_sqlite::open(&path, Default::default()).expect("compatible"));
    assert!(
        idem_store_sqlite::migrate_file(&path)
            .expect("compatible")
            .is_empty()
    );
    assert_eq!(user_version(&path), future, "left as it is");

    // Its contract step.
    conn.execute(
        "UPDATE schema_migrations SET compatible_from = version WHERE version = ?1",
        [future],
    )
    .unwrap();
    let refusals = [
        idem_store_sqlite::open_existing(&path, Default::default()).err(),
        idem_store_sqlite::open(&path, Default::default()).err(),
        idem_store_sqlite::migrate_file(&path).err(),
    ];
    for e in refusals {
        let Some(idem_store::StoreError::Migration(msg)) = e else {
            panic!("an incompatible newer file opened: {e:?}");
        };
        assert!(
            msg.contains(&format!("version {future}"))
                && msg.contains(&format!("this binary's {known}")),
            "{msg}"
        );
    }
}
