//! `POST /console/tasks/{id}/actions/{action}` (admin): `retry-now`,
//! `cancel`, `resolve`, `redrive` and `acknowledge-effect` (a suspected
//! second effect: `external_txn_id`, or `no_external_txn_id=yes` for the one
//! without an id, and a `resolution`), through the same store operations as
//! the API's operator actions, with the signed-in admin key as the actor and
//! the form's reason.
//!
//! Order of refusals, each changing nothing: no session → 403; CSRF token
//! missing or another session's → 403; a client key → 403; an unknown action
//! or task (of this tenant and grant) → 404; no `confirm=yes`, an empty
//! reason or a bad resolve form → 400; an action that does not apply to the
//! task as it is → 409 with the reason. Success: 303 back to the task page.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Redirect, Response};
use idem_core::machine::operator::{Actor, By, Reason, Refused, Resolution, ResolveOutcome};
use idem_core::model::{EffectResolution, Role};
use idem_http::problem::Problem;
use idem_store::Refusal;

use super::sign_in::{field, form_pairs};
use super::{Params, no_task, params, task_id};
use crate::html::task_href;
use crate::session::{self, Poster};
use crate::{ConsoleError, ConsoleState};

/// The actions, by their path segment.
pub const ACTIONS: [&str; 5] = [
    "retry-now",
    "cancel",
    "resolve",
    "redrive",
    "acknowledge-effect",
];

/// The refusal of the store as the API words it (404 the console's way).
fn refused(r: Refusal) -> ConsoleError {
    match r {
        Refusal::NotFound => no_task(),
        Refusal::Operator(Refused::NoSecondEffect { .. }) => ConsoleError::NotFound(
            "this task has no suspected second effect with that transaction id".into(),
        ),
        other => Problem::from(other).into(),
    }
}

/// The suspected second effect an acknowledge form names and how it was
/// settled, or 400: `external_txn_id` (or `no_external_txn_id=yes`) and a
/// `resolution` word.
fn acknowledgment(
    pairs: &[(String, String)],
) -> Result<(Option<String>, EffectResolution), ConsoleError> {
    let txn = match (
        field(pairs, "external_txn_id"),
        field(pairs, "no_external_txn_id"),
    ) {
        (Some(id), None) if !id.is_empty() => Some(id.to_owned()),
        (None, Some("yes")) => None,
        _ => {
            return Err(ConsoleError::BadRequest(
                "name the suspected second effect: its external_txn_id, or no_external_txn_id=yes"
                    .into(),
            ));
        }
    };
    let resolution = field(pairs, "resolution")
        .and_then(|r| r.parse::<EffectResolution>().ok())
        .ok_or_else(|| {
            ConsoleError::BadRequest(
                "choose a resolution: refund_issued, provider_deduplicated or false_alarm".into(),
            )
        })?;
    Ok((txn, resolution))
}

/// The resolution a resolve form asks for, or 400: the form's fields read as
/// the API's (an empty field is no field; the result is a JSON document
/// under the API's strict rules), then [`Resolution::parse`]'s rules.
fn resolution(pairs: &[(String, String)]) -> Result<Resolution, ConsoleError> {
    let txn = field(pairs, "external_txn_id")
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let result = field(pairs, "result")
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .map(|text| {
            idem_core::json::parse_strict(text.as_bytes()).map_err(|e| {
                ConsoleError::BadRequest(format!("the result is not a JSON document: {e}"))
            })
        })
        .transpose()?;
    let outcome = match field(pairs, "outcome") {
        Some("committed") => ResolveOutcome::Committed,
        Some("not_committed") => ResolveOutcome::NotCommitted,
        _ => {
            return Err(ConsoleError::BadRequest(
                "choose what the provider did: committed or not committed".into(),
            ));
        }
    };
    Resolution::parse(outcome, result, txn).map_err(|e| ConsoleError::BadRequest(e.to_string()))
}

/// `POST /console/tasks/{id}/actions/{action}`.
pub async fn act(
    State(st): State<ConsoleState>,
    Poster(who): Poster,
    path: Params<(String, String)>,
    body: Bytes,
) -> Response {
    let (raw, action) = params(path);
    match run(&st, &who, &raw, &action, &body).await {
        Ok(to) => Redirect::to(&to).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn run(
    st: &ConsoleState,
    who: &session::SignedIn,
    raw: &str,
    action: &str,
    body: &[u8],
) -> Result<String, ConsoleError> {
    let pairs = form_pairs(body);
    session::check_csrf(who, field(&pairs, "csrf"))?;
    if who.key.role != Role::Admin {
        return Err(ConsoleError::Forbidden(
            "actions need an admin key; nothing changed".into(),
        ));
    }
    if !ACTIONS.contains(&action) {
        return Err(ConsoleError::NotFound(format!(
            "no such action; actions: {}",
            ACTIONS.join(", ")
        )));
    }
    let id = task_id(raw)?;
    if field(&pairs, "confirm") != Some("yes") {
        return Err(ConsoleError::BadRequest(
            "confirm the action (the checkbox); nothing changed".into(),
        ));
    }
    // A textarea's line breaks become spaces: a reason is one line of text.
    let reason: String = field(&pairs, "reason")
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if matches!(c, '\r' | '\n' | '\t') {
                ' '
            } else {
                c
            }
        })
        .collect();
    let reason =
        Reason::parse(reason.trim()).map_err(|e| ConsoleError::BadRequest(e.to_string()))?;
    let by = By {
        actor: Actor::ApiKey(who.key.id),
        reason,
    };
    let store = who.store(st);
    let tenant = Some(who.tenant());
    match action {
        "retry-now" => store.retry_now(tenant, id, by).await?.map(drop),
        "cancel" => store.operator_cancel(tenant, id, by).await?.map(drop),
        "resolve" => {
            let resolution = resolution(&pairs)?;
            store.resolve(tenant, id, by, resolution).await?.map(drop)
        }
        "acknowledge-effect" => {
            let (txn, resolution) = acknowledgment(&pairs)?;
            store
                .acknowledge_second_effect(tenant, id, by, txn, resolution)
                .await?
                .map(drop)
        }
        _ => store.redrive(tenant, id, by).await?.map(drop),
    }
    .map_err(refused)?;
    Ok(task_href(id))
}
