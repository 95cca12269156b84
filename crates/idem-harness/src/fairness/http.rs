//! The starvation rounds over HTTP, against real `idem serve` processes on
//! one store (`idem-lab fairness --http`): one server on a SQLite file,
//! `--instances` servers on a PostgreSQL database.
//!
//! Keys are made in the store before the servers start: a client key for
//! each tenant and the pool's executor key, which serves every tenant
//! (`--role executor --serves all`, SPEC §2.13). The flood goes in as
//! single `POST /v1/tasks` over keep-alive connections,
//! [`FLOOD_CONCURRENCY`] in flight per server; the claim loops, spread over
//! the servers, each claim one attempt (`POST /v1/attempts/claim`, `max` 1,
//! waiting up to [`CLAIM_WAIT_MS`] for work) and report it `succeeded`;
//! leases are counted from the claim answers. With `--values`, the servers'
//! configuration gives the class the fairness key [`FAIRNESS_POINTER`], and
//! the tasks carry `value-a` or `value-b` there.
//!
//! The servers are child processes killed when the run ends, however it
//! ends; a temporary SQLite file goes with its directory. A PostgreSQL
//! database given with `--store` is left as the run leaves it.

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use idem_client::{Client, ReportBody};
use idem_core::config::Config;
use idem_core::fingerprint::JsonPointer;
use idem_core::model::{AllTenants, Role, Serves};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use uuid::Uuid;

use super::{CLASS, FairnessOptions, Tally, rounds, stopped};
use crate::server;

/// Submits in flight per server while flooding.
pub const FLOOD_CONCURRENCY: usize = 16;

/// `wait_ms` of the claim loops' claims: an empty queue holds a claim this
/// long instead of the loop polling it.
pub const CLAIM_WAIT_MS: u64 = 1_000;

/// Where the tasks of a `--values` run carry their fairness key value.
pub const FAIRNESS_POINTER: &str = "/fair";

/// Lease asked for by the claim loops, ms (each lease is reported at once).
const LEASE_MS: u64 = 60_000;

/// The servers' configuration: the bundled one, with the fairness key
/// [`FAIRNESS_POINTER`] on [`CLASS`] when `values`.
///
/// # Errors
/// If the bundled configuration has no [`CLASS`].
pub fn config(values: bool) -> Result<Config> {
    let mut config = Config::bundled()?;
    let class = config
        .operations
        .get_mut(CLASS)
        .context("the bundled configuration has no generation.dispatch class")?;
    if values {
        class.flow.fairness_key = Some(JsonPointer::parse(FAIRNESS_POINTER)?);
    }
    Ok(config)
}

/// A task's params: `n` makes them unique; `value` is the fairness key
/// value (`--values`).
fn params(n: usize, value: Option<&str>) -> Value {
    let mut p = json!({"prompt": format!("fair {n}"), "steps": n});
    if let Some(v) = value {
        p["fair"] = json!(v);
    }
    p
}

fn progress(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "fairness: {line}");
}

/// The rounds (see the module doc): leases before the single task's, per round.
///
/// # Errors
/// A store that is neither SQLite nor PostgreSQL, a server that does not
/// start, a submit, claim or report that fails, a round whose task is not
/// leased within [`super::ROUND_LIMIT`].
pub async fn starvation(o: &FairnessOptions, idem_bin: &Path) -> Result<Vec<u64>> {
    let dir = tempfile::Builder::new()
        .prefix("idem-lab-fairness-")
        .tempdir()?;
    let store_url = match &o.store {
        Some(u) => u.clone(),
        None => format!("sqlite://{}", dir.path().join("idem.db").display()),
    };
    let postgres = store_url.starts_with("postgres://") || store_url.starts_with("postgresql://");
    if !postgres && !store_url.starts_with("sqlite://") {
        bail!("--store must start with sqlite://, postgres:// or postgresql://, got `{store_url}`");
    }
    // One process serves a SQLite file.
    let instances = if postgres { o.instances.max(1) } else { 1 };
    let config_path = dir.path().join("fairness.toml");
    std::fs::write(&config_path, config(o.values)?.to_toml()?)?;

    let run = Uuid::new_v4().simple().to_string();
    let (key_a, key_b, pool_key) = {
        let (store, _tmp, _path) = server::open_store(Some(&store_url)).await?;
        let client = async |tenant: String| -> Result<String> {
            Ok(store.create_api_key(&tenant, Role::Client, None).await?.1)
        };
        let a = client(format!("a-{}", &run[..8])).await?;
        let b = if o.values {
            a.clone()
        } else {
            client(format!("b-{}", &run[..8])).await?
        };
        let (_, pool) = store
            .create_pool_key(
                "pool",
                Role::Executor,
                None,
                Some(Serves::All(AllTenants::All)),
            )
            .await?;
        (a, b, pool)
    };

    // Killed and waited for (reaped) however the run ends, SIGINT and
    // SIGTERM included; dropped (killed) before `dir` is removed should this
    // future itself be dropped.
    let mut children = Vec::with_capacity(instances);
    let setup = Setup {
        store_url: &store_url,
        config_path: &config_path,
        logs: dir.path(),
        instances,
        keys: [&key_a, &key_b, &pool_key],
    };
    let out = tokio::select! {
        out = serve_and_run(o, idem_bin, &setup, &mut children) => out,
        signal = crate::chaos::interrupted() => Err(anyhow::anyhow!("interrupted by {signal}; no figures")),
    };
    for child in &mut children {
        let _ = child.kill().await;
    }
    out
}

