//! Reads for live events (SPEC §4, "Live events"): a task with its whole history in one
//! read, and a page of the tenant feed ([`crate::feed`]).

use idem_core::model::{Event, Task};
use uuid::Uuid;

use super::{Access, Grant, Operation, owned_task};
use crate::feed::{CursorAhead, FeedCursor, FeedEvent};
use crate::{Refusal, Result, Tx};

/// Most events one feed page holds.
pub const MAX_FEED_PAGE: i64 = 1_000;

/// A task and its event history, read together (a task stream decides from
/// the task's state whether the history holds its end).
#[derive(Debug, Clone)]
pub struct TaskHistory {
    /// Tenant filter (`None` = any tenant).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task id.
    pub task_id: Uuid,
}

impl Operation for TaskHistory {
    type Reply = Result<(Task, Vec<Event>), Refusal>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        Ok(match owned_task(tx, self.task_id, &access, false).await? {
            Ok(task) => Ok((task, tx.events(self.task_id).await?)),
            Err(e) => Err(e),
        })
    }
}

/// One page of a tenant's feed: up to `limit` events after `after`, in feed
/// order, of the classes the grant allows; refused when `after` is ahead of
/// the feed's head ([`crate::feed::FeedHead`]).
#[derive(Debug, Clone)]
pub struct ReadFeed {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant (events of other classes are left out).
    pub grant: Grant,
    /// The events after this place.
    pub after: FeedCursor,
    /// Most events, 1–[`MAX_FEED_PAGE`] (clamped).
    pub limit: i64,
}

impl Operation for ReadFeed {
    type Reply = Result<Vec<FeedEvent>, CursorAhead>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let limit = self.limit.clamp(1, MAX_FEED_PAGE);
        let read = tx
            .feed(
                &self.tenant,
                self.grant.as_deref().map(Vec::as_slice),
                self.after,
                limit,
            )
            .await?;
        Ok(if read.head.admits(self.after) {
            Ok(read.events)
        } else {
            Err(CursorAhead(self.after))
        })
    }
}
