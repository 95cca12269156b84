//! The model explored at the test suite's bound ([`Bounds::small`]): no
//! counterexample, every witness reached, and liveness actually evaluated;
//! built with a seeded defect (idem-core's `--features broken-fencing`,
//! `--features broken-reconcile`, idem-store's `--features
//! broken-same-request`), the counterexample the defect causes, for the
//! property it breaks, printed as a trace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_model::check::{Options, Report, Strategy, Verdict};
use idem_model::{Bounds, Classes, properties};

/// Explores `bounds` to the end (every property's verdict is final).
#[cfg_attr(
    feature = "broken-caps",
    allow(
        dead_code,
        reason = "the broken-caps test explores the caps bound only"
    )
)]
fn explore(bounds: Bounds) -> Report {
    let report = idem_model::run(&Options {
        bounds,
        threads: 2,
        strategy: Strategy::Bfs,
        stop_at_first: false,
    })
    .unwrap();
    eprintln!(
        "{} distinct states, {} generated, depth {}, {:?}",
        report.distinct_states, report.generated_states, report.max_depth, report.elapsed
    );
    report
}

fn verdict<'r>(report: &'r Report, name: &str) -> &'r Verdict {
    &report
        .properties
        .iter()
        .find(|p| p.name == name)
        .unwrap()
        .verdict
}

/// The bound of the concurrency key cap: two tasks of one concurrency key
/// (two idempotency keys, one tenant, the safe class), two executors, a cap
/// of 1, one attempt per task before the horizon, 2 ticks (lease expiries,
/// releases and the clients' cancels among the choices), `operator`
/// operator actions.
fn caps_bound(operator: u8) -> Bounds {
    Bounds {
        keys: 2,
        tasks: 2,
        classes: Classes::Safe,
        executors: 2,
        attempts: 1,
        crashes: 0,
        operator,
        horizon: 2,
        tenants: 1,
        lost: 0,
        cap: 1,
    }
}

/// The caps bound explored to the end, depth first (memory for one path).
fn explore_caps(operator: u8) -> Report {
    let report = idem_model::run(&Options {
        bounds: caps_bound(operator),
        threads: 2,
        // With the seeded defect, the first counterexample is the answer.
        strategy: if cfg!(feature = "broken-caps") {
            Strategy::Bfs
        } else {
            Strategy::Dfs
        },
        stop_at_first: cfg!(feature = "broken-caps"),
    })
    .unwrap();
    eprintln!(
        "caps bound, operator {operator}: {} distinct states, {} generated, depth {}, {:?}",
        report.distinct_states, report.generated_states, report.max_depth, report.elapsed
    );
    report
}

/// The caps bound without operator actions, once per test binary.
fn caps_report() -> &'static Report {
    static REPORT: std::sync::OnceLock<Report> = std::sync::OnceLock::new();
    REPORT.get_or_init(|| explore_caps(0))
}

/// Every invariant holds and the cap's witnesses are reached (the checks
/// of the sound build: none with a seeded defect).
#[cfg(not(any(
    feature = "broken-fencing",
    feature = "broken-reconcile",
    feature = "broken-same-request",
    feature = "broken-caps"
)))]
fn assert_caps_sound(report: &Report) {
    assert!(!report.stopped_early);
    for p in &report.properties {
        if let Verdict::Counterexample { trace } = &p.verdict {
            panic!("{trace}");
        }
        if p.kind != "sometimes" {
            assert_eq!(p.verdict, Verdict::Held, "{}", p.name);
        }
    }
    for name in [
        properties::REACHED_CAPPED,
        properties::REACHED_LEASE_EXPIRED,
        properties::REACHED_RELEASE,
        properties::REACHED_DELIVERY,
    ] {
        assert_eq!(verdict(report, name), &Verdict::Reached, "{name}");
    }
    assert_eq!(verdict(report, properties::CAP_HOLDS), &Verdict::Held);
}

#[cfg(not(any(
    feature = "broken-fencing",
    feature = "broken-reconcile",
    feature = "broken-same-request",
    feature = "broken-caps"
)))]
mod sound {
    use std::sync::OnceLock;

    use idem_model::Action;
    use idem_model::model::IdemModel;
    use idem_model::setup::{Answer, OperatorAction, Sent};
    use idem_model::state::Reported;
    use idem_model::state::State;
    use stateright::Model;

    use super::*;

