//! Scope: one task per scope, replay, conflict (SPEC §2.1–2.3): a new scope
//! creates a task, the same request replays it, another fingerprint conflicts,
//! tenants and operation classes are separate scopes, concurrent and batched
//! submissions of one scope give one task, and a revoked key submits nothing.

use super::*;

/// A new scope creates a queued task; the exact same request again replays it:
/// same id, same record, no new event or attempt (SPEC §2.2).
pub async fn submit_creates_then_exact_repeat_replays(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [NON_SAFE, SAFE] {
        let contract = contract(op);
        let s = c.submission(op, &format!("order-1-{op}"), params(op, 1), &contract);
        let t = created(c.submit(s.clone()).await);
        assert_eq!(t.state, TaskState::Queued);
        assert_eq!((t.generation, t.attempt_count, t.usage), (0, 0, 0));
        assert_eq!(t.operation, op);
        assert_eq!(t.idempotency_key, s.idempotency_key);
        assert_eq!(t.fingerprint, s.fingerprint);
        assert_eq!(t.params, s.params);
        assert_eq!(*t.contract, contract, "the contract is frozen as submitted");
        assert!(t.cancellation.is_none() && t.delivery.is_none() && t.failure.is_none());
        for _ in 0..3 {
            let r = replayed(c.submit(s.clone()).await);
            assert_eq!(r.id, t.id, "a replay returns the original task");
            assert_eq!(api(&r), api(&t), "a replay changes nothing");
        }
        assert_eq!(api(&c.task(t.id).await), api(&t));
        let found = ok2(
            store.find_task("acme", op, &s.idempotency_key).await,
            "find_task",
        );
        assert_eq!(found.id, t.id);
        assert_eq!(c.events(t.id).await.len(), 1, "a replay writes no event");
        assert!(
            c.attempts(t.id).await.is_empty(),
            "a replay creates no attempt"
        );
        assert_history(&store, t.id).await;
    }
}

/// Fields outside the class's material pointers do not change the fingerprint:
/// resubmitting with another `memo` replays the original (with its original params).
pub async fn submit_ignores_non_material_fields(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let p1 = params(NON_SAFE, 1);
    let t = created(
        c.submit(c.submission(NON_SAFE, "k", p1.clone(), &contract))
            .await,
    );
    let mut p2 = p1.clone();
    p2["memo"] = json!("a different note");
    let r = replayed(c.submit(c.submission(NON_SAFE, "k", p2, &contract)).await);
    assert_eq!(r.id, t.id);
    assert_eq!(r.params, p1, "the replay shows the original params");
    assert_history(&store, t.id).await;
}

/// Same scope, different fingerprint: `Conflict` naming the original task, the
/// same answer every time, and the original task, contract and record unchanged
/// (SPEC §2.3).
pub async fn different_fingerprint_conflicts_and_changes_nothing(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [NON_SAFE, SAFE] {
        let contract = contract(op);
        let key = format!("conflict-{op}");
        let s1 = c.submission(op, &key, params(op, 1), &contract);
        let t = created(c.submit(s1.clone()).await);
        let events_before = c.events(t.id).await;
        let mut other_contract = contract.clone();
        other_contract.price += 999;
        let s2 = c.submission(op, &key, params(op, 2), &other_contract);
        assert_ne!(s1.fingerprint, s2.fingerprint);
        for _ in 0..3 {
            match c.submit(s2.clone()).await {
                SubmitOutcome::Conflict { task } => {
                    assert_eq!(task.id, t.id, "the conflict names the original task");
                    assert_eq!(*task, t, "the conflict carries the original task as stored");
                }
                other => panic!("expected Conflict, got {other:?}"),
            }
        }
        let after = c.task(t.id).await;
        assert_eq!(api(&after), api(&t), "the original task is unchanged");
        assert_eq!(
            *after.contract, contract,
            "the original contract is unchanged"
        );
        assert_eq!(c.events(t.id).await, events_before, "no event was written");
        let r = replayed(c.submit(s1).await);
        assert_eq!(r.id, t.id, "the original request still replays");
        assert_history(&store, t.id).await;
    }
}

