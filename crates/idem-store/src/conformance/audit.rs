//! Device acknowledgment, retention, usage and audit (SPEC §2.9, §2.10): the
//! acknowledged-then-completed path, when a terminal key is released, usage
//! kept across attempts, and gap-free events with increasing generations.

use super::*;

/// A device "command acknowledged" marks the attempt `acknowledged` and leaves
/// the task `running` (event `command_acknowledged`, once); physical completion
/// is the later `succeeded` report (event `completion_observed`).
pub async fn device_acknowledge_then_completion(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let task = ok2(
        store
            .acknowledge("acme", a.id, a.generation, json!({"device": "valve-3"}))
            .await,
        "acknowledge",
    );
    assert_eq!(
        task.state,
        TaskState::Running,
        "acknowledged is not completed"
    );
    assert!(task.delivery.is_none());
    ok2(
        store
            .acknowledge("acme", a.id, a.generation, json!({"device": "valve-3"}))
            .await,
        "acknowledge again",
    );
    assert_stale(
        store
            .acknowledge("acme", a.id, a.generation + 1, json!({}))
            .await,
        "acknowledge with a wrong generation",
    );
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts[0].state, AttemptState::Acknowledged);
    let events = c.events(t.id).await;
    assert_eq!(
        count(&events, "command_acknowledged"),
        1,
        "acknowledged once"
    );
    ok2(
        c.heartbeat(&a, a.generation, None).await,
        "heartbeat of an acknowledged attempt",
    );
    let done = c.report_ok(&a, succeeded(a.generation)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let events = c.events(t.id).await;
    let k = kinds(&events);
    let ack_at = k.iter().position(|k| *k == "command_acknowledged");
    let done_at = k.iter().position(|k| *k == "completion_observed");
    assert!(
        matches!((ack_at, done_at), (Some(x), Some(y)) if x < y),
        "command_acknowledged, then completion_observed: {k:?}"
    );
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Succeeded);
    assert_history(&store, t.id).await;
}

/// A contract whose windows are short: retention 15 s = 5 s + 5 s + 5 s, let
/// pass by moving the clock (twice that is still shorter than [`LONG_LEASE`]).
fn short_retention(op: &str) -> Contract {
    let mut c = contract(op);
    c.windows.request_retry_ms = 5_000;
    c.windows.reconciliation_ms = 5_000;
    c.retry.deadline_ms = 5_000;
    c.windows.retention_ms = c.required_retention_ms();
    c
}

/// A terminal task's key is kept until `key_expires_at` (at least retention after
/// the terminal instant), removed by the sweeper after it, and only then does the
/// same key create a new task (SPEC §2.9).
pub async fn retention_releases_terminal_key_only_after_expiry(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = short_retention(SAFE);
    let s = c.submission(SAFE, "retained", params(SAFE, 1), &contract);
    let t = created(c.submit(s.clone()).await);
    let (done, cancel) = c.cancel(t.id).await;
    assert_eq!(done.state, TaskState::Cancelled);
    let Some(terminal_at) = cancel.confirmed_at else {
        panic!("confirmed cancellation has a time");
    };
    let Some(expires) = c.task(t.id).await.control.key_expires_at else {
        panic!("a terminal task has a key expiry");
    };
    assert!(
        expires.ms() >= terminal_at.ms() + contract.required_retention_ms(),
        "the key is kept at least request_retry + deadline + reconciliation"
    );
    let r = replayed(c.submit(s.clone()).await);
    assert_eq!(r.id, t.id, "within retention the key replays");
    let retention = expires.ms() - terminal_at.ms();
    // Shortly before `key_expires_at` the key stays; once past it, one sweep removes it.
    c.pass(retention - LEASE_MARGIN);
    let stats = must(store.sweep(SWEEP).await, "sweep");
    assert_eq!(
        stats.keys_released, 0,
        "no key is released before its expiry"
    );
    let found = ok2(store.find_task("acme", SAFE, "retained").await, "find_task");
    assert_eq!(found.id, t.id, "before its expiry the key is found");
    assert_eq!(replayed(c.submit(s.clone()).await).id, t.id);
    c.pass(LEASE_MARGIN + 1);
    let stats = must(store.sweep(SWEEP).await, "sweep");
    assert_eq!(
        stats.keys_released, 1,
        "the sweep that removed the key says so"
    );
    assert_not_found(
        store.find_task("acme", SAFE, "retained").await,
        "a released key is no longer found",
    );
    let events = ok2(store.list_events(None, t.id).await, "list_events");
    let Some(released) = events.iter().find(|e| e.kind == EventKind::KeyReleased) else {
        panic!("the release is audited: {:?}", kinds(&events));
    };
    assert!(released.at >= expires, "removed only after key_expires_at");
    let again = created(c.submit(s).await);
    assert_ne!(
        again.id, t.id,
        "after release the same key creates a new task"
    );
    assert_eq!(again.state, TaskState::Queued);
    assert_eq!(
        ok2(store.find_task("acme", SAFE, "retained").await, "find").id,
        again.id
    );
    assert_history(&store, t.id).await;
    assert_history(&store, again.id).await;
}

