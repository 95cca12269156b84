//! The task page's verdict block (`section#verdict`, docs/console.md "The
//! verdict"): the answers an on-call engineer needs first, read off the
//! task, its attempts (with their evidence) and its events.
//!
//! - `#verdict-answer`: the state in one sentence; a delivered task's one
//!   charge with its provider transaction id and time.
//! - `#verdict-effects`: how many effects the provider was asked for (the
//!   execute attempts that started, the task's `execute_count`: a released
//!   attempt never started) and how many were delivered (0 or 1).
//! - `#verdict-message`: the newest `message` any executor's report carried,
//!   applied or kept as stale evidence, with its attempt and time.
//! - `#verdict-suspected` (only when the task has any): each suspected
//!   second effect (SPEC §4 TASK `second_effects`), in red while not
//!   acknowledged, with its transaction id, the evidence that showed it
//!   (which report, attempt, generation, when) beside what was delivered,
//!   and its acknowledgment, or for an admin the form that posts one
//!   (`actions/acknowledge-effect`, CSRF like every console action).
//! - `#verdict-next`: what a person does next, by state: wait (and until
//!   when), check the provider and resolve, redrive or not (and why), or
//!   nothing; a cancellation that lost to delivery says its fee is the
//!   delivery's charge, not a second one. An unacknowledged suspected second
//!   effect comes first: check the provider, then acknowledge.
//!
//! Every figure here is the one the rest of the page shows: the attempt
//! counts are [`crate::html::attempt_summary`]'s, the amounts go through
//! [`crate::html::money`].

use idem_core::model::{
    Attempt, AttemptKind, CancelStatus, Disposition, EffectEvidence, EffectResolution, EventData,
    EventKind, FailureClass, SecondEffect, Task, TaskState, Timestamp,
};
use maud::{Markup, html};
use serde_json::Value;

use super::Story;
use crate::html::{count, csrf_input, money, time};
use crate::session::SignedIn;

/// The verdict block of `s`; `admin`, when given, gets the acknowledge form
/// of each suspected second effect not yet acknowledged.
pub fn verdict(s: &Story, admin: Option<&SignedIn>) -> Markup {
    let t = &s.task;
    let open = unacknowledged(t);
    html! {
        section #verdict aria-labelledby="verdict-title" data-state=(t.state.as_str())
            data-suspected=(open.len()) {
            h2 #verdict-title { "Verdict" }
            p #verdict-answer .answer { (answer(s)) }
            @if !t.second_effects.is_empty() {
                (suspected(s, admin))
            }
            dl {
                dt { "Provider asked" }
                dd #verdict-effects data-asked=(t.control.execute_count) data-delivered=(delivered(t)) {
                    (effects(t))
                }
                dt { "Executor's last message" }
                dd #verdict-message {
                    @match last_message(&s.attempts) {
                        Some(m) => {
                            q.message { (m.text) }
                            " — attempt " (m.number) " (" (m.executor) "), reported " (m.outcome)
                            @if m.stale { ", " strong.stale { "stale report" } }
                            " at " (time(m.at))
                        }
                        None => "No executor's report carried a message.",
                    }
                }
                dt { "Next step" }
                dd #verdict-next { (next_step(s)) }
            }
        }
    }
}

/// 1 when the task was delivered, else 0.
fn delivered(t: &Task) -> i64 {
    i64::from(t.delivery.is_some())
}

/// `#verdict-effects`: e.g. "2 execute attempts started: the provider was
/// asked 2 times; 1 delivered".
fn effects(t: &Task) -> String {
    let asked = t.control.execute_count;
    let mut text = format!(
        "{} started: the provider was asked {}; {} delivered",
        count(asked, "execute attempt", "execute attempts"),
        count(asked, "time", "times"),
        delivered(t)
    );
    if !t.second_effects.is_empty() {
        text.push_str(&format!(
            "; {}",
            count(
                t.second_effects.len(),
                "suspected second effect",
                "suspected second effects"
            )
        ));
    }
    text
}

