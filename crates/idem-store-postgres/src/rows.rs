//! Rows of idem's PostgreSQL tables: the column lists, the statements built
//! from them, the parameter arrays of multi-row statements, and the decoding
//! of rows into the model.

use std::sync::LazyLock;

use idem_core::contract::{ContractId, FrozenContract};
use idem_core::model::{
    ApiKey, AppliedReport, Attempt, AttemptKind, AttemptState, Disposition, EffectAcknowledgment,
    EffectEvidence, EffectReport, EffectResolution, Event, EventData, EventKind, Evidence,
    EvidenceOutcome, Role, SecondEffect, Task, TaskControl, TaskState, Timestamp,
};
use idem_core::trace::TraceParent;
use idem_store::{ExistingScope, Result, ScopeRow, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, ToSql};
use uuid::Uuid;

use crate::error::corrupt;

pub(crate) type Param<'a> = &'a (dyn ToSql + Sync);

// ---------------------------------------------------------------- decoding

/// How a decoding helper finds a column of a row: by its name (`&str`), or at
/// a position found once for the whole result ([`At`]).
pub(crate) trait ColumnRef: Copy {
    /// The column's name, for errors.
    fn name(self) -> &'static str;
    /// The column's value in `row`.
    fn read<'r, T: FromSql<'r>>(
        self,
        row: &'r Row,
    ) -> std::result::Result<T, tokio_postgres::Error>;
}

impl ColumnRef for &'static str {
    fn name(self) -> &'static str {
        self
    }
    fn read<'r, T: FromSql<'r>>(
        self,
        row: &'r Row,
    ) -> std::result::Result<T, tokio_postgres::Error> {
        row.try_get(self)
    }
}

/// A column of a result at a position found by its name once per result
/// ([`At::find`]): tokio-postgres finds a column named in `try_get` by
/// comparing it with every column's name, for each column of each row (31
/// columns for a scope joined with its task).
#[derive(Debug, Clone, Copy)]
pub(crate) struct At {
    name: &'static str,
    index: usize,
}

impl At {
    /// Column `name` of a result with `columns`.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the result has no such column.
    pub(crate) fn find(columns: &[tokio_postgres::Column], name: &'static str) -> Result<At> {
        columns
            .iter()
            .position(|c| c.name() == name)
            .map(|index| At { name, index })
            .ok_or_else(|| corrupt(name, "the result has no such column"))
    }
}

impl ColumnRef for At {
    fn name(self) -> &'static str {
        self.name
    }
    fn read<'r, T: FromSql<'r>>(
        self,
        row: &'r Row,
    ) -> std::result::Result<T, tokio_postgres::Error> {
        row.try_get(self.index)
    }
}

pub(crate) fn get<'r, T: FromSql<'r>>(row: &'r Row, col: impl ColumnRef) -> Result<T> {
    col.read(row).map_err(|e| corrupt(col.name(), e))
}

pub(crate) fn word<T: std::str::FromStr>(row: &Row, col: impl ColumnRef) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    let s: &str = get(row, col)?;
    s.parse().map_err(|e| corrupt(col.name(), e))
}

pub(crate) fn opt_word<T: std::str::FromStr>(row: &Row, col: impl ColumnRef) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    let s: Option<&str> = get(row, col)?;
    s.map(|s| s.parse().map_err(|e| corrupt(col.name(), e)))
        .transpose()
}

pub(crate) fn json<T: DeserializeOwned>(row: &Row, col: impl ColumnRef) -> Result<T> {
    let s: &str = get(row, col)?;
    serde_json::from_str(s).map_err(|e| corrupt(col.name(), e))
}

/// An event of a row with the columns `seq, type, at, data`: the data typed
/// by the type ([`EventData::from_json`]).
pub(crate) fn event_from_row(row: &Row) -> Result<Event> {
    let kind = word::<EventKind>(row, "type")?;
    let text: &str = get(row, "data")?;
    Ok(Event {
        seq: get(row, "seq")?,
        kind,
        at: ts(row, "at")?,
        data: EventData::from_json(kind, text).map_err(|e| corrupt("data", e))?,
    })
}

pub(crate) fn opt_json<T: DeserializeOwned>(row: &Row, col: impl ColumnRef) -> Result<Option<T>> {
    let s: Option<&str> = get(row, col)?;
    s.map(|s| serde_json::from_str(s).map_err(|e| corrupt(col.name(), e)))
        .transpose()
}

pub(crate) fn ts(row: &Row, col: impl ColumnRef) -> Result<Timestamp> {
    get::<i64>(row, col).map(Timestamp)
}

pub(crate) fn opt_ts(row: &Row, col: impl ColumnRef) -> Result<Option<Timestamp>> {
    Ok(get::<Option<i64>>(row, col)?.map(Timestamp))
}

pub(crate) fn to_json<T: Serialize + ?Sized>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| corrupt(what, e))
}

pub(crate) fn opt_to_json<T: Serialize>(what: &str, v: Option<&T>) -> Result<Option<String>> {
    v.map(|v| to_json(what, v)).transpose()
}

// ---------------------------------------------------------------- api keys

pub(crate) const KEY_COLS: &str = "id, tenant, role, operations, created_at, revoked_at, serves";

