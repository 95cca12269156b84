//! [`Clock`]: the time a store decides leases, backoffs, deadlines and
//! retention by (SPEC §2.3, §2.5, §2.9).
//!
//! A backend reads its base time where it belongs (SQLite: this process's
//! clock; PostgreSQL: `clock_timestamp()` of the database, so every instance
//! shares one clock) and adds the clock's offset, in ms. A production store's
//! offset is 0 and never moves. A test clock carries an offset shared by every
//! clone, which [`Clock::advance`] moves forward: a test lets a lease, backoff,
//! deadline or retention pass by moving the clock, not by sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::model::Timestamp;

/// The offset a store adds to its base time. Cheap to clone; clones of a test
/// clock share one offset.
#[derive(Debug, Clone, Default)]
pub struct Clock {
    /// Offset in ms; `None`: real time (offset 0, fixed).
    offset: Option<Arc<AtomicI64>>,
}

impl Clock {
    /// Real time: the backend's base time, unshifted.
    pub fn real() -> Clock {
        Clock { offset: None }
    }

    /// A test clock at real time (offset 0), moved by [`Clock::advance`].
    pub fn test() -> Clock {
        Clock::shifted(0)
    }

    /// A test clock starting `offset_ms` off real time (negative: behind it),
    /// moved by [`Clock::advance`].
    pub fn shifted(offset_ms: i64) -> Clock {
        Clock {
            offset: Some(Arc::new(AtomicI64::new(offset_ms))),
        }
    }

    /// Whether this is a test clock (one [`Clock::advance`] can move).
    pub fn is_test(&self) -> bool {
        self.offset.is_some()
    }

    /// The offset added to the base time, ms (0 for [`Clock::real`]).
    pub fn offset_ms(&self) -> i64 {
        self.offset.as_ref().map_or(0, |o| o.load(Ordering::SeqCst))
    }

    /// This process's clock plus the offset, epoch ms (the base time of a
    /// store whose process owns the database). A system clock before 1970
    /// reads as 0.
    pub fn process_now(&self) -> Timestamp {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Timestamp(ms.saturating_add(self.offset_ms()))
    }

    /// Moves the clock forward by `by` (whole ms), for every clone; it never
    /// moves backward.
    ///
    /// # Panics
    /// On a [`Clock::real`] clock: only tests move time, and a test that
    /// moves a real clock would wait for nothing.
    pub fn advance(&self, by: Duration) {
        let Some(offset) = &self.offset else {
            panic!("Clock::advance on a real clock: open the store with Clock::test()");
        };
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        let _ = offset.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |o| {
            Some(o.saturating_add(ms))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_moves_every_clone_forward() {
        let clock = Clock::test();
        let other = clock.clone();
        assert_eq!(clock.offset_ms(), 0);
        other.advance(Duration::from_millis(1_500));
        assert_eq!(clock.offset_ms(), 1_500);
        let before = clock.process_now();
        clock.advance(Duration::from_secs(3600));
        assert!(other.process_now().0 >= before.0 + 3_600_000);
    }

    #[test]
    fn a_real_clock_has_no_offset() {
        let clock = Clock::real();
        assert!(!clock.is_test());
        assert_eq!(clock.offset_ms(), 0);
        assert!(Clock::shifted(-5).is_test());
        assert_eq!(Clock::shifted(-5).offset_ms(), -5);
    }

    #[test]
    #[should_panic(expected = "real clock")]
    fn a_real_clock_cannot_be_moved() {
        Clock::real().advance(Duration::from_millis(1));
    }
}