/// The suspected second effects no operator acknowledged yet.
fn unacknowledged(t: &Task) -> Vec<&SecondEffect> {
    t.second_effects
        .iter()
        .filter(|e| e.acknowledgment.is_none())
        .collect()
}

/// A transaction id as the verdict shows it (`null`: "no transaction id").
fn txn(id: Option<&str>) -> Markup {
    match id {
        Some(id) => html! { code.txn { (id) } },
        None => html! { "an effect reported without a transaction id" },
    }
}

/// Which evidence showed an effect, in words.
fn evidence_words(e: EffectEvidence) -> &'static str {
    match e {
        EffectEvidence::StaleReport => {
            "a stale report (from a generation that no longer held the lease)"
        }
        EffectEvidence::LateReport => "a late report (after its lease ended)",
        EffectEvidence::DuplicateReport => {
            "a duplicate report (the attempt already had another outcome)"
        }
        EffectEvidence::AppliedReport => "the applied report",
        EffectEvidence::OperatorResolved => "an operator's resolve (committed)",
    }
}

/// `#verdict-suspected`: each suspected second effect with its evidence,
/// and its acknowledgment or (for an admin) the form that records one.
fn suspected(s: &Story, admin: Option<&SignedIn>) -> Markup {
    let t = &s.task;
    let delivered = t.delivery.as_ref();
    html! {
        div #verdict-suspected role="group" aria-labelledby="verdict-suspected-title" {
            h3 #verdict-suspected-title { "Suspected second effects: " (t.second_effects.len()) }
            ul {
                @for (i, e) in t.second_effects.iter().enumerate() {
                    @let number = e.attempt_id.and_then(|id| s.attempts.iter().find(|a| a.id == id)).map(|a| a.number);
                    li class=(if e.acknowledgment.is_none() { "second-effect suspected" } else { "second-effect" })
                        data-txn-id=[e.external_txn_id.as_deref()] data-evidence=(e.evidence.as_str())
                        data-acknowledged=(if e.acknowledgment.is_some() { "true" } else { "false" }) {
                        p.effect {
                            @match delivered {
                                Some(d) => {
                                    strong { "The provider may have carried out this " (t.operation) " twice: " }
                                    (txn(e.external_txn_id.as_deref()))
                                    " besides the delivered "
                                    (txn(d.external_txn_id.as_deref()))
                                    " (charged once, " (money(t, d.charge)) ")"
                                }
                                None => {
                                    strong { "The provider may have carried out this " (t.operation) " although nothing was delivered: " }
                                    (txn(e.external_txn_id.as_deref()))
                                    " (the task ended " (t.state.as_str()) ")"
                                }
                            }
                            ". Evidence: " (evidence_words(e.evidence))
                            @if let Some(n) = number { " of attempt " (n) }
                            " (generation " (e.generation) "), suspected at " (time(e.suspected_at)) "."
                        }
                        @match &e.acknowledgment {
                            Some(ack) => p.acknowledgment {
                                "Acknowledged " strong { (ack.resolution.as_str().replace('_', " ")) } " by "
                                (super::actor_words(&ack.actor)) " at " (time(ack.acknowledged_at))
                                ": " q { (ack.reason) }
                            },
                            None => @if let Some(who) = admin {
                                (acknowledge_form(t, e, i, who))
                            },
                        }
                    }
                }
            }
        }
    }
}

