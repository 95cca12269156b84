//! A corpus of stored event data: conformance cases whose histories together
//! hold every [`EventKind`], run by a backend's test on stores whose raw
//! `events.data` text it then reads back (SPEC §2.10: the history is the
//! audit record, so its stored form never changes under a reader).

use std::future::Future;
use std::pin::Pin;

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
    ]
}
