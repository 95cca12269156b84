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
//! file or a new database), because the cases run in parallel, opened with a
//! test clock ([`crate::Clock::test`]).
//!
//! Times come from the store's own clock (the process clock for SQLite, the
//! database clock for PostgreSQL, each plus the test clock's offset). A case
//! lets a lease, backoff, deadline or retention pass by moving that clock
//! forward ([`Store::clock`]) and calling [`Store::sweep`] or claiming, never
//! by sleeping; where it checks that something ends, it checks first that it
//! has not ended shortly before. Real time passes only where concurrency is
//! the point (claimers and sweeps racing each other); those waiting loops
//! give up after [`PATIENCE`]. No case asserts on wall-clock durations.
//!
//! This file holds the macro, the bundled fixtures and the helpers the cases
//! share ([`contract`], [`params`], [`submission`], a tenant context and the
//! history check every case ends with); the cases live in one submodule per
//! part of SPEC §2 (scope, claims, failures, concurrency, cancel, audit,
//! release, rewind, second effects, rate limits) and
//! of SPEC §4, "Live events" (feed), and are re-exported here, so each is `conformance::<case>`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::config::{Backoff, Config, Contract};
use idem_core::contract::FrozenContract;
use idem_core::fingerprint::canonical_request;
use idem_core::machine::{HeartbeatAck, Rejection, Report};
use idem_core::model::{
    ApiKey, Attempt, AttemptKind, AttemptState, CancelStatus, Cancellation, Disposition, Event,
    EventKind, EvidenceOutcome, FailureClass, Outcome, Role, Task, TaskState,
};
use idem_core::trace::TraceParent;
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

/// A lease a case lets run out by moving the clock, ms.
const SHORT_LEASE: i64 = 10_000;
/// How long before its end a lease that is about to run out is checked to be
/// still live, ms (longer than a case takes in real time between its claim
/// and that check).
const LEASE_MARGIN: i64 = 5_000;
/// The longest backoff of [`contract`], ms.
const LONGEST_BACKOFF: i64 = 4_000;
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
            traceparent_is_kept_claimed_and_not_fingerprinted,
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
            executor_key_is_checked_in_the_claim_and_report_transactions,
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
            release_is_fenced_by_generation_and_repeats_answer_again,
            release_is_refused_once_the_attempt_started,
            released_attempts_count_against_no_limit_and_are_never_reconciled,
            release_with_a_pending_cancellation_confirms_it,
            release_of_another_tenants_attempt_is_not_found,
            retention_releases_terminal_key_only_after_expiry,
            retention_never_releases_non_terminal_key,
            usage_is_kept_across_attempts,
            events_are_gap_free_and_generations_increase,
            search_is_tenant_scoped_and_pages_each_task_once,
            operator_retry_now_makes_a_backoff_claimable_at_once,
            operator_cancel_is_the_clients_with_actor_and_reason,
            operator_resolve_settles_a_reconciling_task,
            operator_redrive_grants_one_more_attempt,
            operator_resolve_races_a_reconcile_report,
            operator_redrive_races_a_late_report,
            feed_readers_never_skip_while_writers_commit_concurrently,
            feed_is_scoped_to_tenant_and_grant,
            committed_events_are_heard_with_tenant_class_and_task,
            feed_refuses_a_cursor_ahead_of_its_head,
            console_sessions_expire_end_and_follow_their_key,
            console_overview_counts_and_lists_the_tenants_tasks,
            queues_count_waiting_tasks_and_their_waits,
            store_now_is_the_clock_leases_run_out_by,
            rewind_moves_tasks_that_may_have_started_to_reconcile_first,
            concurrent_identity_checks_rewind_once,
            rewind_keeps_tenants_apart,
            stale_reports_of_other_ids_raise_one_second_effect_per_id,
            late_and_duplicate_reports_raise_second_effects,
            stale_success_on_a_task_cancelled_before_start_is_raised,
            operator_resolve_delivers_its_id_and_raises_earlier_reports,
            second_effect_acknowledgment_is_audited_and_idempotent,
            second_effect_acknowledgment_races_a_report,
            every_reported_id_finds_the_task_and_a_replay_shows_its_second_effects,
            rate_limited_submit_writes_nothing_and_keeps_the_key_free,
            rate_limits_in_a_batch_and_across_buckets,
            concurrent_submits_share_one_bucket,
            attempt_starts_are_throttled_per_class,
            concurrency_key_cap_holds_under_concurrent_claims,
            capped_tasks_wait_without_using_attempts,
            pool_keys_claim_only_the_tenants_they_serve,
            pool_claims_serve_tenants_in_weighted_turns,
            fairness_key_values_are_served_in_turn,
            priorities_order_claims_and_age,
            tasks_without_a_fairness_value_are_claimed_by_turns,
            a_capped_tenant_does_not_hide_the_other_tenants_of_a_pool,
            a_sweep_restores_missing_claim_queues,
            a_sweep_unparks_waiting_queues_past_idle_ones,
            pool_claims_strand_no_task_under_concurrent_writes_and_sweeps,
            a_long_fairness_value_is_queued_and_claimed,
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

