//! Cancellation (SPEC §2.7, CANCEL-01): at once while queued, on the executor's
//! `cancelled` report while running, too late after delivery, and its races
//! with claims, lease expiry and delivery.

use super::*;

/// A queued task is confirmed cancelled at once with the before-start fee; the
/// generation is raised and no claim ever returns it.
pub async fn cancel_queued_confirms_at_once(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let (task, cancel) = c.cancel(t.id).await;
        assert_eq!(
            cancel.status,
            CancelStatus::Confirmed,
            "{op}: queued → confirmed at once"
        );
        assert_eq!(cancel.fee, Some(contract.fees.cancel_before_start));
        assert!(cancel.confirmed_at.is_some());
        assert_eq!(task.state, TaskState::Cancelled);
        assert!(
            task.generation > t.generation,
            "a confirmed cancellation raises the generation"
        );
        assert_eq!(task.cancellation.as_ref(), Some(&cancel));
        let stored = c.task(t.id).await;
        assert_eq!(stored.state, TaskState::Cancelled);
        assert_eq!(stored.cancellation, Some(cancel));
        c.pass(LONGEST_BACKOFF);
        c.assert_nothing_claimable(op).await;
        assert!(c.attempts(t.id).await.is_empty());
        assert_history(&store, t.id).await;
    }
}

/// A running task: the cancel is `requested`, the heartbeat says so, and the
/// executor's `cancelled` report with usage confirms it with the after-start
/// fee; the generation is raised, so a later `succeeded` report is stale.
pub async fn cancel_running_confirms_on_cancelled_report(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let a = c.claim_one(op, LONG_LEASE, t.id).await;
        ok2(c.heartbeat(&a, a.generation, Some(2)).await, "heartbeat");
        let (task, cancel) = c.cancel(t.id).await;
        assert_eq!(
            cancel.status,
            CancelStatus::Requested,
            "{op}: running → requested"
        );
        assert_eq!(cancel.fee, None);
        assert_eq!(
            task.state,
            TaskState::Running,
            "a request does not stop execution"
        );
        let hb = ok2(c.heartbeat(&a, a.generation, None).await, "heartbeat");
        assert!(
            hb.cancel_requested,
            "the heartbeat tells the executor to stop"
        );
        let r = rep(a.generation, Outcome::Cancelled).usage(7).build();
        let done = c.report_ok(&a, r).await;
        assert_eq!(done.state, TaskState::Cancelled);
        let Some(conf) = done.cancellation.clone() else {
            panic!("cancellation record lost");
        };
        assert_eq!(conf.status, CancelStatus::Confirmed);
        assert_eq!(conf.requested_at, cancel.requested_at);
        let fee = contract.fees.cancel_after_start_fixed + 7 * contract.fees.usage_unit_price;
        assert_eq!(conf.fee, Some(fee), "{op}: fixed + usage × unit price");
        assert_eq!(done.usage, 7, "incurred usage is kept");
        assert!(
            done.generation > a.generation,
            "confirmation retires the attempt's authority"
        );
        assert_stale(
            c.report(&a, succeeded(a.generation)).await,
            "succeeded after confirmed cancel",
        );
        assert_stale(
            c.heartbeat(&a, a.generation, None).await,
            "heartbeat after confirmed cancel",
        );
        let after = c.task(t.id).await;
        assert_eq!(after.state, TaskState::Cancelled);
        assert!(after.delivery.is_none());
        assert_eq!(after.cancellation, Some(conf));
        assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Cancelled);
        c.assert_nothing_claimable(op).await;
        assert_history(&store, t.id).await;
    }
}

/// Cancel after delivery: `too_late`, fee = the delivery's charge, delivery unchanged.
pub async fn cancel_after_delivery_is_too_late(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let done = c.report_ok(&a, succeeded(a.generation)).await;
    let (task, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::TooLate);
    let charge = done.delivery.as_ref().map(|d| d.charge);
    assert_eq!(cancel.fee, charge, "too_late fee is the charge");
    assert_eq!(task.state, TaskState::Succeeded);
    assert_eq!(task.delivery, done.delivery, "the delivery is unchanged");
    assert_eq!(task.generation, done.generation);
    assert_history(&store, t.id).await;
}

