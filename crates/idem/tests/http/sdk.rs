//! The client SDK (`idem-client`) against a real `idem serve`.

use std::time::Duration;

use idem_client::{Client, ClientError, SubmitRetry};
use serde_json::json;

use crate::support::Server;

fn payment(amount: i64) -> serde_json::Value {
    json!({"payee": "acct_1", "amount": amount, "currency": "EUR"})
}

/// The lookup sends the key as stored, so a key that starts with `"` is found.
#[tokio::test]
async fn find_task_finds_a_key_that_starts_with_a_quote() {
    let srv = Server::start().await;
    let c = Client::new(&srv.url, srv.keys.acme.clone()).unwrap();
    let s = c
        .submit("payment.release", &payment(5), "\"lead")
        .await
        .unwrap();
    let found = c.find_task("payment.release", "\"lead").await.unwrap();
    assert_eq!(found.id, s.task.id);
}

/// When every try fails, `submit_with_retry` looks the scope up, and returns
/// the task it finds only if it is this request's: another request's task
/// under the key (a conflict) is never handed back as this one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_with_retry_never_returns_another_requests_task() {
    let mut srv = Server::start().await;
    let first = Client::new(&srv.url, srv.keys.acme.clone())
        .unwrap()
        .submit("payment.release", &payment(5), "c1")
        .await
        .unwrap();
    // A new server process has not seen the scope bound, so its submits of
    // "c1" go to the writer instead of the retry reader ...
    srv.restart();
    let c = Client::new(&srv.url, srv.keys.acme.clone())
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    // ... and another process holds SQLite's write lock: submits cannot be
    // written (they time out), while reads, and so the lookup, still work.
    let store = srv.store();
    let path = store.strip_prefix("sqlite://").unwrap();
    let lock = rusqlite::Connection::open(path).unwrap();
    lock.execute_batch("BEGIN IMMEDIATE").unwrap();
    let once = SubmitRetry {
        max_tries: 1,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(10),
    };
    let changed = c
        .submit_with_retry("payment.release", &payment(999), "c1", &once)
        .await;
    assert!(
        matches!(&changed, Err(e) if e.is_retryable()),
        "another request's task came back: {changed:?}"
    );
    let same = c
        .submit_with_retry("payment.release", &payment(5), "c1", &once)
        .await
        .unwrap();
    assert!(same.looked_up);
    assert_eq!(same.task.id, first.task.id);
    lock.execute_batch("ROLLBACK").unwrap();
    drop(lock);
    // Once the store writes again, the changed request is the conflict it is.
    let policy = SubmitRetry::default();
    match c
        .submit_with_retry("payment.release", &payment(999), "c1", &policy)
        .await
    {
        Err(ClientError::Api { status: 422, .. }) => {}
        other => panic!("expected 422 IDEMPOTENCY_CONFLICT, got {other:?}"),
    }
}

/// `submit_and_wait` and `wait_task` hold the answer until an executor
/// delivers the task; a wait that runs out answers the task as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_and_wait_returns_the_delivered_task() {
    let srv = Server::fast().await;
    let c = Client::new(&srv.url, srv.keys.acme.clone()).unwrap();
    let queued = c
        .wait_task(
            c.submit("generation.dispatch", &json!({"prompt": "p"}), "sw-0")
                .await
                .unwrap()
                .task
                .id,
            Duration::from_millis(1),
        )
        .await
        .unwrap();
    assert_eq!(queued.state, idem_client::TaskState::Queued);
    let exec = Client::new(&srv.url, srv.keys.exec.clone()).unwrap();
    let held = {
        let c = c.clone();
        tokio::spawn(async move {
            c.submit_and_wait(
                "generation.dispatch",
                &json!({"prompt": "q"}),
                "sw-1",
                Duration::from_secs(30),
            )
            .await
        })
    };
    // The executor takes the held submit's task (the earlier one first).
    let mut delivered = 0;
    while delivered < 2 {
        let claimed = exec
            .claim("sdk", &["generation.dispatch"], 1, None, 10_000)
            .await
            .unwrap();
        for a in claimed {
            let body = idem_client::ReportBody::succeeded(a.generation, json!({"url": "u"}));
            exec.report(a.id, &body).await.unwrap();
            delivered += 1;
        }
    }
    let s = held.await.unwrap().unwrap();
    assert_eq!(s.task.state, idem_client::TaskState::Succeeded);
    let again = c
        .wait_task(s.task.id, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again.state, idem_client::TaskState::Succeeded);
}