pub(crate) fn api_key_from_row(row: &Row) -> Result<ApiKey> {
    Ok(ApiKey {
        id: get(row, "id")?,
        tenant: get(row, "tenant")?,
        role: word::<Role>(row, "role")?,
        operations: opt_json(row, "operations")?,
        created_at: ts(row, "created_at")?,
        revoked_at: opt_ts(row, "revoked_at")?,
        serves: opt_json(row, "serves")?,
    })
}

// ---------------------------------------------------------------- tasks

/// Declares the task columns once, in the order of [`TaskValues::params`]:
/// [`TASK_COLUMNS`] (their names), [`TASK_COLUMN_TYPES`] (their PostgreSQL
/// types) and [`TaskCols`] (where each is in a result).
macro_rules! task_columns {
    ($($field:ident: $ty:literal),+ $(,)?) => {
        /// How many columns a task has.
        pub(crate) const TASK_COLUMN_COUNT: usize = [$(stringify!($field)),+].len();

        /// Task columns in the order of [`TaskValues::params`]; `version` is at
        /// index 9.
        pub(crate) const TASK_COLUMNS: [&str; TASK_COLUMN_COUNT] = [$(stringify!($field)),+];

        /// PostgreSQL types of [`TASK_COLUMNS`], in order.
        pub(crate) const TASK_COLUMN_TYPES: [&str; TASK_COLUMN_COUNT] = [$($ty),+];

        /// Where each task column is in a result ([`At`]), found once per
        /// result rather than by name for every row.
        #[derive(Debug, Clone, Copy)]
        pub(crate) struct TaskCols {
            $($field: At,)+
            /// The contract's text ([`contract_text`]).
            contract: At,
        }

        impl TaskCols {
            /// The task columns of a result with `columns`.
            ///
            /// # Errors
            /// [`StoreError::Corrupt`] when one is missing.
            pub(crate) fn of(columns: &[tokio_postgres::Column]) -> Result<TaskCols> {
                Ok(TaskCols {
                    $($field: At::find(columns, stringify!($field))?,)+
                    contract: At::find(columns, "contract")?,
                })
            }
        }
    };
}

task_columns! {
    id: "uuid",
    tenant: "text",
    operation: "text",
    idempotency_key: "text",
    fingerprint: "text",
    canonical_request: "text",
    params: "text",
    state: "text",
    generation: "bigint",
    version: "bigint",
    event_seq: "bigint",
    attempt_count: "bigint",
    execute_count: "bigint",
    usage: "bigint",
    contract_id: "bytea",
    cancellation: "text",
    delivery: "text",
    failure: "text",
    api_key_id: "uuid",
    next_kind: "text",
    active_attempt_id: "uuid",
    ready_at: "bigint",
    deadline_at: "bigint",
    terminal_at: "bigint",
    key_expires_at: "bigint",
    created_at: "bigint",
    updated_at: "bigint",
    attempts_granted: "bigint",
    traceparent: "text",
    effect_report_count: "bigint",
    concurrency_key: "text",
    priority: "bigint",
    fairness_key: "text",
}

pub(crate) const VERSION_INDEX: usize = 9;

/// The text of the task's contract (its `contracts` row) as column `contract`,
/// for a task SELECT of `tasks` named `table`.
pub(crate) fn contract_text(table: &str) -> String {
    format!("(SELECT c.contract FROM contracts c WHERE c.id = {table}.contract_id) AS contract")
}

pub(crate) static TASK_SELECT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {}, {} FROM tasks WHERE id = $1",
        TASK_COLUMNS.join(", "),
        contract_text("tasks")
    )
});
pub(crate) static TASK_SELECT_LOCK: LazyLock<String> =
    LazyLock::new(|| format!("{} FOR UPDATE", *TASK_SELECT));
/// One column of `values`, for an array parameter.
pub(crate) fn column<'v, 't: 'v, T>(
    values: &'v [TaskValues<'t>],
    f: impl Fn(&'v TaskValues<'t>) -> T,
) -> Vec<T> {
    values.iter().map(f).collect()
}

/// Many tasks as one array per column, in [`TASK_COLUMNS`] order.
pub(crate) struct TaskArrays<'v> {
    ids: Vec<Uuid>,
    tenants: Vec<&'v str>,
    operations: Vec<&'v str>,
    keys: Vec<&'v str>,
    fingerprints: Vec<&'v str>,
    canonical: Vec<&'v str>,
    params: Vec<&'v str>,
    states: Vec<&'v str>,
    generations: Vec<i64>,
    versions: Vec<i64>,
    event_seqs: Vec<i64>,
    attempt_counts: Vec<i64>,
    execute_counts: Vec<i64>,
    usages: Vec<i64>,
    contract_ids: Vec<&'v [u8]>,
    cancellations: Vec<Option<&'v str>>,
    deliveries: Vec<Option<&'v str>>,
    failures: Vec<Option<&'v str>>,
    api_key_ids: Vec<Uuid>,
    next_kinds: Vec<Option<&'v str>>,
    active: Vec<Option<Uuid>>,
    ready: Vec<i64>,
    deadline: Vec<i64>,
    terminal: Vec<Option<i64>>,
    key_expires: Vec<Option<i64>>,
    created: Vec<i64>,
    updated: Vec<i64>,
    granted: Vec<i64>,
    traceparents: Vec<Option<&'v str>>,
    effect_report_counts: Vec<i64>,
    concurrency_keys: Vec<Option<&'v str>>,
    priorities: Vec<i64>,
    fairness_keys: Vec<Option<&'v str>>,
}

