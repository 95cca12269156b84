//! The scenarios of SPEC §2.4–2.7 on the state machine; every (task state,
//! event) pair, legal and illegal, is in [`table`].

use serde_json::json;
use uuid::Uuid;

use super::*;
use crate::config::{Config, Contract};
use crate::model::EventKind;

/// An event's data as the JSON the store writes and the API serves.
fn data_of(e: &Event) -> Value {
    serde_json::to_value(&e.data).unwrap()
}

const T0: Timestamp = Timestamp(1_000_000);

fn contract(class: &str) -> Contract {
    Config::bundled().unwrap().contract(class).unwrap()
}

fn new_task(class: &str) -> (Task, Journal) {
    accept(
        NewTask {
            id: Uuid::from_u128(1),
            tenant: "acme".into(),
            operation: class.into(),
            idempotency_key: "k1".into(),
            fingerprint: "sha256:00".into(),
            canonical_request: "{}".into(),
            params: json!({"amount": 100}),
            contract: crate::contract::FrozenContract::new(contract(class)).unwrap(),
            api_key_id: Uuid::from_u128(9),
            grant: None,
            traceparent: None,
            priority: 3,
            fairness_key: None,
        },
        T0,
    )
}

fn rep(generation: i64, outcome: Outcome) -> Report {
    let failure_class = (outcome == Outcome::Failed).then_some(FailureClass::Transient);
    Report {
        generation,
        outcome,
        result: Some(json!({"ok": true})),
        failure_class,
        message: None,
        usage: Some(3),
        external_txn_id: Some("tx-1".into()),
        body: json!({"generation": generation, "outcome": outcome.as_str()}),
    }
}

fn claim_now(t: &mut Task, j: &mut Journal, n: u128, now: Timestamp) -> Attempt {
    claim(
        t,
        j,
        Uuid::from_u128(100 + n),
        "ex",
        Some(1_000),
        Authority::Granted,
        now,
    )
    .unwrap()
    .unwrap()
}

mod second_effects;
mod table;

use table::in_state;

#[test]
fn generations_strictly_increase_and_stale_reports_are_evidence() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    assert_eq!(
        (a1.number, a1.generation, a1.kind),
        (1, 1, AttemptKind::Execute)
    );
    expire_lease(&mut t, &mut a1, &mut j, T0.plus_ms(1_000));
    assert_eq!(t.state, TaskState::RetryWait);
    let ready = t.control.ready_at;
    assert!(
        claim(
            &mut t,
            &mut j,
            Uuid::from_u128(2),
            "ex",
            None,
            Authority::Granted,
            T0.plus_ms(1_001)
        )
        .is_err()
    );
    let mut a2 = claim_now(&mut t, &mut j, 2, ready);
    assert_eq!((a2.number, a2.generation), (2, 2));
    let before = t.clone();
    let err = report(&mut t, &mut a1, &mut j, &rep(1, Outcome::Succeeded), ready).unwrap_err();
    assert_eq!(
        err,
        Rejection::StaleGeneration {
            presented: 1,
            current: 2
        }
    );
    assert_eq!(t.state, before.state);
    assert_eq!(t.delivery, None);
    assert_eq!(
        a1.evidence.last().unwrap().disposition,
        Disposition::StaleGeneration
    );
    report(&mut t, &mut a2, &mut j, &rep(2, Outcome::Succeeded), ready).unwrap();
    assert_eq!(t.delivery.as_ref().unwrap().charge, t.contract.price);
}

