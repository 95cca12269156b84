//! `idem-lab bench-waiters` (what waiting executors cost):
//! the run end to end on a small scale, on SQLite and on a fresh PostgreSQL
//! database, and its refusals.

use idem_store_postgres::testing::fresh_database;
use serde_json::Value;

use crate::support::{lab, lab_serving};

/// Runs `idem-lab bench-waiters ARGS --json`; returns the report, after checking
/// the run succeeded.
fn run(args: &[&str]) -> Value {
    let out = lab_serving()
        .arg("bench-waiters")
        .args(args)
        .arg("--json")
        .output()
        .expect("run idem-lab bench-waiters");
    assert!(
        out.status.success(),
        "idem-lab bench-waiters failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("one JSON object")
}

/// What every run reports: both submit phases answered with latencies, every
/// task submitted while waiters wait claimed by one of them, the waiters'
/// claims answered again and again, nothing failed.
fn check_common(r: &Value, submits: u64) {
    for phase in ["submits", "submits_with_waiters"] {
        let p = &r[phase];
        assert_eq!(p["submits"].as_u64(), Some(submits), "{phase}: {r}");
        assert_eq!(p["failed"].as_u64(), Some(0), "{phase}: {r}");
        let (p50, p99) = (p["p50_ms"].as_f64().unwrap(), p["p99_ms"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{phase}: {r}");
    }
    assert!(
        r["submits"]["claims"].is_null(),
        "no waiters, no claims: {r}"
    );
    let claims = &r["submits_with_waiters"]["claims"];
    assert_eq!(claims["claimed"].as_u64(), Some(submits), "{r}");
    assert_eq!(claims["unclaimed"].as_u64(), Some(0), "{r}");
    let (p50, p99) = (
        claims["p50_ms"].as_f64().unwrap(),
        claims["p99_ms"].as_f64().unwrap(),
    );
    assert!(p50 > 0.0 && p50 <= p99, "{r}");
    assert!(
        claims["after_answer_p50_ms"].as_f64().unwrap() <= p50,
        "after the answer is within the delay from the sending: {r}"
    );
    assert!(r["waiting"]["polls_per_s"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(r["idle"]["polls_per_s"].as_f64(), Some(0.0), "{r}");
    assert_eq!(r["failed_polls"].as_u64(), Some(0), "{r}");
    assert_eq!(r["failed_reports"].as_u64(), Some(0), "{r}");
    assert!(
        r["targets"]["submit_p50_ratio"].as_f64().unwrap() > 0.0,
        "{r}"
    );
}

/// On a temporary SQLite store: no transaction counts, everything else.
#[test]
fn bench_waiters_runs_on_sqlite() {
    let r = run(&[
        "--waiters",
        "20",
        "--classes",
        "2",
        "--seconds",
        "2",
        "--submits",
        "20",
        "--wait-ms",
        "3000",
    ]);
    assert_eq!(r["store"], "sqlite", "{r}");
    assert_eq!(r["waiters"].as_u64(), Some(20), "{r}");
    assert_eq!(r["classes"].as_u64(), Some(2), "{r}");
    check_common(&r, 20);
    for phase in ["idle", "waiting"] {
        assert!(r[phase]["tx_per_s"].is_null(), "{phase}: {r}");
    }
    assert!(r["submits"]["tx_per_submit"].is_null(), "{r}");
    assert!(r["targets"]["tx_per_s"].is_null(), "{r}");
    assert!(r["listeners"].is_null(), "{r}");
}

/// On PostgreSQL, over two instances: transactions per second from
/// `pg_stat_database` in both quiet phases (the sweepers commit several a
/// second), and per submit at least the submit's own.
#[tokio::test]
async fn bench_waiters_counts_transactions_on_postgres() {
    let db = fresh_database().await;
    let url = db.url().to_owned();
    let r = tokio::task::spawn_blocking(move || {
        run(&[
            "--store",
            &url,
            "--waiters",
            "10",
            "--instances",
            "2",
            "--seconds",
            "2",
            "--submits",
            "10",
            "--wait-ms",
            "2000",
            // The figures' presence is checked, not their values.
            "--settle-ms",
            "2000",
        ])
    })
    .await
    .unwrap();
    assert_eq!(r["store"], "postgres", "{r}");
    assert_eq!(r["instances"].as_u64(), Some(2), "{r}");
    check_common(&r, 10);
    for phase in ["idle", "waiting"] {
        assert!(
            r[phase]["tx_per_s"].as_f64().is_some_and(|t| t > 0.0),
            "{phase}: {r}"
        );
    }
    for phase in ["submits", "submits_with_waiters"] {
        assert!(r[phase]["tx_per_submit"].as_f64().is_some(), "{phase}: {r}");
    }
    assert!(r["targets"]["tx_per_s"].is_boolean(), "{r}");
    // Each task: its submit, its claim and its report are events.
    let listeners = &r["listeners"];
    assert!(listeners["events"].as_i64().unwrap() >= 3 * 10, "{r}");
    // An estimate (the listening sessions' transactions less the background
    // rate, which the sweeps' identity checks also move): a figure, never a
    // bound, so only its presence is checked.
    let per_event = listeners["tx_per_event_per_instance"].as_f64().unwrap();
    assert!(per_event >= 0.0, "{r}");
}

/// Options a run cannot honour are refused before anything starts, naming
/// the option.
#[test]
fn bench_waiters_refuses_what_it_cannot_run() {
    for (args, says) in [
        (
            &["--instances", "2"][..],
            "--instances 2 needs a PostgreSQL store",
        ),
        (&["--wait-ms", "30001"][..], "--wait-ms"),
        (&["--waiters", "4", "--classes", "5"][..], "--classes"),
        (&["--store", "mysql://x"][..], "--store"),
    ] {
        let out = lab_serving()
            .arg("bench-waiters")
            .args(args)
            .output()
            .expect("run idem-lab bench-waiters");
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// An `idem` binary that is not there is named before anything starts, with
/// the way to name another; `IDEM_BIN` and `--idem-bin` are the same option.
#[test]
fn a_missing_idem_binary_is_named() {
    let missing = "/nonexistent/idem";
    for out in [
        lab()
            .args(["bench-waiters", "--idem-bin", missing])
            .output(),
        lab()
            .args(["chaos", "--ops", "10"])
            .env("IDEM_BIN", missing)
            .output(),
    ] {
        let out = out.expect("run idem-lab");
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("no idem binary at {missing}")) && err.contains("--idem-bin"),
            "{err}"
        );
    }
}

/// The `idem serve` processes the lab started, by pid: the children of
/// process `pid` (Linux `/proc/PID/task/*/children`).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Stopped with SIGTERM in the middle of a run, the lab stops the servers it
/// started before it exits, and says why it stopped.
#[test]
fn bench_waiters_stopped_by_sigterm_leaves_no_server_running() {
    use std::io::{BufRead, BufReader};
    let mut child = lab_serving()
        .args(["bench-waiters", "--waiters", "2", "--submits", "1"])
        .args(["--seconds", "60", "--wait-ms", "1000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run idem-lab bench-waiters");
    let mut stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    let mut said = String::new();
    // The first quiet phase runs 60 s: the server is up by then.
    loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).expect("read the lab's stderr") == 0 {
            panic!("the lab ended before its idle phase: {said}");
        }
        said.push_str(&line);
        if line.contains("idle, no waiters") {
            break;
        }
    }
    let servers = children(child.id());
    assert!(!servers.is_empty(), "an idem serve runs: {said}");
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).expect("read the lab's stderr");
    let status = child.wait().expect("wait for the lab");
    assert_eq!(status.code(), Some(1), "{said}{rest}");
    assert!(rest.contains("stopped by SIGTERM"), "{rest}");
    // A server killed on the lab's way out is reaped by init once the lab is gone.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    for pid in servers {
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // A zombie (state Z) is no longer running.
            if state.split_whitespace().nth(2) == Some("Z") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "server {pid} still runs after the lab exited"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