/// The admin's form acknowledging suspected second effect `e` (the `i`th of
/// the task): `POST /console/tasks/{id}/actions/acknowledge-effect` with the
/// CSRF token, the effect's `external_txn_id` (or `no_external_txn_id=yes`
/// for the one without an id), a resolution, a reason and the confirmation.
fn acknowledge_form(t: &Task, e: &SecondEffect, i: usize, who: &SignedIn) -> Markup {
    let pre = format!("ack-{i}-");
    html! {
        form.action.acknowledge data-action="acknowledge-effect" method="post"
            action={ "/console/tasks/" (t.id) "/actions/acknowledge-effect" } {
            (csrf_input(who))
            @match &e.external_txn_id {
                Some(id) => input type="hidden" name="external_txn_id" value=(id);,
                None => input type="hidden" name="no_external_txn_id" value="yes";,
            }
            fieldset {
                legend { "What did the provider do?" }
                @for r in EffectResolution::ALL {
                    @let id = format!("{pre}{}", r.as_str());
                    span.check {
                        input type="radio" name="resolution" value=(r.as_str()) id=(id) required;
                        label for=(id) { (resolution_words(*r)) }
                    }
                }
            }
            label for={ (pre) "reason" } { "Reason (recorded with your key in the task's history)" }
            textarea name="reason" id={ (pre) "reason" } rows="2" required {}
            span.check {
                input type="checkbox" name="confirm" value="yes" id={ (pre) "confirm" } required;
                label for={ (pre) "confirm" } { "I confirm that I checked this transaction with the provider" }
            }
            button type="submit" { "Acknowledge" }
        }
    }
}

/// A resolution as its radio button says it.
fn resolution_words(r: EffectResolution) -> &'static str {
    match r {
        EffectResolution::RefundIssued => "refund issued (the extra effect was refunded)",
        EffectResolution::ProviderDeduplicated => "provider deduplicated (one effect only)",
        EffectResolution::FalseAlarm => "false alarm (no second effect)",
    }
}

/// The state in one sentence.
fn answer(s: &Story) -> Markup {
    let t = &s.task;
    match t.state {
        TaskState::Succeeded => match &t.delivery {
            Some(d) => html! {
                "Charged once: " (money(t, d.charge)) ", "
                @match &d.external_txn_id {
                    Some(id) => code.txn { (id) },
                    None => "no provider transaction id",
                }
                ", " (time(d.delivered_at)) "."
                @if let Some(e) = unacknowledged(t).first() {
                    " " strong.suspected { "A second effect is suspected: " (txn(e.external_txn_id.as_deref())) "." }
                }
            },
            None => html! { "Succeeded." },
        },
        TaskState::Failed => html! {
            "Failed"
            @if let Some(f) = &t.failure { " (" (f.class.as_str()) ")" }
            ": nothing delivered, nothing charged."
        },
        // An amount never ends a sentence: "EUR 1.00." would read as three
        // decimals (idem_core::money::testing::check_rendering).
        TaskState::Cancelled => html! {
            "Cancelled"
            @if let Some(fee) = t.cancellation.as_ref().and_then(|c| c.fee) {
                " with a fee of " (money(t, fee)) ";"
            }
            " nothing delivered."
        },
        TaskState::Reconciling => html! {
            "Outcome unknown: the provider may or may not have carried out execute attempt "
            (t.control.execute_count) "."
        },
        TaskState::Running => match live_attempt(s) {
            Some(a) => html! {
                "Running: " (a.kind.as_str()) " attempt " (a.number) " held by "
                code { (a.executor_id) } " until " (time(a.lease_expires_at)) "."
            },
            None => html! { "Running." },
        },
        TaskState::RetryWait => html! {
            "Waiting to retry: " (t.control.execute_count) " of " (t.execute_limit())
            " execute attempts used."
        },
        TaskState::Queued => html! {
            "Queued: waiting for an executor to claim "
            @if t.control.execute_count == 0 { "its first attempt." }
            @else { "execute attempt " (t.control.execute_count + 1) " of " (t.execute_limit()) "." }
        },
    }
}

/// The attempt that holds the lease, if any.
fn live_attempt(s: &Story) -> Option<&Attempt> {
    let id = s.task.control.active_attempt_id?;
    s.attempts
        .iter()
        .find(|a| a.id == id && a.state.is_active())
}

