//! [`ConsoleError`]: why a console request was refused, answered as an HTML
//! page with its status and message (5xx details are logged, never shown).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_http::problem::Problem;
use idem_store::StoreError;

use crate::html;

/// A refused console request: the status and the message its page shows.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// 400: a bad filter, form or parameter; nothing changed.
    #[error("{0}")]
    BadRequest(String),
    /// 403: no session for a post, a wrong or missing CSRF token, a role or
    /// grant that does not allow it; nothing changed.
    #[error("{0}")]
    Forbidden(String),
    /// 404: no such page, or no such task for this tenant (the same message
    /// whether it does not exist or is another tenant's).
    #[error("{0}")]
    NotFound(String),
    /// Any other status the API would answer (409 for an action that does
    /// not apply to the task as it is), with its message.
    #[error("{message}")]
    Status {
        /// The HTTP status.
        status: StatusCode,
        /// What the page says.
        message: String,
    },
    /// 503: the store is unavailable; nothing was left half-written.
    #[error("the store is unavailable; try again")]
    Unavailable,
    /// 500: stored data that does not decode, or another internal failure
    /// (logged).
    #[error("internal error")]
    Internal,
}

impl ConsoleError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            ConsoleError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ConsoleError::Forbidden(_) => StatusCode::FORBIDDEN,
            ConsoleError::NotFound(_) => StatusCode::NOT_FOUND,
            ConsoleError::Status { status, .. } => *status,
            ConsoleError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ConsoleError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<StoreError> for ConsoleError {
    fn from(e: StoreError) -> ConsoleError {
        if e.is_retryable() {
            tracing::warn!(error = %e, "console: store unavailable");
            ConsoleError::Unavailable
        } else if let StoreError::Rejected(_) = e {
            ConsoleError::BadRequest(
                "the database refused the request's values; nothing was written".into(),
            )
        } else {
            tracing::error!(error = %e, "console: store failure");
            ConsoleError::Internal
        }
    }
}

impl From<Problem> for ConsoleError {
    fn from(p: Problem) -> ConsoleError {
        let status = StatusCode::from_u16(p.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        match status {
            StatusCode::BAD_REQUEST => ConsoleError::BadRequest(p.detail.clone()),
            StatusCode::FORBIDDEN => ConsoleError::Forbidden(p.detail.clone()),
            StatusCode::NOT_FOUND => ConsoleError::NotFound(p.detail.clone()),
            StatusCode::SERVICE_UNAVAILABLE => ConsoleError::Unavailable,
            s if s.is_server_error() => ConsoleError::Internal,
            status => ConsoleError::Status {
                status,
                message: p.detail.clone(),
            },
        }
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let status = self.status();
        let title = status.canonical_reason().unwrap_or("Error");
        (status, html::error_page(title, &self.to_string())).into_response()
    }
}
