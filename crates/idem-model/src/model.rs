//! The protocol as a [`stateright::Model`]: actors, actions, and the
//! properties of SPEC §2 checked over every state the bounds allow.

use idem_core::machine::operator::Resolution;
use idem_core::model::{AttemptKind, AttemptState, FailureClass};
use idem_store::ops::{
    self, AcknowledgeDelivery, Cancel, Claim, ClaimRequest, Heartbeat, OperatorCancel, Redrive,
    Release, Resolve, RetryNow, RevokeApiKey, Submission, Submit, SubmitOutcome, Sweep,
};
use idem_store::{Refusal, StoreError};
use serde_json::json;
use stateright::{Model, Property};

use crate::action::Action;
use crate::bounds::Bounds;
use crate::memory;
use crate::properties::*;
use crate::setup::{
    self, Answer, OperatorAction, SAFE_CLASS, Sent, Setup, SetupError, TENANTS, UNSAFE_CLASS,
    api_key_id,
};
use crate::state::{Executor, Held, Reported, State, violation};

/// The model: bounds and the store's fixed setup. Time runs in two phases.
/// Before the horizon every actor acts, faults included (crashes, late
/// reports, cancels, operator actions, `failed` and `unknown` reports). At
/// the horizon the run drains: no more submits, cancels, operator actions or
/// crashes; reconcile attempts report what the ledger says; an executor that
/// holds a live lease acts before time passes; the clock jumps to the next
/// lease end or backoff end; executors may claim any number of attempts.
/// The liveness property is checked at the end of every drained run.
#[derive(Debug, Clone)]
pub struct IdemModel {
    /// The bounds.
    pub bounds: Bounds,
    /// Classes, contracts and requests.
    pub setup: Setup,
}

/// The concurrency key every task carries when [`Bounds::cap`] is above 0.
pub const CONCURRENCY_KEY: &str = "payee-1";

impl IdemModel {
    /// The caps claims enforce: [`Bounds::cap`] per concurrency key in both
    /// classes (none when it is 0).
    fn claim_flow(&self) -> idem_store::caps::ClaimFlow {
        let cap = self.bounds.cap;
        if cap == 0 {
            return idem_store::caps::ClaimFlow::default();
        }
        let caps = idem_store::caps::ClassCaps {
            concurrency_key_cap: Some(i64::from(cap)),
            ..idem_store::caps::ClassCaps::default()
        };
        idem_store::caps::ClaimFlow {
            classes: [UNSAFE_CLASS, SAFE_CLASS]
                .into_iter()
                .map(|c| (c.to_owned(), caps))
                .collect(),
            ..idem_store::caps::ClaimFlow::default()
        }
    }

    /// The model of `bounds`.
    ///
    /// # Errors
    /// [`SetupError`] when the model's own configuration is wrong.
    pub fn new(bounds: Bounds) -> Result<IdemModel, SetupError> {
        let classes: Vec<&'static str> = (0..bounds.keys).map(|k| bounds.class_of(k)).collect();
        let setup = Setup::new(&classes, bounds.tenants)?;
        Ok(IdemModel { bounds, setup })
    }

    /// The state before anything happened.
    pub fn initial(&self) -> State {
        State {
            clock: 0,
            tasks: Vec::new(),
            scopes: Vec::new(),
            revoked: 0,
            executors: vec![Executor::Idle; usize::from(self.bounds.executors)],
            ledger: Vec::new(),
            crashes_left: self.bounds.crashes,
            operator_left: self.bounds.operator,
            lost_left: self.bounds.lost,
            violations: 0,
            slots: Vec::new(),
        }
    }

    /// Whether `s` is past the horizon (draining).
    pub fn draining(&self, s: &State) -> bool {
        s.clock >= i64::from(self.bounds.horizon)
    }

