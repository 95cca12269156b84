//! Operator actions (SPEC §4 "Operator actions"):
//! retry-now, cancel, resolve and redrive record actor and reason, refuse the
//! states they do not apply to and other tenants' tasks, and race an
//! executor's report so that exactly one transition applies; a redriven
//! payment delivers once.

use idem_core::machine::operator::{Actor, By, Reason, Refused, Resolution};

use super::*;

/// An admin of `c`'s tenant acting with a reason.
async fn admin(c: &Ctx) -> By {
    let (key, _) = must(
        c.store.create_api_key(&c.tenant, Role::Admin, None).await,
        "create admin key",
    );
    By {
        actor: Actor::ApiKey(key.id),
        reason: must(Reason::parse("checked the provider's dashboard"), "reason"),
    }
}

#[track_caller]
fn assert_invalid_state<T: std::fmt::Debug>(r: crate::Result<Result<T, Refusal>>, what: &str) {
    let r = must(r, what);
    assert!(
        matches!(r, Err(Refusal::Operator(Refused::InvalidState(_)))),
        "{what}: expected InvalidState, got {r:?}"
    );
}

/// The newest event of `kind` carries `by`'s actor and reason.
#[track_caller]
fn assert_recorded(events: &[Event], kind: EventKind, by: &By) -> Value {
    let Some(e) = events.iter().rev().find(|e| e.kind == kind) else {
        panic!("no {kind} event in {:?}", kinds(events));
    };
    let data = json_of(&e.data);
    assert_eq!(data["actor"], json_of(&by.actor), "{kind}: actor");
    assert_eq!(data["reason"], by.reason.as_str(), "{kind}: reason");
    data
}

/// A `payment.release` task whose execute attempt reported `unknown`, and
/// its reconcile attempt, leased now.
async fn reconciling(c: &Ctx) -> (Task, Attempt) {
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a, bare(a.generation, Outcome::Unknown)).await;
    let r = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r.kind, AttemptKind::Reconcile);
    (t, r)
}

/// A `payment.release` task whose one execute attempt failed `transient`
/// (a non-safe class is not retried), and that attempt.
async fn failed_payment(c: &Ctx) -> (Task, Attempt) {
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let t = c
        .report_ok(&a, failed(a.generation, FailureClass::Transient))
        .await;
    assert_failed(&t, FailureClass::Transient);
    (t, a)
}

/// Retry-now: a `retry_wait` task is claimable at once, without moving the
/// clock past its backoff; the event records actor and reason; any other
/// state is `InvalidState`; another tenant's admin does not find the task.
pub async fn operator_retry_now_makes_a_backoff_claimable_at_once(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    assert_invalid_state(
        store.retry_now(Some("acme"), t.id, by.clone()).await,
        "retry-now on a queued task",
    );
    let a = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    let t = c
        .report_ok(&a, failed(a.generation, FailureClass::Transient))
        .await;
    assert_eq!(t.state, TaskState::RetryWait);
    assert!(
        c.claim(&[SAFE], Some(LONG_LEASE), 1).await.is_empty(),
        "backing off"
    );
    assert_not_found(
        store.retry_now(Some("other"), t.id, by.clone()).await,
        "retry-now by another tenant",
    );
    let after = ok2(
        store.retry_now(Some("acme"), t.id, by.clone()).await,
        "retry-now",
    );
    assert_eq!(after.state, TaskState::Queued);
    let next = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    assert_eq!((next.number, next.kind), (2, AttemptKind::Execute));
    assert_recorded(&c.events(t.id).await, EventKind::OperatorRetryNow, &by);
    assert_history(&store, t.id).await;
}

/// An operator's cancel is the client's (confirmed at once while queued,
/// requested while running, too late after delivery) with an
/// `operator_cancel` event; a second cancel answers the same record.
pub async fn operator_cancel_is_the_clients_with_actor_and_reason(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    assert_not_found(
        store.operator_cancel(Some("other"), t.id, by.clone()).await,
        "cancel by another tenant",
    );
    let (task, cancel) = ok2(
        store.operator_cancel(Some("acme"), t.id, by.clone()).await,
        "cancel",
    );
    assert_eq!(cancel.status, CancelStatus::Confirmed);
    assert_eq!(task.state, TaskState::Cancelled);
    let again = ok2(
        store.operator_cancel(Some("acme"), t.id, by.clone()).await,
        "cancel again",
    );
    assert_eq!(again.1, cancel, "the same record");
    let events = c.events(t.id).await;
    assert_recorded(&events, EventKind::OperatorCancel, &by);
    assert_eq!(count(&events, "operator_cancel"), 1);
    assert_history(&store, t.id).await;

    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let (_, cancel) = ok2(
        store.operator_cancel(Some("acme"), t.id, by.clone()).await,
        "cancel running",
    );
    assert_eq!(cancel.status, CancelStatus::Requested);
    let t = c.report_ok(&a, succeeded(a.generation)).await;
    assert_eq!(
        t.cancellation.map(|c| c.status),
        Some(CancelStatus::TooLate),
        "delivery won"
    );
    assert_history(&store, t.id).await;
}

