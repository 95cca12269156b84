//! The plan is a function of the seed; the checker passes honest histories
//! (produced by idem's own state machine) and flags each kind of violation in
//! histories broken on purpose.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_core::machine::{self, Authority, Journal, NewTask, Report};
use idem_core::model::event::{AttemptReleased, Delivered, ReportApplied};
use idem_core::model::{self, EventData, EvidenceOutcome, Outcome, Timestamp};

use super::*;

#[test]
fn same_seed_same_plan_other_seed_other_plan() {
    let a = Plan::new(1, 3000, false);
    let b = Plan::new(1, 3000, false);
    assert_eq!(a, b);
    assert_eq!(a.fault_counts(), b.fault_counts());
    let c = Plan::new(2, 3000, false);
    assert_ne!(a, c);
    assert_ne!(a.fault_counts(), c.fault_counts());
    let pg = Plan::new(1, 3000, true);
    assert_eq!(pg, Plan::new(1, 3000, true));
    assert_eq!(pg.servers, 2);
    assert!(pg.fault_counts()["pg_terminate_backend"] >= 3);
    assert!(!a.fault_counts().contains_key("pg_terminate_backend"));
    // Every kind of fault is planned in a run of this size.
    let f = a.fault_counts();
    for kind in [
        "client_timeout",
        "changed_payload",
        "retry_same_key",
        "cancel",
        "executor_crash_before_effect",
        "executor_crash_after_effect",
        "outcome_unknown_after_effect",
        "outcome_unknown_without_effect",
        "transient_failure",
        "invalid_input_failure",
        "stale_late_report",
        "duplicate_report",
        "reconcile_crash",
        "reconcile_transient_failure",
        "reconcile_unknown",
        "reconcile_stale_late_report",
        "server_sigkill",
    ] {
        assert!(
            f.get(kind).copied().unwrap_or(0) > 0,
            "{kind} never planned"
        );
    }
    assert!(a.server_faults.windows(2).all(|w| w[0].0 <= w[1].0));
}

#[test]
fn the_chaos_configuration_is_valid() {
    let c = chaos_config().unwrap();
    for class in [Class::Payment, Class::Generation] {
        let contract = c.contract(class.operation()).unwrap();
        assert_eq!(contract.retry.safe, class.is_safe());
        assert!(contract.lease.max_ms >= i64::try_from(LEASE_MS).unwrap());
    }
}

#[test]
fn changed_requests_differ_in_material_fields_only_when_changed() {
    for class in [Class::Payment, Class::Generation] {
        let a = class.params(7, 0, 1);
        let b = class.params(7, 0, 2);
        let c = class.params(7, 3, 1);
        assert_eq!(class.material(&a), class.material(&b));
        assert_ne!(class.material(&a), class.material(&c));
    }
}

// ---------------------------------------------------------------------------
// Histories from the real state machine
// ---------------------------------------------------------------------------

const T0: Timestamp = Timestamp(1_700_000_000_000);

struct Sim {
    class: Class,
    task: model::Task,
    attempts: Vec<model::Attempt>,
    events: Vec<model::Event>,
    now: Timestamp,
}

/// Event data as the API serves it.
fn typed(data: EventData) -> Value {
    serde_json::to_value(data).unwrap()
}

fn convert<T: serde::de::DeserializeOwned>(v: &impl Serialize) -> T {
    serde_json::from_value(serde_json::to_value(v).unwrap()).unwrap()
}

impl Sim {
    fn new(class: Class, n: u128) -> Sim {
        let config = chaos_config().unwrap();
        let params = class.params(u32::try_from(n).unwrap(), 0, 0);
        let (task, j) = machine::accept(
            NewTask {
                id: Uuid::from_u128(n),
                tenant: "t".into(),
                operation: class.operation().into(),
                idempotency_key: format!("k{n}"),
                fingerprint: format!("sha256:{n:064x}"),
                canonical_request: "{}".into(),
                params,
                contract: idem_core::contract::FrozenContract::new(
                    config.contract(class.operation()).unwrap(),
                )
                .unwrap(),
                api_key_id: Uuid::from_u128(9),
                grant: None,
                traceparent: None,
                priority: 3,
                fairness_key: None,
            },
            T0,
        );
        Sim {
            class,
            task,
            attempts: Vec::new(),
            events: j.events,
            now: T0,
        }
    }

    fn tick(&mut self, ms: i64) {
        self.now = self.now.plus_ms(ms);
    }

    fn claim(&mut self) -> usize {
        let mut j = Journal::default();
        // A retry waits its backoff (after a transient failure or a
        // reconciliation that found nothing committed): let it pass.
        if self.task.state == idem_core::model::TaskState::RetryWait {
            self.now = self.now.max(self.task.control.ready_at);
            machine::wake(&mut self.task, &mut j, self.now);
        }
        let id = Uuid::from_u128(self.task.id.as_u128() * 1000 + self.attempts.len() as u128 + 1);
        let a = machine::claim(
            &mut self.task,
            &mut j,
            id,
            "ex",
            Some(800),
            Authority::Granted,
            self.now,
        )
        .unwrap()
        .unwrap();
        self.events.extend(j.events);
        self.attempts.push(a);
        self.attempts.len() - 1
    }

