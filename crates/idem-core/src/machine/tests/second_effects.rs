//! Suspected second effects (SPEC §2 "Second effects"): each evidence
//! pattern raises `second_effect_suspected` once per distinct transaction
//! id; a replay, a report matching the delivered id and a `null` id on a
//! delivered task raise nothing.

use super::*;
use crate::machine::operator::{
    Actor, By, Reason, Refused, Resolution, acknowledge_second_effect, resolve,
};
use crate::model::{EffectEvidence, EffectResolution};

/// A `succeeded` report with transaction id `txn` (and a body that tells
/// reports apart by it).
fn done(generation: i64, txn: Option<&str>) -> Report {
    let mut r = rep(generation, Outcome::Succeeded);
    r.external_txn_id = txn.map(str::to_owned);
    r.body = json!({"generation": generation, "outcome": "succeeded", "external_txn_id": txn});
    r
}

/// The data of every `second_effect_suspected` event journaled.
fn suspected(j: &Journal) -> Vec<ev::SecondEffectSuspected> {
    j.events
        .iter()
        .filter_map(|e| match &e.data {
            EventData::SecondEffectSuspected(d) => Some(d.clone()),
            _ => None,
        })
        .collect()
}

/// A safe task whose first attempt expired and whose second holds the lease
/// (generation 2): the first attempt's reports are stale.
fn second_attempt_running() -> (Task, Journal, Attempt, Attempt, Timestamp) {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    expire_lease(&mut t, &mut a1, &mut j, T0.plus_ms(1_000));
    let ready = t.control.ready_at;
    let a2 = claim_now(&mut t, &mut j, 2, ready);
    (t, j, a1, a2, ready)
}

#[test]
fn a_stale_report_of_another_id_after_delivery_raises_once_per_id() {
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    report(&mut t, &mut a2, &mut j, &done(2, Some("B")), now).unwrap();
    assert!(suspected(&j).is_empty());
    report(&mut t, &mut a1, &mut j, &done(1, Some("A")), now).unwrap_err();
    let mut other = done(1, Some("A"));
    other.body = json!({"again": true});
    report(&mut t, &mut a1, &mut j, &other, now).unwrap_err();
    let raised = suspected(&j);
    assert_eq!(raised.len(), 1, "once for `A`: {raised:?}");
    assert_eq!(
        raised[0],
        ev::SecondEffectSuspected {
            attempt_id: Some(a1.id),
            delivered_txn_id: Some("B".into()),
            evidence: EffectEvidence::StaleReport,
            external_txn_id: Some("A".into()),
            generation: 1,
            state: TaskState::Succeeded,
        }
    );
    report(&mut t, &mut a1, &mut j, &done(1, Some("C")), now).unwrap_err();
    assert_eq!(suspected(&j).len(), 2, "a new distinct id raises again");
    assert_eq!(t.second_effects.len(), 2);
    assert_eq!(j.second_effects, t.second_effects);
    assert_eq!(
        t.delivery.as_ref().unwrap().external_txn_id.as_deref(),
        Some("B")
    );
}

#[test]
fn a_report_matching_the_delivered_id_or_a_replay_raises_nothing() {
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    report(&mut t, &mut a2, &mut j, &done(2, Some("B")), now).unwrap();
    // The applied report again (its answer was lost): a replay.
    report(&mut t, &mut a2, &mut j, &done(2, Some("B")), now).unwrap();
    // A stale report of the delivered id.
    report(&mut t, &mut a1, &mut j, &done(1, Some("B")), now).unwrap_err();
    assert!(suspected(&j).is_empty());
    assert!(t.second_effects.is_empty());
    assert_eq!(j.effect_reports.len(), 1, "one distinct id reported");
}

#[test]
fn null_ids_on_a_delivered_task_raise_nothing() {
    // A report without an id after a delivery with one.
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    report(&mut t, &mut a2, &mut j, &done(2, Some("B")), now).unwrap();
    report(&mut t, &mut a1, &mut j, &done(1, None), now).unwrap_err();
    assert!(suspected(&j).is_empty());
    // A delivery without an id is compared with nothing.
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    report(&mut t, &mut a2, &mut j, &done(2, None), now).unwrap();
    report(&mut t, &mut a1, &mut j, &done(1, Some("A")), now).unwrap_err();
    assert!(suspected(&j).is_empty());
}

