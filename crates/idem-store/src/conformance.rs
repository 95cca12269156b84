//! The store conformance suite (SPEC §2, §3, §4 "Details that tests rely on").
//!
//! Every storage backend must pass these cases unchanged. Each public `async fn`
//! checks one rule against a fresh, empty [`Store`] and **panics** (`assert!`)
//! when the store breaks it; panicking is the whole point of this module.
//!
//! A backend crate runs the suite with one line in an integration test:
//!
//! ```ignore
//! idem_store::store_conformance!(|| async { my_backend::open_temp().await });
//! ```
//!
//! The argument is a zero-argument closure (or function) returning a future of
//! [`Store`]; every call must give a new, empty, isolated store (a new temporary
//! file or a new database), because the cases run in parallel.
//!
//! Times come from the store's own clock (the process clock for SQLite, the
//! database clock for PostgreSQL). The cases therefore use short leases and
//! backoffs, sleep past them and call [`Store::sweep`]; they never assert on
//! wall-clock durations. Waiting loops give up after [`PATIENCE`].

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::config::{Backoff, Config, Contract};
use idem_core::fingerprint::canonical_request;
use idem_core::machine::{HeartbeatAck, Rejection, Report};
use idem_core::model::{
    ApiKey, Attempt, AttemptKind, AttemptState, CancelStatus, Cancellation, Event, FailureClass,
    Outcome, Role, Task, TaskState,
};
use serde_json::{Value, json};
use tokio::sync::Barrier;
use tokio::time::{Instant, sleep};
use uuid::Uuid;

use crate::ops::{ClaimRequest, Claimed, Submission, SubmitOutcome};
use crate::{Refusal, Store};

/// The non-safe operation class of the bundled configuration (unknown outcomes are reconciled).
pub const NON_SAFE: &str = "payment.release";
/// The safe operation class of the bundled configuration (transient failures are retried).
pub const SAFE: &str = "generation.dispatch";
/// How long a waiting loop polls before it declares the store stuck.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// A lease meant to run out during the test, ms.
const SHORT_LEASE: i64 = 150;
/// A lease meant to outlive the test, ms.
const LONG_LEASE: i64 = 120_000;
/// Sweep batch size.
const SWEEP: i64 = 100;

/// Expands to one `#[tokio::test]` per conformance case, each calling
/// `$crate::conformance::<case>` with a fresh store from `$make`.
///
/// `$make` is a zero-argument closure or function returning a future of
/// [`Store`](crate::Store); every call must give a new, empty, isolated store.
/// The calling crate needs `tokio` (features `rt-multi-thread`, `macros`).
#[macro_export]
macro_rules! store_conformance {
    ($make:expr) => {
        $crate::store_conformance!(@cases $make;
            submit_creates_then_exact_repeat_replays,
            submit_ignores_non_material_fields,
            different_fingerprint_conflicts_and_changes_nothing,
            same_request_under_changed_fingerprint_fields_replays,
            same_key_other_tenant_is_another_scope_and_invisible,
            same_key_other_operation_is_another_scope,
            concurrent_identical_submits_create_one_task,
            concurrent_conflicting_submits_create_one_task,
            revoked_key_submits_nothing,
            batch_answers_as_if_submitted_one_after_another,
            first_event_records_acceptance_decision,
            claim_leases_first_attempt_with_params,
            claim_respects_tenant_operations_and_max,
            claim_takes_oldest_ready_first_across_classes,
            succeeded_report_delivers_once_with_charge,
            safe_lease_expiry_fences_old_generation,
            heartbeat_extends_lease,
            non_safe_lease_expiry_reconciles_then_not_committed_re_executes,
            non_safe_lease_expiry_reconciles_then_committed_delivers,
            unknown_report_reconciles_before_any_retry,
            failed_reconcile_leads_to_another_reconcile,
            reconcile_lease_expiry_leads_to_another_reconcile,
            transient_on_safe_class_retries_after_backoff,
            transient_on_non_safe_class_fails,
            invalid_input_and_permission_denied_never_retry,
            attempts_exhausted_fails_task,
            budget_exhausted_fails_task,
            deadline_exceeded_before_attempt_fails_task,
            a_backlog_past_its_deadline_does_not_hide_due_work,
            deadline_exceeded_after_transient_fails_task,
            revoked_key_fails_task_before_first_attempt,
            revoked_key_fails_task_before_retry,
            revoked_key_fails_task_before_re_execution_after_reconciliation,
            repeated_report_is_idempotent_and_different_report_refused,
            invalid_report_changes_nothing,
            concurrent_claimers_never_share_a_lease,
            concurrent_reports_apply_exactly_one,
            cancel_queued_confirms_at_once,
            cancel_running_confirms_on_cancelled_report,
            cancel_after_delivery_is_too_late,
            cancel_pending_then_succeeded_is_too_late,
            cancel_twice_returns_same_record,
            cancel_pending_safe_lease_expiry_confirms,
            cancel_pending_non_safe_lease_expiry_committed_delivers,
            cancel_pending_non_safe_lease_expiry_not_committed_cancels,
            cancel_pending_failed_report_confirms,
            cancel_races_claim_and_delivery,
            cancel_pending_expiry_races_succeeded_report,
            device_acknowledge_then_completion,
            retention_releases_terminal_key_only_after_expiry,
            retention_never_releases_non_terminal_key,
            usage_is_kept_across_attempts,
            events_are_gap_free_and_generations_increase,
        );
    };
    (@cases $make:expr; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::conformance::$case(($make)().await).await
            }
        )+
    };
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Unwraps a result, panicking with `what` and the error.
#[track_caller]
fn must<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: {e:?}"),
    }
}

/// Unwraps a store call that may also be refused: both layers must be `Ok`.
#[track_caller]
fn ok2<T>(r: crate::Result<Result<T, Refusal>>, what: &str) -> T {
    must(must(r, what), what)
}

/// The bundled configuration.
fn config() -> Config {
    must(Config::bundled(), "bundled configuration")
}

/// The bundled contract of `op`, shrunk for fast tests: backoff 50 ms ×2 ≤ 200 ms,
/// long default lease, and distinct non-zero fees so every fee path is visible.
pub fn contract(op: &str) -> Contract {
    let Some(mut c) = config().contract(op) else {
        panic!("bundled configuration has no class {op}");
    };
    c.retry.backoff = Backoff {
        initial_ms: 50,
        multiplier: 2.0,
        max_ms: 200,
    };
    c.lease.default_ms = LONG_LEASE;
    c.lease.max_ms = 2 * LONG_LEASE;
    c.fees.cancel_before_start = 3;
    c.fees.cancel_after_start_fixed = 10;
    c.fees.usage_unit_price = 2;
    c.fees.price = c.price;
    c
}

/// Params of test request `n` for `op`.
pub fn params(op: &str, n: u64) -> Value {
    if op == NON_SAFE {
        json!({"payee": format!("acct-{n}"), "amount": 1000 + n, "currency": "EUR", "memo": format!("invoice {n}")})
    } else {
        json!({"prompt": format!("a lighthouse, take {n}"), "steps": n})
    }
}

/// A submission of `params` under `key`, fingerprinted as the HTTP layer does
/// (the class's material pointers from the bundled configuration).
pub fn submission(
    tenant: &str,
    operation: &str,
    key: &str,
    params: Value,
    contract: Contract,
    api_key: &ApiKey,
) -> Submission {
    let config = config();
    let Some(class) = config.operations.get(operation) else {
        panic!("bundled configuration has no class {operation}");
    };
    let canonical = must(
        canonical_request(operation, &params, &class.fingerprint),
        "canonical request",
    );
    Submission {
        tenant: tenant.to_owned(),
        operation: operation.to_owned(),
        idempotency_key: key.to_owned(),
        fingerprint: canonical.fingerprint.to_string(),
        canonical_request: canonical.canonical,
        params,
        contract,
        api_key_id: api_key.id,
        grant: api_key.operations.clone(),
    }
}

/// A report builder that keeps the raw body in step with the fields.
#[derive(Debug, Clone)]
struct R {
    generation: i64,
    outcome: Outcome,
    result: Option<Value>,
    class: Option<FailureClass>,
    usage: Option<i64>,
    txn: Option<String>,
}

fn rep(generation: i64, outcome: Outcome) -> R {
    R {
        generation,
        outcome,
        result: None,
        class: None,
        usage: None,
        txn: None,
    }
}

impl R {
    fn result(mut self, v: Value) -> R {
        self.result = Some(v);
        self
    }
    fn class(mut self, c: FailureClass) -> R {
        self.class = Some(c);
        self
    }
    fn usage(mut self, u: i64) -> R {
        self.usage = Some(u);
        self
    }
    fn txn(mut self, t: &str) -> R {
        self.txn = Some(t.to_owned());
        self
    }
    fn build(self) -> Report {
        let message = self.class.map(|c| format!("executor says {c}"));
        let mut body = serde_json::Map::new();
        body.insert("generation".into(), json!(self.generation));
        body.insert("outcome".into(), json!(self.outcome.as_str()));
        if let Some(v) = &self.result {
            body.insert("result".into(), v.clone());
        }
        if let Some(c) = self.class {
            body.insert("failure_class".into(), json!(c.as_str()));
        }
        if let Some(m) = &message {
            body.insert("message".into(), json!(m));
        }
        if let Some(u) = self.usage {
            body.insert("usage".into(), json!(u));
        }
        if let Some(t) = &self.txn {
            body.insert("external_txn_id".into(), json!(t));
        }
        Report {
            generation: self.generation,
            outcome: self.outcome,
            result: self.result,
            failure_class: self.class,
            message,
            usage: self.usage,
            external_txn_id: self.txn,
            body: Value::Object(body),
        }
    }
}