/// Cancel requested, then the executor reports `succeeded`: delivery wins, the
/// cancellation is `too_late` with the charge as fee.
pub async fn cancel_pending_then_succeeded_is_too_late(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let a = c.claim_one(op, LONG_LEASE, t.id).await;
        let (_, cancel) = c.cancel(t.id).await;
        assert_eq!(cancel.status, CancelStatus::Requested);
        let done = c.report_ok(&a, succeeded(a.generation)).await;
        assert_eq!(done.state, TaskState::Succeeded);
        let Some(d) = &done.delivery else {
            panic!("delivered");
        };
        assert_eq!(d.charge, contract.price);
        let Some(cx) = &done.cancellation else {
            panic!("the cancellation record stays");
        };
        assert_eq!(cx.status, CancelStatus::TooLate, "{op}: delivery won");
        assert_eq!(cx.fee, Some(d.charge));
        let (_, again) = c.cancel(t.id).await;
        assert_eq!(&again, cx, "asking again returns the same record");
        assert_history(&store, t.id).await;
    }
}

/// Cancelling twice returns the same record (queued → confirmed, running →
/// requested, delivered → too_late).
pub async fn cancel_twice_returns_same_record(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    // Queued.
    let t1 = c.create(SAFE, &contract).await;
    let (_, first) = c.cancel(t1.id).await;
    let (task, second) = c.cancel(t1.id).await;
    assert_eq!(first, second);
    assert_eq!(task.state, TaskState::Cancelled);
    // Running.
    let t2 = c.create(SAFE, &contract).await;
    let a = c.claim_one(SAFE, LONG_LEASE, t2.id).await;
    let (_, first) = c.cancel(t2.id).await;
    let (task, second) = c.cancel(t2.id).await;
    assert_eq!(first, second);
    assert_eq!(first.status, CancelStatus::Requested);
    assert_eq!(task.state, TaskState::Running);
    assert_eq!(
        count(&c.events(t2.id).await, "cancel_requested"),
        1,
        "recorded once"
    );
    c.report_ok(&a, bare(a.generation, Outcome::Cancelled))
        .await;
    // Delivered.
    let t3 = c.create(SAFE, &contract).await;
    let a3 = c.claim_one(SAFE, LONG_LEASE, t3.id).await;
    c.report_ok(&a3, succeeded(a3.generation)).await;
    let (_, first) = c.cancel(t3.id).await;
    let (_, second) = c.cancel(t3.id).await;
    assert_eq!(first, second);
    assert_eq!(first.status, CancelStatus::TooLate);
    for id in [t1.id, t2.id, t3.id] {
        assert_history(&store, id).await;
    }
}

/// Pending cancel and the lease expires without a report, safe class: the
/// cancellation is confirmed, usage kept, generation raised.
pub async fn cancel_pending_safe_lease_expiry_confirms(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    let t = c.create(SAFE, &contract).await;
    let a = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
    ok2(
        c.heartbeat(&a, a.generation, Some(4)).await,
        "heartbeat with usage",
    );
    let (_, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::Requested);
    let done = c
        .run_out_lease(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert_eq!(
        done.state,
        TaskState::Cancelled,
        "safe class: expiry confirms the cancel"
    );
    let Some(cx) = &done.cancellation else {
        panic!("cancellation lost");
    };
    assert_eq!(cx.status, CancelStatus::Confirmed);
    assert_eq!(cx.fee, Some(contract.fees.after_start(4)));
    assert_eq!(done.usage, 4);
    assert!(done.generation > a.generation);
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Expired);
    assert_stale(c.report(&a, succeeded(a.generation)).await, "late report");
    c.assert_nothing_claimable(SAFE).await;
    assert_history(&store, t.id).await;
}

/// Pending cancel and the lease expires, non-safe class: reconcile first; a
/// `committed` reconciliation delivers and the cancellation is `too_late`.
pub async fn cancel_pending_non_safe_lease_expiry_committed_delivers(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let t = c.create(NON_SAFE, &contract).await;
    let _a = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    let (_, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::Requested);
    let rec = c
        .run_out_lease(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert_eq!(
        rec.state,
        TaskState::Reconciling,
        "non-safe: reconcile before confirming"
    );
    assert!(
        rec.cancel_pending(),
        "the cancel stays pending while reconciling"
    );
    let r = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r.kind, AttemptKind::Reconcile);
    let done = c
        .report_ok(
            &r,
            rep(r.generation, Outcome::Committed)
                .result(json!({"paid": true}))
                .build(),
        )
        .await;
    assert_eq!(
        done.state,
        TaskState::Succeeded,
        "delivery wins when the effect was committed"
    );
    let Some(cx) = &done.cancellation else {
        panic!("cancellation lost");
    };
    assert_eq!(cx.status, CancelStatus::TooLate);
    assert_eq!(cx.fee, Some(contract.price));
    assert_eq!(
        done.delivery.as_ref().map(|d| d.charge),
        Some(contract.price)
    );
    assert_history(&store, t.id).await;
}

