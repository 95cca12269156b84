//! The mapping between SQLite rows and the model: column lists, decoding,
//! and the task statements built from [`Col`].

use std::sync::LazyLock;

use idem_core::contract::{ContractId, FrozenContract};
use idem_core::model::{
    ApiKey, AppliedReport, Attempt, AttemptKind, AttemptState, Role, Task, TaskControl, TaskState,
    Timestamp,
};
use idem_core::trace::TraceParent;
use idem_store::StoreError;
use rusqlite::Row;
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::db;

pub(super) fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

pub(super) fn to_json<T: Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(corrupt)
}

pub(super) fn from_json<T: DeserializeOwned>(s: &str) -> rusqlite::Result<T> {
    serde_json::from_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

pub(super) fn word<T: std::str::FromStr>(s: &str) -> rusqlite::Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    s.parse().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

pub(super) fn uuid(s: &str) -> rusqlite::Result<Uuid> {
    Uuid::parse_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

pub(super) fn opt_json<T: DeserializeOwned>(s: Option<String>) -> rusqlite::Result<Option<T>> {
    s.as_deref().map(from_json).transpose()
}

/// An attempt's `report` column: the applied report's body, with its outcome.
pub(super) fn applied_report(s: Option<String>) -> rusqlite::Result<Option<AppliedReport>> {
    opt_json(s)?
        .map(|body| {
            AppliedReport::from_body(body).map_err(|e| {
                rusqlite::Error::FromSqlConversionFailure(
                    0,
                    rusqlite::types::Type::Text,
                    Box::new(e),
                )
            })
        })
        .transpose()
}

pub(super) const API_KEY_COLUMNS: &str = "id, tenant, role, operations, created_at, revoked_at";

pub(super) fn api_key_row(r: &Row<'_>) -> rusqlite::Result<ApiKey> {
    Ok(ApiKey {
        id: uuid(&r.get::<_, String>(0)?)?,
        tenant: r.get(1)?,
        role: word::<Role>(&r.get::<_, String>(2)?)?,
        operations: opt_json(r.get(3)?)?,
        created_at: Timestamp(r.get(4)?),
        revoked_at: r.get::<_, Option<i64>>(5)?.map(Timestamp),
    })
}

/// The one list of the task table's columns: calls `$then!` with `$args`,
/// `;`, and the column names in table order. Everything else (the SELECT
/// lists, the INSERT and UPDATE placeholders, [`Col`]'s positions, which
/// [`task_row`] reads and [`task_values`] fills) is generated from it.
macro_rules! with_task_columns {
    ($then:ident!($($args:tt)*)) => {
        $then! { $($args)*; id, tenant, operation, idempotency_key, fingerprint, canonical_request, params, state, generation, version, event_seq, attempt_count, execute_count, usage, contract_id, cancellation, delivery, failure, api_key_id, next_kind, active_attempt_id, ready_at, deadline_at, terminal_at, key_expires_at, created_at, updated_at, attempts_granted, traceparent }
    };
}

/// The task columns, comma-separated, each after `prefix` (`""`, or `"t."`
/// for a join): a literal, so statements are built at compile time (the task
/// read runs on every replay).
macro_rules! task_columns {
    () => {
        task_columns!("")
    };
    ($prefix:literal) => {
        with_task_columns!(task_columns!(@ $prefix))
    };
    (@ $prefix:literal; $first:ident $(, $col:ident)*) => {
        concat!($prefix, stringify!($first) $(, ", ", $prefix, stringify!($col))*)
    };
}

/// Declares [`Col`], [`TASK_COLUMN_NAMES`] and [`TASK_COLUMN_COUNT`].
macro_rules! task_positions {
    (; $($col:ident),+) => {
        /// A task column, by its position in a task SELECT list and in
        /// [`task_values`] (0-based; its SQL parameter is `?` and one more).
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum Col {
            $($col),+
        }

        /// The task columns' names, by [`Col`].
        pub(super) const TASK_COLUMN_NAMES: &[&str] = &[$(stringify!($col)),+];

        /// How many columns a task has.
        pub(super) const TASK_COLUMN_COUNT: usize = TASK_COLUMN_NAMES.len();
    };
}

with_task_columns!(task_positions!());

impl Col {
    /// The column's position.
    pub(super) const fn at(self) -> usize {
        self as usize
    }
}

/// The columns a task update writes (the others are fixed at acceptance);
/// `version` is incremented by the statement itself.
pub(super) const TASK_UPDATED: &[Col] = &[
    Col::state,
    Col::generation,
    Col::version,
    Col::event_seq,
    Col::attempt_count,
    Col::execute_count,
    Col::attempts_granted,
    Col::usage,
    Col::cancellation,
    Col::delivery,
    Col::failure,
    Col::next_kind,
    Col::active_attempt_id,
    Col::ready_at,
    Col::deadline_at,
    Col::terminal_at,
    Col::key_expires_at,
    Col::updated_at,
];

/// `INSERT INTO tasks` of every column, bound from [`task_values`].
pub(super) static TASK_INSERT: LazyLock<String> = LazyLock::new(|| {
    let places: Vec<String> = (1..=TASK_COLUMN_COUNT).map(|i| format!("?{i}")).collect();
    format!(
        "INSERT INTO tasks ({}) VALUES ({})",
        task_columns!(),
        places.join(", ")
    )
});

/// The compare-and-set update of [`TASK_UPDATED`], bound from [`task_values`]
/// then the expected version and generation.
pub(super) static TASK_UPDATE: LazyLock<String> = LazyLock::new(|| {
    let set: Vec<String> = TASK_UPDATED
        .iter()
        .map(|&c| {
            let name = TASK_COLUMN_NAMES.get(c.at()).copied().unwrap_or_default();
            if c == Col::version {
                "version = version + 1".to_owned()
            } else {
                format!("{name} = ?{}", c.at() + 1)
            }
        })
        .collect();
    format!(
        "UPDATE tasks SET {} WHERE id = ?{} AND version = ?{} AND generation = ?{}",
        set.join(", "),
        Col::id.at() + 1,
        TASK_COLUMN_COUNT + 1,
        TASK_COLUMN_COUNT + 2
    )
});

/// The text of the task's contract (its `contracts` row), selected after
/// [`task_columns!`], at [`CONTRACT_TEXT`]; `$prefix` as there.
macro_rules! contract_text {
    ($prefix:literal) => {
        concat!(
            ", (SELECT c.contract FROM contracts c WHERE c.id = ",
            $prefix,
            "contract_id)"
        )
    };
}

/// Where a task SELECT has [`contract_text!`].
pub(super) const CONTRACT_TEXT: usize = TASK_COLUMN_COUNT;

/// A scope row joined with its task: [`task_columns!`] and
/// [`contract_text!`] (NULL when the task row is missing), then the scope's
/// fingerprint and task id.
pub(super) const SCOPE_WITH_TASK: &str = concat!(
    "SELECT ",
    task_columns!("t."),
    contract_text!("t."),
    ", k.fingerprint, k.task_id FROM idempotency_keys k \
     LEFT JOIN tasks t ON t.id = k.task_id \
     WHERE k.tenant = ?1 AND k.operation = ?2 AND k.idempotency_key = ?3"
);

/// Column `i` as text borrowed from the row (no copy before it is parsed).
pub(super) fn text<'r>(r: &'r Row<'_>, i: usize) -> rusqlite::Result<&'r str> {
    r.get_ref(i)?.as_str().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e))
    })
}