impl<'v> TaskArrays<'v> {
    pub(crate) fn new<'t: 'v>(values: &'v [TaskValues<'t>]) -> TaskArrays<'v> {
        TaskArrays {
            ids: column(values, |v| v.task.id),
            tenants: column(values, |v| v.task.control.tenant.as_str()),
            operations: column(values, |v| v.task.operation.as_str()),
            keys: column(values, |v| v.task.idempotency_key.as_str()),
            fingerprints: column(values, |v| v.task.fingerprint.as_str()),
            canonical: column(values, |v| v.task.control.canonical_request.as_str()),
            params: column(values, |v| v.params.as_str()),
            states: column(values, |v| v.state),
            generations: column(values, |v| v.task.generation),
            versions: column(values, |v| v.task.control.version),
            event_seqs: column(values, |v| v.task.control.event_seq),
            attempt_counts: column(values, |v| v.task.attempt_count),
            execute_counts: column(values, |v| v.task.control.execute_count),
            usages: column(values, |v| v.task.usage),
            contract_ids: column(values, |v| v.contract_id),
            cancellations: column(values, |v| v.cancellation.as_deref()),
            deliveries: column(values, |v| v.delivery.as_deref()),
            failures: column(values, |v| v.failure.as_deref()),
            api_key_ids: column(values, |v| v.task.control.api_key_id),
            next_kinds: column(values, |v| v.next_kind),
            active: column(values, |v| v.task.control.active_attempt_id),
            ready: column(values, |v| v.ready_at),
            deadline: column(values, |v| v.deadline_at),
            terminal: column(values, |v| v.terminal_at),
            key_expires: column(values, |v| v.key_expires_at),
            created: column(values, |v| v.created_at),
            updated: column(values, |v| v.updated_at),
            granted: column(values, |v| v.task.control.attempts_granted),
            traceparents: column(values, |v| {
                v.task.traceparent.as_ref().map(TraceParent::as_str)
            }),
            effect_report_counts: column(values, |v| v.task.control.effect_report_count),
            concurrency_keys: column(values, |v| v.task.control.concurrency_key.as_deref()),
            priorities: column(values, |v| v.task.priority),
            fairness_keys: column(values, |v| v.task.control.fairness_key.as_deref()),
        }
    }

    pub(crate) fn params(&self) -> [Param<'_>; TASK_COLUMN_COUNT] {
        [
            &self.ids,
            &self.tenants,
            &self.operations,
            &self.keys,
            &self.fingerprints,
            &self.canonical,
            &self.params,
            &self.states,
            &self.generations,
            &self.versions,
            &self.event_seqs,
            &self.attempt_counts,
            &self.execute_counts,
            &self.usages,
            &self.contract_ids,
            &self.cancellations,
            &self.deliveries,
            &self.failures,
            &self.api_key_ids,
            &self.next_kinds,
            &self.active,
            &self.ready,
            &self.deadline,
            &self.terminal,
            &self.key_expires,
            &self.created,
            &self.updated,
            &self.granted,
            &self.traceparents,
            &self.effect_report_counts,
            &self.concurrency_keys,
            &self.priorities,
            &self.fairness_keys,
        ]
    }
}

/// Events as one array per column: `task_id, seq, type, at, data`.
pub(crate) struct EventArrays<'e> {
    task_ids: Vec<Uuid>,
    seqs: Vec<i64>,
    kinds: Vec<&'e str>,
    ats: Vec<i64>,
    data: Vec<String>,
}

impl<'e> EventArrays<'e> {
    pub(crate) fn new(
        events: impl IntoIterator<Item = (Uuid, &'e Event)>,
    ) -> Result<EventArrays<'e>> {
        let mut a = EventArrays {
            task_ids: Vec::new(),
            seqs: Vec::new(),
            kinds: Vec::new(),
            ats: Vec::new(),
            data: Vec::new(),
        };
        for (task_id, e) in events {
            a.task_ids.push(task_id);
            a.seqs.push(e.seq);
            a.kinds.push(e.kind.as_str());
            a.ats.push(e.at.ms());
            a.data.push(to_json("event data", &e.data)?);
        }
        Ok(a)
    }

    pub(crate) fn params(&self) -> [Param<'_>; 5] {
        [
            &self.task_ids,
            &self.seqs,
            &self.kinds,
            &self.ats,
            &self.data,
        ]
    }
}

