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
