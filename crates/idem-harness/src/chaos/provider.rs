//! The external provider the executors pay at, with its own ledger that is
//! idempotent by task id and answers lookups for reconciliation.

use super::*;

/// An effect the provider performed (a payout, or a rendered job).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Effect {
    /// The provider's idempotency key: the task id.
    pub task_id: Uuid,
    /// The attempt whose executor performed it.
    pub attempt_id: Uuid,
    /// Operation class.
    pub class: Class,
    /// The material fields the provider acted on.
    pub material: Value,
    /// The provider's transaction id.
    pub txn: String,
}

/// One request to perform an effect.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EffectRequest {
    /// Task id (idempotency key).
    pub task_id: Uuid,
    /// Requesting attempt.
    pub attempt_id: Uuid,
    /// The task's idempotency key (as the claimed attempt named it): which
    /// scope an effect belongs to even when the task row is gone.
    pub idempotency_key: String,
    /// Whether this request moved money (false: the ledger already had it).
    pub moved: bool,
}

#[derive(Debug, Default)]
struct Ledger {
    effects: HashMap<Uuid, Effect>,
    requests: Vec<EffectRequest>,
    lookups: u64,
}

/// The provider: performs an effect at most once per task id, answers lookups.
#[derive(Debug, Clone, Default)]
pub struct Provider(Arc<Mutex<Ledger>>);

impl Provider {
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Performs the effect of `params` for `task_id` once; a repeat returns
    /// the recorded one. `key` is the task's idempotency key, kept with the request.
    pub fn perform(
        &self,
        task_id: Uuid,
        attempt_id: Uuid,
        key: &str,
        class: Class,
        params: &Value,
    ) -> Effect {
        let mut l = self.ledger();
        if let Some(e) = l.effects.get(&task_id).cloned() {
            l.requests.push(EffectRequest {
                task_id,
                attempt_id,
                idempotency_key: key.to_owned(),
                moved: false,
            });
            return e;
        }
        let prefix = if class == Class::Payment {
            "pay"
        } else {
            "gen"
        };
        let e = Effect {
            task_id,
            attempt_id,
            class,
            material: class.material(params),
            txn: format!("{prefix}-{}", l.effects.len() + 1),
        };
        l.effects.insert(task_id, e.clone());
        l.requests.push(EffectRequest {
            task_id,
            attempt_id,
            idempotency_key: key.to_owned(),
            moved: true,
        });
        e
    }

    /// What the provider knows about `task_id` (for reconcile attempts).
    pub fn lookup(&self, task_id: Uuid) -> Option<Effect> {
        let mut l = self.ledger();
        l.lookups += 1;
        l.effects.get(&task_id).cloned()
    }

    pub(super) fn snapshot(&self) -> (Vec<Effect>, Vec<EffectRequest>, u64) {
        let l = self.ledger();
        let mut effects: Vec<Effect> = l.effects.values().cloned().collect();
        effects.sort_by_key(|e| e.task_id);
        (effects, l.requests.clone(), l.lookups)
    }
}

pub(super) fn effect_result(e: &Effect) -> Value {
    let status = if e.class == Class::Payment {
        "paid"
    } else {
        "rendered"
    };
    json!({"status": status, "txn": e.txn, "material": e.material})
}
