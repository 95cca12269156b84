//! The store conformance suite, run against PostgreSQL (a fresh database per
//! case, dropped with its store).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

idem_store::store_conformance!(|| async {
    idem_store_postgres::testing::fresh_store(Default::default()).await
});
