//! Operator actions on a task (SPEC §4 "Operator actions"): retry-now,
//! cancel, resolve, redrive. Each is one transaction: the task is loaded with
//! its row lock, one transition of [`idem_core::machine::operator`] applies,
//! and the task is written back with a compare-and-set on the version and
//! generation it was loaded with, together with its events, so an action and
//! an executor's report on the same task are ordered by the database. A
//! refused action writes nothing.

use idem_core::machine::operator::{self, By, Refused, Resolution};
use idem_core::machine::{Authority, Journal};
use idem_core::model::{Cancellation, EffectResolution, SecondEffect, Task, Timestamp};
use uuid::Uuid;

use super::{Access, Grant, Operation, owned_task, persist};
use crate::spans::{EndedAttempt, Ending};
use crate::{Refusal, Result, Store, Tx};

/// Make a `retry_wait` task claimable at once.
#[derive(Debug, Clone)]
pub struct RetryNow {
    /// Tenant (`None`: any, for the operator command line).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task.
    pub task_id: Uuid,
    /// Who acts and why.
    pub by: By,
}

impl Operation for RetryNow {
    type Reply = Result<Task, Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        Ok(on_task(tx, &access, self.task_id, |task, j, now| {
            operator::retry_now(task, j, now, &self.by)
        })
        .await?
        .map(|(task, ())| task))
    }
}

/// Cancel as an operator: the client's cancellation with actor and reason.
#[derive(Debug, Clone)]
pub struct OperatorCancel {
    /// Tenant (`None`: any, for the operator command line).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task.
    pub task_id: Uuid,
    /// Who acts and why.
    pub by: By,
}

impl Operation for OperatorCancel {
    type Reply = Result<(Task, Cancellation), Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        on_task(tx, &access, self.task_id, |task, j, now| {
            Ok(operator::cancel(task, j, now, &self.by))
        })
        .await
    }
}

/// Settle a `reconciling` task's unknown outcome by hand.
#[derive(Debug, Clone)]
pub struct Resolve {
    /// Tenant (`None`: any, for the operator command line).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task.
    pub task_id: Uuid,
    /// Who acts and why.
    pub by: By,
    /// What the operator found.
    pub resolution: Resolution,
}

impl Operation for Resolve {
    type Reply = Ending<Result<Task, Refusal>>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        let mut task = match owned_task(tx, self.task_id, &access, true).await? {
            Ok(t) => t,
            Err(e) => return Ok(Ending::only(Err(e))),
        };
        // The attempt holding the lease, fenced off by the resolution.
        let mut active = match task.control.active_attempt_id {
            Some(id) => tx.attempt(id).await?,
            None => None,
        };
        let before = active.clone();
        let now = tx.now().await?;
        let loaded = (task.control.version, task.generation);
        let mut j = Journal::default();
        let res = operator::resolve(
            &mut task,
            active.as_mut(),
            &mut j,
            now,
            &self.by,
            self.resolution.clone(),
        );
        if let Err(e) = res {
            return Ok(Ending::only(Err(e.into())));
        }
        let mut ended = Vec::new();
        if let Some(a) = active.as_ref().filter(|a| Some(*a) != before.as_ref()) {
            tx.update_attempt(a).await?;
            let was_active = before.as_ref().is_some_and(|b| b.state.is_active());
            ended.extend(EndedAttempt::of(&task, a, was_active, now));
        }
        persist(tx, &task, loaded, &j).await?;
        Ok(Ending {
            reply: Ok(task),
            ended,
        })
    }
}

/// Send a `failed` task back to `queued` with one more execute attempt.
#[derive(Debug, Clone)]
pub struct Redrive {
    /// Tenant (`None`: any, for the operator command line).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task.
    pub task_id: Uuid,
    /// Who acts and why.
    pub by: By,
}

impl Operation for Redrive {
    type Reply = Result<Task, Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        let mut task = match owned_task(tx, self.task_id, &access, true).await? {
            Ok(t) => t,
            Err(e) => return Ok(Err(e)),
        };
        // The submitting key's authority, read where the task is written
        // (SPEC §2.8), as a claim reads it before an execute attempt.
        let authority = match tx.api_key(task.control.api_key_id).await? {
            Some(k) if k.grants(&task.operation) => Authority::Granted,
            _ => Authority::Revoked,
        };
        let now = tx.now().await?;
        let loaded = (task.control.version, task.generation);
        let mut j = Journal::default();
        if let Err(e) = operator::redrive(&mut task, &mut j, now, &self.by, authority) {
            return Ok(Err(e.into()));
        }
        persist(tx, &task, loaded, &j).await?;
        Ok(Ok(task))
    }
}

