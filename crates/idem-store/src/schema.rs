//! Which database schemas a binary serves: the expand/contract rule of
//! rolling upgrades (docs/operations.md, "Upgrading"; SPEC §5).
//!
//! Every migration declares `compatible_from`: the oldest schema version
//! whose binaries can still serve on the schema it produces. An expand step
//! (a column, table, index or wider check that older code neither reads nor
//! violates) keeps the previous version's; a contract step (dropping or
//! tightening what older code uses) raises it to its own. Each store records
//! the declaration next to the version it applied, so that any later binary
//! reads it from the database, including one older than the migration.
//!
//! A database's [`SchemaVersion`] is its newest applied version and the
//! highest `compatible_from` of all applied migrations (a migration recorded
//! without one counts as a contract step: its own version). A binary whose
//! newest known migration is `known` serves a schema at `known`, or a newer
//! one declared compatible with `known`; every other schema it refuses
//! ([`SchemaVersion::check`]), at start-up (exit 1) and on `/readyz` (503,
//! [`SchemaWatch`]).

use std::sync::Mutex;
use std::time::Duration;

use crate::{Clock, Result, StoreError};

/// One schema change of a store (`crates/idem-store-*/migrations/NNNN_*.sql`)
/// and which binaries can serve the schema it produces.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Its version, `NNNN` of its file.
    pub version: i32,
    /// The oldest schema version whose binaries can still serve on the
    /// schema it produces: the previous version for an expand step, its own
    /// for a contract step. Recorded next to the version, so that binaries
    /// older than it read it.
    pub compatible_from: i32,
    /// Its statements, run in the migration's transaction.
    pub sql: &'static str,
}

impl Migration {
    /// A contract step (and every migration from before the expand/contract
    /// rule): only binaries of `version` or newer serve its schema.
    pub const fn contract(version: i32, sql: &'static str) -> Migration {
        Migration {
            version,
            compatible_from: version,
            sql,
        }
    }

    /// An expand step: binaries of the previous version still serve its
    /// schema.
    pub const fn expand(version: i32, sql: &'static str) -> Migration {
        Migration {
            version,
            compatible_from: version - 1,
            sql,
        }
    }
}

/// Checks a store's list of migrations: versions count up from 1, no
/// migration declares itself served by binaries newer than itself, and none
/// lowers what an earlier contract step raised.
///
/// # Errors
/// The first migration that breaks one, described.
pub fn check_declarations(migrations: &[Migration]) -> std::result::Result<(), String> {
    let mut from = 0;
    for (i, m) in migrations.iter().enumerate() {
        if usize::try_from(m.version).ok() != Some(i + 1) {
            return Err(format!(
                "migration {} is number {} in the list",
                m.version,
                i + 1
            ));
        }
        if m.compatible_from > m.version || m.compatible_from < from {
            return Err(format!(
                "migration {} declares compatible_from {}, outside {from}..={}",
                m.version, m.compatible_from, m.version
            ));
        }
        from = m.compatible_from;
    }
    Ok(())
}

/// The `compatible_from` a store records for migration `version` of
/// `migrations` (a list [`check_declarations`] accepts): a contract step's
/// own version; an expand step's is what the schema it declares compatible
/// is served by, so the binaries that served the schema before a run of
/// expand steps serve it after all of them (two expand steps in one release
/// do not shut out the release before).
pub fn recorded_compatible_from(migrations: &[Migration], version: i32) -> i32 {
    let mut v = version;
    loop {
        let Some(m) = usize::try_from(v - 1).ok().and_then(|i| migrations.get(i)) else {
            return v.max(0);
        };
        if m.compatible_from >= m.version {
            return m.version;
        }
        v = m.compatible_from;
    }
}

/// A database's schema as its migrations recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaVersion {
    /// The newest migration applied (0: none, not an idem database).
    pub found: i64,
    /// The oldest schema version whose binaries can serve on this schema: the
    /// highest `compatible_from` recorded by its migrations, each migration
    /// recorded without one counting as its own version.
    pub compatible_from: i64,
}

