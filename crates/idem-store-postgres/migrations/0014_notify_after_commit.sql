-- idem schema v14 (PostgreSQL): changes are announced after commit.
--
-- A `NOTIFY` sent inside a data transaction makes PostgreSQL take one
-- database-wide lock at commit (the notification queue's), so every
-- committing transaction that notifies waits for every other one, WAL flush
-- included. Binaries of this version announce each committed transaction's
-- events themselves, after `COMMIT`, from a connection of their own, and
-- start every session with `idem.notify = off`: the `events` trigger then
-- sends nothing. Sessions without the setting (binaries of earlier versions
-- during a rolling upgrade, `psql`, and the migration transaction itself,
-- which sets it `on`) keep notifying as migration 9 does, in the same
-- payload form. The trigger can be dropped by a later contract migration,
-- once no binary of an earlier version serves.

CREATE OR REPLACE FUNCTION idem_notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('idem.notify', true) = 'off' THEN
        RETURN NULL;
    END IF;
    PERFORM pg_notify('idem_changes',
                      json_build_array(n.tenant, n.operation, n.task_id, n.type,
                             CASE WHEN n.type IN ('retry_scheduled', 'reconciliation_required')
                                  THEN (n.data::jsonb ->> 'backoff_ms')::bigint
                             END)::text)
       FROM new_events n;
    RETURN NULL;
END
$$;
