//! `idem-lab bench`: submit throughput and latency over real HTTP, with the raw
//! database baseline measured in the same run at the same concurrency.
//!
//! Baselines (what "writing the key row yourself" costs):
//! - SQLite: `concurrency` threads, each with its own connection and the same
//!   pragmas as idem (WAL, `synchronous=FULL`, `busy_timeout`), inserting the
//!   same row shape (scope, fingerprint, task id, params) as one
//!   `BEGIN IMMEDIATE … COMMIT` transaction per insert.
//! - PostgreSQL: `pgbench -c <concurrency>` running
//!   `INSERT … ON CONFLICT DO NOTHING` of the same row shape.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::{Connection, SendRequest};
use hyper::header::HeaderValue;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpStream;

use crate::server;

/// What a run submits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A fresh idempotency key per request (201 created).
    New,
    /// Repeats of already accepted requests (201 replayed).
    Replay,
    /// Same key, different params (422 conflict).
    Conflict,
    /// Every client submits one key at once (one task, the rest replays).
    Storm,
    /// 70 % new, 20 % replay, 10 % conflict.
    Mixed,
    /// The replay load against a static handler that answers every request
    /// with the bytes of one real replay answer (201, same length): what HTTP
    /// alone costs on this machine, the ceiling any replay rate sits under.
    /// The static server always runs in this process, on loopback, also
    /// with `--url`: against a remote idem it is not a like-for-like ceiling.
    Floor,
}

impl Mode {
    /// Every mode, in the order `--help` lists them.
    pub const ALL: [Mode; 6] = [
        Mode::New,
        Mode::Replay,
        Mode::Conflict,
        Mode::Storm,
        Mode::Mixed,
        Mode::Floor,
    ];

    /// The mode's name, as `--mode` takes it and the output prints it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::New => "new",
            Mode::Replay => "replay",
            Mode::Conflict => "conflict",
            Mode::Storm => "storm",
            Mode::Mixed => "mixed",
            Mode::Floor => "floor",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Mode::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mode `{s}` ({})", names.join(", "))
            })
    }
}

/// Options of a bench run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Modes to run, in order.
    pub modes: Vec<Mode>,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Requests per mode.
    pub count: usize,
    /// A running idem (`None`: an in-process server).
    pub url: Option<String>,
    /// Client key for `url`.
    pub api_key: Option<String>,
    /// Store of the in-process server (`None`: temporary SQLite).
    pub store: Option<String>,
    /// Skip the baseline.
    pub no_baseline: bool,
    /// Show a progress bar.
    pub progress: bool,
    /// Threads the load generator's clients are spread over, each with its
    /// own single-threaded event loop (wrk's `-t`).
    pub load_threads: usize,
}

/// Figures of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeResult {
    /// The mode.
    pub mode: Mode,
    /// `sqlite` or `postgres` (or `remote` with `--url`); `loopback` for
    /// [`Mode::Floor`], whose server is in this process and has no store.
    pub store: String,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Requests sent.
    pub requests: usize,
    /// Requests not answered with the mode's expected status, including those
    /// with no answer at all (status 0: the connection failed, or no answer
    /// came within 120 s).
    pub unexpected: u64,
    /// Answers with the mode's expected status per second.
    pub throughput_rps: f64,
    /// Latency percentiles, ms.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
    /// Raw baseline inserts per second at the same concurrency (same run).
    pub baseline_rps: Option<f64>,
    /// `throughput_rps / baseline_rps`.
    pub ratio: Option<f64>,
    /// Answers by HTTP status.
    pub statuses: BTreeMap<u16, u64>,
}

/// The `params` of request `i`: `{"model": "v2", "prompt": "render frame
/// {i} {salt}", "seed": i, "steps": 30}`, keys in the order a JSON object
/// prints them (sorted), serialized without building a map per request.
#[derive(Serialize)]
struct Params<'a> {
    model: &'static str,
    prompt: PromptText<'a>,
    seed: usize,
    steps: u32,
}

