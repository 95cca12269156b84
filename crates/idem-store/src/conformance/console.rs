//! The operator console's store (SPEC §4 "Operator console"): sessions run out
//! by the store's clock, end on sign-out, stop with their key's revocation and
//! carry the key's tenant and role; the overview counts and lists only the
//! caller's tenant's tasks (and grant's classes), with its thresholds read on
//! the store's clock.

use std::time::Duration;

use crate::ops::console::{OverviewQuery, hash_session_token};

use super::*;

/// A session's length in the cases, ms.
const TTL: i64 = 60_000;

/// The overview's thresholds: 15 minutes reconciling, 24 hours failed.
const QUERY: OverviewQuery = OverviewQuery {
    reconciling_for_ms: 15 * 60_000,
    failed_within_ms: 24 * 3_600_000,
    limit: 20,
};

fn advance(store: &Store, ms: u64) {
    store.clock().advance(Duration::from_millis(ms));
}

/// A session is found by its token only, with the key's tenant, role and id;
/// it runs out at `expires_at` by the store's clock, ends on sign-out (once),
/// and stops at once when its key is revoked; a revoked key gets none.
pub async fn console_sessions_expire_end_and_follow_their_key(store: Store) {
    let (admin, _) = must(
        store.create_api_key("acme", Role::Admin, None).await,
        "create admin key",
    );
    let (client, _) = must(
        store
            .create_api_key("other", Role::Client, Some(vec![SAFE.to_owned()]))
            .await,
        "create client key",
    );
    let Some((made, token)) = must(store.create_console_session(admin.id, TTL).await, "create")
    else {
        panic!("a live key gets a session");
    };
    assert_eq!(token.len(), 43, "32 bytes, base64url without padding");
    assert_eq!(
        (made.tenant.as_str(), made.role, made.api_key_id),
        ("acme", Role::Admin, admin.id)
    );
    assert_eq!(made.expires_at.0 - made.created_at.0, TTL);
    assert_ne!(hash_session_token(&token), token, "only the hash is stored");

    let Some((found, key)) = must(store.console_session(&token).await, "lookup") else {
        panic!("the session is active");
    };
    assert_eq!(found, made);
    assert_eq!(key, admin);
    assert!(
        must(store.console_session("not-a-token").await, "lookup").is_none(),
        "an unknown token names no session"
    );
    let Some((_, other_token)) = must(store.create_console_session(client.id, TTL).await, "create")
    else {
        panic!("a live key gets a session");
    };
    assert_ne!(other_token, token, "every session has its own token");
    let Some((other, other_key)) = must(store.console_session(&other_token).await, "lookup") else {
        panic!("the other session is active");
    };
    assert_eq!(
        (other.tenant.as_str(), other.role),
        ("other", Role::Client),
        "the tenant and role are the key's"
    );
    assert_eq!(other_key.operations, Some(vec![SAFE.to_owned()]));

    // Expiry by the store's clock.
    advance(&store, (TTL - 5_000) as u64);
    assert!(
        must(store.console_session(&token).await, "lookup").is_some(),
        "not run out before expires_at"
    );
    advance(&store, 5_000);
    assert!(
        must(store.console_session(&token).await, "lookup").is_none(),
        "run out at expires_at"
    );

    // Sign-out ends it, once.
    let Some((_, token)) = must(store.create_console_session(admin.id, TTL).await, "create") else {
        panic!("a live key gets a session");
    };
    assert!(must(store.end_console_session(&token).await, "end"));
    assert!(must(store.console_session(&token).await, "lookup").is_none());
    assert!(
        !must(store.end_console_session(&token).await, "end"),
        "an ended session ends once"
    );

    // Revoking the key stops its sessions at once; it gets no new one.
    let Some((_, token)) = must(store.create_console_session(admin.id, TTL).await, "create") else {
        panic!("a live key gets a session");
    };
    let Some((_, other_token)) = must(store.create_console_session(client.id, TTL).await, "create")
    else {
        panic!("a live key gets a session");
    };
    must(store.revoke_api_key(admin.id).await, "revoke");
    assert!(must(store.console_session(&token).await, "lookup").is_none());
    assert!(
        must(store.create_console_session(admin.id, TTL).await, "create").is_none(),
        "a revoked key gets no session"
    );
    assert!(
        must(
            store.create_console_session(Uuid::new_v4(), TTL).await,
            "create"
        )
        .is_none(),
        "an unknown key gets no session"
    );
    assert!(
        must(store.console_session(&other_token).await, "lookup").is_some(),
        "another key's session goes on"
    );
}

fn ids(tasks: &[Task]) -> Vec<Uuid> {
    tasks.iter().map(|t| t.id).collect()
}

