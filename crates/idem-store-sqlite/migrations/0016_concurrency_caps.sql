-- idem schema v16 (SQLite): concurrency caps (SPEC §8.2 "Concurrency caps").
--
--   * tasks.concurrency_key: the value read from params at submit under the
--     class's `flow.concurrency_key` pointer (a string as it is, other JSON
--     as its canonical text); NULL: no key, and for every task accepted
--     before this version.
--   * lease_slots: one row per leased attempt and cap that applies to it.
--     A cap scope (a JSON array naming the cap: tenant, class, tenant and
--     class, or a concurrency key of a tenant and class) has the slots
--     0..cap; the primary key lets a slot be held by one attempt only. A row
--     is deleted in the transaction in which its attempt stops holding its
--     task's lease; a claim also removes a scope's rows whose attempt no
--     longer holds its task's lease (left by a binary of v15).

ALTER TABLE tasks ADD COLUMN concurrency_key TEXT;

CREATE TABLE lease_slots (
    scope      TEXT    NOT NULL,
    slot       INTEGER NOT NULL CHECK (slot >= 0),
    task_id    TEXT    NOT NULL,
    attempt_id TEXT    NOT NULL,
    PRIMARY KEY (scope, slot)
) WITHOUT ROWID;

CREATE INDEX lease_slots_task ON lease_slots (task_id);
