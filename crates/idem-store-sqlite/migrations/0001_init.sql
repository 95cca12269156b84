-- idem schema v1 (SQLite). Times are epoch milliseconds (INTEGER); JSON is TEXT.
-- The PostgreSQL schema mirrors this one column for column.

CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    role        TEXT NOT NULL CHECK (role IN ('client', 'executor', 'admin')),
    operations  TEXT,                      -- JSON array, NULL = all classes
    key_hash    TEXT NOT NULL UNIQUE,      -- SHA-256 hex of the plain key; the plain key is never stored
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
) STRICT;

CREATE TABLE tasks (
    id                TEXT PRIMARY KEY,
    tenant            TEXT NOT NULL,
    operation         TEXT NOT NULL,
    idempotency_key   TEXT NOT NULL,
    fingerprint       TEXT NOT NULL,
    canonical_request TEXT NOT NULL,
    params            TEXT NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('queued','running','retry_wait','reconciling','succeeded','failed','cancelled')),
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
    next_kind         TEXT CHECK (next_kind IN ('execute','reconcile')),
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

-- Claim scan: claimable tasks of a tenant and class, oldest ready first.
CREATE INDEX tasks_claimable ON tasks (tenant, operation, ready_at)
    WHERE active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling');
CREATE INDEX tasks_wake ON tasks (ready_at) WHERE state = 'retry_wait';
CREATE INDEX tasks_key_expiry ON tasks (key_expires_at) WHERE key_expires_at IS NOT NULL;

-- The scope → task binding (SPEC §2.1, IDEM-01): one row per (tenant, operation, key),
-- written in the same transaction as the task. Removed only by the retention sweeper.
CREATE TABLE idempotency_keys (
    tenant          TEXT NOT NULL,
    operation       TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    fingerprint     TEXT NOT NULL,
    task_id         TEXT NOT NULL UNIQUE REFERENCES tasks(id) DEFERRABLE INITIALLY DEFERRED,
    PRIMARY KEY (tenant, operation, idempotency_key)
) STRICT, WITHOUT ROWID;

CREATE TABLE attempts (
    id               TEXT PRIMARY KEY,
    task_id          TEXT NOT NULL REFERENCES tasks(id),
    number           INTEGER NOT NULL,
    generation       INTEGER NOT NULL,
    kind             TEXT NOT NULL CHECK (kind IN ('execute','reconcile')),
    state            TEXT NOT NULL,
    executor_id      TEXT NOT NULL,
    leased_at        INTEGER NOT NULL,
    lease_expires_at INTEGER NOT NULL,
    lease_ms         INTEGER NOT NULL,
    usage            INTEGER NOT NULL,
    external_txn_id  TEXT,
    report           TEXT,
    UNIQUE (task_id, number),
    UNIQUE (task_id, generation)          -- fencing tokens never repeat (RETRY-01)
) STRICT;

CREATE INDEX attempts_active_lease ON attempts (lease_expires_at) WHERE state IN ('leased', 'acknowledged');

CREATE TABLE evidence (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id     TEXT NOT NULL REFERENCES tasks(id),
    attempt_id  TEXT NOT NULL REFERENCES attempts(id),
    received_at INTEGER NOT NULL,
    generation  INTEGER NOT NULL,
    outcome     TEXT NOT NULL,
    body        TEXT NOT NULL,
    disposition TEXT NOT NULL
) STRICT;
CREATE INDEX evidence_attempt ON evidence (attempt_id, id);

-- Append-only audit history (SPEC §2.10).
CREATE TABLE events (
    task_id TEXT NOT NULL REFERENCES tasks(id),
    seq     INTEGER NOT NULL,
    type    TEXT NOT NULL,
    at      INTEGER NOT NULL,
    data    TEXT NOT NULL,
    PRIMARY KEY (task_id, seq)
) STRICT, WITHOUT ROWID;

CREATE TRIGGER events_append_only_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER events_append_only_delete BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER evidence_append_only_update BEFORE UPDATE ON evidence
BEGIN SELECT RAISE(ABORT, 'evidence is append-only'); END;