/// The task's contract: its `contract_id` and [`contract_text!`], decoded
/// once per process ([`idem_store::contracts::intern`]).
pub(super) fn contract(r: &Row<'_>) -> rusqlite::Result<FrozenContract> {
    let at = Col::contract_id.at();
    let id = r.get_ref(at)?.as_blob().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(at, rusqlite::types::Type::Blob, Box::new(e))
    })?;
    let id = ContractId::from_slice(id).ok_or(rusqlite::Error::InvalidColumnType(
        at,
        "contract_id".into(),
        rusqlite::types::Type::Blob,
    ))?;
    idem_store::contracts::intern(id, text(r, CONTRACT_TEXT)?).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(
            CONTRACT_TEXT,
            rusqlite::types::Type::Text,
            Box::new(e),
        )
    })
}

pub(super) fn task_row(r: &Row<'_>) -> rusqlite::Result<Task> {
    use Col as C;
    Ok(Task {
        id: uuid(text(r, C::id.at())?)?,
        operation: r.get(C::operation.at())?,
        idempotency_key: r.get(C::idempotency_key.at())?,
        fingerprint: r.get(C::fingerprint.at())?,
        params: from_json(text(r, C::params.at())?)?,
        state: word::<TaskState>(text(r, C::state.at())?)?,
        generation: r.get(C::generation.at())?,
        attempt_count: r.get(C::attempt_count.at())?,
        usage: r.get(C::usage.at())?,
        contract: contract(r)?,
        cancellation: opt_json(r.get(C::cancellation.at())?)?,
        delivery: opt_json(r.get(C::delivery.at())?)?,
        failure: opt_json(r.get(C::failure.at())?)?,
        created_at: Timestamp(r.get(C::created_at.at())?),
        updated_at: Timestamp(r.get(C::updated_at.at())?),
        traceparent: r
            .get::<_, Option<String>>(C::traceparent.at())?
            .as_deref()
            .map(word::<TraceParent>)
            .transpose()?,
        control: TaskControl {
            tenant: r.get(C::tenant.at())?,
            canonical_request: r.get(C::canonical_request.at())?,
            version: r.get(C::version.at())?,
            event_seq: r.get(C::event_seq.at())?,
            execute_count: r.get(C::execute_count.at())?,
            attempts_granted: r.get(C::attempts_granted.at())?,
            api_key_id: uuid(text(r, C::api_key_id.at())?)?,
            next_kind: r
                .get::<_, Option<String>>(C::next_kind.at())?
                .as_deref()
                .map(word::<AttemptKind>)
                .transpose()?,
            active_attempt_id: r
                .get::<_, Option<String>>(C::active_attempt_id.at())?
                .as_deref()
                .map(uuid)
                .transpose()?,
            ready_at: Timestamp(r.get(C::ready_at.at())?),
            deadline_at: Timestamp(r.get(C::deadline_at.at())?),
            terminal_at: r.get::<_, Option<i64>>(C::terminal_at.at())?.map(Timestamp),
            key_expires_at: r
                .get::<_, Option<i64>>(C::key_expires_at.at())?
                .map(Timestamp),
        },
    })
}

