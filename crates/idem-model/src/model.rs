//! The protocol as a [`stateright::Model`]: actors, actions, and the
//! properties of SPEC §2 checked over every state the bounds allow.

use std::fmt;

use idem_core::model::{AttemptKind, AttemptState, CancelStatus, TaskState};
use stateright::{Model, Property};

use crate::state::{Executor, Held, State, TaskRow, violation};
use crate::store::{self, Answer, OperatorAction, Reported, SAFE_CLASS, Setup, UNSAFE_CLASS};

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
}

impl Bounds {
    /// The bound `idem verify --ci` explores: one key of the non-safe class,
    /// two executors, three attempts, one crash, one operator action, 2 ticks
    /// (`--classes safe` for the safe class).
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
        }
    }

    /// The bound of the test suite: one key of the non-safe class, two
    /// executors, two attempts, one crash, one operator action, 2 ticks
    /// (about 50,000 distinct states; seconds in a debug build).
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
    /// A client submits under key `key`: the original request, or a changed one.
    Submit {
        /// Key index.
        key: u8,
        /// The request differs in a material field.
        changed: bool,
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
    /// [`store::SetupError`] when the model's own configuration is wrong.
    pub fn new(bounds: Bounds) -> Result<IdemModel, store::SetupError> {
        let classes: Vec<&'static str> = (0..bounds.keys).map(|k| bounds.class_of(k)).collect();
        let setup = Setup::new(&classes)?;
        Ok(IdemModel { bounds, setup })
    }

    /// The state before anything happened.
    pub fn initial(&self) -> State {
        State {
            clock: 0,
            tasks: Vec::new(),
            executors: vec![Executor::Idle; usize::from(self.bounds.executors)],
            ledger: Vec::new(),
            crashes_left: self.bounds.crashes,
            operator_left: self.bounds.operator,
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
                consider(store::tick_of(t.control.ready_at));
            }
            for a in &row.attempts {
                if a.state.is_active() {
                    consider(store::tick_of(a.lease_expires_at));
                }
            }
        }
        next
    }

    /// Applies `action` to a copy of `s`: the new state and the store's
    /// answer, or `None` when the action does not apply.
    pub fn step(&self, s: &State, action: Action) -> Option<(State, Answer)> {
        let mut n = s.clone();
        let now = s.clock;
        let answer = match action {
            Action::Submit { key, changed } => {
                let answer = store::submit(&mut n, &self.setup, key, changed, now);
                if matches!(answer, Answer::Replayed | Answer::Conflict)
                    && (n.tasks != s.tasks || n.ledger != s.ledger)
                {
                    n.violations |= violation::SUBMIT_CHANGED_STORE;
                }
                answer
            }
            Action::Cancel { task } => store::cancel(&mut n, usize::from(task), now),
            Action::AcknowledgeDelivery { task } => {
                store::acknowledge_delivery(&mut n, usize::from(task), now)
            }
            Action::Claim { executor } => {
                let draining = self.draining(s);
                let bound = i64::from(self.bounds.attempts);
                let answer = store::claim(&mut n, usize::from(executor), now, |r| {
                    draining || r.task.attempt_count < bound
                });
                if let (Answer::Leased { kind, .. }, Executor::Holding(h)) =
                    (&answer, &n.executors[usize::from(executor)])
                    && *kind == AttemptKind::Execute
                {
                    let row = &mut n.tasks[usize::from(h.task)];
                    if row.effect_possible && !row.safe() {
                        n.violations |= violation::REPEAT_WITHOUT_RECONCILE;
                    }
                    row.effect_possible = true;
                }
                answer
            }
            Action::Heartbeat { executor } => {
                let held = self.held(s, executor)?.clone();
                let answer = store::heartbeat(&mut n, &held, now);
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
                self.check_stale(s, &mut n, &held);
                answer
            }
            Action::Acknowledge { executor } => {
                let held = self.held(s, executor)?.clone();
                let answer = store::acknowledge(&mut n, &held, now);
                if let Executor::Holding(h) = &mut n.executors[usize::from(executor)] {
                    h.acknowledged = true;
                }
                self.check_stale(s, &mut n, &held);
                answer
            }
            Action::PerformEffect { executor } => {
                let held = self.held(s, executor)?.clone();
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
                let held = self.held(s, executor)?.clone();
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
            Action::Report { executor, what } => {
                let held = self.held(s, executor)?.clone();
                let answer = store::report(&mut n, &held, what, now);
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
                n.executors[usize::from(executor)] = Executor::Idle;
                self.check_stale(s, &mut n, &held);
                answer
            }
            Action::Release { executor } => {
                let held = self.held(s, executor)?.clone();
                let answer = store::release(&mut n, &held, now);
                if answer == Answer::Ok && held.kind == AttemptKind::Execute {
                    // The executor declared, truly, that it never started.
                    n.tasks[usize::from(held.task)].effect_possible = false;
                }
                // Released or refused: either way nothing is left to do.
                n.executors[usize::from(executor)] = Executor::Idle;
                self.check_stale(s, &mut n, &held);
                answer
            }
            Action::Abandon { executor } => {
                self.held(s, executor)?;
                n.executors[usize::from(executor)] = Executor::Idle;
                Answer::Local("its lease ended: the executor stops")
            }
            Action::Crash { executor } => {
                self.held(s, executor)?;
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
            Action::Sweep => store::sweep(&mut n, now),
            Action::Operator { task, action } => {
                n.operator_left = n.operator_left.saturating_sub(1);
                let answer = store::operator(&mut n, &self.setup, usize::from(task), action, now);
                if action == OperatorAction::Resolve
                    && answer == Answer::Ok
                    && !n.ledger[usize::from(task)].applied
                {
                    n.tasks[usize::from(task)].effect_possible = false;
                }
                if matches!(answer, Answer::Refused(_)) {
                    return None;
                }
                answer
            }
        };
        self.check_transition(s, &mut n);
        let changed = n.tasks != s.tasks
            || n.executors != s.executors
            || n.ledger != s.ledger
            || n.clock != s.clock
            || n.violations != s.violations;
        changed.then_some((n, answer))
    }

    fn held<'a>(&self, s: &'a State, executor: u8) -> Option<&'a Held> {
        match s.executors.get(usize::from(executor))? {
            Executor::Holding(h) => Some(h),
            Executor::Idle => None,
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
        let after = &n.tasks[i];
        let same_task = {
            let (a, b) = (&before.task, &after.task);
            a.state == b.state
                && a.generation == b.generation
                && a.usage == b.usage
                && a.cancellation == b.cancellation
                && a.delivery == b.delivery
                && a.failure == b.failure
                && a.control.next_kind == b.control.next_kind
                && a.control.active_attempt_id == b.control.active_attempt_id
                && a.control.ready_at == b.control.ready_at
                && a.control.execute_count == b.control.execute_count
        };
        let same_attempts = before.attempts.len() == after.attempts.len()
            && before.attempts.iter().zip(&after.attempts).all(|(a, b)| {
                a.state == b.state
                    && a.usage == b.usage
                    && a.lease_expires_at == b.lease_expires_at
                    && a.report == b.report
            });
        if !(same_task && same_attempts) {
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
                        changed: false,
                    });
                }
                if held {
                    actions.push(Action::Submit { key, changed: true });
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
                Executor::Holding(h) => h,
            };
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
                    let reports: &[Reported] = if h.effect_done {
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
                    for &what in reports {
                        actions.push(Action::Report { executor, what });
                    }
                }
                AttemptKind::Reconcile => {
                    if live && h.observed.is_none() {
                        actions.push(Action::QueryProvider { executor });
                    }
                    match h.observed {
                        Some(true) => actions.push(Action::Report {
                            executor,
                            what: Reported::Committed,
                        }),
                        Some(false) => actions.push(Action::Report {
                            executor,
                            what: Reported::NotCommitted,
                        }),
                        None => {}
                    }
                    if !draining {
                        actions.push(Action::Report {
                            executor,
                            what: Reported::FailedTransient,
                        });
                        actions.push(Action::Report {
                            executor,
                            what: Reported::Unknown,
                        });
                    }
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
        crate::trace::describe(action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_TASK_PER_SCOPE, |_, s: &State| one_task_per_scope(s)),
            Property::always(SUBMIT_CHANGES_NOTHING, |_, s: &State| {
                s.violations & violation::SUBMIT_CHANGED_STORE == 0
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
        ]
    }
}

/// SPEC §2.1.
pub const ONE_TASK_PER_SCOPE: &str = "one task per scope (SPEC §2.1)";
/// SPEC §2.2, §2.3.
pub const SUBMIT_CHANGES_NOTHING: &str =
    "a replay or a conflicting submit changes nothing (SPEC §2.2, §2.3)";
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
pub const REACHED_RELEASE: &str =
    "reached: a task with a released attempt ends (the attempt given back unstarted)";

fn one_task_per_scope(s: &State) -> bool {
    let mut seen = 0u64;
    for r in s.tasks.iter().filter(|r| r.key_held) {
        let bit = 1u64 << (r.key % 64);
        if seen & bit != 0 {
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
