//! The checker: the invariants of SPEC §2 verified against the event histories,
//! the attempts with their evidence, the clients' log of answers and the
//! provider's ledger, with counts of checked and violated cases per invariant.

use super::*;

/// The invariants the checker verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// §2.1–2.2: one scope, one task; replays name it.
    OneScopeOneTask,
    /// §2.3: a conflicting request is refused and never executed.
    ConflictExecutesNothing,
    /// §2.4: no state change from an old generation.
    Fencing,
    /// §2.5: reconciliation before any repeat after an unknown outcome; no automatic retry of permanent failures.
    ReconcileBeforeRepeat,
    /// §2.6: at most one delivery, one charge and one payout per task; idem and the provider agree.
    OneDeliveryOneCharge,
    /// §2.7: cancellation and delivery never both win.
    CancelOrDeliver,
    /// §2.7: usage is kept (task total = attempts), fees follow it.
    UsageKept,
    /// §2.10: the event history is complete and gap-free.
    Audit,
    /// Every task reached a terminal state after the faults stopped.
    Settled,
}

impl Invariant {
    /// Every invariant, in report order.
    pub const ALL: [Invariant; 9] = [
        Invariant::OneScopeOneTask,
        Invariant::ConflictExecutesNothing,
        Invariant::Fencing,
        Invariant::ReconcileBeforeRepeat,
        Invariant::OneDeliveryOneCharge,
        Invariant::CancelOrDeliver,
        Invariant::UsageKept,
        Invariant::Audit,
        Invariant::Settled,
    ];

    /// Machine name.
    pub fn name(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "one_scope_one_task",
            Invariant::ConflictExecutesNothing => "conflict_executes_nothing",
            Invariant::Fencing => "no_state_change_from_old_generation",
            Invariant::ReconcileBeforeRepeat => "reconcile_before_repeat",
            Invariant::OneDeliveryOneCharge => "one_delivery_one_charge",
            Invariant::CancelOrDeliver => "cancel_xor_delivery",
            Invariant::UsageKept => "usage_kept",
            Invariant::Audit => "audit_history_complete",
            Invariant::Settled => "all_tasks_settled",
        }
    }

    /// SPEC section.
    pub fn spec(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "§2.1-2.2",
            Invariant::ConflictExecutesNothing => "§2.3",
            Invariant::Fencing => "§2.4",
            Invariant::ReconcileBeforeRepeat => "§2.5",
            Invariant::OneDeliveryOneCharge => "§2.6",
            Invariant::CancelOrDeliver | Invariant::UsageKept => "§2.7",
            Invariant::Audit => "§2.10",
            Invariant::Settled => "liveness",
        }
    }

    /// Plain statement.
    pub fn title(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "one task per scope; every answer names it",
            Invariant::ConflictExecutesNothing => {
                "a changed request is refused and never executed or paid"
            }
            Invariant::Fencing => "reports of old generations change no state",
            Invariant::ReconcileBeforeRepeat => {
                "no repeat after an unknown outcome without not_committed"
            }
            Invariant::OneDeliveryOneCharge => "at most one delivery, charge and payout per task",
            Invariant::CancelOrDeliver => "cancellation and delivery never both win",
            Invariant::UsageKept => "usage is kept and fees follow it",
            Invariant::Audit => "event history complete and gap-free",
            Invariant::Settled => "every task terminal after the run",
        }
    }
}

/// The result of one invariant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InvariantResult {
    /// Machine name.
    pub name: &'static str,
    /// SPEC section.
    pub spec: &'static str,
    /// Plain statement.
    pub title: &'static str,
    /// Individual checks made.
    pub checked: u64,
    /// Checks that failed.
    pub violations: u64,
    /// Up to 8 failed checks, described.
    pub examples: Vec<String>,
}

#[derive(Default)]
struct Findings(BTreeMap<Invariant, (u64, u64, Vec<String>)>);

impl Findings {
    fn ok(&mut self, inv: Invariant, cond: bool, why: impl FnOnce() -> String) {
        let e = self.0.entry(inv).or_default();
        e.0 += 1;
        if !cond {
            e.1 += 1;
            if e.2.len() < 8 {
                e.2.push(why());
            }
        }
    }

    fn results(mut self) -> Vec<InvariantResult> {
        Invariant::ALL
            .iter()
            .map(|inv| {
                let (checked, violations, examples) = self.0.remove(inv).unwrap_or_default();
                InvariantResult {
                    name: inv.name(),
                    spec: inv.spec(),
                    title: inv.title(),
                    checked,
                    violations,
                    examples,
                }
            })
            .collect()
    }
}

/// A task or attempt id as printed in findings (the full id: UUID v7 prefixes
/// are timestamps shared by the whole run; `idem task show ID` takes it as is).
fn short(id: Uuid) -> String {
    id.to_string()
}

fn event_attempt(e: &Event) -> Option<Uuid> {
    e.data
        .get("attempt_id")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
}

fn event_generation(e: &Event) -> Option<i64> {
    e.data.get("generation").and_then(Value::as_i64)
}

