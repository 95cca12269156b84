//! `GET /console/overview[?reconciling_after=<seconds>]`: the tenant's task
//! counts by operation class and state (each a link to the search filtered
//! by both), and the tasks that need a person: `reconciling` unchanged for
//! longer than the threshold, `failed` in the last 24 h, cancellations still
//! requested, [`LIST`] of each at most; and its queues: per class the tasks
//! a claim could lease now with their longest, median and 99th-percentile
//! waits.

use std::collections::{BTreeSet, HashMap};

use axum::extract::{RawQuery, State};
use idem_core::model::{Task, TaskState};
use idem_store::ops::console::OverviewQuery;
use maud::{Markup, html};

use super::sign_in::{field, form_pairs};
use crate::html::{self as page, attempt_summary, search_href, state_badge, task_link, time};
use crate::session::Viewer;
use crate::{ConsoleError, ConsoleState};

/// Most tasks each "needs attention" list shows.
pub const LIST: i64 = 20;

/// The window of the failed-tasks list, ms (24 h).
pub const FAILED_WITHIN_MS: i64 = 24 * 3_600_000;

/// `GET /console/overview`.
///
/// # Errors
/// 400 for a `reconciling_after` that is not a whole number of seconds; 503
/// when the store is unavailable.
pub async fn overview(
    State(st): State<ConsoleState>,
    Viewer(who): Viewer,
    RawQuery(q): RawQuery,
) -> Result<Markup, ConsoleError> {
    let pairs = form_pairs(q.unwrap_or_default().as_bytes());
    let reconciling_after_s = match field(&pairs, "reconciling_after").filter(|v| !v.is_empty()) {
        None => st.config.reconciling_after.as_secs(),
        Some(v) => v.parse::<u64>().map_err(|_| {
            ConsoleError::BadRequest("`reconciling_after` must be a whole number of seconds".into())
        })?,
    };
    let query = OverviewQuery {
        reconciling_for_ms: i64::try_from(reconciling_after_s.saturating_mul(1000))
            .unwrap_or(i64::MAX),
        failed_within_ms: FAILED_WITHIN_MS,
        limit: LIST,
    };
    let o = who.store(&st).task_overview(who.tenant(), query).await?;
    // Rows: the configured classes the key may see, and any class with tasks.
    let mut classes: BTreeSet<&str> = who.visible_classes(&st).collect();
    let mut counts: HashMap<(&str, TaskState), i64> = HashMap::new();
    for c in &o.counts {
        classes.insert(&c.operation);
        counts.insert((&c.operation, c.state), c.count);
    }
    let main = html! {
        main #overview {
            h1 { "Overview" }
            p { "Tasks of tenant " strong { (who.tenant()) } " as of " (time(o.now)) "." }
            table #by-state {
                caption { "Tasks by operation class and state" }
                thead {
                    tr {
                        th scope="col" { "Operation class" }
                        @for s in TaskState::ALL {
                            th scope="col" { (s.as_str()) }
                        }
                        th scope="col" { "All" }
                    }
                }
                tbody {
                    @for class in &classes {
                        tr data-operation=(class) {
                            th scope="row" {
                                a href=(search_href([("operation", *class)])) { (class) }
                            }
                            @for s in TaskState::ALL {
                                @let n = counts.get(&(*class, *s)).copied().unwrap_or(0);
                                td data-state=(s.as_str()) {
                                    a href=(search_href([("operation", *class), ("state", s.as_str())]))
                                        aria-label={ (n) " " (s.as_str()) " " (class) " tasks" } { (n) }
                                }
                            }
                            td.total {
                                (TaskState::ALL.iter().map(|s| counts.get(&(*class, *s)).copied().unwrap_or(0)).sum::<i64>())
                            }
                        }
                    }
                }
            }
            table #queues {
                caption { "Queues: tasks a claim could lease now, and how long they have waited" }
                thead {
                    tr {
                        th scope="col" { "Operation class" }
                        th scope="col" { "Waiting" }
                        th scope="col" { "Longest wait" }
                        th scope="col" { "Median wait" }
                        th scope="col" { "99th percentile" }
                    }
                }
                tbody {
                    @if o.queues.is_empty() {
                        tr { td.empty colspan="5" { "Nothing is waiting." } }
                    }
                    @for q in &o.queues {
                        tr data-operation=(q.operation) {
                            th scope="row" {
                                a href=(search_href([("operation", q.operation.as_str()), ("state", "queued")])) { (q.operation) }
                            }
                            td.depth { (q.depth) }
                            td.wait { (wait_words(q.oldest_wait_ms)) }
                            td.wait { (wait_words(q.wait_p50_ms)) }
                            td.wait { (wait_words(q.wait_p99_ms)) }
                        }
                    }
                }
            }
            section #needs-attention aria-labelledby="needs-attention-title" {
                h2 #needs-attention-title { "Needs attention" }
                (list(
                    "reconciling-long",
                    &format!("Reconciling, unchanged for more than {}", duration_words(reconciling_after_s)),
                    "Nothing has been reconciling that long.",
                    &o.reconciling_long,
                    &search_href([("state", "reconciling")]),
                ))
                (list(
                    "failed-recent",
                    "Failed in the last 24 hours",
                    "Nothing failed in the last 24 hours.",
                    &o.failed_recent,
                    &search_href([("state", "failed")]),
                ))
                (list(
                    "cancel-requested",
                    "Cancellation requested, not yet confirmed",
                    "No cancellation is waiting.",
                    &o.cancel_requested,
                    &search_href([("state", "queued"), ("state", "running"), ("state", "retry_wait"), ("state", "reconciling")]),
                ))
            }
        }
    };
    Ok(page::page("Overview", Some(&who), main))
}

