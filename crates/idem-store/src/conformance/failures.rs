//! Retries and failures (SPEC §2.5, §2.8, §4 details): backoff on the safe
//! class, the failure classes that never retry, exhausted attempts, budget and
//! deadline, a revoked key stopping further attempts, and repeated or invalid
//! reports.

use super::*;

/// Safe class, `transient`: `retry_wait`, not claimable during the backoff,
/// woken to `queued` by the sweeper after it, then attempt 2 (SPEC §2.5).
pub async fn transient_on_safe_class_retries_after_backoff(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.backoff = Backoff {
        initial_ms: 1_000,
        multiplier: 2.0,
        max_ms: 1_000,
    };
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    let after = c
        .report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    assert_eq!(
        after.state,
        TaskState::RetryWait,
        "transient on a safe class backs off"
    );
    assert!(after.failure.is_none());
    assert!(
        c.claim(&[SAFE], None, 1).await.is_empty(),
        "not claimable during the backoff"
    );
    // 400 ms before the 1 s backoff ends: PostgreSQL's clock is the
    // database's plus the test clock's offset, so real time passes too, and
    // a loaded machine may take a few hundred ms between these steps.
    c.pass(600);
    must(store.sweep(SWEEP).await, "sweep");
    assert_eq!(
        c.task(t.id).await.state,
        TaskState::RetryWait,
        "not woken before the backoff ends"
    );
    assert!(
        c.claim(&[SAFE], None, 1).await.is_empty(),
        "not claimable before the backoff ends"
    );
    c.pass(401);
    let woken = c
        .after_sweep(t.id, "backoff wake-up", |t| t.state != TaskState::RetryWait)
        .await;
    assert_eq!(
        woken.state,
        TaskState::Queued,
        "the sweeper wakes the task to queued"
    );
    let a2 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    assert_eq!(
        (a2.number, a2.generation, a2.kind),
        (2, 2, AttemptKind::Execute)
    );
    c.report_ok(&a2, succeeded(a2.generation)).await;
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Failed);
    assert_history(&store, t.id).await;
}

/// Non-safe class, `transient`: the task fails with class `transient`, no retry.
pub async fn transient_on_non_safe_class_fails(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a1 = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let after = c
        .report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    assert_failed(&after, FailureClass::Transient);
    c.pass(LONGEST_BACKOFF);
    c.assert_nothing_claimable(NON_SAFE).await;
    assert_failed(&c.task(t.id).await, FailureClass::Transient);
    assert_eq!(c.attempts(t.id).await.len(), 1);
    assert_history(&store, t.id).await;
}

/// `invalid_input` and `permission_denied` are never retried, on either class.
pub async fn invalid_input_and_permission_denied_never_retry(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        for class in [FailureClass::InvalidInput, FailureClass::PermissionDenied] {
            let t = c.create(op, &contract(op)).await;
            let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
            let after = c.report_ok(&a1, failed(a1.generation, class)).await;
            assert_failed(&after, class);
            c.pass(LONGEST_BACKOFF);
            c.assert_nothing_claimable(op).await;
            assert_failed(&c.task(t.id).await, class);
            assert_eq!(c.attempts(t.id).await.len(), 1, "{op}/{class}: no retry");
            assert_history(&store, t.id).await;
        }
    }
}

/// After `max_attempts` execute attempts fail transiently, the task fails
/// `attempts_exhausted`.
pub async fn attempts_exhausted_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.max_attempts = 2;
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    let a2 = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    let after = c
        .report_ok(&a2, failed(a2.generation, FailureClass::Transient))
        .await;
    assert_failed(&after, FailureClass::AttemptsExhausted);
    c.pass(LONGEST_BACKOFF);
    c.assert_nothing_claimable(SAFE).await;
    assert_eq!(c.attempts(t.id).await.len(), 2);
    assert_history(&store, t.id).await;
}

/// Usage beyond the usage budget stops retries: `budget_exhausted`.
pub async fn budget_exhausted_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.usage_budget = 10;
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    ok2(c.heartbeat(&a1, a1.generation, Some(4)).await, "heartbeat");
    let r = rep(a1.generation, Outcome::Failed)
        .class(FailureClass::Transient)
        .usage(11)
        .build();
    let after = c.report_ok(&a1, r).await;
    assert_failed(&after, FailureClass::BudgetExhausted);
    assert_eq!(after.usage, 11, "incurred usage is kept");
    c.pass(LONGEST_BACKOFF);
    c.assert_nothing_claimable(SAFE).await;
    assert_eq!(c.attempts(t.id).await.len(), 1);
    assert_history(&store, t.id).await;
}

