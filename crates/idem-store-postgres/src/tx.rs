//! [`Tx`] over one PostgreSQL transaction.

use std::collections::HashMap;
use std::sync::LazyLock;

use deadpool_postgres::Transaction;
use idem_core::model::{
    ApiKey, Attempt, AttemptKind, AttemptState, Event, Evidence, Role, Task, TaskControl,
    TaskState, Timestamp,
};
use idem_store::ops::{Submission, SubmitOutcome, SubmitPlan};
use idem_store::{ExistingScope, Result, ScopeRow, StoreError, Tx};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, ToSql};
use uuid::Uuid;

use crate::error::{corrupt, map_pg_error};

type Param<'a> = &'a (dyn ToSql + Sync);

/// Where statements go: an open READ COMMITTED transaction (every writing
/// operation), or the connection itself in autocommit for read-only operations
/// (each statement of a READ COMMITTED transaction takes its own snapshot
/// anyway, so this saves the BEGIN/COMMIT round trips and changes no answer).
enum Conn<'a> {
    Tx(Transaction<'a>),
    Auto(&'a deadpool_postgres::Client),
}

/// One operation's connection; implements [`Tx`]. Every statement is prepared
/// once per connection (`prepare_cached`).
pub struct PgTx<'a> {
    conn: Conn<'a>,
}

impl std::fmt::Debug for PgTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTx").finish_non_exhaustive()
    }
}

impl<'a> PgTx<'a> {
    /// Wraps an open transaction.
    pub fn new(tx: Transaction<'a>) -> PgTx<'a> {
        PgTx { conn: Conn::Tx(tx) }
    }

    /// Statements in autocommit: only for operations that do not write.
    pub fn autocommit(client: &'a deadpool_postgres::Client) -> PgTx<'a> {
        PgTx {
            conn: Conn::Auto(client),
        }
    }

    /// The transaction, to commit or roll back (`None` in autocommit).
    pub fn into_inner(self) -> Option<Transaction<'a>> {
        match self.conn {
            Conn::Tx(tx) => Some(tx),
            Conn::Auto(_) => None,
        }
    }

    /// The keys whose SHA-256 hex is in `hashes`, by hash: one statement for a
    /// whole batch of authentications.
    pub async fn api_keys_by_hashes(&self, hashes: &[String]) -> Result<HashMap<String, ApiKey>> {
        let rows = self
            .query(
                &format!("SELECT {KEY_COLS}, key_hash FROM api_keys WHERE key_hash = ANY($1)"),
                &[&hashes],
            )
            .await?;
        rows.iter()
            .map(|r| Ok((get::<String>(r, "key_hash")?, api_key_from_row(r)?)))
            .collect()
    }

    async fn statement(&self, sql: &str) -> Result<tokio_postgres::Statement> {
        match &self.conn {
            Conn::Tx(tx) => tx.prepare_cached(sql).await,
            Conn::Auto(c) => c.prepare_cached(sql).await,
        }
        .map_err(map_pg_error)
    }

    async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        let stmt = self.statement(sql).await?;
        match &self.conn {
            Conn::Tx(tx) => tx.query(&stmt, params).await,
            Conn::Auto(c) => c.query(&stmt, params).await,
        }
        .map_err(map_pg_error)
    }

    async fn query_opt(&self, sql: &str, params: &[Param<'_>]) -> Result<Option<Row>> {
        let stmt = self.statement(sql).await?;
        match &self.conn {
            Conn::Tx(tx) => tx.query_opt(&stmt, params).await,
            Conn::Auto(c) => c.query_opt(&stmt, params).await,
        }
        .map_err(map_pg_error)
    }

    /// New tasks and their events (`events[i]` belongs to `tasks[i]`) in one
    /// statement: tasks as one array per column (prepared once per connection
    /// whatever the batch size), events in a CTE. `stmt` is
    /// [`TASKS_WITH_EVENTS_INSERT`] prepared on this connection, so the request
    /// goes out on the future's first poll (the pipelined submit relies on it);
    /// nothing is sent for no tasks.
    async fn insert_new_tasks(
        &self,
        stmt: &tokio_postgres::Statement,
        tasks: &[Task],
        events: &[Vec<Event>],
    ) -> Result<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        let values = tasks
            .iter()
            .map(TaskValues::new)
            .collect::<Result<Vec<_>>>()?;
        let arrays = TaskArrays::new(&values);
        let events = EventArrays::new(
            tasks
                .iter()
                .zip(events)
                .flat_map(|(t, events)| events.iter().map(|e| (t.id, e))),
        )?;
        let mut params: Vec<Param<'_>> = arrays.params().to_vec();
        params.extend(events.params());
        match &self.conn {
            Conn::Tx(tx) => tx.execute(stmt, &params).await,
            Conn::Auto(c) => c.execute(stmt, &params).await,
        }
        .map_err(map_pg_error)?;
        Ok(())
    }

    async fn exec(&self, sql: &str, params: &[Param<'_>]) -> Result<u64> {
        let stmt = self.statement(sql).await?;
        match &self.conn {
            Conn::Tx(tx) => tx.execute(&stmt, params).await,
            Conn::Auto(c) => c.execute(&stmt, params).await,
        }
        .map_err(map_pg_error)
    }
}

/// A submit batch to run as one pipelined transaction
/// ([`PgTx::submit_pipelined`]).
pub(crate) struct Pipelined<'s>(pub(crate) &'s [Submission]);

