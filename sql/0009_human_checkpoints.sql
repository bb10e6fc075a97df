-- outboxd schema, version 9: human checkpoints (issue 15) and the lookup an agent's tool
-- wrapper makes before it acts again.
--
-- 1. Two states. `held`: waiting for a person's approval, never claimed (the claim reads
--    `pending` and expired `running` rows only). `cancelled`: withdrawn, terminal, never sent
--    again; `cancelled_at` is set exactly while a row is cancelled. The widened CHECK
--    constraints are validated against the table in this migration's transaction (a read
--    of every row under the ALTER's lock); no stored row can fail them.
-- 2. Enqueue held: outbox.enqueue, outbox.enqueue_row and outbox.enqueue_many gain a
--    7th parameter `held` (DEFAULT false; for enqueue_many an array, like the others). An
--    extra overload beside the old signatures would make every six-argument call ambiguous,
--    so the old functions are replaced; the EXECUTE rights granted on them are carried over
--    (a site's sql/grants.sql roles keep enqueueing across the migration). The insert trigger
--    now refuses any state but `pending` or `held` (22023 naming `state`), so the right to
--    INSERT the `state` column (sql/grants.sql) cannot forge a delivered or dead row. Dedup is
--    unchanged: the fingerprint is channel and payload, so a held enqueue of a key stored with
--    the same payload returns that row, whatever its state, and leaves it as it is.
-- 3. Two webhook payload fields the worker reads, checked at enqueue (22023 naming the field):
--    `reconcile`, when present, an object with a string `url`; `store_response`, when present,
--    a boolean. JSON null counts as present (and is refused): a field is there or it is not.
-- 4. Operator actions, with replay's rules (sql/0002): outbox.approve (held → pending, due at
--    its run_after), outbox.cancel (held, pending or dead → cancelled, with a reason) and
--    outbox.confirm (dead with class ambiguous → delivered, response.confirmed = true). All
--    or nothing; P0002 for an unknown id, 55000 for a row in another state, naming the rows;
--    each leaves one history row (`approved`, `cancelled`, `confirmed`) with the actor in
--    `worker`. Each locks its rows (FOR UPDATE, waiting, in id order) before it reads their
--    state: a claim (FOR UPDATE SKIP LOCKED) then either committed first, and the row is
--    `running` and refused, or skips the row, and after the action commits it is no longer
--    `pending`. A successful cancel is never followed by a send.
-- 5. outbox.lookup(message_key): what is known of one side effect, without its payload;
--    SECURITY DEFINER, so the application role may ask about its keys without reading rows.
-- 6. attempts.outcome gains `approved`, `cancelled`, `confirmed` and `reconciled` (the
--    reconciliation lookup's success, written by the worker).
--
-- Every function here runs with `search_path = pg_catalog, pg_temp`, as every function has
-- since sql/0007.

-- ---------------------------------------------------------------------------------------
-- 1. States
-- ---------------------------------------------------------------------------------------

ALTER TABLE outbox.messages ADD COLUMN cancelled_at timestamptz;

ALTER TABLE outbox.messages
    DROP CONSTRAINT messages_state_check,
    ADD CONSTRAINT messages_state_check
        CHECK (state IN ('pending', 'held', 'running', 'delivered', 'dead', 'cancelled')),
    ADD CONSTRAINT messages_cancelled_at_iff_cancelled
        CHECK ((state = 'cancelled') = (cancelled_at IS NOT NULL));

ALTER TABLE outbox.attempts
    DROP CONSTRAINT attempts_outcome_check,
    ADD CONSTRAINT attempts_outcome_check CHECK (
        outcome IN ('delivered', 'retry', 'dead', 'lease_lost', 'released', 'replayed',
                    'approved', 'cancelled', 'confirmed', 'reconciled')
    );

-- `outboxd held` lists held rows oldest first; the /metrics counts read each state from the
-- head of its own partial index (src/queries.rs, STATE_COUNTS_BOUNDED).
CREATE INDEX messages_held_idx ON outbox.messages (created_at, id) WHERE state = 'held';
CREATE INDEX messages_cancelled_idx ON outbox.messages (cancelled_at) WHERE state = 'cancelled';

-- ---------------------------------------------------------------------------------------
-- 2 and 3. Enqueue rules: the insert trigger and outbox.validate
-- ---------------------------------------------------------------------------------------

-- The rules of sql/0007 and the two webhook fields. Same signature, same codes and messages
-- for the rules that were there.
CREATE OR REPLACE FUNCTION outbox.validate(message_key text, channel text, payload jsonb, max_attempts integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bad text;
BEGIN
    IF message_key IS NULL OR char_length(message_key) = 0 THEN
        RAISE EXCEPTION 'message_key must not be empty' USING ERRCODE = '22023', COLUMN = 'message_key';
    END IF;
    -- HTTP strips whitespace at the edges of a header value: ' k' would reach the receiver
    -- as 'k' and collide with another message's key.
    IF message_key <> btrim(message_key, E' \t\r\n') THEN
        RAISE EXCEPTION 'message_key must not begin or end with whitespace'
            USING ERRCODE = '22023', COLUMN = 'message_key';
    END IF;
    IF char_length(message_key) > 255 THEN
        RAISE EXCEPTION 'message_key must be at most 255 characters (got %)', char_length(message_key)
            USING ERRCODE = '22023', COLUMN = 'message_key';
    END IF;
    -- The same class as in outbox.messages_before_insert (keep the two patterns equal). An
    -- E'' string, so the pattern reads the same whatever standard_conforming_strings says.
    v_bad := substring(message_key FROM E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]');
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'message_key must not contain control characters (U+% at character %)',
            lpad(upper(to_hex(ascii(v_bad))), 4, '0'), strpos(message_key, v_bad)
            USING ERRCODE = '22023', COLUMN = 'message_key',
                  HINT = 'C0 and C1 controls, DEL, U+2028, U+2029 and bidirectional controls are refused';
    END IF;
    IF channel IS NULL OR channel NOT IN ('webhook', 'email') THEN
        RAISE EXCEPTION 'channel must be ''webhook'' or ''email'' (got %)', coalesce(quote_literal(channel), 'NULL')
            USING ERRCODE = '22023', COLUMN = 'channel';
    END IF;
    IF payload IS NULL OR jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object' USING ERRCODE = '22023', COLUMN = 'payload';
    END IF;
    -- 1 MiB of JSON text: an outbox row is a notification, not a file transfer, and a
    -- bounded row keeps claims and completions cheap.
    IF octet_length(payload::text) > 1048576 THEN
        RAISE EXCEPTION 'payload must be at most 1 MiB of JSON (got % bytes)', octet_length(payload::text)
            USING ERRCODE = '22023', COLUMN = 'payload';
    END IF;
    IF max_attempts IS NULL OR max_attempts < 1 THEN
        RAISE EXCEPTION 'max_attempts must be at least 1' USING ERRCODE = '22023', COLUMN = 'max_attempts';
    END IF;
    IF channel = 'webhook' THEN
        IF jsonb_typeof(payload -> 'url') IS DISTINCT FROM 'string' THEN
            RAISE EXCEPTION 'payload.url must be a string' USING ERRCODE = '22023', COLUMN = 'payload.url';
        END IF;
        IF payload ? 'reconcile' AND jsonb_typeof(payload -> 'reconcile') <> 'object' THEN
            RAISE EXCEPTION 'payload.reconcile must be an object with a string url'
                USING ERRCODE = '22023', COLUMN = 'payload.reconcile';
        END IF;
        IF payload ? 'reconcile' AND jsonb_typeof(payload -> 'reconcile' -> 'url') IS DISTINCT FROM 'string' THEN
            RAISE EXCEPTION 'payload.reconcile.url must be a string'
                USING ERRCODE = '22023', COLUMN = 'payload.reconcile.url';
        END IF;
        IF payload ? 'store_response' AND jsonb_typeof(payload -> 'store_response') <> 'boolean' THEN
            RAISE EXCEPTION 'payload.store_response must be true or false'
                USING ERRCODE = '22023', COLUMN = 'payload.store_response';
        END IF;
    ELSIF channel = 'email' THEN
        IF NOT coalesce((jsonb_typeof(payload -> 'to') = 'string' AND btrim(payload ->> 'to') <> '')
                OR (jsonb_typeof(payload -> 'to') = 'array' AND jsonb_array_length(payload -> 'to') > 0), false) THEN
            RAISE EXCEPTION 'payload.to must be an address or a non-empty array of addresses'
                USING ERRCODE = '22023', COLUMN = 'payload.to';
        END IF;
    END IF;
END
$$;

-- As in sql/0007 (one rendering of the payload, one expression for every rule, the named
-- error only for a row that breaks one), with the two webhook fields and the state rule: a
-- message starts `pending` or `held`, whoever inserts it. (Without this rule a role allowed
-- to insert the `state` column could store a row as `delivered`, and its key's dedup record
-- would then claim a side effect that never happened.)
CREATE OR REPLACE FUNCTION outbox.messages_before_insert() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_text text := NEW.payload::text;
BEGIN
    -- Every rule at once; NULLs make it false.
    IF NOT coalesce(
            char_length(NEW.message_key) BETWEEN 1 AND 255
            AND NEW.message_key = btrim(NEW.message_key, E' \t\r\n')
            AND NEW.message_key !~ E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]'
            AND jsonb_typeof(NEW.payload) = 'object'
            AND octet_length(v_text) <= 1048576
            AND NEW.max_attempts >= 1
            AND isfinite(NEW.run_after)
            AND NEW.state IN ('pending', 'held')
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
    RETURN NEW;
END
$$;

-- The EXECUTE rights granted on the functions replaced below, to grant them again on the
-- new signatures (a role that could enqueue before this migration still can after it).
CREATE TEMPORARY TABLE outbox_0009_rights AS
SELECT p.proname::text AS fn, a.grantee
FROM pg_catalog.pg_proc p, LATERAL pg_catalog.aclexplode(p.proacl) a
WHERE p.oid IN ('outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean)'::pg_catalog.regprocedure,
                'outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean)'::pg_catalog.regprocedure,
                'outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[])'::pg_catalog.regprocedure)
  AND a.privilege_type = 'EXECUTE'
  AND a.grantee <> p.proowner;

DROP FUNCTION outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean);
DROP FUNCTION outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean);
DROP FUNCTION outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[]);

