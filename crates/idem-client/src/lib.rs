//! idem-client
