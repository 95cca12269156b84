-- idem schema v12 (PostgreSQL): an attempt may end `released` (SPEC §4
-- `POST /v1/attempts/{id}/release`: its executor gave it back before
-- starting it).
--
-- The check on attempts.state is replaced by one that accepts the same
-- values and `released`. The new set holds every value the old one did, so
-- every existing row satisfies it: `NOT VALID` adds it without scanning the
-- table (new and updated rows are checked all the same), and the lock it
-- takes is held only for the catalog change. A binary of schema v11 writes
-- none of the new value and keeps serving while a newer instance migrates.
-- SQLite has no check on this column, so its schema has no counterpart.

ALTER TABLE attempts
    DROP CONSTRAINT attempts_state_check,
    ADD CONSTRAINT attempts_state_check CHECK (state IN ('leased','acknowledged','succeeded','failed','unknown','expired','cancelled','committed','not_committed','released')) NOT VALID;
