//! What a run of the model holds fixed: the operation classes (a TOML
//! configuration checked by [`Config::from_toml`] like any other), the
//! tenants and their API keys, the idempotency keys and the requests clients
//! send under them, and the words a trace uses for what the store answered.

use std::fmt;

use idem_core::config::Config;
use idem_core::contract::FrozenContract;
use idem_core::fingerprint::canonical_request;
use idem_core::machine::operator::{Actor, By, Reason, Refused};
use idem_core::machine::{self, Rejection};
use idem_core::model::{ApiKey, AttemptKind, CancelStatus, Role, Timestamp};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::state::{Held, Reported, TICK_MS};

/// The model's own setup is wrong (a class missing from its configuration,
/// params that do not fingerprint). Never a finding about idem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The model's configuration does not parse or lacks a class.
    #[error("model configuration: {0}")]
    Config(String),
    /// A request of the model does not fingerprint.
    #[error("model request: {0}")]
    Request(String),
}

/// The model's operation classes, scaled to the model clock (1 tick =
/// [`TICK_MS`] ms): `payment.release` is not safe to repeat (unknown
/// outcomes are reconciled), `generation.dispatch` is.
pub const MODEL_TOML: &str = r#"
[operations."payment.release"]
fingerprint = ["/amount"]
[operations."payment.release".retry]
safe = false
max_attempts = 2
backoff = { initial_ms = 100, multiplier = 2.0, max_ms = 400 }
deadline_ms = 300
usage_budget = 1
[operations."payment.release".lease]
default_ms = 200
max_ms = 200
[operations."payment.release".windows]
request_retry_ms = 0
reconciliation_ms = 0
retention_ms = 300
[operations."payment.release".fees]
price = 100
cancel_before_start = 0
cancel_after_start_fixed = 10
usage_unit_price = 1

[operations."generation.dispatch"]
fingerprint = ["/amount"]
[operations."generation.dispatch".retry]
safe = true
max_attempts = 2
backoff = { initial_ms = 100, multiplier = 2.0, max_ms = 400 }
deadline_ms = 300
usage_budget = 1
[operations."generation.dispatch".lease]
default_ms = 200
max_ms = 200
[operations."generation.dispatch".windows]
request_retry_ms = 0
reconciliation_ms = 0
retention_ms = 300
[operations."generation.dispatch".fees]
price = 50
cancel_before_start = 0
cancel_after_start_fixed = 5
usage_unit_price = 1
"#;

/// The material fields of [`MODEL_TOML`]'s classes, and what a changed
/// configuration makes them (the payee made material too): a request sent
/// again after that change has another fingerprint but is the same request.
const MATERIAL: (&str, &str) = (
    r#"fingerprint = ["/amount"]"#,
    r#"fingerprint = ["/amount", "/payee"]"#,
);

/// The non-safe class.
pub const UNSAFE_CLASS: &str = "payment.release";
/// The safe class.
pub const SAFE_CLASS: &str = "generation.dispatch";
/// The model's tenants, in order (`--tenants` takes the first ones).
pub const TENANTS: [&str; 2] = ["acme", "globex"];

/// Which request a client sends under a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sent {
    /// The original request.
    Original,
    /// A changed request: same key, another amount (another fingerprint).
    Changed,
    /// The original request, fingerprinted under a changed configuration
    /// (the payee made material): another fingerprint, the same request.
    Reconfigured,
}

impl Sent {
    /// Whether this is the request the task under its key was accepted with.
    pub fn is_original(self) -> bool {
        self != Sent::Changed
    }
}

/// A request the model's clients send: its params, fingerprint, canonical
/// form and the contract the configuration gives it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The params.
    pub params: Value,
    /// `sha256:<hex>` of the canonical request.
    pub fingerprint: String,
    /// The RFC 8785 canonical request.
    pub canonical: String,
    /// The contract frozen on a task it creates.
    pub contract: FrozenContract,
}

/// One idempotency key of the model, under one tenant.
#[derive(Debug, Clone)]
pub struct KeySetup {
    /// The operation class.
    pub class: &'static str,
    /// Index of the tenant in [`TENANTS`].
    pub tenant: u8,
    /// The key as the client sends it.
    pub idempotency_key: String,
    /// The original request, a changed one and the original reconfigured.
    pub original: Request,
    /// See [`Sent::Changed`].
    pub changed: Request,
    /// See [`Sent::Reconfigured`].
    pub reconfigured: Request,
}

