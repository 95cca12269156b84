//! idem-http
