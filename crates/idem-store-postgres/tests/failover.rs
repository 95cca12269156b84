//! Failover: a store on a multi-host URL (`target_session_attrs=read-write`)
//! follows the primary without a restart. Each test makes its own throwaway
//! clusters (a primary and a streaming standby, or two independent servers)
//! and removes them.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use idem_core::config::Config;
use idem_core::model::Role;
use idem_store::ops::{Submission, SubmitOutcome};
use idem_store::{Notice, Store, StoreError};
use idem_store_postgres::testing::StandbyPair;
use idem_store_postgres::{PgOptions, connect};
use serde_json::json;
use uuid::Uuid;

fn submission(key: &str, api_key_id: Uuid) -> Submission {
    let contract = Config::bundled()
        .unwrap()
        .contract("generation.dispatch")
        .unwrap();
    Submission {
        tenant: "acme".into(),
        operation: "generation.dispatch".into(),
        idempotency_key: key.into(),
        fingerprint: format!("sha256:{}", "a".repeat(64)),
        canonical_request: "{\"prompt\":\"a\"}".into(),
        params: json!({"prompt": "a"}),
        contract: idem_core::contract::FrozenContract::new(contract).unwrap(),
        api_key_id,
        grant: None,
        traceparent: None,
        rate_limits: Vec::new(),
        concurrency_key: None,
        priority: 3,
        fairness_key: None,
    }
}

/// Submits `key` until it is answered (at most `tries` times, `pause`
/// apart); every failure must be `Unavailable` (503: nothing half-written).
/// Returns the outcome and how many tries failed.
async fn submit_until_answered(
    store: &Store,
    key: &str,
    api_key: Uuid,
    tries: usize,
    pause: Duration,
) -> (SubmitOutcome, usize) {
    let mut failed = 0;
    for _ in 0..tries {
        match store.submit(submission(key, api_key)).await {
            Ok(o) => return (o, failed),
            Err(StoreError::Unavailable(_)) => failed += 1,
            Err(e) => panic!("a submit during the failover failed with {e:?}, not Unavailable"),
        }
        tokio::time::sleep(pause).await;
    }
    panic!("{key} was not answered in {tries} tries");
}

/// A primary with a synchronous standby; the store on both hosts. The
/// primary is killed (SIGKILL): submits fail with `Unavailable` until the
/// standby is promoted, then the same store (no restart) writes on it,
/// every submit acknowledged before the kill is there (a replay), and the
/// listening connection listens again on the new primary (a resync, then
/// the notification of a new submit).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_follows_a_promoted_standby_without_a_restart() {
    let mut pair = StandbyPair::start(true).unwrap();
    pair.psql(pair.primary_port(), "CREATE DATABASE idem")
        .unwrap();
    let url = pair.url("idem");
    let mut options = PgOptions::default().with_max_size(8);
    options.operation_timeout = Duration::from_secs(10);
    let store = connect(&url, options).await.unwrap();
    let (key, _) = store
        .create_api_key("acme", Role::Admin, None)
        .await
        .unwrap();
    let mut acknowledged = Vec::new();
    for i in 0..20 {
        let k = format!("before-{i}");
        assert!(matches!(
            store.submit(submission(&k, key.id)).await.unwrap(),
            SubmitOutcome::Created(_)
        ));
        acknowledged.push(k);
    }
    let mut changes = store.changes().subscribe();

    pair.kill_primary().unwrap();
    // Between the kill and the promotion: no primary, a clear 503.
    let err = store
        .submit(submission("between", key.id))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");

    pair.promote(true).unwrap();
    let (outcome, _) =
        submit_until_answered(&store, "after", key.id, 100, Duration::from_millis(100)).await;
    assert!(matches!(outcome, SubmitOutcome::Created(_)), "{outcome:?}");
    for k in &acknowledged {
        let replay = store.submit(submission(k, key.id)).await.unwrap();
        assert!(
            matches!(replay, SubmitOutcome::Replayed(_)),
            "{k} acknowledged before the failover is not on the promoted standby: {replay:?}"
        );
    }
    // The write of the new primary is heard: the listening connection
    // reconnected to it (a resync first, as after any loss); a submit every
    // 200 ms until then.
    let heard = tokio::time::timeout(Duration::from_secs(20), async {
        let mut resynced = false;
        loop {
            tokio::select! {
                n = changes.next() => match n {
                    Notice::Resync => resynced = true,
                    Notice::Change(_) if resynced => return,
                    Notice::Change(_) => {}
                },
                () = tokio::time::sleep(Duration::from_millis(200)) => {
                    let k = Uuid::new_v4().to_string();
                    let _ = store.submit(submission(&k, key.id)).await;
                }
            }
        }
    })
    .await;
    assert!(
        heard.is_ok(),
        "no change was heard from the promoted standby"
    );
}

/// Two servers on one URL, the first one turned read-only under a running
/// store (`default_transaction_read_only`, as a server that stops accepting
/// writes): a write on a pooled connection to it fails with `Unavailable`
/// (SQLSTATE 25006), that connection is closed instead of going back to the
/// pool, and the next connections go to the server that accepts writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_to_a_server_that_refuses_writes_is_not_reused() {
    let first = StandbyPair::start(false).unwrap();
    // The standby of this pair is unused; the second server is another
    // primary (its own pair's primary).
    let second = StandbyPair::start(false).unwrap();
    for p in [&first, &second] {
        p.psql(p.primary_port(), "CREATE DATABASE idem").unwrap();
    }
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/idem",
        first.primary_port(),
        second.primary_port()
    );
    let single = |port: u16| format!("postgres://postgres@127.0.0.1:{port}/idem");
    // Both schemas (an admin key on each: authentication reads whichever
    // server the connection reached).
    let mut keys = Vec::new();
    for port in [first.primary_port(), second.primary_port()] {
        let s = connect(&single(port), PgOptions::default()).await.unwrap();
        keys.push(s.create_api_key("acme", Role::Admin, None).await.unwrap().0);
    }
    let store = connect(&url, PgOptions::default().with_max_size(4))
        .await
        .unwrap();
    let on_first = keys[0].id;
    store
        .submit(submission("on-first", on_first))
        .await
        .unwrap();
    first
        .psql(
            first.primary_port(),
            "ALTER SYSTEM SET default_transaction_read_only = on",
        )
        .unwrap();
    first
        .psql(first.primary_port(), "SELECT pg_reload_conf()")
        .unwrap();
    // Each pooled connection to the first server fails once at most (and is
    // closed); then a new connection skips it (`SHOW transaction_read_only`).
    let (outcome, failed) = submit_until_answered(
        &store,
        "on-second",
        keys[1].id,
        20,
        Duration::from_millis(50),
    )
    .await;
    assert!(matches!(outcome, SubmitOutcome::Created(_)), "{outcome:?}");
    assert!(
        failed <= 8,
        "{failed} submits failed before one reached the second server"
    );
    let found = second
        .psql_in(
            second.primary_port(),
            "idem",
            "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = 'on-second'",
        )
        .unwrap();
    assert_eq!(found, "1");
}
