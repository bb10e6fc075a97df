-- outboxd schema, version 6: the same enqueue rules, in fewer steps per row.
--
-- A profile of single-message enqueue transactions (bench/RESULTS.md) put the enqueue path
-- well above a plain INSERT of the same row: per row, the payload was rendered as text
-- three times (the size rule, the trigger's fingerprint, outbox.enqueue_row's fingerprint),
-- hashed twice, and outbox.validate ran as a separate PL/pgSQL call of a dozen statements.
-- Now the BEFORE INSERT trigger renders the payload once, checks every rule in one
-- expression, and calls outbox.validate (which names the failing field) only for a row
-- that breaks one; outbox.enqueue_row fingerprints the caller's payload only when the key
-- already exists. Rules, error codes and messages are unchanged: outbox.validate is still
-- their one statement, and the fast check below is its conjunction.

CREATE OR REPLACE FUNCTION outbox.messages_before_insert() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_text text := NEW.payload::text;
BEGIN
    -- Every rule of outbox.validate at once; NULLs make it false.
    IF NOT coalesce(
            char_length(NEW.message_key) BETWEEN 1 AND 255
            AND NEW.message_key = btrim(NEW.message_key, E' \t\r\n')
            AND jsonb_typeof(NEW.payload) = 'object'
            AND octet_length(v_text) <= 1048576
            AND NEW.max_attempts >= 1
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
    END IF;
    -- outbox.request_hash(channel, payload), from the text rendered above.
    NEW.request_hash := pg_catalog.sha256(pg_catalog.convert_to(NEW.channel || E'\n' || v_text, 'UTF8'));
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue_row(
    message_key     text,
    channel         text,
    payload         jsonb,
    run_after       timestamptz DEFAULT now(),
    max_attempts    integer DEFAULT 3,
    retry_ambiguous boolean DEFAULT true,
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
    LOOP
        INSERT INTO outbox.messages AS m
            (message_key, channel, payload, request_hash, run_after, max_attempts, retry_ambiguous)
        VALUES (enqueue_row.message_key, enqueue_row.channel, enqueue_row.payload, NULL,
                coalesce(enqueue_row.run_after, now()), enqueue_row.max_attempts,
                enqueue_row.retry_ambiguous)
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
