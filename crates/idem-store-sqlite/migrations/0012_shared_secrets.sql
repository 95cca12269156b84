-- idem schema v12 (SQLite): secrets shared through the store, made once by
-- whoever needs one first (`task_cursor` authenticates the cursors of the
-- task search, SPEC §4 "Task search", for `idem serve` and `idem task list`
-- alike). An expand step: a new table that binaries of schema v11 never read.

CREATE TABLE IF NOT EXISTS shared_secrets (
    name       TEXT PRIMARY KEY,
    secret     BLOB NOT NULL CHECK (length(secret) = 32),
    created_at INTEGER NOT NULL
);
