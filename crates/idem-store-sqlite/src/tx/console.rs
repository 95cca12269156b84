//! [`ConsoleTx`] on SQLite: console sessions (schema v11's
//! `console_sessions`) and the overview's reads (the counts through
//! `tasks_search_operation`, the lists through `tasks_search_state`,
//! `tasks_failed_at` and `tasks_cancel_requested`).

use idem_core::model::{ApiKey, Role, Task, TaskState, Timestamp};
use idem_store::StoreError;
use idem_store::ops::console::{ConsoleSession, ConsoleTx, QueueDepth, TaskCount};
use rusqlite::types::Value as Sql;
use rusqlite::{OptionalExtension, params};

use super::{SqliteTx, api_key_row, db, decode, task_row, word};

/// `AND operation IN (…)` of `operations` bound after `params`, or nothing.
fn in_classes(operations: Option<&[String]>, params: &mut Vec<Sql>) -> String {
    let Some(ops) = operations else {
        return String::new();
    };
    let places: Vec<String> = ops
        .iter()
        .map(|o| {
            params.push(Sql::Text(o.clone()));
            format!("?{}", params.len())
        })
        .collect();
    format!(" AND operation IN ({})", places.join(", "))
}

/// A waiting task at `?1` (epoch ms): what a claim could lease now (the
/// claim's own condition, `CLAIMABLE_IN_CLASS`).
const WAITING: &str = "active_attempt_id IS NULL \
     AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') AND ready_at <= ?1";

impl SqliteTx<'_> {
    /// The tasks whose ids `ids_sql` selects, with `params`, in the order
    /// `order` (columns of `t`, the task).
    fn tasks_of(
        &mut self,
        ids_sql: &str,
        order: &str,
        params: &[Sql],
    ) -> Result<Vec<Task>, StoreError> {
        let sql = format!(
            concat!(
                "SELECT ",
                task_columns!("t."),
                contract_text!("t."),
                " FROM ({}) p JOIN tasks t ON t.id = p.id ORDER BY {}"
            ),
            ids_sql, order
        );
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db)?;
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params.iter()), task_row)
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }
}

