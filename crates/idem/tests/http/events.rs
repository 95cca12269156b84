//! Live events (SPEC §4, "Live events"): a task's events as a
//! Server-Sent Events stream, resumed with `Last-Event-ID` after a cut with no
//! gap and no repeat and ended after the terminal event; the tenant feed as
//! JSON pages and as a stream, consumed from a saved cursor across a SIGKILL
//! of the server (SQLite and PostgreSQL) and checked against the store after
//! 2,000 tasks. The streams are read with the SDK (`idem-client`, which
//! parses them with `eventsource-stream`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use idem_client::{Client, FeedEvent};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::{POLL_TIMEOUT, Server, generation, ikey, s};

/// Tasks submitted in the SIGKILL test.
const TASKS: usize = 2_000;
/// Concurrent submitters in the SIGKILL test.
const SUBMITTERS: usize = 8;

fn client(srv: &Server, key: &str) -> Client {
    Client::new(&srv.url, key).expect("client")
}

/// The next item of `stream` within [`POLL_TIMEOUT`] (`None`: it ended).
async fn next<T>(stream: &mut idem_client::EventStream<T>) -> Option<T> {
    tokio::time::timeout(POLL_TIMEOUT, stream.next())
        .await
        .expect("a stream item within the poll timeout")
        .map(|r| r.expect("a decoded event"))
}

/// Claims the task's next attempt and reports `body`'s outcome.
async fn work(srv: &Server, body: Value) {
    let a = srv.claim_one("generation.dispatch", None).await;
    let mut body = body;
    body["generation"] = a["generation"].clone();
    srv.report(&s(&a["id"]), body).await.ok(200);
}

/// A task's stream sends its history in `seq` order, then each new event as
/// it commits; cut after the lease, a stream resumed with `Last-Event-ID`
/// sends the rest with no gap and no repeat and ends after `delivered`; a
/// stream opened after that on the terminal task is empty (204); the JSON
/// list is unchanged and another tenant's task is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_stream_resumes_after_a_cut_without_gap_or_repeat() {
    let srv = Server::fast().await;
    let c = client(&srv, &srv.keys.acme);
    let task = srv
        .new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let id: uuid::Uuid = s(&task["id"]).parse().unwrap();

    let mut stream = c.task_event_stream(id, None).await.unwrap();
    let mut got = vec![next(&mut stream).await.expect("the submit event")];
    assert_eq!(got[0].kind, "task_submitted");
    work(
        &srv,
        json!({"outcome": "failed", "failure_class": "transient", "message": "try again"}),
    )
    .await;
    // Cut mid-stream: read up to the lease, then drop the connection.
    while got.last().map(|e| e.kind.as_str()) != Some("attempt_leased") {
        got.push(next(&mut stream).await.expect("the stream goes on"));
    }
    drop(stream);

    let last = got.last().map(|e| e.seq);
    let mut resumed = c.task_event_stream(id, last).await.unwrap();
    work(&srv, json!({"outcome": "succeeded", "result": {"ok": 1}})).await;
    while let Some(e) = next(&mut resumed).await {
        got.push(e);
    }
    let seqs: Vec<i64> = got.iter().map(|e| e.seq).collect();
    let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
    assert_eq!(seqs, expected, "every event once, in seq order: {got:?}");
    assert_eq!(
        got.last().map(|e| e.kind.as_str()),
        Some("delivered"),
        "the stream ends after the terminal event"
    );
    let listed = srv.events(&s(&task["id"])).await;
    assert_eq!(
        listed.len(),
        got.len(),
        "the JSON list holds the same events"
    );
    for (e, l) in got.iter().zip(&listed) {
        assert_eq!(
            (e.seq, e.kind.as_str()),
            (l["seq"].as_i64().unwrap(), s(&l["type"]).as_str())
        );
    }

    // Terminal, nothing after the last event: 204, an empty stream.
    let raw = srv
        .http
        .get(format!("{}/v1/tasks/{id}/events", srv.url))
        .bearer_auth(&srv.keys.acme)
        .header("accept", "text/event-stream")
        .header("last-event-id", seqs.len().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 204);
    let mut empty = c
        .task_event_stream(id, Some(seqs.len() as i64))
        .await
        .unwrap();
    assert!(next(&mut empty).await.is_none());

    // From the start on the terminal task: the history up to `delivered`, as
    // `text/event-stream` with `id:` = seq.
    let raw = srv
        .http
        .get(format!("{}/v1/tasks/{id}/events", srv.url))
        .bearer_auth(&srv.keys.acme)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 200);
    assert!(
        raw.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = raw.text().await.unwrap();
    let ids: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("id: ").or_else(|| l.strip_prefix("id:")))
        .collect();
    let want: Vec<String> = expected.iter().map(i64::to_string).collect();
    assert_eq!(ids, want, "{text}");

    let other = client(&srv, &srv.keys.other);
    let err = other.task_event_stream(id, None).await.err().expect("404");
    assert_eq!(err.status(), Some(404));
    let bad = srv
        .http
        .get(format!("{}/v1/tasks/{id}/events", srv.url))
        .bearer_auth(&srv.keys.acme)
        .header("accept", "text/event-stream")
        .header("last-event-id", "x")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);
}

