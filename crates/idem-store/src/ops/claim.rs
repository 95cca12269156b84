//! Claims: lease attempts of claimable tasks (SPEC §4 `POST /v1/attempts/claim`,
//! fair claims and priorities SPEC §2.13).

use std::collections::HashSet;

use idem_core::machine::{self, Authority, Journal};
use idem_core::model::{Attempt, Serves, Task, Timestamp};
use uuid::Uuid;

use super::{Operation, persist};
use crate::flow::{ClaimFlow, ClaimQueue, TURN};
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
    /// The pool's tenants, the classes with a fairness key and the tenants'
    /// weights (SPEC §2.13); the default: the key's own tenant, no fairness
    /// key, weight 1.
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

/// Lease up to `max` attempts, lowest claim rank first (`ready_at -
/// priority × AGING_MS`); by turns among the claim queues for a pool key or
/// a class with a fairness key (SPEC §2.13).
#[derive(Debug, Clone)]
pub struct Claim(pub ClaimRequest);

/// Most candidates one round of a claim reads once earlier rounds found
/// candidates that ended instead (8 rounds: up to about 250 ended per claim).
const CLAIM_SCAN_MAX: i64 = 64;

/// Queues one pick of a claim by turns reads at each level.
const QUEUES_PER_PICK: i64 = 8;

/// What became of one candidate.
enum Lease {
    /// Leased.
    Leased(Box<Claimed>),
    /// Ended instead (deadline passed, key revoked, attempts used up).
    Ended,
    /// Not claimable after all (left as it was).
    Skipped,
}

/// Leases an attempt of task `id` (locked by the candidate query), or ends it.
async fn lease<T: Tx>(tx: &mut T, req: &ClaimRequest, id: Uuid, now: Timestamp) -> Result<Lease> {
    let Some(mut task) = super::load_task(tx, id, true).await? else {
        return Ok(Lease::Skipped);
    };
    let loaded = (task.control.version, task.generation);
    let authority = match tx.api_key(task.control.api_key_id).await? {
        Some(k) if k.grants(&task.operation) => Authority::Granted,
        _ => Authority::Revoked,
    };
    let mut j = Journal::default();
    let attempt_id = tx.new_id();
    Ok(
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
                Lease::Leased(Box::new(Claimed { attempt, task }))
            }
            Ok(None) => {
                persist(tx, &task, loaded, &j).await?;
                Lease::Ended
            }
            Err(_) => Lease::Skipped,
        },
    )
}

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
        if req.flow.by_turns(&req.operations) {
            return claim_by_turns(tx, req, now, max).await;
        }
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
                match lease(tx, req, id, now).await? {
                    Lease::Leased(c) => out.push(*c),
                    Lease::Ended => ended += 1,
                    Lease::Skipped => {}
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

/// A candidate of a claim by turns: the task and the queues it came from
/// (its tenant's, then its value's), whose turns advance when it is leased
/// (`advance`: the claim holds their rows).
struct Pick {
    id: Uuid,
    queues: Vec<ClaimQueue>,
    advance: bool,
}

/// A claim by turns (SPEC §2.13): each attempt comes from the waiting queue
/// with the lowest turn among those the claim serves (the key's tenants and
/// classes), whose turn then advances by [`TURN`] / weight (a value queue:
/// [`TURN`]). A queue found without a ready task goes to the back of its
/// level, or is parked when no task of it waits at all. Per attempt: at most
/// [`QUEUES_PER_PICK`] queues read per level, whatever the number of tenants.
async fn claim_by_turns<T: Tx>(
    tx: &mut T,
    req: &ClaimRequest,
    now: Timestamp,
    max: i64,
) -> Result<Vec<Claimed>> {
    let tenants: Option<Vec<String>> = match &req.flow.serves {
        None => Some(vec![req.tenant.clone()]),
        Some(Serves::All(_)) => None,
        Some(Serves::Tenants(list)) => Some(list.clone()),
    };
    let mut out = Vec::new();
    let mut skipped: HashSet<Uuid> = HashSet::new();
    // Bounded as the plain claim is: candidates that end instead of being
    // leased cost a pick each.
    let picks = max.saturating_mul(2).max(CLAIM_SCAN_MAX);
    for _ in 0..picks {
        if out.len() as i64 >= max {
            break;
        }
        let Some(pick) = pick(tx, req, tenants.as_deref(), now, &skipped).await? else {
            break;
        };
        match lease(tx, req, pick.id, now).await? {
            Lease::Leased(c) => {
                if pick.advance {
                    for q in &pick.queues {
                        let step = if q.key.is_empty() {
                            req.flow.step(&q.tenant)
                        } else {
                            TURN
                        };
                        tx.set_turn(q, Some(q.turn.saturating_add(step))).await?;
                    }
                }
                out.push(*c);
            }
            Lease::Ended => {}
            Lease::Skipped => {
                skipped.insert(pick.id);
            }
        }
    }
    Ok(out)
}

/// The next candidate of a claim by turns: first among the queues no other
/// claim holds (locked, turns kept), then, when none of those has a ready
/// task, among the queues others hold (read, turns left to their holders:
/// one tenant with work keeps the throughput of parallel claims).
async fn pick<T: Tx>(
    tx: &mut T,
    req: &ClaimRequest,
    tenants: Option<&[String]>,
    now: Timestamp,
    skipped: &HashSet<Uuid>,
) -> Result<Option<Pick>> {
    let want = 1 + skipped.len() as i64;
    for locked in [true, false] {
        let queues = tx
            .claim_queues(tenants, &req.operations, QUEUES_PER_PICK, locked)
            .await?;
        for q in queues {
            if req.flow.is_fair(&q.operation) {
                let values = tx
                    .value_queues(&q.tenant, &q.operation, QUEUES_PER_PICK, locked)
                    .await?;
                for v in values {
                    let ids = tx.claimable_with_value(&v, now, want).await?;
                    if let Some(id) = ids.into_iter().find(|id| !skipped.contains(id)) {
                        return Ok(Some(Pick {
                            id,
                            queues: vec![q, v],
                            advance: locked,
                        }));
                    }
                    if locked {
                        settle(tx, &v).await?;
                    }
                }
            } else {
                let ids = tx
                    .claimable(&q.tenant, std::slice::from_ref(&q.operation), now, want)
                    .await?;
                if let Some(id) = ids.into_iter().find(|id| !skipped.contains(id)) {
                    return Ok(Some(Pick {
                        id,
                        queues: vec![q],
                        advance: locked,
                    }));
                }
            }
            if locked {
                settle(tx, &q).await?;
            }
        }
    }
    Ok(None)
}

/// A queue found without a ready task: to the back of its level while a
/// task of it waits (in backoff), else parked.
async fn settle<T: Tx>(tx: &mut T, q: &ClaimQueue) -> Result<()> {
    if tx.queue_waits(q).await? {
        let last = tx.last_turn(q).await?;
        tx.set_turn(q, Some(last.saturating_add(1))).await
    } else {
        tx.set_turn(q, None).await
    }
}
