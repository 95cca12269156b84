//! idem-store
