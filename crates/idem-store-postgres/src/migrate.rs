//! Versioned migrations: `migrations/NNNN_*.sql`, applied in one transaction
//! that holds a transaction-scoped advisory lock, so several instances starting
//! at once migrate exactly once (a session-level advisory lock would outlive
//! the migration on a pooled connection; a transaction-scoped one ends with it).

use crate::error::{connect_pg_error, is_transient, map_pg_error, pg_error_text};
use crate::target::Target;
use idem_store::{Migration, Result, SchemaVersion, StoreError};

/// The migrations of this binary, ascending (`idem_store::schema`:
/// expand/contract). Versions 1 to 11 predate the rule and count as contract
/// steps.
pub const MIGRATIONS: &[Migration] = &[
    Migration::contract(1, include_str!("../migrations/0001_init.sql")),
    Migration::contract(
        2,
        include_str!("../migrations/0002_api_keys_never_deleted.sql"),
    ),
    Migration::contract(3, include_str!("../migrations/0003_claim_order_index.sql")),
    Migration::contract(4, include_str!("../migrations/0004_contracts.sql")),
    Migration::contract(5, include_str!("../migrations/0005_task_search.sql")),
    Migration::contract(6, include_str!("../migrations/0006_event_feed.sql")),
    Migration::contract(7, include_str!("../migrations/0007_attempts_granted.sql")),
    Migration::contract(
        8,
        include_str!("../migrations/0008_change_notifications.sql"),
    ),
    Migration::contract(9, include_str!("../migrations/0009_change_backoffs.sql")),
    Migration::contract(10, include_str!("../migrations/0010_task_traceparent.sql")),
    Migration::contract(11, include_str!("../migrations/0011_console.sql")),
    Migration::expand(12, include_str!("../migrations/0012_attempt_released.sql")),
    Migration::expand(13, include_str!("../migrations/0013_shared_secrets.sql")),
    Migration::expand(
        14,
        include_str!("../migrations/0014_notify_after_commit.sql"),
    ),
    Migration::expand(15, include_str!("../migrations/0015_store_identity.sql")),
    Migration::expand(16, include_str!("../migrations/0016_second_effects.sql")),
    Migration::expand(17, include_str!("../migrations/0017_rate_limits.sql")),
    Migration::expand(18, include_str!("../migrations/0018_concurrency_caps.sql")),
    Migration::expand(19, include_str!("../migrations/0019_fair_claims.sql")),
];

/// How long a migration statement waits for a table lock, ms, before the
/// migration gives up (nothing applied; start-up tries again). A migration that
/// waits for `ACCESS EXCLUSIVE` behind a long transaction would otherwise make
/// every later query on that table, from every instance, queue behind it for
/// as long as that transaction lasts.
pub const MIGRATION_LOCK_TIMEOUT_MS: u32 = 2_000;

/// Key of the advisory lock that serializes migrations (ASCII `idem_mig`).
const MIGRATION_LOCK: i64 = 0x6964_656d_5f6d_6967;

/// A failure while migrating: [`StoreError::Unavailable`] when it may pass
/// (the connection dropped …), else [`StoreError::Migration`] (e.g. `42501`,
/// the role may not create tables), which stops start-up at once.
fn migration_error(e: tokio_postgres::Error) -> StoreError {
    if is_transient(&e) {
        return map_pg_error(e);
    }
    StoreError::Migration(format!("{}{}", pg_error_text(&e), privilege_hint(&e)))
}

/// What to do about SQLSTATE 42501 (the role may not create in the schema),
/// else nothing.
fn privilege_hint(e: &tokio_postgres::Error) -> &'static str {
    if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
        "; the role in the store URL must own the database or have CREATE on its schema `public` (PostgreSQL 15 no longer grants that to every role; see docs/deployment.md)"
    } else {
        ""
    }
}

/// The newest schema version this binary knows.
fn known_version() -> i32 {
    MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0)
}

/// The schema of the database `client` is connected to: its newest applied
/// migration and the highest `compatible_from` recorded (a row without one,
/// written before the column existed, counts as its own version). Version 0
/// when it has no `schema_migrations`.
///
/// # Errors
/// As [`migration_error`].
pub(crate) async fn read_schema<C: tokio_postgres::GenericClient + Sync>(
    client: &C,
) -> Result<SchemaVersion> {
    // `to_jsonb(m)` reads `compatible_from` whether or not the column exists
    // yet (a database migrated only by binaries older than it has none).
    let row = match client
        .query_one(
            "SELECT coalesce(max(version), 0)::bigint,
                    coalesce(max(coalesce((to_jsonb(m) ->> 'compatible_from')::integer, version)), 0)::bigint
               FROM schema_migrations m",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            return Ok(SchemaVersion {
                found: 0,
                compatible_from: 0,
            });
        }
        Err(e) => return Err(migration_error(e)),
    };
    Ok(SchemaVersion {
        found: row.try_get(0).map_err(migration_error)?,
        compatible_from: row.try_get(1).map_err(migration_error)?,
    })
}