impl Params<'_> {
    /// The params of request `i` with `salt`.
    fn of(i: usize, salt: &str) -> Params<'_> {
        Params {
            model: "v2",
            prompt: PromptText(i, salt),
            seed: i,
            steps: 30,
        }
    }
}

/// `render frame {i} {salt}`, written straight into the body.
struct PromptText<'a>(usize, &'a str);

impl Serialize for PromptText<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("render frame {} {}", self.0, self.1))
    }
}

/// A submit body.
#[derive(Serialize)]
struct SubmitBody<'a> {
    operation: &'static str,
    params: Params<'a>,
}

/// The submit body of request `i`: `{"operation": …, "params": …}`
/// ([`Params::of`]).
///
/// # Errors
/// Only if serialising fails (it does not for these types).
fn submit_body(i: usize, salt: &str) -> Result<Bytes> {
    let body = SubmitBody {
        operation: OPERATION,
        params: Params::of(i, salt),
    };
    let mut buf = Vec::with_capacity(160);
    serde_json::to_writer(&mut buf, &body)?;
    Ok(Bytes::from(buf))
}

/// The operation class every bench request submits.
const OPERATION: &str = "generation.dispatch";

/// One request: its `Idempotency-Key` header (an RFC 9651 sf-string) and its
/// body.
#[derive(Clone)]
struct Rendered {
    key: HeaderValue,
    body: Bytes,
}

impl Rendered {
    /// The request with key `key` and the body of request `i`.
    fn new(key: &str, i: usize, salt: &str) -> Result<Rendered> {
        Ok(Rendered {
            key: HeaderValue::from_str(&format!("\"{key}\""))?,
            body: submit_body(i, salt)?,
        })
    }
}

/// Runs the bench and returns one result per mode.
///
/// # Errors
/// When the server cannot be started or reached, or a baseline fails.
pub async fn run(opts: BenchOptions) -> Result<Vec<ModeResult>> {
    if opts.concurrency == 0 || opts.count == 0 {
        bail!("--concurrency and --count must be positive");
    }
    let config = idem_core::config::Config::bundled()?;
    let (in_process, url, key, store_kind) = match &opts.url {
        Some(url) => {
            let key = opts
                .api_key
                .clone()
                .context("--api-key is required with --url")?;
            (None, url.clone(), key, "remote".to_owned())
        }
        None => {
            let s =
                server::start(opts.store.as_deref(), config, Duration::from_millis(200)).await?;
            let (url, key, kind) = (
                s.url.clone(),
                s.client_key.clone(),
                s.store.kind().to_owned(),
            );
            (Some(s), url, key, kind)
        }
    };
    let target = Target::new(&url, &key)?;
    let baseline = if opts.no_baseline {
        None
    } else {
        match (&in_process, store_kind.as_str()) {
            (Some(s), "sqlite") => Some(sqlite_baseline(opts.concurrency, opts.count, s).await?),
            (_, "postgres") => Some(pg_baseline(
                opts.concurrency,
                opts.count,
                opts.store.as_deref().unwrap_or_default(),
            )?),
            _ => None,
        }
    };
    let mut results = Vec::new();
    for (round, mode) in opts.modes.iter().enumerate() {
        let r = run_mode(&target, *mode, &opts, round, &store_kind, baseline).await?;
        results.push(r);
    }
    drop(in_process);
    Ok(results)
}

/// Where the load goes: the server's address and the parts every request
/// shares, parsed once.
#[derive(Clone)]
struct Target {
    /// `host:port` to connect to.
    addr: String,
    /// `Host` header value.
    host: HeaderValue,
    /// `Authorization: Bearer …` value.
    auth: HeaderValue,
}

