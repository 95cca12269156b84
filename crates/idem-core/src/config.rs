//! Operation classes and the contract frozen onto each task (SPEC §5).
//!
//! The configuration is one TOML document (`[operations."<class>"]` tables).
//! [`Config::from_toml`] parses and checks it; [`Config::from_toml_with_env`] applies
//! `IDEM_OPERATIONS__<CLASS>__<SECTION>__<FIELD>` overrides (class names
//! upper-cased with `.` and `-` written as `_`). Parsing is pure: the caller
//! reads files and the environment.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::fingerprint::JsonPointer;
use crate::flow::{ClassFlow, TenantSettings};
use crate::money::{Currency, Money};
use crate::schema::ParamsSchema;

/// The bundled default configuration (also shipped as `examples/idem.toml`).
pub const DEFAULT_TOML: &str = include_str!("../../../examples/idem.toml");

/// Errors from reading or checking a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The TOML did not parse or did not match the schema.
    #[error("configuration does not parse: {0}")]
    Parse(String),
    /// A class's retention is shorter than its windows (SPEC §2.9).
    #[error(
        "operation class `{class}`: retention_ms {retention_ms} is shorter than request_retry_ms + deadline_ms + reconciliation_ms = {required_ms} (SPEC §2.9, IDEM-01)"
    )]
    RetentionTooShort {
        /// The class.
        class: String,
        /// Its configured retention.
        retention_ms: i64,
        /// The minimum it must have.
        required_ms: i64,
    },
    /// A value is out of its range.
    #[error("operation class `{class}`: {message}")]
    Invalid {
        /// The class.
        class: String,
        /// What is wrong.
        message: String,
    },
    /// A tenant's setting is out of its range (`[tenants."<tenant>"]`).
    #[error("tenant `{tenant}`: {message}")]
    Tenant {
        /// The tenant.
        tenant: String,
        /// What is wrong.
        message: String,
    },
    /// An `IDEM_OPERATIONS__…` variable names nothing in the configuration.
    #[error("environment override {name}: {message}")]
    Override {
        /// The variable name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// There is no operation class at all.
    #[error("configuration defines no operation class")]
    Empty,
}

/// Backoff between execute attempts: `initial_ms × multiplier^(n−1)`, capped at `max_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Backoff {
    /// First delay, ms.
    pub initial_ms: i64,
    /// Growth factor per attempt (≥ 1).
    pub multiplier: f64,
    /// Upper bound, ms.
    pub max_ms: i64,
}

impl Backoff {
    /// Delay in ms before execute attempt number `next` (2 → `initial_ms`).
    pub fn delay_ms(&self, next: i64) -> i64 {
        let exp = i32::try_from(next.saturating_sub(2).max(0)).unwrap_or(i32::MAX);
        // Float only for the growth factor; the result is clamped to integer ms.
        let d = (self.initial_ms as f64) * self.multiplier.powi(exp);
        if d.is_finite() && d < self.max_ms as f64 {
            d as i64
        } else {
            self.max_ms
        }
    }
}

/// Retry policy (SPEC §2.5; seed retry table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Declared safe to repeat: transient failures and expired leases lead to a new execute attempt.
    pub safe: bool,
    /// Execute attempts at most.
    pub max_attempts: i64,
    /// Delay before each new execute attempt.
    pub backoff: Backoff,
    /// No new execute attempt starts later than this many ms after acceptance.
    pub deadline_ms: i64,
    /// Usage units the task may consume; beyond it no retry (`budget_exhausted`).
    pub usage_budget: i64,
}

/// Lease bounds (SPEC §5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LeasePolicy {
    /// Lease length when a claim gives none, ms.
    pub default_ms: i64,
    /// Longest lease a claim may ask for, ms.
    pub max_ms: i64,
}

/// Shortest lease a claim may ask for, ms (SPEC §4).
pub const MIN_LEASE_MS: i64 = 100;

/// Windows of an operation class (SPEC §2.9, IDEM-01 retention).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Windows {
    /// How long clients may retry a request, ms.
    pub request_retry_ms: i64,
    /// How long an unknown outcome may take to reconcile, ms.
    pub reconciliation_ms: i64,
    /// How long the idempotency key is kept after the task ends, ms.
    pub retention_ms: i64,
}

/// Fee policy, integer minor currency units (SPEC §5). After delivery the fee is the full price.
///
/// `currency` names the ISO 4217 currency the amounts are minor units of
/// (`"EUR"`: cents); `exponent`, its minor-unit exponent, is never configured:
/// it is taken from the ISO 4217 table when the contract is frozen. Both are absent for a class that names no currency (amounts are
/// then "minor units" of no named currency) and in contracts frozen before
/// idem carried them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Fees {
    /// ISO 4217 alphabetic code of the currency the amounts are in, e.g. `EUR`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = "EUR", pattern = "^[A-Z]{3}$"))]
    pub currency: Option<String>,
    /// Decimals of the currency's minor unit (EUR 2, JPY 0, KWD 3), from ISO
    /// 4217; present in a contract whenever `currency` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exponent: Option<u32>,
    /// Price of a delivered task (the delivery's charge).
    pub price: i64,
    /// Fee for a cancellation confirmed before any attempt started.
    pub cancel_before_start: i64,
    /// Fixed part of the fee for a cancellation confirmed after an attempt started.
    pub cancel_after_start_fixed: i64,
    /// Price of one usage unit, added to the after-start fee.
    pub usage_unit_price: i64,
}

