//! Flow control (SPEC §8 "Flow control"): per-tenant settings
//! (`[tenants."<tenant>"]`) and per-class settings (`[operations."<class>".flow]`).
//! - Rate limits: token buckets run by GCRA (the generic cell rate
//!   algorithm: one theoretical arrival time per bucket) whose state is kept
//!   in the database, so one limit holds across every instance on it.
//! - Concurrency caps: what a class, a tenant, a (tenant, class) and a
//!   concurrency key value may hold leased at once.
//!
//! Limits and caps are configuration, not part of a task's frozen contract:
//! a change applies to the next submit and the next claim. A missing table
//! or field is no limit.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fingerprint::{Fingerprint, JsonPointer, canonical_json};

/// Settings of one tenant (`[tenants."<tenant>"]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    /// The tenant's share of the claims of a pool serving it, against the
    /// other tenants with work (weighted round robin, SPEC §8); ≥ 1.
    #[serde(default = "one")]
    pub weight: i64,
    /// New submits per second of this tenant, all classes (a token bucket;
    /// replays and conflicts are not counted). `None` = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submits_per_s: Option<f64>,
    /// Most new submits admitted at once after a quiet spell (the bucket's
    /// size); default: `submits_per_s` rounded up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submits_burst: Option<u32>,
    /// Leased attempts of this tenant at once, all classes together
    /// (SPEC §8 "Concurrency caps"); `None` = no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<i64>,
}

impl Default for TenantSettings {
    fn default() -> Self {
        TenantSettings {
            weight: 1,
            submits_per_s: None,
            submits_burst: None,
            cap: None,
        }
    }
}

fn one() -> i64 {
    1
}

/// A tenant's weight (1 when not configured).
pub fn weight_of(tenants: &BTreeMap<String, TenantSettings>, tenant: &str) -> i64 {
    tenants.get(tenant).map_or(1, |t| t.weight)
}

/// The lowest and highest priority a submit may name (SPEC §4).
pub const PRIORITY_RANGE: [i64; 2] = [1, 5];

impl TenantSettings {
    /// Checks the weight and the cap (each at least 1).
    ///
    /// # Errors
    /// What is wrong, to be reported against the tenant.
    pub fn check(&self) -> Result<(), String> {
        if self.weight < 1 {
            return Err("weight must be at least 1".to_owned());
        }
        if self.cap.is_some_and(|c| c < 1) {
            return Err("cap must be at least 1".to_owned());
        }
        Ok(())
    }
}

/// Flow settings of one operation class (`[operations."<class>".flow]`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassFlow {
    /// New submits per second of this class, all tenants; burst = the rate
    /// rounded up. `None` = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submits_per_s: Option<f64>,
    /// Leases granted per second for this class, all tenants (the
    /// provider's limit); burst = the rate rounded up. `None` = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_starts_per_s: Option<f64>,
    /// Leased attempts of this class at once, all tenants together
    /// (SPEC §8 "Concurrency caps"); `None` = no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<i64>,
    /// Leased attempts of this class at once per tenant; `None` = no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_cap: Option<i64>,
    /// JSON Pointer (RFC 6901) into `params` naming the concurrency key,
    /// read at submit ([`concurrency_key`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key: Option<JsonPointer>,
    /// Leased attempts at once per concurrency key value (of this class and
    /// tenant); requires `concurrency_key`; `None` = no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key_cap: Option<i64>,
    /// JSON Pointer into params: claims serve the values found there (per
    /// tenant) in turn (SPEC §8 "Fair claims").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fairness_key: Option<JsonPointer>,
    /// The priorities a submit may name, `[min, max]` within 1–5 (default
    /// `[1, 5]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priorities: Option<[i64; 2]>,
}

impl ClassFlow {
    /// Whether nothing is set (the section is left out when written).
    pub fn is_empty(&self) -> bool {
        *self == ClassFlow::default()
    }

