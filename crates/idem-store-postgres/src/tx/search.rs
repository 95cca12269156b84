//! [`TaskSearch`] on PostgreSQL: the statement of [`SearchPlan`] in
//! PostgreSQL's spelling. An idempotency-key prefix is a byte-wise range
//! with the `text_pattern_ops` operators `~>=~` and `~<~`, which
//! `tasks_search_key` serves whatever the database's collation; a list of
//! states or classes is one array parameter (`= ANY($n)`).

use idem_core::model::Task;
use idem_store::Result;
use idem_store::ops::search::{TaskQuery, TaskSearch};
use idem_store::plan::{Bound, Dialect, SearchPlan};
use tokio_postgres::types::ToSql;

use super::PgTx;
use crate::rows::{Param, TASK_COLUMNS, TaskCols, contract_text, task_from_row};

/// A parameter of a search statement.
type Owned = Box<dyn ToSql + Sync + Send>;

/// PostgreSQL's spelling of the plans of [`idem_store::plan`].
pub(crate) struct Postgres;

impl Dialect for Postgres {
    fn placeholder(&self, n: usize) -> String {
        format!("${n}")
    }

    fn byte_range(&self) -> (&'static str, &'static str) {
        ("~>=~", "~<~")
    }

    fn any_of(
        &self,
        column: &str,
        values: Vec<String>,
        bind: &mut dyn FnMut(Bound) -> String,
    ) -> String {
        format!("{column} = ANY({})", bind(Bound::Texts(values)))
    }

    fn union_member(&self, select: String) -> String {
        format!("({select})")
    }

    fn evidence_txn_id(&self) -> &'static str {
        "(body::jsonb ->> 'external_txn_id')"
    }
}

/// A planned value as a driver parameter.
fn owned(b: Bound) -> Owned {
    match b {
        Bound::Int(v) => Box::new(v),
        Bound::Text(v) => Box::new(v),
        Bound::Uuid(v) => Box::new(v),
        Bound::Texts(v) => Box::new(v),
    }
}

/// The statement and parameters of one page of `q` for `tenant`, in
/// `operations` when given ([`SearchPlan`]).
pub(crate) fn page_sql(
    tenant: &str,
    operations: Option<&[String]>,
    q: &TaskQuery,
) -> (String, Vec<Owned>) {
    let plan = SearchPlan::new(&Postgres, tenant, operations, q);
    let columns: Vec<String> = TASK_COLUMNS.iter().map(|c| format!("t.{c}")).collect();
    let sql = format!(
        "SELECT {}, {} FROM ({}) p JOIN tasks t ON t.id = p.id \
         ORDER BY p.created_at DESC, p.id DESC LIMIT {}",
        columns.join(", "),
        contract_text("t"),
        plan.walks,
        plan.limit,
    );
    (sql, plan.params.into_iter().map(owned).collect())
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