/// The configuration's fingerprint fields of a class changed after a task was
/// accepted, so the very request it was accepted with now fingerprints
/// differently: it is still the same request (same operation, params equal),
/// answered with the original task (IDEM-01); a request with other params
/// stays a conflict. Checked in the submit's own transaction, from the task
/// row the store reads for the scope anyway.
pub async fn same_request_under_changed_fingerprint_fields_replays(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let key = "fields-changed";
    let s1 = c.submission(NON_SAFE, key, params(NON_SAFE, 1), &contract);
    let t = created(c.submit(s1.clone()).await);
    // As if fingerprinted under other material fields.
    let mut again = s1.clone();
    again.fingerprint = format!("{}-other-fields", s1.fingerprint);
    let r = replayed(c.submit(again.clone()).await);
    assert_eq!(r.id, t.id);
    let mut other = c.submission(NON_SAFE, key, params(NON_SAFE, 2), &contract);
    other.fingerprint.clone_from(&again.fingerprint);
    match c.submit(other).await {
        SubmitOutcome::Conflict { task } => assert_eq!(task.id, t.id),
        o => panic!("expected Conflict, got {o:?}"),
    }
    assert_history(&store, t.id).await;

    // A task whose contract names no fingerprint fields (`fingerprint: None`)
    // is compared by its whole canonical params (RFC 8785: 1000 and 1000.0 are
    // one number).
    let mut whole = contract.clone();
    whole.fingerprint = None;
    let key = "fields-changed-whole-params";
    let p = json!({"payee": "a", "amount": 1000, "currency": "EUR"});
    let s1 = c.submission(NON_SAFE, key, p, &whole);
    let t = created(c.submit(s1.clone()).await);
    let mut again = c.submission(
        NON_SAFE,
        key,
        json!({"currency": "EUR", "amount": 1000.0, "payee": "a"}),
        &whole,
    );
    again.fingerprint = format!("{}-other-fields", s1.fingerprint);
    assert_eq!(replayed(c.submit(again).await).id, t.id);
    let mut other = c.submission(
        NON_SAFE,
        key,
        json!({"payee": "a", "amount": 1000, "currency": "EUR", "memo": "m"}),
        &whole,
    );
    other.fingerprint = format!("{}-other-fields", s1.fingerprint);
    match c.submit(other).await {
        SubmitOutcome::Conflict { task } => assert_eq!(task.id, t.id),
        o => panic!("expected Conflict, got {o:?}"),
    }
}

/// The same key under another tenant is another scope: a different task, and
/// nothing of the first tenant's task is visible or reachable (SPEC §2.3, §4 404).
pub async fn same_key_other_tenant_is_another_scope_and_invisible(store: Store) {
    let a = Ctx::new(&store, "acme").await;
    let b = Ctx::new(&store, "globex").await;
    let z = Ctx::new(&store, "initech").await;
    let contract = contract(NON_SAFE);
    let ta = created(
        a.submit(a.submission(NON_SAFE, "shared", params(NON_SAFE, 1), &contract))
            .await,
    );
    // Different params under the same key: not a conflict for another tenant.
    let tb = created(
        b.submit(b.submission(NON_SAFE, "shared", params(NON_SAFE, 2), &contract))
            .await,
    );
    // Identical params under the same key: not a replay for another tenant.
    let tz = created(
        z.submit(z.submission(NON_SAFE, "shared", params(NON_SAFE, 1), &contract))
            .await,
    );
    assert_ne!(ta.id, tb.id);
    assert_ne!(ta.id, tz.id);
    assert_ne!(tb.id, tz.id);
    assert_eq!(tz.params, params(NON_SAFE, 1));

    let found = ok2(
        store.find_task("globex", NON_SAFE, "shared").await,
        "find_task",
    );
    assert_eq!(found.id, tb.id, "find_task stays within the tenant");
    assert_not_found(
        store.get_task(Some("globex"), ta.id).await,
        "get_task across tenants",
    );
    assert_not_found(
        store.list_events(Some("globex"), ta.id).await,
        "list_events across tenants",
    );
    assert_not_found(
        store.list_attempts(Some("globex"), ta.id).await,
        "list_attempts across tenants",
    );
    assert_not_found(store.cancel("globex", ta.id).await, "cancel across tenants");
    assert_not_found(
        store.acknowledge_delivery("globex", ta.id).await,
        "acknowledge_delivery across tenants",
    );
    assert_not_found(
        store.find_task("umbrella", NON_SAFE, "shared").await,
        "find_task of an unknown tenant",
    );

    // Claims only return the claimer's own tenant's tasks.
    let got = b.claim(&[NON_SAFE], Some(LONG_LEASE), 10).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].task.id, tb.id);
    let att = a.claim_one(NON_SAFE, LONG_LEASE, ta.id).await;
    assert_not_found(
        store
            .report("globex", att.id, succeeded(att.generation))
            .await,
        "report across tenants",
    );
    assert_not_found(
        store
            .heartbeat("globex", att.id, att.generation, Some(5))
            .await,
        "heartbeat across tenants",
    );
    assert_not_found(
        store
            .acknowledge("globex", att.id, att.generation, json!({}))
            .await,
        "acknowledge across tenants",
    );
    let after = a.task(ta.id).await;
    assert_eq!(
        after.state,
        TaskState::Running,
        "the owner's task is untouched"
    );
    assert_eq!((after.generation, after.usage), (1, 0));
    assert!(after.cancellation.is_none() && after.delivery.is_none());
    let attempts = a.attempts(ta.id).await;
    assert!(
        attempts[0].evidence.is_empty(),
        "a foreign report leaves no evidence"
    );
    // The operator view (no tenant filter) sees every task.
    assert_eq!(
        ok2(store.get_task(None, ta.id).await, "get_task any tenant").id,
        ta.id
    );
    for id in [ta.id, tb.id, tz.id] {
        assert_history(&store, id).await;
    }
}

