-- idem schema v11 (SQLite): the operator console (SPEC §4 "Operator console").
--
-- console_sessions: one row per sign-in. The browser holds a random token;
-- only its SHA-256 (hex) is stored, with the signed-in key, its tenant and
-- role, and when the session was made, runs out and was ended (sign-out).
-- A lookup joins api_keys, so a revoked key's sessions stop at once. Rows
-- that ran out are removed a batch at a time by later sign-ins.
--
-- The overview's "needs attention" lists read short ranges:
--   * tasks_failed_at: a tenant's failed tasks by when they failed
--     (terminal_at changes only together with the state);
--   * tasks_cancel_requested: a tenant's live tasks with a cancellation
--     record (the record is written by the cancel itself; a settled one
--     makes or finds the task terminal, so these are the requested ones).
-- Reconciling tasks are read through tasks_search_state (v5), and the counts
-- by class and state through tasks_search_operation (v5), which covers them.

CREATE TABLE console_sessions (
    token_hash  TEXT PRIMARY KEY,          -- SHA-256 hex of the session token
    tenant      TEXT NOT NULL,
    api_key_id  TEXT NOT NULL REFERENCES api_keys(id),
    role        TEXT NOT NULL CHECK (role IN ('client', 'executor', 'admin')),
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    ended_at    INTEGER,
    CHECK (expires_at > created_at)
) STRICT, WITHOUT ROWID;
CREATE INDEX console_sessions_expiry ON console_sessions (expires_at);

CREATE INDEX tasks_failed_at ON tasks (tenant, terminal_at) WHERE state = 'failed';
CREATE INDEX tasks_cancel_requested ON tasks (tenant, created_at)
    WHERE cancellation IS NOT NULL AND terminal_at IS NULL;
