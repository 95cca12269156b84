//! Request bodies of the operator actions (SPEC §4 "Operator actions"):
//! `retry-now`, `cancel` by an admin, `resolve`, `redrive`, and the
//! acknowledgment of a suspected second effect.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `{"reason": "…"}`: the body of `retry-now`, `redrive` and an admin's `cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReasonBody {
    /// Why the operator acts, recorded in the action's event: 1–500
    /// characters, at least one of them visible (not only white space and
    /// format characters, Unicode category Cf), no control characters.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 500))]
    pub reason: String,
}

/// What an operator found at the external system for a `reconciling` task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ResolveOutcome {
    /// The effect happened: the task delivers `result` once, with its charge.
    Committed,
    /// The effect did not happen: the next execute attempt may start.
    NotCommitted,
}

/// `POST /v1/tasks/{id}/resolve` body: `{"outcome": "committed", "result",
/// "external_txn_id"?, "reason"}` or `{"outcome": "not_committed", "reason"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ResolveBody {
    /// `committed` or `not_committed`.
    pub outcome: ResolveOutcome,
    /// Required with `committed`, refused with `not_committed`: the result
    /// document to deliver (as a reconcile attempt's `result`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub result: Option<Value>,
    /// Only with `committed`: the external system's transaction id (1–200
    /// characters, no control characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 200))]
    pub external_txn_id: Option<String>,
    /// Why the operator acts, as in [`ReasonBody`].
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 500))]
    pub reason: String,
}

/// How an operator settled a suspected second effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EffectResolution {
    /// The second effect happened and was refunded.
    RefundIssued,
    /// The provider deduplicated it: one effect only.
    ProviderDeduplicated,
    /// No second effect happened.
    FalseAlarm,
}

/// `POST /v1/tasks/{id}/second-effects/acknowledge` body:
/// `{"external_txn_id": "…" | null, "resolution", "reason"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AcknowledgeEffectBody {
    /// The suspected second effect's transaction id, as the task's
    /// `second_effects` shows it (`null`: the one without an id). Required.
    #[cfg_attr(
        feature = "openapi",
        schema(required = true, min_length = 1, max_length = 200)
    )]
    pub external_txn_id: Option<String>,
    /// How it was settled.
    pub resolution: EffectResolution,
    /// Why, as in [`ReasonBody`].
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 500))]
    pub reason: String,
}
