-- outboxd schema, version 3: outbox.enqueue_many as set-based statements.
--
-- Same signature, same rules and same results as version 1's function, which looped over
-- outbox.enqueue_row: per row, in array order, validation (22023 naming the field), then
-- dedup (same key and fingerprint: the existing id, created = false; another fingerprint:
-- OB409 naming the key); all or nothing. What changes is the cost: one INSERT for the whole
-- batch instead of one executor start (and one reading of every CHECK constraint) per row.
--
-- How the loop's order of errors is kept: a first statement finds the first row that would
-- conflict (with a stored row, or with an earlier row of the batch carrying the same key).
-- If there is one, the rows up to it are validated in order (a bad row before it, or the
-- conflicting row itself, raises 22023 as the loop would) and then OB409 is raised for it.
-- Otherwise one INSERT ... ORDER BY position ... ON CONFLICT DO NOTHING inserts the batch:
-- the BEFORE INSERT trigger validates every row in array order, duplicates included, as
-- before. A last statement reads the ids back; a key that another transaction inserted
-- meanwhile with another payload, or a row purged meanwhile, is settled by
-- outbox.enqueue_row (OB409 for the former; the latter is inserted again).
--
-- SECURITY DEFINER (like outbox.enqueue_row) because it now reads and inserts rows itself;
-- so EXECUTE is revoked from PUBLIC: only the roles granted it may enqueue through it
-- (sql/grants.sql grants it to outbox_app and outbox_worker).

-- The fingerprint function, declared STABLE (its body calls convert_to, which is STABLE):
-- PostgreSQL inlines an SQL function only when the body is no more volatile than the
-- declaration, so as IMMUTABLE it ran as a separate SQL-function execution for every row
-- the trigger fingerprinted. Same bytes as before; it is used in no index or constraint.
ALTER FUNCTION outbox.request_hash(text, jsonb) STABLE;

