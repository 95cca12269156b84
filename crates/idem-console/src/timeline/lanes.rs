//! The attempt lanes: one row per attempt with its lease bar, heartbeats,
//! acknowledgment, report, lease expiry and stale evidence.

use super::*;

/// One attempt's lane, its top at `y`.
pub(super) fn lane(a: &Attempt, row: &Row, y: f64, alt: bool, scale: &Scale, live: bool) -> Markup {
    let (end, end_word) = lease_end(a, live);
    let x_from = scale.x(a.leased_at.0);
    let x_to = scale.x(end.0).max(x_from + 2.0);
    let open = live && a.state.is_active();
    let bar_class = format!(
        "lease state-{}{}",
        slug(a.state.as_str()),
        if open { " live" } else { "" }
    );
    let lease_title = [
        format!(
            "lease of attempt {} (generation {}, {})",
            a.number, a.generation, a.kind
        ),
        format!(
            "claimed at {} by executor {}",
            a.leased_at.to_rfc3339(),
            a.executor_id
        ),
        format!(
            "{end_word} at {} ({})",
            end.to_rfc3339(),
            duration(end.0 - a.leased_at.0)
        ),
        format!("lease length {} per heartbeat", duration(a.lease_ms)),
    ];
    let stale = a
        .evidence
        .iter()
        .filter(|e| e.disposition == Disposition::StaleGeneration)
        .count();
    let mut detail = format!("{} · usage {}", state_word(a.state), a.usage);
    if stale > 0 {
        detail.push_str(&format!(" · {stale} stale"));
    }
    let gutter = [
        format!("#{} {} · gen {}", a.number, a.kind, a.generation),
        format!("executor {}", a.executor_id),
        detail,
    ];
    html! {
        g class=(format!("lane kind-{}", a.kind)) data-attempt-id=(a.id) data-number=(a.number)
            data-generation=(a.generation) data-kind=(a.kind.as_str()) data-state=(a.state.as_str())
        {
            rect class=(if alt { "lane-bg alt" } else { "lane-bg" }) x="0" y=(n(y))
                width="100%" height=(n(LANE_H)) {}
            (gutter_text(&gutter, y))
            line class="track" x1=(n(GUTTER_W)) x2=(n(GUTTER_W + PLOT_W))
                y1=(n(y + 31.0)) y2=(n(y + 31.0)) {}
            rect class=(bar_class) x=(n(x_from)) y=(n(y + 26.0)) width=(n(x_to - x_from))
                height="10" rx="2" {
                title { (Lines(&lease_title)) }
            }
            @for (m, s) in &row.marks { (marker(m, s, y)) }
        }
    }
}

/// Where an attempt's lease bar ends and what ended it: a live lease at its
/// expiry; else the applied report, or the lease's end (expiry, or the
/// instant an operator or a cancellation retired it).
pub(super) fn lease_end(a: &Attempt, live: bool) -> (Timestamp, &'static str) {
    if a.state.is_active() {
        return (
            a.lease_expires_at,
            if live { "lease expires" } else { "lease ended" },
        );
    }
    let applied = a
        .evidence
        .iter()
        .find(|e| e.disposition == Disposition::Applied && e.outcome != EvidenceOutcome::Ack);
    match applied {
        Some(e) if e.received_at <= a.lease_expires_at => (e.received_at, "reported"),
        _ => (a.lease_expires_at, "lease ended"),
    }
}

