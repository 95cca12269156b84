//! Stored event data on PostgreSQL reads back as its typed form and
//! serializes to the very text the store holds, for every event kind (SPEC
//! §2.10: the history is append-only, so rows written by any release are
//! read, and served, unchanged).
//!
//! `data/stored-events.tsv` holds the rows the same cases stored at commit
//! ead98be, whose transitions built event data as `serde_json::Value`s (one
//! `type<TAB>data` a line): rows this release reads and serves unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use idem_store::conformance::{check_event_corpus, corpus_cases};
use idem_store_postgres::testing::fresh_database;
use idem_store_postgres::{PgOptions, connect};
use tokio_postgres::NoTls;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stored_event_data_round_trips_byte_for_byte() {
    let mut rows = Vec::new();
    for (name, case) in corpus_cases() {
        let db = fresh_database().await;
        let mut options = PgOptions::default();
        options.clock = idem_store::Clock::test();
        case(connect(db.url(), options).await.unwrap()).await;
        let (client, conn) = tokio_postgres::connect(db.url(), NoTls).await.unwrap();
        let session = tokio::spawn(conn);
        let read: Vec<(String, String)> = client
            .query("SELECT type, data FROM events ORDER BY task_id, seq", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        drop(client);
        session.await.unwrap().unwrap();
        assert!(!read.is_empty(), "{name} stored no events");
        rows.extend(read);
    }
    check_event_corpus(&rows, include_str!("data/stored-events.tsv"));
}