/// The same key under another operation class is another scope.
pub async fn same_key_other_operation_is_another_scope(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t1 = created(
        c.submit(c.submission(NON_SAFE, "k", params(NON_SAFE, 1), &contract(NON_SAFE)))
            .await,
    );
    let t2 = created(
        c.submit(c.submission(SAFE, "k", params(SAFE, 1), &contract(SAFE)))
            .await,
    );
    assert_ne!(t1.id, t2.id);
    assert_eq!(
        ok2(store.find_task("acme", NON_SAFE, "k").await, "find").id,
        t1.id
    );
    assert_eq!(
        ok2(store.find_task("acme", SAFE, "k").await, "find").id,
        t2.id
    );
    assert_not_found(
        store.find_task("acme", NON_SAFE, "other").await,
        "find_task of an unused key",
    );
}

/// 64 concurrent identical submissions of one scope yield exactly one task;
/// 20 rounds with fresh keys (SPEC §2.1).
pub async fn concurrent_identical_submits_create_one_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for round in 0..20_u64 {
        let op = if round % 2 == 0 { NON_SAFE } else { SAFE };
        let s = c.submission(
            op,
            &format!("burst-{round}"),
            params(op, round),
            &contract(op),
        );
        let barrier = Arc::new(Barrier::new(64));
        let mut handles = Vec::new();
        for _ in 0..64 {
            let (c, s, barrier) = (c.clone(), s.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                c.submit(s).await
            }));
        }
        let mut ids = BTreeSet::new();
        let mut creations = 0;
        for h in handles {
            match joined(h.await) {
                SubmitOutcome::Created(t) => {
                    creations += 1;
                    ids.insert(t.id);
                }
                SubmitOutcome::Replayed(t) => {
                    ids.insert(t.id);
                }
                other => panic!("identical submissions never conflict: {other:?}"),
            }
        }
        assert_eq!(
            creations, 1,
            "round {round}: exactly one submission creates the task"
        );
        assert_eq!(
            ids.len(),
            1,
            "round {round}: every submission names the same task: {ids:?}"
        );
        let Some(id) = ids.first().copied() else {
            panic!("no task id");
        };
        assert_eq!(
            ok2(
                store.find_task("acme", op, &s.idempotency_key).await,
                "find"
            )
            .id,
            id
        );
        assert_eq!(c.events(id).await.len(), 1, "one task_submitted event");
        assert_history(&store, id).await;
    }
}

/// Concurrent submissions of one scope with two different fingerprints: exactly
/// one task; the winner's twins replay it, the others get a conflict naming it.
pub async fn concurrent_conflicting_submits_create_one_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for round in 0..10_u64 {
        let key = format!("contested-{round}");
        let s1 = c.submission(SAFE, &key, params(SAFE, 1), &contract(SAFE));
        let s2 = c.submission(SAFE, &key, params(SAFE, 2), &contract(SAFE));
        let barrier = Arc::new(Barrier::new(32));
        let mut handles = Vec::new();
        for i in 0..32 {
            let s = if i % 2 == 0 { s1.clone() } else { s2.clone() };
            let (c, barrier) = (c.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                let fp = s.fingerprint.clone();
                (fp, c.submit(s).await)
            }));
        }
        let mut results = Vec::new();
        for h in handles {
            results.push(joined(h.await));
        }
        let winners: Vec<&Task> = results
            .iter()
            .filter_map(|(_, o)| match o {
                SubmitOutcome::Created(t) => Some(t),
                _ => None,
            })
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: exactly one task is created"
        );
        let winner = winners[0].clone();
        for (fp, o) in &results {
            match o {
                SubmitOutcome::Created(_) => {}
                SubmitOutcome::Replayed(t) => {
                    assert_eq!(t.id, winner.id);
                    assert_eq!(
                        *fp, winner.fingerprint,
                        "only the winner's fingerprint replays"
                    );
                }
                SubmitOutcome::Conflict { task } => {
                    assert_eq!(task.id, winner.id, "the conflict names the winner");
                    assert_ne!(*fp, winner.fingerprint, "the winner's twin never conflicts");
                }
                SubmitOutcome::KeyRevoked { .. } => panic!("round {round}: the key is live"),
                SubmitOutcome::RateLimited { .. } => panic!("round {round}: no rate limit is set"),
            }
        }
        assert_history(&store, winner.id).await;
    }
}

