-- idem schema v4 (PostgreSQL): contracts stored once.
--
-- A task keeps the contract it was accepted under (SPEC §2.9), and the tasks
-- of one operation class and configuration version share one. Each distinct
-- contract is one row of `contracts`, keyed by its content id (SHA-256 of its
-- JSON text as UTF-8, 32 bytes), and a task row names that id. Existing tasks
-- keep their contract text: each distinct text becomes a row under its id,
-- and `contract_id` replaces `contract`.
--
-- The table lock comes first, as in schema v3: reads and writes of tasks wait
-- while the rows are rewritten.

LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;

CREATE TABLE contracts (
    id       bytea PRIMARY KEY CHECK (length(id) = 32),
    contract text NOT NULL
);

INSERT INTO contracts (id, contract)
    SELECT sha256(convert_to(contract, 'UTF8')), contract FROM tasks GROUP BY contract;

ALTER TABLE tasks ADD COLUMN contract_id bytea;
UPDATE tasks SET contract_id = sha256(convert_to(contract, 'UTF8'));
ALTER TABLE tasks
    ALTER COLUMN contract_id SET NOT NULL,
    ADD CONSTRAINT tasks_contract_id_fkey FOREIGN KEY (contract_id) REFERENCES contracts (id),
    DROP COLUMN contract;
