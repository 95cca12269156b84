-- idem schema v13 (PostgreSQL): secrets the instances share through the
-- store, made once by whichever instance needs one first. `task_cursor`
-- authenticates the cursors of the task search (SPEC §4 "Task search"), so
-- that every instance (and `idem task list`) accepts exactly the cursors any
-- of them gave out.
--
-- An expand step: a new table that binaries of schema v12 never read.

CREATE TABLE IF NOT EXISTS shared_secrets (
    name       text PRIMARY KEY,
    secret     bytea NOT NULL CHECK (octet_length(secret) = 32),
    created_at bigint NOT NULL
);