impl KeySetup {
    /// The request `sent`.
    pub fn request(&self, sent: Sent) -> &Request {
        match sent {
            Sent::Original => &self.original,
            Sent::Changed => &self.changed,
            Sent::Reconfigured => &self.reconfigured,
        }
    }
}

/// What the model's store needs that does not change during a run.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Per key: its class, tenant, and requests.
    pub keys: Vec<KeySetup>,
    /// Per tenant: its client API key (the one its submits and claims use).
    pub api_keys: Vec<ApiKey>,
    /// The operator's identity and reason on every operator action.
    pub by: By,
}

impl Setup {
    /// The setup of `classes` (one per key, in key order) over `tenants`
    /// tenants: key `k` belongs to tenant `k % tenants` and is sent as
    /// `key-{k / tenants}`, so with two tenants the same idempotency key is
    /// used by both.
    ///
    /// # Errors
    /// [`SetupError`] when the model's configuration or requests are wrong.
    pub fn new(classes: &[&'static str], tenants: u8) -> Result<Setup, SetupError> {
        let config =
            |toml: &str| Config::from_toml(toml).map_err(|e| SetupError::Config(e.to_string()));
        let now = config(MODEL_TOML)?;
        let later = config(&MODEL_TOML.replace(MATERIAL.0, MATERIAL.1))?;
        let tenants = tenants.clamp(1, TENANTS.len() as u8);
        let mut keys = Vec::new();
        for (i, class) in classes.iter().enumerate() {
            let tenant = (i % usize::from(tenants)) as u8;
            let request = |config: &Config, amount: i64| -> Result<Request, SetupError> {
                let contract = config
                    .contract(class)
                    .ok_or_else(|| SetupError::Config(format!("no class {class}")))?;
                let material = contract.fingerprint.clone().unwrap_or_default();
                let contract =
                    FrozenContract::new(contract).map_err(|e| SetupError::Config(e.to_string()))?;
                let params = json!({"amount": amount, "payee": format!("payee-{i}")});
                let c = canonical_request(class, &params, &material)
                    .map_err(|e| SetupError::Request(e.to_string()))?;
                Ok(Request {
                    params,
                    fingerprint: c.fingerprint.to_string(),
                    canonical: c.canonical,
                    contract,
                })
            };
            keys.push(KeySetup {
                class,
                tenant,
                idempotency_key: format!("key-{}", i / usize::from(tenants)),
                original: request(&now, 100)?,
                changed: request(&now, 200)?,
                reconfigured: request(&later, 100)?,
            });
        }
        let api_keys = (0..tenants)
            .map(|t| ApiKey {
                id: api_key_id(t),
                tenant: TENANTS[usize::from(t)].to_owned(),
                role: Role::Client,
                operations: None,
                created_at: Timestamp(0),
                revoked_at: None,
                serves: None,
            })
            .collect();
        let reason =
            Reason::parse("model checking").map_err(|e| SetupError::Config(e.to_string()))?;
        Ok(Setup {
            keys,
            api_keys,
            by: By {
                actor: Actor::Cli {
                    user: "model".to_owned(),
                },
                reason,
            },
        })
    }

    /// The index of the key `(tenant, operation, idempotency_key)` names.
    pub fn key_index(&self, tenant: &str, operation: &str, idempotency_key: &str) -> Option<u8> {
        self.keys
            .iter()
            .position(|k| {
                TENANTS[usize::from(k.tenant)] == tenant
                    && k.class == operation
                    && k.idempotency_key == idempotency_key
            })
            .map(|i| i as u8)
    }
}

/// The id of tenant `t`'s API key: far above the ids the store hands out
/// for tasks and attempts (which count up from 1).
pub fn api_key_id(t: u8) -> Uuid {
    Uuid::from_u128((0xA11CE_u128 << 64) | u128::from(t))
}

/// The instant of tick `t`.
pub fn at(t: i64) -> Timestamp {
    Timestamp(t * TICK_MS)
}

/// The tick of instant `ts` (rounded up: a lease ending inside a tick has ended at the next).
pub fn tick_of(ts: Timestamp) -> i64 {
    (ts.0 + TICK_MS - 1).div_euclid(TICK_MS)
}

impl fmt::Display for Reported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.failure_class() {
            Some(c) => write!(f, "failed ({c})"),
            None => write!(f, "{}", self.outcome()),
        }
    }
}

