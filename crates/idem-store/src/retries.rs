//! Retries answered without a write: which scopes a process has seen bound
//! ([`ScopeHints`], a routing hint) and the read-only answer of a submit to
//! such a scope ([`answer`], [`answer_batch`]), used by both backends.
//!
//! A backend sends a submit whose scope is in its hints to a retry lane, which
//! answers a batch of them with one read: a replay or a conflict exactly as
//! the write path's [`SubmitPlan`] answers a taken scope, without the write
//! lock, a transaction or an insert attempt. What the read cannot answer (a
//! scope never bound or released by retention, a revoked key, a hash
//! collision) goes on to the write path as if it had never been here.

use std::hash::BuildHasher;
use std::sync::Arc;

use crate::ops::{Call, Submission, Submit, SubmitOutcome, SubmitPlan};
use crate::{Result, Tx, batch};

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
    /// (anything but [`SubmitOutcome::KeyRevoked`] and
    /// [`SubmitOutcome::RateLimited`]).
    pub fn remember(&self, h: ScopeHash, outcome: &SubmitOutcome) {
        if !matches!(
            outcome,
            SubmitOutcome::KeyRevoked { .. } | SubmitOutcome::RateLimited { .. }
        ) {
            self.seen.insert(h.0, ());
        }
    }
}

/// The lane a submit takes ([`route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Its scope was seen bound: the reader that answers retries without a
    /// write ([`answer_batch`]), which hands on what it cannot answer.
    Retry,
    /// The write path.
    Write,
}

/// Routes a submit, the same way in every backend: to [`Lane::Retry`] when
/// `hints` saw its scope bound, else to [`Lane::Write`]; once answered, a
/// scope not seen before is remembered, and the answer goes to the caller.
/// `send` hands the inner call to the backend's lane (and answers it, should
/// that lane be gone); `stopped` is the error when no answer comes back.
/// Without `hints` (routing off) every submit is written.
pub async fn route(
    hints: Option<&ScopeHints>,
    call: Call<Submit>,
    send: impl FnOnce(Call<Submit>, Lane),
    stopped: impl FnOnce() -> crate::StoreError,
) {
    let Call { op, reply } = call;
    let scope = hints.map(|h| (h, h.hash(&op.0)));
    let seen = scope.is_some_and(|(h, s)| h.seen(s));
    let (inner, answer) = Call::new(op);
    send(inner, if seen { Lane::Retry } else { Lane::Write });
    let out = answer.await.unwrap_or_else(|_| Err(stopped()));
    if let (Some((h, s)), false, Ok(outcome)) = (scope, seen, &out) {
        h.remember(s, outcome);
    }
    let _ = reply.send(out);
}

/// Answers retries without writing: for each submission, in order, `Some`
/// replay or conflict when its API key is live and its scope row is bound
/// (read by [`Tx::live_scopes_with_tasks`], answered by the same
/// [`SubmitPlan`] as the write path), `None` when its key is revoked or its
/// scope is not bound: those must go through the write path, which refuses
/// the key or creates the task. Reads only.
///
/// # Errors
/// Any [`crate::StoreError`] of the reads; [`crate::StoreError::Corrupt`]
/// when a scope row names a missing task.
pub async fn answer<T: Tx>(tx: &mut T, subs: &[Submission]) -> Result<Vec<Option<SubmitOutcome>>> {
    let mut existing = tx.live_scopes_with_tasks(subs).await?;
    crate::ops::scopes_with_second_effects(tx, &mut existing).await?;
    SubmitPlan::new(subs).read_only().answer(existing)
}

/// Answers a retry lane's batch `calls` with `read` (one read for the batch:
/// [`answer`] in one of the backend's read transactions). When the read fails in a
/// way one row may have caused (any error but [`crate::StoreError::is_retryable`],
/// e.g. a row that does not decode), each submission is read on its own
/// ([`batch::or_one_by_one`]). A submission the read answers gets its
/// answer; one it cannot answer, or whose own read failed that way, goes to
/// `write` (the write path answers it, or fails it alone); when the database
/// failed the read (a retryable error: the write path would meet the same),
/// its caller gets that error (503: retry with the same key).
pub async fn answer_batch(
    calls: Vec<Call<Submit>>,
    read: &mut impl batch::RunBatch<Submission, Out = Option<SubmitOutcome>>,
    mut write: impl FnMut(Call<Submit>),
) {
    let (subs, replies): (Vec<Submission>, Vec<_>) =
        calls.into_iter().map(|c| (c.op.0, c.reply)).unzip();
    let answers = batch::or_one_by_one(&subs, read, |e| !e.is_retryable()).await;
    for ((sub, reply), answer) in subs.into_iter().zip(replies).zip(answers) {
        match answer {
            Ok(Some(outcome)) => {
                let _ = reply.send(Ok(outcome));
            }
            Err(e) if e.is_retryable() => {
                let _ = reply.send(Err(e));
            }
            Ok(None) | Err(_) => write(Call {
                op: Submit(sub),
                reply,
            }),
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
            contract: idem_core::contract::FrozenContract::new(
                idem_core::config::Config::bundled()
                    .unwrap()
                    .contract("generation.dispatch")
                    .unwrap(),
            )
            .unwrap(),
            api_key_id: Uuid::nil(),
            grant: None,
            traceparent: None,
            rate_limits: Vec::new(),
            concurrency_key: None,
            priority: 3,
            fairness_key: None,
        }
    }

    fn task(s: Submission) -> idem_core::model::Task {
        let new = idem_core::machine::NewTask {
            id: Uuid::nil(),
            tenant: s.tenant,
            operation: s.operation,
            idempotency_key: s.idempotency_key,
            fingerprint: s.fingerprint,
            canonical_request: s.canonical_request,
            params: s.params,
            contract: s.contract,
            api_key_id: s.api_key_id,
            grant: s.grant,
            traceparent: s.traceparent,
            priority: s.priority,
            fairness_key: s.fairness_key,
        };
        idem_core::machine::accept(new, idem_core::model::Timestamp(0)).0
    }

    #[test]
    fn only_bound_scopes_are_seen() {
        let h = ScopeHints::new();
        assert!(!h.seen(h.hash(&sub("a"))));
        h.remember(
            h.hash(&sub("a")),
            &SubmitOutcome::Conflict {
                task: Box::new(task(sub("a"))),
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