/// `succeeded` with a small result document.
fn succeeded(generation: i64) -> Report {
    rep(generation, Outcome::Succeeded)
        .result(json!({"ok": true}))
        .build()
}

/// `failed` with `class`.
fn failed(generation: i64, class: FailureClass) -> Report {
    rep(generation, Outcome::Failed).class(class).build()
}

/// A bare report of `outcome`.
fn bare(generation: i64, outcome: Outcome) -> Report {
    rep(generation, outcome).build()
}

/// The API form of a task (control fields left out), for "unchanged" comparisons.
fn api(t: &Task) -> Value {
    must(serde_json::to_value(t), "serialize task")
}

fn kinds(events: &[Event]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

fn count(events: &[Event], kind: &str) -> usize {
    events.iter().filter(|e| e.kind == kind).count()
}

fn dispositions(a: &Attempt) -> Vec<&str> {
    a.evidence.iter().map(|e| e.disposition.as_str()).collect()
}

#[track_caller]
fn assert_stale<T: std::fmt::Debug>(r: crate::Result<Result<T, Refusal>>, what: &str) {
    let r = must(r, what);
    assert!(
        matches!(r, Err(Refusal::Machine(Rejection::StaleGeneration { .. }))),
        "{what}: expected StaleGeneration, got {r:?}"
    );
}

#[track_caller]
fn assert_not_found<T: std::fmt::Debug>(r: crate::Result<Result<T, Refusal>>, what: &str) {
    let r = must(r, what);
    assert!(
        matches!(r, Err(Refusal::NotFound)),
        "{what}: expected NotFound, got {r:?}"
    );
}

#[track_caller]
fn assert_failed(t: &Task, class: FailureClass) {
    assert_eq!(
        t.state,
        TaskState::Failed,
        "task should have failed {class}: {t:?}"
    );
    assert_eq!(
        t.failure.as_ref().map(|f| f.class),
        Some(class),
        "failure class: {:?}",
        t.failure
    );
    assert!(t.delivery.is_none(), "a failed task has no delivery");
}

/// One tenant with one client API key, acting on one store.
#[derive(Debug, Clone)]
struct Ctx {
    store: Store,
    tenant: String,
    key: ApiKey,
}

impl Ctx {
    async fn new(store: &Store, tenant: &str) -> Ctx {
        let (key, _plain) = must(
            store.create_api_key(tenant, Role::Client, None).await,
            "create_api_key",
        );
        Ctx {
            store: store.clone(),
            tenant: tenant.to_owned(),
            key,
        }
    }

    fn submission(&self, op: &str, key: &str, params: Value, contract: &Contract) -> Submission {
        submission(&self.tenant, op, key, params, contract.clone(), &self.key)
    }

    async fn submit(&self, s: Submission) -> SubmitOutcome {
        must(self.store.submit(s).await, "submit")
    }

    /// Submits a new task under a fresh key; it must be created.
    async fn create(&self, op: &str, contract: &Contract) -> Task {
        let key = format!("key-{}", Uuid::new_v4());
        let s = self.submission(op, &key, params(op, 7), contract);
        match self.submit(s).await {
            SubmitOutcome::Created(t) => t,
            other => panic!("a fresh key must create a task, got {other:?}"),
        }
    }

    async fn task(&self, id: Uuid) -> Task {
        ok2(
            self.store.get_task(Some(&self.tenant), id).await,
            "get_task",
        )
    }

    async fn attempts(&self, id: Uuid) -> Vec<Attempt> {
        ok2(
            self.store.list_attempts(Some(&self.tenant), id).await,
            "list_attempts",
        )
    }

    async fn events(&self, id: Uuid) -> Vec<Event> {
        ok2(
            self.store.list_events(Some(&self.tenant), id).await,
            "list_events",
        )
    }

    async fn claim(&self, ops: &[&str], lease_ms: Option<i64>, max: i64) -> Vec<Claimed> {
        let req = ClaimRequest {
            tenant: self.tenant.clone(),
            operations: ops.iter().map(|o| (*o).to_owned()).collect(),
            executor_id: format!("executor-{}", self.tenant),
            max,
            lease_ms,
        };
        must(self.store.claim(req).await, "claim")
    }

    /// Claims now; exactly one attempt of `task` must come back.
    async fn claim_one(&self, op: &str, lease_ms: i64, task: Uuid) -> Attempt {
        let mut got = self.claim(&[op], Some(lease_ms), 1).await;
        assert_eq!(
            got.len(),
            1,
            "expected one claimable attempt of {task}, got {got:?}"
        );
        let c = got.remove(0);
        assert_eq!(c.attempt.task_id, task, "claimed the wrong task");
        assert_eq!(c.task.id, task, "claim returned the wrong task");
        c.attempt
    }

    /// Sweeps and claims until an attempt of `task` comes back (after a backoff).
    async fn claim_due(&self, op: &str, lease_ms: i64, task: Uuid) -> Attempt {
        let until = Instant::now() + PATIENCE;
        loop {
            must(self.store.sweep(SWEEP).await, "sweep");
            let mut got = self.claim(&[op], Some(lease_ms), 1).await;
            if let Some(c) = got.pop() {
                assert!(got.is_empty(), "claim with max 1 returned more");
                assert_eq!(c.attempt.task_id, task, "claimed the wrong task");
                return c.attempt;
            }
            let t = self.task(task).await;
            assert!(
                Instant::now() < until,
                "task {task} never became claimable; it is {:?}",
                t.state
            );
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Nothing is claimable, even after a sweep.
    async fn assert_nothing_claimable(&self, op: &str) {
        must(self.store.sweep(SWEEP).await, "sweep");
        let got = self.claim(&[op], Some(LONG_LEASE), 10).await;
        assert!(got.is_empty(), "nothing should be claimable, got {got:?}");
    }

    async fn report(&self, a: &Attempt, r: Report) -> crate::Result<Result<Task, Refusal>> {
        self.store.report(&self.tenant, a.id, r).await
    }

    /// The task's next attempt (generation 3) is another reconcile, never an
    /// execute (SPEC §2.5).
    async fn reconcile_again(&self, op: &str, task: Uuid) -> Attempt {
        let r = self.claim_due(op, LONG_LEASE, task).await;
        assert_eq!(
            r.kind,
            AttemptKind::Reconcile,
            "{op}: another reconcile, never execute"
        );
        assert_eq!(r.generation, 3);
        r
    }

    /// Reconcile attempt `r` reports `committed`: the task was executed once
    /// only, and its history is complete.
    async fn commit_after_one_execute(&self, r: &Attempt, task: Uuid) {
        self.report_ok(
            r,
            rep(r.generation, Outcome::Committed)
                .result(json!({}))
                .build(),
        )
        .await;
        let executes = self
            .attempts(task)
            .await
            .iter()
            .filter(|a| a.kind == AttemptKind::Execute)
            .count();
        assert_eq!(executes, 1);
        assert_history(&self.store, task).await;
    }

    async fn report_ok(&self, a: &Attempt, r: Report) -> Task {
        let what = format!(
            "report {} on attempt {} (gen {})",
            r.outcome, a.number, a.generation
        );
        ok2(self.report(a, r).await, &what)
    }

    async fn heartbeat(
        &self,
        a: &Attempt,
        generation: i64,
        usage: Option<i64>,
    ) -> crate::Result<Result<HeartbeatAck, Refusal>> {
        self.store
            .heartbeat(&self.tenant, a.id, generation, usage)
            .await
    }

    async fn cancel(&self, id: Uuid) -> (Task, Cancellation) {
        ok2(self.store.cancel(&self.tenant, id).await, "cancel")
    }

    /// Sweeps until `pred` holds for the task (lease expiry, wake-ups happen in the background).
    async fn wait_until(&self, id: Uuid, what: &str, pred: impl Fn(&Task) -> bool) -> Task {
        let until = Instant::now() + PATIENCE;
        loop {
            must(self.store.sweep(SWEEP).await, "sweep");
            let t = self.task(id).await;
            if pred(&t) {
                return t;
            }
            assert!(
                Instant::now() < until,
                "timed out waiting for {what}; task {id} is {:?}",
                t.state
            );
            sleep(Duration::from_millis(25)).await;
        }
    }
}

/// Checks the audit and fencing invariants every task must satisfy at any time
/// (SPEC §2.4, §2.6, §2.10, §4 details): events numbered 1..n without gaps and
/// starting with `task_submitted`; attempts numbered 1..n with strictly
/// increasing generations; at most one active lease, none once terminal;
/// `task.generation` equals the newest attempt's, or more after a confirmed
/// cancellation; usage is the sum of the attempts'; delivery, failure and
/// cancellation agree with the state.
async fn assert_history(store: &Store, id: Uuid) {
    let task = ok2(store.get_task(None, id).await, "get_task");
    let events = ok2(store.list_events(None, id).await, "list_events");
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            e.seq,
            i as i64 + 1,
            "event seq must be 1..n gap-free: {:?}",
            events.iter().map(|e| (e.seq, &e.kind)).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        events.first().map(|e| e.kind.as_str()),
        Some("task_submitted"),
        "first event"
    );
    let attempts = ok2(store.list_attempts(None, id).await, "list_attempts");
    assert_eq!(
        task.attempt_count,
        attempts.len() as i64,
        "attempt_count vs attempts listed"
    );
    let mut last = 0;
    for (i, a) in attempts.iter().enumerate() {
        assert_eq!(a.task_id, id, "attempt of another task listed");
        assert_eq!(
            a.number,
            i as i64 + 1,
            "attempt numbers must be 1..n in order"
        );
        assert!(
            a.generation > last,
            "attempt generations must strictly increase: {:?}",
            attempts.iter().map(|a| a.generation).collect::<Vec<_>>()
        );
        last = a.generation;
    }
    let ids: HashSet<Uuid> = attempts.iter().map(|a| a.id).collect();
    assert_eq!(ids.len(), attempts.len(), "attempt ids must be unique");
    let active = attempts.iter().filter(|a| a.state.is_active()).count();
    assert!(
        active <= 1,
        "a task never has two active leases: {attempts:?}"
    );
    if task.state.is_terminal() {
        assert_eq!(
            active, 0,
            "a terminal task has no active lease: {attempts:?}"
        );
    }
    let confirmed = task
        .cancellation
        .as_ref()
        .is_some_and(|c| c.status == CancelStatus::Confirmed);
    if confirmed {
        assert!(
            task.generation > last,
            "a confirmed cancellation raises the generation above every attempt's ({} vs {last})",
            task.generation
        );
    } else {
        assert_eq!(
            task.generation, last,
            "task.generation equals its newest attempt's"
        );
    }
    assert_eq!(
        task.usage,
        attempts.iter().map(|a| a.usage).sum::<i64>(),
        "task usage is the sum of its attempts' usage"
    );
    assert!(task.usage >= 0);
    match task.state {
        TaskState::Succeeded => {
            let Some(d) = &task.delivery else {
                panic!("a succeeded task has a delivery: {task:?}");
            };
            assert_eq!(
                d.charge, task.contract.price,
                "delivery.charge == contract.price"
            );
            assert!(task.failure.is_none());
            assert_eq!(count(&events, "delivered"), 1, "delivered exactly once");
        }
        TaskState::Failed => {
            assert!(task.failure.is_some(), "a failed task says why");
            assert!(task.delivery.is_none());
        }
        TaskState::Cancelled => {
            assert!(confirmed, "a cancelled task has a confirmed cancellation");
            assert!(task.delivery.is_none());
        }
        _ => {
            assert!(task.delivery.is_none() && task.failure.is_none());
        }
    }
    if !matches!(task.state, TaskState::Succeeded) {
        assert_eq!(
            count(&events, "delivered"),
            0,
            "no delivery event without delivery"
        );
    }
}

#[track_caller]
fn created(o: SubmitOutcome) -> Task {
    match o {
        SubmitOutcome::Created(t) => t,
        other => panic!("expected Created, got {other:?}"),
    }
}

#[track_caller]
fn replayed(o: SubmitOutcome) -> Task {
    match o {
        SubmitOutcome::Replayed(t) => t,
        other => panic!("expected Replayed, got {other:?}"),
    }
}

#[track_caller]
fn joined<T>(r: Result<T, tokio::task::JoinError>) -> T {
    must(r, "spawned task panicked")
}

// ---------------------------------------------------------------------------
// Scope: one task per scope, replay, conflict (SPEC §2.1–2.3)
// ---------------------------------------------------------------------------

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
        assert_eq!(t.contract, contract, "the contract is frozen as submitted");
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
                SubmitOutcome::Conflict { task_id } => {
                    assert_eq!(task_id, t.id, "the conflict names the original task");
                }
                other => panic!("expected Conflict, got {other:?}"),
            }
        }
        let after = c.task(t.id).await;
        assert_eq!(api(&after), api(&t), "the original task is unchanged");
        assert_eq!(
            after.contract, contract,
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
        SubmitOutcome::Conflict { task_id } => assert_eq!(task_id, t.id),
        o => panic!("expected Conflict, got {o:?}"),
    }
    assert_history(&store, t.id).await;

    // A task accepted before the fields were frozen in contracts is compared
    // by its whole canonical params (RFC 8785: 1000 and 1000.0 are one number).
    let mut legacy = contract.clone();
    legacy.fingerprint = None;
    let key = "fields-changed-legacy";
    let p = json!({"payee": "a", "amount": 1000, "currency": "EUR"});
    let s1 = c.submission(NON_SAFE, key, p, &legacy);
    let t = created(c.submit(s1.clone()).await);
    let mut again = c.submission(
        NON_SAFE,
        key,
        json!({"currency": "EUR", "amount": 1000.0, "payee": "a"}),
        &legacy,
    );
    again.fingerprint = format!("{}-other-fields", s1.fingerprint);
    assert_eq!(replayed(c.submit(again).await).id, t.id);
    let mut other = c.submission(
        NON_SAFE,
        key,
        json!({"payee": "a", "amount": 1000, "currency": "EUR", "memo": "m"}),
        &legacy,
    );
    other.fingerprint = format!("{}-other-fields", s1.fingerprint);
    match c.submit(other).await {
        SubmitOutcome::Conflict { task_id } => assert_eq!(task_id, t.id),
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
                SubmitOutcome::Conflict { task_id } => {
                    assert_eq!(*task_id, winner.id, "the conflict names the winner");
                    assert_ne!(*fp, winner.fingerprint, "the winner's twin never conflicts");
                }
                SubmitOutcome::KeyRevoked { .. } => panic!("round {round}: the key is live"),
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
        SubmitOutcome::Conflict { task_id: c0 },
        SubmitOutcome::Created(new),
        SubmitOutcome::Replayed(r2),
        SubmitOutcome::Conflict { task_id: c3 },
        SubmitOutcome::Created(other_task),
        SubmitOutcome::Replayed(r5),
    ] = out.as_slice()
    else {
        panic!("a batch answers in request order, one after the other: {out:?}");
    };
    assert_eq!((*c0, r2.id), (old.id, old.id), "stored scope");
    assert_eq!(api(r2), api(&old), "a replay in a batch changes nothing");
    assert_eq!((*c3, r5.id), (new.id, new.id), "scope created in the batch");
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
    assert_eq!(first.kind, "task_submitted");
    assert_eq!(first.data["fingerprint"], json!(s.fingerprint));
    assert_eq!(first.data["canonical_request"], json!(s.canonical_request));
    assert_eq!(first.data["idempotency_key"], json!("audit-1"));
    assert_eq!(first.data["decision"]["api_key_id"], json!(c.key.id));
    assert_eq!(
        first.data["decision"]["config_version"],
        json!(contract.config_version)
    );
    assert_eq!(t.control.canonical_request, s.canonical_request);
    assert_eq!(
        c.task(t.id).await.control.canonical_request,
        s.canonical_request
    );
}

