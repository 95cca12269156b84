//! [`Tx`] over one SQLite transaction (the writer's, or a reader's), and the
//! mapping between rows and the model.

use std::sync::LazyLock;

use idem_core::contract::{ContractId, FrozenContract};
use idem_core::model::{
    ApiKey, AppliedReport, Attempt, AttemptKind, AttemptState, EffectAcknowledgment,
    EffectEvidence, EffectReport, EffectResolution, Event, Evidence, Role, SecondEffect, Task,
    TaskControl, TaskState, Timestamp,
};
use idem_core::trace::TraceParent;
use idem_store::flow::QueueTamper;
use idem_store::{ExistingScope, ScopeRow, StoreError, Tx};
use rusqlite::{Connection, OptionalExtension, Row, params};
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::SqliteOptions;
use rows::{API_KEY_COLUMNS, ATTEMPT_COLUMNS, api_key_row, attempt_row, task_values};

/// A database error: busy, locked and constraint violations are
/// [`StoreError::Contention`] (run again), anything else
/// [`StoreError::Unavailable`].
pub(crate) fn db(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            StoreError::Contention(e.to_string())
        }
        Some(rusqlite::ErrorCode::ConstraintViolation) => StoreError::Contention(e.to_string()),
        _ => StoreError::Unavailable(e.to_string()),
    }
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// The open transaction on the writer (or a reader) connection.
pub(crate) struct SqliteTx<'a> {
    pub(crate) conn: &'a mut Connection,
    pub(crate) options: &'a SqliteOptions,
    /// The events this transaction (or savepoint) wrote, published once it
    /// committed ([`idem_store::changes`]).
    pub(crate) notes: Vec<idem_store::Change>,
}

fn to_json<T: Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(corrupt)
}

