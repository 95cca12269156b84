//! Rate limits kept in the database (SPEC §8.1): the token of each bucket a
//! new submit or an attempt start takes, by GCRA over the bucket's one row
//! (`rate_limits`: scope, theoretical arrival time in µs), locked for the
//! transaction that takes it. The configuration is the caller's: the
//! limits travel in the request ([`crate::ops::Submission::rate_limits`],
//! [`crate::ops::ClaimRequest::flow`]).
//!
//! A bucket's row is in the database, not in a process, so one limit holds
//! across every instance on the database; an in-process limiter would let
//! each instance admit the whole rate.

use std::collections::BTreeMap;

use idem_core::flow::RateLimit;
use idem_core::model::Timestamp;

use crate::{Result, Tx};

/// Metric: attempt starts refused for want of a token, by `operation`.
pub const ATTEMPT_STARTS_THROTTLED: &str = "idem_attempt_starts_throttled_total";

/// Takes one token from every bucket of each entry of `wanted`, in order,
/// at `now` (ms): an entry is admitted only when all its buckets have a
/// token (then all are taken), else it takes none and answers the ms until
/// every one of its buckets would have one (>= 1). Each bucket's row is
/// locked once, in scope order (so transactions taking several never wait
/// on each other in a cycle), and written once.
///
/// # Errors
/// Any [`crate::StoreError`] of the statements.
pub async fn take_tokens<T: Tx>(
    tx: &mut T,
    wanted: &[&[(String, RateLimit)]],
    now: Timestamp,
) -> Result<Vec<std::result::Result<(), i64>>> {
    let mut tats: BTreeMap<&str, (i64, bool)> = BTreeMap::new();
    for (scope, _) in wanted.iter().flat_map(|w| w.iter()) {
        tats.entry(scope.as_str()).or_insert((0, false));
    }
    for (scope, (tat, _)) in tats.iter_mut() {
        *tat = tx.lock_rate(scope).await?;
    }
    let now_us = now.ms().saturating_mul(1000);
    let mut out = Vec::with_capacity(wanted.len());
    for buckets in wanted {
        let mut next = Vec::with_capacity(buckets.len());
        let mut wait_us = 0i64;
        for (scope, limit) in buckets.iter() {
            let tat = tats.get(scope.as_str()).map_or(0, |t| t.0);
            match limit.take(tat, now_us) {
                Ok(t) => next.push((scope.as_str(), t)),
                Err(w) => wait_us = wait_us.max(w),
            }
        }
        if wait_us > 0 {
            out.push(Err(ceil_ms(wait_us)));
            continue;
        }
        for (scope, t) in next {
            if let Some(e) = tats.get_mut(scope) {
                *e = (t, true);
            }
        }
        out.push(Ok(()));
    }
    for (scope, (tat, changed)) in tats {
        if changed {
            tx.set_rate(scope, tat).await?;
        }
    }
    Ok(out)
}

/// Takes one token from `class`'s attempt-start bucket (`starts:<class>`)
/// at `now` (ms); `false` when it has none (and counts the refusal in
/// [`ATTEMPT_STARTS_THROTTLED`]).
///
/// # Errors
/// Any [`crate::StoreError`] of the statements.
pub async fn take_start_token<T: Tx>(
    tx: &mut T,
    class: &str,
    limit: RateLimit,
    now: Timestamp,
) -> Result<bool> {
    let scope = idem_core::flow::starts_scope(class);
    let wanted = [(scope, limit)];
    let taken = take_tokens(tx, &[&wanted], now).await?;
    let ok = taken.first().is_some_and(|r| r.is_ok());
    if !ok {
        metrics::counter!(ATTEMPT_STARTS_THROTTLED, "operation" => class.to_owned()).increment(1);
    }
    Ok(ok)
}

/// `us` microseconds in whole ms, rounded up.
fn ceil_ms(us: i64) -> i64 {
    (us.saturating_add(999) / 1000).max(1)
}
