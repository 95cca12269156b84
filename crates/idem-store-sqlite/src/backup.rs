//! `idem backup`: a consistent copy of a store while a server writes to it,
//! checked, and marked as a restored backup's (SPEC §2.11).
//!
//! The copy is made with `VACUUM INTO`: one statement that reads the whole
//! database in one read transaction, so it holds exactly what was committed
//! when that transaction began (every task acknowledged before the backup
//! began), and in WAL mode it neither blocks the server's writer nor is
//! restarted by it (SQLite's online backup API copies page by page and
//! starts over whenever another connection writes the source, unless it
//! copies everything in one step, which is what `VACUUM INTO` does anyway,
//! compacted, with no extra crate feature).

use std::path::{Path, PathBuf};
use std::time::Instant;

use rusqlite::{Connection, OpenFlags};
use uuid::Uuid;

use idem_store::StoreError;

use crate::{MIGRATIONS, open_connection, require_file_path, unavailable};

/// What [`backup`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupReport {
    /// The copy.
    pub path: PathBuf,
    /// Its size, bytes.
    pub bytes: u64,
    /// Tasks it holds.
    pub tasks: i64,
    /// Its schema version (`PRAGMA user_version`).
    pub schema_version: i64,
    /// How long the copy took (`VACUUM INTO`), ms.
    pub copy_ms: u64,
    /// How long `PRAGMA integrity_check` took, ms.
    pub check_ms: u64,
}

/// Copies the store at `source` to the new file `to` while it may be in use,
/// marks the copy as a restored backup's (`store_identity.restored`: a store
/// opened on it records a new epoch and moves every task that may have
/// started to reconcile-first before it leases anything), then checks the
/// copy with `PRAGMA integrity_check`. The copy is written next to `to` under
/// a temporary name and linked to `to` only once checked, so `to` never
/// holds a partial or unchecked copy.
///
/// # Errors
/// [`StoreError::Config`] when `to` exists or `source` is not an idem store
/// of this binary's schema (migrate it first); [`StoreError::Corrupt`] when
/// the copy fails its check (it is removed); [`StoreError::Unavailable`] for
/// I/O and SQLite failures.
pub fn backup(source: &Path, to: &Path) -> Result<BackupReport, StoreError> {
    require_file_path(source)?;
    require_file_path(to)?;
    if to.exists() {
        return Err(StoreError::Config(format!(
            "{} already exists; idem backup writes a new file and never replaces one",
            to.display()
        )));
    }
    if !source.exists() {
        return Err(StoreError::Config(format!(
            "no idem database at {}",
            source.display()
        )));
    }
    let version: i64 = Connection::open_with_flags(source, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .and_then(|c| c.query_row("PRAGMA user_version", [], |r| r.get(0)))
        .map_err(|e| unavailable(format!("{}: {e}", source.display())))?;
    let known = MIGRATIONS.len() as i64;
    if version < known {
        return Err(StoreError::Config(format!(
            "{} has schema version {version}, older than this binary's {known}: run `idem migrate` \
             (or start `idem serve`) on it first, so that its copy can be marked as a backup",
            source.display()
        )));
    }
    let tmp = partial_name(to);
    let result = copy_mark_check(source, &tmp, to);
    if result.is_err() {
        for f in [tmp.clone()]
            .into_iter()
            .chain(crate::companion_files(&tmp).into_iter().take(2))
        {
            let _ = std::fs::remove_file(f);
        }
    }
    result
}

/// `<to>.partial-<uuid>` in `to`'s directory.
fn partial_name(to: &Path) -> PathBuf {
    let mut name = to.as_os_str().to_owned();
    name.push(format!(".partial-{}", Uuid::new_v4().simple()));
    PathBuf::from(name)
}

fn copy_mark_check(source: &Path, tmp: &Path, to: &Path) -> Result<BackupReport, StoreError> {
    let db = |e: rusqlite::Error| unavailable(e);
    let started = Instant::now();
    {
        let conn = open_connection(source)?;
        let target = tmp.to_string_lossy().into_owned();
        conn.execute("VACUUM INTO ?1", [&target]).map_err(db)?;
    }
    let copy_ms = started.elapsed().as_millis() as u64;
    let started = Instant::now();
    let (tasks, schema_version) = {
        let conn =
            Connection::open_with_flags(tmp, OpenFlags::SQLITE_OPEN_READ_WRITE).map_err(db)?;
        conn.execute_batch("PRAGMA busy_timeout = 5000; PRAGMA journal_mode = DELETE;")
            .map_err(db)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        // The source may never have recorded an identity (a store no server
        // has opened since its migration): the copy gets one, marked.
        conn.execute(
            "INSERT INTO store_identity (id, epoch, restored, recorded_at) VALUES (1, ?1, 1, ?2) \
             ON CONFLICT (id) DO UPDATE SET restored = 1",
            rusqlite::params![Uuid::new_v4().to_string(), now],
        )
        .map_err(db)?;
        let problems: Vec<String> = conn
            .prepare("PRAGMA integrity_check")
            .and_then(|mut s| {
                s.query_map([], |r| r.get::<_, String>(0))?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(db)?;
        if problems != ["ok"] {
            return Err(StoreError::Corrupt(format!(
                "the copy of {} failed PRAGMA integrity_check: {}",
                source.display(),
                problems.join("; ")
            )));
        }
        let tasks: i64 = conn
            .query_row("SELECT count(*) FROM tasks", [], |r| r.get(0))
            .map_err(db)?;
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(db)?;
        (tasks, version)
    };
    let check_ms = started.elapsed().as_millis() as u64;
    // A hard link never replaces an existing file (a `to` made meanwhile
    // makes it fail), unlike a rename.
    std::fs::hard_link(tmp, to).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            StoreError::Config(format!(
                "{} already exists; idem backup writes a new file and never replaces one",
                to.display()
            ))
        } else {
            unavailable(format!(
                "linking {} to {}: {e}",
                tmp.display(),
                to.display()
            ))
        }
    })?;
    let _ = std::fs::remove_file(tmp);
    let bytes = std::fs::metadata(to)
        .map_err(|e| unavailable(format!("{}: {e}", to.display())))?
        .len();
    Ok(BackupReport {
        path: to.to_owned(),
        bytes,
        tasks,
        schema_version,
        copy_ms,
        check_ms,
    })
}