    fn report(
        &mut self,
        i: usize,
        generation: i64,
        outcome: Outcome,
        usage: i64,
        txn: Option<&str>,
    ) -> bool {
        self.tick(10);
        let failure_class = (outcome == Outcome::Failed).then_some(model::FailureClass::Transient);
        let r = Report {
            generation,
            outcome,
            result: txn.map(|t| json!({"txn": t})),
            failure_class,
            message: None,
            usage: Some(usage),
            external_txn_id: txn.map(str::to_owned),
            body: json!({"generation": generation, "outcome": outcome.as_str(), "usage": usage}),
        };
        let mut j = Journal::default();
        let ok =
            machine::report(&mut self.task, &mut self.attempts[i], &mut j, &r, self.now).is_ok();
        self.events.extend(j.events);
        ok
    }

    fn expire(&mut self, i: usize) {
        self.now = self.attempts[i].lease_expires_at;
        let mut j = Journal::default();
        machine::expire_lease(&mut self.task, &mut self.attempts[i], &mut j, self.now);
        self.events.extend(j.events);
    }

    fn release(&mut self, i: usize) {
        self.tick(5);
        let mut j = Journal::default();
        let g = self.attempts[i].generation;
        machine::release(&mut self.task, &mut self.attempts[i], &mut j, g, self.now).unwrap();
        self.events.extend(j.events);
    }

    fn cancel(&mut self) -> CancelStatus {
        self.tick(5);
        let mut j = Journal::default();
        let c = machine::cancel(&mut self.task, &mut j, self.now);
        self.events.extend(j.events);
        convert::<idem_client::Cancellation>(&c).status
    }

    fn wake(&mut self) {
        self.tick(1000);
        let mut j = Journal::default();
        machine::wake(&mut self.task, &mut j, self.now);
        self.events.extend(j.events);
    }

    fn record(&self) -> TaskRecord {
        TaskRecord {
            task: convert(&self.task),
            attempts: self.attempts.iter().map(convert).collect(),
            events: self.events.iter().map(convert).collect(),
        }
    }

    fn db(&self) -> DbTask {
        DbTask {
            id: self.task.id,
            operation: self.task.operation.clone(),
            idempotency_key: self.task.idempotency_key.clone(),
            state: self.task.state.as_str().to_owned(),
        }
    }

    fn effect(&self, attempt: usize, txn: &str) -> (Effect, EffectRequest) {
        (
            Effect {
                task_id: self.task.id,
                attempt_id: self.attempts[attempt].id,
                class: self.class,
                material: self.class.material(&self.task.params),
                txn: txn.into(),
            },
            EffectRequest {
                task_id: self.task.id,
                attempt_id: self.attempts[attempt].id,
                idempotency_key: self.task.idempotency_key.clone(),
                moved: true,
                in_lease: true,
            },
        )
    }

    /// The effect of an attempt the records do not hold.
    fn effect_placeholder(&self) -> (Effect, EffectRequest) {
        (
            Effect {
                task_id: self.task.id,
                attempt_id: Uuid::nil(),
                class: self.class,
                material: self.class.material(&self.task.params),
                txn: "pay-1".into(),
            },
            EffectRequest {
                task_id: self.task.id,
                attempt_id: Uuid::nil(),
                idempotency_key: self.task.idempotency_key.clone(),
                moved: true,
                in_lease: true,
            },
        )
    }

    fn created(&self) -> SubmitRecord {
        SubmitRecord {
            op: 0,
            class: self.class,
            key: self.task.idempotency_key.clone(),
            material: self.class.material(&self.task.params),
            answer: SubmitAnswer::Accepted {
                task_id: self.task.id,
                replayed: false,
                looked_up: false,
                material: self.class.material(&self.task.params),
                fingerprint: self.task.fingerprint.clone(),
                delivery: None,
            },
        }
    }
}

