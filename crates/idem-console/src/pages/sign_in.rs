//! Sign-in with an API key and sign-out.
//!
//! `GET /console/sign-in[?next=…]` answers the form with a sign-in token in
//! a hidden field and the same token in the pre-session cookie
//! [`session::SIGN_IN_COOKIE`] (a random token, kept while it has the shape
//! of one so that several open forms agree).
//!
//! `POST /console/sign-in` (form: `sign_in_token`, `api_key`, optional
//! `next` and `replace`) is refused with 403 and the form again, changing
//! nothing (a live session stays alive), when:
//! - the browser marks it `Sec-Fetch-Site: cross-site` or `same-site`;
//! - it carries an `Origin` other than the console's own;
//! - its `sign_in_token` is not the pre-session cookie's.
//!
//! Then an active client or admin key gets a new session (cookie
//! [`session::COOKIE`]) and a 303 to `next` (a console path) or the overview;
//! any other key, or none, gets the form again with 401. A browser signed in
//! with another key is first asked ([`confirm`]): only a post carrying the
//! [`session::replace_token`] of its live session for the new key replaces
//! it. `POST /console/sign-out` (with the CSRF token) ends the session in the
//! store, clears the cookie and sends the browser to the sign-in form.

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{AppendHeaders, IntoResponse, Redirect, Response};
use idem_core::model::{ApiKey, Role};
use idem_store::ops::console::generate_session_token;
use maud::{Markup, html};

use crate::session::{self, Poster, SignedIn};
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

fn form(token: &str, next: Option<&str>, error: Option<&str>) -> Markup {
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
                    input type="hidden" name="sign_in_token" value=(token);
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

/// The form page with `status` and `error`, its token the pre-session
/// cookie's (a new one when the request has none), the cookie (re)set.
fn form_answer(
    st: &ConsoleState,
    headers: &HeaderMap,
    status: StatusCode,
    next: Option<&str>,
    error: Option<&str>,
) -> Response {
    let token = match session::sign_in_token_of(headers) {
        Some(t) => t,
        None => match generate_session_token() {
            Ok(t) => t,
            Err(e) => return ConsoleError::from(e).into_response(),
        },
    };
    let cookie = session::sign_in_cookie(&token, session::secure(st.config.secure_cookie, headers));
    (
        status,
        [(header::SET_COOKIE, cookie)],
        form(&token, next, error),
    )
        .into_response()
}

/// `GET /console/sign-in[?next=…]`: the form.
pub async fn form_page(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let pairs = form_pairs(q.unwrap_or_default().as_bytes());
    form_answer(&st, &headers, StatusCode::OK, field(&pairs, "next"), None)
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

/// Why a sign-in post is refused before its key is looked at (403), or
/// `None`.
fn forged(
    st: &ConsoleState,
    headers: &HeaderMap,
    pairs: &[(String, String)],
) -> Option<&'static str> {
    if session::from_elsewhere(headers) {
        return Some("A sign-in from another site or origin is refused; nothing changed.");
    }
    if session::foreign_origin(st.config.secure_cookie, headers) {
        return Some("A sign-in posted by a page of another origin is refused; nothing changed.");
    }
    let cookie = session::sign_in_token_of(headers);
    if !session::check_sign_in_token(cookie.as_deref(), field(pairs, "sign_in_token")) {
        return Some(
            "This sign-in form has no valid token (it is too old, or was not made by this console); nothing changed. Sign in again with this form.",
        );
    }
    None
}

/// The page that asks before a sign-in with `key` replaces `who`'s live
/// session of another key: both named, and a form that posts the sign-in
/// again with the session's [`session::replace_token`] for `key`.
fn confirm(who: &SignedIn, key: &ApiKey, plain: &str, token: &str, next: Option<&str>) -> Markup {
    page::page(
        "Replace your session?",
        None,
        html! {
            main #replace-session {
                h1 { "Replace your session?" }
                p { "This browser is signed in as tenant " strong #current-tenant { (who.session.tenant) }
                    " with " (who.session.role) " key " code #current-key { (who.key.id) } "." }
                p { "The sign-in would end that session and sign in as tenant " strong #new-tenant { (key.tenant) }
                    " with " (key.role) " key " code #new-key { (key.id) } "." }
                form #replace method="post" action="/console/sign-in" {
                    input type="hidden" name="sign_in_token" value=(token);
                    input type="hidden" name="api_key" value=(plain);
                    input type="hidden" name="replace" value=(session::replace_token(&who.token, key.id));
                    @if let Some(n) = next.and_then(safe_next) {
                        input type="hidden" name="next" value=(n);
                    }
                    button type="submit" { "Sign in as tenant " (key.tenant) }
                }
                p { a #keep href=(HOME) { "Stay signed in as tenant " (who.session.tenant) } }
            }
        },
    )
}

/// `POST /console/sign-in`.
pub async fn sign_in(State(st): State<ConsoleState>, headers: HeaderMap, body: Bytes) -> Response {
    let pairs = form_pairs(&body);
    let next = field(&pairs, "next").and_then(safe_next).map(str::to_owned);
    if let Some(why) = forged(&st, &headers, &pairs) {
        return form_answer(
            &st,
            &headers,
            StatusCode::FORBIDDEN,
            next.as_deref(),
            Some(why),
        );
    }
    let refused = |msg: &str| {
        form_answer(
            &st,
            &headers,
            StatusCode::UNAUTHORIZED,
            next.as_deref(),
            Some(msg),
        )
    };
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
    // A live session of another key is replaced only when its browser says
    // so: a page that got a post through the checks above still cannot
    // switch the browser to a tenant of its choosing.
    match session::lookup(&st, &headers).await {
        Ok(Some(who))
            if who.key.id != key.id
                && !session::check_replace(&who, key.id, field(&pairs, "replace")) =>
        {
            let token = field(&pairs, "sign_in_token").unwrap_or_default();
            return confirm(&who, &key, plain, token, next.as_deref()).into_response();
        }
        Ok(_) => {}
        Err(e) => return e.into_response(),
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
    let cookies = AppendHeaders([
        (
            header::SET_COOKIE,
            session::session_cookie(&token, ttl_ms / 1000, secure),
        ),
        (header::SET_COOKIE, session::cleared_sign_in_cookie(secure)),
    ]);
    let to = next.as_deref().unwrap_or(HOME);
    (cookies, Redirect::to(to)).into_response()
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
