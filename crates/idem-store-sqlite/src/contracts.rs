//! Which contract rows each SQLite database file this process writes is
//! known to hold ([`StoredContracts`]), so a submit writes a task's contract
//! row only the first time this process meets its id in that file.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use idem_store::contracts::StoredContracts;
use rusqlite::Connection;

/// The contract ids each database file this process writes is known to hold
/// ([`StoredContracts`]), by the file's path.
static STORED: LazyLock<Mutex<HashMap<String, Arc<StoredContracts>>>> =
    LazyLock::new(Mutex::default);

/// The [`StoredContracts`] of the database `conn` has open.
pub(crate) fn stored_contracts(conn: &Connection) -> Arc<StoredContracts> {
    let path = conn.path().unwrap_or_default();
    let mut all = STORED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match all.get(path) {
        Some(s) => Arc::clone(s),
        None => Arc::clone(all.entry(path.to_owned()).or_default()),
    }
}
