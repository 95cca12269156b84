//! Each operator action in every task state it does and does not apply to,
//! and what its event records.

use serde_json::json;
use uuid::Uuid;

use super::*;
use crate::config::Config;
use crate::machine::{NewTask, Report, accept, claim, report};
use crate::model::{AttemptKind, CancelStatus, EventKind, Outcome};

const T0: Timestamp = Timestamp(1_000_000);
const PAY: &str = "payment.release";
const GEN: &str = "generation.dispatch";

fn by() -> By {
    By {
        actor: Actor::ApiKey(Uuid::from_u128(7)),
        reason: Reason::parse("provider dashboard shows it").unwrap(),
    }
}

fn new_task(class: &str) -> Task {
    let contract = Config::bundled().unwrap().contract(class).unwrap();
    accept(
        NewTask {
            id: Uuid::from_u128(1),
            tenant: "acme".into(),
            operation: class.into(),
            idempotency_key: "k1".into(),
            fingerprint: "sha256:00".into(),
            canonical_request: "{}".into(),
            params: json!({"amount": 100}),
            contract: crate::contract::FrozenContract::new(contract).unwrap(),
            api_key_id: Uuid::from_u128(9),
            grant: None,
            traceparent: None,
            priority: 3,
            fairness_key: None,
        },
        T0,
    )
    .0
}

fn lease(t: &mut Task, n: u128) -> Attempt {
    let mut j = Journal::default();
    claim(
        t,
        &mut j,
        Uuid::from_u128(100 + n),
        "ex",
        Some(1_000),
        Authority::Granted,
        T0,
    )
    .unwrap()
    .unwrap()
}

fn rep(a: &Attempt, outcome: Outcome, class: Option<FailureClass>) -> Report {
    Report {
        generation: a.generation,
        outcome,
        result: Some(json!({"ok": true})),
        failure_class: class,
        message: None,
        usage: None,
        external_txn_id: None,
        body: json!({"generation": a.generation, "outcome": outcome.as_str()}),
    }
}

fn apply(t: &mut Task, a: &mut Attempt, outcome: Outcome, class: Option<FailureClass>) {
    let mut j = Journal::default();
    report(t, a, &mut j, &rep(a, outcome, class), T0).unwrap();
}

/// A task in `state`, with the attempt that holds its lease (`running`,
/// `reconciling` with a reconcile attempt leased).
fn in_state(state: TaskState) -> (Task, Option<Attempt>) {
    match state {
        TaskState::Queued => (new_task(PAY), None),
        TaskState::Running => {
            let mut t = new_task(PAY);
            let a = lease(&mut t, 1);
            (t, Some(a))
        }
        TaskState::RetryWait => {
            let mut t = new_task(GEN);
            let mut a = lease(&mut t, 1);
            apply(
                &mut t,
                &mut a,
                Outcome::Failed,
                Some(FailureClass::Transient),
            );
            (t, None)
        }
        TaskState::Reconciling => {
            let mut t = new_task(PAY);
            let mut a = lease(&mut t, 1);
            apply(&mut t, &mut a, Outcome::Unknown, None);
            let r = lease(&mut t, 2);
            (t, Some(r))
        }
        TaskState::Succeeded => {
            let mut t = new_task(PAY);
            let mut a = lease(&mut t, 1);
            apply(&mut t, &mut a, Outcome::Succeeded, None);
            (t, None)
        }
        TaskState::Failed => failed(FailureClass::Transient),
        TaskState::Cancelled => {
            let mut t = new_task(PAY);
            crate::machine::cancel(&mut t, &mut Journal::default(), T0);
            (t, None)
        }
    }
}

/// A `failed` task of the non-safe payment class, failed with `class`.
fn failed(class: FailureClass) -> (Task, Option<Attempt>) {
    let mut t = new_task(PAY);
    let mut a = lease(&mut t, 1);
    if class.is_reportable() {
        apply(&mut t, &mut a, Outcome::Failed, Some(class));
    } else {
        // idem's own limits: fail the task the way the machine does.
        super::super::fail(&mut t, &mut Journal::default(), T0, class, "limit");
    }
    assert_eq!(t.state, TaskState::Failed);
    (t, Some(a))
}

