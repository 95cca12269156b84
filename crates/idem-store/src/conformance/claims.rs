//! Claims, leases and reconciliation (SPEC §2.4–2.6): what a claim leases and
//! in which order, delivery on `succeeded`, fencing of an expired lease's
//! generation, heartbeats, and the reconcile attempts that follow an expired
//! non-safe lease or an `unknown` report.

use super::*;

/// A claim leases attempt number 1, generation 1, kind `execute`, with the
/// task's params; while it is leased nothing more is claimable.
pub async fn claim_leases_first_attempt_with_params(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let mut got = c.claim(&[NON_SAFE], Some(5_000), 1).await;
    assert_eq!(got.len(), 1, "the queued task is claimable");
    let cl = got.remove(0);
    let a = &cl.attempt;
    assert_eq!(a.task_id, t.id);
    assert_eq!((a.number, a.generation), (1, 1));
    assert_eq!(a.kind, AttemptKind::Execute);
    assert_eq!(a.state, AttemptState::Leased);
    assert_eq!(a.executor_id, "executor-acme");
    assert_eq!(
        a.lease_expires_at.ms() - a.leased_at.ms(),
        5_000,
        "the lease asked for"
    );
    assert_eq!(a.usage, 0);
    assert_eq!(cl.task.id, t.id);
    assert_eq!(cl.task.params, t.params);
    assert_eq!(cl.task.operation, NON_SAFE);
    assert_eq!(cl.task.idempotency_key, t.idempotency_key);
    assert_eq!(cl.task.state, TaskState::Running);
    assert_eq!((cl.task.generation, cl.task.attempt_count), (1, 1));
    assert!(
        c.claim(&[NON_SAFE], None, 5).await.is_empty(),
        "a leased task is not claimable"
    );
    let listed = c.attempts(t.id).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, a.id);
    assert_eq!((listed[0].number, listed[0].generation), (1, 1));
    assert_eq!(listed[0].state, AttemptState::Leased);
    assert_eq!(listed[0].lease_expires_at, a.lease_expires_at);
    let stored = c.task(t.id).await;
    assert_eq!(
        api(&stored),
        api(&cl.task),
        "the claim's task is the stored task"
    );
    assert!(kinds(&c.events(t.id).await).contains(&"attempt_leased"));
    assert_history(&store, t.id).await;
}

/// Claims return only the claimer's tenant's tasks of the classes asked for,
/// at most `max`, each task once.
pub async fn claim_respects_tenant_operations_and_max(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let other = Ctx::new(&store, "globex").await;
    let mut safe_ids = BTreeSet::new();
    for _ in 0..5 {
        safe_ids.insert(c.create(SAFE, &contract(SAFE)).await.id);
    }
    let pay = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    assert!(
        other.claim(&[SAFE, NON_SAFE], None, 10).await.is_empty(),
        "other tenant claims nothing"
    );
    assert!(
        c.claim(&["inventory.reserve"], None, 10).await.is_empty(),
        "other classes claim nothing"
    );
    let got = c.claim(&[NON_SAFE], None, 10).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].task.id, pay.id);
    let mut seen = BTreeSet::new();
    for expect in [3, 2, 0] {
        let got = c.claim(&[SAFE], None, 3).await;
        assert_eq!(got.len(), expect, "max 3 out of what is left");
        for cl in got {
            assert!(safe_ids.contains(&cl.task.id));
            assert!(seen.insert(cl.task.id), "a task was claimed twice");
            assert_eq!(cl.attempt.generation, 1);
        }
    }
    assert_eq!(seen, safe_ids);
    for id in safe_ids.iter().chain([&pay.id]) {
        assert_history(&store, *id).await;
    }
}

/// A claim takes the oldest ready tasks first (`ready_at`, then id) across all
/// the classes it names, a class named twice counting once, and stops at its
/// max.
pub async fn claim_takes_oldest_ready_first_across_classes(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let op = if i % 2 == 0 { SAFE } else { NON_SAFE };
        tasks.push(c.create(op, &contract(op)).await);
    }
    tasks.sort_by_key(|t| (t.control.ready_at, t.id));
    let order: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
    let mut claimed = Vec::new();
    for expect in [3, 3, 2, 0] {
        let got = c.claim(&[NON_SAFE, SAFE, NON_SAFE], None, 3).await;
        assert_eq!(got.len(), expect, "max 3 out of what is left");
        let mut ids: Vec<Uuid> = got.iter().map(|cl| cl.task.id).collect();
        ids.sort_by_key(|id| order.iter().position(|o| o == id));
        claimed.extend(ids);
    }
    assert_eq!(claimed, order, "oldest ready first, each task once");
}

