//! The JSON documents of the HTTP API (SPEC §4) as the server reads and
//! writes them: `idem-api`'s documents filled with `idem-core`'s records and
//! words, which decode strictly, and the lookup query.

use serde::Deserialize;
use utoipa::IntoParams;

pub use idem_api::{AckBody, ClaimBody, Health, HeartbeatBody, Meta, ReleaseBody, SubmitBody};
use idem_core::model::{
    Attempt, AttemptKind, Cancellation, Event, FailureClass, Outcome, Task, Timestamp,
};

/// Submit response.
pub type SubmitResponse = idem_api::SubmitResponse<Task>;

/// `{"task": TASK}`.
pub type TaskEnvelope = idem_api::TaskEnvelope<Task>;

/// `{"tasks": [...], "next_cursor": "…" | null}`.
pub type TasksPage = idem_api::TasksPage<Task>;

/// `{"attempts": [...]}`.
pub type AttemptsEnvelope = idem_api::AttemptsEnvelope<Attempt>;

/// `{"events": [...]}`.
pub type EventsEnvelope = idem_api::EventsEnvelope<Event>;

/// One event of the tenant feed.
pub type FeedEvent = idem_api::FeedEvent<Event>;

/// `{"events": [...], "next_cursor": "…"}`: a page of the tenant feed.
pub type FeedPage = idem_api::FeedPage<FeedEvent>;

/// Cancel response.
pub type CancelResponse = idem_api::CancelResponse<Task, Cancellation>;

/// One leased attempt.
pub type ClaimedAttempt = idem_api::ClaimedAttempt<AttemptKind, Timestamp>;

/// Claim response.
pub type ClaimResponse = idem_api::ClaimResponse<ClaimedAttempt>;

/// Heartbeat response.
pub type HeartbeatResponse = idem_api::HeartbeatResponse<Timestamp>;

/// Report body (strict words: an unknown outcome or class is 400 `INVALID_REQUEST`).
pub type ReportBody = idem_api::ReportBody<Outcome, FailureClass>;

/// Scope lookup query (both parameters are required: a missing one is 400
/// `INVALID_REQUEST`).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LookupQuery {
    /// Operation class.
    #[param(required = true, value_type = String)]
    pub operation: Option<String>,
    /// Idempotency key, as the submit's header carried it without the quotes
    /// (1–255 visible ASCII).
    #[param(required = true, value_type = String, pattern = "^[!-~]{1,255}$")]
    pub idempotency_key: Option<String>,
}
