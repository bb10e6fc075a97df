-- outboxd schema, version 15: outbox.enqueue_many inserts first (issue 17, enqueue).
--
-- Until now the batch was checked for conflicts before anything was inserted: one probe of
-- the `message_key` index per row, and a sort of the batch by key, so that a conflict
-- could be reported before a later row was validated. In a batch of new keys, the common
-- case, those probes found nothing, and without them a call of 1000 rows runs 1.23 times
-- as often (bench/RESULTS.md, 2026-12-06).
--
-- Now the rows are inserted first, in array order, through the insert trigger, which
-- validates every row (those whose key exists too) and fingerprints it. If every row was
-- inserted, every key was new and distinct: nothing else to check. Otherwise a second
-- statement probes only the rows that were not inserted, and the repeats of keys inserted
-- here, comparing fingerprints: the first conflicting row in array order raises OB409, as
-- before.
--
-- One rule changes with it: a batch with an invalid row is refused with 22023 for its first
-- invalid row even when an earlier row conflicts (it was OB409 for that earlier row). Every
-- row is validated before the dedup rules apply, as for one message ("validation comes
-- first"). Either way nothing of the batch is inserted. No subtransaction catches the
-- trigger's error: a transaction that called the function more than 64 times would
-- overflow its subtransaction cache and slow every snapshot on the server. What inserting
-- first costs: a batch that will be refused for a conflict with a stored row now inserts
-- its other rows before it knows, so it waits for other transactions' uncommitted rows of
-- the same keys, as every batch with such keys did already, and may meet a deadlock
-- (40P01, to be retried) where it used to fail at once with OB409.
--
-- Two more changes, from a review:
-- * Arrays of more than one dimension are refused (22023). `n` counted the first
--   dimension while the insert took every element, so a 2x2 batch that repeated a key
--   could pass the "every row inserted" test with rows left out.
-- * A row whose stored twin was purged between the insert and the second statement is
--   enqueued again through outbox.enqueue_row, as intended since sql/0003: the call read
--   its answer `INTO v_ids[i], v_created[i]`, which PL/pgSQL reads as one target and which
--   failed with 42804 (cannot subscript type boolean). Now two scalars.

CREATE OR REPLACE FUNCTION outbox.enqueue_many(message_keys text[], channels text[], payloads jsonb[], run_afters timestamp with time zone[] DEFAULT '{}'::timestamp with time zone[], max_attempts integer[] DEFAULT '{}'::integer[], retry_ambiguous boolean[] DEFAULT '{}'::boolean[], held boolean[] DEFAULT '{}'::boolean[], ordering_key text[] DEFAULT '{}'::text[]) RETURNS TABLE(id bigint, created boolean)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
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
    v_id       bigint;
    v_new      boolean;
BEGIN
    IF coalesce(array_ndims(message_keys), 1) > 1 OR coalesce(array_ndims(channels), 1) > 1
       OR coalesce(array_ndims(payloads), 1) > 1 OR coalesce(array_ndims(run_afters), 1) > 1
       OR coalesce(array_ndims(enqueue_many.max_attempts), 1) > 1
       OR coalesce(array_ndims(enqueue_many.retry_ambiguous), 1) > 1
       OR coalesce(array_ndims(enqueue_many.held), 1) > 1
       OR coalesce(array_ndims(enqueue_many.ordering_key), 1) > 1 THEN
        RAISE EXCEPTION 'the arrays of a batch must have one dimension'
            USING ERRCODE = '22023', COLUMN = 'message_keys';
    END IF;
    IF coalesce(array_length(channels, 1), 0) <> n OR coalesce(array_length(payloads, 1), 0) <> n THEN
        RAISE EXCEPTION 'message_keys, channels and payloads must have the same length'
            USING ERRCODE = '22023', COLUMN = 'message_keys';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    -- The groups' turns, in one order (the insert trigger's own calls are then re-entrant).
    -- Ordering keys past the end of message_keys are ignored, as the other optional
    -- arrays' extra elements are.
    PERFORM pg_advisory_xact_lock(1869767781, g.h)
    FROM (SELECT DISTINCT hashtext(k) AS h
          FROM unnest(enqueue_many.ordering_key[1:n]) AS k
          WHERE k IS NOT NULL) g
    ORDER BY g.h;

    -- One INSERT, rows in array order. The BEFORE INSERT trigger validates each row (those
    -- whose key exists too: it fires before the conflict check), so the first invalid row
    -- in array order raises 22023, and fills the fingerprint (request_hash is left to it).
    WITH ins AS (
        INSERT INTO outbox.messages AS m
            (message_key, channel, payload, request_hash, run_after, max_attempts, retry_ambiguous,
             state, ordering_key)
        SELECT u.k, u.c, u.p, NULL,
               coalesce(run_afters[u.ord], now()),
               coalesce(enqueue_many.max_attempts[u.ord], 3),
               coalesce(enqueue_many.retry_ambiguous[u.ord], true),
               CASE WHEN coalesce(enqueue_many.held[u.ord], false) THEN 'held' ELSE 'pending' END,
               enqueue_many.ordering_key[u.ord]
        FROM unnest(message_keys, channels, payloads) WITH ORDINALITY AS u(k, c, p, ord)
        ORDER BY u.ord
        ON CONFLICT ON CONSTRAINT messages_message_key_key DO NOTHING
        RETURNING m.message_key, m.id
    )
    SELECT coalesce(array_agg(ins.message_key), '{}'), coalesce(array_agg(ins.id), '{}')
    INTO v_ins_keys, v_ins_ids
    FROM ins;

    -- Every row inserted: every key was new, and none repeated (a repeat would have met
    -- its first row). All created, in array order.
    IF cardinality(v_ins_ids) = n THEN
        RETURN QUERY
            SELECT i.id, true
            FROM unnest(message_keys) WITH ORDINALITY AS b(k, ord)
            JOIN unnest(v_ins_keys, v_ins_ids) AS i(k, id) ON i.k = b.k
            ORDER BY b.ord;
        RETURN;
    END IF;

    -- Some keys were stored already, or repeated in the batch. A new statement, so rows
    -- committed meanwhile by others are visible. Each row that is not the one inserted for
    -- its key is compared with the stored row of its key (for a repeat, the row inserted
    -- here): another fingerprint is a conflict, and no stored row at all (purged meanwhile)
    -- an anomaly, settled row by row below.
    SELECT array_agg(z.id ORDER BY z.ord), array_agg(z.mine ORDER BY z.ord),
           min(z.ord) FILTER (WHERE z.conflict), min(z.ord) FILTER (WHERE z.anomaly)
    INTO v_ids, v_created, v_conflict, v_anomaly
    FROM (
        SELECT y.ord, coalesce(y.ins_id, s.id) AS id, y.mine,
               NOT y.mine AND s.request_hash <> outbox.request_hash(y.c, y.p) AS conflict,
               NOT y.mine AND y.ins_id IS NULL AND s.id IS NULL AS anomaly
        FROM (
            SELECT b.ord, b.c, b.p, b.k, i.id AS ins_id,
                   i.id IS NOT NULL AND b.ord = min(b.ord) OVER (PARTITION BY b.k) AS mine
            FROM unnest(message_keys, channels, payloads) WITH ORDINALITY AS b(k, c, p, ord)
            LEFT JOIN unnest(v_ins_keys, v_ins_ids) AS i(k, id) ON i.k = b.k
        ) y
        LEFT JOIN LATERAL (
            SELECT m.id, m.request_hash FROM outbox.messages m
            WHERE NOT y.mine AND m.message_key = y.k LIMIT 1
        ) s ON true
    ) z;

    IF v_conflict IS NOT NULL THEN
        v_key := message_keys[v_conflict];
        RAISE EXCEPTION 'message key % was already used with a different channel or payload',
            quote_literal(v_key)
            USING ERRCODE = 'OB409',
                  DETAIL = v_key,
                  HINT = 'a message key names one side effect; use a new key for a new one';
    END IF;

    IF v_anomaly IS NOT NULL THEN
        -- Rare: settle each remaining row of the batch as outbox.enqueue_row does (it
        -- inserts again a row purged meanwhile).
        FOR i IN v_anomaly .. n LOOP
            IF v_ids[i] IS NULL OR NOT v_created[i] THEN
                SELECT e.id, e.created INTO v_id, v_new
                FROM outbox.enqueue_row(message_keys[i], channels[i], payloads[i],
                                        coalesce(run_afters[i], now()),
                                        coalesce(enqueue_many.max_attempts[i], 3),
                                        coalesce(enqueue_many.retry_ambiguous[i], true),
                                        coalesce(enqueue_many.held[i], false),
                                        enqueue_many.ordering_key[i]) e;
                v_ids[i] := v_id;
                v_created[i] := v_new;
            END IF;
        END LOOP;
    END IF;

    RETURN QUERY SELECT u.id, u.created FROM unnest(v_ids, v_created) AS u(id, created);
END
$$;
