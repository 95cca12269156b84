//! The checks every transition of the model passes: a stale call changes
//! nothing but its evidence (SPEC §2.4), generations and usage never go down,
//! and a delivery record never changes (SPEC §2.6, §2.7).

use idem_core::model::CancelStatus;

use crate::model::IdemModel;
use crate::state::{Held, State, violation};

impl IdemModel {
    /// SPEC §2.4: a call whose generation no longer holds the lease (an
    /// older generation, or an attempt that ended) changes no task or
    /// attempt; only its evidence is kept.
    pub(crate) fn check_stale(&self, s: &State, n: &mut State, held: &Held) {
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
        if !n.tasks[i].unchanged_from(before) {
            n.violations |= violation::STALE_CHANGED_STATE;
        }
    }

    /// Checks every transition: generations and usage never go down, a
    /// delivery record never changes (its acknowledgment aside), and keeps
    /// the ghost counters.
    pub(crate) fn check_transition(&self, s: &State, n: &mut State) {
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
