//! The store conformance suite (crates/idem-store/src/conformance.rs) on SQLite:
//! each case gets a fresh database file in its own temporary directory,
//! removed once the last clone of its store is dropped.
#![allow(clippy::expect_used)]

use idem_store::{Clock, Guarded, Store};
use idem_store_sqlite::{SqliteBackend, SqliteOptions};

async fn fresh_store() -> Store {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = SqliteOptions {
        clock: Clock::test(),
    };
    let backend =
        SqliteBackend::open(dir.path().join("idem.db"), options).expect("open sqlite store");
    // The directory is removed once the last clone of the store is dropped.
    Store::new(Guarded::new(backend, dir))
}

idem_store::store_conformance!(fresh_store);