impl Target {
    fn new(url: &str, api_key: &str) -> Result<Target> {
        let parsed = reqwest::Url::parse(url).with_context(|| format!("--url {url}"))?;
        if parsed.scheme() != "http" {
            bail!("--url must be http:// (the load generator speaks plain HTTP/1.1)");
        }
        let host = parsed.host_str().context("--url has no host")?;
        let port = parsed.port_or_known_default().unwrap_or(80);
        let addr = format!("{host}:{port}");
        Ok(Target {
            host: HeaderValue::from_str(&addr)?,
            auth: HeaderValue::from_str(&format!("Bearer {api_key}"))?,
            addr,
        })
    }
}

/// One load-generating client's keep-alive HTTP/1.1 connection: hyper's
/// client connection, driven inside the client's own task (no pool, no
/// per-request URL parsing, no hand-off to a connection task), so the load
/// generator takes as little of the shared CPU as it can, as wrk does.
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    conn: Driver,
}

/// The connection future that does the connection's I/O while it is polled.
type Driver = Pin<Box<Connection<TokioIo<TcpStream>, Full<Bytes>>>>;

impl Conn {
    async fn open(target: &Target) -> Result<Conn> {
        let stream = TcpStream::connect(&target.addr)
            .await
            .with_context(|| format!("connecting to {}", target.addr))?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        Ok(Conn {
            sender,
            conn: Box::pin(conn),
        })
    }

    /// Posts the submit `rendered`; returns the HTTP status and the whole
    /// answer.
    async fn submit(&mut self, target: &Target, rendered: &Rendered) -> Result<(u16, Bytes)> {
        let mut req = hyper::Request::new(Full::new(rendered.body.clone()));
        *req.method_mut() = hyper::Method::POST;
        *req.uri_mut() = hyper::Uri::from_static("/v1/tasks");
        let headers = req.headers_mut();
        headers.insert(hyper::header::HOST, target.host.clone());
        headers.insert(hyper::header::AUTHORIZATION, target.auth.clone());
        headers.insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(IDEMPOTENCY_KEY, rendered.key.clone());
        drive(&mut self.conn, self.sender.ready()).await??;
        let res = drive(&mut self.conn, self.sender.send_request(req)).await??;
        let status = res.status().as_u16();
        let answer = drive(&mut self.conn, res.into_body().collect()).await??;
        Ok((status, answer.to_bytes()))
    }
}

/// Runs `fut` while driving `conn`; fails if the connection ends first.
async fn drive<T>(conn: &mut Driver, fut: impl Future<Output = T>) -> Result<T> {
    tokio::pin!(fut);
    tokio::select! {
        biased;
        out = &mut fut => Ok(out),
        end = conn.as_mut() => {
            end?;
            bail!("the server closed the connection")
        }
    }
}

/// The `Idempotency-Key` header's name.
const IDEMPOTENCY_KEY: hyper::header::HeaderName =
    hyper::header::HeaderName::from_static("idempotency-key");

/// Submits `rendered` on `conn`, reconnecting once when the connection was
/// lost; returns the HTTP status and the answer.
async fn submit(
    conn: &mut Option<Conn>,
    target: &Target,
    rendered: &Rendered,
) -> Result<(u16, Bytes)> {
    if let Some(c) = conn.as_mut()
        && let Ok(answer) = c.submit(target, rendered).await
    {
        return Ok(answer);
    }
    *conn = None;
    let mut fresh = Conn::open(target).await?;
    let answer = fresh.submit(target, rendered).await?;
    *conn = Some(fresh);
    Ok(answer)
}

/// The slowest latency the histograms hold, µs (120 s).
pub(crate) const MAX_LATENCY_US: u64 = 120_000_000;

/// How long one request may take before it counts as failed (status 0) and
/// its connection is dropped: a stalled server must not hang the bench. The
/// histograms' upper bound.
const REQUEST_TIMEOUT: Duration = Duration::from_micros(MAX_LATENCY_US);

/// An empty latency histogram (µs, 3 significant digits).
pub(crate) fn latency_histogram() -> Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).map_err(|e| anyhow::anyhow!("{e}"))
}