impl Fees {
    /// The currency the amounts are in, `None` when the policy names none.
    /// A contract's frozen exponent wins over the ISO table (a contract never
    /// changes); a configured class's comes from the table.
    pub fn currency(&self) -> Option<Currency> {
        let code = self.currency.as_ref()?;
        match self.exponent {
            Some(exponent) => Some(Currency {
                code: code.clone(),
                exponent,
            }),
            None => Currency::from_code(code).ok(),
        }
    }

    /// `amount` minor units in this policy's currency.
    pub fn money(&self, amount: i64) -> Money {
        Money::new(amount, self.currency())
    }

    /// Fee for a cancellation confirmed after start with `usage` units
    /// consumed, minor currency units: the fixed part plus usage × unit price,
    /// at most 2^53−1 (the largest integer idem's JSON carries exactly).
    pub fn after_start(&self, usage: i64) -> i64 {
        self.cancel_after_start_fixed
            .saturating_add(usage.saturating_mul(self.usage_unit_price))
            .min(crate::json::MAX_SAFE_INTEGER as i64)
    }
}

/// One operation class as configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationClass {
    /// JSON pointers of the material fields; empty = all params.
    #[serde(default)]
    pub fingerprint: Vec<JsonPointer>,
    /// JSON Schema the submit's `params` must match, if any (written as a
    /// TOML table; compiled by [`Config::check`]). A submit that does not
    /// match is 400 `INVALID_REQUEST` and consumes no key (SPEC §5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params_schema: Option<ParamsSchema>,
    /// Retry policy.
    pub retry: RetryPolicy,
    /// Lease bounds.
    pub lease: LeasePolicy,
    /// Windows.
    pub windows: Windows,
    /// Fees.
    pub fees: Fees,
    /// Fields of `params` shown beside a task (the console's search, `idem
    /// task list --table`): display name → JSON Pointer, in written order.
    #[serde(default, skip_serializing_if = "DisplayFields::is_empty")]
    pub display: DisplayFields,
    /// Flow control of the class (`[operations."<class>".flow]`, SPEC §8).
    #[serde(default, skip_serializing_if = "ClassFlow::is_empty")]
    pub flow: ClassFlow,
}

/// A class's `[display]` table: named JSON Pointers (RFC 6901) into a task's
/// `params`, in the order the configuration writes them, e.g. `payee =
/// "/payee"`, `amount = "/amount"`. Names are unique (TOML keys); a pointer
/// that does not parse is a configuration error.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DisplayFields(pub Vec<(String, JsonPointer)>);

impl DisplayFields {
    /// No field configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The fields in order: name and pointer.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &JsonPointer)> {
        self.0.iter().map(|(n, p)| (n.as_str(), p))
    }

    /// Each field's value in `params`, in order: `None` where the pointer
    /// finds nothing.
    pub fn values<'a>(
        &'a self,
        params: &'a serde_json::Value,
    ) -> impl Iterator<Item = (&'a str, Option<&'a serde_json::Value>)> {
        self.iter().map(|(n, p)| (n, params.pointer(p.as_ref())))
    }

    /// Whether the fields `amount` and `currency` are both configured: then
    /// they read as one amount (SPEC §5 "Money": people read amounts in one
    /// form on every surface).
    fn has_money(&self) -> bool {
        self.iter().any(|(n, _)| n == DISPLAY_AMOUNT)
            && self.iter().any(|(n, _)| n == DISPLAY_CURRENCY)
    }

    /// The names the fields are shown under, in order: every field's, but
    /// `currency`'s when it is shown within `amount` ([`DisplayFields::shown`]).
    pub fn columns(&self) -> impl Iterator<Item = &str> {
        let money = self.has_money();
        self.iter()
            .map(|(n, _)| n)
            .filter(move |n| !(money && *n == DISPLAY_CURRENCY))
    }

    /// Each of [`DisplayFields::columns`] with its value in `params` as text,
    /// `None` where the pointer finds nothing: a string as it is, another
    /// value as JSON; `amount` with `currency` (an integer of minor units and
    /// an ISO 4217 code) as [`Money`] writes it (`EUR 12.50`), else both as
    /// given (`1250 XYZ`).
    pub fn shown<'a>(&'a self, params: &'a serde_json::Value) -> Vec<(&'a str, Option<String>)> {
        let money = self.has_money();
        let values: Vec<(&str, Option<&serde_json::Value>)> = self.values(params).collect();
        let get = |name: &str| {
            values
                .iter()
                .find(|(n, _)| *n == name)
                .and_then(|(_, v)| *v)
        };
        let text = |v: &serde_json::Value| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let mut out = Vec::new();
        for (name, v) in &values {
            if money && *name == DISPLAY_CURRENCY {
                continue;
            }
            let shown = v.map(|v| {
                if !(money && *name == DISPLAY_AMOUNT) {
                    return text(v);
                }
                let code = get(DISPLAY_CURRENCY);
                let currency = code
                    .and_then(serde_json::Value::as_str)
                    .and_then(|c| Currency::from_code(c).ok());
                match (v.as_i64(), currency, code) {
                    (Some(minor), Some(c), _) => Money::new(minor, Some(c)).to_string(),
                    (_, _, Some(c)) => format!("{} {}", text(v), text(c)),
                    (_, _, None) => text(v),
                }
            });
            out.push((*name, shown));
        }
        out
    }
}

