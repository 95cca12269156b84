-- idem schema (SQLite): operator redrives grant execute attempts.
--
-- `POST /v1/tasks/{id}/redrive` (SPEC §4 "Operator actions") sends a failed
-- task back to the queue with one more execute attempt than its frozen
-- contract's `max_attempts`. The contract is shared by every task of its
-- class and version and never changes, so the grant is the task's own: its
-- execute limit is `max_attempts + attempts_granted`.

ALTER TABLE tasks ADD COLUMN attempts_granted INTEGER NOT NULL DEFAULT 0 CHECK (attempts_granted >= 0);
