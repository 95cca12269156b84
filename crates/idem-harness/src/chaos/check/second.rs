//! Suspected second effects: the provider's ledger against the
//! `second_effect_suspected` events idem stored.
//!
//! For each task the ledger side expects idem to raise exactly the
//! transaction ids of the task's effects at the provider that an executor
//! named in a report idem answered (so idem holds it as evidence), minus the
//! delivered one when the task was delivered (all of them when it ended
//! `cancelled` or `failed` without delivery; none while it is neither
//! delivered nor ended). What idem cannot see is counted apart: an effect no
//! answered report ever named (an executor that crashed after paying, or
//! reported `unknown`, and no reconciliation found it), and an effect named
//! only in reports that got no answer (idem may or may not hold it: neither
//! a miss nor a false alarm).

use std::collections::BTreeMap;

use super::*;

/// The event kind idem stores for a suspected second effect.
pub const SECOND_EFFECT_SUSPECTED: &str = "second_effect_suspected";

/// The ledger against idem's events, over a whole run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SecondEffects {
    /// Tasks with more than one effect at the provider.
    pub tasks_with_several_effects: u64,
    /// Real second effects: effects at the provider other than the one its
    /// task delivered, and every effect of a task that ended without delivery.
    pub real: u64,
    /// … of which beside a delivery.
    pub beside_delivery: u64,
    /// … of which of a task that ended `cancelled` or `failed`.
    pub without_delivery: u64,
    /// … of which idem was told (an answered report named them): each must
    /// be raised.
    pub reported: u64,
    /// … of which no answered report ever named: idem cannot see them (an
    /// executor that paid and never reported the id).
    pub unreported: u64,
    /// … of which only reports without an answer named: whether idem holds
    /// them is unknown, so they count neither as misses nor as false alarms.
    pub unanswered: u64,
    /// `second_effect_suspected` events idem stored.
    pub raised: u64,
    /// Expected ids idem did not raise.
    pub misses: u64,
    /// Raised ids the ledger does not expect (or raised twice, or with a
    /// delivered id other than the task's).
    pub false_alarms: u64,
}

/// One task's comparison.
pub(super) struct TaskSecondEffects {
    /// Expected ids, raised or not.
    pub(super) expected: BTreeSet<String>,
    /// Ids idem raised (`None`: an event without an id), with how often.
    pub(super) raised: BTreeMap<Option<String>, u64>,
    /// Raised ids whose `delivered_txn_id` is not the task's delivery id.
    pub(super) wrong_delivered_id: Vec<Option<String>>,
    /// Ids neither expected nor excluded: raised although only unanswered
    /// reports named them are excluded.
    pub(super) ambiguous: BTreeSet<String>,
}

/// The ids idem raised for a task, from its event history.
fn raised(rec: &TaskRecord) -> (BTreeMap<Option<String>, u64>, Vec<Option<String>>) {
    let delivered = rec
        .task
        .delivery
        .as_ref()
        .and_then(|d| d.external_txn_id.clone());
    let mut ids: BTreeMap<Option<String>, u64> = BTreeMap::new();
    let mut wrong = Vec::new();
    for e in rec
        .events
        .iter()
        .filter(|e| e.kind == SECOND_EFFECT_SUSPECTED)
    {
        let id = e
            .data
            .get("external_txn_id")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let at_delivery = e
            .data
            .get("delivered_txn_id")
            .and_then(Value::as_str)
            .map(str::to_owned);
        // Raised for a delivered task it names the delivery's id; for a
        // task that ended without delivery, none.
        if at_delivery != delivered {
            wrong.push(id.clone());
        }
        *ids.entry(id).or_default() += 1;
    }
    (ids, wrong)
}

