//! The console's router merged with the API's, as `idem serve` runs them,
//! driven in-process (`oneshot`) over a SQLite store: a sign-in is refused,
//! changing nothing, without the pre-session token, from another origin or
//! from another site; a sign-in with another key asks before it replaces a
//! live session; every page shows the hidden characters of its data as
//! escapes, never raw.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode, header};
use http_body_util::BodyExt;
use idem_core::config::Config;
use idem_core::model::Role;
use idem_store::{Clock, Guarded, Store};
use idem_store_sqlite::{SqliteBackend, SqliteOptions};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::shown::is_hidden;
use crate::{ConsoleConfig, router};

const HOST: &str = "console.test";
const ORIGIN: &str = "http://console.test";

struct App {
    router: Router,
    store: Store,
}

/// An answer: status, headers, body text.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    /// The value `Set-Cookie` gives cookie `name`, if it sets it.
    fn cookie(&self, name: &str) -> Option<String> {
        self.headers
            .get_all(header::SET_COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(|v| cookie::Cookie::parse(v.to_owned()).ok())
            .find(|c| c.name() == name)
            .map(|c| c.value().to_owned())
    }

    /// The `value` of the hidden input `name` of the page.
    fn input(&self, name: &str) -> Option<String> {
        let at = self.body.find(&format!("name=\"{name}\" value=\""))?;
        let rest = &self.body[at..];
        let start = rest.find("value=\"")? + 7;
        let len = rest[start..].find('"')?;
        Some(rest[start..start + len].replace("&amp;", "&"))
    }
}

impl App {
    async fn new() -> App {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = SqliteOptions {
            clock: Clock::test(),
        };
        let backend = SqliteBackend::open(dir.path().join("idem.db"), options).expect("store");
        let store = Store::new(Guarded::new(backend, dir));
        let state = idem_http::AppState::new(store.clone(), Config::bundled().expect("config"));
        let router =
            idem_http::router(state.clone()).merge(router(state, ConsoleConfig::default()));
        App { router, store }
    }

    async fn key(&self, tenant: &str, role: Role) -> (uuid::Uuid, String) {
        let (k, plain) = self
            .store
            .create_api_key(tenant, role, None)
            .await
            .expect("key");
        (k.id, plain)
    }

    async fn send(&self, req: Request<Body>) -> Answer {
        let res = self.router.clone().oneshot(req).await.expect("answer");
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = res.into_body().collect().await.expect("body").to_bytes();
        Answer {
            status,
            headers,
            body: String::from_utf8(bytes.to_vec()).expect("UTF-8"),
        }
    }

    async fn get(&self, path: &str, cookies: &str) -> Answer {
        let req = Request::get(path)
            .header(header::HOST, HOST)
            .header(header::COOKIE, cookies)
            .body(Body::empty())
            .unwrap();
        self.send(req).await
    }

    /// A form post of `pairs` with `cookies` and the extra `headers`.
    async fn post(
        &self,
        path: &str,
        cookies: &str,
        headers: &[(&str, &str)],
        pairs: &[(&str, &str)],
    ) -> Answer {
        let mut body = form_urlencoded::Serializer::new(String::new());
        body.extend_pairs(pairs);
        let mut req = Request::post(path)
            .header(header::HOST, HOST)
            .header(header::COOKIE, cookies)
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        self.send(req.body(Body::from(body.finish())).unwrap())
            .await
    }