/// Honest histories of every path the run exercises, with a matching ledger and client log.
fn honest() -> CheckInput {
    let mut input = CheckInput::default();
    let add = |sim: &Sim, effects: Vec<(Effect, EffectRequest)>, input: &mut CheckInput| {
        input.tasks.push(sim.record());
        input.db_tasks.push(sim.db());
        input.submits.push(sim.created());
        for (e, r) in effects {
            input.effects.push(e);
            input.effect_requests.push(r);
        }
    };

    // A: paid and delivered.
    let mut a = Sim::new(Class::Payment, 1);
    let i = a.claim();
    assert!(a.report(i, 1, Outcome::Succeeded, 4, Some("pay-1")));
    let eff = a.effect(i, "pay-1");
    input.accepted_usage.insert(a.attempts[i].id, 4);
    add(&a, vec![eff], &mut input);

    // B: paid, crashed; the lease expires; reconciliation finds it committed.
    let mut b = Sim::new(Class::Payment, 2);
    let i = b.claim();
    let eff = b.effect(i, "pay-2");
    b.expire(i);
    let r = b.claim();
    assert!(b.report(r, 2, Outcome::Committed, 1, Some("pay-2")));
    add(&b, vec![eff], &mut input);

    // C: crashed before paying; not committed; a new execute attempt pays.
    let mut c = Sim::new(Class::Payment, 3);
    let i = c.claim();
    c.expire(i);
    let r = c.claim();
    assert!(c.report(r, 2, Outcome::NotCommitted, 1, None));
    let k = c.claim();
    assert!(c.report(k, 3, Outcome::Succeeded, 2, Some("pay-3")));
    let eff = c.effect(k, "pay-3");
    add(&c, vec![eff], &mut input);

    // D: cancelled while running; the executor obeys.
    let mut d = Sim::new(Class::Payment, 4);
    let i = d.claim();
    assert_eq!(d.cancel(), CancelStatus::Requested);
    assert!(d.report(i, 1, Outcome::Cancelled, 3, None));
    add(&d, vec![], &mut input);
    input.cancels.push(CancelRecord {
        task_id: d.task.id,
        status: CancelStatus::Requested,
    });

    // E: paid, stalled past the lease, its late report is refused; reconciled committed.
    let mut e = Sim::new(Class::Payment, 5);
    let i = e.claim();
    let eff = e.effect(i, "pay-5");
    e.tick(900);
    assert!(!e.report(i, 1, Outcome::Succeeded, 2, Some("pay-5")));
    let r = e.claim();
    assert!(e.report(r, 2, Outcome::Committed, 1, Some("pay-5")));
    add(&e, vec![eff], &mut input);
    input.suspects.push(SuspectReport {
        task_id: e.task.id,
        attempt_id: e.attempts[i].id,
        kind: SuspectKind::Late,
        accepted: false,
    });

    // F: a safe class fails transiently, backs off and succeeds.
    let mut f = Sim::new(Class::Generation, 6);
    let i = f.claim();
    assert!(f.report(i, 1, Outcome::Failed, 2, None));
    f.wake();
    let k = f.claim();
    assert!(f.report(k, 2, Outcome::Succeeded, 3, Some("gen-1")));
    let eff = f.effect(k, "gen-1");
    add(&f, vec![eff], &mut input);

    // G: cancelled while queued.
    let mut g = Sim::new(Class::Payment, 7);
    assert_eq!(g.cancel(), CancelStatus::Confirmed);
    add(&g, vec![], &mut input);
    input.cancels.push(CancelRecord {
        task_id: g.task.id,
        status: CancelStatus::Confirmed,
    });

    // H: unknown outcome after paying, then a cancel: delivery wins after reconciliation.
    let mut h = Sim::new(Class::Payment, 8);
    let i = h.claim();
    let eff = h.effect(i, "pay-8");
    assert!(h.report(i, 1, Outcome::Unknown, 2, None));
    assert_eq!(h.cancel(), CancelStatus::Requested);
    let r = h.claim();
    assert!(h.report(r, 2, Outcome::Committed, 1, Some("pay-8")));
    add(&h, vec![eff], &mut input);

    // I: released unstarted twice (a worker shutting down), then paid: no
    // reconciliation, no attempt limit used.
    let mut i_ = Sim::new(Class::Payment, 9);
    for _ in 0..3 {
        let k = i_.claim();
        i_.release(k);
    }
    let k = i_.claim();
    assert!(i_.report(k, 4, Outcome::Succeeded, 1, Some("pay-9")));
    let eff = i_.effect(k, "pay-9");
    add(&i_, vec![eff], &mut input);

    // J: cancelled while running; the attempt is released unstarted: the
    // before-start fee.
    let mut j_ = Sim::new(Class::Payment, 10);
    let k = j_.claim();
    assert_eq!(j_.cancel(), CancelStatus::Requested);
    j_.release(k);
    assert_eq!(j_.task.state, model::TaskState::Cancelled);
    add(&j_, vec![], &mut input);

    // A replay of A and a conflicting request under A's key.
    let mut replay = a.created();
    if let SubmitAnswer::Accepted {
        replayed, delivery, ..
    } = &mut replay.answer
    {
        *replayed = true;
        let d = a.record().task.delivery.unwrap();
        *delivery = Some(DeliverySeen {
            external_txn_id: d.external_txn_id,
            charge: d.charge,
            delivered_at: d.delivered_at,
        });
    }
    input.submits.push(replay);
    input.submits.push(SubmitRecord {
        op: 1,
        class: Class::Payment,
        key: "k1".into(),
        material: Class::Payment.material(&Class::Payment.params(1, 4, 0)),
        answer: SubmitAnswer::Conflict {
            task_id: Some(a.task.id),
        },
    });
    input
}

fn violations(input: &CheckInput, inv: Invariant) -> u64 {
    check(input)
        .into_iter()
        .find(|r| r.name == inv.name())
        .unwrap()
        .violations
}

fn task_mut(input: &mut CheckInput, n: u128) -> &mut TaskRecord {
    input
        .tasks
        .iter_mut()
        .find(|r| r.task.id == Uuid::from_u128(n))
        .unwrap()
}

#[test]
fn honest_histories_pass_every_invariant() {
    let results = check(&honest());
    for r in &results {
        assert!(r.checked > 0, "{} checked nothing", r.name);
        assert_eq!(r.violations, 0, "{}: {:?}", r.name, r.examples);
    }
}

#[test]
fn a_second_task_for_a_scope_is_caught() {
    let mut input = honest();
    input.db_tasks.push(DbTask {
        id: Uuid::from_u128(99),
        operation: "payment.release".into(),
        idempotency_key: "k1".into(),
        state: "queued".into(),
    });
    assert!(violations(&input, Invariant::OneScopeOneTask) > 0);

    let mut input = honest();
    let mut other = input.submits[0].clone();
    if let SubmitAnswer::Accepted { task_id, .. } = &mut other.answer {
        *task_id = Uuid::from_u128(99);
    }
    input.submits.push(other);
    assert!(violations(&input, Invariant::OneScopeOneTask) > 0);
}

