//! Stored words on SQLite: the words idem writes in an attempt's report, an
//! evidence row and an event row read back as the enums they came from; a
//! word no version of idem writes is a `Corrupt` store error, not a panic or
//! a default.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use idem_core::machine::Report;
use idem_core::model::{Disposition, EventKind, EvidenceOutcome, Outcome, Role};
use idem_store::StoreError;
use idem_store::conformance::{contract, params, submission};
use idem_store::ops::{ClaimRequest, SubmitOutcome};
use rusqlite::Connection;
use serde_json::json;

const OP: &str = "payment.release";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_words_in_stored_rows_are_corrupt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idem.db");
    let store = idem_store_sqlite::open(&path, Default::default()).expect("open");
    let (key, _) = store
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    let s = submission("acme", OP, "k", params(OP, 1), contract(OP), &key);
    let SubmitOutcome::Created(task) = store.submit(s).await.unwrap() else {
        panic!("expected a new task")
    };
    let claim = ClaimRequest {
        tenant: "acme".into(),
        operations: vec![OP.into()],
        executor_id: "e1".into(),
        max: 1,
        lease_ms: Some(60_000),
    };
    let a = store.claim(claim).await.unwrap()[0].attempt.clone();
    let body = json!({"generation": a.generation, "outcome": "unknown"});
    let report = Report {
        generation: a.generation,
        outcome: Outcome::Unknown,
        result: None,
        failure_class: None,
        message: None,
        usage: None,
        external_txn_id: None,
        body: body.clone(),
    };
    store.report("acme", a.id, report).await.unwrap().unwrap();
    let read = store.list_attempts(None, task.id).await.unwrap().unwrap();
    let applied = read[0].report.clone().unwrap();
    assert_eq!((applied.outcome, applied.body), (Outcome::Unknown, body));
    assert_eq!(read[0].evidence[0].disposition, Disposition::Applied);
    assert_eq!(read[0].evidence[0].outcome, EvidenceOutcome::Unknown);
    let events = store.list_events(None, task.id).await.unwrap().unwrap();
    assert_eq!(events[0].kind, EventKind::TaskSubmitted);

    let db = Connection::open(&path).unwrap();
    let (task_id, attempt_id) = (task.id.to_string(), a.id.to_string());
    let corrupt = |e: StoreError| matches!(e, StoreError::Corrupt(_));
    for report in [r#"{"generation": 1}"#, r#"{"outcome": "nope"}"#] {
        db.execute(
            "UPDATE attempts SET report = ?2 WHERE id = ?1",
            [&attempt_id, report],
        )
        .unwrap();
        let err = store.list_attempts(None, task.id).await.unwrap_err();
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
    assert!(corrupt(
        store.list_attempts(None, task.id).await.unwrap_err()
    ));
    db.execute(
        "INSERT INTO events (task_id, seq, type, at, data) VALUES (?1, 1000, 'nope', 0, '{}')",
        [&task_id],
    )
    .unwrap();
    assert!(corrupt(store.list_events(None, task.id).await.unwrap_err()));
}