/// Events of existing tasks ($1–$5, [`EventArrays`]) in one statement, each
/// with its task's tenant and class and the feed's `txid`: this
/// transaction's id, or the task's previous event's when larger, so a task's
/// events keep their `seq` order in the feed (`crate::feed`); rows are
/// inserted in the arrays' order, so their positions (the column default,
/// taken per row as it is inserted) follow it. An event whose task does not
/// exist inserts no row. Answers each inserted row's tenant and class (the
/// change to announce).
pub(crate) const EVENTS_INSERT: &str = "INSERT INTO events (task_id, seq, type, at, data, tenant, operation, txid) \
     SELECT u.task_id, u.seq, u.type, u.at, u.data, t.tenant, t.operation, \
            greatest(pg_current_xact_id()::text::bigint, \
                     (SELECT max(p.txid) FROM events p WHERE p.task_id = u.task_id)) \
     FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::bigint[], $5::text[]) \
          WITH ORDINALITY AS u(task_id, seq, type, at, data, n) \
     JOIN tasks t ON t.id = u.task_id \
     ORDER BY u.n \
     RETURNING tenant, operation";

/// One contract row ($1 content id, $2 text), unless stored already.
pub(crate) const CONTRACT_INSERT: &str =
    "INSERT INTO contracts (id, contract) VALUES ($1, $2) ON CONFLICT DO NOTHING";

/// New tasks ($1–$n, one array per column of [`TASK_COLUMNS`], n =
/// [`TASK_COLUMN_COUNT`]), their events ($n+1–$n+5, each with its task's
/// tenant and class from $2 and $3; `txid` and `position` by default: a new
/// task has no earlier event) and the contract rows they name that may be
/// absent ($n+6 ids, $n+7 texts; written first, each unless stored already)
/// and the claim queues of the tasks (inserted or unparked, SPEC §2.13;
/// `fairness_key` is the last task column, $n) in one statement.
pub(crate) static TASKS_WITH_EVENTS_INSERT: LazyLock<String> = LazyLock::new(|| {
    let arrays: Vec<String> = TASK_COLUMN_TYPES
        .iter()
        .enumerate()
        .map(|(i, ty)| format!("${}::{ty}[]", i + 1))
        .collect();
    let n = TASK_COLUMN_COUNT;
    let at = |k: usize| n + k;
    format!(
        "WITH c AS (INSERT INTO contracts (id, contract) \
         SELECT * FROM unnest(${}::bytea[], ${}::text[]) ON CONFLICT DO NOTHING), \
         t AS (INSERT INTO tasks ({}) SELECT * FROM unnest({})), \
         q AS ({}) \
         INSERT INTO events (task_id, seq, type, at, data, tenant, operation) \
         SELECT e.task_id, e.seq, e.type, e.at, e.data, n.tenant, n.operation \
         FROM unnest(${}::uuid[], ${}::bigint[], ${}::text[], ${}::bigint[], ${}::text[]) \
              WITH ORDINALITY AS e(task_id, seq, type, at, data, i) \
         JOIN unnest($1::uuid[], $2::text[], $3::text[]) AS n(id, tenant, operation) ON n.id = e.task_id \
         ORDER BY e.i",
        at(6),
        at(7),
        TASK_COLUMNS.join(", "),
        arrays.join(", "),
        open_queues_sql("$2", "$3", &format!("${n}")),
        at(1),
        at(2),
        at(3),
        at(4),
        at(5),
    )
});

pub(crate) static TASK_INSERT: LazyLock<String> = LazyLock::new(|| {
    let params: Vec<String> = (1..=TASK_COLUMNS.len()).map(|i| format!("${i}")).collect();
    format!(
        "INSERT INTO tasks ({}) VALUES ({})",
        TASK_COLUMNS.join(", "),
        params.join(", ")
    )
});
/// `UPDATE tasks SET <every column but id and version> = $2…$n-1, version = version + 1
/// WHERE id = $1 AND version = $n AND generation = $n+1` (n = [`TASK_COLUMN_COUNT`]).
pub(crate) static TASK_UPDATE: LazyLock<String> = LazyLock::new(|| {
    let mut sets = Vec::new();
    let mut n = 1;
    for (i, col) in TASK_COLUMNS.iter().enumerate() {
        if i == VERSION_INDEX {
            continue;
        }
        if i > 0 {
            sets.push(format!("{col} = ${n}"));
        }
        n += 1;
    }
    sets.push("version = version + 1".to_owned());
    format!(
        "UPDATE tasks SET {} WHERE id = $1 AND version = ${} AND generation = ${}",
        sets.join(", "),
        n,
        n + 1
    )
});

/// Owned encodings of a task's non-scalar columns.
pub(crate) struct TaskValues<'t> {
    task: &'t Task,
    params: String,
    state: &'static str,
    contract_id: &'t [u8],
    cancellation: Option<String>,
    delivery: Option<String>,
    failure: Option<String>,
    next_kind: Option<&'static str>,
    ready_at: i64,
    deadline_at: i64,
    terminal_at: Option<i64>,
    key_expires_at: Option<i64>,
    created_at: i64,
    updated_at: i64,
    traceparent: Option<&'t str>,
}

