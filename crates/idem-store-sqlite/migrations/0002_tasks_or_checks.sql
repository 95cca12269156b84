-- idem schema v2 (SQLite): the same `tasks` table, with its state and
-- next_kind checks and the claim index written as OR chains instead of IN
-- lists. SQLite evaluates a constant IN list of more than two values through a
-- scratch table opened for every INSERT and UPDATE of a task; the OR chain
-- accepts and refuses exactly the same rows without it. SQLite cannot alter a
-- CHECK, so the table is rebuilt (https://sqlite.org/lang_altertable.html,
-- "Making Other Kinds Of Table Schema Changes"); the migration runner turns
-- foreign keys off around it and runs `PRAGMA foreign_key_check` before commit.

CREATE TABLE tasks_v2 (
    id                TEXT PRIMARY KEY,
    tenant            TEXT NOT NULL,
    operation         TEXT NOT NULL,
    idempotency_key   TEXT NOT NULL,
    fingerprint       TEXT NOT NULL,
    canonical_request TEXT NOT NULL,
    params            TEXT NOT NULL,
    state             TEXT NOT NULL CHECK (state = 'queued' OR state = 'running' OR state = 'retry_wait'
                                           OR state = 'reconciling' OR state = 'succeeded' OR state = 'failed'
                                           OR state = 'cancelled'),
    generation        INTEGER NOT NULL CHECK (generation >= 0),
    version           INTEGER NOT NULL,
    event_seq         INTEGER NOT NULL,
    attempt_count     INTEGER NOT NULL,
    execute_count     INTEGER NOT NULL,
    usage             INTEGER NOT NULL,
    contract          TEXT NOT NULL,
    cancellation      TEXT,
    delivery          TEXT,
    failure           TEXT,
    api_key_id        TEXT NOT NULL REFERENCES api_keys(id),
    next_kind         TEXT CHECK (next_kind = 'execute' OR next_kind = 'reconcile'),
    active_attempt_id TEXT,
    ready_at          INTEGER NOT NULL,
    deadline_at       INTEGER NOT NULL,
    terminal_at       INTEGER,
    key_expires_at    INTEGER,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    -- a terminal task never holds a lease; a delivered task is never cancelled
    CHECK (terminal_at IS NULL OR active_attempt_id IS NULL),
    CHECK (NOT (state = 'cancelled' AND delivery IS NOT NULL))
) STRICT;

INSERT INTO tasks_v2 SELECT * FROM tasks;
DROP TABLE tasks;
ALTER TABLE tasks_v2 RENAME TO tasks;

-- Claim scan: claimable tasks of a tenant and class, oldest ready first. The
-- claim query repeats this predicate word for word so that SQLite uses the index.
CREATE INDEX tasks_claimable ON tasks (tenant, operation, ready_at)
    WHERE active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling');
CREATE INDEX tasks_wake ON tasks (ready_at) WHERE state = 'retry_wait';
CREATE INDEX tasks_key_expiry ON tasks (key_expires_at) WHERE key_expires_at IS NOT NULL;