#[test]
fn an_executed_conflict_is_caught() {
    // The provider paid a changed amount.
    let mut input = honest();
    input.effects[0].material["amount"] = json!(999_999);
    assert!(violations(&input, Invariant::ConflictExecutesNothing) > 0);
    // A changed request answered as a replay.
    let mut input = honest();
    let last = input.submits.len() - 1;
    input.submits[last].answer = input.submits[0].answer.clone();
    assert!(violations(&input, Invariant::ConflictExecutesNothing) > 0);
}

#[test]
fn a_state_change_from_an_old_generation_is_caught() {
    // What a build without fencing does: task E's late report (generation 1,
    // after its lease expired and reconciliation delivered) is applied.
    let mut input = honest();
    let rec = task_mut(&mut input, 5);
    let old = rec.attempts[0].clone();
    let n = rec.events.len() as i64;
    rec.events.push(Event {
        seq: n + 1,
        kind: "completion_observed".into(),
        at: "2026-01-01T00:00:00.000Z".into(),
        data: typed(EventData::CompletionObserved(ReportApplied {
            attempt_id: old.id,
            external_txn_id: None,
            failure_class: None,
            generation: 1,
            kind: model::AttemptKind::Execute,
            message: None,
            outcome: EvidenceOutcome::Succeeded,
            usage: 0,
        })),
    });
    rec.events.push(Event {
        seq: n + 2,
        kind: "delivered".into(),
        at: "2026-01-01T00:00:00.000Z".into(),
        data: typed(EventData::Delivered(Delivered {
            charge: 100,
            currency: Some(None),
            external_txn_id: None,
        })),
    });
    let ev = rec.attempts[0]
        .evidence
        .iter_mut()
        .find(|e| e.disposition.as_deref() == Some("stale_generation"))
        .unwrap();
    ev.disposition = Some("applied".into());
    rec.attempts[0].state = AttemptState::Succeeded;
    assert!(violations(&input, Invariant::Fencing) > 0);
    assert!(violations(&input, Invariant::OneDeliveryOneCharge) > 0);

    // The harness saw a late report accepted.
    let mut input = honest();
    input.suspects[0].accepted = true;
    assert!(violations(&input, Invariant::Fencing) > 0);
}

#[test]
fn a_release_counted_wrong_or_out_of_its_lease_is_caught() {
    // A released attempt counted as started: task J charged the after-start fee.
    let mut input = honest();
    let rec = task_mut(&mut input, 10);
    let fees = &rec.task.contract.fees;
    let after_start = fees["cancel_after_start_fixed"].as_i64().unwrap();
    assert_ne!(Some(after_start), fees["cancel_before_start"].as_i64());
    rec.task.cancellation.as_mut().unwrap().fee = Some(after_start);
    assert!(violations(&input, Invariant::UsageKept) > 0);
    // A release applied by an attempt that no longer held the lease: task I's
    // first attempt released again after the second was leased.
    let mut input = honest();
    let rec = task_mut(&mut input, 9);
    let first = rec.attempts[0].id;
    let at = rec
        .events
        .iter()
        .position(|e| e.kind == "attempt_leased" && e.data["generation"] == json!(2))
        .unwrap();
    let seq = rec.events[at].seq;
    rec.events.insert(
        at + 1,
        Event {
            seq: seq + 1,
            kind: "attempt_released".into(),
            at: "2026-01-01T00:00:00.000Z".into(),
            data: typed(EventData::AttemptReleased(AttemptReleased {
                attempt_id: first,
                execute_count: 1,
                executor_id: "w1".into(),
                generation: 1,
                kind: model::AttemptKind::Execute,
                number: 1,
            })),
        },
    );
    for (n, e) in rec.events.iter_mut().enumerate() {
        e.seq = n as i64 + 1;
    }
    assert!(violations(&input, Invariant::Fencing) > 0);
}

#[test]
fn a_repeat_without_reconciliation_is_caught() {
    // The machine, tampered with, starts an execute attempt right after `unknown`.
    let mut s = Sim::new(Class::Payment, 1);
    let i = s.claim();
    assert!(s.report(i, 1, Outcome::Unknown, 1, None));
    s.task.control.next_kind = Some(model::AttemptKind::Execute);
    let k = s.claim();
    assert!(s.report(k, 2, Outcome::Succeeded, 1, Some("pay-1")));
    let mut input = CheckInput::default();
    input.tasks.push(s.record());
    input.db_tasks.push(s.db());
    let (e, r) = s.effect(k, "pay-1");
    input.effects.push(e);
    input.effect_requests.push(r);
    assert!(violations(&input, Invariant::ReconcileBeforeRepeat) > 0);

    // The provider was asked to pay by two attempts of a non-safe task.
    let mut input = honest();
    let mut again = input.effect_requests[0].clone();
    again.attempt_id = Uuid::from_u128(12345);
    again.moved = false;
    input.effect_requests.push(again);
    assert!(violations(&input, Invariant::ReconcileBeforeRepeat) > 0);
}

