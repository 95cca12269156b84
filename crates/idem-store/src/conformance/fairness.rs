//! SPEC §2.13: shared executor pools, fair claims and priorities.

use std::collections::BTreeMap;

use idem_core::model::{AllTenants, Serves};

use super::*;
use crate::flow::{AGING_MS, ClaimFlow, QueuePair};

/// A claim of `SAFE` by the executor key `pool` of tenant `pool` with `flow`.
async fn claim_with(store: &Store, flow: &ClaimFlow, max: i64) -> Vec<Claimed> {
    let req = ClaimRequest {
        tenant: "pool".to_owned(),
        operations: vec![SAFE.to_owned()],
        executor_id: "pool-executor".to_owned(),
        max,
        lease_ms: Some(LONG_LEASE),
        flow: flow.clone(),
    };
    must(store.claim(req).await, "claim")
}

/// A pool's flow: the tenants it serves, the weights, `SAFE` with a fairness
/// key when `fair`.
/// A claim by `tenant`'s own executor key (no pool) of at most `max`
/// attempts, serving the class's fairness key values in turn.
fn own_fair_claim(tenant: &str, max: i64) -> ClaimRequest {
    ClaimRequest {
        tenant: tenant.to_owned(),
        operations: vec![SAFE.to_owned()],
        executor_id: format!("{tenant}-executor"),
        max,
        lease_ms: Some(LONG_LEASE),
        flow: ClaimFlow {
            serves: None,
            fair_classes: vec![SAFE.to_owned()],
            ..ClaimFlow::default()
        },
    }
}

fn pool(serves: Serves, weights: &[(&str, i64)], fair: bool) -> ClaimFlow {
    ClaimFlow {
        serves: Some(serves),
        fair_classes: if fair {
            vec![SAFE.to_owned()]
        } else {
            Vec::new()
        },
        weights: weights
            .iter()
            .map(|(t, w)| ((*t).to_owned(), *w))
            .collect::<BTreeMap<_, _>>(),
        ..ClaimFlow::default()
    }
}

/// Submits `n` `SAFE` tasks of `c` with `priority` and `value` as their
/// fairness key.
async fn flood(c: &Ctx, n: usize, priority: i64, value: Option<&str>) -> Vec<Task> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut s = c.submission(
            SAFE,
            &format!("key-{}", Uuid::new_v4()),
            params(SAFE, i as u64),
            &contract(SAFE),
        );
        s.priority = priority;
        s.fairness_key = value.map(str::to_owned);
        match c.submit(s).await {
            SubmitOutcome::Created(t) => out.push(t),
            other => panic!("a fresh key creates a task, got {other:?}"),
        }
    }
    out
}

/// Claims one attempt at a time `n` times, reporting each `succeeded`;
/// the tenant and task of each.
async fn claim_one_by_one(store: &Store, flow: &ClaimFlow, n: usize) -> Vec<(String, Task)> {
    let mut out = Vec::new();
    for _ in 0..n {
        let got = claim_with(store, flow, 1).await;
        let Some(c) = got.into_iter().next() else {
            break;
        };
        let tenant = c.task.control.tenant.clone();
        let done = ok2(
            store
                .report(&tenant, c.attempt.id, succeeded(c.attempt.generation))
                .await,
            "report",
        );
        assert_eq!(done.state, TaskState::Succeeded);
        out.push((tenant, c.task));
    }
    out
}

