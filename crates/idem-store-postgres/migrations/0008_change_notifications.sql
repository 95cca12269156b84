-- idem schema v8 (PostgreSQL): change notifications (SPEC §4, "Waiting").
--
-- Every event row written sends `NOTIFY idem_changes` with the JSON array
-- `[tenant, operation, task_id, type]`. PostgreSQL delivers a transaction's
-- notifications only once it commits, to every listening session: each idem
-- instance listens on one connection and wakes the requests that wait for
-- that task, or for work of that class. One trigger call per statement (a
-- submit batch inserts many events in one statement); notifications are
-- hints, and a waiter always reads the store again.

CREATE FUNCTION idem_notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_changes',
                      json_build_array(n.tenant, n.operation, n.task_id, n.type)::text)
       FROM new_events n;
    RETURN NULL;
END
$$;

CREATE TRIGGER events_notify
    AFTER INSERT ON events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION idem_notify_events();