fn from_json<T: DeserializeOwned>(s: &str) -> rusqlite::Result<T> {
    serde_json::from_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn word<T: std::str::FromStr>(s: &str) -> rusqlite::Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    s.parse().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn uuid(s: &str) -> rusqlite::Result<Uuid> {
    Uuid::parse_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn opt_json<T: DeserializeOwned>(s: Option<String>) -> rusqlite::Result<Option<T>> {
    s.as_deref().map(from_json).transpose()
}

/// An attempt's `report` column: the applied report's body, with its outcome.
fn applied_report(s: Option<String>) -> rusqlite::Result<Option<AppliedReport>> {
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

/// The one list of the task table's columns: calls `$then!` with `$args`,
/// `;`, and the column names in table order. Everything else (the SELECT
/// lists, the INSERT and UPDATE placeholders, [`Col`]'s positions, which
/// [`task_row`] reads and [`task_values`] fills) is generated from it.
macro_rules! with_task_columns {
    ($then:ident!($($args:tt)*)) => {
        $then! { $($args)*; id, tenant, operation, idempotency_key, fingerprint, canonical_request, params, state, generation, version, event_seq, attempt_count, execute_count, usage, contract_id, cancellation, delivery, failure, api_key_id, next_kind, active_attempt_id, ready_at, deadline_at, terminal_at, key_expires_at, created_at, updated_at, attempts_granted, traceparent, effect_report_count, concurrency_key, priority, fairness_key }
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
        enum Col {
            $($col),+
        }

        /// The task columns' names, by [`Col`].
        const TASK_COLUMN_NAMES: &[&str] = &[$(stringify!($col)),+];

        /// How many columns a task has.
        const TASK_COLUMN_COUNT: usize = TASK_COLUMN_NAMES.len();
    };
}

with_task_columns!(task_positions!());

impl Col {
    /// The column's position.
    const fn at(self) -> usize {
        self as usize
    }
}

/// The columns a task update writes (the others are fixed at acceptance);
/// `version` is incremented by the statement itself.
const TASK_UPDATED: &[Col] = &[
    Col::state,
    Col::generation,
    Col::version,
    Col::event_seq,
    Col::attempt_count,
    Col::execute_count,
    Col::attempts_granted,
    Col::effect_report_count,
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
static TASK_INSERT: LazyLock<String> = LazyLock::new(|| {
    let places: Vec<String> = (1..=TASK_COLUMN_COUNT).map(|i| format!("?{i}")).collect();
    format!(
        "INSERT INTO tasks ({}) VALUES ({})",
        task_columns!(),
        places.join(", ")
    )
});

/// The compare-and-set update of [`TASK_UPDATED`], bound from [`task_values`]
/// then the expected version and generation.
static TASK_UPDATE: LazyLock<String> = LazyLock::new(|| {
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
const CONTRACT_TEXT: usize = TASK_COLUMN_COUNT;

/// A scope row joined with its task: [`task_columns!`] and
/// [`contract_text!`] (NULL when the task row is missing), then the scope's
/// fingerprint and task id.
const SCOPE_WITH_TASK: &str = concat!(
    "SELECT ",
    task_columns!("t."),
    contract_text!("t."),
    ", k.fingerprint, k.task_id FROM idempotency_keys k \
     LEFT JOIN tasks t ON t.id = k.task_id \
     WHERE k.tenant = ?1 AND k.operation = ?2 AND k.idempotency_key = ?3"
);

/// Column `i` as text borrowed from the row (no copy before it is parsed).
fn text<'r>(r: &'r Row<'_>, i: usize) -> rusqlite::Result<&'r str> {
    r.get_ref(i)?.as_str().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e))
    })
}

/// The task's contract: its `contract_id` and [`contract_text!`], decoded
/// once per process ([`idem_store::contracts::intern`]).
fn contract(r: &Row<'_>) -> rusqlite::Result<FrozenContract> {
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

fn task_row(r: &Row<'_>) -> rusqlite::Result<Task> {
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
        priority: r.get(C::priority.at())?,
        // Read with the task by the operations that need them, when
        // `effect_report_count` is above 0 (`effects`, `second_effects_of`).
        second_effects: Vec::new(),
        control: TaskControl {
            tenant: r.get(C::tenant.at())?,
            fairness_key: r.get(C::fairness_key.at())?,
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
            effect_reports: Vec::new(),
            effect_report_count: r.get(C::effect_report_count.at())?,
            concurrency_key: r.get(C::concurrency_key.at())?,
        },
    })
}

fn decode(e: rusqlite::Error) -> StoreError {
    match e {
        rusqlite::Error::FromSqlConversionFailure(..) | rusqlite::Error::InvalidColumnType(..) => {
            corrupt(e)
        }
        other => db(other),
    }
}

impl SqliteTx<'_> {
    fn ids(&mut self, sql: &str, params: impl rusqlite::Params) -> Result<Vec<Uuid>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql).map_err(db)?;
        let rows = stmt
            .query_map(params, |r| uuid(&r.get::<_, String>(0)?))
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }
}

/// The claimable tasks of tenant `?1` in class `?2` ready at `?3` (ms), lowest
/// claim rank first (`ready_at - priority * 10000`, SPEC §2.13, then `id`), at
/// most `?4`: an ordered walk of the partial index `tasks_claim_rank`, whose
/// predicate and expression it repeats word for word.
pub const CLAIMABLE_IN_CLASS: &str = "SELECT id, ready_at - priority * 10000 FROM tasks WHERE tenant = ?1 AND operation = ?2 \
     AND active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling') \
     AND ready_at <= ?3 \
     ORDER BY ready_at - priority * 10000, id LIMIT ?4";

