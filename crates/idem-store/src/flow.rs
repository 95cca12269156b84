//! Fair claims and priorities (SPEC §2.13): the claim rank, the claim
//! queues and their turns, and what a claim brings of the configuration.
//!
//! A claim by a pool key (one serving several tenants), or of a class with a
//! `fairness_key`, serves its queues in weighted round robin: each queue (a
//! tenant and class; inside a class with a fairness key, each of its values)
//! has a turn, a virtual time the claim advances by [`TURN`] / weight for each
//! attempt leased from it, and the claim leases from the waiting queue with
//! the lowest turn. Inside a queue, tasks go by [`claim_rank`].

use std::collections::BTreeMap;

use idem_core::model::{Serves, Task, TaskState};

/// Milliseconds of time in queue one priority level is worth (SPEC §2.13):
/// a claim takes a queue's tasks in `ready_at - priority × AGING_MS` order, so
/// a task of priority p waits at most `(5 - p) × AGING_MS` behind tasks of
/// priority 5 that became ready after it. Fixed: the claim indexes
/// (`tasks_claim_rank`, `tasks_claim_fair`) are built on it.
pub const AGING_MS: i64 = 10_000;

/// The turn a queue of weight 1 advances by per attempt leased from it.
pub const TURN: i64 = 1_000_000;

/// The claim rank of `task`: `ready_at - priority × AGING_MS` (ms), lower
/// first; the expression of the claim indexes.
pub fn claim_rank(task: &Task) -> i64 {
    task.control
        .ready_at
        .0
        .saturating_sub(task.priority.saturating_mul(AGING_MS))
}

/// A claim queue (a `claim_turns` row): a tenant and class, or inside a
/// class with a fairness key, one of its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimQueue {
    /// Tenant.
    pub tenant: String,
    /// Operation class.
    pub operation: String,
    /// `""` for the tenant's queue of the class, `"=" + value` for a
    /// fairness key value's.
    pub key: String,
    /// Virtual time: lower turns are served first.
    pub turn: i64,
}

impl ClaimQueue {
    /// The fairness key value of a value's queue; `None` for a tenant's.
    pub fn fairness_value(&self) -> Option<&str> {
        self.key.strip_prefix('=')
    }
}

/// Whether `task` waits to be claimed (ready or in backoff): it keeps its
/// claim queues in the turn order.
pub fn waits(task: &Task) -> bool {
    task.control.active_attempt_id.is_none()
        && task.control.next_kind.is_some()
        && matches!(
            task.state,
            TaskState::Queued | TaskState::RetryWait | TaskState::Reconciling
        )
}

/// The `claim_turns` key of a fairness key value's queue.
pub fn value_key(value: &str) -> String {
    format!("={value}")
}

/// A (tenant, class) pair: where a sweep's walk of the pairs with tasks in
/// the claimable states stopped ([`crate::Tx::open_missing_queues`]); the
/// next walk starts after it, in (tenant, operation) order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueuePair {
    /// Tenant.
    pub tenant: String,
    /// Operation class.
    pub operation: String,
}

/// The caps of one class (`[operations.X.flow]`); `None` = no cap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassCaps {
    /// Leased attempts of the class, all tenants.
    pub cap: Option<i64>,
    /// Leased attempts of the class per tenant.
    pub tenant_cap: Option<i64>,
    /// Leased attempts per concurrency key value (tasks without a key are
    /// not limited by it).
    pub concurrency_key_cap: Option<i64>,
}

/// What a claim brings of the configuration (the store holds none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimFlow {
    /// The tenants a pool key serves; `None`: the claim's tenant only.
    pub serves: Option<Serves>,
    /// The requested classes that declare a `fairness_key`.
    pub fair_classes: Vec<String>,
    /// Round-robin weights of tenants (`[tenants."T"] weight`, ≥ 1); 1
    /// when absent.
    pub weights: BTreeMap<String, i64>,
    /// Each tenant's cap over all classes (`[tenants."T"] cap`, SPEC §8
    /// "Concurrency caps"); a tenant not named has none.
    pub tenant_caps: BTreeMap<String, i64>,
    /// Each class's caps, by class name; a class not named has none.
    pub classes: BTreeMap<String, ClassCaps>,
    /// Attempt starts per class (`flow.attempt_starts_per_s`, SPEC §8.1):
    /// each lease takes a token of the class's `starts:<class>` bucket;
    /// without one the claim leases no more of that class.
    pub starts_per_s: BTreeMap<String, idem_core::flow::RateLimit>,
}

impl ClaimFlow {
    /// Whether the claim goes by turns: a pool key, or a class with a
    /// fairness key among `operations`. A claim that does not leases as
    /// [`crate::Tx::claimable`] orders, with no turn bookkeeping.
    pub fn by_turns(&self, operations: &[String]) -> bool {
        self.serves.is_some() || operations.iter().any(|o| self.is_fair(o))
    }

    /// Whether `operation` declares a fairness key.
    pub fn is_fair(&self, operation: &str) -> bool {
        self.fair_classes.iter().any(|c| c == operation)
    }

    /// How far a tenant's queue's turn advances per lease.
    pub fn step(&self, tenant: &str) -> i64 {
        TURN / self
            .weights
            .get(tenant)
            .copied()
            .unwrap_or(1)
            .clamp(1, TURN)
    }
}

/// What the conformance suite does to a tenant class's claim queues to stand
/// for states other writers leave ([`crate::Tx::tamper_queues`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueTamper {
    /// Parked, waiting tasks or not: as a claim that parked a queue while a
    /// task of it was being written leaves it.
    Park,
    /// Deleted (the tenant's row and its values'): as a binary of a schema
    /// before the claim queues leaves its tasks.
    Forget,
}
