//! The executor's side of a lease (SPEC §4, "Leases and heartbeats"): idem's
//! lease is the truth, but an executor has to stop before idem can hand the
//! task to another executor, whatever the network does. So the worker keeps
//! a **local lease deadline** per attempt on its monotonic clock:
//!
//! > deadline = time the request that last confirmed the lease was *sent*
//! > + its `lease_ms` − margin, margin = max(500 ms, 10 % of `lease_ms`).
//!
//! Counting from the send time, not from the answer's arrival, keeps the
//! deadline before idem's lease end however long the answer took (idem
//! counts the lease from the request's arrival, which is later); the margin
//! covers clock rate differences and the handler's reaction time. The
//! handler's stop signal ([`super::Context::stopped`]) fires at the deadline
//! unless a heartbeat answer moved it, and at once when a heartbeat is
//! answered 401, 403, 404 or 409 (key revoked, attempt gone,
//! `STALE_GENERATION`). Each heartbeat request is given up after
//! min(lease/3, time left to the deadline): a failed or hanging heartbeat
//! costs at most its share of the lease, never a whole lease.
//!
//! A handler that ignores the signal runs on its own: another attempt of the
//! task may start once idem's lease ends, and this one's report is kept as
//! evidence only.

use std::time::Duration;

use tokio::time::Instant;

use crate::ClientError;

/// The smallest safety margin between the local lease deadline and the
/// lease end idem confirmed.
pub const MIN_LEASE_MARGIN: Duration = Duration::from_millis(500);

/// The safety margin of a lease of length `lease`: max(500 ms, 10 % of it).
pub fn lease_margin(lease: Duration) -> Duration {
    MIN_LEASE_MARGIN.max(lease / 10)
}

/// The local lease deadline of a lease of `lease_ms` (as idem answered it)
/// confirmed by a request sent at `sent`: `sent + lease − margin`, never
/// before `sent` (a lease no longer than its margin is lost at once).
pub fn local_deadline(sent: Instant, lease_ms: i64) -> Instant {
    let lease = lease_length(lease_ms);
    sent + lease.saturating_sub(lease_margin(lease))
}

/// `lease_ms` as a duration (a negative one as zero).
pub(crate) fn lease_length(lease_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(lease_ms).unwrap_or(0))
}

/// Whether a refused heartbeat (or release) means the attempt's lease is
/// gone now: 401 and 403 (the key was revoked or lost the class), 404 (the
/// attempt is gone), 409 (`STALE_GENERATION`: another generation holds the
/// task, or the lease expired).
pub(crate) fn lease_is_gone(e: &ClientError) -> bool {
    matches!(e.status(), Some(401 | 403 | 404 | 409))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_half_a_second_or_a_tenth_of_the_lease() {
        assert_eq!(lease_margin(Duration::from_millis(1_000)), MIN_LEASE_MARGIN);
        assert_eq!(lease_margin(Duration::from_millis(5_000)), MIN_LEASE_MARGIN);
        assert_eq!(
            lease_margin(Duration::from_millis(30_000)),
            Duration::from_secs(3)
        );
    }

    #[test]
    fn the_deadline_counts_from_the_send_time_less_the_margin() {
        let sent = Instant::now();
        assert_eq!(
            local_deadline(sent, 2_000),
            sent + Duration::from_millis(1_500)
        );
        assert_eq!(local_deadline(sent, 30_000), sent + Duration::from_secs(27));
        // No longer than its margin: lost at once.
        assert_eq!(local_deadline(sent, 400), sent);
        assert_eq!(local_deadline(sent, -1), sent);
    }
}