    /// Checks the caps (each at least 1; a key cap needs a key pointer).
    ///
    /// # Errors
    /// What is wrong, to be reported against the class.
    pub fn check(&self) -> Result<(), String> {
        for (name, cap) in [
            ("flow.cap", self.cap),
            ("flow.tenant_cap", self.tenant_cap),
            ("flow.concurrency_key_cap", self.concurrency_key_cap),
        ] {
            if cap.is_some_and(|c| c < 1) {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if self.concurrency_key_cap.is_some() && self.concurrency_key.is_none() {
            return Err("flow.concurrency_key_cap needs flow.concurrency_key".to_owned());
        }
        if let Some(p) = self.problem() {
            return Err(p.to_owned());
        }
        Ok(())
    }

    /// Whether the table is all defaults (left out when serialized).
    pub fn is_default(&self) -> bool {
        self.is_empty()
    }

    /// The allowed priority range.
    pub fn priority_range(&self) -> [i64; 2] {
        self.priorities.unwrap_or(PRIORITY_RANGE)
    }

    /// A problem with the priority range.
    pub fn problem(&self) -> Option<&'static str> {
        match self.priorities {
            Some([lo, hi]) if !(1 <= lo && lo <= hi && hi <= 5) => {
                Some("flow.priorities needs 1 <= min <= max <= 5")
            }
            _ => None,
        }
    }

    /// The fairness key value of `params` (SPEC §8 "Fair claims"): `None`
    /// when the class names no pointer; the string at the pointer as is, any
    /// other JSON value as its canonical text, `""` when the params have
    /// nothing there (those tasks share one queue).
    pub fn fairness_value(&self, params: &Value) -> Option<String> {
        let pointer = self.fairness_key.as_ref()?;
        Some(bounded_key_value(match params.pointer(pointer.as_str()) {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => canonical_json(v).unwrap_or_else(|_| v.to_string()),
        }))
    }
}

/// Longest fairness or concurrency key value kept as it is, in bytes
/// (SPEC §2.13, §8): the stores index these values, and a PostgreSQL btree
/// entry holds at most 2,704 bytes with the tenant and class beside them.
pub const MAX_KEY_VALUE_BYTES: usize = 256;

/// A fairness or concurrency key value as the stores keep it: `value` when
/// at most [`MAX_KEY_VALUE_BYTES`] long, else `sha256:` and the hex SHA-256
/// of its bytes, so tasks with one long value still share one queue and
/// one cap.
pub fn bounded_key_value(value: String) -> String {
    if value.len() <= MAX_KEY_VALUE_BYTES {
        value
    } else {
        Fingerprint::digest(value.as_bytes()).to_string()
    }
}

/// The concurrency key of `params` under `pointer` (SPEC §8 "Concurrency
/// caps"): a string value as it is, any other JSON value as its RFC 8785
/// canonical text; `None` when the pointer names nothing.
pub fn concurrency_key(pointer: &JsonPointer, params: &Value) -> Option<String> {
    match params.pointer(pointer.as_str())? {
        Value::String(s) => Some(bounded_key_value(s.clone())),
        other => canonical_json(other).ok().map(bounded_key_value),
    }
}

/// Highest rate accepted, per second (one token per microsecond).
pub const MAX_RATE_PER_S: f64 = 1_000_000.0;

/// A token bucket: `per_s` tokens per second, at most `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Tokens per second, `0 < per_s <= MAX_RATE_PER_S`.
    pub per_s: f64,
    /// Bucket size, >= 1.
    pub burst: u32,
}

impl RateLimit {
    /// `per_s` with a burst of `burst`, or of `per_s` rounded up (at least 1).
    pub fn new(per_s: f64, burst: Option<u32>) -> RateLimit {
        let burst = burst.unwrap_or_else(|| per_s.ceil().clamp(1.0, f64::from(u32::MAX)) as u32);
        RateLimit {
            per_s,
            burst: burst.max(1),
        }
    }

    /// The emission interval: microseconds per token (>= 1).
    pub fn interval_us(&self) -> i64 {
        ((1_000_000.0 / self.per_s).round() as i64).max(1)
    }

    /// GCRA: with the bucket's theoretical arrival time `tat_us` (µs since
    /// the epoch; 0 for a bucket never used) at `now_us`, `Ok(new tat)` when
    /// a token is free (admit iff `max(tat, now) + interval - burst ×
    /// interval <= now`), else `Err(µs until one is)`, >= 1.
    pub fn take(&self, tat_us: i64, now_us: i64) -> Result<i64, i64> {
        let interval = self.interval_us();
        let next = tat_us.max(now_us).saturating_add(interval);
        let allowed_at = next.saturating_sub(interval.saturating_mul(i64::from(self.burst)));
        if allowed_at <= now_us {
            Ok(next)
        } else {
            Err(allowed_at - now_us)
        }
    }
}

/// Checks a rate setting: finite, positive, at most [`MAX_RATE_PER_S`].
pub(crate) fn check_rate(name: &str, per_s: Option<f64>) -> Result<(), String> {
    match per_s {
        Some(r) if !(r.is_finite() && r > 0.0 && r <= MAX_RATE_PER_S) => Err(format!(
            "{name} must be a number > 0 and <= {MAX_RATE_PER_S}"
        )),
        _ => Ok(()),
    }
}

/// Checks every tenant's settings.
///
/// # Errors
/// `(tenant, message)` of the first setting out of range.
pub(crate) fn check_tenants(
    tenants: &BTreeMap<String, TenantSettings>,
) -> Result<(), (String, String)> {
    for (name, t) in tenants {
        check_rate("submits_per_s", t.submits_per_s).map_err(|m| (name.clone(), m))?;
        if t.submits_burst == Some(0) {
            return Err((name.clone(), "submits_burst must be at least 1".into()));
        }
        if t.submits_burst.is_some() && t.submits_per_s.is_none() {
            return Err((name.clone(), "submits_burst needs submits_per_s".into()));
        }
    }
    Ok(())
}

/// The bucket scope of a tenant's new submits (`tenant:<tenant>`).
pub fn tenant_scope(tenant: &str) -> String {
    format!("tenant:{tenant}")
}