/// Checks, changing nothing, that this binary serves the database's schema:
/// its own, or a newer one declared compatible with it
/// ([`SchemaVersion::check`]).
///
/// # Errors
/// [`StoreError::Migration`] naming both versions when it is not an idem
/// database, or its schema is older (run `idem migrate`), or newer and not
/// declared compatible; [`StoreError::Unavailable`] when the database cannot
/// be read.
pub(crate) async fn check<C: tokio_postgres::GenericClient + Sync>(client: &C) -> Result<()> {
    read_schema(client)
        .await?
        .check("database", i64::from(known_version()))
}

/// A failed migration step: [`StoreError::Unavailable`] when it gave up
/// waiting for a table lock (`55P03`, [`MIGRATION_LOCK_TIMEOUT_MS`]) or
/// deadlocked with a running instance's transaction (`40P01`): trying again
/// once that transaction ends can succeed; else
/// [`StoreError::Migration`]. Either way the migration's transaction rolls
/// back: nothing is applied.
fn step_error(version: i32, e: &tokio_postgres::Error) -> StoreError {
    let text = pg_error_text(e);
    if e.code() == Some(&tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED) {
        return StoreError::Unavailable(format!(
            "migration {version} deadlocked with a transaction of a running instance and was \
             rolled back, nothing applied ({text}); try again (idem serve retries for up to \
             IDEM_STORE_WAIT_MS)"
        ));
    }
    if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
        return StoreError::Unavailable(format!(
            "migration {version} waited {MIGRATION_LOCK_TIMEOUT_MS} ms for a table lock that another \
             transaction holds and gave up, nothing applied ({text}); try again once that transaction \
             ends (idem serve retries for up to IDEM_STORE_WAIT_MS)"
        ));
    }
    StoreError::Migration(format!("migration {version}: {text}{}", privilege_hint(e)))
}

/// Applies the pending migrations of the database at `url` and returns the
/// versions it applied (empty when the schema was up to date).
///
/// # Errors
/// [`StoreError::Config`] when `url` does not parse (or names no database),
/// the server refuses the role or database, or TLS fails;
/// [`StoreError::Unavailable`] when the database cannot be reached;
/// [`StoreError::Migration`] when a migration fails or the schema is newer
/// than this binary. Unlike [`crate::connect`], it creates idem's schema in a
/// database that already holds other tables (next to them).
pub async fn migrate(url: &str) -> Result<Vec<i32>> {
    let (config, target) = crate::target::parse(url)?;
    let tls = crate::tls::connector(&target)?;
    let (mut client, connection) = config
        .connect(tls)
        .await
        .map_err(|e| connect_pg_error(e, &target))?;
    let conn = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "migration connection closed with an error");
        }
    });
    let res = apply(&mut client, None, true, &target).await;
    drop(client);
    let _ = conn.await;
    res
}

/// Most table names a refusal lists.
const LISTED_TABLES: usize = 5;

/// Refuses a database whose current schema (`current_schema()`, normally
/// `public`) holds tables, views or sequences but no `schema_migrations`: an
/// application's database, most likely reached through a mistyped URL. An
/// empty database and an idem database pass, and so does one whose only
/// such objects belong to an extension (`pg_stat_statements`' views, which
/// pg_auto_failover creates in the database it makes).
///
/// # Errors
/// [`StoreError::Migration`] naming the database, a few of its tables and the
/// way out (`idem migrate`).
async fn other_tables(tx: &tokio_postgres::Transaction<'_>, target: &Target) -> Result<()> {
    let rows = tx
        .query(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
                AND NOT EXISTS (SELECT 1 FROM pg_depend d
                                 WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                                   AND d.deptype = 'e')
              ORDER BY c.relname",
            &[],
        )
        .await
        .map_err(migration_error)?;
    let names: Vec<String> = rows
        .iter()
        .map(|r| r.try_get::<_, String>(0))
        .collect::<Result<_, _>>()
        .map_err(migration_error)?;
    if names.is_empty() || names.iter().any(|n| n == "schema_migrations") {
        return Ok(());
    }
    let mut listed = names
        .iter()
        .take(LISTED_TABLES)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > LISTED_TABLES {
        listed.push_str(", …");
    }
    Err(StoreError::Migration(format!(
        "database {} at {} already holds {} table(s) that are not idem's ({listed}) and no idem \
         schema; refusing to create idem's tables next to them. Check the database name in the \
         store URL; if this database really is meant for idem, run `idem migrate` with the same \
         --store first",
        target.database,
        target.address_list(),
        names.len()
    )))
}

