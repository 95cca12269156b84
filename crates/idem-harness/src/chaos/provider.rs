//! The external provider the executors pay at, with its own ledger that
//! answers lookups for reconciliation. By default it is idempotent by task
//! id; [`ProviderMode::NonDeduplicating`] makes every pay request a new
//! effect with a new transaction id, as a provider without idempotency keys
//! does.

use super::*;

/// Whether the provider deduplicates pay requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ProviderMode {
    /// A repeat request for a task id returns the recorded effect.
    #[default]
    Deduplicating,
    /// Every request performs a new effect with a new transaction id.
    NonDeduplicating,
}

impl ProviderMode {
    /// The name `--provider` takes.
    pub fn name(self) -> &'static str {
        match self {
            ProviderMode::Deduplicating => "deduplicating",
            ProviderMode::NonDeduplicating => "non-deduplicating",
        }
    }
}

/// An effect the provider performed (a payout, or a rendered job).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Effect {
    /// The task the request named (the deduplicating provider's idempotency key).
    pub task_id: Uuid,
    /// The attempt whose executor performed it.
    pub attempt_id: Uuid,
    /// Operation class.
    pub class: Class,
    /// The material fields the provider acted on.
    pub material: Value,
    /// The provider's transaction id, unique in the ledger.
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
    /// Whether the executor sent it within its lease, as executors must
    /// (false: an executor that lost its lease paid anyway, the fault idem
    /// cannot prevent and reports as a suspected second effect).
    pub in_lease: bool,
}

#[derive(Debug, Default)]
struct Ledger {
    mode: ProviderMode,
    /// Every effect, in the order performed.
    effects: Vec<Effect>,
    /// Indexes into `effects` by task id.
    by_task: HashMap<Uuid, Vec<usize>>,
    requests: Vec<EffectRequest>,
    lookups: u64,
}

/// The provider: performs effects (once per task id when deduplicating),
/// answers lookups.
#[derive(Debug, Clone, Default)]
pub struct Provider(Arc<Mutex<Ledger>>);

impl Provider {
    /// A provider in `mode`.
    pub fn new(mode: ProviderMode) -> Provider {
        Provider(Arc::new(Mutex::new(Ledger {
            mode,
            ..Ledger::default()
        })))
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Performs the effect of `params` for `task_id`: when deduplicating, a
    /// repeat returns the recorded effect. `key` is the task's idempotency
    /// key, kept with the request; `in_lease` whether the executor still held
    /// its lease when it asked.
    pub fn perform(
        &self,
        task_id: Uuid,
        attempt_id: Uuid,
        key: &str,
        class: Class,
        params: &Value,
        in_lease: bool,
    ) -> Effect {
        let mut l = self.ledger();
        let mut request = EffectRequest {
            task_id,
            attempt_id,
            idempotency_key: key.to_owned(),
            moved: false,
            in_lease,
        };
        if l.mode == ProviderMode::Deduplicating
            && let Some(&i) = l.by_task.get(&task_id).and_then(|v| v.first())
        {
            let e = l.effects[i].clone();
            l.requests.push(request);
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
        let i = l.effects.len();
        l.effects.push(e.clone());
        l.by_task.entry(task_id).or_default().push(i);
        request.moved = true;
        l.requests.push(request);
        e
    }

    /// What the provider knows about `task_id` (for reconcile attempts): its
    /// first effect for the task.
    pub fn lookup(&self, task_id: Uuid) -> Option<Effect> {
        let mut l = self.ledger();
        l.lookups += 1;
        let i = *l.by_task.get(&task_id)?.first()?;
        l.effects.get(i).cloned()
    }

    pub(super) fn snapshot(&self) -> (Vec<Effect>, Vec<EffectRequest>, u64) {
        let l = self.ledger();
        let mut effects = l.effects.clone();
        // Stable: a task's effects stay in the order performed.
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
