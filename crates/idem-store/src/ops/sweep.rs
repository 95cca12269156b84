//! The sweep: expire leases, wake backoffs, release keys past retention
//! (SPEC §2.5, §2.9), and put waiting tasks' claim queues back into the turn
//! order (SPEC §2.13).

use idem_core::machine::{self, Journal};

use super::{Operation, persist};
use crate::flow::{QueuePair, QueueTamper};
use crate::spans::{EndedAttempt, Ending};
use crate::{Result, Tx};

/// What one sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Leases expired.
    pub expired: usize,
    /// `retry_wait` tasks woken.
    pub woken: usize,
    /// Idempotency keys removed after retention.
    pub keys_released: usize,
    /// Claim queues unparked (SPEC §2.13).
    pub unparked: usize,
    /// Tenant claim queues inserted for waiting tasks that had none (SPEC
    /// §2.13: tasks a binary of a schema before the claim queues wrote).
    pub opened: usize,
    /// Where the walk for missing queues stopped (it reads at most `limit`
    /// pairs): the next sweep's [`Sweep::queues_after`]; `None` once it
    /// reached the last pair.
    pub queues_walked_to: Option<QueuePair>,
}

/// Expire leases, wake backoffs, remove keys past retention, unpark claim
/// queues and insert missing ones (at most `limit` each).
#[derive(Debug, Clone)]
pub struct Sweep {
    /// Batch size per kind; the (tenant, class) pairs the walk for missing
    /// queues reads.
    pub limit: i64,
    /// The pair the walk for missing queues starts after (the previous
    /// sweep's [`SweepStats::queues_walked_to`]); `None`: the first.
    pub queues_after: Option<QueuePair>,
}

impl Operation for Sweep {
    type Reply = Ending<SweepStats>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let limit = self.limit;
        let now = tx.now().await?;
        let mut stats = SweepStats::default();
        let mut ended = Vec::new();
        for (task_id, attempt_id) in tx.expired_leases(now, limit).await? {
            let (Some(mut task), Some(mut attempt)) = (
                super::load_task(tx, task_id, true).await?,
                tx.attempt(attempt_id).await?,
            ) else {
                continue;
            };
            if !attempt.state.is_active() || attempt.lease_expires_at > now {
                continue;
            }
            let loaded = (task.control.version, task.generation);
            let mut j = Journal::default();
            machine::expire_lease(&mut task, &mut attempt, &mut j, now);
            tx.update_attempt(&attempt).await?;
            persist(tx, &task, loaded, &j).await?;
            stats.expired += 1;
            ended.extend(EndedAttempt::of(&task, &attempt, true, now));
        }
        for task_id in tx.due_wakeups(now, limit).await? {
            let Some(mut task) = super::load_task(tx, task_id, true).await? else {
                continue;
            };
            let loaded = (task.control.version, task.generation);
            let mut j = Journal::default();
            if machine::wake(&mut task, &mut j, now) {
                persist(tx, &task, loaded, &j).await?;
                stats.woken += 1;
            }
        }
        for task_id in tx.expired_scopes(now, limit).await? {
            let Some(mut task) = super::load_task(tx, task_id, true).await? else {
                continue;
            };
            if !task.state.is_terminal() || task.control.key_expires_at.is_none_or(|t| t > now) {
                continue;
            }
            let loaded = (task.control.version, task.generation);
            let mut j = Journal::default();
            tx.delete_scope(task_id).await?;
            machine::release_key(&mut task, &mut j, now);
            persist(tx, &task, loaded, &j).await?;
            stats.keys_released += 1;
        }
        // Queues a claim parked while a task of theirs was being written
        // (SPEC §2.13) go back into the turn order.
        stats.unparked = tx.unpark_waiting(limit).await?;
        // Waiting tasks without a tenant queue (accepted or written by a
        // binary of a schema before the claim queues, which writes none)
        // get one: pool keys and fairness-key classes claim only through
        // the queues (SPEC §2.13).
        (stats.opened, stats.queues_walked_to) = tx
            .open_missing_queues(self.queues_after.as_ref(), limit)
            .await?;
        Ok(Ending {
            reply: stats,
            ended,
        })
    }
}

/// Parks or deletes every claim queue of a tenant's class
/// ([`Tx::tamper_queues`]): for the conformance suite's cases of the sweep
/// that unparks and restores them. Answers how many queues it changed.
#[derive(Debug, Clone)]
pub struct TamperQueues {
    /// Tenant.
    pub tenant: String,
    /// Operation class.
    pub operation: String,
    /// Parked or deleted.
    pub how: QueueTamper,
}

impl Operation for TamperQueues {
    type Reply = usize;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<usize> {
        tx.tamper_queues(&self.tenant, &self.operation, self.how)
            .await
    }
}