/// `succeeded` delivers: the task succeeds with a delivery whose charge is the
/// contract price and which keeps the external transaction id; acknowledging
/// the delivery twice returns the same record; a replay shows it (SPEC §2.6).
pub async fn succeeded_report_delivers_once_with_charge(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let s = c.submission(NON_SAFE, "pay-1", params(NON_SAFE, 1), &contract);
    let t = created(c.submit(s.clone()).await);
    let early = must(
        store.acknowledge_delivery("acme", t.id).await,
        "acknowledge_delivery",
    );
    assert!(
        matches!(early, Err(Refusal::Machine(Rejection::NotDelivered))),
        "nothing to acknowledge yet: {early:?}"
    );
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let r = rep(a.generation, Outcome::Succeeded)
        .result(json!({"receipt": "r-1"}))
        .usage(3)
        .txn("txn-42")
        .build();
    let done = c.report_ok(&a, r).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let Some(d) = done.delivery.clone() else {
        panic!("a succeeded task has a delivery");
    };
    assert_eq!(
        d.charge, contract.price,
        "delivery.charge == contract.price"
    );
    assert_eq!(d.result, json!({"receipt": "r-1"}));
    assert_eq!(d.external_txn_id.as_deref(), Some("txn-42"));
    assert!(d.acknowledged_at.is_none());
    assert_eq!(done.usage, 3);
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts[0].state, AttemptState::Succeeded);
    assert_eq!(attempts[0].external_txn_id.as_deref(), Some("txn-42"));
    assert_eq!(attempts[0].usage, 3);

    let ack1 = ok2(
        store.acknowledge_delivery("acme", t.id).await,
        "acknowledge_delivery",
    );
    let ack2 = ok2(
        store.acknowledge_delivery("acme", t.id).await,
        "acknowledge_delivery again",
    );
    let Some(d1) = ack1.delivery.clone() else {
        panic!("delivery lost");
    };
    assert!(d1.acknowledged_at.is_some());
    assert_eq!(
        ack2.delivery, ack1.delivery,
        "a second acknowledgment returns the same record"
    );
    assert_eq!(d1.charge, d.charge, "the charge never changes");
    assert_eq!(
        (d1.result.clone(), d1.delivered_at),
        (d.result.clone(), d.delivered_at)
    );
    let r = replayed(c.submit(s).await);
    assert_eq!(r.id, t.id);
    assert_eq!(r.state, TaskState::Succeeded);
    assert_eq!(
        r.delivery, ack1.delivery,
        "a replay shows the recorded delivery"
    );
    c.assert_nothing_claimable(NON_SAFE).await;
    assert_eq!(c.attempts(t.id).await.len(), 1, "no further attempt");
    assert_history(&store, t.id).await;
}

