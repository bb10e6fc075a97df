-- outboxd schema, version 19: a replay's history row reads as a replay.
--
-- outbox.replay wrote its `replayed` row into outbox.attempts with the message's last
-- class and error, copied from the attempt that killed it: `outboxd show` and the console
-- then listed the replay as a second failure, with the old error, and an operator read it
-- as a replay that had failed. The row now records the action alone (outcome, actor,
-- time, and the attempt count it followed), with no class and no error; the failure stays
-- on the attempt row before it. Everything else of the function is unchanged, the
-- ambiguous class kept on the message included (sql/0017). Rows written before this
-- migration are left as they are.
--
-- A CREATE OR REPLACE of the function: no lock beyond the catalog's, no table rewritten.

CREATE OR REPLACE FUNCTION outbox.replay(message_ids bigint[], actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(id bigint, message_key text)
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_missing  text;
    v_not_dead text;
BEGIN
    -- As the other actions (outbox.lock_named): a NULL list or id is an error, not nothing.
    IF message_ids IS NULL THEN
        RAISE EXCEPTION 'message_ids must not be null; nothing replayed'
            USING ERRCODE = '22023', COLUMN = 'message_ids';
    END IF;
    IF array_position(message_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'message_ids must not contain null; nothing replayed'
            USING ERRCODE = '22023', COLUMN = 'message_ids';
    END IF;
    -- Lock the rows first (in id order, so two replays cannot deadlock), then check.
    PERFORM 1 FROM outbox.messages m WHERE m.id = ANY(message_ids) ORDER BY m.id FOR UPDATE;

    SELECT string_agg(x::text, ', ' ORDER BY x) INTO v_missing
    FROM unnest(message_ids) AS x
    WHERE NOT EXISTS (SELECT 1 FROM outbox.messages m WHERE m.id = x);
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'no message with id %; nothing replayed', v_missing USING ERRCODE = 'P0002';
    END IF;

    SELECT string_agg(format('%s (%s, %s)', m.id, quote_literal(m.message_key), m.state), ', ' ORDER BY m.id)
    INTO v_not_dead
    FROM outbox.messages m
    WHERE m.id = ANY(message_ids) AND m.state <> 'dead';
    IF v_not_dead IS NOT NULL THEN
        RAISE EXCEPTION 'not dead, so not replayed: %; nothing replayed', v_not_dead
            USING ERRCODE = '55000';
    END IF;

    -- The history's row records the action, not a failure: no class and no error. The
    -- failure it answers is on the attempt row before it.
    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'replayed'
    FROM outbox.messages m
    WHERE m.id = ANY(message_ids);

    -- An ambiguous class stays (and its line): the next attempt is then the one after an
    -- ambiguous attempt, and looks up first when the payload names a lookup. Cleared, the
    -- replay sent the request again without asking, which is the duplicate the lookup is
    -- for.
    RETURN QUERY
    UPDATE outbox.messages m SET
        state       = 'pending',
        attempts    = 0,
        run_after   = now(),
        error_class = CASE WHEN m.error_class = 'ambiguous' THEN 'ambiguous' END,
        last_error  = CASE WHEN m.error_class = 'ambiguous' THEN m.last_error END,
        dead_at     = NULL,
        updated_at  = now()
    WHERE m.id = ANY(message_ids)
    RETURNING m.id, m.message_key;

    PERFORM pg_notify('outbox_messages', '');
END
$$;
