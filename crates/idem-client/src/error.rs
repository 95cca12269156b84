//! [`ClientError`]: what can go wrong with a call, and how an error answer
//! becomes one.

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};

use crate::{Problem, ProblemCode};

/// Everything that can go wrong with a call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// idem answered with an error status. For idem's own errors `problem` is
    /// the RFC 9457 document with its `code` (`ProblemCode::Other` for a code
    /// this version does not know); for an answer that is not a problem
    /// document (e.g. from a proxy) `problem.code` is `ProblemCode::Other`,
    /// `problem.type` is empty and `problem.detail` holds the start of the body.
    #[error("HTTP {status} {}: {}", problem.code, problem.detail)]
    Api {
        /// HTTP status code.
        status: u16,
        /// The problem document (boxed: keeps `Result`s small).
        problem: Box<Problem>,
        /// The `Retry-After` delay, if the server sent one (503 `UNAVAILABLE`
        /// or `OVERLOADED`).
        retry_after: Option<Duration>,
        /// The `X-Request-Id` of the answer, if any.
        request_id: Option<String>,
    },
    /// No answer within the time limit. The request may or may not have been
    /// applied: repeat it with the same idempotency key or look the task up.
    #[error("request timed out")]
    Timeout(#[source] reqwest::Error),
    /// Connection refused or reset, DNS failure, broken body … The request may
    /// or may not have been applied.
    #[error("transport error")]
    Transport(#[source] reqwest::Error),
    /// A success status with a body that is not the expected JSON.
    #[error("unexpected answer (HTTP {status}): {message}")]
    Decode {
        /// HTTP status code.
        status: u16,
        /// What did not decode.
        message: String,
    },
    /// An argument was refused before anything was sent (e.g. a malformed key or URL).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl ClientError {
    /// The HTTP status, when idem answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } | ClientError::Decode { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The problem `code` (e.g. `IDEMPOTENCY_CONFLICT`), when idem answered
    /// with a problem whose code this version knows.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ClientError::Api { problem, .. } if problem.code != ProblemCode::Other => {
                Some(problem.code.as_str())
            }
            _ => None,
        }
    }

    /// The problem document, when idem answered with an error status.
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            ClientError::Api { problem, .. } => Some(problem),
            _ => None,
        }
    }

    /// The `Retry-After` delay idem asked for (503 `UNAVAILABLE` and
    /// `OVERLOADED`): wait at least this long before sending again.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Api { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// Whether idem answered 503 `OVERLOADED`: the store is healthy but had
    /// no connection free in time; back off for [`ClientError::retry_after`].
    pub fn is_overloaded(&self) -> bool {
        self.code() == Some(ProblemCode::Overloaded.as_str())
    }

    /// Whether the request timed out.
    pub fn is_timeout(&self) -> bool {
        matches!(self, ClientError::Timeout(_))
    }

    /// Whether the request failed below HTTP (timeout included).
    pub fn is_transport(&self) -> bool {
        matches!(self, ClientError::Timeout(_) | ClientError::Transport(_))
    }

    /// Whether repeating the same request (with the same idempotency key) may
    /// succeed: timeouts, transport failures and 5xx answers.
    pub fn is_retryable(&self) -> bool {
        self.is_transport() || self.status().is_some_and(|s| s >= 500)
    }

    pub(crate) fn from_reqwest(e: reqwest::Error) -> ClientError {
        if e.is_timeout() {
            ClientError::Timeout(e)
        } else {
            ClientError::Transport(e)
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// The error of an answer with status `status`: its problem document, or one
/// made from the start of a body that is not one.
pub(crate) fn api_error(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    request_id: Option<String>,
) -> ClientError {
    let problem = serde_json::from_slice::<Problem>(body).unwrap_or_else(|_| Problem {
        kind: String::new(),
        title: status.canonical_reason().unwrap_or("Error").to_owned(),
        status: status.as_u16(),
        detail: String::from_utf8_lossy(body).chars().take(200).collect(),
        code: ProblemCode::Other,
        task_id: None,
        differing_fields: None,
        current_generation: None,
        errors: None,
        max_bytes: None,
    });
    let retry_after = headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    ClientError::Api {
        status: status.as_u16(),
        problem: Box::new(problem),
        retry_after,
        request_id,
    }
}
