//! Concurrency caps (SPEC §8.2 "Concurrency caps"): a claim never leases
//! more attempts at once than a cap allows, whatever the concurrency, and a
//! task held back by a cap waits without using an attempt.

use super::*;
use crate::caps::{ClaimFlow, ClassCaps};

/// Events that end the lease of the attempt leased before them (the
/// transaction that writes one frees the attempt's slots).
const LEASE_ENDS: &[EventKind] = &[
    EventKind::CompletionObserved,
    EventKind::Delivered,
    EventKind::Reconciled,
    EventKind::AttemptFailed,
    EventKind::OutcomeUnknown,
    EventKind::AttemptCancelled,
    EventKind::LeaseExpired,
    EventKind::AttemptReleased,
    EventKind::TaskFailed,
    EventKind::CancelConfirmed,
];

/// A flow with `caps` for `op`.
fn flow(op: &str, caps: ClassCaps) -> ClaimFlow {
    ClaimFlow {
        classes: [(op.to_owned(), caps)].into(),
        ..ClaimFlow::default()
    }
}

fn key_cap(n: i64) -> ClassCaps {
    ClassCaps {
        concurrency_key_cap: Some(n),
        ..ClassCaps::default()
    }
}

impl Ctx {
    /// Submits a task of `op` under a fresh key with concurrency key `key`.
    async fn create_keyed(&self, op: &str, contract: &Contract, key: Option<&str>) -> Task {
        let mut s = self.submission(
            op,
            &format!("key-{}", Uuid::new_v4()),
            params(op, 7),
            contract,
        );
        s.concurrency_key = key.map(str::to_owned);
        match self.submit(s).await {
            SubmitOutcome::Created(t) => t,
            other => panic!("a fresh key must create a task, got {other:?}"),
        }
    }

    async fn claim_flow(&self, ops: &[&str], max: i64, flow: &ClaimFlow) -> Vec<Claimed> {
        let req = ClaimRequest {
            tenant: self.tenant.clone(),
            operations: ops.iter().map(|o| (*o).to_owned()).collect(),
            executor_id: format!("executor-{}", self.tenant),
            max,
            lease_ms: Some(SHORT_LEASE),
            flow: flow.clone(),
        };
        must(self.store.claim(req).await, "claim")
    }
}

/// The lease intervals `[start, end)` of a task's attempts from its events:
/// each `attempt_leased` and the first lease-ending event after it (`None`:
/// still leased).
fn lease_intervals(events: &[Event]) -> Vec<(i64, Option<i64>)> {
    let mut out = Vec::new();
    let mut open: Option<i64> = None;
    for e in events {
        if e.kind == EventKind::AttemptLeased {
            assert!(open.is_none(), "a lease began while another was open");
            open = Some(e.at.ms());
        } else if LEASE_ENDS.contains(&e.kind)
            && let Some(start) = open.take()
        {
            out.push((start, Some(e.at.ms())));
        }
    }
    if let Some(start) = open {
        out.push((start, None));
    }
    out
}

/// The most intervals open at one instant (an end at the instant a start
/// happens counts as before it: the slot was freed by then).
fn max_overlap(intervals: &[(i64, Option<i64>)]) -> usize {
    let mut points: Vec<(i64, i8)> = Vec::new();
    for (start, end) in intervals {
        points.push((*start, 1));
        if let Some(end) = end {
            points.push((*end, -1));
        }
    }
    points.sort_unstable();
    let (mut open, mut most) = (0_i64, 0_i64);
    for (_, d) in points {
        open += i64::from(d);
        most = most.max(open);
    }
    usize::try_from(most).unwrap_or(0)
}

