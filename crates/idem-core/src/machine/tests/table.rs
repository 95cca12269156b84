//! Every (task state, event) pair of the state machine, legal and illegal,
//! on a safe and a non-safe class: each task is built in its state through
//! legal transitions only, then one event is applied and the answer compared
//! with the table.

use super::*;

/// Builds a task in `state` (with its latest attempt) through legal transitions only.
pub(super) fn in_state(state: TaskState, class: &str) -> (Task, Option<Attempt>) {
    let (mut t, mut j) = new_task(class);
    let now = T0;
    let a = match state {
        TaskState::Queued => None,
        TaskState::Running => Some(claim_now(&mut t, &mut j, 1, now)),
        TaskState::RetryWait => {
            let mut a = claim_now(&mut t, &mut j, 1, now);
            report(&mut t, &mut a, &mut j, &rep(1, Outcome::Failed), now).unwrap();
            assert_eq!(
                t.state,
                TaskState::RetryWait,
                "RetryWait needs a safe class"
            );
            Some(a)
        }
        TaskState::Reconciling => {
            let mut a = claim_now(&mut t, &mut j, 1, now);
            report(&mut t, &mut a, &mut j, &rep(1, Outcome::Unknown), now).unwrap();
            Some(a)
        }
        TaskState::Succeeded => {
            let mut a = claim_now(&mut t, &mut j, 1, now);
            report(&mut t, &mut a, &mut j, &rep(1, Outcome::Succeeded), now).unwrap();
            Some(a)
        }
        TaskState::Failed => {
            let mut a = claim_now(&mut t, &mut j, 1, now);
            let mut r = rep(1, Outcome::Failed);
            r.failure_class = Some(FailureClass::InvalidInput);
            report(&mut t, &mut a, &mut j, &r, now).unwrap();
            Some(a)
        }
        TaskState::Cancelled => {
            cancel(&mut t, &mut j, now);
            None
        }
    };
    assert_eq!(t.state, state);
    (t, a)
}

/// One event applied to a task in some state; the answer is summarised as
/// `<new state>` or `<new state>!<error kind>`.
fn apply(state: TaskState, class: &str, event: &str) -> String {
    let (mut t, a) = in_state(state, class);
    let mut j = Journal::default();
    // Far enough in the future that every backoff has passed, but before the deadline.
    let later = T0.plus_ms(600_000);
    let now = T0.plus_ms(10);
    let mut a = a.unwrap_or_else(|| Attempt {
        id: Uuid::from_u128(999),
        task_id: t.id,
        number: 0,
        generation: 0,
        kind: AttemptKind::Execute,
        state: AttemptState::Expired,
        executor_id: "none".into(),
        leased_at: T0,
        lease_expires_at: T0,
        usage: 0,
        external_txn_id: None,
        evidence: vec![],
        lease_ms: 1000,
        report: None,
    });
    let g = t.generation;
    let res: Result<(), Rejection> = match event {
        "claim" => claim(
            &mut t,
            &mut j,
            Uuid::from_u128(500),
            "ex2",
            None,
            Authority::Granted,
            later,
        )
        .map(|_| ()),
        "claim_revoked" => claim(
            &mut t,
            &mut j,
            Uuid::from_u128(500),
            "ex2",
            None,
            Authority::Revoked,
            later,
        )
        .map(|_| ()),
        "heartbeat" => heartbeat(&mut t, &mut a, &mut j, g, Some(1), now).map(|_| ()),
        "ack" => acknowledge(&mut t, &mut a, &mut j, g, json!({}), now),
        "release" => release(&mut t, &mut a, &mut j, g, now),
        "expire" => {
            expire_lease(&mut t, &mut a, &mut j, later);
            Ok(())
        }
        "cancel" => {
            cancel(&mut t, &mut j, now);
            Ok(())
        }
        "wake" => {
            wake(&mut t, &mut j, later);
            Ok(())
        }
        "delivery_ack" => acknowledge_delivery(&mut t, &mut j, now),
        other => {
            let outcome: Outcome = other.strip_prefix("report_").unwrap().parse().unwrap();
            let mut r = rep(g, outcome);
            if outcome == Outcome::Cancelled {
                r.result = None;
            }
            report(&mut t, &mut a, &mut j, &r, now)
        }
    };
    // Invariants after every single step.
    if let Some(active) = t.control.active_attempt_id {
        assert!(!t.state.is_terminal(), "terminal task holds a lease");
        let _ = active;
    }
    assert!(t.control.event_seq as usize >= j.events.len());
    assert!(
        !(t.delivery.is_some() && t.state == TaskState::Cancelled),
        "delivered and cancelled"
    );
    match res {
        Ok(()) => t.state.as_str().to_owned(),
        Err(e) => {
            let kind = match e {
                Rejection::StaleGeneration { .. } => "stale",
                Rejection::AlreadyReported { .. } => "already_reported",
                Rejection::InvalidReport(_) => "invalid",
                Rejection::NotDelivered => "not_delivered",
                Rejection::NotClaimable => "not_claimable",
                Rejection::Acknowledged => "acknowledged",
                Rejection::UsageRecorded { .. } => "usage_recorded",
            };
            format!("{}!{kind}", t.state)
        }
    }
}

