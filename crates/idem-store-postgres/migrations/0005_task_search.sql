-- idem schema v5 (PostgreSQL): task search (SPEC §4 `GET /v1/tasks`).
--
-- A search page is the newest tasks of one tenant (ORDER BY created_at DESC,
-- id DESC) after a keyset cursor, optionally in some states and classes. The
-- search reads one ordered range per (state[, class]) and merges them, each
-- range stopping at the page size, so a page costs the same for a thousand
-- tasks or ten million:
--   * tasks_search_state: (tenant, state) ranges, for pages of any class;
--   * tasks_search_operation: (tenant, operation, state) ranges, for pages of
--     one class or of a key granted some classes.
-- An idempotency-key prefix is a byte-wise range (`~>=~` / `~<~`), which the
-- text_pattern_ops operator class serves whatever the database's collation
-- (a LIKE pattern would make `%` and `_` in the prefix wildcards). A provider's
-- transaction id is found through the attempt that reported it.
--
-- The indexes are built in the migration's transaction (CREATE INDEX
-- CONCURRENTLY cannot run in one): writes to tasks wait while they build.

CREATE INDEX tasks_search_state ON tasks (tenant, state, created_at, id);
CREATE INDEX tasks_search_operation ON tasks (tenant, operation, state, created_at, id);
CREATE INDEX tasks_search_key ON tasks (tenant, idempotency_key text_pattern_ops);
CREATE INDEX attempts_external_txn ON attempts (external_txn_id) WHERE external_txn_id IS NOT NULL;