fn applied_reports(a: &Attempt) -> Vec<&idem_client::Evidence> {
    a.evidence
        .iter()
        .filter(|e| e.disposition.as_deref() == Some("applied") && e.outcome != "ack")
        .collect()
}

fn failure_class(a: &Attempt) -> Option<String> {
    applied_reports(a)
        .first()
        .and_then(|e| e.body.get("failure_class"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// Checks every invariant against the run's records.
pub fn check(input: &CheckInput) -> Vec<InvariantResult> {
    let mut f = Findings::default();
    let by_id: HashMap<Uuid, &TaskRecord> = input.tasks.iter().map(|r| (r.task.id, r)).collect();

    // §2.1: one task per scope in the database.
    let mut db_scopes: BTreeMap<(&str, &str), Vec<Uuid>> = BTreeMap::new();
    for t in &input.db_tasks {
        db_scopes
            .entry((&t.operation, &t.idempotency_key))
            .or_default()
            .push(t.id);
    }
    for ((op, key), ids) in &db_scopes {
        f.ok(Invariant::OneScopeOneTask, ids.len() == 1, || {
            format!("scope {op}/{key} has {} tasks in the store", ids.len())
        });
    }
    for t in &input.db_tasks {
        f.ok(Invariant::Audit, by_id.contains_key(&t.id), || {
            format!("task {} is in the database but not served", short(t.id))
        });
    }

    // Client answers, per scope.
    let mut scopes: BTreeMap<(&str, &str), Vec<&SubmitRecord>> = BTreeMap::new();
    for s in &input.submits {
        scopes
            .entry((s.class.operation(), &s.key))
            .or_default()
            .push(s);
    }
    let mut deliveries_seen: HashMap<Uuid, Vec<&DeliverySeen>> = HashMap::new();
    for ((op, key), recs) in &scopes {
        let class = recs[0].class;
        let mut named = BTreeSet::new();
        let mut created = 0;
        for s in recs {
            match &s.answer {
                SubmitAnswer::Accepted {
                    task_id,
                    replayed,
                    looked_up,
                    delivery,
                    ..
                } => {
                    named.insert(*task_id);
                    if !replayed && !looked_up {
                        created += 1;
                    }
                    if let Some(d) = delivery {
                        deliveries_seen.entry(*task_id).or_default().push(d);
                    }
                }
                SubmitAnswer::Conflict { task_id: Some(id) } => {
                    named.insert(*id);
                }
                _ => {}
            }
        }
        f.ok(Invariant::OneScopeOneTask, named.len() <= 1, || {
            format!(
                "scope {op}/{key}: answers named {} different tasks",
                named.len()
            )
        });
        f.ok(Invariant::OneScopeOneTask, created <= 1, || {
            format!("scope {op}/{key}: {created} answers said `created` (not a replay)")
        });
        let db_ids = db_scopes.get(&(*op, *key)).cloned().unwrap_or_default();
        for id in &named {
            f.ok(Invariant::OneScopeOneTask, db_ids.contains(id), || {
                format!(
                    "scope {op}/{key}: an answer named task {} which the store does not hold under it",
                    short(*id)
                )
            });
        }
        let stored = db_ids.first().and_then(|id| by_id.get(id));
        let stored_material = stored.map(|r| class.material(&r.task.params));
        for s in recs {
            match &s.answer {
                SubmitAnswer::Accepted {
                    task_id,
                    looked_up,
                    material,
                    ..
                } => {
                    if !looked_up {
                        f.ok(
                            Invariant::ConflictExecutesNothing,
                            &s.material == material,
                            || {
                                format!(
                                    "op {}: a request with other material fields ({}) was answered with task {} ({material})",
                                    s.op,
                                    s.material,
                                    short(*task_id)
                                )
                            },
                        );
                    }
                    if let Some(m) = &stored_material {
                        f.ok(Invariant::ConflictExecutesNothing, m == material, || {
                            format!(
                                "task {}: accepted params changed from {material} to {m}",
                                short(*task_id)
                            )
                        });
                    }
                }
                SubmitAnswer::Conflict { .. } => {
                    if let Some(m) = &stored_material {
                        f.ok(Invariant::ConflictExecutesNothing, &s.material != m, || {
                            format!(
                                "op {}: the scope's own request was refused as a conflict",
                                s.op
                            )
                        });
                    }
                }
                _ => {}
            }
        }
    }

    // The provider's ledger.
    let effects: HashMap<Uuid, &Effect> = input.effects.iter().map(|e| (e.task_id, e)).collect();
    for e in &input.effects {
        match by_id.get(&e.task_id) {
            Some(r) => {
                let m = e.class.material(&r.task.params);
                f.ok(Invariant::ConflictExecutesNothing, m == e.material, || {
                    format!(
                        "task {}: the provider acted on {} but the accepted request is {m}",
                        short(e.task_id),
                        e.material
                    )
                });
            }
            None => f.ok(Invariant::OneScopeOneTask, false, || {
                format!(
                    "the provider acted for task {} which idem does not serve",
                    short(e.task_id)
                )
            }),
        }
    }
    let mut requests: HashMap<Uuid, (BTreeSet<Uuid>, u64)> = HashMap::new();
    for r in &input.effect_requests {
        let e = requests.entry(r.task_id).or_default();
        e.0.insert(r.attempt_id);
        e.1 += u64::from(r.moved);
    }
    for (task_id, (attempts, moved)) in &requests {
        f.ok(Invariant::OneDeliveryOneCharge, *moved <= 1, || {
            format!("task {}: money moved {moved} times", short(*task_id))
        });
        let safe = by_id
            .get(task_id)
            .and_then(|r| Class::from_operation(&r.task.operation))
            .is_some_and(Class::is_safe);
        if !safe {
            f.ok(Invariant::ReconcileBeforeRepeat, attempts.len() <= 1, || {
                format!(
                    "task {}: {} attempts asked the provider to pay (a repeat without reconciliation)",
                    short(*task_id),
                    attempts.len()
                )
            });
        }
    }

    // Reports that must have been refused.
    for s in &input.suspects {
        f.ok(Invariant::Fencing, !s.accepted, || {
            let what = match s.kind {
                SuspectKind::Late => "a report sent after the lease ran out",
                SuspectKind::Conflicting => "a different second report",
            };
            format!(
                "task {} attempt {}: {what} was accepted",
                short(s.task_id),
                short(s.attempt_id)
            )
        });
    }

    let mut cancels: HashMap<Uuid, Vec<CancelStatus>> = HashMap::new();
    for c in &input.cancels {
        cancels.entry(c.task_id).or_default().push(c.status);
    }
    for rec in &input.tasks {
        let id = rec.task.id;
        check_task(
            rec,
            effects.get(&id).copied(),
            &input.accepted_usage,
            deliveries_seen.get(&id).map_or(&[][..], Vec::as_slice),
            cancels.get(&id).map_or(&[][..], Vec::as_slice),
            &mut f,
        );
    }
    f.results()
}

#[allow(clippy::too_many_lines)]
fn check_task(
    rec: &TaskRecord,
    effect: Option<&Effect>,
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
        events.first().is_some_and(|e| {
            e.kind == "task_submitted"
                && e.data.get("fingerprint").and_then(Value::as_str) == Some(&t.fingerprint)
        }),
        || format!("task {s}: history does not start with its task_submitted event"),
    );
    let leased: HashMap<Uuid, Option<i64>> = events
        .iter()
        .filter(|e| e.kind == "attempt_leased")
        .filter_map(|e| event_attempt(e).map(|a| (a, event_generation(e))))
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
    for e in events {
        let aid = event_attempt(e);
        let g = event_generation(e);
        // A store that went back in time ends the attempt it knew (SPEC
        // §2.11): the event that moved the task on names it.
        let ended = e
            .data
            .get("ended_attempt_id")
            .and_then(Value::as_str)
            .and_then(|s| s.parse::<Uuid>().ok());
        if ended.is_some() && ended == active {
            active = None;
        }
        match e.kind.as_str() {
            "attempt_leased" => {
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
                if e.data.get("kind").and_then(Value::as_str) == Some("execute") {
                    execute_count += 1;
                }
            }
            "lease_expired" if active.is_some() && active == aid => active = None,
            // A release gives back an attempt that never started: only the
            // live attempt's current generation may, and it is no execute
            // attempt for the cancellation fee (nor for any limit).
            "attempt_released" => {
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
                if e.data.get("kind").and_then(Value::as_str) == Some("execute") {
                    execute_count -= 1;
                }
                active = None;
            }
            "completion_observed"
            | "reconciled"
            | "attempt_failed"
            | "outcome_unknown"
            | "attempt_cancelled" => {
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
            "cancel_confirmed" => {
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
            "delivered" => {
                f.ok(Invariant::Fencing, terminal.is_none(), || {
                    format!(
                        "task {s}: delivered (event {}) after the task was {}",
                        e.seq,
                        terminal.unwrap_or("?")
                    )
                });
                terminal = Some("delivered");
            }
            "task_failed" => {
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
        match effect {
            Some(e) => f.ok(
                Invariant::OneDeliveryOneCharge,
                d.external_txn_id.as_deref() == Some(e.txn.as_str()),
                || {
                    format!(
                        "task {s}: delivered transaction {:?} but the provider recorded {}",
                        d.external_txn_id, e.txn
                    )
                },
            ),
            None => f.ok(Invariant::OneDeliveryOneCharge, false, || {
                format!("task {s}: delivered without any effect at the provider")
            }),
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
    if let Some(e) = effect
        && !safe
        && t.state.is_terminal()
    {
        f.ok(
            Invariant::OneDeliveryOneCharge,
            t.delivery.is_some(),
            || {
                format!(
                    "task {s}: the provider paid {} but the task ended {} without delivery",
                    e.txn, t.state
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
        f.ok(Invariant::CancelOrDeliver, effect.is_none(), || {
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
    if confirmed && let Some(ev) = events.iter().find(|e| e.kind == "cancel_confirmed") {
        let usage = ev.data.get("usage").and_then(Value::as_i64);
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
