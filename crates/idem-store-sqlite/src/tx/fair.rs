//! Fair claims on SQLite ([`idem_store::flow`], SPEC §2.13): the claim
//! queues (`claim_turns`) and the claimable tasks of a fairness key value.
//! The one writer runs one transaction at a time, so a queue read is a queue
//! held (no row locks to take or skip).

use idem_core::model::{Task, Timestamp};
use idem_store::StoreError;
use idem_store::flow::{ClaimQueue, QueuePair, QueueTamper, value_key};
use rusqlite::{OptionalExtension, params};
use uuid::Uuid;

use super::{SqliteTx, db, decode, uuid};

/// Unparked tenant queues of class `?1`, lowest turn first, at most `?2`;
/// of the tenants in the JSON array `?3` (NULL: all).
const TENANT_QUEUES: &str = "SELECT tenant, operation, fairness_key, turn FROM claim_turns \
     WHERE operation = ?1 AND fairness_key = '' AND NOT parked \
       AND (?3 IS NULL OR tenant IN (SELECT value FROM json_each(?3))) \
     ORDER BY turn, tenant LIMIT ?2";

/// Unparked value queues of tenant `?1` and class `?2`, lowest turn first, at most `?3`.
const VALUE_QUEUES: &str = "SELECT tenant, operation, fairness_key, turn FROM claim_turns \
     WHERE tenant = ?1 AND operation = ?2 AND fairness_key <> '' AND NOT parked \
     ORDER BY turn, fairness_key LIMIT ?3";

/// Claimable tasks of tenant `?1`, class `?2`, fairness key value `?3`,
/// ready at `?4`, lowest claim rank first, at most `?5`: an ordered walk of
/// `tasks_claim_fair`, whose predicate and expression it repeats.
const CLAIMABLE_WITH_VALUE: &str = "SELECT id FROM tasks WHERE tenant = ?1 AND operation = ?2 \
     AND fairness_key = ?3 AND fairness_key IS NOT NULL \
     AND active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') \
     AND ready_at <= ?4 AND next_kind IS NOT NULL \
     ORDER BY ready_at - priority * 10000, id LIMIT ?5";

/// The first (tenant, class) pair after `(?1, ?2)` with a task in the
/// claimable states, in (tenant, operation) order: one probe of
/// `tasks_claim_rank`, whose predicate it repeats (a walk of these visits each
/// pair once, whatever its backlog).
const NEXT_WAITING_PAIR: &str = "SELECT tenant, operation FROM tasks \
     WHERE active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') \
       AND (tenant, operation) > (?1, ?2) \
     ORDER BY tenant, operation LIMIT 1";

/// Whether tenant `?1` has a queue of class `?2`.
const HAS_TENANT_QUEUE: &str = "SELECT EXISTS (SELECT 1 FROM claim_turns \
     WHERE tenant = ?1 AND operation = ?2 AND fairness_key = '')";

