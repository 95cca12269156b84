#!/usr/bin/env bash
# Which statements the sessions of one PostgreSQL database run, without
# pg_stat_statements or statement logging: samples pg_stat_activity every
# 2 ms for SECONDS (one transaction of its own, in a DO block that clears the
# statistics snapshot before each sample) and counts each statement once per
# (session, query_start). Statements that start within 2 ms of each other on
# one session can be missed, so the counts are a lower bound on busy
# sessions; on quiet ones (waiting executors, sweeps) they are exact.
#
# usage: scripts/pg-statements.sh postgres://postgres@127.0.0.1:5432/DB SECONDS
# prints: count per second, application_name, the statement's first 100 characters
set -euo pipefail
URL=$1; SECONDS_=$2
psql "$URL" -q -v ON_ERROR_STOP=1 -v secs="$SECONDS_" <<'SQL'
CREATE TEMP TABLE samples (pid int, app text, query_start timestamptz, query text);
SELECT set_config('idem.secs', :'secs', false);
DO $$
DECLARE until timestamptz := clock_timestamp() + (current_setting('idem.secs') || ' s')::interval;
BEGIN
  WHILE clock_timestamp() < until LOOP
    PERFORM pg_stat_clear_snapshot();
    INSERT INTO samples
      SELECT pid, application_name, query_start, left(regexp_replace(query, '\s+', ' ', 'g'), 100)
      FROM pg_stat_activity
      WHERE datname = current_database() AND pid <> pg_backend_pid() AND query_start IS NOT NULL
        AND query_start >= now();
    PERFORM pg_sleep(0.002);
  END LOOP;
END $$;
SELECT round(count(*) / current_setting('idem.secs')::numeric, 2) AS per_s, app, query
FROM (SELECT DISTINCT pid, app, query_start, query FROM samples) s
GROUP BY app, query ORDER BY count(*) DESC;
SQL
