//! The tenant event feed (SPEC §4, "Live events"): every event of a tenant, once each, in
//! an order a reader can resume from a [`FeedCursor`] without missing or
//! repeating one.
//!
//! An event's place in the feed is its [`FeedCursor`]: `(txid, position)`.
//! `position` is a global number given when the event is inserted; `txid`
//! orders the events by the transaction that wrote them where the database
//! lets transactions commit out of order:
//! - PostgreSQL: `txid` is the writing transaction's `pg_current_xact_id()`
//!   (or the txid of the task's previous event, when larger, so that one
//!   task's events stay in `seq` order). A page holds only events whose txid
//!   is below `pg_snapshot_xmin(pg_current_snapshot())` of the statement that
//!   reads it: every transaction with a smaller id has ended, committed or
//!   not, so every event before the page's last cursor is already visible and
//!   none can appear there later. A sequence alone would skip: values are
//!   taken at insert and become visible at commit, in another order. The
//!   price: an event is served once every transaction older than its own has
//!   ended (a transaction held open anywhere on the server delays the feed,
//!   never makes it skip).
//! - SQLite: one writer commits one transaction at a time and gives each
//!   event the next position, so position order is commit order; `txid` is 0.
//!
//! The cursor's text form is opaque to clients: `{txid}-{position}`.

use std::fmt;
use std::str::FromStr;

use idem_core::model::Event;
use uuid::Uuid;

/// A place in a tenant's feed: the events after it are those not yet read.
/// [`FeedCursor::START`] is before every event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct FeedCursor {
    /// The transaction order key (PostgreSQL; 0 on SQLite).
    pub txid: i64,
    /// The event's global position.
    pub position: i64,
}

impl FeedCursor {
    /// Before every event.
    pub const START: FeedCursor = FeedCursor {
        txid: 0,
        position: 0,
    };
}

impl fmt::Display for FeedCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.txid, self.position)
    }
}

/// A cursor text that is not one this service gave out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a feed cursor: expected the `next_cursor` or an event `cursor` of an earlier page")]
pub struct BadCursor;

impl FromStr for FeedCursor {
    type Err = BadCursor;
    fn from_str(s: &str) -> Result<FeedCursor, BadCursor> {
        let (txid, position) = s.split_once('-').ok_or(BadCursor)?;
        // Digits only: no sign, no spaces, no empty part.
        let number = |t: &str| {
            if t.is_empty() || t.len() > 19 || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(BadCursor);
            }
            t.parse::<i64>().map_err(|_| BadCursor)
        };
        Ok(FeedCursor {
            txid: number(txid)?,
            position: number(position)?,
        })
    }
}

/// One event of the feed with the task it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedEvent {
    /// Where the event is in the feed (resume after it).
    pub cursor: FeedCursor,
    /// The task.
    pub task_id: Uuid,
    /// The task's operation class.
    pub operation: String,
    /// The event.
    pub event: Event,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_text_round_trips_and_refuses_anything_else() {
        let c = FeedCursor {
            txid: 7_123_456,
            position: 42,
        };
        assert_eq!(c.to_string().parse::<FeedCursor>(), Ok(c));
        assert_eq!("0-0".parse::<FeedCursor>(), Ok(FeedCursor::START));
        for bad in [
            "",
            "-",
            "1",
            "1-",
            "-1",
            "1--1",
            "+1-2",
            "1-2-3",
            " 1-2",
            "a-b",
            "99999999999999999999-1",
        ] {
            assert_eq!(bad.parse::<FeedCursor>(), Err(BadCursor), "{bad:?}");
        }
    }
}
