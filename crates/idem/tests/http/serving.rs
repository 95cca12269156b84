//! The server's connections (header, body and idle bounds, the connection cap),
//! `--listen` names, the last log line, and a SQLite file removed under a
//! running server.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

/// The start of a request whose headers never end.
const HALF_HEADERS: &[u8] = b"POST /v1/tasks HTTP/1.1\r\nHost: idem\r\nContent-Type: applic";

/// A complete keep-alive request.
const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: idem\r\n\r\n";

/// `host:port` of `srv`.
fn addr(srv: &Server) -> String {
    srv.url.trim_start_matches("http://").to_owned()
}

/// Reads until the peer closes the connection (EOF or reset); how long that
/// took from `from`. Panics after `limit`.
async fn closed_at(conn: &mut TcpStream, from: Instant, limit: Duration) -> Duration {
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return from.elapsed(),
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(limit, read)
        .await
        .unwrap_or_else(|_| panic!("connection still open after {limit:?}"))
}

/// Reads one whole response (head and `content-length` body) from `conn`;
/// its head.
async fn read_response(conn: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = conn.read(&mut buf).await.expect("read a response");
        assert!(n > 0, "closed before a whole response: {got:?}");
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let head = text[..end].to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().expect("content-length"));
            if got.len() >= end + 4 + length {
                return text[..end].to_owned();
            }
        }
    }
}

/// Raises this process's soft open-file limit to at least `want` (within
/// the hard limit); servers started after inherit it.
fn raise_open_files(want: u64) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current.is_some_and(|c| c < want) {
        limit.current = Some(limit.maximum.map_or(want, |m| m.min(want)));
        setrlimit(Resource::Nofile, limit).expect("raise RLIMIT_NOFILE");
    }
}

/// Short bounds: 300 ms for request headers, 500 ms idle.
fn short_bounds() -> Options {
    Options::fast()
        .env("IDEM_HEADER_TIMEOUT_MS", "300")
        .env("IDEM_IDLE_TIMEOUT_MS", "500")
}

/// 50 connections that sent half a request header are closed at the header
/// bound, and 50 idle keep-alive connections (one answered request each) at
/// the idle bound: not before, and within 1 s after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_and_idle_connections_are_closed_within_their_bounds() {
    let srv = Server::start_with(short_bounds()).await;
    let (header, idle) = (Duration::from_millis(300), Duration::from_millis(500));
    let limit = Duration::from_secs(10);
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let to = addr(&srv);
        tasks.push(tokio::spawn(async move {
            let from = Instant::now();
            let mut conn = TcpStream::connect(to).await.expect("connect");
            conn.write_all(HALF_HEADERS).await.expect("half a request");
            ("header", closed_at(&mut conn, from, limit).await)
        }));
        let to = addr(&srv);
        tasks.push(tokio::spawn(async move {
            let mut conn = TcpStream::connect(to).await.expect("connect");
            conn.write_all(HEALTHZ).await.expect("request");
            let head = read_response(&mut conn).await;
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            ("idle", closed_at(&mut conn, Instant::now(), limit).await)
        }));
    }
    let mut slowest = [Duration::ZERO; 2];
    for task in tasks {
        let (kind, took) = task.await.expect("join");
        let (bound, i) = if kind == "header" {
            (header, 0)
        } else {
            (idle, 1)
        };
        // The idle bound starts when the answer was written, a little before
        // it was read here.
        assert!(
            took + Duration::from_millis(50) >= bound,
            "a {kind} connection closed after {took:?}, before its bound {bound:?}"
        );
        assert!(
            took <= bound + Duration::from_secs(1),
            "a {kind} connection closed after {took:?}: bound {bound:?} + 1 s"
        );
        slowest[i] = slowest[i].max(took);
    }
    println!(
        "slowest closure: half-sent {:?} (bound {header:?}), idle {:?} (bound {idle:?})",
        slowest[0], slowest[1]
    );
    let metrics = srv.call(reqwest::Method::GET, "/metrics", None, None).await;
    for reason in ["header_timeout", "idle_timeout"] {
        let line = format!("idem_http_connections_closed_total{{reason=\"{reason}\"}} ");
        let n: u64 = metrics
            .text
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .map_or(0, |v| v.trim().parse().expect("a count"));
        assert!(n >= 50, "{reason}: {n}\n{}", metrics.text);
    }
}

