//! The simulated payout provider: idempotent by task id, it records every pay
//! request and lookup so the scenes and the audit can say what moved money.
//! Scene (f) pays through its entry that takes no idempotency key
//! ([`Provider::pay_without_key`]): every request moves money.

use super::*;

/// A payout recorded by the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Payout {
    pub(super) txn: String,
    payee: String,
    pub(super) amount: i64,
    pub(super) currency: String,
    attempt_id: Uuid,
}

impl Payout {
    pub(super) fn result(&self) -> Value {
        json!({
            "status": "paid",
            "payout_txn": self.txn,
            "payee": self.payee,
            "amount": self.amount,
            "currency": self.currency,
        })
    }
}

#[derive(Debug, Default)]
struct Ledger {
    /// Money moved, keyed by the idempotency key the executor passes: the task id.
    payouts: BTreeMap<Uuid, Payout>,
    /// Every pay request: (task, attempt, whether money moved).
    pay_requests: Vec<(Uuid, Uuid, bool)>,
    /// Every lookup by task id.
    lookups: Vec<Uuid>,
    /// Payouts made without an idempotency key for a task that already had
    /// one: (task, payout), in the order made.
    extra: Vec<(Uuid, Payout)>,
    /// Transaction ids refunded.
    refunds: Vec<String>,
}

/// A payout provider that is itself idempotent: a second pay request with the
/// same task id returns the recorded payout and never pays twice.
#[derive(Debug, Clone, Default)]
pub(super) struct Provider(Arc<Mutex<Ledger>>);

impl Provider {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Pays `params` once per task id. Returns the payout and whether money moved now.
    pub(super) fn pay(&self, task_id: Uuid, attempt_id: Uuid, params: &Value) -> (Payout, bool) {
        let mut l = self.ledger();
        if let Some(p) = l.payouts.get(&task_id).cloned() {
            l.pay_requests.push((task_id, attempt_id, false));
            return (p, false);
        }
        let p = Payout {
            txn: format!("pay-{:04}", l.payouts.len() + 1),
            payee: params["payee"].as_str().unwrap_or("?").to_owned(),
            amount: params["amount"].as_i64().unwrap_or(0),
            currency: params["currency"].as_str().unwrap_or("?").to_owned(),
            attempt_id,
        };
        l.payouts.insert(task_id, p.clone());
        l.pay_requests.push((task_id, attempt_id, true));
        (p, true)
    }

    /// Pays `params` without an idempotency key, as a provider that takes
    /// none: money moves on every request. The first payout for a task is
    /// the one [`Provider::lookup`] finds (by the task id in the payment's
    /// reference); later ones are [`Provider::extra_payouts`].
    pub(super) fn pay_without_key(
        &self,
        task_id: Uuid,
        attempt_id: Uuid,
        params: &Value,
    ) -> Payout {
        let mut l = self.ledger();
        let n = l.payouts.len() + l.extra.len() + 1;
        let p = Payout {
            txn: format!("pay-{n:04}"),
            payee: params["payee"].as_str().unwrap_or("?").to_owned(),
            amount: params["amount"].as_i64().unwrap_or(0),
            currency: params["currency"].as_str().unwrap_or("?").to_owned(),
            attempt_id,
        };
        match l.payouts.entry(task_id) {
            std::collections::btree_map::Entry::Occupied(_) => l.extra.push((task_id, p.clone())),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(p.clone());
            }
        }
        l.pay_requests.push((task_id, attempt_id, true));
        p
    }

    /// The payouts for `task_id` beyond its first (see [`Provider::pay_without_key`]).
    pub(super) fn extra_payouts(&self, task_id: Uuid) -> Vec<Payout> {
        self.ledger()
            .extra
            .iter()
            .filter(|(t, _)| *t == task_id)
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// Refunds transaction `txn` (an operator's action at the provider).
    pub(super) fn refund(&self, txn: &str) {
        self.ledger().refunds.push(txn.to_owned());
    }

    /// Whether `txn` was refunded.
    pub(super) fn refunded(&self, txn: &str) -> bool {
        self.ledger().refunds.iter().any(|r| r == txn)
    }

    /// What the provider knows about a task id (used by reconcile attempts).
    pub(super) fn lookup(&self, task_id: Uuid) -> Option<Payout> {
        let mut l = self.ledger();
        l.lookups.push(task_id);
        l.payouts.get(&task_id).cloned()
    }

    pub(super) fn payout(&self, task_id: Uuid) -> Option<Payout> {
        self.ledger().payouts.get(&task_id).cloned()
    }

    /// Times money moved for `task_id`.
    pub(super) fn money_moved(&self, task_id: Uuid) -> usize {
        self.ledger()
            .pay_requests
            .iter()
            .filter(|(t, _, moved)| *t == task_id && *moved)
            .count()
    }

    pub(super) fn pay_requests(&self, task_id: Uuid) -> usize {
        self.ledger()
            .pay_requests
            .iter()
            .filter(|(t, _, _)| *t == task_id)
            .count()
    }

    pub(super) fn lookups(&self, task_id: Uuid) -> usize {
        self.ledger()
            .lookups
            .iter()
            .filter(|t| **t == task_id)
            .count()
    }

    pub(super) fn total_pay_requests(&self) -> usize {
        self.ledger().pay_requests.len()
    }

    pub(super) fn total_payouts(&self) -> usize {
        let l = self.ledger();
        l.payouts.len() + l.extra.len()
    }
}
