-- idem schema (SQLite): fair claims, priorities and shared executor pools
-- (SPEC §2.13). The same columns, table and indexes as PostgreSQL's
-- 0019_fair_claims.sql (its header gives each one's meaning): claims order a
-- tenant's and class's tasks by the claim rank `ready_at - priority * 10000`
-- (tasks_claim_rank replaces tasks_claim_order; the predicate and the
-- expression are repeated word for word by the claim queries so that SQLite
-- uses the index), claim_turns holds the fair claims' queues and turns, and
-- api_keys.serves a pool key's tenants.

ALTER TABLE tasks ADD COLUMN priority INTEGER NOT NULL DEFAULT 3 CHECK (priority BETWEEN 1 AND 5);
ALTER TABLE tasks ADD COLUMN fairness_key TEXT;
CREATE INDEX tasks_claim_rank ON tasks (tenant, operation, ready_at - priority * 10000, id)
    WHERE active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling');
CREATE INDEX tasks_claim_fair ON tasks (tenant, operation, fairness_key, ready_at - priority * 10000, id)
    WHERE fairness_key IS NOT NULL AND active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling');
DROP INDEX tasks_claim_order;

ALTER TABLE api_keys ADD COLUMN serves TEXT;

CREATE TABLE claim_turns (
    tenant       TEXT    NOT NULL,
    operation    TEXT    NOT NULL,
    fairness_key TEXT    NOT NULL DEFAULT '',
    turn         INTEGER NOT NULL,
    parked       INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, operation, fairness_key)
) WITHOUT ROWID;
CREATE INDEX claim_turns_tenants ON claim_turns (operation, turn, tenant) WHERE fairness_key = '' AND NOT parked;
CREATE INDEX claim_turns_keys ON claim_turns (tenant, operation, turn) WHERE fairness_key <> '' AND NOT parked;

CREATE INDEX claim_turns_parked ON claim_turns (tenant, operation, fairness_key) WHERE parked;

INSERT INTO claim_turns (tenant, operation, fairness_key, turn)
    SELECT DISTINCT tenant, operation, '', 0 FROM tasks
     WHERE active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling');
