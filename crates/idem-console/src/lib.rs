//! # idem-console
//!
//! The operator console served under `/console`.

pub mod timeline;