/// Resolve `committed` on a `reconciling` task delivers once with its charge
/// and fences off the live reconcile attempt (its later report is stale
/// evidence); `not_committed` lets the next execute attempt start; any other
/// state is `InvalidState`.
pub async fn operator_resolve_settles_a_reconciling_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    let committed = || Resolution::Committed {
        result: json!({"paid": true}),
        external_txn_id: Some("psp-42".into()),
    };
    let queued = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    assert_invalid_state(
        store
            .resolve(Some("acme"), queued.id, by.clone(), committed())
            .await,
        "resolve a queued task",
    );
    c.cancel(queued.id).await;
    let (t, r) = reconciling(&c).await;
    assert_not_found(
        store
            .resolve(Some("other"), t.id, by.clone(), committed())
            .await,
        "resolve by another tenant",
    );
    let done = ok2(
        store
            .resolve(Some("acme"), t.id, by.clone(), committed())
            .await,
        "resolve committed",
    );
    assert_eq!(done.state, TaskState::Succeeded);
    let d = done.delivery.clone().unwrap_or_else(|| panic!("delivered"));
    assert_eq!(
        (d.charge, &d.result),
        (done.contract.price, &json!({"paid": true}))
    );
    assert_eq!(d.external_txn_id.as_deref(), Some("psp-42"));
    assert!(done.generation > r.generation, "the generation is raised");
    let late = rep(r.generation, Outcome::Committed)
        .result(json!({"paid": "again"}))
        .build();
    assert_stale(
        c.report(&r, late).await,
        "the fenced reconcile attempt reports",
    );
    let events = c.events(t.id).await;
    let data = assert_recorded(&events, EventKind::OperatorResolved, &by);
    assert_eq!(data["outcome"], "committed");
    assert_eq!(data["retired_attempt_id"], json!(r.id));
    assert_eq!(count(&events, "stale_report"), 1);
    let attempts = c.attempts(t.id).await;
    assert_eq!(dispositions(&attempts[1]), ["stale_generation"]);
    assert_invalid_state(
        store
            .resolve(Some("acme"), t.id, by.clone(), committed())
            .await,
        "resolve a succeeded task",
    );
    assert_eq!(c.task(t.id).await.delivery, Some(d), "delivered once");
    assert_history(&store, t.id).await;

    let (t, r) = reconciling(&c).await;
    let t2 = ok2(
        store
            .resolve(Some("acme"), t.id, by.clone(), Resolution::NotCommitted)
            .await,
        "resolve not_committed",
    );
    assert_eq!(t2.state, TaskState::Queued);
    let next = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(next.kind, AttemptKind::Execute);
    assert!(next.generation > r.generation + 1);
    c.report_ok(&next, succeeded(next.generation)).await;
    assert_history(&store, t.id).await;
}

/// Redrive sends a `failed` payment back to `queued` with one more execute
/// attempt and a new deadline; the new attempt delivers once with one charge,
/// and a late report of the failed attempt changes nothing. `invalid_input`
/// failures, `succeeded` and `cancelled` tasks are `InvalidState`; a revoked
/// submitting key is `SubmitterRevoked`.
pub async fn operator_redrive_grants_one_more_attempt(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    let (t, a) = failed_payment(&c).await;
    assert_not_found(
        store.redrive(Some("other"), t.id, by.clone()).await,
        "redrive by another tenant",
    );
    c.pass(1_000);
    let t2 = ok2(
        store.redrive(Some("acme"), t.id, by.clone()).await,
        "redrive",
    );
    assert_eq!(t2.state, TaskState::Queued);
    assert!(t2.failure.is_none());
    assert_eq!(t2.control.attempts_granted, 1);
    assert_eq!(
        t2.control.deadline_at,
        t2.updated_at.plus_ms(t2.contract.retry.deadline_ms),
        "a new deadline from now"
    );
    assert_eq!(t2.control.key_expires_at, None, "retention starts again");
    let data = assert_recorded(&c.events(t.id).await, EventKind::OperatorRedriven, &by);
    assert_eq!(data["failure"]["class"], "transient");
    let b = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!((b.number, b.kind), (2, AttemptKind::Execute));
    assert!(b.generation > a.generation + 1);
    let done = c.report_ok(&b, succeeded(b.generation)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let late = c.report(&a, succeeded(a.generation)).await;
    assert!(
        must(late, "late report").is_err(),
        "the failed attempt is done"
    );
    let events = c.events(t.id).await;
    assert_eq!(count(&events, "delivered"), 1, "delivered once");
    assert!(done.control.key_expires_at.is_some());
    assert_history(&store, t.id).await;
    assert_invalid_state(
        store.redrive(Some("acme"), t.id, by.clone()).await,
        "redrive a succeeded task",
    );

    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a, failed(a.generation, FailureClass::InvalidInput))
        .await;
    assert_invalid_state(
        store.redrive(Some("acme"), t.id, by.clone()).await,
        "redrive an invalid_input failure",
    );
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    c.cancel(t.id).await;
    assert_invalid_state(
        store.redrive(Some("acme"), t.id, by.clone()).await,
        "redrive a cancelled task",
    );

    let (t, _) = failed_payment(&c).await;
    must(store.revoke_api_key(c.key.id).await, "revoke");
    let r = must(
        store.redrive(Some("acme"), t.id, by.clone()).await,
        "redrive",
    );
    assert!(
        matches!(r, Err(Refusal::Operator(Refused::SubmitterRevoked { .. }))),
        "a revoked submitter: {r:?}"
    );
    assert_failed(&c.task(t.id).await, FailureClass::Transient);
}

