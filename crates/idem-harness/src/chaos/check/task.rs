//! The checks of one task's records: its event history (typed by kind,
//! [`EventData`]), attempts with their evidence, the provider's effect and
//! what clients were answered about it, against the invariants of SPEC §2.

use idem_core::model::{EventData, EventKind};

use super::*;

/// An event of the history with its data typed by its kind: `None` for a
/// type idem does not know.
struct Typed<'a> {
    event: &'a Event,
    data: Option<EventData>,
}

impl<'a> Typed<'a> {
    fn of(event: &'a Event) -> Typed<'a> {
        let data = event
            .kind
            .parse::<EventKind>()
            .ok()
            .map(|kind| EventData::from_value(kind, event.data.clone()));
        Typed { event, data }
    }

    fn attempt(&self) -> Option<Uuid> {
        self.data.as_ref().and_then(EventData::attempt_id)
    }

    fn generation(&self) -> Option<i64> {
        self.data.as_ref().and_then(EventData::generation)
    }
}

#[allow(clippy::too_many_lines)]
pub(super) fn check_task(
    rec: &TaskRecord,
    effects: &[&Effect],
    paid_in_lease: bool,
    accepted_usage: &HashMap<Uuid, i64>,
    deliveries_seen: &[&DeliverySeen],
    cancels: &[CancelStatus],
    f: &mut Findings,
) {
    let t = &rec.task;
    let s = short(t.id);
    let Some(class) = Class::from_operation(&t.operation) else {
        return;
    };
    let safe = class.is_safe();
    let attempts = &rec.attempts;
    let events = &rec.events;
    let typed: Vec<Typed> = events.iter().map(Typed::of).collect();
    let count = |kind: &str| events.iter().filter(|e| e.kind == kind).count();
    let confirmed = t
        .cancellation
        .as_ref()
        .is_some_and(|c| c.status == CancelStatus::Confirmed);

    // Liveness.
    f.ok(Invariant::Settled, t.state.is_terminal(), || {
        format!("task {s} is still {} after the run quiesced", t.state)
    });

    // §2.10: audit.
    f.ok(
        Invariant::Audit,
        events
            .iter()
            .zip(1..)
            .all(|(e, n): (&Event, i64)| e.seq == n),
        || {
            format!(
                "task {s}: event sequence numbers are not 1..{}",
                events.len()
            )
        },
    );
    f.ok(
        Invariant::Audit,
        typed.first().is_some_and(|e| {
            matches!(&e.data, Some(EventData::TaskSubmitted(d)) if d.fingerprint == t.fingerprint)
        }),
        || format!("task {s}: history does not start with its task_submitted event"),
    );
    for e in &typed {
        f.ok(
            Invariant::Audit,
            !matches!(e.data, Some(EventData::Other(_))),
            || {
                format!(
                    "task {s}: the data of {} (event {}) is not a {0}'s: {}",
                    e.event.kind, e.event.seq, e.event.data
                )
            },
        );
    }
    let leased: HashMap<Uuid, Option<i64>> = typed
        .iter()
        .filter(|e| matches!(e.data, Some(EventData::AttemptLeased(_))))
        .filter_map(|e| e.attempt().map(|a| (a, e.generation())))
        .collect();
    for a in attempts {
        f.ok(
            Invariant::Audit,
            leased.get(&a.id) == Some(&Some(a.generation)),
            || {
                format!(
                    "task {s}: attempt {} has no attempt_leased event with its generation",
                    a.number
                )
            },
        );
    }
    f.ok(
        Invariant::Audit,
        t.delivery.is_none() || count("delivered") > 0,
        || format!("task {s}: delivery without a delivered event"),
    );
    f.ok(
        Invariant::Audit,
        !confirmed || count("cancel_confirmed") > 0,
        || format!("task {s}: confirmed cancellation without a cancel_confirmed event"),
    );
    let stale_evidence = attempts
        .iter()
        .flat_map(|a| &a.evidence)
        .filter(|e| e.disposition.as_deref() == Some("stale_generation") && e.outcome != "ack")
        .count();
    f.ok(
        Invariant::Audit,
        stale_evidence == count("stale_report"),
        || {
            format!(
                "task {s}: {stale_evidence} stale reports kept as evidence but {} stale_report events",
                count("stale_report")
            )
        },
    );

    // §2.4: fencing, from the attempts and their evidence …
    f.ok(
        Invariant::Fencing,
        attempts.first().is_none_or(|a| a.number == 1),
        || format!("task {s}: attempt numbers do not start at 1"),
    );
    for w in attempts.windows(2) {
        f.ok(
            Invariant::Fencing,
            w[1].number == w[0].number + 1 && w[1].generation > w[0].generation,
            || {
                format!(
                    "task {s}: attempt {} (generation {}) follows attempt {} (generation {})",
                    w[1].number, w[1].generation, w[0].number, w[0].generation
                )
            },
        );
    }
    let last_gen = attempts.last().map_or(0, |a| a.generation);
    f.ok(Invariant::Fencing, t.generation >= last_gen, || {
        format!(
            "task {s}: generation {} below its newest attempt's {last_gen}",
            t.generation
        )
    });
    if confirmed && !attempts.is_empty() {
        f.ok(Invariant::Fencing, t.generation > last_gen, || {
            format!("task {s}: the confirmed cancellation did not raise the generation")
        });
    }
    for a in attempts {
        let applied = applied_reports(a);
        f.ok(Invariant::Fencing, applied.len() <= 1, || {
            format!(
                "task {s}: attempt {} has {} applied reports",
                a.number,
                applied.len()
            )
        });
        for e in applied {
            f.ok(Invariant::Fencing, e.generation == a.generation, || {
                format!(
                    "task {s}: attempt {} (generation {}) applied a report of generation {}",
                    a.number, a.generation, e.generation
                )
            });
        }
        if matches!(a.state, AttemptState::Leased | AttemptState::Acknowledged) {
            f.ok(
                Invariant::Fencing,
                !t.state.is_terminal() && attempts.last().is_some_and(|l| l.id == a.id),
                || {
                    format!(
                        "task {s}: attempt {} still holds a lease while the task is {} with {} attempts",
                        a.number,
                        t.state,
                        attempts.len()
                    )
                },
            );
        }
    }
    // … and from the event history: every state change comes from the current
    // generation's live attempt, nothing changes after a terminal transition.
    let mut current = 0i64;
    let mut active: Option<Uuid> = None;
    let mut terminal: Option<&str> = None;
    let mut executes_before_cancel = 0;
    let mut execute_count = 0;
    for te in &typed {
        let (e, aid, g) = (te.event, te.attempt(), te.generation());
        // A store that went back in time ends the attempt it knew (SPEC
        // §2.11): the event that moved the task on names it.
        let ended = te.data.as_ref().and_then(EventData::ended_attempt_id);
        if ended.is_some() && ended == active {
            active = None;
        }
        match &te.data {
            Some(EventData::AttemptLeased(leased)) => {
                let g = g.unwrap_or(-1);
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: attempt leased (event {}) after the task was {}",
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                f.ok(Invariant::Fencing, active.is_none(), || {
                    format!(
                        "task {s}: attempt leased (event {}) while another attempt held the lease",
                        e.seq
                    )
                });
                f.ok(Invariant::Fencing, g > current, || {
                    format!(
                        "task {s}: attempt leased with generation {g}, not above {current} (event {})",
                        e.seq
                    )
                });
                current = current.max(g);
                active = aid;
                if leased.kind == idem_core::model::AttemptKind::Execute {
                    execute_count += 1;
                }
            }
            Some(EventData::LeaseExpired(_)) if active.is_some() && active == aid => active = None,
            // A release gives back an attempt that never started: only the
            // live attempt's current generation may, and it is no execute
            // attempt for the cancellation fee (nor for any limit).
            Some(EventData::AttemptReleased(released)) => {
                f.ok(
                    Invariant::Fencing,
                    aid.is_some() && aid == active && g == Some(current) && terminal.is_none(),
                    || {
                        format!(
                            "task {s}: attempt_released (event {}) of generation {} of attempt {} while generation {current} {} held the lease",
                            e.seq,
                            g.map_or_else(|| "?".into(), |g| g.to_string()),
                            aid.map_or_else(|| "?".into(), short),
                            active.map_or_else(|| "(no attempt)".into(), short),
                        )
                    },
                );
                if released.kind == idem_core::model::AttemptKind::Execute {
                    execute_count -= 1;
                }
                active = None;
            }
            Some(
                EventData::CompletionObserved(_)
                | EventData::Reconciled(_)
                | EventData::AttemptFailed(_)
                | EventData::OutcomeUnknown(_)
                | EventData::AttemptCancelled(_),
            ) => {
                f.ok(
                    Invariant::Fencing,
                    aid.is_some() && aid == active && g == Some(current),
                    || {
                        format!(
                            "task {s}: {} (event {}) applied a report of generation {} of attempt {} while generation {current} {} held the lease",
                            e.kind,
                            e.seq,
                            g.map_or_else(|| "?".into(), |g| g.to_string()),
                            aid.map_or_else(|| "?".into(), short),
                            active.map_or_else(|| "(no attempt)".into(), short),
                        )
                    },
                );
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: {} (event {}) after the task was {}",
                        e.kind,
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                active = None;
            }
            Some(EventData::CancelConfirmed(_)) => {
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: cancellation confirmed after the task was {}",
                        terminal.unwrap_or("?")
                    )
                });
                if let Some(g) = g {
                    f.ok(Invariant::Fencing, g > current, || {
                        format!("task {s}: cancellation set generation {g}, not above {current}")
                    });
                    current = current.max(g);
                }
                terminal = Some("cancelled");
                active = None;
                executes_before_cancel = execute_count;
            }
            Some(EventData::Delivered(_)) => {
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: delivered (event {}) after the task was {}",
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                terminal = Some("delivered");
            }
            Some(EventData::TaskFailed(_)) => {
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: failed (event {}) after the task was {}",
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                terminal = Some("failed");
            }
            _ => {}
        }
    }
    f.ok(Invariant::Fencing, t.generation == current, || {
        format!(
            "task {s}: generation {} but its history says {current}",
            t.generation
        )
    });

    // §2.5: reconciliation before any repeat; failure classes decide retries.
    for w in attempts.windows(2) {
        let (p, c) = (&w[0], &w[1]);
        let must_reconcile = match (p.kind, p.state) {
            (AttemptKind::Execute, AttemptState::Unknown) => true,
            (AttemptKind::Execute, AttemptState::Expired) => !safe,
            (AttemptKind::Reconcile, st) => st != AttemptState::NotCommitted,
            _ => false,
        };
        f.ok(
            Invariant::ReconcileBeforeRepeat,
            !(must_reconcile && c.kind == AttemptKind::Execute),
            || {
                format!(
                    "task {s}: execute attempt {} follows {} attempt {} ({}) without not_committed",
                    c.number, p.kind, p.number, p.state
                )
            },
        );
        f.ok(
            Invariant::ReconcileBeforeRepeat,
            !matches!(
                p.state,
                AttemptState::Succeeded | AttemptState::Committed | AttemptState::Cancelled
            ),
            || {
                format!(
                    "task {s}: attempt {} follows attempt {} which ended the task ({})",
                    c.number, p.number, p.state
                )
            },
        );
        if p.kind == AttemptKind::Execute && p.state == AttemptState::Failed {
            let class_name = failure_class(p).unwrap_or_default();
            let never = class_name == FailureClass::InvalidInput.as_str()
                || class_name == FailureClass::PermissionDenied.as_str()
                || (!safe && class_name == FailureClass::Transient.as_str());
            f.ok(Invariant::ReconcileBeforeRepeat, !never, || {
                format!(
                    "task {s}: attempt {} retried a `{class_name}` failure of attempt {} automatically",
                    c.number, p.number
                )
            });
        }
    }

    // §2.6: one delivery, one charge; idem and the provider agree.
    f.ok(
        Invariant::OneDeliveryOneCharge,
        count("delivered") <= 1,
        || format!("task {s}: {} delivered events", count("delivered")),
    );
    f.ok(
        Invariant::OneDeliveryOneCharge,
        t.delivery.is_some() == (t.state == TaskState::Succeeded),
        || {
            format!(
                "task {s}: state {} with delivery {}",
                t.state,
                t.delivery.is_some()
            )
        },
    );
    if let Some(d) = &t.delivery {
        f.ok(
            Invariant::OneDeliveryOneCharge,
            d.charge == t.contract.price,
            || {
                format!(
                    "task {s}: charged {} instead of the price {}",
                    d.charge, t.contract.price
                )
            },
        );
        if effects.is_empty() {
            f.ok(Invariant::OneDeliveryOneCharge, false, || {
                format!("task {s}: delivered without any effect at the provider")
            });
        } else {
            f.ok(
                Invariant::OneDeliveryOneCharge,
                effects
                    .iter()
                    .any(|e| d.external_txn_id.as_deref() == Some(e.txn.as_str())),
                || {
                    let txns: Vec<&str> = effects.iter().map(|e| e.txn.as_str()).collect();
                    format!(
                        "task {s}: delivered transaction {:?} but the provider recorded {}",
                        d.external_txn_id,
                        txns.join(", ")
                    )
                },
            );
        }
        if let Some(c) = &t.cancellation
            && c.status == CancelStatus::TooLate
        {
            f.ok(
                Invariant::OneDeliveryOneCharge,
                c.fee == Some(d.charge),
                || {
                    format!(
                        "task {s}: cancel too late after delivery with fee {:?}, not the charge {}",
                        c.fee, d.charge
                    )
                },
            );
        }
        for seen in deliveries_seen {
            f.ok(
                Invariant::OneDeliveryOneCharge,
                seen.external_txn_id == d.external_txn_id
                    && seen.charge == d.charge
                    && seen.delivered_at == d.delivered_at,
                || {
                    format!(
                        "task {s}: a replay answered another delivery record than the final one"
                    )
                },
            );
        }
    } else {
        f.ok(
            Invariant::OneDeliveryOneCharge,
            deliveries_seen.is_empty(),
            || format!("task {s}: a replay showed a delivery the task no longer has"),
        );
    }
    // Effects an executor asked for within its lease: idem must deliver
    // them (a stale payer's are raised as suspected second effects instead).
    if paid_in_lease && !safe && t.state.is_terminal() {
        f.ok(
            Invariant::OneDeliveryOneCharge,
            t.delivery.is_some(),
            || {
                let txns: Vec<&str> = effects.iter().map(|e| e.txn.as_str()).collect();
                format!(
                    "task {s}: the provider paid {} but the task ended {} without delivery",
                    txns.join(", "),
                    t.state
                )
            },
        );
    }

    // §2.7: cancellation and delivery never both.
    f.ok(
        Invariant::CancelOrDeliver,
        !(confirmed && t.delivery.is_some()),
        || format!("task {s}: both cancelled (confirmed) and delivered"),
    );
    f.ok(
        Invariant::CancelOrDeliver,
        confirmed == (t.state == TaskState::Cancelled),
        || {
            format!(
                "task {s}: state {} with cancellation {:?}",
                t.state,
                t.cancellation.as_ref().map(|c| c.status)
            )
        },
    );
    f.ok(
        Invariant::CancelOrDeliver,
        count("delivered") == 0 || count("cancel_confirmed") == 0,
        || format!("task {s}: history has both delivered and cancel_confirmed"),
    );
    if !safe && confirmed {
        f.ok(Invariant::CancelOrDeliver, !paid_in_lease, || {
            format!("task {s}: cancelled although the provider paid it")
        });
    }
    for c in cancels {
        match c {
            CancelStatus::Confirmed => {
                f.ok(
                    Invariant::CancelOrDeliver,
                    t.state == TaskState::Cancelled,
                    || {
                        format!(
                            "task {s}: a cancel was answered `confirmed` but the task ended {}",
                            t.state
                        )
                    },
                );
            }
            CancelStatus::TooLate => {
                f.ok(
                    Invariant::CancelOrDeliver,
                    t.state != TaskState::Cancelled,
                    || format!("task {s}: a cancel was answered `too_late` but the task ended cancelled"),
                );
            }
            _ => {}
        }
    }

    // §2.7: usage kept.
    let sum: i64 = attempts.iter().map(|a| a.usage).sum();
    f.ok(Invariant::UsageKept, t.usage == sum, || {
        format!("task {s}: usage {} but its attempts used {sum}", t.usage)
    });
    for a in attempts {
        if let Some(u) = accepted_usage.get(&a.id) {
            f.ok(Invariant::UsageKept, a.usage >= *u, || {
                format!(
                    "task {s}: attempt {} shows usage {} though {u} was accepted",
                    a.number, a.usage
                )
            });
        }
    }
    let cancel_confirmed = typed.iter().find_map(|e| match &e.data {
        Some(EventData::CancelConfirmed(d)) => Some(d),
        _ => None,
    });
    if confirmed && let Some(ev) = cancel_confirmed {
        let usage = Some(ev.usage);
        f.ok(Invariant::UsageKept, usage == Some(t.usage), || {
            format!(
                "task {s}: cancellation recorded usage {usage:?} but the task has {}",
                t.usage
            )
        });
        let fee = |k: &str| t.contract.fees.get(k).and_then(Value::as_i64);
        let expected = if executes_before_cancel == 0 {
            fee("cancel_before_start")
        } else {
            fee("cancel_after_start_fixed")
                .zip(fee("usage_unit_price"))
                .map(|(fixed, unit)| fixed + t.usage * unit)
        };
        if let Some(expected) = expected {
            let got = t.cancellation.as_ref().and_then(|c| c.fee);
            f.ok(Invariant::UsageKept, got == Some(expected), || {
                format!("task {s}: cancellation fee {got:?}, the frozen fees say {expected}")
            });
        }
    }
}
