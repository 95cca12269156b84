//! Task search (SPEC §4 "Task search"): a tenant's tasks, newest first, in
//! keyset pages. Guards tenant isolation (no filter, grant or cursor shows
//! another tenant's task), and that every task that existed when a walk began
//! is on exactly one page while another writer inserts more.

use std::collections::{BTreeSet, HashMap};

use idem_core::fingerprint::canonical_request;
use idem_core::model::{Role, Task, TaskState, Timestamp};
use serde_json::json;
use uuid::Uuid;

use super::{NON_SAFE, SAFE, contract, failed, must, ok2, rep};
use crate::Store;
use crate::ops::search::{TaskCursor, TaskQuery};
use crate::ops::{ClaimRequest, Submission, SubmitOutcome};

/// A third operation class (the store does not check classes against a
/// configuration; it takes the safe class's contract).
const THIRD: &str = "image.render";
/// The classes of the case.
const CLASSES: [&str; 3] = [NON_SAFE, SAFE, THIRD];
/// Tasks per tenant and class.
const PER_CLASS: usize = 500;

/// A submission of task `n` of `class` for `tenant` under `key`, all params
/// material.
fn submission_of(tenant: &str, class: &str, key: &str, n: usize, api_key: Uuid) -> Submission {
    let params = json!({"n": n, "class": class});
    let canonical = must(canonical_request(class, &params, &[]), "canonical request");
    let contract_of = if class == NON_SAFE { NON_SAFE } else { SAFE };
    Submission {
        tenant: tenant.to_owned(),
        operation: class.to_owned(),
        idempotency_key: key.to_owned(),
        fingerprint: canonical.fingerprint.to_string(),
        canonical_request: canonical.canonical,
        params,
        contract: must(
            idem_core::contract::FrozenContract::new(contract(contract_of)),
            "frozen contract",
        ),
        api_key_id: api_key,
        grant: None,
        traceparent: None,
        rate_limits: Vec::new(),
        concurrency_key: None,
        priority: 3,
        fairness_key: None,
    }
}

/// Submits `count` tasks per class for `tenant` (keys `p%_<class>-<n>` for
/// even `n`, `pX<class>-<n>` for odd: a prefix with LIKE's wildcards must
/// match itself only), in batches.
async fn seed(store: &Store, tenant: &str, tag: &str, count: usize) -> Vec<Task> {
    let (key, _) = must(
        store.create_api_key(tenant, Role::Client, None).await,
        "create_api_key",
    );
    let mut subs = Vec::new();
    for n in 0..count {
        for class in CLASSES {
            let k = if n % 2 == 0 {
                format!("p%_{tag}{class}-{n}")
            } else {
                format!("pX{tag}{class}-{n}")
            };
            subs.push(submission_of(tenant, class, &k, n, key.id));
        }
    }
    let mut out = Vec::new();
    for chunk in subs.chunks(100) {
        for o in must(store.submit_batch(chunk.to_vec()).await, "submit_batch") {
            match o {
                SubmitOutcome::Created(t) => out.push(t),
                other => panic!("a fresh key must create a task, got {other:?}"),
            }
        }
    }
    out
}

/// Moves some of `tenant`'s tasks on: per class, 40 claimed (20 succeed
/// with a provider transaction id, 10 fail, 10 stay running) and 10 queued
/// ones cancelled.
async fn spread_states(store: &Store, tenant: &str, tasks: &[Task]) {
    for class in CLASSES {
        let claimed = must(
            store
                .claim(ClaimRequest {
                    tenant: tenant.to_owned(),
                    operations: vec![class.to_owned()],
                    executor_id: "search-case".into(),
                    max: 40,
                    lease_ms: Some(super::LONG_LEASE),
                    flow: Default::default(),
                })
                .await,
            "claim",
        );
        assert_eq!(claimed.len(), 40, "claimable tasks of {class}");
        for (i, c) in claimed.iter().enumerate() {
            let a = &c.attempt;
            let report = match i {
                0..20 => rep(a.generation, idem_core::model::Outcome::Succeeded)
                    .result(json!({"ok": true}))
                    .txn(&format!("txn-{tenant}-{class}-{i}"))
                    .build(),
                20..30 => failed(a.generation, idem_core::model::FailureClass::InvalidInput),
                _ => continue,
            };
            ok2(store.report(tenant, a.id, report).await, "report");
        }
        let queued: Vec<&Task> = tasks
            .iter()
            .filter(|t| t.operation == class)
            .rev()
            .take(10)
            .collect();
        for t in queued {
            ok2(store.cancel(tenant, t.id).await, "cancel");
        }
    }
}

