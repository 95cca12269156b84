//! `GET /console/tasks/{id}`: a task's whole story — the request (key,
//! scope, fingerprint, canonical request, params), the frozen contract, the
//! timeline picture ([`crate::timeline::svg`]) with the same facts as a table
//! of attempts, delivery and cancellation, and the raw events one click
//! away — and, for an admin, the actions that apply to its state.
//!
//! Everything that changes lives in `#task-body`; `GET
//! /console/tasks/{id}/fragment` answers that inner HTML alone, which the
//! page's script swaps in when the live stream ([`super::live`]) says the task
//! changed.

pub mod verdict;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use idem_core::machine::operator::Actor;
use idem_core::model::{
    Attempt, CancelStatus, Disposition, Event, EventData, Task, TaskState, Timestamp,
};
use maud::{Markup, html};
use serde_json::Value;
use uuid::Uuid;

use super::{Params, no_task, params, task_id};
use crate::html::{
    self as page, attempt_summary, count, csrf_input, money, opt_time, pretty, time,
};
use crate::session::{SignedIn, Viewer, Watcher};
use crate::{ConsoleError, ConsoleState};

/// A task with its attempts and events, as the page shows them.
pub struct Story {
    /// The task.
    pub task: Task,
    /// Its attempts, by number, with their evidence.
    pub attempts: Vec<Attempt>,
    /// Its events, by sequence.
    pub events: Vec<Event>,
    /// When it was read (the store's clock).
    pub now: Timestamp,
}

/// Reads task `id` of `who`'s tenant (and grant) with its attempts and events.
///
/// # Errors
/// 404 for a task that does not exist or is not `who`'s to see; 503 when the
/// store is unavailable.
pub async fn read_story(
    st: &ConsoleState,
    who: &SignedIn,
    id: Uuid,
) -> Result<Story, ConsoleError> {
    let store = who.store(st);
    let (task, events) = store
        .task_history(Some(who.tenant()), id)
        .await?
        .map_err(|_| no_task())?;
    let attempts = store
        .list_attempts(Some(who.tenant()), id)
        .await?
        .map_err(|_| no_task())?;
    Ok(Story {
        task,
        attempts,
        events,
        now: st.app.store.now().await?,
    })
}

/// `GET /console/tasks/{id}`.
///
/// # Errors
/// 404 for a malformed, unknown or other tenant's id; 503.
pub async fn page(
    State(st): State<ConsoleState>,
    Viewer(who): Viewer,
    raw: Params<String>,
) -> Result<Markup, ConsoleError> {
    let id = task_id(&params(raw))?;
    let story = read_story(&st, &who, id).await?;
    let t = &story.task;
    let main = html! {
        main #task data-live={ "/console/tasks/" (t.id) "/live" } data-fragment={ "/console/tasks/" (t.id) "/fragment" } {
            p.kicker { "Task " code { (t.id) } }
            h1 { (t.idempotency_key) }
            div #task-body aria-live="polite" {
                (body(&story, Some(&who)))
            }
            @if who.key.role == idem_core::model::Role::Admin {
                (actions(&who, t))
            }
        }
    };
    Ok(page::page(
        &format!("Task {}", t.idempotency_key),
        Some(&who),
        main,
    ))
}

/// `GET /console/tasks/{id}/fragment`: the inner HTML of `#task-body`.
///
/// # Errors
/// 401 without a session; 404; 503.
pub async fn fragment(
    State(st): State<ConsoleState>,
    Watcher(who): Watcher,
    raw: Params<String>,
) -> Result<Response, ConsoleError> {
    let id = task_id(&params(raw))?;
    let story = read_story(&st, &who, id).await?;
    Ok((
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body(&story, Some(&who)).into_string(),
    )
        .into_response())
}

/// The task's attempts as every page counts them
/// ([`crate::html::attempt_summary`]: all attempts, then the execute
/// attempts that started against the execute limit), then those the
/// attempts list adds: the reconcile attempts and the released ones, which
/// count against nothing; e.g. "6 attempts: 3 of 3 execute, 3 reconcile". A
/// failure's "all 3 execute attempts used" reads against the same figures.
fn attempt_count(s: &Story) -> String {
    use idem_core::model::{AttemptKind, AttemptState};
    let released = s
        .attempts
        .iter()
        .filter(|a| a.state == AttemptState::Released)
        .count();
    let reconcile = s
        .attempts
        .iter()
        .filter(|a| a.kind == AttemptKind::Reconcile && a.state != AttemptState::Released)
        .count();
    let mut text = attempt_summary(&s.task);
    if reconcile > 0 {
        text.push_str(&format!(", {reconcile} reconcile"));
    }
    if released > 0 {
        text.push_str(&format!(", {released} released"));
    }
    text
}

