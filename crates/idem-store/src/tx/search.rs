//! The task search a backend answers: the query, its sealed keyset cursor,
//! and [`TaskSearch`] (SPEC §4 `GET /v1/tasks`; [`crate::ops::search`] runs it).

use std::future::Future;

use idem_core::model::{Task, TaskState, Timestamp};
use uuid::Uuid;

use crate::Result;

/// The most tasks one page holds (SPEC §4: `limit` is 1–200).
pub const MAX_LIMIT: u32 = 200;
/// The page size when the caller names none.
pub const DEFAULT_LIMIT: u32 = 50;

/// Where a page ends: the `(created_at, id)` of its last task. The next page
/// holds the tasks strictly before it in `created_at DESC, id DESC` order.
///
/// Its wire form is sealed ([`CursorKey::seal`]): opaque to clients, and
/// refused when it was not given out.
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

/// The name of the shared secret ([`crate::Store::shared_secret`]) that
/// authenticates task cursors.
pub const CURSOR_SECRET: &str = "task_cursor";

/// Bytes of a cursor's tag (the first half of its HMAC-SHA256).
const TAG_BYTES: usize = 16;

/// The key that seals and opens task cursors: a secret every instance of a
/// store shares through it ([`CURSOR_SECRET`]), so a cursor one instance
/// gave out opens on every other and on `idem task list`, and no client can
/// make one (SPEC §4: a cursor the server did not give out is 400).
#[derive(Clone)]
pub struct CursorKey([u8; 32]);

impl std::fmt::Debug for CursorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CursorKey(…)")
    }
}

impl CursorKey {
    /// A key from the stored secret.
    ///
    /// # Errors
    /// [`crate::StoreError::Corrupt`] when it is not 32 bytes.
    pub fn new(secret: &[u8]) -> Result<CursorKey> {
        let bytes: [u8; 32] = secret.try_into().map_err(|_| {
            crate::StoreError::Corrupt(format!(
                "shared secret {CURSOR_SECRET} has {} bytes, not 32",
                secret.len()
            ))
        })?;
        Ok(CursorKey(bytes))
    }

    /// HMAC-SHA256 (RFC 2104) of the tenant and the cursor's bytes, cut to
    /// [`TAG_BYTES`]: a cursor is bound to the tenant it was given to.
    fn tag(&self, tenant: &str, payload: &[u8]) -> [u8; TAG_BYTES] {
        use hmac::{KeyInit, Mac};
        let mut mac = match hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.0) {
            Ok(m) => m,
            // HMAC takes a key of any length.
            Err(_) => return [0; TAG_BYTES],
        };
        mac.update(b"idem task cursor v1\0");
        mac.update(tenant.as_bytes());
        mac.update(b"\0");
        mac.update(payload);
        let full = mac.finalize().into_bytes();
        let mut tag = [0_u8; TAG_BYTES];
        tag.copy_from_slice(&full[..TAG_BYTES]);
        tag
    }

    /// The text a client gets for `cursor` in `tenant`'s search: 80
    /// lowercase hex digits (the cursor's 24 bytes, then its tag).
    pub fn seal(&self, tenant: &str, cursor: &TaskCursor) -> String {
        let payload = cursor.to_bytes();
        let mut text = hex::encode(payload);
        text.push_str(&hex::encode(self.tag(tenant, &payload)));
        text
    }

    /// The cursor `text` stands for, when this store's key sealed it for
    /// `tenant`.
    ///
    /// # Errors
    /// [`BadCursor`] for any other text: not of the form, edited, made by
    /// a client, or given to another tenant.
    pub fn open(&self, tenant: &str, text: &str) -> std::result::Result<TaskCursor, BadCursor> {
        if text.len() != 2 * (24 + TAG_BYTES)
            || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(BadCursor);
        }
        let mut bytes = [0_u8; 24 + TAG_BYTES];
        hex::decode_to_slice(text, &mut bytes).map_err(|_| BadCursor)?;
        let (payload, tag) = bytes.split_at(24);
        let want = self.tag(tenant, payload);
        if !bool::from(subtle::ConstantTimeEq::ct_eq(&want[..], tag)) {
            return Err(BadCursor);
        }
        TaskCursor::from_bytes(payload)
    }
}

impl TaskCursor {
    /// The cursor after `task`.
    pub fn after(task: &Task) -> TaskCursor {
        TaskCursor {
            created_at: task.created_at,
            id: task.id,
        }
    }

    /// Its 24 bytes: `created_at` as 8 big-endian bytes, then the id's 16.
    fn to_bytes(self) -> [u8; 24] {
        let mut bytes = [0_u8; 24];
        bytes[..8].copy_from_slice(&self.created_at.0.to_be_bytes());
        bytes[8..].copy_from_slice(self.id.as_bytes());
        bytes
    }

    /// The cursor of [`TaskCursor::to_bytes`]'s form.
    fn from_bytes(bytes: &[u8]) -> std::result::Result<TaskCursor, BadCursor> {
        let at: [u8; 8] = bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or(BadCursor)?;
        let id = Uuid::from_slice(bytes.get(8..).ok_or(BadCursor)?).map_err(|_| BadCursor)?;
        Ok(TaskCursor {
            created_at: Timestamp(i64::from_be_bytes(at)),
            id,
        })
    }
}

/// The `second_effect` filter of a search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecondEffectFilter {
    /// Tasks with at least one suspected second effect.
    Suspected,
    /// Tasks with a suspected second effect no operator acknowledged.
    Unacknowledged,
}

impl SecondEffectFilter {
    /// `suspected` or `unacknowledged`, as a search names it.
    pub fn parse(s: &str) -> Option<SecondEffectFilter> {
        match s {
            "suspected" => Some(SecondEffectFilter::Suspected),
            "unacknowledged" => Some(SecondEffectFilter::Unacknowledged),
            _ => None,
        }
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
    /// Only tasks with an attempt that reported this provider transaction
    /// id: applied, stale, late or duplicate evidence, or an operator's resolve.
    pub external_txn_id: Option<String>,
    /// Only tasks with a suspected second effect (any, or one not yet acknowledged).
    pub second_effect: Option<SecondEffectFilter>,
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
            second_effect: None,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A sealed cursor opens for its tenant with its key; edited text (its
    /// first 16 hex digits zeroed, one digit of the tag changed), another
    /// tenant, another key and any other text are refused.
    #[test]
    fn a_sealed_cursor_opens_only_as_given() {
        let key = CursorKey::new(&[7; 32]).unwrap();
        let c = TaskCursor {
            created_at: Timestamp(1_764_000_000_123),
            id: Uuid::now_v7(),
        };
        let text = key.seal("acme", &c);
        assert_eq!(text.len(), 80);
        assert_eq!(key.open("acme", &text), Ok(c));
        assert_eq!(key.open("other", &text), Err(BadCursor));
        let other_key = CursorKey::new(&[8; 32]).unwrap();
        assert_eq!(other_key.open("acme", &text), Err(BadCursor));
        let zeroed = format!("{}{}", "0".repeat(16), &text[16..]);
        let last = if text.ends_with('0') { "1" } else { "0" };
        let retagged = format!("{}{last}", &text[..79]);
        for bad in [
            "",
            "zz",
            &text[..48],
            &text[..79],
            &format!("{text}0"),
            &text.to_uppercase(),
            &zeroed,
            &retagged,
        ] {
            assert_eq!(key.open("acme", bad), Err(BadCursor), "{bad}");
        }
        assert!(CursorKey::new(&[1; 31]).is_err());
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