/// One "needs attention" list: `div#id` with a heading, its tasks (links)
/// and a link to the search that holds them all.
fn list(id: &str, title: &str, empty: &str, tasks: &[Task], all: &str) -> Markup {
    let heading = format!("{id}-title");
    html! {
        div.attention id=(id) role="region" aria-labelledby=(heading) {
            h3 id=(heading) { (title) " (" (tasks.len()) ")" }
            @if tasks.is_empty() {
                p.empty { (empty) }
            } @else {
                ul {
                    @for t in tasks {
                        li {
                            (task_link(t)) " "
                            span.operation { (t.operation) } " "
                            (state_badge(t)) " · " span.attempts { (attempt_summary(t)) }
                            " · changed " (time(t.updated_at))
                        }
                    }
                }
            }
            p { a.all href=(all) { "all" } }
        }
    }
}

/// A wait of `ms` in words: "850 ms", "12.5 s", "4 min 10 s", "3 h 5 min".
fn wait_words(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{}.{} s", ms / 1_000, ms % 1_000 / 100)
    } else if ms < 3_600_000 {
        format!("{} min {} s", ms / 60_000, ms % 60_000 / 1_000)
    } else {
        format!("{} h {} min", ms / 3_600_000, ms % 3_600_000 / 60_000)
    }
}

/// `s` seconds in words: "15 min", "2 h", "90 s".
fn duration_words(s: u64) -> String {
    if s >= 3600 && s.is_multiple_of(3600) {
        format!("{} h", s / 3600)
    } else if s >= 60 && s.is_multiple_of(60) {
        format!("{} min", s / 60)
    } else {
        format!("{s} s")
    }
}

#[cfg(test)]
mod tests {
    use super::wait_words;

    #[test]
    fn waits_read_in_the_unit_that_fits() {
        assert_eq!(wait_words(0), "0 ms");
        assert_eq!(wait_words(850), "850 ms");
        assert_eq!(wait_words(12_550), "12.5 s");
        assert_eq!(wait_words(250_000), "4 min 10 s");
        assert_eq!(wait_words(11_100_000), "3 h 5 min");
        assert_eq!(wait_words(-5), "0 ms");
    }
}