// ---------------------------------------------------------------------------
// Claims and reports
// ---------------------------------------------------------------------------

/// A claim leases attempt number 1, generation 1, kind `execute`, with the
/// task's params; while it is leased nothing more is claimable.
pub async fn claim_leases_first_attempt_with_params(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let mut got = c.claim(&[NON_SAFE], Some(5_000), 1).await;
    assert_eq!(got.len(), 1, "the queued task is claimable");
    let cl = got.remove(0);
    let a = &cl.attempt;
    assert_eq!(a.task_id, t.id);
    assert_eq!((a.number, a.generation), (1, 1));
    assert_eq!(a.kind, AttemptKind::Execute);
    assert_eq!(a.state, AttemptState::Leased);
    assert_eq!(a.executor_id, "executor-acme");
    assert_eq!(
        a.lease_expires_at.ms() - a.leased_at.ms(),
        5_000,
        "the lease asked for"
    );
    assert_eq!(a.usage, 0);
    assert_eq!(cl.task.id, t.id);
    assert_eq!(cl.task.params, t.params);
    assert_eq!(cl.task.operation, NON_SAFE);
    assert_eq!(cl.task.idempotency_key, t.idempotency_key);
    assert_eq!(cl.task.state, TaskState::Running);
    assert_eq!((cl.task.generation, cl.task.attempt_count), (1, 1));
    assert!(
        c.claim(&[NON_SAFE], None, 5).await.is_empty(),
        "a leased task is not claimable"
    );
    let listed = c.attempts(t.id).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, a.id);
    assert_eq!((listed[0].number, listed[0].generation), (1, 1));
    assert_eq!(listed[0].state, AttemptState::Leased);
    assert_eq!(listed[0].lease_expires_at, a.lease_expires_at);
    let stored = c.task(t.id).await;
    assert_eq!(
        api(&stored),
        api(&cl.task),
        "the claim's task is the stored task"
    );
    assert!(kinds(&c.events(t.id).await).contains(&"attempt_leased"));
    assert_history(&store, t.id).await;
}