    /// One exploration of the small bound, shared by the tests that read it.
    fn small() -> &'static Report {
        static REPORT: OnceLock<Report> = OnceLock::new();
        REPORT.get_or_init(|| explore(Bounds::small()))
    }

    #[test]
    fn the_small_bound_has_no_counterexample() {
        let report = small();
        assert!(
            report.distinct_states > 10_000,
            "{}",
            report.distinct_states
        );
        assert!(!report.stopped_early);
        for p in &report.properties {
            if let Verdict::Counterexample { trace } = &p.verdict {
                panic!("{trace}");
            }
            if p.kind != "sometimes" {
                assert_eq!(p.verdict, Verdict::Held, "{}", p.name);
            }
        }
    }

    /// The `sometimes` properties: deliveries, reconciliations, stale
    /// reports kept, cancellations racing delivery both ways, expired
    /// leases, released attempts, a repeated report answered as before and
    /// a task ended by its key's revocation all happen within the bound, so
    /// the invariants are not checked over a model where nothing
    /// interesting happens.
    #[test]
    fn every_witness_is_reached() {
        let report = small();
        let witnesses: Vec<_> = report
            .properties
            .iter()
            .filter(|p| p.kind == "sometimes")
            .collect();
        assert_eq!(witnesses.len(), 9);
        for p in witnesses {
            assert_eq!(p.verdict, Verdict::Reached, "{}", p.name);
        }
    }

    fn walk(m: &IdemModel, actions: &[Action]) -> State {
        let mut s = m.initial();
        for a in actions {
            s = m
                .next_state(&s, *a)
                .unwrap_or_else(|| panic!("{a:?} does not apply"));
        }
        s
    }

    /// Two tasks of one concurrency key, cap 1: never two leased at once,
    /// every other property holds, and the cap is reached with the other
    /// task waiting, as are lease expiries and releases.
    #[test]
    #[cfg_attr(
        debug_assertions,
        ignore = "about 4.4 million states: run in a release build"
    )]
    fn the_caps_bound_has_no_counterexample() {
        assert_caps_sound(caps_report());
    }

    /// The same with an operator action (retry-now, cancel, resolve,
    /// redrive, a key revocation) among the choices; long in a debug build
    /// (`cargo test --release -p idem-model --test explore -- --ignored caps`).
    #[test]
    #[ignore = "long: run in a release build"]
    fn the_caps_bound_with_an_operator_has_no_counterexample() {
        let report = explore_caps(1);
        assert_caps_sound(&report);
        assert_eq!(
            verdict(&report, properties::REACHED_REVOKED),
            &Verdict::Reached
        );
    }

    /// The operator's retry-now, resolve and redrive are offered on a task
    /// in any state, and `machine::operator` refuses them where they do not
    /// apply: no successor, so its preconditions are what is checked.
    #[test]
    fn operator_actions_are_offered_in_every_state_and_refused_by_the_machine() {
        let m = IdemModel::new(Bounds::small()).unwrap();
        let s = walk(
            &m,
            &[
                Action::Submit {
                    key: 0,
                    sent: Sent::Original,
                },
                Action::Claim { executor: 0 },
            ],
        );
        assert_eq!(s.tasks[0].task.state, idem_core::model::TaskState::Running);
        let mut offered = Vec::new();
        m.actions(&s, &mut offered);
        for action in [
            OperatorAction::RetryNow,
            OperatorAction::Resolve,
            OperatorAction::Redrive,
        ] {
            let a = Action::Operator { task: 0, action };
            assert!(offered.contains(&a), "{a:?} not offered");
            assert!(
                m.next_state(&s, a).is_none(),
                "{a:?} applied to a running task"
            );
        }
    }

    /// The steps of `actions` from the initial state, with the store's answers.
    fn answers(m: &IdemModel, actions: &[Action]) -> (State, Vec<Answer>) {
        let mut s = m.initial();
        let mut out = Vec::new();
        for a in actions {
            let (n, answer) = m
                .step(&s, *a)
                .unwrap_or_else(|| panic!("{a:?} does not apply"));
            out.push(answer);
            s = n;
        }
        (s, out)
    }

    /// Submits run `ops::Submit`: the original request again and the same
    /// request fingerprinted under a changed configuration are replays
    /// (`same_request_as_accepted`), a changed request a conflict, and
    /// none of them writes.
    #[test]
    fn submits_replay_the_accepted_request_and_conflict_for_another() {
        let m = IdemModel::new(Bounds::small()).unwrap();
        let submit = |sent| Action::Submit { key: 0, sent };
        let mut s = m.initial();
        let (n, created) = m.step(&s, submit(Sent::Original)).unwrap();
        assert_eq!(created, Answer::Created);
        s = n;
        for (sent, answer) in [
            (Sent::Original, Answer::Replayed),
            (Sent::Reconfigured, Answer::Replayed),
            (Sent::Changed, Answer::Conflict),
        ] {
            // Nothing changed: no successor state.
            assert!(m.step(&s, submit(sent)).is_none(), "{sent:?}");
            let (after, got) = m.outcome(&s, submit(sent)).unwrap();
            assert_eq!(got, answer, "{sent:?}");
            assert_eq!(after, s, "{sent:?}");
        }
    }

    /// A revoked key (`ops::RevokeApiKey`): its submits are refused, and its
    /// queued task ends `permission_denied` at the next claim.
    #[test]
    fn a_revoked_key_is_refused_and_its_task_ends_at_the_claim() {
        let m = IdemModel::new(Bounds {
            keys: 2,
            tasks: 2,
            ..Bounds::small()
        })
        .unwrap();
        let (s, got) = answers(
            &m,
            &[
                Action::Submit {
                    key: 0,
                    sent: Sent::Original,
                },
                Action::RevokeKey { tenant: 0 },
                Action::Claim { executor: 0 },
            ],
        );
        assert_eq!(got[1], Answer::Ok);
        assert_eq!(got[2], Answer::EndedInstead);
        let t = &s.tasks[0].task;
        assert_eq!(t.state, idem_core::model::TaskState::Failed);
        assert_eq!(
            t.failure.as_ref().map(|f| f.class),
            Some(idem_core::model::FailureClass::PermissionDenied)
        );
        let (after, got) = m
            .outcome(
                &s,
                Action::Submit {
                    key: 1,
                    sent: Sent::Original,
                },
            )
            .unwrap();
        assert_eq!(got, Answer::KeyRevoked);
        assert_eq!(after, s, "a revoked key's submit wrote");
    }

    /// An exact repeat of an applied report (its answer lost) is answered
    /// `ok`, changes nothing, and its evidence is kept as a repeat.
    #[test]
    fn a_repeated_report_is_answered_as_before() {
        let m = IdemModel::new(Bounds::small()).unwrap();
        let (s, got) = answers(
            &m,
            &[
                Action::Submit {
                    key: 0,
                    sent: Sent::Original,
                },
                Action::Claim { executor: 0 },
                Action::PerformEffect { executor: 0 },
                Action::Report {
                    executor: 0,
                    what: Reported::Succeeded,
                    lost: true,
                },
                Action::RepeatReport { executor: 0 },
            ],
        );
        assert_eq!(got[3], Answer::Ok);
        assert_eq!(got[4], Answer::Ok);
        assert!(s.tasks[0].repeat_kept);
        assert_eq!(s.violations, 0);
        assert_eq!(
            s.tasks[0].task.state,
            idem_core::model::TaskState::Succeeded
        );
    }

    /// Ids come from `Tx::new_id`: the same history gives the same ids, and
    /// they count up from 1 (task, then its attempt).
    #[test]
    fn ids_are_the_same_for_the_same_history() {
        let m = IdemModel::new(Bounds::small()).unwrap();
        let history = [
            Action::Submit {
                key: 0,
                sent: Sent::Original,
            },
            Action::Claim { executor: 1 },
        ];
        let a = walk(&m, &history);
        let b = walk(&m, &history);
        assert_eq!(a, b);
        assert_eq!(a.tasks[0].task.id, uuid::Uuid::from_u128(1));
        assert_eq!(a.tasks[0].attempts[0].id, uuid::Uuid::from_u128(2));
    }

    /// Liveness is evaluated: a drained run ends in a state with no
    /// successor (stateright checks `eventually` there), with every task terminal.
    #[test]
    fn drained_runs_end_and_liveness_is_checked_there() {
        let m = IdemModel::new(Bounds::small()).unwrap();
        let s = walk(
            &m,
            &[
                Action::Submit {
                    key: 0,
                    sent: Sent::Original,
                },
                Action::Claim { executor: 0 },
                Action::PerformEffect { executor: 0 },
                Action::Report {
                    executor: 0,
                    what: Reported::Succeeded,
                    lost: false,
                },
                Action::Tick,
                Action::Tick,
            ],
        );
        assert!(m.draining(&s));
        assert!(m.next_states(&s).is_empty(), "{:#?}", m.next_states(&s));
        let live = m
            .properties()
            .into_iter()
            .find(|p| p.name == properties::EVERY_TASK_ENDS)
            .unwrap();
        assert!((live.condition)(&m, &s));
    }

    /// The liveness property can fail: with no executor, a submitted task
    /// never ends, and the checker says so with a trace.
    #[test]
    fn liveness_fails_without_executors() {
        let report = explore(Bounds {
            executors: 0,
            classes: Classes::Safe,
            ..Bounds::small()
        });
        match verdict(&report, properties::EVERY_TASK_ENDS) {
            Verdict::Counterexample { trace } => {
                assert!(trace.contains("client: submit under key-0"), "{trace}");
                assert!(trace.contains("queued"), "{trace}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// The hash leaves out only bookkeeping no transition reads: states
    /// that differ in it are one state; states that differ in a field a
    /// transition reads are two.
    #[test]
    fn the_state_hash_covers_what_transitions_read() {
        use std::hash::{DefaultHasher, Hash, Hasher};
        fn hash(s: &State) -> u64 {
            let mut h = DefaultHasher::new();
            s.hash(&mut h);
            h.finish()
        }
        let m = IdemModel::new(Bounds::small()).unwrap();
        let s = walk(
            &m,
            &[
                Action::Submit {
                    key: 0,
                    sent: Sent::Original,
                },
                Action::Claim { executor: 0 },
            ],
        );
        let mut bookkeeping = s.clone();
        bookkeeping.tasks[0].task.control.version += 7;
        bookkeeping.tasks[0].task.control.event_seq += 7;
        assert_eq!(hash(&s), hash(&bookkeeping));
        assert_ne!(s, bookkeeping);
        let mut read = s.clone();
        read.tasks[0].attempts[0].lease_expires_at.0 += 1;
        assert_ne!(hash(&s), hash(&read));
        let mut read = s.clone();
        read.tasks[0].task.control.ready_at.0 += 1;
        assert_ne!(hash(&s), hash(&read));
    }
}

/// Fencing off (idem-core `broken-fencing`): a report from a retired
/// attempt changes the task.
#[cfg(feature = "broken-fencing")]
#[test]
fn broken_fencing_is_found() {
    let report = explore(Bounds::small());
    match verdict(&report, properties::NO_CHANGE_FROM_OLD_GENERATION) {
        Verdict::Counterexample { trace } => {
            eprintln!("{trace}");
            assert!(trace.contains(". client: submit under key-0"), "{trace}");
            assert!(trace.contains("generation"), "{trace}");
            assert!(trace.ends_with(&format!(
                "property failed: {}\n",
                properties::NO_CHANGE_FROM_OLD_GENERATION
            )));
        }
        other => panic!("{other:?}"),
    }
}

/// Unknown outcomes retried without reconciliation (idem-core
/// `broken-reconcile`): an execute attempt is leased after an unknown
/// outcome, and the provider receives the effect twice.
#[cfg(feature = "broken-reconcile")]
#[test]
fn broken_reconcile_is_found() {
    let report = explore(Bounds::small());
    for name in [properties::RECONCILE_BEFORE_REPEAT, properties::EFFECT_ONCE] {
        match verdict(&report, name) {
            Verdict::Counterexample { trace } => {
                eprintln!("{trace}");
                assert!(trace.contains("report `unknown`"), "{trace}");
                assert!(trace.ends_with(&format!("property failed: {name}\n")));
            }
            other => panic!("{name}: {other:?}"),
        }
    }
}

/// The request comparison broken (idem-store `broken-same-request`): a
/// changed request under a taken scope is answered as a replay of the task
/// accepted for another one.
#[cfg(feature = "broken-same-request")]
#[test]
fn broken_same_request_is_found() {
    let report = explore(Bounds::small());
    match verdict(&report, properties::SAME_REQUEST_REPLAYS) {
        Verdict::Counterexample { trace } => {
            eprintln!("{trace}");
            assert!(
                trace.contains("client: submit under key-0 (the original request) → 201 created"),
                "{trace}"
            );
            assert!(
                trace.contains(
                    "(a changed request: same key, other amount) → replay of the original task"
                ),
                "{trace}"
            );
            assert!(trace.ends_with(&format!(
                "property failed: {}\n",
                properties::SAME_REQUEST_REPLAYS
            )));
        }
        other => panic!("{other:?}"),
    }
}

/// Claims that take no cap slot (idem-store `broken-caps`): the second
/// task of the concurrency key is leased while the first holds the cap.
#[cfg(feature = "broken-caps")]
#[test]
fn broken_caps_is_found() {
    match verdict(caps_report(), properties::CAP_HOLDS) {
        Verdict::Counterexample { trace } => {
            eprintln!("{trace}");
            assert!(trace.matches(": claim").count() >= 2, "{trace}");
            assert!(trace.ends_with(&format!("property failed: {}\n", properties::CAP_HOLDS)));
        }
        other => panic!("{other:?}"),
    }
}