/// The one event an action journals first, its data checked for actor and reason.
fn operator_event(j: &Journal, kind: EventKind) -> Value {
    let e = &j.events[0];
    assert_eq!(e.kind, kind);
    let data = serde_json::to_value(&e.data).unwrap();
    assert_eq!(
        data["actor"],
        json!({"type": "api_key", "api_key_id": Uuid::from_u128(7)})
    );
    assert_eq!(data["reason"], "provider dashboard shows it");
    data
}

#[test]
fn reasons_are_bounded_printable_text() {
    for nothing_visible in [
        "",
        "  \u{3000}",
        "\u{200B}",
        "\u{FEFF}",
        " \u{200B}\u{2060} ",
        "\u{00AD}\u{200D}\u{200E}\u{202E}",
        "\u{E0041}\u{180E}",
    ] {
        assert_eq!(
            Reason::parse(nothing_visible),
            Err(ReasonError::NothingVisible),
            "{nothing_visible:?}"
        );
    }
    for visible in ["\u{200B}ok\u{FEFF}", "👩\u{200D}🔧", "\u{0301}", "·"] {
        assert_eq!(Reason::parse(visible).map(|r| r.0), Ok(visible.to_owned()));
    }
    assert_eq!(Reason::parse("a\nb"), Err(ReasonError::Control));
    assert_eq!(Reason::parse("a\u{0}b"), Err(ReasonError::Control));
    assert_eq!(Reason::parse("a\u{85}b"), Err(ReasonError::Control));
    let long = "é".repeat(MAX_REASON_CHARS);
    assert_eq!(Reason::parse(&long).map(|r| r.0), Ok(long.clone()));
    assert_eq!(
        Reason::parse(&format!("{long}x")),
        Err(ReasonError::TooLong {
            chars: MAX_REASON_CHARS + 1
        })
    );
    let cli = Actor::Cli { user: "ops".into() };
    assert_eq!(
        serde_json::to_string(&cli).unwrap(),
        r#"{"type":"cli","user":"ops"}"#
    );
    let key = Actor::ApiKey(Uuid::from_u128(7));
    let text = serde_json::to_string(&key).unwrap();
    assert_eq!(
        text,
        r#"{"api_key_id":"00000000-0000-0000-0000-000000000007","type":"api_key"}"#
    );
    assert_eq!(serde_json::from_str::<Actor>(&text).unwrap(), key);
    for mixed in [
        r#"{"api_key_id":"00000000-0000-0000-0000-000000000007","type":"cli"}"#,
        r#"{"type":"api_key","user":"ops"}"#,
    ] {
        assert!(serde_json::from_str::<Actor>(mixed).is_err(), "{mixed}");
    }
}

#[test]
fn retry_now_makes_a_backing_off_task_claimable_at_once() {
    let (mut t, _) = in_state(TaskState::RetryWait);
    let waited_until = t.control.ready_at;
    let now = T0.plus_ms(1);
    assert!(waited_until > now && !crate::machine::is_claimable(&t, now));
    let mut j = Journal::default();
    retry_now(&mut t, &mut j, now, &by()).unwrap();
    assert_eq!(t.state, TaskState::Queued);
    assert!(crate::machine::is_claimable(&t, now));
    let data = operator_event(&j, EventKind::OperatorRetryNow);
    assert_eq!(data["state"], "retry_wait");
    assert_eq!(data["ready_at"], json!(waited_until));
    assert_eq!(j.events.len(), 1);
}