/// A client that sends its request headers a byte at a time cannot stretch
/// the header bound: the connection closes at the bound counted from its
/// opening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_sent_a_byte_at_a_time_are_cut_at_the_header_bound() {
    let srv = Server::start_with(short_bounds()).await;
    let from = Instant::now();
    let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
    let mut took = None;
    for byte in HALF_HEADERS.iter().cycle().take(200) {
        if conn.write_all(&[*byte]).await.is_err() {
            break;
        }
        let mut buf = [0u8; 64];
        match tokio::time::timeout(Duration::from_millis(50), conn.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => {
                took = Some(from.elapsed());
                break;
            }
            Ok(Ok(_)) => panic!("an answer to half a request"),
            Err(_) => {}
        }
    }
    let took = took.expect("the trickling connection was never closed");
    assert!(
        took >= Duration::from_millis(300) && took <= Duration::from_millis(1300),
        "closed after {took:?}; header bound 300 ms"
    );
}

/// A request being answered is not idle: a long-poll claim of 1.5 s on a
/// server with a 500 ms idle bound answers 200, and the connection then
/// serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_outlasts_the_idle_bound() {
    let srv = Server::start_with(short_bounds()).await;
    let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
    let body = json!({"executor_id": "lp", "operations": ["generation.dispatch"], "wait_ms": 1500})
        .to_string();
    let claim = format!(
        "POST /v1/attempts/claim HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        srv.keys.exec,
        body.len()
    );
    let started = Instant::now();
    conn.write_all(claim.as_bytes()).await.expect("claim");
    let head = read_response(&mut conn).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(started.elapsed() >= Duration::from_millis(1400));
    conn.write_all(HEALTHZ).await.expect("next request");
    let head = read_response(&mut conn).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// With `IDEM_MAX_CONNECTIONS` connections open, one more is closed as soon
