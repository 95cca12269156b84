//! Sign-in with an API key and sign-out.
//!
//! `POST /console/sign-in` (form: `api_key`, optional `next`): an active
//! client or admin key gets a new session (cookie [`session::COOKIE`]) and a
//! 303 to `next` (a console path) or the overview; any other key, or none,
//! gets the form again with 401. `POST /console/sign-out` (with the CSRF
//! token) ends the session in the store, clears the cookie and sends the
//! browser to the sign-in form.

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use idem_core::model::Role;
use maud::{Markup, html};

use crate::session::{self, Poster};
use crate::{ConsoleError, ConsoleState, html as page};

/// Where a signed-in browser goes when the form names no `next`.
const HOME: &str = "/console/overview";

/// `next` when it is a console path (visible ASCII, no scheme, host or
/// backslash, no `.` or `..` path segment, plain or percent-encoded, that a
/// browser would resolve outside `/console`), else `None`: a sign-in never
/// sends the browser elsewhere.
pub fn safe_next(next: &str) -> Option<&str> {
    let console =
        next == "/console" || next.starts_with("/console/") || next.starts_with("/console?");
    let plain =
        next.bytes().all(|b| b.is_ascii_graphic()) && !next.contains('\\') && !next.contains("//");
    let path = next.split(['?', '#']).next().unwrap_or_default();
    let dots = path.split('/').any(|seg| {
        let seg = seg.to_ascii_lowercase().replace("%2e", ".");
        seg == "." || seg == ".."
    });
    (console && plain && !dots).then_some(next)
}

fn form(next: Option<&str>, error: Option<&str>) -> Markup {
    page::page(
        "Sign in",
        None,
        html! {
            main #sign-in-page {
                h1 { "Sign in" }
                p { "Sign in with an API key of the client or admin role. The key is checked and then forgotten: the console keeps a session, never the key." }
                @if let Some(e) = error {
                    p.error role="alert" { (e) }
                }
                form #sign-in method="post" action="/console/sign-in" {
                    label for="api_key" { "API key" }
                    input #api_key type="password" name="api_key" autocomplete="off" required;
                    @if let Some(n) = next.and_then(safe_next) {
                        input type="hidden" name="next" value=(n);
                    }
                    button type="submit" { "Sign in" }
                }
            }
        },
    )
}

/// `GET /console/sign-in[?next=…]`: the form.
pub async fn form_page(RawQuery(q): RawQuery) -> Markup {
    let pairs = form_pairs(q.unwrap_or_default().as_bytes());
    form(field(&pairs, "next"), None)
}

/// The pairs of a form body.
pub(crate) fn form_pairs(body: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(body).into_owned().collect()
}

/// The first value of `name` in `pairs`.
pub(crate) fn field<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// `POST /console/sign-in`.
pub async fn sign_in(State(st): State<ConsoleState>, headers: HeaderMap, body: Bytes) -> Response {
    if session::cross_site(&headers) {
        return ConsoleError::Forbidden("a cross-site sign-in is refused".into()).into_response();
    }
    let pairs = form_pairs(&body);
    let next = field(&pairs, "next").and_then(safe_next).map(str::to_owned);
    let refused =
        |msg: &str| (StatusCode::UNAUTHORIZED, form(next.as_deref(), Some(msg))).into_response();
    let plain = field(&pairs, "api_key").unwrap_or_default().trim();
    if plain.is_empty() {
        return refused("Enter an API key.");
    }
    let key = match st.app.store.authenticate(plain).await {
        Ok(Some(k)) if k.revoked_at.is_none() => k,
        Ok(_) => return refused("This API key is not valid (unknown or revoked)."),
        Err(e) => return ConsoleError::from(e).into_response(),
    };
    if key.role == Role::Executor {
        return refused(
            "An executor key cannot sign in to the console: use a client or admin key.",
        );
    }
    // One browser, one session: the session named by a cookie sent with a
    // sign-in ends, so a copy of its token stops working.
    if let Some(old) = session::token_of(&headers)
        && let Err(e) = st.app.store.end_console_session(&old).await
    {
        return ConsoleError::from(e).into_response();
    }
    let ttl_ms = i64::try_from(st.config.session_ttl.as_millis()).unwrap_or(i64::MAX);
    let made = match st.app.store.create_console_session(key.id, ttl_ms).await {
        Ok(Some(made)) => made,
        Ok(None) => return refused("This API key is not valid (unknown or revoked)."),
        Err(e) => return ConsoleError::from(e).into_response(),
    };
    let (_, token) = made;
    let secure = session::secure(st.config.secure_cookie, &headers);
    let cookie = session::session_cookie(&token, ttl_ms / 1000, secure);
    let to = next.as_deref().unwrap_or(HOME);
    ([(header::SET_COOKIE, cookie)], Redirect::to(to)).into_response()
}

/// `POST /console/sign-out` (form: `csrf`).
pub async fn sign_out(
    State(st): State<ConsoleState>,
    Poster(who): Poster,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let pairs = form_pairs(&body);
    if let Err(e) = session::check_csrf(&who, field(&pairs, "csrf")) {
        return e.into_response();
    }
    if let Err(e) = st.app.store.end_console_session(&who.token).await {
        return ConsoleError::from(e).into_response();
    }
    (
        [(
            header::SET_COOKIE,
            session::cleared_cookie(session::secure(st.config.secure_cookie, &headers)),
        )],
        Redirect::to("/console/sign-in"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_is_a_console_path_only() {
        for ok in [
            "/console",
            "/console/tasks?state=failed",
            "/console/tasks/abc",
            "/console/tasks?idempotency_key_prefix=..",
        ] {
            assert_eq!(safe_next(ok), Some(ok));
        }
        for bad in [
            "https://evil.example/",
            "//evil.example/console",
            "/console//evil",
            "/consolex",
            "/console/\\evil",
            "javascript:alert(1)",
            "/console/tasks?q=a b",
            "/console/../v1/tasks",
            "/console/%2E%2e/x",
            "/console/.",
            "",
        ] {
            assert_eq!(safe_next(bad), None, "{bad}");
        }
    }
}
