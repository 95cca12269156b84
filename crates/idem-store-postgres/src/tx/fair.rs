//! Fair claims on PostgreSQL ([`idem_store::flow`], SPEC §2.13): the claim
//! queues (`claim_turns`) and the claimable tasks of a fairness key value.
//! Parallel claimers lock the queues they serve `FOR UPDATE SKIP LOCKED`, so
//! they serve different queues; a claimer that finds every waiting queue
//! held reads them without a lock and leases without moving their turns.

use idem_core::model::{Task, Timestamp};
use idem_store::Result;
use idem_store::flow::{ClaimQueue, QueuePair, QueueTamper};
use tokio_postgres::Row;
use uuid::Uuid;

use super::PgTx;
use crate::rows::{Param, get, open_queues_sql};

/// Unparked tenant queues of the classes `$1` whose tenant is in `$2` (NULL:
/// all), lowest turn first, at most `$3`: one ordered walk of
/// `claim_turns_tenants` per class; `{lock}` is the locking clause.
fn tenant_queues(lock: &str) -> String {
    format!(
        "SELECT q.tenant, q.operation, q.fairness_key, q.turn \
         FROM (SELECT DISTINCT op FROM unnest($1::text[]) AS u(op)) AS o CROSS JOIN LATERAL ( \
           SELECT tenant, operation, fairness_key, turn FROM claim_turns \
           WHERE operation = o.op AND fairness_key = '' AND NOT parked \
             AND ($2::text[] IS NULL OR tenant = ANY($2::text[])) \
           ORDER BY turn, tenant LIMIT $3 {lock}) AS q \
         ORDER BY q.turn, q.tenant, q.operation LIMIT $3"
    )
}

/// Unparked value queues of tenant `$1` and class `$2`, lowest turn first, at most `$3`.
fn value_queues(lock: &str) -> String {
    format!(
        "SELECT tenant, operation, fairness_key, turn FROM claim_turns \
         WHERE tenant = $1 AND operation = $2 AND fairness_key <> '' AND NOT parked \
         ORDER BY turn, fairness_key LIMIT $3 {lock}"
    )
}

/// Claimable tasks of tenant `$1`, class `$2`, fairness key value `$3`,
/// ready at `$4`, lowest claim rank first, at most `$5`, locked `FOR UPDATE
/// SKIP LOCKED` as `CLAIMABLE` does (one walk of `tasks_claim_fair`).
const CLAIMABLE_WITH_VALUE: &str = "SELECT t.id FROM ( \
       SELECT id, (ready_at - priority * 10000) AS rank FROM tasks \
       WHERE tenant = $1 AND operation = $2 AND fairness_key = $3 AND ready_at <= $4 \
         AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
         AND next_kind IS NOT NULL \
       ORDER BY (ready_at - priority * 10000), id LIMIT $5::bigint + 64) AS candidate \
     CROSS JOIN LATERAL ( \
       SELECT id FROM tasks \
       WHERE id = candidate.id AND ready_at <= $4 \
         AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
         AND next_kind IS NOT NULL \
       FOR UPDATE SKIP LOCKED) AS t \
     ORDER BY candidate.rank, candidate.id LIMIT $5";

const TENANT_WAITS: &str = "SELECT EXISTS (SELECT 1 FROM tasks WHERE tenant = $1 AND operation = $2 \
     AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
     AND next_kind IS NOT NULL) AS e";

const VALUE_WAITS: &str = "SELECT EXISTS (SELECT 1 FROM tasks WHERE tenant = $1 AND operation = $2 \
     AND fairness_key = $3 \
     AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
     AND next_kind IS NOT NULL) AS e";

/// Parked queues that have a task waiting to be claimed, at most `$1`,
/// locked `FOR UPDATE SKIP LOCKED`: one statement, in which a parked queue
/// with nothing waiting costs one index probe of `tasks` and is neither
/// locked nor returned, however many idle queues stay parked.
const PARKED_WAITING: &str = "SELECT q.tenant, q.operation, q.fairness_key, q.turn FROM claim_turns q \
     WHERE q.parked AND CASE WHEN q.fairness_key = '' \
       THEN EXISTS (SELECT 1 FROM tasks t WHERE t.tenant = q.tenant AND t.operation = q.operation \
         AND t.active_attempt_id IS NULL AND t.state IN ('queued', 'retry_wait', 'reconciling') \
         AND t.next_kind IS NOT NULL) \
       ELSE EXISTS (SELECT 1 FROM tasks t WHERE t.tenant = q.tenant AND t.operation = q.operation \
         AND t.fairness_key = substr(q.fairness_key, 2) \
         AND t.active_attempt_id IS NULL AND t.state IN ('queued', 'retry_wait', 'reconciling') \
         AND t.next_kind IS NOT NULL) END \
     LIMIT $1 FOR UPDATE OF q SKIP LOCKED";

