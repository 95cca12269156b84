//! RFC 9457 problem documents with the `code` member of SPEC §4.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
pub use idem_api::{InvalidValue, ProblemCode};
use idem_core::key::KeyError;
use idem_store::{Refusal, StoreError};

/// An `application/problem+json` body (RFC 9457 §3) as the server answers
/// with it: the [`idem_api::Problem`] document (reached through `Deref`),
/// and the `Retry-After` it carries, in seconds, if any (a store that is
/// unavailable or overloaded).
#[derive(Debug, Clone)]
pub struct Problem {
    doc: idem_api::Problem,
    retry_after: Option<u32>,
}

/// `Retry-After` of a 503 `UNAVAILABLE`, seconds: the store failed (a lost
/// connection, a restart, a failover); a prompt retry finds out whether it
/// is back, and the client's own backoff spaces further ones.
pub const UNAVAILABLE_RETRY_AFTER_S: u32 = 1;

/// `Retry-After` of a 503 `NO_SYNC_STANDBY`, seconds: a standby that
/// reconnects takes a few seconds to catch up and be synchronous again, and
/// the server checks every second.
pub const NO_SYNC_STANDBY_RETRY_AFTER_S: u32 = 2;

/// `Retry-After` of a 503 `OVERLOADED`, seconds. The request already queued
/// for a connection for the pool's whole wait bound (`PgOptions::pool_timeout`,
/// 5 s by default) without getting one, so work arrives faster than the pool
/// drains it; retrying at once only lengthens that queue. Two seconds is long
/// enough for the queue ahead to drain (a connection runs hundreds of
/// operations a second), and short next to the wait already spent.
pub const OVERLOADED_RETRY_AFTER_S: u32 = 2;

/// `idem_overloaded_total`: requests that met an overloaded store, by
/// `handled` (docs/operations.md).
pub const OVERLOADED_TOTAL: &str = "idem_overloaded_total";

/// `handled` values of [`OVERLOADED_TOTAL`]: `refused` (answered 503
/// `OVERLOADED`), `waited` (a long-poll claim kept waiting within its
/// `wait_ms` instead).
pub const OVERLOAD_HANDLING: [&str; 2] = ["refused", "waited"];

/// `idem_store_unavailable_total`: requests answered 503 `UNAVAILABLE`
/// because the store failed (docs/operations.md).
pub const STORE_UNAVAILABLE_TOTAL: &str = "idem_store_unavailable_total";

/// The document's schema: a [`Problem`] answers as its [`idem_api::Problem`].
impl utoipa::PartialSchema for Problem {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        <idem_api::Problem as utoipa::PartialSchema>::schema()
    }
}

impl utoipa::ToSchema for Problem {
    fn name() -> std::borrow::Cow<'static, str> {
        <idem_api::Problem as utoipa::ToSchema>::name()
    }

    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        <idem_api::Problem as utoipa::ToSchema>::schemas(schemas);
    }
}

impl std::ops::Deref for Problem {
    type Target = idem_api::Problem;
    fn deref(&self) -> &idem_api::Problem {
        &self.doc
    }
}

impl std::ops::DerefMut for Problem {
    fn deref_mut(&mut self) -> &mut idem_api::Problem {
        &mut self.doc
    }
}

impl Problem {
    /// A problem with `status`, `code` and `detail`.
    pub fn new(status: StatusCode, code: ProblemCode, detail: impl Into<String>) -> Problem {
        Problem {
            doc: idem_api::Problem::new(
                status.as_u16(),
                status.canonical_reason().unwrap_or("Error"),
                code,
                detail,
            ),
            retry_after: None,
        }
    }

    /// 400 `INVALID_REQUEST`.
    pub fn invalid(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, ProblemCode::InvalidRequest, detail)
    }

    /// 404 `NOT_FOUND` saying what was not found: a path, an id that is not
    /// a UUID, or a record (also for other tenants' records, with the same
    /// text: existence is not leaked).
    pub fn not_found(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::NOT_FOUND, ProblemCode::NotFound, detail)
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
        Problem::new(
            StatusCode::UNAUTHORIZED,
            ProblemCode::Unauthenticated,
            detail,
        )
    }

    /// 403 `PERMISSION_DENIED`.
    pub fn forbidden(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::FORBIDDEN, ProblemCode::PermissionDenied, detail)
    }

    /// 413 `PAYLOAD_TOO_LARGE` naming the limit, `limit` bytes, in its
    /// `detail` and as the `max_bytes` member (a client cuts its free text
    /// to fit and sends again).
    pub fn too_large(limit: usize) -> Problem {
        let mut p = Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ProblemCode::PayloadTooLarge,
            format!("the request body is over the limit of {limit} bytes"),
        );
        p.max_bytes = u64::try_from(limit).ok();
        p
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

