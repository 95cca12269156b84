-- idem schema v3 (SQLite): claims walk an index in claim order.
--
-- A claim takes the oldest ready tasks of its tenant and operation classes
-- (ORDER BY ready_at, id). With `operation IN (…)` and no id in the index,
-- every claim read and sorted the tenant's whole claimable backlog on the one
-- writer thread: 16 ms per claim with 22,000 queued tasks, during which no
-- submit could commit. The claim now reads this index once per class, in
-- order, and stops at its limit (0.02 ms for the same backlog). It replaces the
-- old index, so a task write still updates one claim index. The predicate is
-- repeated word for word by the claim query so that SQLite uses the index.

CREATE INDEX tasks_claim_order ON tasks (tenant, operation, ready_at, id)
    WHERE active_attempt_id IS NULL AND (state = 'queued' OR state = 'retry_wait' OR state = 'reconciling');
DROP INDEX tasks_claimable;