fn counted(o: &crate::ops::Overview, operation: &str, state: TaskState) -> i64 {
    o.counts
        .iter()
        .find(|c| c.operation == operation && c.state == state)
        .map_or(0, |c| c.count)
}

/// The overview of a tenant counts its tasks by class and state and lists
/// those that need a person: `reconciling` unchanged past the threshold (by
/// the store's clock), `failed` within the window, cancellation requested;
/// another tenant's tasks and ungranted classes never appear.
pub async fn console_overview_counts_and_lists_the_tenants_tasks(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let other = Ctx::new(&store, "other").await;
    // acme: a running safe task with its cancellation requested, two queued
    // safe tasks, a failed payment, a reconciling payment.
    let cancelling = c.create(SAFE, &contract(SAFE)).await;
    c.claim_one(SAFE, LONG_LEASE, cancelling.id).await;
    for _ in 0..2 {
        c.create(SAFE, &contract(SAFE)).await;
    }
    let failed_task = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, failed_task.id).await;
    c.report_ok(&a, failed(a.generation, FailureClass::InvalidInput))
        .await;
    let reconciling = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, reconciling.id).await;
    c.report_ok(&a, bare(a.generation, Outcome::Unknown)).await;
    let (_, cancellation) = c.cancel(cancelling.id).await;
    assert_eq!(cancellation.status, CancelStatus::Requested);
    // other: the same kinds of tasks, which acme never sees.
    let o_failed = other.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = other.claim_one(NON_SAFE, LONG_LEASE, o_failed.id).await;
    other
        .report_ok(&a, failed(a.generation, FailureClass::InvalidInput))
        .await;
    let o_rec = other.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = other.claim_one(NON_SAFE, LONG_LEASE, o_rec.id).await;
    other
        .report_ok(&a, bare(a.generation, Outcome::Unknown))
        .await;

    let o = must(store.task_overview("acme", QUERY).await, "overview");
    assert_eq!(counted(&o, SAFE, TaskState::Running), 1);
    assert_eq!(counted(&o, SAFE, TaskState::Queued), 2);
    assert_eq!(counted(&o, NON_SAFE, TaskState::Failed), 1);
    assert_eq!(counted(&o, NON_SAFE, TaskState::Reconciling), 1);
    assert_eq!(
        o.counts.iter().map(|c| c.count).sum::<i64>(),
        5,
        "acme's five tasks, no other tenant's: {:?}",
        o.counts
    );
    assert!(o.counts.iter().all(|c| c.count > 0), "no empty pair");
    assert!(
        o.reconciling_long.is_empty(),
        "reconciling for less than the threshold"
    );
    assert_eq!(ids(&o.failed_recent), vec![failed_task.id]);
    assert_eq!(ids(&o.cancel_requested), vec![cancelling.id]);

    // Past the reconciling threshold (the store's clock): listed.
    advance(&store, 16 * 60_000);
    let o = must(store.task_overview("acme", QUERY).await, "overview");
    assert_eq!(ids(&o.reconciling_long), vec![reconciling.id]);
    assert_eq!(ids(&o.failed_recent), vec![failed_task.id]);
    let theirs = must(store.task_overview("other", QUERY).await, "overview");
    assert_eq!(ids(&theirs.reconciling_long), vec![o_rec.id]);
    assert_eq!(ids(&theirs.failed_recent), vec![o_failed.id]);
    assert!(theirs.cancel_requested.is_empty());
    assert_eq!(theirs.counts.iter().map(|c| c.count).sum::<i64>(), 2);

    // A key granted the safe class only sees that class.
    let safe_only = store.granted(Some(vec![SAFE.to_owned()]));
    let g = must(safe_only.task_overview("acme", QUERY).await, "overview");
    assert!(
        g.counts.iter().all(|c| c.operation == SAFE),
        "{:?}",
        g.counts
    );
    assert!(g.reconciling_long.is_empty() && g.failed_recent.is_empty());
    assert_eq!(ids(&g.cancel_requested), vec![cancelling.id]);

    // Past the failure window: no longer listed, still counted.
    advance(&store, 24 * 3_600_000);
    let o = must(store.task_overview("acme", QUERY).await, "overview");
    assert!(o.failed_recent.is_empty(), "failed more than a day ago");
    assert_eq!(counted(&o, NON_SAFE, TaskState::Failed), 1);
    // A list holds at most `limit` tasks.
    let one = OverviewQuery { limit: 1, ..QUERY };
    let o = must(store.task_overview("acme", one).await, "overview");
    assert_eq!(o.reconciling_long.len(), 1);
}