impl Problem {
    /// 503 `NO_SYNC_STANDBY` with `Retry-After`: `why` names what the last
    /// check of the primary found; nothing was written.
    pub fn no_sync_standby(why: &str) -> Problem {
        let mut p = Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemCode::NoSyncStandby,
            format!(
                "{why}; nothing was written: retry after {NO_SYNC_STANDBY_RETRY_AFTER_S} s (a submit with the same Idempotency-Key)"
            ),
        );
        p.retry_after = Some(NO_SYNC_STANDBY_RETRY_AFTER_S);
        p
    }
    /// 429 `RATE_LIMITED` with `Retry-After`: a new task over a rate limit
    /// (SPEC §8.1), admitted again in `retry_after_ms` (whole seconds,
    /// rounded up, at least 1); nothing was written and the
    /// `Idempotency-Key` is still free.
    pub fn rate_limited(retry_after_ms: i64) -> Problem {
        let seconds = u32::try_from(retry_after_ms.max(1).saturating_add(999) / 1000)
            .unwrap_or(u32::MAX)
            .max(1);
        let mut p = Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            ProblemCode::RateLimited,
            format!(
                "over the rate limit of new tasks; nothing was created and this Idempotency-Key is still free: retry after {seconds} s"
            ),
        );
        p.retry_after = Some(seconds);
        p
    }
}

impl From<StoreError> for Problem {
    fn from(e: StoreError) -> Problem {
        match e {
            StoreError::Unavailable(_) | StoreError::Contention(_) => {
                tracing::warn!(error = %e, "store unavailable");
                let mut p = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ProblemCode::Unavailable,
                    "the store is unavailable and nothing is left half-written; retry (a submit with the same Idempotency-Key: its answer says whether an earlier try was accepted)",
                );
                p.retry_after = Some(UNAVAILABLE_RETRY_AFTER_S);
                p
            }
            StoreError::Overloaded(_) => {
                tracing::warn!(error = %e, "store overloaded");
                let mut p = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ProblemCode::Overloaded,
                    format!(
                        "the store is overloaded: no database connection came free in time; nothing was written; retry after {OVERLOADED_RETRY_AFTER_S} s (a submit with the same Idempotency-Key)"
                    ),
                );
                p.retry_after = Some(OVERLOADED_RETRY_AFTER_S);
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
                    ProblemCode::Internal,
                    "internal error",
                )
            }
        }
    }
}

impl From<Refusal> for Problem {
    fn from(r: Refusal) -> Problem {
        use idem_core::machine::Rejection;
        use idem_core::machine::operator::Refused;
        match r {
            Refusal::NotFound => Problem::not_found("no such record for this tenant"),
            Refusal::Machine(Rejection::StaleGeneration { presented, current }) => {
                let mut p = Problem::new(
                    StatusCode::CONFLICT,
                    ProblemCode::StaleGeneration,
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
                ProblemCode::AttemptAlreadyReported,
                format!(
                    "the attempt already reported `{existing}`; this report was kept as evidence"
                ),
            ),
            Refusal::Machine(e @ (Rejection::Acknowledged | Rejection::UsageRecorded { .. })) => {
                Problem::new(
                    StatusCode::CONFLICT,
                    ProblemCode::AttemptAlreadyReported,
                    format!("{e}; nothing changed"),
                )
            }
            Refusal::Machine(Rejection::InvalidReport(m)) => Problem::invalid(m),
            Refusal::Machine(Rejection::NotDelivered) => Problem::new(
                StatusCode::CONFLICT,
                ProblemCode::NotDelivered,
                "the task has no delivery yet",
            ),
            Refusal::Operator(Refused::InvalidState(detail)) => {
                Problem::new(StatusCode::CONFLICT, ProblemCode::InvalidState, detail)
            }
            Refusal::Operator(e @ Refused::SubmitterRevoked { .. }) => Problem::new(
                StatusCode::CONFLICT,
                ProblemCode::SubmitterRevoked,
                e.to_string(),
            ),
            Refusal::Operator(e @ Refused::NoSecondEffect { .. }) => {
                Problem::not_found(e.to_string())
            }
            Refusal::Machine(other) => Problem::new(
                StatusCode::CONFLICT,
                ProblemCode::Conflict,
                other.to_string(),
            ),
            _ => Problem::new(StatusCode::CONFLICT, ProblemCode::Conflict, r.to_string()),
        }
    }
}

impl From<KeyError> for Problem {
    /// 400 `IDEMPOTENCY_KEY_MISSING` for no key, else 400 `IDEMPOTENCY_KEY_INVALID`.
    fn from(e: KeyError) -> Problem {
        let code = match e {
            KeyError::Missing => ProblemCode::IdempotencyKeyMissing,
            KeyError::Multiple | KeyError::Invalid { .. } => ProblemCode::IdempotencyKeyInvalid,
        };
        Problem::new(StatusCode::BAD_REQUEST, code, e.to_string())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry_after = self.retry_after;
        // Counted when answered, not when made: a waiting claim that meets
        // an overload keeps waiting instead ([`OVERLOAD_HANDLING`]).
        match (self.doc.code, retry_after) {
            (ProblemCode::Overloaded, _) => {
                metrics::counter!(OVERLOADED_TOTAL, "handled" => "refused").increment(1);
            }
            (ProblemCode::Unavailable, Some(_)) => {
                metrics::counter!(STORE_UNAVAILABLE_TOTAL).increment(1);
            }
            _ => {}
        }
        // Only `ProblemCode::Other` fails to serialize, and the server never
        // builds a problem with it.
        let body = serde_json::to_vec(&self.doc).unwrap_or_default();
        let mut res = (status, body).into_response();
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = retry_after {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        res
    }
}
