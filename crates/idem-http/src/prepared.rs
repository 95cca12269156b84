//! Submit bodies already read, validated and fingerprinted by this process.
//!
//! A client that retries after a timeout or a reconnect sends the same bytes
//! again (same operation, same params). Reading a body under the strict JSON
//! rules, checking its operation and computing its RFC 8785 canonical form and
//! SHA-256 fingerprint is a pure function of those bytes and of the server's
//! configuration, which is fixed for the life of the process. So the result is
//! kept here, keyed by the submitting API key and the exact body bytes, and a
//! retry skips that work.
//!
//! This is a memo of a computation, not an answer cache: every submit still
//! goes to the store, whose transaction decides created, replayed or conflict
//! under its unique constraint (IDEM-01), and what the caller may do (role,
//! grant) is checked on every request. Only bodies that passed every check for
//! the key that sent them are kept. Entries belong to one API key, so whether a
//! body is kept (a faster answer) tells a caller nothing about what other keys
//! or tenants sent.

use std::sync::Arc;

use axum::body::Bytes;
use quick_cache::Weighter;
use quick_cache::sync::Cache;
use serde_json::Value;
use uuid::Uuid;

/// Bodies larger than this (bytes) are not kept: they are rare, and keeping
/// them would let a few requests take the whole budget.
pub const MAX_KEPT_BODY_BYTES: usize = 8 * 1024;

/// The memory budget of the memo (bytes, as estimated by [`heap_bytes`] for
/// the parsed params plus the kept strings and bytes).
pub const BUDGET_BYTES: u64 = 32 * 1024 * 1024;

/// An entry estimated above this many bytes is not kept (a small body can
/// parse into much more memory, e.g. many one-entry objects). It also keeps
/// every entry within one shard's share of the budget.
pub const MAX_ENTRY_BYTES: u64 = 64 * 1024;

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
    /// The body's `priority`, if it named one.
    pub priority: Option<i64>,
}

impl PreparedBody {
    /// Estimated heap bytes held by this value.
    fn heap_bytes(&self) -> u64 {
        heap_bytes(&self.params)
            .saturating_add(self.operation.capacity() as u64)
            .saturating_add(self.fingerprint.capacity() as u64)
            .saturating_add(self.canonical_request.capacity() as u64)
    }
}

/// Estimated heap bytes of a parsed JSON value, counting what its allocations
/// take rather than its text: an object is a `BTreeMap` whose nodes hold 11
/// entries and take about 540 bytes (leaf) to 630 (internal) even for one
/// entry; an array takes 32 bytes per slot.
pub fn heap_bytes(v: &Value) -> u64 {
    const VALUE: u64 = std::mem::size_of::<Value>() as u64;
    const MAP_NODE: u64 = 640;
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        Value::String(s) => s.capacity() as u64,
        Value::Array(items) => items.iter().fold(
            (items.capacity() as u64).saturating_mul(VALUE),
            |acc, item| acc.saturating_add(heap_bytes(item)),
        ),
        Value::Object(map) => {
            // Nodes are between half full and full: count one per 6 entries.
            let nodes = 1 + map.len() as u64 / 6;
            map.iter()
                .fold(nodes.saturating_mul(MAP_NODE), |acc, (k, v)| {
                    acc.saturating_add(k.capacity() as u64)
                        .saturating_add(heap_bytes(v))
                })
        }
    }
}

#[derive(Clone)]
struct Entry {
    prepared: Arc<PreparedBody>,
    /// The entry's estimated bytes, computed once when it is kept.
    weight: u64,
}

#[derive(Clone)]
struct ByWeight;

impl Weighter<Bytes, Entry> for ByWeight {
    fn weight(&self, _key: &Bytes, entry: &Entry) -> u64 {
        entry.weight
    }
}

