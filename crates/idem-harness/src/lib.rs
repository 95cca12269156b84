//! # idem-harness
//!
//! Load and fault harness of idem: `idem bench` (throughput and latency
//! against a raw-database baseline measured in the same run) and `idem demo`
//! (the seeds' payment case end to end).

pub mod bench;
pub mod chaos;
pub mod demo;
pub mod server;
