//! RFC 9457 problem documents with the `code` member of SPEC §4.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_store::{Refusal, StoreError};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

/// An `application/problem+json` body (RFC 9457 §3).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Problem {
    /// A URI naming the problem type: `https://idem.dev/problems/<code>` (informational).
    #[serde(rename = "type")]
    pub kind: String,
    /// Short summary of the problem type.
    pub title: String,
    /// HTTP status code.
    pub status: u16,
    /// Explanation specific to this occurrence.
    pub detail: String,
    /// Stable machine-readable code (SPEC §4 status table), e.g. `IDEMPOTENCY_CONFLICT`.
    pub code: String,
    /// For `IDEMPOTENCY_CONFLICT`: the original task (never its params).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_id: Option<Uuid>,
    /// For `STALE_GENERATION`: the task's current generation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_generation: Option<i64>,
    /// For `INVALID_REQUEST` from a class's `params_schema`: each failing
    /// value, by its JSON Pointer into the request body (`/params/...`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<InvalidValue>>,
    #[serde(skip)]
    retry_after: bool,
}

/// One value of a request that breaks a rule (a member of [`Problem::errors`]).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct InvalidValue {
    /// RFC 6901 JSON Pointer into the request body, e.g. `/params/currency`
    /// (for a missing member: where it would be).
    pub pointer: String,
    /// What is wrong, e.g. `"currency" is a required property`.
    pub message: String,
}

impl Problem {
    /// A problem with `status`, `code` and `detail`.
    pub fn new(status: StatusCode, code: &str, detail: impl Into<String>) -> Problem {
        Problem {
            kind: format!(
                "https://idem.dev/problems/{}",
                code.to_ascii_lowercase().replace('_', "-")
            ),
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            status: status.as_u16(),
            detail: detail.into(),
            code: code.to_owned(),
            task_id: None,
            current_generation: None,
            errors: None,
            retry_after: false,
        }
    }

    /// 400 `INVALID_REQUEST`.
    pub fn invalid(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", detail)
    }

    /// 404 `NOT_FOUND` saying what was not found: a path, an id that is not
    /// a UUID, or a record (also for other tenants' records, with the same
    /// text: existence is not leaked).
    pub fn not_found(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::NOT_FOUND, "NOT_FOUND", detail)
    }

    /// `r` as a problem, with `missing()` as the detail of its 404 (e.g. `no
    /// task <id> for this tenant`).
    pub fn refused(r: Refusal, missing: impl FnOnce() -> String) -> Problem {
        match r {
            Refusal::NotFound => Problem::not_found(missing()),
            other => other.into(),
        }
    }

    /// 401 `UNAUTHENTICATED`.
    pub fn unauthenticated(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", detail)
    }

    /// 403 `PERMISSION_DENIED`.
    pub fn forbidden(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::FORBIDDEN, "PERMISSION_DENIED", detail)
    }

    /// 413 `PAYLOAD_TOO_LARGE`.
    pub fn too_large(limit: usize) -> Problem {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "PAYLOAD_TOO_LARGE",
            format!("request body exceeds {limit} bytes"),
        )
    }
}

/// Longest piece of a request (a path, an id, a class name) a problem's
/// `detail` quotes, in characters.
pub const MAX_QUOTED_CHARS: usize = 100;

/// `text` cut to [`MAX_QUOTED_CHARS`] characters (ending `…` when cut), to be
/// quoted in a `detail`.
pub fn shorten(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().count() <= MAX_QUOTED_CHARS {
        std::borrow::Cow::Borrowed(text)
    } else {
        let mut cut: String = text.chars().take(MAX_QUOTED_CHARS - 1).collect();
        cut.push('…');
        std::borrow::Cow::Owned(cut)
    }
}

impl From<StoreError> for Problem {
    fn from(e: StoreError) -> Problem {
        match e {
            StoreError::Unavailable(_) | StoreError::Contention(_) => {
                tracing::warn!(error = %e, "store unavailable");
                let mut p = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "UNAVAILABLE",
                    "the store is unavailable and nothing is left half-written; retry (a submit with the same Idempotency-Key: its answer says whether an earlier try was accepted)",
                );
                p.retry_after = true;
                p
            }
            StoreError::Rejected(_) => {
                tracing::warn!(error = %e, "the database refused a request's values");
                Problem::invalid(
                    "the database refused the request's values (a value over a storage limit, e.g. a very long tenant or key); nothing was written",
                )
            }
            other => {
                tracing::error!(error = %other, "store failure");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "INTERNAL",
                    "internal error",
                )
            }
        }
    }
}

impl From<Refusal> for Problem {
    fn from(r: Refusal) -> Problem {
        use idem_core::machine::Rejection;
        match r {
            Refusal::NotFound => Problem::not_found("no such record for this tenant"),
            Refusal::Machine(Rejection::StaleGeneration { presented, current }) => {
                let mut p = Problem::new(
                    StatusCode::CONFLICT,
                    "STALE_GENERATION",
                    if presented > current {
                        // Generations only grow, one per claim: this one was
                        // never handed out (an executor bug or a mixed-up
                        // attempt), so it never held any lease.
                        format!(
                            "generation {presented} is newer than the task's current generation {current}: it was never issued; nothing changed, and a report is kept as evidence"
                        )
                    } else if presented == current {
                        // Heartbeats, acks and reports all end here: the lease
                        // ran out, or the attempt already ended (reported).
                        format!(
                            "generation {presented} no longer holds a live lease (it expired, or the attempt has ended); nothing changed, and a report is kept as evidence"
                        )
                    } else {
                        format!(
                            "generation {presented} no longer holds the lease (current {current}); nothing changed, and a report is kept as evidence"
                        )
                    },
                );
                p.current_generation = Some(current);
                p
            }
            Refusal::Machine(Rejection::AlreadyReported { existing }) => Problem::new(
                StatusCode::CONFLICT,
                "ATTEMPT_ALREADY_REPORTED",
                format!(
                    "the attempt already reported `{existing}`; this report was kept as evidence"
                ),
            ),
            Refusal::Machine(Rejection::InvalidReport(m)) => Problem::invalid(m),
            Refusal::Machine(Rejection::NotDelivered) => Problem::new(
                StatusCode::CONFLICT,
                "NOT_DELIVERED",
                "the task has no delivery yet",
            ),
            Refusal::Machine(other) => {
                Problem::new(StatusCode::CONFLICT, "CONFLICT", other.to_string())
            }
            _ => Problem::new(StatusCode::CONFLICT, "CONFLICT", r.to_string()),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry_after = self.retry_after;
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut res = (status, body).into_response();
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if retry_after {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        res
    }
}
