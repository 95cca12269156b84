//! What a failover to a standby that was behind lost, and what idem did
//! about it: the run's records set against the promoted database.
//!
//! A standby that was behind is a store that went back in time (SPEC
//! §2.11): every write acknowledged after its last received WAL record is
//! gone. Two kinds of loss follow, and the provider's ledger tells them apart:
//!
//! - the task row survived but writes to it are gone (an attempt leased, a
//!   report, a heartbeat's usage, a cancel, a delivery): idem records the
//!   store's identity, sees the new timeline and moves every task whose
//!   attempts may have started to reconcile-first with its generation raised
//!   (`store_rewound`). An effect performed by a lost attempt is then found
//!   by a reconcile attempt before anything executes again: a second attempt
//!   asking the provider to pay for such a task is a violation
//!   (`repeated_without_reconcile`);
//! - the task row itself is gone (its submit was acknowledged after the
//!   restore point): idem has nothing to reconcile. A client that submits the
//!   idempotency key again creates a new task, which executes again; when the
//!   lost task had already moved money, the key's effect happened twice
//!   (`executed_again_after_loss`). idem cannot tell; the checker reports it
//!   as such.
//!
//! [`split_losses`] also returns the run's records without the lost writes,
//! for the invariants of SPEC §2 to be checked on what the promoted database
//! holds (a failover to an asynchronous standby).

use super::*;

/// What the promoted database lacks, and what idem did about it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LossReport {
    /// Tasks the run saw (named by a submit's answer, or paid for at the
    /// provider) that the promoted database does not hold.
    pub lost_tasks: u64,
    /// … whose scope holds another task now: the idempotency key was
    /// submitted again after the loss and made a new task.
    pub lost_tasks_recreated: u64,
    /// … with an effect at the provider.
    pub lost_tasks_with_effect: u64,
    /// Lost tasks with an effect whose scope's new task had the effect
    /// performed again: one idempotency key, two effects. idem cannot detect
    /// it (the first task's row is gone).
    pub executed_again_after_loss: u64,
    /// Cancels answered for a task that survived, whose answer the final task
    /// contradicts (no cancellation, or `confirmed` but not cancelled,
    /// `too_late` but cancelled), on a task moved on by `store_rewound` or of
    /// a retry-safe class (which it may leave as it was); and cancels of lost
    /// tasks.
    pub lost_cancels: u64,
    /// Submit answers that showed a delivery the task (moved on by
    /// `store_rewound`, or of a retry-safe class) no longer has, or has with
    /// another time but the same provider transaction and charge.
    pub lost_deliveries: u64,
    /// Attempts whose accepted usage (heartbeats, reports) exceeds what the
    /// promoted database shows, or which it does not hold.
    pub lost_usage: u64,
    /// Tasks moved on by `store_rewound` (their generation raised).
    pub rewound_tasks: u64,
    /// … of them moved to reconcile-first (`reconciliation_required`).
    pub rewound_to_reconcile: u64,
    /// Surviving tasks, not retry-safe, with an effect performed by an
    /// attempt the promoted database does not hold.
    pub lost_attempts_with_effect: u64,
    /// … that were not moved on by `store_rewound`, or that another attempt
    /// asked the provider to pay for: an effect repeated without a
    /// reconciliation in between (violations).
    pub repeated_without_reconcile: u64,
    /// Up to 8 cases of `executed_again_after_loss` and
    /// `repeated_without_reconcile`, described.
    pub examples: Vec<String>,
}

/// Whether `e` is the event `store_rewound` recorded (its `reason`, or the
/// `store` and `ended_attempt_id` it adds to the event that settled a
/// retry-safe task).
fn is_rewind(e: &Event) -> bool {
    e.data.get("reason").and_then(Value::as_str) == Some("store_rewound")
        || (e.data.get("store").is_some() && e.data.get("ended_attempt_id").is_some())
}

