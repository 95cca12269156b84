//! The store conformance suite (crates/idem-store/src/conformance.rs) on SQLite:
//! each case gets a fresh database file in its own temporary directory,
//! removed once the last clone of its store is dropped.
#![allow(clippy::expect_used)]

use idem_store::{Backend, BoxFuture, Clock, Op, Result, Store};
use idem_store_sqlite::{SqliteBackend, SqliteOptions};

async fn fresh_store() -> Store {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = SqliteOptions {
        clock: Clock::test(),
    };
    let backend =
        SqliteBackend::open(dir.path().join("idem.db"), options).expect("open sqlite store");
    Store::new(WithDir { backend, _dir: dir })
}

/// A [`SqliteBackend`] that owns the directory of its database file: the
/// directory is removed after the backend is dropped (fields drop in order).
struct WithDir {
    backend: SqliteBackend,
    _dir: tempfile::TempDir,
}

impl Backend for WithDir {
    fn execute(&self, op: Op) -> BoxFuture<'_, ()> {
        self.backend.execute(op)
    }

    fn runs_detached(&self, op: &Op) -> bool {
        self.backend.runs_detached(op)
    }

    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        self.backend.ping()
    }

    fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    fn clock(&self) -> &Clock {
        self.backend.clock()
    }
}

idem_store::store_conformance!(fresh_store);
