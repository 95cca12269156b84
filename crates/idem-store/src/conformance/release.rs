//! Releases (SPEC §4 `/release`): an executor gives back an attempt it never
//! started. Fenced by generation like a report, refused once the attempt
//! started, counted against no limit, never followed by a reconcile.

use super::*;

impl Ctx {
    async fn release(&self, a: &Attempt, generation: i64) -> crate::Result<Result<Task, Refusal>> {
        self.store.release(&self.tenant, a.id, generation).await
    }

    async fn release_ok(&self, a: &Attempt) -> Task {
        let what = format!("release attempt {} (gen {})", a.number, a.generation);
        ok2(self.release(a, a.generation).await, &what)
    }

    async fn attempt(&self, task: Uuid, id: Uuid) -> Attempt {
        let attempts = self.attempts(task).await;
        let Some(a) = attempts.into_iter().find(|a| a.id == id) else {
            panic!("attempt {id} of task {task} is listed");
        };
        a
    }
}

/// An old generation and an expired lease are stale and change nothing (the
/// expiry itself is applied); the holder's release puts the task back in
/// `queued`, claimable at once, the attempt kept `released` with one
/// `attempt_released` event; an exact repeat answers the same and adds
/// nothing.
pub async fn release_is_fenced_by_generation_and_repeats_answer_again(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    assert_stale(c.release(&a, a.generation - 1).await, "release gen 0");
    assert_stale(c.release(&a, a.generation + 1).await, "release gen 2");
    assert_eq!(c.attempt(t.id, a.id).await.state, AttemptState::Leased);
    let task = c.release_ok(&a).await;
    assert_eq!(task.state, TaskState::Queued);
    assert_eq!(task.generation, a.generation, "a release raises nothing");
    assert_eq!(c.attempt(t.id, a.id).await.state, AttemptState::Released);
    let events = c.events(t.id).await;
    assert_eq!(count(&events, "attempt_released"), 1);
    let again = c.release_ok(&a).await;
    assert_eq!(api(&again), api(&task), "an exact repeat answers the same");
    assert_eq!(c.events(t.id).await, events, "and adds nothing");
    let b = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    assert_eq!((b.kind, b.generation), (AttemptKind::Execute, 2));
    // The old attempt's generation no longer holds anything.
    assert_stale(c.report(&a, succeeded(a.generation)).await, "late report");
    // A lease that ran out is expired first: stale, and the non-safe class
    // reconciles as for any expiry.
    c.pass(SHORT_LEASE + 1);
    assert_stale(c.release(&b, b.generation).await, "release after expiry");
    assert_eq!(c.attempt(t.id, b.id).await.state, AttemptState::Expired);
    assert_eq!(c.task(t.id).await.state, TaskState::Reconciling);
    assert_history(&store, t.id).await;
}

/// An attempt reported (any outcome) or acknowledged by its device started:
/// its release is refused and changes nothing.
pub async fn release_is_refused_once_the_attempt_started(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a, failed(a.generation, FailureClass::Transient))
        .await;
    let before = c.task(t.id).await;
    let r = must(c.release(&a, a.generation).await, "release reported");
    assert!(
        matches!(
            r,
            Err(Refusal::Machine(Rejection::AlreadyReported {
                existing: Outcome::Failed
            }))
        ),
        "a reported attempt is not released: {r:?}"
    );
    assert_eq!(api(&c.task(t.id).await), api(&before));
    assert_eq!(c.attempt(t.id, a.id).await.state, AttemptState::Failed);
    assert_history(&store, t.id).await;

    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    ok2(
        store
            .acknowledge("acme", a.id, a.generation, json!({"device": "valve-3"}))
            .await,
        "acknowledge",
    );
    let r = must(c.release(&a, a.generation).await, "release acknowledged");
    assert!(
        matches!(r, Err(Refusal::Machine(Rejection::Acknowledged))),
        "an acknowledged attempt is not released: {r:?}"
    );
    assert_eq!(
        c.attempt(t.id, a.id).await.state,
        AttemptState::Acknowledged
    );
    assert_eq!(c.task(t.id).await.state, TaskState::Running);
    assert_history(&store, t.id).await;
}

/// With `max_attempts` 1 on the non-safe class, a claimed and released
/// attempt leaves the task's one execute attempt unused: the next claim is an
/// execute attempt, even once the released lease's time has passed (no
/// reconcile: nothing ran), and the task delivers.
pub async fn released_attempts_count_against_no_limit_and_are_never_reconciled(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut one = contract(NON_SAFE);
    one.retry.max_attempts = 1;
    let t = c.create(NON_SAFE, &one).await;
    for _ in 0..3 {
        let a = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
        assert_eq!(a.kind, AttemptKind::Execute);
        c.release_ok(&a).await;
        c.pass(SHORT_LEASE + 1);
        let after = c
            .after_sweep(t.id, "queued", |t| t.state == TaskState::Queued)
            .await;
        assert!(after.failure.is_none(), "no limit was used up: {after:?}");
    }
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(
        (a.kind, a.number, a.generation),
        (AttemptKind::Execute, 4, 4)
    );
    let done = c.report_ok(&a, succeeded(a.generation)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let events = c.events(t.id).await;
    assert_eq!(count(&events, "attempt_released"), 3);
    assert_eq!(count(&events, "reconciliation_required"), 0);
    assert_eq!(count(&events, "lease_expired"), 0);
    let states: Vec<AttemptState> = c.attempts(t.id).await.iter().map(|a| a.state).collect();
    assert_eq!(
        states,
        [
            AttemptState::Released,
            AttemptState::Released,
            AttemptState::Released,
            AttemptState::Succeeded
        ]
    );
    assert_history(&store, t.id).await;
}

/// A release with a cancellation pending confirms it with the before-start
/// fee (no execute attempt started); after one that did start, the
/// after-start fee.
pub async fn release_with_a_pending_cancellation_confirms_it(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    let t = c.create(SAFE, &contract).await;
    let a = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    assert_eq!(c.cancel(t.id).await.1.status, CancelStatus::Requested);
    let task = c.release_ok(&a).await;
    let cancel = task.cancellation.clone();
    assert_eq!(task.state, TaskState::Cancelled);
    assert_eq!(
        cancel.map(|x| (x.status, x.fee)),
        Some((
            CancelStatus::Confirmed,
            Some(contract.fees.cancel_before_start)
        ))
    );
    c.assert_nothing_claimable(SAFE).await;
    assert_history(&store, t.id).await;

    let t = c.create(SAFE, &contract).await;
    let a = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    c.report_ok(
        &a,
        rep(a.generation, Outcome::Failed)
            .class(FailureClass::Transient)
            .usage(4)
            .build(),
    )
    .await;
    let b = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    c.cancel(t.id).await;
    let task = c.release_ok(&b).await;
    let fee = task.cancellation.and_then(|x| x.fee);
    assert_eq!(
        fee,
        Some(contract.fees.cancel_after_start_fixed + 4 * contract.fees.usage_unit_price)
    );
    assert_history(&store, t.id).await;
}

/// Another tenant's attempt is not found, and its release changes nothing.
pub async fn release_of_another_tenants_attempt_is_not_found(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let other = Ctx::new(&store, "globex").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    assert_not_found(other.release(&a, a.generation).await, "other tenant");
    assert_not_found(
        store.release("acme", Uuid::new_v4(), 1).await,
        "no such attempt",
    );
    assert_eq!(c.attempt(t.id, a.id).await.state, AttemptState::Leased);
    assert_eq!(c.task(t.id).await.state, TaskState::Running);
    assert_history(&store, t.id).await;
}
