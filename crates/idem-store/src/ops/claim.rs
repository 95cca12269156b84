//! Claims: lease attempts of claimable tasks (SPEC §4 `POST /v1/attempts/claim`).

use std::collections::HashSet;

use idem_core::machine::{self, Authority, Journal};
use idem_core::model::{Attempt, Task};

use super::{Operation, persist};
pub use crate::caps::ClaimFlow;
use crate::caps::{CLAIMS_CAPPED, CapKind};
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

/// TEST ONLY: leases without taking cap slots. The `broken-caps` feature
/// sets it, which exists so the model checker can show it finds a cap
/// exceeded (docs/verification.md, "Seeded defects").
const BROKEN_CAPS: bool = cfg!(feature = "broken-caps");

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
        // Classes whose class or (tenant, class) cap is full leave the scan
        // (SPEC §5 "Concurrency caps"), so their waiting tasks do not hide
        // the other classes' tasks behind them.
        let mut operations = req.operations.clone();
        // Cap scopes found full in this claim, and the candidates they held
        // back: a later round reads those again and skips them unread.
        let mut full_scopes = std::collections::HashSet::new();
        let mut held_back = std::collections::HashSet::new();
        for _ in 0..8 {
            if operations.is_empty() {
                break;
            }
            let ids = tx.claimable(&req.tenant, &operations, now, limit).await?;
            if ids.is_empty() {
                break;
            }
            let mut ended = 0;
            for id in ids {
                if out.len() as i64 >= max {
                    return Ok(out);
                }
                if held_back.contains(&id) {
                    ended += 1;
                    continue;
                }
                let Some(mut task) = super::load_task(tx, id, true).await? else {
                    continue;
                };
                if !operations.contains(&task.operation) {
                    continue;
                }
                let loaded = (task.control.version, task.generation);
                let authority = match tx.api_key(task.control.api_key_id).await? {
                    Some(k) if k.grants(&task.operation) => Authority::Granted,
                    _ => Authority::Revoked,
                };
                if throttled.contains(&task.operation) {
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
                        let slots = req.flow.slots(&task);
                        let full = match slots.iter().position(|s| full_scopes.contains(&s.scope)) {
                            Some(i) => Some(i),
                            None if slots.is_empty() || BROKEN_CAPS => None,
                            None => tx.take_slots(task.id, attempt.id, &slots).await?,
                        };
                        if let Some(full) = full {
                            // Capped: nothing is written, the task waits
                            // without using an attempt.
                            let kind = slots.get(full).map_or(CapKind::Tenant, |s| s.kind);
                            if let Some(s) = slots.get(full) {
                                full_scopes.insert(s.scope.clone());
                            }
                            held_back.insert(task.id);
                            metrics::counter!(CLAIMS_CAPPED, "operation" => task.operation.clone(), "cap" => kind.as_str())
                                .increment(1);
                            match kind {
                                CapKind::Tenant => return Ok(out),
                                CapKind::Class | CapKind::TenantClass => {
                                    operations.retain(|o| o != &task.operation);
                                }
                                CapKind::ConcurrencyKey => {}
                            }
                            ended += 1;
                            continue;
                        }
                        // The caps hold: then the class's attempt-start
                        // token (SPEC §8.1), whose refusal gives the slots
                        // back and stops leasing the class in this claim.
                        if let Some(&rate) = req.flow.starts_per_s.get(&task.operation)
                            && !super::rates::take_start_token(tx, &task.operation, rate, now)
                                .await?
                        {
                            if !slots.is_empty() {
                                tx.free_slots(task.id, None).await?;
                            }
                            throttled.insert(task.operation.clone());
                            continue;
                        }
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