/// A pool key's claims lease the tasks of the tenants it serves and of no
/// other; each task keeps its tenant; a tenant's task that turns claimable
/// again after the pool found that tenant without work (a release) is
/// claimed again; the attempt's tenant is what a pool key's heartbeat,
/// acknowledge, report and release are scoped by, and another tenant's
/// attempt is not found under any other tenant.
pub async fn pool_keys_claim_only_the_tenants_they_serve(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    let globex = Ctx::new(&store, "globex").await;
    let initech = Ctx::new(&store, "initech").await;
    let (key, _) = must(
        store
            .create_pool_key(
                "pool",
                Role::Executor,
                None,
                Some(Serves::Tenants(vec!["acme".into(), "globex".into()])),
            )
            .await,
        "create_pool_key",
    );
    let listed = must(store.list_api_keys().await, "list_api_keys");
    let kept = listed.iter().find(|k| k.id == key.id).map(|k| &k.serves);
    assert_eq!(kept, Some(&key.serves), "the key's tenants read back");
    let flow = pool(
        key.serves.clone().unwrap_or(Serves::Tenants(vec![])),
        &[],
        false,
    );
    let a = flood(&acme, 1, 3, None).await;
    let g = flood(&globex, 1, 3, None).await;
    let i = flood(&initech, 1, 3, None).await;
    let got = claim_with(&store, &flow, 10).await;
    let mut tenants: Vec<&str> = got.iter().map(|c| c.task.control.tenant.as_str()).collect();
    tenants.sort_unstable();
    assert_eq!(
        tenants,
        ["acme", "globex"],
        "the served tenants' tasks only"
    );
    assert!(claim_with(&store, &flow, 10).await.is_empty());
    for c in &got {
        let tenant = must(store.attempt_tenant(c.attempt.id).await, "attempt_tenant");
        assert_eq!(tenant.as_deref(), Some(c.task.control.tenant.as_str()));
        let other = if tenant.as_deref() == Some("acme") {
            "globex"
        } else {
            "acme"
        };
        assert_not_found(
            store
                .heartbeat(other, c.attempt.id, c.attempt.generation, None)
                .await,
            "heartbeat under another tenant",
        );
        assert_not_found(
            store
                .release("pool", c.attempt.id, c.attempt.generation)
                .await,
            "release under the pool's own tenant",
        );
    }
    // Released, the acme task waits again: the pool claims it again.
    let acme_claim = got
        .iter()
        .find(|c| c.task.control.tenant == "acme")
        .unwrap_or_else(|| panic!("acme's task was claimed"));
    ok2(
        store
            .release("acme", acme_claim.attempt.id, acme_claim.attempt.generation)
            .await,
        "release",
    );
    let again = claim_with(&store, &flow, 10).await;
    assert_eq!(
        again.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        vec![a[0].id]
    );
    // A new task of a tenant the pool found without work is claimed too.
    let g2 = flood(&globex, 1, 3, None).await;
    let next = claim_with(&store, &flow, 10).await;
    assert_eq!(
        next.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        vec![g2[0].id]
    );
    let unserved = must(
        store.attempt_tenant(Uuid::new_v4()).await,
        "attempt_tenant of nothing",
    );
    assert_eq!(unserved, None);
    assert_eq!(initech.task(i[0].id).await.state, TaskState::Queued);
    for t in [&a[0], &g[0], &i[0], &g2[0]] {
        assert_history(&store, t.id).await;
    }
}

/// A pool serving every tenant takes them in turn: a tenant that submits
/// one task after another tenant's flood has it claimed within one turn of
/// the tenants with work; two tenants with work share claims one for one,
/// or by their weights.
pub async fn pool_claims_serve_tenants_in_weighted_turns(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    let globex = Ctx::new(&store, "globex").await;
    let all = pool(Serves::All(AllTenants::All), &[], false);
    flood(&acme, 12, 3, None).await;
    let late = flood(&globex, 1, 3, None).await;
    let order = claim_one_by_one(&store, &all, 2).await;
    assert!(
        order.iter().any(|(_, t)| t.id == late[0].id),
        "globex's task within one turn: {:?}",
        order.iter().map(|(t, _)| t).collect::<Vec<_>>()
    );
    // acme: 11 left; globex: 11 more. One for one.
    flood(&globex, 11, 3, None).await;
    let order = claim_one_by_one(&store, &all, 10).await;
    let count = |o: &[(String, Task)], t: &str| o.iter().filter(|(x, _)| x == t).count();
    assert_eq!((count(&order, "acme"), count(&order, "globex")), (5, 5));
    // Weights 3 : 1 (acme has 6 left; globex 6).
    let weighted = pool(Serves::All(AllTenants::All), &[("acme", 3)], false);
    let order = claim_one_by_one(&store, &weighted, 8).await;
    let acme_n = count(&order, "acme");
    assert!(
        (5..=6).contains(&acme_n),
        "acme 3 of 4 claims: {acme_n} of 8"
    );
}

