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

use std::future::Future;

use idem_core::model::{Task, TaskState, Timestamp};
use uuid::Uuid;

use super::{Grant, Operation};
use crate::Result;

/// The most tasks one page holds (SPEC §4: `limit` is 1–200).
pub const MAX_LIMIT: u32 = 200;
/// The page size when the caller names none.
pub const DEFAULT_LIMIT: u32 = 50;

/// Where a page ends: the `(created_at, id)` of its last task. The next page
/// holds the tasks strictly before it in `created_at DESC, id DESC` order.
///
/// Its wire form ([`TaskCursor::encode`]) is opaque to clients: 48 lowercase
/// hex digits (`created_at` as 8 big-endian bytes, then the id's 16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskCursor {
    /// The last task's acceptance time.
    pub created_at: Timestamp,
    /// The last task's id.
    pub id: Uuid,
}

/// Why a cursor text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cursor: not one this server handed out")]
pub struct BadCursor;

impl TaskCursor {
    /// The cursor after `task`.
    pub fn after(task: &Task) -> TaskCursor {
        TaskCursor {
            created_at: task.created_at,
            id: task.id,
        }
    }

    /// The opaque text form: 48 lowercase hex digits.
    pub fn encode(&self) -> String {
        let mut bytes = [0_u8; 24];
        bytes[..8].copy_from_slice(&self.created_at.0.to_be_bytes());
        bytes[8..].copy_from_slice(self.id.as_bytes());
        hex::encode(bytes)
    }

    /// Parses [`TaskCursor::encode`]'s form.
    ///
    /// # Errors
    /// [`BadCursor`] for any other text (wrong length, not lowercase hex).
    pub fn decode(text: &str) -> std::result::Result<TaskCursor, BadCursor> {
        if text.len() != 48 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(BadCursor);
        }
        let mut bytes = [0_u8; 24];
        hex::decode_to_slice(text, &mut bytes).map_err(|_| BadCursor)?;
        let mut at = [0_u8; 8];
        at.copy_from_slice(&bytes[..8]);
        let id = Uuid::from_slice(&bytes[8..]).map_err(|_| BadCursor)?;
        Ok(TaskCursor {
            created_at: Timestamp(i64::from_be_bytes(at)),
            id,
        })
    }
}

/// The filters of a search; every one present must hold (an empty `states`
/// means any state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskQuery {
    /// Any of these states (empty: any state).
    pub states: Vec<TaskState>,
    /// Only this operation class.
    pub operation: Option<String>,
    /// Only tasks accepted strictly after this instant (ms).
    pub created_after: Option<Timestamp>,
    /// Only tasks accepted strictly before this instant (ms).
    pub created_before: Option<Timestamp>,
    /// Only idempotency keys starting with this text (compared as bytes; no
    /// character is a wildcard).
    pub idempotency_key_prefix: Option<String>,
    /// Only tasks with an attempt that reported this provider transaction id.
    pub external_txn_id: Option<String>,
    /// At most this many tasks (1–[`MAX_LIMIT`]).
    pub limit: u32,
    /// Only tasks after this cursor (the previous page's last).
    pub cursor: Option<TaskCursor>,
}

impl Default for TaskQuery {
    fn default() -> Self {
        TaskQuery {
            states: Vec::new(),
            operation: None,
            created_after: None,
            created_before: None,
            idempotency_key_prefix: None,
            external_txn_id: None,
            limit: DEFAULT_LIMIT,
            cursor: None,
        }
    }
}

impl TaskQuery {
    /// The states to read, each once, in a fixed order: those asked for, or
    /// every state. A backend reads one ordered index range per state and
    /// merges them, so a page costs at most seven short index walks.
    pub fn states_to_read(&self) -> Vec<TaskState> {
        let mut states: Vec<TaskState> = if self.states.is_empty() {
            TaskState::ALL.to_vec()
        } else {
            self.states.clone()
        };
        states.sort_by_key(|s| s.as_str());
        states.dedup();
        states
    }

    /// The exclusive upper bound of the keys starting with
    /// `idempotency_key_prefix`, in byte order (= code point order for
    /// UTF-8): the prefix with its last character replaced by the next one
    /// (dropping trailing U+10FFFF). `None` when there is no prefix or no
    /// bound (a prefix of U+10FFFF only).
    pub fn key_prefix_end(&self) -> Option<String> {
        let mut chars: Vec<char> = self.idempotency_key_prefix.as_deref()?.chars().collect();
        while let Some(last) = chars.pop() {
            let next = (u32::from(last) + 1..=0x10FFFF).find_map(char::from_u32);
            if let Some(next) = next {
                chars.push(next);
                return Some(chars.into_iter().collect());
            }
        }
        None
    }
}

/// The search a backend offers inside a transaction (a supertrait of
/// [`crate::Tx`], implemented in each backend's own search module).
pub trait TaskSearch: Send {
    /// Up to `q.limit + 1` tasks of `tenant` matching `q`, in the classes of
    /// `operations` when given (a key's grant), newest first
    /// (`created_at DESC, id DESC`), after `q.cursor`.
    fn search_tasks(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        q: &TaskQuery,
    ) -> impl Future<Output = Result<Vec<Task>>> + Send;
}

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
        Ok(TaskPage { tasks, next_cursor })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_round_trips_and_refuses_other_text() {
        let c = TaskCursor {
            created_at: Timestamp(1_764_000_000_123),
            id: Uuid::now_v7(),
        };
        let text = c.encode();
        assert_eq!(text.len(), 48);
        assert_eq!(TaskCursor::decode(&text), Ok(c));
        for bad in [
            "",
            "zz",
            &text[..47],
            &format!("{text}0"),
            &text.to_uppercase(),
            "g00000000000000000000000000000000000000000000000",
        ] {
            assert_eq!(TaskCursor::decode(bad), Err(BadCursor), "{bad}");
        }
    }

    #[test]
    fn key_prefix_end_is_the_next_string_in_byte_order() {
        let end = |p: &str| {
            TaskQuery {
                idempotency_key_prefix: Some(p.to_owned()),
                ..TaskQuery::default()
            }
            .key_prefix_end()
        };
        assert_eq!(end("pay-"), Some("pay.".into()));
        assert_eq!(end("a%_"), Some("a%`".into()));
        assert_eq!(end("a\u{10FFFF}"), Some("b".into()));
        assert_eq!(end("\u{10FFFF}"), None);
        assert_eq!(end("\u{D7FF}"), Some("\u{E000}".into()));
        assert_eq!(TaskQuery::default().key_prefix_end(), None);
        // Every key with the prefix sorts below the end, byte-wise.
        for key in ["pay-", "pay-\u{10FFFF}\u{10FFFF}", "pay-zzz"] {
            assert!(key.as_bytes() < "pay.".as_bytes());
        }
    }

    #[test]
    fn states_to_read_are_each_state_once() {
        let q = TaskQuery {
            states: vec![TaskState::Queued, TaskState::Failed, TaskState::Queued],
            ..TaskQuery::default()
        };
        assert_eq!(
            q.states_to_read(),
            vec![TaskState::Failed, TaskState::Queued]
        );
        assert_eq!(TaskQuery::default().states_to_read().len(), 7);
    }
}
