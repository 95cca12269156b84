//! Opening the store a command names (`--store` / `IDEM_STORE`): SQLite or
//! PostgreSQL, created and migrated or required to exist, retried at start-up
//! while it is unavailable; the log line saying where the data goes; the
//! lock that keeps one `idem serve` per SQLite file.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use idem_store::Store;

use crate::StoreArgs;

/// Opens a store that must already exist: inspection commands never create a
/// database at a mistyped path.
pub(crate) async fn open_existing_store(args: &StoreArgs) -> Result<Store> {
    if let Some(path) = args.store.strip_prefix("sqlite://")
        && !std::path::Path::new(path).exists()
    {
        bail!(
            "no idem database at {path} (check --store / IDEM_STORE; `idem migrate` or `idem serve` creates one)"
        );
    }
    // Reading or administering a store never creates or upgrades its schema.
    open_store_with(args, false).await
}

/// Opens the store of `args`, creating it and applying pending migrations,
/// and checks its identity (SPEC §2.11): a store that went back in time is
/// rewound before anything is written to it.
pub(crate) async fn open_store(args: &StoreArgs) -> Result<Store> {
    let store = open_store_with(args, true).await?;
    store
        .check_identity()
        .await
        .context("checking the store's identity")?;
    Ok(store)
}

/// Opens the store of `args`; with `migrate` false it changes no schema and
/// refuses one that is not this binary's.
async fn open_store_with(args: &StoreArgs, migrate: bool) -> Result<Store> {
    if let Some(path) = args.store.strip_prefix("sqlite://") {
        let options = idem_store_sqlite::SqliteOptions {
            clock: match args.clock_offset_ms {
                0 => idem_store::Clock::real(),
                skew => idem_store::Clock::shifted(skew),
            },
        };
        let path = path.to_owned();
        return tokio::task::spawn_blocking(move || {
            if migrate {
                idem_store_sqlite::open(path, options)
            } else {
                idem_store_sqlite::open_existing(path, options)
            }
        })
        .await?
        .context("opening the SQLite store");
    }
    if is_postgres(&args.store) {
        let mut options =
            idem_store_postgres::PgOptions::default().with_max_size(args.pg_pool_size);
        options.migrate = migrate;
        return idem_store_postgres::connect(&args.store, options)
            .await
            .context("connecting to PostgreSQL");
    }
    bail!(
        "--store must start with sqlite://, postgres:// or postgresql://, got `{}`",
        args.store
    )
}

/// Whether `store` is a PostgreSQL URL (`postgres://` or `postgresql://`).
pub(crate) fn is_postgres(store: &str) -> bool {
    store.starts_with("postgres://") || store.starts_with("postgresql://")
}

/// Logs where the data of `args` goes, before it is opened: the SQLite file's
/// absolute path, or PostgreSQL's host, port, database, role and `sslmode`
/// (never the password).
///
/// # Errors
/// A PostgreSQL URL that does not parse or names no database (refused before
/// anything is connected), a store that is neither SQLite nor PostgreSQL.
pub(crate) fn log_store_location(args: &StoreArgs) -> Result<()> {
    if let Some(path) = args.store.strip_prefix("sqlite://") {
        let absolute =
            std::path::absolute(path).map_or_else(|_| path.to_owned(), |p| p.display().to_string());
        tracing::info!(store = "sqlite", path = %absolute, "store: SQLite file {absolute}");
        return Ok(());
    }
    if is_postgres(&args.store) {
        let target = idem_store_postgres::Target::of_url(&args.store)
            .context("reading the PostgreSQL store URL")?;
        tracing::info!(
            store = "postgres",
            host = %target.host,
            port = target.port,
            database = %target.database,
            user = %target.user.as_deref().unwrap_or("-"),
            sslmode = %target.ssl_mode.as_str(),
            hosts = %target.address_list(),
            read_write = target.read_write,
            "store: PostgreSQL database {} at {}{}",
            target.database,
            target.address_list(),
            if target.addresses.len() > 1 {
                " (the one that accepts writes)"
            } else {
                ""
            }
        );
        return Ok(());
    }
    bail!(
        "--store must start with sqlite://, postgres:// or postgresql://, got `{}`",
        args.store
    )
}