#[test]
fn a_second_delivery_or_charge_is_caught() {
    let mut input = honest();
    task_mut(&mut input, 1)
        .task
        .delivery
        .as_mut()
        .unwrap()
        .charge = 200;
    assert!(violations(&input, Invariant::OneDeliveryOneCharge) > 0);

    let mut input = honest();
    input.effect_requests[0].moved = true;
    let mut twice = input.effect_requests[0].clone();
    twice.moved = true;
    input.effect_requests.push(twice);
    assert!(violations(&input, Invariant::OneDeliveryOneCharge) > 0);

    // Paid at the provider but the task failed without delivering.
    let mut input = honest();
    let (e, r) = {
        let s2 = Sim::new(Class::Payment, 4);
        (
            Effect {
                task_id: s2.task.id,
                attempt_id: Uuid::from_u128(4001),
                class: Class::Payment,
                material: Class::Payment.material(&s2.task.params),
                txn: "pay-4".into(),
            },
            EffectRequest {
                task_id: s2.task.id,
                attempt_id: Uuid::from_u128(4001),
                idempotency_key: s2.task.idempotency_key.clone(),
                moved: true,
                in_lease: true,
            },
        )
    };
    input.effects.push(e);
    input.effect_requests.push(r);
    assert!(violations(&input, Invariant::OneDeliveryOneCharge) > 0);
    assert!(violations(&input, Invariant::CancelOrDeliver) > 0);
}

#[test]
fn cancel_and_delivery_both_is_caught() {
    let mut input = honest();
    let delivered = task_mut(&mut input, 1).task.delivery.clone();
    task_mut(&mut input, 4).task.delivery = delivered;
    assert!(violations(&input, Invariant::CancelOrDeliver) > 0);

    // A cancel answered `confirmed` on a task that then delivered.
    let mut input = honest();
    input.cancels.push(CancelRecord {
        task_id: Uuid::from_u128(1),
        status: CancelStatus::Confirmed,
    });
    assert!(violations(&input, Invariant::CancelOrDeliver) > 0);
}

#[test]
fn lost_usage_is_caught() {
    let mut input = honest();
    task_mut(&mut input, 1).task.usage += 5;
    assert!(violations(&input, Invariant::UsageKept) > 0);

    let mut input = honest();
    task_mut(&mut input, 1).attempts[0].usage = 1;
    task_mut(&mut input, 1).task.usage = 1;
    assert!(violations(&input, Invariant::UsageKept) > 0);

    let mut input = honest();
    task_mut(&mut input, 4)
        .task
        .cancellation
        .as_mut()
        .unwrap()
        .fee = Some(0);
    assert!(violations(&input, Invariant::UsageKept) > 0);
}

#[test]
fn a_gap_in_the_history_is_caught() {
    let mut input = honest();
    task_mut(&mut input, 2).events.remove(1);
    assert!(violations(&input, Invariant::Audit) > 0);
}

#[test]
fn an_unsettled_task_is_caught() {
    let mut s = Sim::new(Class::Payment, 1);
    s.claim();
    let mut input = CheckInput::default();
    input.tasks.push(s.record());
    input.db_tasks.push(s.db());
    assert!(violations(&input, Invariant::Settled) > 0);
}

/// The network plan (`--netns`) is a function of the seed, drawn from its
/// own stream: the rest of the plan is the same with and without it.
#[test]
fn the_network_plan_is_seeded_and_big_enough() {
    let a = Plan::new(5, 10_000, true).with_network();
    assert_eq!(a, Plan::new(5, 10_000, true).with_network());
    assert_ne!(a.network, Plan::new(6, 10_000, true).with_network().network);
    let without = Plan::new(5, 10_000, true);
    assert_eq!(a.ops, without.ops);
    assert_eq!(a.scripts, without.scripts);
    assert_eq!(a.server_faults, without.server_faults);
    assert!(without.network.is_empty());

    let count = |p: &Plan, name: &str| p.network.iter().filter(|e| e.fault.name() == name).count();
    assert!(count(&a, "net_partition") >= 5);
    assert!(count(&a, "net_delay") >= 5);
    assert!(count(&a, "net_loss") >= 1);
    let f = a.fault_counts();
    assert_eq!(f["net_partition"], count(&a, "net_partition") as u64);
    assert!(f["net_partition_ms"] >= 5 * 2_000);

    // Spread over the run, one after the other, each against one instance.
    assert!(a.network.windows(2).all(|w| w[0].at < w[1].at));
    assert!(a.network.iter().all(|e| e.at >= 500 && e.at < 8_500));
    assert!(a.network.iter().all(|e| e.instance < a.servers));
    assert!(a.network.iter().any(|e| e.instance == 0));
    assert!(a.network.iter().any(|e| e.instance == 1));
    // Delays hold chunks long enough that a few round trips outlive a lease.
    for e in &a.network {
        if let NetFault::Delay {
            delay_ms,
            jitter_ms,
        } = e.fault
        {
            assert!((200..=900).contains(&delay_ms) && jitter_ms <= delay_ms);
            assert!(4 * delay_ms >= LEASE_MS);
        }
    }

    // The short CI run still has two partitions and two delays.
    let small = Plan::new(3, 1_500, true).with_network();
    assert_eq!(count(&small, "net_partition"), 2);
    assert_eq!(count(&small, "net_delay"), 2);
    assert_eq!(count(&small, "net_loss"), 1);
}