/// Pending cancel and the lease expires, non-safe class: a `not_committed`
/// reconciliation confirms the cancellation; nothing is executed again.
pub async fn cancel_pending_non_safe_lease_expiry_not_committed_cancels(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let t = c.create(NON_SAFE, &contract).await;
    let _a = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    let (_, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::Requested);
    c.run_out_lease(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
        .await;
    let r = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r.kind, AttemptKind::Reconcile);
    let done = c
        .report_ok(&r, bare(r.generation, Outcome::NotCommitted))
        .await;
    assert_eq!(done.state, TaskState::Cancelled);
    let Some(cx) = &done.cancellation else {
        panic!("cancellation lost");
    };
    assert_eq!(cx.status, CancelStatus::Confirmed);
    assert_eq!(cx.fee, Some(contract.fees.after_start(done.usage)));
    assert!(done.generation > r.generation);
    c.assert_nothing_claimable(NON_SAFE).await;
    let attempts = c.attempts(t.id).await;
    assert_eq!(
        attempts
            .iter()
            .filter(|a| a.kind == AttemptKind::Execute)
            .count(),
        1
    );
    assert_history(&store, t.id).await;
}

/// A `failed` report (any class) while a cancellation is pending confirms the
/// cancellation; no retry (SPEC §4 details).
pub async fn cancel_pending_failed_report_confirms(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for (op, class) in [
        (SAFE, FailureClass::Transient),
        (NON_SAFE, FailureClass::Transient),
        (SAFE, FailureClass::InvalidInput),
        (NON_SAFE, FailureClass::PermissionDenied),
    ] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let a = c.claim_one(op, LONG_LEASE, t.id).await;
        c.cancel(t.id).await;
        let r = rep(a.generation, Outcome::Failed)
            .class(class)
            .usage(1)
            .build();
        let done = c.report_ok(&a, r).await;
        assert_eq!(
            done.state,
            TaskState::Cancelled,
            "{op}/{class}: failed confirms the cancel"
        );
        let Some(cx) = &done.cancellation else {
            panic!("cancellation lost");
        };
        assert_eq!(cx.status, CancelStatus::Confirmed);
        assert_eq!(cx.fee, Some(contract.fees.after_start(1)));
        c.pass(LONGEST_BACKOFF);
        c.assert_nothing_claimable(op).await;
        assert_eq!(c.attempts(t.id).await.len(), 1);
        assert_history(&store, t.id).await;
    }
}