mod audit;
mod cancel;
mod caps;
mod changes;
mod claims;
mod concurrency;
mod console;
mod corpus;
mod effects;
mod failures;
mod fairness;
mod feed;
mod operator;
mod rates;
mod release;
mod rewind;
mod scope;
mod search;
mod search_bench;

pub use audit::*;
pub use cancel::*;
pub use caps::*;
pub use changes::*;
pub use claims::*;
pub use concurrency::*;
pub use console::*;
pub use corpus::*;
pub use effects::*;
pub use failures::*;
pub use fairness::*;
pub use feed::*;
pub use operator::*;
pub use rates::*;
pub use release::*;
pub use rewind::*;
pub use scope::*;
pub use search::*;
pub use search_bench::*;

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

/// `v` as the JSON the store writes and the API serves.
#[track_caller]
fn json_of<T: serde::Serialize>(v: &T) -> Value {
    must(serde_json::to_value(v), "to JSON")
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

/// The bundled contract of `op`, shrunk for fast tests: backoff 1 s ×2 ≤ 4 s (cases
/// move the clock past it; a second of real time never ends one on a loaded machine),
/// long default lease, and distinct non-zero fees so every fee path is visible.
pub fn contract(op: &str) -> Contract {
    let Some(mut c) = config().contract(op) else {
        panic!("bundled configuration has no class {op}");
    };
    c.retry.backoff = Backoff {
        initial_ms: 1_000,
        multiplier: 2.0,
        max_ms: LONGEST_BACKOFF,
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
        contract: must(FrozenContract::new(contract), "frozen contract"),
        api_key_id: api_key.id,
        grant: api_key.operations.clone(),
        traceparent: None,
        rate_limits: Vec::new(),
        concurrency_key: None,
        priority: 3,
        fairness_key: None,
    }
}

/// A task of tenant `acme` whose one attempt reported `unknown`, as `(task
/// id, attempt id)`, after checking that its applied report, evidence and
/// events read back as the words written: the start of a backend's test of
/// stored words, which then writes rows directly.
pub async fn task_with_a_reported_attempt(store: &Store) -> (Uuid, Uuid) {
    let c = Ctx::new(store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let report = bare(a.generation, Outcome::Unknown);
    let body = report.body.clone();
    c.report_ok(&a, report).await;
    let read = c.attempts(t.id).await;
    let applied = read[0].report.clone().map(|r| (r.outcome, r.body));
    assert_eq!(applied, Some((Outcome::Unknown, body)));
    let evidence = &read[0].evidence[0];
    assert_eq!(
        (evidence.outcome, evidence.disposition),
        (EvidenceOutcome::Unknown, Disposition::Applied)
    );
    assert_eq!(c.events(t.id).await[0].kind, EventKind::TaskSubmitted);
    (t.id, a.id)
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
    events.iter().filter(|e| e.kind.as_str() == kind).count()
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
            flow: Default::default(),
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

    /// Moves the store's clock forward by `ms`.
    fn pass(&self, ms: i64) {
        self.store
            .clock()
            .advance(Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
    }

    /// Moves the clock past the longest backoff ([`LONGEST_BACKOFF`]), sweeps
    /// and claims: an attempt of `task` must come back.
    async fn claim_due(&self, op: &str, lease_ms: i64, task: Uuid) -> Attempt {
        self.pass(LONGEST_BACKOFF);
        must(self.store.sweep(SWEEP).await, "sweep");
        let mut got = self.claim(&[op], Some(lease_ms), 1).await;
        let Some(c) = got.pop() else {
            panic!(
                "task {task} is not claimable after its backoff; it is {:?}",
                self.task(task).await.state
            );
        };
        assert!(got.is_empty(), "claim with max 1 returned more");
        assert_eq!(c.attempt.task_id, task, "claimed the wrong task");
        c.attempt
    }

    /// Lets the [`SHORT_LEASE`] of `task`'s newest attempt, claimed just now,
    /// run out: with the clock [`LEASE_MARGIN`] short of its end a sweep
    /// leaves the attempt leased; once the clock passed its end a sweep
    /// expires it. Returns the task after that sweep, which must satisfy
    /// `pred` (`what` names it).
    async fn run_out_lease(&self, id: Uuid, what: &str, pred: impl Fn(&Task) -> bool) -> Task {
        self.pass(SHORT_LEASE - LEASE_MARGIN);
        must(self.store.sweep(SWEEP).await, "sweep");
        let attempts = self.attempts(id).await;
        assert_eq!(
            attempts.last().map(|a| a.state),
            Some(AttemptState::Leased),
            "a lease does not end before its time: {attempts:?}"
        );
        self.pass(LEASE_MARGIN + 1);
        let t = self.after_sweep(id, what, pred).await;
        let attempts = self.attempts(id).await;
        assert_eq!(
            attempts.last().map(|a| a.state),
            Some(AttemptState::Expired),
            "the lease ran out: {attempts:?}"
        );
        t
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

    /// Sweeps once; `pred` must then hold for the task (`what` names it).
    async fn after_sweep(&self, id: Uuid, what: &str, pred: impl Fn(&Task) -> bool) -> Task {
        must(self.store.sweep(SWEEP).await, "sweep");
        let t = self.task(id).await;
        assert!(
            pred(&t),
            "expected {what} after a sweep; task {id} is {t:?}"
        );
        t
    }
}

/// Checks the audit and fencing invariants every task must satisfy at any time
/// (SPEC §2.4, §2.6, §2.10, §4 details): events numbered 1..n without gaps and
/// starting with `task_submitted`; attempts numbered 1..n with strictly
/// increasing generations; at most one active lease, none once terminal;
/// `task.generation` equals the newest attempt's, or more after a confirmed
/// cancellation, an operator's resolve or redrive or a rewind; usage is the sum of the attempts'; delivery, failure and
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
    // An operator's resolve or redrive raises it too, until the next claim.
    // A store that went back in time raises it too (SPEC §2.11).
    let rewound = events
        .iter()
        .any(|e| e.data.reason() == Some(idem_core::machine::STORE_REWOUND));
    let raised =
        count(&events, "operator_resolved") + count(&events, "operator_redriven") > 0 || rewound;
    if confirmed {
        assert!(
            task.generation > last,
            "a confirmed cancellation raises the generation above every attempt's ({} vs {last})",
            task.generation
        );
    } else if raised {
        assert!(
            task.generation >= last,
            "an operator's action never lowers the generation ({} vs {last})",
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
