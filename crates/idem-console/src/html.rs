//! The page layout and the helpers every page shares. Every value goes
//! through `maud`, which escapes it in text and attributes, and then through
//! [`crate::shown`], which shows its hidden characters as escapes; every URL
//! with a value in it is built with `form_urlencoded`.

use idem_core::model::{Task, Timestamp};
use maud::{DOCTYPE, Markup, html};
use uuid::Uuid;

use crate::session::SignedIn;

/// The static files' version, appended to their URLs so a new binary's
/// files are fetched despite their long cache.
pub const ASSET_VERSION: &str = env!("CARGO_PKG_VERSION");

/// A whole page: `<title>`, the header with its navigation (for a signed-in
/// `who`), and `main` (the page's `<main>` element and what follows it).
pub fn page(title: &str, who: Option<&SignedIn>, main: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · idem console" }
                link rel="stylesheet" href={ "/console/static/console.css?v=" (ASSET_VERSION) };
                script src={ "/console/static/console.js?v=" (ASSET_VERSION) } defer {}
            }
            body {
                header {
                    span.brand { "idem console" }
                    @if let Some(who) = who {
                        (nav(who))
                    }
                }
                (main)
            }
        }
    }
}

/// The signed-in header: links, tenant, role and the sign-out form.
fn nav(who: &SignedIn) -> Markup {
    html! {
        nav aria-label="Console" {
            ul {
                li { a href="/console/overview" { "Overview" } }
                li { a href="/console/tasks" { "Tasks" } }
            }
            p.who {
                "Tenant " span #tenant { (who.session.tenant) }
                " · role " span #role { (who.session.role) }
            }
            form #sign-out method="post" action="/console/sign-out" {
                (csrf_input(who))
                button type="submit" { "Sign out" }
            }
        }
    }
}

/// The hidden CSRF input every state-changing form carries.
pub fn csrf_input(who: &SignedIn) -> Markup {
    html! { input type="hidden" name="csrf" value=(who.csrf); }
}

/// An error page: its title and message (`p.error[role=alert]`).
pub fn error_page(title: &str, message: &str) -> Markup {
    page(
        title,
        None,
        html! {
            main #error {
                h1 { (title) }
                p.error role="alert" { (message) }
                p { a href="/console/overview" { "Back to the overview" } }
            }
        },
    )
}

/// The task page's path.
pub fn task_href(id: Uuid) -> String {
    format!("/console/tasks/{id}")
}

/// A search's path with `pairs` as its query.
pub fn search_href<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        q.append_pair(k, v);
    }
    let q = q.finish();
    if q.is_empty() {
        "/console/tasks".to_owned()
    } else {
        format!("/console/tasks?{q}")
    }
}

/// An instant as RFC 3339 in a `<time>` element.
pub fn time(t: Timestamp) -> Markup {
    let text = t.to_rfc3339();
    html! { time datetime=(text) { (text) } }
}

/// An optional instant, or a dash.
pub fn opt_time(t: Option<Timestamp>) -> Markup {
    match t {
        Some(t) => time(t),
        None => html! { "—" },
    }
}

/// A count with its noun, singular for one: `1 attempt`, `3 attempts`.
pub fn count<N: std::fmt::Display + PartialEq + From<u8>>(n: N, one: &str, many: &str) -> String {
    let noun = if n == N::from(1) { one } else { many };
    format!("{n} {noun}")
}

/// `minor` minor units in task `t`'s frozen currency, as
/// [`idem_core::money::Money`] writes it: `EUR 1.00`, `JPY 100`, `KWD
/// 1.000`, or `100 minor units` when the contract names no currency.
pub fn money(t: &Task, minor: i64) -> String {
    t.contract.money(minor).to_string()
}

/// A task's attempts as every page counts them, from the task alone (so the
/// search, the overview and the task page agree): every attempt created
/// (the API's `attempt_count`), then the execute attempts that started
/// against the execute limit (`max_attempts` plus redrives), e.g.
/// "3 attempts: 2 of 3 execute".
pub fn attempt_summary(t: &Task) -> String {
    let mut text = count(t.attempt_count, "attempt", "attempts");
    if t.attempt_count > 0 {
        text.push_str(&format!(
            ": {} of {} execute",
            t.control.execute_count,
            t.execute_limit()
        ));
    }
    text
}

/// A JSON document, pretty-printed for a `<pre>` ([`crate::shown::json`]).
pub fn pretty(v: &serde_json::Value) -> Markup {
    crate::shown::json(v)
}

/// A link to the task page, showing its idempotency key.
pub fn task_link(t: &Task) -> Markup {
    html! { a.task-link href=(task_href(t.id)) { (t.idempotency_key) } }
}

/// A task's state as a badge.
pub fn state_badge(t: &Task) -> Markup {
    let s = t.state.as_str();
    html! { span class={ "state state-" (s) } { (s) } }
}
