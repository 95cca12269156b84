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
//!
//! A cursor no page could have given out, one ahead of the feed's head
//! ([`FeedHead`]), is refused ([`CursorAhead`]): read as it is, it would
//! answer empty pages until the feed caught up with it and then skip every
//! event in between. The head is read by the page's own statement, so the
//! check costs no round trip.

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

/// Where a feed's head was when a page was read: every cursor the feed has
/// given out (an event's, or `after` handed back with an empty page) lies at
/// or behind it, and stays there, because both bounds only grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedHead {
    /// Every given cursor's `txid` is below this. PostgreSQL: the reading
    /// statement's `pg_snapshot_xmin(pg_current_snapshot())` (a page serves
    /// only events below it, and a later snapshot's xmin is never lower);
    /// SQLite: 1 (every `txid` is 0).
    pub txid_below: i64,
    /// Every given cursor's `position` is at most this. PostgreSQL: the last
    /// value the position sequence gave out (`events_position_seq`); SQLite:
    /// the largest stored position (events are never removed).
    pub last_position: i64,
}

impl FeedHead {
    /// Whether `after` could have been given out by this feed: not ahead of
    /// its head.
    pub fn admits(&self, after: FeedCursor) -> bool {
        after.txid < self.txid_below && after.position <= self.last_position
    }
}

/// A page read after `after`: the feed's head then, and the events.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedRead {
    /// The head when the page was read.
    pub head: FeedHead,
    /// The page's events, in feed order.
    pub events: Vec<FeedEvent>,
}

/// A cursor ahead of the feed's head ([`FeedHead::admits`]): no page of this
/// feed gave it out, and reading after it would skip the events before it
/// once they appear (HTTP 400 `INVALID_REQUEST`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "cursor {0} is ahead of the feed: no page gave it out (pass an event's `cursor` or a page's `next_cursor` as it is)"
)]
pub struct CursorAhead(pub FeedCursor);

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

    #[test]
    fn the_head_admits_what_it_gave_out_and_nothing_beyond() {
        let head = FeedHead {
            txid_below: 700,
            last_position: 42,
        };
        for given in [(0, 0), (0, 42), (699, 1), (699, 42)] {
            let c = FeedCursor {
                txid: given.0,
                position: given.1,
            };
            assert!(head.admits(c), "{c}");
        }
        for ahead in [(0, 43), (700, 1), (699, 43), (i64::MAX, 0), (0, i64::MAX)] {
            let c = FeedCursor {
                txid: ahead.0,
                position: ahead.1,
            };
            assert!(!head.admits(c), "{c}");
        }
        // SQLite: every txid is 0.
        let sqlite = FeedHead {
            txid_below: 1,
            last_position: 5,
        };
        assert!(sqlite.admits(FeedCursor {
            txid: 0,
            position: 5
        }));
        assert!(!sqlite.admits(FeedCursor {
            txid: 1,
            position: 5
        }));
    }
}