#[test]
fn each_action_refuses_the_states_it_does_not_apply_to() {
    for &state in TaskState::ALL {
        let (t, a) = in_state(state);
        let mut j = Journal::default();
        let refused = |r: Result<(), Refused>| matches!(r, Err(Refused::InvalidState(_)));

        let mut u = t.clone();
        let r = retry_now(&mut u, &mut j, T0, &by());
        assert_eq!(refused(r), state != TaskState::RetryWait, "{state}");

        let mut u = t.clone();
        let mut a2 = a.clone();
        let r = resolve(
            &mut u,
            a2.as_mut(),
            &mut j,
            T0,
            &by(),
            Resolution::NotCommitted,
        );
        assert_eq!(refused(r), state != TaskState::Reconciling, "{state}");

        let mut u = t.clone();
        let r = redrive(&mut u, &mut j, T0, &by(), Authority::Granted);
        assert_eq!(refused(r), state != TaskState::Failed, "{state}");

        if state != TaskState::Failed
            && state != TaskState::Reconciling
            && state != TaskState::RetryWait
        {
            assert!(j.events.is_empty(), "{state}: a refusal journals nothing");
        }
    }
}

#[test]
fn a_refused_action_changes_nothing() {
    let (mut t, _) = in_state(TaskState::Running);
    let before = t.clone();
    let mut j = Journal::default();
    assert!(retry_now(&mut t, &mut j, T0, &by()).is_err());
    assert!(resolve(&mut t, None, &mut j, T0, &by(), Resolution::NotCommitted).is_err());
    assert!(redrive(&mut t, &mut j, T0, &by(), Authority::Granted).is_err());
    assert_eq!(t, before);
    assert!(j.events.is_empty() && j.evidence.is_empty());
}

#[test]
fn resolve_committed_delivers_once_and_fences_the_live_reconcile_attempt() {
    let (mut t, r) = in_state(TaskState::Reconciling);
    let mut r = r.unwrap();
    assert_eq!(r.kind, AttemptKind::Reconcile);
    let generation = t.generation;
    let mut j = Journal::default();
    let now = T0.plus_ms(5);
    let res = Resolution::Committed {
        result: json!({"paid": true}),
        external_txn_id: Some("psp-1".into()),
    };
    resolve(&mut t, Some(&mut r), &mut j, now, &by(), res).unwrap();
    assert_eq!(t.state, TaskState::Succeeded);
    assert_eq!(t.generation, generation + 1);
    let d = t.delivery.clone().unwrap();
    assert_eq!(d.charge, t.contract.price);
    assert_eq!(d.result, json!({"paid": true}));
    assert_eq!(d.external_txn_id.as_deref(), Some("psp-1"));
    let data = operator_event(&j, EventKind::OperatorResolved);
    assert_eq!(data["outcome"], "committed");
    assert_eq!(data["retired_attempt_id"], json!(r.id));
    let kinds: Vec<_> = j.events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [EventKind::OperatorResolved, EventKind::Delivered],
        "one delivery"
    );
    assert_eq!(r.state, AttemptState::Expired);

    // The retired attempt's report comes too late: kept as stale evidence.
    let mut j = Journal::default();
    let late = rep(&r, Outcome::Committed, None);
    let e = report(&mut t, &mut r, &mut j, &late, now).unwrap_err();
    assert!(matches!(
        e,
        crate::machine::Rejection::StaleGeneration { .. }
    ));
    assert_eq!(t.delivery, Some(d));
    assert_eq!(j.events[0].kind, EventKind::StaleReport);
}

#[test]
fn resolve_not_committed_queues_the_next_execute_attempt() {
    let (mut t, r) = in_state(TaskState::Reconciling);
    let mut r = r.unwrap();
    let mut j = Journal::default();
    resolve(
        &mut t,
        Some(&mut r),
        &mut j,
        T0,
        &by(),
        Resolution::NotCommitted,
    )
    .unwrap();
    assert_eq!(t.state, TaskState::Queued);
    assert_eq!(t.control.next_kind, Some(AttemptKind::Execute));
    assert!(t.delivery.is_none());
    assert!(crate::machine::is_claimable(&t, T0));
    let next = lease(&mut t, 3);
    assert_eq!(next.kind, AttemptKind::Execute);
    assert_eq!(next.generation, r.generation + 2);
}