/// Whether `t` matches `q` (the filters a walk is checked against).
fn matches(t: &Task, q: &TaskQuery, txns: &HashMap<Uuid, BTreeSet<String>>) -> bool {
    (q.states.is_empty() || q.states.contains(&t.state))
        && q.operation.as_ref().is_none_or(|o| *o == t.operation)
        && q.created_after.is_none_or(|a| t.created_at > a)
        && q.created_before.is_none_or(|b| t.created_at < b)
        && q.idempotency_key_prefix
            .as_ref()
            .is_none_or(|p| t.idempotency_key.starts_with(p.as_str()))
        && q.external_txn_id
            .as_ref()
            .is_none_or(|x| txns.get(&t.id).is_some_and(|s| s.contains(x)))
}

/// Walks every page of `q` for `tenant`; checks the order and that no task
/// repeats; returns the tasks and the first `next_cursor`.
async fn walk(store: &Store, tenant: &str, q: &TaskQuery) -> (Vec<Task>, Option<TaskCursor>) {
    let mut q = q.clone();
    let mut all: Vec<Task> = Vec::new();
    let mut first_cursor = None;
    for _ in 0..10_000 {
        let page = must(store.search_tasks(tenant, q.clone()).await, "search_tasks");
        assert!(page.tasks.len() <= q.limit as usize, "page over its limit");
        if page.next_cursor.is_some() {
            assert_eq!(
                page.tasks.len(),
                q.limit as usize,
                "a page before the last is full"
            );
        }
        all.extend(page.tasks);
        first_cursor = first_cursor.or(page.next_cursor);
        match page.next_cursor {
            Some(c) => q.cursor = Some(c),
            None => break,
        }
    }
    for w in all.windows(2) {
        assert!(
            (w[0].created_at, w[0].id) > (w[1].created_at, w[1].id),
            "pages must be newest first without repeats: {} then {}",
            w[0].id,
            w[1].id
        );
    }
    (all, first_cursor)
}