/// A submit checks its API key in its own transaction: once the key is revoked,
/// its submissions are refused (`KeyRevoked`) and write nothing, neither a new
/// scope nor a replay, while another key's submissions in the same batch go on
/// (SPEC §4 Auth: a revoked key is refused on the next request).
pub async fn revoked_key_submits_nothing(store: Store) {
    let live = Ctx::new(&store, "acme").await;
    let gone = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    let before = gone.submission(SAFE, "before-revoke", params(SAFE, 1), &contract);
    let t = created(gone.submit(before.clone()).await);
    must(store.revoke_api_key(gone.key.id).await, "revoke_api_key");
    let fresh = gone.submission(SAFE, "after-revoke", params(SAFE, 2), &contract);
    for s in [fresh.clone(), before.clone()] {
        match gone.submit(s).await {
            SubmitOutcome::KeyRevoked { api_key_id } => assert_eq!(api_key_id, gone.key.id),
            other => panic!("a revoked key's submit must be refused, got {other:?}"),
        }
    }
    let other = live.submission(SAFE, "live-key", params(SAFE, 3), &contract);
    let batch = vec![fresh.clone(), other.clone(), before.clone(), other.clone()];
    let out = must(store.submit_batch(batch).await, "batch");
    assert!(
        matches!(
            out.as_slice(),
            [
                SubmitOutcome::KeyRevoked { .. },
                SubmitOutcome::Created(_),
                SubmitOutcome::KeyRevoked { .. },
                SubmitOutcome::Replayed(_),
            ]
        ),
        "only the revoked key's submissions are refused: {out:?}"
    );
    assert!(
        matches!(
            store.find_task("acme", SAFE, "after-revoke").await,
            Ok(Err(Refusal::NotFound))
        ),
        "a refused submit writes no scope"
    );
    assert_eq!(
        gone.events(t.id).await.len(),
        1,
        "a refused replay writes nothing"
    );
    let created_other = ok2(store.find_task("acme", SAFE, "live-key").await, "find_task");
    assert_eq!(created_other.control.api_key_id, live.key.id);
}

/// One batch (one transaction) answers each submission as if they had been sent
/// one after the other: a new scope is created once, its twin later in the batch
/// replays it and a changed payload conflicts with it; scopes stored before the
/// batch replay or conflict; only the created tasks get events (SPEC §2.1–2.3).
pub async fn batch_answers_as_if_submitted_one_after_another(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    let stored = c.submission(SAFE, "batch-stored", params(SAFE, 1), &contract);
    let old = created(c.submit(stored.clone()).await);
    let stored_changed = c.submission(SAFE, "batch-stored", params(SAFE, 2), &contract);
    let fresh = c.submission(SAFE, "batch-fresh", params(SAFE, 3), &contract);
    let fresh_changed = c.submission(SAFE, "batch-fresh", params(SAFE, 4), &contract);
    let other = c.submission(SAFE, "batch-other", params(SAFE, 5), &contract);
    let batch = vec![
        stored_changed,
        fresh.clone(),
        stored,
        fresh_changed,
        other,
        fresh,
    ];
    let out = must(store.submit_batch(batch).await, "batch");
    let [
        SubmitOutcome::Conflict { task: c0 },
        SubmitOutcome::Created(new),
        SubmitOutcome::Replayed(r2),
        SubmitOutcome::Conflict { task: c3 },
        SubmitOutcome::Created(other_task),
        SubmitOutcome::Replayed(r5),
    ] = out.as_slice()
    else {
        panic!("a batch answers in request order, one after the other: {out:?}");
    };
    assert_eq!((c0.id, r2.id), (old.id, old.id), "stored scope");
    assert_eq!(api(r2), api(&old), "a replay in a batch changes nothing");
    assert_eq!(
        (c3.id, r5.id),
        (new.id, new.id),
        "scope created in the batch"
    );
    assert_eq!(api(r5), api(new), "the in-batch replay is the created task");
    assert_ne!(other_task.id, new.id);
    for t in [&old, new, other_task] {
        assert_eq!(c.events(t.id).await.len(), 1, "one task_submitted each");
        assert_history(&store, t.id).await;
    }
    let found = ok2(
        store.find_task("acme", SAFE, "batch-fresh").await,
        "find_task",
    );
    assert_eq!(found.params, params(SAFE, 3), "the first of the batch won");
}