/// No execute attempt starts after the deadline: the claim returns nothing and
/// the task fails `deadline_exceeded`.
pub async fn deadline_exceeded_before_attempt_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let mut contract = contract(op);
        contract.retry.deadline_ms = 1_000;
        let t = c.create(op, &contract).await;
        c.pass(1_100);
        assert!(
            c.claim(&[op], None, 1).await.is_empty(),
            "{op}: no attempt after the deadline"
        );
        assert_failed(&c.task(t.id).await, FailureClass::DeadlineExceeded);
        assert!(c.attempts(t.id).await.is_empty());
        assert_history(&store, t.id).await;
    }
}

/// A backlog of queued tasks whose deadline passed does not make a claim come
/// back empty while a due task waits behind it: the claim ends them
/// (`deadline_exceeded`) and leases the due one (SPEC §4: an empty list means
/// nothing is due).
pub async fn a_backlog_past_its_deadline_does_not_hide_due_work(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut dead = contract(SAFE);
    dead.retry.deadline_ms = 1;
    let mut backlog = Vec::new();
    for _ in 0..40 {
        backlog.push(c.create(SAFE, &dead).await);
    }
    c.pass(50);
    let due = c.create(SAFE, &contract(SAFE)).await;
    let claimed = c.claim(&[SAFE], None, 1).await;
    assert_eq!(
        claimed.len(),
        1,
        "the due task is leased by the first claim"
    );
    assert_eq!(claimed[0].task.id, due.id);
    for t in &backlog {
        assert_failed(&c.task(t.id).await, FailureClass::DeadlineExceeded);
    }
}

/// A transient failure after the deadline fails the task `deadline_exceeded`
/// instead of scheduling a retry.
pub async fn deadline_exceeded_after_transient_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.deadline_ms = 1_500;
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    c.pass(1_700);
    let after = c
        .report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    assert_failed(&after, FailureClass::DeadlineExceeded);
    c.assert_nothing_claimable(SAFE).await;
    assert_history(&store, t.id).await;
}

/// Revoking the submitting key before the first attempt: the claim returns
/// nothing and the task fails `permission_denied` (SPEC §2.8).
pub async fn revoked_key_fails_task_before_first_attempt(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let revoked = must(store.revoke_api_key(c.key.id).await, "revoke_api_key");
    assert!(
        revoked.is_some_and(|k| k.revoked_at.is_some()),
        "the key is revoked"
    );
    assert!(
        c.claim(&[NON_SAFE], None, 1).await.is_empty(),
        "no attempt with a revoked key"
    );
    assert_failed(&c.task(t.id).await, FailureClass::PermissionDenied);
    assert!(c.attempts(t.id).await.is_empty());
    assert_history(&store, t.id).await;
}

/// Revoking the submitting key while a retry is pending: the next claim
/// returns nothing and the task fails `permission_denied` (SPEC §2.8).
pub async fn revoked_key_fails_task_before_retry(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    must(store.revoke_api_key(c.key.id).await, "revoke_api_key");
    c.pass(LONGEST_BACKOFF);
    must(store.sweep(SWEEP).await, "sweep");
    assert!(
        c.claim(&[SAFE], None, 1).await.is_empty(),
        "no retry with a revoked key"
    );
    assert_failed(&c.task(t.id).await, FailureClass::PermissionDenied);
    assert_eq!(c.attempts(t.id).await.len(), 1);
    assert_history(&store, t.id).await;
}

/// Revoking the submitting key while reconciling: re-execution after
/// `not_committed` is refused and the task fails `permission_denied`; no
/// execute attempt starts after the revocation (SPEC §2.8).
pub async fn revoked_key_fails_task_before_re_execution_after_reconciliation(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a1 = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a1, bare(a1.generation, Outcome::Unknown))
        .await;
    must(store.revoke_api_key(c.key.id).await, "revoke_api_key");
    // Reconciling only asks the external system; a backend may run it or not.
    let mut got = c.claim(&[NON_SAFE], Some(LONG_LEASE), 1).await;
    if let Some(cl) = got.pop() {
        assert_eq!(
            cl.attempt.kind,
            AttemptKind::Reconcile,
            "no execute attempt before reconciliation"
        );
        c.report_ok(
            &cl.attempt,
            bare(cl.attempt.generation, Outcome::NotCommitted),
        )
        .await;
        // The next execute attempt waits its backoff, then meets the revocation.
        c.pass(LONGEST_BACKOFF);
        must(store.sweep(SWEEP).await, "sweep");
        assert!(
            c.claim(&[NON_SAFE], None, 1).await.is_empty(),
            "no re-execution with a revoked key"
        );
    }
    assert_failed(&c.task(t.id).await, FailureClass::PermissionDenied);
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