/// 64 concurrent claimers, a cap of 2 per concurrency key over 4 key
/// values, 100 rounds. Each round: the claimers claim at once; then each
/// leased attempt, all at once, is reported `succeeded`, released,
/// cancelled (reported `cancelled`), or left to run out; then the test
/// clock moves past the leases and a sweep expires them. Checked two ways:
/// - from the stored rows: each attempt's lease interval (its
///   `attempt_leased` event to the event that ended it), the most open at
///   one instant per key is at most 2 (claims and lease ends run in
///   separate phases, so the database clock orders them);
/// - from the store while everything runs: a reader searching the running
///   tasks (one statement, one snapshot) never sees more than 2 of one key.
///
/// Some key reaches 2, so the cap was exercised.
pub async fn concurrency_key_cap_holds_under_concurrent_claims(store: Store) {
    const CLAIMERS: usize = 64;
    const KEYS: usize = 4;
    const CAP: usize = 2;
    const ROUNDS: usize = 100;
    let c = Ctx::new(&store, "acme-caps").await;
    let mut contract = contract(SAFE);
    contract.retry.backoff = Backoff {
        initial_ms: 0,
        multiplier: 1.0,
        max_ms: 0,
    };
    contract.retry.max_attempts = 1_000;
    contract.retry.deadline_ms = 1_000_000_000;
    let flow = Arc::new(flow(SAFE, key_cap(CAP as i64)));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let observer = {
        let (c, stop) = (c.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut reads, mut at_cap) = (0_usize, 0_usize);
            while !stop.load(Ordering::SeqCst) {
                let query = crate::ops::TaskQuery {
                    states: vec![TaskState::Running],
                    limit: 100,
                    ..crate::ops::TaskQuery::default()
                };
                let page = must(c.store.search_tasks(&c.tenant, query).await, "search");
                let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
                for t in &page.tasks {
                    if let Some(k) = &t.control.concurrency_key {
                        *per_key.entry(k.clone()).or_default() += 1;
                    }
                }
                let most = per_key.values().copied().max().unwrap_or(0);
                assert!(most <= CAP, "a snapshot shows {per_key:?} running");
                reads += 1;
                at_cap += usize::from(most == CAP);
                sleep(Duration::from_millis(1)).await;
            }
            (reads, at_cap)
        })
    };
    let mut tasks: Vec<(Uuid, usize)> = Vec::new();
    let mut leased_total = 0;
    for round in 0..ROUNDS {
        // Two more tasks per key value each round.
        for k in 0..KEYS * 2 {
            let key = k % KEYS;
            let t = c
                .create_keyed(SAFE, &contract, Some(&format!("payee-{key}")))
                .await;
            tasks.push((t.id, key));
        }
        let barrier = Arc::new(Barrier::new(CLAIMERS));
        let mut handles = Vec::new();
        for _ in 0..CLAIMERS {
            let (c, barrier, flow) = (c.clone(), barrier.clone(), flow.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                c.claim_flow(&[SAFE], 1, &flow).await
            }));
        }
        let mut leased = Vec::new();
        for h in handles {
            leased.extend(joined(h.await));
        }
        leased_total += leased.len();
        c.pass(1);
        let mut handles = Vec::new();
        for (n, cl) in leased.into_iter().enumerate() {
            let c = c.clone();
            handles.push(tokio::spawn(async move {
                let a = &cl.attempt;
                match (n + round) % 5 {
                    0 | 1 => {
                        c.report_ok(a, succeeded(a.generation)).await;
                    }
                    2 => {
                        ok2(
                            c.store.release(&c.tenant, a.id, a.generation).await,
                            "release",
                        );
                    }
                    3 => {
                        ok2(c.store.cancel(&c.tenant, a.task_id).await, "cancel");
                        c.report_ok(a, bare(a.generation, Outcome::Cancelled)).await;
                    }
                    // Left leased: its lease runs out below.
                    _ => {}
                }
            }));
        }
        for h in handles {
            joined(h.await);
        }
        // Leases left to run out end; their tasks wait again.
        c.pass(SHORT_LEASE + 1);
        must(store.sweep(1_000).await, "sweep");
        c.pass(1);
    }
    stop.store(true, Ordering::SeqCst);
    let (reads, at_cap) = joined(observer.await);
    assert!(leased_total > ROUNDS, "the claims leased {leased_total}");
    let mut per_key: Vec<Vec<(i64, Option<i64>)>> = vec![Vec::new(); KEYS];
    let mut attempts_seen = 0;
    for (id, key) in &tasks {
        let events = c.events(*id).await;
        let intervals = lease_intervals(&events);
        attempts_seen += intervals.len();
        assert_eq!(
            intervals.len(),
            c.attempts(*id).await.len(),
            "task {id}: one lease per attempt"
        );
        per_key[*key].extend(intervals);
    }
    assert_eq!(attempts_seen, leased_total, "every lease granted is stored");
    let most: Vec<usize> = per_key.iter().map(|i| max_overlap(i)).collect();
    println!(
        "caps: {ROUNDS} rounds, {CLAIMERS} claimers, {} tasks, {leased_total} leases, most leased at once per key {most:?} (cap {CAP}); {reads} snapshots, {at_cap} with a key at its cap",
        tasks.len()
    );
    assert!(
        most.iter().all(|&m| m <= CAP),
        "a key had more than {CAP} attempts leased at once: {most:?}"
    );
    assert!(
        most.contains(&CAP),
        "no key ever reached its cap ({most:?}): the test shows nothing"
    );
}