#[test]
fn resolve_not_committed_with_a_pending_cancel_confirms_it() {
    let (mut t, r) = in_state(TaskState::Reconciling);
    let mut j = Journal::default();
    crate::machine::cancel(&mut t, &mut j, T0);
    let mut r = r.unwrap();
    resolve(
        &mut t,
        Some(&mut r),
        &mut j,
        T0,
        &by(),
        Resolution::NotCommitted,
    )
    .unwrap();
    assert_eq!(t.state, TaskState::Cancelled);
    assert_eq!(
        t.cancellation.as_ref().map(|c| c.status),
        Some(CancelStatus::Confirmed)
    );
}

#[test]
fn resolve_between_reconcile_attempts_needs_no_attempt() {
    let (mut t, r) = in_state(TaskState::Reconciling);
    let mut r = r.unwrap();
    // The reconcile attempt failed: the task waits for the next one.
    apply(
        &mut t,
        &mut r,
        Outcome::Failed,
        Some(FailureClass::Transient),
    );
    assert_eq!(t.state, TaskState::Reconciling);
    let mut j = Journal::default();
    let res = Resolution::Committed {
        result: json!({}),
        external_txn_id: None,
    };
    resolve(&mut t, None, &mut j, T0, &by(), res).unwrap();
    assert_eq!(t.state, TaskState::Succeeded);
    assert_eq!(
        operator_event(&j, EventKind::OperatorResolved)["retired_attempt_id"],
        Value::Null
    );
}

#[test]
fn redrive_grants_one_more_attempt_and_a_new_deadline() {
    let (mut t, _) = in_state(TaskState::Failed);
    let old_generation = t.generation;
    let max = t.contract.retry.max_attempts;
    let now = T0.plus_ms(9_000_000);
    let mut j = Journal::default();
    redrive(&mut t, &mut j, now, &by(), Authority::Granted).unwrap();
    assert_eq!(t.state, TaskState::Queued);
    assert_eq!(t.failure, None);
    assert_eq!(t.generation, old_generation + 1);
    assert_eq!(t.control.attempts_granted, 1);
    assert_eq!(t.execute_limit(), max + 1);
    assert_eq!(
        t.control.deadline_at,
        now.plus_ms(t.contract.retry.deadline_ms)
    );
    assert_eq!(
        (t.control.terminal_at, t.control.key_expires_at),
        (None, None)
    );
    assert!(crate::machine::is_claimable(&t, now));
    let data = operator_event(&j, EventKind::OperatorRedriven);
    assert_eq!(data["state"], "failed");
    assert_eq!(data["failure"]["class"], "transient");
    assert_eq!(data["execute_limit"], json!(max + 1));
}

#[test]
fn redrive_after_attempts_exhausted_allows_exactly_one_more() {
    let mut t = new_task(PAY);
    let max = t.contract.retry.max_attempts;
    t.control.execute_count = max;
    super::super::fail(
        &mut t,
        &mut Journal::default(),
        T0,
        FailureClass::AttemptsExhausted,
        "x",
    );
    redrive(
        &mut t,
        &mut Journal::default(),
        T0,
        &by(),
        Authority::Granted,
    )
    .unwrap();
    let mut a = lease(&mut t, 1);
    assert_eq!(t.state, TaskState::Running);
    // A non-safe class fails `transient` at once; a `not_committed`
    // reconciliation would then find the limit reached.
    apply(&mut t, &mut a, Outcome::Unknown, None);
    let mut r = lease(&mut t, 2);
    apply(&mut t, &mut r, Outcome::NotCommitted, None);
    assert_eq!(t.state, TaskState::Failed);
    assert_eq!(
        t.failure.as_ref().map(|f| f.class),
        Some(FailureClass::AttemptsExhausted)
    );
    assert_eq!(t.control.execute_count, max + 1);
}