/// The inner HTML of `#task-body`; `who`, when an admin, also gets the
/// verdict's acknowledge forms.
pub fn body(s: &Story, who: Option<&SignedIn>) -> Markup {
    let t = &s.task;
    html! {
        (verdict::verdict(s, who.filter(|w| w.key.role == idem_core::model::Role::Admin)))
        p.summary {
            "State " span #task-state class={ "state state-" (t.state.as_str()) } data-state=(t.state.as_str()) { (t.state.as_str()) }
            " · operation " span.operation { (t.operation) }
            " · generation " span #generation { (t.generation) }
            " · " span #attempt-count { (attempt_count(s)) } " · usage " (t.usage)
            " · created " (time(t.created_at)) " · updated " (time(t.updated_at))
        }
        @if let Some(f) = &t.failure {
            p #failure.failure { "Failed: " strong { (f.class.as_str()) } " — " (f.message) }
        }
        section #timeline aria-labelledby="timeline-heading" {
            h2 #timeline-heading { "Timeline" }
            // The picture is at least 1,008 px wide: it scrolls sideways on
            // a narrow screen instead of shrinking its labels.
            div .timeline-scroll {
                (crate::timeline::svg(t, &s.attempts, &s.events, s.now))
            }
            (attempts_table(&s.attempts))
        }
        section #delivery aria-labelledby="delivery-title" {
            h2 #delivery-title { "Delivery" }
            @match &t.delivery {
                Some(d) => {
                    dl {
                        dt { "Charge" } dd.charge data-minor-units=(d.charge) { (money(t, d.charge)) " (charged once)" }
                        dt { "Delivered" } dd.delivered-at { (time(d.delivered_at)) }
                        dt { "Acknowledged" } dd.acknowledged-at { (opt_time(d.acknowledged_at)) }
                        dt { "External transaction id" } dd.external-txn-id { (d.external_txn_id.as_deref().unwrap_or("—")) }
                        dt { "Result" } dd { pre.result { (pretty(&d.result)) } }
                    }
                }
                None => {
                    p.result.none { "Not delivered." }
                }
            }
            h3 { "Cancellation" }
            @match &t.cancellation {
                Some(c) => {
                    dl #cancellation {
                        dt { "Status" } dd.cancel-status data-status=(c.status.as_str()) { (c.status.as_str()) }
                        dt { "Requested" } dd { (time(c.requested_at)) }
                        dt { "Settled" } dd { (opt_time(c.confirmed_at)) }
                        dt { "Fee" } dd.fee data-minor-units=[c.fee] { (fee_words(t, c)) }
                    }
                }
                None => p { "No cancellation was requested." }
            }
            h3 { "Idempotency key" }
            p #key-expiry {
                @match t.control.key_expires_at {
                    Some(at) => { "Kept until " (time(at)) ", then released: the same key then starts a new task." }
                    None => { "Kept while the task runs; released after the retention window once it ends." }
                }
            }
        }
        section #request aria-labelledby="request-title" {
            h2 #request-title { "Request" }
            dl {
                dt { "Idempotency key" } dd #idempotency-key { (t.idempotency_key) }
                dt { "Scope" } dd #scope { "tenant " (t.control.tenant) ", operation " (t.operation) ", key " (t.idempotency_key) }
                dt { "Task id" } dd { code { (t.id) } }
                dt { "Fingerprint" } dd { code #fingerprint { (t.fingerprint) } }
                @if let Some(tp) = &t.traceparent {
                    dt { "Trace" } dd { code { (tp) } }
                }
            }
            h3 { "Canonical request" }
            pre #canonical-request { (t.control.canonical_request) }
            h3 { "Params" }
            pre #params { (pretty(&t.params)) }
        }
        details #contract {
            summary #contract-title { "Contract frozen at acceptance" }
            p { "What this task is charged and how it is retried, whatever the configuration says now." }
            @match serde_json::from_str::<Value>(t.contract.json()) {
                Ok(v) => (json_dl(&v)),
                Err(_) => pre { (t.contract.json()) },
            }
        }
        details #raw-events {
            summary { "Raw events" }
            table {
                caption { (count(s.events.len(), "event", "events")) " of the task, in order" }
                thead {
                    tr {
                        th scope="col" { "Seq" }
                        th scope="col" { "Type" }
                        th scope="col" { "Time" }
                        th scope="col" { "Actor" }
                        th scope="col" { "Payload" }
                    }
                }
                tbody {
                    @for e in &s.events {
                        tr data-event-id=(e.seq) data-type=(e.kind.as_str()) {
                            td.seq { (e.seq) }
                            td.type { (e.kind.as_str()) }
                            td.time { (time(e.at)) }
                            td.actor { (actor(&e.data)) }
                            // Focusable: a long payload scrolls within its 12rem
                            // (WCAG 2.1.1, axe `scrollable-region-focusable`).
                            td.payload { pre tabindex="0" { (pretty(&data_json(&e.data))) } }
                        }
                    }
                }
            }
        }
    }
}