impl PgTx<'_> {
    /// Runs the [`SubmitPlan`] of `subs` in two round trips instead of five,
    /// using the protocol's pipelining. Round trip 1: `BEGIN`, the clock and key
    /// check, the scope rows. Round trip 2: the new tasks with their events and
    /// `COMMIT` (a batch that won every scope), or the read-back of the taken
    /// scopes and `COMMIT` (a batch that won none, so wrote nothing). A batch
    /// with both sends the tasks and the read-back, and commits in a third round
    /// trip once every answer is decoded. Each statement still runs in order in
    /// one READ COMMITTED transaction, with its own snapshot, and the plan
    /// decides every answer, so the answers are those of [`SubmitPlan::run`],
    /// and nothing can fail after a `COMMIT` that wrote something. Only on an
    /// autocommit [`PgTx`] (the connection itself).
    ///
    /// Answers `None`, with nothing written, when a submitting key is revoked:
    /// run the batch as an ordinary transaction, which refuses that key's
    /// submissions only.
    ///
    /// A failed statement aborts the transaction, and PostgreSQL then ends a
    /// pipelined `COMMIT` as a rollback: errors are read in statement order and
    /// the first one is returned, with nothing written. On any error a
    /// `ROLLBACK` is sent, so the connection goes back to the pool idle.
    ///
    /// # Errors
    /// As [`SubmitPlan::run`]: [`StoreError::Contention`] (run it again; also
    /// when a taken scope's row vanished before the read-back),
    /// [`StoreError::Unavailable`] (connection lost; if during `COMMIT`, the
    /// outcome is unknown), [`StoreError::Corrupt`].
    pub(crate) async fn submit_pipelined(
        &self,
        subs: &[Submission],
    ) -> Result<Option<Vec<SubmitOutcome>>> {
        let Conn::Auto(client) = &self.conn else {
            return Err(StoreError::Corrupt(
                "a pipelined submit opens its own transaction".into(),
            ));
        };
        let res = self.submit_pipelined_on(client, subs).await;
        if res.is_err() {
            // After a COMMIT this only draws a warning ("no transaction").
            let _ = client.batch_execute("ROLLBACK").await;
        }
        res
    }

    async fn submit_pipelined_on(
        &self,
        client: &deadpool_postgres::Client,
        subs: &[Submission],
    ) -> Result<Option<Vec<SubmitOutcome>>> {
        let keys_stmt = self.statement(NOW_AND_LIVE_KEYS).await?;
        let scopes_stmt = self.statement(SCOPES_INSERT).await?;
        let tasks_stmt = self.statement(&TASKS_WITH_EVENTS_INSERT).await?;
        let lookup_stmt = self.statement(&SCOPES_WITH_TASKS).await?;
        let mut plan = SubmitPlan::new(subs);
        let (now, live, won) = {
            let scope_arrays = ScopeArrays::new(plan.scope_rows());
            let keys = plan.keys();
            let keys_params: [Param<'_>; 1] = [&keys];
            let scope_params = scope_arrays.params();
            // Round trip 1. `biased` polls in order, so the requests go out in
            // order. Should BEGIN fail, the scope insert would fail too: its
            // foreign key to `tasks` is checked at commit, and there is no task yet.
            let (begun, keys, inserted) = tokio::join!(
                biased;
                client.batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED"),
                client.query(&keys_stmt, &keys_params),
                client.query(&scopes_stmt, &scope_params),
            );
            begun.map_err(map_pg_error)?;
            let (now, live) = now_and_live(&keys.map_err(map_pg_error)?)?;
            let won = scopes_won(plan.scope_rows(), &inserted.map_err(map_pg_error)?)?;
            (now, live, won)
        };
        if !plan.check_keys(&live) {
            client
                .batch_execute("ROLLBACK")
                .await
                .map_err(map_pg_error)?;
            return Ok(None);
        }
        let accepted = plan.accept(&won, now)?;
        let (created, journals) = accepted.new_tasks();
        let lookup = ScopeLookup::new(accepted.taken());
        let lookup_params = lookup.params();
        if accepted.taken().is_empty() {
            // Round trip 2 of a batch of new scopes only: tasks and events, COMMIT.
            // Nothing is left to decode after COMMIT, so no error can follow it.
            let (tasks_written, committed) = tokio::join!(
                biased;
                self.insert_new_tasks(&tasks_stmt, created, journals),
                client.batch_execute("COMMIT"),
            );
            // In statement order: a failed insert turned COMMIT into a rollback.
            tasks_written?;
            committed.map_err(map_pg_error)?;
            drop(lookup);
            return accepted.answer_all(Vec::new()).map(Some);
        }
        if created.is_empty() {
            // Round trip 2 of a batch that won no scope (replays and conflicts
            // only): the read-back and COMMIT. The batch wrote nothing, so an
            // error found after COMMIT (a row that does not decode, a vanished
            // scope) leaves nothing behind either, and the batch may run again.
            let (existing, committed) = tokio::join!(
                biased;
                client.query(&lookup_stmt, &lookup_params),
                client.batch_execute("COMMIT"),
            );
            let existing = existing.map_err(map_pg_error)?;
            committed.map_err(map_pg_error)?;
            let existing = existing_scopes(accepted.taken(), &existing)?;
            drop(lookup);
            return accepted.answer_all(existing).map(Some);
        }
        // Round trip 2 of a batch with both: tasks and events, then the read-back,
        // a later statement, so it sees the scope rows that beat this batch
        // (committed) and the tasks this batch just wrote (two submissions of
        // one scope in a batch). COMMIT waits for round trip 3, once every
        // answer is decoded: any failure until then writes nothing.
        let (tasks_written, existing) = tokio::join!(
            biased;
            self.insert_new_tasks(&tasks_stmt, created, journals),
            client.query(&lookup_stmt, &lookup_params),
        );
        tasks_written?;
        let existing = existing_scopes(accepted.taken(), &existing.map_err(map_pg_error)?)?;
        drop(lookup);
        let outcomes = accepted.answer_all(existing)?;
        client.batch_execute("COMMIT").await.map_err(map_pg_error)?;
        Ok(Some(outcomes))
    }
}

