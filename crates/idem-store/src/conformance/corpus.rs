//! A corpus of stored event data: conformance cases whose histories together
//! hold every [`EventKind`], run by a backend's test on stores whose raw
//! `events.data` text it then reads back (SPEC §2.10: the history is the
//! audit record, so its stored form never changes under a reader).

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;

use idem_core::model::{EventData, EventKind};
use serde_json::Value;

use super::must;
use crate::Store;

/// One conformance case, boxed so a list can hold them.
pub type CorpusCase = fn(Store) -> Pin<Box<dyn Future<Output = ()>>>;

/// The cases a corpus is drawn from, by name: between them every
/// [`EventKind`](idem_core::model::EventKind) is written, the store-rewind
/// variants included.
pub fn corpus_cases() -> Vec<(&'static str, CorpusCase)> {
    macro_rules! cases {
        ($($case:ident),+ $(,)?) => {
            vec![$((stringify!($case), (|s| Box::pin(super::$case(s))) as CorpusCase)),+]
        };
    }
    cases![
        first_event_records_acceptance_decision,
        succeeded_report_delivers_once_with_charge,
        safe_lease_expiry_fences_old_generation,
        heartbeat_extends_lease,
        non_safe_lease_expiry_reconciles_then_not_committed_re_executes,
        non_safe_lease_expiry_reconciles_then_committed_delivers,
        unknown_report_reconciles_before_any_retry,
        failed_reconcile_leads_to_another_reconcile,
        transient_on_safe_class_retries_after_backoff,
        transient_on_non_safe_class_fails,
        attempts_exhausted_fails_task,
        budget_exhausted_fails_task,
        deadline_exceeded_after_transient_fails_task,
        revoked_key_fails_task_before_first_attempt,
        repeated_report_is_idempotent_and_different_report_refused,
        cancel_queued_confirms_at_once,
        cancel_running_confirms_on_cancelled_report,
        cancel_after_delivery_is_too_late,
        cancel_pending_then_succeeded_is_too_late,
        cancel_pending_non_safe_lease_expiry_not_committed_cancels,
        device_acknowledge_then_completion,
        release_is_fenced_by_generation_and_repeats_answer_again,
        release_with_a_pending_cancellation_confirms_it,
        retention_releases_terminal_key_only_after_expiry,
        usage_is_kept_across_attempts,
        claim_leases_first_attempt_with_params,
        operator_retry_now_makes_a_backoff_claimable_at_once,
        operator_cancel_is_the_clients_with_actor_and_reason,
        operator_resolve_settles_a_reconciling_task,
        operator_redrive_grants_one_more_attempt,
        rewind_moves_tasks_that_may_have_started_to_reconcile_first,
        stale_reports_of_other_ids_raise_one_second_effect_per_id,
        late_and_duplicate_reports_raise_second_effects,
        second_effect_acknowledgment_is_audited_and_idempotent,
    ]
}

/// Checks the event data a store holds after the [`corpus_cases`] ran on it,
/// `rows` (`(type, data)` as stored), against `earlier`: the same cases' rows
/// as an earlier release stored them (one `type<TAB>data` a line), so that
/// rows of either read back unchanged.
///
/// - Every row of both reads as its kind's struct (never
///   [`EventData::Other`]) and serializes to exactly the text stored.
/// - Every [`EventKind`] occurs in both.
/// - Per kind, both hold the same shapes: member names, nesting and JSON
///   types (values differ: ids and times are new on every run).
///
/// # Panics
/// On the first row that breaks a rule (this is a test).
pub fn check_event_corpus(rows: &[(String, String)], earlier: &str) {
    let earlier: Vec<(String, String)> = earlier
        .lines()
        .map(|line| match line.split_once('\t') {
            Some((kind, data)) => (kind.to_owned(), data.to_owned()),
            None => panic!("corpus line without a tab: {line}"),
        })
        .collect();
    round_trips(rows, "stored now");
    let before = round_trips(&earlier, "stored by the earlier release");
    // Members this release writes that the earlier corpus has not: each is
    // written now, and the shapes are compared without them.
    for (kind, member) in ADDED_MEMBERS {
        assert!(
            rows.iter().any(|(k, text)| k == kind
                && serde_json::from_str::<Value>(text).is_ok_and(|v| v.get(member).is_some())),
            "no {kind} stored now with its {member}"
        );
    }
    let now: BTreeSet<(&'static str, String)> = rows
        .iter()
        .map(|(kind, text)| {
            let kind: EventKind = must(kind.parse(), "stored now");
            let mut v: Value = must(serde_json::from_str(text), "stored now");
            if let Some(members) = v.as_object_mut() {
                for (k, m) in ADDED_MEMBERS {
                    if *k == kind.as_str() {
                        members.remove(*m);
                    }
                }
            }
            (kind.as_str(), shape(&v))
        })
        .collect();
    for kind in EventKind::ALL {
        assert!(
            now.iter().any(|(k, _)| *k == kind.as_str()),
            "no {kind} stored now"
        );
        assert!(
            before.iter().any(|(k, _)| *k == kind.as_str()),
            "no {kind} in the earlier corpus"
        );
    }
    assert_eq!(now, before, "shapes of the event data, now and earlier");
}

/// `(kind, member)`: the members of event data added after the earlier
/// corpus was stored. Rows without them (the earlier release's) still read
/// back unchanged; rows with them are compared to the earlier shapes without
/// them. The amount-carrying events name the contract's currency (SPEC §4,
/// §5 "Money").
const ADDED_MEMBERS: &[(&str, &str)] = &[
    ("delivered", "currency"),
    ("cancel_confirmed", "currency"),
    ("cancel_too_late", "currency"),
];

/// Checks that each row reads typed and serializes to its text; returns the
/// (kind, shape) pairs.
fn round_trips(rows: &[(String, String)], what: &str) -> BTreeSet<(&'static str, String)> {
    let mut shapes = BTreeSet::new();
    for (kind, text) in rows {
        let kind: EventKind = must(kind.parse(), what);
        let data = must(EventData::from_json(kind, text), what);
        assert!(
            !matches!(data, EventData::Other(_)),
            "{what}: {kind} data does not read as its struct: {text}"
        );
        assert_eq!(data.kind(), kind, "{what}: {text}");
        let again = must(serde_json::to_string(&data), what);
        assert_eq!(&again, text, "{what}: {kind} data serializes differently");
        shapes.insert((
            kind.as_str(),
            shape(&must(serde_json::from_str(text), what)),
        ));
    }
    shapes
}

/// `v` with every scalar replaced by its JSON type's name.
fn shape(v: &Value) -> String {
    match v {
        Value::Null => "null".to_owned(),
        Value::Bool(_) => "boolean".to_owned(),
        Value::Number(_) => "number".to_owned(),
        Value::String(_) => "string".to_owned(),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(shape).collect();
            format!("[{}]", items.join(","))
        }
        Value::Object(members) => {
            let members: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("{k}:{}", shape(v)))
                .collect();
            format!("{{{}}}", members.join(","))
        }
    }
}