/// One client's figures: its latency histogram (µs) and its answers by status.
type ClientFigures = (Histogram<u64>, BTreeMap<u16, u64>);

/// What every load-generating client of one mode shares.
#[derive(Clone)]
struct Load {
    target: Target,
    mode: Mode,
    /// The next request number to send (shared by all clients and threads).
    next: Arc<AtomicU64>,
    /// Requests in the mode.
    count: u64,
    /// The seeded requests (replay, conflict, mixed, floor), rendered
    /// before the clock starts: a replay resends a seed's exact bytes.
    seeded: Arc<[Rendered]>,
    /// The seeds' keys with other params (conflict, mixed).
    conflicting: Arc<[Rendered]>,
    /// The one request of [`Mode::Storm`].
    storm: Rendered,
    salt: String,
    bar: indicatif::ProgressBar,
}

impl Load {
    /// Runs `clients` clients on this thread's own single-threaded runtime
    /// until the mode's requests are used up. One event loop per thread, as
    /// wrk's threads: no task moves between threads and no thread wakes
    /// another, which a work-stealing runtime would do on every answer.
    fn run_thread(self, clients: usize) -> Result<Vec<ClientFigures>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let tasks: Vec<_> = (0..clients)
                .map(|_| tokio::spawn(self.clone().client()))
                .collect();
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await??);
            }
            Ok(out)
        })
    }

    /// One client: a keep-alive connection sending the mode's requests one
    /// after another.
    async fn client(self) -> Result<ClientFigures> {
        let Load {
            target,
            mode,
            next,
            count,
            seeded,
            conflicting,
            storm,
            salt,
            bar,
        } = self;
        let mut conn = Some(Conn::open(&target).await?);
        let mut hist = latency_histogram()?;
        let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= count {
                break;
            }
            let i = i as usize;
            let seed = i % seeded.len();
            let fresh = |i: usize| Rendered::new(&format!("new-{salt}-{i}"), i, &salt);
            // A new key's request is rendered here (its key and body exist
            // nowhere yet, as for a client's first try), outside the latency
            // it is timed for; the others are borrowed from what was rendered
            // before the clock started.
            let owned;
            let rendered: &Rendered = match mode {
                Mode::New => {
                    owned = fresh(i)?;
                    &owned
                }
                Mode::Replay | Mode::Floor => &seeded[seed],
                Mode::Conflict => &conflicting[seed],
                Mode::Storm => &storm,
                Mode::Mixed => match i % 10 {
                    0..=6 => {
                        owned = fresh(i)?;
                        &owned
                    }
                    7 | 8 => &seeded[seed],
                    _ => &conflicting[seed],
                },
            };
            let t = Instant::now();
            let status =
                match tokio::time::timeout(REQUEST_TIMEOUT, submit(&mut conn, &target, rendered))
                    .await
                {
                    Ok(Ok((status, _))) => status,
                    Ok(Err(_)) => 0,
                    // The connection may still carry the late answer: start afresh.
                    Err(_) => {
                        conn = None;
                        0
                    }
                };
            let us = u64::try_from(t.elapsed().as_micros())
                .unwrap_or(u64::MAX)
                .max(1);
            let _ = hist.record(us.min(MAX_LATENCY_US));
            *statuses.entry(status).or_default() += 1;
            bar.inc(1);
        }
        Ok((hist, statuses))
    }
}

/// `clients` split as evenly as possible over at most `threads` threads (no
/// thread gets none).
fn split(clients: usize, threads: usize) -> Vec<usize> {
    let threads = threads.clamp(1, clients.max(1));
    (0..threads)
        .map(|t| clients / threads + usize::from(t < clients % threads))
        .collect()
}

