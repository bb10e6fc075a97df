-- outboxd schema, version 17: a replayed ambiguous message still looks up first,
-- destination_of runs on PostgreSQL 13, and a purge keeps a dead head of an ordering group.
--
-- 1. outbox.replay cleared `error_class`, so the attempt after replaying a message that was
--    dead `ambiguous` (it may have taken effect) did not know it came after an ambiguous one:
--    with a `reconcile` URL it sent the request again without asking the provider first,
--    the duplicate the lookup is there to prevent (contract, "Reconciliation"). An ambiguous
--    class now stays on the replayed row, with its line; other classes are cleared as
--    before. The history's `replayed` row is unchanged.
-- 2. outbox.destination_of took the authority after the last '@' with
--    split_part(…, '@', -1), which PostgreSQL 13 refuses ("field position must be greater
--    than zero"): on 13 every push and restore of a breaker's backlog failed. The same text
--    is now taken with regexp_replace; the names it gives are unchanged
--    (tests/it/destinations.rs holds them to the worker's).
--
-- 3. outbox.purge with include_dead deleted a dead message that headed its ordering group,
--    so the next message of the group was sent as if the head had been dealt with (the
--    contract: a dead message blocks its group until it is replayed or cancelled). Such a
--    row is now kept; a dead row with nothing waiting behind it goes as before.
--
-- 4. outbox.replay took a NULL list, or a NULL among the ids, as nothing to replay, and
--    recorded a NULL actor as such; it now refuses them (22023) and records the current
--    user, as approve, cancel and confirm do.
--
-- All four are CREATE OR REPLACE of functions: no lock beyond the catalog's, no table
-- rewritten.

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

    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'replayed',
           m.error_class, m.last_error
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

CREATE OR REPLACE FUNCTION outbox.destination_of(channel text, payload jsonb) RETURNS text
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $_$
DECLARE
    url text;
    scheme text;
    auth text;
    host text;
    port text;
BEGIN
    IF channel <> 'webhook' OR jsonb_typeof(payload -> 'url') IS DISTINCT FROM 'string' THEN
        RETURN NULL;
    END IF;
    url := payload ->> 'url';
    IF url !~ '^[A-Za-z][A-Za-z0-9+.-]*://' THEN
        RETURN NULL;
    END IF;
    scheme := lower(split_part(url, '://', 1));
    -- The authority: up to the first '/', '?' or '#', after the last '@'.
    auth := substr(url, length(scheme) + 4);
    -- After the last '@' (split_part with a negative position needs PostgreSQL 14).
    auth := regexp_replace(split_part(split_part(split_part(auth, '/', 1), '?', 1), '#', 1), '^.*@', '');
    -- Checked before lower-casing: lower() maps some non-ASCII letters to ASCII ones (the
    -- Kelvin sign to `k`), which would give a name the worker does not.
    IF auth !~ '^(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$' THEN
        RETURN NULL;
    END IF;
    auth := lower(auth);
    IF left(auth, 1) = '[' THEN
        host := split_part(auth, ']', 1) || ']';
        port := ltrim(split_part(auth, ']', 2), ':');
    ELSE
        host := rtrim(split_part(auth, ':', 1), '.');
        port := split_part(auth, ':', 2);
    END IF;
    IF host = '' THEN
        RETURN NULL;
    ELSIF port = '' OR (scheme = 'http' AND port::int = 80) OR (scheme = 'https' AND port::int = 443) THEN
        RETURN host;
    END IF;
    RETURN host || ':' || port::int::text;
END
$_$;

CREATE OR REPLACE FUNCTION outbox.purge(older_than interval, include_dead boolean DEFAULT false, batch_size integer DEFAULT 1000) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
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
    ), old_cancelled AS (
        SELECT m.id FROM outbox.messages m
        WHERE m.state = 'cancelled' AND m.cancelled_at < now() - older_than
        ORDER BY m.cancelled_at LIMIT batch_size FOR UPDATE SKIP LOCKED
    ), old_dead AS (
        -- Not a dead row that holds up its ordering group: it blocks the group until it is
        -- replayed or cancelled, and deleting it would send the next one out of order.
        SELECT m.id FROM outbox.messages m
        WHERE include_dead AND m.state = 'dead' AND m.dead_at < now() - older_than
          AND (m.ordering_key IS NULL OR NOT EXISTS (
              SELECT 1 FROM outbox.messages e
              WHERE e.ordering_key = m.ordering_key AND e.id > m.id
                AND e.state IN ('pending', 'running', 'held', 'dead')))
        ORDER BY m.dead_at LIMIT batch_size FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM outbox.messages m
        WHERE m.id IN (SELECT id FROM old_delivered
                       UNION ALL SELECT id FROM old_cancelled
                       UNION ALL SELECT id FROM old_dead)
        RETURNING 1
    )
    SELECT count(*) INTO v_deleted FROM gone;
    RETURN v_deleted;
END
$$;
