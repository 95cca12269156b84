//! The store conformance suite, run against PostgreSQL (a fresh database per case).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

idem_store::store_conformance!(|| async {
    idem_store_postgres::connect(
        &idem_store_postgres::testing::fresh_database().await,
        Default::default(),
    )
    .await
    .unwrap()
});