/// The attempts as a table: the timeline's facts for screen readers and tests.
fn attempts_table(attempts: &[Attempt]) -> Markup {
    html! {
        table #attempts {
            caption { "Attempts" }
            thead {
                tr {
                    th scope="col" { "#" }
                    th scope="col" { "Generation" }
                    th scope="col" { "Kind" }
                    th scope="col" { "Executor" }
                    th scope="col" { "Outcome" }
                    th scope="col" { "Leased" }
                    th scope="col" { "Lease ends" }
                    th scope="col" { "Usage" }
                    th scope="col" { "Message" }
                    th scope="col" { "External transaction" }
                    th scope="col" { "Evidence" }
                }
            }
            tbody {
                @for a in attempts {
                    tr data-attempt-id=(a.id) {
                        td.number { (a.number) }
                        td.generation { (a.generation) }
                        td.kind { (a.kind.as_str()) }
                        td.executor { (a.executor_id) }
                        td.outcome data-state=(a.state.as_str()) { (a.state.as_str()) }
                        td.leased { (time(a.leased_at)) }
                        td.lease-end { (time(a.lease_expires_at)) }
                        td.usage { (a.usage) }
                        td.message { (attempt_message(a)) }
                        td.txn { (txn_ids(a)) }
                        td.evidence {
                            @if a.evidence.is_empty() { "—" }
                            @else { ul {
                                @for ev in &a.evidence {
                                    @let stale = !matches!(ev.disposition, idem_core::model::Disposition::Applied | idem_core::model::Disposition::Repeat);
                                    li class=[stale.then_some("stale")] {
                                        (ev.outcome.as_str()) " (gen " (ev.generation) ") " (ev.disposition.as_str())
                                        @if stale { " — " strong { "stale" } }
                                        " at " (time(ev.received_at))
                                    }
                                }
                            } }
                        }
                    }
                }
            }
        }
    }
}

/// A cancellation's fee in words. A cancellation that lost to delivery
/// names no second amount: its fee is the delivery's charge (SPEC §2.7).
fn fee_words(t: &Task, c: &idem_core::model::Cancellation) -> Markup {
    match (c.status, c.fee, &t.delivery) {
        (CancelStatus::TooLate, Some(fee), Some(d)) if fee == d.charge => html! {
            "the delivery's charge above, not a second charge"
        },
        (_, Some(fee), _) => html! { (money(t, fee)) },
        (_, None, _) => html! { "none yet (settled when the attempt stops)" },
    }
}

/// Every provider transaction id attempt `a` reported
/// ([`verdict::attempt_txn_ids`]), each with how it was kept.
fn txn_ids(a: &Attempt) -> Markup {
    let ids = verdict::attempt_txn_ids(a);
    html! {
        @if ids.is_empty() { span.none { "none reported" } }
        @else { ul {
            @for r in &ids {
                li.txn-id data-txn-id=(r.id) data-kept-as=[r.kept_as.map(|d| d.as_str())] {
                    code { (r.id) }
                    @match r.kept_as {
                        None => {}
                        Some(Disposition::StaleGeneration) => { " — " strong.stale { "stale report" } " (generation " (r.generation) ")" }
                        Some(d) => { " — " strong.stale { (d.as_str().replace('_', " ")) } " (generation " (r.generation) ")" }
                    }
                }
            }
        } }
    }
}

/// The newest message of attempt `a`'s reports, or nothing.
fn attempt_message(a: &Attempt) -> Markup {
    match verdict::last_message(std::slice::from_ref(a)) {
        Some(m) => html! { q { (m.text) } },
        None => html! { "—" },
    }
}

/// An operator event's actor in words: "api key <id>" or "cli <user>".
pub(crate) fn actor_words(actor: &Actor) -> String {
    match actor {
        Actor::ApiKey(id) => format!("api key {id}"),
        Actor::Cli { user } => format!("cli {user}"),
    }
}

/// The actor of an operator's event (`data.actor`), or a dash.
fn actor(data: &EventData) -> String {
    let actor = match data {
        EventData::OperatorRetryNow(d) => &d.actor,
        EventData::OperatorCancel(d) => &d.actor,
        EventData::OperatorResolved(d) => &d.actor,
        EventData::OperatorRedriven(d) => &d.actor,
        _ => return "—".to_owned(),
    };
    actor_words(actor)
}