// ---------------------------------------------------------------- decoding

/// How a decoding helper finds a column of a row: by its name (`&str`), or at
/// a position found once for the whole result ([`At`]).
trait ColumnRef: Copy {
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
/// comparing it with every column's name, which for the 31 columns of a
/// scope joined with its task cost about 5,000 instructions per row.
#[derive(Debug, Clone, Copy)]
struct At {
    name: &'static str,
    index: usize,
}

impl At {
    /// Column `name` of a result with `columns`.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the result has no such column.
    fn find(columns: &[tokio_postgres::Column], name: &'static str) -> Result<At> {
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

fn get<'r, T: FromSql<'r>>(row: &'r Row, col: impl ColumnRef) -> Result<T> {
    col.read(row).map_err(|e| corrupt(col.name(), e))
}

fn word<T: std::str::FromStr>(row: &Row, col: impl ColumnRef) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    let s: &str = get(row, col)?;
    s.parse().map_err(|e| corrupt(col.name(), e))
}

fn opt_word<T: std::str::FromStr>(row: &Row, col: impl ColumnRef) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    let s: Option<&str> = get(row, col)?;
    s.map(|s| s.parse().map_err(|e| corrupt(col.name(), e)))
        .transpose()
}

fn json<T: DeserializeOwned>(row: &Row, col: impl ColumnRef) -> Result<T> {
    let s: &str = get(row, col)?;
    serde_json::from_str(s).map_err(|e| corrupt(col.name(), e))
}

fn opt_json<T: DeserializeOwned>(row: &Row, col: impl ColumnRef) -> Result<Option<T>> {
    let s: Option<&str> = get(row, col)?;
    s.map(|s| serde_json::from_str(s).map_err(|e| corrupt(col.name(), e)))
        .transpose()
}

fn ts(row: &Row, col: impl ColumnRef) -> Result<Timestamp> {
    get::<i64>(row, col).map(Timestamp)
}

fn opt_ts(row: &Row, col: impl ColumnRef) -> Result<Option<Timestamp>> {
    Ok(get::<Option<i64>>(row, col)?.map(Timestamp))
}

fn to_json<T: Serialize + ?Sized>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| corrupt(what, e))
}

fn opt_to_json<T: Serialize>(what: &str, v: Option<&T>) -> Result<Option<String>> {
    v.map(|v| to_json(what, v)).transpose()
}

// ---------------------------------------------------------------- api keys

const KEY_COLS: &str = "id, tenant, role, operations, created_at, revoked_at";

fn api_key_from_row(row: &Row) -> Result<ApiKey> {
    Ok(ApiKey {
        id: get(row, "id")?,
        tenant: get(row, "tenant")?,
        role: word::<Role>(row, "role")?,
        operations: opt_json(row, "operations")?,
        created_at: ts(row, "created_at")?,
        revoked_at: opt_ts(row, "revoked_at")?,
    })
}

// ---------------------------------------------------------------- tasks

/// Declares the task columns once, in the order of [`TaskValues::params`]:
/// [`TASK_COLUMNS`] (their names), [`TASK_COLUMN_TYPES`] (their PostgreSQL
/// types) and [`TaskCols`] (where each is in a result).
macro_rules! task_columns {
    ($($field:ident: $ty:literal),+ $(,)?) => {
        /// How many columns a task has.
        const TASK_COLUMN_COUNT: usize = [$(stringify!($field)),+].len();

        /// Task columns in the order of [`TaskValues::params`]; `version` is at
        /// index 9.
        const TASK_COLUMNS: [&str; TASK_COLUMN_COUNT] = [$(stringify!($field)),+];

        /// PostgreSQL types of [`TASK_COLUMNS`], in order.
        const TASK_COLUMN_TYPES: [&str; TASK_COLUMN_COUNT] = [$($ty),+];

        /// Where each task column is in a result ([`At`]), found once per
        /// result rather than by name for every row.
        #[derive(Debug, Clone, Copy)]
        struct TaskCols {
            $($field: At,)+
        }

        impl TaskCols {
            /// The task columns of a result with `columns`.
            ///
            /// # Errors
            /// [`StoreError::Corrupt`] when one is missing.
            fn of(columns: &[tokio_postgres::Column]) -> Result<TaskCols> {
                Ok(TaskCols {
                    $($field: At::find(columns, stringify!($field))?,)+
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
    contract: "text",
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
}

const VERSION_INDEX: usize = 9;

static TASK_SELECT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM tasks WHERE id = $1",
        TASK_COLUMNS.join(", ")
    )
});
static TASK_SELECT_LOCK: LazyLock<String> =
    LazyLock::new(|| format!("{} FOR UPDATE", *TASK_SELECT));
/// One column of `values`, for an array parameter.
fn column<'v, 't: 'v, T>(
    values: &'v [TaskValues<'t>],
    f: impl Fn(&'v TaskValues<'t>) -> T,
) -> Vec<T> {
    values.iter().map(f).collect()
}

