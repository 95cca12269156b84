-- idem schema v6 (SQLite): the tenant event feed (SPEC §4, "Live events").
--
-- Each event row carries its task's tenant and operation class (the feed is
-- read per tenant and limited to a key's grant) and `position`, one more
-- than the largest position stored, given at insert. SQLite has one writer
-- and readers see whole commits, so position order is commit order and a
-- reader never sees a position appear below one it has already read.
--
-- Existing events get positions in the order of their task's creation, then
-- `seq`. The append-only update trigger is dropped only while this
-- transaction fills them, then created again word for word.

ALTER TABLE events ADD COLUMN tenant TEXT;
ALTER TABLE events ADD COLUMN operation TEXT;
ALTER TABLE events ADD COLUMN position INTEGER;

DROP TRIGGER events_append_only_update;
UPDATE events
   SET tenant = o.tenant, operation = o.operation, position = o.n
  FROM (SELECT e.task_id, e.seq, t.tenant, t.operation,
               row_number() OVER (ORDER BY t.created_at, e.task_id, e.seq) AS n
          FROM events e JOIN tasks t ON t.id = e.task_id) AS o
 WHERE events.task_id = o.task_id AND events.seq = o.seq;
CREATE TRIGGER events_append_only_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;

-- Columns added to a table cannot be NOT NULL without a default: new rows
-- are checked here instead.
CREATE TRIGGER events_feed_columns BEFORE INSERT ON events
    WHEN NEW.tenant IS NULL OR NEW.operation IS NULL OR NEW.position IS NULL
BEGIN SELECT RAISE(ABORT, 'an event needs its tenant, operation and position'); END;

CREATE UNIQUE INDEX events_position ON events (position);
CREATE INDEX events_feed ON events (tenant, position);
