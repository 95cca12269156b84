//! RFC 9457 problem documents with the `code` member of SPEC §4.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Declares the problem codes with `as_str` and `Display`; `Other` decodes
/// any code this version does not know and is never serialized. Each code's
/// spelling is its variant's name in SCREAMING_SNAKE_CASE (serde's and the
/// schema's) and the literal given (`as_str`); a test checks they agree.
macro_rules! problem_codes {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $var:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(rename_all = "SCREAMING_SNAKE_CASE")]
        pub enum $name {
            $($(#[$vm])* $var,)+
            /// A code this version does not know (sent by a newer server).
            /// Serializing it is an error: a server never sends it.
            #[serde(other, skip_serializing)]
            Other,
        }

        impl $name {
            /// Every code a server sends, in declaration order ([`Self::Other`] is not one).
            pub const ALL: &'static [$name] = &[$($name::$var),+];

            /// The wire spelling (`"OTHER"` for [`Self::Other`], which is never sent).
            pub fn as_str(self) -> &'static str {
                match self { $($name::$var => $s,)+ $name::Other => "OTHER" }
            }
        }
    };
}

problem_codes! {
    /// Stable machine-readable code of a problem (SPEC §4 status table).
    ProblemCode {
        /// 400: the request has no `Idempotency-Key`.
        IdempotencyKeyMissing => "IDEMPOTENCY_KEY_MISSING",
        /// 400: the `Idempotency-Key` is malformed (empty, over 255 bytes, not
        /// visible ASCII, several header lines).
        IdempotencyKeyInvalid => "IDEMPOTENCY_KEY_INVALID",
        /// 422: the scope is bound to a request with a different fingerprint.
        IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
        /// 400: the request is malformed or breaks a rule.
        InvalidRequest => "INVALID_REQUEST",
        /// 401: no or bad credentials.
        Unauthenticated => "UNAUTHENTICATED",
        /// 403: the key's role or grant does not allow the request.
        PermissionDenied => "PERMISSION_DENIED",
        /// 404: no such path or record (for this tenant).
        NotFound => "NOT_FOUND",
        /// 405: the path exists, not with this method.
        MethodNotAllowed => "METHOD_NOT_ALLOWED",
        /// 409: the generation no longer holds the lease.
        StaleGeneration => "STALE_GENERATION",
        /// 409: the attempt already has a different outcome.
        AttemptAlreadyReported => "ATTEMPT_ALREADY_REPORTED",
        /// 409: the task has no delivery to acknowledge.
        NotDelivered => "NOT_DELIVERED",
        /// 409: an operator action does not apply to the task's state (e.g.
        /// `resolve` on a task that is not `reconciling`).
        InvalidState => "INVALID_STATE",
        /// 409: a redrive of a task whose submitting API key was revoked or
        /// is no longer granted the task's class.
        SubmitterRevoked => "SUBMITTER_REVOKED",
        /// 409: another refusal of the state machine.
        Conflict => "CONFLICT",
        /// 408: the request body was not complete within the server's body
        /// bound (`IDEM_BODY_TIMEOUT_MS`); the connection is closed.
        RequestTimeout => "REQUEST_TIMEOUT",
        /// 429: a new task over a rate limit of its tenant or class
        /// (SPEC §8.1); nothing was created and the `Idempotency-Key` is
        /// still free. Sent with `Retry-After` (seconds, >= 1).
        RateLimited => "RATE_LIMITED",
        /// 413: the body is over the limit.
        PayloadTooLarge => "PAYLOAD_TOO_LARGE",
        /// 503: the store (or the metrics recorder) is unavailable; nothing
        /// was half-written.
        Unavailable => "UNAVAILABLE",
        /// 503: the store is healthy but every connection (PostgreSQL) stayed
        /// busy for as long as the request may wait for one; nothing was
        /// written. Sent with `Retry-After` (seconds): retry no sooner.
        Overloaded => "OVERLOADED",
        /// 503: the server requires a synchronous standby
        /// (`IDEM_REQUIRE_SYNC_STANDBY`) and none is attached to the primary;
        /// nothing was written. Sent with `Retry-After` (seconds).
        NoSyncStandby => "NO_SYNC_STANDBY",
        /// 500: an internal error.
        Internal => "INTERNAL",
    }
}

impl fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An `application/problem+json` body (RFC 9457 §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    pub code: ProblemCode,
    /// For `IDEMPOTENCY_CONFLICT`: the original task (never its params).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<Uuid>,
    /// For `IDEMPOTENCY_CONFLICT`: the RFC 6901 JSON Pointers into `params`
    /// of the material fields whose canonical values differ from the original
    /// request's (never the values).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub differing_fields: Option<Vec<String>>,
    /// For `STALE_GENERATION`: the task's current generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_generation: Option<i64>,
    /// For `INVALID_REQUEST` from a class's `params_schema`: each failing
    /// value, by its JSON Pointer into the request body (`/params/...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<InvalidValue>>,
    /// For `PAYLOAD_TOO_LARGE`: the largest body accepted, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

impl Problem {
    /// A problem with `status`, its `title`, `code` and `detail`; `type` is
    /// `https://idem.dev/problems/<code in lower case, words joined by ->`.
    pub fn new(
        status: u16,
        title: impl Into<String>,
        code: ProblemCode,
        detail: impl Into<String>,
    ) -> Problem {
        Problem {
            kind: format!(
                "https://idem.dev/problems/{}",
                code.as_str().to_ascii_lowercase().replace('_', "-")
            ),
            title: title.into(),
            status,
            detail: detail.into(),
            code,
            task_id: None,
            differing_fields: None,
            current_generation: None,
            errors: None,
            max_bytes: None,
        }
    }
}

/// One value of a request that breaks a rule (a member of [`Problem::errors`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct InvalidValue {
    /// RFC 6901 JSON Pointer into the request body, e.g. `/params/currency`
    /// (for a missing member: where it would be).
    pub pointer: String,
    /// What is wrong, e.g. `"currency" is a required property`.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// Every code serializes as its `as_str` spelling and decodes back; an
    /// unknown code decodes as `Other`, which does not serialize.
    #[test]
    fn codes_round_trip_and_other_is_never_sent() {
        for c in ProblemCode::ALL {
            let json = serde_json::to_value(c).unwrap();
            assert_eq!(json, Value::String(c.as_str().to_owned()));
            assert_eq!(serde_json::from_value::<ProblemCode>(json).unwrap(), *c);
        }
        let newer: ProblemCode = serde_json::from_value(json!("SOME_NEW_CODE")).unwrap();
        assert_eq!(newer, ProblemCode::Other);
        assert!(serde_json::to_value(ProblemCode::Other).is_err());
        let mut p = Problem::new(409, "Conflict", ProblemCode::Other, "x");
        assert!(serde_json::to_vec(&p).is_err());
        p.code = ProblemCode::StaleGeneration;
        assert!(serde_json::to_vec(&p).is_ok());
    }

    #[test]
    fn problems_decode_with_and_without_their_optional_members() {
        let p = Problem::new(
            422,
            "Unprocessable Entity",
            ProblemCode::IdempotencyConflict,
            "d",
        );
        assert_eq!(p.kind, "https://idem.dev/problems/idempotency-conflict");
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(
            json,
            json!({"type": "https://idem.dev/problems/idempotency-conflict",
                   "title": "Unprocessable Entity", "status": 422, "detail": "d",
                   "code": "IDEMPOTENCY_CONFLICT"})
        );
        assert_eq!(serde_json::from_value::<Problem>(json).unwrap(), p);
    }
}
