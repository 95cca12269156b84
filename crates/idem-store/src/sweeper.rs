//! The sweeper: one [`Store::check_identity`] (SPEC §2.11) and one
//! [`Store::sweep`] (lease expiry, backoff wake-ups, retention, claim
//! queues; SPEC §2.3, §2.5, §2.9, §2.13) every interval, for as long as a server
//! runs. What it does is counted in Prometheus counters (through the
//! `metrics` facade: the server's recorder exports them) and its failures are
//! logged.

use std::time::Duration;

use crate::Store;

/// Leases the sweeper found expired (counter).
pub const LEASES_EXPIRED: &str = "idem_leases_expired_total";
/// `retry_wait` tasks whose backoff passed (counter).
pub const TASKS_WOKEN: &str = "idem_tasks_woken_total";
/// Idempotency keys removed after their retention (counter).
pub const KEYS_RELEASED: &str = "idem_keys_released_total";

/// Most tasks, attempts, keys and claim queues one sweep handles of each
/// kind, and the (tenant, class) pairs its walk for missing claim queues
/// reads (SPEC §2.13: a missing queue is restored within ⌈pairs / 500⌉
/// sweeps).
const SWEEP_BATCH: i64 = 500;

/// Runs one sweep (lease expiry, backoff wake-ups, retention) every `every` until
/// `shutdown` resolves. What a sweep makes claimable wakes waiting claims
/// through the events it writes ([`crate::changes`]).
/// Errors are retried on the next tick and logged (WARN `sweep failed`) when
/// they differ from the previous sweep's, so a store that stays down (or a
/// SQLite file removed under it, which fails every sweep) logs one line, not
/// one per tick; the first sweep that works again logs `sweeps work again`
/// (INFO).
pub async fn run_sweeper(
    store: Store,
    every: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut failing: Option<String> = None;
    // Where the last sweep's walk for missing claim queues stopped: each
    // sweep reads the next SWEEP_BATCH (tenant, class) pairs.
    let mut queues_after = None;
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = tick.tick() => {}
        }
        // The identity check first (SPEC §2.11): a failover changes the
        // timeline while the server runs, and claims lease nothing until
        // the check has rewound what the new primary lost.
        let swept = match store.check_identity().await {
            Ok(_) => store.sweep_from(SWEEP_BATCH, queues_after.clone()).await,
            Err(e) => Err(e),
        };
        match swept {
            Ok(s) => {
                if failing.take().is_some() {
                    tracing::info!("sweeps work again");
                }
                queues_after = s.queues_walked_to;
                // Only what happened: the series exist (at 0) from start-up
                // (the server registers them), not from the first sweep.
                for (name, n) in [
                    (LEASES_EXPIRED, s.expired),
                    (TASKS_WOKEN, s.woken),
                    (KEYS_RELEASED, s.keys_released),
                ] {
                    if n > 0 {
                        metrics::counter!(name).increment(n as u64);
                    }
                }
            }
            Err(e) => {
                let message = e.to_string();
                if failing.as_ref() != Some(&message) {
                    tracing::warn!(error = %message, "sweep failed");
                    failing = Some(message);
                }
            }
        }
    }
}
