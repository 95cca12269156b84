-- idem schema v10 (PostgreSQL): the W3C trace context a task was submitted with.
--
-- A submit may carry a `traceparent` header (W3C Trace Context Level 1; SPEC
-- §4 `POST /v1/tasks`): kept on the task as sent (55 characters, checked by
-- idem before it is written) and handed to every executor that claims one
-- of its attempts. NULL for a task submitted without one, and for every task
-- accepted before this version. Fixed at acceptance, like the fingerprint it
-- takes no part in. A nullable column without a default is added without
-- rewriting the table.

ALTER TABLE tasks ADD COLUMN traceparent text CHECK (traceparent IS NULL OR length(traceparent) = 55);
