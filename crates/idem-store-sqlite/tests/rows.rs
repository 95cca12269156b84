//! Stored words on SQLite: the words idem writes in an attempt's report, an
//! evidence row and an event row read back as the enums they came from; a
//! word no version of idem writes is a `Corrupt` store error, not a panic or
//! a default.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use idem_store::StoreError;
use idem_store::conformance::task_with_a_reported_attempt;
use rusqlite::Connection;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_words_in_stored_rows_are_corrupt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idem.db");
    let store = idem_store_sqlite::open(&path, Default::default()).expect("open");
    let (task, attempt) = task_with_a_reported_attempt(&store).await;

    let db = Connection::open(&path).unwrap();
    let (task_id, attempt_id) = (task.to_string(), attempt.to_string());
    let corrupt = |e: StoreError| matches!(e, StoreError::Corrupt(_));
    for report in [r#"{"generation": 1}"#, r#"{"outcome": "nope"}"#] {
        db.execute(
            "UPDATE attempts SET report = ?2 WHERE id = ?1",
            [&attempt_id, report],
        )
        .unwrap();
        let err = store.list_attempts(None, task).await.unwrap_err();
        assert!(corrupt(err), "report {report}");
    }
    db.execute(
        "UPDATE attempts SET report = '{\"outcome\": \"unknown\"}' WHERE id = ?1",
        [&attempt_id],
    )
    .unwrap();
    db.execute(
        "INSERT INTO evidence (task_id, attempt_id, received_at, generation, outcome, body, disposition) \
         VALUES (?1, ?2, 0, 1, 'unknown', '{}', 'nope')",
        [&task_id, &attempt_id],
    )
    .unwrap();
    assert!(corrupt(store.list_attempts(None, task).await.unwrap_err()));
    db.execute(
        "INSERT INTO events (task_id, seq, type, at, data, tenant, operation, position) \
         VALUES (?1, 1000, 'nope', 0, '{}', 'acme', 'payment.release', 1000000)",
        [&task_id],
    )
    .unwrap();
    assert!(corrupt(store.list_events(None, task).await.unwrap_err()));
}

/// The database holds "once per distinct id" itself (SPEC §2.12): a second
/// row of a task's suspected second effect or effect report with the same
/// `external_txn_id`, `null` counted as one id, is refused by the unique
/// index, whatever a binary does; another id of the same task is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_effects_and_effect_reports_are_unique_per_task_and_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idem.db");
    let store = idem_store_sqlite::open(&path, Default::default()).expect("open");
    let (task, _) = task_with_a_reported_attempt(&store).await;
    let db = Connection::open(&path).unwrap();
    let task_id = task.to_string();
    for (table, at) in [
        ("second_effects", "suspected_at"),
        ("effect_reports", "reported_at"),
    ] {
        let insert = |txn: Option<&str>| {
            db.execute(
                &format!(
                    "INSERT INTO {table} (task_id, external_txn_id, attempt_id, generation, evidence, {at}) \
                     VALUES (?1, ?2, NULL, 1, 'stale_report', 0)"
                ),
                rusqlite::params![task_id, txn],
            )
        };
        insert(None).unwrap();
        insert(Some("psp-1")).unwrap();
        assert!(insert(None).is_err(), "{table}: a second null id");
        assert!(insert(Some("psp-1")).is_err(), "{table}: a second psp-1");
        insert(Some("null")).unwrap();
    }
}