/// Unparks the queues `($1[i], $2[i], $3[i])` (held by the sweep), each at
/// the lowest unparked turn of its level (0 when it has none), as
/// `open_queues_sql` does.
const UNPARK: &str = "UPDATE claim_turns c SET parked = false, turn = coalesce(CASE WHEN c.fairness_key = '' \
       THEN (SELECT min(m.turn) FROM claim_turns m WHERE m.operation = c.operation AND m.fairness_key = '' AND NOT m.parked) \
       ELSE (SELECT min(m.turn) FROM claim_turns m WHERE m.tenant = c.tenant AND m.operation = c.operation \
         AND m.fairness_key <> '' AND NOT m.parked) END, 0) \
     FROM unnest($1::text[], $2::text[], $3::text[]) AS u(tenant, operation, k) \
     WHERE c.tenant = u.tenant AND c.operation = u.operation AND c.fairness_key = u.k AND c.parked";

/// The walk for missing tenant queues: up to `$3` (tenant, class) pairs
/// with a task in the claimable states, in (tenant, operation) order after
/// `($1, $2)`, each probed from the last by one step of `tasks_claim_rank`
/// (whose predicate it repeats), so its cost is per pair, whatever the
/// backlog. Of those, the pairs without a tenant queue (one probe of the
/// `claim_turns` key each) that have a task waiting to be claimed
/// (`next_kind`, read only for those) answer `missing`; the `$3`-th pair
/// answers too (where the walk stopped), missing or not. Both reads are
/// lateral `LIMIT 1` subqueries, so the planner probes per pair and never
/// hashes all of `claim_turns` (value queues included) instead.
const MISSING_TENANT_QUEUES: &str = "WITH RECURSIVE pairs (n, tenant, operation) AS ( \
       (SELECT 1::bigint, tenant, operation FROM tasks \
        WHERE active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
          AND (tenant, operation) > ($1::text, $2::text) \
        ORDER BY tenant, operation LIMIT 1) \
       UNION ALL \
       SELECT p.n + 1, x.tenant, x.operation FROM pairs p CROSS JOIN LATERAL ( \
         SELECT tenant, operation FROM tasks \
         WHERE active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
           AND (tenant, operation) > (p.tenant, p.operation) \
         ORDER BY tenant, operation LIMIT 1) AS x \
       WHERE p.n < $3::bigint) \
     SELECT p.n, p.tenant, p.operation, (w.waits IS NOT NULL) AS missing FROM pairs p \
     LEFT JOIN LATERAL ( \
       SELECT 1 AS present FROM claim_turns q \
       WHERE q.tenant = p.tenant AND q.operation = p.operation AND q.fairness_key = '' LIMIT 1) AS q ON true \
     LEFT JOIN LATERAL ( \
       SELECT 1 AS waits FROM tasks t \
       WHERE q.present IS NULL AND t.tenant = p.tenant AND t.operation = p.operation \
         AND t.active_attempt_id IS NULL AND t.state IN ('queued', 'retry_wait', 'reconciling') \
         AND t.next_kind IS NOT NULL LIMIT 1) AS w ON true \
     WHERE w.waits IS NOT NULL OR p.n = $3::bigint";

fn queue(row: &Row) -> Result<ClaimQueue> {
    Ok(ClaimQueue {
        tenant: get(row, "tenant")?,
        operation: get(row, "operation")?,
        key: get(row, "fairness_key")?,
        turn: get(row, "turn")?,
    })
}