/// Event data as the JSON the API serves (`null` if it had none).
fn data_json(data: &EventData) -> Value {
    serde_json::to_value(data).unwrap_or_default()
}

/// A JSON object as a definition list (nested objects as nested lists, other
/// values as JSON text).
fn json_dl(v: &Value) -> Markup {
    match v {
        Value::Object(map) => html! {
            dl.json {
                @for (k, v) in map {
                    dt { (k) }
                    dd { (json_dl(v)) }
                }
            }
        },
        Value::String(s) => html! { (s) },
        other => html! { code { (other.to_string()) } },
    }
}

/// Which actions apply to a task in its state: `retry-now` (backing off),
/// `cancel` (not terminal, no cancellation yet), `resolve` (reconciling),
/// `redrive` (failed).
pub fn applicable(t: &Task) -> Vec<&'static str> {
    let mut out = Vec::new();
    if t.state == TaskState::RetryWait {
        out.push("retry-now");
    }
    if !t.state.is_terminal() && t.cancellation.is_none() {
        out.push("cancel");
    }
    if t.state == TaskState::Reconciling {
        out.push("resolve");
    }
    if t.state == TaskState::Failed {
        out.push("redrive");
    }
    out
}

/// The admin's action forms for `t`'s state.
fn actions(who: &SignedIn, t: &Task) -> Markup {
    let which = applicable(t);
    html! {
        section #actions aria-labelledby="actions-title" data-state=(t.state.as_str()) {
            h2 #actions-title { "Actions" }
            // The forms stay as loaded while live updates redraw the task
            // (a reason being typed survives them); console.js shows this
            // when the redrawn state is no longer the forms' state.
            p #actions-stale .notice role="status" hidden {
                "The task's state changed since this page loaded: "
                a href={ "/console/tasks/" (t.id) } { "reload" }
                " to see the actions that apply now."
            }
            @if which.is_empty() {
                p { "No action applies to a task in state " (t.state.as_str()) "." }
            }
            @for a in which {
                @let pre = format!("{a}-");
                form.action data-action=(a) method="post" action={ "/console/tasks/" (t.id) "/actions/" (a) } {
                    h3 { (action_title(a)) }
                    p.help { (action_help(a)) }
                    (csrf_input(who))
                    @if a == "resolve" {
                        fieldset {
                            legend { "What did the provider do?" }
                            span.check {
                                input type="radio" name="outcome" value="committed" id={ (pre) "committed" } required;
                                label for={ (pre) "committed" } { "committed (deliver the result, charged once)" }
                            }
                            span.check {
                                input type="radio" name="outcome" value="not_committed" id={ (pre) "not-committed" };
                                label for={ (pre) "not-committed" } { "not committed (the next execute attempt may start)" }
                            }
                        }
                        label for={ (pre) "result" } { "Result (JSON, for committed)" }
                        textarea name="result" id={ (pre) "result" } rows="3" {}
                        label for={ (pre) "external-txn-id" } { "External transaction id (optional, for committed)" }
                        input type="text" name="external_txn_id" id={ (pre) "external-txn-id" };
                    }
                    label for={ (pre) "reason" } { "Reason (recorded with your key in the task's history)" }
                    textarea name="reason" id={ (pre) "reason" } rows="2" required {}
                    span.check {
                        input type="checkbox" name="confirm" value="yes" id={ (pre) "confirm" } required;
                        label for={ (pre) "confirm" } { "I confirm " (action_confirm(a)) }
                    }
                    button type="submit" { (action_title(a)) }
                }
            }
        }
    }
}

fn action_title(a: &str) -> &'static str {
    match a {
        "retry-now" => "Retry now",
        "cancel" => "Cancel",
        "resolve" => "Resolve the reconciliation",
        _ => "Redrive",
    }
}

fn action_help(a: &str) -> &'static str {
    match a {
        "retry-now" => "Ends the backoff: the task can be claimed at once.",
        "cancel" => {
            "Requests cancellation: a queued task is cancelled at once; a running one when its attempt stops, with the contract's fee."
        }
        "resolve" => "Settles the unknown outcome by hand; a live reconcile attempt is fenced off.",
        _ => "Sends the failed task back to the queue with one more execute attempt.",
    }
}

fn action_confirm(a: &str) -> &'static str {
    match a {
        "retry-now" => "that this task should be retried now",
        "cancel" => "that this task should be cancelled",
        "resolve" => "that I checked the outcome with the provider",
        _ => "that this failed task should run again",
    }
}