-- As in sql/0006, with `held`: a new key inserts a `held` row instead of a `pending` one.
CREATE FUNCTION outbox.enqueue_row(
    message_key     text,
    channel         text,
    payload         jsonb,
    run_after       timestamptz DEFAULT now(),
    max_attempts    integer DEFAULT 3,
    retry_ambiguous boolean DEFAULT true,
    held            boolean DEFAULT false,
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
             state)
        VALUES (enqueue_row.message_key, enqueue_row.channel, enqueue_row.payload, NULL,
                coalesce(enqueue_row.run_after, now()), enqueue_row.max_attempts,
                enqueue_row.retry_ambiguous,
                CASE WHEN enqueue_row.held THEN 'held' ELSE 'pending' END)
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
    outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean) FROM PUBLIC;

-- The contract's enqueue: outbox.enqueue_row without the `created` flag.
--   SELECT outbox.enqueue('order-42:refund', 'webhook', '{"url": "https://…"}', held => true);
CREATE FUNCTION outbox.enqueue(
    message_key     text,
    channel         text,
    payload         jsonb,
    run_after       timestamptz DEFAULT now(),
    max_attempts    integer DEFAULT 3,
    retry_ambiguous boolean DEFAULT true,
    held            boolean DEFAULT false
) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (outbox.enqueue_row(enqueue.message_key, enqueue.channel, enqueue.payload,
                               enqueue.run_after, enqueue.max_attempts,
                               enqueue.retry_ambiguous, enqueue.held)).id;
