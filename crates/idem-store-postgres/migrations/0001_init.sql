-- idem schema v1 (PostgreSQL). Mirrors crates/idem-store-sqlite/migrations/0001_init.sql
-- column for column. Times are epoch milliseconds (bigint); JSON is text (serialized by
-- serde_json, so a stored document round-trips byte for byte); ids are uuid.

CREATE TABLE api_keys (
    id          uuid PRIMARY KEY,
    tenant      text NOT NULL,
    role        text NOT NULL CHECK (role IN ('client', 'executor', 'admin')),
    operations  text,                      -- JSON array, NULL = all classes
    key_hash    text NOT NULL UNIQUE,      -- SHA-256 hex of the plain key; the plain key is never stored
    created_at  bigint NOT NULL,
    revoked_at  bigint
);

CREATE TABLE tasks (
    id                uuid PRIMARY KEY,
    tenant            text NOT NULL,
    operation         text NOT NULL,
    idempotency_key   text NOT NULL,
    fingerprint       text NOT NULL,
    canonical_request text NOT NULL,
    params            text NOT NULL,
    state             text NOT NULL CHECK (state IN ('queued','running','retry_wait','reconciling','succeeded','failed','cancelled')),
    generation        bigint NOT NULL CHECK (generation >= 0),
    version           bigint NOT NULL,
    event_seq         bigint NOT NULL,
    attempt_count     bigint NOT NULL,
    execute_count     bigint NOT NULL,
    usage             bigint NOT NULL,
    contract          text NOT NULL,
    cancellation      text,
    delivery          text,
    failure           text,
    api_key_id        uuid NOT NULL REFERENCES api_keys(id),
    next_kind         text CHECK (next_kind IN ('execute','reconcile')),
    active_attempt_id uuid,
    ready_at          bigint NOT NULL,
    deadline_at       bigint NOT NULL,
    terminal_at       bigint,
    key_expires_at    bigint,
    created_at        bigint NOT NULL,
    updated_at        bigint NOT NULL,
    -- a terminal task never holds a lease; a delivered task is never cancelled
    CHECK (terminal_at IS NULL OR active_attempt_id IS NULL),
    CHECK (NOT (state = 'cancelled' AND delivery IS NOT NULL))
);

-- Claim scan: claimable tasks of a tenant and class, oldest ready first.
CREATE INDEX tasks_claimable ON tasks (tenant, operation, ready_at)
    WHERE active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling');
CREATE INDEX tasks_wake ON tasks (ready_at) WHERE state = 'retry_wait';
CREATE INDEX tasks_key_expiry ON tasks (key_expires_at) WHERE key_expires_at IS NOT NULL;

-- The scope -> task binding (SPEC §2.1, IDEM-01): one row per (tenant, operation, key),
-- written in the same transaction as the task (the scope row is inserted first, hence
-- the deferred foreign key). Removed only by the retention sweeper.
CREATE TABLE idempotency_keys (
    tenant          text NOT NULL,
    operation       text NOT NULL,
    idempotency_key text NOT NULL,
    fingerprint     text NOT NULL,
    task_id         uuid NOT NULL UNIQUE REFERENCES tasks(id) DEFERRABLE INITIALLY DEFERRED,
    PRIMARY KEY (tenant, operation, idempotency_key)
);

CREATE TABLE attempts (
    id               uuid PRIMARY KEY,
    task_id          uuid NOT NULL REFERENCES tasks(id),
    number           bigint NOT NULL,
    generation       bigint NOT NULL,
    kind             text NOT NULL CHECK (kind IN ('execute','reconcile')),
    state            text NOT NULL CHECK (state IN ('leased','acknowledged','succeeded','failed','unknown','expired','cancelled','committed','not_committed')),
    executor_id      text NOT NULL,
    leased_at        bigint NOT NULL,
    lease_expires_at bigint NOT NULL,
    lease_ms         bigint NOT NULL,
    usage            bigint NOT NULL,
    external_txn_id  text,
    report           text,
    UNIQUE (task_id, number),
    UNIQUE (task_id, generation)          -- fencing tokens never repeat (RETRY-01)
);

CREATE INDEX attempts_active_lease ON attempts (lease_expires_at) WHERE state IN ('leased', 'acknowledged');

CREATE TABLE evidence (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id     uuid NOT NULL REFERENCES tasks(id),
    attempt_id  uuid NOT NULL REFERENCES attempts(id),
    received_at bigint NOT NULL,
    generation  bigint NOT NULL,
    outcome     text NOT NULL,
    body        text NOT NULL,
    disposition text NOT NULL
);
CREATE INDEX evidence_attempt ON evidence (attempt_id, id);

-- Append-only audit history (SPEC §2.10).
CREATE TABLE events (
    task_id uuid NOT NULL REFERENCES tasks(id),
    seq     bigint NOT NULL,
    type    text NOT NULL,
    at      bigint NOT NULL,
    data    text NOT NULL,
    PRIMARY KEY (task_id, seq)
);

CREATE FUNCTION idem_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION idem_append_only();
CREATE TRIGGER evidence_append_only BEFORE UPDATE OR DELETE ON evidence
    FOR EACH ROW EXECUTE FUNCTION idem_append_only();