async fn run_mode(
    target: &Target,
    mode: Mode,
    opts: &BenchOptions,
    round: usize,
    store_kind: &str,
    baseline: Option<f64>,
) -> Result<ModeResult> {
    let salt = format!("{}-{round}", uuid::Uuid::new_v4().simple());
    let next = Arc::new(AtomicU64::new(0));
    // Seed keys for replay / conflict / mixed / floor.
    let seeds = opts.concurrency.max(16);
    let seed_key = |i: usize| format!("seed-{salt}-{i}");
    let seeded = (0..seeds)
        .map(|i| Rendered::new(&seed_key(i), i, &salt))
        .collect::<Result<Arc<[Rendered]>>>()?;
    let conflicting = (0..seeds)
        .map(|i| Rendered::new(&seed_key(i), i + 1_000_000, &salt))
        .collect::<Result<Arc<[Rendered]>>>()?;
    let storm = Rendered::new(&format!("storm-{salt}"), 0, &salt)?;
    let mut conn = None;
    if matches!(
        mode,
        Mode::Replay | Mode::Conflict | Mode::Mixed | Mode::Floor
    ) {
        for rendered in seeded.iter() {
            let (status, _) = submit(&mut conn, target, rendered).await?;
            if status != 201 {
                bail!("seeding failed with HTTP {status}");
            }
        }
    }
    // The floor answers every request with one real replay answer's bytes.
    let floor = if mode == Mode::Floor {
        let (status, answer) = submit(&mut conn, target, &seeded[0]).await?;
        if status != 201 {
            bail!("the replay the floor answers with got HTTP {status}");
        }
        Some(server::start_floor(answer).await?)
    } else {
        None
    };
    drop(conn);
    let target = match &floor {
        Some(f) => Target::new(&f.url, "floor")?,
        None => target.clone(),
    };
    let bar = if opts.progress {
        let b = indicatif::ProgressBar::new(opts.count as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{msg:>10} {bar:40} {pos}/{len} {per_sec}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(mode.name());
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let started = Instant::now();
    let shape = Load {
        target,
        mode,
        next,
        count: opts.count as u64,
        seeded,
        conflicting,
        storm,
        salt,
        bar: bar.clone(),
    };
    let mut threads = Vec::new();
    for clients in split(opts.concurrency, opts.load_threads.max(1)) {
        let shape = shape.clone();
        threads.push(std::thread::spawn(move || shape.run_thread(clients)));
    }
    // Every thread is joined before an error is returned, so none outlives the run.
    let joined = tokio::task::spawn_blocking(move || {
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .map_err(|_| anyhow::anyhow!("a load generator thread panicked"))?
            })
            .collect::<Vec<Result<Vec<ClientFigures>>>>()
    })
    .await?;
    let mut hist = latency_histogram()?;
    let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
    for clients in joined {
        for (h, s) in clients? {
            hist.add(&h).map_err(|e| anyhow::anyhow!("{e}"))?;
            for (k, v) in s {
                *statuses.entry(k).or_default() += v;
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    drop(floor);
    bar.finish_and_clear();
    let expected: &[u16] = match mode {
        Mode::New | Mode::Replay | Mode::Storm | Mode::Floor => &[201],
        Mode::Conflict => &[422],
        Mode::Mixed => &[201, 422],
    };
    let unexpected: u64 = statuses
        .iter()
        .filter(|(s, _)| !expected.contains(s))
        .map(|(_, n)| n)
        .sum();
    // Only answers with the mode's status count as throughput: a server that
    // died mid-run fails its requests at once, which must not look fast.
    let answered = (opts.count as u64).saturating_sub(unexpected);
    // The raw database baseline means nothing for the HTTP floor.
    let baseline = baseline.filter(|_| mode != Mode::Floor);
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let throughput = answered as f64 / elapsed;
    Ok(ModeResult {
        mode,
        store: if mode == Mode::Floor {
            "loopback".to_owned()
        } else {
            store_kind.to_owned()
        },
        concurrency: opts.concurrency,
        requests: opts.count,
        unexpected,
        throughput_rps: throughput,
        p50_ms: ms(0.5),
        p90_ms: ms(0.9),
        p99_ms: ms(0.99),
        max_ms: hist.max() as f64 / 1000.0,
        baseline_rps: baseline,
        ratio: baseline.map(|b| throughput / b),
        statuses,
    })
}

/// Raw rusqlite inserts of the same row shape with idem's pragmas, one durable
/// transaction per insert, from `concurrency` threads. Returns inserts per second.
async fn sqlite_baseline(concurrency: usize, count: usize, s: &server::InProcess) -> Result<f64> {
    let dir = s
        .sqlite_path
        .as_ref()
        .and_then(|p| p.parent())
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let path = dir.join(format!("baseline-{}.db", uuid::Uuid::new_v4().simple()));
    tokio::task::spawn_blocking(move || -> Result<f64> {
        let setup = open_raw(&path)?;
        setup.execute_batch(
            "CREATE TABLE IF NOT EXISTS raw_keys (tenant TEXT NOT NULL, operation TEXT NOT NULL, idempotency_key TEXT NOT NULL,
               fingerprint TEXT NOT NULL, task_id TEXT NOT NULL, params TEXT NOT NULL, created_at INTEGER NOT NULL,
               PRIMARY KEY (tenant, operation, idempotency_key)) WITHOUT ROWID;",
        )?;
        drop(setup);
        let next = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut threads = Vec::new();
        for _ in 0..concurrency {
            let next = Arc::clone(&next);
            let path = path.clone();
            threads.push(std::thread::spawn(move || -> Result<()> {
                let mut conn = open_raw(&path)?;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    if i >= count {
                        return Ok(());
                    }
                    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                    tx.execute(
                        "INSERT INTO raw_keys VALUES ('bench', 'generation.dispatch', ?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
                        rusqlite::params![
                            format!("raw-{i}"),
                            format!("sha256:{:064x}", i),
                            uuid::Uuid::now_v7().to_string(),
                            serde_json::to_string(&Params::of(i, "raw"))?,
                            i as i64
                        ],
                    )?;
                    tx.commit()?;
                }
            }));
        }
        for t in threads {
            t.join().map_err(|_| anyhow::anyhow!("baseline thread panicked"))??;
        }
        let rps = count as f64 / started.elapsed().as_secs_f64();
        let _ = std::fs::remove_file(&path);
        Ok(rps)
    })
    .await?
}

fn open_raw(path: &std::path::Path) -> Result<rusqlite::Connection> {
    let conn = rusqlite::Connection::open(path)?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 30000;",
    )?;
    Ok(conn)
}

