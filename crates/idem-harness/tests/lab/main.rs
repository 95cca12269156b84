//! Black-box tests of `idem-lab`: each test runs the binary as a process
//! (`bench` and `verify` in this process's children alone, `bench-waiters`,
//! `chaos` and `fairness --http` with the `idem serve` processes they start
//! from the `idem` binary).

// Helpers outside `#[test]` functions panic on setup failures by design.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod bench;
mod bench_waiters;
mod chaos;
mod fairness;
mod support;
mod verify;