#[test]
fn redrive_applies_to_retryable_failure_classes_only() {
    for &class in FailureClass::ALL {
        let (mut t, _) = failed(class);
        let r = redrive(
            &mut t,
            &mut Journal::default(),
            T0,
            &by(),
            Authority::Granted,
        );
        assert_eq!(r.is_ok(), REDRIVABLE.contains(&class), "{class}");
    }
}

#[test]
fn redrive_refuses_a_revoked_submitter_a_cancelled_client_and_a_released_key() {
    let (mut t, _) = failed(FailureClass::Transient);
    let before = t.clone();
    let r = redrive(
        &mut t,
        &mut Journal::default(),
        T0,
        &by(),
        Authority::Revoked,
    );
    assert!(matches!(r, Err(Refused::SubmitterRevoked { .. })));
    assert_eq!(t, before);

    crate::machine::cancel(&mut t, &mut Journal::default(), T0);
    assert_eq!(
        t.cancellation.as_ref().map(|c| c.status),
        Some(CancelStatus::TooLate)
    );
    let r = redrive(
        &mut t,
        &mut Journal::default(),
        T0,
        &by(),
        Authority::Granted,
    );
    assert!(matches!(r, Err(Refused::InvalidState(_))));

    let (mut t, _) = failed(FailureClass::Transient);
    crate::machine::release_key(&mut t, &mut Journal::default(), T0);
    let r = redrive(
        &mut t,
        &mut Journal::default(),
        T0,
        &by(),
        Authority::Granted,
    );
    assert!(matches!(r, Err(Refused::InvalidState(_))));
}

#[test]
fn operator_cancel_is_the_clients_cancel_with_actor_and_reason() {
    for &state in TaskState::ALL {
        let (t, _) = in_state(state);
        let (mut client, mut operator) = (t.clone(), t.clone());
        let mut cj = Journal::default();
        let mut oj = Journal::default();
        let c = crate::machine::cancel(&mut client, &mut cj, T0);
        let o = cancel(&mut operator, &mut oj, T0, &by());
        assert_eq!(c, o, "{state}");
        assert_eq!(client.state, operator.state, "{state}");
        if t.cancellation.is_none() {
            let data = operator_event(&oj, EventKind::OperatorCancel);
            assert_eq!(data["state"], json!(state));
            let rest: Vec<_> = oj.events[1..].iter().map(|e| e.kind).collect();
            let client_kinds: Vec<_> = cj.events.iter().map(|e| e.kind).collect();
            assert_eq!(rest, client_kinds, "{state}");
        } else {
            assert!(oj.events.is_empty(), "{state}");
        }
    }
}

#[test]
fn a_resolution_is_parsed_by_the_rules_of_every_entry_point() {
    use ResolveOutcome::{Committed, NotCommitted};
    let ok = Resolution::parse(Committed, Some(json!({"payout": "po_1"})), Some("po_1"));
    assert_eq!(
        ok,
        Ok(Resolution::Committed {
            result: json!({"payout": "po_1"}),
            external_txn_id: Some("po_1".into()),
        })
    );
    assert_eq!(
        Resolution::parse(Committed, None, None),
        Err(ResolutionError::NoResult)
    );
    assert_eq!(
        Resolution::parse(Committed, Some(json!(null)), None),
        Err(ResolutionError::NoResult)
    );
    for bad in ["", "a\nb", &"x".repeat(201)] {
        assert_eq!(
            Resolution::parse(Committed, Some(json!(1)), Some(bad)),
            Err(ResolutionError::ExternalTxnId(ExternalTxnIdError)),
            "{bad:?}"
        );
    }
    assert!(Resolution::parse(Committed, Some(json!(1)), Some(&"é".repeat(200))).is_ok());
    assert_eq!(
        Resolution::parse(NotCommitted, None, None),
        Ok(Resolution::NotCommitted)
    );
    assert_eq!(
        Resolution::parse(NotCommitted, Some(json!({})), None),
        Err(ResolutionError::NotCommittedDeliversNothing)
    );
    assert_eq!(
        Resolution::parse(NotCommitted, None, Some("po_1")),
        Err(ResolutionError::NotCommittedDeliversNothing)
    );
}