#[test]
fn non_safe_reconciliation_paths() {
    // committed → delivered, no further execute attempt.
    let (mut t, mut j) = new_task("payment.release");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    expire_lease(&mut t, &mut a1, &mut j, T0.plus_ms(2_000));
    assert_eq!(t.state, TaskState::Reconciling);
    let mut r = claim_now(&mut t, &mut j, 2, T0.plus_ms(2_000));
    assert_eq!(r.kind, AttemptKind::Reconcile);
    report(
        &mut t,
        &mut r,
        &mut j,
        &rep(2, Outcome::Committed),
        T0.plus_ms(2_001),
    )
    .unwrap();
    assert_eq!(t.state, TaskState::Succeeded);
    assert_eq!(t.control.execute_count, 1);
    // not_committed → a new execute attempt with a higher generation.
    let (mut t, mut j) = new_task("payment.release");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a1, &mut j, &rep(1, Outcome::Unknown), T0).unwrap();
    let mut r = claim_now(&mut t, &mut j, 2, T0);
    report(&mut t, &mut r, &mut j, &rep(2, Outcome::NotCommitted), T0).unwrap();
    // … after the contract's backoff for the second execute attempt, as a
    // transient failure's retry: never at once.
    assert_eq!(t.state, TaskState::RetryWait);
    let backoff = t.contract.retry.backoff.delay_ms(2);
    assert!(backoff > 0);
    assert_eq!(t.control.ready_at, T0.plus_ms(backoff));
    assert!(!is_claimable(&t, T0.plus_ms(backoff - 1)));
    wake(&mut t, &mut j, T0.plus_ms(backoff));
    let a3 = claim_now(&mut t, &mut j, 3, T0.plus_ms(backoff));
    assert_eq!((a3.kind, a3.generation), (AttemptKind::Execute, 3));
    // A failed reconcile attempt leads to another reconcile, never to execute.
    let (mut t, mut j) = new_task("payment.release");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a1, &mut j, &rep(1, Outcome::Unknown), T0).unwrap();
    let mut r = claim_now(&mut t, &mut j, 2, T0);
    report(&mut t, &mut r, &mut j, &rep(2, Outcome::Failed), T0).unwrap();
    assert_eq!(t.state, TaskState::Reconciling);
    assert_eq!(t.control.next_kind, Some(AttemptKind::Reconcile));
}

#[test]
fn retry_limits_attempts_deadline_budget() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut now = T0;
    for n in 1..=5u128 {
        now = now.plus_ms(60_000);
        let mut a = claim_now(&mut t, &mut j, n, now);
        let mut r = rep(a.generation, Outcome::Failed);
        if n == 5 {
            r.message = Some("gpu timeout".into());
        }
        report(&mut t, &mut a, &mut j, &r, now).unwrap();
    }
    assert_eq!(
        t.failure.as_ref().unwrap().class,
        FailureClass::AttemptsExhausted
    );
    // The failure names the limit, then what the last attempt said.
    assert_eq!(
        t.failure.as_ref().unwrap().message,
        "all 5 execute attempts used; last attempt: gpu timeout"
    );

    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    let past = T0.plus_ms(t.contract.retry.deadline_ms + 1);
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Failed), T0).unwrap();
    assert!(
        claim(
            &mut t,
            &mut j,
            Uuid::from_u128(7),
            "ex",
            None,
            Authority::Granted,
            past
        )
        .unwrap()
        .is_none()
    );
    assert_eq!(
        t.failure.as_ref().unwrap().class,
        FailureClass::DeadlineExceeded
    );

    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    let mut r = rep(1, Outcome::Failed);
    r.usage = Some(t.contract.retry.usage_budget + 1);
    report(&mut t, &mut a, &mut j, &r, T0).unwrap();
    assert_eq!(
        t.failure.as_ref().unwrap().class,
        FailureClass::BudgetExhausted
    );
    // A failure reported without a message still says what ended the task.
    assert_eq!(
        t.failure.as_ref().unwrap().message,
        format!(
            "usage {} over the budget of {}",
            t.contract.retry.usage_budget + 1,
            t.contract.retry.usage_budget
        )
    );
}