/// What a person does next: an unacknowledged suspected second effect
/// first, then by state.
fn next_step(s: &Story) -> Markup {
    let open = unacknowledged(&s.task);
    html! {
        @if !open.is_empty() {
            strong.suspected {
                "Check the provider for "
                @for (i, e) in open.iter().enumerate() {
                    @if i > 0 { ", " }
                    (txn(e.external_txn_id.as_deref()))
                }
                ": if it paid twice, refund and acknowledge "
                em { "refund issued" } "; otherwise acknowledge "
                em { "provider deduplicated" } " or " em { "false alarm" } "."
            }
            " The task itself: "
        }
        (by_state(s))
    }
}

/// What a person does next, by state.
fn by_state(s: &Story) -> Markup {
    let t = &s.task;
    match t.state {
        TaskState::Reconciling => {
            let since = reconciling_since(s).unwrap_or(t.updated_at);
            let executes: Vec<&Attempt> = s
                .attempts
                .iter()
                .filter(|a| a.kind == AttemptKind::Execute)
                .collect();
            let ids = reported_txn_ids(&s.attempts);
            html! {
                @if let Some(a) = live_attempt(s) {
                    "A reconcile attempt (" code { (a.executor_id) } ") holds the lease until "
                    (time(a.lease_expires_at)) ". "
                }
                strong { "Reconciling for " (span_words(s.now.ms() - since.ms())) }
                ": check the provider for this payment"
                @if !executes.is_empty() {
                    " (attempt ids sent to it: "
                    @for (i, a) in executes.iter().enumerate() {
                        @if i > 0 { ", " }
                        code { (a.id) }
                    }
                    @if !ids.is_empty() {
                        "; provider transaction ids reported: "
                        @for (i, id) in ids.iter().enumerate() {
                            @if i > 0 { ", " }
                            code { (id) }
                        }
                    }
                    ")"
                }
                ", then resolve: " em { "committed" } " if it paid (delivered once, charged "
                (money(t, t.contract.price)) "), " em { "not committed" } " if it did not."
            }
        }
        TaskState::RetryWait => html! {
            "Nothing to do: execute attempt " (t.control.execute_count + 1) " of "
            (t.execute_limit()) " may start at " (time(t.control.ready_at))
            " (" (relative(t.control.ready_at.ms() - s.now.ms())) "). "
            em { "Retry now" } " (admin) ends the wait."
        },
        TaskState::Failed => failed_next(s),
        TaskState::Cancelled => {
            let c = t.cancellation.as_ref();
            html! {
                "Nothing to do: cancelled"
                @if let Some(at) = c.and_then(|c| c.confirmed_at) { " at " (time(at)) }
                @if t.control.execute_count == 0 { " before any attempt started" }
                @else { " after " (count(t.control.execute_count, "execute attempt", "execute attempts")) }
                @if let Some(fee) = c.and_then(|c| c.fee) { ", with the contract's fee of " (money(t, fee)) }
                "; nothing was delivered."
            }
        }
        TaskState::Succeeded => match (&t.delivery, &t.cancellation) {
            (Some(d), Some(c)) if c.status == CancelStatus::TooLate => html! {
                "Nothing to do: the cancellation requested at " (time(c.requested_at))
                " came too late, the delivery won. "
                strong.fee-words { "Its fee is that same charge (" (money(t, d.charge)) "), not a second charge." }
            },
            (Some(d), _) => html! {
                "Nothing to do"
                @match d.acknowledged_at {
                    Some(at) => { ": the client acknowledged the delivery at " (time(at)) "." }
                    None => { "; the client has not acknowledged the delivery yet." }
                }
            },
            (None, _) => html! { "Nothing to do." },
        },
        TaskState::Running => html! {
            @if let Some(c) = t.cancellation.as_ref().filter(|c| c.status == CancelStatus::Requested) {
                "Cancellation requested at " (time(c.requested_at))
                ": confirmed when the attempt stops; should it deliver first, the cancellation is too late and its fee is the delivery's charge. "
            }
            "Nothing to do while the lease holds. Should it run out without a report, "
            @if t.contract.retry.safe { "another execute attempt follows (within " (t.execute_limit()) ")." }
            @else { "the task is reconciled before anything is repeated." }
        },
        TaskState::Queued => html! {
            @if let Some((at, d)) = redriven(s) {
                "Redriven at " (time(at)) " (" (d) "). "
            }
            "Nothing to do: it waits for an executor of class " code { (t.operation) } "."
        },
    }
}