/// Inside one tenant, a class with a fairness key serves its values in
/// turn: a value with one task after another value's flood is claimed
/// within one turn of the values with work.
pub async fn fairness_key_values_are_served_in_turn(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    flood(&acme, 12, 3, Some("workspace-a")).await;
    let late = flood(&acme, 1, 3, Some("workspace-b")).await;
    let req = |max| own_fair_claim("acme", max);
    let mut seen = Vec::new();
    for _ in 0..2 {
        let got = must(store.claim(req(1)).await, "claim");
        seen.extend(got.into_iter().map(|c| c.task));
    }
    assert!(
        seen.iter().any(|t| t.id == late[0].id),
        "workspace-b within one turn: {:?}",
        seen.iter()
            .map(|t| t.control.fairness_key.clone())
            .collect::<Vec<_>>()
    );
    assert_eq!(
        acme.task(late[0].id).await.control.fairness_key.as_deref(),
        Some("workspace-b"),
        "the fairness key is kept on the task"
    );
    // The rest drains: every task of the value's flood is claimed.
    let rest = must(store.claim(req(20)).await, "claim");
    assert_eq!(rest.len() + seen.len(), 13);
}

/// Claims take higher priorities first among tasks ready at once, and a
/// task's priority rises with its time in queue: a priority-1 task ready
/// more than 4 × AGING_MS before a priority-5 task goes first.
pub async fn priorities_order_claims_and_age(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    let low = flood(&acme, 1, 1, None).await;
    let high = flood(&acme, 1, 5, None).await;
    let mid = flood(&acme, 1, 3, None).await;
    assert_eq!(acme.task(high[0].id).await.priority, 5, "kept on the task");
    assert_eq!(api(&acme.task(mid[0].id).await)["priority"], json!(3));
    let order: Vec<Uuid> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            let a = acme.claim(&[SAFE], Some(LONG_LEASE), 1).await;
            out.extend(a.iter().map(|c| c.task.id));
        }
        out
    };
    assert_eq!(order, vec![high[0].id, mid[0].id, low[0].id]);
    // Aging: a priority-1 task that waited longer than 4 levels goes first …
    let old = flood(&acme, 1, 1, None).await;
    store.clock().advance(Duration::from_millis(
        u64::try_from(4 * AGING_MS + 1_000).unwrap_or(0),
    ));
    let urgent = flood(&acme, 1, 5, None).await;
    let first = acme.claim(&[SAFE], Some(LONG_LEASE), 1).await;
    assert_eq!(
        first.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        vec![old[0].id]
    );
    let second = acme.claim(&[SAFE], Some(LONG_LEASE), 1).await;
    assert_eq!(
        second.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        vec![urgent[0].id]
    );
    // … and one that waited less does not.
    let young = flood(&acme, 1, 1, None).await;
    store.clock().advance(Duration::from_millis(
        u64::try_from(4 * AGING_MS - 1_000).unwrap_or(0),
    ));
    let urgent = flood(&acme, 1, 5, None).await;
    let first = acme.claim(&[SAFE], Some(LONG_LEASE), 1).await;
    assert_eq!(
        first.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        vec![urgent[0].id]
    );
    let second = acme.claim(&[SAFE], Some(LONG_LEASE), 1).await;
    assert_eq!(
        second.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        vec![young[0].id]
    );
    // A pool's claims order each tenant's tasks the same way.
    let p1 = flood(&acme, 1, 1, None).await;
    let p5 = flood(&acme, 1, 5, None).await;
    let all = pool(Serves::All(AllTenants::All), &[], false);
    let order = claim_one_by_one(&store, &all, 2).await;
    assert_eq!(
        order.iter().map(|(_, t)| t.id).collect::<Vec<_>>(),
        vec![p5[0].id, p1[0].id]
    );
    for t in [&low[0], &high[0], &mid[0], &old[0], &young[0]] {
        assert_history(&store, t.id).await;
    }
}

