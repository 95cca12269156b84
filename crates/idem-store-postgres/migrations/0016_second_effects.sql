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
-- An expand step: new tables that binaries of schema v15 never read.

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
