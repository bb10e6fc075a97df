-- outboxd schema, version 12: ordering keys (issue 18, part 4).
--
-- Messages sharing an `ordering_key` are sent one at a time, in id order: the claim
-- (src/queries.rs, CLAIM) takes a message with a key only when no earlier message of its
-- group is `pending` (due or not), `running`, `held` or `dead`. NULL, the default, means no
-- ordering: such a message is claimed as before.
--
-- 1. The column, refused when it could not name a group safely: 1..255 characters
--    (a CHECK constraint, as messages_key_length), no whitespace at either end and none of
--    the control characters refused in message keys (the insert trigger, 22023 naming
--    `ordering_key`). The same rules as the message key, so a key that is safe in a log line
--    or an operator's terminal is safe here too. The constraint is validated here under the
--    ALTER's lock (every stored row is NULL: a read of the table, no rewrite).
-- 2. messages_ordering_idx on (ordering_key, id) for the rows that block their group: the
--    claim's probe "is there an earlier unfinished message of this group" is one descent of
--    it, and rows without a key are not in it (they cost the claim nothing).
-- 3. Ids within a group follow commit order. The claim sees committed rows only, so without
--    this a transaction that drew id 10 and committed after one that drew id 11 would let
--    11 be sent first. The insert trigger takes a per-group advisory lock (class 1869767781,
--    "orde" in ASCII; the group's hashtext as the object), held until the enqueueing
--    transaction ends, and only then draws the row's id (outbox.ordering_turn): a second
--    transaction enqueueing into the same group waits for the first to end, and its ids
--    come after. Rows without a key take no lock and keep the id the column default drew.
--    Two transactions that enqueue into two groups in opposite orders can deadlock (one is
--    rolled back, 40P01); outbox.enqueue_many takes its groups' locks in one sorted order
--    first, so one call cannot meet another call that way.
-- 4. outbox.enqueue, outbox.enqueue_row and outbox.enqueue_many gain an 8th parameter
--    `ordering_key` (DEFAULT NULL; for enqueue_many an array, like the others), replacing
--    the old functions as sql/0009 did for `held` (an extra overload would make every
--    shorter call ambiguous), with the EXECUTE rights granted on them carried over. The
--    ordering key does not enter the fingerprint: enqueueing a stored key again with the
--    same payload returns that row, whatever its ordering key, as it does whatever its state.
--
-- Every function here runs with `search_path = pg_catalog, pg_temp`, as every function has
-- since sql/0007.

-- ---------------------------------------------------------------------------------------
-- 1 and 2. The column, its check and its index
-- ---------------------------------------------------------------------------------------

ALTER TABLE outbox.messages
    ADD COLUMN ordering_key text,
    ADD CONSTRAINT messages_ordering_key_length
        CHECK (char_length(ordering_key) BETWEEN 1 AND 255);

-- The rows that block their group (the states the claim's probe looks for). A row leaves
-- the index when it is delivered or cancelled, so the index stays as small as the backlog.
CREATE INDEX messages_ordering_idx ON outbox.messages (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND state IN ('pending', 'running', 'held', 'dead');

-- The ordering key's rules, with the named error (22023, COLUMN = 'ordering_key'); NULL
-- passes. The control-character class is the message key's (keep the patterns equal).
CREATE FUNCTION outbox.validate_ordering_key(ordering_key text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bad text;
BEGIN
    IF ordering_key IS NULL THEN
        RETURN;
    END IF;
    IF char_length(ordering_key) = 0 THEN
        RAISE EXCEPTION 'ordering_key must not be empty (leave it NULL for no ordering)'
            USING ERRCODE = '22023', COLUMN = 'ordering_key';
    END IF;
    IF char_length(ordering_key) > 255 THEN
        RAISE EXCEPTION 'ordering_key must be at most 255 characters (got %)', char_length(ordering_key)
            USING ERRCODE = '22023', COLUMN = 'ordering_key';
    END IF;
    IF ordering_key <> btrim(ordering_key, E' \t\r\n') THEN
        RAISE EXCEPTION 'ordering_key must not begin or end with whitespace'
            USING ERRCODE = '22023', COLUMN = 'ordering_key';
    END IF;
    v_bad := substring(ordering_key FROM E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]');
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'ordering_key must not contain control characters (U+% at character %)',
            lpad(upper(to_hex(ascii(v_bad))), 4, '0'), strpos(ordering_key, v_bad)
            USING ERRCODE = '22023', COLUMN = 'ordering_key',
                  HINT = 'C0 and C1 controls, DEL, U+2028, U+2029 and bidirectional controls are refused';
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------------
-- 3. Ids in commit order within a group
-- ---------------------------------------------------------------------------------------

-- Wait for the group's turn (the advisory lock, held until this transaction ends), then
-- draw a message id. SECURITY DEFINER: the insert trigger runs with the inserting role's
-- rights, which need not include the id sequence (an identity column's own default does not
-- check them). Open to PUBLIC as outbox.enqueue is: it only draws an id and takes a lock
-- that lasts as long as the caller's transaction.
CREATE FUNCTION outbox.ordering_turn(ordering_key text)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1869767781, hashtext(ordering_key));
    RETURN nextval(pg_get_serial_sequence('outbox.messages', 'id')::regclass);
END
$$;

-- As in sql/0009, with the ordering key: its rules join the one expression of the fast path,
-- its named error the slow path, and a row with a key waits for its group's turn and takes
-- its id after it.
CREATE OR REPLACE FUNCTION outbox.messages_before_insert() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_text text := NEW.payload::text;
BEGIN
    -- Every rule at once; NULLs make it false (a NULL ordering key is allowed explicitly).
    IF NOT coalesce(
            char_length(NEW.message_key) BETWEEN 1 AND 255
            AND NEW.message_key = btrim(NEW.message_key, E' \t\r\n')
            AND NEW.message_key !~ E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]'
            AND jsonb_typeof(NEW.payload) = 'object'
            AND octet_length(v_text) <= 1048576
            AND NEW.max_attempts >= 1
            AND isfinite(NEW.run_after)
            AND NEW.state IN ('pending', 'held')
            AND (NEW.ordering_key IS NULL
                 OR (char_length(NEW.ordering_key) BETWEEN 1 AND 255
                     AND NEW.ordering_key = btrim(NEW.ordering_key, E' \t\r\n')
                     AND NEW.ordering_key !~ E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]'))
            AND CASE NEW.channel
                    WHEN 'webhook' THEN
                        jsonb_typeof(NEW.payload -> 'url') = 'string'
                        AND (NOT NEW.payload ? 'reconcile'
                             OR jsonb_typeof(NEW.payload -> 'reconcile' -> 'url') = 'string')
                        AND (NOT NEW.payload ? 'store_response'
                             OR jsonb_typeof(NEW.payload -> 'store_response') = 'boolean')
                    WHEN 'email' THEN
                        (jsonb_typeof(NEW.payload -> 'to') = 'string'
                         AND btrim(NEW.payload ->> 'to') <> '')
                        OR (jsonb_typeof(NEW.payload -> 'to') = 'array'
                            AND jsonb_array_length(NEW.payload -> 'to') > 0)
                    ELSE false
                END,
            false) THEN
        -- Raises 22023 naming the field.
        PERFORM outbox.validate(NEW.message_key, NEW.channel, NEW.payload, NEW.max_attempts);
        PERFORM outbox.validate_ordering_key(NEW.ordering_key);
        -- A NULL run_after or state is left to the column's NOT NULL constraint.
        IF NOT isfinite(NEW.run_after) THEN
            RAISE EXCEPTION 'run_after must be a finite time (got %)', NEW.run_after
                USING ERRCODE = '22023', COLUMN = 'run_after';
        END IF;
        -- The value is not quoted back: it is the caller's text, of any length.
        IF NEW.state NOT IN ('pending', 'held') THEN
            RAISE EXCEPTION 'state must be ''pending'' or ''held'' when a message is inserted'
                USING ERRCODE = '22023', COLUMN = 'state';
        END IF;
    END IF;
    -- outbox.request_hash(channel, payload), from the text rendered above.
    NEW.request_hash := sha256(convert_to(NEW.channel || E'\n' || v_text, 'UTF8'));
    IF NEW.ordering_key IS NOT NULL THEN
        NEW.id := outbox.ordering_turn(NEW.ordering_key);
    END IF;
    RETURN NEW;
END
$$;

-- ---------------------------------------------------------------------------------------
-- 4. Enqueue with an ordering key
-- ---------------------------------------------------------------------------------------

-- The EXECUTE rights granted on the functions replaced below, to grant them again on the
-- new signatures (a role that could enqueue before this migration still can after it).
CREATE TEMPORARY TABLE outbox_0012_rights AS
SELECT p.proname::text AS fn, a.grantee
FROM pg_catalog.pg_proc p, LATERAL pg_catalog.aclexplode(p.proacl) a
WHERE p.oid IN ('outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean, boolean)'::pg_catalog.regprocedure,
                'outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean)'::pg_catalog.regprocedure,
                'outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[])'::pg_catalog.regprocedure)
  AND a.privilege_type = 'EXECUTE'
  AND a.grantee <> p.proowner;

DROP FUNCTION outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean, boolean);
DROP FUNCTION outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean);
DROP FUNCTION outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[]);