/// The display field whose integer value is an amount in minor units.
pub const DISPLAY_AMOUNT: &str = "amount";
/// The display field whose value is the ISO 4217 code of `amount`.
pub const DISPLAY_CURRENCY: &str = "currency";

impl Serialize for DisplayFields {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, pointer) in &self.0 {
            map.serialize_entry(name, pointer)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for DisplayFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = DisplayFields;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a table of display names to JSON Pointers")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<DisplayFields, A::Error> {
                let mut fields = Vec::new();
                while let Some((name, pointer)) = map.next_entry::<String, JsonPointer>()? {
                    fields.push((name, pointer));
                }
                Ok(DisplayFields(fields))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Operation classes by name.
    pub operations: BTreeMap<String, OperationClass>,
    /// Per-tenant settings (`[tenants."<tenant>"]`, SPEC §8), by tenant.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, TenantSettings>,
}

/// The policy frozen onto a task when it is accepted (SPEC §1 "contract").
/// Later configuration changes never alter it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Contract {
    /// Price in minor units (= `fees.price`).
    pub price: i64,
    /// Retry policy.
    pub retry: RetryPolicy,
    /// Fees.
    pub fees: Fees,
    /// Lease bounds.
    pub lease: LeasePolicy,
    /// Windows.
    pub windows: Windows,
    /// Version of the configuration the contract came from (`cfg-<12 hex>`).
    pub config_version: String,
    /// JSON pointers (RFC 6901) of the material fields the task's request was
    /// fingerprinted by (empty = all params), frozen with the rest so that a
    /// retry is judged by the rule its task was accepted under (IDEM-01,
    /// IDEM-02), whatever the configuration says later. Absent on tasks
    /// accepted before idem froze it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Vec<String>>))]
    pub fingerprint: Option<Vec<crate::fingerprint::JsonPointer>>,
    /// The JSON Schema the task's params were checked against at acceptance
    /// (the class's `params_schema`), frozen with the rest so the task records
    /// what it was accepted under. Absent when the class has none.
    // Shared, not copied, by the contracts of one class (one per submit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub params_schema: Option<std::sync::Arc<serde_json::Value>>,
}

impl Contract {
    /// `amount` minor units in the contract's frozen currency (`None`: minor
    /// units of no named currency).
    pub fn money(&self, amount: i64) -> Money {
        self.fees.money(amount)
    }

    /// `request_retry + deadline + reconciliation`, the least retention (SPEC §2.9).
    pub fn required_retention_ms(&self) -> i64 {
        required_retention(&self.retry, &self.windows)
    }
}

fn required_retention(retry: &RetryPolicy, windows: &Windows) -> i64 {
    windows
        .request_retry_ms
        .saturating_add(retry.deadline_ms)
        .saturating_add(windows.reconciliation_ms)
}

impl Config {
    /// The bundled default configuration.
    ///
    /// # Errors
    /// Never in practice: the bundled file is checked by a test.
    pub fn bundled() -> Result<Config, ConfigError> {
        Config::from_toml(DEFAULT_TOML)
    }

