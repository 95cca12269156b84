//! Stored event data on SQLite reads back as its typed form and serializes to
//! the very text the store holds, for every event kind (SPEC §2.10: the
//! history is append-only, so rows written by any release are read, and
//! served, unchanged).
//!
//! `data/stored-events.tsv` holds the rows the same cases stored at commit
//! ead98be, whose transitions built event data as `serde_json::Value`s (one
//! `type<TAB>data` a line): rows this release reads and serves unchanged.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use idem_store::conformance::{check_event_corpus, corpus_cases};
use idem_store::{Clock, Store};
use idem_store_sqlite::{SqliteBackend, SqliteOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stored_event_data_round_trips_byte_for_byte() {
    let mut rows = Vec::new();
    for (name, case) in corpus_cases() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("idem.db");
        let options = SqliteOptions {
            clock: Clock::test(),
        };
        let backend = SqliteBackend::open(&path, options).expect("open sqlite store");
        case(Store::new(backend)).await;
        let conn = rusqlite::Connection::open(&path).expect("open the file again");
        let mut stmt = conn
            .prepare("SELECT type, data FROM events ORDER BY task_id, seq")
            .unwrap();
        let read = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
            .unwrap()
            .collect::<rusqlite::Result<Vec<_>>>()
            .unwrap();
        assert!(!read.is_empty(), "{name} stored no events");
        rows.extend(read);
    }
    check_event_corpus(&rows, include_str!("data/stored-events.tsv"));
}
