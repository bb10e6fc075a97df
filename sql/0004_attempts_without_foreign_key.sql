-- outboxd schema, version 4: outbox.attempts without a foreign key.
--
-- From a profile of the worker's hot path (bench/RESULTS.md): the foreign key check on every
-- attempt row was about a third of the completion statement.
--
-- PostgreSQL checks a foreign key with one SPI query (and a row lock on the message) per
-- inserted row. Every attempt row is written by the worker in the same statement that
-- updates, and so locks, its message (or, for a lease it lost, after checking that the
-- message exists), so the check proves nothing the statement does not already know. What
-- the key also gave, deleting a message's history with it, is kept by the triggers below:
-- a plain DELETE, outbox.purge and TRUNCATE of outbox.messages take the history along, as
-- ON DELETE CASCADE did (and TRUNCATE … CASCADE). They run with the owner's rights, as the cascade did: a role that
-- may delete messages need not be allowed to delete history rows.
ALTER TABLE outbox.attempts DROP CONSTRAINT IF EXISTS attempts_message_id_fkey;

CREATE FUNCTION outbox.messages_delete_history() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- One statement per DELETE statement, through attempts_message_idx.
    DELETE FROM outbox.attempts a USING gone g WHERE a.message_id = g.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER messages_delete_history
    AFTER DELETE ON outbox.messages
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.messages_delete_history();

CREATE FUNCTION outbox.messages_truncate_history() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- DELETE, not TRUNCATE: `TRUNCATE outbox.attempts, outbox.messages` fires this with
    -- outbox.attempts already truncated by the same statement, which a nested TRUNCATE
    -- refuses ("being used by active queries").
    DELETE FROM outbox.attempts;
    RETURN NULL;
END
$$;

CREATE TRIGGER messages_truncate_history
    AFTER TRUNCATE ON outbox.messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.messages_truncate_history();