impl SqliteTx<'_> {
    fn queues(
        &self,
        sql: &str,
        args: impl rusqlite::Params,
    ) -> Result<Vec<ClaimQueue>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql).map_err(db)?;
        let rows = stmt
            .query_map(args, |r| {
                Ok(ClaimQueue {
                    tenant: r.get(0)?,
                    operation: r.get(1)?,
                    key: r.get(2)?,
                    turn: r.get(3)?,
                })
            })
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    pub(super) fn fair_claim_queues(
        &self,
        tenants: Option<&[String]>,
        operations: &[String],
        limit: i64,
    ) -> Result<Vec<ClaimQueue>, StoreError> {
        let list = tenants
            .map(|t| serde_json::to_string(t).map_err(|e| StoreError::Corrupt(e.to_string())))
            .transpose()?;
        let mut classes: Vec<&str> = operations.iter().map(String::as_str).collect();
        classes.sort_unstable();
        classes.dedup();
        let mut found = Vec::new();
        for class in classes {
            found.extend(self.queues(TENANT_QUEUES, params![class, limit, list])?);
        }
        found.sort_by(|a, b| {
            (a.turn, &a.tenant, &a.operation).cmp(&(b.turn, &b.tenant, &b.operation))
        });
        found.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(found)
    }

    pub(super) fn fair_value_queues(
        &self,
        tenant: &str,
        operation: &str,
        limit: i64,
    ) -> Result<Vec<ClaimQueue>, StoreError> {
        self.queues(VALUE_QUEUES, params![tenant, operation, limit])
    }

    pub(super) fn fair_claimable_with_value(
        &self,
        queue: &ClaimQueue,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        let Some(value) = queue.fairness_value() else {
            return Ok(Vec::new());
        };
        let mut stmt = self.conn.prepare_cached(CLAIMABLE_WITH_VALUE).map_err(db)?;
        let rows = stmt
            .query_map(
                params![queue.tenant, queue.operation, value, now.0, limit],
                |r| r.get::<_, String>(0),
            )
            .map_err(db)?;
        rows.map(|r| r.map_err(decode).and_then(|id| uuid(&id).map_err(decode)))
            .collect()
    }

    pub(super) fn fair_queue_waits(&self, queue: &ClaimQueue) -> Result<bool, StoreError> {
        const TENANT: &str = "SELECT EXISTS (SELECT 1 FROM tasks WHERE tenant = ?1 AND operation = ?2 \
             AND active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') \
             AND next_kind IS NOT NULL)";
        const VALUE: &str = "SELECT EXISTS (SELECT 1 FROM tasks WHERE tenant = ?1 AND operation = ?2 \
             AND fairness_key = ?3 AND fairness_key IS NOT NULL \
             AND active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') \
             AND next_kind IS NOT NULL)";
        let found: bool = match queue.fairness_value() {
            None => self.conn.prepare_cached(TENANT).and_then(|mut s| {
                s.query_row(params![queue.tenant, queue.operation], |r| r.get(0))
            }),
            Some(v) => self.conn.prepare_cached(VALUE).and_then(|mut s| {
                s.query_row(params![queue.tenant, queue.operation, v], |r| r.get(0))
            }),
        }
        .map_err(db)?;
        Ok(found)
    }

    pub(super) fn fair_set_turn(
        &self,
        queue: &ClaimQueue,
        turn: Option<i64>,
    ) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(
                "UPDATE claim_turns SET turn = coalesce(?4, turn), parked = (?4 IS NULL) \
                 WHERE tenant = ?1 AND operation = ?2 AND fairness_key = ?3",
            )
            .and_then(|mut s| s.execute(params![queue.tenant, queue.operation, queue.key, turn]))
            .map_err(db)?;
        Ok(())
    }

    pub(super) fn fair_last_turn(&self, queue: &ClaimQueue) -> Result<i64, StoreError> {
        let turn: Option<i64> = if queue.key.is_empty() {
            self.conn
                .prepare_cached(
                    "SELECT max(turn) FROM claim_turns WHERE operation = ?1 AND fairness_key = '' AND NOT parked",
                )
                .and_then(|mut s| s.query_row(params![queue.operation], |r| r.get(0)))
        } else {
            self.conn
                .prepare_cached(
                    "SELECT max(turn) FROM claim_turns WHERE tenant = ?1 AND operation = ?2 \
                     AND fairness_key <> '' AND NOT parked",
                )
                .and_then(|mut s| s.query_row(params![queue.tenant, queue.operation], |r| r.get(0)))
        }
        .map_err(db)?;
        Ok(turn.unwrap_or(queue.turn).max(queue.turn))
    }

    /// The lowest unparked turn of the level of the queue `(tenant,
    /// operation, key)`; 0 when it has none.
    fn first_turn(&self, tenant: &str, operation: &str, key: &str) -> Result<i64, StoreError> {
        let turn: Option<i64> = if key.is_empty() {
            self.conn
                .prepare_cached(
                    "SELECT min(turn) FROM claim_turns WHERE operation = ?1 AND fairness_key = '' AND NOT parked",
                )
                .and_then(|mut s| s.query_row(params![operation], |r| r.get(0)))
        } else {
            self.conn
                .prepare_cached(
                    "SELECT min(turn) FROM claim_turns WHERE tenant = ?1 AND operation = ?2 \
                     AND fairness_key <> '' AND NOT parked",
                )
                .and_then(|mut s| s.query_row(params![tenant, operation], |r| r.get(0)))
        }
        .map_err(db)?;
        Ok(turn.unwrap_or(0))
    }

    /// Inserts or unparks the queue `(tenant, operation, key)`; a queue in
    /// the turn order is left as it is.
    fn open_queue(&self, tenant: &str, operation: &str, key: &str) -> Result<(), StoreError> {
        let parked: Option<bool> = self
            .conn
            .prepare_cached(
                "SELECT parked FROM claim_turns WHERE tenant = ?1 AND operation = ?2 AND fairness_key = ?3",
            )
            .and_then(|mut s| {
                s.query_row(params![tenant, operation, key], |r| r.get(0))
                    .optional()
            })
            .map_err(db)?;
        if parked == Some(false) {
            return Ok(());
        }
        let turn = self.first_turn(tenant, operation, key)?;
        self.conn
            .prepare_cached(
                "INSERT INTO claim_turns (tenant, operation, fairness_key, turn, parked) \
                 VALUES (?1, ?2, ?3, ?4, 0) \
                 ON CONFLICT (tenant, operation, fairness_key) DO UPDATE SET parked = 0, turn = excluded.turn",
            )
            .and_then(|mut s| s.execute(params![tenant, operation, key, turn]))
            .map_err(db)?;
        Ok(())
    }

    pub(super) fn fair_open_queues(&self, task: &Task) -> Result<(), StoreError> {
        if !idem_store::flow::waits(task) {
            return Ok(());
        }
        let tenant = &task.control.tenant;
        self.open_queue(tenant, &task.operation, "")?;
        if let Some(v) = &task.control.fairness_key {
            self.open_queue(tenant, &task.operation, &value_key(v))?;
        }
        Ok(())
    }

    pub(super) fn fair_unpark_waiting(&self, limit: i64) -> Result<usize, StoreError> {
        // One statement: a parked queue with nothing waiting costs one index
        // probe of `tasks` and is not returned, however many idle queues
        // stay parked.
        let parked = self.queues(
            "SELECT q.tenant, q.operation, q.fairness_key, q.turn FROM claim_turns q \
             WHERE q.parked AND CASE WHEN q.fairness_key = '' \
               THEN EXISTS (SELECT 1 FROM tasks t WHERE t.tenant = q.tenant AND t.operation = q.operation \
                 AND t.active_attempt_id IS NULL \
                 AND (t.state = 'queued' OR t.state = 'retry_wait' OR t.state = 'reconciling') \
                 AND t.next_kind IS NOT NULL) \
               ELSE EXISTS (SELECT 1 FROM tasks t WHERE t.tenant = q.tenant AND t.operation = q.operation \
                 AND t.fairness_key = substr(q.fairness_key, 2) \
                 AND t.active_attempt_id IS NULL \
                 AND (t.state = 'queued' OR t.state = 'retry_wait' OR t.state = 'reconciling') \
                 AND t.next_kind IS NOT NULL) END \
             LIMIT ?1",
            params![limit],
        )?;
        for q in &parked {
            self.open_queue(&q.tenant, &q.operation, &q.key)?;
        }
        Ok(parked.len())
    }

    pub(super) fn fair_open_missing_queues(
        &self,
        after: Option<&QueuePair>,
        limit: i64,
    ) -> Result<(usize, Option<QueuePair>), StoreError> {
        let mut next = self.conn.prepare_cached(NEXT_WAITING_PAIR).map_err(db)?;
        let mut has = self.conn.prepare_cached(HAS_TENANT_QUEUE).map_err(db)?;
        // From the start: ("", "") is below every pair (a class name is not
        // empty).
        let (mut tenant, mut operation) = after
            .map(|p| (p.tenant.clone(), p.operation.clone()))
            .unwrap_or_default();
        let mut opened = 0;
        for _ in 0..limit.max(0) {
            let Some(pair) = next
                .query_row(params![tenant, operation], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
                })
                .optional()
                .map_err(db)?
            else {
                return Ok((opened, None));
            };
            (tenant, operation) = pair;
            let present: bool = has
                .query_row(params![tenant, operation], |r| r.get(0))
                .map_err(db)?;
            if present {
                continue;
            }
            let queue = ClaimQueue {
                tenant: tenant.clone(),
                operation: operation.clone(),
                key: String::new(),
                turn: 0,
            };
            if self.fair_queue_waits(&queue)? {
                self.open_queue(&tenant, &operation, "")?;
                opened += 1;
            }
        }
        Ok((opened, Some(QueuePair { tenant, operation })))
    }

    pub(super) fn fair_tamper_queues(
        &self,
        tenant: &str,
        operation: &str,
        how: QueueTamper,
    ) -> Result<usize, StoreError> {
        let sql = match how {
            QueueTamper::Park => {
                "UPDATE claim_turns SET parked = 1 WHERE tenant = ?1 AND operation = ?2"
            }
            QueueTamper::Forget => "DELETE FROM claim_turns WHERE tenant = ?1 AND operation = ?2",
        };
        self.conn
            .prepare_cached(sql)
            .and_then(|mut s| s.execute(params![tenant, operation]))
            .map_err(db)
    }
}