/// Acknowledge a suspected second effect: how it was settled, who and why.
#[derive(Debug, Clone)]
pub struct AcknowledgeSecondEffect {
    /// Tenant (`None`: any, for the operator command line).
    pub tenant: Option<String>,
    /// The caller's grant.
    pub grant: Grant,
    /// Task.
    pub task_id: Uuid,
    /// Who acts and why.
    pub by: By,
    /// The suspected effect's transaction id (`None`: the one without an id).
    pub external_txn_id: Option<String>,
    /// How it was settled.
    pub resolution: EffectResolution,
}

impl Operation for AcknowledgeSecondEffect {
    type Reply = Result<(Task, SecondEffect), Refusal>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let access = Access::new(self.tenant.as_deref(), &self.grant);
        on_task(tx, &access, self.task_id, |task, j, now| {
            operator::acknowledge_second_effect(
                task,
                j,
                now,
                &self.by,
                self.external_txn_id.as_deref(),
                self.resolution,
            )
        })
        .await
    }
}

/// Loads the task with its row lock, checks access, applies `f`, and
/// persists when `f` journaled anything.
async fn on_task<T: Tx, R>(
    tx: &mut T,
    access: &Access<'_>,
    task_id: Uuid,
    f: impl FnOnce(&mut Task, &mut Journal, Timestamp) -> Result<R, Refused>,
) -> Result<Result<(Task, R), Refusal>> {
    let mut task = match owned_task(tx, task_id, access, true).await? {
        Ok(t) => t,
        Err(e) => return Ok(Err(e)),
    };
    let now = tx.now().await?;
    let loaded = (task.control.version, task.generation);
    let mut j = Journal::default();
    let reply = match f(&mut task, &mut j, now) {
        Ok(r) => r,
        Err(e) => return Ok(Err(e.into())),
    };
    if !j.events.is_empty() {
        persist(tx, &task, loaded, &j).await?;
    }
    Ok(Ok((task, reply)))
}

/// The operator actions of [`Store`]: `tenant` is the caller's (`None`: any
/// tenant, for the command line acting on the store); a task of another
/// tenant, or of a class the store's grant does not cover, is
/// [`Refusal::NotFound`]; a refused action is [`Refusal::Operator`].
impl Store {
    /// Makes a `retry_wait` task claimable at once.
    ///
    /// # Errors
    /// Storage failures ([`crate::StoreError`]); refusals are in the value.
    pub async fn retry_now(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
        by: By,
    ) -> Result<Result<Task, Refusal>> {
        self.call(RetryNow {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
            by,
        })
        .await
    }

    /// Cancels as an operator (the client's cancellation, with actor and reason).
    ///
    /// # Errors
    /// Storage failures ([`crate::StoreError`]); refusals are in the value.
    pub async fn operator_cancel(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
        by: By,
    ) -> Result<Result<(Task, Cancellation), Refusal>> {
        self.call(OperatorCancel {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
            by,
        })
        .await
    }

    /// Settles a `reconciling` task's unknown outcome.
    ///
    /// # Errors
    /// Storage failures ([`crate::StoreError`]); refusals are in the value.
    pub async fn resolve(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
        by: By,
        resolution: Resolution,
    ) -> Result<Result<Task, Refusal>> {
        self.call_ending(Resolve {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
            by,
            resolution,
        })
        .await
    }

    /// Sends a `failed` task back to `queued` with one more execute attempt.
    ///
    /// # Errors
    /// Storage failures ([`crate::StoreError`]); refusals are in the value.
    pub async fn redrive(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
        by: By,
    ) -> Result<Result<Task, Refusal>> {
        self.call(Redrive {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
            by,
        })
        .await
    }

    /// Acknowledges a suspected second effect (idempotent: an acknowledged
    /// one answers its acknowledgment and nothing is written).
    ///
    /// # Errors
    /// Storage failures ([`crate::StoreError`]); refusals are in the value.
    pub async fn acknowledge_second_effect(
        &self,
        tenant: Option<&str>,
        task_id: Uuid,
        by: By,
        external_txn_id: Option<String>,
        resolution: EffectResolution,
    ) -> Result<Result<(Task, SecondEffect), Refusal>> {
        self.call(AcknowledgeSecondEffect {
            tenant: tenant.map(str::to_owned),
            grant: self.grant.clone(),
            task_id,
            by,
            external_txn_id,
            resolution,
        })
        .await
    }
}
