-- idem schema v3 (PostgreSQL): claims walk an index in claim order.
--
-- A claim takes the oldest ready tasks of its tenant and operation classes
-- (ORDER BY ready_at, id). The old index (tenant, operation, ready_at) could not
-- give that order for `operation = ANY(...)`, nor break ties on id, so every
-- claim read and sorted the tenant's whole claimable backlog: 32 ms per claim
-- with 22,000 queued tasks. This index carries id as well, and the claim reads
-- it once per class (a LATERAL join) and stops at its limit: 0.2 ms for the
-- same backlog. It replaces the old index, so a task insert still updates one
-- claim index.
--
-- The table lock comes first: taking SHARE for the build and then ACCESS
-- EXCLUSIVE for the drop could deadlock with a transaction of an instance
-- still running the previous binary (row locks, then a write). Reads and
-- writes of tasks wait while the index builds.

LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;
CREATE INDEX tasks_claim_order ON tasks (tenant, operation, ready_at, id)
    WHERE active_attempt_id IS NULL AND state IN ('queued', 'retry_wait', 'reconciling');
DROP INDEX tasks_claimable;