/// The memo: (API key, body bytes) → [`PreparedBody`], bounded by
/// [`BUDGET_BYTES`] (least useful entries are evicted first; see
/// `quick_cache`).
pub struct PreparedBodies {
    cache: Cache<Bytes, Entry, ByWeight>,
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

/// The cache key: the API key's 16 bytes, then the body.
fn memo_key(api_key: Uuid, body: &[u8]) -> Option<Vec<u8>> {
    if body.len() > MAX_KEPT_BODY_BYTES {
        return None;
    }
    let mut key = Vec::with_capacity(16 + body.len());
    key.extend_from_slice(api_key.as_bytes());
    key.extend_from_slice(body);
    Some(key)
}

impl PreparedBodies {
    /// What `body` yielded before when `api_key` sent it, if this process kept
    /// it.
    pub fn get(&self, api_key: Uuid, body: &[u8]) -> Option<Arc<PreparedBody>> {
        let key = memo_key(api_key, body)?;
        self.cache.get(key.as_slice()).map(|entry| entry.prepared)
    }

    /// Keeps what `body` yielded for `api_key`, unless the body is over
    /// [`MAX_KEPT_BODY_BYTES`] or the entry over [`MAX_ENTRY_BYTES`].
    pub fn insert(&self, api_key: Uuid, body: &[u8], prepared: Arc<PreparedBody>) {
        let Some(key) = memo_key(api_key, body) else {
            return;
        };
        // The key's copy, the parsed params and strings, the entry's overhead.
        let weight = (key.len() as u64)
            .saturating_add(prepared.heap_bytes())
            .saturating_add(256);
        if weight <= MAX_ENTRY_BYTES {
            self.cache
                .insert(Bytes::from(key), Entry { prepared, weight });
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

    fn prepared(params: Value) -> Arc<PreparedBody> {
        Arc::new(PreparedBody {
            operation: "a".to_owned(),
            params,
            fingerprint: "sha256:00".to_owned(),
            canonical_request: "{}".to_owned(),
            priority: None,
        })
    }

    #[test]
    fn keeps_by_api_key_and_exact_bytes_and_skips_large_bodies() {
        let memo = PreparedBodies::default();
        let (k1, k2) = (Uuid::now_v7(), Uuid::now_v7());
        let body = br#"{"operation":"a","params":{}}"#;
        memo.insert(k1, body, prepared(serde_json::json!({})));
        assert!(memo.get(k1, body).is_some());
        // Another key's request is its own, even with the same bytes.
        assert!(memo.get(k2, body).is_none());
        // One byte of difference (here a space) is another body.
        assert!(memo.get(k1, br#"{"operation":"a", "params":{}}"#).is_none());
        let large = vec![b' '; MAX_KEPT_BODY_BYTES + 1];
        memo.insert(k1, &large, prepared(serde_json::json!({})));
        assert!(memo.get(k1, &large).is_none());
        assert_eq!(memo.len(), 1);
    }

    /// Small bodies that parse into much more memory than their bytes (many
    /// one-entry objects) are weighed by what they take, and not kept when
    /// that is over [`MAX_ENTRY_BYTES`].
    #[test]
    fn weighs_parsed_params_by_their_allocations() {
        let objects: Vec<Value> = (0..1_000).map(|_| serde_json::json!({"": 0})).collect();
        let params = serde_json::json!({ "o": objects });
        let text = params.to_string();
        assert!(text.len() <= MAX_KEPT_BODY_BYTES, "{}", text.len());
        assert!(heap_bytes(&params) > 50 * text.len() as u64);
        let memo = PreparedBodies::default();
        let key = Uuid::now_v7();
        memo.insert(key, text.as_bytes(), prepared(params));
        assert!(memo.get(key, text.as_bytes()).is_none());
    }

    #[test]
    fn stays_within_its_budget() {
        let memo = PreparedBodies::default();
        let key = Uuid::now_v7();
        let text = "x".repeat(MAX_KEPT_BODY_BYTES - 64);
        for i in 0..8_000u32 {
            let body = format!("{i:08}{text}");
            memo.insert(key, body.as_bytes(), prepared(Value::String(body.clone())));
        }
        assert!(memo.cache.weight() <= BUDGET_BYTES);
        assert!(memo.len() < 8_000);
        assert!(memo.len() > 1_000, "{}", memo.len());
    }
}