    /// A call of the public API with `key`.
    async fn api(
        &self,
        method: &str,
        path: &str,
        key: &str,
        body: Value,
        ikey: Option<&str>,
    ) -> Value {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, HOST)
            .header(header::AUTHORIZATION, format!("Bearer {key}"))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(k) = ikey {
            req = req.header("idempotency-key", k);
        }
        let a = self
            .send(req.body(Body::from(body.to_string())).unwrap())
            .await;
        assert!(
            a.status.is_success(),
            "{method} {path}: {} {}",
            a.status,
            a.body
        );
        serde_json::from_str(&a.body).expect("JSON")
    }

    /// The sign-in form's pre-session cookie value (also the form's token).
    async fn form_token(&self, cookies: &str) -> String {
        let a = self.get("/console/sign-in", cookies).await;
        assert_eq!(a.status, StatusCode::OK);
        let cookie = a.cookie("idem_sign_in").expect("pre-session cookie");
        assert_eq!(a.input("sign_in_token").as_deref(), Some(cookie.as_str()));
        cookie
    }

    /// Signs in with `plain` as a browser with no session: the session token.
    async fn sign_in(&self, plain: &str) -> String {
        let t = self.form_token("").await;
        let a = self
            .post(
                "/console/sign-in",
                &format!("idem_sign_in={t}"),
                &[("origin", ORIGIN), ("sec-fetch-site", "same-origin")],
                &[("sign_in_token", &t), ("api_key", plain)],
            )
            .await;
        assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);
        a.cookie("idem_session").expect("session cookie")
    }

    /// The key id of the live session `token`, if it is live.
    async fn session_key(&self, token: &str) -> Option<uuid::Uuid> {
        self.store
            .console_session(token)
            .await
            .expect("lookup")
            .map(|(_, k)| k.id)
    }
}

#[tokio::test]
async fn a_sign_in_with_the_forms_token_from_the_console_itself_signs_in() {
    let app = App::new().await;
    let (id, plain) = app.key("acme", Role::Client).await;
    let t = app.form_token("").await;
    // The same cookie keeps the same token (several open forms agree).
    assert_eq!(app.form_token(&format!("idem_sign_in={t}")).await, t);
    let a = app
        .post(
            "/console/sign-in",
            &format!("idem_sign_in={t}"),
            &[("origin", ORIGIN), ("sec-fetch-site", "same-origin")],
            &[("sign_in_token", &t), ("api_key", &plain)],
        )
        .await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    let session = a.cookie("idem_session").expect("session");
    assert_eq!(app.session_key(&session).await, Some(id));
    assert_eq!(
        a.cookie("idem_sign_in").as_deref(),
        Some(""),
        "token used up"
    );
    // A browser that sends no Origin (older ones, on same-origin posts) is
    // judged by the token.
    let t = app.form_token("").await;
    let a = app
        .post(
            "/console/sign-in",
            &format!("idem_sign_in={t}"),
            &[],
            &[("sign_in_token", &t), ("api_key", &plain)],
        )
        .await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
}

/// A forged sign-in: what it lacks, its cookies, headers and form.
type Forged<'a> = (
    &'a str,
    String,
    Vec<(&'a str, &'a str)>,
    Vec<(&'a str, &'a str)>,
);

#[tokio::test]
async fn forged_sign_ins_are_refused_and_the_live_session_stays() {
    let app = App::new().await;
    let (victim_id, victim) = app.key("victim", Role::Admin).await;
    let (_, attacker) = app.key("attacker", Role::Client).await;
    let session = app.sign_in(&victim).await;
    let t = app.form_token(&format!("idem_session={session}")).await;
    let with_token = format!("idem_session={session}; idem_sign_in={t}");
    let mine = "B".repeat(43);
    let cases: [Forged; 6] = [
        (
            "no form token",
            with_token.clone(),
            vec![("origin", ORIGIN)],
            vec![("api_key", &attacker)],
        ),
        (
            "no pre-session cookie",
            format!("idem_session={session}"),
            vec![("origin", ORIGIN)],
            vec![("sign_in_token", &t), ("api_key", &attacker)],
        ),
        (
            "a token of another cookie",
            with_token.clone(),
            vec![("origin", ORIGIN)],
            vec![("sign_in_token", &mine), ("api_key", &attacker)],
        ),
        (
            "another port's origin",
            with_token.clone(),
            vec![("origin", "http://console.test:8081")],
            vec![("sign_in_token", &t), ("api_key", &attacker)],
        ),
        (
            "a same-site page",
            with_token.clone(),
            vec![("sec-fetch-site", "same-site")],
            vec![("sign_in_token", &t), ("api_key", &attacker)],
        ),
        (
            "a cross-site page",
            with_token.clone(),
            vec![("sec-fetch-site", "cross-site")],
            vec![("sign_in_token", &t), ("api_key", &attacker)],
        ),
    ];
    for (what, cookies, headers, pairs) in cases {
        let a = app
            .post("/console/sign-in", &cookies, &headers, &pairs)
            .await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{what}");
        assert!(a.body.contains("id=\"sign-in\""), "{what}: the form again");
        assert!(a.input("sign_in_token").is_some(), "{what}: with a token");
        assert_eq!(a.cookie("idem_session"), None, "{what}: no session cookie");
        assert_eq!(app.session_key(&session).await, Some(victim_id), "{what}");
    }
}