/// 100 rounds of a cancel racing a claim followed by a `succeeded` report on a
/// queued task: exactly one wins. Either the task is cancelled (confirmed, before-start
/// fee, no attempt, no delivery), or it succeeded (charged once; the cancellation
/// is `too_late` with the charge as fee).
pub async fn cancel_races_claim_and_delivery(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut wins = (0, 0);
    for round in 0..200_u32 {
        let op = if round % 2 == 0 { SAFE } else { NON_SAFE };
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let barrier = Arc::new(Barrier::new(2));
        let canceller = {
            let (c, barrier) = (c.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                c.cancel(t.id).await
            })
        };
        let worker = {
            let (c, barrier) = (c.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut got = c.claim(&[op], Some(LONG_LEASE), 1).await;
                match got.pop() {
                    Some(cl) => {
                        assert_eq!(cl.attempt.task_id, t.id);
                        let r = c
                            .report(&cl.attempt, succeeded(cl.attempt.generation))
                            .await;
                        Some(must(r, "report"))
                    }
                    None => None,
                }
            })
        };
        let (_, cancel) = joined(canceller.await);
        let reported = joined(worker.await);
        let task = c.task(t.id).await;
        match task.state {
            TaskState::Cancelled => {
                wins.0 += 1;
                assert!(
                    reported.is_none(),
                    "round {round}: a cancelled queued task is never claimed"
                );
                assert_eq!(cancel.status, CancelStatus::Confirmed);
                let Some(cx) = &task.cancellation else {
                    panic!("round {round}: cancellation lost");
                };
                assert_eq!(cx.status, CancelStatus::Confirmed);
                assert_eq!(cx.fee, Some(contract.fees.cancel_before_start));
                assert!(task.delivery.is_none());
                assert!(c.attempts(t.id).await.is_empty());
            }
            TaskState::Succeeded => {
                wins.1 += 1;
                match &reported {
                    Some(Ok(_)) => {}
                    other => panic!(
                        "round {round}: the claimed attempt must be able to deliver: {other:?}"
                    ),
                }
                assert!(
                    matches!(
                        cancel.status,
                        CancelStatus::Requested | CancelStatus::TooLate
                    ),
                    "round {round}: cancel answer {cancel:?}"
                );
                let Some(d) = &task.delivery else {
                    panic!("round {round}: delivery lost");
                };
                assert_eq!(d.charge, contract.price);
                let Some(cx) = &task.cancellation else {
                    panic!("round {round}: cancellation lost");
                };
                assert_eq!(cx.status, CancelStatus::TooLate);
                assert_eq!(cx.fee, Some(d.charge));
            }
            other => {
                panic!("round {round}: exactly one of cancel and delivery wins, task is {other:?}")
            }
        }
        assert_history(&store, t.id).await;
    }
    assert_eq!(wins.0 + wins.1, 200);
}

/// 50 rounds (safe class): a cancellation is pending and the lease runs out
/// while the executor's `succeeded` report races the expiry sweep. Exactly one
/// wins each round: `cancelled`/`confirmed` with no delivery (and the report
/// is refused as stale), or `succeeded` with the cancellation `too_late`.
pub async fn cancel_pending_expiry_races_succeeded_report(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    let mut wins = (0, 0);
    for round in 0..50_i64 {
        let t = c.create(SAFE, &contract).await;
        let a = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
        let (_, cancel) = c.cancel(t.id).await;
        assert_eq!(cancel.status, CancelStatus::Requested, "round {round}");
        // Move the clock to around the lease end: some rounds before it,
        // some after (real time moves it on a little more).
        c.pass(SHORT_LEASE - 20 + (round % 5) * 10);
        let barrier = Arc::new(Barrier::new(2));
        let sweeper = {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.sweep(SWEEP).await
            })
        };
        let reporter = {
            let (c, barrier, a) = (c.clone(), barrier.clone(), a.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                c.report(&a, succeeded(a.generation)).await
            })
        };
        must(joined(sweeper.await), "sweep");
        let reported = must(joined(reporter.await), "report");
        let task = c
            .after_sweep(t.id, "a winner", |t| t.state.is_terminal())
            .await;
        let Some(cx) = &task.cancellation else {
            panic!("round {round}: cancellation lost");
        };
        match task.state {
            TaskState::Cancelled => {
                wins.0 += 1;
                assert!(
                    task.delivery.is_none(),
                    "round {round}: cancelled and delivered"
                );
                assert!(
                    matches!(
                        reported,
                        Err(Refusal::Machine(Rejection::StaleGeneration { .. }))
                    ),
                    "round {round}: the losing report must be stale: {reported:?}"
                );
                assert_eq!(cx.status, CancelStatus::Confirmed);
                assert_eq!(cx.fee, Some(contract.fees.after_start(task.usage)));
                assert!(task.generation > a.generation);
            }
            TaskState::Succeeded => {
                wins.1 += 1;
                assert!(
                    reported.is_ok(),
                    "round {round}: delivery won, the report applied: {reported:?}"
                );
                let Some(d) = &task.delivery else {
                    panic!("round {round}: delivery lost");
                };
                assert_eq!(d.charge, contract.price);
                assert_eq!(cx.status, CancelStatus::TooLate);
                assert_eq!(cx.fee, Some(d.charge));
            }
            other => {
                panic!("round {round}: exactly one of cancel and delivery wins, task is {other:?}")
            }
        }
        assert_history(&store, t.id).await;
    }
    eprintln!("cancel wins {}, delivery wins {}", wins.0, wins.1);
    assert_eq!(wins.0 + wins.1, 50);
}

// ---------------------------------------------------------------------------