/// The loss accounting of `input`, and `input` without the lost writes.
pub fn split_losses(input: &CheckInput) -> (CheckInput, LossReport) {
    let mut r = LossReport::default();
    let in_db: BTreeSet<Uuid> = input.db_tasks.iter().map(|t| t.id).collect();
    let by_id: HashMap<Uuid, &TaskRecord> = input.tasks.iter().map(|t| (t.task.id, t)).collect();
    let rewound: BTreeSet<Uuid> = input
        .tasks
        .iter()
        .filter(|t| t.events.iter().any(is_rewind))
        .map(|t| t.task.id)
        .collect();
    r.rewound_tasks = rewound.len() as u64;
    r.rewound_to_reconcile = input
        .tasks
        .iter()
        .filter(|t| {
            t.events
                .iter()
                .any(|e| e.kind == "reconciliation_required" && is_rewind(e))
        })
        .count() as u64;

    // Lost tasks: named by an answer, or paid for, and not in the database.
    let named = |a: &SubmitAnswer| match a {
        SubmitAnswer::Accepted { task_id, .. }
        | SubmitAnswer::Conflict {
            task_id: Some(task_id),
        } => Some(*task_id),
        _ => None,
    };
    let mut lost: BTreeMap<Uuid, (&str, String)> = BTreeMap::new();
    for s in &input.submits {
        if let Some(id) = named(&s.answer)
            && !in_db.contains(&id)
        {
            lost.insert(id, (s.class.operation(), s.key.clone()));
        }
    }
    let class_of: HashMap<Uuid, Class> =
        input.effects.iter().map(|e| (e.task_id, e.class)).collect();
    for q in &input.effect_requests {
        if !in_db.contains(&q.task_id)
            && let Some(c) = class_of.get(&q.task_id)
        {
            lost.entry(q.task_id)
                .or_insert_with(|| (c.operation(), q.idempotency_key.clone()));
        }
    }
    r.lost_tasks = lost.len() as u64;
    let scope_now: HashMap<(&str, &str), Uuid> = input
        .db_tasks
        .iter()
        .map(|t| ((t.operation.as_str(), t.idempotency_key.as_str()), t.id))
        .collect();
    let moved: BTreeSet<Uuid> = input
        .effect_requests
        .iter()
        .filter(|q| q.moved)
        .map(|q| q.task_id)
        .collect();
    for (id, (op, key)) in &lost {
        let now = scope_now.get(&(*op, key.as_str()));
        r.lost_tasks_recreated += u64::from(now.is_some());
        if moved.contains(id) {
            r.lost_tasks_with_effect += 1;
            if let Some(now) = now
                && moved.contains(now)
            {
                r.executed_again_after_loss += 1;
                if r.examples.len() < 8 {
                    r.examples.push(format!(
                        "scope {op}/{key}: task {id} (lost with the store) and task {now} (made by a submit after the loss) both had the effect performed"
                    ));
                }
            }
        }
    }

    // Surviving tasks whose effect a lost attempt performed.
    let mut asked: BTreeMap<Uuid, BTreeSet<Uuid>> = BTreeMap::new();
    for q in &input.effect_requests {
        asked.entry(q.task_id).or_default().insert(q.attempt_id);
    }
    for (task_id, attempts) in &asked {
        let Some(rec) = by_id.get(task_id) else {
            continue;
        };
        if Class::from_operation(&rec.task.operation).is_none_or(Class::is_safe) {
            continue;
        }
        let held: BTreeSet<Uuid> = rec.attempts.iter().map(|a| a.id).collect();
        if attempts.is_subset(&held) {
            continue;
        }
        r.lost_attempts_with_effect += 1;
        let ok = rewound.contains(task_id) && attempts.len() == 1;
        if !ok {
            r.repeated_without_reconcile += 1;
            if r.examples.len() < 8 {
                r.examples.push(format!(
                    "task {task_id}: an attempt the promoted database lacks had the effect performed, then {}",
                    if rewound.contains(task_id) {
                        format!("{} attempts asked the provider to pay", attempts.len())
                    } else {
                        "the task was not moved on by store_rewound".to_owned()
                    }
                ));
            }
        }
    }

    // The records without the lost writes.
    // store_rewound leaves a retry-safe task without an active attempt as it
    // is: a write lost on it shows without a rewind.
    let rewound_or_safe = |id: &Uuid| {
        rewound.contains(id)
            || by_id
                .get(id)
                .and_then(|t| Class::from_operation(&t.task.operation))
                .is_some_and(Class::is_safe)
    };
    let mut kept = input.clone();
    kept.submits
        .retain(|s| named(&s.answer).is_none_or(|id| in_db.contains(&id)));
    for s in &mut kept.submits {
        if let SubmitAnswer::Accepted {
            task_id,
            delivery: delivery @ Some(_),
            ..
        } = &mut s.answer
            && rewound_or_safe(task_id)
            && let (Some(seen), Some(rec)) = (delivery.as_ref(), by_id.get(task_id))
        {
            let now = rec.task.delivery.as_ref();
            let same_effect = now.is_none_or(|d| {
                d.external_txn_id == seen.external_txn_id && d.charge == seen.charge
            });
            let replaced = now.is_none_or(|d| d.delivered_at != seen.delivered_at);
            if same_effect && replaced {
                r.lost_deliveries += 1;
                *delivery = None;
            }
        }
    }
    let cancels = kept.cancels.len();
    kept.cancels.retain(|c| {
        let Some(rec) = by_id.get(&c.task_id) else {
            return false;
        };
        let t = &rec.task;
        let contradicted = t.cancellation.is_none()
            || (c.status == CancelStatus::Confirmed && t.state != TaskState::Cancelled)
            || (c.status == CancelStatus::TooLate && t.state == TaskState::Cancelled);
        !(contradicted && rewound_or_safe(&c.task_id))
    });
    r.lost_cancels = (cancels - kept.cancels.len()) as u64;
    let shown: HashMap<Uuid, i64> = input
        .tasks
        .iter()
        .flat_map(|t| &t.attempts)
        .map(|a| (a.id, a.usage))
        .collect();
    let usage = kept.accepted_usage.len();
    kept.accepted_usage
        .retain(|id, u| shown.get(id).is_some_and(|s| s >= u));
    r.lost_usage = (usage - kept.accepted_usage.len()) as u64;
    kept.effects.retain(|e| in_db.contains(&e.task_id));
    kept.effect_requests.retain(|q| in_db.contains(&q.task_id));
    // Evidence idem answered may be among the lost writes: an effect report
    // counts as unanswered (neither a miss nor a false alarm when raised).
    for answered in kept.effect_reports.values_mut() {
        *answered = false;
    }
    (kept, r)
}

/// The report's lines.
pub(super) fn render_loss(out: &mut String, l: &LossReport) {
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "failover: {} tasks moved on by store_rewound ({} to reconcile-first); {} surviving tasks had an effect by a lost attempt, {} repeated without a reconciliation",
        l.rewound_tasks,
        l.rewound_to_reconcile,
        l.lost_attempts_with_effect,
        l.repeated_without_reconcile
    );
    let _ = writeln!(
        out,
        "failover: lost with the store: {} tasks ({} re-created by a later submit, {} with an effect, {} executed again under the same key), {} cancels, {} deliveries, {} attempts' usage",
        l.lost_tasks,
        l.lost_tasks_recreated,
        l.lost_tasks_with_effect,
        l.executed_again_after_loss,
        l.lost_cancels,
        l.lost_deliveries,
        l.lost_usage
    );
    for e in &l.examples {
        let _ = writeln!(out, "failover:   {e}");
    }
}
