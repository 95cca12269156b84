//! Claims: lease attempts of claimable tasks (SPEC §4 `POST /v1/attempts/claim`).

use std::collections::{BTreeMap, HashSet};

use idem_core::flow::RateLimit;
use idem_core::machine::{self, Authority, Journal};
use idem_core::model::{Attempt, Task};

use super::{Operation, persist};
use crate::{Result, Tx};

/// A claim request.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// Tenant of the executor key.
    pub tenant: String,
    /// Operation classes to claim from (already limited to the key's grant).
    pub operations: Vec<String>,
    /// Executor id, recorded on the attempt.
    pub executor_id: String,
    /// Attempts at most.
    pub max: i64,
    /// Lease length; `None` = the class default.
    pub lease_ms: Option<i64>,
    /// The flow control that applies (SPEC §8; default: none).
    pub flow: ClaimFlow,
}

/// The flow control a claim applies, from the configuration (the store
/// holds none).
#[derive(Debug, Clone, Default)]
pub struct ClaimFlow {
    /// Attempt starts per class (`flow.attempt_starts_per_s`, SPEC §8.1):
    /// each lease takes a token of the class's `starts:<class>` bucket;
    /// without one the claim leases no more of that class.
    pub starts_per_s: BTreeMap<String, RateLimit>,
}

/// A leased attempt with its task.
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    /// The new attempt.
    pub attempt: Attempt,
    /// Its task after the claim.
    pub task: Task,
}

/// Lease up to `max` attempts, oldest `ready_at` first.
#[derive(Debug, Clone)]
pub struct Claim(pub ClaimRequest);

/// Most candidates one round of a claim reads once earlier rounds found
/// candidates that ended instead (8 rounds: up to about 250 ended per claim).
const CLAIM_SCAN_MAX: i64 = 64;

impl Operation for Claim {
    type Reply = Vec<Claimed>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Vec<Claimed>> {
        let req = &self.0;
        if !tx.identity_is_current().await? {
            // The database changed under the recorded identity (SPEC §2.11):
            // nothing is leased until the identity check has rewound.
            return Ok(Vec::new());
        }
        let now = tx.now().await?;
        let max = req.max.max(1);
        let mut out = Vec::new();
        // Candidates that end instead of being leased (deadline passed, key
        // revoked, attempts used up) leave the claimable set, so scan again
        // until `max` are leased or nothing is left; bounded so one claim
        // stays short. Each round that ended candidates reads twice as many
        // (up to CLAIM_SCAN_MAX), so a backlog of dead tasks is cleared in one
        // claim instead of starving the due tasks behind it, while a claim
        // that finds work at once still reads (and, on PostgreSQL, locks)
        // only 2 × max candidates.
        let mut limit = max.saturating_mul(2);
        // Classes whose attempt-start bucket ran dry in this claim.
        let mut throttled: HashSet<String> = HashSet::new();
        for _ in 0..8 {
            let ids = tx
                .claimable(&req.tenant, &req.operations, now, limit)
                .await?;
            if ids.is_empty() {
                break;
            }
            let mut ended = 0;
            for id in ids {
                if out.len() as i64 >= max {
                    return Ok(out);
                }
                let Some(mut task) = super::load_task(tx, id, true).await? else {
                    continue;
                };
                let loaded = (task.control.version, task.generation);
                let authority = match tx.api_key(task.control.api_key_id).await? {
                    Some(k) if k.grants(&task.operation) => Authority::Granted,
                    _ => Authority::Revoked,
                };
                if let Some(&rate) = req.flow.starts_per_s.get(&task.operation)
                    && (throttled.contains(&task.operation)
                        || !super::rates::take_start_token(tx, &task.operation, rate, now).await?)
                {
                    throttled.insert(task.operation.clone());
                    continue;
                }
                let mut j = Journal::default();
                let attempt_id = tx.new_id();
                match machine::claim(
                    &mut task,
                    &mut j,
                    attempt_id,
                    &req.executor_id,
                    req.lease_ms,
                    authority,
                    now,
                ) {
                    Ok(Some(attempt)) => {
                        tx.insert_attempt(&attempt).await?;
                        persist(tx, &task, loaded, &j).await?;
                        out.push(Claimed { attempt, task });
                    }
                    Ok(None) => {
                        persist(tx, &task, loaded, &j).await?;
                        ended += 1;
                    }
                    Err(_) => {}
                }
            }
            if out.len() as i64 >= max || ended == 0 {
                break;
            }
            limit = limit.saturating_mul(2).min(CLAIM_SCAN_MAX.max(max));
        }
        Ok(out)
    }
}
