//! `idem-lab bench-rates`: rate limits where replays are free (SPEC §8.1).
//!
//! An in-process server whose tenant `bench` may create `per_s` new tasks
//! per second (`[tenants."bench"] submits_per_s`, burst = the rate) gets an
//! open-loop load of `load × per_s` submits per second for `seconds`: 50 %
//! new keys, 40 % replays and 10 % conflicts of keys already accepted. It
//! checks that every replay is 201 `replayed: true`, every conflict 422,
//! every 429 `RATE_LIMITED` carries `Retry-After` (whole seconds >= 1), and
//! measures the rate new keys were admitted at. Then it submits each refused
//! key again (paced at the limit, waiting `Retry-After` when refused again):
//! each must be 201 `replayed: false`, the key never consumed by its refusal.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::server;

/// Options of a `bench-rates` run.
#[derive(Debug, Clone)]
pub struct RateBenchOptions {
    /// The tenant's limit, new tasks per second.
    pub per_s: f64,
    /// Offered load as a multiple of `per_s`.
    pub load: f64,
    /// Length of the load, seconds.
    pub seconds: u64,
    /// Store of the in-process server (`None`: temporary SQLite).
    pub store: Option<String>,
}

/// Figures of a `bench-rates` run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RateBenchResult {
    /// `sqlite` or `postgres`.
    pub store: String,
    /// The limit, new tasks per second (burst = the rate rounded up).
    pub limit_per_s: f64,
    /// The bucket's burst.
    pub burst: u32,
    /// Submits per second offered.
    pub offered_per_s: f64,
    /// Seconds from the first submit sent to the last answer.
    pub elapsed_s: f64,
    /// Submits of new keys sent.
    pub new_sent: u64,
    /// Of those, 201 `replayed: false`.
    pub admitted: u64,
    /// Of those, 429 `RATE_LIMITED`.
    pub refused: u64,
    /// `admitted / elapsed_s`.
    pub admitted_per_s: f64,
    /// `(admitted - burst) / elapsed_s`: the rate after the initial burst.
    pub steady_per_s: f64,
    /// Replays sent / answered 201 `replayed: true`.
    pub replays: (u64, u64),
    /// Conflicts sent / answered 422 `IDEMPOTENCY_CONFLICT`.
    pub conflicts: (u64, u64),
    /// 429s without a `Retry-After` of whole seconds >= 1.
    pub retry_after_missing: u64,
    /// Smallest and largest `Retry-After` seen, seconds.
    pub retry_after_range: (u64, u64),
    /// Refused keys submitted again / answered 201 `replayed: false`.
    pub retried: (u64, u64),
    /// Answers of any other kind (a replay refused, a 5xx, …).
    pub unexpected: u64,
}

/// What a request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    New,
    Replay,
    Conflict,
}

/// One answer: status, `meta.replayed`, `Retry-After` seconds.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: Option<bool>,
    retry_after: Option<u64>,
}

fn params(key: &str, conflicting: bool) -> Value {
    let prompt = if conflicting {
        format!("{key} (changed)")
    } else {
        key.to_owned()
    };
    json!({"prompt": prompt, "model": "m1", "steps": 20})
}

async fn submit(
    http: &reqwest::Client,
    url: &str,
    api_key: &str,
    key: &str,
    conflicting: bool,
) -> Result<Answer> {
    let res = http
        .post(format!("{url}/v1/tasks"))
        .bearer_auth(api_key)
        .header("Idempotency-Key", key)
        .json(&json!({"operation": "generation.dispatch", "params": params(key, conflicting)}))
        .send()
        .await?;
    let status = res.status().as_u16();
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let body: Value = res.json().await.unwrap_or(Value::Null);
    Ok(Answer {
        status,
        replayed: body["meta"]["replayed"].as_bool(),
        retry_after,
    })
}