pub(super) const ATTEMPT_COLUMNS: &str = "id, task_id, number, generation, kind, state, executor_id, leased_at, lease_expires_at, \
     lease_ms, usage, external_txn_id, report";

pub(super) fn attempt_row(r: &Row<'_>) -> rusqlite::Result<Attempt> {
    Ok(Attempt {
        id: uuid(&r.get::<_, String>(0)?)?,
        task_id: uuid(&r.get::<_, String>(1)?)?,
        number: r.get(2)?,
        generation: r.get(3)?,
        kind: word::<AttemptKind>(&r.get::<_, String>(4)?)?,
        state: word::<AttemptState>(&r.get::<_, String>(5)?)?,
        executor_id: r.get(6)?,
        leased_at: Timestamp(r.get(7)?),
        lease_expires_at: Timestamp(r.get(8)?),
        lease_ms: r.get(9)?,
        usage: r.get(10)?,
        external_txn_id: r.get(11)?,
        report: applied_report(r.get(12)?)?,
        evidence: Vec::new(),
    })
}

pub(super) fn decode(e: rusqlite::Error) -> StoreError {
    match e {
        rusqlite::Error::FromSqlConversionFailure(..) | rusqlite::Error::InvalidColumnType(..) => {
            corrupt(e)
        }
        other => db(other),
    }
}

/// Every task column as an SQL value, at its [`Col`] position.
pub(super) fn task_values(t: &Task) -> Result<Vec<rusqlite::types::Value>, StoreError> {
    use rusqlite::types::Value as V;
    let text = |s: &str| V::Text(s.to_owned());
    let opt_text = |s: Option<String>| s.map_or(V::Null, V::Text);
    let opt_int = |i: Option<i64>| i.map_or(V::Null, V::Integer);
    let c = &t.control;
    let columns = [
        (Col::id, V::Text(t.id.to_string())),
        (Col::tenant, text(&c.tenant)),
        (Col::operation, text(&t.operation)),
        (Col::idempotency_key, text(&t.idempotency_key)),
        (Col::fingerprint, text(&t.fingerprint)),
        (Col::canonical_request, text(&c.canonical_request)),
        (Col::params, V::Text(to_json(&t.params)?)),
        (Col::state, text(t.state.as_str())),
        (Col::generation, V::Integer(t.generation)),
        (Col::version, V::Integer(c.version)),
        (Col::event_seq, V::Integer(c.event_seq)),
        (Col::attempt_count, V::Integer(t.attempt_count)),
        (Col::execute_count, V::Integer(c.execute_count)),
        (Col::attempts_granted, V::Integer(c.attempts_granted)),
        (Col::usage, V::Integer(t.usage)),
        (
            Col::contract_id,
            V::Blob(t.contract.id().as_bytes().to_vec()),
        ),
        (
            Col::cancellation,
            opt_text(t.cancellation.as_ref().map(to_json).transpose()?),
        ),
        (
            Col::delivery,
            opt_text(t.delivery.as_ref().map(to_json).transpose()?),
        ),
        (
            Col::failure,
            opt_text(t.failure.as_ref().map(to_json).transpose()?),
        ),
        (Col::api_key_id, V::Text(c.api_key_id.to_string())),
        (
            Col::next_kind,
            opt_text(c.next_kind.map(|k| k.as_str().to_owned())),
        ),
        (
            Col::active_attempt_id,
            opt_text(c.active_attempt_id.map(|id| id.to_string())),
        ),
        (Col::ready_at, V::Integer(c.ready_at.0)),
        (Col::deadline_at, V::Integer(c.deadline_at.0)),
        (Col::terminal_at, opt_int(c.terminal_at.map(|t| t.0))),
        (Col::key_expires_at, opt_int(c.key_expires_at.map(|t| t.0))),
        (Col::created_at, V::Integer(t.created_at.0)),
        (Col::updated_at, V::Integer(t.updated_at.0)),
        (
            Col::traceparent,
            opt_text(t.traceparent.as_ref().map(|tp| tp.as_str().to_owned())),
        ),
    ];
    let mut values = vec![V::Null; TASK_COLUMN_COUNT];
    for (col, value) in columns {
        if let Some(slot) = values.get_mut(col.at()) {
            *slot = value;
        }
    }
    Ok(values)
}
