-- idem schema v16 (PostgreSQL): suspected second effects (SPEC §2 "Second
-- effects"). Two tables, each unique per task and external transaction id
-- (`txn_key`: the id, or 'null' for a report without one, so that NULL
-- counts as one distinct id):
--   * effect_reports: the first effect report (evidence that the external
--     effect happened: an applied, stale, late or duplicate `succeeded` /
--     `committed` report, or an operator's committed resolve) of each
--     distinct id of a task. The state machine compares them with the
--     delivery; search by `external_txn_id` finds a task through them.
--   * second_effects: each suspected second effect, raised once per distinct
--     id (the unique constraint holds it in the database), with the
--     operator's acknowledgment once given (resolution, reason, actor as
--     its event's JSON, time: all four or none).
--
--   * tasks.effect_report_count: how many effect_reports rows the task has,
--     written by the task update of the transition that records one. A task
--     reads its effect reports and second effects only when it is above 0,
--     so the common task (no effect report) costs no extra read. Binaries of
--     schema v15 never write effect reports, so the DEFAULT 0 stays true for
--     the tasks they create and update during a rolling upgrade.
--   * evidence_external_txn: an index on the `external_txn_id` of each
--     evidence row's report body (the expression the search spells), so
--     rows written before this step or by binaries of schema v15 are found
--     too, and no table is rewritten. Search by `external_txn_id` finds a
--     task through it: every id any report of its attempts carried,
--     whatever its outcome or disposition (a stale `unknown` or `failed`
--     included).
--
-- An expand step: new tables, a column and an index that binaries of schema
-- v15 never read (their explicit column lists leave the column to its default).
--
-- The table locks come first, as in schemas v3 and v4, tasks before evidence
-- (the order every data transaction takes them in): the foreign keys below
-- would otherwise take a weaker lock on tasks that the ALTER TABLE then
-- upgrades, which deadlocks with a transaction of a running instance that
-- holds a row lock of tasks and waits to write one. Reads and writes of
-- tasks and evidence wait while this step runs (the index build included).

LOCK TABLE tasks, evidence IN ACCESS EXCLUSIVE MODE;

CREATE TABLE IF NOT EXISTS effect_reports (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id         uuid NOT NULL REFERENCES tasks(id),
    external_txn_id text,
    txn_key         text GENERATED ALWAYS AS (COALESCE('id:' || external_txn_id, 'null')) STORED,
    attempt_id      uuid,
    generation      bigint NOT NULL,
    evidence        text NOT NULL,
    reported_at     bigint NOT NULL,
    UNIQUE (task_id, txn_key)
);
CREATE INDEX IF NOT EXISTS effect_reports_external_txn
    ON effect_reports (external_txn_id) WHERE external_txn_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS second_effects (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id         uuid NOT NULL REFERENCES tasks(id),
    external_txn_id text,
    txn_key         text GENERATED ALWAYS AS (COALESCE('id:' || external_txn_id, 'null')) STORED,
    attempt_id      uuid,
    generation      bigint NOT NULL,
    evidence        text NOT NULL,
    suspected_at    bigint NOT NULL,
    resolution      text,
    reason          text,
    actor           text,
    acknowledged_at bigint,
    UNIQUE (task_id, txn_key),
    CHECK ((resolution IS NULL) = (acknowledged_at IS NULL)
       AND (reason IS NULL) = (acknowledged_at IS NULL)
       AND (actor IS NULL) = (acknowledged_at IS NULL))
);
CREATE INDEX IF NOT EXISTS second_effects_unacknowledged
    ON second_effects (task_id) WHERE acknowledged_at IS NULL;

ALTER TABLE tasks ADD COLUMN IF NOT EXISTS effect_report_count bigint NOT NULL DEFAULT 0;

CREATE INDEX IF NOT EXISTS evidence_external_txn
    ON evidence ((body::jsonb ->> 'external_txn_id'))
    WHERE (body::jsonb ->> 'external_txn_id') IS NOT NULL;
