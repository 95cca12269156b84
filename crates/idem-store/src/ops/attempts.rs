//! Reports on a leased attempt: heartbeats, device acknowledgments,
//! outcome reports and releases (SPEC §2.4–2.6, §4 `/release`).

use idem_core::machine::{self, HeartbeatAck, Journal, Rejection};
use idem_core::model::{Attempt, Task, Timestamp};
use serde_json::Value;
use uuid::Uuid;

use super::{Access, Grant, Operation, owned_task, persist};
use crate::spans::{EndedAttempt, Ending};
use crate::{Refusal, Result, Tx};

/// Extend a lease.
#[derive(Debug, Clone)]
pub struct Heartbeat {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant.
    pub grant: Grant,
    /// Attempt.
    pub attempt_id: Uuid,
    /// Generation held.
    pub generation: i64,
    /// Attempt usage so far.
    pub usage: Option<i64>,
}

impl Operation for Heartbeat {
    type Reply = Result<HeartbeatAck, Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(Some(&self.tenant), &self.grant);
        Ok(
            on_attempt(tx, &access, self.attempt_id, |task, attempt, j, now| {
                machine::heartbeat(task, attempt, j, self.generation, self.usage, now)
            })
            .await?
            .map(|(_, ack)| ack),
        )
    }
}

/// Device "command acknowledged".
#[derive(Debug, Clone)]
pub struct Acknowledge {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant.
    pub grant: Grant,
    /// Attempt.
    pub attempt_id: Uuid,
    /// Generation held.
    pub generation: i64,
    /// Raw body (evidence).
    pub body: Value,
}

impl Operation for Acknowledge {
    type Reply = Result<Task, Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(Some(&self.tenant), &self.grant);
        Ok(
            on_attempt(tx, &access, self.attempt_id, |task, attempt, j, now| {
                machine::acknowledge(task, attempt, j, self.generation, self.body.clone(), now)
            })
            .await?
            .map(|(task, ())| task),
        )
    }
}

/// Report an outcome.
#[derive(Debug, Clone)]
pub struct Report {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant.
    pub grant: Grant,
    /// Attempt.
    pub attempt_id: Uuid,
    /// The report.
    pub report: machine::Report,
}

impl Operation for Report {
    type Reply = Ending<Result<Task, Refusal>>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(Some(&self.tenant), &self.grant);
        ending_attempt(tx, &access, self.attempt_id, |task, attempt, j, now| {
            machine::report(task, attempt, j, &self.report, now)
        })
        .await
    }
}

/// An executor gives back an attempt it never started.
#[derive(Debug, Clone)]
pub struct Release {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant.
    pub grant: Grant,
    /// Attempt.
    pub attempt_id: Uuid,
    /// Generation held.
    pub generation: i64,
}

impl Operation for Release {
    type Reply = Ending<Result<Task, Refusal>>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(Some(&self.tenant), &self.grant);
        ending_attempt(tx, &access, self.attempt_id, |task, attempt, j, now| {
            machine::release(task, attempt, j, self.generation, now)
        })
        .await
    }
}

/// [`on_attempt`] for a transition that may end the attempt (a report, a
/// release): the task, with the attempt's span record when it ended.
async fn ending_attempt<T: Tx>(
    tx: &mut T,
    access: &Access<'_>,
    attempt_id: Uuid,
    f: impl FnOnce(&mut Task, &mut Attempt, &mut Journal, Timestamp) -> Result<(), Rejection>,
) -> Result<Ending<Result<Task, Refusal>>> {
    let mut ended = Vec::new();
    let reply = on_attempt(tx, access, attempt_id, |task, attempt, j, now| {
        let was_active = attempt.state.is_active();
        let res = f(task, attempt, j, now);
        ended.extend(EndedAttempt::of(task, attempt, was_active, now));
        res
    })
    .await?
    .map(|(task, ())| task);
    Ok(Ending { reply, ended })
}

/// Loads attempt and task (task locked first, then the attempt reloaded), checks
/// the tenant, applies `f`, and persists everything unless `f` refused the input
/// as invalid (which changes nothing).
async fn on_attempt<T: Tx, R>(
    tx: &mut T,
    access: &Access<'_>,
    attempt_id: Uuid,
    f: impl FnOnce(&mut Task, &mut Attempt, &mut Journal, Timestamp) -> Result<R, Rejection>,
) -> Result<Result<(Task, R), Refusal>> {
    let Some(a) = tx.attempt(attempt_id).await? else {
        return Ok(Err(Refusal::NotFound));
    };
    let mut task = match owned_task(tx, a.task_id, access, true).await? {
        Ok(t) => t,
        Err(e) => return Ok(Err(e)),
    };
    let Some(mut attempt) = tx.attempt(attempt_id).await? else {
        return Ok(Err(Refusal::NotFound));
    };
    let now = tx.now().await?;
    let loaded = (task.control.version, task.generation);
    let before = attempt.clone();
    let mut j = Journal::default();
    let res = f(&mut task, &mut attempt, &mut j, now);
    if let Err(Rejection::InvalidReport(_)) = res {
        return Ok(res.map(|r| (task, r)).map_err(Refusal::from));
    }
    if attempt != before {
        tx.update_attempt(&attempt).await?;
    }
    persist(tx, &task, loaded, &j).await?;
    Ok(res.map(|r| (task, r)).map_err(Refusal::from))
}

/// The tenant of attempt `attempt_id`'s task (`None`: no such attempt): what
/// a pool executor key's heartbeat, acknowledge, report and release check
/// against the tenants it serves before the tenant-scoped operation (SPEC
/// §2.13). An attempt's tenant never changes.
#[derive(Debug, Clone)]
pub struct AttemptTenant {
    /// Attempt.
    pub attempt_id: Uuid,
}

impl Operation for AttemptTenant {
    type Reply = Option<String>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Option<String>> {
        let Some(attempt) = tx.attempt(self.attempt_id).await? else {
            return Ok(None);
        };
        Ok(tx
            .task(attempt.task_id, false)
            .await?
            .map(|t| t.control.tenant))
    }
}