/// A task stream opened with a `Last-Event-ID` past the live task's last
/// event is 400 `INVALID_REQUEST`, as the feed refuses a cursor ahead of it:
/// accepted, it would silently skip every event up to that `seq` as the
/// events are written (a new task at seq 1 resumed at 3 would send seq 4
/// first). Its own last `seq` is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_stream_past_the_last_event_is_refused() {
    let srv = Server::fast().await;
    let task = srv
        .new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let id = s(&task["id"]);
    let open = |last: &'static str| {
        srv.http
            .get(format!("{}/v1/tasks/{id}/events", srv.url))
            .bearer_auth(&srv.keys.acme)
            .header("accept", "text/event-stream")
            .header("last-event-id", last)
            .send()
    };
    let past = open("3").await.unwrap();
    assert_eq!(past.status().as_u16(), 400);
    let problem: Value = past.json().await.unwrap();
    assert_eq!(problem["code"], "INVALID_REQUEST", "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("past the task's last event"),
        "{problem}"
    );
    let mut at_last = open("1").await.unwrap();
    assert_eq!(at_last.status().as_u16(), 200);
    // The stream stays open on the live task: its next event is the lease.
    srv.claim_one("generation.dispatch", None).await;
    let chunk = tokio::time::timeout(POLL_TIMEOUT, at_last.chunk())
        .await
        .expect("an event within the poll timeout")
        .unwrap()
        .expect("a chunk");
    assert!(
        String::from_utf8_lossy(&chunk).contains("id: 2"),
        "{chunk:?}"
    );
}