/// Claims return only the claimer's tenant's tasks of the classes asked for,
/// at most `max`, each task once.
pub async fn claim_respects_tenant_operations_and_max(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let other = Ctx::new(&store, "globex").await;
    let mut safe_ids = BTreeSet::new();
    for _ in 0..5 {
        safe_ids.insert(c.create(SAFE, &contract(SAFE)).await.id);
    }
    let pay = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    assert!(
        other.claim(&[SAFE, NON_SAFE], None, 10).await.is_empty(),
        "other tenant claims nothing"
    );
    assert!(
        c.claim(&["inventory.reserve"], None, 10).await.is_empty(),
        "other classes claim nothing"
    );
    let got = c.claim(&[NON_SAFE], None, 10).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].task.id, pay.id);
    let mut seen = BTreeSet::new();
    for expect in [3, 2, 0] {
        let got = c.claim(&[SAFE], None, 3).await;
        assert_eq!(got.len(), expect, "max 3 out of what is left");
        for cl in got {
            assert!(safe_ids.contains(&cl.task.id));
            assert!(seen.insert(cl.task.id), "a task was claimed twice");
            assert_eq!(cl.attempt.generation, 1);
        }
    }
    assert_eq!(seen, safe_ids);
    for id in safe_ids.iter().chain([&pay.id]) {
        assert_history(&store, *id).await;
    }
}

/// A claim takes the oldest ready tasks first (`ready_at`, then id) across all
/// the classes it names, a class named twice counting once, and stops at its
/// max.
pub async fn claim_takes_oldest_ready_first_across_classes(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let op = if i % 2 == 0 { SAFE } else { NON_SAFE };
        tasks.push(c.create(op, &contract(op)).await);
    }
    tasks.sort_by_key(|t| (t.control.ready_at, t.id));
    let order: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
    let mut claimed = Vec::new();
    for expect in [3, 3, 2, 0] {
        let got = c.claim(&[NON_SAFE, SAFE, NON_SAFE], None, 3).await;
        assert_eq!(got.len(), expect, "max 3 out of what is left");
        let mut ids: Vec<Uuid> = got.iter().map(|cl| cl.task.id).collect();
        ids.sort_by_key(|id| order.iter().position(|o| o == id));
        claimed.extend(ids);
    }
    assert_eq!(claimed, order, "oldest ready first, each task once");
}

/// `succeeded` delivers: the task succeeds with a delivery whose charge is the
/// contract price and which keeps the external transaction id; acknowledging
/// the delivery twice returns the same record; a replay shows it (SPEC §2.6).
pub async fn succeeded_report_delivers_once_with_charge(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let s = c.submission(NON_SAFE, "pay-1", params(NON_SAFE, 1), &contract);
    let t = created(c.submit(s.clone()).await);
    let early = must(
        store.acknowledge_delivery("acme", t.id).await,
        "acknowledge_delivery",
    );
    assert!(
        matches!(early, Err(Refusal::Machine(Rejection::NotDelivered))),
        "nothing to acknowledge yet: {early:?}"
    );
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let r = rep(a.generation, Outcome::Succeeded)
        .result(json!({"receipt": "r-1"}))
        .usage(3)
        .txn("txn-42")
        .build();
    let done = c.report_ok(&a, r).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let Some(d) = done.delivery.clone() else {
        panic!("a succeeded task has a delivery");
    };
    assert_eq!(
        d.charge, contract.price,
        "delivery.charge == contract.price"
    );
    assert_eq!(d.result, json!({"receipt": "r-1"}));
    assert_eq!(d.external_txn_id.as_deref(), Some("txn-42"));
    assert!(d.acknowledged_at.is_none());
    assert_eq!(done.usage, 3);
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts[0].state, AttemptState::Succeeded);
    assert_eq!(attempts[0].external_txn_id.as_deref(), Some("txn-42"));
    assert_eq!(attempts[0].usage, 3);

    let ack1 = ok2(
        store.acknowledge_delivery("acme", t.id).await,
        "acknowledge_delivery",
    );
    let ack2 = ok2(
        store.acknowledge_delivery("acme", t.id).await,
        "acknowledge_delivery again",
    );
    let Some(d1) = ack1.delivery.clone() else {
        panic!("delivery lost");
    };
    assert!(d1.acknowledged_at.is_some());
    assert_eq!(
        ack2.delivery, ack1.delivery,
        "a second acknowledgment returns the same record"
    );
    assert_eq!(d1.charge, d.charge, "the charge never changes");
    assert_eq!(
        (d1.result.clone(), d1.delivered_at),
        (d.result.clone(), d.delivered_at)
    );
    let r = replayed(c.submit(s).await);
    assert_eq!(r.id, t.id);
    assert_eq!(r.state, TaskState::Succeeded);
    assert_eq!(
        r.delivery, ack1.delivery,
        "a replay shows the recorded delivery"
    );
    c.assert_nothing_claimable(NON_SAFE).await;
    assert_eq!(c.attempts(t.id).await.len(), 1, "no further attempt");
    assert_history(&store, t.id).await;
}

/// Safe class: an expired lease leads to attempt 2 with generation 2; attempt 1's
/// late report is refused as stale, kept as evidence, and changes nothing; its
/// heartbeat is stale too (SPEC §2.4, RETRY-01).
pub async fn safe_lease_expiry_fences_old_generation(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a1 = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
    sleep(Duration::from_millis(2 * SHORT_LEASE as u64)).await;
    let expired = c
        .wait_until(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert!(
        matches!(expired.state, TaskState::RetryWait | TaskState::Queued),
        "a safe class retries after an expired lease: {:?}",
        expired.state
    );
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Expired);
    assert_stale(
        c.heartbeat(&a1, 1, None).await,
        "heartbeat of an expired lease",
    );

    let a2 = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    assert_eq!((a2.number, a2.generation), (2, 2));
    assert_eq!(a2.kind, AttemptKind::Execute);
    assert_ne!(a2.id, a1.id, "every attempt has a new id");
    let before = c.task(t.id).await;
    let late = must(
        c.report(
            &a1,
            rep(1, Outcome::Succeeded)
                .result(json!({"late": true}))
                .usage(9)
                .build(),
        )
        .await,
        "late report",
    );
    assert_eq!(
        late,
        Err(Refusal::Machine(Rejection::StaleGeneration {
            presented: 1,
            current: 2
        })),
        "a report with an old generation is stale"
    );
    let after = c.task(t.id).await;
    assert_eq!(after.state, TaskState::Running);
    assert_eq!(
        (after.generation, after.attempt_count, after.usage),
        (before.generation, before.attempt_count, before.usage),
        "a stale report changes no task state"
    );
    assert!(after.delivery.is_none());
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts.len(), 2, "old attempts stay visible");
    assert_eq!(attempts[0].state, AttemptState::Expired);
    assert_eq!(attempts[0].usage, 0, "stale usage is evidence only");
    let ev = attempts[0]
        .evidence
        .iter()
        .find(|e| e.disposition == "stale_generation");
    let Some(ev) = ev else {
        panic!(
            "the late report is kept as evidence: {:?}",
            attempts[0].evidence
        );
    };
    assert_eq!(ev.generation, 1);
    assert_eq!(ev.outcome, "succeeded");
    assert_eq!(ev.body["result"], json!({"late": true}));
    assert_stale(
        c.heartbeat(&a1, 1, None).await,
        "heartbeat with generation 1",
    );
    assert_stale(
        c.heartbeat(&a2, 1, None).await,
        "heartbeat on attempt 2 with generation 1",
    );
    let hb = ok2(
        c.heartbeat(&a2, 2, None).await,
        "heartbeat of the live attempt",
    );
    assert!(!hb.cancel_requested);
    let done = c.report_ok(&a2, succeeded(2)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    assert_history(&store, t.id).await;
}

/// Heartbeats extend a lease past its original end; the attempt keeps its lease.
pub async fn heartbeat_extends_lease(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let lease = 1_000;
    let a = c.claim_one(SAFE, lease, t.id).await;
    let mut last = a.lease_expires_at;
    for i in 1..=6 {
        sleep(Duration::from_millis(250)).await;
        let hb = ok2(c.heartbeat(&a, a.generation, Some(i)).await, "heartbeat");
        assert!(hb.lease_expires_at > last, "a heartbeat extends the lease");
        last = hb.lease_expires_at;
        must(store.sweep(SWEEP).await, "sweep");
    }
    let listed = c.attempts(t.id).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].state,
        AttemptState::Leased,
        "a heartbeated lease does not expire"
    );
    assert_eq!(listed[0].lease_expires_at, last);
    assert_eq!(c.task(t.id).await.usage, 6, "heartbeat usage is recorded");
    let done = c.report_ok(&a, succeeded(a.generation)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    assert_history(&store, t.id).await;
}