/// The report `held` sends for `what`: the body an executor posts, and the
/// machine's [`machine::Report`] parsed from it.
pub fn report_of(held: &Held, what: Reported) -> machine::Report {
    let outcome = what.outcome();
    let delivers = matches!(what, Reported::Succeeded | Reported::Committed);
    let result = delivers.then(|| json!({"receipt": format!("r-{}", held.task)}));
    let external_txn_id = delivers.then(|| format!("txn-{}", held.task));
    let mut body = json!({
        "generation": held.generation,
        "outcome": outcome,
        "usage": held.usage,
    });
    if let Some(c) = what.failure_class() {
        body["failure_class"] = json!(c);
    }
    if let Some(r) = &result {
        body["result"] = r.clone();
        body["external_txn_id"] = json!(external_txn_id);
    }
    machine::Report {
        generation: held.generation,
        outcome,
        result,
        failure_class: what.failure_class(),
        message: None,
        usage: Some(held.usage),
        external_txn_id,
        body,
    }
}

/// An operator action (SPEC §4 "Operator actions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperatorAction {
    /// `retry-now` of a `retry_wait` task.
    RetryNow,
    /// `cancel`.
    Cancel,
    /// `resolve` of a `reconciling` task as the provider's ledger says.
    Resolve,
    /// `redrive` of a `failed` task.
    Redrive,
}

impl fmt::Display for OperatorAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OperatorAction::RetryNow => "retry-now",
            OperatorAction::Cancel => "cancel",
            OperatorAction::Resolve => "resolve",
            OperatorAction::Redrive => "redrive",
        })
    }
}

/// What the store answered an action, for traces.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// A new task was accepted.
    Created,
    /// Same scope and the same request: the original task.
    Replayed,
    /// Same scope, another request: nothing changed.
    Conflict,
    /// The submitting API key is revoked: nothing changed.
    KeyRevoked,
    /// An attempt was leased.
    Leased {
        /// Attempt number.
        number: i64,
        /// Its generation.
        generation: i64,
        /// Its kind.
        kind: AttemptKind,
    },
    /// Claimable tasks ended instead of being leased (deadline, attempts,
    /// revoked key).
    EndedInstead,
    /// Nothing was claimable.
    NothingClaimable,
    /// Accepted.
    Ok,
    /// A heartbeat's answer.
    Heartbeat {
        /// The lease end, in ticks.
        lease_end: i64,
        /// A cancellation is pending.
        cancel_requested: bool,
    },
    /// The state machine refused the call (its evidence may have been kept).
    Rejected(Rejection),
    /// An operator action was refused; nothing changed.
    Refused(Refused),
    /// No such task or attempt for the caller.
    NotFound,
    /// The cancellation record after the call.
    Cancellation(CancelStatus),
    /// The sweep's work.
    Swept {
        /// Leases expired.
        expired: usize,
        /// Backoffs woken.
        woken: usize,
        /// Keys released.
        released: usize,
    },
    /// The operation failed as a storage failure: the transaction rolled
    /// back (the in-memory store never fails, so this is a finding).
    StoreFailed(String),
    /// Not a store call (the clock, a provider call, a crash).
    Local(&'static str),
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Created => f.write_str("201 created"),
            Answer::Replayed => f.write_str("replay of the original task"),
            Answer::Conflict => f.write_str("422 conflict: the key is bound to another request"),
            Answer::KeyRevoked => f.write_str("401: the API key is revoked"),
            Answer::Leased {
                number,
                generation,
                kind,
            } => write!(
                f,
                "leased {kind} attempt #{number}, generation {generation}"
            ),
            Answer::EndedInstead => f.write_str("no attempt: the task ended at the claim"),
            Answer::NothingClaimable => f.write_str("nothing claimable"),
            Answer::Ok => f.write_str("ok"),
            Answer::Heartbeat {
                lease_end,
                cancel_requested,
            } => write!(
                f,
                "lease extended to t={lease_end}{}",
                if *cancel_requested {
                    ", cancellation requested"
                } else {
                    ""
                }
            ),
            Answer::Rejected(r) => write!(f, "refused: {r}"),
            Answer::Refused(r) => write!(f, "refused: {r}"),
            Answer::NotFound => f.write_str("404 not found"),
            Answer::Cancellation(s) => write!(f, "cancellation {s}"),
            Answer::Swept {
                expired,
                woken,
                released,
            } => write!(
                f,
                "{expired} lease(s) expired, {woken} backoff(s) woken, {released} key(s) released"
            ),
            Answer::StoreFailed(e) => write!(f, "store failed, rolled back: {e}"),
            Answer::Local(s) => f.write_str(s),
        }
    }
}
