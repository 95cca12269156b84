//! Flow control settings (SPEC §5 "Flow control"): what a class and a
//! tenant may hold at once. Read from the configuration's
//! `[operations.<class>.flow]` and `[tenants."<tenant>"]` tables; a missing
//! table or field is no limit.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fingerprint::{JsonPointer, canonical_json};

/// A class's `[operations.<class>.flow]` table.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassFlow {
    /// Leased attempts of this class at once, all tenants together
    /// (SPEC §5 "Concurrency caps"); `None` = no cap.
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
}

impl ClassFlow {
    /// Whether nothing is set (the table is left out when serialised).
    pub fn is_empty(&self) -> bool {
        self == &ClassFlow::default()
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
        Ok(())
    }
}

/// A tenant's `[tenants."<tenant>"]` table.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    /// Leased attempts of this tenant at once, all classes together
    /// (SPEC §5 "Concurrency caps"); `None` = no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<i64>,
}

impl TenantSettings {
    /// Checks the settings (a cap is at least 1).
    ///
    /// # Errors
    /// What is wrong, to be reported against the tenant.
    pub fn check(&self) -> Result<(), String> {
        if self.cap.is_some_and(|c| c < 1) {
            return Err("cap must be at least 1".to_owned());
        }
        Ok(())
    }
}

/// The concurrency key of `params` under `pointer` (SPEC §5 "Concurrency
/// caps"): a string value as it is, any other JSON value as its RFC 8785
/// canonical text; `None` when the pointer names nothing.
pub fn concurrency_key(pointer: &JsonPointer, params: &Value) -> Option<String> {
    match params.pointer(pointer.as_str())? {
        Value::String(s) => Some(s.clone()),
        other => canonical_json(other).ok(),
    }
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
        assert!(TenantSettings { cap: Some(0) }.check().is_err());
        assert_eq!(TenantSettings { cap: Some(3) }.check(), Ok(()));
    }
}
