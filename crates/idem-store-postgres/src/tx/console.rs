//! [`ConsoleTx`] on PostgreSQL: console sessions (schema v11's
//! `console_sessions`) and the overview's reads (the counts through
//! `tasks_search_operation`, the lists through `tasks_search_state`,
//! `tasks_failed_at` and `tasks_cancel_requested`).

use idem_core::model::{ApiKey, Role, Task, TaskState, Timestamp};
use idem_store::Result;
use idem_store::ops::console::{ConsoleSession, ConsoleTx, QueueDepth, TaskCount};
use tokio_postgres::Row;

use super::PgTx;
use crate::rows::{
    Param, TASK_COLUMNS, TaskCols, api_key_from_row, contract_text, get, opt_ts, task_from_row, ts,
    word,
};

/// `AND operation = ANY($n)` when `operations` is given (bound as `$n`).
fn in_classes(operations: Option<&[String]>, n: usize) -> String {
    match operations {
        Some(_) => format!(" AND operation = ANY(${n})"),
        None => String::new(),
    }
}

/// A waiting task at `$1` (epoch ms): what a claim could lease now (the
/// claim's own condition, `CLAIMABLE`).
const WAITING: &str = "ready_at <= $1 AND active_attempt_id IS NULL \
     AND state IN ('queued', 'retry_wait', 'reconciling') AND next_kind IS NOT NULL";

impl PgTx<'_> {
    /// The tasks whose ids `ids_sql` selects, with `params`, in the order
    /// `order` (columns of `t`, the task).
    async fn tasks_of(
        &self,
        ids_sql: &str,
        order: &str,
        params: &[Param<'_>],
    ) -> Result<Vec<Task>> {
        let columns: Vec<String> = TASK_COLUMNS.iter().map(|c| format!("t.{c}")).collect();
        let sql = format!(
            "SELECT {}, {} FROM ({ids_sql}) p JOIN tasks t ON t.id = p.id ORDER BY {order}",
            columns.join(", "),
            contract_text("t"),
        );
        let rows = self.query(&sql, params).await?;
        let Some(first) = rows.first() else {
            return Ok(Vec::new());
        };
        let cols = TaskCols::of(first.columns())?;
        rows.iter().map(|r| task_from_row(r, &cols)).collect()
    }
}

fn session_from_row(r: &Row) -> Result<(ConsoleSession, ApiKey)> {
    let key = api_key_from_row(r)?;
    let session = ConsoleSession {
        tenant: get(r, "s_tenant")?,
        api_key_id: key.id,
        role: word::<Role>(r, "s_role")?,
        created_at: ts(r, "s_created_at")?,
        expires_at: ts(r, "s_expires_at")?,
        ended_at: opt_ts(r, "s_ended_at")?,
    };
    Ok((session, key))
}