/// as it is accepted (counted as `over_capacity`); once one of them closes,
/// a new connection is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_the_cap_is_closed_at_once() {
    let srv = Server::start_with(Options::fast().env("IDEM_MAX_CONNECTIONS", "3")).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
        conn.write_all(HEALTHZ).await.expect("request");
        read_response(&mut conn).await;
        held.push(conn);
    }
    let from = Instant::now();
    let mut over = TcpStream::connect(addr(&srv)).await.expect("connect");
    let took = closed_at(&mut over, from, Duration::from_secs(5)).await;
    assert!(took < Duration::from_secs(1), "closed after {took:?}");
    drop(held.pop());
    let deadline = Instant::now() + POLL_TIMEOUT;
    let metrics = loop {
        let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
        let asked = conn
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: idem\r\nConnection: close\r\n\r\n")
            .await;
        let mut text = String::new();
        if asked.is_ok()
            && conn.read_to_string(&mut text).await.is_ok()
            && text.starts_with("HTTP/1.1 200")
        {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no slot freed within {POLL_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        metrics.contains("idem_http_connections_closed_total{reason=\"over_capacity\"} "),
        "{metrics}"
    );
    assert!(
        !metrics.contains("idem_http_connections_closed_total{reason=\"over_capacity\"} 0\n"),
        "{metrics}"
    );
}

/// 3,000 connections holding half-sent requests (within the default 30 s
/// header bound) leave room for a submit on a new connection: 201 within 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_is_answered_beside_3000_half_sent_requests() {
    raise_open_files(8192);
    let srv = Server::fast().await;
    let started = Instant::now();
    let mut conns = Vec::with_capacity(3000);
    for _ in 0..3000 {
        let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
        conn.write_all(HALF_HEADERS).await.expect("half a request");
        conns.push(conn);
    }
    let fd_dir = format!("/proc/{}/fd", srv.pid());
    let deadline = Instant::now() + POLL_TIMEOUT;
    loop {
        let open = std::fs::read_dir(&fd_dir)
            .expect("the server's fds")
            .count();
        if open >= 3000 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server holds {open} descriptors"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let opened = started.elapsed();
    let started = Instant::now();
    let r = srv
        .submit(&ikey(), "generation.dispatch", generation("beside"))
        .await;
    let took = started.elapsed();
    r.ok(201);
    println!("3000 half-sent requests open in {opened:?}; a new submit answered in {took:?}");
    assert!(took < Duration::from_secs(1), "the submit took {took:?}");
    // Still open: the header bound (30 s) has not run out.
    let mut buf = [0u8; 8];
    let probe = tokio::time::timeout(Duration::from_millis(50), conns[0].read(&mut buf)).await;
    assert!(probe.is_err(), "a half-sent request was answered or closed");
}

/// Complete headers of a submit with `key` announcing a 100-byte body, and 4
/// bytes of it.
fn stalled_body(key: &str) -> Vec<u8> {
    format!(
        "POST /v1/tasks HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 100\r\nIdempotency-Key: stalled\r\n\r\n{{\"op"
    )
    .into_bytes()
}

/// 3,000 connections whose request bodies stall after complete headers
/// (`Content-Length: 100`, 4 bytes sent) are each answered 408
/// `REQUEST_TIMEOUT` and closed within the body bound + 1 s, counted as
/// `body_timeout`; meanwhile a submit on a new connection is answered 201
/// within 1 s, and a body that arrives in time is read as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_are_answered_408_and_closed_at_the_body_bound() {
    raise_open_files(8192);
    let bound = Duration::from_millis(2000);
    let srv = Server::start_with(Options::fast().env("IDEM_BODY_TIMEOUT_MS", "2000")).await;
    let limit = bound + Duration::from_secs(10);
    let stalled = stalled_body(&srv.keys.acme);
    let mut tasks = Vec::with_capacity(3000);
    for _ in 0..3000 {
        let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
        let sent = Instant::now();
        conn.write_all(&stalled).await.expect("headers and 4 bytes");
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            let read = async {
                loop {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return sent.elapsed(),
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            };
            let took = tokio::time::timeout(limit, read)
                .await
                .unwrap_or_else(|_| panic!("connection still open after {limit:?}"));
            (took, String::from_utf8_lossy(&got).into_owned())
        }));
    }
    let started = Instant::now();
    let r = srv
        .submit(&ikey(), "generation.dispatch", generation("beside"))
        .await;
    let submit_took = started.elapsed();
    r.ok(201);
    assert!(
        submit_took < Duration::from_secs(1),
        "the submit took {submit_took:?}"
    );
    let mut slowest = Duration::ZERO;
    for task in tasks {
        let (took, answer) = task.await.expect("join");
        assert!(
            answer.starts_with("HTTP/1.1 408") && answer.contains("REQUEST_TIMEOUT"),
            "{answer}"
        );
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
        assert!(
            took + Duration::from_millis(50) >= bound,
            "closed after {took:?}, before the bound"
        );
        assert!(
            took <= bound + Duration::from_secs(1),
            "closed after {took:?}: bound + 1 s"
        );
        slowest = slowest.max(took);
    }
    println!(
        "3000 stalled bodies: slowest answered and closed after {slowest:?} (bound {bound:?}); a new submit meanwhile in {submit_took:?}"
    );
    let metrics = srv.call(reqwest::Method::GET, "/metrics", None, None).await;
    let line = "idem_http_connections_closed_total{reason=\"body_timeout\"} ";
    let n: u64 = metrics
        .text
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .map_or(0, |v| v.trim().parse().expect("a count"));
    assert_eq!(n, 3000, "{}", metrics.text);
    // Nothing was created by the stalled submits.
    let found = srv
        .get(
            "/v1/tasks?operation=generation.dispatch&idempotency_key=stalled",
            &srv.keys.acme,
        )
        .await;
    assert_eq!(found.status, 404, "{}", found.text);
}

/// A body sent slowly but complete within the body bound is read as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_complete_within_the_bound_is_read() {
    let srv = Server::start_with(Options::fast().env("IDEM_BODY_TIMEOUT_MS", "2000")).await;
    let body = br#"{"operation":"generation.dispatch","params":{"prompt":"slow"}}"#;
    let head = format!(
        "POST /v1/tasks HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\nIdempotency-Key: slow-1\r\n\r\n",
        srv.keys.acme,
        body.len()
    );
    let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
    conn.write_all(head.as_bytes()).await.unwrap();
    for chunk in body.chunks(16) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        conn.write_all(chunk).await.unwrap();
    }
    let answer = read_response(&mut conn).await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}