/// The key of a task that is not terminal is never removed, however long it waits.
pub async fn retention_never_releases_non_terminal_key(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = short_retention(SAFE);
    let running_s = c.submission(SAFE, "still-running", params(SAFE, 2), &contract);
    let running = created(c.submit(running_s.clone()).await);
    let a = c.claim_one(SAFE, LONG_LEASE, running.id).await;
    let queued_s = c.submission(SAFE, "still-queued", params(SAFE, 1), &contract);
    let queued = created(c.submit(queued_s.clone()).await);
    let waiting_s = c.submission(
        NON_SAFE,
        "still-reconciling",
        params(NON_SAFE, 3),
        &short_retention(NON_SAFE),
    );
    let waiting = created(c.submit(waiting_s.clone()).await);
    let w = c.claim_one(NON_SAFE, LONG_LEASE, waiting.id).await;
    c.report_ok(&w, bare(w.generation, Outcome::Unknown)).await;
    c.pass(2 * contract.windows.retention_ms);
    let stats = must(store.sweep(SWEEP).await, "sweep");
    assert_eq!(
        stats.keys_released, 0,
        "no key of a non-terminal task is released"
    );
    for (s, t) in [
        (queued_s, &queued),
        (running_s, &running),
        (waiting_s, &waiting),
    ] {
        let found = ok2(
            store
                .find_task("acme", &s.operation, &s.idempotency_key)
                .await,
            "find_task",
        );
        assert_eq!(found.id, t.id);
        assert!(!found.state.is_terminal());
        assert_eq!(replayed(c.submit(s).await).id, t.id);
    }
    assert_eq!(c.task(running.id).await.state, TaskState::Running);
    assert_eq!(a.generation, 1);
    for id in [queued.id, running.id, waiting.id] {
        assert_history(&store, id).await;
    }
}

/// Usage reported by every attempt is kept and summed on the task.
pub async fn usage_is_kept_across_attempts(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    ok2(c.heartbeat(&a1, a1.generation, Some(5)).await, "heartbeat");
    assert_eq!(c.task(t.id).await.usage, 5);
    let r = rep(a1.generation, Outcome::Failed)
        .class(FailureClass::Transient)
        .usage(7)
        .build();
    assert_eq!(c.report_ok(&a1, r).await.usage, 7);
    let a2 = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    assert_eq!(
        c.task(t.id).await.usage,
        7,
        "a new attempt keeps earlier usage"
    );
    let r = rep(a2.generation, Outcome::Succeeded)
        .result(json!({}))
        .usage(3)
        .build();
    let done = c.report_ok(&a2, r).await;
    assert_eq!(done.usage, 10);
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts.iter().map(|a| a.usage).collect::<Vec<_>>(), [7, 3]);
    assert_history(&store, t.id).await;
}

/// A long history (expiry, reconcile, unknown, reconcile, not_committed, execute,
/// stale report, cancel) keeps events numbered 1..n without gaps and attempt
/// generations strictly increasing, with the task's generation above them all.
pub async fn events_are_gap_free_and_generations_increase(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a1 = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    c.run_out_lease(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
        .await;
    assert_history(&store, t.id).await;
    let r2 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&r2, bare(r2.generation, Outcome::Unknown))
        .await;
    let r3 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r3.kind, AttemptKind::Reconcile);
    c.report_ok(&r3, bare(r3.generation, Outcome::NotCommitted))
        .await;
    assert_stale(c.report(&a1, succeeded(a1.generation)).await, "late report");
    assert_history(&store, t.id).await;
    let a4 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(a4.kind, AttemptKind::Execute);
    ok2(c.heartbeat(&a4, a4.generation, Some(2)).await, "heartbeat");
    c.cancel(t.id).await;
    let done = c
        .report_ok(&a4, rep(a4.generation, Outcome::Cancelled).usage(2).build())
        .await;
    assert_eq!(done.state, TaskState::Cancelled);
    let attempts = c.attempts(t.id).await;
    let gens: Vec<i64> = attempts.iter().map(|a| a.generation).collect();
    assert_eq!(gens, [1, 2, 3, 4]);
    assert_eq!(
        done.generation, 5,
        "confirmation raised the generation once more"
    );
    let events = c.events(t.id).await;
    assert!(
        events.len() >= 10,
        "every transition is journaled: {:?}",
        kinds(&events)
    );
    assert_history(&store, t.id).await;
}
