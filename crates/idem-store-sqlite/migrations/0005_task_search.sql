-- idem schema v5 (SQLite): task search (SPEC §4 `GET /v1/tasks`).
--
-- A search page is the newest tasks of one tenant (ORDER BY created_at DESC,
-- id DESC) after a keyset cursor, optionally in some states and classes. The
-- search reads one ordered range per (state[, class]) and merges them, each
-- range stopping at the page size, so a page costs the same for a thousand
-- tasks or ten million:
--   * tasks_search_state: (tenant, state) ranges, for pages of any class;
--   * tasks_search_operation: (tenant, operation, state) ranges, for pages of
--     one class or of a key granted some classes.
-- An idempotency-key prefix is a range of the BINARY collation (byte order,
-- which is code point order for UTF-8), never a LIKE pattern (whose `%` and
-- `_` would be wildcards and which SQLite compares case-insensitively).
-- A provider's transaction id is found through the attempt that reported it.

CREATE INDEX tasks_search_state ON tasks (tenant, state, created_at, id);
CREATE INDEX tasks_search_operation ON tasks (tenant, operation, state, created_at, id);
CREATE INDEX tasks_search_key ON tasks (tenant, idempotency_key);
CREATE INDEX attempts_external_txn ON attempts (external_txn_id) WHERE external_txn_id IS NOT NULL;