#[tokio::test]
async fn a_sign_in_with_another_key_asks_before_it_replaces_the_session() {
    let app = App::new().await;
    let (first_id, first) = app.key("first", Role::Admin).await;
    let (second_id, second) = app.key("second", Role::Client).await;
    let session = app.sign_in(&first).await;
    let t = app.form_token(&format!("idem_session={session}")).await;
    let cookies = format!("idem_session={session}; idem_sign_in={t}");
    let post = |pairs: Vec<(&'static str, String)>| {
        let cookies = cookies.clone();
        let app = &app;
        async move {
            let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
            app.post("/console/sign-in", &cookies, &[("origin", ORIGIN)], &pairs)
                .await
        }
    };
    let base = vec![("sign_in_token", t.clone()), ("api_key", second.clone())];
    let asked = post(base.clone()).await;
    assert_eq!(asked.status, StatusCode::OK);
    assert!(
        asked.body.contains("id=\"replace-session\""),
        "{}",
        asked.body
    );
    for named in [
        "first",
        "second",
        &first_id.to_string(),
        &second_id.to_string(),
    ] {
        assert!(asked.body.contains(named), "the page names {named}");
    }
    assert_eq!(asked.cookie("idem_session"), None);
    assert_eq!(
        app.session_key(&session).await,
        Some(first_id),
        "still signed in"
    );
    // A replace token of another session or for another key asks again.
    let other = crate::session::replace_token("another-session", second_id);
    let wrong_key = crate::session::replace_token(&session, first_id);
    for bad in [other, wrong_key] {
        let mut pairs = base.clone();
        pairs.push(("replace", bad));
        let a = post(pairs).await;
        assert!(a.body.contains("id=\"replace-session\""));
        assert_eq!(app.session_key(&session).await, Some(first_id));
    }
    // The confirmation's own form replaces it.
    let mut pairs = base.clone();
    pairs.push(("replace", asked.input("replace").expect("replace token")));
    let done = post(pairs).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);
    let new = done.cookie("idem_session").expect("new session");
    assert_eq!(app.session_key(&new).await, Some(second_id));
    assert_eq!(app.session_key(&session).await, None, "the old one ended");
    // The same key again replaces its own session without asking.
    let t = app.form_token(&format!("idem_session={new}")).await;
    let again = app
        .post(
            "/console/sign-in",
            &format!("idem_session={new}; idem_sign_in={t}"),
            &[("origin", ORIGIN)],
            &[("sign_in_token", &t), ("api_key", &second)],
        )
        .await;
    assert_eq!(again.status, StatusCode::SEE_OTHER);
}

/// The hidden characters put into every field a page shows: all of them
/// where the API takes any character (params, results, messages), the
/// non-control ones where it refuses control characters (executor ids,
/// external transaction ids, reasons).
const ANY: &str = "a\u{0}\u{1}\u{9}\u{a}\u{1b}\u{7f}\u{85}\u{9f}\u{ad}\u{61c}\u{200b}\u{200d}\u{200e}\u{200f}\u{202a}\u{202e}\u{2028}\u{2029}\u{2066}\u{2069}\u{feff}z";
const NO_CONTROL: &str =
    "a\u{ad}\u{61c}\u{200b}\u{200f}\u{202a}\u{202e}\u{2028}\u{2029}\u{2066}\u{2069}\u{feff}z";

