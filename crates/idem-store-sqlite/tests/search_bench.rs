//! docs/benchmarks.md "Task search" on SQLite: a page of 50 `queued` tasks
//! with 10,000 and with 1,000,000 tasks in the tenant, and the plan of that
//! page. Seeds by copying one submitted task with a recursive CTE.
//! Run: `cargo test --release -p idem-store-sqlite --features
//! idem-store/conformance --test search_bench -- --ignored --nocapture`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use idem_core::model::TaskState;
use idem_store::conformance::{BENCH_TENANT, bench_pages, bench_template};
use idem_store::ops::TaskQuery;

/// Copies task `?1` `?2` times: a tenth `queued`, the rest `succeeded`, one
/// ms apart; `?3` makes the ids and keys of this call distinct.
const SEED: &str = "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?2) \
     INSERT INTO tasks (id, tenant, operation, idempotency_key, fingerprint, canonical_request, params, \
     state, generation, version, event_seq, attempt_count, execute_count, usage, contract_id, api_key_id, next_kind, \
     ready_at, deadline_at, created_at, updated_at) \
     SELECT printf('%08x-0000-7000-8000-%012x', ?3, n), t.tenant, t.operation, 'bench-' || ?3 || '-' || n, t.fingerprint, \
     t.canonical_request, t.params, CASE WHEN n % 10 = 0 THEN 'queued' ELSE 'succeeded' END, t.generation, t.version, \
     t.event_seq, t.attempt_count, t.execute_count, t.usage, t.contract_id, t.api_key_id, t.next_kind, t.ready_at, \
     t.deadline_at, t.created_at - 100000000 * ?3 + n, t.updated_at \
     FROM tasks t, g WHERE t.id = ?1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run it by name (docs/benchmarks.md)"]
async fn search_page_latency() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = idem_store_sqlite::open(&path, Default::default()).unwrap();
    let template = bench_template(&store).await.to_string();
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.busy_timeout(std::time::Duration::from_secs(30))
        .unwrap();
    let mut held = 1;
    for (round, n) in [10_000_i64, 1_000_000].into_iter().enumerate() {
        let t = std::time::Instant::now();
        conn.execute(
            SEED,
            rusqlite::params![template, n - held, round as i64 + 1],
        )
        .unwrap();
        conn.execute_batch("ANALYZE").unwrap();
        held = n;
        println!("seeded {n} tasks in {:.1} s", t.elapsed().as_secs_f64());
        bench_pages(&store, &format!("sqlite, {n} tasks"), 500).await;
        let q = TaskQuery {
            states: vec![TaskState::Queued],
            limit: 50,
            ..TaskQuery::default()
        };
        let (sql, params) = idem_store_sqlite::search_page_sql(BENCH_TENANT, &q);
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params.iter()), |r| {
                r.get::<_, String>(3)
            })
            .unwrap();
        for r in rows {
            println!("  {}", r.unwrap());
        }
    }
    drop(store);
}