#[test]
fn cancellation_fees_follow_the_frozen_contract() {
    // Before start.
    let (mut t, mut j) = new_task("payment.release");
    let c = cancel(&mut t, &mut j, T0);
    assert_eq!((c.status, c.fee), (CancelStatus::Confirmed, Some(0)));
    assert_eq!(t.generation, 1);
    assert!(!is_claimable(&t, T0.plus_ms(1_000_000)));
    // After start: requested, then the executor confirms with usage.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    assert_eq!(cancel(&mut t, &mut j, T0).status, CancelStatus::Requested);
    assert!(
        heartbeat(&mut t, &mut a, &mut j, 1, None, T0)
            .unwrap()
            .cancel_requested
    );
    let mut r = rep(1, Outcome::Cancelled);
    r.usage = Some(7);
    report(&mut t, &mut a, &mut j, &r, T0).unwrap();
    let c = t.cancellation.clone().unwrap();
    assert_eq!((c.status, c.fee), (CancelStatus::Confirmed, Some(10 + 7)));
    assert_eq!(t.generation, 2);
    let late = report(&mut t, &mut a, &mut j, &rep(1, Outcome::Succeeded), T0).unwrap_err();
    assert!(matches!(late, Rejection::StaleGeneration { .. }));
    assert_eq!(t.state, TaskState::Cancelled);
    // Delivery wins over a pending cancel.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    cancel(&mut t, &mut j, T0);
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Succeeded), T0).unwrap();
    let c = t.cancellation.clone().unwrap();
    assert_eq!(
        (t.state, c.status, c.fee),
        (TaskState::Succeeded, CancelStatus::TooLate, Some(100))
    );
    // Cancel after delivery: too_late, fee = charge; twice → same record.
    let first = cancel(&mut t, &mut j, T0.plus_ms(5));
    assert_eq!(first, cancel(&mut t, &mut j, T0.plus_ms(9)));
    // Pending cancel + expiry on the non-safe class: reconcile first.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    cancel(&mut t, &mut j, T0);
    expire_lease(&mut t, &mut a, &mut j, T0.plus_ms(5_000));
    assert_eq!(t.state, TaskState::Reconciling);
    let mut r = claim_now(&mut t, &mut j, 2, T0.plus_ms(5_000));
    report(
        &mut t,
        &mut r,
        &mut j,
        &rep(2, Outcome::NotCommitted),
        T0.plus_ms(5_001),
    )
    .unwrap();
    assert_eq!(
        t.cancellation.as_ref().unwrap().status,
        CancelStatus::Confirmed
    );
    // Safe class: confirmed at expiry.
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    cancel(&mut t, &mut j, T0);
    expire_lease(&mut t, &mut a, &mut j, T0.plus_ms(5_000));
    assert_eq!(t.state, TaskState::Cancelled);
}

#[test]
fn repeated_and_conflicting_reports() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Succeeded), T0).unwrap();
    let delivered = t.delivery.clone();
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Succeeded), T0).unwrap();
    assert_eq!(t.delivery, delivered);
    let e = report(&mut t, &mut a, &mut j, &rep(1, Outcome::Unknown), T0).unwrap_err();
    assert!(matches!(e, Rejection::AlreadyReported { .. }));
    assert_eq!(a.evidence.len(), 3);
}

#[test]
fn revoked_authority_fails_instead_of_executing() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let got = claim(
        &mut t,
        &mut j,
        Uuid::from_u128(3),
        "ex",
        None,
        Authority::Revoked,
        T0,
    )
    .unwrap();
    assert!(got.is_none());
    assert_eq!(t.failure.unwrap().class, FailureClass::PermissionDenied);
}

#[test]
fn device_ack_does_not_complete() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    acknowledge(&mut t, &mut a, &mut j, 1, json!({}), T0).unwrap();
    assert_eq!(
        (t.state, a.state),
        (TaskState::Running, AttemptState::Acknowledged)
    );
    assert!(
        j.events
            .iter()
            .any(|e| e.kind == EventKind::CommandAcknowledged)
    );
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Succeeded), T0).unwrap();
    assert!(
        j.events
            .iter()
            .any(|e| e.kind == EventKind::CompletionObserved)
    );
}

