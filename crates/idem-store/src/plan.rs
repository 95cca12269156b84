//! Statements both SQL backends build, written once: a plan emits the
//! clauses and the parameters of a statement, and a [`Dialect`] says how
//! each backend spells what differs (placeholders, a byte-wise range on
//! text, membership in a list, a sub-select in a `UNION ALL`).
//!
//! The backends keep what is theirs: the column lists, how a [`Bound`]
//! becomes a driver parameter, and running the statement.

use idem_core::model::TaskState;
use uuid::Uuid;

use crate::ops::search::{SecondEffectFilter, TaskQuery};

/// A value bound to a planned statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    /// A 64-bit integer (counts, epoch ms).
    Int(i64),
    /// A text.
    Text(String),
    /// A task's id.
    Uuid(Uuid),
    /// A list of texts, bound as one parameter where the dialect takes
    /// arrays ([`Dialect::any_of`]).
    Texts(Vec<String>),
}

/// How one SQL dialect spells what the plans need.
pub trait Dialect {
    /// The placeholder of the `n`-th parameter (1-based).
    fn placeholder(&self, n: usize) -> String;

    /// The operators of a byte-wise range on a text column, whatever the
    /// database's collation: (at least, below).
    fn byte_range(&self) -> (&'static str, &'static str);

    /// `column` is one of `values`: binds them through `bind` and returns the
    /// condition.
    fn any_of(
        &self,
        column: &str,
        values: Vec<String>,
        bind: &mut dyn FnMut(Bound) -> String,
    ) -> String;

    /// An ordered, limited sub-select as one member of a `UNION ALL`.
    fn union_member(&self, select: String) -> String;
}

/// Parameters bound in order, each answering its placeholder.
struct Binder<'d, D: Dialect + ?Sized> {
    dialect: &'d D,
    params: Vec<Bound>,
}

impl<D: Dialect + ?Sized> Binder<'_, D> {
    fn bind(&mut self, v: Bound) -> String {
        self.params.push(v);
        self.dialect.placeholder(self.params.len())
    }
}

/// One page of a task search ([`TaskQuery`]) for one tenant: a `UNION ALL`
/// of one ordered walk per state (and per class, when the page is limited to
/// some), each stopping at the page size (schema v5's `tasks_search_state`
/// and `tasks_search_operation` indexes); a filter on a provider's
/// transaction id or an idempotency-key prefix reads one range instead
/// (`attempts_external_txn`, `tasks_search_key`).
///
/// Each walk selects `id, created_at` of `tasks`; the backend joins the
/// union to the task's columns and orders and cuts it:
/// `SELECT … FROM ({walks}) p JOIN tasks t ON t.id = p.id ORDER BY
/// p.created_at DESC, p.id DESC LIMIT {limit}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchPlan {
    /// The walks, joined by `UNION ALL`.
    pub walks: String,
    /// The placeholder of the page size plus one (a page's last row tells
    /// whether another page follows).
    pub limit: String,
    /// The parameters, in placeholder order.
    pub params: Vec<Bound>,
}