#[test]
fn a_stale_report_before_the_delivery_is_raised_when_it_is_delivered() {
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    report(&mut t, &mut a1, &mut j, &done(1, Some("A")), now).unwrap_err();
    assert!(suspected(&j).is_empty(), "nothing delivered yet");
    report(&mut t, &mut a2, &mut j, &done(2, Some("B")), now).unwrap();
    let raised = suspected(&j);
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].evidence, EffectEvidence::StaleReport);
    assert_eq!(raised[0].external_txn_id.as_deref(), Some("A"));
    let kinds: Vec<EventKind> = j.events.iter().map(|e| e.kind).collect();
    let at = kinds
        .iter()
        .position(|k| *k == EventKind::Delivered)
        .unwrap();
    assert_eq!(kinds[at + 1], EventKind::SecondEffectSuspected);
}

#[test]
fn a_late_report_is_raised_when_reconciliation_delivers_another_id() {
    let (mut t, mut j) = new_task("payment.release");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    expire_lease(&mut t, &mut a1, &mut j, T0.plus_ms(2_000));
    assert_eq!(t.state, TaskState::Reconciling);
    // Its own generation, after its lease: late.
    report(
        &mut t,
        &mut a1,
        &mut j,
        &done(1, Some("A")),
        T0.plus_ms(2_001),
    )
    .unwrap_err();
    let mut r = claim_now(&mut t, &mut j, 2, T0.plus_ms(2_002));
    let mut committed = rep(2, Outcome::Committed);
    committed.external_txn_id = Some("B".into());
    report(&mut t, &mut r, &mut j, &committed, T0.plus_ms(2_003)).unwrap();
    let raised = suspected(&j);
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].evidence, EffectEvidence::LateReport);
    assert_eq!(raised[0].attempt_id, Some(a1.id));
}

#[test]
fn a_duplicate_report_of_another_id_is_raised() {
    let (mut t, mut j) = new_task("generation.dispatch");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    report(&mut t, &mut a1, &mut j, &rep(1, Outcome::Failed), T0).unwrap();
    let dup = report(&mut t, &mut a1, &mut j, &done(1, Some("A")), T0).unwrap_err();
    assert!(matches!(dup, Rejection::AlreadyReported { .. }));
    let ready = t.control.ready_at;
    let mut a2 = claim_now(&mut t, &mut j, 2, ready);
    report(&mut t, &mut a2, &mut j, &done(2, Some("B")), ready).unwrap();
    let raised = suspected(&j);
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].evidence, EffectEvidence::DuplicateReport);
}

#[test]
fn an_effect_report_on_a_task_that_ended_undelivered_is_raised_null_id_included() {
    // Cancelled: the stale report of an expired attempt, without an id.
    let (mut t, mut j, mut a1, _a2, now) = second_attempt_running();
    cancel(&mut t, &mut j, now);
    // Fail the running attempt by a cancellation report: the task is cancelled.
    assert_eq!(t.state, TaskState::Running);
    report(&mut t, &mut a1, &mut j, &done(1, None), now).unwrap_err();
    assert!(suspected(&j).is_empty(), "still running");
    let mut a2 = _a2;
    report(&mut t, &mut a2, &mut j, &rep(2, Outcome::Cancelled), now).unwrap();
    assert_eq!(t.state, TaskState::Cancelled);
    let raised = suspected(&j);
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].external_txn_id, None);
    assert_eq!(raised[0].delivered_txn_id, None);
    assert_eq!(raised[0].state, TaskState::Cancelled);
    // A second report without an id is the same distinct id.
    let mut again = done(1, None);
    again.body = json!({"again": true});
    report(&mut t, &mut a1, &mut j, &again, now).unwrap_err();
    assert_eq!(suspected(&j).len(), 1);
    // Failed: a later stale report raises at once.
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    let mut invalid = rep(2, Outcome::Failed);
    invalid.failure_class = Some(FailureClass::InvalidInput);
    report(&mut t, &mut a2, &mut j, &invalid, now).unwrap();
    assert_eq!(t.state, TaskState::Failed);
    report(&mut t, &mut a1, &mut j, &done(1, Some("A")), now).unwrap_err();
    assert_eq!(suspected(&j).len(), 1);
    assert_eq!(suspected(&j)[0].state, TaskState::Failed);
}

