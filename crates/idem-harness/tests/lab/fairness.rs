//! `idem-lab fairness --http` (starvation of fair claims against `idem
//! serve` processes): a small flood on SQLite (two tenants) and on a fresh
//! PostgreSQL database over two servers (two fairness key values), and its
//! refusal of the runs it does not make over HTTP.

use idem_store_postgres::testing::fresh_database;
use serde_json::Value;

use crate::support::lab_serving;

/// Tasks of the flooding tenant (or value).
const FLOOD: u64 = 200;
/// Rounds of the single task.
const ROUNDS: usize = 5;

/// Runs `idem-lab fairness --http ARGS --json` with a flood of [`FLOOD`]
/// and [`ROUNDS`] rounds; returns the leases before the single task's, per
/// round, after checking the run succeeded.
fn run(args: &[&str]) -> Vec<u64> {
    let out = lab_serving()
        .args(["fairness", "--http", "--json", "--claimers", "2"])
        .args([
            "--flood",
            &FLOOD.to_string(),
            "--rounds",
            &ROUNDS.to_string(),
        ])
        .args(args)
        .output()
        .expect("run idem-lab fairness");
    assert!(
        out.status.success(),
        "idem-lab fairness failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("one JSON object");
    r["leases_before"]
        .as_array()
        .expect("leases_before")
        .iter()
        .map(|n| n.as_u64().expect("a count"))
        .collect()
}

/// Every round's single task is leased after a few of the flood's, not
/// behind the flood: queued after all of it, without fair turns it would
/// wait for nearly [`FLOOD`] leases.
fn check_fair(leases_before: &[u64]) {
    assert_eq!(leases_before.len(), ROUNDS, "{leases_before:?}");
    assert!(
        leases_before.iter().all(|&n| n <= FLOOD / 10),
        "{leases_before:?}"
    );
}

/// Two tenants on a temporary SQLite file, one server.
#[test]
fn fairness_over_http_serves_the_second_tenant_in_turn_on_sqlite() {
    check_fair(&run(&[]));
}

/// Two fairness key values of one tenant, two servers on one PostgreSQL
/// database: the servers' configuration names the fairness key.
#[tokio::test]
async fn fairness_over_http_serves_the_second_value_in_turn_on_postgres() {
    let db = fresh_database().await;
    let url = db.url().to_owned();
    let leases = tokio::task::spawn_blocking(move || {
        run(&["--store", &url, "--instances", "2", "--values"])
    })
    .await
    .unwrap();
    check_fair(&leases);
}

/// The cost and aging runs are not made over HTTP: refused, naming why.
#[test]
fn fairness_over_http_refuses_cost_and_aging_runs() {
    for args in [&["--tenants", "1"][..], &["--aging-backlog", "10"][..]] {
        let out = lab_serving()
            .args(["fairness", "--http", "--rounds", "0", "--flood", "0"])
            .args(args)
            .output()
            .expect("run idem-lab fairness");
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--http runs the starvation rounds only"),
            "{args:?}: {err}"
        );
    }
}