impl Tx for SqliteTx<'_> {
    async fn now(&mut self) -> Result<Timestamp, StoreError> {
        Ok(self.options.clock.process_now())
    }

    async fn shared_secret(
        &mut self,
        name: &str,
        candidate: &[u8; 32],
        now: Timestamp,
    ) -> Result<Vec<u8>, StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO shared_secrets (name, secret, created_at) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (name) DO NOTHING",
            )
            .and_then(|mut s| s.execute(params![name, &candidate[..], now.0]))
            .map_err(db)?;
        self.conn
            .prepare_cached("SELECT secret FROM shared_secrets WHERE name = ?1")
            .and_then(|mut s| s.query_row([name], |r| r.get::<_, Vec<u8>>(0)))
            .map_err(decode)
    }

    async fn insert_api_key(&mut self, key: &ApiKey, hash: &str) -> Result<(), StoreError> {
        let ops = key.operations.as_ref().map(to_json).transpose()?;
        let serves = key.serves.as_ref().map(to_json).transpose()?;
        self.conn
            .prepare_cached("INSERT INTO api_keys (id, tenant, role, operations, key_hash, created_at, revoked_at, serves) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)")
            .and_then(|mut s| {
                s.execute(params![
                    key.id.to_string(),
                    key.tenant,
                    key.role.as_str(),
                    ops,
                    hash,
                    key.created_at.0,
                    key.revoked_at.map(|t| t.0),
                    serves
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn api_key_by_hash(&mut self, hash: &str) -> Result<Option<ApiKey>, StoreError> {
        let sql = format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE key_hash = ?1");
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| s.query_row([hash], api_key_row).optional())
            .map_err(decode)
    }

    async fn api_key(&mut self, id: Uuid) -> Result<Option<ApiKey>, StoreError> {
        let sql = format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1");
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| s.query_row([id.to_string()], api_key_row).optional())
            .map_err(decode)
    }

    async fn revoke_api_key(
        &mut self,
        id: Uuid,
        at: Timestamp,
    ) -> Result<Option<ApiKey>, StoreError> {
        self.conn
            .prepare_cached(
                "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
            )
            .and_then(|mut s| s.execute(params![id.to_string(), at.0]))
            .map_err(db)?;
        self.api_key(id).await
    }

    async fn list_api_keys(&mut self) -> Result<Vec<ApiKey>, StoreError> {
        let sql = format!("SELECT {API_KEY_COLUMNS} FROM api_keys ORDER BY created_at, id");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db)?;
        let rows = stmt.query_map([], api_key_row).map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    async fn insert_scope(&mut self, row: &ScopeRow) -> Result<bool, StoreError> {
        let n = self
            .conn
            .prepare_cached(
                "INSERT INTO idempotency_keys (tenant, operation, idempotency_key, fingerprint, task_id) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
            )
            .and_then(|mut s| {
                s.execute(params![
                    row.tenant,
                    row.operation,
                    row.idempotency_key,
                    row.fingerprint,
                    row.task_id.to_string()
                ])
            })
            .map_err(db)?;
        Ok(n == 1)
    }

    async fn scope(
        &mut self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<Option<ScopeRow>, StoreError> {
        self.conn
            .prepare_cached(
                "SELECT fingerprint, task_id FROM idempotency_keys \
                 WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
            )
            .and_then(|mut s| {
                s.query_row(params![tenant, operation, key], |r| {
                    Ok(ScopeRow {
                        tenant: tenant.to_owned(),
                        operation: operation.to_owned(),
                        idempotency_key: key.to_owned(),
                        fingerprint: r.get(0)?,
                        task_id: uuid(&r.get::<_, String>(1)?)?,
                    })
                })
                .optional()
            })
            .map_err(decode)
    }

    /// One statement per scope (the scope row joined with its task) instead
    /// of the default's two; same rows, same snapshot (one transaction).
    async fn scopes_with_tasks(
        &mut self,
        scopes: &[(String, String, String)],
    ) -> Result<Vec<ExistingScope>, StoreError> {
        let mut stmt = self.conn.prepare_cached(SCOPE_WITH_TASK).map_err(decode)?;
        let mut out = Vec::with_capacity(scopes.len());
        for (tenant, operation, key) in scopes {
            let found = stmt
                .query_row(params![tenant, operation, key], |r| {
                    let row = ScopeRow {
                        tenant: tenant.clone(),
                        operation: operation.clone(),
                        idempotency_key: key.clone(),
                        fingerprint: r.get(CONTRACT_TEXT + 1)?,
                        task_id: uuid(text(r, CONTRACT_TEXT + 2)?)?,
                    };
                    // No task row joined: `t.id` is NULL.
                    let task = match r.get_ref(0)? {
                        rusqlite::types::ValueRef::Null => None,
                        _ => Some(task_row(r)?),
                    };
                    Ok((row, task))
                })
                .optional()
                .map_err(decode)?;
            out.push(found);
        }
        Ok(out)
    }

    async fn lock_rate(&mut self, scope: &str) -> Result<i64, StoreError> {
        // The one writer holds the database: the row needs no lock of its own.
        self.conn
            .prepare_cached("SELECT tat_us FROM rate_limits WHERE scope = ?1")
            .and_then(|mut s| s.query_row([scope], |r| r.get(0)).optional())
            .map(|t| t.unwrap_or(0))
            .map_err(db)
    }

    async fn set_rate(&mut self, scope: &str, tat_us: i64) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO rate_limits (scope, tat_us) VALUES (?1, ?2) \
                 ON CONFLICT (scope) DO UPDATE SET tat_us = excluded.tat_us",
            )
            .and_then(|mut s| s.execute(rusqlite::params![scope, tat_us]))
            .map_err(db)?;
        Ok(())
    }

    async fn take_slots(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        slots: &[idem_store::caps::CapSlot],
    ) -> Result<Option<usize>, StoreError> {
        let (task, attempt) = (task_id.to_string(), attempt_id.to_string());
        for (i, s) in slots.iter().enumerate() {
            self.conn
                .prepare_cached(
                    "DELETE FROM lease_slots WHERE scope = ?1 AND NOT EXISTS \
                     (SELECT 1 FROM tasks t WHERE t.id = lease_slots.task_id \
                        AND t.active_attempt_id = lease_slots.attempt_id)",
                )
                .and_then(|mut st| st.execute([&s.scope]))
                .map_err(db)?;
            let taken = self
                .conn
                .prepare_cached(
                    "INSERT INTO lease_slots (scope, slot, task_id, attempt_id) \
                     SELECT ?1, f.slot, ?2, ?3 FROM (SELECT CASE \
                       WHEN NOT EXISTS (SELECT 1 FROM lease_slots WHERE scope = ?1 AND slot = 0) THEN 0 \
                       ELSE (SELECT min(l.slot) + 1 FROM lease_slots l WHERE l.scope = ?1 AND NOT EXISTS \
                             (SELECT 1 FROM lease_slots m WHERE m.scope = ?1 AND m.slot = l.slot + 1)) \
                     END AS slot) f \
                     WHERE f.slot < ?4 \
                     ON CONFLICT DO NOTHING",
                )
                .and_then(|mut st| st.execute(params![s.scope, task, attempt, s.cap]))
                .map_err(db)?;
            if taken == 0 {
                self.conn
                    .prepare_cached(
                        "DELETE FROM lease_slots WHERE task_id = ?1 AND attempt_id = ?2",
                    )
                    .and_then(|mut st| st.execute([&task, &attempt]))
                    .map_err(db)?;
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    async fn free_slots(&mut self, task_id: Uuid, keep: Option<Uuid>) -> Result<(), StoreError> {
        self.conn
            .prepare_cached("DELETE FROM lease_slots WHERE task_id = ?1 AND attempt_id IS NOT ?2")
            .and_then(|mut st| {
                st.execute(params![task_id.to_string(), keep.map(|k| k.to_string())])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn delete_scope(&mut self, task_id: Uuid) -> Result<(), StoreError> {
        self.conn
            .prepare_cached("DELETE FROM idempotency_keys WHERE task_id = ?1")
            .and_then(|mut s| s.execute([task_id.to_string()]))
            .map_err(db)?;
        Ok(())
    }

    /// The task, and its contract's row first unless this database is known
    /// to hold it ([`idem_store::contracts::StoredContracts`]); a failed insert forgets what is known
    /// (the row may be missing: the savepoint runs again and writes it).
    async fn insert_task(&mut self, t: &Task) -> Result<(), StoreError> {
        let values = task_values(t)?;
        let stored = crate::contracts::stored_contracts(self.conn);
        let contract = &t.contract;
        if !stored.holds(contract.id()) {
            self.conn
                .prepare_cached(
                    "INSERT INTO contracts (id, contract) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                )
                .and_then(|mut s| {
                    s.execute(params![&contract.id().as_bytes()[..], contract.json()])
                })
                .map_err(db)?;
            stored.remember([contract]);
        }
        self.conn
            .prepare_cached(&TASK_INSERT)
            .and_then(|mut s| s.execute(rusqlite::params_from_iter(values.iter())))
            .map_err(|e| {
                stored.forget();
                db(e)
            })?;
        Ok(())
    }

    async fn task(&mut self, id: Uuid, _lock: bool) -> Result<Option<Task>, StoreError> {
        // The writer holds the only write transaction (BEGIN IMMEDIATE): rows are locked.
        self.conn
            .prepare_cached(concat!(
                "SELECT ",
                task_columns!(),
                contract_text!(""),
                " FROM tasks WHERE id = ?1"
            ))
            .and_then(|mut s| s.query_row([id.to_string()], task_row).optional())
            .map_err(decode)
    }

    async fn update_task(
        &mut self,
        t: &Task,
        expected_version: i64,
        expected_generation: i64,
    ) -> Result<(), StoreError> {
        let values = task_values(t)?;
        let n = self
            .conn
            .prepare_cached(&TASK_UPDATE)
            .and_then(|mut s| {
                let mut all = values;
                all.push(expected_version.into());
                all.push(expected_generation.into());
                // The columns fixed at acceptance are bound, unused.
                s.execute(rusqlite::params_from_iter(all.iter()))
            })
            .map_err(db)?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "task {} changed concurrently",
                t.id
            )))
        }
    }

    async fn insert_attempt(&mut self, a: &Attempt) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO attempts ({ATTEMPT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
        );
        let report = a.report.as_ref().map(|r| to_json(&r.body)).transpose()?;
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| {
                s.execute(params![
                    a.id.to_string(),
                    a.task_id.to_string(),
                    a.number,
                    a.generation,
                    a.kind.as_str(),
                    a.state.as_str(),
                    a.executor_id,
                    a.leased_at.0,
                    a.lease_expires_at.0,
                    a.lease_ms,
                    a.usage,
                    a.external_txn_id,
                    report
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn update_attempt(&mut self, a: &Attempt) -> Result<(), StoreError> {
        let report = a.report.as_ref().map(|r| to_json(&r.body)).transpose()?;
        let n = self
            .conn
            .prepare_cached(
                "UPDATE attempts SET state = ?3, lease_expires_at = ?4, usage = ?5, external_txn_id = ?6, report = ?7 \
                 WHERE id = ?1 AND generation = ?2",
            )
            .and_then(|mut s| {
                s.execute(params![
                    a.id.to_string(),
                    a.generation,
                    a.state.as_str(),
                    a.lease_expires_at.0,
                    a.usage,
                    a.external_txn_id,
                    report
                ])
            })
            .map_err(db)?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "attempt {} changed concurrently",
                a.id
            )))
        }
    }

    async fn attempt(&mut self, id: Uuid) -> Result<Option<Attempt>, StoreError> {
        let sql = format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE id = ?1");
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| s.query_row([id.to_string()], attempt_row).optional())
            .map_err(decode)
    }

    async fn attempts(&mut self, task_id: Uuid) -> Result<Vec<Attempt>, StoreError> {
        let sql =
            format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE task_id = ?1 ORDER BY number");
        let mut attempts = {
            let mut stmt = self.conn.prepare_cached(&sql).map_err(db)?;
            let rows = stmt
                .query_map([task_id.to_string()], attempt_row)
                .map_err(db)?;
            rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)?
        };
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT attempt_id, received_at, generation, outcome, body, disposition FROM evidence \
                 WHERE task_id = ?1 ORDER BY id",
            )
            .map_err(db)?;
        let rows = stmt
            .query_map([task_id.to_string()], |r| {
                Ok((
                    uuid(&r.get::<_, String>(0)?)?,
                    Evidence {
                        received_at: Timestamp(r.get(1)?),
                        generation: r.get(2)?,
                        outcome: word(&r.get::<_, String>(3)?)?,
                        body: from_json(&r.get::<_, String>(4)?)?,
                        disposition: word(&r.get::<_, String>(5)?)?,
                    },
                ))
            })
            .map_err(db)?;
        for row in rows {
            let (attempt_id, ev) = row.map_err(decode)?;
            if let Some(a) = attempts.iter_mut().find(|a| a.id == attempt_id) {
                a.evidence.push(ev);
            }
        }
        Ok(attempts)
    }

    async fn insert_evidence(
        &mut self,
        task_id: Uuid,
        attempt_id: Uuid,
        ev: &Evidence,
    ) -> Result<(), StoreError> {
        let body = to_json(&ev.body)?;
        self.conn
            .prepare_cached(
                "INSERT INTO evidence (task_id, attempt_id, received_at, generation, outcome, body, disposition) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    task_id.to_string(),
                    attempt_id.to_string(),
                    ev.received_at.0,
                    ev.generation,
                    ev.outcome.as_str(),
                    body,
                    ev.disposition.as_str()
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn effects(
        &mut self,
        task_id: Uuid,
    ) -> Result<(Vec<EffectReport>, Vec<SecondEffect>), StoreError> {
        // Both tables' rows of the task, reports first, each in insertion order.
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT 0 AS suspected, id, external_txn_id, attempt_id, generation, evidence, \
                        reported_at, NULL, NULL, NULL, NULL \
                   FROM effect_reports WHERE task_id = ?1 \
                 UNION ALL \
                 SELECT 1, id, external_txn_id, attempt_id, generation, evidence, suspected_at, \
                        resolution, reason, actor, acknowledged_at \
                   FROM second_effects WHERE task_id = ?1 \
                 ORDER BY 1, 2",
            )
            .map_err(db)?;
        let rows = stmt
            .query_map([task_id.to_string()], |r| {
                let suspected: i64 = r.get(0)?;
                let external_txn_id: Option<String> = r.get(2)?;
                let attempt_id = r
                    .get::<_, Option<String>>(3)?
                    .as_deref()
                    .map(uuid)
                    .transpose()?;
                let generation: i64 = r.get(4)?;
                let evidence = word::<EffectEvidence>(&r.get::<_, String>(5)?)?;
                let at = Timestamp(r.get(6)?);
                if suspected == 0 {
                    return Ok(Err(EffectReport {
                        external_txn_id,
                        attempt_id,
                        generation,
                        evidence,
                        reported_at: at,
                    }));
                }
                let acknowledgment = match r.get::<_, Option<i64>>(10)? {
                    None => None,
                    Some(ms) => Some(EffectAcknowledgment {
                        resolution: word::<EffectResolution>(&r.get::<_, String>(7)?)?,
                        reason: r.get(8)?,
                        actor: from_json(&r.get::<_, String>(9)?)?,
                        acknowledged_at: Timestamp(ms),
                    }),
                };
                Ok(Ok(SecondEffect {
                    external_txn_id,
                    attempt_id,
                    generation,
                    evidence,
                    suspected_at: at,
                    acknowledgment,
                }))
            })
            .map_err(db)?;
        let (mut reports, mut effects) = (Vec::new(), Vec::new());
        for row in rows {
            match row.map_err(decode)? {
                Ok(e) => effects.push(e),
                Err(r) => reports.push(r),
            }
        }
        Ok((reports, effects))
    }

    async fn insert_effect_report(
        &mut self,
        task_id: Uuid,
        r: &EffectReport,
    ) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO effect_reports (task_id, external_txn_id, attempt_id, generation, evidence, reported_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    task_id.to_string(),
                    r.external_txn_id,
                    r.attempt_id.map(|a| a.to_string()),
                    r.generation,
                    r.evidence.as_str(),
                    r.reported_at.0
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn insert_second_effect(
        &mut self,
        task_id: Uuid,
        e: &SecondEffect,
    ) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO second_effects (task_id, external_txn_id, attempt_id, generation, evidence, suspected_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    task_id.to_string(),
                    e.external_txn_id,
                    e.attempt_id.map(|a| a.to_string()),
                    e.generation,
                    e.evidence.as_str(),
                    e.suspected_at.0
                ])
            })
            .map_err(db)?;
        Ok(())
    }

    async fn acknowledge_second_effect(
        &mut self,
        task_id: Uuid,
        e: &SecondEffect,
    ) -> Result<(), StoreError> {
        let Some(ack) = &e.acknowledgment else {
            return Err(corrupt("an acknowledgment without its record"));
        };
        let actor = to_json(&ack.actor)?;
        let n = self
            .conn
            .prepare_cached(
                "UPDATE second_effects SET resolution = ?3, reason = ?4, actor = ?5, acknowledged_at = ?6 \
                 WHERE task_id = ?1 AND external_txn_id IS ?2 AND acknowledged_at IS NULL",
            )
            .and_then(|mut s| {
                s.execute(params![
                    task_id.to_string(),
                    e.external_txn_id,
                    ack.resolution.as_str(),
                    ack.reason,
                    actor,
                    ack.acknowledged_at.0
                ])
            })
            .map_err(db)?;
        if n == 1 {
            Ok(())
        } else {
            Err(StoreError::Contention(format!(
                "the second effect of task {task_id} was acknowledged since it was read"
            )))
        }
    }

    async fn insert_events(&mut self, task_id: Uuid, events: &[Event]) -> Result<(), StoreError> {
        self.append_events(task_id, events)
    }

    async fn events(&mut self, task_id: Uuid) -> Result<Vec<Event>, StoreError> {
        self.history(task_id)
    }

    async fn feed(
        &mut self,
        tenant: &str,
        operations: Option<&[String]>,
        after: idem_store::feed::FeedCursor,
        limit: i64,
    ) -> Result<idem_store::feed::FeedRead, StoreError> {
        self.feed_page(tenant, operations, after, limit)
    }

    async fn claimable(
        &mut self,
        tenant: &str,
        operations: &[String],
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        // One ordered walk of `tasks_claim_order` per distinct class, each
        // stopping at the limit, then the oldest across classes (migration 3):
        // a claim's cost follows its limit, not the backlog.
        let mut classes: Vec<&str> = operations.iter().map(String::as_str).collect();
        classes.sort_unstable();
        classes.dedup();
        let mut stmt = self.conn.prepare_cached(CLAIMABLE_IN_CLASS).map_err(db)?;
        let mut found: Vec<(i64, String)> = Vec::new();
        for class in classes {
            let rows = stmt
                .query_map(params![tenant, class, now.0, limit], |r| {
                    Ok((r.get::<_, i64>(1)?, r.get::<_, String>(0)?))
                })
                .map_err(db)?;
            for row in rows {
                found.push(row.map_err(decode)?);
            }
        }
        found.sort_unstable();
        found.truncate(usize::try_from(limit).unwrap_or(0));
        found
            .into_iter()
            .map(|(_, id)| uuid(&id).map_err(decode))
            .collect()
    }

    async fn claim_queues(
        &mut self,
        tenants: Option<&[String]>,
        operations: &[String],
        limit: i64,
        _locked: bool,
    ) -> Result<Vec<idem_store::flow::ClaimQueue>, StoreError> {
        self.fair_claim_queues(tenants, operations, limit)
    }

    async fn value_queues(
        &mut self,
        tenant: &str,
        operation: &str,
        limit: i64,
        _locked: bool,
    ) -> Result<Vec<idem_store::flow::ClaimQueue>, StoreError> {
        self.fair_value_queues(tenant, operation, limit)
    }

    async fn claimable_with_value(
        &mut self,
        queue: &idem_store::flow::ClaimQueue,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        self.fair_claimable_with_value(queue, now, limit)
    }

    async fn queue_waits(
        &mut self,
        queue: &idem_store::flow::ClaimQueue,
    ) -> Result<bool, StoreError> {
        self.fair_queue_waits(queue)
    }

    async fn set_turn(
        &mut self,
        queue: &idem_store::flow::ClaimQueue,
        turn: Option<i64>,
    ) -> Result<(), StoreError> {
        self.fair_set_turn(queue, turn)
    }

    async fn last_turn(&mut self, queue: &idem_store::flow::ClaimQueue) -> Result<i64, StoreError> {
        self.fair_last_turn(queue)
    }

    async fn open_queues(&mut self, task: &Task) -> Result<(), StoreError> {
        self.fair_open_queues(task)
    }

    async fn unpark_waiting(&mut self, limit: i64) -> Result<usize, StoreError> {
        self.fair_unpark_waiting(limit)
    }

    async fn open_missing_queues(
        &mut self,
        after: Option<&idem_store::flow::QueuePair>,
        limit: i64,
    ) -> Result<(usize, Option<idem_store::flow::QueuePair>), StoreError> {
        self.fair_open_missing_queues(after, limit)
    }

    async fn tamper_queues(
        &mut self,
        tenant: &str,
        operation: &str,
        how: QueueTamper,
    ) -> Result<usize, StoreError> {
        self.fair_tamper_queues(tenant, operation, how)
    }

    async fn expired_leases(
        &mut self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<(Uuid, Uuid)>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT task_id, id FROM attempts WHERE state IN ('leased', 'acknowledged') AND lease_expires_at <= ?1 \
                 ORDER BY lease_expires_at LIMIT ?2",
            )
            .map_err(db)?;
        let rows = stmt
            .query_map(params![now.0, limit], |r| {
                Ok((
                    uuid(&r.get::<_, String>(0)?)?,
                    uuid(&r.get::<_, String>(1)?)?,
                ))
            })
            .map_err(db)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(decode)
    }

    async fn due_wakeups(&mut self, now: Timestamp, limit: i64) -> Result<Vec<Uuid>, StoreError> {
        self.ids(
            "SELECT id FROM tasks WHERE state = 'retry_wait' AND ready_at <= ?1 ORDER BY ready_at LIMIT ?2",
            params![now.0, limit],
        )
    }

    async fn expired_scopes(
        &mut self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        self.ids(
            "SELECT t.id FROM tasks t JOIN idempotency_keys k ON k.task_id = t.id \
             WHERE t.key_expires_at IS NOT NULL AND t.key_expires_at <= ?1 ORDER BY t.key_expires_at LIMIT ?2",
            params![now.0, limit],
        )
    }

    /// SQLite's file has no identity of its own (`idem_store::identity`).
    async fn database_identity(
        &mut self,
    ) -> Result<Option<idem_store::identity::DatabaseIdentity>, StoreError> {
        Ok(None)
    }

    async fn recorded_identity(
        &mut self,
    ) -> Result<Option<idem_store::identity::RecordedIdentity>, StoreError> {
        let row = self
            .conn
            .prepare_cached("SELECT epoch, restored FROM store_identity WHERE id = 1")
            .and_then(|mut s| {
                s.query_row([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, bool>(1)?)))
                    .optional()
            })
            .map_err(decode)?;
        row.map(|(epoch, restored)| {
            Ok(idem_store::identity::RecordedIdentity {
                identity: idem_store::identity::StoreIdentity {
                    epoch: uuid(&epoch).map_err(decode)?,
                    system_identifier: None,
                    timeline: None,
                },
                restored,
            })
        })
        .transpose()
    }

    async fn record_identity(
        &mut self,
        expected: Option<&idem_store::identity::StoreIdentity>,
        new: &idem_store::identity::StoreIdentity,
    ) -> Result<bool, StoreError> {
        let at = self.options.clock.process_now().0;
        let n = match expected {
            None => self
                .conn
                .prepare_cached(
                    "INSERT INTO store_identity (id, epoch, restored, recorded_at) \
                     VALUES (1, ?1, 0, ?2) ON CONFLICT (id) DO NOTHING",
                )
                .and_then(|mut s| s.execute(params![new.epoch.to_string(), at])),
            Some(old) => self
                .conn
                .prepare_cached(
                    "UPDATE store_identity SET epoch = ?1, restored = 0, recorded_at = ?2 \
                     WHERE id = 1 AND epoch = ?3",
                )
                .and_then(|mut s| {
                    s.execute(params![new.epoch.to_string(), at, old.epoch.to_string()])
                }),
        }
        .map_err(db)?;
        Ok(n == 1)
    }

    async fn mark_restored(&mut self) -> Result<bool, StoreError> {
        let n = self
            .conn
            .prepare_cached("UPDATE store_identity SET restored = 1 WHERE id = 1")
            .and_then(|mut s| s.execute([]))
            .map_err(db)?;
        Ok(n == 1)
    }

    async fn identity_is_current(&mut self) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached("SELECT NOT EXISTS (SELECT 1 FROM store_identity WHERE restored = 1)")
            .and_then(|mut s| s.query_row([], |r| r.get::<_, bool>(0)))
            .map_err(decode)
    }

    async fn unfinished_tasks(
        &mut self,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        self.ids(
            "SELECT id FROM tasks WHERE state NOT IN ('succeeded', 'failed', 'cancelled') \
             AND (?1 IS NULL OR id > ?1) ORDER BY id LIMIT ?2",
            params![after.map(|a| a.to_string()), limit],
        )
    }
}

mod console;
mod fair;
mod feed;
mod rows;
pub(crate) mod search;
#[cfg(test)]
mod tests;
