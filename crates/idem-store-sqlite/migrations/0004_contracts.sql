-- idem schema v4 (SQLite): contracts stored once.
--
-- A task keeps the contract it was accepted under (SPEC §2.9), and the tasks
-- of one operation class and configuration version share one. Each distinct
-- contract is one row of `contracts`, keyed by its content id (SHA-256 of its
-- JSON text, 32 bytes), and a task row names that id. Existing tasks keep
-- their contract text: each distinct text becomes a row under its id, computed
-- by `idem_contract_id`, which the migration runner defines on the
-- connection. `contract_id` takes the place of `contract`, so the table is
-- rebuilt (https://sqlite.org/lang_altertable.html); the migration runner
-- turns foreign keys off around it and runs `PRAGMA foreign_key_check` before
-- commit.

CREATE TABLE contracts (
    id       BLOB PRIMARY KEY CHECK (length(id) = 32),
    contract TEXT NOT NULL
) STRICT, WITHOUT ROWID;

INSERT INTO contracts (id, contract)
    SELECT idem_contract_id(contract), contract FROM tasks GROUP BY contract;

CREATE TABLE tasks_v4 (
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
    contract_id       BLOB NOT NULL REFERENCES contracts(id),
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

INSERT INTO tasks_v4 (id, tenant, operation, idempotency_key, fingerprint, canonical_request, params, state, generation, version, event_seq, attempt_count, execute_count, usage, contract_id, cancellation, delivery, failure, api_key_id, next_kind, active_attempt_id, ready_at, deadline_at, terminal_at, key_expires_at, created_at, updated_at)
    SELECT id, tenant, operation, idempotency_key, fingerprint, canonical_request, params, state, generation, version, event_seq, attempt_count, execute_count, usage, idem_contract_id(contract), cancellation, delivery, failure, api_key_id, next_kind, active_attempt_id, ready_at, deadline_at, terminal_at, key_expires_at, created_at, updated_at FROM tasks;
DROP TABLE tasks;
ALTER TABLE tasks_v4 RENAME TO tasks;

CREATE INDEX tasks_claim_order ON tasks (tenant, operation, ready_at, id)
    WHERE active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling');
CREATE INDEX tasks_wake ON tasks (ready_at) WHERE state = 'retry_wait';
CREATE INDEX tasks_key_expiry ON tasks (key_expires_at) WHERE key_expires_at IS NOT NULL;