/// 50 rounds: a reconcile attempt's report (`committed`, or `not_committed`
/// every other round) and an operator's resolve of the other outcome, sent
/// at once. Exactly one transition applies: the report (the resolve is then
/// `InvalidState`), or the resolve (the report is then stale evidence).
pub async fn operator_resolve_races_a_reconcile_report(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    let (mut reports_won, mut resolves_won) = (0, 0);
    for round in 0..50 {
        let (t, r) = reconciling(&c).await;
        let (report, resolution) = if round % 2 == 0 {
            let rep = rep(r.generation, Outcome::Committed).result(json!({"by": "executor"}));
            (rep.build(), Resolution::NotCommitted)
        } else {
            let res = Resolution::Committed {
                result: json!({"by": "operator"}),
                external_txn_id: None,
            };
            (bare(r.generation, Outcome::NotCommitted), res)
        };
        let barrier = Arc::new(Barrier::new(2));
        let (c2, b2, r2) = (c.clone(), barrier.clone(), r.clone());
        let reporter = tokio::spawn(async move {
            b2.wait().await;
            c2.report(&r2, report).await
        });
        let (s2, b3, by2, id) = (store.clone(), barrier.clone(), by.clone(), t.id);
        let resolver = tokio::spawn(async move {
            b3.wait().await;
            s2.resolve(Some("acme"), id, by2, resolution).await
        });
        let reported = must(joined(reporter.await), "report");
        let resolved = must(joined(resolver.await), "resolve");
        match (&reported, &resolved) {
            (Ok(_), Err(Refusal::Operator(Refused::InvalidState(_)))) => reports_won += 1,
            (Err(Refusal::Machine(Rejection::StaleGeneration { .. })), Ok(_)) => {
                resolves_won += 1;
            }
            other => panic!("round {round}: exactly one must apply, got {other:?}"),
        }
        let events = c.events(t.id).await;
        assert_eq!(
            count(&events, "reconciled") + count(&events, "operator_resolved"),
            1,
            "round {round}: one settlement: {:?}",
            kinds(&events)
        );
        assert!(count(&events, "delivered") <= 1);
        assert_history(&store, t.id).await;
        // A task queued again leaves the claims of the next round alone.
        if !c.task(t.id).await.state.is_terminal() {
            c.cancel(t.id).await;
        }
    }
    assert_eq!(reports_won + resolves_won, 50);
    println!("resolve race: the report applied {reports_won} times, the resolve {resolves_won}");
}

/// 50 rounds: a failed payment's redrive and its failed attempt's late
/// `succeeded` report, sent at once. Exactly one transition applies, the
/// redrive, in whichever order the database runs them: the late report is
/// refused and kept as evidence, and never delivers. The redriven task's new
/// attempt then delivers once, with one charge.
pub async fn operator_redrive_races_a_late_report(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    for round in 0..50 {
        let (t, a) = failed_payment(&c).await;
        let barrier = Arc::new(Barrier::new(2));
        let (c2, b2, a2) = (c.clone(), barrier.clone(), a.clone());
        let reporter = tokio::spawn(async move {
            b2.wait().await;
            c2.report(&a2, succeeded(a2.generation)).await
        });
        let (s2, b3, by2, id) = (store.clone(), barrier.clone(), by.clone(), t.id);
        let redriver = tokio::spawn(async move {
            b3.wait().await;
            s2.redrive(Some("acme"), id, by2).await
        });
        let reported = must(joined(reporter.await), "report");
        let redriven = must(joined(redriver.await), "redrive");
        assert!(
            matches!(
                reported,
                Err(Refusal::Machine(
                    Rejection::AlreadyReported { .. } | Rejection::StaleGeneration { .. }
                ))
            ),
            "round {round}: the late report is refused: {reported:?}"
        );
        let queued = match redriven {
            Ok(t) => t,
            Err(e) => panic!("round {round}: the redrive applies: {e:?}"),
        };
        assert_eq!(queued.state, TaskState::Queued);
        let evidence = &c.attempts(t.id).await[0].evidence;
        assert_eq!(
            evidence.len(),
            2,
            "round {round}: the late report is evidence"
        );
        let b = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
        let done = c.report_ok(&b, succeeded(b.generation)).await;
        assert_eq!(done.delivery.map(|d| d.charge), Some(done.contract.price));
        let events = c.events(t.id).await;
        assert_eq!(count(&events, "delivered"), 1, "round {round}");
        assert_eq!(count(&events, "operator_redriven"), 1, "round {round}");
        assert_history(&store, t.id).await;
    }
}
