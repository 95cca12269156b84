//! A counterexample as a readable trace: numbered steps, each naming the
//! actor and its action in the field's words, what the store answered, and
//! every task's state, generation and attempts and the provider's ledger
//! after the step.

use std::fmt::Write as _;

use crate::action::Action;
use crate::model::IdemModel;
use crate::setup::tick_of;
use crate::state::{Executor, State};

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
                let _ = writeln!(
                    out,
                    "{:>3}. {} → {}",
                    i + 1,
                    a.describe(&m.setup, m.bounds.tenants),
                    answer
                );
                out.push_str(&summary(m, &n));
                s = n;
            }
            None => {
                let _ = writeln!(
                    out,
                    "{:>3}. {} → (no change)",
                    i + 1,
                    a.describe(&m.setup, m.bounds.tenants)
                );
            }
        }
    }
    let _ = writeln!(out, "property failed: {failed}");
    out
}