/// Safe class: an expired lease leads to attempt 2 with generation 2; attempt 1's
/// late report is refused as stale, kept as evidence, and changes nothing; its
/// heartbeat is stale too (SPEC §2.4, RETRY-01).
pub async fn safe_lease_expiry_fences_old_generation(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a1 = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
    let expired = c
        .run_out_lease(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert!(
        matches!(expired.state, TaskState::RetryWait | TaskState::Queued),
        "a safe class retries after an expired lease: {:?}",
        expired.state
    );
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Expired);
    assert_stale(
        c.heartbeat(&a1, 1, None).await,
        "heartbeat of an expired lease",
    );

    let a2 = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    assert_eq!((a2.number, a2.generation), (2, 2));
    assert_eq!(a2.kind, AttemptKind::Execute);
    assert_ne!(a2.id, a1.id, "every attempt has a new id");
    let before = c.task(t.id).await;
    let late = must(
        c.report(
            &a1,
            rep(1, Outcome::Succeeded)
                .result(json!({"late": true}))
                .usage(9)
                .build(),
        )
        .await,
        "late report",
    );
    assert_eq!(
        late,
        Err(Refusal::Machine(Rejection::StaleGeneration {
            presented: 1,
            current: 2
        })),
        "a report with an old generation is stale"
    );
    let after = c.task(t.id).await;
    assert_eq!(after.state, TaskState::Running);
    assert_eq!(
        (after.generation, after.attempt_count, after.usage),
        (before.generation, before.attempt_count, before.usage),
        "a stale report changes no task state"
    );
    assert!(after.delivery.is_none());
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts.len(), 2, "old attempts stay visible");
    assert_eq!(attempts[0].state, AttemptState::Expired);
    assert_eq!(attempts[0].usage, 0, "stale usage is evidence only");
    let ev = attempts[0]
        .evidence
        .iter()
        .find(|e| e.disposition == Disposition::StaleGeneration);
    let Some(ev) = ev else {
        panic!(
            "the late report is kept as evidence: {:?}",
            attempts[0].evidence
        );
    };
    assert_eq!(ev.generation, 1);
    assert_eq!(ev.outcome, EvidenceOutcome::Succeeded);
    assert_eq!(ev.body["result"], json!({"late": true}));
    assert_stale(
        c.heartbeat(&a1, 1, None).await,
        "heartbeat with generation 1",
    );
    assert_stale(
        c.heartbeat(&a2, 1, None).await,
        "heartbeat on attempt 2 with generation 1",
    );
    let hb = ok2(
        c.heartbeat(&a2, 2, None).await,
        "heartbeat of the live attempt",
    );
    assert!(!hb.cancel_requested);
    let done = c.report_ok(&a2, succeeded(2)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    assert_history(&store, t.id).await;
}

/// Heartbeats extend a lease past its original end; the attempt keeps its lease.
pub async fn heartbeat_extends_lease(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let lease = 1_000;
    let a = c.claim_one(SAFE, lease, t.id).await;
    let mut last = a.lease_expires_at;
    for i in 1..=6 {
        c.pass(250);
        let hb = ok2(c.heartbeat(&a, a.generation, Some(i)).await, "heartbeat");
        assert!(hb.lease_expires_at > last, "a heartbeat extends the lease");
        last = hb.lease_expires_at;
        must(store.sweep(SWEEP).await, "sweep");
    }
    let listed = c.attempts(t.id).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].state,
        AttemptState::Leased,
        "a heartbeated lease does not expire"
    );
    assert_eq!(listed[0].lease_expires_at, last);
    assert_eq!(c.task(t.id).await.usage, 6, "heartbeat usage is recorded");
    let done = c.report_ok(&a, succeeded(a.generation)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    assert_history(&store, t.id).await;
}

/// Non-safe class: an expired lease moves the task to `reconciling`; the next
/// claim is a reconcile attempt; `not_committed` allows a new execute attempt
/// with a higher generation (SPEC §2.5).
pub async fn non_safe_lease_expiry_reconciles_then_not_committed_re_executes(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a1 = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    let rec = c
        .run_out_lease(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert_eq!(
        rec.state,
        TaskState::Reconciling,
        "an unknown outcome is reconciled"
    );
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Expired);
    let r2 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(
        r2.kind,
        AttemptKind::Reconcile,
        "no execute attempt before reconciliation"
    );
    assert_eq!((r2.number, r2.generation), (2, 2));
    assert_eq!(c.task(t.id).await.state, TaskState::Reconciling);
    let after = c
        .report_ok(&r2, bare(r2.generation, Outcome::NotCommitted))
        .await;
    assert!(
        !after.state.is_terminal() && after.state != TaskState::Reconciling,
        "not_committed allows a new execute attempt: {:?}",
        after.state
    );
    // … after the contract's backoff, as a transient failure's retry.
    assert_eq!(after.state, TaskState::RetryWait);
    assert!(
        c.claim(&[NON_SAFE], Some(LONG_LEASE), 1).await.is_empty(),
        "no execute attempt before the backoff passed"
    );
    let a3 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(a3.kind, AttemptKind::Execute);
    assert_eq!(a3.number, 3);
    assert!(a3.generation > r2.generation);
    assert_stale(
        c.report(&a1, succeeded(1)).await,
        "late report of attempt 1",
    );
    let done = c.report_ok(&a3, succeeded(a3.generation)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts[1].state, AttemptState::NotCommitted);
    assert_history(&store, t.id).await;
}