/// Where [`serve_and_run`] starts the servers and which keys it uses.
struct Setup<'a> {
    store_url: &'a str,
    config_path: &'a Path,
    /// Directory of the servers' logs.
    logs: &'a Path,
    instances: usize,
    /// Client keys of the flooding tenant and of the single task's tenant
    /// (the same with `--values`), and the pool's executor key.
    keys: [&'a str; 3],
}

/// Starts the servers (into `children`), floods, runs the rounds.
async fn serve_and_run(
    o: &FairnessOptions,
    idem_bin: &Path,
    s: &Setup<'_>,
    children: &mut Vec<tokio::process::Child>,
) -> Result<Vec<u64>> {
    let mut urls = Vec::with_capacity(s.instances);
    for i in 0..s.instances {
        let args: Vec<OsString> = vec![
            "--store".into(),
            s.store_url.into(),
            "--config".into(),
            s.config_path.into(),
        ];
        let log = s.logs.join(format!("server-{i}.log"));
        let (child, url) = server::spawn_serve(idem_bin, &args, &log, "warn")
            .await
            .with_context(|| format!("instance {i}"))?;
        children.push(child);
        progress(format_args!("idem serve {i} on {url}"));
        urls.push(url);
    }
    let timeout = Duration::from_secs(60);
    let clients = |key: &str| -> Result<Vec<Client>> {
        urls.iter()
            .map(|u| Ok(Client::new(u, key)?.with_timeout(timeout)))
            .collect()
    };
    let [key_a, key_b, pool_key] = s.keys;
    let (a, b, pool) = (clients(key_a)?, clients(key_b)?, clients(pool_key)?);
    let (va, vb) = if o.values {
        (Some("value-a"), Some("value-b"))
    } else {
        (None, None)
    };

    let started = Instant::now();
    flood(&a, o.flood, va).await?;
    progress(format_args!(
        "{} tasks submitted in {:.1} s",
        o.flood,
        started.elapsed().as_secs_f64()
    ));

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let loops = (0..o.claimers.max(1))
        .map(|i| {
            let client = pool[i % pool.len()].clone();
            tokio::spawn(claim_loop(i, client, stop.clone(), tally.clone()))
        })
        .collect();
    let out = rounds(&tally, o.rounds, async |round, key| {
        b[round % b.len()]
            .submit(CLASS, &params(1_000_000 + round, vb), key)
            .await
            .with_context(|| format!("round {round}: submitting the single task"))?;
        Ok(())
    })
    .await;
    stopped(&stop, loops, out).await
}

/// Submits `n` tasks through `clients` (spread over them),
/// [`FLOOD_CONCURRENCY`] in flight per client.
async fn flood(clients: &[Client], n: usize, value: Option<&str>) -> Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    let salt = Uuid::new_v4().simple().to_string();
    let mut set = JoinSet::new();
    for i in 0..clients.len() * FLOOD_CONCURRENCY {
        let client = clients[i % clients.len()].clone();
        let (next, salt) = (next.clone(), salt.clone());
        let value = value.map(str::to_owned);
        set.spawn(async move {
            loop {
                let t = next.fetch_add(1, Ordering::Relaxed);
                if t >= n {
                    return Ok::<_, anyhow::Error>(());
                }
                let key = format!("fair-flood-{salt}-{t}");
                client
                    .submit(CLASS, &params(t, value.as_deref()), &key)
                    .await
                    .with_context(|| format!("submitting {key}"))?;
            }
        });
    }
    while let Some(done) = set.join_next().await {
        done??;
    }
    Ok(())
}

/// One claim loop until `stop`: claims one attempt for the pool, counts its
/// lease in `tally` and reports it `succeeded`.
async fn claim_loop(
    i: usize,
    client: Client,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Result<()> {
    let executor_id = format!("fair-{i}");
    while !stop.load(Ordering::Relaxed) {
        let got = client
            .claim(&executor_id, &[CLASS], 1, Some(LEASE_MS), CLAIM_WAIT_MS)
            .await
            .with_context(|| format!("claim loop {i}: claiming"))?;
        for a in got {
            tally.lease(&a.idempotency_key);
            client
                .report(a.id, &ReportBody::succeeded(a.generation, json!({})))
                .await
                .with_context(|| format!("claim loop {i}: reporting"))?;
        }
    }
    Ok(())
}
