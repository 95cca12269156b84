//! Reading requests: JSON bodies under the strict rules (duplicate keys,
//! integers beyond ±(2^53−1) and nesting deeper than 64 are refused) with the
//! 400/413 problems they give, and the task or attempt id of a path.

use axum::body::Bytes;
use axum::extract::Path;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;
use uuid::Uuid;

use crate::problem::Problem;
use crate::{AppResult, BODY_LIMIT_BYTES};

/// Reads a JSON body strictly (duplicate keys, unsafe integers, depth > 64 → 400)
/// and decodes it into `T`.
pub(super) fn strict_body<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> AppResult<(Value, T)> {
    let value = strict_value(body)?;
    let typed = serde_json::from_value(value.clone())
        .map_err(|e| Problem::invalid(format!("body: {e}")))?;
    Ok((value, typed))
}

/// [`strict_body`] for a handler that needs only the typed body (no copy of
/// the parsed document is kept).
pub(super) fn strict_typed<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> AppResult<T> {
    strict_typed_bytes(&body_bytes(body)?)
}

/// `bytes` read under the strict JSON rules into `T`, or a 400 problem.
pub(super) fn strict_typed_bytes<T: DeserializeOwned>(bytes: &[u8]) -> AppResult<T> {
    serde_json::from_value(strict_value_bytes(bytes)?)
        .map_err(|e| Problem::invalid(format!("body: {e}")))
}

/// The body read under the strict JSON rules (`idem_core::json::parse_strict`),
/// or the problem: 413 over [`BODY_LIMIT_BYTES`], 400 otherwise.
fn strict_value(body: Result<Bytes, BytesRejection>) -> AppResult<Value> {
    strict_value_bytes(&body_bytes(body)?)
}

/// `bytes` read under the strict JSON rules, or a 400 problem. Every
/// request body is a JSON object (the OpenAPI document); serde's derived
/// structs would also read a sequence of their fields in order
/// (`["ex-1", ["op"], 1]`), so anything else is refused here.
fn strict_value_bytes(bytes: &[u8]) -> AppResult<Value> {
    let value =
        idem_core::json::parse_strict(bytes).map_err(|e| Problem::invalid(e.to_string()))?;
    if !value.is_object() {
        return Err(Problem::invalid("body: the body must be a JSON object"));
    }
    Ok(value)
}

/// The body's bytes, or the problem: 413 over [`BODY_LIMIT_BYTES`], 400 when
/// it could not be read.
pub(super) fn body_bytes(body: Result<Bytes, BytesRejection>) -> AppResult<Bytes> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Problem::too_large(BODY_LIMIT_BYTES)
        } else {
            Problem::invalid(e.body_text())
        }
    })
}

/// A task or attempt id from the path; anything that is not a UUID (including
/// bytes that are not UTF-8) is a 404 problem saying so (`` `x` is not a task
/// id (a UUID)``).
pub struct IdPath(pub Uuid);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdPath {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Problem> {
        let what = if parts.uri.path().starts_with("/v1/attempts/") {
            "an attempt id"
        } else {
            "a task id"
        };
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| Problem::not_found(format!("the path's id is not {what} (a UUID)")))?;
        Uuid::parse_str(&raw).map(IdPath).map_err(|_| {
            Problem::not_found(format!(
                "`{}` is not {what} (a UUID)",
                crate::problem::shorten(&raw)
            ))
        })
    }
}
