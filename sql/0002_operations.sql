-- outboxd schema, version 2: operator actions as functions, so that psql users and the CLI
-- follow the same rules.

-- Replay dead messages: dead → pending, attempts reset to 0, due now, the same key (so
-- providers still deduplicate), and a `replayed` row in each history carrying the error
-- that killed it. All or nothing: an unknown id raises P0002 (no_data_found), a message
-- that is not dead raises 55000 (object_not_in_prerequisite_state), both naming the
-- messages, and then nothing is replayed. Wakes idle workers at commit.
--
--   SELECT * FROM outbox.replay(ARRAY[17, 18]);
--   SELECT * FROM outbox.replay(ARRAY(SELECT id FROM outbox.messages
--                                     WHERE state = 'dead' AND error_class = 'exhausted'));
CREATE FUNCTION outbox.replay(message_ids bigint[], actor text DEFAULT current_user::text)
RETURNS TABLE (id bigint, message_key text)
LANGUAGE plpgsql
AS $$
DECLARE
    v_missing  text;
    v_not_dead text;
BEGIN
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

    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error)
    SELECT m.id, m.attempts, actor, now(), now(), 'replayed', m.error_class, m.last_error
    FROM outbox.messages m
    WHERE m.id = ANY(message_ids);

    RETURN QUERY
    UPDATE outbox.messages m SET
        state       = 'pending',
        attempts    = 0,
        run_after   = now(),
        error_class = NULL,
        last_error  = NULL,
        dead_at     = NULL,
        updated_at  = now()
    WHERE m.id = ANY(message_ids)
    RETURNING m.id, m.message_key;

    PERFORM pg_notify('outbox_messages', '');
END
$$;

-- Delete one batch of finished messages (and, by cascade, their history): delivered rows
-- whose delivered_at is older than `older_than`, and with include_dead also dead rows whose
-- dead_at is. Returns how many rows it deleted; call it until it returns 0. Small batches
-- keep each transaction (and its locks) short; SKIP LOCKED keeps it off rows a worker or
-- an operator is touching. Refuses less than 24 hours: a key's dedup record must outlive
-- the provider's retry window.
CREATE FUNCTION outbox.purge(older_than interval, include_dead boolean DEFAULT false, batch_size integer DEFAULT 1000)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_deleted bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '24 hours' THEN
        RAISE EXCEPTION 'older_than must be at least 24 hours' USING ERRCODE = '22023', COLUMN = 'older_than';
    END IF;
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'batch_size must be at least 1' USING ERRCODE = '22023', COLUMN = 'batch_size';
    END IF;
    WITH old_delivered AS (
        SELECT m.id FROM outbox.messages m
        WHERE m.state = 'delivered' AND m.delivered_at < now() - older_than
        ORDER BY m.delivered_at LIMIT batch_size FOR UPDATE SKIP LOCKED
    ), old_dead AS (
        SELECT m.id FROM outbox.messages m
        WHERE include_dead AND m.state = 'dead' AND m.dead_at < now() - older_than
        ORDER BY m.dead_at LIMIT batch_size FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM outbox.messages m
        WHERE m.id IN (SELECT id FROM old_delivered UNION ALL SELECT id FROM old_dead)
        RETURNING 1
    )
    SELECT count(*) INTO v_deleted FROM gone;
    RETURN v_deleted;
END
$$;