/// Feed pages: each event once, with its task, class and cursor; the next
/// page starts after `next_cursor`; an empty page keeps the cursor; a
/// foreign cursor or limit is 400; another tenant's feed has none of these
/// events; a key limited to one class sees only that class; the stream
/// resumes after `Last-Event-ID`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feed_pages_and_stream_hold_the_tenants_events_once() {
    let srv = Server::fast().await;
    let c = client(&srv, &srv.keys.acme);
    let a = srv
        .new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let b = srv
        .new_task(&ikey(), "payment.release", crate::support::payment(5))
        .await;
    // Both submits committed: the feed holds both (bounded wait).
    let deadline = Instant::now() + POLL_TIMEOUT;
    let first = loop {
        let p = c.feed_page(None, Some(1)).await.unwrap();
        if !p.events.is_empty() {
            break p;
        }
        assert!(Instant::now() < deadline, "the feed stays empty");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(first.events.len(), 1);
    assert_eq!(first.events[0].task_id.to_string(), s(&a["id"]));
    assert_eq!(first.events[0].operation, "generation.dispatch");
    assert_eq!(first.events[0].event.kind, "task_submitted");
    assert_eq!(first.next_cursor, first.events[0].cursor);
    let second = c
        .feed_page(Some(&first.next_cursor), Some(10))
        .await
        .unwrap();
    assert_eq!(second.events.len(), 1, "{second:?}");
    assert_eq!(second.events[0].task_id.to_string(), s(&b["id"]));
    let empty = c.feed_page(Some(&second.next_cursor), None).await.unwrap();
    assert!(empty.events.is_empty());
    assert_eq!(
        empty.next_cursor, second.next_cursor,
        "an empty page keeps the cursor"
    );

    for q in ["after=abc", "after=1", "limit=0", "limit=1001", "limit=x"] {
        srv.get(&format!("/v1/events?{q}"), &srv.keys.acme)
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    srv.get("/v1/events", &srv.keys.exec)
        .await
        .assert_problem(403, "PERMISSION_DENIED");
    let other = client(&srv, &srv.keys.other);
    assert!(other.feed_page(None, None).await.unwrap().events.is_empty());
    assert!(
        other
            .feed_page(Some(&first.next_cursor), None)
            .await
            .unwrap()
            .events
            .is_empty(),
        "acme's cursor shows nothing of acme's to another tenant"
    );
    let (_, limited) = srv.create_key("acme", "client", Some("payment.release"));
    let limited = client(&srv, &limited);
    let page = limited.feed_page(None, None).await.unwrap();
    assert_eq!(
        page.events
            .iter()
            .map(|e| e.task_id.to_string())
            .collect::<Vec<_>>(),
        vec![s(&b["id"])],
        "a key limited to payment.release sees only its events"
    );

    // The stream after the first event: the second, then a new one as it commits.
    let mut stream = c.feed_stream(Some(&first.next_cursor)).await.unwrap();
    let e = next(&mut stream).await.expect("the second event");
    assert_eq!(e.cursor, second.next_cursor);
    let d = srv
        .new_task(&ikey(), "generation.dispatch", generation("d"))
        .await;
    let e = next(&mut stream).await.expect("the new event");
    assert_eq!(e.task_id.to_string(), s(&d["id"]));
    assert_eq!(e.event.seq, 1);
}

/// A server that shuts down (SIGTERM) ends its open streams at once: the
/// process exits within its grace period although two streams were open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_open_streams() {
    let mut srv = Server::fast().await;
    let c = client(&srv, &srv.keys.acme);
    let task = srv
        .new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let mut ts = c
        .task_event_stream(s(&task["id"]).parse().unwrap(), None)
        .await
        .unwrap();
    assert!(next(&mut ts).await.is_some());
    let mut fs = c.feed_stream(None).await.unwrap();
    assert!(next(&mut fs).await.is_some());
    srv.signal_term();
    // Both streams end (no error needed: the server closes them).
    assert!(
        tokio::time::timeout(POLL_TIMEOUT, ts.next())
            .await
            .unwrap()
            .is_none_or(|r| r.is_err())
    );
    assert!(
        tokio::time::timeout(POLL_TIMEOUT, fs.next())
            .await
            .unwrap()
            .is_none_or(|r| r.is_err())
    );
    let status = tokio::task::block_in_place(|| srv.exit_within(POLL_TIMEOUT));
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful exit: {status:?}"
    );
}

/// What the feed consumer has read, and where it resumes.
#[derive(Default)]
struct Consumed {
    events: Vec<FeedEvent>,
    /// The server's current URL (changes when it restarts).
    url: String,
    stop: bool,
}