impl SchemaVersion {
    /// Whether a binary that knows migrations up to `known` serves this
    /// schema: it is `known`, or newer and declared compatible with `known`
    /// (`compatible_from <= known`).
    ///
    /// # Errors
    /// [`StoreError::Migration`] from [`schema_mismatch`] naming both
    /// versions (`what`: `store` or `database`) when it is older (a binary
    /// that may migrate applies the missing steps before it asks) or newer
    /// and not declared compatible.
    pub fn check(self, what: &str, known: i64) -> Result<()> {
        if self.found == known || (self.found > known && self.compatible_from <= known) {
            return Ok(());
        }
        if self.found > known {
            return Err(StoreError::Migration(format!(
                "the {what}'s schema is at version {}, newer than this binary's {known}, and its migrations \
                 declare it served only by binaries of schema version {} or newer: use a newer idem",
                self.found, self.compatible_from
            )));
        }
        Err(schema_mismatch(what, self.found, known))
    }
}

/// [`StoreError::Migration`] for a store whose schema is at version `found`
/// while this binary's is at `known` (`what`: `store` or `database`): not an
/// idem one (0), older (run `idem migrate`) or newer (use a newer idem). For
/// opening a store without migrating it.
pub fn schema_mismatch(what: &str, found: i64, known: i64) -> StoreError {
    StoreError::Migration(if found == 0 {
        format!(
            "not an idem {what} (schema version 0; this binary's is {known}): check --store, or run `idem migrate` to make one"
        )
    } else if found < known {
        format!(
            "the {what}'s schema is at version {found}, older than this binary's {known}: run `idem migrate` first"
        )
    } else {
        format!(
            "the {what}'s schema is at version {found}, newer than this binary's {known} and not declared compatible with it: use a newer idem"
        )
    })
}

/// How long a running instance trusts its last reading of the schema version
/// ([`SchemaWatch`]): a `/readyz` reads the database's schema again at most
/// this often, and otherwise only checks that the database answers.
pub const SCHEMA_RECHECK: Duration = Duration::from_secs(3);

/// The last verdict on the schema of a running instance's database: another
/// instance may migrate it under this one, and readiness must then say that
/// this one can no longer serve it. Read at most every [`SCHEMA_RECHECK`] of
/// the store's [`Clock`] (a test moves a test clock instead of waiting).
#[derive(Debug, Default)]
pub struct SchemaWatch {
    /// When the schema was last read (epoch ms of the store's clock), and
    /// the verdict (the refusal's text).
    last: Mutex<Option<(i64, std::result::Result<(), String>)>>,
}

impl SchemaWatch {
    /// A watch that has read nothing yet.
    pub fn new() -> SchemaWatch {
        SchemaWatch::default()
    }

    /// The verdict read less than [`SCHEMA_RECHECK`] ago by `clock`, if any
    /// (none once that clock reads earlier than it did then).
    ///
    /// # Errors
    /// The [`StoreError::Migration`] that verdict was.
    pub fn fresh(&self, clock: &Clock) -> Option<Result<()>> {
        let last = self.last.lock().ok()?;
        let (at, verdict) = last.as_ref()?;
        let age = clock.process_now().ms().checked_sub(*at)?;
        let recheck = i64::try_from(SCHEMA_RECHECK.as_millis()).unwrap_or(i64::MAX);
        (0..recheck)
            .contains(&age)
            .then(|| verdict.clone().map_err(StoreError::Migration))
    }

