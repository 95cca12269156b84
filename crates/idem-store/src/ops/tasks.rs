//! Task reads, cancellation and delivery acknowledgment (SPEC §2.7–2.8, §4).

use idem_core::machine::{self, Journal, Rejection};
use idem_core::model::{Attempt, Cancellation, Event, Task, Timestamp};
use uuid::Uuid;

use super::{Access, Grant, Operation, owned_task, persist};
use crate::{Refusal, Result, Tx};

/// Read the store's clock: the time, epoch ms, by which it decides leases,
/// backoffs, deadlines and retention (the database clock on PostgreSQL,
/// plus a test clock's offset), for a reader that shows time left.
#[derive(Debug, Clone)]
pub struct ReadClock;

impl Operation for ReadClock {
    type Reply = Timestamp;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        tx.now().await
    }
}

/// Read the shared secret `name`, storing `candidate` as it when there is
/// none yet ([`crate::Tx::shared_secret`]).
#[derive(Debug, Clone)]
pub struct SharedSecret {
    /// The secret's name, e.g. [`super::search::CURSOR_SECRET`].
    pub name: String,
    /// 32 fresh random bytes, kept only when no secret of that name exists.
    pub candidate: [u8; 32],
}

impl Operation for SharedSecret {
    type Reply = Vec<u8>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let now = tx.now().await?;
        tx.shared_secret(&self.name, &self.candidate, now).await
    }
}

/// Read a task.
#[derive(Debug, Clone)]
pub struct GetTask {
    /// Tenant filter (`None` = any tenant, for the operator CLI).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task id.
    pub id: Uuid,
}

impl Operation for GetTask {
    type Reply = Result<Task, Refusal>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        owned_task(tx, self.id, &access, false).await
    }
}

/// Look a task up by scope.
#[derive(Debug, Clone)]
pub struct FindTask {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant.
    pub grant: Grant,
    /// Operation class.
    pub operation: String,
    /// Idempotency key.
    pub idempotency_key: String,
}

impl Operation for FindTask {
    type Reply = Result<Task, Refusal>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(Some(&self.tenant), &self.grant);
        match tx
            .scope(&self.tenant, &self.operation, &self.idempotency_key)
            .await?
        {
            Some(row) => owned_task(tx, row.task_id, &access, false).await,
            None => Ok(Err(Refusal::NotFound)),
        }
    }
}

/// Attempts of a task, with their evidence.
#[derive(Debug, Clone)]
pub struct ListAttempts {
    /// Tenant filter (`None` = any tenant).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task id.
    pub task_id: Uuid,
}

impl Operation for ListAttempts {
    type Reply = Result<Vec<Attempt>, Refusal>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        Ok(match owned_task(tx, self.task_id, &access, false).await? {
            Ok(_) => Ok(tx.attempts(self.task_id).await?),
            Err(e) => Err(e),
        })
    }
}

/// Event history of a task.
#[derive(Debug, Clone)]
pub struct ListEvents {
    /// Tenant filter (`None` = any tenant).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task id.
    pub task_id: Uuid,
}

impl Operation for ListEvents {
    type Reply = Result<Vec<Event>, Refusal>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        Ok(match owned_task(tx, self.task_id, &access, false).await? {
            Ok(_) => Ok(tx.events(self.task_id).await?),
            Err(e) => Err(e),
        })
    }
}

/// Request cancellation.
#[derive(Debug, Clone)]
pub struct Cancel {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant.
    pub grant: Grant,
    /// Task.
    pub task_id: Uuid,
}

impl Operation for Cancel {
    type Reply = Result<(Task, Cancellation), Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(Some(&self.tenant), &self.grant);
        on_task(tx, &access, self.task_id, |task, j, now| {
            Ok(machine::cancel(task, j, now))
        })
        .await
    }
}

/// Acknowledge delivery of a task's result.
#[derive(Debug, Clone)]
pub struct AcknowledgeDelivery {
    /// Tenant.
    pub tenant: String,
    /// The caller's grant.
    pub grant: Grant,
    /// Task.
    pub task_id: Uuid,
}

impl Operation for AcknowledgeDelivery {
    type Reply = Result<Task, Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(Some(&self.tenant), &self.grant);
        Ok(on_task(tx, &access, self.task_id, |task, j, now| {
            machine::acknowledge_delivery(task, j, now)
        })
        .await?
        .map(|(task, ())| task))
    }
}

/// Loads the task with its row lock, checks access, applies `f`, and persists
/// when `f` journaled anything.
async fn on_task<T: Tx, R>(
    tx: &mut T,
    access: &Access<'_>,
    task_id: Uuid,
    f: impl FnOnce(&mut Task, &mut Journal, Timestamp) -> Result<R, Rejection>,
) -> Result<Result<(Task, R), Refusal>> {
    let mut task = match owned_task(tx, task_id, access, true).await? {
        Ok(t) => t,
        Err(e) => return Ok(Err(e)),
    };
    let now = tx.now().await?;
    let loaded = (task.control.version, task.generation);
    let mut j = Journal::default();
    let res = f(&mut task, &mut j, now);
    if !j.events.is_empty() {
        persist(tx, &task, loaded, &j).await?;
    }
    Ok(res.map(|r| (task, r)).map_err(Refusal::from))
}