/// How often a migration that finds another instance migrating checks
/// whether that one is done.
const MIGRATION_LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Applies the pending migrations on `client`. While another instance holds
/// the migration lock (it is migrating, or checking that nothing is pending),
/// waits for it: at most `lock_wait` (then [`StoreError::Unavailable`], which
/// start-up retries), or for as long as it takes with `None` (`idem migrate`).
/// Without `allow_other_tables`, refuses (nothing created) a database whose
/// current schema holds tables but no idem schema ([`other_tables`]).
pub(crate) async fn apply(
    client: &mut tokio_postgres::Client,
    lock_wait: Option<std::time::Duration>,
    allow_other_tables: bool,
    target: &Target,
) -> Result<Vec<i32>> {
    let tx = client.transaction().await.map_err(map_pg_error)?;
    // `CREATE TABLE IF NOT EXISTS` below would log a NOTICE on every start; a
    // migration may build an index over a large table, which the session's
    // `statement_timeout` (a pooled connection's) must not cut short; and the
    // events a migration writes are announced by the `events` trigger at its
    // commit (migration 14: a pooled session starts with it off, and
    // migrations are too rare for its commit-time lock to matter).
    tx.batch_execute(
        "SET LOCAL client_min_messages = warning; SET LOCAL statement_timeout = 0; \
         SET LOCAL idem.notify = on",
    )
    .await
    .map_err(migration_error)?;
    let started = std::time::Instant::now();
    let mut told = false;
    loop {
        let locked: bool = tx
            .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(migration_error)?
            .try_get(0)
            .map_err(migration_error)?;
        if locked {
            break;
        }
        if lock_wait.is_some_and(|w| started.elapsed() >= w) {
            return Err(StoreError::Unavailable(format!(
                "another instance has been applying migrations to this database for {} ms or more \
                 (it holds the migration lock); nothing applied here yet",
                started.elapsed().as_millis()
            )));
        }
        if !told {
            tracing::info!(
                "another instance holds the migration lock (applying or checking migrations); waiting for it"
            );
            told = true;
        }
        tokio::time::sleep(MIGRATION_LOCK_POLL).await;
    }
    if !allow_other_tables {
        other_tables(&tx, target).await?;
    }
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
             version         integer PRIMARY KEY,
             applied_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
             compatible_from integer
         )",
    )
    .await
    .map_err(migration_error)?;
    let schema = read_schema(&tx).await?;
    let known = known_version();
    if schema.found > i64::from(known) {
        // Newer than this binary: served as it is if declared compatible,
        // never migrated by a binary that does not know its steps.
        schema.check("database", i64::from(known))?;
        return Ok(Vec::new());
    }
    let applied: Vec<i32> = tx
        .query(
            "SELECT version FROM schema_migrations ORDER BY version",
            &[],
        )
        .await
        .map_err(migration_error)?
        .iter()
        .map(|r| r.try_get::<_, i32>(0))
        .collect::<Result<_, _>>()
        .map_err(migration_error)?;
    if MIGRATIONS.iter().any(|m| !applied.contains(&m.version)) {
        // Only now: waiting for the advisory lock above (another instance
        // migrating) is not bounded by it.
        tx.batch_execute(&format!(
            "SET LOCAL lock_timeout = {MIGRATION_LOCK_TIMEOUT_MS}"
        ))
        .await
        .map_err(migration_error)?;
        // A database migrated only by binaries older than the expand/contract
        // rule has no column for the declarations yet.
        tx.batch_execute(
            "ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS compatible_from integer",
        )
        .await
        .map_err(migration_error)?;
    }
    let mut done = Vec::new();
    for m in MIGRATIONS {
        if applied.contains(&m.version) {
            continue;
        }
        tx.batch_execute(m.sql)
            .await
            .map_err(|e| step_error(m.version, &e))?;
        tx.execute(
            "INSERT INTO schema_migrations (version, compatible_from) VALUES ($1, $2)",
            &[
                &m.version,
                &idem_store::schema::recorded_compatible_from(MIGRATIONS, m.version),
            ],
        )
        .await
        .map_err(migration_error)?;
        done.push(m.version);
    }
    tx.commit().await.map_err(map_pg_error)?;
    if !done.is_empty() {
        tracing::info!(versions = ?done, "applied PostgreSQL migrations");
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    #[test]
    fn migrations_are_numbered_in_order_and_declare_their_compatibility() {
        assert_eq!(
            idem_store::schema::check_declarations(super::MIGRATIONS),
            Ok(())
        );
    }
}
