//! # idem-harness
//!
//! Load and fault harness of idem: `idem bench` (throughput and latency
//! against a raw-database baseline measured in the same run), `idem chaos`
//! (a seeded fault-injection run against real `idem serve` processes and a
//! checker of SPEC §2), `idem demo` (the seeds' payment case end to end) and
//! `idem bench-waiters` ([`waiters`]: what long-polling executors cost the
//! database and the submitters), `idem bench-console` ([`console_bench`]: the
//! console's pages with a large tenant), with [`server`], an idem server inside this
//! process for bench and demo and `idem serve` child processes for chaos and
//! bench-waiters, and [`fault_proxy`], the proxy that injects network faults
//! between an executor and idem for the worker tests.

pub mod bench;
pub mod chaos;
pub mod console_bench;
pub mod demo;
pub mod fault_proxy;
pub mod server;
pub mod waiters;