/// Non-safe class: an expired lease moves the task to `reconciling`; the next
/// claim is a reconcile attempt; `not_committed` allows a new execute attempt
/// with a higher generation (SPEC §2.5).
pub async fn non_safe_lease_expiry_reconciles_then_not_committed_re_executes(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a1 = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    let rec = c
        .wait_until(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert_eq!(
        rec.state,
        TaskState::Reconciling,
        "an unknown outcome is reconciled"
    );
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Expired);
    let r2 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(
        r2.kind,
        AttemptKind::Reconcile,
        "no execute attempt before reconciliation"
    );
    assert_eq!((r2.number, r2.generation), (2, 2));
    assert_eq!(c.task(t.id).await.state, TaskState::Reconciling);
    let after = c
        .report_ok(&r2, bare(r2.generation, Outcome::NotCommitted))
        .await;
    assert!(
        !after.state.is_terminal() && after.state != TaskState::Reconciling,
        "not_committed allows a new execute attempt: {:?}",
        after.state
    );
    let a3 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(a3.kind, AttemptKind::Execute);
    assert_eq!(a3.number, 3);
    assert!(a3.generation > r2.generation);
    assert_stale(
        c.report(&a1, succeeded(1)).await,
        "late report of attempt 1",
    );
    let done = c.report_ok(&a3, succeeded(a3.generation)).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts[1].state, AttemptState::NotCommitted);
    assert_history(&store, t.id).await;
}

/// Non-safe class: after an expired lease, a reconcile attempt reporting
/// `committed` delivers the reconciled result; no further execute attempt.
pub async fn non_safe_lease_expiry_reconciles_then_committed_delivers(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let t = c.create(NON_SAFE, &contract).await;
    let _a1 = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    c.wait_until(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
        .await;
    let r2 = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r2.kind, AttemptKind::Reconcile);
    let report = rep(r2.generation, Outcome::Committed)
        .result(json!({"found": "payout p-9"}))
        .txn("bank-77")
        .build();
    let done = c.report_ok(&r2, report).await;
    assert_eq!(done.state, TaskState::Succeeded);
    let Some(d) = &done.delivery else {
        panic!("committed delivers");
    };
    assert_eq!(d.charge, contract.price);
    assert_eq!(d.result, json!({"found": "payout p-9"}));
    assert_eq!(d.external_txn_id.as_deref(), Some("bank-77"));
    c.assert_nothing_claimable(NON_SAFE).await;
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts.len(), 2);
    assert_eq!(
        attempts
            .iter()
            .filter(|a| a.kind == AttemptKind::Execute)
            .count(),
        1,
        "committed never leads to another execute attempt"
    );
    assert_eq!(attempts[1].state, AttemptState::Committed);
    assert_history(&store, t.id).await;
}

/// An executor reporting `unknown` moves the task to `reconciling` on both
/// classes; the next attempt is a reconcile attempt (SPEC §2.5).
pub async fn unknown_report_reconciles_before_any_retry(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let t = c.create(op, &contract(op)).await;
        let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
        let after = c
            .report_ok(&a1, bare(a1.generation, Outcome::Unknown))
            .await;
        assert_eq!(
            after.state,
            TaskState::Reconciling,
            "{op}: unknown → reconciling"
        );
        assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Unknown);
        let r2 = c.claim_due(op, LONG_LEASE, t.id).await;
        assert_eq!(
            r2.kind,
            AttemptKind::Reconcile,
            "{op}: reconcile before any retry"
        );
        assert_eq!(r2.generation, 2);
        c.report_ok(&r2, bare(r2.generation, Outcome::NotCommitted))
            .await;
        let a3 = c.claim_due(op, LONG_LEASE, t.id).await;
        assert_eq!(a3.kind, AttemptKind::Execute);
        c.report_ok(&a3, succeeded(a3.generation)).await;
        assert_history(&store, t.id).await;
    }
}

/// A reconcile attempt that fails `transient` leads to another reconcile
/// attempt, never to an execute attempt (SPEC §4 details).
pub async fn failed_reconcile_leads_to_another_reconcile(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [NON_SAFE, SAFE] {
        let t = c.create(op, &contract(op)).await;
        let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
        c.report_ok(&a1, bare(a1.generation, Outcome::Unknown))
            .await;
        let r2 = c.claim_due(op, LONG_LEASE, t.id).await;
        assert_eq!(r2.kind, AttemptKind::Reconcile);
        let after = c
            .report_ok(&r2, failed(r2.generation, FailureClass::Transient))
            .await;
        assert_eq!(
            after.state,
            TaskState::Reconciling,
            "{op}: still reconciling"
        );
        let r3 = c.reconcile_again(op, t.id).await;
        c.commit_after_one_execute(&r3, t.id).await;
    }
}

/// A reconcile attempt whose lease expires without a report leads to another
/// reconcile attempt, never to an execute attempt, on both classes (SPEC §2.5).
pub async fn reconcile_lease_expiry_leads_to_another_reconcile(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [NON_SAFE, SAFE] {
        let t = c.create(op, &contract(op)).await;
        let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
        c.report_ok(&a1, bare(a1.generation, Outcome::Unknown))
            .await;
        let r2 = c.claim_due(op, SHORT_LEASE, t.id).await;
        assert_eq!(r2.kind, AttemptKind::Reconcile);
        let until = Instant::now() + PATIENCE;
        loop {
            must(store.sweep(SWEEP).await, "sweep");
            if c.attempts(t.id).await[1].state == AttemptState::Expired {
                break;
            }
            assert!(
                Instant::now() < until,
                "{op}: the reconcile lease never expired"
            );
            sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(
            c.task(t.id).await.state,
            TaskState::Reconciling,
            "{op}: still reconciling"
        );
        let r3 = c.reconcile_again(op, t.id).await;
        assert_stale(
            c.report(&r2, bare(r2.generation, Outcome::NotCommitted))
                .await,
            "late reconcile report",
        );
        c.commit_after_one_execute(&r3, t.id).await;
    }
}

/// Safe class, `transient`: `retry_wait`, not claimable during the backoff,
/// woken to `queued` by the sweeper after it, then attempt 2 (SPEC §2.5).
pub async fn transient_on_safe_class_retries_after_backoff(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.backoff = Backoff {
        initial_ms: 1_000,
        multiplier: 2.0,
        max_ms: 1_000,
    };
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    let after = c
        .report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    assert_eq!(
        after.state,
        TaskState::RetryWait,
        "transient on a safe class backs off"
    );
    assert!(after.failure.is_none());
    assert!(
        c.claim(&[SAFE], None, 1).await.is_empty(),
        "not claimable during the backoff"
    );
    let woken = c
        .wait_until(t.id, "backoff wake-up", |t| t.state != TaskState::RetryWait)
        .await;
    assert_eq!(
        woken.state,
        TaskState::Queued,
        "the sweeper wakes the task to queued"
    );
    let a2 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    assert_eq!(
        (a2.number, a2.generation, a2.kind),
        (2, 2, AttemptKind::Execute)
    );
    c.report_ok(&a2, succeeded(a2.generation)).await;
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Failed);
    assert_history(&store, t.id).await;
}

/// Non-safe class, `transient`: the task fails with class `transient`, no retry.
pub async fn transient_on_non_safe_class_fails(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a1 = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let after = c
        .report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    assert_failed(&after, FailureClass::Transient);
    sleep(Duration::from_millis(300)).await;
    c.assert_nothing_claimable(NON_SAFE).await;
    assert_failed(&c.task(t.id).await, FailureClass::Transient);
    assert_eq!(c.attempts(t.id).await.len(), 1);
    assert_history(&store, t.id).await;
}

/// `invalid_input` and `permission_denied` are never retried, on either class.
pub async fn invalid_input_and_permission_denied_never_retry(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        for class in [FailureClass::InvalidInput, FailureClass::PermissionDenied] {
            let t = c.create(op, &contract(op)).await;
            let a1 = c.claim_one(op, LONG_LEASE, t.id).await;
            let after = c.report_ok(&a1, failed(a1.generation, class)).await;
            assert_failed(&after, class);
            sleep(Duration::from_millis(300)).await;
            c.assert_nothing_claimable(op).await;
            assert_failed(&c.task(t.id).await, class);
            assert_eq!(c.attempts(t.id).await.len(), 1, "{op}/{class}: no retry");
            assert_history(&store, t.id).await;
        }
    }
}

/// After `max_attempts` execute attempts fail transiently, the task fails
/// `attempts_exhausted`.
pub async fn attempts_exhausted_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.max_attempts = 2;
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    let a2 = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    let after = c
        .report_ok(&a2, failed(a2.generation, FailureClass::Transient))
        .await;
    assert_failed(&after, FailureClass::AttemptsExhausted);
    sleep(Duration::from_millis(300)).await;
    c.assert_nothing_claimable(SAFE).await;
    assert_eq!(c.attempts(t.id).await.len(), 2);
    assert_history(&store, t.id).await;
}

