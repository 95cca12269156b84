//! Task search: one tenant's tasks, newest first, filtered, in pages walked
//! with a keyset cursor on `(created_at, id)` (SPEC §4 `GET /v1/tasks`).
//!
//! A page is the first `limit` tasks after the cursor in the order
//! `created_at DESC, id DESC`. The cursor is the `(created_at, id)` of the
//! last task of the previous page, so a task inserted while a client walks
//! the pages never moves another one across a page boundary: every task that
//! existed when the walk began is on exactly one page, whatever is inserted
//! meanwhile (a new task is newer than the walk's first page, or lands on a
//! later one).
//!
//! Each backend answers [`TaskQuery`] through [`TaskSearch::search_tasks`]
//! with one statement whose cost does not grow with the tenant's number of
//! tasks (schema v5's indexes; `docs/benchmarks.md`, "Task search").

use idem_core::model::Task;

use super::{Grant, Operation};
use crate::Result;

pub use crate::tx::search::{
    BadCursor, CURSOR_SECRET, CursorKey, DEFAULT_LIMIT, MAX_LIMIT, SecondEffectFilter, TaskCursor,
    TaskQuery, TaskSearch,
};

/// One page of a search.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskPage {
    /// The tasks, newest first.
    pub tasks: Vec<Task>,
    /// Where the next page starts; `None` when this page is the last.
    pub next_cursor: Option<TaskCursor>,
}

/// Search the tasks of one tenant.
#[derive(Debug, Clone)]
pub struct SearchTasks {
    /// Tenant (every read is scoped to one).
    pub tenant: String,
    /// The caller's grant: a key limited to some classes sees only those.
    pub grant: Grant,
    /// The filters.
    pub query: TaskQuery,
}

impl Operation for SearchTasks {
    type Reply = TaskPage;
    const WRITES: bool = false;
    async fn run<T: crate::Tx>(&self, tx: &mut T) -> Result<TaskPage> {
        let q = &self.query;
        let granted = self.grant.as_deref().map(Vec::as_slice);
        if let (Some(op), Some(ops)) = (&q.operation, granted)
            && !ops.contains(op)
        {
            return Ok(TaskPage {
                tasks: Vec::new(),
                next_cursor: None,
            });
        }
        let limit = q.limit.clamp(1, MAX_LIMIT) as usize;
        let mut tasks = tx.search_tasks(&self.tenant, granted, q).await?;
        let next_cursor = if tasks.len() > limit {
            tasks.truncate(limit);
            tasks.last().map(TaskCursor::after)
        } else {
            None
        };
        // Each task as its answer shows it, suspected second effects included.
        for t in &mut tasks {
            t.second_effects = tx.effects(t.id).await?.1;
        }
        Ok(TaskPage { tasks, next_cursor })
    }
}
