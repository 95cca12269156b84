//! The names of the properties the model checks (SPEC §2) and the
//! invariants that read a whole state.

use idem_core::model::{CancelStatus, TaskState};

use crate::state::{State, TaskRow, violation};

/// SPEC §2.1.
pub const ONE_TASK_PER_SCOPE: &str = "one task per scope (SPEC §2.1)";
/// SPEC §2.2, §2.3.
pub const SUBMIT_CHANGES_NOTHING: &str =
    "a replay or a conflicting submit changes nothing (SPEC §2.2, §2.3)";
/// SPEC §2.2, §2.3.
pub const SAME_REQUEST_REPLAYS: &str = "a submit to a taken scope replays exactly the accepted request, and conflicts for any other (SPEC §2.2, §2.3)";
/// SPEC §4 "Details".
pub const REPEAT_ANSWERED_AS_BEFORE: &str =
    "an exact repeat of an applied report is answered as before and changes nothing (SPEC §4)";
/// The in-memory store.
pub const STORE_NEVER_FAILS: &str =
    "every operation commits or refuses: none fails on the in-memory store";
/// SPEC §2.4.
pub const NO_CHANGE_FROM_OLD_GENERATION: &str =
    "no state change from an old generation (SPEC §2.4)";
/// SPEC §2.4.
pub const GENERATIONS_INCREASE: &str = "generations strictly increase (SPEC §2.4)";
/// SPEC §2.6.
pub const DELIVERY_ONCE: &str = "at most one delivery and one charge (SPEC §2.6)";
/// SPEC §2.5 and "not promised".
pub const EFFECT_ONCE: &str = "at most one effect per non-safe task at the provider, and a delivery only for an effect (SPEC §2.5)";
/// SPEC §2.5.
pub const RECONCILE_BEFORE_REPEAT: &str =
    "reconcile before any repeat after an unknown outcome (SPEC §2.5)";
/// SPEC §2.7.
pub const CANCEL_XOR_DELIVERY: &str = "cancellation and delivery never both (SPEC §2.7)";
/// SPEC §2.7, §2.10.
pub const USAGE_KEPT: &str = "usage is kept: never lost, never lowered (SPEC §2.7, §2.10)";
/// Liveness.
pub const EVERY_TASK_ENDS: &str =
    "every task ends terminal once faults stop (liveness, drained runs)";
/// SPEC §8.2 "Concurrency caps".
pub const CAP_HOLDS: &str =
    "never more attempts leased at once per concurrency key than its cap (SPEC §5)";
/// Witness.
pub const REACHED_CAPPED: &str =
    "reached: a task waits, with no attempt, while its concurrency key's cap is held";
/// Witness.
pub const REACHED_DELIVERY: &str = "reached: a task is delivered";
/// Witness.
pub const REACHED_RECONCILE: &str = "reached: a reconcile attempt settles an unknown outcome";
/// Witness.
pub const REACHED_STALE_REPORT: &str = "reached: a stale report is kept as evidence";
/// Witness.
pub const REACHED_CANCEL_LOST: &str = "reached: a pending cancellation loses to delivery";
/// Witness.
pub const REACHED_CANCEL_CONFIRMED: &str =
    "reached: a pending cancellation is confirmed after the attempt stopped";
/// Witness.
pub const REACHED_LEASE_EXPIRED: &str = "reached: a lease expires";
/// Witness.
pub const REACHED_REPEAT: &str =
    "reached: a report whose answer was lost is sent again and answered as before";
/// Witness.
pub const REACHED_REVOKED: &str =
    "reached: a task ends at a claim because its submitting key was revoked";
/// Witness.
pub const REACHED_RESUBMIT: &str =
    "reached: a key released after retention is submitted again and makes a new task";
/// Witness.
pub const REACHED_TWO_TENANTS: &str =
    "reached: tasks of two tenants under the same idempotency key are both delivered";
/// Witness.
pub const REACHED_RELEASE: &str =
    "reached: a task with a released attempt ends (the attempt given back unstarted)";

/// No two scope rows of one key, and each names a task of its key.
pub(crate) fn one_task_per_scope(s: &State) -> bool {
    let mut seen = 0u64;
    for sc in &s.scopes {
        let bit = 1u64 << (sc.key % 64);
        let names_own = s
            .task_index(sc.task_id)
            .is_some_and(|i| s.tasks[i].key == sc.key);
        if seen & bit != 0 || !names_own {
            return false;
        }
        seen |= bit;
    }
    true
}

pub(crate) fn generations_increase(s: &State) -> bool {
    s.violations & violation::GENERATION_DECREASED == 0
        && s.tasks.iter().all(|r| {
            r.attempts
                .windows(2)
                .all(|w| w[0].number < w[1].number && w[0].generation < w[1].generation)
                && r.attempts.iter().all(|a| a.generation <= r.task.generation)
        })
}

pub(crate) fn delivery_once(s: &State) -> bool {
    s.violations & violation::DELIVERY_CHANGED == 0
        && s.tasks.iter().all(|r: &TaskRow| {
            r.deliveries <= 1
                && r.task.delivery.as_ref().is_none_or(|d| {
                    d.charge == r.task.contract.price
                        && r.task.cancellation.as_ref().is_none_or(|c| {
                            c.status != CancelStatus::TooLate || c.fee == Some(d.charge)
                        })
                })
        })
}

pub(crate) fn effect_once(s: &State) -> bool {
    s.tasks
        .iter()
        .zip(&s.ledger)
        .all(|(r, l)| (r.safe() || l.repeats == 0) && (r.task.delivery.is_none() || l.applied))
}

pub(crate) fn cancel_xor_delivery(s: &State) -> bool {
    s.tasks.iter().all(|r| {
        let confirmed = r.task.state == TaskState::Cancelled
            || r.task
                .cancellation
                .as_ref()
                .is_some_and(|c| c.status == CancelStatus::Confirmed);
        !(confirmed && r.task.delivery.is_some())
    })
}

pub(crate) fn usage_kept(s: &State) -> bool {
    s.violations & violation::USAGE_DECREASED == 0
        && s.tasks
            .iter()
            .all(|r| r.task.usage == r.attempts.iter().map(|a| a.usage).sum::<i64>())
}

/// Tasks holding a lease, per (tenant, class, concurrency key): at most `cap`.
pub(crate) fn cap_holds(s: &State, cap: u8) -> bool {
    let mut held: std::collections::HashMap<(&str, &str, &str), u8> =
        std::collections::HashMap::new();
    for r in &s.tasks {
        let t = &r.task;
        if let (Some(key), Some(_)) = (&t.control.concurrency_key, t.control.active_attempt_id) {
            let n = held
                .entry((
                    t.control.tenant.as_str(),
                    t.operation.as_str(),
                    key.as_str(),
                ))
                .or_default();
            *n += 1;
            if *n > cap {
                return false;
            }
        }
    }
    true
}

/// A concurrency key has `cap` leased attempts while another of its tasks
/// that never had an attempt waits, claimable, for a slot.
pub(crate) fn capped_task_waits(s: &State, cap: u8) -> bool {
    let leased = s
        .tasks
        .iter()
        .filter(|r| r.task.control.active_attempt_id.is_some())
        .count();
    leased == usize::from(cap)
        && s.tasks.iter().any(|r| {
            r.task.state == TaskState::Queued
                && r.task.attempt_count == 0
                && r.task.control.ready_at <= crate::setup::at(s.clock)
        })
}
