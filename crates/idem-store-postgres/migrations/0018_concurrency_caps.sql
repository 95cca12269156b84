-- idem schema v18 (PostgreSQL): concurrency caps (SPEC §8.2 "Concurrency caps").
--
--   * tasks.concurrency_key: the value read from params at submit under the
--     class's `flow.concurrency_key` pointer (a string as it is, other JSON
--     as its canonical text); NULL: no key, and for every task accepted
--     before this version. Nullable without a default: added without
--     rewriting the table. Binaries of v17 write NULL for their tasks.
--   * lease_slots: one row per leased attempt and cap that applies to it.
--     A cap scope (a JSON array naming the cap: tenant, class, tenant and
--     class, or a concurrency key of a tenant and class) has the slots
--     0..cap; the primary key lets a slot be held by one attempt only, so a
--     cap is never exceeded whatever the concurrency. A row is deleted in
--     the transaction in which its attempt stops holding its task's lease.
--     A claim also removes a scope's rows whose attempt no longer holds its
--     task's lease (left by v17 binaries during a rolling upgrade, which end
--     leases without knowing the table).

-- The table lock first, as in v16: a running instance's transactions then
-- wait for this step instead of deadlocking with it.

LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;

ALTER TABLE tasks ADD COLUMN concurrency_key text;

CREATE TABLE lease_slots (
    scope      text    NOT NULL,
    slot       integer NOT NULL CHECK (slot >= 0),
    task_id    uuid    NOT NULL,
    attempt_id uuid    NOT NULL,
    PRIMARY KEY (scope, slot)
);

CREATE INDEX lease_slots_task ON lease_slots (task_id);
