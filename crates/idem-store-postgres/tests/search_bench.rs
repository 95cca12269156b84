//! docs/benchmarks.md "Task search" on PostgreSQL: a page of 50 `queued`
//! tasks with 10,000 and with 1,000,000 tasks in the tenant, and the plan of
//! that page. Seeds by copying one submitted task with `generate_series`.
//! Run: `cargo test --release -p idem-store-postgres --features
//! idem-store/conformance --test search_bench -- --ignored --nocapture`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use idem_core::model::TaskState;
use idem_store::conformance::{BENCH_TENANT, bench_pages, bench_template};
use idem_store::ops::TaskQuery;
use idem_store_postgres::testing;

/// Copies task `$1` `$2` times: a tenth `queued`, the rest `succeeded`, one
/// ms apart; `$3` makes the ids and keys of this call distinct.
const SEED: &str = "INSERT INTO tasks (id, tenant, operation, idempotency_key, fingerprint, canonical_request, params, \
     state, generation, version, event_seq, attempt_count, execute_count, usage, contract_id, api_key_id, next_kind, \
     ready_at, deadline_at, created_at, updated_at) \
     SELECT md5(t.id::text || '-' || $3::bigint || '-' || g)::uuid, t.tenant, t.operation, 'bench-' || $3::bigint || '-' || g, t.fingerprint, \
     t.canonical_request, t.params, CASE WHEN g % 10 = 0 THEN 'queued' ELSE 'succeeded' END, t.generation, t.version, \
     t.event_seq, t.attempt_count, t.execute_count, t.usage, t.contract_id, t.api_key_id, t.next_kind, t.ready_at, \
     t.deadline_at, t.created_at - 100000000 * $3::bigint + g, t.updated_at \
     FROM tasks t, generate_series(1, $2::bigint) g WHERE t.id = $1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run it by name (docs/benchmarks.md)"]
async fn search_page_latency() {
    let db = testing::fresh_database().await;
    let store = idem_store_postgres::connect(db.url(), Default::default())
        .await
        .unwrap();
    let template = bench_template(&store).await;
    let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut held = 1;
    for (round, n) in [10_000_i64, 1_000_000].into_iter().enumerate() {
        let t = std::time::Instant::now();
        client
            .execute(SEED, &[&template, &(n - held), &(round as i64 + 1)])
            .await
            .unwrap();
        client.batch_execute("VACUUM ANALYZE tasks").await.unwrap();
        held = n;
        println!("seeded {n} tasks in {:.1} s", t.elapsed().as_secs_f64());
        bench_pages(&store, &format!("postgres, {n} tasks"), 500).await;
        let q = TaskQuery {
            states: vec![TaskState::Queued],
            limit: 50,
            ..TaskQuery::default()
        };
        let (sql, params) = testing::search_page_sql(BENCH_TENANT, &q);
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            params.iter().map(|p| &**p as _).collect();
        let plan = client
            .query(
                &format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}"),
                &params,
            )
            .await
            .unwrap();
        for row in plan {
            println!("  {}", row.get::<_, String>(0));
        }
    }
    drop(store);
}
