//! `GET /v1/queues`, the queue metrics and `idem task list --queues` (SPEC §4
//! "Queues"): a tenant sees its own waiting tasks per class; a leased task is
//! not waiting; the time it waited is counted once at its lease.

use serde_json::Value;

use crate::support::{Server, generation, ikey, payment};

/// The value of the series `series` (name with labels) in a `/metrics` text.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test]
async fn queues_show_the_tenants_waiting_tasks_and_the_metrics_count_them() {
    let srv = Server::start().await;
    let k = srv.keys.clone();
    for n in 0..3 {
        srv.new_task(&ikey(), "generation.dispatch", generation(&format!("q{n}")))
            .await;
    }
    srv.new_task(&ikey(), "payment.release", payment(100)).await;
    srv.submit_as(
        &k.other,
        &ikey(),
        "generation.dispatch",
        generation("theirs"),
    )
    .await
    .ok(201);
    srv.claim_one("generation.dispatch", None).await;

    let page = srv.get("/v1/queues", &k.acme).await;
    let body = page.ok(200).clone();
    let queues = body["queues"].as_array().cloned().unwrap_or_default();
    let depth = |op: &str| {
        queues
            .iter()
            .find(|q| q["operation"] == op)
            .map(|q| q["depth"].clone())
    };
    assert_eq!(depth("generation.dispatch"), Some(Value::from(2)), "{body}");
    assert_eq!(depth("payment.release"), Some(Value::from(1)), "{body}");
    assert_eq!(queues.len(), 2, "{body}");
    for q in &queues {
        for field in ["oldest_wait_ms", "wait_p50_ms", "wait_p99_ms"] {
            assert!(q[field].as_i64().is_some_and(|ms| ms >= 0), "{field}: {q}");
        }
    }
    assert!(body["now"].is_string(), "{body}");
    // Another tenant sees its own queue only; an executor key is refused.
    let theirs = srv.get("/v1/queues", &k.other).await;
    let theirs = theirs.ok(200);
    assert_eq!(
        theirs["queues"].as_array().map(Vec::len),
        Some(1),
        "{theirs}"
    );
    assert_eq!(theirs["queues"][0]["depth"], 1, "{theirs}");
    srv.get("/v1/queues", &k.exec)
        .await
        .assert_problem(403, "PERMISSION_DENIED");

    // The metrics: depth per tenant and class, one wait observed per lease.
    let m = srv.call(reqwest::Method::GET, "/metrics", None, None).await;
    m.ok(200);
    for (series, want) in [
        (
            "idem_queue_depth{tenant=\"acme\",operation=\"generation.dispatch\"}",
            2.0,
        ),
        (
            "idem_queue_depth{tenant=\"acme\",operation=\"payment.release\"}",
            1.0,
        ),
        (
            "idem_queue_depth{tenant=\"other\",operation=\"generation.dispatch\"}",
            1.0,
        ),
        (
            "idem_queue_wait_seconds_count{operation=\"generation.dispatch\"}",
            1.0,
        ),
    ] {
        assert_eq!(
            metric(&m.text, series),
            Some(want),
            "{series} in:\n{}",
            m.text
        );
    }

    // The CLI reads the same queues from the store.
    let (ok, out, err) = srv.cli(&["task", "list", "--tenant", "acme", "--queues", "--table"]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("OPERATION"), "{out}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("generation.dispatch")
                && l.split_whitespace().nth(1) == Some("2")),
        "{out}"
    );
    let (ok, out, err) = srv.cli(&["task", "list", "--tenant", "acme", "--queues"]);
    assert!(ok, "{err}");
    let json: Value = serde_json::from_str(&out).unwrap_or_default();
    assert_eq!(json["queues"].as_array().map(Vec::len), Some(2), "{out}");
}
