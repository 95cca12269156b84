//! A store that went back in time (SPEC §2.11): the identity check records
//! the store's identity, and when the database is another than the one
//! recorded (here: marked as a restored backup, as `idem backup` marks its
//! copy) it moves every task that may have started to reconcile-first, in
//! one transaction, once however many instances notice.

use crate::identity::IdentityCheck;

use super::*;

/// Whether `events` hold exactly one event of the rewind (reason
/// `store_rewound`), of `kind`.
fn rewound_once(events: &[Event], kind: &str) -> bool {
    let rewinds: Vec<&Event> = events
        .iter()
        .filter(|e| e.data.reason() == Some(idem_core::machine::STORE_REWOUND))
        .collect();
    rewinds.len() == 1 && rewinds[0].kind.as_str() == kind
}

/// Records the identity (a fresh store has none) and marks the store as a
/// restored backup's: claims lease nothing until the next check.
async fn restore(store: &Store) {
    let first = must(store.check_identity().await, "first identity check");
    assert!(
        matches!(
            first,
            IdentityCheck::Recorded(_) | IdentityCheck::Unchanged(_)
        ),
        "a store's first check records its identity: {first:?}"
    );
    assert!(
        matches!(
            must(store.check_identity().await, "second identity check"),
            IdentityCheck::Unchanged(_)
        ),
        "nothing changed between two checks"
    );
    assert!(must(store.mark_restored().await, "mark restored"));
}

