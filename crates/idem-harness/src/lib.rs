//! # idem-harness
//!
//! Load and fault harness of idem: `idem bench` (throughput and latency
//! against a raw-database baseline measured in the same run), `idem chaos`
//! (a seeded fault-injection run against real `idem serve` processes and a
//! checker of SPEC §2) and `idem demo` (the seeds' payment case end to end),
//! with [`server`], an idem server inside this process for bench and demo.

pub mod bench;
pub mod chaos;
pub mod demo;
pub mod server;