fn assert_shown(what: &str, a: &Answer) {
    assert_eq!(a.status, StatusCode::OK, "{what}: {}", a.body);
    let raw: std::collections::BTreeSet<String> = a
        .body
        .chars()
        .filter(|c| is_hidden(*c))
        .map(|c| format!("U+{:04X}", u32::from(c)))
        .collect();
    assert!(raw.is_empty(), "{what} shows raw {raw:?}");
    assert!(a.body.contains("⟨U+202E⟩"), "{what} shows the escape");
}

#[tokio::test]
async fn every_page_shows_hidden_characters_as_escapes() {
    let app = App::new().await;
    let tenant = format!("acme{NO_CONTROL}");
    let (_, admin) = app.key(&tenant, Role::Admin).await;
    let (_, exec) = app.key(&tenant, Role::Executor).await;
    let session = app.sign_in(&admin).await;
    let cookies = format!("idem_session={session}");

    let params = json!({"prompt": ANY, ANY: NO_CONTROL});
    let task = app
        .api(
            "POST",
            "/v1/tasks",
            &admin,
            json!({"operation": "generation.dispatch", "params": params}),
            Some("esc-1"),
        )
        .await;
    let id = task["task"]["id"].as_str().unwrap().to_owned();
    let claim = json!({"executor_id": NO_CONTROL, "operations": ["generation.dispatch"], "max": 1});
    let a1 = app
        .api("POST", "/v1/attempts/claim", &exec, claim.clone(), None)
        .await;
    let a1 = &a1["attempts"][0];
    let report = json!({"generation": a1["generation"], "outcome": "failed", "failure_class": "transient", "message": ANY});
    app.api(
        "POST",
        &format!("/v1/attempts/{}/report", a1["id"].as_str().unwrap()),
        &exec,
        report,
        None,
    )
    .await;
    // Past the retry's backoff.
    app.store
        .clock()
        .advance(std::time::Duration::from_secs(10));
    app.store.sweep(100).await.expect("sweep");
    let a2 = app
        .api("POST", "/v1/attempts/claim", &exec, claim.clone(), None)
        .await;
    let a2 = &a2["attempts"][0];
    let report = json!({"generation": a2["generation"], "outcome": "succeeded", "result": {ANY: ANY}, "external_txn_id": NO_CONTROL});
    app.api(
        "POST",
        &format!("/v1/attempts/{}/report", a2["id"].as_str().unwrap()),
        &exec,
        report,
        None,
    )
    .await;
    let queued = app
        .api("POST", "/v1/tasks", &admin, json!({"operation": "payment.release", "params": {"payee": ANY, "amount": 1250, "currency": "EUR"}}), Some("esc-2"))
        .await;
    let queued_id = queued["task"]["id"].as_str().unwrap().to_owned();
    app.api(
        "POST",
        &format!("/v1/tasks/{queued_id}/cancel"),
        &admin,
        json!({"reason": NO_CONTROL}),
        None,
    )
    .await;

    let txn = form_urlencoded::byte_serialize(NO_CONTROL.as_bytes()).collect::<String>();
    for path in [
        format!("/console/tasks/{id}"),
        format!("/console/tasks/{id}/fragment"),
        format!("/console/tasks/{queued_id}"),
        "/console/tasks?idempotency_key_prefix=esc".to_owned(),
        format!("/console/tasks?external_txn_id={txn}"),
        "/console/overview".to_owned(),
    ] {
        assert_shown(&path, &app.get(&path, &cookies).await);
    }
}

/// The text of the element with `id` in `html` up to its first closing
/// `</dd>` or `</p>`, tags left out (enough for the verdict's one-line
/// fields).
fn field_text(html: &str, id: &str) -> String {
    let at = html
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id}"));
    let start = at + html[at..].find('>').expect("tag end") + 1;
    let rest = &html[start..];
    let end = ["</dd>", "</p>"]
        .iter()
        .filter_map(|e| rest.find(e))
        .min()
        .expect("closing tag");
    let mut out = String::new();
    let mut in_tag = false;
    for c in rest[..end].chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&#39;", "'")
}