/// The marks of one attempt's lane: its evidence (reports, acknowledgments,
/// repeats, duplicates, stale evidence) and its events (heartbeats that
/// raised usage, lease expiry).
pub(super) fn attempt_marks(a: &Attempt, events: &[&Event]) -> Vec<Mark> {
    let mut marks: Vec<Mark> = a
        .evidence
        .iter()
        .enumerate()
        .map(|(i, e)| evidence_mark(a, e, i as i64))
        .collect();
    let mine: Vec<&&Event> = events
        .iter()
        .filter(|e| e.data.attempt_id() == Some(a.id))
        .collect();
    let heartbeats = mine
        .iter()
        .filter(|e| e.kind == EventKind::UsageRecorded)
        .count();
    let mut beat = 0;
    for e in mine {
        match &e.data {
            EventData::UsageRecorded(d) => {
                beat += 1;
                let usage = d.usage;
                let labelled = heartbeats <= LABELLED_HEARTBEATS || beat == heartbeats;
                let mut m = Mark::new(e.at, e.seq, Shape::Dot, "heartbeat").title(
                    "heartbeat",
                    &[
                        format!("attempt usage {usage}"),
                        format!("task usage {}", d.task_usage),
                        format!("generation {}", d.generation),
                    ],
                );
                if labelled {
                    m = m.label(&format!("usage {usage}")).optional();
                }
                marks.push(m);
            }
            EventData::LeaseExpired(d) => {
                let ended = d.lease_expires_at.to_rfc3339();
                marks.push(
                    Mark::new(e.at, e.seq, Shape::Triangle, "expired")
                        .label("lease expired")
                        .title(
                            "lease expired without a report",
                            &[
                                format!("lease end {ended}"),
                                format!("generation {}", a.generation),
                            ],
                        ),
                );
            }
            EventData::AttemptReleased(_) => {
                marks.push(
                    Mark::new(e.at, e.seq, Shape::Triangle, "expired")
                        .label("released")
                        .title(
                            "released by its executor before it started",
                            &[format!("generation {}", a.generation)],
                        ),
                );
            }
            _ => {}
        }
    }
    marks
}

/// The mark of one piece of evidence; index `i` orders marks of one instant.
pub(super) fn evidence_mark(a: &Attempt, e: &Evidence, i: i64) -> Mark {
    let outcome = e.outcome.as_str();
    let body = &e.body;
    let class_of_failure = str_of(body, "failure_class");
    let mut details = vec![
        format!("generation presented {}", e.generation),
        format!("outcome {outcome}"),
    ];
    if let Some(c) = &class_of_failure {
        details.push(format!("failure class {c}"));
    }
    if let Some(m) = str_of(body, "message") {
        details.push(format!("message {m}"));
    }
    if let Some(u) = int_of(body, "usage") {
        details.push(format!("usage {u}"));
    }
    if let Some(t) = str_of(body, "external_txn_id") {
        details.push(format!("external transaction id {t}"));
    }
    if let Some(r) = body.get("result") {
        details.push(format!("result {r}"));
    }
    details.push(format!("disposition {}", e.disposition));
    let order = 1_000_000 + i;
    match (e.disposition, e.outcome) {
        (Disposition::StaleGeneration, _) => {
            details.insert(
                0,
                format!(
                    "kept as evidence, nothing changed: attempt {} holds generation {}, its lease ended at {}",
                    a.number,
                    a.generation,
                    a.lease_expires_at.to_rfc3339()
                ),
            );
            let what = if e.outcome == EvidenceOutcome::Ack {
                "stale ack".to_owned()
            } else {
                format!("stale {outcome}")
            };
            Mark::new(e.received_at, order, Shape::Ring, "stale")
                .label(&what)
                .title("stale evidence", &details)
        }
        (Disposition::Applied, EvidenceOutcome::Ack) => {
            Mark::new(e.received_at, order, Shape::Diamond, "ack")
                .label("ack")
                .title("command acknowledged", &details)
        }
        (Disposition::Applied, _) => {
            let word = match &class_of_failure {
                Some(c) => format!("{outcome}: {c}"),
                None => outcome.to_owned(),
            };
            Mark::new(
                e.received_at,
                order,
                Shape::Square,
                format!("report outcome-{}", slug(outcome)),
            )
            .label(&word)
            .title("report", &details)
        }
        (Disposition::Repeat, _) => {
            Mark::new(e.received_at, order, Shape::Dot, "repeat").title("exact repeat", &details)
        }
        (Disposition::AlreadyReported, _) => {
            Mark::new(e.received_at, order, Shape::Square, "duplicate")
                .label(&format!("duplicate {outcome}"))
                .title(
                    "different report after the attempt's outcome; nothing changed",
                    &details,
                )
        }
    }
}
