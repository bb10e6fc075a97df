-- outboxd schema, version 7: hardening from an adversarial review (issue 13).
--
-- 1. Every function of the outbox schema now runs with `search_path = pg_catalog, pg_temp`.
--    The BEFORE INSERT trigger ran with its caller's search_path: a role with only the
--    outbox_app rights (sql/grants.sql) that owns a schema could put look-alike
--    `octet_length`, `btrim`, `char_length`, `jsonb_typeof` and an `||` operator ahead of
--    pg_catalog, and then a plain INSERT stored a payload over 1 MiB, a key with edge
--    whitespace, and a forged fingerprint (so a later enqueue of the genuine payload under
--    the victim's key returned the attacker's row as `created = false`, not OB409). Type
--    names (`text`, the `::text` cast) and every operator (`=` included) resolve through the
--    search_path too, so pinning the path, not qualifying names one by one, is the fix.
--    The enqueue functions were already pinned (and a trigger fired inside them inherits
--    their path); a plain INSERT and outbox.validate were not. Each body here names outbox
--    objects with their schema, so the pinned path changes nothing else (the two
--    SQL-language functions become PL/pgSQL, see below, so that they stay cheap). Rows
--    stored before this version by such a caller keep what it stored; to look for them (a
--    full read of the table):
--      SELECT id, message_key FROM outbox.messages
--      WHERE request_hash <> outbox.request_hash(channel, payload)
--         OR octet_length(payload::text) > 1048576
--         OR message_key <> btrim(message_key, E' \t\r\n');
--
-- 2. run_after must be finite. 'infinity' and '-infinity' are valid timestamptz values, but
--    `now() - run_after` cannot be computed for them (SQLSTATE 22008), which broke
--    `outboxd status` and the /metrics counts. Refused at enqueue, in the trigger (so every
--    path gets it), with SQLSTATE 22023 naming `run_after`. Not a CHECK constraint: rows
--    stored before this version may hold such a value, a VALIDATE would then fail (and, in
--    this migration's transaction, hold an exclusive lock on the table for the whole scan),
--    and a NOT VALID constraint would make every later UPDATE of such a row fail, the
--    claim's included. The status queries (src/queries.rs) cope with those rows instead.
--
-- 3. message_key must not contain control characters: C0 (U+0001–U+001F; U+0000 cannot be
--    stored in text at all), DEL (U+007F), C1 (U+0080–U+009F), the Unicode line and
--    paragraph separators (U+2028, U+2029), and the bidirectional embedding, override and
--    isolate controls (U+202A–U+202E, U+2066–U+2069). A key is printed in logs, in
--    `outboxd` output and sent as a header: such characters forge log lines, move the
--    terminal's cursor, or make a key display as another one. SQLSTATE 22023 naming
--    `message_key`; the message gives the code point and position, never the key itself.
--    Keys stored before this version are left as they are (a new enqueue with such a key is
--    refused, as the trigger validates before the conflict check).

-- The rules, with the control-character rule added after the length rule. Same signature,
-- same error codes and messages for the other rules.
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
    ELSIF channel = 'email' THEN
        IF NOT coalesce((jsonb_typeof(payload -> 'to') = 'string' AND btrim(payload ->> 'to') <> '')
                OR (jsonb_typeof(payload -> 'to') = 'array' AND jsonb_array_length(payload -> 'to') > 0), false) THEN
            RAISE EXCEPTION 'payload.to must be an address or a non-empty array of addresses'
                USING ERRCODE = '22023', COLUMN = 'payload.to';
        END IF;
    END IF;
END
$$;

-- As in sql/0006 (one rendering of the payload, one expression for every rule, the named
-- error only for a row that breaks one), with the pinned path, the control-character rule
-- and the run_after rule. run_after has no place in outbox.validate's signature, so its
-- rule is checked here, after the others: every path of enqueue inserts through this
-- trigger.
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
            AND CASE NEW.channel
                    WHEN 'webhook' THEN jsonb_typeof(NEW.payload -> 'url') = 'string'
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
        -- A NULL run_after is left to the column's NOT NULL constraint.
        IF NOT isfinite(NEW.run_after) THEN
            RAISE EXCEPTION 'run_after must be a finite time (got %)', NEW.run_after
                USING ERRCODE = '22023', COLUMN = 'run_after';
        END IF;
    END IF;
    -- outbox.request_hash(channel, payload), from the text rendered above.
    NEW.request_hash := sha256(convert_to(NEW.channel || E'\n' || v_text, 'UTF8'));
    RETURN NEW;
END
$$;

-- The two SQL-language functions become PL/pgSQL. A SQL function with a SET clause is never
-- inlined, and PostgreSQL (before 18) parses and plans a non-inlined SQL function's body
-- afresh in every statement that calls it (a single-row `SELECT outbox.enqueue(…)` would pay
-- that in every transaction); PL/pgSQL keeps the compiled body and its plans for the
-- session. Same signatures, defaults, results and volatility.
CREATE OR REPLACE FUNCTION outbox.request_hash(channel text, payload jsonb) RETURNS bytea
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN sha256(convert_to(channel || E'\n' || payload::text, 'UTF8'));
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(
    message_key     text,
    channel         text,
    payload         jsonb,
    run_after       timestamptz DEFAULT now(),
    max_attempts    integer DEFAULT 3,
    retry_ambiguous boolean DEFAULT true
) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (outbox.enqueue_row(enqueue.message_key, enqueue.channel, enqueue.payload,
                               enqueue.run_after, enqueue.max_attempts,
                               enqueue.retry_ambiguous)).id;
END
$$;

-- Every other function of the schema that was not pinned yet. (outbox.enqueue_row,
-- outbox.enqueue_many, outbox.messages_delete_history and outbox.messages_truncate_history
-- were pinned when they were made.)
ALTER FUNCTION outbox.messages_notify() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.wake_needed() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.replay(bigint[], text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.purge(interval, boolean, integer) SET search_path = pg_catalog, pg_temp;