/// A cancellation that lost to delivery: the verdict states one charge and
/// says the fee is that same charge; the cancellation names no second
/// amount; the search and the task page count the attempts alike.
#[tokio::test]
async fn the_verdict_of_a_cancellation_that_lost_to_delivery_names_one_charge() {
    let app = App::new().await;
    let (_, admin) = app.key("acme", Role::Admin).await;
    let (_, exec) = app.key("acme", Role::Executor).await;
    let session = app.sign_in(&admin).await;
    let cookies = format!("idem_session={session}");
    let params = json!({"payee": "acct-1", "amount": 100, "currency": "EUR"});
    let task = app
        .api(
            "POST",
            "/v1/tasks",
            &admin,
            json!({"operation": "payment.release", "params": params}),
            Some("late-1"),
        )
        .await;
    let id = task["task"]["id"].as_str().unwrap().to_owned();
    let claim = json!({"executor_id": "w1", "operations": ["payment.release"], "max": 1});
    let a = app
        .api("POST", "/v1/attempts/claim", &exec, claim, None)
        .await;
    let a = &a["attempts"][0];
    app.api(
        "POST",
        &format!("/v1/tasks/{id}/cancel"),
        &admin,
        json!({"reason": "client asked"}),
        None,
    )
    .await;
    let report = json!({"generation": a["generation"], "outcome": "succeeded", "result": {"ok": true}, "external_txn_id": "po_C"});
    let done = app
        .api(
            "POST",
            &format!("/v1/attempts/{}/report", a["id"].as_str().unwrap()),
            &exec,
            report,
            None,
        )
        .await;
    assert_eq!(done["task"]["cancellation"]["status"], "too_late");
    let charge = done["task"]["delivery"]["charge"].as_i64().unwrap();
    assert_eq!(done["task"]["cancellation"]["fee"].as_i64(), Some(charge));

    let page = app.get(&format!("/console/tasks/{id}"), &cookies).await;
    assert_eq!(page.status, StatusCode::OK);
    let html = &page.body;
    let answer = field_text(html, "verdict-answer");
    assert!(answer.starts_with("Charged once: "), "{answer}");
    assert!(answer.contains(", po_C, "), "{answer}");
    let next = field_text(html, "verdict-next");
    assert!(
        next.contains("Its fee is that same charge (") && next.ends_with("not a second charge."),
        "{next}"
    );
    assert_eq!(
        field_text(html, "verdict-effects"),
        "1 execute attempt started: the provider was asked 1 time; 1 delivered"
    );
    let fee = html.find("class=\"fee\"").expect("the fee");
    let fee_text = &html[fee..fee + html[fee..].find("</dd>").unwrap()];
    let fee_text = &fee_text[fee_text.find('>').unwrap() + 1..];
    assert!(
        fee_text.contains("the delivery&#39;s charge above, not a second charge")
            || fee_text.contains("the delivery's charge above, not a second charge"),
        "{fee_text}"
    );
    assert!(!fee_text.contains(&charge.to_string()), "{fee_text}");
    // The verdict comes first, the contract collapsed after the timeline.
    let verdict = html.find("id=\"verdict\"").unwrap();
    let timeline = html.find("id=\"timeline\"").unwrap();
    let contract = html.find("<details id=\"contract\"").unwrap();
    assert!(verdict < timeline && timeline < contract);

    let count = field_text(html, "attempt-count");
    let search = app
        .get("/console/tasks?idempotency_key_prefix=late-", &cookies)
        .await;
    let row = search
        .body
        .find("class=\"attempts\"")
        .expect("attempts cell");
    let cell = &search.body[row..];
    let cell = &cell[cell.find('>').unwrap() + 1..cell.find("</td>").unwrap()];
    assert_eq!(cell, "1 attempt: 1 of 3 execute");
    assert!(count.starts_with(cell), "{count} vs {cell}");
}
