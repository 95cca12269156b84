//! [`Tx`] over one PostgreSQL transaction: one method per named statement
//! (the statements and row decoding are in `rows.rs`); the pipelined run of
//! the [`SubmitPlan`](idem_store::ops::SubmitPlan) is in `tx/pipeline.rs`.

use std::collections::HashMap;

use deadpool_postgres::Transaction;
use idem_core::contract::FrozenContract;
use idem_core::model::{
    ApiKey, Attempt, EffectReport, Event, Evidence, SecondEffect, Task, Timestamp,
};
use idem_store::contracts::StoredContracts;
use idem_store::flow::QueueTamper;
use idem_store::ops::Submission;
use idem_store::{Change, Clock, ExistingScope, Result, ScopeRow, StoreError, Tx};
use tokio_postgres::Row;
use uuid::Uuid;

use crate::error::{corrupt, map_pg_error};
/// The claim scan, for `testing`.
pub(crate) use crate::rows::CLAIMABLE;
use crate::rows::*;

mod console;
mod fair;
mod pipeline;
pub(crate) mod search;

pub(crate) use pipeline::Pipelined;

/// Where statements go: an open READ COMMITTED transaction (every writing
/// operation), or the connection itself in autocommit for read-only operations
/// (each statement of a READ COMMITTED transaction takes its own snapshot
/// anyway, so this saves the BEGIN/COMMIT round trips and changes no answer).
enum Conn<'a> {
    Tx(Transaction<'a>),
    Auto(&'a deadpool_postgres::Client),
}

/// One operation's connection; implements [`Tx`]. Every statement is prepared
/// once per connection (`prepare_cached`). Every statement that reads the
/// database clock adds the offset of `clock`.
pub struct PgTx<'a> {
    conn: Conn<'a>,
    clock: &'a Clock,
    /// The events written so far, as changes to announce once the
    /// transaction commits ([`PgTx::take_changes`]).
    changes: Vec<Change>,
}

impl std::fmt::Debug for PgTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTx").finish_non_exhaustive()
    }
}