-- As in sql/0009, with `ordering_key` (checked by the insert trigger, which also waits for
-- the group's turn).
CREATE FUNCTION outbox.enqueue_row(
    message_key     text,
    channel         text,
    payload         jsonb,
    run_after       timestamptz DEFAULT now(),
    max_attempts    integer DEFAULT 3,
    retry_ambiguous boolean DEFAULT true,
    held            boolean DEFAULT false,
    ordering_key    text DEFAULT NULL,
    OUT id          bigint,
    OUT created     boolean
)
LANGUAGE plpgsql
-- SECURITY DEFINER and the pinned search_path as in sql/0001 (see there why).
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_existing bytea;
BEGIN
    -- The BEFORE INSERT trigger validates the row and fills its fingerprint, also when the
    -- key already exists (row triggers fire before the conflict check), so bad input never
    -- reaches the dedup path.
    IF enqueue_row.retry_ambiguous IS NULL THEN
        RAISE EXCEPTION 'retry_ambiguous must not be null'
            USING ERRCODE = '22023', COLUMN = 'retry_ambiguous';
    END IF;
    IF enqueue_row.held IS NULL THEN
        RAISE EXCEPTION 'held must not be null' USING ERRCODE = '22023', COLUMN = 'held';
    END IF;
    LOOP
        INSERT INTO outbox.messages AS m
            (message_key, channel, payload, request_hash, run_after, max_attempts, retry_ambiguous,
             state, ordering_key)
        VALUES (enqueue_row.message_key, enqueue_row.channel, enqueue_row.payload, NULL,
                coalesce(enqueue_row.run_after, now()), enqueue_row.max_attempts,
                enqueue_row.retry_ambiguous,
                CASE WHEN enqueue_row.held THEN 'held' ELSE 'pending' END,
                enqueue_row.ordering_key)
        ON CONFLICT ON CONSTRAINT messages_message_key_key DO NOTHING
        RETURNING m.id INTO enqueue_row.id;
        IF enqueue_row.id IS NOT NULL THEN
            created := true;
            RETURN;
        END IF;

        SELECT m.id, m.request_hash INTO enqueue_row.id, v_existing
        FROM outbox.messages AS m
        WHERE m.message_key = enqueue_row.message_key;
        IF enqueue_row.id IS NOT NULL THEN
            IF v_existing <> outbox.request_hash(enqueue_row.channel, enqueue_row.payload) THEN
                RAISE EXCEPTION 'message key % was already used with a different channel or payload',
                    quote_literal(enqueue_row.message_key)
                    USING ERRCODE = 'OB409',
                          DETAIL = enqueue_row.message_key,
                          HINT = 'a message key names one side effect; use a new key for a new one';
            END IF;
            created := false;
            RETURN;
        END IF;
        -- The conflicting row was deleted (purged) between the two statements: insert again.
    END LOOP;
END
$$;

REVOKE EXECUTE ON FUNCTION
    outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean, text) FROM PUBLIC;