impl SearchPlan {
    /// The plan of the page `q` asks for, of `tenant`'s tasks, in
    /// `operations` when given (a key granted some classes only).
    pub fn new<D: Dialect + ?Sized>(
        dialect: &D,
        tenant: &str,
        operations: Option<&[String]>,
        q: &TaskQuery,
    ) -> SearchPlan {
        let mut b = Binder {
            dialect,
            params: Vec::new(),
        };
        let limit = b.bind(Bound::Int(i64::from(q.limit) + 1));
        let mut common = format!("tenant = {}", b.bind(Bound::Text(tenant.to_owned())));
        if let Some(t) = q.created_after {
            common += &format!(" AND created_at > {}", b.bind(Bound::Int(t.0)));
        }
        if let Some(t) = q.created_before {
            common += &format!(" AND created_at < {}", b.bind(Bound::Int(t.0)));
        }
        if let Some(p) = &q.idempotency_key_prefix {
            let (at_least, below) = dialect.byte_range();
            let from = b.bind(Bound::Text(p.clone()));
            common += &format!(" AND idempotency_key {at_least} {from}");
            if let Some(end) = q.key_prefix_end() {
                let to = b.bind(Bound::Text(end));
                common += &format!(" AND idempotency_key {below} {to}");
            }
        }
        if let Some(x) = &q.external_txn_id {
            let x = b.bind(Bound::Text(x.clone()));
            common += &format!(
                " AND id IN (SELECT task_id FROM attempts WHERE external_txn_id = {x} \
                 UNION SELECT task_id FROM effect_reports WHERE external_txn_id = {x})"
            );
        }
        match q.second_effect {
            Some(SecondEffectFilter::Suspected) => {
                common += " AND id IN (SELECT task_id FROM second_effects)";
            }
            Some(SecondEffectFilter::Unacknowledged) => {
                common += " AND id IN (SELECT task_id FROM second_effects \
                           WHERE acknowledged_at IS NULL)";
            }
            None => {}
        }
        if let Some(c) = q.cursor {
            let at = b.bind(Bound::Int(c.created_at.0));
            let id = b.bind(Bound::Uuid(c.id));
            common += &format!(" AND (created_at, id) < ({at}, {id})");
        }
        let classes: Vec<Option<String>> = match (&q.operation, operations) {
            (Some(op), _) => vec![Some(op.clone())],
            (None, Some(ops)) => ops.iter().cloned().map(Some).collect(),
            (None, None) => vec![None],
        };
        let states = q.states_to_read();
        let mut parts = Vec::new();
        if q.external_txn_id.is_some()
            || q.idempotency_key_prefix.is_some()
            || q.second_effect.is_some()
        {
            // A narrow range of its own: one read, filtered.
            let names = states.iter().map(|s| s.as_str().to_owned()).collect();
            let mut cond = format!(
                "{common} AND {}",
                dialect.any_of("state", names, &mut |v| b.bind(v))
            );
            if classes != [None] {
                let ops = classes.iter().flatten().cloned().collect();
                cond += &format!(
                    " AND {}",
                    dialect.any_of("operation", ops, &mut |v| b.bind(v))
                );
            }
            parts.push(cond);
        } else {
            for class in &classes {
                for s in &states {
                    let mut cond = common.clone();
                    if let Some(op) = class {
                        cond += &format!(" AND operation = {}", b.bind(Bound::Text(op.clone())));
                    }
                    cond += &format!(" AND state = {}", b.bind(state(*s)));
                    parts.push(cond);
                }
            }
        }
        let walks: Vec<String> = parts
            .iter()
            .map(|cond| {
                dialect.union_member(format!(
                    "SELECT id, created_at FROM tasks WHERE {cond} \
                     ORDER BY created_at DESC, id DESC LIMIT {limit}"
                ))
            })
            .collect();
        SearchPlan {
            walks: walks.join(" UNION ALL "),
            limit,
            params: b.params,
        }
    }
}

fn state(s: TaskState) -> Bound {
    Bound::Text(s.as_str().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dialect that shows each of its choices in the text.
    struct Shown;

    impl Dialect for Shown {
        fn placeholder(&self, n: usize) -> String {
            format!("${n}")
        }
        fn byte_range(&self) -> (&'static str, &'static str) {
            (">=b", "<b")
        }
        fn any_of(
            &self,
            column: &str,
            values: Vec<String>,
            bind: &mut dyn FnMut(Bound) -> String,
        ) -> String {
            format!("{column} IN LIST {}", bind(Bound::Texts(values)))
        }
        fn union_member(&self, select: String) -> String {
            format!("[{select}]")
        }
    }

    #[test]
    fn a_walk_per_state_and_class_each_bound_in_order() {
        let q = TaskQuery {
            states: vec![TaskState::Queued, TaskState::Failed],
            limit: 10,
            ..TaskQuery::default()
        };
        let ops = ["a".to_owned(), "b".to_owned()];
        let plan = SearchPlan::new(&Shown, "acme", Some(&ops), &q);
        assert_eq!(plan.limit, "$1");
        assert_eq!(
            plan.walks.matches(" UNION ALL ").count(),
            3,
            "{}",
            plan.walks
        );
        assert!(plan.walks.starts_with(
            "[SELECT id, created_at FROM tasks WHERE tenant = $2 AND operation = $3 AND state = $4 \
             ORDER BY created_at DESC, id DESC LIMIT $1]"
        ), "{}", plan.walks);
        assert_eq!(plan.params[0], Bound::Int(11));
        assert_eq!(plan.params[1], Bound::Text("acme".into()));
        assert_eq!(plan.params.len(), 2 + 4 * 2);
    }

    #[test]
    fn a_key_prefix_reads_one_range_in_the_dialects_spelling() {
        let q = TaskQuery {
            idempotency_key_prefix: Some("order-".into()),
            limit: 5,
            ..TaskQuery::default()
        };
        let plan = SearchPlan::new(&Shown, "acme", None, &q);
        assert!(!plan.walks.contains("UNION ALL"), "{}", plan.walks);
        assert!(
            plan.walks
                .contains("idempotency_key >=b $3 AND idempotency_key <b $4"),
            "{}",
            plan.walks
        );
        assert!(plan.walks.contains("state IN LIST $5"), "{}", plan.walks);
        assert!(matches!(&plan.params[4], Bound::Texts(s) if s.len() == TaskState::ALL.len()));
    }
}