const EVENTS: &[&str] = &[
    "claim",
    "claim_revoked",
    "heartbeat",
    "ack",
    "report_succeeded",
    "report_failed",
    "report_unknown",
    "report_cancelled",
    "report_committed",
    "report_not_committed",
    "expire",
    "cancel",
    "wake",
    "delivery_ack",
    "release",
];

/// The full table for the safe class `generation.dispatch`. Columns follow `EVENTS`.
/// Reports and heartbeats go to the task's newest attempt with the task's current
/// generation: in `retry_wait`, `reconciling` and the terminal states that attempt
/// already has an outcome, so an exact repeat answers Ok and another outcome
/// `already_reported` (SPEC §4 "Details").
const SAFE: &[(&str, &[&str])] = &[
    (
        "queued",
        &[
            "running",
            "failed",
            "queued!stale",
            "queued!stale",
            "queued!stale",
            "queued!stale",
            "queued!stale",
            "queued!stale",
            "queued!invalid",
            "queued!invalid",
            "queued",
            "cancelled",
            "queued",
            "queued!not_delivered",
            "queued!stale",
        ],
    ),
    (
        "running",
        &[
            "running!not_claimable",
            "running!not_claimable",
            "running",
            "running",
            "succeeded",
            "retry_wait",
            "reconciling",
            "running!invalid",
            "running!invalid",
            "running!invalid",
            "retry_wait",
            "running",
            "running",
            "running!not_delivered",
            "queued",
        ],
    ),
    (
        "retry_wait",
        &[
            "running",
            "failed",
            "retry_wait!stale",
            "retry_wait!stale",
            "retry_wait!already_reported",
            "retry_wait",
            "retry_wait!already_reported",
            "retry_wait!already_reported",
            "retry_wait!invalid",
            "retry_wait!invalid",
            "retry_wait",
            "cancelled",
            "queued",
            "retry_wait!not_delivered",
            "retry_wait!already_reported",
        ],
    ),
    (
        "reconciling",
        &[
            "reconciling",
            "reconciling",
            "reconciling!stale",
            "reconciling!stale",
            "reconciling!already_reported",
            "reconciling!already_reported",
            "reconciling",
            "reconciling!already_reported",
            "reconciling!invalid",
            "reconciling!invalid",
            "reconciling",
            "reconciling",
            "reconciling",
            "reconciling!not_delivered",
            "reconciling!already_reported",
        ],
    ),
    (
        "succeeded",
        &[
            "succeeded!not_claimable",
            "succeeded!not_claimable",
            "succeeded!stale",
            "succeeded!stale",
            "succeeded",
            "succeeded!already_reported",
            "succeeded!already_reported",
            "succeeded!already_reported",
            "succeeded!invalid",
            "succeeded!invalid",
            "succeeded",
            "succeeded",
            "succeeded",
            "succeeded",
            "succeeded!already_reported",
        ],
    ),
    (
        "failed",
        &[
            "failed!not_claimable",
            "failed!not_claimable",
            "failed!stale",
            "failed!stale",
            "failed!already_reported",
            "failed",
            "failed!already_reported",
            "failed!already_reported",
            "failed!invalid",
            "failed!invalid",
            "failed",
            "failed",
            "failed",
            "failed!not_delivered",
            "failed!already_reported",
        ],
    ),
    (
        "cancelled",
        &[
            "cancelled!not_claimable",
            "cancelled!not_claimable",
            "cancelled!stale",
            "cancelled!stale",
            "cancelled!stale",
            "cancelled!stale",
            "cancelled!stale",
            "cancelled!stale",
            "cancelled!invalid",
            "cancelled!invalid",
            "cancelled",
            "cancelled",
            "cancelled",
            "cancelled!not_delivered",
            "cancelled!stale",
        ],
    ),
];

#[test]
fn every_state_event_pair_on_the_safe_class() {
    check_table("generation.dispatch", SAFE);
}

/// The non-safe class `payment.release` differs where a retry or expiry decides.
#[test]
fn every_state_event_pair_on_the_non_safe_class() {
    let mut table: Vec<(&str, Vec<&str>)> =
        SAFE.iter().map(|(s, row)| (*s, row.to_vec())).collect();
    for (state, row) in &mut table {
        if *state == "running" {
            row[5] = "failed"; // transient on a non-safe class ends the task
            row[10] = "reconciling"; // expired lease: outcome unknown
        }
    }
    // retry_wait cannot be reached on a non-safe class.
    table.retain(|(s, _)| *s != "retry_wait");
    let table: Vec<(&str, &[&str])> = table.iter().map(|(s, r)| (*s, r.as_slice())).collect();
    check_table("payment.release", &table);
}

fn check_table(class: &str, table: &[(&str, &[&str])]) {
    let mut mismatches = Vec::new();
    for (state, row) in table {
        assert_eq!(row.len(), EVENTS.len());
        let st: TaskState = state.parse().unwrap();
        for (event, expected) in EVENTS.iter().zip(row.iter()) {
            let got = apply(st, class, event);
            if &got != expected {
                mismatches.push(format!(
                    "{class} {state} + {event}: expected {expected}, got {got}"
                ));
            }
        }
    }
    assert!(mismatches.is_empty(), "\n{}", mismatches.join("\n"));
}