/// A task held back by a full cap waits `queued` with no attempt (its
/// attempt count stays 0) while the tasks behind it that no full cap holds
/// are leased; once the lease ends it is leased. A class whose cap is full
/// does not hide another class's tasks. A cap lowered below what is leased
/// grants nothing until enough leases end.
pub async fn capped_tasks_wait_without_using_attempts(store: Store) {
    let c = Ctx::new(&store, "acme-capped").await;
    let safe = contract(SAFE);
    let one = flow(SAFE, key_cap(1));
    let first = c.create_keyed(SAFE, &safe, Some("payee-1")).await;
    let waiting = c.create_keyed(SAFE, &safe, Some("payee-1")).await;
    let other = c.create_keyed(SAFE, &safe, Some("payee-2")).await;
    let keyless = c.create_keyed(SAFE, &safe, None).await;
    let got = c.claim_flow(&[SAFE], 1, &one).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].task.id, first.id, "oldest first");
    let a = got[0].attempt.clone();
    // `waiting` is older than `other` and `keyless`, but capped.
    let got = c.claim_flow(&[SAFE], 5, &one).await;
    let ids: BTreeSet<Uuid> = got.iter().map(|g| g.task.id).collect();
    assert_eq!(ids, BTreeSet::from([other.id, keyless.id]));
    for _ in 0..3 {
        assert!(c.claim_flow(&[SAFE], 5, &one).await.is_empty());
    }
    let t = c.task(waiting.id).await;
    assert_eq!(t.state, TaskState::Queued);
    assert_eq!(t.attempt_count, 0, "a capped task uses no attempt");
    assert!(c.attempts(waiting.id).await.is_empty());
    c.report_ok(&a, succeeded(a.generation)).await;
    let got = c.claim_flow(&[SAFE], 5, &one).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].task.id, waiting.id);
    assert_eq!(got[0].attempt.number, 1);
    for g in &got {
        c.report_ok(&g.attempt, succeeded(g.attempt.generation))
            .await;
    }

    // A full class cap takes the class out of the scan: the other class's
    // younger task is leased.
    let class_one = ClaimFlow {
        classes: [(
            SAFE.to_owned(),
            ClassCaps {
                cap: Some(1),
                ..ClassCaps::default()
            },
        )]
        .into(),
        ..ClaimFlow::default()
    };
    let s1 = c.create_keyed(SAFE, &safe, None).await;
    let s2 = c.create_keyed(SAFE, &safe, None).await;
    let n1 = c.create_keyed(NON_SAFE, &contract(NON_SAFE), None).await;
    let got = c.claim_flow(&[SAFE, NON_SAFE], 5, &class_one).await;
    let ids: BTreeSet<Uuid> = got.iter().map(|g| g.task.id).collect();
    assert_eq!(ids, BTreeSet::from([s1.id, n1.id]));
    assert_eq!(c.task(s2.id).await.attempt_count, 0);

    // The tenant's cap counts every class; lowered to 1 while 2 are leased
    // it grants nothing until both have ended.
    let tenant_two = ClaimFlow {
        tenant_caps: [("acme-capped".to_owned(), 2)].into(),
        classes: BTreeMap::new(),
        ..ClaimFlow::default()
    };
    let tenant_one = ClaimFlow {
        tenant_caps: [("acme-capped".to_owned(), 1)].into(),
        classes: BTreeMap::new(),
        ..ClaimFlow::default()
    };
    // s1 and n1 hold no tenant slot (leased without a tenant cap): end them.
    for g in &got {
        c.report_ok(&g.attempt, succeeded(g.attempt.generation))
            .await;
    }
    let s3 = c.create_keyed(SAFE, &safe, None).await;
    let got = c.claim_flow(&[SAFE], 5, &tenant_two).await;
    let ids: BTreeSet<Uuid> = got.iter().map(|g| g.task.id).collect();
    assert_eq!(ids, BTreeSet::from([s2.id, s3.id]));
    let s4 = c.create_keyed(SAFE, &safe, None).await;
    assert!(c.claim_flow(&[SAFE], 5, &tenant_one).await.is_empty());
    // Slot 0 (s2, the older) is what a cap of 1 grants; s3 holds slot 1.
    let held = |id: Uuid| {
        got.iter()
            .find(|g| g.task.id == id)
            .map(|g| g.attempt.clone())
            .unwrap_or_else(|| panic!("{id} was leased"))
    };
    let (a2, a3) = (held(s2.id), held(s3.id));
    c.report_ok(&a3, succeeded(a3.generation)).await;
    assert!(
        c.claim_flow(&[SAFE], 5, &tenant_one).await.is_empty(),
        "slot 0 is still held"
    );
    c.report_ok(&a2, succeeded(a2.generation)).await;
    let got = c.claim_flow(&[SAFE], 5, &tenant_one).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].task.id, s4.id);
    assert_eq!(c.task(s4.id).await.attempt_count, 1);
}
