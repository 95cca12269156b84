//! `idem-lab verify`: the model checker's report on a small bound, and a
//! bound that never reaches a witness failing rather than passing vacuously.

use crate::support::lab;

/// `idem-lab verify` (docs/verification.md): a small bound prints its bounds, its counts and
/// every property's verdict, and exits 0 without a counterexample; `--json`
/// gives the same report as one object.
#[test]
fn verify_explores_a_small_bound_and_reports_each_property() {
    let bound = [
        "verify",
        "--ci",
        "--executors",
        "1",
        "--attempts",
        "2",
        "--horizon",
        "1",
    ];
    let out = lab().args(bound).output().expect("run idem-lab");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "bounds: keys 1, tasks 1, classes unsafe, tenants 1, executors 1, attempts per task 2, crashes 1, operator actions 1, lost answers 0, horizon 1 ticks",
        "distinct states: ",
        "states generated: ",
        "max depth: ",
        "holds                        no state change from an old generation (SPEC §2.4)",
        "holds                        every task ends terminal once faults stop",
        "holds                        a submit to a taken scope replays exactly the accepted request",
        "reached                      reached: a task ends at a claim because its submitting key was revoked",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    let out = lab()
        .args(bound)
        .arg("--json")
        .output()
        .expect("run idem-lab");
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["bounds"]["executors"], 1);
    assert!(
        v["report"]["distinct_states"].as_u64().unwrap_or(0) > 100,
        "{v}"
    );
    let properties = v["report"]["properties"].as_array().expect("properties");
    assert_eq!(properties.len(), 21);
    // One attempt per task: no report can go stale, so that witness is never
    // reached and the run fails rather than pass vacuously.
    let out = lab()
        .args([
            "verify",
            "--ci",
            "--executors",
            "1",
            "--attempts",
            "1",
            "--horizon",
            "1",
        ])
        .output()
        .expect("run idem-lab");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("these bounds never reach: a stale report is kept as evidence"),
        "{err}"
    );
    assert!(
        properties
            .iter()
            .all(|p| p["verdict"]["status"] != "counterexample"),
        "{v}"
    );
}
