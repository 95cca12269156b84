//! `GET /console/tasks?…`: the search of `GET /v1/tasks` as a page. The
//! query takes exactly the API's parameters (`state` repeated or as a comma
//! list, `operation`, `created_after`, `created_before`,
//! `idempotency_key_prefix`, `external_txn_id`, `second_effect`, `limit`,
//! `cursor`), read by the API's own parser ([`idem_http::read_task_query`]),
//! so filters and errors are the API's; the form's empty fields are left out
//! first. The URL is the whole state of the page: it can be shared.
//!
//! Each result shows, besides its key, class and state, its attempts counted
//! as on the task page, its class's display fields (`[operations.X.display]`,
//! one column per name across the classes shown, in configuration order; a
//! class's `amount` and `currency` fields shown together as one amount
//! through [`idem_core::money`]) and its provider transaction ids: the
//! delivered one and each suspected second effect's, marked.

use axum::extract::{RawQuery, State};
use idem_core::config::Config;
use idem_core::model::{Task, TaskState};
use idem_store::ops::search::{DEFAULT_LIMIT, MAX_LIMIT};
use maud::{Markup, html};

use crate::html::{
    self as page, attempt_summary, count, search_href, state_badge, task_link, time,
};
use crate::session::Viewer;
use crate::{ConsoleError, ConsoleState};

/// The search's pairs of a raw query: decoded, empty values left out, each
/// comma-separated `state` split into one pair per state.
pub fn search_pairs(raw: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (k, v) in form_urlencoded::parse(raw.as_bytes()).into_owned() {
        if k == "state" {
            out.extend(
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| (k.clone(), s.to_owned())),
            );
        } else if !v.is_empty() {
            out.push((k, v));
        }
    }
    out
}

fn value<'a>(pairs: &'a [(String, String)], name: &str) -> &'a str {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map_or("", |(_, v)| v.as_str())
}

/// `GET /console/tasks`.
///
/// # Errors
/// 400 with the API's message for a bad filter (and nothing else on the
/// page); 403 for an operation class the key is not granted; 503 when the
/// store is unavailable.
pub async fn search(
    State(st): State<ConsoleState>,
    Viewer(who): Viewer,
    RawQuery(q): RawQuery,
) -> Result<Markup, ConsoleError> {
    let pairs = search_pairs(&q.unwrap_or_default());
    let store = who.store(&st);
    let key = store.cursor_key().await?;
    let query = idem_http::read_task_query(&pairs, &key, who.tenant())?;
    if let Some(op) = &query.operation {
        if !st.app.config.operations.contains_key(op) {
            let classes: Vec<&str> = st
                .app
                .config
                .operations
                .keys()
                .map(String::as_str)
                .collect();
            return Err(ConsoleError::BadRequest(format!(
                "unknown operation `{}`; configured classes: {}",
                idem_http::problem::shorten(op),
                classes.join(", ")
            )));
        }
        if !who.key.grants(op) {
            return Err(ConsoleError::Forbidden(format!(
                "this API key is not granted operation class `{op}`"
            )));
        }
    }
    let states = query.states.clone();
    let page_of = store.search_tasks(who.tenant(), query).await?;
    let next = page_of.next_cursor.map(|c| {
        let encoded = key.seal(who.tenant(), &c);
        let mut kept: Vec<(&str, &str)> = pairs
            .iter()
            .filter(|(k, _)| k != "cursor")
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        kept.push(("cursor", &encoded));
        search_href(kept)
    });
    let classes: Vec<&str> = who.visible_classes(&st).collect();
    let columns = display_columns(&st.app.config, &page_of.tasks);
    let main = html! {
        main #search-page {
            h1 { "Tasks" }
            form #search method="get" action="/console/tasks" {
                fieldset.states {
                    legend { "State" }
                    @for s in TaskState::ALL {
                        @let id = format!("state-{}", s.as_str());
                        span.check {
                            input type="checkbox" name="state" id=(id) value=(s.as_str()) checked[states.contains(s)];
                            label for=(id) { (s.as_str()) }
                        }
                    }
                }
                div.fields {
                    div {
                        label for="operation" { "Operation class" }
                        select #operation name="operation" {
                            option value="" selected[value(&pairs, "operation").is_empty()] { "any" }
                            @for c in &classes {
                                option value=(c) selected[value(&pairs, "operation") == *c] { (c) }
                            }
                        }
                    }
                    div {
                        label for="idempotency_key_prefix" { "Idempotency key prefix" }
                        input #idempotency_key_prefix type="text" name="idempotency_key_prefix" value=(value(&pairs, "idempotency_key_prefix"));
                    }
                    div {
                        label for="external_txn_id" { "External transaction id" }
                        input #external_txn_id type="text" name="external_txn_id" value=(value(&pairs, "external_txn_id"));
                    }
                    div {
                        label for="second_effect" { "Second effects" }
                        select #second_effect name="second_effect" {
                            option value="" selected[value(&pairs, "second_effect").is_empty()] { "any" }
                            option value="suspected" selected[value(&pairs, "second_effect") == "suspected"] { "suspected" }
                            option value="unacknowledged" selected[value(&pairs, "second_effect") == "unacknowledged"] { "suspected, not acknowledged" }
                        }
                    }
                    div {
                        label for="created_after" { "Created after (RFC 3339)" }
                        input #created_after type="text" name="created_after" placeholder="2026-12-01T00:00:00Z" value=(value(&pairs, "created_after"));
                    }
                    div {
                        label for="created_before" { "Created before (RFC 3339)" }
                        input #created_before type="text" name="created_before" placeholder="2026-12-02T00:00:00Z" value=(value(&pairs, "created_before"));
                    }
                    div {
                        label for="limit" { "Per page" }
                        input #limit type="number" name="limit" min="1" max=(MAX_LIMIT) placeholder=(DEFAULT_LIMIT) value=(value(&pairs, "limit"));
                    }
                }
                button type="submit" { "Search" }
            }
            table #results {
                caption { (count(page_of.tasks.len(), "task", "tasks")) " on this page, newest first" }
                thead {
                    tr {
                        th scope="col" { "Idempotency key" }
                        th scope="col" { "Operation" }
                        th scope="col" { "State" }
                        th scope="col" { "Attempts" }
                        @for c in &columns {
                            th scope="col" data-field=(c) { (c) }
                        }
                        th scope="col" { "Transaction ids" }
                        th scope="col" { "Created" }
                        th scope="col" { "Updated" }
                    }
                }
                tbody {
                    @for t in &page_of.tasks {
                        tr data-task-id=(t.id) {
                            td.key { (task_link(t)) }
                            td.operation { (t.operation) }
                            td.state data-state=(t.state.as_str()) { (state_badge(t)) }
                            td.attempts { (attempt_summary(t)) }
                            @let shown = display_values(&st.app.config, t);
                            @for c in &columns {
                                td.display data-field=(c) {
                                    @if let Some((_, v)) = shown.iter().find(|(n, _)| n == c) { (v) }
                                }
                            }
                            td.txns { (txn_ids(t)) }
                            td.created { (time(t.created_at)) }
                            td.updated { (time(t.updated_at)) }
                        }
                    }
                }
            }
            @if let Some(href) = &next {
                nav.pages aria-label="Pages" {
                    a rel="next" href=(href) { "Next page" }
                }
            }
        }
    };
    Ok(page::page("Tasks", Some(&who), main))
}