impl<'t> TaskValues<'t> {
    pub(crate) fn new(task: &'t Task) -> Result<TaskValues<'t>> {
        let c = &task.control;
        Ok(TaskValues {
            task,
            params: to_json("params", &task.params)?,
            state: task.state.as_str(),
            contract_id: task.contract.id_bytes(),
            cancellation: opt_to_json("cancellation", task.cancellation.as_ref())?,
            delivery: opt_to_json("delivery", task.delivery.as_ref())?,
            failure: opt_to_json("failure", task.failure.as_ref())?,
            next_kind: c.next_kind.map(AttemptKind::as_str),
            ready_at: c.ready_at.ms(),
            deadline_at: c.deadline_at.ms(),
            terminal_at: c.terminal_at.map(Timestamp::ms),
            key_expires_at: c.key_expires_at.map(Timestamp::ms),
            created_at: task.created_at.ms(),
            updated_at: task.updated_at.ms(),
            traceparent: task.traceparent.as_ref().map(TraceParent::as_str),
        })
    }

    /// Parameters in [`TASK_COLUMNS`] order.
    pub(crate) fn params(&self) -> [Param<'_>; TASK_COLUMN_COUNT] {
        let t = self.task;
        let c = &t.control;
        [
            &t.id,
            &c.tenant,
            &t.operation,
            &t.idempotency_key,
            &t.fingerprint,
            &c.canonical_request,
            &self.params,
            &self.state,
            &t.generation,
            &c.version,
            &c.event_seq,
            &t.attempt_count,
            &c.execute_count,
            &t.usage,
            &self.contract_id,
            &self.cancellation,
            &self.delivery,
            &self.failure,
            &c.api_key_id,
            &self.next_kind,
            &c.active_attempt_id,
            &self.ready_at,
            &self.deadline_at,
            &self.terminal_at,
            &self.key_expires_at,
            &self.created_at,
            &self.updated_at,
            &c.attempts_granted,
            &self.traceparent,
            &c.effect_report_count,
            &c.concurrency_key,
            &t.priority,
            &c.fairness_key,
        ]
    }
}

/// The task of `row`, whose result has its columns at `c`.
pub(crate) fn task_from_row(row: &Row, c: &TaskCols) -> Result<Task> {
    Ok(Task {
        id: get(row, c.id)?,
        operation: get(row, c.operation)?,
        idempotency_key: get(row, c.idempotency_key)?,
        fingerprint: get(row, c.fingerprint)?,
        params: json(row, c.params)?,
        state: word::<TaskState>(row, c.state)?,
        generation: get(row, c.generation)?,
        attempt_count: get(row, c.attempt_count)?,
        usage: get(row, c.usage)?,
        contract: contract(row, c)?,
        cancellation: opt_json(row, c.cancellation)?,
        delivery: opt_json(row, c.delivery)?,
        failure: opt_json(row, c.failure)?,
        created_at: ts(row, c.created_at)?,
        updated_at: ts(row, c.updated_at)?,
        traceparent: opt_word::<TraceParent>(row, c.traceparent)?,
        priority: get(row, c.priority)?,
        // Read with the task by the operations that need them, when
        // `effect_report_count` is above 0 (`effects`, `second_effects_of`).
        second_effects: Vec::new(),
        control: TaskControl {
            tenant: get(row, c.tenant)?,
            api_key_id: get(row, c.api_key_id)?,
            canonical_request: get(row, c.canonical_request)?,
            version: get(row, c.version)?,
            event_seq: get(row, c.event_seq)?,
            execute_count: get(row, c.execute_count)?,
            attempts_granted: get(row, c.attempts_granted)?,
            next_kind: opt_word::<AttemptKind>(row, c.next_kind)?,
            active_attempt_id: get(row, c.active_attempt_id)?,
            ready_at: ts(row, c.ready_at)?,
            deadline_at: ts(row, c.deadline_at)?,
            terminal_at: opt_ts(row, c.terminal_at)?,
            key_expires_at: opt_ts(row, c.key_expires_at)?,
            effect_reports: Vec::new(),
            effect_report_count: get(row, c.effect_report_count)?,
            concurrency_key: get(row, c.concurrency_key)?,
            fairness_key: get(row, c.fairness_key)?,
        },
    })
}

/// The task's contract: its `contract_id` and [`contract_text`], decoded once
/// per process ([`idem_store::contracts::intern`]).
fn contract(row: &Row, c: &TaskCols) -> Result<FrozenContract> {
    let id: &[u8] = get(row, c.contract_id)?;
    let id = ContractId::from_slice(id)
        .ok_or_else(|| StoreError::Corrupt("contract_id is not 32 bytes".into()))?;
    idem_store::contracts::intern(id, get(row, c.contract)?).map_err(|e| corrupt("contract", e))
}

/// The task of a single row (its columns found in that row's result).
pub(crate) fn one_task_from_row(row: &Row) -> Result<Task> {
    task_from_row(row, &TaskCols::of(row.columns())?)
}

// ---------------------------------------------------------------- attempts

pub(crate) const ATTEMPT_COLS: &str = "id, task_id, number, generation, kind, state, executor_id, leased_at, \
     lease_expires_at, lease_ms, usage, external_txn_id, report";

pub(crate) fn attempt_from_row(row: &Row) -> Result<Attempt> {
    Ok(Attempt {
        id: get(row, "id")?,
        task_id: get(row, "task_id")?,
        number: get(row, "number")?,
        generation: get(row, "generation")?,
        kind: word::<AttemptKind>(row, "kind")?,
        state: word::<AttemptState>(row, "state")?,
        executor_id: get(row, "executor_id")?,
        leased_at: ts(row, "leased_at")?,
        lease_expires_at: ts(row, "lease_expires_at")?,
        usage: get(row, "usage")?,
        external_txn_id: get(row, "external_txn_id")?,
        evidence: Vec::new(),
        lease_ms: get(row, "lease_ms")?,
        report: opt_json(row, "report")?
            .map(|body| AppliedReport::from_body(body).map_err(|e| corrupt("report", e)))
            .transpose()?,
    })
}

/// The effect reports and second effects of one task (`$1`), in one read:
/// `suspected` tells the tables apart; each table's rows in insertion order.
pub(crate) const EFFECTS_SELECT: &str = "\
    SELECT false AS suspected, id, external_txn_id, attempt_id, generation, evidence, \
           reported_at AS at, NULL::text AS resolution, NULL::text AS reason, \
           NULL::text AS actor, NULL::bigint AS acknowledged_at \
      FROM effect_reports WHERE task_id = $1 \
    UNION ALL \
    SELECT true, id, external_txn_id, attempt_id, generation, evidence, suspected_at, \
           resolution, reason, actor, acknowledged_at \
      FROM second_effects WHERE task_id = $1 \
    ORDER BY 1, 2";

pub(crate) fn effect_report_from_row(row: &Row) -> Result<EffectReport> {
    Ok(EffectReport {
        external_txn_id: get(row, "external_txn_id")?,
        attempt_id: get(row, "attempt_id")?,
        generation: get(row, "generation")?,
        evidence: word::<EffectEvidence>(row, "evidence")?,
        reported_at: ts(row, "at")?,
    })
}

pub(crate) fn second_effect_from_row(row: &Row) -> Result<SecondEffect> {
    let acknowledgment = match opt_ts(row, "acknowledged_at")? {
        None => None,
        Some(acknowledged_at) => Some(EffectAcknowledgment {
            resolution: word::<EffectResolution>(row, "resolution")?,
            reason: get(row, "reason")?,
            actor: json(row, "actor")?,
            acknowledged_at,
        }),
    };
    Ok(SecondEffect {
        external_txn_id: get(row, "external_txn_id")?,
        attempt_id: get(row, "attempt_id")?,
        generation: get(row, "generation")?,
        evidence: word::<EffectEvidence>(row, "evidence")?,
        suspected_at: ts(row, "at")?,
        acknowledgment,
    })
}

pub(crate) fn evidence_from_row(row: &Row) -> Result<Evidence> {
    Ok(Evidence {
        received_at: ts(row, "received_at")?,
        generation: get(row, "generation")?,
        outcome: word::<EvidenceOutcome>(row, "outcome")?,
        body: json(row, "body")?,
        disposition: word::<Disposition>(row, "disposition")?,
    })
}

/// The claimable tasks of tenant `$1` in classes `$2` ready at `$3` (ms), lowest
/// claim rank first (`ready_at - priority * 10000`, SPEC §2.13, then `id`), at
/// most `$4`, locked `FOR UPDATE SKIP LOCKED`.
///
/// Candidates: one ordered walk of the partial index `tasks_claim_rank` per
/// distinct class (the WHERE repeats the index predicate), each stopping after
/// `$4 + 64` rows, merged oldest first; a claim's cost follows its
/// limit, not the backlog (migration 3). Then each candidate, in that order,
/// is locked by primary key (`FOR UPDATE SKIP LOCKED`, the predicate checked
/// again on the row as locked) until `$4` are held: a claim locks only the rows
/// it returns, and rows other claimers hold are skipped (up to 64 of them per
/// class before a claim comes back short).
pub(crate) const CLAIMABLE: &str = "SELECT t.id FROM ( \
       SELECT c.id, c.rank \
       FROM (SELECT DISTINCT op FROM unnest($2::text[]) AS u(op)) AS o CROSS JOIN LATERAL ( \
         SELECT id, (ready_at - priority * 10000) AS rank FROM tasks \
         WHERE tenant = $1 AND operation = o.op AND ready_at <= $3 \
           AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
           AND next_kind IS NOT NULL \
         ORDER BY (ready_at - priority * 10000), id LIMIT $4::bigint + 64) AS c \
       ORDER BY c.rank, c.id) AS candidate \
     CROSS JOIN LATERAL ( \
       SELECT id FROM tasks \
       WHERE id = candidate.id AND ready_at <= $3 \
         AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
         AND next_kind IS NOT NULL \
       FOR UPDATE SKIP LOCKED) AS t \
     ORDER BY candidate.rank, candidate.id LIMIT $4";

