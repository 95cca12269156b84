//! An overloaded PostgreSQL pool is not a failed store (SPEC §4 status
//! table): a request that waits for a free connection past the pool's wait
//! bound is answered 503 `OVERLOADED` with `Retry-After`, not `UNAVAILABLE`,
//! and a long-poll claim that cannot get a connection keeps waiting within
//! its `wait_ms`, so a crowd of waiting executors against a backlog sees no
//! 5xx and every task is leased once (judged in the database).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::multi_pg::{count, db};
use crate::support::{Keys, Resp, Server, send};
use idem_store_postgres::testing::fresh_database;
use serde_json::json;

/// The attempts of a claim's 200 answer.
#[track_caller]
fn attempts(r: &Resp) -> usize {
    r.ok(200)["attempts"].as_array().map_or(0, Vec::len)
}

/// Until a session of the database waits on a lock (bounded).
async fn waits_on_a_lock(watcher: &tokio_postgres::Client) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(
        watcher,
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the claim never waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// With a pool of one connection held by a claim that waits on a table
/// lock, a request waits the pool's wait bound and is answered 503
/// `OVERLOADED` with `Retry-After: 2` (counted as refused, not as a store
/// failure); a long-poll claim in the same situation keeps waiting past that
/// bound (counted as waited) and, once the connection is free again, claims
/// within its `wait_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_gets_no_connection_is_overloaded_and_a_long_poll_keeps_waiting() {
    let url = fresh_database().await;
    let keys = Server::create_keys(&url);
    let server = Server::start_pg(&url, &keys, &[("IDEM_PG_POOL_SIZE", "1")]).await;
    for k in ["held-1", "held-2", "held-3"] {
        server
            .submit(k, "generation.dispatch", json!({"prompt": k}))
            .await
            .ok(201);
    }
    let claim = |executor: &str, wait_ms: u64| {
        let req = server
            .http
            .post(format!("{}/v1/attempts/claim", server.url))
            .bearer_auth(&server.keys.exec)
            .json(&json!({
                "executor_id": executor,
                "operations": ["generation.dispatch"],
                "max": 1,
                "wait_ms": wait_ms,
            }));
        tokio::spawn(send(req))
    };
    let counter = |series: &'static str| {
        let req = server.http.get(format!("{}/metrics", server.url));
        async move {
            let metrics = send(req).await.text;
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {series} in {metrics}"))
        }
    };
    let locker = db(&url).await;
    let watcher = db(&url).await;
    // A claim takes the pool's only connection and waits for the lock on
    // `events` (at most the 10 s statement timeout) to write its event; the
    // sweeper, which writes no event while nothing expires, is not held.
    let lock = || async {
        locker
            .batch_execute("BEGIN; LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
    };
    // Ends the lock; the held claim then gets its attempt.
    let unlocker = &locker;
    let release = |holder: tokio::task::JoinHandle<Resp>| async move {
        unlocker.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(attempts(&holder.await.unwrap()), 1, "the held claim");
    };

    lock().await;
    let holder = claim("holder", 0);
    waits_on_a_lock(&watcher).await;
    let r = server
        .get(&format!("/v1/tasks/{}", uuid::Uuid::new_v4()), &keys.acme)
        .await;
    r.assert_problem(503, "OVERLOADED");
    assert_eq!(r.header("retry-after"), "2", "{r:?}");
    release(holder).await;
    assert_eq!(
        counter("idem_overloaded_total{handled=\"refused\"}").await,
        1
    );
    assert_eq!(
        counter("idem_store_unavailable_total").await,
        0,
        "an overload is not a store failure"
    );

    lock().await;
    let holder = claim("holder", 0);
    waits_on_a_lock(&watcher).await;
    let sent = Instant::now();
    let waiting = claim("waiting", 20_000);
    let deadline = Instant::now() + Duration::from_secs(9);
    while counter("idem_overloaded_total{handled=\"waited\"}").await == 0 {
        assert!(
            Instant::now() < deadline,
            "the long poll never met the overload (answered already: {})",
            waiting.is_finished()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !waiting.is_finished(),
        "the long poll keeps waiting past the pool's wait bound"
    );
    release(holder).await;
    assert_eq!(
        attempts(&waiting.await.unwrap()),
        1,
        "the long poll claims once the connection is free"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(20),
        "within its wait_ms"
    );
    assert_eq!(
        counter("idem_overloaded_total{handled=\"refused\"}").await,
        1
    );
}

/// Figures of one run of [`claim_crowd`].
#[derive(Debug)]
struct CrowdRun {
    /// Claim answers received.
    answers: usize,
    /// Answers with status 500 and up.
    server_errors: usize,
    /// Attempts handed out in the answers.
    claimed: usize,
    /// From the first claim to the last answer.
    took: Duration,
}

/// `tasks` tasks of `generation.dispatch` submitted, then `claimers`
/// concurrent executors each claiming with `wait_ms` 5000 and `max` 1 until
/// every task was handed out (or `limit` passed), against one server with the
/// default pool of 16 connections. Checks in the database that no task has
/// two attempts and that the attempts leased equal the ones answered.
async fn claim_crowd(claimers: usize, tasks: usize, limit: Duration) {
    let url = fresh_database().await;
    let keys: Keys = Server::create_keys(&url);
    let server = Arc::new(Server::start_pg(&url, &keys, &[("IDEM_PG_POOL_SIZE", "16")]).await);
    // The backlog, 32 submits at a time.
    let next = Arc::new(AtomicUsize::new(0));
    let mut submitters = Vec::new();
    for _ in 0..32 {
        let (server, next) = (Arc::clone(&server), Arc::clone(&next));
        submitters.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= tasks {
                    return;
                }
                server
                    .submit(
                        &format!("crowd-{i}"),
                        "generation.dispatch",
                        json!({"prompt": format!("p{i}")}),
                    )
                    .await
                    .ok(201);
            }
        }));
    }
    for s in submitters {
        s.await.unwrap();
    }
    let claimed = Arc::new(AtomicUsize::new(0));
    let answers = Arc::new(AtomicUsize::new(0));
    let server_errors = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let stop_at = started + limit;
    let mut crowd = Vec::new();
    for w in 0..claimers {
        let server = Arc::clone(&server);
        let (claimed, answers, server_errors) = (
            Arc::clone(&claimed),
            Arc::clone(&answers),
            Arc::clone(&server_errors),
        );
        crowd.push(tokio::spawn(async move {
            while claimed.load(Ordering::SeqCst) < tasks && Instant::now() < stop_at {
                let req = server
                    .http
                    .post(format!("{}/v1/attempts/claim", server.url))
                    .bearer_auth(&server.keys.exec)
                    .timeout(Duration::from_secs(60))
                    .json(&json!({
                        "executor_id": format!("crowd-{w}"),
                        "operations": ["generation.dispatch"],
                        "max": 1,
                        "wait_ms": 5000,
                        "lease_ms": 300000,
                    }));
                let r = send(req).await;
                answers.fetch_add(1, Ordering::SeqCst);
                if r.status >= 500 {
                    server_errors.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                claimed.fetch_add(attempts(&r), Ordering::SeqCst);
            }
        }));
    }
    for c in crowd {
        c.await.unwrap();
    }
    let run = CrowdRun {
        answers: answers.load(Ordering::SeqCst),
        server_errors: server_errors.load(Ordering::SeqCst),
        claimed: claimed.load(Ordering::SeqCst),
        took: started.elapsed(),
    };
    eprintln!(
        "{claimers} claimers against {tasks} tasks: {} answers, {} of them 5xx, {} attempts claimed, in {:?}",
        run.answers, run.server_errors, run.claimed, run.took
    );
    let db = db(&url).await;
    let twice = count(
        &db,
        "SELECT count(*) FROM (SELECT task_id FROM attempts WHERE kind = 'execute'
         GROUP BY task_id HAVING count(*) > 1) t",
    )
    .await;
    let leased = count(&db, "SELECT count(*) FROM attempts").await;
    assert_eq!(run.server_errors, 0, "{run:?}");
    assert_eq!(twice, 0, "no task has two execute attempts: {run:?}");
    assert_eq!(leased as usize, run.claimed, "leased = answered: {run:?}");
    assert_eq!(run.claimed, tasks, "every task claimed: {run:?}");
}

/// 200 waiting executors against 2,000 tasks on the default pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_waiting_claims_gets_no_5xx_and_leases_every_task_once() {
    claim_crowd(200, 2_000, Duration::from_secs(240)).await;
}

/// 1,000 waiting executors against 20,000 tasks on the default pool (a
/// load run: `cargo test -p idem --test http overload -- --ignored`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a load run of several minutes"]
async fn a_thousand_waiting_claims_get_no_5xx_and_lease_every_task_once() {
    claim_crowd(1_000, 20_000, Duration::from_secs(900)).await;
}
