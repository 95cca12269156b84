//! An idem server inside this process, on a temporary SQLite file or a
//! PostgreSQL URL, for `idem-lab bench` and `idem-lab demo`; and [`spawn_serve`], an
//! `idem serve` child process, for `idem-lab chaos` and `idem-lab bench-waiters`.

use std::ffi::OsString;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use idem_core::config::Config;
use idem_core::model::Role;
use idem_store::Store;
use tokio::sync::oneshot;

/// A running in-process server. Dropping it stops the server and removes the temporary store.
pub struct InProcess {
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    /// The store behind it.
    pub store: Store,
    /// A client key of tenant `bench`.
    pub client_key: String,
    /// An executor key of tenant `bench`.
    pub executor_key: String,
    /// Where a temporary SQLite store lives (`None` for PostgreSQL).
    pub sqlite_path: Option<std::path::PathBuf>,
    _dir: Option<tempfile::TempDir>,
    stop: Option<oneshot::Sender<()>>,
    /// The server's own runtime (see [`start`]).
    runtime: ServerRuntime,
}

/// The server's runtime, shut down without blocking when dropped: dropping a
/// tokio runtime blocks, which an async caller may not do (tokio panics), and
/// [`start`] may be dropped or fail inside one. The server's tasks are dropped
/// without waiting (the SQLite writer thread ends when the last handle to its
/// queue is gone).
struct ServerRuntime(Option<tokio::runtime::Runtime>);

impl ServerRuntime {
    /// A multi-threaded runtime (one worker per core, as `idem serve`) whose
    /// threads are named `name`, and a handle to spawn on it.
    fn build(name: &str) -> Result<(ServerRuntime, tokio::runtime::Handle)> {
        let built = tokio::runtime::Builder::new_multi_thread()
            .thread_name(name)
            .enable_all()
            .build()
            .with_context(|| format!("building the {name} runtime"))?;
        let handle = built.handle().clone();
        Ok((ServerRuntime(Some(built)), handle))
    }
}

impl Drop for ServerRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Opens `store_url` (`sqlite://PATH`, `postgres://…`) or, when `None`, a new
/// temporary SQLite store.
///
/// # Errors
/// When the store cannot be opened.
pub async fn open_store(
    store_url: Option<&str>,
) -> Result<(Store, Option<tempfile::TempDir>, Option<std::path::PathBuf>)> {
    match store_url {
        None => {
            let dir = tempfile::tempdir()?;
            let path = dir.path().join("idem.db");
            // Opened in this task, not on the blocking pool: were this future
            // dropped while an open ran there, the directory would be removed
            // and then made again by the open, and left behind (breaker).
            // Opening a new file takes a few milliseconds.
            let store = idem_store_sqlite::open(&path, Default::default())?;
            Ok((store, Some(dir), Some(path)))
        }
        Some(url) if url.starts_with("sqlite://") => {
            let path = std::path::PathBuf::from(url.trim_start_matches("sqlite://"));
            let p = path.clone();
            let store =
                tokio::task::spawn_blocking(move || idem_store_sqlite::open(p, Default::default()))
                    .await??;
            Ok((store, None, Some(path)))
        }
        Some(url) => {
            let store =
                idem_store_postgres::connect(url, idem_store_postgres::PgOptions::default())
                    .await
                    .context("connecting to PostgreSQL")?;
            Ok((store, None, None))
        }
    }
}

/// Starts a server with `config` on `store_url` (see [`open_store`]), with a
/// sweeper every `sweep`: [`idem_server::App`] with `idem serve`'s limits and
/// drain, without the console.
///
/// The server runs on its own multi-threaded tokio runtime (one worker per
/// core, as `idem serve`), not on the caller's: a load generator in this
/// process then competes with it for the cores as a separate client process
/// would, instead of sharing its task queues.
///
/// # Errors
/// When the runtime cannot be built, the store cannot be opened or the port bound.
pub async fn start(store_url: Option<&str>, config: Config, sweep: Duration) -> Result<InProcess> {
    let (runtime, handle) = ServerRuntime::build("idem-server")?;
    let store_url = store_url.map(str::to_owned);
    let (stop, stopped) = oneshot::channel::<()>();
    let mut server: InProcess = handle
        .spawn(async move {
            let (store, dir, sqlite_path) = open_store(store_url.as_deref()).await?;
            let (_, client_key) = store.create_api_key("bench", Role::Client, None).await?;
            let (_, executor_key) = store.create_api_key("bench", Role::Executor, None).await?;
            let options = idem_server::Options {
                sweep_interval: sweep,
                console: None,
                ..idem_server::Options::default()
            };
            let app = idem_server::App::build(store.clone(), config, options).await?;
            let url = app.url();
            tokio::spawn(app.run(async move {
                let _ = stopped.await;
            }));
            Ok::<_, anyhow::Error>(InProcess {
                url,
                store,
                client_key,
                executor_key,
                sqlite_path,
                _dir: dir,
                stop: None,
                runtime: ServerRuntime(None),
            })
        })
        .await
        .context("the server's runtime stopped")??;
    server.stop = Some(stop);
    server.runtime = runtime;
    Ok(server)
}

/// A running static HTTP server for the bench's `floor` mode. Dropping it
/// stops it.
pub struct Floor {
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    stop: Option<oneshot::Sender<()>>,
    _runtime: ServerRuntime,
}