/// The bucket scope of a class's new submits (`class:<class>`).
pub fn class_scope(class: &str) -> String {
    format!("class:{class}")
}

/// The bucket scope of a class's attempt starts (`starts:<class>`).
pub fn starts_scope(class: &str) -> String {
    format!("starts:{class}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pointer(s: &str) -> JsonPointer {
        JsonPointer::parse(s).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn concurrency_key_is_the_string_or_the_canonical_text() {
        let params = json!({"payee": "p-1", "n": 1.0, "o": {"b": 1, "a": [true]}});
        assert_eq!(
            concurrency_key(&pointer("/payee"), &params).as_deref(),
            Some("p-1")
        );
        assert_eq!(
            concurrency_key(&pointer("/n"), &params).as_deref(),
            Some("1")
        );
        assert_eq!(
            concurrency_key(&pointer("/o"), &params).as_deref(),
            Some(r#"{"a":[true],"b":1}"#)
        );
        assert_eq!(concurrency_key(&pointer("/missing"), &params), None);
    }

    #[test]
    fn caps_are_checked() {
        let ok = ClassFlow {
            cap: Some(1),
            tenant_cap: Some(2),
            concurrency_key: Some(pointer("/payee")),
            concurrency_key_cap: Some(1),
            ..ClassFlow::default()
        };
        assert_eq!(ok.check(), Ok(()));
        let zero = ClassFlow {
            cap: Some(0),
            ..ClassFlow::default()
        };
        assert!(zero.check().is_err());
        let keyless = ClassFlow {
            concurrency_key_cap: Some(1),
            ..ClassFlow::default()
        };
        assert!(keyless.check().is_err());
        let tenant = |cap| TenantSettings {
            cap: Some(cap),
            ..TenantSettings::default()
        };
        assert!(tenant(0).check().is_err());
        assert_eq!(tenant(3).check(), Ok(()));
    }

    /// A burst of `burst` is admitted at once, the next token one interval
    /// later; the wait is exact.
    #[test]
    fn gcra_admits_burst_then_rate() {
        let l = RateLimit::new(50.0, Some(2));
        assert_eq!(l.interval_us(), 20_000);
        let now = 1_000_000_000;
        let t1 = l.take(0, now).unwrap();
        let t2 = l.take(t1, now).unwrap();
        assert_eq!(l.take(t2, now), Err(20_000));
        assert_eq!(l.take(t2, now + 19_999), Err(1));
        assert!(l.take(t2, now + 20_000).is_ok());
    }

    /// The default burst is the rate rounded up, at least 1.
    #[test]
    fn default_burst() {
        assert_eq!(RateLimit::new(2.5, None).burst, 3);
        assert_eq!(RateLimit::new(0.1, None).burst, 1);
        assert_eq!(RateLimit::new(0.1, None).interval_us(), 10_000_000);
    }

    #[test]
    fn fairness_values_are_strings_as_is_and_other_json_as_canonical_text() {
        let flow = ClassFlow {
            fairness_key: Some(JsonPointer::parse("/ws").unwrap()),
            ..ClassFlow::default()
        };
        assert_eq!(
            flow.fairness_value(&json!({"ws": "a"})).as_deref(),
            Some("a")
        );
        assert_eq!(
            flow.fairness_value(&json!({"ws": {"b": 1, "a": 2}}))
                .as_deref(),
            Some(r#"{"a":2,"b":1}"#)
        );
        assert_eq!(flow.fairness_value(&json!({"ws": 7})).as_deref(), Some("7"));
        assert_eq!(flow.fairness_value(&json!({})).as_deref(), Some(""));
        let long = "w".repeat(MAX_KEY_VALUE_BYTES + 1);
        let digest = Fingerprint::digest(long.as_bytes()).to_string();
        assert_eq!(
            flow.fairness_value(&json!({ "ws": long })).as_deref(),
            Some(digest.as_str()),
            "a long value is kept as its digest"
        );
        assert_eq!(
            concurrency_key(&pointer("/ws"), &json!({ "ws": long })).as_deref(),
            Some(digest.as_str())
        );
        let most = "w".repeat(MAX_KEY_VALUE_BYTES);
        assert_eq!(
            flow.fairness_value(&json!({ "ws": most })).as_deref(),
            Some(most.as_str())
        );
        assert_eq!(
            ClassFlow::default().fairness_value(&json!({"ws": "a"})),
            None
        );
    }

    #[test]
    fn priority_ranges_stay_within_one_to_five() {
        let mut flow = ClassFlow::default();
        assert_eq!(flow.priority_range(), [1, 5]);
        assert_eq!(flow.problem(), None);
        for bad in [[0, 5], [1, 6], [4, 2]] {
            flow.priorities = Some(bad);
            assert!(flow.problem().is_some(), "{bad:?}");
        }
        flow.priorities = Some([2, 4]);
        assert_eq!(flow.problem(), None);
    }
}
