//! Events and the tenant feed on SQLite ([`idem_store::feed`]): each event
//! row carries its task's tenant and class and a global `position`, one more
//! than the largest stored (the unique index `events_position` makes that a
//! single index probe). The one writer commits one transaction at a time and
//! readers see whole commits, so a reader paging by position never sees an
//! event appear below the last one it read. The feed's head
//! ([`idem_store::feed::FeedHead`]) is the largest stored position, one probe
//! of the same index, read on the same connection as the page.

use idem_core::model::{Event, EventData, EventKind, Timestamp};
use idem_store::StoreError;
use idem_store::feed::{FeedCursor, FeedEvent, FeedHead, FeedRead};
use rusqlite::{OptionalExtension, params};
use uuid::Uuid;

use super::{SqliteTx, db, decode, to_json, uuid, word};

/// One event of task `?1` (`seq`, `type`, `at`, `data`: `?2`–`?5`) with the
/// task's tenant and class and the next position; answers the tenant and
/// class. Inserts no row when the task does not exist.
const EVENT_INSERT: &str = "INSERT INTO events (task_id, seq, type, at, data, tenant, operation, position) \
     SELECT ?1, ?2, ?3, ?4, ?5, t.tenant, t.operation, \
            (SELECT coalesce(max(position), 0) + 1 FROM events) \
     FROM tasks t WHERE t.id = ?1 \
     RETURNING tenant, operation";

/// Tenant `?1`'s events after position `?2`, of the classes in the JSON array
/// `?3` (NULL: all), by position, at most `?4`.
const FEED_PAGE: &str = "SELECT task_id, seq, type, at, data, operation, position FROM events \
     WHERE tenant = ?1 AND position > ?2 \
       AND (?3 IS NULL OR operation IN (SELECT value FROM json_each(?3))) \
     ORDER BY position LIMIT ?4";

/// The largest stored position (0 when there is no event): every position
/// the feed gave out is at most this, as events are never removed.
const LAST_POSITION: &str = "SELECT coalesce(max(position), 0) FROM events";

impl SqliteTx<'_> {
    /// Appends `events` of `task_id` (the task row must exist).
    pub(super) fn append_events(
        &mut self,
        task_id: Uuid,
        events: &[Event],
    ) -> Result<(), StoreError> {
        let mut stmt = self.conn.prepare_cached(EVENT_INSERT).map_err(db)?;
        let id = task_id.to_string();
        for e in events {
            let data = to_json(&e.data)?;
            let inserted = stmt
                .query_row(params![id, e.seq, e.kind.as_str(), e.at.0, data], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
                })
                .optional()
                .map_err(db)?;
            let Some((tenant, operation)) = inserted else {
                return Err(StoreError::Corrupt(format!(
                    "event {} of task {task_id}: the task row is missing",
                    e.seq
                )));
            };
            self.notes
                .push(idem_store::Change::of_event(tenant, operation, task_id, e));
        }
        Ok(())
    }

    /// The history of `task_id`, by sequence.
    pub(super) fn history(&mut self, task_id: Uuid) -> Result<Vec<Event>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT seq, type, at, data FROM events WHERE task_id = ?1 ORDER BY seq",
            )
            .map_err(db)?;
        let rows = stmt
            .query_map([task_id.to_string()], |r| {
                let kind = word(&r.get::<_, String>(1)?)?;
                Ok(Event {
                    seq: r.get(0)?,
                    kind,
                    at: Timestamp(r.get(2)?),
                    data: event_data(kind, &r.get::<_, String>(3)?)?,
                })
            })
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    /// A page of the tenant feed with the feed's head
    /// ([`idem_store::Tx::feed`]): every `txid` is 0, so the head's
    /// `txid_below` is 1.
    pub(super) fn feed_page(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        after: FeedCursor,
        limit: i64,
    ) -> Result<FeedRead, StoreError> {
        let last_position: i64 = self
            .conn
            .prepare_cached(LAST_POSITION)
            .and_then(|mut stmt| stmt.query_row([], |r| r.get(0)))
            .map_err(db)?;
        let head = FeedHead {
            txid_below: 1,
            last_position,
        };
        let classes = operations.map(|o| to_json(&o)).transpose()?;
        let mut stmt = self.conn.prepare_cached(FEED_PAGE).map_err(db)?;
        let rows = stmt
            .query_map(params![tenant, after.position, classes, limit], |r| {
                let kind = word(&r.get::<_, String>(2)?)?;
                Ok(FeedEvent {
                    task_id: uuid(&r.get::<_, String>(0)?)?,
                    event: Event {
                        seq: r.get(1)?,
                        kind,
                        at: Timestamp(r.get(3)?),
                        data: event_data(kind, &r.get::<_, String>(4)?)?,
                    },
                    operation: r.get(5)?,
                    cursor: FeedCursor {
                        txid: 0,
                        position: r.get(6)?,
                    },
                })
            })
            .map_err(db)?;
        let events = rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)?;
        Ok(FeedRead { head, events })
    }
}

/// An event's stored data typed by its kind ([`EventData::from_json`]).
fn event_data(kind: EventKind, text: &str) -> rusqlite::Result<EventData> {
    EventData::from_json(kind, text).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}