/// An exact repeat of an applied report answers Ok; a different outcome is
/// refused `AlreadyReported`; both are kept as evidence (SPEC §4 details).
pub async fn repeated_report_is_idempotent_and_different_report_refused(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    let r = rep(a.generation, Outcome::Succeeded)
        .result(json!({"image": "i-1"}))
        .usage(2)
        .build();
    let first = c.report_ok(&a, r.clone()).await;
    let again = c.report_ok(&a, r).await;
    assert_eq!(again.state, TaskState::Succeeded);
    assert_eq!(again.delivery, first.delivery, "a repeat changes nothing");
    let other = must(
        c.report(&a, failed(a.generation, FailureClass::InvalidInput))
            .await,
        "report",
    );
    match other {
        Err(Refusal::Machine(Rejection::AlreadyReported { existing })) => {
            assert_eq!(existing, Outcome::Succeeded);
        }
        other => panic!("a different outcome is AlreadyReported, got {other:?}"),
    }
    let after = c.task(t.id).await;
    assert_eq!(after.state, TaskState::Succeeded);
    assert_eq!(after.delivery, first.delivery);
    assert!(after.failure.is_none());
    assert_eq!(after.usage, 2);
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts[0].state, AttemptState::Succeeded);
    assert_eq!(
        dispositions(&attempts[0]),
        ["applied", "repeat", "already_reported"]
    );
    let outcomes: Vec<&str> = attempts[0]
        .evidence
        .iter()
        .map(|e| e.outcome.as_str())
        .collect();
    assert_eq!(outcomes, ["succeeded", "succeeded", "failed"]);
    assert_history(&store, t.id).await;
}

/// A `failed` report without a failure class is refused and stores nothing.
pub async fn invalid_report_changes_nothing(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let before = c.task(t.id).await;
    let events = c.events(t.id).await;
    let res = must(
        c.report(&a, bare(a.generation, Outcome::Failed)).await,
        "report",
    );
    assert!(
        matches!(res, Err(Refusal::Machine(Rejection::InvalidReport(_)))),
        "failed without failure_class is invalid: {res:?}"
    );
    assert_eq!(api(&c.task(t.id).await), api(&before), "nothing changed");
    assert_eq!(c.events(t.id).await, events, "no event");
    let attempts = c.attempts(t.id).await;
    assert!(
        attempts[0].evidence.is_empty(),
        "an invalid report is not evidence"
    );
    assert_eq!(attempts[0].state, AttemptState::Leased);
    c.report_ok(&a, succeeded(a.generation)).await;
    assert_history(&store, t.id).await;
}

// ---------------------------------------------------------------------------

/// An executor key checked inside the claim's or the report's own
/// transaction ([`Store::claim_as`], [`Store::report_as`]): while it is
/// live they lease and report as [`Store::claim`] and [`Store::report`] do;
/// once it is revoked they lease nothing and write nothing (SPEC §4 Auth).
pub async fn executor_key_is_checked_in_the_claim_and_report_transactions(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let first = c.create(SAFE, &contract(SAFE)).await;
    let second = c.create(SAFE, &contract(SAFE)).await;
    let mut keys = Vec::new();
    for _ in 0..2 {
        let (key, _) = must(
            store.create_api_key("acme", Role::Executor, None).await,
            "create_api_key",
        );
        keys.push(key.id);
    }
    let req = ClaimRequest {
        tenant: "acme".into(),
        operations: vec![SAFE.into()],
        executor_id: "executor-keyed".into(),
        max: 1,
        lease_ms: Some(LONG_LEASE),
        flow: Default::default(),
    };
    let got = must(store.claim_as(keys[0], req.clone()).await, "claim_as");
    let Some(claimed) = got else {
        panic!("a live key claims");
    };
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    let a = claimed[0].attempt.clone();
    assert_eq!(a.task_id, first.id, "the oldest task first");
    must(store.revoke_api_key(keys[0]).await, "revoke_api_key");
    let refused = must(
        store
            .report_as(keys[0], "acme", a.id, succeeded(a.generation))
            .await,
        "report_as",
    );
    assert!(
        refused.is_none(),
        "a revoked key reports nothing: {refused:?}"
    );
    assert_eq!(c.task(first.id).await.state, TaskState::Running);
    let none = must(store.claim_as(keys[0], req.clone()).await, "claim_as");
    assert!(none.is_none(), "a revoked key leases nothing: {none:?}");
    assert_eq!(c.task(second.id).await.state, TaskState::Queued);
    assert!(c.attempts(second.id).await.is_empty());
    let done = must(
        store
            .report_as(keys[1], "acme", a.id, succeeded(a.generation))
            .await,
        "report_as",
    );
    match done {
        Some(Ok(task)) => assert_eq!(task.state, TaskState::Succeeded),
        other => panic!("a live key's report applies: {other:?}"),
    }
    assert_history(&store, first.id).await;
}