/// The display names of the classes of `tasks`, in configuration order
/// (a class's `currency` is shown within its `amount` when it has both:
/// [`idem_core::config::DisplayFields::columns`]).
fn display_columns(config: &Config, tasks: &[Task]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (op, class) in &config.operations {
        if !tasks.iter().any(|t| &t.operation == op) {
            continue;
        }
        for name in class.display.columns() {
            if !out.iter().any(|c| c == name) {
                out.push(name.to_owned());
            }
        }
    }
    out
}

/// Task `t`'s display fields as text, by name ([`idem_core::config::DisplayFields::shown`]:
/// `amount` with `currency` as one amount, `EUR 12.50`); fields its params
/// lack are left out.
fn display_values(config: &Config, t: &Task) -> Vec<(String, String)> {
    let Some(class) = config.operations.get(&t.operation) else {
        return Vec::new();
    };
    class
        .display
        .shown(&t.params)
        .into_iter()
        .filter_map(|(name, v)| v.map(|v| (name.to_owned(), v)))
        .collect()
}

/// Task `t`'s provider transaction ids: the delivered one, then each
/// suspected second effect's (marked, in red while not acknowledged).
fn txn_ids(t: &Task) -> Markup {
    let delivered = t
        .delivery
        .as_ref()
        .and_then(|d| d.external_txn_id.as_deref());
    html! {
        @if let Some(id) = delivered {
            span.txn-id.delivered data-txn-id=(id) { code { (id) } " delivered" }
        }
        @for e in &t.second_effects {
            " "
            span class=(if e.acknowledgment.is_none() { "txn-id suspected" } else { "txn-id" })
                data-txn-id=[e.external_txn_id.as_deref()] {
                @match &e.external_txn_id {
                    Some(id) => code { (id) },
                    None => "(no id)",
                }
                @if e.acknowledgment.is_none() { " " strong.stale { "suspected second effect" } }
                @else { " second effect, acknowledged" }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_fields_are_left_out_and_state_lists_split() {
        let got = search_pairs(
            "state=queued,failed&state=running&operation=&limit=&idempotency_key_prefix=a%2Cb",
        );
        let want: Vec<(String, String)> = [
            ("state", "queued"),
            ("state", "failed"),
            ("state", "running"),
            ("idempotency_key_prefix", "a,b"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        assert_eq!(got, want);
    }
}
