-- outboxd schema, version 1: the outbox table, its attempt history, and the enqueue function.
--
-- Applied by `outboxd migrate` in one transaction under an advisory lock, and usable as it is
-- with psql or any migration tool. Runtime queries live in src/queries.rs, not here.

CREATE SCHEMA IF NOT EXISTS outbox;

-- The migration ledger. `outboxd migrate` creates it too (it must exist before the first
-- file is applied); it is here so that a psql-only install has the same shape.
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- One row per side effect. The CHECK constraints make the impossible states
-- unrepresentable: a lease exists exactly while a row is running, a delivered row has a
-- delivery time, a dead row has a death time and a class. The worker relies on them: a bug
-- that tried to write such a state would fail loudly instead of corrupting the queue.
CREATE TABLE outbox.messages (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_key      text NOT NULL,
    channel          text NOT NULL,
    payload          jsonb NOT NULL,
    request_hash     bytea NOT NULL,
    state            text NOT NULL DEFAULT 'pending',
    attempts         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL DEFAULT 3,
    retry_ambiguous  boolean NOT NULL DEFAULT true,
    run_after        timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    lease_token      uuid,
    lease_expires_at timestamptz,
    error_class      text,
    last_error       text,
    response         jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    delivered_at     timestamptz,
    dead_at          timestamptz,

    CONSTRAINT messages_message_key_key UNIQUE (message_key),
    CONSTRAINT messages_key_length CHECK (char_length(message_key) BETWEEN 1 AND 255),
    CONSTRAINT messages_channel_check CHECK (channel IN ('webhook', 'email')),
    CONSTRAINT messages_payload_object CHECK (jsonb_typeof(payload) = 'object'),
    CONSTRAINT messages_request_hash_len CHECK (octet_length(request_hash) = 32),
    CONSTRAINT messages_state_check CHECK (state IN ('pending', 'running', 'delivered', 'dead')),
    CONSTRAINT messages_attempts_check CHECK (attempts >= 0),
    CONSTRAINT messages_max_attempts_check CHECK (max_attempts >= 1),
    CONSTRAINT messages_error_class_check
        CHECK (error_class IN ('transient', 'ambiguous', 'permanent', 'invalid', 'exhausted')),
    -- A lease (all three columns) exists if and only if the row is running.
    CONSTRAINT messages_lease_iff_running CHECK (
        (state = 'running') = (lease_owner IS NOT NULL)
        AND (lease_owner IS NULL) = (lease_token IS NULL)
        AND (lease_owner IS NULL) = (lease_expires_at IS NULL)
    ),
    CONSTRAINT messages_delivered_at_iff_delivered
        CHECK ((state = 'delivered') = (delivered_at IS NOT NULL)),
    CONSTRAINT messages_dead_at_iff_dead CHECK ((state = 'dead') = (dead_at IS NOT NULL)),
    CONSTRAINT messages_dead_has_class CHECK (state <> 'dead' OR error_class IS NOT NULL)
);

-- The claim reads due pending rows in (run_after, id) order; a partial index keeps that scan
-- proportional to the due rows, however many delivered rows the table still holds.
CREATE INDEX messages_due_idx ON outbox.messages (run_after, id) WHERE state = 'pending';
-- Expired leases are found by expiry time among the (few) running rows.
CREATE INDEX messages_lease_idx ON outbox.messages (lease_expires_at) WHERE state = 'running';
-- Dead-letter listings and retention purges.
CREATE INDEX messages_dead_idx ON outbox.messages (dead_at) WHERE state = 'dead';
CREATE INDEX messages_delivered_idx ON outbox.messages (delivered_at) WHERE state = 'delivered';

-- Every row is inserted, updated two or three times and deleted by retention: a queue table
-- churns. Vacuum it after 2% of rows changed rather than the default 20%, so dead tuples do
-- not pile up in the claim's index between autovacuum runs.
ALTER TABLE outbox.messages SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05
);

-- One row per attempt and per operator action on a message.
CREATE TABLE outbox.attempts (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   bigint NOT NULL REFERENCES outbox.messages (id) ON DELETE CASCADE,
    attempt      integer NOT NULL,
    worker       text,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz,
    outcome      text NOT NULL,
    error_class  text,
    error        text,
    status       integer,
    deduplicated boolean NOT NULL DEFAULT false,

    CONSTRAINT attempts_outcome_check CHECK (
        outcome IN ('delivered', 'retry', 'dead', 'lease_lost', 'released', 'replayed')
    ),
    CONSTRAINT attempts_error_class_check
        CHECK (error_class IN ('transient', 'ambiguous', 'permanent', 'invalid', 'exhausted'))
);

CREATE INDEX attempts_message_idx ON outbox.attempts (message_id, id);

ALTER TABLE outbox.attempts SET (autovacuum_vacuum_insert_scale_factor = 0.05);

-- The request fingerprint: SHA-256 over the channel and jsonb's canonical text form of the
-- payload, so that key order or whitespace in the caller's JSON does not matter.
CREATE FUNCTION outbox.request_hash(channel text, payload jsonb) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT sha256(convert_to(channel || E'\n' || payload::text, 'UTF8')) $$;