    /// Parses and checks a TOML configuration.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] on bad TOML or unknown fields; [`ConfigError::RetentionTooShort`]
    /// and [`ConfigError::Invalid`] when a class breaks a rule.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        config.check()?;
        Ok(config)
    }

    /// This configuration as a TOML document that [`Config::from_toml`] reads
    /// back to an equal configuration (e.g. to write a `--config` file).
    ///
    /// # Errors
    /// [`ConfigError::Parse`] if a value has no TOML form.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|e| ConfigError::Parse(e.to_string()))
    }

    /// Parses `text`, applies environment overrides, then checks the result.
    ///
    /// `vars` are `(name, value)` pairs; only names starting `IDEM_OPERATIONS__` are used.
    /// A value is read as a TOML value (`200`, `true`, `1.5`, `["/a"]`), else as a string.
    ///
    /// # Errors
    /// As [`Config::from_toml`], plus [`ConfigError::Override`] for a variable naming an
    /// unknown class or field.
    pub fn from_toml_with_env(
        text: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut doc: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        for (name, value) in vars {
            let Some(path) = name.strip_prefix("IDEM_OPERATIONS__") else {
                continue;
            };
            apply_override(&mut doc, &name, path, &value)?;
            // Name the variable when its value does not fit the schema (a typo'd
            // field, a string for a number), instead of a line of a generated document.
            let text = toml::to_string(&doc).map_err(|e| ConfigError::Parse(e.to_string()))?;
            if let Err(e) = toml::from_str::<Config>(&text) {
                return Err(ConfigError::Override {
                    name,
                    message: e.message().to_owned(),
                });
            }
        }
        let text = toml::to_string(&doc).map_err(|e| ConfigError::Parse(e.to_string()))?;
        Config::from_toml(&text)
    }

    /// Checks every class (SPEC §2.9 retention rule, positive bounds) and
    /// compiles its `params_schema`.
    ///
    /// # Errors
    /// The first rule broken; [`ConfigError::Invalid`] naming the class for a
    /// schema that does not compile.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.operations.is_empty() {
            return Err(ConfigError::Empty);
        }
        for (name, class) in &self.operations {
            let invalid = |message: &str| ConfigError::Invalid {
                class: name.clone(),
                message: message.to_owned(),
            };
            let r = &class.retry;
            if r.max_attempts < 1 {
                return Err(invalid("retry.max_attempts must be at least 1"));
            }
            if r.backoff.initial_ms < 0 || r.backoff.max_ms < r.backoff.initial_ms {
                return Err(invalid("retry.backoff needs 0 <= initial_ms <= max_ms"));
            }
            if !(r.backoff.multiplier.is_finite() && r.backoff.multiplier >= 1.0) {
                return Err(invalid(
                    "retry.backoff.multiplier must be a finite number >= 1",
                ));
            }
            if r.deadline_ms <= 0 || r.usage_budget < 0 {
                return Err(invalid(
                    "retry.deadline_ms must be > 0 and usage_budget >= 0",
                ));
            }
            if class.lease.default_ms < MIN_LEASE_MS || class.lease.max_ms < class.lease.default_ms
            {
                return Err(invalid("lease needs 100 <= default_ms <= max_ms"));
            }
            let f = &class.fees;
            if f.price < 0
                || f.cancel_before_start < 0
                || f.cancel_after_start_fixed < 0
                || f.usage_unit_price < 0
            {
                return Err(invalid("fees must not be negative"));
            }
            if f.exponent.is_some() {
                return Err(invalid(
                    "fees.exponent is not configured: it comes from ISO 4217 for fees.currency",
                ));
            }
            if let Some(code) = &f.currency {
                Currency::from_code(code).map_err(|e| invalid(&format!("fees.currency: {e}")))?;
            }
            let w = &class.windows;
            if w.request_retry_ms < 0 || w.reconciliation_ms < 0 {
                return Err(invalid("windows must not be negative"));
            }
            let required_ms = required_retention(r, w);
            if w.retention_ms < required_ms {
                return Err(ConfigError::RetentionTooShort {
                    class: name.clone(),
                    retention_ms: w.retention_ms,
                    required_ms,
                });
            }
            if let Some(schema) = &class.params_schema {
                schema.compile().map_err(|e| invalid(&e.to_string()))?;
            }
            crate::flow::check_rate("flow.submits_per_s", class.flow.submits_per_s)
                .and_then(|()| {
                    crate::flow::check_rate(
                        "flow.attempt_starts_per_s",
                        class.flow.attempt_starts_per_s,
                    )
                })
                .and_then(|()| class.flow.check())
                .map_err(|m| invalid(&m))?;
        }
        for (name, tenant) in &self.tenants {
            tenant.check().map_err(|message| ConfigError::Tenant {
                tenant: name.clone(),
                message,
            })?;
        }
        crate::flow::check_tenants(&self.tenants)
            .map_err(|(tenant, message)| ConfigError::Tenant { tenant, message })?;
        Ok(())
    }

    /// The configuration version: `cfg-` and the first 12 hex digits of the SHA-256 of its
    /// canonical JSON form. Any change of any class changes it.
    pub fn version(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        let digest = Sha256::digest(&json);
        let hex = hex::encode(digest);
        format!("cfg-{}", hex.get(..12).unwrap_or(&hex))
    }

    /// The contract a task of `operation` is accepted under, or `None` for an unknown class.
    pub fn contract(&self, operation: &str) -> Option<Contract> {
        let class = self.operations.get(operation)?;
        Some(Contract {
            price: class.fees.price,
            retry: class.retry.clone(),
            fees: Fees {
                exponent: class.fees.currency().map(|c| c.exponent),
                ..class.fees.clone()
            },
            lease: class.lease.clone(),
            windows: class.windows.clone(),
            config_version: self.version(),
            fingerprint: Some(class.fingerprint.clone()),
            params_schema: class
                .params_schema
                .as_ref()
                .map(|s| std::sync::Arc::new(s.document().clone())),
        })
    }
}

