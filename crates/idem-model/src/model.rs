//! The protocol as a [`stateright::Model`]: actors, actions, and the
//! properties of SPEC §2 checked over every state the bounds allow.

use std::fmt;

use idem_core::machine::operator::Resolution;
use idem_core::model::{AttemptKind, AttemptState, CancelStatus, FailureClass, TaskState};
use idem_store::ops::{
    self, AcknowledgeDelivery, Cancel, Claim, ClaimRequest, Heartbeat, OperatorCancel, Redrive,
    Release, Resolve, RetryNow, RevokeApiKey, Submission, Submit, SubmitOutcome, Sweep,
};
use idem_store::{Refusal, StoreError};
use serde_json::json;
use stateright::{Model, Property};

use crate::memory;
use crate::setup::{
    self, Answer, OperatorAction, Reported, SAFE_CLASS, Sent, Setup, SetupError, TENANTS,
    UNSAFE_CLASS, api_key_id,
};
use crate::state::{Executor, Held, State, TaskRow, violation};

/// Which operation classes the keys use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classes {
    /// Every key is `payment.release` (not safe to repeat).
    Unsafe,
    /// Every key is `generation.dispatch` (safe to repeat).
    Safe,
    /// Keys alternate: key 0 `payment.release`, key 1 `generation.dispatch`, …
    Both,
}

impl std::str::FromStr for Classes {
    type Err = String;
    fn from_str(s: &str) -> Result<Classes, String> {
        match s {
            "unsafe" => Ok(Classes::Unsafe),
            "safe" => Ok(Classes::Safe),
            "both" => Ok(Classes::Both),
            _ => Err(format!("`{s}`: expected unsafe, safe or both")),
        }
    }
}

impl fmt::Display for Classes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Classes::Unsafe => "unsafe",
            Classes::Safe => "safe",
            Classes::Both => "both",
        })
    }
}

/// The bounds of one exploration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds {
    /// Idempotency keys (scopes) clients submit under.
    pub keys: u8,
    /// Tasks the store may accept in all (more than `keys` once retention
    /// released a key and the key is submitted again).
    pub tasks: u8,
    /// Classes of the keys.
    pub classes: Classes,
    /// Executors.
    pub executors: u8,
    /// Attempts (execute and reconcile) executors may claim per task before
    /// the horizon.
    pub attempts: u8,
    /// Executor crashes in all.
    pub crashes: u8,
    /// Operator actions in all.
    pub operator: u8,
    /// Ticks of the clock (100 ms each) during which faults happen; then
    /// the run drains (see [`IdemModel`]).
    pub horizon: u8,
    /// Tenants (1 or 2): key `k` and executor `e` belong to tenant
    /// `k % tenants` and `e % tenants`.
    pub tenants: u8,
    /// Report answers lost in all (the executor sends the same report again).
    pub lost: u8,
}

impl Bounds {
    /// The bound `idem verify --ci` explores: one key of the non-safe class,
    /// one tenant, two executors, three attempts, one crash, one operator
    /// action, no lost report answer, 2 ticks (`--classes safe` for the safe
    /// class).
    pub fn ci() -> Bounds {
        Bounds {
            keys: 1,
            tasks: 1,
            classes: Classes::Unsafe,
            executors: 2,
            attempts: 3,
            crashes: 1,
            operator: 1,
            horizon: 2,
            tenants: 1,
            lost: 0,
        }
    }

    /// The bound of the test suite: one key of the non-safe class, two
    /// executors, two attempts, one crash, one operator action, one lost
    /// report answer, 2 ticks (about 240,000 distinct states; under a
    /// minute of CPU in a debug build).
    pub fn small() -> Bounds {
        Bounds {
            keys: 1,
            tasks: 1,
            classes: Classes::Unsafe,
            executors: 2,
            attempts: 2,
            crashes: 1,
            operator: 1,
            horizon: 2,
            tenants: 1,
            lost: 1,
        }
    }