/// `--listen localhost:0` resolves the name and serves on what it resolves to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_takes_a_host_name() {
    let srv = Server::start_with(Options::fast().env("IDEM_LISTEN", "localhost:0")).await;
    let r = srv.call(reqwest::Method::GET, "/healthz", None, None).await;
    r.ok(200);
    let host = srv.url.trim_start_matches("http://");
    assert!(
        host.starts_with("127.0.0.1:") || host.starts_with("[::1]:"),
        "{}",
        srv.url
    );
}

/// A `--listen` that does not resolve is refused with a message naming it.
#[test]
fn listen_that_does_not_resolve_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "localhost",
            "--store",
            &store_url(dir.path()),
        ])
        .env("RUST_LOG", "warn")
        .env_remove("IDEM_CONFIG")
        .output()
        .expect("run idem serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(
            "error: --listen `localhost` does not resolve to an address \
             (expected HOST:PORT, e.g. 127.0.0.1:8787 or localhost:8787): "
        ),
        "{err}"
    );
}

/// The last line a SIGTERM'd server logs is `idem stopped`; when the grace
/// period cuts a request off, it is the line saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_logs_a_last_line_when_stopped() {
    let mut srv = Server::start_with(Options::fast().env("RUST_LOG", "info")).await;
    let status = tokio::task::block_in_place(|| srv.terminate());
    assert!(status.success(), "{status:?}");
    let log = srv.log();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.ends_with(" idem stopped"),
        "last line {last:?}:\n{log}"
    );

    let mut srv = Server::start_with(
        Options::fast()
            .env("IDEM_SHUTDOWN_GRACE_MS", "300")
            .env("RUST_LOG", DEBUG_LOG),
    )
    .await;
    let mut conn = TcpStream::connect(addr(&srv)).await.expect("connect");
    conn.write_all(HALF_HEADERS).await.expect("half a request");
    srv.wait_read_from(conn.local_addr().expect("the client's address"))
        .await;
    srv.signal_term();
    let status = tokio::task::block_in_place(|| srv.exit_within(Duration::from_secs(10)));
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{status:?}");
    let log = srv.log();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.ends_with(" idem stopped with requests still open (exit status 1)"),
        "last line {last:?}:\n{log}"
    );
}

/// What the store logs once its file is gone (`what`: `removed`, …).
fn gone_line(srv: &Server, what: &str) -> String {
    format!(
        "the SQLite store file {} was {what} while idem had it open; every request is refused \
         (writes would go to a file no longer at that path, lost at the next restart): \
         restore the file if it was moved by mistake, then restart idem",
        srv.db_path().display()
    )
}

/// `rm` of the SQLite file under a running server, with no request: the
/// sweeper finds it within 2 sweep intervals (50 ms here) and logs one
/// ERROR line; `/readyz` and a submit answer 503 problems; the line is not
/// repeated, nor is the failing sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_store_file_is_found_and_refused() {
    let srv = Server::fast().await;
    srv.new_task(&ikey(), "generation.dispatch", generation("before"))
        .await;
    let line = gone_line(&srv, "removed");
    let removed = Instant::now();
    std::fs::remove_file(srv.db_path()).expect("rm the database");
    srv.wait_log(&line).await;
    let found = removed.elapsed();
    println!("removal logged after {found:?} (sweep interval 50 ms)");
    assert!(
        found <= Duration::from_millis(2 * 50 + 150),
        "found after {found:?}"
    );
    let r = srv.call(reqwest::Method::GET, "/readyz", None, None).await;
    r.assert_problem(503, "UNAVAILABLE");
    let r = srv
        .submit(&ikey(), "generation.dispatch", generation("after"))
        .await;
    r.assert_problem(503, "UNAVAILABLE");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = srv.log();
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" ERROR ") && l.ends_with(&line))
        .collect();
    assert_eq!(errors.len(), 1, "{log}");
    assert_eq!(log.matches("sweep failed").count(), 1, "{log}");
}