    /// The next instant something is due while draining: a lease or a
    /// backoff end, after `now`. `None` while an executor holds a live lease
    /// (it acts first) or when nothing is due.
    fn next_due(&self, s: &State) -> Option<i64> {
        let now = s.clock;
        let live = s
            .executors
            .iter()
            .any(|e| matches!(e, Executor::Holding(h) if h.lease_end > now));
        if live {
            return None;
        }
        let mut next: Option<i64> = None;
        let mut consider = |t: i64| {
            if t > now {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        for row in &s.tasks {
            let t = &row.task;
            if t.state.is_terminal() {
                continue;
            }
            if t.control.active_attempt_id.is_none() && t.control.next_kind.is_some() {
                consider(setup::tick_of(t.control.ready_at));
            }
            for a in &row.attempts {
                if a.state.is_active() {
                    consider(setup::tick_of(a.lease_expires_at));
                }
            }
        }
        next
    }

    /// The tenant index executor `executor` works for.
    fn tenant_of_executor(&self, executor: u8) -> u8 {
        executor % self.bounds.tenants.max(1)
    }

    /// Runs `op` as one transaction on `n` ([`memory::run`]); claims offer
    /// only tasks below `claim_bound` attempts.
    fn run<O: ops::Operation>(
        &self,
        n: &mut State,
        claim_bound: Option<i64>,
        op: &O,
    ) -> Result<O::Reply, StoreError> {
        memory::run(n, &self.setup, claim_bound, op)
    }

    /// Applies `action` to a copy of `s`: the new state and the store's
    /// answer, or `None` when the action does not apply. An operation that
    /// fails keeps nothing of its transaction (the state is `s` again) and
    /// is recorded as a violation.
    pub fn step(&self, s: &State, action: Action) -> Option<(State, Answer)> {
        let (n, answer) = self.outcome(s, action)?;
        let changed = n.tasks != s.tasks
            || n.scopes != s.scopes
            || n.revoked != s.revoked
            || n.executors != s.executors
            || n.ledger != s.ledger
            || n.clock != s.clock
            || n.violations != s.violations;
        changed.then_some((n, answer))
    }

    /// [`IdemModel::step`] also when nothing changed (a replay, a
    /// conflict): the state after `action` and the store's answer, or
    /// `None` when the action does not apply.
    pub fn outcome(&self, s: &State, action: Action) -> Option<(State, Answer)> {
        let mut n = s.clone();
        let answer = match self.apply(s, &mut n, action)? {
            Ok(answer) => answer,
            Err(e) => {
                n = s.clone();
                n.violations |= violation::STORE_FAILED;
                Answer::StoreFailed(e.to_string())
            }
        };
        self.check_transition(s, &mut n);
        Some((n, answer))
    }

    fn apply(
        &self,
        s: &State,
        n: &mut State,
        action: Action,
    ) -> Option<Result<Answer, StoreError>> {
        let now = s.clock;
        Some(Ok(match action {
            Action::Submit { key, sent } => {
                let k = self.setup.keys.get(usize::from(key))?;
                let req = k.request(sent);
                let submission = Submission {
                    tenant: TENANTS[usize::from(k.tenant)].to_owned(),
                    operation: k.class.to_owned(),
                    idempotency_key: k.idempotency_key.clone(),
                    fingerprint: req.fingerprint.clone(),
                    canonical_request: req.canonical.clone(),
                    params: req.params.clone(),
                    contract: req.contract.clone(),
                    api_key_id: api_key_id(k.tenant),
                    grant: None,
                    traceparent: None,
                    rate_limits: Vec::new(),
                    concurrency_key: (self.bounds.cap > 0).then(|| CONCURRENCY_KEY.to_owned()),
                    priority: 3,
                    fairness_key: None,
                };
                let outcome = match self.run(n, None, &Submit(submission)) {
                    Ok(o) => o,
                    Err(e) => return Some(Err(e)),
                };
                // A taken scope answers a replay exactly for the request its
                // task was accepted with (the same params), else a conflict.
                let (answer, wrong) = match &outcome {
                    SubmitOutcome::Created(_) => (Answer::Created, false),
                    SubmitOutcome::Replayed(t) => (Answer::Replayed, t.params != req.params),
                    SubmitOutcome::Conflict { task } => {
                        (Answer::Conflict, task.params == req.params)
                    }
                    SubmitOutcome::KeyRevoked { .. } => (Answer::KeyRevoked, false),
                    // The model's submissions carry no rate limit.
                    SubmitOutcome::RateLimited { .. } => (Answer::KeyRevoked, true),
                };
                if wrong {
                    n.violations |= violation::WRONG_SUBMIT_ANSWER;
                }
                if answer != Answer::Created
                    && (n.tasks != s.tasks || n.ledger != s.ledger || n.scopes != s.scopes)
                {
                    n.violations |= violation::SUBMIT_CHANGED_STORE;
                }
                answer
            }
            Action::Cancel { task } => {
                let row = s.tasks.get(usize::from(task))?;
                let op = Cancel {
                    tenant: row.task.control.tenant.clone(),
                    grant: None,
                    task_id: row.task.id,
                };
                match self.run(n, None, &op) {
                    Ok(Ok((_, c))) => Answer::Cancellation(c.status),
                    Ok(Err(r)) => refusal(r),
                    Err(e) => return Some(Err(e)),
                }
            }
            Action::AcknowledgeDelivery { task } => {
                let row = s.tasks.get(usize::from(task))?;
                let op = AcknowledgeDelivery {
                    tenant: row.task.control.tenant.clone(),
                    grant: None,
                    task_id: row.task.id,
                };
                match self.run(n, None, &op) {
                    Ok(Ok(_)) => Answer::Ok,
                    Ok(Err(r)) => refusal(r),
                    Err(e) => return Some(Err(e)),
                }
            }
            Action::Claim { executor } => {
                let bound = (!self.draining(s)).then_some(i64::from(self.bounds.attempts));
                let op = Claim(ClaimRequest {
                    tenant: TENANTS[usize::from(self.tenant_of_executor(executor))].to_owned(),
                    operations: vec![UNSAFE_CLASS.to_owned(), SAFE_CLASS.to_owned()],
                    executor_id: format!("executor-{executor}"),
                    max: 1,
                    lease_ms: None,
                    flow: self.claim_flow(),
                });
                let claimed = match self.run(n, bound, &op) {
                    Ok(c) => c,
                    Err(e) => return Some(Err(e)),
                };
                let Some(c) = claimed.into_iter().next() else {
                    return Some(Ok(if n.tasks != s.tasks {
                        Answer::EndedInstead
                    } else {
                        Answer::NothingClaimable
                    }));
                };
                let index = n.task_index(c.task.id)?;
                let a = c.attempt;
                n.executors[usize::from(executor)] = Executor::Holding(Held {
                    task: index as u8,
                    attempt_id: a.id,
                    number: a.number,
                    generation: a.generation,
                    kind: a.kind,
                    lease_end: setup::tick_of(a.lease_expires_at),
                    usage: 0,
                    effect_done: false,
                    acknowledged: false,
                    observed: None,
                    cancel_heard: false,
                });
                if a.kind == AttemptKind::Execute {
                    let row = &mut n.tasks[index];
                    if row.effect_possible && !row.safe() {
                        n.violations |= violation::REPEAT_WITHOUT_RECONCILE;
                    }
                    row.effect_possible = true;
                }
                Answer::Leased {
                    number: a.number,
                    generation: a.generation,
                    kind: a.kind,
                }
            }
            Action::Heartbeat { executor } => {
                let held = self.holding(s, executor)?.clone();
                let op = Heartbeat {
                    tenant: self.tenant(executor),
                    grant: None,
                    attempt_id: held.attempt_id,
                    generation: held.generation,
                    usage: Some(held.usage),
                };
                let answer = match self.run(n, None, &op) {
                    Ok(Ok(ack)) => Answer::Heartbeat {
                        lease_end: setup::tick_of(ack.lease_expires_at),
                        cancel_requested: ack.cancel_requested,
                    },
                    Ok(Err(r)) => refusal(r),
                    Err(e) => return Some(Err(e)),
                };
                let e = &mut n.executors[usize::from(executor)];
                match &answer {
                    Answer::Heartbeat {
                        lease_end,
                        cancel_requested,
                    } => {
                        if let Executor::Holding(h) = e {
                            h.lease_end = *lease_end;
                            h.cancel_heard |= *cancel_requested;
                        }
                    }
                    // A stale executor stops.
                    _ => *e = Executor::Idle,
                }
                self.check_stale(s, n, &held);
                answer
            }
            Action::Acknowledge { executor } => {
                let held = self.holding(s, executor)?.clone();
                let op = ops::Acknowledge {
                    tenant: self.tenant(executor),
                    grant: None,
                    attempt_id: held.attempt_id,
                    generation: held.generation,
                    body: json!({"generation": held.generation}),
                };
                let answer = match self.run(n, None, &op) {
                    Ok(Ok(_)) => Answer::Ok,
                    Ok(Err(r)) => refusal(r),
                    Err(e) => return Some(Err(e)),
                };
                if let Executor::Holding(h) = &mut n.executors[usize::from(executor)] {
                    h.acknowledged = true;
                }
                self.check_stale(s, n, &held);
                answer
            }
            Action::PerformEffect { executor } => {
                let held = self.holding(s, executor)?.clone();
                let l = &mut n.ledger[usize::from(held.task)];
                if l.applied {
                    l.repeats = l.repeats.saturating_add(1);
                } else {
                    l.applied = true;
                }
                if let Executor::Holding(h) = &mut n.executors[usize::from(executor)] {
                    h.effect_done = true;
                    h.usage = 1;
                }
                Answer::Local("the provider performs the effect (idempotent by task id)")
            }
            Action::QueryProvider { executor } => {
                let held = self.holding(s, executor)?.clone();
                let applied = n.ledger[usize::from(held.task)].applied;
                if let Executor::Holding(h) = &mut n.executors[usize::from(executor)] {
                    h.observed = Some(applied);
                }
                Answer::Local(if applied {
                    "the provider's ledger has the effect"
                } else {
                    "the provider's ledger has no effect"
                })
            }
            Action::Report {
                executor,
                what,
                lost,
            } => {
                let held = self.holding(s, executor)?.clone();
                let answer = match self.report(n, executor, &held, what) {
                    Ok(a) => a,
                    Err(e) => return Some(Err(e)),
                };
                if !matches!(answer, Answer::Rejected(_)) {
                    let row = &mut n.tasks[usize::from(held.task)];
                    let settled_not_done = match what {
                        Reported::FailedTransient
                        | Reported::FailedInvalidInput
                        | Reported::Cancelled => held.kind == AttemptKind::Execute,
                        Reported::NotCommitted => true,
                        _ => false,
                    };
                    if settled_not_done {
                        row.effect_possible = false;
                    }
                }
                n.executors[usize::from(executor)] = if lost {
                    n.lost_left = n.lost_left.saturating_sub(1);
                    Executor::Repeating(held.clone(), what)
                } else {
                    Executor::Idle
                };
                self.check_stale(s, n, &held);
                answer
            }
            Action::RepeatReport { executor } => {
                let Some(Executor::Repeating(held, what)) = s.executors.get(usize::from(executor))
                else {
                    return None;
                };
                let (held, what) = (held.clone(), *what);
                let answer = match self.report(n, executor, &held, what) {
                    Ok(a) => a,
                    Err(e) => return Some(Err(e)),
                };
                let i = usize::from(held.task);
                let body = setup::report_of(&held, what).body;
                let applied = s.tasks[i].attempts.iter().any(|a| {
                    a.id == held.attempt_id && a.report.as_ref().is_some_and(|r| r.body == body)
                });
                if applied && (answer != Answer::Ok || !n.tasks[i].unchanged_from(&s.tasks[i])) {
                    n.violations |= violation::REPEAT_CHANGED;
                }
                n.executors[usize::from(executor)] = Executor::Idle;
                self.check_stale(s, n, &held);
                answer
            }
            Action::Release { executor } => {
                let held = self.holding(s, executor)?.clone();
                let op = Release {
                    tenant: self.tenant(executor),
                    grant: None,
                    attempt_id: held.attempt_id,
                    generation: held.generation,
                };
                let answer = match self.run(n, None, &op) {
                    Ok(r) => match r.reply {
                        Ok(_) => Answer::Ok,
                        Err(r) => refusal(r),
                    },
                    Err(e) => return Some(Err(e)),
                };
                if answer == Answer::Ok && held.kind == AttemptKind::Execute {
                    // The executor declared, truly, that it never started.
                    n.tasks[usize::from(held.task)].effect_possible = false;
                }
                // Released or refused: either way nothing is left to do.
                n.executors[usize::from(executor)] = Executor::Idle;
                self.check_stale(s, n, &held);
                answer
            }
            Action::Abandon { executor } => {
                self.holding(s, executor)?;
                n.executors[usize::from(executor)] = Executor::Idle;
                Answer::Local("its lease ended: the executor stops")
            }
            Action::Crash { executor } => {
                self.holding(s, executor)?;
                n.executors[usize::from(executor)] = Executor::Idle;
                n.crashes_left = n.crashes_left.saturating_sub(1);
                Answer::Local("crashed; restarts with nothing")
            }
            Action::Tick => {
                n.clock = if self.draining(s) {
                    self.next_due(s)?
                } else {
                    now + 1
                };
                Answer::Local("time passes")
            }
            Action::Sweep => match self.run(
                n,
                None,
                &Sweep {
                    limit: 100,
                    queues_after: None,
                },
            ) {
                Ok(e) => Answer::Swept {
                    expired: e.reply.expired,
                    woken: e.reply.woken,
                    released: e.reply.keys_released,
                },
                Err(e) => return Some(Err(e)),
            },
            Action::RevokeKey { tenant } => {
                n.operator_left = n.operator_left.saturating_sub(1);
                let op = RevokeApiKey {
                    id: api_key_id(tenant),
                };
                match self.run(n, None, &op) {
                    Ok(Some(_)) => Answer::Ok,
                    Ok(None) => Answer::NotFound,
                    Err(e) => return Some(Err(e)),
                }
            }
            Action::Operator { task, action } => {
                n.operator_left = n.operator_left.saturating_sub(1);
                let i = usize::from(task);
                let task_id = s.tasks.get(i)?.task.id;
                let by = self.setup.by.clone();
                let res = match action {
                    OperatorAction::RetryNow => self
                        .run(
                            n,
                            None,
                            &RetryNow {
                                tenant: None,
                                grant: None,
                                task_id,
                                by,
                            },
                        )
                        .map(|r| r.map(|_| Answer::Ok)),
                    OperatorAction::Cancel => self
                        .run(
                            n,
                            None,
                            &OperatorCancel {
                                tenant: None,
                                grant: None,
                                task_id,
                                by,
                            },
                        )
                        .map(|r| r.map(|(_, c)| Answer::Cancellation(c.status))),
                    OperatorAction::Resolve => {
                        // As the provider's ledger says, as an operator who
                        // looked would.
                        let resolution = if s.ledger[i].applied {
                            Resolution::Committed {
                                result: json!({"receipt": format!("r-{task}")}),
                                external_txn_id: Some(format!("txn-{task}")),
                            }
                        } else {
                            Resolution::NotCommitted
                        };
                        self.run(
                            n,
                            None,
                            &Resolve {
                                tenant: None,
                                grant: None,
                                task_id,
                                by,
                                resolution,
                            },
                        )
                        .map(|r| r.reply.map(|_| Answer::Ok))
                    }
                    OperatorAction::Redrive => self
                        .run(
                            n,
                            None,
                            &Redrive {
                                tenant: None,
                                grant: None,
                                task_id,
                                by,
                            },
                        )
                        .map(|r| r.map(|_| Answer::Ok)),
                };
                let answer = match res {
                    Ok(Ok(a)) => a,
                    // A refused action has no successor state.
                    Ok(Err(Refusal::Operator(_))) => return None,
                    Ok(Err(r)) => refusal(r),
                    Err(e) => return Some(Err(e)),
                };
                if action == OperatorAction::Resolve && answer == Answer::Ok && !n.ledger[i].applied
                {
                    n.tasks[i].effect_possible = false;
                }
                answer
            }
        }))
    }

    /// `/report` of `what` by the executor holding `held`.
    fn report(
        &self,
        n: &mut State,
        executor: u8,
        held: &Held,
        what: Reported,
    ) -> Result<Answer, StoreError> {
        let op = ops::Report {
            tenant: self.tenant(executor),
            grant: None,
            attempt_id: held.attempt_id,
            report: setup::report_of(held, what),
        };
        Ok(match self.run(n, None, &op)?.reply {
            Ok(_) => Answer::Ok,
            Err(r) => refusal(r),
        })
    }

    /// The tenant name executor `executor` works for.
    fn tenant(&self, executor: u8) -> String {
        TENANTS[usize::from(self.tenant_of_executor(executor))].to_owned()
    }

    /// The attempt executor `executor` holds and works on (not while it
    /// sends a report again).
    fn holding<'a>(&self, s: &'a State, executor: u8) -> Option<&'a Held> {
        match s.executors.get(usize::from(executor))? {
            Executor::Holding(h) => Some(h),
            _ => None,
        }
    }
}