    /// The class of key `k`.
    pub fn class_of(&self, k: u8) -> &'static str {
        match self.classes {
            Classes::Unsafe => UNSAFE_CLASS,
            Classes::Safe => SAFE_CLASS,
            Classes::Both if k.is_multiple_of(2) => UNSAFE_CLASS,
            Classes::Both => SAFE_CLASS,
        }
    }
}

/// An action of one actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A client submits under key `key`.
    Submit {
        /// Key index.
        key: u8,
        /// Which request.
        sent: Sent,
    },
    /// The client cancels task `task`.
    Cancel {
        /// Task index.
        task: u8,
    },
    /// The client acknowledges the delivery of task `task`.
    AcknowledgeDelivery {
        /// Task index.
        task: u8,
    },
    /// Executor `executor` claims one attempt.
    Claim {
        /// Executor index.
        executor: u8,
    },
    /// The executor heartbeats its attempt.
    Heartbeat {
        /// Executor index.
        executor: u8,
    },
    /// The executor sends the device acknowledgment of its execute attempt.
    Acknowledge {
        /// Executor index.
        executor: u8,
    },
    /// The executor performs the effect at the provider (within its lease).
    PerformEffect {
        /// Executor index.
        executor: u8,
    },
    /// The executor of a reconcile attempt asks the provider's ledger.
    QueryProvider {
        /// Executor index.
        executor: u8,
    },
    /// The executor reports an outcome (late when its lease ran out).
    Report {
        /// Executor index.
        executor: u8,
        /// What it reports.
        what: Reported,
        /// The answer is lost on the way back: the executor sends the
        /// same report again.
        lost: bool,
    },
    /// The executor whose report's answer was lost sends it again, exactly.
    RepeatReport {
        /// Executor index.
        executor: u8,
    },
    /// The executor gives back an attempt it has not started (a worker
    /// shutting down): an execute attempt before the effect and the device
    /// acknowledgment, a reconcile attempt before it asked the ledger.
    Release {
        /// Executor index.
        executor: u8,
    },
    /// The executor stops working on an attempt whose lease it saw end.
    Abandon {
        /// Executor index.
        executor: u8,
    },
    /// The executor crashes and restarts with nothing (before or after the effect).
    Crash {
        /// Executor index.
        executor: u8,
    },
    /// The clock advances.
    Tick,
    /// The sweeper runs.
    Sweep,
    /// An admin revokes tenant `tenant`'s API key (`idem keys revoke`).
    RevokeKey {
        /// Tenant index.
        tenant: u8,
    },
    /// An operator acts on a task.
    Operator {
        /// Task index.
        task: u8,
        /// The action.
        action: OperatorAction,
    },
}

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