// ---------------------------------------------------------------- submit batches

/// The database clock (`clock_timestamp()`, not the transaction start), ms,
/// plus the offset `$1` of the backend's [`idem_store::Clock`] (0 in
/// production), added here so the database clock stays the one clock.
pub(crate) const NOW: &str =
    "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + $1::bigint AS now";

/// The database clock (ms) plus the offset `$2` ([`NOW`]) and which of the
/// keys `$1` are live (not revoked).
pub(crate) const NOW_AND_LIVE_KEYS: &str = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + $2::bigint AS now, \
     ARRAY(SELECT id FROM api_keys WHERE id = ANY($1) AND revoked_at IS NULL) AS live";

pub(crate) fn now_and_live(rows: &[Row]) -> Result<(Timestamp, std::collections::HashSet<Uuid>)> {
    let row = rows.first().ok_or_else(|| corrupt("now", "no row"))?;
    let live: Vec<Uuid> = get(row, "live")?;
    Ok((ts(row, "now")?, live.into_iter().collect()))
}

/// Scope rows ($1–$5, [`ScopeArrays`]) in one statement; returns the task ids of
/// the rows it inserted. A row whose scope is taken (or is being inserted by a
/// transaction still open, which this waits for) is skipped.
pub(crate) const SCOPES_INSERT: &str = "INSERT INTO idempotency_keys (tenant, operation, idempotency_key, fingerprint, task_id) \
     SELECT t, o, k, f, i FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::uuid[]) \
     WITH ORDINALITY AS u(t, o, k, f, i, n) ORDER BY n ON CONFLICT DO NOTHING RETURNING task_id";