/// Many tasks as one array per column, in [`TASK_COLUMNS`] order.
struct TaskArrays<'v> {
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
    contracts: Vec<&'v str>,
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
}

impl<'v> TaskArrays<'v> {
    fn new<'t: 'v>(values: &'v [TaskValues<'t>]) -> TaskArrays<'v> {
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
            contracts: column(values, |v| v.contract.as_str()),
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
        }
    }

    fn params(&self) -> [Param<'_>; TASK_COLUMN_COUNT] {
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
            &self.contracts,
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
        ]
    }
}

/// Events as one array per column: `task_id, seq, type, at, data`.
struct EventArrays<'e> {
    task_ids: Vec<Uuid>,
    seqs: Vec<i64>,
    kinds: Vec<&'e str>,
    ats: Vec<i64>,
    data: Vec<String>,
}

impl<'e> EventArrays<'e> {
    fn new(events: impl IntoIterator<Item = (Uuid, &'e Event)>) -> Result<EventArrays<'e>> {
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

    fn params(&self) -> [Param<'_>; 5] {
        [
            &self.task_ids,
            &self.seqs,
            &self.kinds,
            &self.ats,
            &self.data,
        ]
    }
}

/// Events ($1–$5, [`EventArrays`]) in one statement.
const EVENTS_INSERT: &str = "INSERT INTO events (task_id, seq, type, at, data) \
     SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::bigint[], $5::text[])";

/// New tasks ($1–$27, one array per column of [`TASK_COLUMNS`]) and their
/// events ($28–$32) in one statement.
static TASKS_WITH_EVENTS_INSERT: LazyLock<String> = LazyLock::new(|| {
    let arrays: Vec<String> = TASK_COLUMN_TYPES
        .iter()
        .enumerate()
        .map(|(i, ty)| format!("${}::{ty}[]", i + 1))
        .collect();
    format!(
        "WITH t AS (INSERT INTO tasks ({}) SELECT * FROM unnest({})) \
         INSERT INTO events (task_id, seq, type, at, data) \
         SELECT * FROM unnest($28::uuid[], $29::bigint[], $30::text[], $31::bigint[], $32::text[])",
        TASK_COLUMNS.join(", "),
        arrays.join(", ")
    )
});

static TASK_INSERT: LazyLock<String> = LazyLock::new(|| {
    let params: Vec<String> = (1..=TASK_COLUMNS.len()).map(|i| format!("${i}")).collect();
    format!(
        "INSERT INTO tasks ({}) VALUES ({})",
        TASK_COLUMNS.join(", "),
        params.join(", ")
    )
});
/// `UPDATE tasks SET <every column but id and version> = $2…$26, version = version + 1
/// WHERE id = $1 AND version = $27 AND generation = $28`.
static TASK_UPDATE: LazyLock<String> = LazyLock::new(|| {
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
struct TaskValues<'t> {
    task: &'t Task,
    params: String,
    state: &'static str,
    contract: String,
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
}

impl<'t> TaskValues<'t> {
    fn new(task: &'t Task) -> Result<TaskValues<'t>> {
        let c = &task.control;
        Ok(TaskValues {
            task,
            params: to_json("params", &task.params)?,
            state: task.state.as_str(),
            contract: idem_core::model::contract_json(&task.contract)
                .map_err(|e| corrupt("contract", e))?,
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
        })
    }

    /// Parameters in [`TASK_COLUMNS`] order.
    fn params(&self) -> [Param<'_>; TASK_COLUMN_COUNT] {
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
            &self.contract,
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
        ]
    }
}

/// The task of `row`, whose result has its columns at `c`.
fn task_from_row(row: &Row, c: &TaskCols) -> Result<Task> {
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
        contract: idem_store::decode_contract(get(row, c.contract)?)
            .map_err(|e| corrupt("contract", e))?,
        cancellation: opt_json(row, c.cancellation)?,
        delivery: opt_json(row, c.delivery)?,
        failure: opt_json(row, c.failure)?,
        created_at: ts(row, c.created_at)?,
        updated_at: ts(row, c.updated_at)?,
        control: TaskControl {
            tenant: get(row, c.tenant)?,
            api_key_id: get(row, c.api_key_id)?,
            canonical_request: get(row, c.canonical_request)?,
            version: get(row, c.version)?,
            event_seq: get(row, c.event_seq)?,
            execute_count: get(row, c.execute_count)?,
            next_kind: opt_word::<AttemptKind>(row, c.next_kind)?,
            active_attempt_id: get(row, c.active_attempt_id)?,
            ready_at: ts(row, c.ready_at)?,
            deadline_at: ts(row, c.deadline_at)?,
            terminal_at: opt_ts(row, c.terminal_at)?,
            key_expires_at: opt_ts(row, c.key_expires_at)?,
        },
    })
}

/// The task of a single row (its columns found in that row's result).
fn one_task_from_row(row: &Row) -> Result<Task> {
    task_from_row(row, &TaskCols::of(row.columns())?)
}

// ---------------------------------------------------------------- attempts

const ATTEMPT_COLS: &str = "id, task_id, number, generation, kind, state, executor_id, leased_at, \
     lease_expires_at, lease_ms, usage, external_txn_id, report";

fn attempt_from_row(row: &Row) -> Result<Attempt> {
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
        report: opt_json(row, "report")?,
    })
}

