-- idem schema (PostgreSQL): fair claims, priorities and shared executor pools
-- (SPEC §2.13).
--
--   * tasks.priority: 1 (least urgent) to 5 (most urgent), 3 unless the
--     submit named one. Claims take a tenant's and class's tasks in
--     `ready_at - priority * 10000` order (the claim rank: each level is
--     worth 10 s of waiting, so a task's effective priority rises with its
--     time in queue), then id.
--   * tasks.fairness_key: the value at the class's `fairness_key` pointer
--     ('' when the params have none), NULL for a class without a pointer.
--   * tasks_claim_rank replaces tasks_claim_order (same predicate, the claim
--     rank instead of ready_at), so a task write still updates one claim
--     index; tasks_claim_fair orders the tasks that carry a fairness key by
--     their value too (only those pay for it).
--   * api_keys.serves: the tenants a pool executor key claims for, as JSON
--     (`"all"` or an array of tenants); NULL = its own tenant.
--   * claim_turns: the claim queues of fair claims and their turns (virtual
--     time, advanced by 1,000,000 / weight per lease). One row per (tenant,
--     class) with fairness_key '' (the tenant level) and, for classes with a
--     fairness key, one per value ('=' || value; '~' for tasks without one).
--     A claim that finds a queue without a task waiting parks it (out of
--     the turn order); a submit (in its task insert), a task write that
--     leaves a task waiting to be claimed, and the sweeper (for the writes
--     that raced with a claim parking the queue) unpark it at the lowest
--     turn of its level. Rows are never deleted.
--
-- An expand step: columns with defaults, a table and indexes binaries of the
-- previous schema never read. Their claims order by ready_at without an index
-- that gives that order (slower with a long backlog, the same answers), and
-- their submits write no claim_turns rows (the sweeper of a binary of this
-- schema inserts the tenant queues their tasks lack, SPEC §2.13).

LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;
ALTER TABLE tasks ADD COLUMN priority bigint NOT NULL DEFAULT 3 CHECK (priority BETWEEN 1 AND 5);
ALTER TABLE tasks ADD COLUMN fairness_key text;
CREATE INDEX tasks_claim_rank ON tasks (tenant, operation, (ready_at - priority * 10000), id)
    WHERE active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling');
CREATE INDEX tasks_claim_fair ON tasks (tenant, operation, fairness_key, (ready_at - priority * 10000), id)
    WHERE fairness_key IS NOT NULL AND active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling');
DROP INDEX tasks_claim_order;

ALTER TABLE api_keys ADD COLUMN serves text;

CREATE TABLE claim_turns (
    tenant       text   NOT NULL,
    operation    text   NOT NULL,
    fairness_key text   NOT NULL DEFAULT '',
    turn         bigint NOT NULL,
    parked       boolean NOT NULL DEFAULT false,
    PRIMARY KEY (tenant, operation, fairness_key)
);
CREATE INDEX claim_turns_tenants ON claim_turns (operation, turn, tenant) WHERE fairness_key = '' AND NOT parked;
CREATE INDEX claim_turns_keys ON claim_turns (tenant, operation, turn) WHERE fairness_key <> '' AND NOT parked;

CREATE INDEX claim_turns_parked ON claim_turns (tenant, operation, fairness_key) WHERE parked;

INSERT INTO claim_turns (tenant, operation, fairness_key, turn)
    SELECT DISTINCT tenant, operation, '', 0 FROM tasks
     WHERE active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling');
