//! The measurement behind docs/benchmarks.md "Task search": the latency of a
//! page of 50 with a state filter, first page and a page deep in the keyset,
//! over a store a backend seeded with `n` tasks of one tenant (a tenth of
//! them `queued`). Not a test: it asserts nothing about speed and prints the
//! figures; each backend runs it from an ignored test.

use std::time::{Duration, Instant};

use idem_core::model::{Role, TaskState};
use serde_json::json;

use super::{NON_SAFE, contract, must, submission};
use crate::Store;
use crate::ops::SubmitOutcome;
use crate::ops::search::TaskQuery;

/// The tenant of the benchmark.
pub const BENCH_TENANT: &str = "bench";

/// Submits the one task a backend copies `n` times (the template row) and
/// returns its id.
pub async fn bench_template(store: &Store) -> uuid::Uuid {
    let (key, _) = must(
        store.create_api_key(BENCH_TENANT, Role::Client, None).await,
        "create_api_key",
    );
    let s = submission(
        BENCH_TENANT,
        NON_SAFE,
        "template",
        json!({"payee": "p", "amount": 1, "currency": "EUR"}),
        contract(NON_SAFE),
        &key,
    );
    match must(store.submit(s).await, "submit") {
        SubmitOutcome::Created(t) => t.id,
        other => panic!("template: {other:?}"),
    }
}

/// `rounds` first pages and `rounds` deep pages of 50 `queued` tasks;
/// prints p50 and p99 of each, labelled `label`.
pub async fn bench_pages(store: &Store, label: &str, rounds: usize) {
    let q = TaskQuery {
        states: vec![TaskState::Queued],
        limit: 50,
        ..TaskQuery::default()
    };
    // A cursor half-way down: walk with big pages to it.
    let mut deep = q.clone();
    deep.limit = 200;
    for _ in 0..10 {
        let page = must(
            store.search_tasks(BENCH_TENANT, deep.clone()).await,
            "search",
        );
        deep.cursor = page.next_cursor;
    }
    deep.limit = 50;
    for (what, query) in [("first page", q), ("page after 2,000", deep)] {
        let mut times: Vec<Duration> = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t = Instant::now();
            let page = must(
                store.search_tasks(BENCH_TENANT, query.clone()).await,
                "search",
            );
            times.push(t.elapsed());
            assert_eq!(page.tasks.len(), 50, "a full page");
        }
        times.sort();
        let p = |q: f64| times[((times.len() as f64 - 1.0) * q) as usize];
        println!(
            "{label}: {what}: p50 {:.3} ms, p99 {:.3} ms ({rounds} rounds)",
            p(0.5).as_secs_f64() * 1e3,
            p(0.99).as_secs_f64() * 1e3
        );
    }
}
