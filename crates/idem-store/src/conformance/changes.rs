//! Committed changes (SPEC §4, "Waiting"; [`crate::changes`]): every event a
//! transaction commits is heard by a subscriber of the store with its tenant,
//! class, task and type; what is refused or rolled back is not heard.

use super::*;
use crate::changes::{Change, Notice, Watch};

/// The changes `watch` hears until it has heard every `(task, type)` of
/// `want` or [`PATIENCE`] ran out, in the order heard.
async fn hear(watch: &mut Watch, want: &BTreeSet<(Uuid, String)>) -> Vec<Change> {
    let until = Instant::now() + PATIENCE;
    let mut heard = Vec::new();
    let mut missing = want.clone();
    while !missing.is_empty() {
        match tokio::time::timeout_at(until, watch.next()).await {
            Ok(Notice::Change(c)) => {
                missing.remove(&(c.task_id, c.kind.as_str().to_owned()));
                heard.push((*c).clone());
            }
            Ok(Notice::Resync) => {}
            Err(_) => panic!("not heard within {PATIENCE:?}: {missing:?}"),
        }
    }
    heard
}

/// Every event of a task's life (submit, lease, report, delivery), of a
/// conflicting submit (none) and of another tenant's task is heard once each,
/// with its own tenant, class and task.
pub async fn committed_events_are_heard_with_tenant_class_and_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let other = Ctx::new(&store, "globex").await;
    let mut watch = store.changes().subscribe();
    tokio::time::timeout(PATIENCE, store.changes().heard())
        .await
        .unwrap_or_else(|_| panic!("the store's changes are not heard within {PATIENCE:?}"));
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    // A conflicting submit writes nothing, so nothing is heard of it.
    let conflicting = c.submission(
        NON_SAFE,
        &t.idempotency_key,
        params(NON_SAFE, 8),
        &contract(NON_SAFE),
    );
    assert!(matches!(
        c.submit(conflicting).await,
        SubmitOutcome::Conflict { .. }
    ));
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let r = rep(a.generation, Outcome::Succeeded)
        .result(json!({"ok": true}))
        .txn("txn-1")
        .build();
    c.report_ok(&a, r).await;
    let o = other.create(SAFE, &contract(SAFE)).await;

    let mut want = BTreeSet::new();
    for e in c.events(t.id).await {
        want.insert((t.id, e.kind.as_str().to_owned()));
    }
    for e in other.events(o.id).await {
        want.insert((o.id, e.kind.as_str().to_owned()));
    }
    let heard = hear(&mut watch, &want).await;
    let stored = c.events(t.id).await.len() + other.events(o.id).await.len();
    assert_eq!(
        heard.len(),
        stored,
        "each committed event is heard once: {heard:?}"
    );
    for h in &heard {
        let (tenant, op) = if h.task_id == t.id {
            ("acme", NON_SAFE)
        } else {
            ("globex", SAFE)
        };
        assert_eq!(
            (h.tenant.as_str(), h.operation.as_str()),
            (tenant, op),
            "{h:?}"
        );
    }
    let kinds_of_t: Vec<&str> = heard
        .iter()
        .filter(|h| h.task_id == t.id)
        .map(|h| h.kind.as_str())
        .collect();
    let stored_kinds = c.events(t.id).await;
    assert_eq!(
        kinds_of_t,
        kinds(&stored_kinds),
        "one task's events are heard in seq order"
    );
}