/// With a clock skew the second instance is restarted at least twice, so
/// it runs with +skew and then −skew; the rest of the plan is unchanged.
#[test]
fn a_clock_skew_plan_restarts_the_skewed_instance() {
    let base = Plan::new(9, 3_000, true);
    let p = Plan::new(9, 3_000, true).with_clock_skew(30_000);
    assert_eq!(p, Plan::new(9, 3_000, true).with_clock_skew(30_000));
    assert_eq!(p.ops, base.ops);
    assert_eq!(p.clock_skew_ms, 30_000);
    let restarts = |p: &Plan| {
        p.server_faults
            .iter()
            .filter(|(_, f)| {
                *f == ServerFault::Kill {
                    server: SKEWED_SERVER,
                }
            })
            .count()
    };
    assert!(restarts(&p) >= restarts(&base) + 2);
    assert_eq!(p.fault_counts()["clock_skew_flip"], restarts(&p) as u64);
    assert!(p.server_faults.windows(2).all(|w| w[0].0 <= w[1].0));
    assert!(!base.fault_counts().contains_key("clock_skew_flip"));
}

/// `--clock-skew-ms` takes 5 s to one day either way; `i64::MIN`, whose size
/// has no `i64`, is refused like any other size beyond a day.
#[test]
fn clock_skew_sizes() {
    for ok in [5_000, -5_000, 20_000, -86_400_000, 86_400_000] {
        assert!(check_clock_skew(ok).is_ok(), "{ok}");
    }
    for bad in [1, -4_999, 86_400_001, -86_400_001, i64::MAX, i64::MIN] {
        assert!(check_clock_skew(bad).is_err(), "{bad}");
    }
}

// ---------------------------------------------------------------------------
// A failover to a standby that was behind
// ---------------------------------------------------------------------------

fn all_violations(input: &CheckInput) -> u64 {
    check(input).iter().map(|r| r.violations).sum()
}

impl Sim {
    /// What idem does when it finds the store on another timeline.
    fn store_rewound(&mut self) {
        self.tick(5);
        let mut j = Journal::default();
        assert!(machine::store_rewound(
            &mut self.task,
            None,
            &mut j,
            self.now,
            &json!({"timeline": 2}),
        ));
        self.events.extend(j.events);
    }
}

/// A task whose submit was acknowledged after the restore point is gone; the
/// key submitted again makes a new task that pays again. idem cannot see it;
/// the loss accounting names it, and the invariants hold for what survived.
#[test]
fn a_lost_task_executed_again_under_its_key_is_reported() {
    let mut lost = Sim::new(Class::Payment, 1);
    let i = lost.claim();
    assert!(lost.report(i, 1, Outcome::Succeeded, 1, Some("pay-1")));
    let (e1, r1) = lost.effect(i, "pay-1");

    let mut again = Sim::new(Class::Payment, 1);
    again.task.id = Uuid::from_u128(1001);
    let k = again.claim();
    assert!(again.report(k, 1, Outcome::Succeeded, 1, Some("pay-2")));
    let (e2, r2) = again.effect(k, "pay-2");

    let mut input = CheckInput::default();
    input.tasks.push(again.record());
    input.db_tasks.push(again.db());
    input.submits.push(lost.created());
    input.submits.push(again.created());
    input.effects.extend([e1, e2]);
    input.effect_requests.extend([r1, r2]);
    // Taken at face value, the records break one scope, one task.
    assert!(violations(&input, Invariant::OneScopeOneTask) > 0);

    let (kept, loss) = split_losses(&input);
    assert_eq!(loss.lost_tasks, 1);
    assert_eq!(loss.lost_tasks_recreated, 1);
    assert_eq!(loss.lost_tasks_with_effect, 1);
    assert_eq!(loss.executed_again_after_loss, 1);
    assert_eq!(loss.repeated_without_reconcile, 0);
    assert_eq!(loss.examples.len(), 1);
    assert_eq!(all_violations(&kept), 0);
}

/// The task survived but the attempt that paid is gone: idem moves the task
/// to reconcile-first, the reconcile attempt finds the payment, nothing pays
/// twice. Without the rewind a new execute attempt pays again: caught.
#[test]
fn an_effect_by_a_lost_attempt_is_reconciled_before_any_repeat() {
    let lost_attempt = Uuid::from_u128(777);
    let build = |rewind: bool| {
        let mut s = Sim::new(Class::Payment, 1);
        let mut input = CheckInput::default();
        input.submits.push(s.created());
        let (mut e, mut r) = s.effect_placeholder();
        e.attempt_id = lost_attempt;
        r.attempt_id = lost_attempt;
        input.effects.push(e);
        input.effect_requests.push(r.clone());
        if rewind {
            s.store_rewound();
            let a = s.claim();
            assert_eq!(s.attempts[a].kind, model::AttemptKind::Reconcile);
            assert!(s.report(a, 2, Outcome::Committed, 1, Some("pay-1")));
        } else {
            let a = s.claim();
            assert!(s.report(a, 1, Outcome::Succeeded, 1, Some("pay-1")));
            let mut repeat = r;
            repeat.attempt_id = s.attempts[a].id;
            repeat.moved = false;
            input.effect_requests.push(repeat);
        }
        input.tasks.push(s.record());
        input.db_tasks.push(s.db());
        input
    };

    let (kept, loss) = split_losses(&build(true));
    assert_eq!(loss.rewound_tasks, 1);
    assert_eq!(loss.rewound_to_reconcile, 1);
    assert_eq!(loss.lost_attempts_with_effect, 1);
    assert_eq!(loss.repeated_without_reconcile, 0);
    assert_eq!(all_violations(&kept), 0);

    let input = build(false);
    let (kept, loss) = split_losses(&input);
    assert_eq!(loss.lost_attempts_with_effect, 1);
    assert_eq!(loss.repeated_without_reconcile, 1);
    assert!(violations(&kept, Invariant::ReconcileBeforeRepeat) > 0);
}

