//! Flow control settings (SPEC §2.13, docs/configuration.md): per-tenant
//! settings (`[tenants."T"]`) and a class's flow table
//! (`[operations."C".flow]`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fingerprint::{JsonPointer, canonical_json};

/// Settings of one tenant (`[tenants."T"]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    /// The tenant's share of the claims of a pool serving it, against the
    /// other tenants with work (weighted round robin, SPEC §2.13); ≥ 1.
    #[serde(default = "one")]
    pub weight: i64,
}

impl Default for TenantSettings {
    fn default() -> Self {
        TenantSettings { weight: 1 }
    }
}

fn one() -> i64 {
    1
}

/// The lowest and highest priority a submit may name (SPEC §4).
pub const PRIORITY_RANGE: [i64; 2] = [1, 5];

/// A class's flow table (`[operations."C".flow]`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassFlow {
    /// JSON Pointer into params: claims serve the values found there (per
    /// tenant) in turn (SPEC §2.13).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fairness_key: Option<JsonPointer>,
    /// The priorities a submit may name, `[min, max]` within 1–5 (default
    /// `[1, 5]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priorities: Option<[i64; 2]>,
}

impl ClassFlow {
    /// Whether the table is all defaults (left out when serialized).
    pub fn is_default(&self) -> bool {
        self == &ClassFlow::default()
    }

    /// The allowed priority range.
    pub fn priority_range(&self) -> [i64; 2] {
        self.priorities.unwrap_or(PRIORITY_RANGE)
    }

    /// A problem with the table, for [`crate::config::Config::check`].
    pub fn problem(&self) -> Option<&'static str> {
        match self.priorities {
            Some([lo, hi]) if !(1 <= lo && lo <= hi && hi <= 5) => {
                Some("flow.priorities needs 1 <= min <= max <= 5")
            }
            _ => None,
        }
    }

    /// The fairness key value of `params` (SPEC §2.13): `None` when the class
    /// names no pointer; the string at the pointer as is, any other JSON
    /// value as its canonical text, `""` when the params have nothing there
    /// (those tasks share one queue).
    pub fn fairness_value(&self, params: &Value) -> Option<String> {
        let pointer = self.fairness_key.as_ref()?;
        Some(match params.pointer(pointer.as_str()) {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => canonical_json(v).unwrap_or_else(|_| v.to_string()),
        })
    }
}

/// A tenant's weight (1 when not configured).
pub fn weight_of(
    tenants: &std::collections::BTreeMap<String, TenantSettings>,
    tenant: &str,
) -> i64 {
    tenants.get(tenant).map_or(1, |t| t.weight)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fairness_values_are_strings_as_is_and_other_json_as_canonical_text() {
        let flow = ClassFlow {
            fairness_key: Some(JsonPointer::parse("/ws").unwrap()),
            priorities: None,
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