/// Opens the store, retrying while it is unavailable (the database is starting,
/// or its connections were terminated during start-up) for at most `wait`;
/// invalid configuration and migration errors fail at once, and so does an
/// embedded SQLite file (nothing to wait for).
pub(crate) async fn open_store_waiting(args: &StoreArgs, wait: Duration) -> Result<Store> {
    if args.store.starts_with("sqlite://") {
        return open_store(args).await;
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut backoff = Duration::from_millis(100);
    loop {
        // One try may hang (packets dropped after the handshake): bounded by
        // what is left of the wait, and by at least the pool timeout.
        let budget = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .max(Duration::from_secs(5));
        let err = match tokio::time::timeout(budget, open_store(args)).await {
            Ok(Ok(store)) => return Ok(store),
            Ok(Err(e)) => e,
            Err(_) => anyhow::Error::new(idem_store::StoreError::Unavailable(format!(
                "no answer from the database within {} ms",
                budget.as_millis()
            ))),
        };
        let unavailable = matches!(
            err.downcast_ref::<idem_store::StoreError>(),
            Some(idem_store::StoreError::Unavailable(_))
        );
        let now = tokio::time::Instant::now();
        if !unavailable || wait.is_zero() {
            return Err(err);
        }
        if now >= deadline {
            return Err(err.context(format!(
                "gave up after retrying for {} ms (IDEM_STORE_WAIT_MS)",
                wait.as_millis()
            )));
        }
        // The last try comes at the deadline itself.
        let pause = backoff.min(deadline - now);
        tracing::warn!(error = %format!("{err:#}"), retry_in_ms = pause.as_millis() as u64, "store unavailable at start-up; retrying");
        tokio::time::sleep(pause).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Refuses, for `idem migrate` and `idem keys create` on an SQLite store, a
/// file whose database is missing while others of it remain
/// ([`idem_store_sqlite::refuse_lost_store`]), and a file a running `idem
/// serve` holds when the command would create or migrate its schema under
/// that server (`keys create` on a store whose schema is current only adds
/// a row, which a running server reads as any other writer's). Nothing for
/// PostgreSQL, whose migrations serialise themselves.
///
/// # Errors
/// The refusal, naming the files.
pub(crate) fn refuse_sqlite_change_under_serve(
    args: &StoreArgs,
    changes_schema: bool,
) -> Result<()> {
    let Some(path) = args.store.strip_prefix("sqlite://") else {
        return Ok(());
    };
    let file = std::path::Path::new(path);
    idem_store_sqlite::refuse_lost_store(file).context("opening the SQLite store")?;
    let lock_path = format!("{path}.serve-lock");
    let Ok(lock) = std::fs::OpenOptions::new().write(true).open(&lock_path) else {
        // No lock file: no server has run here.
        return Ok(());
    };
    let serving = matches!(lock.try_lock(), Err(std::fs::TryLockError::WouldBlock));
    if !serving {
        return Ok(());
    }
    let current = file.exists()
        && idem_store_sqlite::schema_version(file).ok()
            == Some(idem_store_sqlite::MIGRATIONS.len() as i64);
    if changes_schema || !current {
        bail!(
            "a running `idem serve` holds {path} ({lock_path} is locked): stop it before \
             creating or migrating the store's schema"
        );
    }
    Ok(())
}

/// Holds an exclusive lock on `<file>.serve-lock` next to an SQLite store for
/// as long as the returned file lives: one `idem serve` per SQLite file (its
/// single writer and its process clock decide; docs/architecture.md). Other
/// commands (`keys`, `task`, `gc`) do not take it. `None` for PostgreSQL.
pub(crate) fn lock_sqlite_for_serve(args: &StoreArgs) -> Result<Option<std::fs::File>> {
    let Some(path) = args.store.strip_prefix("sqlite://") else {
        return Ok(None);
    };
    // Checked before the lock file is made next to it.
    idem_store_sqlite::require_file_path(std::path::Path::new(path))
        .context("opening the SQLite store")?;
    idem_store_sqlite::refuse_lost_store(std::path::Path::new(path))
        .context("opening the SQLite store")?;
    let lock_path = format!("{path}.serve-lock");
    if let Some(dir) = std::path::Path::new(&lock_path).parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {lock_path}"))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "another `idem serve` is already running on {path} (it holds {lock_path}); \
             run one per SQLite file, or use PostgreSQL for several instances"
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {lock_path}"))
        }
    }
}