/// Usage beyond the usage budget stops retries: `budget_exhausted`.
pub async fn budget_exhausted_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.usage_budget = 10;
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    ok2(c.heartbeat(&a1, a1.generation, Some(4)).await, "heartbeat");
    let r = rep(a1.generation, Outcome::Failed)
        .class(FailureClass::Transient)
        .usage(11)
        .build();
    let after = c.report_ok(&a1, r).await;
    assert_failed(&after, FailureClass::BudgetExhausted);
    assert_eq!(after.usage, 11, "incurred usage is kept");
    sleep(Duration::from_millis(300)).await;
    c.assert_nothing_claimable(SAFE).await;
    assert_eq!(c.attempts(t.id).await.len(), 1);
    assert_history(&store, t.id).await;
}

/// No execute attempt starts after the deadline: the claim returns nothing and
/// the task fails `deadline_exceeded`.
pub async fn deadline_exceeded_before_attempt_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let mut contract = contract(op);
        contract.retry.deadline_ms = 1;
        let t = c.create(op, &contract).await;
        sleep(Duration::from_millis(50)).await;
        assert!(
            c.claim(&[op], None, 1).await.is_empty(),
            "{op}: no attempt after the deadline"
        );
        assert_failed(&c.task(t.id).await, FailureClass::DeadlineExceeded);
        assert!(c.attempts(t.id).await.is_empty());
        assert_history(&store, t.id).await;
    }
}

/// A backlog of queued tasks whose deadline passed does not make a claim come
/// back empty while a due task waits behind it: the claim ends them
/// (`deadline_exceeded`) and leases the due one (SPEC §4: an empty list means
/// nothing is due).
pub async fn a_backlog_past_its_deadline_does_not_hide_due_work(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut dead = contract(SAFE);
    dead.retry.deadline_ms = 1;
    let mut backlog = Vec::new();
    for _ in 0..40 {
        backlog.push(c.create(SAFE, &dead).await);
    }
    sleep(Duration::from_millis(50)).await;
    let due = c.create(SAFE, &contract(SAFE)).await;
    let claimed = c.claim(&[SAFE], None, 1).await;
    assert_eq!(
        claimed.len(),
        1,
        "the due task is leased by the first claim"
    );
    assert_eq!(claimed[0].task.id, due.id);
    for t in &backlog {
        assert_failed(&c.task(t.id).await, FailureClass::DeadlineExceeded);
    }
}

/// A transient failure after the deadline fails the task `deadline_exceeded`
/// instead of scheduling a retry.
pub async fn deadline_exceeded_after_transient_fails_task(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut contract = contract(SAFE);
    contract.retry.deadline_ms = 1_500;
    let t = c.create(SAFE, &contract).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    sleep(Duration::from_millis(1_700)).await;
    let after = c
        .report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    assert_failed(&after, FailureClass::DeadlineExceeded);
    c.assert_nothing_claimable(SAFE).await;
    assert_history(&store, t.id).await;
}

/// Revoking the submitting key before the first attempt: the claim returns
/// nothing and the task fails `permission_denied` (SPEC §2.8).
pub async fn revoked_key_fails_task_before_first_attempt(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let revoked = must(store.revoke_api_key(c.key.id).await, "revoke_api_key");
    assert!(
        revoked.is_some_and(|k| k.revoked_at.is_some()),
        "the key is revoked"
    );
    assert!(
        c.claim(&[NON_SAFE], None, 1).await.is_empty(),
        "no attempt with a revoked key"
    );
    assert_failed(&c.task(t.id).await, FailureClass::PermissionDenied);
    assert!(c.attempts(t.id).await.is_empty());
    assert_history(&store, t.id).await;
}

/// Revoking the submitting key while a retry is pending: the next claim
/// returns nothing and the task fails `permission_denied` (SPEC §2.8).
pub async fn revoked_key_fails_task_before_retry(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a1 = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a1, failed(a1.generation, FailureClass::Transient))
        .await;
    must(store.revoke_api_key(c.key.id).await, "revoke_api_key");
    sleep(Duration::from_millis(400)).await; // past the longest backoff (200 ms)
    must(store.sweep(SWEEP).await, "sweep");
    assert!(
        c.claim(&[SAFE], None, 1).await.is_empty(),
        "no retry with a revoked key"
    );
    assert_failed(&c.task(t.id).await, FailureClass::PermissionDenied);
    assert_eq!(c.attempts(t.id).await.len(), 1);
    assert_history(&store, t.id).await;
}

/// Revoking the submitting key while reconciling: re-execution after
/// `not_committed` is refused and the task fails `permission_denied`; no
/// execute attempt starts after the revocation (SPEC §2.8).
pub async fn revoked_key_fails_task_before_re_execution_after_reconciliation(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a1 = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    c.report_ok(&a1, bare(a1.generation, Outcome::Unknown))
        .await;
    must(store.revoke_api_key(c.key.id).await, "revoke_api_key");
    // Reconciling only asks the external system; a backend may run it or not.
    let mut got = c.claim(&[NON_SAFE], Some(LONG_LEASE), 1).await;
    if let Some(cl) = got.pop() {
        assert_eq!(
            cl.attempt.kind,
            AttemptKind::Reconcile,
            "no execute attempt before reconciliation"
        );
        c.report_ok(
            &cl.attempt,
            bare(cl.attempt.generation, Outcome::NotCommitted),
        )
        .await;
        assert!(
            c.claim(&[NON_SAFE], None, 1).await.is_empty(),
            "no re-execution with a revoked key"
        );
    }
    assert_failed(&c.task(t.id).await, FailureClass::PermissionDenied);
    let attempts = c.attempts(t.id).await;
    assert_eq!(
        attempts
            .iter()
            .filter(|a| a.kind == AttemptKind::Execute)
            .count(),
        1
    );
    assert_history(&store, t.id).await;
}

/// An exact repeat of an applied report answers Ok; a different outcome is
/// refused `AlreadyReported`; both are kept as evidence (SPEC §4 details).
pub async fn repeated_report_is_idempotent_and_different_report_refused(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a = c.claim_one(SAFE, LONG_LEASE, t.id).await;
    let r = rep(a.generation, Outcome::Succeeded)
        .result(json!({"image": "i-1"}))
        .usage(2)
        .build();
    let first = c.report_ok(&a, r.clone()).await;
    let again = c.report_ok(&a, r).await;
    assert_eq!(again.state, TaskState::Succeeded);
    assert_eq!(again.delivery, first.delivery, "a repeat changes nothing");
    let other = must(
        c.report(&a, failed(a.generation, FailureClass::InvalidInput))
            .await,
        "report",
    );
    match other {
        Err(Refusal::Machine(Rejection::AlreadyReported { existing })) => {
            assert_eq!(existing, "succeeded");
        }
        other => panic!("a different outcome is AlreadyReported, got {other:?}"),
    }
    let after = c.task(t.id).await;
    assert_eq!(after.state, TaskState::Succeeded);
    assert_eq!(after.delivery, first.delivery);
    assert!(after.failure.is_none());
    assert_eq!(after.usage, 2);
    let attempts = c.attempts(t.id).await;
    assert_eq!(attempts[0].state, AttemptState::Succeeded);
    assert_eq!(
        dispositions(&attempts[0]),
        ["applied", "repeat", "already_reported"]
    );
    let outcomes: Vec<&str> = attempts[0]
        .evidence
        .iter()
        .map(|e| e.outcome.as_str())
        .collect();
    assert_eq!(outcomes, ["succeeded", "succeeded", "failed"]);
    assert_history(&store, t.id).await;
}

/// A `failed` report without a failure class is refused and stores nothing.
pub async fn invalid_report_changes_nothing(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let before = c.task(t.id).await;
    let events = c.events(t.id).await;
    let res = must(
        c.report(&a, bare(a.generation, Outcome::Failed)).await,
        "report",
    );
    assert!(
        matches!(res, Err(Refusal::Machine(Rejection::InvalidReport(_)))),
        "failed without failure_class is invalid: {res:?}"
    );
    assert_eq!(api(&c.task(t.id).await), api(&before), "nothing changed");
    assert_eq!(c.events(t.id).await, events, "no event");
    let attempts = c.attempts(t.id).await;
    assert!(
        attempts[0].evidence.is_empty(),
        "an invalid report is not evidence"
    );
    assert_eq!(attempts[0].state, AttemptState::Leased);
    c.report_ok(&a, succeeded(a.generation)).await;
    assert_history(&store, t.id).await;
}

// ---------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------

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
                        existing,
                        winner.as_str(),
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
// Cancellation (SPEC §2.7, CANCEL-01)
// ---------------------------------------------------------------------------

/// A queued task is confirmed cancelled at once with the before-start fee; the
/// generation is raised and no claim ever returns it.
pub async fn cancel_queued_confirms_at_once(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let (task, cancel) = c.cancel(t.id).await;
        assert_eq!(
            cancel.status,
            CancelStatus::Confirmed,
            "{op}: queued → confirmed at once"
        );
        assert_eq!(cancel.fee, Some(contract.fees.cancel_before_start));
        assert!(cancel.confirmed_at.is_some());
        assert_eq!(task.state, TaskState::Cancelled);
        assert!(
            task.generation > t.generation,
            "a confirmed cancellation raises the generation"
        );
        assert_eq!(task.cancellation.as_ref(), Some(&cancel));
        let stored = c.task(t.id).await;
        assert_eq!(stored.state, TaskState::Cancelled);
        assert_eq!(stored.cancellation, Some(cancel));
        sleep(Duration::from_millis(100)).await;
        c.assert_nothing_claimable(op).await;
        assert!(c.attempts(t.id).await.is_empty());
        assert_history(&store, t.id).await;
    }
}