// ---------------------------------------------------------------------------
// Suspected second effects
// ---------------------------------------------------------------------------

/// Appends a `second_effect_suspected` event with idem's data shape (a
/// false alarm where the state machine raised none).
fn raise(rec: &mut TaskRecord, txn: Option<&str>) {
    let delivered = rec
        .task
        .delivery
        .as_ref()
        .and_then(|d| d.external_txn_id.clone());
    let seq = rec.events.last().map_or(1, |e| e.seq + 1);
    rec.events.push(Event {
        seq,
        kind: SECOND_EFFECT_SUSPECTED.into(),
        at: "2023-11-14T22:13:21Z".into(),
        data: json!({
            "attempt_id": Uuid::from_u128(1),
            "generation": 1,
            "external_txn_id": txn,
            "delivered_txn_id": delivered,
            "evidence": "stale_report",
            "state": rec.task.state.as_str(),
        }),
    });
}

/// A request by an executor whose lease had run out.
fn stale_request(sim: &Sim, attempt: usize, txn: &str) -> (Effect, EffectRequest) {
    let (e, mut r) = sim.effect(attempt, txn);
    r.in_lease = false;
    (e, r)
}

/// The honest histories plus three at a provider that does not deduplicate,
/// with the events idem's state machine raised: (K) a stale payer pays after
/// the reconciliation found nothing, a new execute attempt pays and
/// delivers, the stale report comes last: one second effect, raised; (L) a
/// stale payer pays after the task was cancelled (the reconciliation found
/// nothing): raised; (M) a safe task's executor renders, crashes, the task is
/// executed again: a second effect no report named, which idem cannot see.
fn with_second_effects() -> CheckInput {
    let mut input = honest();
    input.provider = ProviderMode::NonDeduplicating;
    for e in &input.effects {
        input.effect_reports.insert(e.txn.clone(), true);
    }

    let mut k = Sim::new(Class::Payment, 21);
    let i = k.claim();
    k.expire(i);
    let r = k.claim();
    assert!(k.report(r, 2, Outcome::NotCommitted, 1, None));
    k.wake();
    let stale = stale_request(&k, i, "pay-21a");
    let x = k.claim();
    assert!(k.report(x, 3, Outcome::Succeeded, 1, Some("pay-21b")));
    let paid = k.effect(x, "pay-21b");
    assert!(!k.report(i, 1, Outcome::Succeeded, 1, Some("pay-21a")));
    input.effect_reports.insert("pay-21a".into(), true);
    input.effect_reports.insert("pay-21b".into(), true);
    input.suspects.push(SuspectReport {
        task_id: k.task.id,
        attempt_id: k.attempts[i].id,
        kind: SuspectKind::Late,
        accepted: false,
    });

    let mut l = Sim::new(Class::Payment, 22);
    let i = l.claim();
    assert_eq!(l.cancel(), CancelStatus::Requested);
    l.expire(i);
    let r = l.claim();
    assert!(l.report(r, 2, Outcome::NotCommitted, 1, None));
    assert_eq!(l.task.state, model::TaskState::Cancelled);
    let late = stale_request(&l, i, "pay-22");
    assert!(!l.report(i, 1, Outcome::Succeeded, 1, Some("pay-22")));
    input.effect_reports.insert("pay-22".into(), true);

    let mut m = Sim::new(Class::Generation, 23);
    let i = m.claim();
    let lost = m.effect(i, "gen-23a");
    m.expire(i);
    let x = m.claim();
    assert!(m.report(x, 2, Outcome::Succeeded, 1, Some("gen-23b")));
    let rendered = m.effect(x, "gen-23b");
    input.effect_reports.insert("gen-23b".into(), true);

    for (sim, effects) in [
        (&k, vec![stale, paid]),
        (&l, vec![late]),
        (&m, vec![lost, rendered]),
    ] {
        input.tasks.push(sim.record());
        input.db_tasks.push(sim.db());
        input.submits.push(sim.created());
        for (e, r) in effects {
            input.effects.push(e);
            input.effect_requests.push(r);
        }
    }
    input.cancels.push(CancelRecord {
        task_id: l.task.id,
        status: CancelStatus::Requested,
    });
    input
}

