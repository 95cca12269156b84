//! A bench-waiters report as a table, then its targets.

use super::*;

/// Renders a report as a table, then the targets.
pub fn render(r: &WaitersReport) -> String {
    let opt =
        |v: Option<f64>, prec: usize| v.map_or_else(|| "-".to_owned(), |x| format!("{x:.prec$}"));
    let mut s = format!(
        "{} waiters over {} instance(s), {} class(es), {}, wait_ms {}, pause between submits {} ms\n\n",
        r.waiters, r.instances, r.classes, r.store, r.wait_ms, r.pause_ms
    );
    s.push_str(&format!(
        "{:<28} {:>8} {:>8}\n",
        "quiet phase", "tx/s", "polls/s"
    ));
    for (name, p) in [("no waiters", &r.idle), ("waiters, no work", &r.waiting)] {
        s.push_str(&format!(
            "{:<28} {:>8} {:>8.1}\n",
            name,
            opt(p.tx_per_s, 1),
            p.polls_per_s
        ));
    }
    s.push_str(&format!(
        "\n{:<28} {:>7} {:>5} {:>8} {:>8} {:>8} {:>6} {:>9} {:>9} {:>9} {:>6}\n",
        "sequential submits",
        "submits",
        "bad",
        "p50 ms",
        "p99 ms",
        "max ms",
        "tx/sub",
        "claim p50",
        "claim p99",
        "claim max",
        "lost"
    ));
    for (name, p) in [
        ("no waiters", &r.submits),
        ("waiters", &r.submits_with_waiters),
    ] {
        let c = p.claims.as_ref();
        s.push_str(&format!(
            "{:<28} {:>7} {:>5} {:>8.2} {:>8.2} {:>8.2} {:>6} {:>9} {:>9} {:>9} {:>6}\n",
            name,
            p.submits,
            p.failed,
            p.p50_ms,
            p.p99_ms,
            p.max_ms,
            opt(p.tx_per_submit, 2),
            opt(c.map(|c| c.p50_ms), 2),
            opt(c.map(|c| c.p99_ms), 2),
            opt(c.map(|c| c.max_ms), 2),
            c.map_or_else(|| "-".to_owned(), |c| c.unclaimed.to_string()),
        ));
    }
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    s.push('\n');
    s.push_str(&format!(
        "waiters, no work: {} tx/s (target < {TX_PER_S_TARGET}): {}\n",
        opt(r.waiting.tx_per_s, 1),
        r.targets.tx_per_s.map_or("not measured (SQLite)", verdict)
    ));
    s.push_str(&format!(
        "submit p50 with ÷ without waiters: {:.2} (target ≤ {SUBMIT_P50_RATIO_TARGET}): {}\n",
        r.targets.submit_p50_ratio,
        verdict(r.targets.submit_p50)
    ));
    s.push_str(&format!(
        "claim delay p99: {} ms (target ≤ {CLAIM_P99_TARGET_MS}, none lost): {}\n",
        opt(r.submits_with_waiters.claims.as_ref().map(|c| c.p99_ms), 2),
        verdict(r.targets.claim_p99)
    ));
    if let Some(l) = &r.listeners {
        s.push_str(&format!(
            "listening sessions since their last round trip (not in tx/s, tx/sub): {:.0} tx for {} events × {} instance(s), {:.2} per event per instance\n",
            l.tx, l.events, r.instances, l.tx_per_event_per_instance
        ));
    }
    if r.failed_polls > 0 || r.failed_reports > 0 {
        s.push_str(&format!(
            "failed claims: {}, failed reports: {}\n",
            r.failed_polls, r.failed_reports
        ));
    }
    s
}