-- Input rules shared by outbox.enqueue and plain INSERTs (through the trigger below).
-- Raises SQLSTATE 22023 (invalid_parameter_value) naming the offending field. Rules that
-- need the network or a parser (URL syntax, addresses) are the worker's: such a message is
-- dead-lettered with class `invalid` before any network call.
CREATE FUNCTION outbox.validate(message_key text, channel text, payload jsonb, max_attempts integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
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

-- BEFORE INSERT: validate, and compute the fingerprint so a plain INSERT behaves like
-- outbox.enqueue. The fingerprint is always recomputed: a caller cannot make it lie.
CREATE FUNCTION outbox.messages_before_insert() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM outbox.validate(NEW.message_key, NEW.channel, NEW.payload, NEW.max_attempts);
    NEW.request_hash := outbox.request_hash(NEW.channel, NEW.payload);
    RETURN NEW;
END
$$;

CREATE TRIGGER messages_before_insert
    BEFORE INSERT ON outbox.messages
    FOR EACH ROW EXECUTE FUNCTION outbox.messages_before_insert();

-- Wake idle workers when the inserting transaction commits. Statement level, with a fixed
-- payload: PostgreSQL folds identical notifications of one transaction into one, so a
-- transaction that enqueues a thousand rows sends a single wake-up.
CREATE FUNCTION outbox.messages_notify() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_notify('outbox_messages', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER messages_notify
    AFTER INSERT ON outbox.messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.messages_notify();

-- Enqueue one message inside the caller's transaction; returns its id and whether this call
-- created it. The rules (outbox.enqueue is the documented face of them):
--
-- * A new key inserts a pending row.
-- * The same key with the same channel and payload returns the existing id and inserts
--   nothing, whatever that row's state: the row is the dedup record of the side effect.
-- * The same key with another channel or payload raises SQLSTATE OB409, naming the key
--   (quoted in the message, verbatim in the error's DETAIL field).
-- * Bad input raises SQLSTATE 22023 naming the field (also in the error's COLUMN field).
--
-- Concurrent callers with one key: ON CONFLICT DO NOTHING waits for the other inserting
-- transaction, so exactly one inserts and the other then sees the committed row and
-- compares fingerprints; no unique violation escapes. (Under REPEATABLE READ the waiter
-- gets a serialization failure instead, as for any conflicting write at that level.)
CREATE FUNCTION outbox.enqueue_row(
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
-- SECURITY DEFINER: an application role may enqueue (and learn whether its own key exists)
-- without any right to read or change outbox rows (see sql/grants.sql). The pinned
-- search_path keeps a caller's objects from standing in for the ones used here.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_hash     bytea;
    v_existing bytea;
BEGIN
    -- The BEFORE INSERT trigger validates the row, also when the key already exists (row
    -- triggers fire before the conflict check), so bad input never reaches the dedup path.
    IF enqueue_row.retry_ambiguous IS NULL THEN
        RAISE EXCEPTION 'retry_ambiguous must not be null'
            USING ERRCODE = '22023', COLUMN = 'retry_ambiguous';
    END IF;
    v_hash := outbox.request_hash(enqueue_row.channel, enqueue_row.payload);
    LOOP
        INSERT INTO outbox.messages AS m
            (message_key, channel, payload, request_hash, run_after, max_attempts, retry_ambiguous)
        VALUES (enqueue_row.message_key, enqueue_row.channel, enqueue_row.payload, v_hash,
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
            IF v_existing <> v_hash THEN
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

-- Only roles granted it may enqueue through the definer-rights function (sql/grants.sql);
-- the schema owner always can.
REVOKE EXECUTE ON FUNCTION outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean) FROM PUBLIC;

-- The contract's enqueue: outbox.enqueue_row without the `created` flag.
CREATE FUNCTION outbox.enqueue(
    message_key     text,
    channel         text,
    payload         jsonb,
    run_after       timestamptz DEFAULT now(),
    max_attempts    integer DEFAULT 3,
    retry_ambiguous boolean DEFAULT true
) RETURNS bigint
LANGUAGE sql
AS $$
    SELECT (outbox.enqueue_row(message_key, channel, payload, run_after, max_attempts,
                               retry_ambiguous)).id
$$;

-- Enqueue many messages in one call, with the rules of outbox.enqueue_row for each row, in
-- array order; all or nothing (the first failing row aborts the statement). NULL elements
-- of run_afters, max_attempts and retry_ambiguous take the defaults; shorter arrays are
-- padded with NULLs (so the optional arrays may be empty).
CREATE FUNCTION outbox.enqueue_many(
    message_keys    text[],
    channels        text[],
    payloads        jsonb[],
    run_afters      timestamptz[] DEFAULT '{}',
    max_attempts    integer[] DEFAULT '{}',
    retry_ambiguous boolean[] DEFAULT '{}'
) RETURNS TABLE (id bigint, created boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    n integer := coalesce(array_length(message_keys, 1), 0);
    r record;
BEGIN
    IF coalesce(array_length(channels, 1), 0) <> n OR coalesce(array_length(payloads, 1), 0) <> n THEN
        RAISE EXCEPTION 'message_keys, channels and payloads must have the same length'
            USING ERRCODE = '22023', COLUMN = 'message_keys';
    END IF;
    FOR i IN 1 .. n LOOP
        r := outbox.enqueue_row(message_keys[i], channels[i], payloads[i],
                                coalesce(run_afters[i], now()),
                                coalesce(enqueue_many.max_attempts[i], 3),
                                coalesce(enqueue_many.retry_ambiguous[i], true));
        id := r.id;
        created := r.created;
        RETURN NEXT;
    END LOOP;
END
$$;
