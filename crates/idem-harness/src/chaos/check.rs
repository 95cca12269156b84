//! The checker: the invariants of SPEC §2 verified against the event histories,
//! the attempts with their evidence, the clients' log of answers and the
//! provider's ledger, with counts of checked and violated cases per invariant.

use super::*;

mod second;
mod task;
pub use second::*;
use task::check_task;

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
    /// Every second effect reported to idem is raised as suspected, once;
    /// nothing else is.
    SecondEffectsDetected,
}

impl Invariant {
    /// Every invariant, in report order.
    pub const ALL: [Invariant; 10] = [
        Invariant::OneScopeOneTask,
        Invariant::ConflictExecutesNothing,
        Invariant::Fencing,
        Invariant::ReconcileBeforeRepeat,
        Invariant::OneDeliveryOneCharge,
        Invariant::CancelOrDeliver,
        Invariant::UsageKept,
        Invariant::Audit,
        Invariant::Settled,
        Invariant::SecondEffectsDetected,
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
            Invariant::SecondEffectsDetected => "second_effects_detected",
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
            Invariant::SecondEffectsDetected => "§2.12",
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
            Invariant::SecondEffectsDetected => {
                "second effects reported to idem are raised, nothing else"
            }
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
    let effects = effects_by_task(input);
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
    // Requests executors sent within their lease: idem's doing. A request
    // after the lease ran out (a stale payer) is the executor's fault, which
    // idem cannot prevent; it must raise what it is told of
    // (`second_effects_detected`).
    let mut requests: HashMap<Uuid, (BTreeSet<Uuid>, u64)> = HashMap::new();
    for r in input.effect_requests.iter().filter(|r| r.in_lease) {
        let e = requests.entry(r.task_id).or_default();
        e.0.insert(r.attempt_id);
        e.1 += u64::from(r.moved);
    }
    for (task_id, (attempts, moved)) in &requests {
        let safe = by_id
            .get(task_id)
            .and_then(|r| Class::from_operation(&r.task.operation))
            .is_some_and(Class::is_safe);
        // A safe class may be repeated; at a provider that does not
        // deduplicate each repeat is a new effect.
        if !safe || input.provider == ProviderMode::Deduplicating {
            f.ok(Invariant::OneDeliveryOneCharge, *moved <= 1, || {
                format!("task {}: money moved {moved} times", short(*task_id))
            });
        }
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
    let mut figures = SecondEffects::default();
    for rec in &input.tasks {
        let id = rec.task.id;
        let task_effects = effects.get(&id).map_or(&[][..], Vec::as_slice);
        let second = task_second_effects(rec, task_effects, &input.effect_reports, &mut figures);
        check_second_effects(rec, &second, &mut f);
        check_task(
            rec,
            task_effects,
            requests.contains_key(&id),
            &input.accepted_usage,
            deliveries_seen.get(&id).map_or(&[][..], Vec::as_slice),
            cancels.get(&id).map_or(&[][..], Vec::as_slice),
            &mut f,
        );
    }
    f.results()
}