/// Scope rows as one array per column, in a fixed (scope) order so that two
/// batches touching the same scopes lock them in the same order.
pub(crate) struct ScopeArrays<'r> {
    tenants: Vec<&'r str>,
    operations: Vec<&'r str>,
    keys: Vec<&'r str>,
    fingerprints: Vec<&'r str>,
    task_ids: Vec<Uuid>,
}

impl<'r> ScopeArrays<'r> {
    pub(crate) fn new(rows: &'r [ScopeRow]) -> ScopeArrays<'r> {
        let mut order: Vec<&ScopeRow> = rows.iter().collect();
        order.sort_by(|x, y| {
            (&x.tenant, &x.operation, &x.idempotency_key).cmp(&(
                &y.tenant,
                &y.operation,
                &y.idempotency_key,
            ))
        });
        ScopeArrays {
            tenants: order.iter().map(|r| r.tenant.as_str()).collect(),
            operations: order.iter().map(|r| r.operation.as_str()).collect(),
            keys: order.iter().map(|r| r.idempotency_key.as_str()).collect(),
            fingerprints: order.iter().map(|r| r.fingerprint.as_str()).collect(),
            task_ids: order.iter().map(|r| r.task_id).collect(),
        }
    }

    pub(crate) fn params(&self) -> [Param<'_>; 5] {
        [
            &self.tenants,
            &self.operations,
            &self.keys,
            &self.fingerprints,
            &self.task_ids,
        ]
    }
}

/// Which of `rows` [`SCOPES_INSERT`] inserted (its `RETURNING task_id`).
pub(crate) fn scopes_won(rows: &[ScopeRow], inserted: &[Row]) -> Result<Vec<bool>> {
    let won: std::collections::HashSet<Uuid> = inserted
        .iter()
        .map(|r| get::<Uuid>(r, "task_id"))
        .collect::<Result<_>>()?;
    Ok(rows.iter().map(|r| won.contains(&r.task_id)).collect())
}

/// The scope rows named by `$1–$3` (tenants, operations, idempotency keys) with
/// their tasks; `scope_n` is the 1-based position in the arrays.
pub(crate) static SCOPES_WITH_TASKS: LazyLock<String> = LazyLock::new(|| {
    let cols: Vec<String> = TASK_COLUMNS.iter().map(|c| format!("t.{c}")).collect();
    format!(
        "SELECT u.n AS scope_n, k.fingerprint AS scope_fingerprint, k.task_id AS scope_task_id, \
         t.id IS NOT NULL AS scope_has_task, {}, {} \
         FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(tn, op, ky, n) \
         JOIN idempotency_keys k ON k.tenant = u.tn AND k.operation = u.op AND k.idempotency_key = u.ky \
         LEFT JOIN tasks t ON t.id = k.task_id",
        cols.join(", "),
        contract_text("t")
    )
});

/// [`SCOPES_WITH_TASKS`] for the scopes whose submitting key (`$4`, one per
/// scope) is live: a scope of a revoked key is left out, as a missing one.
pub(crate) static LIVE_SCOPES_WITH_TASKS: LazyLock<String> = LazyLock::new(|| {
    let cols: Vec<String> = TASK_COLUMNS.iter().map(|c| format!("t.{c}")).collect();
    format!(
        "SELECT u.n AS scope_n, k.fingerprint AS scope_fingerprint, k.task_id AS scope_task_id, \
         t.id IS NOT NULL AS scope_has_task, {}, {} \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[]) WITH ORDINALITY AS u(tn, op, ky, kid, n) \
         JOIN api_keys a ON a.id = u.kid AND a.revoked_at IS NULL \
         JOIN idempotency_keys k ON k.tenant = u.tn AND k.operation = u.op AND k.idempotency_key = u.ky \
         LEFT JOIN tasks t ON t.id = k.task_id",
        cols.join(", "),
        contract_text("t")
    )
});

/// The parameters of [`SCOPES_WITH_TASKS`].
pub(crate) struct ScopeLookup<'s> {
    tenants: Vec<&'s str>,
    operations: Vec<&'s str>,
    keys: Vec<&'s str>,
}