impl ConsoleTx for PgTx<'_> {
    async fn insert_console_session(&mut self, s: &ConsoleSession, token_hash: &str) -> Result<()> {
        let role = s.role.as_str();
        let (created, expires) = (s.created_at.ms(), s.expires_at.ms());
        let ended = s.ended_at.map(Timestamp::ms);
        self.exec(
            "INSERT INTO console_sessions (token_hash, tenant, api_key_id, role, created_at, expires_at, ended_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[&token_hash, &s.tenant, &s.api_key_id, &role, &created, &expires, &ended],
        )
        .await?;
        Ok(())
    }

    async fn purge_console_sessions(&mut self, before: Timestamp, limit: i64) -> Result<u64> {
        let before = before.ms();
        self.exec(
            "DELETE FROM console_sessions WHERE token_hash IN \
             (SELECT token_hash FROM console_sessions WHERE expires_at < $1 ORDER BY expires_at LIMIT $2 \
              FOR UPDATE SKIP LOCKED)",
            &[&before, &limit],
        )
        .await
    }

    async fn active_console_session(
        &mut self,
        token_hash: &str,
        now: Timestamp,
    ) -> Result<Option<(ConsoleSession, ApiKey)>> {
        let now = now.ms();
        self.query_opt(
            "SELECT k.id, k.tenant, k.role, k.operations, k.created_at, k.revoked_at, k.serves, \
                    s.tenant AS s_tenant, s.role AS s_role, s.created_at AS s_created_at, \
                    s.expires_at AS s_expires_at, s.ended_at AS s_ended_at \
             FROM console_sessions s JOIN api_keys k ON k.id = s.api_key_id \
             WHERE s.token_hash = $1 AND s.ended_at IS NULL AND s.expires_at > $2 \
               AND k.revoked_at IS NULL",
            &[&token_hash, &now],
        )
        .await?
        .as_ref()
        .map(session_from_row)
        .transpose()
    }

    async fn end_console_session(&mut self, token_hash: &str, at: Timestamp) -> Result<bool> {
        let at = at.ms();
        let n = self
            .exec(
                "UPDATE console_sessions SET ended_at = $2 WHERE token_hash = $1 AND ended_at IS NULL",
                &[&token_hash, &at],
            )
            .await?;
        Ok(n > 0)
    }

    async fn task_counts(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
    ) -> Result<Vec<TaskCount>> {
        let sql = format!(
            "SELECT operation, state, count(*) AS n FROM tasks WHERE tenant = $1{} \
             GROUP BY operation, state ORDER BY operation, state",
            in_classes(operations, 2)
        );
        let rows = match operations {
            Some(ops) => self.query(&sql, &[&tenant, &ops]).await?,
            None => self.query(&sql, &[&tenant]).await?,
        };
        rows.iter()
            .map(|r| {
                Ok(TaskCount {
                    operation: get(r, "operation")?,
                    state: word::<TaskState>(r, "state")?,
                    count: get(r, "n")?,
                })
            })
            .collect()
    }

    async fn queue_depths(
        &mut self,
        tenant: Option<&str>,
        operations: Option<&[String]>,
        now: Timestamp,
    ) -> Result<Vec<QueueDepth>> {
        let now = now.ms();
        let (tenant_is, classes) = match tenant {
            Some(_) => (" AND tenant = $2", in_classes(operations, 3)),
            None => ("", in_classes(operations, 2)),
        };
        let sql = format!(
            "SELECT tenant, operation, count(*) AS n, min(ready_at) AS oldest FROM tasks \
             WHERE {WAITING}{tenant_is}{classes} \
             GROUP BY tenant, operation ORDER BY tenant, operation"
        );
        let rows = match (tenant, operations) {
            (Some(t), Some(ops)) => self.query(&sql, &[&now, &t, &ops]).await?,
            (Some(t), None) => self.query(&sql, &[&now, &t]).await?,
            (None, Some(ops)) => self.query(&sql, &[&now, &ops]).await?,
            (None, None) => self.query(&sql, &[&now]).await?,
        };
        rows.iter()
            .map(|r| {
                Ok(QueueDepth {
                    tenant: get(r, "tenant")?,
                    operation: get(r, "operation")?,
                    depth: get(r, "n")?,
                    oldest_ready_at: Timestamp(get(r, "oldest")?),
                })
            })
            .collect()
    }

    async fn queue_ready_at(
        &mut self,
        tenant: &str,
        operation: &str,
        now: Timestamp,
        rank: i64,
    ) -> Result<Option<Timestamp>> {
        let now = now.ms();
        let rank = rank.max(0);
        let sql = format!(
            "SELECT ready_at FROM tasks WHERE {WAITING} AND tenant = $2 AND operation = $3 \
             ORDER BY ready_at, id LIMIT 1 OFFSET $4"
        );
        self.query_opt(&sql, &[&now, &tenant, &operation, &rank])
            .await?
            .map(|r| get(&r, "ready_at").map(Timestamp))
            .transpose()
    }

    async fn stale_reconciling(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        unchanged_since: Timestamp,
        limit: i64,
    ) -> Result<Vec<Task>> {
        let since = unchanged_since.ms();
        let ids = format!(
            "SELECT id FROM tasks WHERE tenant = $1 AND state = 'reconciling' AND updated_at < $2{} \
             ORDER BY updated_at, id LIMIT $3",
            in_classes(operations, 4)
        );
        let order = "t.updated_at, t.id";
        match operations {
            Some(ops) => {
                self.tasks_of(&ids, order, &[&tenant, &since, &limit, &ops])
                    .await
            }
            None => self.tasks_of(&ids, order, &[&tenant, &since, &limit]).await,
        }
    }

    async fn failed_since(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        since: Timestamp,
        limit: i64,
    ) -> Result<Vec<Task>> {
        let since = since.ms();
        let ids = format!(
            "SELECT id FROM tasks WHERE tenant = $1 AND state = 'failed' AND terminal_at >= $2{} \
             ORDER BY terminal_at DESC, id DESC LIMIT $3",
            in_classes(operations, 4)
        );
        let order = "t.terminal_at DESC, t.id DESC";
        match operations {
            Some(ops) => {
                self.tasks_of(&ids, order, &[&tenant, &since, &limit, &ops])
                    .await
            }
            None => self.tasks_of(&ids, order, &[&tenant, &since, &limit]).await,
        }
    }

    async fn cancel_requested(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        limit: i64,
    ) -> Result<Vec<Task>> {
        let ids = format!(
            "SELECT id FROM tasks WHERE tenant = $1 AND cancellation IS NOT NULL AND terminal_at IS NULL{} \
             ORDER BY created_at, id LIMIT $2",
            in_classes(operations, 3)
        );
        let order = "t.created_at, t.id";
        match operations {
            Some(ops) => self.tasks_of(&ids, order, &[&tenant, &limit, &ops]).await,
            None => self.tasks_of(&ids, order, &[&tenant, &limit]).await,
        }
    }
}
