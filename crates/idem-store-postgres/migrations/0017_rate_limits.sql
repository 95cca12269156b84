-- idem schema v17 (PostgreSQL): rate limits (SPEC §8.1). One row per token
-- bucket, by scope (`tenant:<tenant>`, `class:<class>`, `starts:<class>`),
-- holding GCRA's theoretical arrival time in µs since the epoch. A submit or
-- claim that takes a token locks the row until it commits, so one limit holds
-- across every instance on this database. A new table only: running
-- instances of schema v16 never read it (an expand step).
CREATE TABLE rate_limits (
    scope  text PRIMARY KEY,
    tat_us bigint NOT NULL
);