#[test]
fn failed_reconcile_with_pending_cancel_keeps_reconciling() {
    // An unknown payout must be reconciled before a cancellation can be confirmed.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Unknown), T0).unwrap();
    let mut r = claim_now(&mut t, &mut j, 2, T0);
    assert_eq!(cancel(&mut t, &mut j, T0).status, CancelStatus::Requested);
    report(&mut t, &mut r, &mut j, &rep(2, Outcome::Failed), T0).unwrap();
    assert_eq!(t.state, TaskState::Reconciling);
    assert!(t.cancel_pending());
    let mut r2 = claim_now(&mut t, &mut j, 3, T0.plus_ms(60_000));
    assert_eq!(r2.kind, AttemptKind::Reconcile);
    report(
        &mut t,
        &mut r2,
        &mut j,
        &rep(3, Outcome::Committed),
        T0.plus_ms(60_000),
    )
    .unwrap();
    assert_eq!(t.state, TaskState::Succeeded);
    assert_eq!(t.cancellation.unwrap().status, CancelStatus::TooLate);
}

#[test]
fn exact_repeat_of_an_older_attempts_report_is_answered_again() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a1, &mut j, &rep(1, Outcome::Failed), T0).unwrap();
    let _a2 = claim_now(&mut t, &mut j, 2, T0.plus_ms(60_000));
    // The same body again (the executor lost the answer): 200, as before.
    report(
        &mut t,
        &mut a1,
        &mut j,
        &rep(1, Outcome::Failed),
        T0.plus_ms(60_001),
    )
    .unwrap();
    assert_eq!(a1.evidence.last().unwrap().disposition, Disposition::Repeat);
    // A different one is stale.
    let e = report(
        &mut t,
        &mut a1,
        &mut j,
        &rep(1, Outcome::Succeeded),
        T0.plus_ms(60_002),
    )
    .unwrap_err();
    assert!(matches!(e, Rejection::StaleGeneration { .. }));
    assert_eq!(t.state, TaskState::Running);
}

#[test]
fn usage_and_fees_stay_within_the_integers_idem_reads() {
    let max = crate::json::MAX_SAFE_INTEGER as i64;
    // A cancellation fee of the fixed part plus usage × price stops at 2^53−1.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    assert_eq!(cancel(&mut t, &mut j, T0).status, CancelStatus::Requested);
    let mut r = rep(1, Outcome::Cancelled);
    r.usage = Some(max);
    report(&mut t, &mut a, &mut j, &r, T0).unwrap();
    assert_eq!(t.usage, max);
    assert_eq!(t.cancellation.as_ref().unwrap().fee, Some(max));
    // A task's usage total (the sum over its attempts) stops there too.
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    t.usage = max - 1;
    add_usage(&mut t, &mut a, Some(5));
    assert_eq!((t.usage, a.usage), (max, 5));
}

/// A `cancelled` report that arrives after its lease expired is a late report
/// like any other: 409 stale, kept as evidence (SPEC §2.4), not a 400 that
/// drops it. On a current attempt with no pending cancellation it is refused
/// as input and nothing is stored.
#[test]
fn late_cancelled_report_is_kept_as_evidence() {
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    let before = t.clone();
    let err = report(&mut t, &mut a, &mut j, &rep(1, Outcome::Cancelled), T0).unwrap_err();
    assert!(matches!(err, Rejection::InvalidReport(_)), "{err:?}");
    assert!(a.evidence.is_empty());
    assert_eq!((t.state, t.generation), (before.state, before.generation));
    // The lease runs out; the same report now comes late.
    let late = T0.plus_ms(1_000);
    let err = report(&mut t, &mut a, &mut j, &rep(1, Outcome::Cancelled), late).unwrap_err();
    assert!(
        matches!(err, Rejection::StaleGeneration { presented: 1, .. }),
        "{err:?}"
    );
    assert_eq!(
        a.evidence.last().unwrap().disposition,
        Disposition::StaleGeneration
    );
    assert_eq!(t.cancellation, None);
}