/// Runs the load, then the retries of the refused keys.
///
/// # Errors
/// When the server cannot start or a request cannot be sent.
pub async fn run(opts: RateBenchOptions) -> Result<RateBenchResult> {
    if !(opts.per_s > 0.0 && opts.load > 0.0 && opts.seconds > 0) {
        bail!("--per-s, --load and --seconds must be positive");
    }
    let mut config = idem_core::config::Config::bundled()?;
    config.tenants.insert(
        "bench".into(),
        idem_core::flow::TenantSettings {
            submits_per_s: Some(opts.per_s),
            ..idem_core::flow::TenantSettings::default()
        },
    );
    let burst = idem_core::flow::RateLimit::new(opts.per_s, None).burst;
    let srv = server::start(opts.store.as_deref(), config, Duration::from_millis(200)).await?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let (url, api_key) = (srv.url.clone(), srv.client_key.clone());
    let mut out = RateBenchResult {
        store: srv.store.kind().to_owned(),
        limit_per_s: opts.per_s,
        burst,
        offered_per_s: opts.per_s * opts.load,
        retry_after_range: (u64::MAX, 0),
        ..RateBenchResult::default()
    };
    // Keys to replay from the start, then a full bucket again.
    let pool: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    for i in 0..10 {
        let key = format!("seed-{i}");
        let a = submit(&http, &url, &api_key, &key, false).await?;
        if a.status != 201 {
            bail!("seeding: {key} answered {}", a.status);
        }
        pool.lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .push(key);
    }
    tokio::time::sleep(Duration::from_secs_f64(f64::from(burst) / opts.per_s + 0.5)).await;

    let total = (opts.per_s * opts.load * opts.seconds as f64).round() as u64;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / (opts.per_s * opts.load)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut handles = Vec::with_capacity(total as usize);
    for i in 0..total {
        tick.tick().await;
        let kind = match i % 10 {
            0..=4 => Kind::New,
            5..=8 => Kind::Replay,
            _ => Kind::Conflict,
        };
        let key = match kind {
            Kind::New => format!("new-{i}"),
            _ => {
                let p = pool.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                p[(i as usize).wrapping_mul(7919) % p.len()].clone()
            }
        };
        let (http, url, api_key, pool) = (http.clone(), url.clone(), api_key.clone(), pool.clone());
        handles.push(tokio::spawn(async move {
            let a = submit(&http, &url, &api_key, &key, kind == Kind::Conflict).await;
            if let Ok(a) = &a
                && kind == Kind::New
                && a.status == 201
                && let Ok(mut p) = pool.lock()
            {
                p.push(key.clone());
            }
            (kind, key, a)
        }));
    }
    let mut refused_keys = Vec::new();
    for h in handles {
        let (kind, key, a) = h.await?;
        let a = a?;
        let note_429 = |out: &mut RateBenchResult| match a.retry_after {
            Some(s) if s >= 1 => {
                out.retry_after_range.0 = out.retry_after_range.0.min(s);
                out.retry_after_range.1 = out.retry_after_range.1.max(s);
            }
            _ => out.retry_after_missing += 1,
        };
        match (kind, a.status, a.replayed) {
            (Kind::New, 201, Some(false)) => {
                out.new_sent += 1;
                out.admitted += 1;
            }
            (Kind::New, 429, _) => {
                out.new_sent += 1;
                out.refused += 1;
                note_429(&mut out);
                refused_keys.push(key);
            }
            (Kind::Replay, 201, Some(true)) => {
                out.replays.0 += 1;
                out.replays.1 += 1;
            }
            (Kind::Conflict, 422, _) => {
                out.conflicts.0 += 1;
                out.conflicts.1 += 1;
            }
            (Kind::New, ..) => {
                out.new_sent += 1;
                out.unexpected += 1;
            }
            (Kind::Replay, ..) => {
                out.replays.0 += 1;
                out.unexpected += 1;
            }
            (Kind::Conflict, ..) => {
                out.conflicts.0 += 1;
                out.unexpected += 1;
            }
        }
    }
    out.elapsed_s = started.elapsed().as_secs_f64();
    out.admitted_per_s = out.admitted as f64 / out.elapsed_s;
    out.steady_per_s = out.admitted.saturating_sub(u64::from(burst)) as f64 / out.elapsed_s;
    if out.retry_after_range.0 == u64::MAX {
        out.retry_after_range.0 = 0;
    }

    // Each refused key again, paced at the limit.
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / opts.per_s));
    let mut handles = Vec::new();
    for key in refused_keys {
        tick.tick().await;
        let (http, url, api_key) = (http.clone(), url.clone(), api_key.clone());
        handles.push(tokio::spawn(async move {
            for _ in 0..20 {
                let a = submit(&http, &url, &api_key, &key, false).await?;
                match a.status {
                    429 => {
                        tokio::time::sleep(Duration::from_secs(a.retry_after.unwrap_or(1))).await;
                    }
                    _ => {
                        return Ok::<_, anyhow::Error>(
                            a.status == 201 && a.replayed == Some(false),
                        );
                    }
                }
            }
            Ok(false)
        }));
    }
    for h in handles {
        out.retried.0 += 1;
        if h.await?.context("retrying a refused key")? {
            out.retried.1 += 1;
        }
    }
    drop(srv);
    Ok(out)
}

/// The figures as a few lines of text.
pub fn render(r: &RateBenchResult) -> String {
    format!(
        "store {store}: limit {limit}/s (burst {burst}), offered {offered}/s for {elapsed:.2} s\n\
         new keys: {new} sent, {admitted} admitted ({aps:.2}/s; {sps:.2}/s after the burst), {refused} refused 429\n\
         replays: {r0} sent, {r1} answered 201 replayed\n\
         conflicts: {c0} sent, {c1} answered 422\n\
         429 without Retry-After: {missing}; Retry-After {ra0}-{ra1} s\n\
         refused keys retried: {t0}, answered 201 replayed:false: {t1}\n\
         unexpected answers: {unexpected}\n",
        store = r.store,
        limit = r.limit_per_s,
        burst = r.burst,
        offered = r.offered_per_s,
        elapsed = r.elapsed_s,
        new = r.new_sent,
        admitted = r.admitted,
        aps = r.admitted_per_s,
        sps = r.steady_per_s,
        refused = r.refused,
        r0 = r.replays.0,
        r1 = r.replays.1,
        c0 = r.conflicts.0,
        c1 = r.conflicts.1,
        missing = r.retry_after_missing,
        ra0 = r.retry_after_range.0,
        ra1 = r.retry_after_range.1,
        t0 = r.retried.0,
        t1 = r.retried.1,
        unexpected = r.unexpected,
    )
}