#[test]
fn a_failure_report_or_an_unknown_one_is_no_effect_report() {
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    let mut invalid = rep(2, Outcome::Failed);
    invalid.failure_class = Some(FailureClass::InvalidInput);
    report(&mut t, &mut a2, &mut j, &invalid, now).unwrap();
    report(&mut t, &mut a1, &mut j, &rep(1, Outcome::Unknown), now).unwrap_err();
    assert!(suspected(&j).is_empty());
    assert!(j.effect_reports.is_empty());
}

fn by() -> By {
    By {
        actor: Actor::ApiKey(Uuid::from_u128(7)),
        reason: Reason::parse("refunded at the provider").unwrap(),
    }
}

#[test]
fn an_operator_resolve_is_an_effect_report_and_delivers_its_own_id() {
    let (mut t, mut j) = new_task("payment.release");
    let mut a1 = claim_now(&mut t, &mut j, 1, T0);
    expire_lease(&mut t, &mut a1, &mut j, T0.plus_ms(2_000));
    report(
        &mut t,
        &mut a1,
        &mut j,
        &done(1, Some("A")),
        T0.plus_ms(2_001),
    )
    .unwrap_err();
    let resolution = Resolution::Committed {
        result: json!({"ok": true}),
        external_txn_id: Some("R".into()),
    };
    resolve(&mut t, None, &mut j, T0.plus_ms(3_000), &by(), resolution).unwrap();
    let raised = suspected(&j);
    assert_eq!(raised.len(), 1, "`A` only, not the delivered `R`");
    assert_eq!(raised[0].external_txn_id.as_deref(), Some("A"));
    assert_eq!(raised[0].delivered_txn_id.as_deref(), Some("R"));
    assert_eq!(
        t.control.effect_reports.last().map(|r| r.evidence),
        Some(EffectEvidence::OperatorResolved)
    );
}

#[test]
fn an_acknowledgment_records_who_and_why_once() {
    let (mut t, mut j, mut a1, mut a2, now) = second_attempt_running();
    report(&mut t, &mut a2, &mut j, &done(2, Some("B")), now).unwrap();
    report(&mut t, &mut a1, &mut j, &done(1, Some("A")), now).unwrap_err();
    let mut j = Journal::default();
    let unknown = acknowledge_second_effect(
        &mut t,
        &mut j,
        now,
        &by(),
        Some("B"),
        EffectResolution::FalseAlarm,
    );
    assert!(matches!(unknown, Err(Refused::NoSecondEffect { .. })));
    assert_eq!(j, Journal::default(), "nothing changed");
    let later = now.plus_ms(5);
    let acked = acknowledge_second_effect(
        &mut t,
        &mut j,
        later,
        &by(),
        Some("A"),
        EffectResolution::RefundIssued,
    )
    .unwrap();
    let ack = acked.acknowledgment.clone().unwrap();
    assert_eq!(ack.resolution, EffectResolution::RefundIssued);
    assert_eq!(ack.actor, Actor::ApiKey(Uuid::from_u128(7)));
    assert_eq!(ack.acknowledged_at, later);
    assert_eq!(j.events.len(), 1);
    assert_eq!(
        data_of(&j.events[0]),
        json!({
            "actor": {"api_key_id": Uuid::from_u128(7), "type": "api_key"},
            "external_txn_id": "A",
            "reason": "refunded at the provider",
            "resolution": "refund_issued",
            "state": "succeeded",
        })
    );
    assert_eq!(t.second_effects[0], acked);
    assert_eq!(t.state, TaskState::Succeeded, "the task does not change");
    // Idempotent: the existing acknowledgment, nothing written.
    let mut again = Journal::default();
    let other = By {
        actor: Actor::Cli { user: "ops".into() },
        reason: Reason::parse("another reason").unwrap(),
    };
    let same = acknowledge_second_effect(
        &mut t,
        &mut again,
        later.plus_ms(1),
        &other,
        Some("A"),
        EffectResolution::FalseAlarm,
    )
    .unwrap();
    assert_eq!(same, acked);
    assert_eq!(again, Journal::default());
}