END
$$;

-- As in sql/0003, with `held` (an array like the other optional ones: NULL elements and
-- missing ones are false).
CREATE FUNCTION outbox.enqueue_many(
    message_keys    text[],
    channels        text[],
    payloads        jsonb[],
    run_afters      timestamptz[] DEFAULT '{}',
    max_attempts    integer[] DEFAULT '{}',
    retry_ambiguous boolean[] DEFAULT '{}',
    held            boolean[] DEFAULT '{}'
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
            (message_key, channel, payload, request_hash, run_after, max_attempts, retry_ambiguous,
             state)
        SELECT u.k, u.c, u.p, NULL,
               coalesce(run_afters[u.ord], now()),
               coalesce(enqueue_many.max_attempts[u.ord], 3),
               coalesce(enqueue_many.retry_ambiguous[u.ord], true),
               CASE WHEN coalesce(enqueue_many.held[u.ord], false) THEN 'held' ELSE 'pending' END
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
                                        coalesce(enqueue_many.held[i], false)) e;
            END IF;
        END LOOP;
    END IF;

    RETURN QUERY SELECT u.id, u.created FROM unnest(v_ids, v_created) AS u(id, created);
END
$$;

REVOKE EXECUTE ON FUNCTION
    outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[]) FROM PUBLIC;

