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

use idem_core::model::{Event, EventKind};
use idem_store::Result;
use idem_store::feed::{FeedCursor, FeedEvent};
use tokio_postgres::Row;

use crate::rows::{get, json, ts, word};

/// Tenant `$1`'s events after `($2 txid, $3 position)`, of the classes in
/// `$4` (NULL: all), at most `$5`, in feed order, below the snapshot's xmin.
pub(crate) const FEED_PAGE: &str = "SELECT task_id, seq, type, at, data, operation, txid, position FROM events \
     WHERE tenant = $1 AND (txid, position) > ($2, $3) \
       AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint \
       AND ($4::text[] IS NULL OR operation = ANY($4)) \
     ORDER BY txid, position LIMIT $5";

/// One row of [`FEED_PAGE`].
pub(crate) fn feed_event(row: &Row) -> Result<FeedEvent> {
    Ok(FeedEvent {
        cursor: FeedCursor {
            txid: get(row, "txid")?,
            position: get(row, "position")?,
        },
        task_id: get(row, "task_id")?,
        operation: get(row, "operation")?,
        event: Event {
            seq: get(row, "seq")?,
            kind: word::<EventKind>(row, "type")?,
            at: ts(row, "at")?,
            data: json(row, "data")?,
        },
    })
}