/// Tasks a class's claims find by turns after the class declared a fairness
/// key (tasks submitted before it, or by a binary of an earlier schema,
/// carry none and have no value queue) are still claimed: by the key's own
/// tenant and by a pool key, all of them.
pub async fn tasks_without_a_fairness_value_are_claimed_by_turns(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    let before = flood(&acme, 3, 3, None).await;
    let req = own_fair_claim("acme", 1);
    let got = must(store.claim(req).await, "claim");
    assert_eq!(
        got.len(),
        1,
        "the key's own tenant claims a task without a value"
    );
    let by_pool = claim_with(
        &store,
        &pool(Serves::Tenants(vec!["acme".into()]), &[], true),
        10,
    )
    .await;
    assert_eq!(by_pool.len(), 2, "a pool key claims the rest");
    for t in &before {
        assert_eq!(acme.task(t.id).await.state, TaskState::Running);
    }
}

/// A pool's claim passes over a tenant whose cap is full, however long its
/// backlog and however low its turn: the other tenants' tasks are leased in
/// the same claim, and the capped tenant's wait with no attempt used.
pub async fn a_capped_tenant_does_not_hide_the_other_tenants_of_a_pool(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    let globex = Ctx::new(&store, "globex").await;
    let backlog = flood(&acme, 80, 3, None).await;
    let g = flood(&globex, 2, 3, None).await;
    let mut flow = pool(Serves::All(AllTenants::All), &[], false);
    flow.tenant_caps = [("acme".to_owned(), 1)].into();
    // acme (turn 0, first by name), then globex: each turn 1,000,000.
    let first = claim_with(&store, &flow, 1).await;
    let second = claim_with(&store, &flow, 1).await;
    let tenants: Vec<&str> = first
        .iter()
        .chain(&second)
        .map(|c| c.task.control.tenant.as_str())
        .collect();
    assert_eq!(tenants, ["acme", "globex"]);
    // acme's turn is the lowest again (a tie, first by name) and its cap is
    // full: globex's second task is what the claim leases.
    let third = claim_with(&store, &flow, 5).await;
    let ids: Vec<Uuid> = third.iter().map(|c| c.task.id).collect();
    assert_eq!(ids, [g[1].id], "globex's task, past acme's full cap");
    let waiting = backlog.iter().skip(1).take(5);
    for t in waiting {
        assert_eq!(acme.task(t.id).await.attempt_count, 0);
    }
}

/// A queue parked while a task of it was being written holds a waiting
/// task a pool key does not see; the sweep unparks it, however many idle
/// queues stay parked beside it: a sweep of at most 2 reads only parked
/// queues that have a task waiting. Idle parked queues are not unparked.
pub async fn a_sweep_unparks_waiting_queues_past_idle_ones(store: Store) {
    let idle: Vec<String> = (0..6).map(|i| format!("idle-{i}")).collect();
    for tenant in &idle {
        let c = Ctx::new(&store, tenant).await;
        flood(&c, 1, 3, None).await;
    }
    let everyone = pool(Serves::All(AllTenants::All), &[], false);
    // Their tasks leased and done: each idle queue is then parked by a claim
    // that finds it empty.
    let done = claim_one_by_one(&store, &everyone, idle.len()).await;
    assert_eq!(done.len(), idle.len());
    assert!(claim_with(&store, &everyone, 1).await.is_empty());
    for tenant in &idle {
        must(store.park_queues(tenant, SAFE).await, "park_queues");
    }
    let acme = Ctx::new(&store, "acme").await;
    let a = flood(&acme, 2, 3, None).await;
    let parked = must(store.park_queues("acme", SAFE).await, "park_queues");
    assert_eq!(parked, 1, "acme's queue");
    assert!(
        claim_with(&store, &everyone, 1).await.is_empty(),
        "acme's queue is parked: the pool does not see its tasks"
    );
    let swept = must(store.sweep(2).await, "sweep");
    assert_eq!(swept.unparked, 1, "{swept:?}");
    let again = must(store.sweep(2).await, "sweep");
    assert_eq!(again.unparked, 0, "idle queues stay parked: {again:?}");
    let got = claim_one_by_one(&store, &everyone, 3).await;
    let ids: Vec<Uuid> = got.iter().map(|(_, t)| t.id).collect();
    assert_eq!(ids, [a[0].id, a[1].id], "acme's tasks, nothing else");
    for t in &a {
        assert_history(&store, t.id).await;
    }
}

