//! The description: the timeline's story in words, for the SVG's `<desc>`.

use super::*;

/// The story in words, e.g. `3 attempts: attempt 1 generation 1 execute
/// reported unknown; attempt 2 generation 2 reconcile lease expired; …
/// Delivered, charge 500. State succeeded.`
pub(super) fn describe(task: &Task, attempts: &[&Attempt], events: &[&Event]) -> String {
    let mut parts = Vec::new();
    let count = attempts.len();
    parts.push(match count {
        0 => "No attempts yet".to_owned(),
        1 => "1 attempt".to_owned(),
        _ => format!("{count} attempts"),
    });
    let named = if count > DESC_ATTEMPTS {
        let (earlier, last) = attempts.split_at(count - (DESC_ATTEMPTS - 1));
        let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
        for a in earlier {
            *by_state.entry(state_phrase(a.state)).or_default() += 1;
        }
        let counts: Vec<String> = by_state.iter().map(|(s, c)| format!("{c} {s}")).collect();
        parts.push(format!(
            "attempts 1 to {}: {}",
            earlier.len(),
            counts.join(", ")
        ));
        last
    } else {
        attempts
    };
    for a in named {
        let mut s = format!(
            "attempt {} generation {} {} {}",
            a.number,
            a.generation,
            a.kind,
            state_phrase(a.state)
        );
        if a.kind == AttemptKind::Execute
            && let Some(c) = a
                .report
                .as_ref()
                .and_then(|r| str_of(&r.body, "failure_class"))
        {
            s.push_str(&format!(" ({c})"));
        }
        parts.push(s);
    }
    let stale: Vec<String> = attempts
        .iter()
        .flat_map(|a| {
            a.evidence
                .iter()
                .filter(|e| e.disposition == Disposition::StaleGeneration)
                .map(move |e| {
                    format!(
                        "stale {} from attempt {} generation {}",
                        e.outcome, a.number, e.generation
                    )
                })
        })
        .collect();
    match stale.len() {
        0 => {}
        1..=3 => parts.push(format!("stale evidence kept: {}", stale.join(", "))),
        k => parts.push(format!("{k} pieces of stale evidence kept")),
    }
    for e in events {
        if let EventData::OperatorResolved(d) = &e.data {
            parts.push(format!("resolved {} by an operator", d.outcome));
        }
    }
    if let Some(c) = &task.cancellation {
        parts.push(match c.status {
            CancelStatus::Requested => "cancellation requested".to_owned(),
            CancelStatus::Confirmed => format!("cancelled, fee {}", opt_money(task, c.fee)),
            CancelStatus::TooLate
                if task
                    .delivery
                    .as_ref()
                    .is_some_and(|d| Some(d.charge) == c.fee) =>
            {
                "cancellation too late, its fee the delivery's charge (not a second charge)"
                    .to_owned()
            }
            CancelStatus::TooLate => {
                format!("cancellation too late, fee {}", opt_money(task, c.fee))
            }
        });
    }
    if let Some(d) = &task.delivery {
        let mut s = format!("delivered, charge {}", money(task, d.charge));
        if d.acknowledged_at.is_some() {
            s.push_str(", acknowledged");
        }
        parts.push(s);
    }
    if let Some(f) = &task.failure {
        parts.push(format!("failed: {}", f.class));
    }
    format!(
        "Task {} ({}), state {}. {}.",
        task.idempotency_key,
        task.operation,
        task.state,
        parts.join("; ")
    )
}

/// An attempt's state as the description says it.
pub(super) fn state_phrase(s: AttemptState) -> &'static str {
    match s {
        AttemptState::Leased => "holds the lease",
        AttemptState::Acknowledged => "acknowledged by the device",
        AttemptState::Succeeded => "reported succeeded",
        AttemptState::Failed => "reported failed",
        AttemptState::Unknown => "reported unknown",
        AttemptState::Expired => "lease expired",
        AttemptState::Cancelled => "cancelled",
        AttemptState::Committed => "reconciled committed",
        AttemptState::NotCommitted => "reconciled not committed",
        AttemptState::Released => "released unstarted by its executor",
    }
}

/// An attempt's state for its gutter line.
pub(super) fn state_word(s: AttemptState) -> String {
    s.as_str().replace('_', " ")
}
