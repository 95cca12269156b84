//! Console sessions as the browser sees them: the `idem_session` cookie, the
//! extractors that find the signed-in key behind it, and CSRF tokens.
//!
//! - The cookie holds the session token ([`idem_store::ops::console`]):
//!   `HttpOnly; SameSite=Strict; Path=/console; Max-Age=<ttl s>`, and
//!   `Secure` when the console is reached over TLS.
//! - A request's session is looked up in the store on every request (the
//!   lookup joins the API key, so sign-out and revocation take effect at
//!   once, on every instance).
//! - Without a session, a page ([`Viewer`]) redirects to the sign-in form
//!   (303, with `next` = the page), a post ([`Poster`]) is 403 and a live
//!   stream or fragment ([`Watcher`]) is 401.
//! - The CSRF token of a session is `base64url(SHA-256("idem-console-csrf\0"
//!   ‖ token))`: fixed for the session, different for every other session,
//!   and not the token itself (a page that shows it gives the cookie away to
//!   nobody). Posts compare it in constant time ([`check_csrf`]).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine;
use idem_core::model::ApiKey;
use idem_store::Store;
use idem_store::ops::console::ConsoleSession;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{ConsoleError, ConsoleState};

/// The session cookie's name.
pub const COOKIE: &str = "idem_session";

/// The label CSRF tokens are derived under.
const CSRF_LABEL: &[u8] = b"idem-console-csrf\0";

/// A signed-in request: its session, the key behind it, the token (from the
/// cookie) and the session's CSRF token.
#[derive(Clone)]
pub struct SignedIn {
    /// The session as stored.
    pub session: ConsoleSession,
    /// The signed-in API key (active: the lookup refuses a revoked one).
    pub key: ApiKey,
    /// The session token from the cookie.
    pub token: String,
    /// The session's CSRF token ([`csrf_token`]).
    pub csrf: String,
}

impl std::fmt::Debug for SignedIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignedIn")
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl SignedIn {
    /// The store acting for the signed-in key: tasks of classes the key is
    /// not granted are not found.
    pub fn store(&self, st: &ConsoleState) -> Store {
        st.app.store.granted(self.key.operations.clone())
    }

    /// The tenant.
    pub fn tenant(&self) -> &str {
        &self.session.tenant
    }

    /// The configured operation classes the key may see, in name order.
    pub fn visible_classes<'a>(&'a self, st: &'a ConsoleState) -> impl Iterator<Item = &'a str> {
        st.app
            .config
            .operations
            .keys()
            .map(String::as_str)
            .filter(|c| self.key.grants(c))
    }
}

/// The CSRF token of the session whose token is `token`.
pub fn csrf_token(token: &str) -> String {
    let mut h = Sha256::new();
    h.update(CSRF_LABEL);
    h.update(token.as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(h.finalize())
}

/// Whether `given` is `who`'s CSRF token (constant-time in the token).
///
/// # Errors
/// [`ConsoleError::Forbidden`] when it is missing or another.
pub fn check_csrf(who: &SignedIn, given: Option<&str>) -> Result<(), ConsoleError> {
    let ok = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(who.csrf.as_bytes())));
    if ok {
        Ok(())
    } else {
        Err(ConsoleError::Forbidden(
            "the form carries no CSRF token of this session; nothing was changed (reload the page to get a form with the token)"
                .into(),
        ))
    }
}

/// The session token in the request's cookies, if any.
pub fn token_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == COOKIE && !c.value().is_empty())
        .map(|c| c.value().to_owned())
}

/// The `Set-Cookie` value that stores `token` for `max_age_s` seconds.
pub fn session_cookie(token: &str, max_age_s: i64, secure: bool) -> String {
    cookie::Cookie::build((COOKIE, token.to_owned()))
        .http_only(true)
        .same_site(cookie::SameSite::Strict)
        .path("/console")
        .max_age(cookie::time::Duration::seconds(max_age_s))
        .secure(secure)
        .build()
        .to_string()
}

/// The `Set-Cookie` value that removes the session cookie.
pub fn cleared_cookie(secure: bool) -> String {
    session_cookie("", 0, secure)
}

/// The signed-in key behind the request's cookie, if its session is active.
///
/// # Errors
/// [`ConsoleError::Unavailable`] and the like when the store fails.
pub async fn lookup(
    st: &ConsoleState,
    headers: &HeaderMap,
) -> Result<Option<SignedIn>, ConsoleError> {
    let Some(token) = token_of(headers) else {
        return Ok(None);
    };
    Ok(st
        .app
        .store
        .console_session(&token)
        .await?
        .map(|(session, key)| SignedIn {
            csrf: csrf_token(&token),
            session,
            key,
            token,
        }))
}