impl IdemModel {
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
                if applied && (answer != Answer::Ok || !unchanged(&s.tasks[i], &n.tasks[i])) {
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
            Action::Sweep => match self.run(n, None, &Sweep { limit: 100 }) {
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

    /// SPEC §2.4: a call whose generation no longer holds the lease (an
    /// older generation, or an attempt that ended) changes no task or
    /// attempt; only its evidence is kept.
    fn check_stale(&self, s: &State, n: &mut State, held: &Held) {
        let i = usize::from(held.task);
        let before = &s.tasks[i];
        let holds = held.generation == before.task.generation
            && before.task.control.active_attempt_id == Some(held.attempt_id)
            && before
                .attempts
                .iter()
                .any(|a| a.id == held.attempt_id && a.state.is_active());
        if holds {
            return;
        }
        if !unchanged(before, &n.tasks[i]) {
            n.violations |= violation::STALE_CHANGED_STATE;
        }
    }

    /// Checks every transition: generations and usage never go down, a
    /// delivery record never changes (its acknowledgment aside), and keeps
    /// the ghost counters.
    fn check_transition(&self, s: &State, n: &mut State) {
        for (i, after) in n.tasks.iter_mut().enumerate() {
            let Some(before) = s.tasks.get(i) else {
                continue;
            };
            let (b, a) = (&before.task, &after.task);
            if a.generation < b.generation {
                n.violations |= violation::GENERATION_DECREASED;
            }
            if a.usage < b.usage {
                n.violations |= violation::USAGE_DECREASED;
            }
            match (&b.delivery, &a.delivery) {
                (None, Some(_)) => after.deliveries = after.deliveries.saturating_add(1),
                (Some(x), Some(y)) => {
                    let mut y = y.clone();
                    y.acknowledged_at = x.acknowledged_at;
                    if *x != y {
                        n.violations |= violation::DELIVERY_CHANGED;
                    }
                }
                (Some(_), None) => n.violations |= violation::DELIVERY_CHANGED,
                (None, None) => {}
            }
            let status = |t: &idem_core::model::Task| t.cancellation.as_ref().map(|c| c.status);
            if status(b) == Some(CancelStatus::Requested) {
                match status(a) {
                    Some(CancelStatus::TooLate) => after.cancel_lost_to_delivery = true,
                    Some(CancelStatus::Confirmed) => after.pending_cancel_confirmed = true,
                    _ => {}
                }
            }
        }
    }
}

/// Whether a call left the task and its attempts as they were: every task
/// field a transition decides (state, generation, usage, cancellation,
/// delivery, failure, next attempt, readiness) and every attempt; the
/// evidence it kept aside.
fn unchanged(before: &TaskRow, after: &TaskRow) -> bool {
    let (a, b) = (&before.task, &after.task);
    let same_task = a.state == b.state
        && a.generation == b.generation
        && a.usage == b.usage
        && a.cancellation == b.cancellation
        && a.delivery == b.delivery
        && a.failure == b.failure
        && a.control.next_kind == b.control.next_kind
        && a.control.active_attempt_id == b.control.active_attempt_id
        && a.control.ready_at == b.control.ready_at
        && a.control.execute_count == b.control.execute_count;
    same_task
        && before.attempts.len() == after.attempts.len()
        && before.attempts.iter().zip(&after.attempts).all(|(a, b)| {
            a.state == b.state
                && a.usage == b.usage
                && a.lease_expires_at == b.lease_expires_at
                && a.report == b.report
        })
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
        crate::trace::describe(self, action)
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

/// SPEC §2.1.
pub const ONE_TASK_PER_SCOPE: &str = "one task per scope (SPEC §2.1)";
/// SPEC §2.2, §2.3.
pub const SUBMIT_CHANGES_NOTHING: &str =
    "a replay or a conflicting submit changes nothing (SPEC §2.2, §2.3)";
/// SPEC §2.2, §2.3.
pub const SAME_REQUEST_REPLAYS: &str = "a submit to a taken scope replays exactly the accepted request, and conflicts for any other (SPEC §2.2, §2.3)";
/// SPEC §4 "Details".
pub const REPEAT_ANSWERED_AS_BEFORE: &str =
    "an exact repeat of an applied report is answered as before and changes nothing (SPEC §4)";
/// The in-memory store.
pub const STORE_NEVER_FAILS: &str =
    "every operation commits or refuses: none fails on the in-memory store";
/// SPEC §2.4.
pub const NO_CHANGE_FROM_OLD_GENERATION: &str =
    "no state change from an old generation (SPEC §2.4)";
/// SPEC §2.4.
pub const GENERATIONS_INCREASE: &str = "generations strictly increase (SPEC §2.4)";
/// SPEC §2.6.
pub const DELIVERY_ONCE: &str = "at most one delivery and one charge (SPEC §2.6)";
/// SPEC §2.5 and "not promised".
pub const EFFECT_ONCE: &str = "at most one effect per non-safe task at the provider, and a delivery only for an effect (SPEC §2.5)";
/// SPEC §2.5.
pub const RECONCILE_BEFORE_REPEAT: &str =
    "reconcile before any repeat after an unknown outcome (SPEC §2.5)";
/// SPEC §2.7.
pub const CANCEL_XOR_DELIVERY: &str = "cancellation and delivery never both (SPEC §2.7)";
/// SPEC §2.7, §2.10.
pub const USAGE_KEPT: &str = "usage is kept: never lost, never lowered (SPEC §2.7, §2.10)";
/// Liveness.
pub const EVERY_TASK_ENDS: &str =
    "every task ends terminal once faults stop (liveness, drained runs)";
/// Witness.
pub const REACHED_DELIVERY: &str = "reached: a task is delivered";
/// Witness.
pub const REACHED_RECONCILE: &str = "reached: a reconcile attempt settles an unknown outcome";
/// Witness.
pub const REACHED_STALE_REPORT: &str = "reached: a stale report is kept as evidence";
/// Witness.
pub const REACHED_CANCEL_LOST: &str = "reached: a pending cancellation loses to delivery";
/// Witness.
pub const REACHED_CANCEL_CONFIRMED: &str =
    "reached: a pending cancellation is confirmed after the attempt stopped";
/// Witness.
pub const REACHED_LEASE_EXPIRED: &str = "reached: a lease expires";
/// Witness.
pub const REACHED_REPEAT: &str =
    "reached: a report whose answer was lost is sent again and answered as before";
/// Witness.
pub const REACHED_REVOKED: &str =
    "reached: a task ends at a claim because its submitting key was revoked";
/// Witness.
pub const REACHED_RESUBMIT: &str =
    "reached: a key released after retention is submitted again and makes a new task";
/// Witness.
pub const REACHED_TWO_TENANTS: &str =
    "reached: tasks of two tenants under the same idempotency key are both delivered";
/// Witness.
pub const REACHED_RELEASE: &str =
    "reached: a task with a released attempt ends (the attempt given back unstarted)";

/// No two scope rows of one key, and each names a task of its key.
fn one_task_per_scope(s: &State) -> bool {
    let mut seen = 0u64;
    for sc in &s.scopes {
        let bit = 1u64 << (sc.key % 64);
        let names_own = s
            .task_index(sc.task_id)
            .is_some_and(|i| s.tasks[i].key == sc.key);
        if seen & bit != 0 || !names_own {
            return false;
        }
        seen |= bit;
    }
    true
}

fn generations_increase(s: &State) -> bool {
    s.violations & violation::GENERATION_DECREASED == 0
        && s.tasks.iter().all(|r| {
            r.attempts
                .windows(2)
                .all(|w| w[0].number < w[1].number && w[0].generation < w[1].generation)
                && r.attempts.iter().all(|a| a.generation <= r.task.generation)
        })
}

fn delivery_once(s: &State) -> bool {
    s.violations & violation::DELIVERY_CHANGED == 0
        && s.tasks.iter().all(|r: &TaskRow| {
            r.deliveries <= 1
                && r.task.delivery.as_ref().is_none_or(|d| {
                    d.charge == r.task.contract.price
                        && r.task.cancellation.as_ref().is_none_or(|c| {
                            c.status != CancelStatus::TooLate || c.fee == Some(d.charge)
                        })
                })
        })
}

fn effect_once(s: &State) -> bool {
    s.tasks
        .iter()
        .zip(&s.ledger)
        .all(|(r, l)| (r.safe() || l.repeats == 0) && (r.task.delivery.is_none() || l.applied))
}

fn cancel_xor_delivery(s: &State) -> bool {
    s.tasks.iter().all(|r| {
        let confirmed = r.task.state == TaskState::Cancelled
            || r.task
                .cancellation
                .as_ref()
                .is_some_and(|c| c.status == CancelStatus::Confirmed);
        !(confirmed && r.task.delivery.is_some())
    })
}

fn usage_kept(s: &State) -> bool {
    s.violations & violation::USAGE_DECREASED == 0
        && s.tasks
            .iter()
            .all(|r| r.task.usage == r.attempts.iter().map(|a| a.usage).sum::<i64>())
}
