//! The store's identity (SPEC §2.11): what a store records about the
//! database it writes to, so that it notices when that database went back
//! in time and never re-executes blindly what it had leased before.
//!
//! - PostgreSQL: the cluster's system identifier (`pg_control_system()`) and
//!   the timeline the primary writes WAL on (the first 8 hex digits of
//!   `pg_walfile_name(pg_current_wal_lsn())`, which a promoted standby
//!   answers with its new timeline at once, where `pg_control_checkpoint()`
//!   keeps the old one until the next checkpoint). A failover to a standby,
//!   a point-in-time restore and a base backup restore all start a new
//!   timeline; a logical restore into another cluster has another system
//!   identifier.
//! - SQLite: nothing of the file itself changes on a restore, so `idem
//!   backup` marks its copy as a backup (`restored`); a store opened on such
//!   a file takes a new epoch.
//!
//! Every store also holds an epoch (a UUID v4) that changes each time a new
//! identity is recorded: the compare-and-set of [`crate::Tx::record_identity`]
//! is on it, so of several instances noticing the same change at once one
//! records it and rewinds the tasks, and the others find it done.

use uuid::Uuid;

/// The identity a store recorded, or found, of its database.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StoreIdentity {
    /// Changes each time a new identity is recorded (UUID v4).
    pub epoch: Uuid,
    /// PostgreSQL's system identifier (decimal, as `pg_controldata` shows
    /// it); `None` on SQLite.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_identifier: Option<String>,
    /// PostgreSQL's timeline of the primary; `None` on SQLite.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<i64>,
}

/// What the database says about itself now ([`crate::Tx::database_identity`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseIdentity {
    /// PostgreSQL's system identifier, decimal.
    pub system_identifier: String,
    /// The timeline the primary writes WAL on.
    pub timeline: i64,
}

/// The identity row of a store ([`crate::Tx::recorded_identity`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedIdentity {
    /// The identity last recorded.
    pub identity: StoreIdentity,
    /// Whether the file is a copy `idem backup` made and no store has
    /// opened since (SQLite): it takes a new epoch when one does.
    pub restored: bool,
}

impl StoreIdentity {
    /// Whether the database that answers now is another than the one this
    /// identity was recorded on (another system identifier or timeline).
    pub fn differs_from(&self, db: &DatabaseIdentity) -> bool {
        self.system_identifier.as_deref() != Some(db.system_identifier.as_str())
            || self.timeline != Some(db.timeline)
    }
}

/// What a check of the store's identity found ([`crate::Store::check_identity`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityCheck {
    /// No identity was recorded yet (a new store, or one migrated from a
    /// schema without it): this one is recorded, nothing rewound.
    Recorded(StoreIdentity),
    /// The database is the one recorded (or another instance recorded the
    /// new identity first, and rewound).
    Unchanged(StoreIdentity),
    /// The database went back in time: the new identity is recorded and
    /// `tasks` tasks were moved to reconcile-first in the same transaction.
    Rewound {
        /// The identity recorded before.
        from: StoreIdentity,
        /// The identity recorded now.
        to: StoreIdentity,
        /// Whether the change was a restored backup (SQLite).
        restored: bool,
        /// Tasks changed ([`idem_core::machine::store_rewound`]).
        tasks: usize,
    },
}
