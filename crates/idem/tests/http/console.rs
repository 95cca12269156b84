//! The operator console (black box, over HTTP with a cookie store):
//! sign-in and sign-out; a signed-out browser reaches no page (303 to the
//! sign-in form), no post (403) and no live stream (401); CSRF (missing,
//! another session's) and a client key's posts are 403 and change nothing;
//! another tenant's task is 404; a revoked key's session stops at once;
//! hostile params render only as escaped text; every `/console` response
//! carries the Content-Security-Policy; an admin's resolve through the console
//! leaves the events of the API's resolve; the task page's live stream wakes
//! on an executor's report; sessions work across two instances over one
//! PostgreSQL. Session and CSRF cases run on SQLite and PostgreSQL.

use std::time::Duration;

use idem_store_postgres::testing::{TestDatabase, fresh_database};
use serde_json::{Value, json};

use crate::support::{Resp, Server, payment, s, send};

const PAY: &str = "payment.release";

/// The CSP every console response carries.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// A browser of the console: its own cookie store, redirects not followed.
pub(crate) struct Browser {
    base: String,
    http: reqwest::Client,
}

impl Browser {
    pub(crate) fn new(srv: &Server) -> Browser {
        Browser::at(&srv.url)
    }

    fn at(url: &str) -> Browser {
        Browser {
            base: url.to_owned(),
            http: reqwest::Client::builder()
                .cookie_store(true)
                .redirect(reqwest::redirect::Policy::none())
                .timeout(Duration::from_secs(30))
                .build()
                .expect("reqwest client"),
        }
    }

    /// A browser signed in with `key` (asserts the 303 and the cookie).
    async fn signed_in(srv: &Server, key: &str) -> Browser {
        let b = Browser::new(srv);
        let r = b.sign_in(key, None).await;
        assert_eq!(r.status, 303, "sign-in: {}", r.text);
        assert_eq!(r.header("location"), "/console/overview");
        b
    }

    /// Signs in as a person does: the form first (its token, and the
    /// pre-session cookie the cookie store keeps), then the post.
    pub(crate) async fn sign_in(&self, key: &str, next: Option<&str>) -> Resp {
        let page = self.get("/console/sign-in").await;
        let token = attr_after(&page.text, "name=\"sign_in_token\" value=\"");
        let mut form = vec![("sign_in_token", token.as_str()), ("api_key", key)];
        if let Some(n) = next {
            form.push(("next", n));
        }
        self.post("/console/sign-in", &form).await
    }

    pub(crate) async fn get(&self, path: &str) -> Resp {
        let r = send(self.http.get(format!("{}{path}", self.base))).await;
        assert_security_headers(&r, path);
        r
    }

    async fn post(&self, path: &str, form: &[(&str, &str)]) -> Resp {
        let r = send(self.http.post(format!("{}{path}", self.base)).form(form)).await;
        assert_security_headers(&r, path);
        r
    }

    /// The session's CSRF token, read from the sign-out form of a page.
    async fn csrf(&self) -> String {
        let r = self.get("/console/overview").await;
        assert_eq!(r.status, 200, "overview: {}", r.text);
        attr_after(&r.text, "name=\"csrf\" value=\"")
    }
}

/// The attribute value that follows `marker` in `html`.
fn attr_after(html: &str, marker: &str) -> String {
    let at = html
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker} in {html}"));
    let rest = &html[at + marker.len()..];
    rest[..rest.find('"').expect("closing quote")].to_owned()
}

#[track_caller]
fn assert_security_headers(r: &Resp, path: &str) {
    assert_eq!(r.header("content-security-policy"), CSP, "CSP of {path}");
    assert_eq!(r.header("x-content-type-options"), "nosniff", "{path}");
    assert_eq!(r.header("referrer-policy"), "same-origin", "{path}");
    assert!(!r.header("cache-control").is_empty(), "{path}");
}

/// A signed-out GET of a page: 303 to the sign-in form with `next`.
#[track_caller]
fn assert_to_sign_in(r: &Resp, path: &str) {
    assert_eq!(r.status, 303, "{path}: {}", r.text);
    let want = format!(
        "/console/sign-in?{}",
        form_urlencoded::Serializer::new(String::new())
            .append_pair("next", path)
            .finish()
    );
    assert_eq!(r.header("location"), want, "{path}");
}

/// A payment whose attempt reported `unknown`, its reconcile attempt
/// leased (reconciling): its id.
async fn reconciling(srv: &Server, key: &str) -> String {
    let t = srv.new_task(key, PAY, payment(5)).await;
    let a = srv.claim_one(PAY, None).await;
    srv.report(
        &s(&a["id"]),
        json!({"generation": a["generation"], "outcome": "unknown"}),
    )
    .await
    .ok(200);
    let r = srv.claim_one(PAY, None).await;
    assert_eq!(r["kind"], json!("reconcile"));
    let id = s(&t["id"]);
    assert_eq!(srv.task(&id).await["state"], json!("reconciling"));
    id
}

