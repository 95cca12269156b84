//! [`TaskSearch`] on SQLite: one statement per page, a `UNION ALL` of one
//! ordered walk per state (and per class, when the page is limited to some),
//! each stopping at the page size, merged and cut to the page (schema v5's
//! `tasks_search_state` and `tasks_search_operation` indexes).
//!
//! A filter on a provider's transaction id or an idempotency-key prefix
//! reads one range instead (`attempts_external_txn`, `tasks_search_key`).

use idem_store::StoreError;
use idem_store::ops::search::{TaskQuery, TaskSearch};
use rusqlite::types::Value as Sql;

use super::{SqliteTx, decode, task_row};
use idem_core::model::Task;

/// The statement and parameters of one page of `q` for `tenant`, in
/// `operations` when given.
pub(crate) fn page_sql(
    tenant: &str,
    operations: Option<&[String]>,
    q: &TaskQuery,
) -> (String, Vec<Sql>) {
    let mut params: Vec<Sql> = Vec::new();
    let mut bind = |v: Sql| {
        params.push(v);
        format!("?{}", params.len())
    };
    let fetch = i64::from(q.limit) + 1;
    let limit = bind(Sql::Integer(fetch));
    let tenant_p = bind(Sql::Text(tenant.to_owned()));
    let mut common = format!("tenant = {tenant_p}");
    if let Some(t) = q.created_after {
        common += &format!(" AND created_at > {}", bind(Sql::Integer(t.0)));
    }
    if let Some(t) = q.created_before {
        common += &format!(" AND created_at < {}", bind(Sql::Integer(t.0)));
    }
    if let Some(p) = &q.idempotency_key_prefix {
        common += &format!(" AND idempotency_key >= {}", bind(Sql::Text(p.clone())));
        if let Some(end) = q.key_prefix_end() {
            common += &format!(" AND idempotency_key < {}", bind(Sql::Text(end)));
        }
    }
    if let Some(x) = &q.external_txn_id {
        common += &format!(
            " AND id IN (SELECT task_id FROM attempts WHERE external_txn_id = {})",
            bind(Sql::Text(x.clone()))
        );
    }
    if let Some(c) = q.cursor {
        let at = bind(Sql::Integer(c.created_at.0));
        let id = bind(Sql::Text(c.id.to_string()));
        common += &format!(" AND (created_at, id) < ({at}, {id})");
    }
    let classes: Vec<Option<String>> = match (&q.operation, operations) {
        (Some(op), _) => vec![Some(op.clone())],
        (None, Some(ops)) => ops.iter().cloned().map(Some).collect(),
        (None, None) => vec![None],
    };
    let states = q.states_to_read();
    let mut parts = Vec::new();
    if q.external_txn_id.is_some() || q.idempotency_key_prefix.is_some() {
        // A narrow range of its own: one read, filtered.
        let states: Vec<String> = states
            .iter()
            .map(|s| bind(Sql::Text(s.as_str().to_owned())))
            .collect();
        let mut cond = format!("{common} AND state IN ({})", states.join(", "));
        if classes != [None] {
            let ops: Vec<String> = classes
                .iter()
                .flatten()
                .map(|o| bind(Sql::Text(o.clone())))
                .collect();
            cond += &format!(" AND operation IN ({})", ops.join(", "));
        }
        parts.push(cond);
    } else {
        for class in &classes {
            for s in &states {
                let mut cond = common.clone();
                if let Some(op) = class {
                    cond += &format!(" AND operation = {}", bind(Sql::Text(op.clone())));
                }
                cond += &format!(" AND state = {}", bind(Sql::Text(s.as_str().to_owned())));
                parts.push(cond);
            }
        }
    }
    let walks: Vec<String> = parts
        .iter()
        .map(|cond| {
            format!(
                "SELECT * FROM (SELECT id, created_at FROM tasks WHERE {cond} \
                 ORDER BY created_at DESC, id DESC LIMIT {limit})"
            )
        })
        .collect();
    let sql = format!(
        concat!(
            "SELECT ",
            task_columns!("t."),
            contract_text!("t."),
            " FROM ({}) p JOIN tasks t ON t.id = p.id \
             ORDER BY p.created_at DESC, p.id DESC LIMIT {}"
        ),
        walks.join(" UNION ALL "),
        limit
    );
    (sql, params)
}

impl TaskSearch for SqliteTx<'_> {
    async fn search_tasks(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        q: &TaskQuery,
    ) -> Result<Vec<Task>, StoreError> {
        let (sql, params) = page_sql(tenant, operations, q);
        let mut stmt = self.conn.prepare_cached(&sql).map_err(super::db)?;
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params.iter()), task_row)
            .map_err(super::db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }
}