fn evidence_from_row(row: &Row) -> Result<Evidence> {
    Ok(Evidence {
        received_at: ts(row, "received_at")?,
        generation: get(row, "generation")?,
        outcome: get(row, "outcome")?,
        body: json(row, "body")?,
        disposition: get(row, "disposition")?,
    })
}

/// The claimable tasks of tenant `$1` in classes `$2` ready at `$3` (ms), oldest
/// first (`ready_at`, then `id`), at most `$4`, locked `FOR UPDATE SKIP LOCKED`.
///
/// Candidates: one ordered walk of the partial index `tasks_claim_order` per
/// distinct class (the WHERE repeats the index predicate), each stopping after
/// `$4 + 64` rows, merged oldest first; a claim's cost follows its
/// limit, not the backlog (migration 3). Then each candidate, in that order,
/// is locked by primary key (`FOR UPDATE SKIP LOCKED`, the predicate checked
/// again on the row as locked) until `$4` are held: a claim locks only the rows
/// it returns, and rows other claimers hold are skipped (up to 64 of them per
/// class before a claim comes back short).
pub(crate) const CLAIMABLE: &str = "SELECT t.id FROM ( \
       SELECT c.id, c.ready_at \
       FROM (SELECT DISTINCT op FROM unnest($2::text[]) AS u(op)) AS o CROSS JOIN LATERAL ( \
         SELECT id, ready_at FROM tasks \
         WHERE tenant = $1 AND operation = o.op AND ready_at <= $3 \
           AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
           AND next_kind IS NOT NULL \
         ORDER BY ready_at, id LIMIT $4::bigint + 64) AS c \
       ORDER BY c.ready_at, c.id) AS candidate \
     CROSS JOIN LATERAL ( \
       SELECT id FROM tasks \
       WHERE id = candidate.id AND ready_at <= $3 \
         AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling') \
         AND next_kind IS NOT NULL \
       FOR UPDATE SKIP LOCKED) AS t \
     ORDER BY candidate.ready_at, candidate.id LIMIT $4";

// ---------------------------------------------------------------- submit batches

/// The database clock (ms) and which of the keys `$1` are live (not revoked).
const NOW_AND_LIVE_KEYS: &str = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now, \
     ARRAY(SELECT id FROM api_keys WHERE id = ANY($1) AND revoked_at IS NULL) AS live";

fn now_and_live(rows: &[Row]) -> Result<(Timestamp, std::collections::HashSet<Uuid>)> {
    let row = rows.first().ok_or_else(|| corrupt("now", "no row"))?;
    let live: Vec<Uuid> = get(row, "live")?;
    Ok((ts(row, "now")?, live.into_iter().collect()))
}

/// Scope rows ($1–$5, [`ScopeArrays`]) in one statement; returns the task ids of
/// the rows it inserted. A row whose scope is taken (or is being inserted by a
/// transaction still open, which this waits for) is skipped.
const SCOPES_INSERT: &str = "INSERT INTO idempotency_keys (tenant, operation, idempotency_key, fingerprint, task_id) \
     SELECT t, o, k, f, i FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::uuid[]) \
     WITH ORDINALITY AS u(t, o, k, f, i, n) ORDER BY n ON CONFLICT DO NOTHING RETURNING task_id";

/// Scope rows as one array per column, in a fixed (scope) order so that two
/// batches touching the same scopes lock them in the same order.
struct ScopeArrays<'r> {
    tenants: Vec<&'r str>,
    operations: Vec<&'r str>,
    keys: Vec<&'r str>,
    fingerprints: Vec<&'r str>,
    task_ids: Vec<Uuid>,
}

