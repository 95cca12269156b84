//! The console's pages and endpoints, one module each: [`sign_in`] (and
//! sign-out), [`overview`], [`search`], [`task`] (the page and its
//! fragment), [`live`] (the task page's update stream), [`actions`] (an
//! admin's retry-now, cancel, resolve, redrive) and [`statics`].

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use uuid::Uuid;

use crate::{ConsoleError, ConsoleState, session};

pub mod actions;
pub mod live;
pub mod overview;
pub mod search;
pub mod sign_in;
pub mod statics;
pub mod task;

/// `GET /console`: 303 to the overview when signed in, else to the sign-in form.
pub async fn root(State(st): State<ConsoleState>, headers: HeaderMap) -> Response {
    match session::lookup(&st, &headers).await {
        Ok(Some(_)) => Redirect::to("/console/overview").into_response(),
        Ok(None) => Redirect::to("/console/sign-in").into_response(),
        Err(e) => e.into_response(),
    }
}

/// An unknown console path: 404 page.
pub async fn not_found() -> ConsoleError {
    ConsoleError::NotFound("no such console page".into())
}

/// A known console path with another method: 405 page.
pub async fn method_not_allowed() -> ConsoleError {
    ConsoleError::Status {
        status: axum::http::StatusCode::METHOD_NOT_ALLOWED,
        message: "method not allowed on this page".into(),
    }
}

/// A path's parameters as the router found them; `Err` when one is not
/// UTF-8 once percent-decoded.
pub(crate) type Params<T> = Result<Path<T>, PathRejection>;

/// The path's parameters, or empty ones when they are not UTF-8 (a malformed
/// task id then answers the console's 404 page, like any other, not the
/// router's plain-text 400).
pub(crate) fn params<T: Default>(p: Params<T>) -> T {
    p.map(|Path(t)| t).unwrap_or_default()
}

/// A task id from a path, or 404 (a malformed id names no task).
pub(crate) fn task_id(raw: &str) -> Result<Uuid, ConsoleError> {
    Uuid::parse_str(raw).map_err(|_| no_task())
}

/// The 404 of a task that does not exist or is another tenant's (or of a
/// class the key is not granted): the same words either way.
pub(crate) fn no_task() -> ConsoleError {
    ConsoleError::NotFound("no such task for this tenant".into())
}
