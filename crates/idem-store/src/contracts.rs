//! Stored contracts: one row per distinct frozen contract, keyed by its
//! [`ContractId`], that task rows name (SPEC §2.9: a task keeps the contract
//! it was accepted under).
//!
//! Two process-level records keep the rows from costing work per task:
//! [`intern`] decodes each stored text once per process, and
//! [`StoredContracts`] remembers which ids a database is known to hold, so a
//! submit writes a contract row only the first time this process meets it.
//! Neither decides correctness: a task row's foreign key refuses a contract id
//! without its row, and a backend writes the row, if absent, in the submit's
//! own transaction whenever the id is not known to be stored.

use std::collections::HashSet;
use std::sync::{LazyLock, RwLock};

use idem_core::contract::{ContractId, FrozenContract};

/// Distinct contracts [`intern`] keeps decoded; a configuration has a few
/// versions times a few classes.
pub const INTERNED: usize = 256;

/// Distinct ids a [`StoredContracts`] remembers before it starts again.
pub const REMEMBERED: usize = 1024;

static DECODED: LazyLock<quick_cache::sync::Cache<ContractId, FrozenContract>> =
    LazyLock::new(|| quick_cache::sync::Cache::new(INTERNED));

/// The contract stored under `id` as `stored` (the text of its row): decoded
/// once per process, then the same shared [`FrozenContract`] for every task
/// that names `id`.
///
/// # Errors
/// The JSON error when `stored` is not a contract (nothing is kept).
pub fn intern(id: ContractId, stored: &str) -> serde_json::Result<FrozenContract> {
    if let Some(c) = DECODED.get(&id) {
        return Ok(c);
    }
    let c = FrozenContract::decode(id, stored)?;
    DECODED.insert(id, c.clone());
    Ok(c)
}

/// The contract ids one database is known to hold a row for: written or found
/// by this process. An id absent here costs an `INSERT … ON CONFLICT DO
/// NOTHING`; an id present but missing (the database restored from a backup,
/// say) makes the task insert fail on its foreign key, after which the backend
/// calls [`StoredContracts::forget`] and the transaction runs again.
#[derive(Debug, Default)]
pub struct StoredContracts {
    ids: RwLock<HashSet<ContractId>>,
}

impl StoredContracts {
    /// Nothing known yet.
    pub fn new() -> StoredContracts {
        StoredContracts::default()
    }

    /// The distinct contracts of `contracts` not known to be stored, in order
    /// of first appearance.
    pub fn unknown<'c>(
        &self,
        contracts: impl IntoIterator<Item = &'c FrozenContract>,
    ) -> Vec<&'c FrozenContract> {
        let Ok(ids) = self.ids.read() else {
            return Vec::new();
        };
        let mut out: Vec<&FrozenContract> = Vec::new();
        for c in contracts {
            if !ids.contains(&c.id()) && !out.iter().any(|o| o.id() == c.id()) {
                out.push(c);
            }
        }
        out
    }

    /// Whether `id` is known to be stored.
    pub fn holds(&self, id: ContractId) -> bool {
        self.ids.read().is_ok_and(|ids| ids.contains(&id))
    }

    /// Remembers that the rows of `contracts` are stored (committed, or
    /// written in a transaction that may still roll back: a wrong guess costs
    /// one failed attempt, see [`StoredContracts`]).
    pub fn remember<'c>(&self, contracts: impl IntoIterator<Item = &'c FrozenContract>) {
        if let Ok(mut ids) = self.ids.write() {
            for c in contracts {
                if ids.len() >= REMEMBERED {
                    ids.clear();
                }
                ids.insert(c.id());
            }
        }
    }

    /// Forgets every id: the next submits write their contract rows again.
    pub fn forget(&self) {
        if let Ok(mut ids) = self.ids.write() {
            ids.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn frozen(price: i64) -> FrozenContract {
        let config = idem_core::config::Config::bundled().unwrap();
        let mut c = config.contract("generation.dispatch").unwrap();
        c.price = price;
        FrozenContract::new(c).unwrap()
    }

    /// Interning answers each id with the contract of its text, decoded once:
    /// a later text under a known id is not read again.
    #[test]
    fn intern_decodes_each_id_once() {
        let a = frozen(7001);
        let first = intern(a.id(), a.json()).unwrap();
        assert_eq!(first, a);
        assert_eq!(first.price, 7001);
        let again = intern(a.id(), "not json").unwrap();
        assert_eq!(again.price, 7001);
        let b = frozen(7002);
        assert!(intern(b.id(), "not json").is_err());
        assert_eq!(intern(b.id(), b.json()).unwrap().price, 7002);
    }

    /// Unknown contracts are listed once each until remembered; forgetting
    /// lists them again.
    #[test]
    fn stored_contracts_list_the_unknown_once() {
        let (a, b) = (frozen(1), frozen(2));
        let stored = StoredContracts::new();
        let unknown = stored.unknown([&a, &b, &a]);
        assert_eq!(unknown, vec![&a, &b]);
        stored.remember([&a]);
        assert!(stored.holds(a.id()));
        assert!(!stored.holds(b.id()));
        assert_eq!(stored.unknown([&a, &b]), vec![&b]);
        stored.forget();
        assert_eq!(stored.unknown([&a]), vec![&a]);
    }
}
