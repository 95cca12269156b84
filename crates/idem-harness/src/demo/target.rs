//! Where idem runs (in this process on a temporary SQLite store, or at `--url`)
//! and the flaky link in front of it that can lose one answer on purpose.

use super::*;

/// An in-process idem: stops when dropped (the temporary store is removed with it).
struct InProcess {
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

/// The idem the demo talks to.
pub(super) struct Target {
    pub(super) url: String,
    pub(super) client_key: String,
    pub(super) executor_key: String,
    pub(super) admin_key: Option<String>,
    pub(super) description: String,
    _server: Option<InProcess>,
}

impl Target {
    pub(super) async fn open(opts: &DemoOptions) -> Result<Target> {
        if let Some(url) = &opts.url {
            let (Some(client_key), Some(executor_key)) = (&opts.client_key, &opts.executor_key)
            else {
                bail!(
                    "--url needs --client-key and --executor-key (keys of one tenant, e.g. from `idem keys create --tenant demo --role client`)"
                );
            };
            return Ok(Target {
                url: url.trim_end_matches('/').to_owned(),
                client_key: client_key.clone(),
                executor_key: executor_key.clone(),
                admin_key: opts.admin_key.clone(),
                description: format!("the running service at {url}"),
                _server: None,
            });
        }
        let dir = tempfile::tempdir().context("creating a temporary directory")?;
        let path = dir.path().join("idem.db");
        let store =
            tokio::task::spawn_blocking(move || idem_store_sqlite::open(path, Default::default()))
                .await?
                .context("opening the temporary SQLite store")?;
        let ops = Some(vec![OPERATION.to_owned()]);
        let (_, client_key) = store
            .create_api_key("demo", Role::Client, ops.clone())
            .await?;
        let (_, executor_key) = store
            .create_api_key("demo", Role::Executor, ops.clone())
            .await?;
        let (_, admin_key) = store.create_api_key("demo", Role::Admin, ops).await?;
        let overrides = [
            ("IDEM_OPERATIONS__PAYMENT_RELEASE__LEASE__DEFAULT_MS", "300"),
            (
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS",
                "50",
            ),
            (
                "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS",
                "1000",
            ),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let config = Config::from_toml_with_env(DEFAULT_TOML, overrides)?;
        let options = idem_server::Options {
            sweep_interval: Duration::from_millis(50),
            console: None,
            ..idem_server::Options::default()
        };
        let app = idem_server::App::build(store, config, options).await?;
        let url = app.url();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let _ = app
                .run(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Target {
            description: format!(
                "an in-process server at {url} (temporary SQLite store, sweeper every 50 ms)"
            ),
            url,
            client_key,
            executor_key,
            admin_key: Some(admin_key),
            _server: Some(InProcess {
                stop: Some(stop),
                server: Some(server),
                _dir: dir,
            }),
        })
    }
}

#[derive(Clone)]
struct LinkState {
    upstream: String,
    http: reqwest::Client,
    /// Lose the answer of the next `POST /v1/tasks`.
    lose_next_submit: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
}

/// A forwarding HTTP proxy between the agent and idem that can lose an answer:
/// the request reaches idem and is processed, but the answer is held back
/// until the agent has given up waiting.
pub(super) struct FlakyLink {
    pub(super) url: String,
    lose_next_submit: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Drop for FlakyLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FlakyLink {
    pub(super) async fn start(upstream: &str) -> Result<FlakyLink> {
        let state = LinkState {
            upstream: upstream.to_owned(),
            http: reqwest::Client::new(),
            lose_next_submit: Arc::new(AtomicBool::new(false)),
            lost: Arc::new(AtomicBool::new(false)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let lose_next_submit = Arc::clone(&state.lose_next_submit);
        let lost = Arc::clone(&state.lost);
        let app = axum::Router::new().fallback(forward).with_state(state);
        let task = tokio::spawn(async move {
            let _ = idem_http::serve(
                listener,
                app,
                idem_http::ServeLimits::with_defaults(0),
                std::future::pending(),
            )
            .await;
        });
        Ok(FlakyLink {
            url,
            lose_next_submit,
            lost,
            task,
        })
    }

    /// Loses the answer to the next submission.
    pub(super) fn arm(&self) {
        self.lost.store(false, Ordering::SeqCst);
        self.lose_next_submit.store(true, Ordering::SeqCst);
    }

    /// Whether an answer was lost since [`FlakyLink::arm`].
    pub(super) fn lost_one(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

async fn forward(State(s): State<LinkState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, idem_http::BODY_LIMIT_BYTES * 2).await else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut rb = s
        .http
        .request(parts.method.clone(), format!("{}{path}", s.upstream));
    for (name, value) in &parts.headers {
        if name != header::HOST && name != header::CONTENT_LENGTH && name != header::CONNECTION {
            rb = rb.header(name, value);
        }
    }
    let upstream = match rb.body(bytes).send().await {
        Ok(r) => r,
        Err(_) => return StatusCode::BAD_GATEWAY.into_response(),
    };
    let status = upstream.status();
    let headers: HeaderMap = upstream.headers().clone();
    let body = upstream.bytes().await.unwrap_or_default();
    let is_submit = parts.method == axum::http::Method::POST && parts.uri.path() == "/v1/tasks";
    if is_submit && s.lose_next_submit.swap(false, Ordering::SeqCst) {
        // idem has committed and answered; the answer never reaches the agent.
        s.lost.store(true, Ordering::SeqCst);
        tokio::time::sleep(AGENT_TIMEOUT * 4).await;
        return StatusCode::GATEWAY_TIMEOUT.into_response();
    }
    let mut res = Response::new(Body::from(body));
    *res.status_mut() = status;
    for (name, value) in &headers {
        if name != header::TRANSFER_ENCODING
            && name != header::CONNECTION
            && name != header::CONTENT_LENGTH
        {
            res.headers_mut().append(name, value.clone());
        }
    }
    res
}
