//! Each mode of the proxy as a client and a tiny upstream see it: what the
//! client receives, and whether the request reached the upstream.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::Uri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// An upstream that answers `200 upstream <path>` and counts its requests.
struct Upstream {
    addr: SocketAddr,
    hits: Arc<AtomicU64>,
    _task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    async fn start() -> anyhow::Result<Upstream> {
        let hits = Arc::new(AtomicU64::new(0));
        let app = Router::new()
            .fallback(|State(hits): State<Arc<AtomicU64>>, uri: Uri| async move {
                hits.fetch_add(1, Ordering::SeqCst);
                format!("upstream {}", uri.path())
            })
            .with_state(Arc::clone(&hits));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Upstream {
            addr,
            hits,
            _task: task,
        })
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

async fn setup() -> anyhow::Result<(Upstream, FaultProxy)> {
    let upstream = Upstream::start().await?;
    let proxy = FaultProxy::start(([127, 0, 0, 1], 0).into(), upstream.addr).await?;
    Ok((upstream, proxy))
}

/// [`setup`] with `mode` applied to every request of `class`.
async fn faulted(class: RouteClass, mode: Mode) -> anyhow::Result<(Upstream, FaultProxy)> {
    let (upstream, proxy) = setup().await?;
    proxy.set_faults(Faults::from([(class, Rule::now(mode))]));
    Ok((upstream, proxy))
}

fn heartbeat_request() -> &'static [u8] {
    b"POST /v1/attempts/a1/heartbeat HTTP/1.1\r\nhost: idem\r\ncontent-type: application/json\r\ncontent-length: 16\r\n\r\n{\"generation\":1}"
}

/// `POST /v1/attempts/a1/heartbeat` through `proxy` with an optional time
/// limit.
async fn post_heartbeat(
    proxy: &FaultProxy,
    timeout: Option<Duration>,
) -> reqwest::Result<reqwest::Response> {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/attempts/a1/heartbeat", proxy.url()))
        .body("{}");
    if let Some(t) = timeout {
        req = req.timeout(t);
    }
    req.send().await
}

/// Asserts that no request reached the upstream and `n` heartbeats met the
/// fault.
#[track_caller]
fn assert_heartbeats_faulted(upstream: &Upstream, proxy: &FaultProxy, n: u64) {
    assert_eq!(upstream.hits(), 0);
    assert_eq!(proxy.counts()[&RouteClass::Heartbeat].faulted, n);
}

/// Sends `raw` on a new connection and reads until the proxy closes it,
/// `Ok(bytes)` on a clean close.
async fn raw_exchange(addr: SocketAddr, raw: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(raw).await?;
    let mut got = Vec::new();
    stream.read_to_end(&mut got).await?;
    Ok(got)
}

#[test]
fn route_classes_follow_method_and_path() {
    let cases = [
        (Method::POST, "/v1/attempts/claim", RouteClass::Claim),
        (
            Method::POST,
            "/v1/attempts/a1/heartbeat",
            RouteClass::Heartbeat,
        ),
        (Method::POST, "/v1/attempts/a1/report", RouteClass::Report),
        (Method::POST, "/v1/attempts/a1/release", RouteClass::Release),
        (Method::POST, "/v1/attempts/a1/ack", RouteClass::Ack),
        (Method::POST, "/v1/tasks", RouteClass::Submit),
        (Method::GET, "/v1/tasks", RouteClass::Other),
        (Method::GET, "/v1/attempts/a1/heartbeat", RouteClass::Other),
        (Method::POST, "/v1/tasks/t1/delivery/ack", RouteClass::Other),
        (Method::POST, "/v1/tasks/t1/cancel", RouteClass::Other),
        (Method::POST, "/v1/attempts//heartbeat", RouteClass::Other),
    ];
    for (method, path, class) in cases {
        assert_eq!(RouteClass::of(&method, path), class, "{method} {path}");
    }
}

