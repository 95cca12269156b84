//! Which scopes a process has seen bound: a routing hint for retries.

use std::hash::BuildHasher;
use std::sync::Arc;

use crate::ops::{Submission, SubmitOutcome};

/// Most scopes [`ScopeHints`] remembers (a few MiB in all).
pub const SCOPE_HINTS: usize = 262_144;

/// A scope's keyed hash in one [`ScopeHints`] (meaningless in another).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScopeHash(u64);

/// Scopes this process has seen bound (a submit answered created, replayed or
/// in conflict), by a keyed 64-bit hash of tenant, operation and idempotency
/// key: a routing hint, never an answer. A backend sends a submit whose scope
/// is here to a reader that answers retries without a write transaction, and
/// writes whatever that read cannot answer (a released scope, a revoked key, a
/// hash collision) as if the hint had not been there. Scopes bound by another
/// process, or before a restart, are not here and are written as before. At
/// most [`SCOPE_HINTS`] entries; those not used lately go first. Cloning
/// shares the set.
#[derive(Clone)]
pub struct ScopeHints {
    seen: Arc<quick_cache::sync::Cache<u64, ()>>,
    hasher: std::hash::RandomState,
}

impl std::fmt::Debug for ScopeHints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopeHints")
            .field("seen", &self.seen.len())
            .finish_non_exhaustive()
    }
}

impl Default for ScopeHints {
    fn default() -> Self {
        ScopeHints::new()
    }
}

impl ScopeHints {
    /// An empty set, bounded by [`SCOPE_HINTS`].
    pub fn new() -> ScopeHints {
        ScopeHints {
            seen: Arc::new(quick_cache::sync::Cache::new(SCOPE_HINTS)),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// The keyed hash of the scope of `s` (tenant, operation, idempotency
    /// key), for [`ScopeHints::seen`] and [`ScopeHints::remember`], which
    /// may come after `s` has been handed on.
    pub fn hash(&self, s: &Submission) -> ScopeHash {
        ScopeHash(
            self.hasher
                .hash_one((&s.tenant, &s.operation, &s.idempotency_key)),
        )
    }

    /// Whether the scope hashed to `h` was seen bound (a hit counts as a use,
    /// so scopes retried often stay).
    pub fn seen(&self, h: ScopeHash) -> bool {
        self.seen.get(&h.0).is_some()
    }

    /// Remembers the scope hashed to `h` when `outcome` found it bound
    /// (anything but [`SubmitOutcome::KeyRevoked`]).
    pub fn remember(&self, h: ScopeHash, outcome: &SubmitOutcome) {
        if !matches!(outcome, SubmitOutcome::KeyRevoked { .. }) {
            self.seen.insert(h.0, ());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use uuid::Uuid;

    fn sub(key: &str) -> Submission {
        Submission {
            tenant: "acme".into(),
            operation: "op".into(),
            idempotency_key: key.into(),
            fingerprint: String::new(),
            canonical_request: String::new(),
            params: serde_json::Value::Null,
            contract: idem_core::config::Config::bundled()
                .unwrap()
                .contract("generation.dispatch")
                .unwrap(),
            api_key_id: Uuid::nil(),
            grant: None,
        }
    }

    #[test]
    fn only_bound_scopes_are_seen() {
        let h = ScopeHints::new();
        assert!(!h.seen(h.hash(&sub("a"))));
        h.remember(
            h.hash(&sub("a")),
            &SubmitOutcome::Conflict {
                task_id: Uuid::nil(),
            },
        );
        h.remember(
            h.hash(&sub("b")),
            &SubmitOutcome::KeyRevoked {
                api_key_id: Uuid::nil(),
            },
        );
        assert!(h.seen(h.hash(&sub("a"))));
        assert!(!h.seen(h.hash(&sub("b"))), "a refused key binds nothing");
        assert!(!h.seen(h.hash(&sub("c"))));
    }
}