/// Compares one task's effects at the provider with the events idem stored,
/// adding the task's figures to `figures`.
pub(super) fn task_second_effects(
    rec: &TaskRecord,
    effects: &[&Effect],
    effect_reports: &HashMap<String, bool>,
    figures: &mut SecondEffects,
) -> TaskSecondEffects {
    let t = &rec.task;
    if effects.len() > 1 {
        figures.tasks_with_several_effects += 1;
    }
    let ended_undelivered = matches!(t.state, TaskState::Cancelled | TaskState::Failed);
    let mut expected = BTreeSet::new();
    let mut ambiguous = BTreeSet::new();
    for e in effects {
        let second = match &t.delivery {
            Some(d) => d.external_txn_id.as_deref() != Some(e.txn.as_str()),
            None => ended_undelivered,
        };
        if !second {
            continue;
        }
        figures.real += 1;
        if t.delivery.is_some() {
            figures.beside_delivery += 1;
        } else {
            figures.without_delivery += 1;
        }
        match effect_reports.get(&e.txn) {
            Some(true) => {
                figures.reported += 1;
                // A delivery without an id is compared with nothing.
                let comparable = t
                    .delivery
                    .as_ref()
                    .is_none_or(|d| d.external_txn_id.is_some());
                if comparable {
                    expected.insert(e.txn.clone());
                }
            }
            Some(false) => {
                figures.unanswered += 1;
                ambiguous.insert(e.txn.clone());
            }
            None => figures.unreported += 1,
        }
    }
    let (raised, wrong_delivered_id) = raised(rec);
    figures.raised += raised.values().sum::<u64>();
    for (id, n) in &raised {
        let fine = id
            .as_ref()
            .is_some_and(|id| expected.contains(id) || ambiguous.contains(id));
        figures.false_alarms += if fine { n - 1 } else { *n };
    }
    figures.false_alarms += wrong_delivered_id.len() as u64;
    for id in &expected {
        if !raised.contains_key(&Some(id.clone())) {
            figures.misses += 1;
        }
    }
    TaskSecondEffects {
        expected,
        raised,
        wrong_delivered_id,
        ambiguous,
    }
}

/// The run's figures: every served task against the provider's ledger.
pub fn second_effects(input: &CheckInput) -> SecondEffects {
    let mut figures = SecondEffects::default();
    let effects = effects_by_task(input);
    for rec in &input.tasks {
        task_second_effects(
            rec,
            effects.get(&rec.task.id).map_or(&[][..], Vec::as_slice),
            &input.effect_reports,
            &mut figures,
        );
    }
    figures
}

/// The provider's effects by task, each task's in the order performed.
pub(super) fn effects_by_task(input: &CheckInput) -> HashMap<Uuid, Vec<&Effect>> {
    let mut m: HashMap<Uuid, Vec<&Effect>> = HashMap::new();
    for e in &input.effects {
        m.entry(e.task_id).or_default().push(e);
    }
    m
}

/// The invariant's checks for one task.
pub(super) fn check_second_effects(rec: &TaskRecord, c: &TaskSecondEffects, f: &mut Findings) {
    let s = short(rec.task.id);
    for id in &c.expected {
        f.ok(
            Invariant::SecondEffectsDetected,
            c.raised.contains_key(&Some(id.clone())),
            || {
                format!(
                    "task {s} ({}): the provider performed {id}, an executor reported it, and idem raised no {SECOND_EFFECT_SUSPECTED} for it",
                    rec.task.state
                )
            },
        );
    }
    for (id, n) in &c.raised {
        let known = id
            .as_ref()
            .is_some_and(|id| c.expected.contains(id) || c.ambiguous.contains(id));
        f.ok(Invariant::SecondEffectsDetected, known, || {
            format!(
                "task {s} ({}): {SECOND_EFFECT_SUSPECTED} for {id:?}, which the provider's ledger does not show as a second effect reported to idem",
                rec.task.state
            )
        });
        f.ok(Invariant::SecondEffectsDetected, *n == 1, || {
            format!("task {s}: {SECOND_EFFECT_SUSPECTED} for {id:?} raised {n} times")
        });
    }
    for id in &c.wrong_delivered_id {
        f.ok(Invariant::SecondEffectsDetected, false, || {
            format!(
                "task {s}: {SECOND_EFFECT_SUSPECTED} for {id:?} names another delivered id than the delivery's {:?}",
                rec.task.delivery.as_ref().and_then(|d| d.external_txn_id.clone())
            )
        });
    }
    if c.expected.is_empty() && c.raised.is_empty() {
        // Counted: a task where nothing was to be raised and nothing was.
        f.ok(Invariant::SecondEffectsDetected, true, String::new);
    }
}
