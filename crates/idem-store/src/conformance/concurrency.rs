//! Concurrency (SPEC §2.4): concurrent claimers never share a lease and
//! concurrent reports on one attempt apply exactly one.

use super::*;

/// 50 rounds of 4 concurrent claimers working a pool of tasks that each need
/// three execute attempts: no attempt is leased twice, no two leases of one task
/// overlap (every report is accepted, none is stale), generations are unique
/// per task (SPEC §2.4).
pub async fn concurrent_claimers_never_share_a_lease(store: Store) {
    const TASKS: usize = 6;
    const CLAIMERS: usize = 4;
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.backoff = Backoff {
        initial_ms: 0,
        multiplier: 1.0,
        max_ms: 0,
    };
    for round in 0..50 {
        let mut ids = BTreeSet::new();
        for _ in 0..TASKS {
            ids.insert(c.create(SAFE, &contract).await.id);
        }
        let done = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(CLAIMERS));
        let mut handles = Vec::new();
        for w in 0..CLAIMERS {
            let (c, done, barrier) = (c.clone(), done.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                let until = Instant::now() + PATIENCE;
                let mut seen = Vec::new();
                while done.load(Ordering::SeqCst) < TASKS {
                    assert!(Instant::now() < until, "claimer {w} starved");
                    let got = c.claim(&[SAFE], Some(LONG_LEASE), 2).await;
                    if got.is_empty() {
                        must(c.store.sweep(SWEEP).await, "sweep");
                        sleep(Duration::from_millis(2)).await;
                        continue;
                    }
                    for cl in got {
                        let a = cl.attempt;
                        seen.push((a.task_id, a.generation, a.id, a.number));
                        let r = if a.number < 3 {
                            failed(a.generation, FailureClass::Transient)
                        } else {
                            succeeded(a.generation)
                        };
                        let t = c.report_ok(&a, r).await;
                        if t.state == TaskState::Succeeded {
                            done.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                seen
            }));
        }
        let mut all = Vec::new();
        for h in handles {
            all.extend(joined(h.await));
        }
        let pairs: HashSet<(Uuid, i64)> = all.iter().map(|(t, g, _, _)| (*t, *g)).collect();
        assert_eq!(
            pairs.len(),
            all.len(),
            "round {round}: a (task, generation) was leased twice"
        );
        let attempt_ids: HashSet<Uuid> = all.iter().map(|(_, _, a, _)| *a).collect();
        assert_eq!(
            attempt_ids.len(),
            all.len(),
            "round {round}: an attempt was leased twice"
        );
        let mut per_task: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
        for (t, g, _, _) in &all {
            assert!(
                ids.contains(t),
                "round {round}: claimed a task of an earlier round"
            );
            per_task.entry(*t).or_default().push(*g);
        }
        assert_eq!(per_task.len(), TASKS);
        for (id, mut gens) in per_task {
            gens.sort_unstable();
            assert_eq!(gens, [1, 2, 3], "round {round}: task {id} generations");
            let t = c.task(id).await;
            assert_eq!(t.state, TaskState::Succeeded);
            assert_eq!(c.attempts(id).await.len(), 3);
            assert_history(&store, id).await;
        }
    }
}

/// 50 rounds of two concurrent reports on one attempt: exactly one is applied;
/// the other is `AlreadyReported` (different outcome) or an Ok repeat (same
/// report); the delivery happens at most once; both are evidence.
pub async fn concurrent_reports_apply_exactly_one(store: Store) {
    for round in 0..50_u32 {
        // A tenant per round: a task left `reconciling` stays claimable.
        let c = Ctx::new(&store, &format!("acme-{round}")).await;
        let op = if round % 2 == 0 { SAFE } else { NON_SAFE };
        let t = c.create(op, &contract(op)).await;
        let a = c.claim_one(op, LONG_LEASE, t.id).await;
        let g = a.generation;
        let win = rep(g, Outcome::Succeeded)
            .result(json!({"round": round}))
            .build();
        let other = match round % 3 {
            0 => failed(g, FailureClass::InvalidInput),
            1 => bare(g, Outcome::Unknown),
            _ => win.clone(),
        };
        let same = round % 3 == 2;
        let barrier = Arc::new(Barrier::new(2));
        let mut handles = Vec::new();
        for r in [win.clone(), other.clone()] {
            let (c, a, barrier) = (c.clone(), a.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                let outcome = r.outcome;
                (outcome, must(c.report(&a, r).await, "report"))
            }));
        }
        let mut results = Vec::new();
        for h in handles {
            results.push(joined(h.await));
        }
        let oks: Vec<Outcome> = results
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|(o, _)| *o)
            .collect();
        let task = c.task(t.id).await;
        let attempts = c.attempts(t.id).await;
        let disp = dispositions(&attempts[0]);
        assert_eq!(
            disp.len(),
            2,
            "round {round}: both reports are evidence: {disp:?}"
        );
        assert_eq!(
            disp.iter().filter(|d| **d == "applied").count(),
            1,
            "round {round}: exactly one applied: {disp:?}"
        );
        let events = c.events(t.id).await;
        assert!(
            count(&events, "delivered") <= 1,
            "round {round}: delivery at most once"
        );
        if same {
            assert_eq!(
                oks.len(),
                2,
                "round {round}: an exact repeat answers Ok: {results:?}"
            );
            assert!(disp.contains(&"repeat"));
            assert_eq!(task.state, TaskState::Succeeded);
        } else {
            assert_eq!(
                oks.len(),
                1,
                "round {round}: exactly one report wins: {results:?}"
            );
            let winner = oks[0];
            let loser = results.iter().find(|(_, r)| r.is_err());
            match loser {
                Some((_, Err(Refusal::Machine(Rejection::AlreadyReported { existing })))) => {
                    assert_eq!(
                        *existing, winner,
                        "round {round}: names the applied outcome"
                    );
                }
                other => panic!("round {round}: the loser is AlreadyReported, got {other:?}"),
            }
            assert!(disp.contains(&"already_reported"));
            let expected = match winner {
                Outcome::Succeeded => TaskState::Succeeded,
                Outcome::Failed => TaskState::Failed,
                _ => TaskState::Reconciling,
            };
            assert_eq!(
                task.state, expected,
                "round {round}: the state follows the winner"
            );
        }
        assert_eq!(task.delivery.is_some(), task.state == TaskState::Succeeded);
        assert_history(&store, t.id).await;
    }
}

// ---------------------------------------------------------------------------
