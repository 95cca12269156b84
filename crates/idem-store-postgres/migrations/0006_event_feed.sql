-- idem schema v6 (PostgreSQL): the tenant event feed (SPEC §4, "Live events").
--
-- Each event row carries its task's tenant and operation class (the feed is
-- read per tenant and limited to a key's grant), `txid`: the transaction id
-- (`pg_current_xact_id()`, xid8 as bigint) of the transaction that wrote it,
-- or the `txid` of the task's previous event when that is larger, and
-- `position`: a global sequence value taken at insert. The feed serves events
-- in (txid, position) order and only those whose txid is below the xmin of
-- the reading statement's snapshot: every transaction with a smaller id has
-- ended, so no event can later appear before the last one served (sequence
-- values alone are taken at insert and become visible at commit, out of
-- order). The `txid` of a task's previous event is carried forward so that
-- one task's events keep their `seq` order in the feed.
--
-- Existing events have no transaction id: they get txid 0 (before every new
-- event) and positions in the order of their task's creation, then `seq`.
-- The append-only trigger is off only while this transaction fills them.

CREATE SEQUENCE events_position_seq AS bigint;

ALTER TABLE events
    ADD COLUMN tenant text,
    ADD COLUMN operation text,
    ADD COLUMN txid bigint,
    ADD COLUMN position bigint;

ALTER TABLE events DISABLE TRIGGER events_append_only;
UPDATE events e
   SET tenant = o.tenant, operation = o.operation, txid = 0, position = o.n
  FROM (SELECT e2.task_id, e2.seq, t.tenant, t.operation,
               row_number() OVER (ORDER BY t.created_at, e2.task_id, e2.seq) AS n
          FROM events e2 JOIN tasks t ON t.id = e2.task_id) o
 WHERE e.task_id = o.task_id AND e.seq = o.seq;
ALTER TABLE events ENABLE TRIGGER events_append_only;

SELECT setval('events_position_seq', coalesce((SELECT max(position) FROM events), 0) + 1, false);

ALTER TABLE events
    ALTER COLUMN tenant SET NOT NULL,
    ALTER COLUMN operation SET NOT NULL,
    ALTER COLUMN txid SET NOT NULL,
    ALTER COLUMN txid SET DEFAULT (pg_current_xact_id()::text::bigint),
    ALTER COLUMN position SET NOT NULL,
    ALTER COLUMN position SET DEFAULT nextval('events_position_seq');
ALTER SEQUENCE events_position_seq OWNED BY events.position;

CREATE UNIQUE INDEX events_feed ON events (tenant, txid, position);