/// [`Store::now`] reads the clock the store decides leases by (the database
/// clock on PostgreSQL, with the test clock's offset): an attempt's lease has
/// not run out by it just after the claim, and has once the clock passed its
/// length; the console shows time left on a lease by it.
pub async fn store_now_is_the_clock_leases_run_out_by(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let task = c.create(SAFE, &contract(SAFE)).await;
    let attempt = c.claim_one(SAFE, LONG_LEASE, task.id).await;
    let before = must(store.now().await, "now");
    assert!(
        before < attempt.lease_expires_at,
        "now {before:?} is past the lease just granted ({:?})",
        attempt.lease_expires_at
    );
    advance(&store, u64::try_from(LONG_LEASE).unwrap_or(0) + 1);
    let after = must(store.now().await, "now");
    assert!(
        after >= attempt.lease_expires_at,
        "now {after:?} has not reached the lease's end ({:?}) after its length passed",
        attempt.lease_expires_at
    );
    assert!(
        after.ms() - before.ms() < LONG_LEASE + 60_000,
        "the clock moved {} ms for a {LONG_LEASE} ms advance",
        after.ms() - before.ms()
    );
}

/// A tenant's queues count the tasks a claim could lease now (not one
/// holding a lease, not one not yet due) and give their waits from
/// `ready_at` by the store's clock: the longest, the median and the 99th
/// percentile (nearest rank); another tenant's tasks and ungranted classes
/// never appear; every tenant's depths are read together for the metrics.
pub async fn queues_count_waiting_tasks_and_their_waits(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let other = Ctx::new(&store, "other").await;
    let empty = must(store.task_queues("acme").await, "queues");
    assert!(empty.queues.is_empty(), "{:?}", empty.queues);
    // Four safe tasks, 1 s apart; the first is then leased.
    let mut safe = Vec::new();
    for _ in 0..4 {
        safe.push(c.create(SAFE, &contract(SAFE)).await);
        advance(&store, 1_000);
    }
    c.claim_one(SAFE, LONG_LEASE, safe[0].id).await;
    other.create(SAFE, &contract(SAFE)).await;
    let pay = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    advance(&store, 500);

    let q = must(store.task_queues("acme").await, "queues");
    // Waiting: safe[1..4] for 3.5 s, 2.5 s and 1.5 s; the payment for 0.5 s.
    let safe_q = q.queues.iter().find(|q| q.operation == SAFE);
    let Some(safe_q) = safe_q else {
        panic!("no {SAFE} queue: {:?}", q.queues);
    };
    // The store's clock is the moved test clock plus real time: each wait is
    // the moved time plus the test's own run time so far (well under 0.5 s).
    let about = |ms: i64, want: i64| (want..want + 500).contains(&ms);
    assert_eq!(safe_q.depth, 3, "the leased task is not waiting");
    assert!(about(safe_q.oldest_wait_ms, 3_500), "{safe_q:?}");
    assert!(about(safe_q.wait_p50_ms, 2_500), "{safe_q:?}");
    assert!(about(safe_q.wait_p99_ms, 3_500), "{safe_q:?}");
    let pay_q = q.queues.iter().find(|q| q.operation == NON_SAFE);
    assert_eq!(pay_q.map(|q| q.depth), Some(1));
    assert!(
        pay_q.is_some_and(|q| about(q.oldest_wait_ms, 500)),
        "{pay_q:?}"
    );
    assert_eq!(q.queues.len(), 2, "{:?}", q.queues);
    assert_eq!(pay.control.tenant, "acme");

    // The overview carries the same queues.
    let o = must(store.task_overview("acme", QUERY).await, "overview");
    let shape = |qs: &[crate::ops::QueueStat]| {
        qs.iter()
            .map(|q| (q.operation.clone(), q.depth))
            .collect::<Vec<_>>()
    };
    assert_eq!(shape(&o.queues), shape(&q.queues));
    // A key granted the safe class only sees that queue.
    let safe_only = store.granted(Some(vec![SAFE.to_owned()]));
    let g = must(safe_only.task_queues("acme").await, "queues");
    assert_eq!(g.queues.len(), 1);
    assert_eq!(g.queues[0].operation, SAFE);
    let theirs = must(store.task_queues("other").await, "queues");
    assert_eq!(
        theirs.queues.iter().map(|q| q.depth).collect::<Vec<_>>(),
        vec![1]
    );

    // Every tenant's depths, for the metrics.
    let (_, all) = must(store.all_queue_depths().await, "depths");
    let depth = |tenant: &str, op: &str| {
        all.iter()
            .find(|d| d.tenant == tenant && d.operation == op)
            .map(|d| d.depth)
    };
    assert_eq!(depth("acme", SAFE), Some(3));
    assert_eq!(depth("acme", NON_SAFE), Some(1));
    assert_eq!(depth("other", SAFE), Some(1));
}
