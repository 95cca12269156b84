-- idem schema v2 (PostgreSQL): a submit no longer locks its API key's row.
--
-- The foreign key tasks.api_key_id -> api_keys made every task insert take a
-- FOR KEY SHARE lock on the submitting key's row: concurrent submit batches of
-- one key (every instance's batchers) all locked that one row, each new locker
-- building a MultiXact, and it cost about 5 % of new-key throughput
-- (docs/benchmarks.md). The guarantee it gave holds without it:
--   * the submit transaction reads the key in the same transaction and refuses
--     a revoked or unknown key (Tx::now_and_live_api_keys), and
--   * a key row is never deleted or truncated and its id never changes (below):
--     keys are revoked, and a task's api_key_id always names a key that exists.
-- SQLite keeps its foreign key: it takes no row lock there.

ALTER TABLE tasks DROP CONSTRAINT tasks_api_key_id_fkey;

CREATE FUNCTION idem_keys_never_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'api_keys rows are never deleted and their ids never change (revoke the key instead)'
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE TRIGGER api_keys_never_deleted BEFORE DELETE ON api_keys
    FOR EACH ROW EXECUTE FUNCTION idem_keys_never_deleted();
CREATE TRIGGER api_keys_never_truncated BEFORE TRUNCATE ON api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION idem_keys_never_deleted();
CREATE TRIGGER api_keys_id_fixed BEFORE UPDATE OF id ON api_keys
    FOR EACH ROW WHEN (NEW.id IS DISTINCT FROM OLD.id)
    EXECUTE FUNCTION idem_keys_never_deleted();