    /// Records `verdict`, read now by `clock`, and hands it back. An error other than
    /// [`StoreError::Migration`] (the database did not answer) says nothing
    /// about the schema and is not kept.
    ///
    /// # Errors
    /// `verdict`'s.
    pub fn record(&self, clock: &Clock, verdict: Result<()>) -> Result<()> {
        let kept = match &verdict {
            Ok(()) => Some(Ok(())),
            Err(StoreError::Migration(m)) => Some(Err(m.clone())),
            Err(_) => None,
        };
        if let (Some(kept), Ok(mut last)) = (kept, self.last.lock()) {
            *last = Some((clock.process_now().ms(), kept));
        }
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(found: i64, compatible_from: i64) -> SchemaVersion {
        SchemaVersion {
            found,
            compatible_from,
        }
    }

    #[test]
    fn declarations_count_up_and_never_lower_compatibility() {
        let ok = [
            Migration::contract(1, ""),
            Migration::contract(2, ""),
            Migration::expand(3, ""),
        ];
        assert_eq!(check_declarations(&ok), Ok(()));
        let gap = [Migration::contract(1, ""), Migration::contract(3, "")];
        assert!(check_declarations(&gap).is_err());
        let mut lowered = ok;
        lowered[2].compatible_from = 1;
        assert!(check_declarations(&lowered).is_err());
    }

    #[test]
    fn expand_steps_in_a_row_keep_what_the_last_contract_step_recorded() {
        let list = [
            Migration::contract(1, ""),
            Migration::contract(2, ""),
            Migration::expand(3, ""),
            Migration::expand(4, ""),
            Migration::expand(5, ""),
            Migration::contract(6, ""),
            Migration::expand(7, ""),
        ];
        let recorded: Vec<i32> = (1..=7)
            .map(|v| recorded_compatible_from(&list, v))
            .collect();
        assert_eq!(recorded, [1, 2, 2, 2, 2, 6, 6]);
        let first = [Migration::expand(1, "")];
        assert_eq!(recorded_compatible_from(&first, 1), 0);
    }

    #[test]
    fn a_binary_serves_its_own_schema_and_newer_ones_declared_compatible() {
        assert!(schema(11, 11).check("database", 11).is_ok());
        assert!(schema(12, 11).check("database", 11).is_ok(), "expand step");
        assert!(schema(14, 10).check("database", 11).is_ok());
    }

    #[test]
    fn a_newer_schema_not_declared_compatible_is_refused_naming_both_versions() {
        let e = schema(13, 13)
            .check("database", 12)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("version 13") && e.contains("this binary's 12"),
            "{e}"
        );
        assert!(e.contains("schema version 13 or newer"), "{e}");
        let e = schema(13, 12)
            .check("database", 11)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("version 13") && e.contains("this binary's 11"),
            "{e}"
        );
    }

    #[test]
    fn an_older_schema_is_refused_naming_both_versions() {
        let e = schema(11, 11).check("store", 12).unwrap_err().to_string();
        assert!(e.contains("version 11, older than this binary's 12"), "{e}");
        let e = schema(0, 0).check("store", 12).unwrap_err().to_string();
        assert!(e.contains("not an idem store"), "{e}");
    }

    #[test]
    fn the_watch_keeps_schema_verdicts_for_the_recheck_interval_but_not_outages() {
        let clock = Clock::test();
        let watch = SchemaWatch::new();
        assert!(watch.fresh(&clock).is_none());
        let _ = watch.record(&clock, Err(StoreError::Unavailable("down".into())));
        assert!(
            watch.fresh(&clock).is_none(),
            "an outage says nothing about the schema"
        );
        let _ = watch.record(&clock, schema(13, 13).check("database", 12));
        assert!(matches!(
            watch.fresh(&clock),
            Some(Err(StoreError::Migration(_)))
        ));
        let _ = watch.record(&clock, Ok(()));
        clock.advance(SCHEMA_RECHECK - Duration::from_millis(1));
        assert!(matches!(watch.fresh(&clock), Some(Ok(()))));
        clock.advance(Duration::from_millis(1));
        assert!(watch.fresh(&clock).is_none(), "read again once stale");
    }
}
