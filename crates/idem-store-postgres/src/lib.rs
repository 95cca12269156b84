//! idem-store-postgres
