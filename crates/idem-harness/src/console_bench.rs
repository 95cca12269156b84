//! `idem-lab bench-console`: how fast the console's pages answer with a large
//! tenant (target: p99 within 200 ms with 100,000 tasks), against a real
//! `idem serve` child process.
//!
//! The run, in order:
//!
//! 1. **seed**: [`ConsoleBenchOptions::tasks`] submits through the API
//!    (`POST /v1/tasks`, [`SEED_CONCURRENCY`] at a time), alternating
//!    `payment.release` and `generation.dispatch`; then an executor claims
//!    and reports a share of them so every state the overview counts is
//!    present: 15 % `succeeded`, 2 % `failed` (`invalid_input`), 2 %
//!    `reconciling` (`unknown` on a payment), 1 % `cancelled`; the rest stay
//!    `queued`. One payment goes the whole way through reconciliation to
//!    delivery: the task page measured is its page.
//! 2. **measure**: an admin signs in (`POST /console/sign-in`), then each
//!    page is fetched [`ConsoleBenchOptions::rounds`] times, one request at
//!    a time (no other load), and its latency recorded: sign-in form,
//!    overview, search by state, search by idempotency key prefix, a search
//!    page deep in the keyset (after 2,000 tasks), the reconciled payment's
//!    task page and its live fragment. Every answer must be 200.
//!
//! Latency is from sending the request to the end of the body, in µs.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use idem_client::{Client, FailureClass, ReportBody};
use idem_core::model::Role;
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::bench::latency_histogram;
use crate::server;

/// Tenant of the run's keys and tasks.
const TENANT: &str = "bench-console";

/// Submits in flight while seeding.
pub const SEED_CONCURRENCY: usize = 16;

/// The payment class (non-safe: an `unknown` report leads to reconciliation).
const PAYMENT: &str = "payment.release";
/// The generation class (safe to repeat).
const GENERATION: &str = "generation.dispatch";

/// Options of a run.
#[derive(Debug, Clone)]
pub struct ConsoleBenchOptions {
    /// `postgres://…` (a database nothing else uses) or `sqlite://PATH`;
    /// `None`: a temporary SQLite file.
    pub store: Option<String>,
    /// Tasks seeded in the tenant.
    pub tasks: usize,
    /// Requests per page.
    pub rounds: usize,
    /// The `idem` binary whose `serve` is measured.
    pub idem_bin: PathBuf,
    /// Progress lines on stderr.
    pub progress: bool,
}

