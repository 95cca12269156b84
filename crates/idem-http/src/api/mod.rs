//! Handlers of SPEC §4, each documented for the OpenAPI document: submit
//! ([`submit`]), task search ([`search`]), queues ([`queues`]), task reads and actions ([`tasks`]), the executor protocol
//! ([`attempts`]), the operator actions ([`operator`]), live events and the tenant feed
//! ([`events`]), health ([`health`]); the documents they read and write
//! ([`wire`]) and how a request's body and path are read ([`extract`]).

use uuid::Uuid;

use crate::problem::Problem;

pub mod attempts;
pub mod events;
pub mod extract;
pub mod health;
pub mod operator;
pub mod queues;
pub mod search;
pub mod submit;
pub mod tasks;
pub mod wire;

/// The 404 detail for task `id`, the same whether it does not exist or
/// belongs to another tenant or to a class the key is not granted.
fn no_task(id: Uuid) -> impl FnOnce() -> String {
    move || format!("no task {id} for this tenant")
}

/// The 404 detail for attempt `id` (as [`no_task`]).
fn no_attempt(id: Uuid) -> impl FnOnce() -> String {
    move || format!("no attempt {id} for this tenant")
}

/// 400 `INVALID_REQUEST` for an operation class this configuration does not
/// define, listing the ones it does.
fn unknown_operation(st: &crate::AppState, operation: &str) -> Problem {
    let classes: Vec<&str> = st.config.operations.keys().map(String::as_str).collect();
    Problem::invalid(format!(
        "unknown operation `{}`; configured classes: {}",
        crate::problem::shorten(operation),
        classes.join(", ")
    ))
}