impl PgTx<'_> {
    pub(super) async fn fair_claim_queues(
        &self,
        tenants: Option<&[String]>,
        operations: &[String],
        limit: i64,
        locked: bool,
    ) -> Result<Vec<ClaimQueue>> {
        if operations.is_empty() || limit <= 0 {
            return Ok(Vec::new());
        }
        let sql = tenant_queues(if locked { "FOR UPDATE SKIP LOCKED" } else { "" });
        let tenants: Option<Vec<&str>> = tenants.map(|t| t.iter().map(String::as_str).collect());
        let params: [Param<'_>; 3] = [&operations, &tenants, &limit];
        self.query(&sql, &params).await?.iter().map(queue).collect()
    }

    pub(super) async fn fair_value_queues(
        &self,
        tenant: &str,
        operation: &str,
        limit: i64,
        locked: bool,
    ) -> Result<Vec<ClaimQueue>> {
        let sql = value_queues(if locked { "FOR UPDATE SKIP LOCKED" } else { "" });
        self.query(&sql, &[&tenant, &operation, &limit])
            .await?
            .iter()
            .map(queue)
            .collect()
    }

    pub(super) async fn fair_claimable_with_value(
        &self,
        q: &ClaimQueue,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>> {
        let Some(value) = q.fairness_value() else {
            return Ok(Vec::new());
        };
        let now = now.ms();
        self.query(
            CLAIMABLE_WITH_VALUE,
            &[&q.tenant, &q.operation, &value, &now, &limit],
        )
        .await?
        .iter()
        .map(|r| get(r, "id"))
        .collect()
    }

    pub(super) async fn fair_queue_waits(&self, q: &ClaimQueue) -> Result<bool> {
        let row = match q.fairness_value() {
            None => {
                self.query_opt(TENANT_WAITS, &[&q.tenant, &q.operation])
                    .await?
            }
            Some(v) => {
                self.query_opt(VALUE_WAITS, &[&q.tenant, &q.operation, &v])
                    .await?
            }
        };
        Ok(match row {
            Some(r) => get(&r, "e")?,
            None => false,
        })
    }

    pub(super) async fn fair_set_turn(&self, q: &ClaimQueue, turn: Option<i64>) -> Result<()> {
        self.exec(
            "UPDATE claim_turns SET turn = coalesce($4, turn), parked = ($4::bigint IS NULL) \
             WHERE tenant = $1 AND operation = $2 AND fairness_key = $3",
            &[&q.tenant, &q.operation, &q.key, &turn],
        )
        .await?;
        Ok(())
    }

    pub(super) async fn fair_last_turn(&self, q: &ClaimQueue) -> Result<i64> {
        let row = if q.key.is_empty() {
            self.query_opt(
                "SELECT max(turn) AS turn FROM claim_turns WHERE operation = $1 AND fairness_key = '' AND NOT parked",
                &[&q.operation],
            )
            .await?
        } else {
            self.query_opt(
                "SELECT max(turn) AS turn FROM claim_turns WHERE tenant = $1 AND operation = $2 \
                 AND fairness_key <> '' AND NOT parked",
                &[&q.tenant, &q.operation],
            )
            .await?
        };
        let last: Option<i64> = match row {
            Some(r) => get(&r, "turn")?,
            None => None,
        };
        Ok(last.unwrap_or(q.turn).max(q.turn))
    }

    pub(super) async fn fair_open_queues(&self, task: &Task) -> Result<()> {
        let c = &task.control;
        if !idem_store::flow::waits(task) {
            return Ok(());
        }
        let tenants = vec![c.tenant.as_str()];
        let operations = vec![task.operation.as_str()];
        let values = vec![c.fairness_key.as_deref()];
        self.exec(
            &open_queues_sql("$1", "$2", "$3"),
            &[&tenants, &operations, &values],
        )
        .await?;
        Ok(())
    }

    pub(super) async fn fair_unpark_waiting(&self, limit: i64) -> Result<usize> {
        let parked: Vec<ClaimQueue> = self
            .query(PARKED_WAITING, &[&limit])
            .await?
            .iter()
            .map(queue)
            .collect::<Result<_>>()?;
        if parked.is_empty() {
            return Ok(0);
        }
        // Only the rows this sweep holds: a value queue's tenant row is
        // unparked as a row of its own (it has the same waiting task), so
        // the sweep waits for no row lock a submit may hold while it waits
        // for one of these.
        let tenants: Vec<&str> = parked.iter().map(|q| q.tenant.as_str()).collect();
        let operations: Vec<&str> = parked.iter().map(|q| q.operation.as_str()).collect();
        let keys: Vec<&str> = parked.iter().map(|q| q.key.as_str()).collect();
        self.exec(UNPARK, &[&tenants, &operations, &keys]).await?;
        Ok(parked.len())
    }

    pub(super) async fn fair_open_missing_queues(
        &self,
        after: Option<&QueuePair>,
        limit: i64,
    ) -> Result<(usize, Option<QueuePair>)> {
        if limit <= 0 {
            return Ok((0, after.cloned()));
        }
        // From the start: ("", "") is below every pair (a class name is not
        // empty).
        let (tenant, operation) = after.map_or(("", ""), |p| (&p.tenant, &p.operation));
        let rows = self
            .query(MISSING_TENANT_QUEUES, &[&tenant, &operation, &limit])
            .await?;
        let mut tenants: Vec<String> = Vec::new();
        let mut operations: Vec<String> = Vec::new();
        let mut walked_to = None;
        for row in &rows {
            let n: i64 = get(row, "n")?;
            let pair = QueuePair {
                tenant: get(row, "tenant")?,
                operation: get(row, "operation")?,
            };
            let missing: bool = get(row, "missing")?;
            if missing {
                tenants.push(pair.tenant.clone());
                operations.push(pair.operation.clone());
            }
            if n == limit {
                walked_to = Some(pair);
            }
        }
        if !tenants.is_empty() {
            let values: Vec<Option<&str>> = vec![None; tenants.len()];
            self.exec(
                &open_queues_sql("$1", "$2", "$3"),
                &[&tenants, &operations, &values],
            )
            .await?;
        }
        Ok((tenants.len(), walked_to))
    }

    pub(super) async fn fair_tamper_queues(
        &self,
        tenant: &str,
        operation: &str,
        how: QueueTamper,
    ) -> Result<usize> {
        let sql = match how {
            QueueTamper::Park => {
                "UPDATE claim_turns SET parked = true WHERE tenant = $1 AND operation = $2"
            }
            QueueTamper::Forget => "DELETE FROM claim_turns WHERE tenant = $1 AND operation = $2",
        };
        let n = self.exec(sql, &[&tenant, &operation]).await?;
        Ok(usize::try_from(n).unwrap_or(0))
    }
}