fn normalise(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            '.' | '-' => '_',
            c => c.to_ascii_uppercase(),
        })
        .collect()
}

fn apply_override(
    doc: &mut toml::Table,
    name: &str,
    path: &str,
    value: &str,
) -> Result<(), ConfigError> {
    let err = |message: &str| ConfigError::Override {
        name: name.to_owned(),
        message: message.to_owned(),
    };
    let mut parts = path.split("__");
    let class = parts.next().ok_or_else(|| err("missing class"))?;
    let ops = doc
        .get_mut("operations")
        .and_then(|v| v.as_table_mut())
        .ok_or_else(|| err("no [operations] table"))?;
    let class_key = ops
        .keys()
        .find(|k| normalise(k) == class)
        .cloned()
        .ok_or_else(|| err("names no configured operation class"))?;
    let mut table = ops
        .get_mut(&class_key)
        .and_then(|v| v.as_table_mut())
        .ok_or_else(|| err("class is not a table"))?;
    let fields: Vec<String> = parts.map(|p| p.to_ascii_lowercase()).collect();
    let (last, sections) = fields.split_last().ok_or_else(|| err("names no field"))?;
    for section in sections {
        // `flow` is optional as a whole: an override may add it.
        if section == "flow" && !table.contains_key("flow") {
            table.insert("flow".into(), toml::Value::Table(toml::Table::new()));
        }
        table = table
            .get_mut(section.as_str())
            .and_then(|v| v.as_table_mut())
            .ok_or_else(|| err("names an unknown section"))?;
    }
    let parsed: toml::Value = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_owned()));
    table.insert(last.clone(), parsed);
    Ok(())
}

impl Config {
    /// The buckets a new submit of `operation` by `tenant` takes a token
    /// from, as `(scope, limit)`: the tenant's (`submits_per_s`,
    /// `submits_burst`) and the class's (`flow.submits_per_s`), when set.
    pub fn submit_limits(
        &self,
        tenant: &str,
        operation: &str,
    ) -> Vec<(String, crate::flow::RateLimit)> {
        let mut out = Vec::new();
        if let Some(t) = self.tenants.get(tenant)
            && let Some(per_s) = t.submits_per_s
        {
            out.push((
                crate::flow::tenant_scope(tenant),
                crate::flow::RateLimit::new(per_s, t.submits_burst),
            ));
        }
        if let Some(per_s) = self
            .operations
            .get(operation)
            .and_then(|c| c.flow.submits_per_s)
        {
            out.push((
                crate::flow::class_scope(operation),
                crate::flow::RateLimit::new(per_s, None),
            ));
        }
        out
    }

