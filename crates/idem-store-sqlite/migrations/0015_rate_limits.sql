-- idem schema v15 (SQLite): the rate limits' tables (SPEC §5 "Flow
-- control"); this file holds the version's place in the sequence.

SELECT 1;
