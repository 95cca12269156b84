//! The assembled server over a real SQLite store on a real socket: what it
//! serves, and that its shutdown drains what waits instead of waiting it out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use idem_core::model::Role;

use super::*;

/// A SQLite store in its own temporary directory (removed with it).
fn sqlite_store() -> (Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_store_sqlite::open(dir.path().join("idem.db"), Default::default()).unwrap();
    (store, dir)
}

/// The status of `GET url`.
async fn status_of(url: &str) -> u16 {
    reqwest::get(url).await.unwrap().status().as_u16()
}

/// The API, `/metrics` and the console are served; after the shutdown the
/// run ends drained and the address takes no more connections.
#[tokio::test]
async fn serves_the_api_and_the_console_then_stops_drained() {
    let (store, _dir) = sqlite_store();
    let app = App::build(store, Config::bundled().unwrap(), Options::default())
        .await
        .unwrap();
    let url = app.url();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    assert_eq!(status_of(&format!("{url}/healthz")).await, 200);
    assert_eq!(status_of(&format!("{url}/metrics")).await, 200);
    assert_eq!(status_of(&format!("{url}/console/sign-in")).await, 200);
    stop.send(()).unwrap();
    assert_eq!(run.await.unwrap().unwrap(), Stopped::Drained);
    assert!(reqwest::get(format!("{url}/healthz")).await.is_err());
}

/// Without a console configuration `/console` is the API's 404.
#[tokio::test]
async fn without_a_console_its_paths_are_not_found() {
    let (store, _dir) = sqlite_store();
    let options = Options {
        console: None,
        ..Options::default()
    };
    let app = App::build(store, Config::bundled().unwrap(), options)
        .await
        .unwrap();
    let url = app.url();
    let (_stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    assert_eq!(status_of(&format!("{url}/console/sign-in")).await, 404);
    assert_eq!(status_of(&format!("{url}/healthz")).await, 200);
}

/// A long-poll claim (30 s) waiting when the shutdown begins is answered at
/// once with what it finds (nothing), so the run ends drained well inside a
/// grace period shorter than the claim's wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_long_poll_claim_is_answered_when_the_shutdown_begins() {
    let (store, _dir) = sqlite_store();
    let (_, exec) = store
        .create_api_key("acme", Role::Executor, None)
        .await
        .unwrap();
    let options = Options {
        shutdown_grace: Duration::from_secs(5),
        ..Options::default()
    };
    let app = App::build(store, Config::bundled().unwrap(), options)
        .await
        .unwrap();
    let url = app.url();
    let hub = Arc::clone(&app.state().claims);
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    let claim = tokio::spawn(
        reqwest::Client::new()
            .post(format!("{url}/v1/attempts/claim"))
            .bearer_auth(exec)
            .json(&serde_json::json!({
                "executor_id": "lp",
                "operations": ["generation.dispatch"],
                "wait_ms": 30_000,
            }))
            .send(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while hub.waiting().0 == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim never waited"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.send(()).unwrap();
    let answer = claim.await.unwrap().unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(body["attempts"], serde_json::json!([]), "{body}");
    assert_eq!(run.await.unwrap().unwrap(), Stopped::Drained);
}

/// An address already taken is [`AppError::Bind`] naming it.
#[tokio::test]
async fn a_taken_address_is_a_bind_error() {
    let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = taken.local_addr().unwrap();
    let (store, _dir) = sqlite_store();
    let options = Options {
        listen: Listen::Addr(addr),
        ..Options::default()
    };
    let err = App::build(store, Config::bundled().unwrap(), options)
        .await
        .err()
        .expect("the address is taken");
    assert!(
        matches!(err, AppError::Bind { addr: a, .. } if a == addr),
        "{err}"
    );
}