/// Non-safe class: after an expired lease, a reconcile attempt reporting
/// `committed` delivers the reconciled result; no further execute attempt.
pub async fn non_safe_lease_expiry_reconciles_then_committed_delivers(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let t = c.create(NON_SAFE, &contract).await;
    let _a1 = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    c.run_out_lease(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
        .await;
    let r2 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r2.kind, AttemptKind::Reconcile);
    let report = rep(r2.generation, Outcome::Committed)
        .result(json!({"found": "payout p-9"}))
        .txn("bank-77")
        .build();
    let done = c.report_ok(&r2, report).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let Some(d) = &done.delivery else {
        panic!("committed delivers");
    };
    assert_eq!(d.charge, contract.price);
    assert_eq!(d.result, json!({"found": "payout p-9"}));
    assert_eq!(d.external_txn_id.as_deref(), Some("bank-77"));
    c.assert_nothing_claimable(NON_SAFE).await;
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts.len(), 2);
    assert_eq!(
        attempts
            .iter()
            .filter(|a| a.kind == AttemptKind::Execute)
            .count(),
        1,
        "committed never leads to another execute attempt"
    );
    assert_eq!(attempts[1].state, AttemptState::Committed);
    assert_history(&store, t.id).await;
}

/// An executor reporting `unknown` moves the task to `reconciling` on both
/// classes; the next attempt is a reconcile attempt (SPEC §2.5).
pub async fn unknown_report_reconciles_before_any_retry(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let t = c.create(op, &contract(op)).await;
        let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
        let after = c
            .report_ok(&a1, bare(a1.generation, Outcome::Unknown))
            .await;
        assert_eq!(
            after.state,
            TaskState::Reconciling,
            "{op}: unknown → reconciling"
        );
        assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Unknown);
        let r2 = c.claim_due(op, LONG_LEASE, t.id).await;
        assert_eq!(
            r2.kind,
            AttemptKind::Reconcile,
            "{op}: reconcile before any retry"
        );
        assert_eq!(r2.generation, 2);
        c.report_ok(&r2, bare(r2.generation, Outcome::NotCommitted))
            .await;
        let a3 = c.claim_due(op, LONG_LEASE, t.id).await;
        assert_eq!(a3.kind, AttemptKind::Execute);
        c.report_ok(&a3, succeeded(a3.generation)).await;
        assert_history(&store, t.id).await;
    }
}

/// A reconcile attempt that fails `transient` leads to another reconcile
/// attempt, never to an execute attempt (SPEC §4 details).
pub async fn failed_reconcile_leads_to_another_reconcile(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [NON_SAFE, SAFE] {
        let t = c.create(op, &contract(op)).await;
        let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
        c.report_ok(&a1, bare(a1.generation, Outcome::Unknown))
            .await;
        let r2 = c.claim_due(op, LONG_LEASE, t.id).await;
        assert_eq!(r2.kind, AttemptKind::Reconcile);
        let after = c
            .report_ok(&r2, failed(r2.generation, FailureClass::Transient))
            .await;
        assert_eq!(
            after.state,
            TaskState::Reconciling,
            "{op}: still reconciling"
        );
        let r3 = c.reconcile_again(op, t.id).await;
        c.commit_after_one_execute(&r3, t.id).await;
    }
}

/// A reconcile attempt whose lease expires without a report leads to another
/// reconcile attempt, never to an execute attempt, on both classes (SPEC §2.5).
pub async fn reconcile_lease_expiry_leads_to_another_reconcile(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [NON_SAFE, SAFE] {
        let t = c.create(op, &contract(op)).await;
        let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
        c.report_ok(&a1, bare(a1.generation, Outcome::Unknown))
            .await;
        let r2 = c.claim_due(op, SHORT_LEASE, t.id).await;
        assert_eq!(r2.kind, AttemptKind::Reconcile);
        c.run_out_lease(t.id, "still reconciling", |t| {
            t.state == TaskState::Reconciling
        })
        .await;
        assert_eq!(c.attempts(t.id).await[1].state, AttemptState::Expired);
        let r3 = c.reconcile_again(op, t.id).await;
        assert_stale(
            c.report(&r2, bare(r2.generation, Outcome::NotCommitted))
                .await,
            "late reconcile report",
        );
        c.commit_after_one_execute(&r3, t.id).await;
    }
}
