-- idem schema v17 (PostgreSQL): the rate limits' tables (SPEC §5 "Flow
-- control"); this file holds the version's place in the sequence.

SELECT 1;
