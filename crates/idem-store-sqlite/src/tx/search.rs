//! [`TaskSearch`] on SQLite: the statement of [`SearchPlan`] in SQLite's
//! spelling.

use idem_store::StoreError;
use idem_store::ops::search::{TaskQuery, TaskSearch};
use idem_store::plan::{Bound, Dialect, SearchPlan};
use rusqlite::types::Value as Sql;

use super::{SqliteTx, decode, task_row};
use idem_core::model::Task;

/// SQLite's spelling of the plans of [`idem_store::plan`].
pub(crate) struct Sqlite;

impl Dialect for Sqlite {
    fn placeholder(&self, n: usize) -> String {
        format!("?{n}")
    }

    fn byte_range(&self) -> (&'static str, &'static str) {
        // Text compares byte-wise (the BINARY collation of every column).
        (">=", "<")
    }

    fn any_of(
        &self,
        column: &str,
        values: Vec<String>,
        bind: &mut dyn FnMut(Bound) -> String,
    ) -> String {
        let each: Vec<String> = values.into_iter().map(|v| bind(Bound::Text(v))).collect();
        format!("{column} IN ({})", each.join(", "))
    }

    fn union_member(&self, select: String) -> String {
        // A compound SELECT takes ORDER BY and LIMIT only at its end.
        format!("SELECT * FROM ({select})")
    }

    fn evidence_txn_id(&self) -> &'static str {
        "json_extract(body, '$.external_txn_id')"
    }
}

/// A planned value as a driver parameter. Lists are never planned here:
/// [`Sqlite::any_of`] binds each text of a list on its own.
fn sql_value(b: Bound) -> Sql {
    match b {
        Bound::Int(v) => Sql::Integer(v),
        Bound::Text(v) => Sql::Text(v),
        Bound::Uuid(v) => Sql::Text(v.to_string()),
        Bound::Texts(_) => Sql::Null,
    }
}

/// The statement and parameters of one page of `q` for `tenant`, in
/// `operations` when given ([`SearchPlan`]).
pub(crate) fn page_sql(
    tenant: &str,
    operations: Option<&[String]>,
    q: &TaskQuery,
) -> (String, Vec<Sql>) {
    let plan = SearchPlan::new(&Sqlite, tenant, operations, q);
    let sql = format!(
        concat!(
            "SELECT ",
            task_columns!("t."),
            contract_text!("t."),
            " FROM ({}) p JOIN tasks t ON t.id = p.id \
             ORDER BY p.created_at DESC, p.id DESC LIMIT {}"
        ),
        plan.walks, plan.limit
    );
    (sql, plan.params.into_iter().map(sql_value).collect())
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
