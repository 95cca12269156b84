//! Versioned migrations: `migrations/NNNN_*.sql`, applied in one transaction
//! that holds a transaction-scoped advisory lock, so several instances starting
//! at once migrate exactly once (RUST-NOTES §4.7).

use idem_store::{Result, StoreError};
use tokio_postgres::NoTls;

use crate::error::{connect_pg_error, is_transient, map_pg_error, parse_url, pg_error_text};

/// The migrations of this binary: `(version, SQL)`, ascending.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../migrations/0001_init.sql")),
    (
        2,
        include_str!("../migrations/0002_api_keys_never_deleted.sql"),
    ),
    (3, include_str!("../migrations/0003_claim_order_index.sql")),
];

/// Key of the advisory lock that serializes migrations (ASCII `idem_mig`).
const MIGRATION_LOCK: i64 = 0x6964_656d_5f6d_6967;

/// A failure while migrating: [`StoreError::Unavailable`] when it may pass
/// (the connection dropped …), else [`StoreError::Migration`] (e.g. `42501`,
/// the role may not create tables), which stops start-up at once.
fn migration_error(e: tokio_postgres::Error) -> StoreError {
    if is_transient(&e) {
        return map_pg_error(e);
    }
    StoreError::Migration(pg_error_text(&e))
}

/// Applies the pending migrations of the database at `url` and returns the
/// versions it applied (empty when the schema was up to date).
///
/// # Errors
/// [`StoreError::Config`] when `url` does not parse or the server refuses the
/// role or database; [`StoreError::Unavailable`] when the database cannot be
/// reached; [`StoreError::Migration`] when a migration fails or the schema is
/// newer than this binary.
pub async fn migrate(url: &str) -> Result<Vec<i32>> {
    let config = parse_url(url)?;
    let (mut client, connection) = config.connect(NoTls).await.map_err(connect_pg_error)?;
    let conn = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "migration connection closed with an error");
        }
    });
    let res = apply(&mut client).await;
    drop(client);
    let _ = conn.await;
    res
}

/// Applies the pending migrations on `client`.
pub(crate) async fn apply(client: &mut tokio_postgres::Client) -> Result<Vec<i32>> {
    let tx = client.transaction().await.map_err(map_pg_error)?;
    // `CREATE TABLE IF NOT EXISTS` below would log a NOTICE on every start.
    tx.batch_execute("SET LOCAL client_min_messages = warning")
        .await
        .map_err(migration_error)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(migration_error)?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
             version    integer PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
         )",
    )
    .await
    .map_err(migration_error)?;
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
    let known = MIGRATIONS.iter().map(|(v, _)| *v).max().unwrap_or(0);
    if let Some(newest) = applied.iter().copied().max().filter(|v| *v > known) {
        return Err(StoreError::Migration(format!(
            "the database schema is at version {newest}, newer than this binary's {known}"
        )));
    }
    let mut done = Vec::new();
    for (version, sql) in MIGRATIONS {
        if applied.contains(version) {
            continue;
        }
        tx.batch_execute(sql).await.map_err(|e| {
            StoreError::Migration(format!("migration {version}: {}", pg_error_text(&e)))
        })?;
        tx.execute(
            "INSERT INTO schema_migrations (version) VALUES ($1)",
            &[version],
        )
        .await
        .map_err(migration_error)?;
        done.push(*version);
    }
    tx.commit().await.map_err(map_pg_error)?;
    if !done.is_empty() {
        tracing::info!(versions = ?done, "applied PostgreSQL migrations");
    }
    Ok(done)
}
