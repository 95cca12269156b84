//! idem-harness