/// A running task: the cancel is `requested`, the heartbeat says so, and the
/// executor's `cancelled` report with usage confirms it with the after-start
/// fee; the generation is raised, so a later `succeeded` report is stale.
pub async fn cancel_running_confirms_on_cancelled_report(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let a = c.claim_one(op, LONG_LEASE, t.id).await;
        ok2(c.heartbeat(&a, a.generation, Some(2)).await, "heartbeat");
        let (task, cancel) = c.cancel(t.id).await;
        assert_eq!(
            cancel.status,
            CancelStatus::Requested,
            "{op}: running → requested"
        );
        assert_eq!(cancel.fee, None);
        assert_eq!(
            task.state,
            TaskState::Running,
            "a request does not stop execution"
        );
        let hb = ok2(c.heartbeat(&a, a.generation, None).await, "heartbeat");
        assert!(
            hb.cancel_requested,
            "the heartbeat tells the executor to stop"
        );
        let r = rep(a.generation, Outcome::Cancelled).usage(7).build();
        let done = c.report_ok(&a, r).await;
        assert_eq!(done.state, TaskState::Cancelled);
        let Some(conf) = done.cancellation.clone() else {
            panic!("cancellation record lost");
        };
        assert_eq!(conf.status, CancelStatus::Confirmed);
        assert_eq!(conf.requested_at, cancel.requested_at);
        let fee = contract.fees.cancel_after_start_fixed + 7 * contract.fees.usage_unit_price;
        assert_eq!(conf.fee, Some(fee), "{op}: fixed + usage × unit price");
        assert_eq!(done.usage, 7, "incurred usage is kept");
        assert!(
            done.generation > a.generation,
            "confirmation retires the attempt's authority"
        );
        assert_stale(
            c.report(&a, succeeded(a.generation)).await,
            "succeeded after confirmed cancel",
        );
        assert_stale(
            c.heartbeat(&a, a.generation, None).await,
            "heartbeat after confirmed cancel",
        );
        let after = c.task(t.id).await;
        assert_eq!(after.state, TaskState::Cancelled);
        assert!(after.delivery.is_none());
        assert_eq!(after.cancellation, Some(conf));
        assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Cancelled);
        c.assert_nothing_claimable(op).await;
        assert_history(&store, t.id).await;
    }
}

/// Cancel after delivery: `too_late`, fee = the delivery's charge, delivery unchanged.
pub async fn cancel_after_delivery_is_too_late(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let done = c.report_ok(&a, succeeded(a.generation)).await;
    let (task, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::TooLate);
    let charge = done.delivery.as_ref().map(|d| d.charge);
    assert_eq!(cancel.fee, charge, "too_late fee is the charge");
    assert_eq!(task.state, TaskState::Succeeded);
    assert_eq!(task.delivery, done.delivery, "the delivery is unchanged");
    assert_eq!(task.generation, done.generation);
    assert_history(&store, t.id).await;
}

/// Cancel requested, then the executor reports `succeeded`: delivery wins, the
/// cancellation is `too_late` with the charge as fee.
pub async fn cancel_pending_then_succeeded_is_too_late(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for op in [SAFE, NON_SAFE] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let a = c.claim_one(op, LONG_LEASE, t.id).await;
        let (_, cancel) = c.cancel(t.id).await;
        assert_eq!(cancel.status, CancelStatus::Requested);
        let done = c.report_ok(&a, succeeded(a.generation)).await;
        assert_eq!(done.state, TaskState::Succeeded);
        let Some(d) = &done.delivery else {
            panic!("delivered");
        };
        assert_eq!(d.charge, contract.price);
        let Some(cx) = &done.cancellation else {
            panic!("the cancellation record stays");
        };
        assert_eq!(cx.status, CancelStatus::TooLate, "{op}: delivery won");
        assert_eq!(cx.fee, Some(d.charge));
        let (_, again) = c.cancel(t.id).await;
        assert_eq!(&again, cx, "asking again returns the same record");
        assert_history(&store, t.id).await;
    }
}

/// Cancelling twice returns the same record (queued → confirmed, running →
/// requested, delivered → too_late).
pub async fn cancel_twice_returns_same_record(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    // Queued.
    let t1 = c.create(SAFE, &contract).await;
    let (_, first) = c.cancel(t1.id).await;
    let (task, second) = c.cancel(t1.id).await;
    assert_eq!(first, second);
    assert_eq!(task.state, TaskState::Cancelled);
    // Running.
    let t2 = c.create(SAFE, &contract).await;
    let a = c.claim_one(SAFE, LONG_LEASE, t2.id).await;
    let (_, first) = c.cancel(t2.id).await;
    let (task, second) = c.cancel(t2.id).await;
    assert_eq!(first, second);
    assert_eq!(first.status, CancelStatus::Requested);
    assert_eq!(task.state, TaskState::Running);
    assert_eq!(
        count(&c.events(t2.id).await, "cancel_requested"),
        1,
        "recorded once"
    );
    c.report_ok(&a, bare(a.generation, Outcome::Cancelled))
        .await;
    // Delivered.
    let t3 = c.create(SAFE, &contract).await;
    let a3 = c.claim_one(SAFE, LONG_LEASE, t3.id).await;
    c.report_ok(&a3, succeeded(a3.generation)).await;
    let (_, first) = c.cancel(t3.id).await;
    let (_, second) = c.cancel(t3.id).await;
    assert_eq!(first, second);
    assert_eq!(first.status, CancelStatus::TooLate);
    for id in [t1.id, t2.id, t3.id] {
        assert_history(&store, id).await;
    }
}

/// Pending cancel and the lease expires without a report, safe class: the
/// cancellation is confirmed, usage kept, generation raised.
pub async fn cancel_pending_safe_lease_expiry_confirms(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    let t = c.create(SAFE, &contract).await;
    let a = c.claim_one(SAFE, 400, t.id).await;
    ok2(
        c.heartbeat(&a, a.generation, Some(4)).await,
        "heartbeat with usage",
    );
    let (_, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::Requested);
    let done = c
        .wait_until(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert_eq!(
        done.state,
        TaskState::Cancelled,
        "safe class: expiry confirms the cancel"
    );
    let Some(cx) = &done.cancellation else {
        panic!("cancellation lost");
    };
    assert_eq!(cx.status, CancelStatus::Confirmed);
    assert_eq!(cx.fee, Some(contract.fees.after_start(4)));
    assert_eq!(done.usage, 4);
    assert!(done.generation > a.generation);
    assert_eq!(c.attempts(t.id).await[0].state, AttemptState::Expired);
    assert_stale(c.report(&a, succeeded(a.generation)).await, "late report");
    c.assert_nothing_claimable(SAFE).await;
    assert_history(&store, t.id).await;
}

/// Pending cancel and the lease expires, non-safe class: reconcile first; a
/// `committed` reconciliation delivers and the cancellation is `too_late`.
pub async fn cancel_pending_non_safe_lease_expiry_committed_delivers(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let t = c.create(NON_SAFE, &contract).await;
    let _a = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    let (_, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::Requested);
    let rec = c
        .wait_until(t.id, "lease expiry", |t| t.state != TaskState::Running)
        .await;
    assert_eq!(
        rec.state,
        TaskState::Reconciling,
        "non-safe: reconcile before confirming"
    );
    assert!(
        rec.cancel_pending(),
        "the cancel stays pending while reconciling"
    );
    let r = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r.kind, AttemptKind::Reconcile);
    let done = c
        .report_ok(
            &r,
            rep(r.generation, Outcome::Committed)
                .result(json!({"paid": true}))
                .build(),
        )
        .await;
    assert_eq!(
        done.state,
        TaskState::Succeeded,
        "delivery wins when the effect was committed"
    );
    let Some(cx) = &done.cancellation else {
        panic!("cancellation lost");
    };
    assert_eq!(cx.status, CancelStatus::TooLate);
    assert_eq!(cx.fee, Some(contract.price));
    assert_eq!(
        done.delivery.as_ref().map(|d| d.charge),
        Some(contract.price)
    );
    assert_history(&store, t.id).await;
}