/// Usage raised by a heartbeat is in the event history when it is raised
/// (SPEC §2.10), even if the attempt never reports; a heartbeat that does not
/// raise it records nothing.
#[test]
fn heartbeat_usage_is_recorded_as_an_event() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    let events = j.events.len();
    heartbeat(&mut t, &mut a, &mut j, 1, Some(11), T0.plus_ms(10)).unwrap();
    let e = j.events.last().unwrap();
    assert_eq!(e.kind, EventKind::UsageRecorded);
    assert_eq!(data_of(e)["usage"], 11);
    assert_eq!(data_of(e)["task_usage"], 11);
    assert_eq!(j.events.len(), events + 1);
    heartbeat(&mut t, &mut a, &mut j, 1, Some(11), T0.plus_ms(20)).unwrap();
    heartbeat(&mut t, &mut a, &mut j, 1, Some(4), T0.plus_ms(30)).unwrap();
    heartbeat(&mut t, &mut a, &mut j, 1, None, T0.plus_ms(40)).unwrap();
    assert_eq!(j.events.len(), events + 1);
    assert_eq!(t.usage, 11);
}

/// A released execute attempt counts against no limit: with every attempt
/// of `payment.release` (3) released, the task is still claimable and runs.
#[test]
fn released_attempts_count_against_no_limit_and_need_no_reconcile() {
    let (mut t, mut j) = new_task("payment.release");
    let limit = t.execute_limit();
    for n in 1..=(limit as u128 + 2) {
        let mut a = claim_now(&mut t, &mut j, n, T0);
        let g = a.generation;
        release(&mut t, &mut a, &mut j, g, T0).unwrap();
        assert_eq!(a.state, AttemptState::Released);
        assert_eq!(
            (
                t.state,
                t.control.execute_count,
                t.control.active_attempt_id
            ),
            (TaskState::Queued, 0, None)
        );
        assert_eq!(t.control.next_kind, Some(AttemptKind::Execute));
        assert!(is_claimable(&t, T0), "claimable at once");
        assert_eq!(j.events.last().unwrap().kind, EventKind::AttemptReleased);
    }
    let mut a = claim_now(&mut t, &mut j, 50, T0);
    assert_eq!(a.generation, limit + 3, "generations still only grow");
    let g = a.generation;
    report(&mut t, &mut a, &mut j, &rep(g, Outcome::Succeeded), T0).unwrap();
    assert_eq!(t.state, TaskState::Succeeded);
    assert!(
        j.events
            .iter()
            .all(|e| e.kind != EventKind::ReconciliationRequired),
        "nothing ran, so nothing is reconciled"
    );
}

#[test]
fn release_is_fenced_and_refused_once_the_attempt_started() {
    // An exact repeat changes nothing and is answered again.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    release(&mut t, &mut a, &mut j, 1, T0).unwrap();
    let (before, events) = (t.clone(), j.events.len());
    release(&mut t, &mut a, &mut j, 1, T0.plus_ms(5)).unwrap();
    assert_eq!((t, j.events.len()), (before, events));
    // An old generation, and a lease that ran out (expired first: the
    // non-safe class reconciles).
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    let stale = release(&mut t, &mut a, &mut j, 0, T0).unwrap_err();
    assert!(matches!(stale, Rejection::StaleGeneration { .. }));
    assert_eq!(a.state, AttemptState::Leased);
    let late = release(&mut t, &mut a, &mut j, 1, T0.plus_ms(1_000)).unwrap_err();
    assert!(matches!(late, Rejection::StaleGeneration { .. }));
    assert_eq!(
        (a.state, t.state),
        (AttemptState::Expired, TaskState::Reconciling)
    );
    // Acknowledged by its device, or reported: it started.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    acknowledge(&mut t, &mut a, &mut j, 1, json!({}), T0).unwrap();
    let started = release(&mut t, &mut a, &mut j, 1, T0).unwrap_err();
    assert_eq!(started, Rejection::Acknowledged);
    assert_eq!(a.state, AttemptState::Acknowledged);
    // A heartbeat recorded usage: it consumed something, so it started.
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    heartbeat(&mut t, &mut a, &mut j, 1, Some(0), T0).unwrap();
    let (before, events) = (t.clone(), j.events.len());
    heartbeat(&mut t, &mut a, &mut j, 1, Some(3), T0).unwrap();
    let used = release(&mut t, &mut a, &mut j, 1, T0).unwrap_err();
    assert_eq!(used, Rejection::UsageRecorded { usage: 3 });
    assert_eq!((a.state, t.state), (AttemptState::Leased, before.state));
    assert_eq!(j.events.len(), events + 1, "only the usage was recorded");
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Failed), T0).unwrap();
    let reported = release(&mut t, &mut a, &mut j, 1, T0).unwrap_err();
    assert_eq!(
        reported,
        Rejection::AlreadyReported {
            existing: Outcome::Failed
        }
    );
    assert_eq!(t.state, TaskState::RetryWait);
}