/// After a restore every non-terminal task whose attempts may have started
/// is reconcile-first: the active attempt ends, the generation rises, so a
/// report from before is stale evidence; a non-safe class (even one the
/// store shows `queued`: it may have been claimed after the restore point)
/// and a task already reconciling reconcile next; a retry-safe class with an
/// active attempt executes again at once; a retry-safe class with nothing
/// running and terminal tasks are unchanged. Claims lease nothing between
/// the restore and the check.
pub async fn rewind_moves_tasks_that_may_have_started_to_reconcile_first(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    // Each claim takes the oldest ready task: the ones to claim come first.
    let running = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let run_a = c.claim_one(NON_SAFE, LONG_LEASE, running.id).await;
    let done = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let done_a = c.claim_one(NON_SAFE, LONG_LEASE, done.id).await;
    c.report_ok(&done_a, succeeded(done_a.generation)).await;
    let unknown = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let unk_a = c.claim_one(NON_SAFE, LONG_LEASE, unknown.id).await;
    c.report_ok(&unk_a, bare(unk_a.generation, Outcome::Unknown))
        .await;
    let queued = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let safe_running = c.create(SAFE, &contract(SAFE)).await;
    let safe_a = c.claim_one(SAFE, LONG_LEASE, safe_running.id).await;
    let safe_queued = c.create(SAFE, &contract(SAFE)).await;
    let before: Vec<Task> = {
        let mut v = Vec::new();
        for id in [
            queued.id,
            running.id,
            unknown.id,
            done.id,
            safe_queued.id,
            safe_running.id,
        ] {
            v.push(c.task(id).await);
        }
        v
    };
    let done_events = c.events(done.id).await;
    let safe_queued_events = c.events(safe_queued.id).await;

    restore(&store).await;
    let blocked = c.claim(&[NON_SAFE, SAFE], Some(LONG_LEASE), 10).await;
    assert!(
        blocked.is_empty(),
        "a restored store leases nothing before its identity check: {blocked:?}"
    );
    let check = must(store.check_identity().await, "identity check");
    let IdentityCheck::Rewound {
        from,
        to,
        restored,
        tasks,
    } = check
    else {
        panic!("a restored store rewinds at its next check, got {check:?}");
    };
    assert!(restored, "the change was a restored backup");
    assert_ne!(from.epoch, to.epoch, "a rewind records a new epoch");
    assert_eq!(tasks, 4, "queued, running, reconciling and safe running");

    // Non-safe, queued: reconcile first, though no attempt is known.
    let t = c.task(queued.id).await;
    assert_eq!(t.state, TaskState::Reconciling);
    assert_eq!(t.generation, before[0].generation + 1);
    assert!(rewound_once(
        &c.events(queued.id).await,
        "reconciliation_required"
    ));
    // Non-safe, running: the attempt ends, its report is stale evidence.
    let t = c.task(running.id).await;
    assert_eq!(t.state, TaskState::Reconciling);
    assert_eq!(t.generation, before[1].generation + 1);
    let events = c.events(running.id).await;
    assert!(rewound_once(&events, "reconciliation_required"));
    let rewind = events.last().map(|e| json_of(&e.data)).unwrap_or_default();
    assert_eq!(rewind["ended_attempt_id"], json!(run_a.id));
    assert_eq!(rewind["store"]["from"]["epoch"], json!(from.epoch));
    assert_eq!(rewind["store"]["to"]["epoch"], json!(to.epoch));
    assert_eq!(rewind["store"]["restored_backup"], json!(true));
    assert_stale(
        c.report(&run_a, succeeded(run_a.generation)).await,
        "report from before the rewind",
    );
    let attempts = c.attempts(running.id).await;
    assert_eq!(attempts[0].state, AttemptState::Expired);
    assert_eq!(
        dispositions(&attempts[0]),
        vec!["stale_generation"],
        "the late report is kept as evidence"
    );
    // Already reconciling: reconciles again, ready now.
    let t = c.task(unknown.id).await;
    assert_eq!(t.state, TaskState::Reconciling);
    assert_eq!(t.generation, before[2].generation + 1);
    // Terminal and retry-safe with nothing running: unchanged.
    assert_eq!(api(&c.task(done.id).await), api(&before[3]));
    assert_eq!(c.events(done.id).await, done_events);
    assert_eq!(api(&c.task(safe_queued.id).await), api(&before[4]));
    assert_eq!(c.events(safe_queued.id).await, safe_queued_events);
    // Retry-safe, running: the attempt ends, the next execute is due now.
    let t = c.task(safe_running.id).await;
    assert_eq!(t.state, TaskState::Queued);
    assert_eq!(t.generation, before[5].generation + 1);
    assert!(rewound_once(
        &c.events(safe_running.id).await,
        "retry_scheduled"
    ));
    assert_stale(
        c.report(&safe_a, succeeded(safe_a.generation)).await,
        "safe report from before the rewind",
    );

    // Claims lease again: reconcile attempts for the non-safe class first.
    let mut kinds_by_task = BTreeMap::new();
    for cl in c.claim(&[NON_SAFE, SAFE], Some(LONG_LEASE), 10).await {
        kinds_by_task.insert(cl.task.id, (cl.attempt.kind, cl.attempt.generation));
    }
    assert_eq!(
        kinds_by_task.get(&queued.id),
        Some(&(AttemptKind::Reconcile, before[0].generation + 2))
    );
    assert_eq!(
        kinds_by_task.get(&running.id),
        Some(&(AttemptKind::Reconcile, before[1].generation + 2))
    );
    assert_eq!(
        kinds_by_task.get(&unknown.id).map(|k| k.0),
        Some(AttemptKind::Reconcile)
    );
    assert_eq!(
        kinds_by_task.get(&safe_running.id).map(|k| k.0),
        Some(AttemptKind::Execute)
    );
    assert_eq!(
        kinds_by_task.get(&safe_queued.id).map(|k| k.0),
        Some(AttemptKind::Execute)
    );
    assert!(matches!(
        must(store.check_identity().await, "check after the rewind"),
        IdentityCheck::Unchanged(_)
    ));
    for t in &before {
        assert_history(&store, t.id).await;
    }
}

