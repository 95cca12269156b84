//! idem-core