impl<'s> ScopeLookup<'s> {
    pub(crate) fn new(scopes: &'s [(String, String, String)]) -> ScopeLookup<'s> {
        ScopeLookup {
            tenants: scopes.iter().map(|s| s.0.as_str()).collect(),
            operations: scopes.iter().map(|s| s.1.as_str()).collect(),
            keys: scopes.iter().map(|s| s.2.as_str()).collect(),
        }
    }

    pub(crate) fn params(&self) -> [Param<'_>; 3] {
        [&self.tenants, &self.operations, &self.keys]
    }
}

/// Decodes [`SCOPES_WITH_TASKS`] into one entry per scope asked, in order.
pub(crate) fn existing_scopes(
    scopes: &[(String, String, String)],
    rows: &[Row],
) -> Result<Vec<ExistingScope>> {
    let mut out: Vec<ExistingScope> = vec![None; scopes.len()];
    // Every row of one result has the same columns: find them once.
    let Some(first) = rows.first() else {
        return Ok(out);
    };
    let columns = first.columns();
    let (scope_n, scope_fingerprint, scope_task_id, scope_has_task) = (
        At::find(columns, "scope_n")?,
        At::find(columns, "scope_fingerprint")?,
        At::find(columns, "scope_task_id")?,
        At::find(columns, "scope_has_task")?,
    );
    // Only rows with a task need the task columns (a scope whose task row is
    // missing reads as NULLs, and a result of such rows still has them all).
    let task_cols = TaskCols::of(columns)?;
    for row in rows {
        let n: i64 = get(row, scope_n)?;
        let Some((i, (tenant, operation, key))) = usize::try_from(n - 1)
            .ok()
            .and_then(|i| scopes.get(i).map(|s| (i, s)))
        else {
            continue;
        };
        let scope = ScopeRow {
            tenant: tenant.clone(),
            operation: operation.clone(),
            idempotency_key: key.clone(),
            fingerprint: get(row, scope_fingerprint)?,
            task_id: get(row, scope_task_id)?,
        };
        let has_task: bool = get(row, scope_has_task)?;
        let task = if has_task {
            Some(task_from_row(row, &task_cols)?)
        } else {
            None
        };
        if let Some(slot) = out.get_mut(i) {
            *slot = Some((scope, task));
        }
    }
    Ok(out)
}

/// The database's identity now (`idem_store::identity`): the cluster's system
/// identifier (decimal text) and the timeline the primary writes WAL on, read
/// from the name of the current WAL file (its first 8 hex digits), which a
/// promoted standby answers with its new timeline at once
/// (`pg_control_checkpoint()` keeps the old one until the next checkpoint).
/// Fails on a standby (`pg_current_wal_lsn()` during recovery).
pub(crate) const DATABASE_IDENTITY: &str = "SELECT \
     (SELECT system_identifier::text FROM pg_control_system()) AS system_identifier, \
     ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint AS timeline";

/// Whether the recorded identity is the database's now, or none is recorded
/// (`Tx::identity_is_current`).
pub(crate) const IDENTITY_IS_CURRENT: &str = "SELECT NOT EXISTS (SELECT 1 FROM store_identity \
     WHERE restored \
        OR system_identifier IS DISTINCT FROM (SELECT system_identifier::text FROM pg_control_system()) \
        OR timeline IS DISTINCT FROM \
           ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint) AS current";

/// Inserts or unparks the queues of `(tenants[i], operations[i], values[i])`
/// (the tenant's queue, and the value's when `values[i]` is not NULL), each
/// at the lowest unparked turn of its level; a queue in the turn order is
/// not written. The conflict locks the queue row (in tenant, class, key
/// order) even then: a claim that holds the row and parks it (it saw none of
/// this transaction's tasks) commits first, and this statement then sees the
/// row parked and unparks it, so no waiting task is left in a parked queue.
/// Also the `q` CTE of the task insert (`TASKS_WITH_EVENTS_INSERT`).
pub(crate) fn open_queues_sql(tenants: &str, operations: &str, values: &str) -> String {
    format!(
        "INSERT INTO claim_turns (tenant, operation, fairness_key, turn) \
         SELECT n.tenant, n.operation, n.k, coalesce(CASE WHEN n.k = '' \
             THEN (SELECT min(m.turn) FROM claim_turns m WHERE m.operation = n.operation AND m.fairness_key = '' AND NOT m.parked) \
             ELSE (SELECT min(m.turn) FROM claim_turns m WHERE m.tenant = n.tenant AND m.operation = n.operation AND m.fairness_key <> '' AND NOT m.parked) \
           END, 0) \
         FROM (SELECT DISTINCT u.tenant, u.operation, k.k \
               FROM unnest({tenants}::text[], {operations}::text[], {values}::text[]) AS u(tenant, operation, fk) \
               CROSS JOIN LATERAL unnest(ARRAY['', '=' || u.fk]) AS k(k) WHERE k.k IS NOT NULL) AS n \
         ORDER BY n.tenant, n.operation, n.k \
         ON CONFLICT (tenant, operation, fairness_key) DO UPDATE SET parked = false, turn = EXCLUDED.turn \
         WHERE claim_turns.parked"
    )
}