/// One page's latency over the run.
#[derive(Debug, Clone, Serialize)]
pub struct PageFigures {
    /// What was fetched (a name and the path).
    pub page: String,
    /// Requests.
    pub requests: u64,
    /// Median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
    /// Size of the answer's body, bytes (the last one).
    pub bytes: usize,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct ConsoleBenchReport {
    /// `sqlite` or `postgres`.
    pub store: String,
    /// Tasks in the tenant.
    pub tasks: usize,
    /// Seconds the seeding took.
    pub seed_s: f64,
    /// Per page.
    pub pages: Vec<PageFigures>,
    /// The target: every page's p99 within this, ms.
    pub target_p99_ms: f64,
    /// Whether every page's p99 is within the target.
    pub within_target: bool,
}

/// The console's p99 target with 100,000 tasks in a tenant, ms.
pub const TARGET_P99_MS: f64 = 200.0;

fn progress(on: bool, line: std::fmt::Arguments<'_>) {
    if on {
        let _ = writeln!(std::io::stderr(), "bench-console: {line}");
    }
}

/// Runs the bench.
///
/// # Errors
/// A server that does not start, a refused submit or report while seeding,
/// a refused sign-in, or a page that does not answer 200.
pub async fn run(opts: ConsoleBenchOptions) -> Result<ConsoleBenchReport> {
    if opts.tasks < 100 || opts.rounds == 0 {
        bail!("--tasks must be at least 100 and --rounds at least 1");
    }
    let dir = tempfile::Builder::new()
        .prefix("idem-bench-console-")
        .tempdir()?;
    let store_url = match &opts.store {
        Some(u) => u.clone(),
        None => format!("sqlite://{}", dir.path().join("idem.db").display()),
    };
    let postgres = store_url.starts_with("postgres://") || store_url.starts_with("postgresql://");
    if !postgres && !store_url.starts_with("sqlite://") {
        bail!("--store must start with sqlite://, postgres:// or postgresql://, got `{store_url}`");
    }
    let (client_key, executor_key, admin_key) = {
        let (store, _tmp, _path) = server::open_store(Some(&store_url)).await?;
        let (_, c) = store.create_api_key(TENANT, Role::Client, None).await?;
        let (_, e) = store.create_api_key(TENANT, Role::Executor, None).await?;
        let (_, a) = store.create_api_key(TENANT, Role::Admin, None).await?;
        (c, e, a)
    };
    let args: Vec<OsString> = vec!["--store".into(), store_url.clone().into()];
    let log = dir.path().join("server.log");
    let (_child, url) = server::spawn_serve(&opts.idem_bin, &args, &log, "warn").await?;
    progress(opts.progress, format_args!("server on {url}"));

    let started = Instant::now();
    let client = Client::new(&url, client_key)?.with_timeout(Duration::from_secs(60));
    let executor = Client::new(&url, executor_key)?.with_timeout(Duration::from_secs(60));
    let reconciled = reconciled_payment(&client, &executor).await?;
    seed(&client, opts.tasks, opts.progress).await?;
    settle(&client, &executor, opts.tasks).await?;
    let seed_s = started.elapsed().as_secs_f64();
    progress(
        opts.progress,
        format_args!("seeded {} tasks in {seed_s:.1} s", opts.tasks),
    );

    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(60))
        .build()?;
    let cookie = sign_in(&http, &url, &admin_key).await?;
    let deep = deep_cursor(&http, &url, &cookie).await?;
    let pages: Vec<(&str, String, bool)> = vec![
        ("sign-in form", "/console/sign-in".to_owned(), false),
        ("overview", "/console/overview".to_owned(), true),
        (
            "search: state=queued",
            "/console/tasks?state=queued".to_owned(),
            true,
        ),
        (
            "search: idempotency_key_prefix",
            "/console/tasks?idempotency_key_prefix=seed-00042".to_owned(),
            true,
        ),
        (
            "search: page after 2,000",
            with_query("/console/tasks", &[("state", "queued"), ("cursor", &deep)]),
            true,
        ),
        (
            "task page (reconciled payment)",
            format!("/console/tasks/{reconciled}"),
            true,
        ),
        (
            "task fragment (live update)",
            format!("/console/tasks/{reconciled}/fragment"),
            true,
        ),
    ];
    let mut figures = Vec::new();
    for (name, path, signed_in) in pages {
        let mut h = latency_histogram()?;
        let mut bytes = 0;
        for _ in 0..opts.rounds {
            let mut req = http.get(format!("{url}{path}"));
            if signed_in {
                req = req.header("cookie", &cookie);
            }
            let at = Instant::now();
            let res = req.send().await.with_context(|| format!("GET {path}"))?;
            let status = res.status();
            let body = res.bytes().await?;
            let took = at.elapsed();
            if status != 200 {
                bail!("GET {path} answered {status}");
            }
            bytes = body.len();
            h.record(u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1))?;
        }
        let f = PageFigures {
            page: format!(
                "{name}: {}",
                path.split('?')
                    .next()
                    .unwrap_or(&path)
                    .replace(&reconciled.to_string(), "{id}")
            ),
            requests: h.len(),
            p50_ms: ms(&h, 0.50),
            p99_ms: ms(&h, 0.99),
            max_ms: h.max() as f64 / 1000.0,
            bytes,
        };
        progress(
            opts.progress,
            format_args!("{}: p50 {:.1} ms, p99 {:.1} ms", f.page, f.p50_ms, f.p99_ms),
        );
        figures.push(f);
    }
    let within_target = figures.iter().all(|f| f.p99_ms <= TARGET_P99_MS);
    Ok(ConsoleBenchReport {
        store: if postgres { "postgres" } else { "sqlite" }.to_owned(),
        tasks: opts.tasks,
        seed_s,
        pages: figures,
        target_p99_ms: TARGET_P99_MS,
        within_target,
    })
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Submits `n` tasks, [`SEED_CONCURRENCY`] at a time; keys `seed-NNNNNN`.
async fn seed(client: &Client, n: usize, show: bool) -> Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut set = JoinSet::new();
    for _ in 0..SEED_CONCURRENCY {
        let client = client.clone();
        let next = Arc::clone(&next);
        set.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, anyhow::Error>(());
                }
                let key = format!("seed-{i:06}");
                let (op, params) = if i.is_multiple_of(2) {
                    (
                        PAYMENT,
                        json!({"payee": format!("acct-{}", i % 977), "amount": 1000 + i, "currency": "EUR"}),
                    )
                } else {
                    (
                        GENERATION,
                        json!({"prompt": format!("a lighthouse, take {i}"), "steps": 1 + i % 50}),
                    )
                };
                client
                    .submit(op, &params, &key)
                    .await
                    .with_context(|| format!("submitting {key}"))?;
                if show && i.is_multiple_of(10_000) && i > 0 {
                    progress(true, format_args!("{i} submitted"));
                }
            }
        });
    }
    while let Some(done) = set.join_next().await {
        done??;
    }
    Ok(())
}