/// A failed task's next step: why, and whether a redrive applies (SPEC §4
/// "Operator actions": `transient`, `attempts_exhausted`,
/// `deadline_exceeded` and `budget_exhausted`, no cancellation record, the
/// key not yet released).
fn failed_next(s: &Story) -> Markup {
    let t = &s.task;
    let Some(f) = &t.failure else {
        return html! { "Failed without a recorded reason." };
    };
    let released = s.events.iter().any(|e| e.kind == EventKind::KeyReleased);
    let refused: Option<String> = match f.class {
        FailureClass::InvalidInput => Some(
            "an invalid_input failure would fail the same way: correct the request and submit it under a new idempotency key".into(),
        ),
        FailureClass::PermissionDenied => Some(
            "a permission_denied failure would fail the same way: fix the submitting key's grant, then submit again".into(),
        ),
        _ if t.cancellation.is_some() => {
            Some("its client asked to cancel it".into())
        }
        _ if released => Some(
            "its idempotency key was already released (a new submit may own the scope)".into(),
        ),
        _ => None,
    };
    html! {
        "Why: " q.failure-message { (f.message) } ". "
        @match refused {
            None => {
                strong { "Redrive applies" } ": it sends the task back to the queue with one more execute attempt ("
                (t.control.execute_count) " of " (t.execute_limit()) " used, the limit becomes "
                (t.execute_limit() + 1) ")"
                @if !t.contract.retry.safe { "; check the provider first that no attempt paid" }
                "."
            }
            Some(why) => { strong { "Redrive does not apply" } ": " (why) "." }
        }
    }
}

/// When the task entered `reconciling` this time: the first
/// `reconciliation_required` after the newest event that moved it elsewhere.
fn reconciling_since(s: &Story) -> Option<Timestamp> {
    let mut since = None;
    for e in &s.events {
        match &e.data {
            EventData::ReconciliationRequired(_) => {
                since.get_or_insert(e.at);
            }
            EventData::RetryScheduled(_)
            | EventData::TaskWoken(_)
            | EventData::Delivered(_)
            | EventData::TaskFailed(_)
            | EventData::CancelConfirmed(_)
            | EventData::OperatorRedriven(_)
            | EventData::OperatorResolved(_) => since = None,
            _ => {}
        }
    }
    since
}

/// The newest operator redrive, when no attempt was leased since: its time
/// and who did it.
fn redriven(s: &Story) -> Option<(Timestamp, String)> {
    for e in s.events.iter().rev() {
        match &e.data {
            EventData::AttemptLeased(_) => return None,
            EventData::OperatorRedriven(d) => {
                return Some((
                    e.at,
                    format!("{}: {}", super::actor_words(&d.actor), d.reason),
                ));
            }
            _ => {}
        }
    }
    None
}

/// An executor's message as the verdict shows it.
pub struct Message<'a> {
    /// The text as reported.
    pub text: &'a str,
    /// The attempt's number.
    pub number: i64,
    /// The attempt's executor.
    pub executor: &'a str,
    /// The reported outcome.
    pub outcome: &'static str,
    /// Whether the report was kept as evidence without being applied.
    pub stale: bool,
    /// When it was received.
    pub at: Timestamp,
}

