-- idem schema v13 (SQLite): the store's identity (SPEC §2.11). One row: an
-- epoch (a UUID) that changes each time a new identity is recorded, and
-- `restored`, which `idem backup` sets on its copy: a store opened on a
-- restored copy takes a new epoch and moves the tasks that may have started
-- to reconcile-first in the same transaction, and claims lease nothing while
-- `restored` is set.
--
-- An expand step: a new table that binaries of schema v12 never read.

CREATE TABLE IF NOT EXISTS store_identity (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    epoch       TEXT NOT NULL,
    restored    INTEGER NOT NULL DEFAULT 0 CHECK (restored IN (0, 1)),
    recorded_at INTEGER NOT NULL
);
