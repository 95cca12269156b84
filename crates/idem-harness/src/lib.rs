//! # idem-harness
//!
//! Load and fault harness of idem: `idem-lab bench` (throughput and latency
//! against a raw-database baseline measured in the same run), `idem-lab chaos`
//! (a seeded fault-injection run against real `idem serve` processes and a
//! checker of SPEC §2), `idem-lab demo` (the seeds' payment case end to end) and
//! `idem-lab bench-waiters` ([`waiters`]: what long-polling executors cost the
//! database and the submitters), `idem-lab bench-console` ([`console_bench`]: the
//! console's pages with a large tenant), with [`server`], an idem server inside this
//! process for bench and demo and `idem serve` child processes for chaos and
//! bench-waiters, and [`fault_proxy`], the proxy that injects network faults
//! between an executor and idem for the worker tests.
//!
//! The lab's binary, `idem-lab` (`src/bin/idem-lab/`), runs these commands
//! and `idem-lab verify` (idem-model); the product binary `idem` links none
//! of them.

pub mod bench;
pub mod chaos;
pub mod console_bench;
pub mod demo;
pub mod fairness;
pub mod fault_proxy;
pub mod rate_bench;
pub mod server;
pub mod waiters;