/// The newest non-empty `message` of any report of `attempts`, applied or
/// not (by when it was received; on a tie, the later attempt).
pub fn last_message(attempts: &[Attempt]) -> Option<Message<'_>> {
    attempts
        .iter()
        .flat_map(|a| a.evidence.iter().map(move |e| (a, e)))
        .filter_map(|(a, e)| {
            let text = e.body.get("message").and_then(Value::as_str)?;
            (!text.trim().is_empty()).then_some(Message {
                text,
                number: a.number,
                executor: &a.executor_id,
                outcome: e.outcome.as_str(),
                stale: !applied(e.disposition),
                at: e.received_at,
            })
        })
        .max_by_key(|m| (m.at, m.number))
}

/// Whether evidence with `d` changed the attempt (or repeated what did).
pub fn applied(d: Disposition) -> bool {
    matches!(d, Disposition::Applied | Disposition::Repeat)
}

/// One provider transaction id an attempt reported, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportedTxn {
    /// The id as reported.
    pub id: String,
    /// `None` for the applied report's; else the evidence's disposition
    /// (`stale_generation`, `already_reported`).
    pub kept_as: Option<Disposition>,
    /// The generation the report presented.
    pub generation: i64,
}

/// Every distinct provider transaction id attempt `a` reported: the applied
/// report's (the attempt's `external_txn_id`), then those of reports kept as
/// evidence without being applied, in the order received.
pub fn attempt_txn_ids(a: &Attempt) -> Vec<ReportedTxn> {
    let mut out: Vec<ReportedTxn> = Vec::new();
    if let Some(id) = &a.external_txn_id {
        out.push(ReportedTxn {
            id: id.clone(),
            kept_as: None,
            generation: a.generation,
        });
    }
    for e in &a.evidence {
        let Some(id) = e.body.get("external_txn_id").and_then(Value::as_str) else {
            continue;
        };
        let kept_as = (!applied(e.disposition)).then_some(e.disposition);
        if out.iter().any(|r| r.id == id && r.kept_as == kept_as) {
            continue;
        }
        out.push(ReportedTxn {
            id: id.to_owned(),
            kept_as,
            generation: e.generation,
        });
    }
    out
}

/// Every distinct provider transaction id any of `attempts` reported.
fn reported_txn_ids(attempts: &[Attempt]) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for r in attempts.iter().flat_map(attempt_txn_ids) {
        if !ids.contains(&r.id) {
            ids.push(r.id);
        }
    }
    ids
}

/// A length of time in words, rounded down: "less than a minute", "15 min",
/// "2 h 5 min", "3 d 4 h".
pub fn span_words(ms: i64) -> String {
    let min = ms.max(0) / 60_000;
    match min {
        0 => "less than a minute".to_owned(),
        1..=59 => format!("{min} min"),
        60..=1439 if min % 60 == 0 => format!("{} h", min / 60),
        60..=1439 => format!("{} h {} min", min / 60, min % 60),
        _ if min % 1440 / 60 == 0 => format!("{} d", min / 1440),
        _ => format!("{} d {} h", min / 1440, min % 1440 / 60),
    }
}