/// The first event is `task_submitted` with the fingerprint, canonical request
/// and acceptance decision (API key id, config version) (SPEC §2.10).
pub async fn first_event_records_acceptance_decision(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let s = c.submission(NON_SAFE, "audit-1", params(NON_SAFE, 1), &contract);
    let t = created(c.submit(s.clone()).await);
    let events = c.events(t.id).await;
    let Some(first) = events.first() else {
        panic!("a new task has an event");
    };
    assert_eq!(first.seq, 1);
    assert_eq!(first.kind, EventKind::TaskSubmitted);
    let data = json_of(&first.data);
    assert_eq!(data["fingerprint"], json!(s.fingerprint));
    assert_eq!(data["canonical_request"], json!(s.canonical_request));
    assert_eq!(data["idempotency_key"], json!("audit-1"));
    assert_eq!(data["decision"]["api_key_id"], json!(c.key.id));
    assert_eq!(
        data["decision"]["config_version"],
        json!(contract.config_version)
    );
    assert_eq!(t.control.canonical_request, s.canonical_request);
    assert_eq!(
        c.task(t.id).await.control.canonical_request,
        s.canonical_request
    );
}

/// The W3C `traceparent` of a submit is kept on its task, read back as
/// submitted, and handed out with every claimed attempt (a reclaim after a
/// lease ran out too); it is not part of the fingerprint: a retry with
/// another `traceparent`, or with none, replays the task unchanged (SPEC §4
/// `POST /v1/tasks`). A task submitted without one has none.
pub async fn traceparent_is_kept_claimed_and_not_fingerprinted(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let first = must(
        TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        "traceparent",
    );
    let other = must(
        TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"),
        "traceparent",
    );
    let contract = contract(SAFE);
    let mut s = c.submission(SAFE, "traced", params(SAFE, 1), &contract);
    s.traceparent = Some(first.clone());
    let t = created(c.submit(s.clone()).await);
    assert_eq!(t.traceparent.as_ref(), Some(&first));
    assert_eq!(api(&t)["traceparent"], json!(first.as_str()));
    for retry in [Some(other.clone()), None] {
        let mut again = s.clone();
        again.traceparent = retry;
        let r = replayed(c.submit(again).await);
        assert_eq!(r.id, t.id);
        assert_eq!(api(&r), api(&t), "a retry's traceparent changes nothing");
    }
    assert_eq!(c.task(t.id).await.traceparent.as_ref(), Some(&first));
    let untraced = created(
        c.submit(c.submission(SAFE, "untraced", params(SAFE, 2), &contract))
            .await,
    );
    assert_eq!(untraced.traceparent, None);
    assert_eq!(api(&untraced)["traceparent"], Value::Null);

    let claimed = c.claim(&[SAFE], Some(SHORT_LEASE), 2).await;
    let by_task: BTreeMap<Uuid, Option<TraceParent>> = claimed
        .iter()
        .map(|cl| (cl.task.id, cl.task.traceparent.clone()))
        .collect();
    assert_eq!(
        by_task,
        BTreeMap::from([(t.id, Some(first.clone())), (untraced.id, None)]),
        "each claimed attempt carries its task's traceparent"
    );
    // The untraced task ends, so the next claim can only be the traced one's.
    for cl in claimed.iter().filter(|cl| cl.task.id == untraced.id) {
        c.report_ok(
            &cl.attempt,
            rep(cl.attempt.generation, Outcome::Succeeded)
                .result(json!({}))
                .build(),
        )
        .await;
    }
    c.run_out_lease(t.id, "the traced task queued again", |t| {
        t.state != TaskState::Running
    })
    .await;
    let again = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    let task = c.task(again.task_id).await;
    assert_eq!(again.generation, 2);
    assert_eq!(task.traceparent.as_ref(), Some(&first));
    let reclaimed = c.attempts(t.id).await;
    assert_eq!(reclaimed.len(), 2);
    assert_history(&store, t.id).await;
}