/// Claims and reports a share of the seeded tasks so each state is present
/// (see the module's documentation), and cancels 1 % of the queued ones.
async fn settle(client: &Client, executor: &Client, n: usize) -> Result<()> {
    let succeed = n * 15 / 100;
    let fail = n * 2 / 100;
    let unknown = n * 2 / 100;
    // Execute attempts only: the `unknown` reports come last, so no
    // reconcile attempt is claimable while the others are claimed.
    let mut failed = 0usize;
    let phases: [(usize, &[&str]); 2] = [
        (succeed + fail, &[PAYMENT, GENERATION]),
        (unknown, &[PAYMENT]),
    ];
    for (phase, (count, classes)) in phases.into_iter().enumerate() {
        let mut left = count;
        while left > 0 {
            let want = u32::try_from(left.min(100)).unwrap_or(100);
            let attempts = executor
                .claim("bench-console", classes, want, None, 0)
                .await
                .context("claiming seeded tasks")?;
            if attempts.is_empty() {
                bail!("{left} seeded tasks left to claim in phase {phase}, none claimable");
            }
            for a in attempts {
                let report = if phase == 1 {
                    ReportBody::unknown(a.generation)
                } else if a.operation == GENERATION && failed < fail {
                    failed += 1;
                    ReportBody::failed(a.generation, FailureClass::InvalidInput, "prompt refused")
                } else {
                    ReportBody::succeeded(a.generation, json!({"ok": true}))
                        .with_external_txn_id(format!("tx-{}", a.task_id.simple()))
                };
                executor
                    .report(a.id, &report)
                    .await
                    .context("reporting a seeded task")?;
                left = left.saturating_sub(1);
            }
        }
    }
    // 1 % cancelled: keys from the end, which no claim above reached.
    let filter = idem_client::TaskFilter {
        states: vec![idem_client::TaskState::Queued],
        limit: Some(u32::try_from((n / 100).clamp(1, 200)).unwrap_or(200)),
        ..Default::default()
    };
    let page = client
        .list_tasks(&filter, None)
        .await
        .context("listing queued tasks")?;
    for t in page.tasks {
        client
            .cancel(t.id)
            .await
            .context("cancelling a seeded task")?;
    }
    Ok(())
}

/// A payment taken through `unknown`, a reconcile attempt and `committed`
/// to delivery, with a heartbeat carrying usage; its id. Run on an empty
/// queue: the claims find this task only.
async fn reconciled_payment(client: &Client, executor: &Client) -> Result<Uuid> {
    let key = format!("bench-reconciled-{}", Uuid::new_v4().simple());
    let submitted = client
        .submit(
            PAYMENT,
            &json!({"payee": "acct-disputed", "amount": 4200, "currency": "EUR"}),
            &key,
        )
        .await?;
    let id = submitted.task.id;
    for round in 0..2 {
        // The reconcile attempt is due after the class's backoff: wait for it.
        let attempts = executor
            .claim("bench-console-story", &[PAYMENT], 1, None, 20_000)
            .await?;
        let Some(attempt) = attempts.into_iter().find(|a| a.task_id == id) else {
            bail!("the reconciled payment was not claimed (round {round})");
        };
        executor
            .heartbeat(attempt.id, attempt.generation, Some(3))
            .await?;
        let report = if round == 0 {
            ReportBody::unknown(attempt.generation).with_usage(3)
        } else {
            ReportBody::committed(attempt.generation, json!({"payout": "po_4200"}))
                .with_external_txn_id("tx-disputed-4200")
        };
        executor.report(attempt.id, &report).await?;
    }
    Ok(id)
}

