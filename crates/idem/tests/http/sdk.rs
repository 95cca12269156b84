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

/// The Rust client's retry after a lost answer: a proxy forwards the first submit and
/// closes the connection before relaying its answer; `submit_with_retry`
/// repeats it under the same key and gets the same task, and the tenant holds
/// exactly one task for the scope (counted with a search). The same key with
/// another amount is the typed conflict naming the differing field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_first_answer_is_retried_under_the_same_key() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let srv = Server::start().await;
    let upstream = srv.url.trim_start_matches("http://").to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut client, _)) = listener.accept().await {
            let mut server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            if first {
                // Forward the request, wait for the answer to start, then cut
                // the client off: the submit is committed, its answer lost.
                first = false;
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let n = client.read(&mut buf).await.unwrap_or(0);
                    server.write_all(&buf[..n]).await.unwrap();
                    let _ = server.read(&mut buf).await;
                    drop(client);
                });
            } else {
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        }
    });
    let c = Client::new(&proxy, srv.keys.acme.clone()).unwrap();
    let retry = SubmitRetry {
        max_tries: 3,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
    };
    let s = c
        .submit_with_retry("payment.release", &payment(77), "lost-answer-1", &retry)
        .await
        .unwrap();
    assert!(s.tries >= 2, "the first answer was lost: {s:?}");
    assert!(
        s.replayed,
        "the retry is answered with the task of the first try"
    );
    let filter = idem_client::TaskFilter {
        idempotency_key_prefix: Some("lost-answer-1".into()),
        ..idem_client::TaskFilter::default()
    };
    let page = c.list_tasks(&filter, None).await.unwrap();
    assert_eq!(page.tasks.len(), 1, "one task for the scope");
    assert_eq!(page.tasks[0].id, s.task.id);
    let e = c
        .submit("payment.release", &payment(78), "lost-answer-1")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some("IDEMPOTENCY_CONFLICT"));
    let problem = e.problem().unwrap();
    assert_eq!(problem.task_id, Some(s.task.id));
    assert_eq!(problem.differing_fields, Some(vec!["/amount".to_owned()]));
}