impl<'r> ScopeArrays<'r> {
    fn new(rows: &'r [ScopeRow]) -> ScopeArrays<'r> {
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

    fn params(&self) -> [Param<'_>; 5] {
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
fn scopes_won(rows: &[ScopeRow], inserted: &[Row]) -> Result<Vec<bool>> {
    let won: std::collections::HashSet<Uuid> = inserted
        .iter()
        .map(|r| get::<Uuid>(r, "task_id"))
        .collect::<Result<_>>()?;
    Ok(rows.iter().map(|r| won.contains(&r.task_id)).collect())
}

/// The scope rows named by `$1–$3` (tenants, operations, idempotency keys) with
/// their tasks; `scope_n` is the 1-based position in the arrays.
static SCOPES_WITH_TASKS: LazyLock<String> = LazyLock::new(|| {
    let cols: Vec<String> = TASK_COLUMNS.iter().map(|c| format!("t.{c}")).collect();
    format!(
        "SELECT u.n AS scope_n, k.fingerprint AS scope_fingerprint, k.task_id AS scope_task_id, \
         t.id IS NOT NULL AS scope_has_task, {} \
         FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(tn, op, ky, n) \
         JOIN idempotency_keys k ON k.tenant = u.tn AND k.operation = u.op AND k.idempotency_key = u.ky \
         LEFT JOIN tasks t ON t.id = k.task_id",
        cols.join(", ")
    )
});

/// [`SCOPES_WITH_TASKS`] for the scopes whose submitting key (`$4`, one per
/// scope) is live: a scope of a revoked key is left out, as a missing one.
static LIVE_SCOPES_WITH_TASKS: LazyLock<String> = LazyLock::new(|| {
    let cols: Vec<String> = TASK_COLUMNS.iter().map(|c| format!("t.{c}")).collect();
    format!(
        "SELECT u.n AS scope_n, k.fingerprint AS scope_fingerprint, k.task_id AS scope_task_id, \
         t.id IS NOT NULL AS scope_has_task, {} \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[]) WITH ORDINALITY AS u(tn, op, ky, kid, n) \
         JOIN api_keys a ON a.id = u.kid AND a.revoked_at IS NULL \
         JOIN idempotency_keys k ON k.tenant = u.tn AND k.operation = u.op AND k.idempotency_key = u.ky \
         LEFT JOIN tasks t ON t.id = k.task_id",
        cols.join(", ")
    )
});

/// The parameters of [`SCOPES_WITH_TASKS`].
struct ScopeLookup<'s> {
    tenants: Vec<&'s str>,
    operations: Vec<&'s str>,
    keys: Vec<&'s str>,
}

impl<'s> ScopeLookup<'s> {
    fn new(scopes: &'s [(String, String, String)]) -> ScopeLookup<'s> {
        ScopeLookup {
            tenants: scopes.iter().map(|s| s.0.as_str()).collect(),
            operations: scopes.iter().map(|s| s.1.as_str()).collect(),
            keys: scopes.iter().map(|s| s.2.as_str()).collect(),
        }
    }

    fn params(&self) -> [Param<'_>; 3] {
        [&self.tenants, &self.operations, &self.keys]
    }
}

/// Decodes [`SCOPES_WITH_TASKS`] into one entry per scope asked, in order.
fn existing_scopes(
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

// ---------------------------------------------------------------- Tx

impl Tx for PgTx<'_> {
    /// The database clock (`clock_timestamp()`, not the transaction start), so
    /// every instance decides leases, backoff and retention on one clock.
    async fn now(&mut self) -> Result<Timestamp> {
        let rows = self
            .query(
                "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now",
                &[],
            )
            .await?;
        let row = rows.first().ok_or_else(|| corrupt("now", "no row"))?;
        ts(row, "now")
    }

    async fn insert_api_key(&mut self, key: &ApiKey, hash: &str) -> Result<()> {
        let operations = opt_to_json("operations", key.operations.as_ref())?;
        let role = key.role.as_str();
        let created_at = key.created_at.ms();
        let revoked_at = key.revoked_at.map(Timestamp::ms);
        self.exec(
            "INSERT INTO api_keys (id, tenant, role, operations, key_hash, created_at, revoked_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                &key.id,
                &key.tenant,
                &role,
                &operations,
                &hash,
                &created_at,
                &revoked_at,
            ],
        )
        .await?;
        Ok(())
    }

    async fn now_and_live_api_keys(
        &mut self,
        ids: &[Uuid],
    ) -> Result<(Timestamp, std::collections::HashSet<Uuid>)> {
        now_and_live(&self.query(NOW_AND_LIVE_KEYS, &[&ids]).await?)
    }

    async fn api_key_by_hash(&mut self, hash: &str) -> Result<Option<ApiKey>> {
        self.query_opt(
            &format!("SELECT {KEY_COLS} FROM api_keys WHERE key_hash = $1"),
            &[&hash],
        )
        .await?
        .as_ref()
        .map(api_key_from_row)
        .transpose()
    }

    async fn api_key(&mut self, id: Uuid) -> Result<Option<ApiKey>> {
        self.query_opt(
            &format!("SELECT {KEY_COLS} FROM api_keys WHERE id = $1"),
            &[&id],
        )
        .await?
        .as_ref()
        .map(api_key_from_row)
        .transpose()
    }

    async fn revoke_api_key(&mut self, id: Uuid, at: Timestamp) -> Result<Option<ApiKey>> {
        let at = at.ms();
        self.query_opt(
            &format!("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $2) WHERE id = $1 RETURNING {KEY_COLS}"),
            &[&id, &at],
        )
        .await?
        .as_ref()
        .map(api_key_from_row)
        .transpose()
    }

    async fn list_api_keys(&mut self) -> Result<Vec<ApiKey>> {
        self.query(
            &format!("SELECT {KEY_COLS} FROM api_keys ORDER BY created_at, id"),
            &[],
        )
        .await?
        .iter()
        .map(api_key_from_row)
        .collect()
    }

    async fn insert_scope(&mut self, row: &ScopeRow) -> Result<bool> {
        // Under READ COMMITTED a conflicting, uncommitted insert makes this wait for
        // that transaction: it then inserts (the other rolled back) or does nothing.
        let n = self
            .exec(
                "INSERT INTO idempotency_keys (tenant, operation, idempotency_key, fingerprint, task_id) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                &[&row.tenant, &row.operation, &row.idempotency_key, &row.fingerprint, &row.task_id],
            )
            .await?;
        Ok(n == 1)
    }

    async fn scope(
        &mut self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<Option<ScopeRow>> {
        let Some(r) = self
            .query_opt(
                "SELECT tenant, operation, idempotency_key, fingerprint, task_id FROM idempotency_keys \
                 WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3",
                &[&tenant, &operation, &key],
            )
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(ScopeRow {
            tenant: get(&r, "tenant")?,
            operation: get(&r, "operation")?,
            idempotency_key: get(&r, "idempotency_key")?,
            fingerprint: get(&r, "fingerprint")?,
            task_id: get(&r, "task_id")?,
        }))
    }

    async fn delete_scope(&mut self, task_id: Uuid) -> Result<()> {
        self.exec(
            "DELETE FROM idempotency_keys WHERE task_id = $1",
            &[&task_id],
        )
        .await?;
        Ok(())
    }

    async fn insert_task(&mut self, task: &Task) -> Result<()> {
        let v = TaskValues::new(task)?;
        self.exec(&TASK_INSERT, &v.params()).await?;
        Ok(())
    }

    async fn insert_scopes(&mut self, rows: &[ScopeRow]) -> Result<Vec<bool>> {
        if let [row] = rows {
            return Ok(vec![self.insert_scope(row).await?]);
        }
        let arrays = ScopeArrays::new(rows);
        let inserted = self.query(SCOPES_INSERT, &arrays.params()).await?;
        scopes_won(rows, &inserted)
    }

    async fn scopes_with_tasks(
        &mut self,
        scopes: &[(String, String, String)],
    ) -> Result<Vec<ExistingScope>> {
        if scopes.is_empty() {
            return Ok(Vec::new());
        }
        let lookup = ScopeLookup::new(scopes);
        let rows = self.query(&SCOPES_WITH_TASKS, &lookup.params()).await?;
        existing_scopes(scopes, &rows)
    }

    /// One statement, so one snapshot: a scope row and its task are read
    /// together, and two submissions of one scope get the same answer; a
    /// scope of a revoked key is left out, as a missing one.
    async fn live_scopes_with_tasks(&mut self, subs: &[Submission]) -> Result<Vec<ExistingScope>> {
        if subs.is_empty() {
            return Ok(Vec::new());
        }
        let scopes: Vec<(String, String, String)> = subs.iter().map(Submission::scope).collect();
        let lookup = ScopeLookup::new(&scopes);
        let key_ids: Vec<Uuid> = subs.iter().map(|s| s.api_key_id).collect();
        let [tenants, operations, keys] = lookup.params();
        let params: [Param<'_>; 4] = [tenants, operations, keys, &key_ids];
        let rows = self.query(&LIVE_SCOPES_WITH_TASKS, &params).await?;
        existing_scopes(&scopes, &rows)
    }

    async fn insert_tasks_with_events(
        &mut self,
        tasks: &[Task],
        events: &[Vec<Event>],
    ) -> Result<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        let stmt = self.statement(&TASKS_WITH_EVENTS_INSERT).await?;
        self.insert_new_tasks(&stmt, tasks, events).await
    }

    async fn task(&mut self, id: Uuid, lock: bool) -> Result<Option<Task>> {
        let sql: &str = if lock {
            &TASK_SELECT_LOCK
        } else {
            &TASK_SELECT
        };
        self.query_opt(sql, &[&id])
            .await?
            .as_ref()
            .map(one_task_from_row)
            .transpose()
    }

    async fn update_task(
        &mut self,
        task: &Task,
        expected_version: i64,
        expected_generation: i64,
    ) -> Result<()> {
        let v = TaskValues::new(task)?;
        let all = v.params();
        let mut params: Vec<Param<'_>> = Vec::with_capacity(all.len() + 1);
        params.extend(
            all.iter()
                .enumerate()
                .filter(|(i, _)| *i != VERSION_INDEX)
                .map(|(_, p)| *p),
        );
        params.push(&expected_version);
        params.push(&expected_generation);
        let n = self.exec(&TASK_UPDATE, &params).await?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "task {} changed since it was read (expected version {expected_version}, generation {expected_generation})",
                task.id
            )))
        }
    }

    async fn insert_attempt(&mut self, a: &Attempt) -> Result<()> {
        let kind = a.kind.as_str();
        let state = a.state.as_str();
        let leased_at = a.leased_at.ms();
        let lease_expires_at = a.lease_expires_at.ms();
        let report = opt_to_json("report", a.report.as_ref())?;
        self.exec(
            &format!("INSERT INTO attempts ({ATTEMPT_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"),
            &[
                &a.id,
                &a.task_id,
                &a.number,
                &a.generation,
                &kind,
                &state,
                &a.executor_id,
                &leased_at,
                &lease_expires_at,
                &a.lease_ms,
                &a.usage,
                &a.external_txn_id,
                &report,
            ],
        )
        .await?;
        Ok(())
    }

    async fn update_attempt(&mut self, a: &Attempt) -> Result<()> {
        let state = a.state.as_str();
        let lease_expires_at = a.lease_expires_at.ms();
        let report = opt_to_json("report", a.report.as_ref())?;
        let n = self
            .exec(
                "UPDATE attempts SET state = $2, lease_expires_at = $3, lease_ms = $4, usage = $5, \
                 external_txn_id = $6, report = $7 WHERE id = $1",
                &[
                    &a.id,
                    &state,
                    &lease_expires_at,
                    &a.lease_ms,
                    &a.usage,
                    &a.external_txn_id,
                    &report,
                ],
            )
            .await?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Corrupt(format!("attempt {} vanished", a.id)))
        }
    }

    async fn attempt(&mut self, id: Uuid) -> Result<Option<Attempt>> {
        self.query_opt(
            &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE id = $1"),
            &[&id],
        )
        .await?
        .as_ref()
        .map(attempt_from_row)
        .transpose()
    }

    async fn attempts(&mut self, task_id: Uuid) -> Result<Vec<Attempt>> {
        let mut attempts = self
            .query(
                &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE task_id = $1 ORDER BY number"),
                &[&task_id],
            )
            .await?
            .iter()
            .map(attempt_from_row)
            .collect::<Result<Vec<_>>>()?;
        let index: HashMap<Uuid, usize> = attempts
            .iter()
            .enumerate()
            .map(|(i, a)| (a.id, i))
            .collect();
        let rows = self
            .query(
                "SELECT attempt_id, received_at, generation, outcome, body, disposition FROM evidence \
                 WHERE task_id = $1 ORDER BY id",
                &[&task_id],
            )
            .await?;
        for row in &rows {
            let attempt_id: Uuid = get(row, "attempt_id")?;
            if let Some(a) = index.get(&attempt_id).and_then(|i| attempts.get_mut(*i)) {
                a.evidence.push(evidence_from_row(row)?);
            }
        }
        Ok(attempts)
    }

    async fn insert_evidence(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        ev: &Evidence,
    ) -> Result<()> {
        let received_at = ev.received_at.ms();
        let body = to_json("evidence body", &ev.body)?;
        self.exec(
            "INSERT INTO evidence (task_id, attempt_id, received_at, generation, outcome, body, disposition) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[&task_id, &attempt_id, &received_at, &ev.generation, &ev.outcome, &body, &ev.disposition],
        )
        .await?;
        Ok(())
    }

    async fn insert_events(&mut self, task_id: Uuid, events: &[Event]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let arrays = EventArrays::new(events.iter().map(|e| (task_id, e)))?;
        self.exec(EVENTS_INSERT, &arrays.params()).await?;
        Ok(())
    }

    async fn events(&mut self, task_id: Uuid) -> Result<Vec<Event>> {
        self.query(
            "SELECT seq, type, at, data FROM events WHERE task_id = $1 ORDER BY seq",
            &[&task_id],
        )
        .await?
        .iter()
        .map(|row| {
            Ok(Event {
                seq: get(row, "seq")?,
                kind: get(row, "type")?,
                at: ts(row, "at")?,
                data: json(row, "data")?,
            })
        })
        .collect()
    }

    async fn claimable(
        &mut self,
        tenant: &str,
        operations: &[String],
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>> {
        if operations.is_empty() || limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        self.query(CLAIMABLE, &[&tenant, &operations, &now, &limit])
            .await?
            .iter()
            .map(|r| get(r, "id"))
            .collect()
    }

    async fn expired_leases(&mut self, now: Timestamp, limit: i64) -> Result<Vec<(Uuid, Uuid)>> {
        if limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        self.query(
            "SELECT t.id AS task_id, a.id AS attempt_id FROM attempts a JOIN tasks t ON t.id = a.task_id \
             WHERE a.state IN ('leased', 'acknowledged') AND a.lease_expires_at <= $1 \
             ORDER BY a.lease_expires_at LIMIT $2 FOR UPDATE OF t SKIP LOCKED",
            &[&now, &limit],
        )
        .await?
        .iter()
        .map(|r| Ok((get(r, "task_id")?, get(r, "attempt_id")?)))
        .collect()
    }

    async fn due_wakeups(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>> {
        if limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        self.query(
            "SELECT id FROM tasks WHERE state = 'retry_wait' AND ready_at <= $1 \
             ORDER BY ready_at LIMIT $2 FOR UPDATE SKIP LOCKED",
            &[&now, &limit],
        )
        .await?
        .iter()
        .map(|r| get(r, "id"))
        .collect()
    }

    async fn expired_scopes(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>> {
        if limit <= 0 {
            return Ok(Vec::new());
        }
        let now = now.ms();
        // Only tasks that still own a scope row (releasing a key clears
        // `key_expires_at` too; the join keeps this right either way).
        self.query(
            "SELECT t.id FROM tasks t JOIN idempotency_keys k ON k.task_id = t.id \
             WHERE t.key_expires_at IS NOT NULL AND t.key_expires_at <= $1 \
             ORDER BY t.key_expires_at LIMIT $2 FOR UPDATE OF t SKIP LOCKED",
            &[&now, &limit],
        )
        .await?
        .iter()
        .map(|r| get(r, "id"))
        .collect()
    }
}