/// A wait until an instant `ms` ahead: "in 4 s", "in 2 min", or "now".
fn relative(ms: i64) -> String {
    if ms <= 0 {
        "now".to_owned()
    } else if ms < 60_000 {
        format!("in {} s", (ms + 999) / 1000)
    } else {
        format!("in {}", span_words(ms))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]

    use idem_core::config::Config;
    use idem_core::contract::FrozenContract;
    use idem_core::model::{Cancellation, Delivery, TaskControl};
    use idem_core::money::testing::{check_rendering, currencies};
    use idem_core::money::{Currency, Money};
    use uuid::Uuid;

    use super::*;

    /// A delivered payment in `currency` charged `charge`, whose
    /// cancellation (when `too_late`) lost to the delivery; else a payment
    /// cancelled with fee `charge`.
    fn story(currency: Option<&Currency>, charge: i64, delivered: bool) -> Story {
        let mut contract = Config::bundled()
            .expect("config")
            .contract("payment.release")
            .expect("class");
        contract.price = charge;
        contract.fees.price = charge;
        contract.fees.currency = currency.map(|c| c.code.clone());
        contract.fees.exponent = currency.map(|c| c.exponent);
        let at = Timestamp(1_796_560_000_000);
        let cancellation = Cancellation {
            status: if delivered {
                CancelStatus::TooLate
            } else {
                CancelStatus::Confirmed
            },
            requested_at: at,
            confirmed_at: Some(at),
            fee: Some(charge),
            currency: currency.map(|c| c.code.clone()),
        };
        let task = Task {
            id: Uuid::nil(),
            operation: "payment.release".into(),
            idempotency_key: "k".into(),
            fingerprint: "sha256:0".into(),
            params: serde_json::json!({}),
            state: if delivered {
                TaskState::Succeeded
            } else {
                TaskState::Cancelled
            },
            generation: 1,
            attempt_count: 1,
            usage: 0,
            contract: FrozenContract::new(contract).expect("contract"),
            cancellation: Some(cancellation),
            delivery: delivered.then(|| Delivery {
                result: serde_json::json!({}),
                external_txn_id: Some("po_B".into()),
                delivered_at: at,
                acknowledged_at: None,
                charge,
                currency: currency.map(|c| c.code.clone()),
            }),
            failure: None,
            created_at: at,
            updated_at: at,
            traceparent: None,
            priority: 3,
            second_effects: Vec::new(),
            control: TaskControl {
                execute_count: 1,
                ..TaskControl::default()
            },
        };
        Story {
            task,
            attempts: Vec::new(),
            events: Vec::new(),
            now: at,
        }
    }

    /// `html` without its tags.
    fn text(html: &str) -> String {
        let mut out = String::new();
        let mut in_tag = false;
        for c in html.chars() {
            match c {
                '<' => in_tag = true,
                '>' => in_tag = false,
                c if !in_tag => out.push(c),
                _ => {}
            }
        }
        out
    }

    proptest::proptest! {
        /// The console's words for a charge and a fee carry the amount as
        /// idem_core::money writes it, reading back to the same amount, for
        /// exponents 0, 2, 3 and no currency: the verdict's answer and next
        /// step of a cancellation that lost to delivery (one amount, said
        /// to be the fee), the delivery's charge on the task page, a
        /// confirmed cancellation's fee.
        #[test]
        fn charges_and_fees_keep_their_currency(amount in 0i64..=9_007_199_254_740_991, which in 0usize..4) {
            let currency = currencies().swap_remove(which);
            let money = Money::new(amount, currency.clone());

            let late = story(currency.as_ref(), amount, true);
            let said = text(&answer(&late).into_string());
            proptest::prop_assert_eq!(check_rendering(&said, &money), Ok(()));
            let next = text(&next_step(&late).into_string());
            proptest::prop_assert!(next.contains("Its fee is that same charge ("), "{}", next);
            proptest::prop_assert_eq!(check_rendering(&next, &money), Ok(()));
            let page = text(&super::super::body(&late, None).into_string());
            let delivery = &page[page.find("Charge").unwrap()..];
            proptest::prop_assert_eq!(check_rendering(delivery, &money), Ok(()));

            let cancelled = story(currency.as_ref(), amount, false);
            let said = text(&answer(&cancelled).into_string());
            proptest::prop_assert_eq!(check_rendering(&said, &money), Ok(()));
        }
    }

    #[test]
    fn spans_read_in_words() {
        assert_eq!(span_words(59_999), "less than a minute");
        assert_eq!(span_words(15 * 60_000 + 5), "15 min");
        assert_eq!(span_words(2 * 3_600_000), "2 h");
        assert_eq!(span_words(2 * 3_600_000 + 5 * 60_000), "2 h 5 min");
        assert_eq!(span_words(3 * 86_400_000 + 4 * 3_600_000), "3 d 4 h");
        assert_eq!(span_words(-5), "less than a minute");
        assert_eq!(relative(1_500), "in 2 s");
        assert_eq!(relative(0), "now");
        assert_eq!(relative(120_000), "in 2 min");
    }
}