    /// The attempt-start limit of each class that has one
    /// (`flow.attempt_starts_per_s`), by class.
    pub fn start_limits(&self) -> BTreeMap<String, crate::flow::RateLimit> {
        self.operations
            .iter()
            .filter_map(|(name, c)| {
                c.flow
                    .attempt_starts_per_s
                    .map(|r| (name.clone(), crate::flow::RateLimit::new(r, None)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_caps_parse_and_are_checked() {
        let base = DEFAULT_TOML.to_owned();
        let text = format!(
            "{base}\n[tenants.\"acme\"]\ncap = 10\n\n[operations.\"payment.release\".flow]\nconcurrency_key = \"/payee\"\nconcurrency_key_cap = 1\ncap = 50\ntenant_cap = 5\n"
        );
        let config = Config::from_toml(&text).unwrap();
        let flow = &config.operations["payment.release"].flow;
        assert_eq!(flow.cap, Some(50));
        assert_eq!(flow.tenant_cap, Some(5));
        assert_eq!(flow.concurrency_key_cap, Some(1));
        assert_eq!(
            flow.concurrency_key.as_ref().map(|p| p.as_str()),
            Some("/payee")
        );
        assert_eq!(config.tenants["acme"].cap, Some(10));
        // Without flow settings the version is what it was.
        assert_eq!(
            Config::from_toml(&base).unwrap().version(),
            Config::bundled().unwrap().version()
        );
        let bad = format!("{base}\n[tenants.\"acme\"]\ncap = 0\n");
        assert!(matches!(
            Config::from_toml(&bad),
            Err(ConfigError::Tenant { .. })
        ));
        let keyless =
            format!("{base}\n[operations.\"payment.release\".flow]\nconcurrency_key_cap = 1\n");
        assert!(matches!(
            Config::from_toml(&keyless),
            Err(ConfigError::Invalid { .. })
        ));
        let env = Config::from_toml_with_env(
            &text,
            [(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__FLOW__CAP".to_owned(),
                "7".to_owned(),
            )],
        )
        .unwrap();
        assert_eq!(env.operations["payment.release"].flow.cap, Some(7));
    }

    #[test]
    fn amount_and_currency_display_as_one_amount() {
        let d = DisplayFields(vec![
            ("payee".into(), JsonPointer::parse("/payee").unwrap()),
            ("amount".into(), JsonPointer::parse("/amount").unwrap()),
            ("currency".into(), JsonPointer::parse("/currency").unwrap()),
        ]);
        assert_eq!(d.columns().collect::<Vec<_>>(), ["payee", "amount"]);
        let shown = |p: serde_json::Value| {
            d.shown(&p)
                .into_iter()
                .map(|(n, v)| (n.to_owned(), v))
                .collect::<Vec<_>>()
        };
        let eur = serde_json::json!({"payee": "acct-1", "amount": 1250, "currency": "EUR"});
        assert_eq!(
            shown(eur),
            [
                ("payee".into(), Some("acct-1".into())),
                ("amount".into(), Some("EUR 12.50".into()))
            ]
        );
        let jpy = serde_json::json!({"amount": 1250, "currency": "JPY"});
        assert_eq!(shown(jpy)[1], ("amount".into(), Some("JPY 1250".into())));
        // Not an amount of a known currency: both as given.
        let odd = serde_json::json!({"amount": "12.50", "currency": "XYZ"});
        assert_eq!(shown(odd)[1], ("amount".into(), Some("12.50 XYZ".into())));
        let none = serde_json::json!({"amount": 5});
        assert_eq!(
            shown(none),
            [("payee".into(), None), ("amount".into(), Some("5".into()))]
        );
        // Without a `currency` field, `amount` is a field like any other.
        let plain = DisplayFields(vec![(
            "amount".into(),
            JsonPointer::parse("/amount").unwrap(),
        )]);
        assert_eq!(
            plain.shown(&serde_json::json!({"amount": 1250}))[0]
                .1
                .as_deref(),
            Some("1250")
        );
    }

    #[test]
    fn to_toml_reads_back_equal() {
        let c = Config::from_toml_with_env(
            DEFAULT_TOML,
            [(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS".to_owned(),
                "20".to_owned(),
            )],
        )
        .unwrap();
        let back = Config::from_toml(&c.to_toml().unwrap()).unwrap();
        assert_eq!(back, c);
        assert_eq!(
            back.operations["payment.release"].retry.backoff.initial_ms,
            20
        );
    }

    #[test]
    fn bundled_configuration_matches_spec_table() {
        let c = Config::bundled().unwrap();
        let p = c.contract("payment.release").unwrap();
        assert!(!p.retry.safe);
        assert_eq!(p.retry.max_attempts, 3);
        assert_eq!(p.price, 100);
        assert_eq!(p.fees.cancel_after_start_fixed, 10);
        assert_eq!(p.lease.default_ms, 30_000);
        assert_eq!(p.windows.retention_ms, 72 * 3_600_000);
        let g = c.contract("generation.dispatch").unwrap();
        assert!(g.retry.safe);
        assert_eq!(g.retry.max_attempts, 5);
        assert_eq!(g.price, 50);
        assert!(c.operations["generation.dispatch"].fingerprint.is_empty());
        assert_eq!(c.operations["payment.release"].fingerprint.len(), 3);
    }

    #[test]
    fn bundled_payment_schema_is_compiled_and_frozen_into_the_contract() {
        let c = Config::bundled().unwrap();
        let class = &c.operations["payment.release"];
        let schema = class.params_schema.as_ref().unwrap();
        let ok = serde_json::json!({"payee": "p", "amount": 1, "currency": "EUR"});
        schema.validate(&ok).unwrap();
        for bad in [
            serde_json::json!({"payee": "p", "amount": 1}),
            serde_json::json!({"payee": "p", "amount": -5, "currency": "EUR"}),
            serde_json::json!({"payee": "p", "amount": 1.5, "currency": "EUR"}),
            serde_json::json!({"payee": "", "amount": 1, "currency": "EUR"}),
            serde_json::json!({"payee": "p", "amount": 1, "currency": "eur"}),
        ] {
            assert!(schema.validate(&bad).is_err(), "{bad}");
        }
        let contract = c.contract("payment.release").unwrap();
        assert_eq!(contract.params_schema.as_deref(), Some(schema.document()));
        assert_eq!(
            contract.params_schema.unwrap()["properties"]["currency"]["pattern"],
            "^[A-Z]{3}$"
        );
        assert!(
            c.contract("generation.dispatch")
                .unwrap()
                .params_schema
                .is_none()
        );
        // The schema is part of the configuration's version and its TOML form.
        let back = Config::from_toml(&c.to_toml().unwrap()).unwrap();
        assert_eq!(back, c);
        let mut lax = c.clone();
        lax.operations
            .get_mut("payment.release")
            .unwrap()
            .params_schema = None;
        assert_ne!(lax.version(), c.version());
    }

    #[test]
    fn a_schema_that_does_not_compile_names_its_class() {
        let text = DEFAULT_TOML.replace(
            r#"properties.payee = { type = "string", minLength = 1 }"#,
            r#"properties.payee = { type = "text" }"#,
        );
        let e = Config::from_toml(&text).unwrap_err().to_string();
        assert!(
            e.starts_with("operation class `payment.release`: params_schema does not compile: "),
            "{e}"
        );
        // An environment override may replace the whole schema with an inline table.
        let e = Config::from_toml_with_env(
            DEFAULT_TOML,
            [(
                "IDEM_OPERATIONS__GENERATION_DISPATCH__PARAMS_SCHEMA".to_owned(),
                r#"{ "$ref" = "https://example.invalid/s.json" }"#.to_owned(),
            )],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("operation class `generation.dispatch`: params_schema does not compile"),
            "{e}"
        );
    }

    #[test]
    fn retention_shorter_than_windows_is_refused() {
        let text = DEFAULT_TOML.replace("retention_ms = 259200000", "retention_ms = 1000");
        assert!(matches!(
            Config::from_toml(&text),
            Err(ConfigError::RetentionTooShort { .. })
        ));
    }

    #[test]
    fn env_overrides_change_fees_and_version() {
        let base = Config::bundled().unwrap();
        let c = Config::from_toml_with_env(
            DEFAULT_TOML,
            [(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__FEES__PRICE".to_owned(),
                "250".to_owned(),
            )],
        )
        .unwrap();
        assert_eq!(c.contract("payment.release").unwrap().price, 250);
        assert_ne!(c.version(), base.version());
        for (name, value) in [
            ("IDEM_OPERATIONS__PAYMENT_RELEASE__FEES__PRICE", "abc"),
            ("IDEM_OPERATIONS__PAYMENT_RELEASE__FEES__PRCE", "1"),
        ] {
            match Config::from_toml_with_env(DEFAULT_TOML, [(name.to_owned(), value.to_owned())]) {
                Err(ConfigError::Override { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}={value}: {other:?}"),
            }
        }
        let bad = Config::from_toml_with_env(
            DEFAULT_TOML,
            [(
                "IDEM_OPERATIONS__NOPE__FEES__PRICE".to_owned(),
                "1".to_owned(),
            )],
        );
        assert!(matches!(bad, Err(ConfigError::Override { .. })));
    }

    #[test]
    fn a_class_s_currency_is_frozen_with_its_iso_exponent() {
        let c = Config::bundled().unwrap();
        let p = c.contract("payment.release").unwrap();
        assert_eq!(p.fees.currency.as_deref(), Some("EUR"));
        assert_eq!(p.fees.exponent, Some(2));
        assert_eq!(p.money(p.price).to_string(), "EUR 1.00");
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["fees"]["currency"], "EUR");
        assert_eq!(json["fees"]["exponent"], 2);
        // The configured class carries no exponent: ISO 4217 gives it.
        assert_eq!(c.operations["payment.release"].fees.exponent, None);
        // A class without a currency keeps working, in minor units.
        let g = c.contract("generation.dispatch").unwrap();
        assert_eq!(g.fees.currency, None);
        assert_eq!(g.money(g.price).to_string(), "50 minor units");
        let json = serde_json::to_value(&g).unwrap();
        assert!(json["fees"].get("currency").is_none());
        // A contract frozen before idem carried a currency reads as minor units.
        let mut old = serde_json::to_value(&p).unwrap();
        let fees = old["fees"].as_object_mut().unwrap();
        fees.remove("currency");
        fees.remove("exponent");
        let old: Contract = serde_json::from_value(old).unwrap();
        assert_eq!(old.money(100).to_string(), "100 minor units");
        // A frozen contract keeps its currency whatever the configuration says later.
        let frozen = crate::contract::FrozenContract::new(p.clone()).unwrap();
        let jpy = Config::from_toml(&DEFAULT_TOML.replace(
            r#"currency = "EUR"          #"#,
            r#"currency = "JPY"          #"#,
        ))
        .unwrap();
        assert_eq!(
            jpy.contract("payment.release")
                .unwrap()
                .money(100)
                .to_string(),
            "JPY 100"
        );
        assert_ne!(jpy.version(), c.version());
        let back = crate::contract::FrozenContract::decode(frozen.id(), frozen.json()).unwrap();
        assert_eq!(back.money(100).to_string(), "EUR 1.00");
    }

    #[test]
    fn a_currency_outside_iso_4217_names_its_class() {
        for (code, says) in [
            ("ZZZ", "is not an ISO 4217 code"),
            ("eur", "is not an ISO 4217 code"),
            ("XAU", "has no minor unit"),
        ] {
            let text = DEFAULT_TOML.replace(
                r#"currency = "EUR"          #"#,
                &format!(r#"currency = "{code}" #"#),
            );
            let e = Config::from_toml(&text).unwrap_err().to_string();
            assert!(
                e.starts_with("operation class `payment.release`: fees.currency: ")
                    && e.contains(says),
                "{e}"
            );
        }
        let e = Config::from_toml_with_env(
            DEFAULT_TOML,
            [(
                "IDEM_OPERATIONS__GENERATION_DISPATCH__FEES__CURRENCY".to_owned(),
                "ABC".to_owned(),
            )],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("operation class `generation.dispatch`: fees.currency"),
            "{e}"
        );
        let text = DEFAULT_TOML.replace("price = 100\n", "price = 100\nexponent = 2\n");
        let e = Config::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("fees.exponent is not configured"), "{e}");
    }

    #[test]
    fn display_fields_keep_their_order_and_must_be_pointers() {
        let c = Config::bundled().unwrap();
        let display = &c.operations["payment.release"].display;
        let names: Vec<&str> = display.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["payee", "amount", "currency"]);
        let params = serde_json::json!({"payee": "acct-alice", "amount": 1250});
        let values: Vec<_> = display.values(&params).collect();
        assert_eq!(
            values,
            [
                ("payee", Some(&serde_json::json!("acct-alice"))),
                ("amount", Some(&serde_json::json!(1250))),
                ("currency", None),
            ]
        );
        assert!(c.operations["generation.dispatch"].display.is_empty());
        // Order survives the TOML form and environment overrides.
        let text = DEFAULT_TOML.replace(
            "payee = \"/payee\"\namount = \"/amount\"",
            "zeta = \"/amount\"\npayee = \"/payee\"",
        );
        let c = Config::from_toml_with_env(
            &text,
            [(
                "IDEM_OPERATIONS__PAYMENT_RELEASE__FEES__PRICE".to_owned(),
                "7".to_owned(),
            )],
        )
        .unwrap();
        let names: Vec<&str> = c.operations["payment.release"]
            .display
            .iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["zeta", "payee", "currency"]);
        let back = Config::from_toml(&c.to_toml().unwrap()).unwrap();
        assert_eq!(back, c);
        let bad = DEFAULT_TOML.replace("payee = \"/payee\"\n", "payee = \"payee\"\n");
        let e = Config::from_toml(&bad).unwrap_err().to_string();
        assert!(e.contains("invalid JSON pointer \"payee\""), "{e}");
    }

    #[test]
    fn backoff_grows_and_caps() {
        let b = Backoff {
            initial_ms: 1000,
            multiplier: 2.0,
            max_ms: 5000,
        };
        assert_eq!(b.delay_ms(2), 1000);
        assert_eq!(b.delay_ms(3), 2000);
        assert_eq!(b.delay_ms(4), 4000);
        assert_eq!(b.delay_ms(5), 5000);
        assert_eq!(b.delay_ms(500), 5000);
    }
    /// Tenant and class limits parse, apply to their tenant and class, and
    /// out-of-range values are refused.
    #[test]
    fn limits_from_config() {
        let base = crate::config::DEFAULT_TOML;
        let class = crate::config::Config::from_toml(base)
            .unwrap()
            .operations
            .keys()
            .next()
            .unwrap()
            .clone();
        let text = format!(
            "{base}\n[tenants.acme]\nsubmits_per_s = 50\nsubmits_burst = 5\n[operations.\"{class}\".flow]\nsubmits_per_s = 2.5\nattempt_starts_per_s = 10\n"
        );
        let c = crate::config::Config::from_toml(&text).unwrap();
        assert_eq!(
            c.submit_limits("acme", &class),
            vec![
                (
                    "tenant:acme".into(),
                    crate::flow::RateLimit::new(50.0, Some(5))
                ),
                (
                    format!("class:{class}"),
                    crate::flow::RateLimit::new(2.5, None)
                ),
            ]
        );
        assert_eq!(c.submit_limits("other", "nope"), vec![]);
        assert_eq!(
            c.start_limits().get(&class),
            Some(&crate::flow::RateLimit::new(10.0, None))
        );
        for bad in [
            "[tenants.acme]\nsubmits_per_s = 0",
            "[tenants.acme]\nsubmits_per_s = 5\nsubmits_burst = 0",
            "[tenants.acme]\nsubmits_burst = 5",
            "[tenants.acme]\nsubmits_per_s = -1",
        ] {
            assert!(
                crate::config::Config::from_toml(&format!("{base}\n{bad}\n")).is_err(),
                "{bad}"
            );
        }
        let bad_class =
            format!("{base}\n[operations.\"{class}\".flow]\nattempt_starts_per_s = 0\n");
        assert!(crate::config::Config::from_toml(&bad_class).is_err());
        let env = crate::config::Config::from_toml_with_env(
            base,
            [(
                format!(
                    "IDEM_OPERATIONS__{}__FLOW__ATTEMPT_STARTS_PER_S",
                    class.to_ascii_uppercase().replace(['.', '-'], "_")
                ),
                "7".to_owned(),
            )],
        )
        .unwrap();
        assert_eq!(
            env.start_limits().get(&class),
            Some(&crate::flow::RateLimit::new(7.0, None))
        );
        // Without flow settings the configuration version is unchanged.
        let plain = crate::config::Config::from_toml(base).unwrap();
        assert!(!plain.to_toml().unwrap().contains("flow"));
    }
}
