-- idem schema v9 (PostgreSQL): change notifications name the backoff.
--
-- Each `NOTIFY idem_changes` of an event (migration 8) carries a fifth
-- element, the event's `data.backoff_ms` for `retry_scheduled` and
-- `reconciliation_required` (null otherwise), so an instance wakes a waiting
-- claim when a task's backoff has passed (SPEC §4, "Waiting executors").
-- Binaries read payloads of four elements as well (no backoff known).

CREATE OR REPLACE FUNCTION idem_notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_changes',
                      json_build_array(n.tenant, n.operation, n.task_id, n.type,
                             CASE WHEN n.type IN ('retry_scheduled', 'reconciliation_required')
                                  THEN (n.data::jsonb ->> 'backoff_ms')::bigint
                             END)::text)
       FROM new_events n;
    RETURN NULL;
END
$$;