#[test]
fn rules_read_both_forms_and_refuse_unknown_names() -> anyhow::Result<()> {
    let faults: Faults = serde_json::from_str(
        r#"{"heartbeat": {"mode": "503", "after": 1}, "claim": "hang", "report": {"mode": "drop-answer"}, "ack": "reset"}"#,
    )?;
    assert_eq!(
        faults[&RouteClass::Heartbeat],
        Rule::after(1, Mode::Unavailable)
    );
    assert_eq!(faults[&RouteClass::Claim], Rule::now(Mode::Hang));
    assert_eq!(faults[&RouteClass::Report], Rule::now(Mode::DropAnswer));
    assert_eq!(faults[&RouteClass::Ack], Rule::now(Mode::Reset));
    assert!(serde_json::from_str::<Faults>(r#"{"heartbeats": "503"}"#).is_err());
    assert!(serde_json::from_str::<Faults>(r#"{"heartbeat": "500"}"#).is_err());
    Ok(())
}

#[tokio::test]
async fn pass_forwards_requests_and_answers() -> anyhow::Result<()> {
    let (upstream, proxy) = setup().await?;
    let res = post_heartbeat(&proxy, None).await?;
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await?, "upstream /v1/attempts/a1/heartbeat");
    assert_eq!(upstream.hits(), 1);
    assert_eq!(
        proxy.counts()[&RouteClass::Heartbeat],
        Counts {
            forwarded: 1,
            faulted: 0
        }
    );
    Ok(())
}

#[tokio::test]
async fn unavailable_answers_the_problem_after_the_first_n_without_forwarding() -> anyhow::Result<()>
{
    let (upstream, proxy) = setup().await?;
    proxy.set_faults(Faults::from([(
        RouteClass::Heartbeat,
        Rule::after(1, Mode::Unavailable),
    )]));
    let client = reqwest::Client::new();
    let url = format!("{}/v1/attempts/a1/heartbeat", proxy.url());
    let first = client.post(&url).send().await?;
    assert_eq!(first.status(), 200);
    for _ in 0..2 {
        let res = client.post(&url).send().await?;
        assert_eq!(res.status(), 503);
        assert_eq!(
            res.headers().get(CONTENT_TYPE).map(HeaderValue::as_bytes),
            Some(&b"application/problem+json"[..])
        );
        assert_eq!(res.text().await?, INJECTED_503_BODY);
    }
    // Another class passes.
    let other = client
        .post(format!("{}/v1/tasks", proxy.url()))
        .send()
        .await?;
    assert_eq!(other.status(), 200);
    assert_eq!(upstream.hits(), 2);
    let counts = proxy.counts();
    assert_eq!(
        counts[&RouteClass::Heartbeat],
        Counts {
            forwarded: 1,
            faulted: 2
        }
    );
    assert_eq!(counts[&RouteClass::Submit].forwarded, 1);
    Ok(())
}

#[tokio::test]
async fn reset_closes_the_connection_with_an_rst_and_forwards_nothing() -> anyhow::Result<()> {
    let (upstream, proxy) = faulted(RouteClass::Heartbeat, Mode::Reset).await?;
    let got = raw_exchange(proxy.addr(), heartbeat_request()).await;
    assert_eq!(
        got.as_ref().map_err(std::io::Error::kind).err(),
        Some(std::io::ErrorKind::ConnectionReset),
        "{got:?}"
    );
    // An HTTP client sees the same reset.
    let res = post_heartbeat(&proxy, None).await;
    assert!(res.is_err(), "{res:?}");
    assert_heartbeats_faulted(&upstream, &proxy, 2);
    Ok(())
}

#[tokio::test]
async fn hang_never_answers_and_keeps_the_connection_open() -> anyhow::Result<()> {
    let (upstream, proxy) = faulted(RouteClass::Heartbeat, Mode::Hang).await?;
    let mut stream = TcpStream::connect(proxy.addr()).await?;
    stream.write_all(heartbeat_request()).await?;
    let mut buf = [0u8; 64];
    // Neither an answer nor a close (read would return 0) within the wait.
    let read = tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await;
    assert!(read.is_err(), "{read:?}");
    let res = post_heartbeat(&proxy, Some(Duration::from_millis(200))).await;
    assert!(
        res.as_ref().is_err_and(reqwest::Error::is_timeout),
        "{res:?}"
    );
    assert_heartbeats_faulted(&upstream, &proxy, 2);
    Ok(())
}

#[tokio::test]
async fn drop_answer_forwards_then_closes_without_answering() -> anyhow::Result<()> {
    let (upstream, proxy) = faulted(RouteClass::Report, Mode::DropAnswer).await?;
    let got = raw_exchange(
        proxy.addr(),
        b"POST /v1/attempts/a1/report HTTP/1.1\r\nhost: idem\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await?;
    assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
    assert_eq!(upstream.hits(), 1);
    assert_eq!(proxy.counts()[&RouteClass::Report].faulted, 1);
    Ok(())
}

#[tokio::test]
async fn too_large_refuses_bodies_over_the_limit_and_forwards_the_others() -> anyhow::Result<()> {
    let (upstream, proxy) = setup().await?;
    proxy.set_faults(Faults::from([(RouteClass::Report, Rule::too_large(10))]));
    let client = reqwest::Client::new();
    let url = format!("{}/v1/attempts/a1/report", proxy.url());
    let small = client.post(&url).body("0123456789").send().await?;
    assert_eq!(small.status(), 200);
    assert_eq!(small.text().await?, "upstream /v1/attempts/a1/report");
    let big = client.post(&url).body("0123456789a").send().await?;
    assert_eq!(big.status(), 413);
    let problem: serde_json::Value = big.json().await?;
    assert_eq!(problem["code"], "PAYLOAD_TOO_LARGE");
    assert_eq!(problem["max_bytes"], 10);
    assert_eq!(upstream.hits(), 1);
    assert_eq!(
        proxy.counts()[&RouteClass::Report],
        Counts {
            forwarded: 1,
            faulted: 1
        }
    );
    let rule: Faults = serde_json::from_str(r#"{"report": {"mode": "413", "max_bytes": 10}}"#)?;
    assert_eq!(rule[&RouteClass::Report], Rule::too_large(10));
    Ok(())
}

#[tokio::test]
async fn control_endpoints_replace_rules_restart_after_counts_and_refuse_bad_rules()
-> anyhow::Result<()> {
    let (upstream, proxy) = setup().await?;
    let client = reqwest::Client::new();
    let faults = format!("{}{FAULTS_PATH}", proxy.url());
    let claim = format!("{}/v1/attempts/claim", proxy.url());
    let one_then_503 = r#"{"claim": {"mode": "503", "after": 1}}"#;
    for _ in 0..2 {
        // Setting the same rules again lets one pass again.
        let put = client.put(&faults).body(one_then_503).send().await?;
        assert_eq!(put.status(), 204);
        assert_eq!(client.post(&claim).send().await?.status(), 200);
        assert_eq!(client.post(&claim).send().await?.status(), 503);
    }
    // A refused body changes nothing.
    let bad = client
        .put(&faults)
        .body(r#"{"claim": "slow"}"#)
        .send()
        .await?;
    assert_eq!(bad.status(), 400);
    assert_eq!(client.post(&claim).send().await?.status(), 503);
    // An empty object: everything passes.
    assert_eq!(client.put(&faults).body("{}").send().await?.status(), 204);
    assert_eq!(client.post(&claim).send().await?.status(), 200);
    assert_eq!(upstream.hits(), 3);

    let counts: BTreeMap<String, Counts> = client
        .get(format!("{}{COUNTS_PATH}", proxy.url()))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(counts.len(), RouteClass::ALL.len());
    assert_eq!(
        counts["claim"],
        Counts {
            forwarded: 3,
            faulted: 3
        }
    );
    assert_eq!(counts["other"], Counts::default());
    Ok(())
}