/// 2 tenants × 3 classes × 500 tasks in several states: every combination
/// of filters, walked page by page while a concurrent writer inserts more
/// tasks into both tenants, returns only the caller's tasks that match, and
/// each task that existed before the walk exactly once; a cursor of one
/// tenant used by the other shows none of the first's tasks; a key granted
/// one class sees only that class.
pub async fn search_is_tenant_scoped_and_pages_each_task_once(store: Store) {
    let tenants = ["search-a", "search-b"];
    let mut before: HashMap<&str, Vec<Task>> = HashMap::new();
    for tenant in tenants {
        let tasks = seed(&store, tenant, "", PER_CLASS).await;
        spread_states(&store, tenant, &tasks).await;
        // Read back: the states after the spread.
        let mut now = Vec::with_capacity(tasks.len());
        for t in &tasks {
            now.push(ok2(store.get_task(Some(tenant), t.id).await, "get_task"));
        }
        before.insert(tenant, now);
    }
    let mut txns: HashMap<Uuid, BTreeSet<String>> = HashMap::new();
    for tenant in tenants {
        for t in &before[tenant] {
            if let Some(d) = &t.delivery
                && let Some(x) = &d.external_txn_id
            {
                txns.entry(t.id).or_default().insert(x.clone());
            }
        }
    }
    let mut created: Vec<Timestamp> = before[tenants[0]].iter().map(|t| t.created_at).collect();
    created.sort();
    let pivot = created[created.len() / 2];
    let some_txn = format!("txn-{}-{NON_SAFE}-3", tenants[0]);

    // The concurrent writer: more tasks in both tenants until told to stop.
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let writer_store = store.clone();
    let writer = tokio::spawn(async move {
        let mut round = 0;
        loop {
            for tenant in ["search-a", "search-b"] {
                seed(&writer_store, tenant, &format!("w{round}-"), 2).await;
            }
            round += 1;
            if stop_rx.try_recv().is_ok() {
                return round;
            }
            tokio::task::yield_now().await;
        }
    });

    let state_sets: [&[TaskState]; 4] = [
        &[],
        &[TaskState::Queued],
        &[TaskState::Succeeded, TaskState::Failed],
        &[TaskState::Running, TaskState::Cancelled],
    ];
    let mut queries = Vec::new();
    for states in state_sets {
        for operation in [None, Some(NON_SAFE), Some(THIRD)] {
            for (after, before_t) in [(None, None), (Some(pivot), None), (None, Some(pivot))] {
                for prefix in [None, Some("p%")] {
                    queries.push(TaskQuery {
                        states: states.to_vec(),
                        operation: operation.map(str::to_owned),
                        created_after: after,
                        created_before: before_t,
                        idempotency_key_prefix: prefix.map(str::to_owned),
                        limit: if prefix.is_some() { 97 } else { 200 },
                        ..TaskQuery::default()
                    });
                }
            }
        }
    }
    queries.push(TaskQuery {
        external_txn_id: Some(some_txn.clone()),
        ..TaskQuery::default()
    });
    queries.push(TaskQuery {
        states: vec![TaskState::Succeeded],
        limit: 7,
        ..TaskQuery::default()
    });

    for q in &queries {
        for tenant in tenants {
            let (got, _) = walk(&store, tenant, q).await;
            let ids: BTreeSet<Uuid> = got.iter().map(|t| t.id).collect();
            for t in &got {
                assert_eq!(t.control.tenant, tenant, "another tenant's task in {q:?}");
                // Tasks inserted meanwhile may show, if they match.
                let known = before[tenant].iter().find(|b| b.id == t.id);
                let t = known.unwrap_or(t);
                assert!(matches(t, q, &txns), "{} does not match {q:?}", t.id);
            }
            let expected: Vec<&Task> = before[tenant]
                .iter()
                .filter(|t| matches(t, q, &txns))
                .collect();
            for t in &expected {
                assert!(
                    ids.contains(&t.id),
                    "{} missing from {q:?} of {tenant}",
                    t.id
                );
            }
            if q.external_txn_id.is_some() {
                let n = usize::from(tenant == tenants[0]);
                assert_eq!(expected.len(), n, "the task behind {some_txn}");
            }
            if q.idempotency_key_prefix.is_some() {
                assert!(got.iter().all(|t| t.idempotency_key.starts_with("p%_")));
            }
        }
    }

    // A cursor of tenant A, used by tenant B, shows none of A's tasks.
    let (_, cursor) = walk(
        &store,
        tenants[0],
        &TaskQuery {
            limit: 10,
            ..TaskQuery::default()
        },
    )
    .await;
    let Some(cursor) = cursor else {
        panic!("tenant A has more than one page");
    };
    let page = must(
        store
            .search_tasks(
                tenants[1],
                TaskQuery {
                    cursor: Some(cursor),
                    limit: 200,
                    ..TaskQuery::default()
                },
            )
            .await,
        "search_tasks",
    );
    assert!(page.tasks.iter().all(|t| t.control.tenant == tenants[1]));

    // A key granted one class sees only that class, even when it asks for another.
    let granted = store.granted(Some(vec![SAFE.to_owned()]));
    let (got, _) = walk(&granted, tenants[0], &TaskQuery::default()).await;
    assert!(got.iter().all(|t| t.operation == SAFE));
    let n = before[tenants[0]]
        .iter()
        .filter(|t| t.operation == SAFE)
        .count();
    assert!(got.len() >= n, "every task of the granted class");
    let other = TaskQuery {
        operation: Some(NON_SAFE.to_owned()),
        ..TaskQuery::default()
    };
    let page = must(
        granted.search_tasks(tenants[0], other).await,
        "search_tasks",
    );
    assert!(page.tasks.is_empty() && page.next_cursor.is_none());

    let _ = stop_tx.send(());
    let rounds = must(writer.await, "writer");
    assert!(rounds > 0, "the concurrent writer inserted tasks");
}