/// Pending cancel and the lease expires, non-safe class: a `not_committed`
/// reconciliation confirms the cancellation; nothing is executed again.
pub async fn cancel_pending_non_safe_lease_expiry_not_committed_cancels(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(NON_SAFE);
    let t = c.create(NON_SAFE, &contract).await;
    let _a = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    let (_, cancel) = c.cancel(t.id).await;
    assert_eq!(cancel.status, CancelStatus::Requested);
    c.wait_until(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
        .await;
    let r = c.claim_due(NON_SAFE, LONG_LEASE, t.id).await;
    assert_eq!(r.kind, AttemptKind::Reconcile);
    let done = c
        .report_ok(&r, bare(r.generation, Outcome::NotCommitted))
        .await;
    assert_eq!(done.state, TaskState::Cancelled);
    let Some(cx) = &done.cancellation else {
        panic!("cancellation lost");
    };
    assert_eq!(cx.status, CancelStatus::Confirmed);
    assert_eq!(cx.fee, Some(contract.fees.after_start(done.usage)));
    assert!(done.generation > r.generation);
    c.assert_nothing_claimable(NON_SAFE).await;
    let attempts = c.attempts(t.id).await;
    assert_eq!(
        attempts
            .iter()
            .filter(|a| a.kind == AttemptKind::Execute)
            .count(),
        1
    );
    assert_history(&store, t.id).await;
}

/// A `failed` report (any class) while a cancellation is pending confirms the
/// cancellation; no retry (SPEC §4 details).
pub async fn cancel_pending_failed_report_confirms(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    for (op, class) in [
        (SAFE, FailureClass::Transient),
        (NON_SAFE, FailureClass::Transient),
        (SAFE, FailureClass::InvalidInput),
        (NON_SAFE, FailureClass::PermissionDenied),
    ] {
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let a = c.claim_one(op, LONG_LEASE, t.id).await;
        c.cancel(t.id).await;
        let r = rep(a.generation, Outcome::Failed)
            .class(class)
            .usage(1)
            .build();
        let done = c.report_ok(&a, r).await;
        assert_eq!(
            done.state,
            TaskState::Cancelled,
            "{op}/{class}: failed confirms the cancel"
        );
        let Some(cx) = &done.cancellation else {
            panic!("cancellation lost");
        };
        assert_eq!(cx.status, CancelStatus::Confirmed);
        assert_eq!(cx.fee, Some(contract.fees.after_start(1)));
        sleep(Duration::from_millis(300)).await;
        c.assert_nothing_claimable(op).await;
        assert_eq!(c.attempts(t.id).await.len(), 1);
        assert_history(&store, t.id).await;
    }
}

/// 100 rounds of a cancel racing a claim followed by a `succeeded` report on a
/// queued task: exactly one wins. Either the task is cancelled (confirmed, before-start
/// fee, no attempt, no delivery), or it succeeded (charged once; the cancellation
/// is `too_late` with the charge as fee).
pub async fn cancel_races_claim_and_delivery(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let mut wins = (0, 0);
    for round in 0..200_u32 {
        let op = if round % 2 == 0 { SAFE } else { NON_SAFE };
        let contract = contract(op);
        let t = c.create(op, &contract).await;
        let barrier = Arc::new(Barrier::new(2));
        let canceller = {
            let (c, barrier) = (c.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                c.cancel(t.id).await
            })
        };
        let worker = {
            let (c, barrier) = (c.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut got = c.claim(&[op], Some(LONG_LEASE), 1).await;
                match got.pop() {
                    Some(cl) => {
                        assert_eq!(cl.attempt.task_id, t.id);
                        let r = c
                            .report(&cl.attempt, succeeded(cl.attempt.generation))
                            .await;
                        Some(must(r, "report"))
                    }
                    None => None,
                }
            })
        };
        let (_, cancel) = joined(canceller.await);
        let reported = joined(worker.await);
        let task = c.task(t.id).await;
        match task.state {
            TaskState::Cancelled => {
                wins.0 += 1;
                assert!(
                    reported.is_none(),
                    "round {round}: a cancelled queued task is never claimed"
                );
                assert_eq!(cancel.status, CancelStatus::Confirmed);
                let Some(cx) = &task.cancellation else {
                    panic!("round {round}: cancellation lost");
                };
                assert_eq!(cx.status, CancelStatus::Confirmed);
                assert_eq!(cx.fee, Some(contract.fees.cancel_before_start));
                assert!(task.delivery.is_none());
                assert!(c.attempts(t.id).await.is_empty());
            }
            TaskState::Succeeded => {
                wins.1 += 1;
                match &reported {
                    Some(Ok(_)) => {}
                    other => panic!(
                        "round {round}: the claimed attempt must be able to deliver: {other:?}"
                    ),
                }
                assert!(
                    matches!(
                        cancel.status,
                        CancelStatus::Requested | CancelStatus::TooLate
                    ),
                    "round {round}: cancel answer {cancel:?}"
                );
                let Some(d) = &task.delivery else {
                    panic!("round {round}: delivery lost");
                };
                assert_eq!(d.charge, contract.price);
                let Some(cx) = &task.cancellation else {
                    panic!("round {round}: cancellation lost");
                };
                assert_eq!(cx.status, CancelStatus::TooLate);
                assert_eq!(cx.fee, Some(d.charge));
            }
            other => {
                panic!("round {round}: exactly one of cancel and delivery wins, task is {other:?}")
            }
        }
        assert_history(&store, t.id).await;
    }
    assert_eq!(wins.0 + wins.1, 200);
}

/// 50 rounds (safe class): a cancellation is pending and the lease runs out
/// while the executor's `succeeded` report races the expiry sweep. Exactly one
/// wins each round: `cancelled`/`confirmed` with no delivery (and the report
/// is refused as stale), or `succeeded` with the cancellation `too_late`.
pub async fn cancel_pending_expiry_races_succeeded_report(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let contract = contract(SAFE);
    let mut wins = (0, 0);
    for round in 0..50_u64 {
        let t = c.create(SAFE, &contract).await;
        let a = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
        let (_, cancel) = c.cancel(t.id).await;
        assert_eq!(cancel.status, CancelStatus::Requested, "round {round}");
        // Land around the lease end: some rounds before it, some after.
        let nap = u64::try_from(SHORT_LEASE).unwrap_or(150) - 20 + (round % 5) * 10;
        tokio::time::sleep(std::time::Duration::from_millis(nap)).await;
        let barrier = Arc::new(Barrier::new(2));
        let sweeper = {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.sweep(SWEEP).await
            })
        };
        let reporter = {
            let (c, barrier, a) = (c.clone(), barrier.clone(), a.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                c.report(&a, succeeded(a.generation)).await
            })
        };
        must(joined(sweeper.await), "sweep");
        let reported = must(joined(reporter.await), "report");
        let task = c
            .wait_until(t.id, "a winner", |t| t.state.is_terminal())
            .await;
        let Some(cx) = &task.cancellation else {
            panic!("round {round}: cancellation lost");
        };
        match task.state {
            TaskState::Cancelled => {
                wins.0 += 1;
                assert!(
                    task.delivery.is_none(),
                    "round {round}: cancelled and delivered"
                );
                assert!(
                    matches!(
                        reported,
                        Err(Refusal::Machine(Rejection::StaleGeneration { .. }))
                    ),
                    "round {round}: the losing report must be stale: {reported:?}"
                );
                assert_eq!(cx.status, CancelStatus::Confirmed);
                assert_eq!(cx.fee, Some(contract.fees.after_start(task.usage)));
                assert!(task.generation > a.generation);
            }
            TaskState::Succeeded => {
                wins.1 += 1;
                assert!(
                    reported.is_ok(),
                    "round {round}: delivery won, the report applied: {reported:?}"
                );
                let Some(d) = &task.delivery else {
                    panic!("round {round}: delivery lost");
                };
                assert_eq!(d.charge, contract.price);
                assert_eq!(cx.status, CancelStatus::TooLate);
                assert_eq!(cx.fee, Some(d.charge));
            }
            other => {
                panic!("round {round}: exactly one of cancel and delivery wins, task is {other:?}")
            }
        }
        assert_history(&store, t.id).await;
    }
    eprintln!("cancel wins {}, delivery wins {}", wins.0, wins.1);
    assert_eq!(wins.0 + wins.1, 50);
}

// ---------------------------------------------------------------------------
// Device acknowledgment, retention, usage, audit
// ---------------------------------------------------------------------------

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

/// A contract whose windows are tiny: retention 1.5 s = 0.5 s + 0.5 s + 0.5 s.
fn short_retention(op: &str) -> Contract {
    let mut c = contract(op);
    c.windows.request_retry_ms = 500;
    c.windows.reconciliation_ms = 500;
    c.retry.deadline_ms = 500;
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
    let until = Instant::now() + PATIENCE;
    loop {
        let stats = must(store.sweep(SWEEP).await, "sweep");
        let found = must(store.find_task("acme", SAFE, "retained").await, "find_task");
        match found {
            Ok(f) => {
                assert_eq!(f.id, t.id);
                assert_eq!(stats.keys_released, 0, "a released key is no longer found");
            }
            Err(Refusal::NotFound) => {
                assert_eq!(
                    stats.keys_released, 1,
                    "the sweep that removed the key says so"
                );
                break;
            }
            Err(e) => panic!("find_task: {e:?}"),
        }
        assert!(Instant::now() < until, "the key was never released");
        sleep(Duration::from_millis(50)).await;
    }
    let events = ok2(store.list_events(None, t.id).await, "list_events");
    let Some(released) = events.iter().find(|e| e.kind == "key_released") else {
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
    sleep(Duration::from_millis(
        2 * contract.windows.retention_ms as u64,
    ))
    .await;
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
    c.wait_until(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
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
