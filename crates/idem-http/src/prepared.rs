//! Submit bodies already read, validated and fingerprinted by this process.
//!
//! A client that retries after a timeout or a reconnect sends the same bytes
//! again (same operation, same params). Reading a body under the strict JSON
//! rules, checking its operation and computing its RFC 8785 canonical form and
//! SHA-256 fingerprint is a pure function of those bytes and of the server's
//! configuration, which is fixed for the life of the process. So the result is
//! kept here, keyed by the exact body bytes, and a retry skips that work.
//!
//! This is a memo of a computation, not an answer cache: every submit still
//! goes to the store, whose transaction decides created, replayed or conflict
//! under its unique constraint (IDEM-01); what the caller may do (role, grant)
//! is still checked on every request. Only bodies that were accepted by the
//! checks are kept; a body that failed them is read again each time and fails
//! the same way.

use std::sync::Arc;

use axum::body::Bytes;
use quick_cache::Weighter;
use quick_cache::sync::Cache;
use serde_json::Value;

/// Bodies larger than this (bytes) are not kept: they are rare, and keeping
/// them would let a few requests take the whole budget.
pub const MAX_KEPT_BODY_BYTES: usize = 8 * 1024;

/// The memory budget of the memo (bytes, an upper estimate: see the weight
/// below). About 15,000 submit bodies of 120 bytes, 250 of the largest kept.
pub const BUDGET_BYTES: u64 = 32 * 1024 * 1024;

/// Parsed params take at most this many bytes of memory per byte of JSON (a
/// one-byte JSON value such as `0,` becomes a 32-byte `serde_json::Value`).
const PARSED_BYTES_PER_BODY_BYTE: usize = 16;

/// What a submit body yields once read and fingerprinted: its operation class,
/// params as submitted, and the fingerprint and canonical request of IDEM-02.
#[derive(Debug)]
pub struct PreparedBody {
    /// Operation class named by the body (known to this configuration).
    pub operation: String,
    /// Params as submitted (a JSON object).
    pub params: Value,
    /// `sha256:<hex>` of `canonical_request`.
    pub fingerprint: String,
    /// RFC 8785 canonical request.
    pub canonical_request: String,
}

#[derive(Clone)]
struct ByWeight;

impl Weighter<Bytes, Arc<PreparedBody>> for ByWeight {
    fn weight(&self, body: &Bytes, prepared: &Arc<PreparedBody>) -> u64 {
        // The body's copy, its parsed params at their worst, the strings,
        // and the entry's own overhead.
        let bytes = (1 + PARSED_BYTES_PER_BODY_BYTE) * body.len()
            + prepared.operation.len()
            + prepared.fingerprint.len()
            + prepared.canonical_request.len()
            + 256;
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }
}

/// The memo: body bytes → [`PreparedBody`], bounded by [`BUDGET_BYTES`]
/// (least useful entries are evicted first; see `quick_cache`).
pub struct PreparedBodies {
    cache: Cache<Bytes, Arc<PreparedBody>, ByWeight>,
}

impl std::fmt::Debug for PreparedBodies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedBodies")
            .field("entries", &self.cache.len())
            .field("weight_bytes", &self.cache.weight())
            .finish()
    }
}

impl Default for PreparedBodies {
    fn default() -> Self {
        PreparedBodies {
            cache: Cache::with_weighter(16_000, BUDGET_BYTES, ByWeight),
        }
    }
}

impl PreparedBodies {
    /// What `body` yielded before, if this process kept it.
    pub fn get(&self, body: &[u8]) -> Option<Arc<PreparedBody>> {
        if body.len() > MAX_KEPT_BODY_BYTES {
            return None;
        }
        self.cache.get(body)
    }

    /// Keeps what `body` yielded (ignored for bodies over
    /// [`MAX_KEPT_BODY_BYTES`]). The bytes are copied, so the request's buffer
    /// is not held.
    pub fn insert(&self, body: &[u8], prepared: Arc<PreparedBody>) {
        if body.len() <= MAX_KEPT_BODY_BYTES {
            self.cache.insert(Bytes::copy_from_slice(body), prepared);
        }
    }

    /// Number of kept bodies.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepared(op: &str) -> Arc<PreparedBody> {
        Arc::new(PreparedBody {
            operation: op.to_owned(),
            params: serde_json::json!({"a": 1}),
            fingerprint: "sha256:00".to_owned(),
            canonical_request: "{}".to_owned(),
        })
    }

    #[test]
    fn keeps_by_exact_bytes_and_skips_large_bodies() {
        let memo = PreparedBodies::default();
        memo.insert(br#"{"operation":"a","params":{}}"#, prepared("a"));
        assert_eq!(
            memo.get(br#"{"operation":"a","params":{}}"#)
                .map(|p| p.operation.clone()),
            Some("a".to_owned())
        );
        // One byte of difference (here a space) is another body.
        assert!(memo.get(br#"{"operation":"a", "params":{}}"#).is_none());
        let large = vec![b' '; MAX_KEPT_BODY_BYTES + 1];
        memo.insert(&large, prepared("b"));
        assert!(memo.get(&large).is_none());
        assert_eq!(memo.len(), 1);
    }

    #[test]
    fn stays_within_its_budget() {
        let memo = PreparedBodies::default();
        let body = vec![b'x'; MAX_KEPT_BODY_BYTES];
        for i in 0..4_000u32 {
            let mut b = body.clone();
            b[..4].copy_from_slice(&i.to_le_bytes());
            memo.insert(&b, prepared("a"));
        }
        assert!(memo.cache.weight() <= BUDGET_BYTES);
        assert!(memo.len() < 4_000);
    }
}
