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
//! - Sign-in ([`crate::pages::sign_in`]) is guarded before any session
//!   exists: the form carries a random token that must equal the one in the
//!   pre-session cookie [`SIGN_IN_COOKIE`] ([`check_sign_in_token`]), a post
//!   whose `Origin` is not the console's own is refused ([`foreign_origin`]),
//!   and so is one the browser marks `Sec-Fetch-Site: cross-site` or
//!   `same-site` ([`from_elsewhere`]). Replacing a live session of another
//!   key needs a confirmation carrying [`replace_token`].

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

/// The pre-session cookie's name: it holds the sign-in form's token.
pub const SIGN_IN_COOKIE: &str = "idem_sign_in";

/// How long a sign-in form's token lasts, seconds (an older form is refused
/// with a fresh one).
pub const SIGN_IN_TTL_S: i64 = 3600;

/// The label a replace token is derived under.
const REPLACE_LABEL: &[u8] = b"idem-console-replace\0";

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

/// The value of cookie `name` in the request's cookies, if any and not empty.
fn cookie_of(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == name && !c.value().is_empty())
        .map(|c| c.value().to_owned())
}

/// The session token in the request's cookies, if any.
pub fn token_of(headers: &HeaderMap) -> Option<String> {
    cookie_of(headers, COOKIE)
}

/// A console cookie: `HttpOnly; SameSite=Strict; Path=/console;
/// Max-Age=<max_age_s>`, `Secure` when `secure`.
fn console_cookie(name: &'static str, value: &str, max_age_s: i64, secure: bool) -> String {
    cookie::Cookie::build((name, value.to_owned()))
        .http_only(true)
        .same_site(cookie::SameSite::Strict)
        .path("/console")
        .max_age(cookie::time::Duration::seconds(max_age_s))
        .secure(secure)
        .build()
        .to_string()
}

/// The `Set-Cookie` value that stores `token` for `max_age_s` seconds.
pub fn session_cookie(token: &str, max_age_s: i64, secure: bool) -> String {
    console_cookie(COOKIE, token, max_age_s, secure)
}