impl Drop for Floor {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Starts axum, on its own runtime built as [`start`] builds the server's,
/// with one route, `POST /v1/tasks`, that reads the body and answers 201
/// `application/json` with `answer`: HTTP/1.1 with nothing of idem behind it.
///
/// # Errors
/// When the runtime cannot be built or the port bound.
pub async fn start_floor(answer: axum::body::Bytes) -> Result<Floor> {
    use axum::http::{StatusCode, header};
    let (runtime, handle) = ServerRuntime::build("idem-floor")?;
    let (stop, stopped) = oneshot::channel::<()>();
    let url = handle
        .spawn(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let url = format!("http://{}", listener.local_addr()?);
            let app = axum::Router::new().route(
                "/v1/tasks",
                axum::routing::post(move |_body: axum::body::Bytes| {
                    let answer = answer.clone();
                    async move {
                        (
                            StatusCode::CREATED,
                            [(header::CONTENT_TYPE, "application/json")],
                            answer,
                        )
                    }
                }),
            );
            tokio::spawn(async move {
                // idem's own connection loop and limits: the floor differs
                // from idem only by what is behind the route.
                let _ = idem_http::serve(
                    listener,
                    app,
                    idem_http::ServeLimits::with_defaults(0),
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await;
            });
            Ok::<_, anyhow::Error>(url)
        })
        .await
        .context("the floor server's runtime stopped")??;
    Ok(Floor {
        url,
        stop: Some(stop),
        _runtime: runtime,
    })
}

/// How long [`spawn_serve`] waits for a child to print its address.
pub const SPAWN_TIMEOUT: Duration = Duration::from_secs(30);

/// How [`spawn_serve_in`] starts `idem serve`.
#[derive(Debug, Clone, Copy)]
pub struct ServeCommand<'a> {
    /// The `idem` binary.
    pub bin: &'a Path,
    /// A program and its arguments that run `bin` (for example
    /// `ip netns exec NAME`, which execs it, so the child's pid is the
    /// server's); empty: `bin` itself.
    pub prefix: &'a [String],
    /// `--listen` address, e.g. `127.0.0.1:0`.
    pub listen: &'a str,
    /// Variables set for the child (for example `LD_PRELOAD`).
    pub env: &'a [(String, String)],
}

/// Starts `bin serve --listen 127.0.0.1:0` with `args` after it, no `IDEM_*`
/// variable of this process, `RUST_LOG` set to `rust_log`, stderr appended
/// to `log` and stdout read until it prints `idem listening on URL`.
/// Returns the child (killed with SIGKILL when dropped) and its base URL,
/// e.g. `http://127.0.0.1:41234`.
///
/// # Errors
/// When the child cannot be started, or prints no address within
/// [`SPAWN_TIMEOUT`] (the error ends with the last 15 lines of `log`).
pub async fn spawn_serve(
    bin: &Path,
    args: &[OsString],
    log: &Path,
    rust_log: &str,
) -> Result<(tokio::process::Child, String)> {
    let how = ServeCommand {
        bin,
        prefix: &[],
        listen: "127.0.0.1:0",
        env: &[],
    };
    spawn_serve_in(how, args, log, rust_log).await
}

/// [`spawn_serve`] started as `how` says: through a prefix command, on
/// another listen address, with more environment variables.
///
/// # Errors
/// As [`spawn_serve`].
pub async fn spawn_serve_in(
    how: ServeCommand<'_>,
    args: &[OsString],
    log: &Path,
    rust_log: &str,
) -> Result<(tokio::process::Child, String)> {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let bin = how.bin;
    let mut cmd = match how.prefix.split_first() {
        Some((program, rest)) => {
            let mut c = tokio::process::Command::new(program);
            c.args(rest).arg(bin);
            c
        }
        None => tokio::process::Command::new(bin),
    };
    cmd.arg("serve").arg("--listen").arg(how.listen).args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("IDEM_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(how.env.iter().map(|(k, v)| (k, v)));
    cmd.env("RUST_LOG", rust_log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("no stdout of the server")?;
    let mut lines = BufReader::new(stdout).lines();
    let found = tokio::time::timeout(SPAWN_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(url) = line.strip_prefix("idem listening on ") {
                return Some(url.trim().to_owned());
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(url)) => {
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            Ok((child, url))
        }
        _ => {
            let _ = child.kill().await;
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            bail!(
                "{} serve did not start listening; its log ends:\n{tail}",
                bin.display()
            )
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A server that cannot start is an error, not a panic: its runtime is
    /// shut down inside the caller's async context (breaker: tokio panicked
    /// "Cannot drop a runtime in a context where blocking is not allowed").
    #[tokio::test]
    async fn a_server_that_cannot_start_is_an_error() {
        let config = Config::bundled().unwrap();
        let res = start(
            Some("sqlite:///proc/no-such-dir/idem.db"),
            config,
            Duration::from_millis(200),
        )
        .await;
        assert!(res.is_err());
    }

    /// A started server stops when dropped inside an async context.
    #[tokio::test]
    async fn a_started_server_is_dropped_inside_an_async_context() {
        let config = Config::bundled().unwrap();
        let server = start(None, config, Duration::from_millis(200))
            .await
            .unwrap();
        let dir = server.sqlite_path.clone().unwrap();
        drop(server);
        assert!(!dir.exists(), "the temporary store is removed");
    }
}