/// A pending cancellation is confirmed by a release with the fee of a task
/// that never started, unless an earlier execute attempt did.
#[test]
fn release_with_a_pending_cancellation_confirms_it() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    assert_eq!(cancel(&mut t, &mut j, T0).status, CancelStatus::Requested);
    release(&mut t, &mut a, &mut j, 1, T0).unwrap();
    let c = t.cancellation.clone().unwrap();
    assert_eq!(
        (t.state, c.status, c.fee),
        (TaskState::Cancelled, CancelStatus::Confirmed, Some(0))
    );
    assert_eq!(t.generation, 2, "the confirmation retires the generation");
    // An earlier attempt ran (a transient failure): the after-start fee.
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    let mut r = rep(1, Outcome::Failed);
    r.usage = Some(4);
    report(&mut t, &mut a, &mut j, &r, T0).unwrap();
    let mut b = claim_now(&mut t, &mut j, 2, T0.plus_ms(600_000));
    cancel(&mut t, &mut j, T0.plus_ms(600_000));
    release(&mut t, &mut b, &mut j, 2, T0.plus_ms(600_000)).unwrap();
    let c = t.cancellation.clone().unwrap();
    assert_eq!((c.status, c.fee), (CancelStatus::Confirmed, Some(5 + 4)));
}

/// A released reconcile attempt leaves the task `reconciling` with the next
/// reconcile due at once, also with a cancellation pending: the unknown
/// outcome is still unknown.
#[test]
fn released_reconcile_attempt_keeps_reconciling() {
    let (mut t, mut j) = new_task("payment.release");
    let mut a = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a, &mut j, &rep(1, Outcome::Unknown), T0).unwrap();
    let mut r = claim_now(&mut t, &mut j, 2, T0.plus_ms(1));
    assert_eq!(r.kind, AttemptKind::Reconcile);
    cancel(&mut t, &mut j, T0.plus_ms(2));
    release(&mut t, &mut r, &mut j, 2, T0.plus_ms(3)).unwrap();
    assert_eq!(
        (t.state, t.control.next_kind, t.control.execute_count),
        (TaskState::Reconciling, Some(AttemptKind::Reconcile), 1)
    );
    assert!(is_claimable(&t, T0.plus_ms(3)));
    assert_eq!(
        t.cancellation.as_ref().unwrap().status,
        CancelStatus::Requested
    );
}