/// Waiting tasks without a tenant queue (accepted by a binary of a schema
/// before the claim queues, which writes none) are invisible to a pool key
/// and to a class with a fairness key until a sweep inserts their queues,
/// each at the lowest unparked turn of its level, as a submit does. Each
/// sweep walks at most its batch size of (tenant, class) pairs, from where
/// the last one stopped; one that finds every queue in place inserts
/// nothing.
pub async fn a_sweep_restores_missing_claim_queues(store: Store) {
    let acme = Ctx::new(&store, "acme").await;
    let globex = Ctx::new(&store, "globex").await;
    let initech = Ctx::new(&store, "initech").await;
    let a = flood(&acme, 3, 3, None).await;
    let g = flood(&globex, 1, 3, Some("workspace-a")).await;
    let i = flood(&initech, 4, 3, None).await;
    for tenant in ["acme", "globex"] {
        let gone = must(store.forget_queues(tenant, SAFE).await, "forget_queues");
        assert!(gone > 0, "{tenant}'s queues were there to delete");
    }
    let pooled = pool(
        Serves::Tenants(vec!["acme".into(), "initech".into()]),
        &[],
        false,
    );
    let before = claim_one_by_one(&store, &pooled, 2).await;
    let tenants: Vec<&str> = before.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(
        tenants,
        ["initech", "initech"],
        "acme's tasks have no queue: the pool does not see them"
    );
    let fair = |max| own_fair_claim("globex", max);
    assert!(
        must(store.claim(fair(10)).await, "claim").is_empty(),
        "globex's task has no queue: its fairness-key class does not see it"
    );
    // Sweeps of 1 walk one (tenant, class) pair each, each from where the
    // last stopped: acme's (queue inserted), globex's (inserted),
    // initech's (in place), then none left.
    let pair = |tenant: &str| {
        Some(QueuePair {
            tenant: tenant.to_owned(),
            operation: SAFE.to_owned(),
        })
    };
    let mut after = None;
    for (opened, walked_to) in [(1, "acme"), (1, "globex"), (0, "initech")] {
        let swept = must(store.sweep_from(1, after.clone()).await, "sweep");
        assert_eq!(
            (swept.opened, &swept.queues_walked_to),
            (opened, &pair(walked_to)),
            "{swept:?}"
        );
        after = swept.queues_walked_to;
    }
    let last = must(store.sweep_from(1, after).await, "sweep");
    assert_eq!((last.opened, last.queues_walked_to), (0, None));
    let again = must(store.sweep(SWEEP).await, "sweep");
    assert_eq!(
        (again.opened, again.queues_walked_to),
        (0, None),
        "nothing missing"
    );
    // acme's queue joins at initech's turn (2 leases: 2,000,000), not at 0:
    // the two alternate (ties go by tenant name).
    let after = claim_one_by_one(&store, &pooled, 4).await;
    let tenants: Vec<&str> = after.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(tenants, ["acme", "initech", "acme", "initech"]);
    let got = must(store.claim(fair(10)).await, "claim");
    assert_eq!(
        got.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        vec![g[0].id],
        "globex's fairness-key class claims its task"
    );
    for t in a.iter().chain(&g).chain(&i) {
        assert_history(&store, t.id).await;
    }
}

