-- idem schema v15 (SQLite): rate limits (SPEC §8.1). One row per token
-- bucket, by scope (`tenant:<tenant>`, `class:<class>`, `starts:<class>`),
-- holding GCRA's theoretical arrival time in µs since the epoch, written by
-- the one writer in the submit's or claim's transaction. A new table only
-- (an expand step).
CREATE TABLE rate_limits (
    scope  TEXT PRIMARY KEY,
    tat_us INTEGER NOT NULL
) STRICT;
