//! The store conformance suite, run against PostgreSQL (a fresh database per
//! case, dropped with its store).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

idem_store::store_conformance!(|| async {
    let mut options = idem_store_postgres::PgOptions::default();
    options.clock = idem_store::Clock::test();
    idem_store_postgres::testing::fresh_store(options).await
});
