-- outboxd schema, version 18: the operators' actions take their ids by the contract's name,
-- and a purge keeps every dead row of an ordering group.
--
-- 1. The contract names the first parameter of outbox.approve, outbox.cancel and
--    outbox.confirm `ids` (`outbox.cancel(ids bigint[], reason text DEFAULT NULL)`); sql/0009
--    named it `message_ids`, so a call by name as the contract writes it
--    (`outbox.cancel(ids => …, reason => …)`) found no function (42883). A parameter cannot
--    be renamed in place, so the three are dropped and made again, bodies unchanged but for
--    the name, and the EXECUTE rights granted on them are carried over exactly: a role
--    that could approve, cancel or confirm before this migration still can after it (with
--    the grant option if it had it), and no other can, whatever default privileges the
--    schema has (CREATE FUNCTION applies them; they are taken back). The old owner's own
--    right is carried over too: run by another role, the migration makes that role the
--    owner, and the old owner keeps EXECUTE (not ownership). The errors of a NULL
--    list name `ids` too (outbox.lock_named, which the three share). Calls by position,
--    the command line's and the console's, are unchanged.
--
-- 2. outbox.purge with include_dead kept a dead row of an ordering group only while a later
--    message of its group was already there (sql/0017). A message of the group enqueued
--    after the purge, or during it and committed after it, then found its group's dead head
--    gone and was sent as if the head had been dealt with; the contract: a dead one blocks
--    its group until it is replayed or cancelled. A dead row with an ordering key is now
--    never purged: an operator replays or cancels it, and a cancelled row is purged as
--    before.
--
-- 3. outbox.destination_of named a host of any length, and outbox.destinations holds names
--    of at most 1000 characters: a webhook to a longer one (no DNS name is longer than 253)
--    made the breakers' update of its whole batch fail on the table's check, so the other
--    hosts' failures in that batch went uncounted. Such a URL now has no destination, in
--    SQL as in the worker (tests/it/destinations.rs holds the two to the same names).

-- The EXECUTE rights granted on the functions replaced below, to grant them again.
CREATE TEMPORARY TABLE outbox_0018_rights AS
SELECT p.proname::text AS fn, a.grantee, a.is_grantable
FROM pg_catalog.pg_proc p, LATERAL pg_catalog.aclexplode(p.proacl) a
WHERE p.oid IN ('outbox.approve(bigint[], text)'::pg_catalog.regprocedure,
                'outbox.cancel(bigint[], text, text)'::pg_catalog.regprocedure,
                'outbox.confirm(bigint[], text)'::pg_catalog.regprocedure)
  AND a.privilege_type = 'EXECUTE';

DROP FUNCTION outbox.approve(bigint[], text);
DROP FUNCTION outbox.cancel(bigint[], text, text);
DROP FUNCTION outbox.confirm(bigint[], text);