/// The signed-in key of a page request; without a session, a 303 to the
/// sign-in form with `next` = this page.
#[derive(Debug, Clone)]
pub struct Viewer(pub SignedIn);

/// The signed-in key of a post; without a session, 403 and nothing changes.
#[derive(Debug, Clone)]
pub struct Poster(pub SignedIn);

/// The signed-in key of a live stream or fragment; without a session, 401.
#[derive(Debug, Clone)]
pub struct Watcher(pub SignedIn);

/// Where the sign-in form sends a signed-out visitor of `parts`' page back to.
pub fn sign_in_redirect(parts: &Parts) -> Response {
    // The console's router is nested under `/console`: the request's own URI
    // has the prefix stripped, the original one has it.
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |o| &o.0);
    let next = uri
        .path_and_query()
        .map_or("/console/overview", |p| p.as_str());
    let q = form_urlencoded::Serializer::new(String::new())
        .append_pair("next", next)
        .finish();
    Redirect::to(&format!("/console/sign-in?{q}")).into_response()
}

impl FromRequestParts<ConsoleState> for Viewer {
    type Rejection = Response;
    async fn from_request_parts(parts: &mut Parts, st: &ConsoleState) -> Result<Self, Response> {
        match lookup(st, &parts.headers).await {
            Ok(Some(who)) => Ok(Viewer(who)),
            Ok(None) => Err(sign_in_redirect(parts)),
            Err(e) => Err(e.into_response()),
        }
    }
}

impl FromRequestParts<ConsoleState> for Poster {
    type Rejection = Response;
    async fn from_request_parts(parts: &mut Parts, st: &ConsoleState) -> Result<Self, Response> {
        if cross_site(&parts.headers) {
            return Err(
                ConsoleError::Forbidden("a cross-site form post is refused".into()).into_response(),
            );
        }
        match lookup(st, &parts.headers).await {
            Ok(Some(who)) => Ok(Poster(who)),
            Ok(None) => Err(ConsoleError::Forbidden(
                "not signed in (the session ended or ran out, or its key was revoked); nothing changed"
                    .into(),
            )
            .into_response()),
            Err(e) => Err(e.into_response()),
        }
    }
}

impl FromRequestParts<ConsoleState> for Watcher {
    type Rejection = Response;
    async fn from_request_parts(parts: &mut Parts, st: &ConsoleState) -> Result<Self, Response> {
        match lookup(st, &parts.headers).await {
            Ok(Some(who)) => Ok(Watcher(who)),
            Ok(None) => Err((StatusCode::UNAUTHORIZED, "not signed in").into_response()),
            Err(e) => Err(e.into_response()),
        }
    }
}

/// Whether the session cookie must be `Secure`: when configured so
/// (`--console-secure-cookie`), or when the proxy in front of `idem serve`
/// says the browser reached it over TLS (`X-Forwarded-Proto: https`, the
/// de-facto standard header; a forged one only makes the cookie stricter).
pub fn secure(configured: bool, headers: &HeaderMap) -> bool {
    configured
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(',').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("https"))
}

/// Whether the browser says the request comes from another site
/// (`Sec-Fetch-Site: cross-site`): refused on every post, on top of the
/// `SameSite=Strict` cookie and the CSRF token.
pub fn cross_site(headers: &HeaderMap) -> bool {
    headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csrf_tokens_differ_per_session_and_are_not_the_token() {
        let a = csrf_token("token-a");
        assert_eq!(a, csrf_token("token-a"));
        assert_ne!(a, csrf_token("token-b"));
        assert_ne!(a, "token-a");
        assert_eq!(a.len(), 43);
    }

    #[test]
    fn the_cookie_is_http_only_strict_and_scoped() {
        let c = session_cookie("abc", 60, false);
        for part in [
            "idem_session=abc",
            "HttpOnly",
            "SameSite=Strict",
            "Path=/console",
            "Max-Age=60",
        ] {
            assert!(c.contains(part), "{c} lacks {part}");
        }
        assert!(!c.contains("Secure"));
        assert!(session_cookie("abc", 60, true).contains("Secure"));
    }

    #[test]
    fn the_token_is_read_from_any_cookie_header() {
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, "a=1; idem_session=tok".parse().unwrap());
        assert_eq!(token_of(&h).as_deref(), Some("tok"));
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, "idem_session=".parse().unwrap());
        assert_eq!(token_of(&h), None);
    }
}