/// The task as the API shows it, with its events: what "nothing changed"
/// compares.
async fn snapshot(srv: &Server, id: &str) -> (Value, Vec<Value>) {
    (srv.task(id).await, srv.events(id).await)
}

fn resolve_form<'a>(csrf: &'a str, reason: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("csrf", csrf),
        ("outcome", "committed"),
        ("result", r#"{"provider_ref": "PR-1"}"#),
        ("external_txn_id", "txn-42"),
        ("reason", reason),
        ("confirm", "yes"),
    ]
}

// ---------------------------------------------------------------- cases

/// Sign-in (bad key, executor key, client key with `next`), the signed-in
/// header, sign-out (needs the CSRF token; ends the session in the store).
async fn sign_in_and_out(srv: &Server) {
    let b = Browser::new(srv);
    let r = b.get("/console").await;
    assert_eq!(
        (r.status, r.header("location").as_str()),
        (303, "/console/sign-in")
    );
    let form = b.get("/console/sign-in").await;
    assert_eq!(form.status, 200);
    for part in [
        r#"<form id="sign-in" method="post" action="/console/sign-in">"#,
        r#"<label for="api_key">"#,
        r#"type="password" name="api_key""#,
    ] {
        assert!(form.text.contains(part), "sign-in form lacks {part}");
    }
    let bad = b.sign_in("idem_not-a-key", None).await;
    assert_eq!(bad.status, 401);
    assert!(
        bad.text.contains(r#"<p class="error" role="alert">"#),
        "{}",
        bad.text
    );
    assert!(
        bad.headers
            .get_all("set-cookie")
            .iter()
            .all(|c| !c.as_bytes().starts_with(b"idem_session=")),
        "no session cookie"
    );
    let exec = b.sign_in(&srv.keys.exec, None).await;
    assert_eq!(exec.status, 401, "an executor key cannot sign in");

    let r = b
        .sign_in(&srv.keys.acme, Some("/console/tasks?state=failed"))
        .await;
    assert_eq!(r.status, 303, "{}", r.text);
    assert_eq!(r.header("location"), "/console/tasks?state=failed");
    let cookie = r.header("set-cookie");
    for part in [
        "idem_session=",
        "HttpOnly",
        "SameSite=Strict",
        "Path=/console",
        "Max-Age=28800",
    ] {
        assert!(cookie.contains(part), "cookie {cookie} lacks {part}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: no Secure");
    let first = token_of(&cookie);
    let evil = b
        .sign_in(&srv.keys.acme, Some("https://evil.example/"))
        .await;
    assert_eq!(
        evil.header("location"),
        "/console/overview",
        "next stays on the console"
    );
    // A sign-in that carries a session cookie ends that session and sets a
    // new one.
    let cookie = evil.header("set-cookie");
    assert_ne!(token_of(&cookie), first, "a new sign-in gets a new token");
    let old = with_token(&srv.url, "/console/overview", &first).await;
    assert_to_sign_in(&old, "/console/overview");
    // Behind a TLS-terminating proxy the cookies are Secure (so sent here
    // by hand: a cookie store keeps them for HTTPS only).
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("reqwest client");
    let page = send(
        http.get(format!("{}/console/sign-in", srv.url))
            .header("x-forwarded-proto", "https"),
    )
    .await;
    let pre = page.header("set-cookie");
    assert!(pre.contains("Secure"), "{pre}");
    let token = attr_after(&page.text, "name=\"sign_in_token\" value=\"");
    let proxied = send(
        http.post(format!("{}/console/sign-in", srv.url))
            .header("x-forwarded-proto", "https")
            .header("cookie", format!("idem_sign_in={token}"))
            .form(&[
                ("sign_in_token", token.as_str()),
                ("api_key", srv.keys.acme.as_str()),
            ]),
    )
    .await;
    assert_eq!(proxied.status, 303);
    assert!(proxied.header("set-cookie").contains("Secure"));

    let o = b.get("/console/overview").await;
    assert_eq!(o.status, 200, "{}", o.text);
    assert!(o.text.contains(r#"<span id="tenant">acme</span>"#));
    assert!(o.text.contains(r#"<span id="role">client</span>"#));
    assert!(
        o.text
            .contains(r#"<form id="sign-out" method="post" action="/console/sign-out">"#)
    );

    // Sign-out without the CSRF token: 403, still signed in.
    let r = b.post("/console/sign-out", &[]).await;
    assert_eq!(r.status, 403);
    assert_eq!(b.get("/console/overview").await.status, 200);
    let csrf = b.csrf().await;
    let r = b.post("/console/sign-out", &[("csrf", &csrf)]).await;
    assert_eq!(
        (r.status, r.header("location").as_str()),
        (303, "/console/sign-in")
    );
    assert!(r.header("set-cookie").contains("Max-Age=0"));
    // The session is over in the store, not only in this browser.
    let replay = with_token(&srv.url, "/console/overview", &token_of(&cookie)).await;
    assert_to_sign_in(&replay, "/console/overview");
}

/// The session token of a `Set-Cookie` value.
fn token_of(set_cookie: &str) -> String {
    set_cookie
        .split(';')
        .next()
        .and_then(|c| c.strip_prefix("idem_session="))
        .unwrap_or_else(|| panic!("no session cookie in {set_cookie:?}"))
        .to_owned()
}

/// `GET base/path` presenting session `token` by hand (no cookie store).
async fn with_token(base: &str, path: &str, token: &str) -> Resp {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("reqwest client");
    send(
        http.get(format!("{base}{path}"))
            .header("cookie", format!("idem_session={token}")),
    )
    .await
}

/// Without a session (none, a made-up one, after sign-out, after the key's
/// revocation): every page is a 303 to the sign-in form, every post 403, the
/// live stream and the fragment 401.
async fn signed_out_reaches_nothing(srv: &Server) {
    let id = srv.new_task(&crate::support::ikey(), PAY, payment(3)).await;
    let id = s(&id["id"]);
    let (admin_id, admin) = srv.create_key("acme", "admin", None);
    let b = Browser::signed_in(srv, &admin).await;
    let csrf = b.csrf().await;
    let pages = [
        "/console/overview".to_owned(),
        "/console/tasks?state=queued".to_owned(),
        format!("/console/tasks/{id}"),
    ];
    for p in &pages {
        assert_eq!(b.get(p).await.status, 200, "{p} signed in");
    }
    srv.revoke_key(&admin_id);
    let nobody = Browser::new(srv);
    for browser in [&b, &nobody] {
        for p in &pages {
            assert_to_sign_in(&browser.get(p).await, p);
        }
        for live in [
            format!("/console/tasks/{id}/live"),
            format!("/console/tasks/{id}/fragment"),
        ] {
            assert_eq!(browser.get(&live).await.status, 401, "{live}");
        }
        let before = snapshot(srv, &id).await;
        let r = browser
            .post(
                &format!("/console/tasks/{id}/actions/cancel"),
                &[("csrf", &csrf), ("reason", "x"), ("confirm", "yes")],
            )
            .await;
        assert_eq!(r.status, 403, "{}", r.text);
        assert_eq!(snapshot(srv, &id).await, before, "nothing changed");
        assert_eq!(
            browser
                .post("/console/sign-out", &[("csrf", &csrf)])
                .await
                .status,
            403
        );
    }
    assert_eq!(
        Browser::new(srv).sign_in(&admin, None).await.status,
        401,
        "a revoked key cannot sign in"
    );
}

/// A post without the CSRF token, with another session's, or by a client
/// key: 403 and the task unchanged (read back through the API); without
/// `confirm=yes` or a reason: 400, unchanged; then the admin's resolve works.
async fn csrf_and_roles_guard_actions(srv: &Server) {
    let (_, admin) = srv.create_key("acme", "admin", None);
    let a = Browser::signed_in(srv, &admin).await;
    let other_admin = Browser::signed_in(srv, &admin).await;
    let client = Browser::signed_in(srv, &srv.keys.acme).await;
    let id = reconciling(srv, &crate::support::ikey()).await;
    let path = format!("/console/tasks/{id}/actions/resolve");
    let mine = a.csrf().await;
    let theirs = other_admin.csrf().await;
    let clients = client.csrf().await;
    assert_ne!(mine, theirs, "every session has its own CSRF token");

    let page = a.get(&format!("/console/tasks/{id}")).await;
    assert!(
        page.text.contains(r#"data-action="resolve""#),
        "an admin sees resolve"
    );
    assert!(
        page.text
            .contains(&format!(r#"name="csrf" value="{mine}""#))
    );
    let page = client.get(&format!("/console/tasks/{id}")).await;
    assert_eq!(page.status, 200);
    assert!(
        !page.text.contains("class=\"action\""),
        "a client sees no action"
    );

    let before = snapshot(srv, &id).await;
    let no_csrf: Vec<(&str, &str)> = resolve_form(&mine, "checked").into_iter().skip(1).collect();
    for (who, form, what) in [
        (&a, no_csrf, "no CSRF token"),
        (
            &a,
            resolve_form(&theirs, "checked"),
            "another session's token",
        ),
        (&a, resolve_form("", "checked"), "an empty token"),
        (&client, resolve_form(&clients, "checked"), "a client key"),
    ] {
        let r = who.post(&path, &form).await;
        assert_eq!(r.status, 403, "{what}: {}", r.text);
        assert!(
            r.text.contains(r#"role="alert""#),
            "{what}: the page says why"
        );
        assert_eq!(snapshot(srv, &id).await, before, "{what}: nothing changed");
    }
    let mut unconfirmed = resolve_form(&mine, "checked");
    unconfirmed.retain(|(k, _)| *k != "confirm");
    for (form, what) in [
        (unconfirmed, "no confirmation"),
        (resolve_form(&mine, "  "), "an empty reason"),
    ] {
        let r = a.post(&path, &form).await;
        assert_eq!(r.status, 400, "{what}: {}", r.text);
        assert_eq!(snapshot(srv, &id).await, before, "{what}: nothing changed");
    }
    let r = a
        .post(&path, &resolve_form(&mine, "provider says paid"))
        .await;
    assert_eq!(r.status, 303, "{}", r.text);
    assert_eq!(r.header("location"), format!("/console/tasks/{id}"));
    let t = srv.task(&id).await;
    assert_eq!(t["state"], json!("succeeded"));
    assert_eq!(t["delivery"]["charge"], t["contract"]["price"]);
    let page = a.get(&format!("/console/tasks/{id}")).await;
    assert!(page.text.contains(r#"data-state="succeeded""#));
    assert!(page.text.contains(r#"class="charge""#));
    // The action no longer applies: 409 with the reason, nothing changes.
    let after = snapshot(srv, &id).await;
    let r = a.post(&path, &resolve_form(&mine, "again")).await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(snapshot(srv, &id).await, after);
}

// ---------------------------------------------------------------- SQLite

#[tokio::test]
async fn sqlite_sign_in_and_out() {
    sign_in_and_out(&Server::in_process().await).await;
}

#[tokio::test]
async fn sqlite_signed_out_reaches_nothing() {
    signed_out_reaches_nothing(&Server::in_process().await).await;
}

#[tokio::test]
async fn sqlite_csrf_and_roles_guard_actions() {
    csrf_and_roles_guard_actions(&Server::in_process().await).await;
}

/// A session runs out after its TTL (8 h by default) on the store's clock.
#[tokio::test]
async fn a_session_runs_out_after_its_ttl() {
    let srv = Server::in_process().await;
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    srv.advance(8 * 3_600_000 - 60_000);
    assert_eq!(b.get("/console/overview").await.status, 200);
    srv.advance(60_000);
    assert_to_sign_in(&b.get("/console/overview").await, "/console/overview");
}

/// Another tenant's task (and a malformed or unknown id) is a 404 on every
/// task endpoint, for pages, fragment, stream and posts alike.
#[tokio::test]
async fn another_tenants_task_is_not_found() {
    let srv = Server::in_process().await;
    let (_, other_admin) = srv.create_key("other", "admin", None);
    let theirs = srv
        .submit_as(&srv.keys.other, &crate::support::ikey(), PAY, payment(9))
        .await;
    let theirs = s(&theirs.ok(201)["task"]["id"]);
    let (_, admin) = srv.create_key("acme", "admin", None);
    let b = Browser::signed_in(&srv, &admin).await;
    let csrf = b.csrf().await;
    for id in [
        theirs.as_str(),
        "not-a-uuid",
        "01a23d1e-0000-7000-8000-000000000000",
    ] {
        for p in [
            format!("/console/tasks/{id}"),
            format!("/console/tasks/{id}/fragment"),
            format!("/console/tasks/{id}/live"),
        ] {
            let r = b.get(&p).await;
            assert_eq!(r.status, 404, "{p}: {}", r.text);
        }
        let r = b
            .post(
                &format!("/console/tasks/{id}/actions/cancel"),
                &[("csrf", &csrf), ("reason", "x"), ("confirm", "yes")],
            )
            .await;
        assert_eq!(r.status, 404, "{}", r.text);
    }
    // The owner sees it, untouched.
    let owner = Browser::signed_in(&srv, &other_admin).await;
    let r = owner.get(&format!("/console/tasks/{theirs}")).await;
    assert_eq!(r.status, 200);
    assert!(r.text.contains(r#"data-state="queued""#));
    // acme's search and overview never show it.
    assert!(!b.get("/console/tasks").await.text.contains(&theirs));
    assert!(!b.get("/console/overview").await.text.contains(&theirs));
}

/// Params, keys and query values with markup or `javascript:` appear only as
/// escaped text, in text and in attributes, on every page that shows them.
#[tokio::test]
async fn hostile_values_render_as_text() {
    let srv = Server::in_process().await;
    let script = "<script>alert(1)</script>";
    let img = "\"><img src=x onerror=alert(1)>";
    let js = "javascript:alert(1)";
    let params = json!({"payee": script, "amount": 5, "currency": "EUR", "memo": img, "url": js});
    // A structured-field string: the key is `k-<script>"'&x`.
    let key = r#""k-<script>\"'&x""#;
    let t = srv.submit(key, PAY, params).await;
    let id = s(&t.ok(201)["task"]["id"]);
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    let pages = [
        format!("/console/tasks/{id}"),
        format!("/console/tasks/{id}/fragment"),
        "/console/tasks?idempotency_key_prefix=k-%3Cscript%3E".to_owned(),
        format!(
            "/console/tasks?{}",
            form_urlencoded::Serializer::new(String::new())
                .append_pair("external_txn_id", img)
                .finish()
        ),
        "/console/overview".to_owned(),
    ];
    let mut shown = 0;
    for p in &pages {
        let r = b.get(p).await;
        assert_eq!(r.status, 200, "{p}: {}", r.text);
        let html = &r.text;
        assert!(!html.contains("<script>alert"), "{p}: raw <script>");
        assert!(!html.contains("<img"), "{p}: raw <img");
        assert!(
            !html.contains("onerror=alert(1)>"),
            "{p}: unescaped attribute break-out"
        );
        assert!(
            !html.contains("href=\"javascript:"),
            "{p}: javascript: link"
        );
        assert!(!html.contains("k-<script>"), "{p}: raw key");
        if html.contains("&lt;script&gt;alert(1)&lt;/script&gt;") {
            shown += 1;
        }
    }
    assert!(
        shown >= 2,
        "the task page and fragment show the params as text"
    );
    let page = b.get(&format!("/console/tasks/{id}")).await.text;
    assert!(page.contains("k-&lt;script&gt;&quot;'&amp;x"), "{page}");
    assert!(page.contains("&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"));
    assert!(page.contains(js), "javascript: shows as text");
    // The search form echoes a hostile filter in an escaped attribute.
    let r = b
        .get(&format!(
            "/console/tasks?{}",
            form_urlencoded::Serializer::new(String::new())
                .append_pair("external_txn_id", img)
                .finish()
        ))
        .await;
    assert!(
        r.text
            .contains(r#"value="&quot;&gt;&lt;img src=x onerror=alert(1)&gt;""#)
    );
    // A bad filter: 400, the API's message, escaped.
    let r = b.get("/console/tasks?state=%3Cscript%3E").await;
    assert_eq!(r.status, 400);
    assert!(
        r.text.contains("unknown state `&lt;script&gt;`"),
        "{}",
        r.text
    );
}

/// Every console response carries the CSP and the other security headers:
/// pages, redirects, errors, static files, posts and the live stream.
#[tokio::test]
async fn every_console_response_carries_the_csp() {
    let srv = Server::in_process().await;
    let id = s(&srv.new_task(&crate::support::ikey(), PAY, payment(1)).await["id"]);
    let nobody = Browser::new(&srv);
    // `Browser::get`/`post` assert the headers on every answer.
    for p in [
        "/console",
        "/console/sign-in",
        "/console/overview",
        "/console/nowhere",
    ] {
        nobody.get(p).await;
    }
    nobody.post("/console/sign-out", &[]).await;
    nobody.post("/console/overview", &[]).await;
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    let css = b.get("/console/static/console.css").await;
    assert_eq!(css.header("content-type"), "text/css; charset=utf-8");
    assert!(css.header("cache-control").contains("max-age="));
    let js = b.get("/console/static/console.js").await;
    assert_eq!(js.header("content-type"), "text/javascript; charset=utf-8");
    for p in [
        "/console/overview".to_owned(),
        "/console/tasks".to_owned(),
        "/console/tasks?limit=0".to_owned(),
        format!("/console/tasks/{id}"),
        format!("/console/tasks/{id}/fragment"),
    ] {
        let r = b.get(&p).await;
        assert_eq!(r.header("cache-control"), "no-store", "{p}");
        assert!(!r.text.contains(" style=\""), "{p}: no inline style");
        assert!(!r.text.contains("<script>"), "{p}: no inline script");
    }
    // The stream's headers arrive before its body.
    let res = b
        .http
        .get(format!("{}/console/tasks/{id}/live", srv.url))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-security-policy"], CSP);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
}

/// An admin's resolve through the console leaves the events the API's
/// resolve leaves (same types in the same order, same actor, reason and
/// outcome), and the page shows the delivery once, with its charge.
#[tokio::test]
async fn console_resolve_leaves_the_events_of_the_api_resolve() {
    let srv = Server::in_process().await;
    let (admin_id, admin) = srv.create_key("acme", "admin", None);
    let by_api = reconciling(&srv, &crate::support::ikey()).await;
    let by_console = reconciling(&srv, &crate::support::ikey()).await;
    let reason = "provider dashboard shows it paid";
    srv.post(
        &format!("/v1/tasks/{by_api}/resolve"),
        &admin,
        json!({"outcome": "committed", "result": {"provider_ref": "PR-1"}, "external_txn_id": "txn-42", "reason": reason}),
    )
    .await
    .ok(200);
    let b = Browser::signed_in(&srv, &admin).await;
    let csrf = b.csrf().await;
    let r = b
        .post(
            &format!("/console/tasks/{by_console}/actions/resolve"),
            &resolve_form(&csrf, reason),
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.text);
    let (api_task, api_events) = snapshot(&srv, &by_api).await;
    let (con_task, con_events) = snapshot(&srv, &by_console).await;
    let kinds = |es: &[Value]| es.iter().map(|e| s(&e["type"])).collect::<Vec<_>>();
    assert_eq!(kinds(&con_events), kinds(&api_events));
    let resolved = |es: &[Value]| {
        let e = es
            .iter()
            .find(|e| e["type"] == json!("operator_resolved"))
            .expect("operator_resolved")["data"]
            .clone();
        (
            e["actor"].clone(),
            e["reason"].clone(),
            e["outcome"].clone(),
        )
    };
    assert_eq!(resolved(&con_events), resolved(&api_events));
    assert_eq!(
        resolved(&con_events).0,
        json!({"type": "api_key", "api_key_id": admin_id})
    );
    for field in ["state", "generation", "attempt_count", "usage"] {
        assert_eq!(con_task[field], api_task[field], "{field}");
    }
    assert_eq!(
        con_task["delivery"]["charge"],
        api_task["delivery"]["charge"]
    );
    assert_eq!(
        con_task["delivery"]["result"],
        api_task["delivery"]["result"]
    );
    assert_eq!(
        con_task["delivery"]["external_txn_id"],
        api_task["delivery"]["external_txn_id"]
    );
    let page = b.get(&format!("/console/tasks/{by_console}")).await.text;
    assert_eq!(
        page.matches(r#"class="charge""#).count(),
        1,
        "delivered once"
    );
    assert_eq!(
        page.matches(r#"data-type="delivered""#).count(),
        1,
        "one delivered event in the raw events"
    );
}

/// The task page's live stream says `change` at once, again within 2 s of an
/// executor's report, and `end` once the task is terminal; the fragment then
/// shows the new state.
#[tokio::test]
async fn the_live_stream_wakes_on_a_report() {
    let srv = Server::in_process().await;
    let t = srv.new_task(&crate::support::ikey(), PAY, payment(2)).await;
    let id = s(&t["id"]);
    let a = srv.claim_one(PAY, None).await;
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    let mut res = b
        .http
        .get(format!("{}/console/tasks/{id}/live", srv.url))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let mut seen = String::new();
    let mut read_until = async |what: &str, within: Duration| {
        let deadline = tokio::time::Instant::now() + within;
        while !seen.contains(what) {
            let chunk = tokio::time::timeout_at(deadline, res.chunk())
                .await
                .unwrap_or_else(|_| panic!("no {what:?} within {within:?}; got {seen:?}"))
                .expect("stream chunk")
                .unwrap_or_else(|| panic!("stream ended before {what:?}; got {seen:?}"));
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    };
    read_until("event: change", Duration::from_secs(2)).await;
    let started = tokio::time::Instant::now();
    srv.report(
        &s(&a["id"]),
        json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": true}}),
    )
    .await
    .ok(200);
    read_until("event: end", Duration::from_secs(2)).await;
    assert!(started.elapsed() < Duration::from_secs(2));
    let f = b.get(&format!("/console/tasks/{id}/fragment")).await;
    assert!(f.text.contains(r#"data-state="succeeded""#), "{}", f.text);
}

/// The search takes the API's filters (a comma list of states too), pages
/// with a `rel="next"` link, and answers a bad filter with the API's 400.
#[tokio::test]
async fn search_filters_and_pages_as_the_api_does() {
    let srv = Server::in_process().await;
    let mut ids = Vec::new();
    for n in 0..3 {
        let t = srv.new_task(&format!("pay-{n}"), PAY, payment(n + 1)).await;
        ids.push(s(&t["id"]));
    }
    srv.new_task("other-1", PAY, payment(7)).await;
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    let r = b
        .get("/console/tasks?idempotency_key_prefix=pay-&state=queued,running&limit=2&operation=")
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.text.matches("<tr data-task-id=").count(), 2);
    let next = attr_after(&r.text, r#"<a rel="next" href=""#).replace("&amp;", "&");
    assert!(next.contains("cursor="), "{next}");
    let r2 = b.get(&next).await;
    assert_eq!(r2.text.matches("<tr data-task-id=").count(), 1);
    assert!(!r2.text.contains(r#"rel="next""#));
    let mut found: Vec<String> = [&r.text, &r2.text]
        .iter()
        .flat_map(|h| {
            h.split("<tr data-task-id=\"")
                .skip(1)
                .map(|x| x[..36].to_owned())
        })
        .collect();
    found.sort();
    ids.sort();
    assert_eq!(found, ids);
    for bad in [
        "limit=0",
        "created_after=yesterday",
        "cursor=abc",
        "operation=nope",
        "x=1",
    ] {
        let r = b.get(&format!("/console/tasks?{bad}")).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text);
        assert!(r.text.contains(r#"<p class="error" role="alert">"#));
    }
}

// ---------------------------------------------------------------- PostgreSQL

/// A fresh PostgreSQL database with the standard keys and one server on it.
async fn pg_server() -> (TestDatabase, Server) {
    let db = fresh_database().await;
    let keys = Server::create_keys(&db);
    let srv = Server::start_pg(&db, &keys, &[]).await;
    (db, srv)
}

#[tokio::test]
async fn postgres_sign_in_and_out() {
    let (_db, srv) = pg_server().await;
    sign_in_and_out(&srv).await;
}

#[tokio::test]
async fn postgres_signed_out_reaches_nothing() {
    let (_db, srv) = pg_server().await;
    signed_out_reaches_nothing(&srv).await;
}

#[tokio::test]
async fn postgres_csrf_and_roles_guard_actions() {
    let (_db, srv) = pg_server().await;
    csrf_and_roles_guard_actions(&srv).await;
}

/// A session made on one instance works on another over the same
/// PostgreSQL, and a sign-out on either ends it on both.
#[tokio::test]
async fn postgres_sessions_work_across_instances() {
    let db = fresh_database().await;
    let keys = Server::create_keys(&db);
    let one = Server::start_pg(&db, &keys, &[]).await;
    let two = Server::start_pg(&db, &keys, &[]).await;
    let b = Browser::new(&one);
    let r = b.sign_in(&keys.acme, None).await;
    assert_eq!(r.status, 303, "{}", r.text);
    let token = token_of(&r.header("set-cookie"));
    for srv in [&one, &two] {
        let r = with_token(&srv.url, "/console/overview", &token).await;
        assert_eq!(r.status, 200, "{}: {}", srv.url, r.text);
        assert!(r.text.contains(r#"<span id="tenant">acme</span>"#));
    }
    let page = with_token(&two.url, "/console/overview", &token).await;
    let csrf = attr_after(&page.text, "name=\"csrf\" value=\"");
    let out = send(
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("reqwest client")
            .post(format!("{}/console/sign-out", two.url))
            .header("cookie", format!("idem_session={token}"))
            .form(&[("csrf", csrf.as_str())]),
    )
    .await;
    assert_eq!(out.status, 303, "{}", out.text);
    for srv in [&one, &two] {
        let r = with_token(&srv.url, "/console/overview", &token).await;
        assert_to_sign_in(&r, "/console/overview");
    }
}

/// `IDEM_CONSOLE=off` (as `--no-console`): nothing is served under
/// `/console`; the API is unchanged.
#[tokio::test]
async fn the_console_can_be_turned_off() {
    let srv =
        Server::start_with(crate::support::Options::default().env("IDEM_CONSOLE", "off")).await;
    let r = Browser::new(&srv);
    let res = send(r.http.get(format!("{}/console/sign-in", srv.url))).await;
    assert_eq!(res.status, 404);
    assert!(res.header("content-security-policy").is_empty());
    srv.new_task(&crate::support::ikey(), PAY, payment(1)).await;
}

/// A resolve's result is read under the API's strict JSON rules: a
/// duplicate member name, an integer beyond ±(2^53−1), nesting deeper than
/// 64 or `null` (no result, as the API reads it) is a 400 and changes
/// nothing, as `POST /v1/tasks/{id}/resolve` answers them.
#[tokio::test]
async fn a_resolve_result_follows_the_apis_json_rules() {
    let srv = Server::in_process().await;
    let (_, admin) = srv.create_key("acme", "admin", None);
    let b = Browser::signed_in(&srv, &admin).await;
    let csrf = b.csrf().await;
    let id = reconciling(&srv, &crate::support::ikey()).await;
    let path = format!("/console/tasks/{id}/actions/resolve");
    let deep = format!("{}{}", "[".repeat(65), "]".repeat(65));
    for (result, what) in [
        (r#"{"ref": "a", "ref": "b"}"#, "a duplicate member name"),
        (r#"{"amount": 9007199254740993}"#, "an unsafe integer"),
        (deep.as_str(), "nesting deeper than 64"),
        ("null", "null"),
    ] {
        let before = snapshot(&srv, &id).await;
        let form = vec![
            ("csrf", csrf.as_str()),
            ("outcome", "committed"),
            ("result", result),
            ("reason", "checked"),
            ("confirm", "yes"),
        ];
        let r = b.post(&path, &form).await;
        assert_eq!(r.status, 400, "{what}: {}", r.text);
        assert_eq!(snapshot(&srv, &id).await, before, "{what}: nothing changed");
    }
    let api = srv
        .post(
            &format!("/v1/tasks/{id}/resolve"),
            &admin,
            json!({"outcome": "committed", "reason": "r", "result": null}),
        )
        .await;
    assert_eq!(api.status, 400, "the API refuses a null result too");
}

/// `/console/` (with the slash) is the console's, not the API's: the CSP
/// and the other headers, and the root's answer (303 to sign-in).
#[tokio::test]
async fn the_console_root_with_a_slash_is_the_consoles() {
    let srv = Server::in_process().await;
    let nobody = Browser::new(&srv);
    // `Browser::get` asserts the security headers.
    let r = nobody.get("/console/").await;
    assert_eq!(r.status, 303, "{}", r.text);
    assert_eq!(r.header("location"), "/console/sign-in");
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    let r = b.get("/console/").await;
    assert_eq!(
        (r.status, r.header("location").as_str()),
        (303, "/console/overview")
    );
}

/// A task id that is not UTF-8 once percent-decoded is a malformed id like
/// any other: the console's 404 page (not the router's plain-text 400), on
/// the page, fragment, stream and action alike; nothing changes.
#[tokio::test]
async fn a_task_id_that_is_not_utf8_is_not_found() {
    let srv = Server::in_process().await;
    let (_, admin) = srv.create_key("acme", "admin", None);
    let b = Browser::signed_in(&srv, &admin).await;
    let csrf = b.csrf().await;
    for p in [
        "/console/tasks/%FF",
        "/console/tasks/%FF/fragment",
        "/console/tasks/%FF/live",
    ] {
        let r = b.get(p).await;
        assert_eq!(r.status, 404, "{p}: {}", r.text);
        assert!(r.text.contains(r#"role="alert""#), "{p}: {}", r.text);
    }
    let r = b
        .post(
            "/console/tasks/%FF/actions/cancel",
            &[("csrf", &csrf), ("reason", "x"), ("confirm", "yes")],
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.text.contains(r#"role="alert""#), "{}", r.text);
    // Still the CSRF check first: without the token, 403.
    let r = b
        .post(
            "/console/tasks/%FF/actions/cancel",
            &[("reason", "x"), ("confirm", "yes")],
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.text);
}

/// `next` that a browser resolves outside `/console` (dot segments, plain
/// or percent-encoded) is not followed: the sign-in goes to the overview.
#[tokio::test]
async fn next_with_dot_segments_stays_on_the_console() {
    let srv = Server::in_process().await;
    let b = Browser::new(&srv);
    for next in [
        "/console/../v1/tasks",
        "/console/..",
        "/console/%2e%2e/v1/tasks",
        "/console/.%2E/v1/tasks",
        "/console/%2E./x",
        "/console/tasks/../../x",
        "/console/./../x",
    ] {
        let r = b.sign_in(&srv.keys.acme, Some(next)).await;
        assert_eq!(r.status, 303, "{next}: {}", r.text);
        assert_eq!(r.header("location"), "/console/overview", "{next}");
        let form = b
            .get(&format!(
                "/console/sign-in?{}",
                form_urlencoded::Serializer::new(String::new())
                    .append_pair("next", next)
                    .finish()
            ))
            .await;
        assert!(
            !form.text.contains(r#"name="next""#),
            "{next}: {}",
            form.text
        );
    }
    // A query may hold dots: `/console/tasks?idempotency_key_prefix=..` stays.
    let r = b
        .sign_in(
            &srv.keys.acme,
            Some("/console/tasks?idempotency_key_prefix=.."),
        )
        .await;
    assert_eq!(
        r.header("location"),
        "/console/tasks?idempotency_key_prefix=.."
    );
}

/// The live stream is `Cache-Control: no-store` like every other console
/// answer but the static files (SPEC §4), not the SSE default `no-cache`.
#[tokio::test]
async fn the_live_stream_is_not_stored() {
    let srv = Server::in_process().await;
    let id = s(&srv.new_task(&crate::support::ikey(), PAY, payment(1)).await["id"]);
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    let res = b
        .http
        .get(format!("{}/console/tasks/{id}/live", srv.url))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["cache-control"], "no-store");
}

/// The task page counts attempts the way the limit does: every attempt, then
/// the execute attempts against the execute limit and the reconcile ones
/// apart, so "2 attempts" never reads against a failure's "all 3 execute
/// attempts used".
#[tokio::test]
async fn the_task_page_counts_execute_and_reconcile_attempts_apart() {
    let srv = Server::fast().await;
    let id = reconciling(&srv, "count-1").await;
    let b = Browser::signed_in(&srv, &srv.keys.acme).await;
    let page = b.get(&format!("/console/tasks/{id}")).await;
    assert_eq!(page.status, 200, "{}", page.text);
    assert!(
        page.text
            .contains("2 attempts: 1 of 3 execute, 1 reconcile"),
        "{}",
        page.text
    );
}
