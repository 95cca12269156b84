//! [`TaskSearch`] on PostgreSQL: one statement per page, a `UNION ALL` of
//! one ordered walk per state (and per class, when the page is limited to
//! some), each stopping at the page size, merged and cut to the page (schema
//! v5's `tasks_search_state` and `tasks_search_operation` indexes).
//!
//! A filter on a provider's transaction id or an idempotency-key prefix
//! reads one range instead (`attempts_external_txn`, `tasks_search_key`: a
//! byte-wise range with the `text_pattern_ops` operators `~>=~` and `~<~`,
//! which that index serves whatever the database's collation).

use idem_core::model::Task;
use idem_store::Result;
use idem_store::ops::search::{TaskQuery, TaskSearch};
use tokio_postgres::types::ToSql;

use super::PgTx;
use crate::rows::{Param, TASK_COLUMNS, TaskCols, contract_text, task_from_row};

/// A parameter of a search statement.
type Owned = Box<dyn ToSql + Sync + Send>;

/// The statement and parameters of one page of `q` for `tenant`, in
/// `operations` when given.
pub(crate) fn page_sql(
    tenant: &str,
    operations: Option<&[String]>,
    q: &TaskQuery,
) -> (String, Vec<Owned>) {
    let mut params: Vec<Owned> = Vec::new();
    let mut bind = |v: Owned| {
        params.push(v);
        format!("${}", params.len())
    };
    let fetch = i64::from(q.limit) + 1;
    let limit = bind(Box::new(fetch));
    let mut common = format!("tenant = {}", bind(Box::new(tenant.to_owned())));
    if let Some(t) = q.created_after {
        common += &format!(" AND created_at > {}", bind(Box::new(t.0)));
    }
    if let Some(t) = q.created_before {
        common += &format!(" AND created_at < {}", bind(Box::new(t.0)));
    }
    if let Some(p) = &q.idempotency_key_prefix {
        common += &format!(" AND idempotency_key ~>=~ {}", bind(Box::new(p.clone())));
        if let Some(end) = q.key_prefix_end() {
            common += &format!(" AND idempotency_key ~<~ {}", bind(Box::new(end)));
        }
    }
    if let Some(x) = &q.external_txn_id {
        common += &format!(
            " AND id IN (SELECT task_id FROM attempts WHERE external_txn_id = {})",
            bind(Box::new(x.clone()))
        );
    }
    if let Some(c) = q.cursor {
        let at = bind(Box::new(c.created_at.0));
        let id = bind(Box::new(c.id));
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
        let states: Vec<String> = states.iter().map(|s| s.as_str().to_owned()).collect();
        let mut cond = format!("{common} AND state = ANY({})", bind(Box::new(states)));
        if classes != [None] {
            let ops: Vec<String> = classes.iter().flatten().cloned().collect();
            cond += &format!(" AND operation = ANY({})", bind(Box::new(ops)));
        }
        parts.push(cond);
    } else {
        for class in &classes {
            for s in &states {
                let mut cond = common.clone();
                if let Some(op) = class {
                    cond += &format!(" AND operation = {}", bind(Box::new(op.clone())));
                }
                cond += &format!(" AND state = {}", bind(Box::new(s.as_str().to_owned())));
                parts.push(cond);
            }
        }
    }
    let walks: Vec<String> = parts
        .iter()
        .map(|cond| {
            format!(
                "(SELECT id, created_at FROM tasks WHERE {cond} \
                 ORDER BY created_at DESC, id DESC LIMIT {limit})"
            )
        })
        .collect();
    let columns: Vec<String> = TASK_COLUMNS.iter().map(|c| format!("t.{c}")).collect();
    let sql = format!(
        "SELECT {}, {} FROM ({}) p JOIN tasks t ON t.id = p.id \
         ORDER BY p.created_at DESC, p.id DESC LIMIT {limit}",
        columns.join(", "),
        contract_text("t"),
        walks.join(" UNION ALL "),
    );
    (sql, params)
}

impl TaskSearch for PgTx<'_> {
    async fn search_tasks(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        q: &TaskQuery,
    ) -> Result<Vec<Task>> {
        let (sql, owned) = page_sql(tenant, operations, q);
        let params: Vec<Param<'_>> = owned.iter().map(|p| &**p as Param<'_>).collect();
        let rows = self.query(&sql, &params).await?;
        let Some(first) = rows.first() else {
            return Ok(Vec::new());
        };
        let cols = TaskCols::of(first.columns())?;
        rows.iter().map(|r| task_from_row(r, &cols)).collect()
    }
}
