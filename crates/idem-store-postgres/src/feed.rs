//! The tenant feed on PostgreSQL ([`idem_store::feed`]).
//!
//! Sequence values are taken at insert and become visible at commit, so
//! concurrent transactions make them visible out of order: a reader that
//! served position 12 may later find 11. Each event row therefore also
//! carries `txid`, the id of the transaction that wrote it (`pg_current_xact_id()`
//! as bigint; for an event of an existing task at least its previous event's
//! txid, `rows::EVENTS_INSERT`), and a page holds only events whose txid is
//! below the xmin of its own statement's snapshot
//! (`pg_snapshot_xmin(pg_current_snapshot())`): every transaction with an id
//! below it has ended, so every such event that will ever exist is visible to
//! that statement, and an event written later has a txid at or above it.
//! Pages are ordered by `(txid, position)` (index `events_feed (tenant, txid,
//! position)`, migration 6), so the events before a page's last cursor are
//! final: resuming after it skips nothing and repeats nothing. The statement
//! runs in autocommit (the feed is read-only): a transaction id of its own
//! would hold its horizon back.
//!
//! The same statement reads the feed's head ([`idem_store::feed::FeedHead`]):
//! the xmin it serves below, and the last value of the position sequence
//! (`events_position_seq`; one less while it has given none), so a cursor
//! ahead of the head is found without another round trip.

use idem_store::Result;
use idem_store::feed::{FeedCursor, FeedEvent, FeedHead, FeedRead};
use tokio_postgres::Row;

use crate::error::corrupt;
use crate::rows::{event_from_row, get};

/// The feed's head (`head_txid`, `head_position`) and tenant `$1`'s events
/// after `($2 txid, $3 position)`, of the classes in `$4` (NULL: all), at
/// most `$5`, in feed order, below the snapshot's xmin. Always one row or
/// more: with no event, one row whose event columns are NULL.
pub(crate) const FEED_PAGE: &str = "WITH head AS ( \
       SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS txid_below, \
              CASE WHEN is_called THEN last_value ELSE last_value - 1 END AS last_position \
         FROM events_position_seq) \
     SELECT h.txid_below AS head_txid, h.last_position AS head_position, \
            e.task_id, e.seq, e.type, e.at, e.data, e.operation, e.txid, e.position \
       FROM head h LEFT JOIN LATERAL ( \
            SELECT task_id, seq, type, at, data, operation, txid, position FROM events \
             WHERE tenant = $1 AND (txid, position) > ($2, $3) \
               AND txid < h.txid_below \
               AND ($4::text[] IS NULL OR operation = ANY($4)) \
             ORDER BY txid, position LIMIT $5) e ON true \
      ORDER BY e.txid, e.position";

/// The rows of [`FEED_PAGE`] as the head and the page.
pub(crate) fn feed_read(rows: &[Row]) -> Result<FeedRead> {
    let Some(first) = rows.first() else {
        return Err(corrupt("feed page", "the head row is missing"));
    };
    let head = FeedHead {
        txid_below: get(first, "head_txid")?,
        last_position: get(first, "head_position")?,
    };
    let mut events = Vec::with_capacity(rows.len());
    for row in rows {
        if get::<Option<uuid::Uuid>>(row, "task_id")?.is_some() {
            events.push(feed_event(row)?);
        }
    }
    Ok(FeedRead { head, events })
}

/// One event row of [`FEED_PAGE`].
fn feed_event(row: &Row) -> Result<FeedEvent> {
    Ok(FeedEvent {
        cursor: FeedCursor {
            txid: get(row, "txid")?,
            position: get(row, "position")?,
        },
        task_id: get(row, "task_id")?,
        operation: get(row, "operation")?,
        event: event_from_row(row)?,
    })
}