/// Rounds of concurrent writers, claimers and sweepers on the claim queues
/// of a pool and a fairness-key class (SPEC §2.13): per round, one
/// submitter per tenant (fairness values none, `a`, `b`), two pool claimers
/// and one claimer of acme's own fair key that succeed, fail (a retry
/// waits), release or abandon (the lease runs out) what they lease, two
/// sweepers, queues parked or deleted behind their writers' backs, and a
/// clock that moves. No store call fails, no (task,
/// generation) is leased twice, and once the writers stop, two sweeps let
/// the pool lease every task still waiting: none is left in a parked or
/// missing queue.
pub async fn pool_claims_strand_no_task_under_concurrent_writes_and_sweeps(store: Store) {
    const TENANTS: [&str; 3] = ["acme", "globex", "initech"];
    const VALUES: [Option<&str>; 3] = [None, Some("a"), Some("b")];
    const ROUNDS: usize = 8;
    const PER_TENANT: usize = 6;
    let flow = pool(Serves::All(AllTenants::All), &[], true);
    let own = ClaimFlow {
        serves: None,
        fair_classes: vec![SAFE.to_owned()],
        ..ClaimFlow::default()
    };
    let request = |tenant: &str, flow: &ClaimFlow, max: i64| ClaimRequest {
        tenant: tenant.to_owned(),
        operations: vec![SAFE.to_owned()],
        executor_id: format!("{tenant}-executor"),
        max,
        lease_ms: Some(SHORT_LEASE),
        flow: flow.clone(),
    };
    let mut ctxs = Vec::new();
    for t in TENANTS {
        ctxs.push(Ctx::new(&store, t).await);
    }
    let mut leased: HashSet<(Uuid, i64)> = HashSet::new();
    let mut all: Vec<Uuid> = Vec::new();
    for round in 0..ROUNDS {
        let writing = Arc::new(AtomicUsize::new(TENANTS.len()));
        let mut writers = Vec::new();
        for (i, c) in ctxs.iter().enumerate() {
            let (c, writing) = (c.clone(), writing.clone());
            writers.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                for n in 0..PER_TENANT {
                    let value = VALUES[(n + i + round) % VALUES.len()];
                    ids.extend(flood(&c, 1, 3, value).await.iter().map(|t| t.id));
                    tokio::task::yield_now().await;
                }
                writing.fetch_sub(1, Ordering::SeqCst);
                ids
            }));
        }
        let mut claimers = Vec::new();
        for w in 0..3 {
            let (store, writing) = (store.clone(), writing.clone());
            let req = if w < 2 {
                request("pool", &flow, 2)
            } else {
                request("acme", &own, 2)
            };
            claimers.push(tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut k = w;
                let mut idle = 0;
                while writing.load(Ordering::SeqCst) > 0 || idle < 20 {
                    let got = must(store.claim(req.clone()).await, "claim");
                    if got.is_empty() {
                        idle += 1;
                        tokio::task::yield_now().await;
                        continue;
                    }
                    for c in got {
                        let a = c.attempt;
                        let tenant = c.task.control.tenant.clone();
                        seen.push((a.task_id, a.generation));
                        k += 1;
                        match k % 4 {
                            0 => {
                                let _ = must(
                                    store.report(&tenant, a.id, succeeded(a.generation)).await,
                                    "report",
                                );
                            }
                            1 => {
                                let _ = must(
                                    store
                                        .report(
                                            &tenant,
                                            a.id,
                                            failed(a.generation, FailureClass::Transient),
                                        )
                                        .await,
                                    "report",
                                );
                            }
                            2 => {
                                let _ = must(
                                    store.release(&tenant, a.id, a.generation).await,
                                    "release",
                                );
                            }
                            _ => {}
                        }
                    }
                }
                seen
            }));
        }
        let mut sweepers = Vec::new();
        for _ in 0..2 {
            let (store, writing) = (store.clone(), writing.clone());
            sweepers.push(tokio::spawn(async move {
                while writing.load(Ordering::SeqCst) > 0 {
                    must(store.sweep(2).await, "sweep");
                    store.clock().advance(Duration::from_millis(700));
                    tokio::task::yield_now().await;
                }
            }));
        }
        // Queues parked under a write that leaves a task waiting (a race
        // the sweep repairs) and deleted (as a binary of a schema before
        // the claim queues leaves its tasks).
        {
            let (store, writing) = (store.clone(), writing.clone());
            sweepers.push(tokio::spawn(async move {
                let mut k = round;
                while writing.load(Ordering::SeqCst) > 0 {
                    k += 1;
                    let tenant = TENANTS[k % TENANTS.len()];
                    if k % 2 == 0 {
                        must(store.park_queues(tenant, SAFE).await, "park_queues");
                    } else {
                        must(store.forget_queues(tenant, SAFE).await, "forget_queues");
                    }
                    tokio::task::yield_now().await;
                }
            }));
        }
        for h in writers {
            all.extend(joined(h.await));
        }
        for h in sweepers {
            joined(h.await);
        }
        for h in claimers {
            for pair in joined(h.await) {
                assert!(
                    leased.insert(pair),
                    "round {round}: (task, generation) {pair:?} leased twice"
                );
            }
        }
        // Quiet: leases run out (a sweep expires them), backoffs end; two
        // sweeps, then the pool leases every task still waiting.
        store
            .clock()
            .advance(Duration::from_millis(SHORT_LEASE as u64));
        must(store.sweep(SWEEP).await, "sweep");
        store
            .clock()
            .advance(Duration::from_millis(LONGEST_BACKOFF as u64));
        for _ in 0..2 {
            must(store.sweep(SWEEP).await, "sweep");
        }
        loop {
            let got = must(store.claim(request("pool", &flow, 10)).await, "claim");
            if got.is_empty() {
                break;
            }
            for c in got {
                let a = c.attempt;
                assert!(
                    leased.insert((a.task_id, a.generation)),
                    "round {round}: leased twice"
                );
                let _ = must(
                    store
                        .report(&c.task.control.tenant, a.id, succeeded(a.generation))
                        .await,
                    "report",
                );
            }
        }
        for id in &all {
            let t = ok2(store.get_task(None, *id).await, "get_task");
            assert!(
                !crate::flow::waits(&t),
                "round {round}: task {id} of {} (fairness key {:?}) waits in {:?} but the pool \
                 leases nothing after two sweeps",
                t.control.tenant,
                t.control.fairness_key,
                t.state
            );
        }
    }
    assert_eq!(all.len(), ROUNDS * TENANTS.len() * PER_TENANT);
    for id in &all {
        assert_history(&store, *id).await;
    }
}