/// Signs in with `admin_key`; the `Cookie` header value of the session.
async fn sign_in(http: &reqwest::Client, url: &str, admin_key: &str) -> Result<String> {
    // The form's token is the pre-session cookie's: read it from the form page.
    let form = http
        .get(format!("{url}/console/sign-in"))
        .send()
        .await
        .context("reading the sign-in form")?;
    let token = cookie_value(form.headers(), "idem_sign_in")
        .context("the sign-in form set no idem_sign_in cookie")?;
    let body = format!(
        "{}&{}",
        form_urlencoded_pair("sign_in_token", &token),
        form_urlencoded_pair("api_key", admin_key)
    );
    let res = http
        .post(format!("{url}/console/sign-in"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("cookie", format!("idem_sign_in={token}"))
        .body(body)
        .send()
        .await
        .context("signing in")?;
    if res.status() != 303 {
        bail!("sign-in answered {}", res.status());
    }
    match cookie_value(res.headers(), "idem_session") {
        Some(v) => Ok(format!("idem_session={v}")),
        None => bail!("sign-in set no idem_session cookie"),
    }
}

/// The value `Set-Cookie` gives cookie `name` in `headers`, if any.
fn cookie_value(headers: &reqwest::header::HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next())
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// `name=value`, form-encoded.
fn form_urlencoded_pair(name: &str, value: &str) -> String {
    reqwest::Url::parse_with_params("http://x/", &[(name, value)])
        .ok()
        .and_then(|u| u.query().map(str::to_owned))
        .unwrap_or_default()
}

/// `path` with `pairs` as its query, form-encoded.
fn with_query(path: &str, pairs: &[(&str, &str)]) -> String {
    match reqwest::Url::parse_with_params(&format!("http://x{path}"), pairs) {
        Ok(u) => format!("{}?{}", u.path(), u.query().unwrap_or_default()),
        Err(_) => path.to_owned(),
    }
}

/// The cursor of the search page after 2,000 queued tasks, read from the
/// console's own `rel="next"` links.
async fn deep_cursor(http: &reqwest::Client, url: &str, cookie: &str) -> Result<String> {
    let first = [("state", "queued"), ("limit", "200")];
    let mut path = with_query("/console/tasks", &first);
    let mut cursor = String::new();
    for _ in 0..10 {
        let body = http
            .get(format!("{url}{path}"))
            .header("cookie", cookie)
            .send()
            .await?
            .text()
            .await?;
        let Some(c) = next_cursor(&body) else {
            bail!("the search page has no next link (fewer than 2,000 queued tasks?)");
        };
        cursor = c;
        path = with_query(
            "/console/tasks",
            &[("state", "queued"), ("limit", "200"), ("cursor", &cursor)],
        );
    }
    Ok(cursor)
}

/// The `cursor` query value of the page's `rel="next"` link.
fn next_cursor(html: &str) -> Option<String> {
    let at = html.find("rel=\"next\"")?;
    let tag_start = html[..at].rfind('<')?;
    let tag_end = at + html[at..].find('>')?;
    let tag = &html[tag_start..tag_end];
    let href = tag.split("href=\"").nth(1)?.split('"').next()?;
    let href = href.replace("&amp;", "&");
    let parsed = reqwest::Url::parse(&format!("http://x{href}")).ok()?;
    parsed
        .query_pairs()
        .find(|(k, _)| k == "cursor")
        .map(|(_, v)| v.into_owned())
}

/// The report as a table.
pub fn render(r: &ConsoleBenchReport) -> String {
    let mut s = format!(
        "{} tasks in one tenant on {}, seeded in {:.1} s; one request at a time\n\n{:<58} {:>8} {:>8} {:>8} {:>8} {:>8}\n",
        r.tasks, r.store, r.seed_s, "page", "requests", "p50 ms", "p99 ms", "max ms", "bytes"
    );
    for p in &r.pages {
        s.push_str(&format!(
            "{:<58} {:>8} {:>8.1} {:>8.1} {:>8.1} {:>8}\n",
            p.page, p.requests, p.p50_ms, p.p99_ms, p.max_ms, p.bytes
        ));
    }
    s.push_str(&format!(
        "\nevery p99 within {} ms: {}\n",
        r.target_p99_ms,
        if r.within_target { "yes" } else { "NO" }
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_cursor_reads_the_rel_next_link() {
        let html = r#"<p><a class="x" rel="next" href="/console/tasks?state=queued&amp;cursor=abc%3D%3D">Next</a></p>"#;
        assert_eq!(next_cursor(html).as_deref(), Some("abc=="));
        assert_eq!(next_cursor("<p>no link</p>"), None);
    }
}
