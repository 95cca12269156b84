//! `idem-lab chaos`: a seeded, reproducible fault-injection run against real
//! `idem serve` processes, followed by a checker of the invariants of SPEC §2.
//!
//! What the seed fixes (the [`Plan`], identical for the same seed, operation
//! count and store kind):
//!
//! - clients: which operation class and idempotency key each operation uses
//!   (keys come from a small key space, so replays and conflicts happen), which
//!   first try runs into a tiny client timeout and is retried with the same key,
//!   which retries change a material field (must get 422 and never be paid), how
//!   many replays follow, and which operations cancel after how long;
//! - executors: per scope and per execute / reconcile attempt ordinal, whether
//!   the executor heartbeats, crashes before or after the effect, reports
//!   `unknown` (with or without the effect), fails `transient` or
//!   `invalid_input`, reports late after its lease ran out (must get 409
//!   `STALE_GENERATION`), or repeats its report and then sends a different one;
//! - servers: after which operation a server process is killed with SIGKILL
//!   (and restarted on the same store, on a new port), and — with PostgreSQL —
//!   when the idem connections are terminated with `pg_terminate_backend`;
//! - with `--netns` (PostgreSQL): each instance in a network namespace of its
//!   own, and partitions, delays and packet loss on one instance's database
//!   link at a time ([`netns`], [`NetEpisode`]);
//! - with `--clock-skew-ms N` (PostgreSQL): the second instance's wall clock
//!   shifted by ±N under libfaketime, the sign flipping at each of its
//!   restarts ([`Plan::with_clock_skew`], [`SkewReport`]).
//!
//! Which attempt meets which executor, and the exact interleaving, are left to
//! real concurrency; `faults_realized` reports what actually happened.
//!
//! The executors pay at an in-memory provider that is itself idempotent by task
//! id (or, with [`ProviderMode::NonDeduplicating`], performs every request)
//! and answers lookups for reconciliation. An executor only moves money
//! within the first part of its lease and never after it reported, so every
//! payout is visible to any later reconciliation: a second pay request within
//! the lease for a non-safe task therefore means idem repeated an effect
//! without reconciling. Stale payers ([`Plan::with_stale_payers`]) break that
//! rule on purpose and pay after their lease ran out: idem cannot prevent it,
//! and must raise each such second effect it is told of as
//! `second_effect_suspected` ([`second_effects`]).
//!
//! Afterwards faults stop, executors run until every task is terminal (or
//! none became terminal for a minute: the rest is stuck), and the checker reads every task of the run's tenant (ids from the database, records
//! over HTTP) and verifies SPEC §2 against the event histories, the attempts
//! with their evidence, the clients' log of answers and the provider's ledger.
//!
//! This file holds the run's timing constants and configuration; the plan,
//! the provider, the records, the checker, the server processes, the
//! clients and executors, and the run itself each have a submodule, whose
//! public items are re-exported here.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use idem_client::{
    Attempt, AttemptKind, AttemptState, CancelStatus, ClaimedAttempt, Client, ClientError, Event,
    FailureClass, HeartbeatAck, ReportBody, Task, TaskState,
};
use idem_core::config::{Config, ConfigError, DEFAULT_TOML};
use idem_core::model::Role;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::process::Child;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::server;

/// Lease every executor asks for, ms.
pub const LEASE_MS: u64 = 800;

/// An executor only performs the effect this soon after it sent its claim, so
/// that the effect is committed before the lease can possibly expire.
const EFFECT_WITHIN: Duration = Duration::from_millis(300);

/// A late report is sent this long after the lease ran out.
const LATE_MARGIN: Duration = Duration::from_millis(150);

/// Per-request time limit of clients and executors.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a client keeps retrying one submission (same key) before it looks the scope up.
const CLIENT_PATIENCE: Duration = Duration::from_secs(30);

/// How long an executor keeps retrying one report through outages.
const REPORT_PATIENCE: Duration = Duration::from_secs(30);

/// How long an executor keeps retrying a report that names an effect (an
/// `external_txn_id`) through outages: until answered, in practice.
const EFFECT_REPORT_PATIENCE: Duration = Duration::from_secs(120);

/// How long the run waits at most for every task to become terminal after
/// the faults stopped.
const QUIESCE_LIMIT: Duration = Duration::from_secs(900);

/// The wait for every task to become terminal ends earlier when no task
/// became terminal for this long: with executors claiming, backoffs of at
/// most 200 ms and leases of 800 ms, a task still open then is stuck, not
/// slow (the liveness check fails for it).
const QUIESCE_STALL: Duration = Duration::from_secs(60);

/// Attempts handled at once by all executors together.
const MAX_INFLIGHT: usize = 512;

/// How `idem-lab chaos` changes the bundled classes for its servers: short leases
/// and backoffs, long windows (no key is removed during a run), one more
/// attempt for payouts. Environment-override form (`IDEM_OPERATIONS__…`).
pub const CHAOS_OVERRIDES: &[(&str, &str)] = &[
    ("IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__MAX_ATTEMPTS", "4"),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS",
        "20",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS",
        "200",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__DEADLINE_MS",
        "1800000",
    ),
    ("IDEM_OPERATIONS__PAYMENT_RELEASE__LEASE__DEFAULT_MS", "800"),
    ("IDEM_OPERATIONS__PAYMENT_RELEASE__LEASE__MAX_MS", "10000"),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__WINDOWS__REQUEST_RETRY_MS",
        "3600000",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__WINDOWS__RECONCILIATION_MS",
        "3600000",
    ),
    (
        "IDEM_OPERATIONS__PAYMENT_RELEASE__WINDOWS__RETENTION_MS",
        "10800000",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__INITIAL_MS",
        "20",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__MAX_MS",
        "200",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__DEADLINE_MS",
        "1800000",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__LEASE__DEFAULT_MS",
        "800",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__LEASE__MAX_MS",
        "10000",
    ),
    (
        "IDEM_OPERATIONS__GENERATION_DISPATCH__WINDOWS__RETENTION_MS",
        "10800000",
    ),
];

/// The configuration of `idem-lab chaos`'s servers: the bundled classes with
/// [`CHAOS_OVERRIDES`].
///
/// # Errors
/// A [`ConfigError`] if the overrides no longer fit the
/// bundled configuration.
pub fn chaos_config() -> Result<Config, ConfigError> {
    Config::from_toml_with_env(
        DEFAULT_TOML,
        CHAOS_OVERRIDES
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    )
}

mod check;
mod failover;
mod forward;
mod loss;
pub mod netns;
mod network;
mod plan;
mod provider;
mod records;
mod run;
mod servers;
mod skew;
mod workload;

pub use check::*;
pub use failover::*;
pub use loss::*;
pub use network::*;
pub use plan::*;
pub use provider::*;
pub use records::*;
pub use run::*;
use servers::*;
pub use skew::*;
use workload::*;

#[cfg(test)]
mod tests;