#[test]
fn second_effects_reported_to_idem_must_be_raised_and_nothing_else() {
    let input = with_second_effects();
    for r in check(&input) {
        assert_eq!(r.violations, 0, "{}: {:?}", r.name, r.examples);
    }
    let figures = second_effects(&input);
    assert_eq!(
        figures,
        SecondEffects {
            tasks_with_several_effects: 2,
            real: 3,
            beside_delivery: 2,
            without_delivery: 1,
            reported: 2,
            unreported: 1,
            unanswered: 0,
            raised: 2,
            misses: 0,
            false_alarms: 0,
        }
    );

    // Missed: no event for the stale payer's effect.
    let mut missed = with_second_effects();
    task_mut(&mut missed, 21)
        .events
        .retain(|e| e.kind != SECOND_EFFECT_SUSPECTED);
    assert_eq!(
        violations(&missed, Invariant::SecondEffectsDetected),
        1,
        "one miss"
    );
    assert_eq!(second_effects(&missed).misses, 1);

    // A false alarm: the delivered id raised, an id the ledger never saw,
    // an event without an id, one id raised twice.
    for txn in [Some("pay-21b"), Some("pay-999"), None, Some("pay-21a")] {
        let mut alarmed = with_second_effects();
        raise(task_mut(&mut alarmed, 21), txn);
        assert_eq!(
            violations(&alarmed, Invariant::SecondEffectsDetected),
            1,
            "{txn:?}"
        );
        assert_eq!(second_effects(&alarmed).false_alarms, 1, "{txn:?}");
    }
    // An event naming another delivered id than the delivery's.
    let mut wrong = with_second_effects();
    let rec = task_mut(&mut wrong, 21);
    let last = rec.events.len() - 1;
    rec.events[last].data["delivered_txn_id"] = json!("pay-1");
    assert!(violations(&wrong, Invariant::SecondEffectsDetected) > 0);

    // A report only sent, never answered: neither a miss when not raised …
    let mut unanswered = with_second_effects();
    unanswered.effect_reports.insert("pay-21a".into(), false);
    let before = unanswered.clone();
    task_mut(&mut unanswered, 21)
        .events
        .retain(|e| e.kind != SECOND_EFFECT_SUSPECTED);
    assert_eq!(violations(&unanswered, Invariant::SecondEffectsDetected), 0);
    // … nor a false alarm when raised.
    assert_eq!(violations(&before, Invariant::SecondEffectsDetected), 0);
    assert_eq!(second_effects(&before).unanswered, 1);

    // A task still open: nothing may be raised yet.
    let mut open = Sim::new(Class::Payment, 31);
    open.claim();
    let mut rec = open.record();
    raise(&mut rec, Some("pay-31"));
    let mut input = CheckInput::default();
    input.tasks.push(rec);
    assert_eq!(violations(&input, Invariant::SecondEffectsDetected), 1);
}

#[test]
fn a_stale_payer_is_no_violation_of_idem_but_an_effect_in_lease_is() {
    // The stale payer's effect of a cancelled task, and its second request:
    // the executor's fault, not idem's.
    let input = with_second_effects();
    assert_eq!(violations(&input, Invariant::CancelOrDeliver), 0);
    assert_eq!(violations(&input, Invariant::ReconcileBeforeRepeat), 0);
    // The same requests within the lease are idem's doing.
    let mut in_lease = with_second_effects();
    for r in &mut in_lease.effect_requests {
        r.in_lease = true;
    }
    assert!(violations(&in_lease, Invariant::CancelOrDeliver) > 0);
    assert!(violations(&in_lease, Invariant::ReconcileBeforeRepeat) > 0);
    assert!(violations(&in_lease, Invariant::OneDeliveryOneCharge) > 0);
}

#[test]
fn a_non_deduplicating_provider_pays_each_request_and_looks_up_the_first() {
    let p = Provider::new(ProviderMode::NonDeduplicating);
    let (t, a) = (Uuid::from_u128(1), Uuid::from_u128(2));
    let params = Class::Payment.params(1, 0, 0);
    let first = p.perform(t, a, "k1", Class::Payment, &params, true);
    let second = p.perform(t, a, "k1", Class::Payment, &params, false);
    assert_ne!(first.txn, second.txn);
    assert_eq!(p.lookup(t), Some(first.clone()));
    let (effects, requests, lookups) = p.snapshot();
    assert_eq!(effects.len(), 2);
    assert_eq!((requests.len(), lookups), (2, 1));
    assert!(requests.iter().all(|r| r.moved));

    let d = Provider::new(ProviderMode::Deduplicating);
    let first = d.perform(t, a, "k1", Class::Payment, &params, true);
    assert_eq!(d.perform(t, a, "k1", Class::Payment, &params, false), first);
    let (effects, requests, _) = d.snapshot();
    assert_eq!(effects.len(), 1);
    assert_eq!(
        requests.iter().map(|r| r.moved).collect::<Vec<_>>(),
        [true, false]
    );
}

/// Stale payers come from a stream of their own: the rest of the plan is the
/// seed's as without them, and both kinds are planned.
#[test]
fn stale_payers_are_seeded_and_leave_the_rest_of_the_plan() {
    let a = Plan::new(5, 3000, false).with_stale_payers();
    assert_eq!(a, Plan::new(5, 3000, false).with_stale_payers());
    let without = Plan::new(5, 3000, false);
    assert_eq!(a.ops, without.ops);
    assert_eq!(a.server_faults, without.server_faults);
    let f = a.fault_counts();
    for kind in ["stale_executor_pays", "stale_executor_pays_again"] {
        assert!(f.get(kind).copied().unwrap_or(0) > 20, "{kind}: {f:?}");
    }
    assert!(!without.fault_counts().contains_key("stale_executor_pays"));
}
