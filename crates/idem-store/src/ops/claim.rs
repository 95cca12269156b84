//! Claims: lease attempts of claimable tasks (SPEC §4 `POST /v1/attempts/claim`,
//! fair claims and priorities SPEC §2.13).

use std::collections::HashSet;

use idem_core::machine::{self, Authority, Journal};
use idem_core::model::{Attempt, Serves, Task, Timestamp};
use uuid::Uuid;

use super::{Operation, persist};
use crate::caps::{CLAIMS_CAPPED, CapKind};
pub use crate::flow::ClaimFlow;
use crate::flow::{ClaimQueue, TURN};
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
    /// The flow control that applies (SPEC §8): the pool's tenants, the
    /// classes with a fairness key and the tenants' weights, the caps and
    /// the attempt-start limits; the default: the key's own tenant, no
    /// fairness key, weight 1, no cap, no limit.
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

/// TEST ONLY: leases without taking cap slots. The `broken-caps` feature
/// sets it, which exists so the model checker can show it finds a cap
/// exceeded (docs/verification.md, "Seeded defects").
const BROKEN_CAPS: bool = cfg!(feature = "broken-caps");

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
    /// Held back by a full cap (SPEC §8 "Concurrency caps") or a dry
    /// attempt-start bucket (SPEC §8.1): left as it was, no attempt used.
    Held,
}

/// What one claim learnt of its caps and buckets: scopes found full,
/// classes found throttled or capped, and the candidates they held back (a
/// later round reads those again and skips them unread).
#[derive(Default)]
struct Held {
    full_scopes: HashSet<String>,
    throttled: HashSet<String>,
    /// Classes whose class cap is full: none of their tasks is leased.
    capped_classes: HashSet<String>,
    /// (tenant, class) pairs and tenants whose cap is full.
    capped_tenant_classes: HashSet<(String, String)>,
    capped_tenants: HashSet<String>,
    tasks: HashSet<Uuid>,
}

impl Held {
    /// Whether `task` is held back by what this claim already found.
    fn holds(&self, task: &Task) -> bool {
        self.tasks.contains(&task.id)
            || self.throttled.contains(&task.operation)
            || self.capped_classes.contains(&task.operation)
            || self.capped_tenants.contains(&task.control.tenant)
            || self
                .capped_tenant_classes
                .contains(&(task.control.tenant.clone(), task.operation.clone()))
    }

    /// Whether every task of the claim queue `q` (a tenant and class) is
    /// held back: its tenant's cap, its class's cap, its (tenant, class)
    /// cap is full or its class's bucket is dry.
    fn holds_queue(&self, q: &ClaimQueue) -> bool {
        self.throttled.contains(&q.operation)
            || self.capped_classes.contains(&q.operation)
            || self.capped_tenants.contains(&q.tenant)
            || self
                .capped_tenant_classes
                .contains(&(q.tenant.clone(), q.operation.clone()))
    }
}

