-- idem schema v15 (PostgreSQL): the store's identity (SPEC §2.11). One row:
-- the cluster's system identifier and the timeline of the primary idem last
-- found, and an epoch that changes each time a new identity is recorded (the
-- compare-and-set of the identity check is on it). When an instance finds
-- the database on another timeline or system (a failover, a point-in-time or
-- base backup restore, a logical restore elsewhere) it records the new
-- identity and moves the tasks that may have started to reconcile-first in
-- the same transaction; claims lease nothing while the row and the database
-- disagree.
--
-- An expand step: a new table that binaries of schema v14 never read.

CREATE TABLE IF NOT EXISTS store_identity (
    id                smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    epoch             uuid NOT NULL,
    system_identifier text,
    timeline          bigint,
    restored          boolean NOT NULL DEFAULT false,
    recorded_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