-- The rights carried over (grantee 0 is PUBLIC, which outbox.enqueue has by default).
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT fn, grantee FROM outbox_0009_rights ORDER BY fn, grantee LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s',
            CASE r.fn
                WHEN 'enqueue' THEN 'outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean, boolean)'
                WHEN 'enqueue_row' THEN 'outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean)'
                ELSE 'outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[])'
            END,
            CASE WHEN r.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(r.grantee)) END);
    END LOOP;
END
$$;

DROP TABLE outbox_0009_rights;

-- ---------------------------------------------------------------------------------------
-- 4. Operator actions
-- ---------------------------------------------------------------------------------------

-- The common first step of approve, cancel and confirm: refuse a NULL list or NULL ids
-- (22023), lock the named rows in id order (waiting for a claim or another action that
-- holds one, so two actions cannot deadlock and a claim cannot slip in between the check
-- and the change), then refuse unknown ids (P0002, naming them). `verb` completes the
-- messages: 'nothing approved'.
CREATE FUNCTION outbox.lock_named(message_ids bigint[], verb text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_missing text;
BEGIN
    IF message_ids IS NULL THEN
        RAISE EXCEPTION 'message_ids must not be null; nothing %', verb
            USING ERRCODE = '22023', COLUMN = 'message_ids';
    END IF;
    IF array_position(message_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'message_ids must not contain null; nothing %', verb
            USING ERRCODE = '22023', COLUMN = 'message_ids';
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

REVOKE EXECUTE ON FUNCTION outbox.lock_named(bigint[], text) FROM PUBLIC;

-- The named rows that are not in one of `allowed`, as '17 (''k'', running), 18 (…)', or
-- NULL when every row is. (Read after outbox.lock_named, so the states are those locked.)
CREATE FUNCTION outbox.not_in_states(message_ids bigint[], allowed text[])
RETURNS text
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT string_agg(format('%s (%s, %s%s)', m.id, quote_literal(m.message_key), m.state,
                                     CASE WHEN m.state = 'dead' THEN ' ' || m.error_class ELSE '' END),
                              ', ' ORDER BY m.id)
            FROM outbox.messages m
            WHERE m.id = ANY(message_ids) AND m.state <> ALL(allowed));
END
$$;

REVOKE EXECUTE ON FUNCTION outbox.not_in_states(bigint[], text[]) FROM PUBLIC;

-- Approve held messages: held → pending, due at its run_after (at once if that has passed),
-- an `approved` history row. All or nothing, as outbox.replay. Wakes idle workers at commit.
--   SELECT * FROM outbox.approve(ARRAY[17, 18]);
CREATE FUNCTION outbox.approve(message_ids bigint[], actor text DEFAULT current_user::text)
RETURNS TABLE (id bigint, message_key text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wrong text;
BEGIN
    PERFORM outbox.lock_named(message_ids, 'approved');
    v_wrong := outbox.not_in_states(message_ids, ARRAY['held']);
    IF v_wrong IS NOT NULL THEN
        RAISE EXCEPTION 'not held, so not approved: %; nothing approved', v_wrong
            USING ERRCODE = '55000';
    END IF;

    INSERT INTO outbox.attempts (message_id, attempt, worker, started_at, finished_at, outcome)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'approved'
    FROM outbox.messages m
    WHERE m.id = ANY(message_ids);

    RETURN QUERY
    UPDATE outbox.messages m SET state = 'pending', updated_at = now()
    WHERE m.id = ANY(message_ids)
    RETURNING m.id, m.message_key;

    PERFORM pg_notify('outbox_messages', '');
END
$$;

-- Cancel messages: held, pending or dead → cancelled (terminal: never claimed, replayed or
-- approved again), a `cancelled` history row carrying the reason in `error`. A running row
-- is refused (its attempt is under way: wait for its outcome, then cancel a retry), and so
-- is a delivered one (the effect happened). The reason is one line for the history: at most
-- 500 characters, no control characters (the class refused in message keys, which covers
-- line breaks and tabs), not empty (leave it NULL instead). Refused, not escaped, so that
-- what is stored is what the operator typed. The row keeps its error class and last error.
--   SELECT * FROM outbox.cancel(ARRAY[17], 'customer withdrew the order');
CREATE FUNCTION outbox.cancel(message_ids bigint[], reason text DEFAULT NULL,
                              actor text DEFAULT current_user::text)
RETURNS TABLE (id bigint, message_key text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
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

    PERFORM outbox.lock_named(message_ids, 'cancelled');
    v_wrong := outbox.not_in_states(message_ids, ARRAY['held', 'pending', 'dead']);
    IF v_wrong IS NOT NULL THEN
        RAISE EXCEPTION 'not held, pending or dead, so not cancelled: %; nothing cancelled', v_wrong
            USING ERRCODE = '55000';
    END IF;

    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'cancelled', reason
    FROM outbox.messages m
    WHERE m.id = ANY(message_ids);

    RETURN QUERY
    UPDATE outbox.messages m SET
        state        = 'cancelled',
        cancelled_at = now(),
        dead_at      = NULL,
        updated_at   = now()
    WHERE m.id = ANY(message_ids)
    RETURNING m.id, m.message_key;
END
$$;

-- Confirm dead messages whose outcome was ambiguous, after a person checked with the provider
-- that the effect happened: dead (class ambiguous) → delivered, `response.confirmed = true`
-- (merged into the stored response), delivered_at now; class and error are cleared from the
-- row and kept in the `confirmed` history row (as replay keeps them). Any other row is
-- refused: a dead row of another class failed provably, and a live one is still trying.
--   SELECT * FROM outbox.confirm(ARRAY[17]);
CREATE FUNCTION outbox.confirm(message_ids bigint[], actor text DEFAULT current_user::text)
RETURNS TABLE (id bigint, message_key text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wrong text;
BEGIN
    PERFORM outbox.lock_named(message_ids, 'confirmed');
    SELECT string_agg(format('%s (%s, %s%s)', m.id, quote_literal(m.message_key), m.state,
                             CASE WHEN m.state = 'dead' THEN ' ' || m.error_class ELSE '' END),
                      ', ' ORDER BY m.id)
    INTO v_wrong
    FROM outbox.messages m
    WHERE m.id = ANY(message_ids)
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
    WHERE m.id = ANY(message_ids);

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
    WHERE m.id = ANY(message_ids)
    RETURNING m.id, m.message_key;
END
$$;

-- Operators only (sql/grants.sql grants them to outbox_worker).
REVOKE EXECUTE ON FUNCTION outbox.approve(bigint[], text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox.cancel(bigint[], text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox.confirm(bigint[], text) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------
-- 5. Lookup
-- ---------------------------------------------------------------------------------------

-- What is known of one side effect, by its key: no row for an unknown key. No payload (an
-- application role may call it, and payloads are not its to read). A key no enqueue could
-- have stored (NULL, empty, over 255 characters, control characters) raises 22023 naming
-- `message_key`, as enqueue would: a tool wrapper that built such a key has a bug to see.
-- SECURITY DEFINER: the caller needs no right on the table.
--   SELECT * FROM outbox.lookup('run-7:step-3:refund');
CREATE FUNCTION outbox.lookup(message_key text)
RETURNS TABLE (id bigint, state text, attempts integer, max_attempts integer, error_class text,
               last_error text, response jsonb, created_at timestamptz, updated_at timestamptz,
               delivered_at timestamptz, dead_at timestamptz, cancelled_at timestamptz)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_bad text;
BEGIN
    IF lookup.message_key IS NULL OR char_length(lookup.message_key) = 0 THEN
        RAISE EXCEPTION 'message_key must not be empty' USING ERRCODE = '22023', COLUMN = 'message_key';
    END IF;
    IF char_length(lookup.message_key) > 255 THEN
        RAISE EXCEPTION 'message_key must be at most 255 characters (got %)', char_length(lookup.message_key)
            USING ERRCODE = '22023', COLUMN = 'message_key';
    END IF;
    v_bad := substring(lookup.message_key FROM E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]');
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'message_key must not contain control characters (U+% at character %)',
            lpad(upper(to_hex(ascii(v_bad))), 4, '0'), strpos(lookup.message_key, v_bad)
            USING ERRCODE = '22023', COLUMN = 'message_key';
    END IF;
    RETURN QUERY
    SELECT m.id, m.state, m.attempts, m.max_attempts, m.error_class, m.last_error, m.response,
           m.created_at, m.updated_at, m.delivered_at, m.dead_at, m.cancelled_at
    FROM outbox.messages m
    WHERE m.message_key = lookup.message_key;
END
$$;

REVOKE EXECUTE ON FUNCTION outbox.lookup(text) FROM PUBLIC;