impl ConsoleTx for SqliteTx<'_> {
    async fn insert_console_session(
        &mut self,
        s: &ConsoleSession,
        token_hash: &str,
    ) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO console_sessions (token_hash, tenant, api_key_id, role, created_at, expires_at, ended_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    token_hash,
                    s.tenant,
                    s.api_key_id.to_string(),
                    s.role.as_str(),
                    s.created_at.0,
                    s.expires_at.0,
                    s.ended_at.map(|t| t.0)
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn purge_console_sessions(
        &mut self,
        before: Timestamp,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let n = self
            .conn
            .prepare_cached(
                "DELETE FROM console_sessions WHERE token_hash IN \
                 (SELECT token_hash FROM console_sessions WHERE expires_at < ?1 ORDER BY expires_at LIMIT ?2)",
            )
            .and_then(|mut st| st.execute(params![before.0, limit]))
            .map_err(db)?;
        Ok(n as u64)
    }

    async fn active_console_session(
        &mut self,
        token_hash: &str,
        now: Timestamp,
    ) -> Result<Option<(ConsoleSession, ApiKey)>, StoreError> {
        self.conn
            .prepare_cached(
                "SELECT k.id, k.tenant, k.role, k.operations, k.created_at, k.revoked_at, k.serves, \
                        s.tenant, s.role, s.created_at, s.expires_at, s.ended_at \
                 FROM console_sessions s JOIN api_keys k ON k.id = s.api_key_id \
                 WHERE s.token_hash = ?1 AND s.ended_at IS NULL AND s.expires_at > ?2 \
                   AND k.revoked_at IS NULL",
            )
            .and_then(|mut st| {
                st.query_row(params![token_hash, now.0], |r| {
                    let key = api_key_row(r)?;
                    let session = ConsoleSession {
                        tenant: r.get(7)?,
                        api_key_id: key.id,
                        role: word::<Role>(&r.get::<_, String>(8)?)?,
                        created_at: Timestamp(r.get(9)?),
                        expires_at: Timestamp(r.get(10)?),
                        ended_at: r.get::<_, Option<i64>>(11)?.map(Timestamp),
                    };
                    Ok((session, key))
                })
                .optional()
            })
            .map_err(decode)
    }

    async fn end_console_session(
        &mut self,
        token_hash: &str,
        at: Timestamp,
    ) -> Result<bool, StoreError> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE console_sessions SET ended_at = ?2 WHERE token_hash = ?1 AND ended_at IS NULL",
            )
            .and_then(|mut st| st.execute(params![token_hash, at.0]))
            .map_err(db)?;
        Ok(n > 0)
    }

    async fn task_counts(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
    ) -> Result<Vec<TaskCount>, StoreError> {
        let mut params = vec![Sql::Text(tenant.to_owned())];
        let classes = in_classes(operations, &mut params);
        let sql = format!(
            "SELECT operation, state, count(*) FROM tasks WHERE tenant = ?1{classes} \
             GROUP BY operation, state ORDER BY operation, state"
        );
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db)?;
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params.iter()), |r| {
                Ok(TaskCount {
                    operation: r.get(0)?,
                    state: word::<TaskState>(&r.get::<_, String>(1)?)?,
                    count: r.get(2)?,
                })
            })
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    async fn queue_depths(
        &mut self,
        tenant: Option<&str>,
        operations: Option<&[String]>,
        now: Timestamp,
    ) -> Result<Vec<QueueDepth>, StoreError> {
        let mut params = vec![Sql::Integer(now.0)];
        let tenant_is = match tenant {
            Some(t) => {
                params.push(Sql::Text(t.to_owned()));
                " AND tenant = ?2"
            }
            None => "",
        };
        let classes = in_classes(operations, &mut params);
        let sql = format!(
            "SELECT tenant, operation, count(*), min(ready_at) FROM tasks \
             WHERE {WAITING}{tenant_is}{classes} \
             GROUP BY tenant, operation ORDER BY tenant, operation"
        );
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db)?;
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params.iter()), |r| {
                Ok(QueueDepth {
                    tenant: r.get(0)?,
                    operation: r.get(1)?,
                    depth: r.get(2)?,
                    oldest_ready_at: Timestamp(r.get(3)?),
                })
            })
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    async fn queue_ready_at(
        &mut self,
        tenant: &str,
        operation: &str,
        now: Timestamp,
        rank: i64,
    ) -> Result<Option<Timestamp>, StoreError> {
        let sql = format!(
            "SELECT ready_at FROM tasks WHERE {WAITING} AND tenant = ?2 AND operation = ?3 \
             ORDER BY ready_at, id LIMIT 1 OFFSET ?4"
        );
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut st| {
                st.query_row(params![now.0, tenant, operation, rank.max(0)], |r| {
                    r.get::<_, i64>(0)
                })
                .optional()
            })
            .map(|at| at.map(Timestamp))
            .map_err(decode)
    }

    async fn stale_reconciling(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        unchanged_since: Timestamp,
        limit: i64,
    ) -> Result<Vec<Task>, StoreError> {
        let mut params = vec![
            Sql::Text(tenant.to_owned()),
            Sql::Integer(unchanged_since.0),
            Sql::Integer(limit),
        ];
        let classes = in_classes(operations, &mut params);
        let ids = format!(
            "SELECT id FROM tasks \
             WHERE tenant = ?1 AND state = 'reconciling' AND updated_at < ?2{classes} \
             ORDER BY updated_at, id LIMIT ?3"
        );
        self.tasks_of(&ids, "t.updated_at, t.id", &params)
    }

    async fn failed_since(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        since: Timestamp,
        limit: i64,
    ) -> Result<Vec<Task>, StoreError> {
        let mut params = vec![
            Sql::Text(tenant.to_owned()),
            Sql::Integer(since.0),
            Sql::Integer(limit),
        ];
        let classes = in_classes(operations, &mut params);
        let ids = format!(
            "SELECT id FROM tasks \
             WHERE tenant = ?1 AND state = 'failed' AND terminal_at >= ?2{classes} \
             ORDER BY terminal_at DESC, id DESC LIMIT ?3"
        );
        self.tasks_of(&ids, "t.terminal_at DESC, t.id DESC", &params)
    }

    async fn cancel_requested(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        limit: i64,
    ) -> Result<Vec<Task>, StoreError> {
        let mut params = vec![Sql::Text(tenant.to_owned()), Sql::Integer(limit)];
        let classes = in_classes(operations, &mut params);
        let ids = format!(
            "SELECT id FROM tasks \
             WHERE tenant = ?1 AND cancellation IS NOT NULL AND terminal_at IS NULL{classes} \
             ORDER BY created_at, id LIMIT ?2"
        );
        self.tasks_of(&ids, "t.created_at, t.id", &params)
    }
}
