//! The store conformance suite (crates/idem-store/src/conformance.rs) on SQLite:
//! each case gets a fresh database file in its own temporary directory.
#![allow(clippy::expect_used)]

async fn fresh_store() -> idem_store::Store {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.keep().join("idem.db");
    let options = idem_store_sqlite::SqliteOptions {
        clock: idem_store::Clock::test(),
    };
    idem_store_sqlite::open(path, options).expect("open sqlite store")
}

idem_store::store_conformance!(fresh_store);