impl<'a> PgTx<'a> {
    /// Wraps an open transaction; its clock reads add `clock`'s offset.
    pub fn new(tx: Transaction<'a>, clock: &'a Clock) -> PgTx<'a> {
        PgTx {
            conn: Conn::Tx(tx),
            clock,
            changes: Vec::new(),
        }
    }

    /// Statements in autocommit: only for operations that do not write.
    pub fn autocommit(client: &'a deadpool_postgres::Client, clock: &'a Clock) -> PgTx<'a> {
        PgTx {
            conn: Conn::Auto(client),
            clock,
            changes: Vec::new(),
        }
    }

    /// The changes the events written so far make (taken: the next call
    /// answers only what was written since). Announce them once the
    /// transaction committed, never before ([`idem_store::changes`]).
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// The transaction, to commit or roll back (`None` in autocommit).
    pub fn into_inner(self) -> Option<Transaction<'a>> {
        match self.conn {
            Conn::Tx(tx) => Some(tx),
            Conn::Auto(_) => None,
        }
    }

    /// The keys whose SHA-256 hex is in `hashes`, by hash: one statement for a
    /// whole batch of authentications.
    pub async fn api_keys_by_hashes(&self, hashes: &[String]) -> Result<HashMap<String, ApiKey>> {
        let rows = self
            .query(
                &format!("SELECT {KEY_COLS}, key_hash FROM api_keys WHERE key_hash = ANY($1)"),
                &[&hashes],
            )
            .await?;
        rows.iter()
            .map(|r| Ok((get::<String>(r, "key_hash")?, api_key_from_row(r)?)))
            .collect()
    }

    async fn statement(&self, sql: &str) -> Result<tokio_postgres::Statement> {
        match &self.conn {
            Conn::Tx(tx) => tx.prepare_cached(sql).await,
            Conn::Auto(c) => c.prepare_cached(sql).await,
        }
        .map_err(map_pg_error)
    }

    async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        let stmt = self.statement(sql).await?;
        match &self.conn {
            Conn::Tx(tx) => tx.query(&stmt, params).await,
            Conn::Auto(c) => c.query(&stmt, params).await,
        }
        .map_err(map_pg_error)
    }

    async fn query_opt(&self, sql: &str, params: &[Param<'_>]) -> Result<Option<Row>> {
        let stmt = self.statement(sql).await?;
        match &self.conn {
            Conn::Tx(tx) => tx.query_opt(&stmt, params).await,
            Conn::Auto(c) => c.query_opt(&stmt, params).await,
        }
        .map_err(map_pg_error)
    }

    /// New tasks and their events (`events[i]` belongs to `tasks[i]`) in one
    /// statement, after the rows of `contracts` (those of the tasks not known
    /// to be stored; each written if absent): tasks as one array per column
    /// (prepared once per connection whatever the batch size), contracts and
    /// events in CTEs. `stmt` is
    /// [`TASKS_WITH_EVENTS_INSERT`] prepared on this connection, so the request
    /// goes out on the future's first poll (the pipelined submit relies on it);
    /// nothing is sent for no tasks.
    async fn insert_new_tasks(
        &self,
        stmt: &tokio_postgres::Statement,
        tasks: &[Task],
        events: &[Vec<Event>],
        contracts: &[FrozenContract],
    ) -> Result<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        let contract_ids: Vec<&[u8]> = contracts.iter().map(|c| c.id_bytes()).collect();
        let contract_texts: Vec<&str> = contracts.iter().map(|c| c.json()).collect();
        let values = tasks
            .iter()
            .map(TaskValues::new)
            .collect::<Result<Vec<_>>>()?;
        let arrays = TaskArrays::new(&values);
        let events = EventArrays::new(
            tasks
                .iter()
                .zip(events)
                .flat_map(|(t, events)| events.iter().map(|e| (t.id, e))),
        )?;
        let mut params: Vec<Param<'_>> = arrays.params().to_vec();
        params.extend(events.params());
        params.extend([&contract_ids as Param<'_>, &contract_texts]);
        match &self.conn {
            Conn::Tx(tx) => tx.execute(stmt, &params).await,
            Conn::Auto(c) => c.execute(stmt, &params).await,
        }
        .map_err(map_pg_error)?;
        Ok(())
    }

    async fn exec(&self, sql: &str, params: &[Param<'_>]) -> Result<u64> {
        let stmt = self.statement(sql).await?;
        match &self.conn {
            Conn::Tx(tx) => tx.execute(&stmt, params).await,
            Conn::Auto(c) => c.execute(&stmt, params).await,
        }
        .map_err(map_pg_error)
    }
}

/// The changes new `tasks` and their `events` (`events[i]` of `tasks[i]`) make.
pub(super) fn changes_of(tasks: &[Task], events: &[Vec<Event>]) -> Vec<Change> {
    tasks
        .iter()
        .zip(events)
        .flat_map(|(t, events)| {
            events
                .iter()
                .map(|e| Change::of_event(t.control.tenant.clone(), t.operation.clone(), t.id, e))
        })
        .collect()
}

// ---------------------------------------------------------------- Tx

impl Tx for PgTx<'_> {
    /// The database clock (`clock_timestamp()`, not the transaction start)
    /// plus the clock's offset, so every instance decides leases, backoff and
    /// retention on one clock.
    async fn now(&mut self) -> Result<Timestamp> {
        let rows = self.query(NOW, &[&self.clock.offset_ms()]).await?;
        let row = rows.first().ok_or_else(|| corrupt("now", "no row"))?;
        ts(row, "now")
    }

    async fn shared_secret(
        &mut self,
        name: &str,
        candidate: &[u8; 32],
        now: Timestamp,
    ) -> Result<Vec<u8>> {
        let secret: &[u8] = candidate;
        let at = now.ms();
        self.exec(
            "INSERT INTO shared_secrets (name, secret, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO NOTHING",
            &[&name, &secret, &at],
        )
        .await?;
        let rows = self
            .query(
                "SELECT secret FROM shared_secrets WHERE name = $1",
                &[&name],
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| corrupt("shared_secrets", "no row after insert"))?;
        row.try_get::<_, Vec<u8>>(0)
            .map_err(|e| corrupt("shared_secrets", e))
    }

    async fn insert_api_key(&mut self, key: &ApiKey, hash: &str) -> Result<()> {
        let operations = opt_to_json("operations", key.operations.as_ref())?;
        let role = key.role.as_str();
        let created_at = key.created_at.ms();
        let revoked_at = key.revoked_at.map(Timestamp::ms);
        let serves = opt_to_json("serves", key.serves.as_ref())?;
        self.exec(
            "INSERT INTO api_keys (id, tenant, role, operations, key_hash, created_at, revoked_at, serves) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &key.id,
                &key.tenant,
                &role,
                &operations,
                &hash,
                &created_at,
                &revoked_at,
                &serves,
            ],
        )
        .await?;
        Ok(())
    }

    async fn now_and_live_api_keys(
        &mut self,
        ids: &[Uuid],
    ) -> Result<(Timestamp, std::collections::HashSet<Uuid>)> {
        now_and_live(
            &self
                .query(NOW_AND_LIVE_KEYS, &[&ids, &self.clock.offset_ms()])
                .await?,
        )
    }

    async fn api_key_by_hash(&mut self, hash: &str) -> Result<Option<ApiKey>> {
        self.query_opt(
            &format!("SELECT {KEY_COLS} FROM api_keys WHERE key_hash = $1"),
            &[&hash],
        )
        .await?
        .as_ref()
        .map(api_key_from_row)
        .transpose()
    }

    async fn api_key(&mut self, id: Uuid) -> Result<Option<ApiKey>> {
        self.query_opt(
            &format!("SELECT {KEY_COLS} FROM api_keys WHERE id = $1"),
            &[&id],
        )
        .await?
        .as_ref()
        .map(api_key_from_row)
        .transpose()
    }

    async fn revoke_api_key(&mut self, id: Uuid, at: Timestamp) -> Result<Option<ApiKey>> {
        let at = at.ms();
        self.query_opt(
            &format!("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $2) WHERE id = $1 RETURNING {KEY_COLS}"),
            &[&id, &at],
        )
        .await?
        .as_ref()
        .map(api_key_from_row)
        .transpose()
    }

    async fn list_api_keys(&mut self) -> Result<Vec<ApiKey>> {
        self.query(
            &format!("SELECT {KEY_COLS} FROM api_keys ORDER BY created_at, id"),
            &[],
        )
        .await?
        .iter()
        .map(api_key_from_row)
        .collect()
    }

    async fn insert_scope(&mut self, row: &ScopeRow) -> Result<bool> {
        // Under READ COMMITTED a conflicting, uncommitted insert makes this wait for
        // that transaction: it then inserts (the other rolled back) or does nothing.
        let n = self
            .exec(
                "INSERT INTO idempotency_keys (tenant, operation, idempotency_key, fingerprint, task_id) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                &[&row.tenant, &row.operation, &row.idempotency_key, &row.fingerprint, &row.task_id],
            )
            .await?;
        Ok(n == 1)
    }

    async fn scope(
        &mut self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<Option<ScopeRow>> {
        let Some(r) = self
            .query_opt(
                "SELECT tenant, operation, idempotency_key, fingerprint, task_id FROM idempotency_keys \
                 WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3",
                &[&tenant, &operation, &key],
            )
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(ScopeRow {
            tenant: get(&r, "tenant")?,
            operation: get(&r, "operation")?,
            idempotency_key: get(&r, "idempotency_key")?,
            fingerprint: get(&r, "fingerprint")?,
            task_id: get(&r, "task_id")?,
        }))
    }

    async fn take_slots(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        slots: &[idem_store::caps::CapSlot],
    ) -> Result<Option<usize>> {
        for (i, s) in slots.iter().enumerate() {
            let cap = i32::try_from(s.cap).unwrap_or(i32::MAX);
            self.exec(
                "DELETE FROM lease_slots l WHERE l.scope = $1 AND NOT EXISTS \
                 (SELECT 1 FROM tasks t WHERE t.id = l.task_id AND t.active_attempt_id = l.attempt_id)",
                &[&s.scope],
            )
            .await?;
            // The lowest free slot below the cap; a slot a concurrent
            // transaction inserted first makes this one wait for it, then
            // insert nothing (capped).
            let taken = self
                .exec(
                    "INSERT INTO lease_slots (scope, slot, task_id, attempt_id) \
                     SELECT $1, f.slot, $2, $3 FROM (SELECT CASE \
                       WHEN NOT EXISTS (SELECT 1 FROM lease_slots WHERE scope = $1 AND slot = 0) THEN 0 \
                       ELSE (SELECT min(l.slot) + 1 FROM lease_slots l WHERE l.scope = $1 AND NOT EXISTS \
                             (SELECT 1 FROM lease_slots m WHERE m.scope = $1 AND m.slot = l.slot + 1)) \
                     END AS slot) f \
                     WHERE f.slot < $4 \
                     ON CONFLICT DO NOTHING",
                    &[&s.scope, &task_id, &attempt_id, &cap],
                )
                .await?;
            if taken == 0 {
                self.exec(
                    "DELETE FROM lease_slots WHERE task_id = $1 AND attempt_id = $2",
                    &[&task_id, &attempt_id],
                )
                .await?;
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    async fn free_slots(&mut self, task_id: Uuid, keep: Option<Uuid>) -> Result<()> {
        self.exec(
            "DELETE FROM lease_slots WHERE task_id = $1 AND attempt_id IS DISTINCT FROM $2",
            &[&task_id, &keep],
        )
        .await?;
        Ok(())
    }

    async fn delete_scope(&mut self, task_id: Uuid) -> Result<()> {
        self.exec(
            "DELETE FROM idempotency_keys WHERE task_id = $1",
            &[&task_id],
        )
        .await?;
        Ok(())
    }

    async fn lock_rate(&mut self, scope: &str) -> Result<i64> {
        let r = self
            .query_opt(
                "INSERT INTO rate_limits (scope, tat_us) VALUES ($1, 0) \
                 ON CONFLICT (scope) DO UPDATE SET tat_us = rate_limits.tat_us RETURNING tat_us",
                &[&scope],
            )
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("rate limit {scope} not locked")))?;
        get(&r, "tat_us")
    }

    async fn set_rate(&mut self, scope: &str, tat_us: i64) -> Result<()> {
        self.exec(
            "UPDATE rate_limits SET tat_us = $2 WHERE scope = $1",
            &[&scope, &tat_us],
        )
        .await?;
        Ok(())
    }

    /// The task, after its contract's row (written if absent).
    async fn insert_task(&mut self, task: &Task) -> Result<()> {
        let c = &task.contract;
        self.exec(CONTRACT_INSERT, &[&c.id_bytes(), &c.json()])
            .await?;
        let v = TaskValues::new(task)?;
        self.exec(&TASK_INSERT, &v.params()).await?;
        Ok(())
    }

    async fn insert_scopes(&mut self, rows: &[ScopeRow]) -> Result<Vec<bool>> {
        if let [row] = rows {
            return Ok(vec![self.insert_scope(row).await?]);
        }
        let arrays = ScopeArrays::new(rows);
        let inserted = self.query(SCOPES_INSERT, &arrays.params()).await?;
        scopes_won(rows, &inserted)
    }

    async fn scopes_with_tasks(
        &mut self,
        scopes: &[(String, String, String)],
    ) -> Result<Vec<ExistingScope>> {
        if scopes.is_empty() {
            return Ok(Vec::new());
        }
        let lookup = ScopeLookup::new(scopes);
        let rows = self.query(&SCOPES_WITH_TASKS, &lookup.params()).await?;
        existing_scopes(scopes, &rows)
    }

    /// One statement, so one snapshot: a scope row and its task are read
    /// together, and two submissions of one scope get the same answer; a
    /// scope of a revoked key is left out, as a missing one.
    async fn live_scopes_with_tasks(&mut self, subs: &[Submission]) -> Result<Vec<ExistingScope>> {
        if subs.is_empty() {
            return Ok(Vec::new());
        }
        let scopes: Vec<(String, String, String)> = subs.iter().map(Submission::scope).collect();
        let lookup = ScopeLookup::new(&scopes);
        let key_ids: Vec<Uuid> = subs.iter().map(|s| s.api_key_id).collect();
        let [tenants, operations, keys] = lookup.params();
        let params: [Param<'_>; 4] = [tenants, operations, keys, &key_ids];
        let rows = self.query(&LIVE_SCOPES_WITH_TASKS, &params).await?;
        existing_scopes(&scopes, &rows)
    }

    async fn insert_tasks_with_events(
        &mut self,
        tasks: &[Task],
        events: &[Vec<Event>],
    ) -> Result<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        let stmt = self.statement(&TASKS_WITH_EVENTS_INSERT).await?;
        // Not the pipelined submit: no record of stored contracts here, so
        // each distinct one is written if absent.
        let contracts: Vec<FrozenContract> = StoredContracts::new()
            .unknown(tasks.iter().map(|t| &t.contract))
            .into_iter()
            .cloned()
            .collect();
        self.insert_new_tasks(&stmt, tasks, events, &contracts)
            .await?;
        self.changes.extend(changes_of(tasks, events));
        Ok(())
    }

    async fn task(&mut self, id: Uuid, lock: bool) -> Result<Option<Task>> {
        let sql: &str = if lock {
            &TASK_SELECT_LOCK
        } else {
            &TASK_SELECT
        };
        self.query_opt(sql, &[&id])
            .await?
            .as_ref()
            .map(one_task_from_row)
            .transpose()
    }

    async fn update_task(
        &mut self,
        task: &Task,
        expected_version: i64,
        expected_generation: i64,
    ) -> Result<()> {
        let v = TaskValues::new(task)?;
        let all = v.params();
        let mut params: Vec<Param<'_>> = Vec::with_capacity(all.len() + 1);
        params.extend(
            all.iter()
                .enumerate()
                .filter(|(i, _)| *i != VERSION_INDEX)
                .map(|(_, p)| *p),
        );
        params.push(&expected_version);
        params.push(&expected_generation);
        let n = self.exec(&TASK_UPDATE, &params).await?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "task {} changed since it was read (expected version {expected_version}, generation {expected_generation})",
                task.id
            )))
        }
    }

    async fn insert_attempt(&mut self, a: &Attempt) -> Result<()> {
        let kind = a.kind.as_str();
        let state = a.state.as_str();
        let leased_at = a.leased_at.ms();
        let lease_expires_at = a.lease_expires_at.ms();
        let report = opt_to_json("report", a.report.as_ref().map(|r| &r.body))?;
        self.exec(
            &format!("INSERT INTO attempts ({ATTEMPT_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"),
            &[
                &a.id,
                &a.task_id,
                &a.number,
                &a.generation,
                &kind,
                &state,
                &a.executor_id,
                &leased_at,
                &lease_expires_at,
                &a.lease_ms,
                &a.usage,
                &a.external_txn_id,
                &report,
            ],
        )
        .await?;
        Ok(())
    }

    async fn update_attempt(&mut self, a: &Attempt) -> Result<()> {
        let state = a.state.as_str();
        let lease_expires_at = a.lease_expires_at.ms();
        let report = opt_to_json("report", a.report.as_ref().map(|r| &r.body))?;
        let n = self
            .exec(
                "UPDATE attempts SET state = $2, lease_expires_at = $3, lease_ms = $4, usage = $5, \
                 external_txn_id = $6, report = $7 WHERE id = $1",
                &[
                    &a.id,
                    &state,
                    &lease_expires_at,
                    &a.lease_ms,
                    &a.usage,
                    &a.external_txn_id,
                    &report,
                ],
            )
            .await?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Corrupt(format!("attempt {} vanished", a.id)))
        }
    }

    async fn attempt(&mut self, id: Uuid) -> Result<Option<Attempt>> {
        self.query_opt(
            &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE id = $1"),
            &[&id],
        )
        .await?
        .as_ref()
        .map(attempt_from_row)
        .transpose()
    }

    async fn attempts(&mut self, task_id: Uuid) -> Result<Vec<Attempt>> {
        let mut attempts = self
            .query(
                &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE task_id = $1 ORDER BY number"),
                &[&task_id],
            )
            .await?
            .iter()
            .map(attempt_from_row)
            .collect::<Result<Vec<_>>>()?;
        let index: HashMap<Uuid, usize> = attempts
            .iter()
            .enumerate()
            .map(|(i, a)| (a.id, i))
            .collect();
        let rows = self
            .query(
                "SELECT attempt_id, received_at, generation, outcome, body, disposition FROM evidence \
                 WHERE task_id = $1 ORDER BY id",
                &[&task_id],
            )
            .await?;
        for row in &rows {
            let attempt_id: Uuid = get(row, "attempt_id")?;
            if let Some(a) = index.get(&attempt_id).and_then(|i| attempts.get_mut(*i)) {
                a.evidence.push(evidence_from_row(row)?);
            }
        }
        Ok(attempts)
    }

    async fn insert_evidence(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        ev: &Evidence,
    ) -> Result<()> {
        let received_at = ev.received_at.ms();
        let body = to_json("evidence body", &ev.body)?;
        self.exec(
            "INSERT INTO evidence (task_id, attempt_id, received_at, generation, outcome, body, disposition) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[&task_id, &attempt_id, &received_at, &ev.generation, &ev.outcome.as_str(), &body, &ev.disposition.as_str()],
        )
        .await?;
        Ok(())
    }

    async fn effects(&mut self, task_id: Uuid) -> Result<(Vec<EffectReport>, Vec<SecondEffect>)> {
        // One round trip: both tables' rows of the task, reports first.
        let rows = self.query(EFFECTS_SELECT, &[&task_id]).await?;
        let (mut reports, mut effects) = (Vec::new(), Vec::new());
        for row in &rows {
            if get::<bool>(row, "suspected")? {
                effects.push(second_effect_from_row(row)?);
            } else {
                reports.push(effect_report_from_row(row)?);
            }
        }
        Ok((reports, effects))
    }

    async fn second_effects_of(&mut self, task_ids: &[Uuid]) -> Result<Vec<(Uuid, SecondEffect)>> {
        /// The second effects of the tasks `$1`, each task's oldest first.
        const SECOND_EFFECTS_OF: &str = "\
            SELECT task_id, id, external_txn_id, attempt_id, generation, evidence, \
                   suspected_at AS at, resolution, reason, actor, acknowledged_at \
              FROM second_effects WHERE task_id = ANY($1) ORDER BY task_id, id";
        if task_ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = self.query(SECOND_EFFECTS_OF, &[&task_ids]).await?;
        rows.iter()
            .map(|row| Ok((get::<Uuid>(row, "task_id")?, second_effect_from_row(row)?)))
            .collect()
    }

    async fn insert_effect_report(&mut self, task_id: Uuid, r: &EffectReport) -> Result<()> {
        self.exec(
            "INSERT INTO effect_reports (task_id, external_txn_id, attempt_id, generation, evidence, reported_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[&task_id, &r.external_txn_id, &r.attempt_id, &r.generation, &r.evidence.as_str(), &r.reported_at.ms()],
        )
        .await?;
        Ok(())
    }

    async fn insert_second_effect(&mut self, task_id: Uuid, s: &SecondEffect) -> Result<()> {
        self.exec(
            "INSERT INTO second_effects (task_id, external_txn_id, attempt_id, generation, evidence, suspected_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[&task_id, &s.external_txn_id, &s.attempt_id, &s.generation, &s.evidence.as_str(), &s.suspected_at.ms()],
        )
        .await?;
        Ok(())
    }

    async fn acknowledge_second_effect(&mut self, task_id: Uuid, s: &SecondEffect) -> Result<()> {
        let Some(ack) = &s.acknowledgment else {
            return Err(corrupt(
                "second effect",
                "an acknowledgment without its record",
            ));
        };
        let actor = to_json("actor", &ack.actor)?;
        let n = self
            .exec(
                "UPDATE second_effects SET resolution = $3, reason = $4, actor = $5, acknowledged_at = $6 \
                 WHERE task_id = $1 AND external_txn_id IS NOT DISTINCT FROM $2 AND acknowledged_at IS NULL",
                &[&task_id, &s.external_txn_id, &ack.resolution.as_str(), &ack.reason, &actor, &ack.acknowledged_at.ms()],
            )
            .await?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "the second effect of task {task_id} was acknowledged since it was read"
            )))
        }
    }

    async fn insert_events(&mut self, task_id: Uuid, events: &[Event]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let arrays = EventArrays::new(events.iter().map(|e| (task_id, e)))?;
        let rows = self.query(EVENTS_INSERT, &arrays.params()).await?;
        let (Some(first), true) = (rows.first(), rows.len() == events.len()) else {
            return Err(corrupt(
                &format!("events of task {task_id}"),
                "the task row is missing",
            ));
        };
        let tenant: String = get(first, "tenant")?;
        let operation: String = get(first, "operation")?;
        self.changes.extend(
            events
                .iter()
                .map(|e| Change::of_event(tenant.clone(), operation.clone(), task_id, e)),
        );
        Ok(())
    }

    async fn feed(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        after: idem_store::feed::FeedCursor,
        limit: i64,
    ) -> Result<idem_store::feed::FeedRead> {
        let rows = self
            .query(
                crate::feed::FEED_PAGE,
                &[&tenant, &after.txid, &after.position, &operations, &limit],
            )
            .await?;
        crate::feed::feed_read(&rows)
    }

    async fn events(&mut self, task_id: Uuid) -> Result<Vec<Event>> {
        self.query(
            "SELECT seq, type, at, data FROM events WHERE task_id = $1 ORDER BY seq",
            &[&task_id],
        )
        .await?
        .iter()
        .map(crate::rows::event_from_row)
        .collect()
    }

    async fn claimable(
        &mut self,
        tenant: &str,
        operations: &[String],
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>> {
        if operations.is_empty() || limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        self.query(CLAIMABLE, &[&tenant, &operations, &now, &limit])
            .await?
            .iter()
            .map(|r| get(r, "id"))
            .collect()
    }

    async fn claim_queues(
        &mut self,
        tenants: Option<&[String]>,
        operations: &[String],
        limit: i64,
        locked: bool,
    ) -> Result<Vec<idem_store::flow::ClaimQueue>> {
        self.fair_claim_queues(tenants, operations, limit, locked)
            .await
    }

    async fn value_queues(
        &mut self,
        tenant: &str,
        operation: &str,
        limit: i64,
        locked: bool,
    ) -> Result<Vec<idem_store::flow::ClaimQueue>> {
        self.fair_value_queues(tenant, operation, limit, locked)
            .await
    }

    async fn claimable_with_value(
        &mut self,
        queue: &idem_store::flow::ClaimQueue,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>> {
        self.fair_claimable_with_value(queue, now, limit).await
    }

    async fn queue_waits(&mut self, queue: &idem_store::flow::ClaimQueue) -> Result<bool> {
        self.fair_queue_waits(queue).await
    }

    async fn set_turn(
        &mut self,
        queue: &idem_store::flow::ClaimQueue,
        turn: Option<i64>,
    ) -> Result<()> {
        self.fair_set_turn(queue, turn).await
    }

    async fn last_turn(&mut self, queue: &idem_store::flow::ClaimQueue) -> Result<i64> {
        self.fair_last_turn(queue).await
    }

    async fn open_queues(&mut self, task: &Task) -> Result<()> {
        self.fair_open_queues(task).await
    }

    async fn unpark_waiting(&mut self, limit: i64) -> Result<usize> {
        self.fair_unpark_waiting(limit).await
    }

    async fn open_missing_queues(
        &mut self,
        after: Option<&idem_store::flow::QueuePair>,
        limit: i64,
    ) -> Result<(usize, Option<idem_store::flow::QueuePair>)> {
        self.fair_open_missing_queues(after, limit).await
    }

    async fn tamper_queues(
        &mut self,
        tenant: &str,
        operation: &str,
        how: QueueTamper,
    ) -> Result<usize> {
        self.fair_tamper_queues(tenant, operation, how).await
    }

    async fn expired_leases(&mut self, now: Timestamp, limit: i64) -> Result<Vec<(Uuid, Uuid)>> {
        if limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        self.query(
            "SELECT t.id AS task_id, a.id AS attempt_id FROM attempts a JOIN tasks t ON t.id = a.task_id \
             WHERE a.state IN ('leased', 'acknowledged') AND a.lease_expires_at <= $1 \
             ORDER BY a.lease_expires_at LIMIT $2 FOR UPDATE OF t SKIP LOCKED",
            &[&now, &limit],
        )
        .await?
        .iter()
        .map(|r| Ok((get(r, "task_id")?, get(r, "attempt_id")?)))
        .collect()
    }

    async fn due_wakeups(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>> {
        if limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        self.query(
            "SELECT id FROM tasks WHERE state = 'retry_wait' AND ready_at <= $1 \
             ORDER BY ready_at LIMIT $2 FOR UPDATE SKIP LOCKED",
            &[&now, &limit],
        )
        .await?
        .iter()
        .map(|r| get(r, "id"))
        .collect()
    }

    async fn expired_scopes(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>> {
        if limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        // Only tasks that still own a scope row (releasing a key clears
        // `key_expires_at` too; the join keeps this right either way).
        self.query(
            "SELECT t.id FROM tasks t JOIN idempotency_keys k ON k.task_id = t.id \
             WHERE t.key_expires_at IS NOT NULL AND t.key_expires_at <= $1 \
             ORDER BY t.key_expires_at LIMIT $2 FOR UPDATE OF t SKIP LOCKED",
            &[&now, &limit],
        )
        .await?
        .iter()
        .map(|r| get(r, "id"))
        .collect()
    }

    async fn database_identity(
        &mut self,
    ) -> Result<Option<idem_store::identity::DatabaseIdentity>> {
        let rows = self.query(DATABASE_IDENTITY, &[]).await?;
        let row = rows
            .first()
            .ok_or_else(|| corrupt("database identity", "no row"))?;
        Ok(Some(idem_store::identity::DatabaseIdentity {
            system_identifier: get(row, "system_identifier")?,
            timeline: get(row, "timeline")?,
        }))
    }

    async fn recorded_identity(
        &mut self,
    ) -> Result<Option<idem_store::identity::RecordedIdentity>> {
        let row = self
            .query_opt(
                "SELECT epoch, system_identifier, timeline, restored FROM store_identity \
                 WHERE id = 1",
                &[],
            )
            .await?;
        row.map(|r| {
            Ok(idem_store::identity::RecordedIdentity {
                identity: idem_store::identity::StoreIdentity {
                    epoch: get(&r, "epoch")?,
                    system_identifier: get(&r, "system_identifier")?,
                    timeline: get(&r, "timeline")?,
                },
                restored: get(&r, "restored")?,
            })
        })
        .transpose()
    }

    async fn record_identity(
        &mut self,
        expected: Option<&idem_store::identity::StoreIdentity>,
        new: &idem_store::identity::StoreIdentity,
    ) -> Result<bool> {
        let n =
            match expected {
                None => {
                    self.exec(
                        "INSERT INTO store_identity (id, epoch, system_identifier, timeline) \
                     VALUES (1, $1, $2, $3) ON CONFLICT (id) DO NOTHING",
                        &[&new.epoch, &new.system_identifier, &new.timeline],
                    )
                    .await?
                }
                Some(old) => {
                    // Compare-and-set on the epoch: of two transactions that read
                    // the same row, the second finds the epoch changed once the
                    // first committed (READ COMMITTED re-checks the row) and
                    // writes nothing.
                    self.exec(
                    "UPDATE store_identity SET epoch = $1, system_identifier = $2, timeline = $3, \
                     restored = false, recorded_at = clock_timestamp() WHERE id = 1 AND epoch = $4",
                    &[&new.epoch, &new.system_identifier, &new.timeline, &old.epoch],
                )
                .await?
                }
            };
        Ok(n == 1)
    }

    async fn mark_restored(&mut self) -> Result<bool> {
        let n = self
            .exec(
                "UPDATE store_identity SET restored = true WHERE id = 1",
                &[],
            )
            .await?;
        Ok(n == 1)
    }

    async fn identity_is_current(&mut self) -> Result<bool> {
        let rows = self.query(IDENTITY_IS_CURRENT, &[]).await?;
        let row = rows
            .first()
            .ok_or_else(|| corrupt("store identity", "no row"))?;
        get(row, "current")
    }

    async fn unfinished_tasks(&mut self, after: Option<Uuid>, limit: i64) -> Result<Vec<Uuid>> {
        self.query(
            "SELECT id FROM tasks WHERE state NOT IN ('succeeded', 'failed', 'cancelled') \
             AND ($1::uuid IS NULL OR id > $1) ORDER BY id LIMIT $2",
            &[&after, &limit],
        )
        .await?
        .iter()
        .map(|r| get(r, "id"))
        .collect()
    }
}
