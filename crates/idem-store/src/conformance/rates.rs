//! Rate limits (SPEC §8.1): a new submit takes a token of each bucket it
//! carries or is refused with nothing written and its idempotency key still
//! free; replays and conflicts are never charged nor refused; a claim leases
//! no more of a class whose attempt-start bucket is empty. The buckets'
//! intervals are 100 s, so the real time a case takes refills nothing and the
//! test clock alone refills them.

use idem_core::flow::{RateLimit, class_scope, tenant_scope};

use super::*;
use crate::ops::ClaimFlow;

/// One token per 100 s.
const PER_S: f64 = 0.01;
/// The interval of [`PER_S`], ms.
const INTERVAL_MS: i64 = 100_000;

impl Ctx {
    /// A submission of `op` under `key` (params `n`) carrying `limits`.
    fn limited(&self, op: &str, key: &str, n: u64, limits: &[(String, RateLimit)]) -> Submission {
        let mut s = self.submission(op, key, params(op, n), &contract(op));
        s.rate_limits = limits.to_vec();
        s
    }
}

/// `outcome` is a refusal for a rate limit; its wait, ms.
#[track_caller]
fn refused(outcome: &SubmitOutcome) -> i64 {
    match outcome {
        SubmitOutcome::RateLimited { retry_after_ms } => *retry_after_ms,
        other => panic!("expected RateLimited, got {other:?}"),
    }
}

/// A submission over its tenant's limit is refused with the wait until a
/// token: no task, no scope row (the key is free), and once the clock has
/// moved by an interval the same submission creates its task. Replays and
/// conflicts of accepted keys are answered as usual with the bucket empty,
/// and take no token.
pub async fn rate_limited_submit_writes_nothing_and_keeps_the_key_free(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let limits = [(tenant_scope("acme"), RateLimit::new(PER_S, Some(2)))];
    let mut first = None;
    for key in ["k1", "k2"] {
        match c.submit(c.limited(NON_SAFE, key, 1, &limits)).await {
            SubmitOutcome::Created(t) => first = first.or(Some(t)),
            other => panic!("the burst admits two, got {other:?}"),
        }
    }
    let wait = refused(&c.submit(c.limited(NON_SAFE, "k3", 1, &limits)).await);
    assert!(
        wait > 0 && wait <= INTERVAL_MS,
        "the wait is at most one interval: {wait}"
    );
    assert!(
        matches!(
            must(store.find_task("acme", NON_SAFE, "k3").await, "find"),
            Err(Refusal::NotFound)
        ),
        "a refused submission binds no key"
    );
    for _ in 0..3 {
        assert!(matches!(
            c.submit(c.limited(NON_SAFE, "k1", 1, &limits)).await,
            SubmitOutcome::Replayed(_)
        ));
        assert!(matches!(
            c.submit(c.limited(NON_SAFE, "k2", 2, &limits)).await,
            SubmitOutcome::Conflict { .. }
        ));
    }
    // Replays and conflicts took nothing: the wait is unchanged but for
    // the real time passed.
    let again = refused(&c.submit(c.limited(NON_SAFE, "k3", 1, &limits)).await);
    assert!(again <= wait, "a replay took no token: {again} > {wait}");
    c.pass(INTERVAL_MS);
    match c.submit(c.limited(NON_SAFE, "k3", 1, &limits)).await {
        SubmitOutcome::Created(t) => assert_eq!(t.idempotency_key, "k3"),
        other => panic!("after an interval the refused key is accepted, got {other:?}"),
    }
    refused(&c.submit(c.limited(NON_SAFE, "k4", 1, &limits)).await);
    let other = Ctx::new(&store, "globex").await;
    let theirs = [(tenant_scope("globex"), RateLimit::new(PER_S, Some(1)))];
    assert!(
        matches!(
            other
                .submit(other.limited(NON_SAFE, "k4", 1, &theirs))
                .await,
            SubmitOutcome::Created(_)
        ),
        "another tenant's bucket is its own"
    );
    if let Some(t) = first {
        assert_history(&store, t.id).await;
    }
}

