//! idem-store-sqlite