-- The contract's enqueue: outbox.enqueue_row without the `created` flag.
--   SELECT outbox.enqueue('order-42:refund', 'webhook', '{"url": "https://…"}', held => true);
--   SELECT outbox.enqueue('order-42:shipped', 'webhook', '{"url": "https://…"}',
--                         ordering_key => 'order-42');
CREATE FUNCTION outbox.enqueue(
    message_key     text,
    channel         text,
    payload         jsonb,
    run_after       timestamptz DEFAULT now(),
    max_attempts    integer DEFAULT 3,
    retry_ambiguous boolean DEFAULT true,
    held            boolean DEFAULT false,
    ordering_key    text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (outbox.enqueue_row(enqueue.message_key, enqueue.channel, enqueue.payload,
                               enqueue.run_after, enqueue.max_attempts,
                               enqueue.retry_ambiguous, enqueue.held,
                               enqueue.ordering_key)).id;
END
$$;

-- As in sql/0009, with `ordering_key` (an array like the other optional ones: NULL elements
-- and missing ones are no ordering). The groups' locks are taken first, in one sorted
-- order, so two batches naming the same groups in different orders do not deadlock.
CREATE FUNCTION outbox.enqueue_many(
    message_keys    text[],
    channels        text[],
    payloads        jsonb[],
    run_afters      timestamptz[] DEFAULT '{}',
    max_attempts    integer[] DEFAULT '{}',
    retry_ambiguous boolean[] DEFAULT '{}',
    held            boolean[] DEFAULT '{}',
    ordering_key    text[] DEFAULT '{}'
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

    -- The groups' turns, in one order (the insert trigger's own calls are then re-entrant).
    -- Ordering keys past the end of message_keys are ignored, as the other optional
    -- arrays' extra elements are.
    PERFORM pg_advisory_xact_lock(1869767781, g.h)
    FROM (SELECT DISTINCT hashtext(k) AS h
          FROM unnest(enqueue_many.ordering_key[1:n]) AS k
          WHERE k IS NOT NULL) g
    ORDER BY g.h;

    -- One INSERT, rows in array order. The BEFORE INSERT trigger validates each row (those
    -- whose key exists too) and fills the fingerprint (request_hash is left to it).
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
                                        coalesce(enqueue_many.retry_ambiguous[i], true),
                                        coalesce(enqueue_many.held[i], false),
                                        enqueue_many.ordering_key[i]) e;
            END IF;
        END LOOP;
    END IF;

    RETURN QUERY SELECT u.id, u.created FROM unnest(v_ids, v_created) AS u(id, created);
END
$$;

REVOKE EXECUTE ON FUNCTION
    outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[], text[]) FROM PUBLIC;

-- The rights carried over (grantee 0 is PUBLIC, which outbox.enqueue has by default).
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT fn, grantee FROM outbox_0012_rights ORDER BY fn, grantee LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s',
            CASE r.fn
                WHEN 'enqueue' THEN 'outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean, boolean, text)'
                WHEN 'enqueue_row' THEN 'outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean, text)'
                ELSE 'outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[], text[])'
            END,
            CASE WHEN r.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(r.grantee)) END);
    END LOOP;
END
$$;

DROP TABLE outbox_0012_rights;