/// The database file renamed away under a stream of submits: every submit
/// answered 201 is in the renamed file (with its WAL), and submits answer
/// 503 from then on. Nothing is acknowledged that is not on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_submit_is_acknowledged_that_the_file_does_not_hold() {
    let mut srv = Server::fast().await;
    let srv_ref = &srv;
    let acked = std::sync::Mutex::new(Vec::<String>::new());
    let refused = std::sync::atomic::AtomicUsize::new(0);
    let moved = srv.db_path().with_file_name("moved.db");
    let worker = || async {
        for _ in 0..2000 {
            let r = srv_ref
                .submit(&ikey(), "generation.dispatch", generation("w"))
                .await;
            match r.status {
                201 => acked.lock().unwrap().push(s(&r.json["task"]["id"])),
                503 => {
                    r.assert_problem(503, "UNAVAILABLE");
                    refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
                other => panic!("status {other}: {}", r.text),
            }
        }
        panic!("still accepted after 2000 submits");
    };
    let rename = async {
        while acked.lock().unwrap().len() < 40 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        std::fs::rename(srv_ref.db_path(), &moved).expect("rename the database");
    };
    tokio::join!(worker(), worker(), worker(), worker(), rename);
    assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 4);
    assert!(
        srv.log().contains(&gone_line(&srv, "removed")),
        "{}",
        srv.log()
    );
    tokio::task::block_in_place(|| srv.kill9());
    let wal = srv.db_path().with_file_name("idem.db-wal");
    if wal.exists() {
        std::fs::rename(&wal, moved.with_file_name("moved.db-wal")).expect("move the WAL");
    }
    let _ = std::fs::remove_file(srv.db_path().with_file_name("idem.db-shm"));
    let conn = rusqlite::Connection::open(&moved).expect("open the moved file");
    let mut stmt = conn.prepare("SELECT id FROM tasks").expect("prepare");
    let stored: std::collections::HashSet<String> = stmt
        .query_map([], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("ids");
    let acked = acked.into_inner().unwrap();
    let missing: Vec<&String> = acked.iter().filter(|id| !stored.contains(*id)).collect();
    println!(
        "{} submits acknowledged, {} tasks in the moved file",
        acked.len(),
        stored.len()
    );
    assert!(
        missing.is_empty(),
        "acknowledged but not stored: {missing:?}"
    );
}

/// The longest request target reaches the API and gets its problem; one
/// byte more is answered by hyper's HTTP/1 parser before any route or
/// middleware runs (request targets over 65,534 bytes, a constant of hyper's,
/// `MAX_URI_LEN`): 414 with an empty body, no problem document and no
/// `X-Request-Id` (SPEC §7). Sent over a raw connection: HTTP clients refuse
/// to build such a request.
#[tokio::test]
async fn a_request_target_over_hypers_limit_is_414_without_a_body() {
    let srv = Server::in_process().await;
    let head = |len: usize| {
        let path = "/v1/tasks?pad=";
        let target = format!("{path}{}", "a".repeat(len - path.len()));
        format!(
            "GET {target} HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            srv.keys.acme
        )
    };
    let mut conn = TcpStream::connect(addr(&srv)).await.unwrap();
    conn.write_all(head(65_534).as_bytes()).await.unwrap();
    let mut longest = String::new();
    conn.read_to_string(&mut longest).await.unwrap();
    let (status, rest) = longest.split_once("\r\n").unwrap();
    assert_eq!(status, "HTTP/1.1 400 Bad Request");
    let lower = rest.to_ascii_lowercase();
    assert!(
        lower.contains("content-type: application/problem+json"),
        "{rest}"
    );
    assert!(lower.contains("x-request-id:"), "{rest}");
    assert!(rest.contains("unknown parameter `pad"), "{rest}");

    let mut conn = TcpStream::connect(addr(&srv)).await.unwrap();
    conn.write_all(head(65_535).as_bytes()).await.unwrap();
    let mut over = String::new();
    conn.read_to_string(&mut over).await.unwrap();
    let (status, rest) = over.split_once("\r\n").unwrap();
    assert_eq!(status, "HTTP/1.1 414 URI Too Long");
    let lower = rest.to_ascii_lowercase();
    assert!(lower.contains("content-length: 0\r\n"), "{rest}");
    assert!(!lower.contains("content-type:"), "{rest}");
    assert!(!lower.contains("x-request-id:"), "{rest}");
    assert!(rest.ends_with("\r\n\r\n"), "{rest}");
}