/// `store_rewound` in every state of both classes: what changes, the state
/// reached, the generation's rise and the event that says why.
#[test]
fn store_rewound_moves_every_task_that_may_have_started() {
    let store = json!({"from": {"epoch": "a"}, "to": {"epoch": "b"}, "restored_backup": true});
    /// The class, the state, and what a rewind makes of it (`None`: nothing).
    type Case = (&'static str, TaskState, Option<(TaskState, EventKind)>);
    let cases: &[Case] = &[
        (
            "payment.release",
            TaskState::Queued,
            Some((TaskState::Reconciling, EventKind::ReconciliationRequired)),
        ),
        (
            "payment.release",
            TaskState::Running,
            Some((TaskState::Reconciling, EventKind::ReconciliationRequired)),
        ),
        (
            "payment.release",
            TaskState::Reconciling,
            Some((TaskState::Reconciling, EventKind::ReconciliationRequired)),
        ),
        ("payment.release", TaskState::Succeeded, None),
        ("payment.release", TaskState::Failed, None),
        ("payment.release", TaskState::Cancelled, None),
        ("generation.dispatch", TaskState::Queued, None),
        ("generation.dispatch", TaskState::RetryWait, None),
        (
            "generation.dispatch",
            TaskState::Running,
            Some((TaskState::Queued, EventKind::RetryScheduled)),
        ),
        (
            "generation.dispatch",
            TaskState::Reconciling,
            Some((TaskState::Reconciling, EventKind::ReconciliationRequired)),
        ),
        ("generation.dispatch", TaskState::Succeeded, None),
    ];
    for (class, state, expected) in cases {
        let (mut t, mut a) = in_state(*state, class);
        let before = t.clone();
        let was_live = a.as_ref().is_some_and(|a| a.state.is_active());
        let mut j = Journal::default();
        let now = T0.plus_ms(20);
        let changed = store_rewound(&mut t, a.as_mut(), &mut j, now, &store);
        let what = format!("{class} {state}");
        match expected {
            None => {
                assert!(!changed, "{what}: unchanged");
                assert_eq!(t, before, "{what}: unchanged");
                assert!(j.events.is_empty(), "{what}: no event");
            }
            Some((to, kind)) => {
                assert!(changed, "{what}: changed");
                assert_eq!(t.state, *to, "{what}: state");
                assert_eq!(t.generation, before.generation + 1, "{what}: generation");
                assert_eq!(t.control.active_attempt_id, None, "{what}: no live attempt");
                assert_eq!(t.control.ready_at, now, "{what}: due at once");
                assert_eq!(j.events.len(), 1, "{what}: one event");
                let e = &j.events[0];
                assert_eq!(e.kind, *kind, "{what}: event");
                assert_eq!(data_of(e)["reason"], json!(STORE_REWOUND), "{what}");
                assert_eq!(data_of(e)["store"], store, "{what}");
                assert_eq!(data_of(e)["generation"], json!(t.generation), "{what}");
                let ended = a.as_ref().filter(|_| was_live).map(|a| a.id);
                assert_eq!(data_of(e)["ended_attempt_id"], json!(ended), "{what}");
                if was_live {
                    let a = a.as_ref().unwrap();
                    assert_eq!(a.state, AttemptState::Expired, "{what}: attempt ended");
                    // A report from before is stale evidence.
                    let mut a = a.clone();
                    let mut j = Journal::default();
                    let late = rep(a.generation, Outcome::Succeeded);
                    let r = report(&mut t, &mut a, &mut j, &late, now);
                    assert!(
                        matches!(r, Err(Rejection::StaleGeneration { .. })),
                        "{what}: {r:?}"
                    );
                }
            }
        }
    }
}

/// A retry-safe class whose running attempt the rewind ends: a pending
/// cancellation is confirmed; past its attempt limit the task fails.
#[test]
fn store_rewound_on_a_safe_class_confirms_a_cancellation_or_ends_at_its_limit() {
    let store = json!({"restored_backup": false});
    let (mut t, mut a) = in_state(TaskState::Running, "generation.dispatch");
    let mut j = Journal::default();
    cancel(&mut t, &mut j, T0.plus_ms(1));
    let mut j = Journal::default();
    assert!(store_rewound(
        &mut t,
        a.as_mut(),
        &mut j,
        T0.plus_ms(2),
        &store
    ));
    assert_eq!(t.state, TaskState::Cancelled);
    assert_eq!(
        j.events.last().map(|e| e.kind),
        Some(EventKind::CancelConfirmed)
    );
    assert_eq!(data_of(&j.events[0])["store"], store);

    let (mut t, mut a) = in_state(TaskState::Running, "generation.dispatch");
    t.control.execute_count = t.execute_limit();
    let mut j = Journal::default();
    assert!(store_rewound(
        &mut t,
        a.as_mut(),
        &mut j,
        T0.plus_ms(2),
        &store
    ));
    assert_eq!(t.state, TaskState::Failed);
    assert_eq!(j.events[0].kind, EventKind::TaskFailed);
    assert_eq!(
        data_of(&j.events[0])["reason"],
        json!(null),
        "task_failed keeps its own data"
    );
    assert_eq!(data_of(&j.events[0])["store"], store);
}