/// The sign-in form's token in the pre-session cookie, if it has the shape
/// of one (a session token's: 43 base64url characters).
pub fn sign_in_token_of(headers: &HeaderMap) -> Option<String> {
    cookie_of(headers, SIGN_IN_COOKIE).filter(|t| {
        t.len() == 43
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

/// The `Set-Cookie` value of the pre-session cookie holding `token` for
/// [`SIGN_IN_TTL_S`] (with the session cookie's attributes).
pub fn sign_in_cookie(token: &str, secure: bool) -> String {
    console_cookie(SIGN_IN_COOKIE, token, SIGN_IN_TTL_S, secure)
}

/// The `Set-Cookie` value that removes the pre-session cookie (a sign-in
/// used it up).
pub fn cleared_sign_in_cookie(secure: bool) -> String {
    console_cookie(SIGN_IN_COOKIE, "", 0, secure)
}

/// Whether the sign-in form's token `given` equals the pre-session cookie's
/// `cookie` (both present; constant-time in the token).
pub fn check_sign_in_token(cookie: Option<&str>, given: Option<&str>) -> bool {
    match (cookie, given) {
        (Some(c), Some(g)) => bool::from(g.as_bytes().ct_eq(c.as_bytes())),
        _ => false,
    }
}

/// The token that confirms replacing the session whose token is
/// `session_token` by a session of key `new_key`:
/// `base64url(SHA-256("idem-console-replace\0" ‖ token ‖ "\0" ‖ key id))`.
/// Only the browser holding the session can have it, and it confirms that
/// key only.
pub fn replace_token(session_token: &str, new_key: uuid::Uuid) -> String {
    let mut h = Sha256::new();
    h.update(REPLACE_LABEL);
    h.update(session_token.as_bytes());
    h.update(b"\0");
    h.update(new_key.to_string().as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(h.finalize())
}

/// Whether `given` is the replace token of `who`'s session for `new_key`
/// (constant-time).
pub fn check_replace(who: &SignedIn, new_key: uuid::Uuid, given: Option<&str>) -> bool {
    let want = replace_token(&who.token, new_key);
    given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(want.as_bytes())))
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

/// The console's own origin as the browser sees it: `https` when the
/// session cookie is `Secure` ([`secure`]: configured, or `X-Forwarded-Proto:
/// https`), else `http`; the host and port of `X-Forwarded-Host` (first
/// value) when a proxy sends one, else of `Host`. `None` without a host.
fn own_origin(configured_secure: bool, headers: &HeaderMap) -> Option<(&'static str, String)> {
    let scheme = if secure(configured_secure, headers) {
        "https"
    } else {
        "http"
    };
    let host = headers
        .get("x-forwarded-host")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .or_else(|| headers.get(header::HOST).and_then(|v| v.to_str().ok()))?;
    Some((scheme, host.trim().to_owned()))
}

/// `scheme`, lower-case host and port (the scheme's default when none) of an
/// origin.
fn origin_parts(scheme: &str, authority: &str) -> Option<(String, String, u16)> {
    let a: axum::http::uri::Authority = authority.parse().ok()?;
    let scheme = scheme.to_ascii_lowercase();
    let port = match (a.port_u16(), scheme.as_str()) {
        (Some(p), _) => p,
        (None, "https") => 443,
        (None, "http") => 80,
        _ => return None,
    };
    // `Origin` never carries user information.
    if authority.contains('@') {
        return None;
    }
    Some((scheme, a.host().to_ascii_lowercase(), port))
}

/// Whether the request carries an `Origin` (RFC 6454 §7) other than the
/// console's own (scheme, host and port; [`own_origin`]), `null` included.
/// A post without `Origin` passes this check (older browsers send none on
/// same-origin posts; the sign-in token still guards it). The forwarded
/// headers come from the proxy: a page cannot make a browser send them.
pub fn foreign_origin(configured_secure: bool, headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return false;
    };
    let theirs = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .filter(|(_, rest)| !rest.contains('/'))
        .and_then(|(scheme, authority)| origin_parts(scheme, authority));
    let ours = own_origin(configured_secure, headers)
        .and_then(|(scheme, authority)| origin_parts(scheme, &authority));
    match (theirs, ours) {
        (Some(t), Some(o)) => t != o,
        _ => true,
    }
}

/// Whether the browser says the request comes from another origin than the
/// console's (`Sec-Fetch-Site: cross-site` or `same-site`: a page of another
/// port or subdomain of the same site is `same-site`): refused on sign-in,
/// where no session's CSRF token exists yet.
pub fn from_elsewhere(headers: &HeaderMap) -> bool {
    headers.get("sec-fetch-site").is_some_and(|v| {
        let v = v.as_bytes();
        v.eq_ignore_ascii_case(b"cross-site") || v.eq_ignore_ascii_case(b"same-site")
    })
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

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn the_sign_in_cookie_is_http_only_strict_scoped_and_short() {
        let c = sign_in_cookie("abc", false);
        for part in [
            "idem_sign_in=abc",
            "HttpOnly",
            "SameSite=Strict",
            "Path=/console",
            "Max-Age=3600",
        ] {
            assert!(c.contains(part), "{c} lacks {part}");
        }
        assert!(!c.contains("Secure"));
        assert!(sign_in_cookie("abc", true).contains("Secure"));
        assert!(cleared_sign_in_cookie(false).contains("Max-Age=0"));
    }

    #[test]
    fn the_sign_in_token_is_read_only_in_its_shape() {
        let t = "A".repeat(43);
        let h = headers(&[("cookie", &format!("idem_sign_in={t}; idem_session=x"))]);
        assert_eq!(sign_in_token_of(&h), Some(t));
        for bad in ["short", &"A".repeat(44), &format!("{}+", "A".repeat(42))] {
            let h = headers(&[("cookie", &format!("idem_sign_in={bad}"))]);
            assert_eq!(sign_in_token_of(&h), None, "{bad}");
        }
    }

    #[test]
    fn the_sign_in_token_must_equal_the_cookie() {
        assert!(check_sign_in_token(Some("tok"), Some("tok")));
        assert!(!check_sign_in_token(Some("tok"), Some("tok2")));
        assert!(!check_sign_in_token(Some("tok"), None));
        assert!(!check_sign_in_token(None, Some("tok")));
        assert!(!check_sign_in_token(None, None));
    }

    #[test]
    fn replace_tokens_bind_the_session_and_the_new_key() {
        let k1 = uuid::Uuid::from_u128(1);
        let k2 = uuid::Uuid::from_u128(2);
        let a = replace_token("session-a", k1);
        assert_eq!(a, replace_token("session-a", k1));
        assert_ne!(a, replace_token("session-b", k1));
        assert_ne!(a, replace_token("session-a", k2));
        assert_ne!(a, csrf_token("session-a"));
    }

    #[test]
    fn only_the_consoles_own_origin_may_sign_in() {
        let host = ("host", "127.0.0.1:8080");
        assert!(
            !foreign_origin(false, &headers(&[host])),
            "no Origin: the token decides"
        );
        for ok in ["http://127.0.0.1:8080", "HTTP://127.0.0.1:8080"] {
            assert!(
                !foreign_origin(false, &headers(&[host, ("origin", ok)])),
                "{ok}"
            );
        }
        for bad in [
            "http://127.0.0.1:8081",
            "http://localhost:8080",
            "https://127.0.0.1:8080",
            "null",
            "http://127.0.0.1:8080/",
            "http://user@127.0.0.1:8080",
            "",
        ] {
            assert!(
                foreign_origin(false, &headers(&[host, ("origin", bad)])),
                "{bad}"
            );
        }
        // No Host to compare with: any Origin is foreign.
        assert!(foreign_origin(
            false,
            &headers(&[("origin", "http://127.0.0.1:8080")])
        ));
    }

    #[test]
    fn behind_a_tls_proxy_the_origin_is_https_on_the_default_port() {
        let proxied = [("host", "console.example"), ("x-forwarded-proto", "https")];
        let with = |o: &'static str| {
            let mut h = headers(&proxied);
            h.append("origin", o.parse().unwrap());
            h
        };
        assert!(!foreign_origin(false, &with("https://console.example")));
        assert!(!foreign_origin(false, &with("https://console.example:443")));
        assert!(foreign_origin(false, &with("http://console.example")));
        // Configured Secure: the console is reached over TLS.
        let h = headers(&[
            ("host", "console.example"),
            ("origin", "https://console.example"),
        ]);
        assert!(!foreign_origin(true, &h));
        assert!(foreign_origin(false, &h));
        // A proxy that rewrites Host names the browser's in X-Forwarded-Host.
        let h = headers(&[
            ("host", "127.0.0.1:8080"),
            ("x-forwarded-host", "console.example"),
            ("x-forwarded-proto", "https"),
            ("origin", "https://console.example"),
        ]);
        assert!(!foreign_origin(false, &h));
    }

    #[test]
    fn sign_in_is_refused_from_another_site_or_origin_of_it() {
        for v in ["cross-site", "same-site", "Same-Site"] {
            assert!(from_elsewhere(&headers(&[("sec-fetch-site", v)])), "{v}");
        }
        for v in ["same-origin", "none"] {
            assert!(!from_elsewhere(&headers(&[("sec-fetch-site", v)])), "{v}");
        }
        assert!(!from_elsewhere(&HeaderMap::new()));
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