/// A fairness key value is what the params hold at the class's pointer
/// (SPEC §2.13), of any length: tasks whose value is long and does not
/// compress (8,000 characters) are accepted under its digest
/// ([`idem_core::flow::bounded_key_value`]), share one value queue and are
/// leased by a claim of their fairness-key class, as with a short value.
pub async fn a_long_fairness_value_is_queued_and_claimed(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut long = String::new();
    while long.len() < 8_000 {
        long.push_str(&Uuid::new_v4().simple().to_string());
    }
    let class = idem_core::flow::ClassFlow {
        fairness_key: Some(must(
            idem_core::fingerprint::JsonPointer::parse("/ws"),
            "pointer",
        )),
        ..idem_core::flow::ClassFlow::default()
    };
    let Some(value) = class.fairness_value(&json!({ "ws": long })) else {
        panic!("the class has a fairness key");
    };
    assert!(value.len() <= idem_core::flow::MAX_KEY_VALUE_BYTES);
    let t = flood(&c, 2, 3, Some(&value)).await;
    let req = own_fair_claim("acme", 2);
    let got = must(store.claim(req).await, "claim");
    assert_eq!(
        got.iter().map(|c| c.task.id).collect::<Vec<_>>(),
        t.iter().map(|t| t.id).collect::<Vec<_>>()
    );
    for c in &got {
        assert_eq!(c.task.control.fairness_key.as_deref(), Some(value.as_str()));
        assert_history(&store, c.task.id).await;
    }
}