/// Several instances noticing the same restore at once: one records the new
/// identity and rewinds, the others find it done; each task is rewound once.
pub async fn concurrent_identity_checks_rewind_once(store: Store) {
    const CHECKERS: usize = 6;
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    restore(&store).await;
    let barrier = Arc::new(Barrier::new(CHECKERS));
    let mut handles = Vec::new();
    for _ in 0..CHECKERS {
        let store = store.clone();
        let barrier = Arc::clone(&barrier);
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            must(store.check_identity().await, "concurrent identity check")
        }));
    }
    let mut rewinds = 0;
    let mut epochs = BTreeSet::new();
    for h in handles {
        match joined(h.await) {
            IdentityCheck::Rewound { to, tasks, .. } => {
                rewinds += 1;
                assert_eq!(tasks, 1);
                epochs.insert(to.epoch);
            }
            IdentityCheck::Unchanged(id) => {
                epochs.insert(id.epoch);
            }
            other => panic!("unexpected check {other:?}"),
        }
    }
    assert_eq!(rewinds, 1, "exactly one check rewinds");
    assert_eq!(epochs.len(), 1, "every check answers the one new epoch");
    let task = c.task(t.id).await;
    assert_eq!(task.generation, a.generation + 1, "raised once");
    assert!(rewound_once(
        &c.events(t.id).await,
        "reconciliation_required"
    ));
    assert_history(&store, t.id).await;
}

/// The rewind covers every tenant's tasks, and each tenant sees only its
/// own: its tasks' events, its feed, none of the other tenant's.
pub async fn rewind_keeps_tenants_apart(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    let globex = Ctx::new(&store, "globex").await;
    let ta = acme.create(NON_SAFE, &contract(NON_SAFE)).await;
    let aa = acme.claim_one(NON_SAFE, LONG_LEASE, ta.id).await;
    let tg = globex.create(NON_SAFE, &contract(NON_SAFE)).await;
    let ag = globex.claim_one(NON_SAFE, LONG_LEASE, tg.id).await;
    restore(&store).await;
    let check = must(store.check_identity().await, "identity check");
    assert!(
        matches!(check, IdentityCheck::Rewound { tasks: 2, .. }),
        "both tenants' tasks rewound: {check:?}"
    );
    for (c, t, a, other) in [(&acme, &ta, &aa, &tg), (&globex, &tg, &ag, &ta)] {
        assert_eq!(c.task(t.id).await.state, TaskState::Reconciling);
        assert!(rewound_once(
            &c.events(t.id).await,
            "reconciliation_required"
        ));
        assert_not_found(
            c.store.get_task(Some(&c.tenant), other.id).await,
            "the other tenant's task",
        );
        assert_not_found(
            c.store
                .report(
                    &c.tenant,
                    if t.id == ta.id { ag.id } else { aa.id },
                    succeeded(1),
                )
                .await,
            "the other tenant's attempt",
        );
        assert_stale(
            c.report(a, succeeded(a.generation)).await,
            "own late report",
        );
        // The feed serves an event once no earlier one can still appear
        // (PostgreSQL: below every open transaction), so it is read until
        // the rewind shows, within PATIENCE.
        let rewinds = |feed: &[crate::feed::FeedEvent]| {
            feed.iter()
                .filter(|e| e.event.data.reason() == Some(idem_core::machine::STORE_REWOUND))
                .count()
        };
        let started = Instant::now();
        let feed = loop {
            let feed = must(
                store
                    .feed(&c.tenant, crate::feed::FeedCursor::START, 100)
                    .await,
                "feed",
            );
            if rewinds(&feed) > 0 || started.elapsed() > PATIENCE {
                break feed;
            }
            sleep(Duration::from_millis(20)).await;
        };
        assert!(
            feed.iter().all(|e| e.task_id == t.id),
            "{}'s feed holds only its own task: {feed:?}",
            c.tenant
        );
        assert_eq!(
            rewinds(&feed),
            1,
            "{}'s feed shows its rewind once",
            c.tenant
        );
        let reclaimed = c.claim(&[NON_SAFE], Some(LONG_LEASE), 10).await;
        assert_eq!(reclaimed.len(), 1, "{} claims only its own task", c.tenant);
        assert_eq!(reclaimed[0].task.id, t.id);
        assert_eq!(reclaimed[0].attempt.kind, AttemptKind::Reconcile);
    }
    assert_history(&store, ta.id).await;
    assert_history(&store, tg.id).await;
}
