//! `idem-lab chaos` on a small scale, on SQLite and on a fresh PostgreSQL
//! database, at a provider that does not deduplicate: stale payers make real
//! second effects, and every one an executor reported is raised by idem as
//! `second_effect_suspected`, nothing else (docs/chaos.md).

use idem_store_postgres::testing::fresh_database;
use serde_json::Value;

use crate::support::lab_serving;

/// Runs `idem-lab chaos ARGS --json`; returns the report (exit 1 is a
/// violation: the report still comes, and the assertions name it).
fn chaos(args: &[&str]) -> Value {
    let out = lab_serving()
        .arg("chaos")
        .args(args)
        .arg("--json")
        .output()
        .expect("run idem-lab chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "idem-lab chaos gave no report ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Every invariant holds; second effects happened, were reported and raised.
fn check_second_effects(r: &Value) {
    let e = &r["second_effects"];
    assert_eq!(r["provider"], "non_deduplicating", "{e}");
    assert_eq!(r["violations"], 0, "{}", r["invariants"]);
    assert_eq!(e["misses"], 0, "{e}");
    assert_eq!(e["false_alarms"], 0, "{e}");
    assert_eq!(e["unanswered"], 0, "every effect report answered: {e}");
    let reported = e["reported"].as_u64().unwrap_or(0);
    assert!(reported > 0, "no second effect reported to idem: {e}");
    assert_eq!(e["raised"].as_u64(), Some(reported), "{e}");
    assert!(e["real"].as_u64() >= Some(reported), "{e}");
    assert!(
        r["faults_realized"]["stale_executor_pays_again"].as_u64() > Some(0),
        "{}",
        r["faults_realized"]
    );
}

#[test]
fn chaos_at_a_non_deduplicating_provider_raises_every_reported_second_effect_on_sqlite() {
    let r = chaos(&[
        "--seed",
        "11",
        "--ops",
        "400",
        "--provider",
        "non-deduplicating",
    ]);
    assert_eq!(r["store"], "sqlite");
    check_second_effects(&r);
}

#[tokio::test]
async fn chaos_at_a_non_deduplicating_provider_raises_every_reported_second_effect_on_postgres() {
    let db = fresh_database().await;
    let url = db.url().to_owned();
    let r = tokio::task::spawn_blocking(move || {
        chaos(&[
            "--seed",
            "12",
            "--ops",
            "400",
            "--provider",
            "non-deduplicating",
            "--store",
            &url,
        ])
    })
    .await
    .unwrap();
    assert_eq!(r["store"], "postgres");
    check_second_effects(&r);
}

/// At the deduplicating provider no task has two effects, and idem raises
/// only what the ledger shows (an effect of a task that ended without
/// delivery, e.g. a safe task's late report after a confirmed cancel): no
/// false alarm.
#[test]
fn chaos_at_a_deduplicating_provider_raises_no_false_alarm() {
    let r = chaos(&["--seed", "13", "--ops", "300", "--stale-payers"]);
    assert_eq!(r["provider"], "deduplicating");
    assert_eq!(r["violations"], 0, "{}", r["invariants"]);
    let e = &r["second_effects"];
    assert_eq!(e["tasks_with_several_effects"], 0, "{e}");
    assert_eq!(e["false_alarms"], 0, "{e}");
    assert_eq!(e["misses"], 0, "{e}");
}