/// In a batch with the bucket empty, a new submission is refused and so is
/// a later one of the same scope, while a replay in between is answered; a
/// submission with two buckets takes both or neither.
pub async fn rate_limits_in_a_batch_and_across_buckets(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let tenant = (tenant_scope("acme"), RateLimit::new(PER_S, Some(3)));
    let class = (class_scope(NON_SAFE), RateLimit::new(PER_S, Some(1)));
    let both = [tenant.clone(), class.clone()];
    assert!(matches!(
        c.submit(c.limited(NON_SAFE, "a", 1, &both)).await,
        SubmitOutcome::Created(_)
    ));
    // The class bucket is empty: the tenant's token is not taken either.
    refused(&c.submit(c.limited(NON_SAFE, "b", 1, &both)).await);
    let out = must(
        store
            .submit_batch(vec![
                c.limited(NON_SAFE, "b", 1, &both),
                c.limited(NON_SAFE, "a", 1, &both),
                c.limited(NON_SAFE, "b", 1, &both),
                c.limited(SAFE, "s1", 1, std::slice::from_ref(&tenant)),
                c.limited(SAFE, "s2", 1, std::slice::from_ref(&tenant)),
                c.limited(SAFE, "s3", 1, std::slice::from_ref(&tenant)),
            ])
            .await,
        "batch",
    );
    refused(&out[0]);
    assert!(matches!(out[1], SubmitOutcome::Replayed(_)), "{:?}", out[1]);
    refused(&out[2]);
    // The tenant's burst of 3: `a` took one, the refused ones none.
    assert!(matches!(out[3], SubmitOutcome::Created(_)), "{:?}", out[3]);
    assert!(matches!(out[4], SubmitOutcome::Created(_)), "{:?}", out[4]);
    refused(&out[5]);
    assert!(matches!(
        must(store.find_task("acme", NON_SAFE, "b").await, "find"),
        Err(Refusal::NotFound)
    ));
}

/// Concurrent new submits share one bucket: with a burst of 4 and no
/// refill, exactly 4 of 16 create a task, whichever connection runs them.
pub async fn concurrent_submits_share_one_bucket(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let limits = [(tenant_scope("acme"), RateLimit::new(PER_S, Some(4)))];
    let mut handles = Vec::new();
    for i in 0..16u64 {
        let s = c.limited(SAFE, &format!("c{i}"), i, &limits);
        let store = store.clone();
        handles.push(tokio::spawn(async move { store.submit(s).await }));
    }
    let mut created = 0;
    for h in handles {
        match must(must(h.await, "join"), "submit") {
            SubmitOutcome::Created(_) => created += 1,
            SubmitOutcome::RateLimited { .. } => {}
            other => panic!("a new key is created or refused, got {other:?}"),
        }
    }
    assert_eq!(created, 4, "the burst, across connections");
}

/// A claim leases at most the class's attempt starts: with the bucket
/// empty the tasks stay queued with no attempt used, other classes are
/// leased, and once the clock has moved by an interval one more starts.
pub async fn attempt_starts_are_throttled_per_class(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(c.create(NON_SAFE, &contract(NON_SAFE)).await.id);
    }
    let safe = c.create(SAFE, &contract(SAFE)).await;
    let claim = |max: i64| {
        let req = ClaimRequest {
            tenant: "acme".into(),
            operations: vec![NON_SAFE.into(), SAFE.into()],
            executor_id: "executor-acme".into(),
            max,
            lease_ms: Some(LONG_LEASE),
            flow: ClaimFlow {
                starts_per_s: [(NON_SAFE.to_owned(), RateLimit::new(PER_S, Some(1)))].into(),
                ..ClaimFlow::default()
            },
        };
        let store = store.clone();
        async move { must(store.claim(req).await, "claim") }
    };
    let got = claim(10).await;
    let classes: Vec<&str> = got.iter().map(|g| g.task.operation.as_str()).collect();
    assert_eq!(
        classes.iter().filter(|o| **o == NON_SAFE).count(),
        1,
        "one start of the throttled class: {classes:?}"
    );
    assert!(classes.contains(&SAFE), "the other class is not throttled");
    assert!(claim(10).await.is_empty(), "the bucket is empty");
    let leased = got[0].task.id;
    for id in ids.iter().filter(|id| **id != leased) {
        let t = c.task(*id).await;
        assert_eq!(t.state, TaskState::Queued, "a throttled task stays queued");
        assert_eq!(t.attempt_count, 0, "and uses no attempt");
    }
    c.pass(INTERVAL_MS);
    let next = claim(10).await;
    assert_eq!(next.len(), 1, "one more start after an interval");
    assert_eq!(next[0].task.operation, NON_SAFE);
    assert_history(&store, safe.id).await;
}
