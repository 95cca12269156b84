//! A counterexample as a readable trace: numbered steps, each naming the
//! actor and its action in the field's words, what the store answered, and
//! every task's state, generation and attempts and the provider's ledger
//! after the step.

use std::fmt::Write as _;

use crate::model::{Action, IdemModel};
use crate::setup::{OperatorAction, Sent, tick_of};
use crate::state::{Executor, State};

/// The actor and action of `a`, e.g. `executor-1: report \`unknown\``.
pub fn describe(m: &IdemModel, a: &Action) -> String {
    match a {
        Action::Submit { key, sent } => {
            let who = m.setup.keys.get(usize::from(*key)).map_or_else(
                || format!("key {key}"),
                |k| {
                    if m.bounds.tenants > 1 {
                        format!(
                            "{} of {}",
                            k.idempotency_key,
                            crate::setup::TENANTS[usize::from(k.tenant)]
                        )
                    } else {
                        k.idempotency_key.clone()
                    }
                },
            );
            format!(
                "client: submit under {who} ({})",
                match sent {
                    Sent::Original => "the original request",
                    Sent::Changed => "a changed request: same key, other amount",
                    Sent::Reconfigured =>
                        "the original request, fingerprinted after the configuration made the payee material",
                }
            )
        }
        Action::Cancel { task } => format!("client: cancel task {}", task + 1),
        Action::AcknowledgeDelivery { task } => {
            format!("client: acknowledge the delivery of task {}", task + 1)
        }
        Action::Claim { executor } => format!("executor-{executor}: claim an attempt"),
        Action::Heartbeat { executor } => format!("executor-{executor}: heartbeat"),
        Action::Acknowledge { executor } => {
            format!("executor-{executor}: device acknowledgment (/ack)")
        }
        Action::PerformEffect { executor } => {
            format!("executor-{executor}: perform the effect at the provider")
        }
        Action::QueryProvider { executor } => {
            format!("executor-{executor}: reconcile: ask the provider's ledger")
        }
        Action::Report {
            executor,
            what,
            lost,
        } => format!(
            "executor-{executor}: report `{what}`{}",
            if *lost {
                " (the answer is lost on the way back)"
            } else {
                ""
            }
        ),
        Action::RepeatReport { executor } => {
            format!("executor-{executor}: send the same report again")
        }
        Action::RevokeKey { tenant } => format!(
            "admin: revoke the API key of tenant {}",
            crate::setup::TENANTS[usize::from(*tenant) % crate::setup::TENANTS.len()]
        ),
        Action::Release { executor } => {
            format!("executor-{executor}: release the attempt it has not started")
        }
        Action::Abandon { executor } => {
            format!("executor-{executor}: its lease ended; stop working on the attempt")
        }
        Action::Crash { executor } => format!("executor-{executor}: crash"),
        Action::Tick => "clock: advance".to_owned(),
        Action::Sweep => "sweeper: expire leases, wake backoffs, release keys".to_owned(),
        Action::Operator { task, action } => {
            let what = match action {
                OperatorAction::Resolve => "resolve (as the provider's ledger says)".to_owned(),
                other => other.to_string(),
            };
            format!("operator: {what} task {}", task + 1)
        }
    }
}

/// Every task, executor and ledger entry of `s`, indented.
pub fn summary(m: &IdemModel, s: &State) -> String {
    let mut out = String::new();
    let _ = write!(out, "     t={}", s.clock);
    if m.draining(s) {
        out.push_str(" (draining)");
    }
    out.push('\n');
    for (i, r) in s.tasks.iter().enumerate() {
        let t = &r.task;
        let _ = write!(
            out,
            "     task {} ({} {}, {}): {}, generation {}, usage {}",
            i + 1,
            t.control.tenant,
            t.idempotency_key,
            t.operation,
            t.state,
            t.generation,
            t.usage
        );
        if let Some(c) = &t.cancellation {
            let _ = write!(out, ", cancellation {}", c.status);
        }
        if let Some(d) = &t.delivery {
            let _ = write!(out, ", delivered (charge {})", d.charge);
        }
        if let Some(f) = &t.failure {
            let _ = write!(out, ", failure {}", f.class);
        }
        if !s.key_held(i) {
            out.push_str(", key released");
        }
        out.push('\n');
        for a in &r.attempts {
            let _ = writeln!(
                out,
                "       attempt #{} {} generation {}: {} (lease to t={}, {})",
                a.number,
                a.kind,
                a.generation,
                a.state,
                tick_of(a.lease_expires_at),
                a.executor_id
            );
        }
        if let Some(l) = s.ledger.get(i) {
            let _ = writeln!(
                out,
                "       ledger: {}{}",
                if l.applied {
                    "effect applied"
                } else {
                    "no effect"
                },
                if l.repeats > 0 {
                    format!(", {} repeated request(s)", l.repeats)
                } else {
                    String::new()
                }
            );
        }
    }
    for (e, ex) in s.executors.iter().enumerate() {
        if let Executor::Repeating(h, what) = ex {
            let _ = writeln!(
                out,
                "     executor-{e} is to send `{what}` for task {} attempt #{} again",
                h.task + 1,
                h.number
            );
        }
        if let Executor::Holding(h) = ex {
            let _ = writeln!(
                out,
                "     executor-{e} holds task {} attempt #{} generation {} (lease to t={}{})",
                h.task + 1,
                h.number,
                h.generation,
                h.lease_end,
                if h.effect_done {
                    ", effect performed"
                } else {
                    ""
                }
            );
        }
    }
    out
}

/// The trace of `actions` from the initial state, with `failed` (the
/// property's name) at the end.
pub fn render(m: &IdemModel, actions: &[Action], failed: &str) -> String {
    let mut out = String::new();
    let mut s = m.initial();
    let _ = writeln!(out, "counterexample: {failed}");
    let _ = writeln!(out, "  0. initial state");
    out.push_str(&summary(m, &s));
    for (i, a) in actions.iter().enumerate() {
        match m.step(&s, *a) {
            Some((n, answer)) => {
                let _ = writeln!(out, "{:>3}. {} → {}", i + 1, describe(m, a), answer);
                out.push_str(&summary(m, &n));
                s = n;
            }
            None => {
                let _ = writeln!(out, "{:>3}. {} → (no change)", i + 1, describe(m, a));
            }
        }
    }
    let _ = writeln!(out, "property failed: {failed}");
    out
}
