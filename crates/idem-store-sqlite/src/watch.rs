//! The database file as the store opened it ([`FileWatch`]): a file removed
//! or replaced under a running store fails the store for good, so no write is
//! acknowledged that went into a file no longer at its path.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use idem_store::StoreError;

use crate::unavailable;

/// The database file as the store opened it: its path and (device, inode),
/// and whether it has been found removed or replaced since (then for good).
#[derive(Debug)]
pub struct FileWatch {
    path: PathBuf,
    /// (device, inode) of `path` at open; `None` where the platform has none.
    id: Option<(u64, u64)>,
    failed: OnceLock<StoreError>,
    /// (device, inode) of the write-ahead log `<path>-wal`, taken the first
    /// time a check finds it: SQLite keeps (and reuses) that file while any
    /// connection is open, so once seen it must stay the same file.
    wal: OnceLock<(u64, u64)>,
}

impl FileWatch {
    /// Takes the identity of the file at `path` now.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when `path` cannot be read (naming it).
    pub fn new(path: &Path) -> Result<FileWatch, StoreError> {
        Ok(FileWatch {
            path: path.to_path_buf(),
            id: file_id(path).map_err(|e| unavailable(format!("{}: {e}", path.display())))?,
            failed: OnceLock::new(),
            wal: OnceLock::new(),
        })
    }

    /// The error the store failed with, if it has (no system call).
    pub fn failed(&self) -> Option<StoreError> {
        self.failed.get().cloned()
    }

    /// Checks that the file at the path is still the one opened (one
    /// `stat`). The first time it is not, logs one ERROR line and marks the
    /// store failed.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]: `the SQLite store file PATH was removed
    /// …` or `… was replaced by another file …`, then the same for every later
    /// call; or, when the path cannot be read for another reason (permission),
    /// that error, without marking the store failed.
    pub fn check(&self) -> Result<(), StoreError> {
        if let Some(e) = self.failed.get() {
            return Err(e.clone());
        }
        let Some(opened) = self.id else {
            return Ok(());
        };
        let what = match file_id(&self.path) {
            Ok(Some(now)) if now == opened => match self.wal_changed() {
                None => return Ok(()),
                Some(what) => what,
            },
            Ok(_) => "replaced by another file",
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "removed",
            Err(e) => {
                return Err(unavailable(format!(
                    "cannot check the SQLite store file {}: {e}",
                    self.path.display()
                )));
            }
        };
        let err = unavailable(format!(
            "the SQLite store file {} was {what} while idem had it open; every request is refused \
             (writes would go to a file no longer at that path, lost at the next restart): \
             restore the file if it was moved by mistake, then restart idem",
            self.path.display()
        ));
        if self.failed.set(err.clone()).is_ok()
            && let StoreError::Unavailable(message) = &err
        {
            tracing::error!("{message}");
        }
        Err(err)
    }

    /// What happened to the write-ahead log since it was first seen, if
    /// anything: committed pages not yet checkpointed live only there, so a
    /// removed or replaced log loses acknowledged writes as surely as a
    /// removed database file.
    fn wal_changed(&self) -> Option<&'static str> {
        let mut wal = self.path.clone().into_os_string();
        wal.push("-wal");
        match file_id(Path::new(&wal)) {
            Ok(Some(now)) => match self.wal.get() {
                Some(seen) if *seen != now => {
                    Some("left without its write-ahead log (-wal replaced)")
                }
                Some(_) => None,
                None => {
                    let _ = self.wal.set(now);
                    None
                }
            },
            Ok(None) => None,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.wal.get().is_some() => {
                Some("left without its write-ahead log (-wal removed)")
            }
            Err(_) => None,
        }
    }
}

/// The (device, inode) of the file at `path` (following symbolic links, as
/// SQLite does when it opens it); `None` where the platform has none.
fn file_id(path: &Path) -> std::io::Result<Option<(u64, u64)>> {
    let meta = std::fs::metadata(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Ok(Some((meta.dev(), meta.ino())))
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        Ok(None)
    }
}