/// Reads the feed as `key` from the last cursor read, reconnecting (to the
/// current URL) whenever the stream breaks or ends, until told to stop.
async fn consume(state: Arc<Mutex<Consumed>>, key: String) {
    loop {
        let (url, after) = {
            let st = state.lock().unwrap();
            if st.stop {
                return;
            }
            (st.url.clone(), st.events.last().map(|e| e.cursor.clone()))
        };
        let Ok(c) = Client::new(&url, key.clone()) else {
            return;
        };
        if let Ok(mut stream) = c.feed_stream(after.as_deref()).await {
            loop {
                let item = tokio::time::timeout(Duration::from_millis(300), stream.next()).await;
                match item {
                    Ok(Some(Ok(e))) => state.lock().unwrap().events.push(e),
                    Ok(Some(Err(_)) | None) => break,
                    // Nothing new: see whether to stop.
                    Err(_) => {
                        if state.lock().unwrap().stop {
                            return;
                        }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Submits tasks at `url` until `count` answered 201 or a request fails
/// (the server was killed); returns how many were created.
async fn submit_until(url: &str, key: &str, count: usize) -> usize {
    let c = Client::new(url, key).expect("client");
    let mut created = 0;
    while created < count {
        match c
            .submit("generation.dispatch", &generation("feed"), &ikey())
            .await
        {
            Ok(_) => created += 1,
            Err(_) => break,
        }
    }
    created
}

/// Claims and reports `succeeded` at `url` until a request fails or
/// `stop` is set.
async fn execute_until(url: String, key: String, stop: Arc<std::sync::atomic::AtomicBool>) {
    let Ok(c) = Client::new(&url, key) else {
        return;
    };
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let Ok(attempts) = c
            .claim("feed-exec", &["generation.dispatch"], 8, None, 0)
            .await
        else {
            return;
        };
        for a in attempts {
            let body = idem_client::ReportBody::succeeded(a.generation, json!({"ok": true}));
            if c.report(a.id, &body).await.is_err() {
                return;
            }
        }
    }
}

/// Runs the SIGKILL scenario on `srv`; `stored` reads `(task_id, seq)` of
/// every event of tenant `acme` from the store after the run.
async fn feed_across_sigkill<F, Fut>(mut srv: Server, stored: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Vec<(String, i64)>>,
{
    let acme = srv.keys.acme.clone();
    let exec = srv.keys.exec.clone();
    let state = Arc::new(Mutex::new(Consumed {
        url: srv.url.clone(),
        ..Consumed::default()
    }));
    let consumer = tokio::spawn(consume(state.clone(), acme.clone()));
    let mut total = 0;
    let mut read_before_kill = 0;
    for round in 0..2 {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let executor = tokio::spawn(execute_until(srv.url.clone(), exec.clone(), stop.clone()));
        // Round 0's submitters run until the kill stops them, so the kill
        // always lands while submitting, however fast this machine is.
        let per = if round == 0 {
            usize::MAX
        } else {
            (TASKS / 2).div_ceil(SUBMITTERS)
        };
        let submitters: Vec<_> = (0..SUBMITTERS)
            .map(|_| {
                let (url, key) = (srv.url.clone(), acme.clone());
                tokio::spawn(async move { submit_until(&url, &key, per).await })
            })
            .collect();
        if round == 0 {
            // Mid-consumption: the consumer has read some events, the
            // submitters are still at work.
            let deadline = Instant::now() + POLL_TIMEOUT;
            while state.lock().unwrap().events.len() < 300 {
                assert!(Instant::now() < deadline, "the consumer reads nothing");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::task::block_in_place(|| srv.kill9());
            read_before_kill = state.lock().unwrap().events.len();
        }
        for h in submitters {
            total += h.await.unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        executor.await.unwrap();
        if round == 0 {
            assert!(total > 0, "nothing was submitted before the kill");
            tokio::task::block_in_place(|| srv.restart());
            state.lock().unwrap().url = srv.url.clone();
        }
    }
    // Top up to the full count (the killed round created fewer).
    total += submit_until(&srv.url, &acme, TASKS.saturating_sub(total)).await;
    assert!(total >= TASKS);
    let expected: HashSet<(String, i64)> = stored(srv.store()).await.into_iter().collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while state.lock().unwrap().events.len() < expected.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    state.lock().unwrap().stop = true;
    consumer.await.unwrap();
    let events = std::mem::take(&mut state.lock().unwrap().events);
    let mut seen = HashSet::new();
    for e in &events {
        assert!(
            seen.insert((e.task_id.to_string(), e.event.seq)),
            "event {} of task {} read twice",
            e.event.seq,
            e.task_id
        );
    }
    let missing = expected.difference(&seen).count();
    let extra = seen.difference(&expected).count();
    assert!(
        missing == 0 && extra == 0,
        "{missing} of {} stored events never read, {extra} read but not stored",
        expected.len()
    );
    assert!(
        expected.len() > TASKS,
        "more events than tasks: {}",
        expected.len()
    );
    println!(
        "feed across SIGKILL: {} tasks submitted, {} stored events read once each ({} before the kill)",
        total,
        expected.len(),
        read_before_kill
    );
}

/// The feed consumed from a saved cursor across a SIGKILL of the server
/// (SQLite): nothing missed, nothing twice, against the store after 2,000 tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_feed_misses_nothing_across_a_sigkill_sqlite() {
    let srv = Server::fast().await;
    let db = srv.db_path();
    feed_across_sigkill(srv, move |_| {
        let db = db.clone();
        async move {
            let conn = rusqlite::Connection::open(&db).unwrap();
            let mut stmt = conn
                .prepare("SELECT task_id, seq FROM events WHERE tenant = 'acme'")
                .unwrap();
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        }
    })
    .await;
}

/// The same across a SIGKILL of a server on PostgreSQL (concurrent
/// transactions commit out of order there).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_feed_misses_nothing_across_a_sigkill_postgres() {
    let db = idem_store_postgres::testing::fresh_database().await;
    let keys = Server::create_keys(db.url());
    let srv = Server::start_pg(db.url(), &keys, &[]).await;
    feed_across_sigkill(srv, |url| async move {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
            .query(
                "SELECT task_id::text, seq FROM events WHERE tenant = 'acme'",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    })
    .await;
}

/// The first non-empty page of `key`'s feed (bounded wait: on PostgreSQL an
/// event is served once every older transaction has ended).
async fn first_page(srv: &Server, key: &str) -> idem_client::FeedPage {
    let c = client(srv, key);
    let deadline = Instant::now() + POLL_TIMEOUT;
    loop {
        let p = c.feed_page(None, None).await.unwrap();
        if !p.events.is_empty() {
            return p;
        }
        assert!(Instant::now() < deadline, "the feed stays empty");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `GET /v1/events` as a stream with `Last-Event-ID: cursor`.
async fn feed_stream_from(srv: &Server, cursor: &str) -> crate::support::Resp {
    crate::support::send(
        srv.http
            .get(format!("{}/v1/events", srv.url))
            .bearer_auth(&srv.keys.acme)
            .header("accept", "text/event-stream")
            .header("last-event-id", cursor),
    )
    .await
}

/// Which store a test's server runs on.
#[derive(Clone, Copy, PartialEq)]
enum Backend {
    Sqlite,
    Postgres,
}

/// A cursor no page of the feed could have given out, one ahead of the
/// feed's head, is 400 `INVALID_REQUEST` as a page (`after`) and as a stream
/// (`Last-Event-ID`): a position past the last one given out, a transaction
/// id not yet served (PostgreSQL: at or above the snapshot's xmin; SQLite:
/// any but 0). Every cursor the feed gave out, the head's included, and the
/// start (`0-0`) are read.
async fn cursor_ahead_of_the_feed_is_refused(srv: Server, backend: Backend) {
    srv.new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let page = first_page(&srv, &srv.keys.acme).await;
    let head = page.next_cursor.clone();
    let (txid, position) = head.split_once('-').unwrap();
    let (txid, position): (i64, i64) = (txid.parse().unwrap(), position.parse().unwrap());
    for given in ["0-0".to_owned(), head.clone()] {
        let r = srv
            .get(&format!("/v1/events?after={given}"), &srv.keys.acme)
            .await;
        r.ok(200);
    }
    let mut ahead = vec![
        "0-99999999".to_owned(),
        format!("{txid}-{}", position + 1),
        format!("{}-{position}", i64::MAX / 2),
    ];
    if backend == Backend::Sqlite {
        ahead.push(format!("1-{position}"));
    }
    for cursor in &ahead {
        let r = srv
            .get(&format!("/v1/events?after={cursor}"), &srv.keys.acme)
            .await;
        r.assert_problem(400, "INVALID_REQUEST");
        assert!(
            r.json["detail"]
                .as_str()
                .unwrap()
                .contains("ahead of the feed"),
            "{cursor}: {}",
            r.text
        );
        feed_stream_from(&srv, cursor)
            .await
            .assert_problem(400, "INVALID_REQUEST");
    }
    // Another tenant's feed has the same head: acme's head cursor is not
    // ahead of it (a cursor names no tenant), it just holds nothing after it.
    let theirs = srv
        .get(&format!("/v1/events?after={head}"), &srv.keys.other)
        .await;
    assert_eq!(theirs.ok(200)["events"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_ahead_of_the_feed_is_refused_sqlite() {
    cursor_ahead_of_the_feed_is_refused(Server::fast().await, Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_ahead_of_the_feed_is_refused_postgres() {
    let db = idem_store_postgres::testing::fresh_database().await;
    let keys = Server::create_keys(db.url());
    let srv = Server::start_pg(db.url(), &keys, &[]).await;
    cursor_ahead_of_the_feed_is_refused(srv, Backend::Postgres).await;
}

/// The feed takes `after` and `limit`, each at most once: an unknown
/// parameter is 400 naming it, a repeated one 400 saying so (as a search
/// answers them).
#[tokio::test]
async fn the_feed_refuses_unknown_and_repeated_parameters() {
    let srv = Server::in_process().await;
    for (query, says) in [
        ("foo=1", "unknown parameter `foo`"),
        ("after=0-0&Limit=5", "unknown parameter `Limit`"),
        ("after=0-0&after=0-0", "`after` is given more than once"),
        ("limit=5&limit=5", "`limit` is given more than once"),
    ] {
        for path in ["/v1/events", "/v1/tasks"] {
            if path == "/v1/tasks" && query.starts_with("after") {
                continue;
            }
            let r = srv.get(&format!("{path}?{query}"), &srv.keys.acme).await;
            r.assert_problem(400, "INVALID_REQUEST");
            let detail = r.json["detail"].as_str().unwrap();
            assert!(detail.contains(says), "{path}?{query}: {detail}");
        }
    }
    srv.get("/v1/events?after=0-0&limit=5", &srv.keys.acme)
        .await
        .ok(200);
}

/// `Accept` is negotiated by q-value (RFC 9110 §12.5.1) between the JSON
/// answer and the stream, on a task's events and on the feed: `q=0` is not
/// acceptable, the higher q wins, a tie goes to JSON unless the stream is
/// named more specifically or first, and a wildcard alone never opens a
/// stream.
#[tokio::test]
async fn accept_is_negotiated_by_q_value() {
    let srv = Server::in_process().await;
    let task = srv
        .new_task(&ikey(), "generation.dispatch", generation("a"))
        .await;
    let id = s(&task["id"]);
    let cases = [
        ("text/event-stream", true),
        ("Text/Event-Stream", true),
        ("text/event-stream;q=0", false),
        ("text/event-stream; q=0.0, application/json;q=0.1", false),
        ("application/json;q=0.5, text/event-stream", true),
        ("application/json, text/event-stream;q=0.9", false),
        ("application/json, text/event-stream", false),
        ("text/event-stream, */*", true),
        ("text/event-stream;q=0.5, */*", false),
        ("*/*", false),
        ("text/*", false),
        ("application/json", false),
    ];
    for path in [format!("/v1/tasks/{id}/events"), "/v1/events".to_owned()] {
        for (accept, streams) in cases {
            let res = srv
                .http
                .get(format!("{}{path}", srv.url))
                .bearer_auth(&srv.keys.acme)
                .header("accept", accept)
                .send()
                .await
                .unwrap();
            assert_eq!(res.status().as_u16(), 200, "{path} {accept}");
            let ct = res.headers()["content-type"].to_str().unwrap().to_owned();
            let want = if streams {
                "text/event-stream"
            } else {
                "application/json"
            };
            assert!(ct.starts_with(want), "{path} Accept: {accept} → {ct}");
        }
    }
}