/// The answer of a business refusal.
fn refusal(r: Refusal) -> Answer {
    match r {
        Refusal::Machine(r) => Answer::Rejected(r),
        Refusal::Operator(r) => Answer::Refused(r),
        _ => Answer::NotFound,
    }
}

impl Model for IdemModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let draining = self.draining(s);
        if !draining {
            for key in 0..self.bounds.keys {
                let held = s.scope(key).is_some();
                if held || s.tasks.len() < usize::from(self.bounds.tasks) {
                    actions.push(Action::Submit {
                        key,
                        sent: Sent::Original,
                    });
                }
                if held {
                    for sent in [Sent::Changed, Sent::Reconfigured] {
                        actions.push(Action::Submit { key, sent });
                    }
                }
            }
            if s.operator_left > 0 {
                for tenant in 0..self.bounds.tenants.max(1) {
                    if s.revoked & (1 << tenant) == 0 {
                        actions.push(Action::RevokeKey { tenant });
                    }
                }
            }
            for (i, row) in s.tasks.iter().enumerate() {
                let task = i as u8;
                if row.task.cancellation.is_none() {
                    actions.push(Action::Cancel { task });
                }
                if row
                    .task
                    .delivery
                    .as_ref()
                    .is_some_and(|d| d.acknowledged_at.is_none())
                {
                    actions.push(Action::AcknowledgeDelivery { task });
                }
                if s.operator_left > 0 {
                    // Every task is offered retry-now, resolve and redrive
                    // whatever its state: `machine::operator` decides which
                    // apply, and a refused action has no successor state.
                    for action in [
                        OperatorAction::RetryNow,
                        OperatorAction::Resolve,
                        OperatorAction::Redrive,
                    ] {
                        actions.push(Action::Operator { task, action });
                    }
                    if row.task.cancellation.is_none() {
                        actions.push(Action::Operator {
                            task,
                            action: OperatorAction::Cancel,
                        });
                    }
                }
            }
        }
        let now = s.clock;
        for (e, ex) in s.executors.iter().enumerate() {
            let executor = e as u8;
            let h = match ex {
                Executor::Idle => {
                    actions.push(Action::Claim { executor });
                    continue;
                }
                Executor::Repeating(..) => {
                    actions.push(Action::RepeatReport { executor });
                    continue;
                }
                Executor::Holding(h) => h,
            };
            let mut reports: Vec<Reported> = Vec::new();
            let live = now < h.lease_end;
            actions.push(Action::Heartbeat { executor });
            // Releases happen before the horizon only: each one lets another
            // claim follow, which the drain does not bound.
            let unstarted = match h.kind {
                AttemptKind::Execute => !h.effect_done && !h.acknowledged,
                AttemptKind::Reconcile => h.observed.is_none(),
            };
            if !draining && unstarted {
                actions.push(Action::Release { executor });
            }
            if !live {
                actions.push(Action::Abandon { executor });
            }
            if !draining && s.crashes_left > 0 {
                actions.push(Action::Crash { executor });
            }
            match h.kind {
                AttemptKind::Execute => {
                    if !h.acknowledged {
                        actions.push(Action::Acknowledge { executor });
                    }
                    if live && !h.effect_done {
                        actions.push(Action::PerformEffect { executor });
                    }
                    let choices: &[Reported] = if h.effect_done {
                        &[Reported::Succeeded, Reported::Unknown]
                    } else if h.cancel_heard {
                        &[
                            Reported::FailedTransient,
                            Reported::FailedInvalidInput,
                            Reported::Unknown,
                            Reported::Cancelled,
                        ]
                    } else {
                        &[
                            Reported::FailedTransient,
                            Reported::FailedInvalidInput,
                            Reported::Unknown,
                        ]
                    };
                    reports.extend_from_slice(choices);
                }
                AttemptKind::Reconcile => {
                    if live && h.observed.is_none() {
                        actions.push(Action::QueryProvider { executor });
                    }
                    match h.observed {
                        Some(true) => reports.push(Reported::Committed),
                        Some(false) => reports.push(Reported::NotCommitted),
                        None => {}
                    }
                    if !draining {
                        reports.push(Reported::FailedTransient);
                        reports.push(Reported::Unknown);
                    }
                }
            }
            // An answer may be lost before the horizon, a bounded number
            // of times: the executor then sends the same report again.
            let lose = !draining && s.lost_left > 0;
            for what in reports {
                actions.push(Action::Report {
                    executor,
                    what,
                    lost: false,
                });
                if lose {
                    actions.push(Action::Report {
                        executor,
                        what,
                        lost: true,
                    });
                }
            }
        }
        actions.push(Action::Tick);
        actions.push(Action::Sweep);
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        self.step(s, action).map(|(n, _)| n)
    }

    fn format_action(&self, action: &Action) -> String {
        action.describe(&self.setup, self.bounds.tenants)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(ONE_TASK_PER_SCOPE, |_, s: &State| one_task_per_scope(s)),
            Property::always(SUBMIT_CHANGES_NOTHING, |_, s: &State| {
                s.violations & violation::SUBMIT_CHANGED_STORE == 0
            }),
            Property::always(SAME_REQUEST_REPLAYS, |_, s: &State| {
                s.violations & violation::WRONG_SUBMIT_ANSWER == 0
            }),
            Property::always(REPEAT_ANSWERED_AS_BEFORE, |_, s: &State| {
                s.violations & violation::REPEAT_CHANGED == 0
            }),
            Property::always(STORE_NEVER_FAILS, |_, s: &State| {
                s.violations & violation::STORE_FAILED == 0
            }),
            Property::always(NO_CHANGE_FROM_OLD_GENERATION, |_, s: &State| {
                s.violations & violation::STALE_CHANGED_STATE == 0
            }),
            Property::always(GENERATIONS_INCREASE, |_, s: &State| generations_increase(s)),
            Property::always(DELIVERY_ONCE, |_, s: &State| delivery_once(s)),
            Property::always(EFFECT_ONCE, |_, s: &State| effect_once(s)),
            Property::always(RECONCILE_BEFORE_REPEAT, |_, s: &State| {
                s.violations & violation::REPEAT_WITHOUT_RECONCILE == 0
            }),
            Property::always(CANCEL_XOR_DELIVERY, |_, s: &State| cancel_xor_delivery(s)),
            Property::always(USAGE_KEPT, |_, s: &State| usage_kept(s)),
            Property::eventually(EVERY_TASK_ENDS, |m: &IdemModel, s: &State| {
                m.draining(s) && s.tasks.iter().all(|r| r.task.state.is_terminal())
            }),
            Property::sometimes(REACHED_DELIVERY, |_, s: &State| {
                s.tasks.iter().any(|r| r.task.delivery.is_some())
            }),
            Property::sometimes(REACHED_RECONCILE, |_, s: &State| {
                s.tasks.iter().any(|r| {
                    r.attempts.iter().any(|a| {
                        matches!(
                            a.state,
                            AttemptState::Committed | AttemptState::NotCommitted
                        )
                    })
                })
            }),
            Property::sometimes(REACHED_STALE_REPORT, |_, s: &State| {
                s.tasks.iter().any(|r| r.stale_report_kept)
            }),
            Property::sometimes(REACHED_CANCEL_LOST, |_, s: &State| {
                s.tasks.iter().any(|r| r.cancel_lost_to_delivery)
            }),
            Property::sometimes(REACHED_CANCEL_CONFIRMED, |_, s: &State| {
                s.tasks.iter().any(|r| r.pending_cancel_confirmed)
            }),
            Property::sometimes(REACHED_RELEASE, |_, s: &State| {
                s.tasks.iter().any(|r| {
                    r.attempts.iter().any(|a| a.state == AttemptState::Released)
                        && r.task.state.is_terminal()
                })
            }),
            Property::sometimes(REACHED_LEASE_EXPIRED, |_, s: &State| {
                s.tasks
                    .iter()
                    .any(|r| r.attempts.iter().any(|a| a.state == AttemptState::Expired))
            }),
        ];
        // Witnesses of what only some bounds explore.
        let b = &self.bounds;
        if b.cap > 0 {
            properties.push(Property::always(CAP_HOLDS, |m: &IdemModel, s: &State| {
                cap_holds(s, m.bounds.cap)
            }));
            properties.push(Property::sometimes(
                REACHED_CAPPED,
                |m: &IdemModel, s: &State| capped_task_waits(s, m.bounds.cap),
            ));
        }
        if b.lost > 0 {
            properties.push(Property::sometimes(REACHED_REPEAT, |_, s: &State| {
                s.tasks.iter().any(|r| r.repeat_kept)
            }));
        }
        if b.operator > 0 {
            properties.push(Property::sometimes(REACHED_REVOKED, |_, s: &State| {
                s.tasks.iter().any(|r| {
                    r.task
                        .failure
                        .as_ref()
                        .is_some_and(|f| f.class == FailureClass::PermissionDenied)
                })
            }));
        }
        if b.tasks > b.keys {
            properties.push(Property::sometimes(REACHED_RESUBMIT, |_, s: &State| {
                s.tasks
                    .iter()
                    .enumerate()
                    .any(|(i, r)| s.tasks[..i].iter().any(|e| e.key == r.key))
            }));
        }
        if b.tenants > 1 && b.keys > 1 {
            properties.push(Property::sometimes(
                REACHED_TWO_TENANTS,
                |m: &IdemModel, s: &State| {
                    let tenants: std::collections::HashSet<&str> = s
                        .tasks
                        .iter()
                        .filter(|r| r.task.delivery.is_some())
                        .map(|r| r.task.control.tenant.as_str())
                        .collect();
                    tenants.len() > 1 && m.bounds.tenants > 1
                },
            ));
        }
        properties
    }
}