/// `pgbench` at the same client count running an equivalent
/// `INSERT … ON CONFLICT DO NOTHING` of the same row shape. Returns tps.
fn pg_baseline(concurrency: usize, count: usize, url: &str) -> Result<f64> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("insert.sql");
    std::fs::write(
        &script,
        "\\set n random(1, 2000000000)\n\
         INSERT INTO raw_keys VALUES ('bench', 'generation.dispatch', 'raw-' || :client_id || '-' || :n || '-' || random(), \
         'sha256:' || md5(:n::text) || md5(:client_id::text), gen_random_uuid()::text, \
         '{\"prompt\": \"render frame\", \"model\": \"v2\", \"steps\": 30}', :n) ON CONFLICT DO NOTHING;\n",
    )?;
    let setup = std::process::Command::new("psql")
        .args([url, "-q", "-c"])
        .arg(
            "CREATE TABLE IF NOT EXISTS raw_keys (tenant text NOT NULL, operation text NOT NULL, idempotency_key text NOT NULL, \
             fingerprint text NOT NULL, task_id text NOT NULL, params text NOT NULL, created_at bigint NOT NULL, \
             PRIMARY KEY (tenant, operation, idempotency_key))",
        )
        .status()
        .context("running psql (install postgresql-client)")?;
    if !setup.success() {
        bail!("psql could not create the baseline table");
    }
    let per_client = count.div_ceil(concurrency).max(1);
    let out = std::process::Command::new("pgbench")
        .args([
            "-n",
            "-c",
            &concurrency.to_string(),
            "-j",
            "2",
            "-t",
            &per_client.to_string(),
            "-f",
        ])
        .arg(&script)
        .arg(url)
        .output()
        .context("running pgbench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let tps = text
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.trim_start_matches("tps = ").split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .with_context(|| {
            format!(
                "pgbench output had no tps line: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    Ok(tps)
}

/// Renders results as a table.
pub fn render(results: &[ModeResult]) -> String {
    let mut s = format!(
        "{:<9} {:<8} {:>5} {:>7} {:>10} {:>8} {:>8} {:>8} {:>8} {:>10} {:>6} {:>5}\n",
        "mode",
        "store",
        "conc",
        "reqs",
        "req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "base/s",
        "ratio",
        "bad"
    );
    for r in results {
        s.push_str(&format!(
            "{:<9} {:<8} {:>5} {:>7} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10} {:>6} {:>5}\n",
            r.mode.name(),
            r.store,
            r.concurrency,
            r.requests,
            r.throughput_rps,
            r.p50_ms,
            r.p90_ms,
            r.p99_ms,
            r.max_ms,
            r.baseline_rps
                .map_or_else(|| "-".to_owned(), |b| format!("{b:.0}")),
            r.ratio
                .map_or_else(|| "-".to_owned(), |x| format!("{x:.2}")),
            r.unexpected
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// A request's params as a JSON map: the oracle [`Params`] is held to.
    fn params(i: usize, salt: &str) -> Value {
        json!({"prompt": format!("render frame {i} {salt}"), "model": "v2", "steps": 30, "seed": i})
    }

    /// A rendered body is byte for byte the JSON of `{"operation", "params":
    /// params(i)}` (a replay must resend the seed's exact bytes), also for a
    /// salt that needs escaping; the baseline's params are the same JSON.
    #[test]
    fn rendered_bodies_are_the_params_json() {
        for salt in ["0f3a-1", "q\"uote\\back\u{1}slash", "café"] {
            for i in [0, 1, 17, 1_000_000, usize::MAX] {
                let want =
                    serde_json::to_vec(&json!({"operation": OPERATION, "params": params(i, salt)}))
                        .unwrap();
                let got = Rendered::new("k", i, salt).unwrap();
                assert_eq!(got.body, want, "i={i} salt={salt:?}");
                assert_eq!(
                    serde_json::to_string(&Params::of(i, salt)).unwrap(),
                    params(i, salt).to_string()
                );
                assert_eq!(got.key, "\"k\"");
            }
        }
    }

    /// Every mode parses from the name it prints; anything else is refused
    /// with the list of names.
    #[test]
    fn modes_parse_from_the_names_they_print() {
        for m in Mode::ALL {
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
            assert_eq!(m.to_string(), m.name());
        }
        let err = "Replay".parse::<Mode>().unwrap_err();
        assert!(
            err.contains("new, replay, conflict, storm, mixed, floor"),
            "{err}"
        );
    }

    /// Clients are spread over the load threads evenly, none is lost and no
    /// thread is left without one.
    #[test]
    fn clients_split_evenly_over_the_load_threads() {
        assert_eq!(split(32, 1), [32]);
        assert_eq!(split(32, 2), [16, 16]);
        assert_eq!(split(4, 3), [2, 1, 1]);
        assert_eq!(split(2, 8), [1, 1]);
        assert_eq!(split(5, 0), [5]);
        for clients in 1..40 {
            for threads in 0..10 {
                let parts = split(clients, threads);
                assert_eq!(parts.iter().sum::<usize>(), clients);
                assert!(parts.iter().all(|&n| n > 0));
                assert!(parts.iter().max().unwrap_or(&0) - parts.iter().min().unwrap_or(&0) <= 1);
            }
        }
    }
}