CREATE FUNCTION outbox.approve(ids bigint[], actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(id bigint, message_key text)
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_wrong text;
BEGIN
    PERFORM outbox.lock_named(ids, 'approved');
    v_wrong := outbox.not_in_states(ids, ARRAY['held']);
    IF v_wrong IS NOT NULL THEN
        RAISE EXCEPTION 'not held, so not approved: %; nothing approved', v_wrong
            USING ERRCODE = '55000';
    END IF;

    INSERT INTO outbox.attempts (message_id, attempt, worker, started_at, finished_at, outcome)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'approved'
    FROM outbox.messages m
    WHERE m.id = ANY(ids);

    RETURN QUERY
    UPDATE outbox.messages m SET state = 'pending', updated_at = now()
    WHERE m.id = ANY(ids)
    RETURNING m.id, m.message_key;

    PERFORM pg_notify('outbox_messages', '');
END
$$;


CREATE FUNCTION outbox.cancel(ids bigint[], reason text DEFAULT NULL::text, actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(id bigint, message_key text)
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_bad   text;
    v_wrong text;
BEGIN
    IF reason IS NOT NULL THEN
        IF btrim(reason) = '' THEN
            RAISE EXCEPTION 'reason must not be empty (leave it out instead); nothing cancelled'
                USING ERRCODE = '22023', COLUMN = 'reason';
        END IF;
        IF char_length(reason) > 500 THEN
            RAISE EXCEPTION 'reason must be at most 500 characters (got %); nothing cancelled',
                char_length(reason) USING ERRCODE = '22023', COLUMN = 'reason';
        END IF;
        v_bad := substring(reason FROM E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]');
        IF v_bad IS NOT NULL THEN
            RAISE EXCEPTION 'reason must be one line without control characters (U+% at character %); nothing cancelled',
                lpad(upper(to_hex(ascii(v_bad))), 4, '0'), strpos(reason, v_bad)
                USING ERRCODE = '22023', COLUMN = 'reason';
        END IF;
    END IF;

    PERFORM outbox.lock_named(ids, 'cancelled');
    v_wrong := outbox.not_in_states(ids, ARRAY['held', 'pending', 'dead']);
    IF v_wrong IS NOT NULL THEN
        RAISE EXCEPTION 'not held, pending or dead, so not cancelled: %; nothing cancelled', v_wrong
            USING ERRCODE = '55000';
    END IF;

    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'cancelled', reason
    FROM outbox.messages m
    WHERE m.id = ANY(ids);

    RETURN QUERY
    UPDATE outbox.messages m SET
        state        = 'cancelled',
        cancelled_at = now(),
        dead_at      = NULL,
        updated_at   = now()
    WHERE m.id = ANY(ids)
    RETURNING m.id, m.message_key;
END
$$;


CREATE FUNCTION outbox.confirm(ids bigint[], actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(id bigint, message_key text)
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_wrong text;
BEGIN
    PERFORM outbox.lock_named(ids, 'confirmed');
    SELECT string_agg(format('%s (%s, %s%s)', m.id, quote_literal(m.message_key), m.state,
                             CASE WHEN m.state = 'dead' THEN ' ' || m.error_class ELSE '' END),
                      ', ' ORDER BY m.id)
    INTO v_wrong
    FROM outbox.messages m
    WHERE m.id = ANY(ids)
      AND (m.state <> 'dead' OR m.error_class IS DISTINCT FROM 'ambiguous');
    IF v_wrong IS NOT NULL THEN
        RAISE EXCEPTION 'not dead with class ambiguous, so not confirmed: %; nothing confirmed', v_wrong
            USING ERRCODE = '55000';
    END IF;

    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'confirmed',
           m.error_class, m.last_error
    FROM outbox.messages m
    WHERE m.id = ANY(ids);

    RETURN QUERY
    UPDATE outbox.messages m SET
        state        = 'delivered',
        response     = CASE WHEN jsonb_typeof(m.response) = 'object' THEN m.response ELSE '{}'::jsonb END
                       || jsonb_build_object('confirmed', true),
        error_class  = NULL,
        last_error   = NULL,
        dead_at      = NULL,
        delivered_at = now(),
        updated_at   = now()
    WHERE m.id = ANY(ids)
    RETURNING m.id, m.message_key;
END
$$;


-- Operators only (sql/grants.sql grants them to outbox_worker), as sql/0009 had them:
-- PUBLIC's default EXECUTE, and anything the schema's default privileges granted as the
-- functions were made, is taken back; then the rights captured above are granted again.
DO $$
DECLARE
    f text;
    r record;
BEGIN
    FOREACH f IN ARRAY ARRAY['outbox.approve(bigint[], text)', 'outbox.cancel(bigint[], text, text)',
                             'outbox.confirm(bigint[], text)'] LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
        FOR r IN SELECT DISTINCT a.grantee
                 FROM pg_catalog.pg_proc p, LATERAL pg_catalog.aclexplode(p.proacl) a
                 WHERE p.oid = f::pg_catalog.regprocedure AND a.grantee <> p.proowner
                   AND a.grantee <> 0 LOOP
            EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM %s CASCADE', f,
                pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(r.grantee)));
        END LOOP;
    END LOOP;
    FOR r IN SELECT fn, grantee, bool_or(is_grantable) AS grantable
             FROM outbox_0018_rights GROUP BY fn, grantee ORDER BY fn, grantee LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s',
            CASE r.fn
                WHEN 'approve' THEN 'outbox.approve(bigint[], text)'
                WHEN 'cancel' THEN 'outbox.cancel(bigint[], text, text)'
                ELSE 'outbox.confirm(bigint[], text)'
            END,
            CASE WHEN r.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(r.grantee)) END,
            CASE WHEN r.grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$$;

DROP TABLE outbox_0018_rights;

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
        -- Not a dead row of an ordering group: it blocks its group until it is replayed
        -- or cancelled, also for a message of the group enqueued after the purge (or
        -- during it, not yet committed), which deleting it would send out of order.
        SELECT m.id FROM outbox.messages m
        WHERE include_dead AND m.state = 'dead' AND m.dead_at < now() - older_than
          AND m.ordering_key IS NULL
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
    ELSIF port <> '' AND NOT ((scheme = 'http' AND port::int = 80) OR (scheme = 'https' AND port::int = 443)) THEN
        host := host || ':' || port::int::text;
    END IF;
    -- outbox.destinations holds names of at most 1000 characters (no host name is longer
    -- than 253): a longer one is no name, as the worker's rule has it.
    IF length(host) > 1000 THEN
        RETURN NULL;
    END IF;
    RETURN host;
END
$_$;


-- The three actions' shared first step: its errors name the actions' parameter, `ids`.
CREATE OR REPLACE FUNCTION outbox.lock_named(message_ids bigint[], verb text) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_missing text;
BEGIN
    IF message_ids IS NULL THEN
        RAISE EXCEPTION 'ids must not be null; nothing %', verb
            USING ERRCODE = '22023', COLUMN = 'ids';
    END IF;
    IF array_position(message_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ids must not contain null; nothing %', verb
            USING ERRCODE = '22023', COLUMN = 'ids';
    END IF;

    PERFORM 1 FROM outbox.messages m WHERE m.id = ANY(message_ids) ORDER BY m.id FOR UPDATE;

    SELECT string_agg(DISTINCT x::text, ', ') INTO v_missing
    FROM unnest(message_ids) AS x
    WHERE NOT EXISTS (SELECT 1 FROM outbox.messages m WHERE m.id = x);
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'no message with id %; nothing %', v_missing, verb USING ERRCODE = 'P0002';
    END IF;
END
$$;