/// Leases an attempt of task `id` (locked by the candidate query), or ends
/// it; a lease takes a slot of every cap that applies, then the class's
/// attempt-start token (SPEC §8), and nothing is written when one is
/// refused.
async fn lease<T: Tx>(
    tx: &mut T,
    req: &ClaimRequest,
    id: Uuid,
    now: Timestamp,
    held: &mut Held,
) -> Result<Lease> {
    let Some(mut task) = super::load_task(tx, id, true).await? else {
        return Ok(Lease::Skipped);
    };
    if held.holds(&task) {
        return Ok(Lease::Held);
    }
    let loaded = (task.control.version, task.generation);
    let authority = match tx.api_key(task.control.api_key_id).await? {
        Some(k) if k.grants(&task.operation) => Authority::Granted,
        _ => Authority::Revoked,
    };
    let mut j = Journal::default();
    let attempt_id = tx.new_id();
    let attempt = match machine::claim(
        &mut task,
        &mut j,
        attempt_id,
        &req.executor_id,
        req.lease_ms,
        authority,
        now,
    ) {
        Ok(Some(attempt)) => attempt,
        Ok(None) => {
            persist(tx, &task, loaded, &j).await?;
            return Ok(Lease::Ended);
        }
        Err(_) => return Ok(Lease::Skipped),
    };
    let slots = req.flow.slots(&task);
    let full = match slots
        .iter()
        .position(|s| held.full_scopes.contains(&s.scope))
    {
        Some(i) => Some(i),
        None if slots.is_empty() || BROKEN_CAPS => None,
        None => tx.take_slots(task.id, attempt.id, &slots).await?,
    };
    if let Some(full) = full {
        // Capped: nothing is written, the task waits without using an
        // attempt.
        let kind = slots.get(full).map_or(CapKind::Tenant, |s| s.kind);
        if let Some(s) = slots.get(full) {
            held.full_scopes.insert(s.scope.clone());
        }
        held.tasks.insert(task.id);
        metrics::counter!(CLAIMS_CAPPED, "operation" => task.operation.clone(), "cap" => kind.as_str())
            .increment(1);
        match kind {
            CapKind::Tenant => {
                held.capped_tenants.insert(task.control.tenant.clone());
            }
            CapKind::Class => {
                held.capped_classes.insert(task.operation.clone());
            }
            CapKind::TenantClass => {
                held.capped_tenant_classes
                    .insert((task.control.tenant.clone(), task.operation.clone()));
            }
            CapKind::ConcurrencyKey => {}
        }
        return Ok(Lease::Held);
    }
    // The caps hold: then the class's attempt-start token (SPEC §8.1), whose
    // refusal gives the slots back and stops leasing the class in this claim.
    if let Some(&rate) = req.flow.starts_per_s.get(&task.operation)
        && !super::rates::take_start_token(tx, &task.operation, rate, now).await?
    {
        if !slots.is_empty() {
            tx.free_slots(task.id, None).await?;
        }
        held.throttled.insert(task.operation.clone());
        held.tasks.insert(task.id);
        return Ok(Lease::Held);
    }
    tx.insert_attempt(&attempt).await?;
    persist(tx, &task, loaded, &j).await?;
    Ok(Lease::Leased(Box::new(Claimed { attempt, task })))
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
        // that finds work at once reads (and, on PostgreSQL, locks) only the
        // `max` candidates it leases: a claimable task locked by a claim that
        // does not lease it would be skipped by the claims running beside it
        // (`FOR UPDATE SKIP LOCKED`), and a waiting claim that found nothing
        // takes its group's work for accounted for (idem-http `claims`).
        let mut limit = max;
        // What the caps and buckets held back in this claim. Classes whose
        // class or (tenant, class) cap is full, or whose bucket ran dry,
        // leave the scan, so their waiting tasks do not hide the other
        // classes' tasks behind them; held-back candidates widen the scan as
        // ended ones do.
        let mut held = Held::default();
        for _ in 0..8 {
            let operations: Vec<String> = req
                .operations
                .iter()
                .filter(|o| {
                    !held.throttled.contains(*o)
                        && !held.capped_classes.contains(*o)
                        && !held
                            .capped_tenant_classes
                            .contains(&(req.tenant.clone(), (*o).clone()))
                })
                .cloned()
                .collect();
            if operations.is_empty() || held.capped_tenants.contains(&req.tenant) {
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
                if held.tasks.contains(&id) {
                    ended += 1;
                    continue;
                }
                match lease(tx, req, id, now, &mut held).await? {
                    Lease::Leased(c) => out.push(*c),
                    Lease::Ended | Lease::Held => ended += 1,
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
    let own = [req.tenant.clone()];
    let tenants: Option<&[String]> = match &req.flow.serves {
        None => Some(&own),
        Some(Serves::All(_)) => None,
        Some(Serves::Tenants(list)) => Some(list),
    };
    let mut out = Vec::new();
    let mut skipped: HashSet<Uuid> = HashSet::new();
    let mut held = Held::default();
    // Bounded as the plain claim is: candidates that end instead of being
    // leased cost a pick each.
    let picks = max.saturating_mul(2).max(CLAIM_SCAN_MAX);
    for _ in 0..picks {
        if out.len() as i64 >= max {
            break;
        }
        let Some(pick) = pick(tx, req, tenants, now, &skipped, &held).await? else {
            break;
        };
        match lease(tx, req, pick.id, now, &mut held).await? {
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
            // A task held back by a cap or a bucket is passed over like one
            // not claimable: its queue keeps its turn.
            Lease::Skipped | Lease::Held => {
                skipped.insert(pick.id);
            }
        }
    }
    Ok(out)
}

/// The next candidate of a claim by turns: first among the queues no other
/// claim holds (locked, turns kept), then, when none of those has a ready
/// task, among the queues others hold (read, turns left to their holders:
/// one tenant with work keeps the throughput of parallel claims). A queue
/// whose tasks this claim found all held back (a full cap of its tenant,
/// class or both, a dry bucket of its class) is passed over with its turn
/// kept, so its backlog does not hide the other queues' tasks.
async fn pick<T: Tx>(
    tx: &mut T,
    req: &ClaimRequest,
    tenants: Option<&[String]>,
    now: Timestamp,
    skipped: &HashSet<Uuid>,
    held: &Held,
) -> Result<Option<Pick>> {
    let want = 1 + skipped.len() as i64;
    // Classes held back as a whole are not read; the queues held back one by
    // one widen the read, so they hide no other queue.
    let operations: Vec<String> = req
        .operations
        .iter()
        .filter(|o| !held.throttled.contains(*o) && !held.capped_classes.contains(*o))
        .cloned()
        .collect();
    if operations.is_empty() {
        return Ok(None);
    }
    let per_pick = QUEUES_PER_PICK
        .saturating_add(held.capped_tenants.len() as i64)
        .saturating_add(held.capped_tenant_classes.len() as i64);
    for locked in [true, false] {
        let queues = tx
            .claim_queues(tenants, &operations, per_pick, locked)
            .await?;
        for q in queues {
            if held.holds_queue(&q) {
                continue;
            }
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
            }
            // The tenant queue's tasks in claim rank order: a class without
            // a fairness key, or, when none of its value queues read had a
            // ready task, the tasks no value queue holds (submitted before
            // the class declared its fairness key, or by a binary of an
            // earlier schema: no fairness value, no value queue).
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
