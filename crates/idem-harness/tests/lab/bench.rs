//! `idem-lab bench`: every mode on its in-process server over SQLite and
//! PostgreSQL with the same-run baseline, and the runs whose figures would
//! not measure idem refused or failed.

use std::time::Duration;

use idem_store_postgres::testing::fresh_database;
use serde_json::json;

use crate::support::lab;

/// Runs `idem-lab bench … --json` and returns one object per mode, checking the
/// documented fields (docs/benchmarks.md).
fn bench_json(args: &[&str]) -> Vec<serde_json::Value> {
    let out = lab()
        .arg("bench")
        .args(args)
        .args(["--concurrency", "4", "--count", "120", "--json"])
        .output()
        .expect("run idem-lab bench");
    assert!(
        out.status.success(),
        "idem-lab bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    for r in &rows {
        for field in ["throughput_rps", "p50_ms", "p90_ms", "p99_ms", "max_ms"] {
            assert!(r[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {r}");
        }
        for field in ["baseline_rps", "ratio"] {
            if r["mode"] == json!("floor") {
                // The database baseline means nothing for the HTTP floor.
                assert!(r[field].is_null(), "{field} in {r}");
            } else {
                assert!(r[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {r}");
            }
        }
        assert!(r["p50_ms"].as_f64() <= r["p99_ms"].as_f64(), "{r}");
        assert_eq!(
            r["unexpected"],
            json!(0),
            "every answer as the mode expects: {r}"
        );
        assert_eq!(r["requests"], json!(120), "{r}");
        let answered: u64 = r["statuses"]
            .as_object()
            .map(|m| m.values().filter_map(serde_json::Value::as_u64).sum())
            .unwrap_or_default();
        assert_eq!(answered, 120, "every client's answers are counted: {r}");
    }
    rows
}

/// `idem-lab bench --load-threads 0` is refused before anything starts: a load
/// generator without a thread would send nothing.
#[test]
fn bench_refuses_zero_load_threads() {
    let out = lab()
        .args(["bench", "--load-threads", "0", "--count", "10"])
        .output()
        .expect("run idem-lab bench");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--load-threads"), "{err}");
}

/// A bench whose requests are refused (an executor's key may not submit:
/// 403) prints its figures with every request counted as bad, claims no
/// throughput, and exits non-zero: such figures do not measure idem.
#[tokio::test]
async fn bench_fails_when_requests_are_not_answered_as_its_mode_expects() {
    let config = idem_core::config::Config::bundled().unwrap();
    let server = idem_harness::server::start(None, config, Duration::from_millis(200))
        .await
        .unwrap();
    let out = lab()
        .args([
            "bench",
            "--mode",
            "new",
            "--concurrency",
            "2",
            "--count",
            "20",
        ])
        .args(["--no-baseline", "--json", "--url", &server.url])
        .args(["--api-key", &server.executor_key])
        .output()
        .expect("run idem-lab bench");
    assert!(!out.status.success());
    let row: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("one JSON row");
    assert_eq!(row["unexpected"], json!(20), "{row}");
    assert_eq!(row["statuses"], json!({"403": 20}), "{row}");
    assert_eq!(row["throughput_rps"], json!(0.0), "{row}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("new: 20 of 20"), "{err}");
}

/// `idem-lab bench` on its in-process SQLite server: every mode answers as
/// expected, with latency percentiles and the same-run raw-insert baseline.
#[tokio::test]
async fn bench_runs_every_mode_on_sqlite_with_its_baseline() {
    // Three load threads for four clients: one thread runs two.
    let rows = bench_json(&[
        "--mode",
        "new,replay,conflict,storm,mixed,floor",
        "--load-threads",
        "3",
    ]);
    let modes: Vec<&str> = rows.iter().filter_map(|r| r["mode"].as_str()).collect();
    assert_eq!(
        modes,
        ["new", "replay", "conflict", "storm", "mixed", "floor"]
    );
    for r in &rows {
        let store = if r["mode"] == json!("floor") {
            "loopback"
        } else {
            "sqlite"
        };
        assert_eq!(r["store"], json!(store), "{r}");
    }
}

/// `idem-lab bench` on an in-process server over PostgreSQL, with pgbench as the
/// same-run baseline: every mode answers as expected, with the documented fields.
#[tokio::test]
async fn bench_runs_on_postgres_with_the_pgbench_baseline() {
    let db = fresh_database().await;
    let rows = bench_json(&[
        "--mode",
        "new,replay,conflict,storm,mixed",
        "--bench-store",
        db.url(),
    ]);
    assert_eq!(rows.len(), 5);
    assert!(
        rows.iter().all(|r| r["store"] == json!("postgres")),
        "{rows:?}"
    );
}
