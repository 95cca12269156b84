//! The documents of live events (SPEC §4, "Live events"): one event of the tenant feed
//! and a page of it.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// One event of the tenant feed: the event and the task it belongs to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FeedEvent<E> {
    /// Where this event is in the feed: pass it as `after` (or
    /// `Last-Event-ID`) to read the events after it. Opaque.
    pub cursor: String,
    /// The task the event belongs to.
    pub task_id: Uuid,
    /// The task's operation class.
    pub operation: String,
    /// The event, as `GET /v1/tasks/{id}/events` lists it.
    pub event: E,
}

/// `{"events": [...], "next_cursor": "…"}`: a page of the tenant feed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FeedPage<F> {
    /// Events in feed order (at most `limit`; empty when none is new yet).
    pub events: Vec<F>,
    /// The cursor to read the next page after: the last event's, or the
    /// request's `after` when the page is empty. Never null: the feed goes on.
    pub next_cursor: String,
}
