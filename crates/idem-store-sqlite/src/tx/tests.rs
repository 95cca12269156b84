//! The task column list against the migrated table.

#![allow(clippy::unwrap_used)]

use super::*;

/// The one column list names every column of the migrated `tasks` table
/// and nothing else, and the statements generated from it prepare.
#[test]
fn the_column_list_is_the_task_table() {
    let dir = tempfile::tempdir().unwrap();
    let mut conn = Connection::open(dir.path().join("idem.db")).unwrap();
    crate::migrate(&mut conn).unwrap();
    let mut stmt = conn
        .prepare("SELECT name FROM pragma_table_info('tasks')")
        .unwrap();
    let mut table: Vec<String> = stmt
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    drop(stmt);
    let mut listed: Vec<String> = TASK_COLUMN_NAMES.iter().map(|c| (*c).to_owned()).collect();
    table.sort();
    listed.sort();
    assert_eq!(listed, table);
    for sql in [TASK_INSERT.as_str(), TASK_UPDATE.as_str(), SCOPE_WITH_TASK] {
        conn.prepare(sql).unwrap();
    }
    assert!(
        TASK_UPDATE.contains("version = version + 1"),
        "{}",
        *TASK_UPDATE
    );
    assert!(
        TASK_UPDATE.ends_with("?34 AND generation = ?35"),
        "{}",
        *TASK_UPDATE
    );
}