CREATE OR REPLACE FUNCTION outbox.enqueue_many(
    message_keys    text[],
    channels        text[],
    payloads        jsonb[],
    run_afters      timestamptz[] DEFAULT '{}',
    max_attempts    integer[] DEFAULT '{}',
    retry_ambiguous boolean[] DEFAULT '{}'
) RETURNS TABLE (id bigint, created boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n          integer := coalesce(array_length(message_keys, 1), 0);
    v_conflict integer;
    v_key      text;
    v_ins_keys text[];
    v_ins_ids  bigint[];
    v_ids      bigint[];
    v_created  boolean[];
    v_anomaly  integer;
BEGIN
    IF coalesce(array_length(channels, 1), 0) <> n OR coalesce(array_length(payloads, 1), 0) <> n THEN
        RAISE EXCEPTION 'message_keys, channels and payloads must have the same length'
            USING ERRCODE = '22023', COLUMN = 'message_keys';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    -- The first row that would conflict, in array order. Fingerprints are computed only
    -- for keys that are stored already or repeated in the batch.
    SELECT min(x.ord) INTO v_conflict
    FROM (
        SELECT y.ord, y.h, y.h_stored,
               first_value(y.h) OVER (PARTITION BY y.k ORDER BY y.ord) AS h_first
        FROM (
            SELECT b.ord, b.k, s.request_hash AS h_stored,
                   CASE WHEN s.request_hash IS NOT NULL OR b.repeated
                        THEN outbox.request_hash(b.c, b.p) END AS h
            FROM (
                SELECT u.ord, u.k, u.c, u.p, count(*) OVER (PARTITION BY u.k) > 1 AS repeated
                FROM unnest(message_keys, channels, payloads) WITH ORDINALITY AS u(k, c, p, ord)
            ) b
            -- LIMIT 1: a probe of the unique index per row, whatever the table holds.
            LEFT JOIN LATERAL (
                SELECT m.request_hash FROM outbox.messages m WHERE m.message_key = b.k LIMIT 1
            ) s ON true
        ) y
    ) x
    WHERE CASE WHEN x.h_stored IS NOT NULL THEN x.h_stored <> x.h ELSE x.h_first <> x.h END;

    IF v_conflict IS NOT NULL THEN
        FOR i IN 1 .. v_conflict LOOP
            PERFORM outbox.validate(message_keys[i], channels[i], payloads[i],
                                    coalesce(enqueue_many.max_attempts[i], 3));
        END LOOP;
        v_key := message_keys[v_conflict];
        RAISE EXCEPTION 'message key % was already used with a different channel or payload',
            quote_literal(v_key)
            USING ERRCODE = 'OB409',
                  DETAIL = v_key,
                  HINT = 'a message key names one side effect; use a new key for a new one';
    END IF;

    -- One INSERT, rows in array order. The BEFORE INSERT trigger validates each row (those
    -- whose key exists too) and fills the fingerprint (request_hash is left to it).
    WITH ins AS (
        INSERT INTO outbox.messages AS m
            (message_key, channel, payload, request_hash, run_after, max_attempts, retry_ambiguous)
        SELECT u.k, u.c, u.p, NULL,
               coalesce(run_afters[u.ord], now()),
               coalesce(enqueue_many.max_attempts[u.ord], 3),
               coalesce(enqueue_many.retry_ambiguous[u.ord], true)
        FROM unnest(message_keys, channels, payloads) WITH ORDINALITY AS u(k, c, p, ord)
        ORDER BY u.ord
        ON CONFLICT ON CONSTRAINT messages_message_key_key DO NOTHING
        RETURNING m.message_key, m.id
    )
    SELECT coalesce(array_agg(ins.message_key), '{}'), coalesce(array_agg(ins.id), '{}')
    INTO v_ins_keys, v_ins_ids
    FROM ins;

    -- The ids, in array order: inserted here (the first row of its key is `created`), or
    -- stored already. A new statement, so rows committed meanwhile by others are visible:
    -- such a row with another fingerprint, or a row purged meanwhile, is an anomaly.
    SELECT array_agg(z.id ORDER BY z.ord), array_agg(z.created ORDER BY z.ord),
           min(z.ord) FILTER (WHERE z.anomaly)
    INTO v_ids, v_created, v_anomaly
    FROM (
        SELECT b.ord,
               coalesce(i.id, s.id) AS id,
               i.id IS NOT NULL AND b.ord = min(b.ord) OVER (PARTITION BY b.k) AS created,
               i.id IS NULL AND (s.id IS NULL
                                 OR s.request_hash <> outbox.request_hash(b.c, b.p)) AS anomaly
        FROM unnest(message_keys, channels, payloads) WITH ORDINALITY AS b(k, c, p, ord)
        LEFT JOIN unnest(v_ins_keys, v_ins_ids) AS i(k, id) ON i.k = b.k
        LEFT JOIN LATERAL (
            SELECT m.id, m.request_hash FROM outbox.messages m
            WHERE i.id IS NULL AND m.message_key = b.k LIMIT 1
        ) s ON true
    ) z;

    IF v_anomaly IS NOT NULL THEN
        -- Rare: settle each remaining row of the batch as outbox.enqueue_row does (it
        -- raises OB409 for a key taken meanwhile with another payload, and inserts again
        -- a row purged meanwhile).
        FOR i IN v_anomaly .. n LOOP
            IF v_ids[i] IS NULL OR NOT v_created[i] THEN
                SELECT e.id, e.created INTO v_ids[i], v_created[i]
                FROM outbox.enqueue_row(message_keys[i], channels[i], payloads[i],
                                        coalesce(run_afters[i], now()),
                                        coalesce(enqueue_many.max_attempts[i], 3),
                                        coalesce(enqueue_many.retry_ambiguous[i], true)) e;
            END IF;
        END LOOP;
    END IF;

    RETURN QUERY SELECT u.id, u.created FROM unnest(v_ids, v_created) AS u(id, created);
END
$$;

REVOKE EXECUTE ON FUNCTION
    outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[]) FROM PUBLIC;
