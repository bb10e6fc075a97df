-- outboxd: the baseline schema, everything in the schema `outbox`.
--
-- Applied by `outboxd migrate` in one transaction and recorded in outbox.schema_migrations;
-- usable with psql (`psql -1 -f`) or any migration tool. This file is the live schema: read
-- it to learn what the database holds. Until the first release tag the schema may be
-- squashed here again; from that tag on, this file never changes and every change is a
-- new numbered file (tests/it/tidy.rs holds released files to the tag).
--
-- Roles and grants are a site's choice: sql/grants.sql, run once after migrating.
--
-- Function bodies are checked when they are first called, not here: the functions are
-- created after the tables, in name order, and some call others defined after them.
SET check_function_bodies = false;

CREATE SCHEMA IF NOT EXISTS outbox;

-- outboxd's own ledger of applied migrations (`outboxd migrate` creates it first, the same).
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- ======================================================================================
-- Tables: messages (one row per intended side effect), attempts (its history),
-- destinations (circuit breakers shared by every worker), backlog_samples (the backlog,
-- minute by minute)
-- ======================================================================================

CREATE TABLE outbox.attempts (
    id bigint NOT NULL,
    message_id bigint NOT NULL,
    attempt integer NOT NULL,
    worker text,
    started_at timestamp with time zone NOT NULL,
    finished_at timestamp with time zone,
    outcome text NOT NULL,
    error_class text,
    error text,
    status integer,
    deduplicated boolean DEFAULT false NOT NULL,
    CONSTRAINT attempts_error_class_check CHECK ((error_class = ANY (ARRAY['transient'::text, 'ambiguous'::text, 'permanent'::text, 'invalid'::text, 'exhausted'::text]))),
    CONSTRAINT attempts_outcome_check CHECK ((outcome = ANY (ARRAY['delivered'::text, 'retry'::text, 'dead'::text, 'lease_lost'::text, 'released'::text, 'replayed'::text, 'approved'::text, 'cancelled'::text, 'confirmed'::text, 'reconciled'::text])))
)
WITH (autovacuum_vacuum_insert_scale_factor='0.05');

ALTER TABLE outbox.attempts ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME outbox.attempts_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- A provider's API that `http` messages name: its base URL, the header its credential goes
-- in and the NAME of the secret that fills it (each worker reads the value from
-- OUTBOXD_SECRET_<NAME> or OUTBOXD_SECRET_<NAME>_FILE: never stored here), the header that
-- carries the message key (NULL: the provider takes none), how long the provider remembers a
-- key (NULL: unknown), and fixed headers that are no secret.
CREATE TABLE outbox.endpoints (
    name text NOT NULL,
    url text NOT NULL,
    auth_header text DEFAULT 'Authorization'::text NOT NULL,
    auth_secret text,
    idempotency_header text DEFAULT 'Idempotency-Key'::text,
    key_ttl interval,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT endpoints_name_check CHECK ((name ~ '^[a-z][a-z0-9_-]{0,62}$'::text))
);

CREATE TABLE outbox.destinations (
    host text NOT NULL,
    state text NOT NULL,
    consecutive_failures integer DEFAULT 0 NOT NULL,
    open_until timestamp with time zone,
    cooldown_seconds double precision,
    probe_until timestamp with time zone,
    deferred_until timestamp with time zone,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    -- A pause (outbox.pause_destination), apart from the circuit: since when, by whom, why,
    -- and the far-off time its held-back messages are parked at until it is resumed.
    paused_at timestamp with time zone,
    paused_by text,
    pause_reason text,
    parked_until timestamp with time zone,
    CONSTRAINT destinations_host_check CHECK (((length(host) >= 1) AND (length(host) <= 1000))),
    CONSTRAINT destinations_state_check CHECK ((state = ANY (ARRAY['closed'::text, 'open'::text, 'half_open'::text]))),
    CONSTRAINT destinations_paused_check CHECK ((((paused_at IS NULL) = (paused_by IS NULL)) AND ((paused_at IS NULL) = (parked_until IS NULL)) AND ((paused_at IS NOT NULL) OR (pause_reason IS NULL))))
);

-- What operators did to destinations (pause, resume, close by hand): who, when, why, and
-- how many messages it held back or made due. The destination's own row keeps only its
-- present state.
CREATE TABLE outbox.destination_actions (
    id bigint NOT NULL,
    host text NOT NULL,
    action text NOT NULL,
    actor text NOT NULL,
    reason text,
    messages bigint,
    at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT destination_actions_action_check CHECK ((action = ANY (ARRAY['paused'::text, 'resumed'::text, 'closed'::text])))
);

ALTER TABLE outbox.destination_actions ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME outbox.destination_actions_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE outbox.messages (
    id bigint NOT NULL,
    message_key text NOT NULL COLLATE pg_catalog."C",
    channel text NOT NULL,
    payload jsonb NOT NULL,
    request_hash bytea NOT NULL,
    state text DEFAULT 'pending'::text NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 3 NOT NULL,
    retry_ambiguous boolean DEFAULT true NOT NULL,
    run_after timestamp with time zone DEFAULT now() NOT NULL,
    lease_owner text,
    lease_token uuid,
    lease_expires_at timestamp with time zone,
    error_class text,
    last_error text,
    response jsonb,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    delivered_at timestamp with time zone,
    dead_at timestamp with time zone,
    cancelled_at timestamp with time zone,
    ordering_key text,
    destination text,
    lookup_destination text,
    first_attempt_at timestamp with time zone,
    CONSTRAINT messages_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT messages_cancelled_at_iff_cancelled CHECK (((state = 'cancelled'::text) = (cancelled_at IS NOT NULL))),
    CONSTRAINT messages_dead_at_iff_dead CHECK (((state = 'dead'::text) = (dead_at IS NOT NULL))),
    CONSTRAINT messages_dead_has_class CHECK (((state <> 'dead'::text) OR (error_class IS NOT NULL))),
    CONSTRAINT messages_delivered_at_iff_delivered CHECK (((state = 'delivered'::text) = (delivered_at IS NOT NULL))),
    CONSTRAINT messages_error_class_check CHECK ((error_class = ANY (ARRAY['transient'::text, 'ambiguous'::text, 'permanent'::text, 'invalid'::text, 'exhausted'::text]))),
    CONSTRAINT messages_lease_iff_running CHECK ((((state = 'running'::text) = (lease_owner IS NOT NULL)) AND ((lease_owner IS NULL) = (lease_token IS NULL)) AND ((lease_owner IS NULL) = (lease_expires_at IS NULL)))),
    CONSTRAINT messages_state_check CHECK ((state = ANY (ARRAY['pending'::text, 'held'::text, 'running'::text, 'delivered'::text, 'dead'::text, 'cancelled'::text])))
)
WITH (autovacuum_vacuum_scale_factor='0.02', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_insert_scale_factor='0.05');

ALTER TABLE outbox.messages ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME outbox.messages_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- The backlog as the daemon saw it, one row per minute (the console's backlog chart): how
-- many messages were due (pending, run_after passed; counted up to 100 000) and how long
-- the oldest of them had been due, sampled at some moment of the minute by whichever
-- worker came first. A minute without a row had no worker running. Rows older than a day
-- are deleted by the statement that adds one, so the table holds at most 1 441 rows.
-- Reconstructing the same figures from outbox.messages afterwards is both dearer (a join
-- of every minute with every message that waited in the hour) and wrong (a retry
-- overwrites run_after, and a held or deferred message leaves no trace of its waits).
CREATE TABLE outbox.backlog_samples (
    minute timestamp with time zone PRIMARY KEY,
    due bigint NOT NULL,
    oldest_due_seconds double precision NOT NULL,
    sampled_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT backlog_samples_minute_check CHECK ((minute = date_trunc('minute'::text, minute, 'UTC'::text))),
    CONSTRAINT backlog_samples_due_check CHECK ((due >= 0)),
    CONSTRAINT backlog_samples_oldest_check CHECK ((oldest_due_seconds >= (0)::double precision))
);

ALTER TABLE ONLY outbox.attempts
    ADD CONSTRAINT attempts_pkey PRIMARY KEY (id);

ALTER TABLE ONLY outbox.endpoints
    ADD CONSTRAINT endpoints_pkey PRIMARY KEY (name);

ALTER TABLE ONLY outbox.destinations
    ADD CONSTRAINT destinations_pkey PRIMARY KEY (host);

ALTER TABLE ONLY outbox.destination_actions
    ADD CONSTRAINT destination_actions_pkey PRIMARY KEY (id);

ALTER TABLE ONLY outbox.messages
    ADD CONSTRAINT messages_message_key_key UNIQUE (message_key);

ALTER TABLE ONLY outbox.messages
    ADD CONSTRAINT messages_pkey PRIMARY KEY (id);

-- ======================================================================================
-- Indexes: one partial index per state a worker or an operator scans
-- ======================================================================================

CREATE INDEX attempts_message_idx ON outbox.attempts USING btree (message_id, id);

CREATE INDEX destination_actions_host_idx ON outbox.destination_actions USING btree (host, id);

CREATE INDEX messages_cancelled_idx ON outbox.messages USING btree (cancelled_at) WHERE (state = 'cancelled'::text);

CREATE INDEX messages_dead_idx ON outbox.messages USING btree (dead_at) WHERE (state = 'dead'::text);

CREATE INDEX messages_delivered_idx ON outbox.messages USING btree (delivered_at) WHERE (state = 'delivered'::text);

-- The messages waiting for one destination (a pause holds them back, the console counts
-- them); finished ones are not in it, so the index stays the size of the backlog.
CREATE INDEX messages_destination_idx ON outbox.messages USING btree (destination, state, run_after) WHERE ((destination IS NOT NULL) AND (state = ANY (ARRAY['pending'::text, 'held'::text])));

CREATE INDEX messages_due_idx ON outbox.messages USING btree (run_after, id) WHERE (state = 'pending'::text);

CREATE INDEX messages_held_idx ON outbox.messages USING btree (created_at, id) WHERE (state = 'held'::text);

CREATE INDEX messages_lease_idx ON outbox.messages USING btree (lease_expires_at) WHERE (state = 'running'::text);

CREATE INDEX messages_ordering_idx ON outbox.messages USING btree (ordering_key, id) WHERE ((ordering_key IS NOT NULL) AND (state = ANY (ARRAY['pending'::text, 'running'::text, 'held'::text, 'dead'::text])));

-- ======================================================================================
-- Functions: enqueue and its validation, the operator actions, lookups, purge
-- ======================================================================================

-- Approve held messages: held → pending, due at its run_after (at once if that has passed),
-- an `approved` history row. All or nothing, as outbox.replay. Wakes idle workers at commit.
--   SELECT * FROM outbox.approve(ARRAY[17, 18]);
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

-- Cancel messages: held, pending or dead → cancelled (terminal: never claimed, replayed or
-- approved again), a `cancelled` history row carrying the reason in `error`. A running row
-- is refused (its attempt is under way: wait for its outcome, then cancel a retry), and so
-- is a delivered one (the effect happened). The reason follows outbox.reason_problem. The
-- row keeps its error class and last error.
--   SELECT * FROM outbox.cancel(ARRAY[17], 'customer withdrew the order');
CREATE FUNCTION outbox.cancel(ids bigint[], reason text DEFAULT NULL::text, actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(id bigint, message_key text)
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_problem text := outbox.reason_problem(reason);
    v_wrong   text;
BEGIN
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '%; nothing cancelled', v_problem USING ERRCODE = '22023', COLUMN = 'reason';
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

-- Confirm dead messages whose outcome was ambiguous, after a person checked with the provider
-- that the effect happened: dead (class ambiguous) → delivered, `response.confirmed = true`
-- (merged into the stored response), delivered_at now; class and error are cleared from the
-- row and kept in the `confirmed` history row (as replay keeps them). Any other row is
-- refused: a dead row of another class failed provably, and a live one is still trying.
--   SELECT * FROM outbox.confirm(ARRAY[17]);
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

-- A destination as an operator writes it (`outboxd destinations --pause HOST`), in the form
-- outbox.destination_of gives it: lower case, no trailing dot, the port without leading
-- zeros. NULL when it is no destination: anything but a host (ASCII letters, digits, `.`,
-- `_`, `-`, or an IPv6 address in brackets) and an optional port up to 65535. The rule is
-- destination_of's, read through a scheme without a default port, so `:80` and `:443` stay.
--   SELECT outbox.destination_name('API.example.com:08443');  -- api.example.com:8443
CREATE FUNCTION outbox.destination_name(host text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $_$
SELECT CASE
    WHEN host ~ '^[][A-Za-z0-9._:-]+$' AND char_length(host) <= 1000
         AND coalesce(substring(host FROM ':([0-9]{1,5})$')::int, 0) <= 65535
    THEN outbox.destination_of('webhook', jsonb_build_object('url', 'name://' || host))
END
$_$;

CREATE FUNCTION outbox.destination_of(channel text, payload jsonb) RETURNS text
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

-- The destination of endpoint `name` (outbox.destination_of of its URL), NULL when there
-- is no such endpoint. SECURITY DEFINER: the insert trigger runs with the inserting role's
-- rights, and an application may name an endpoint without reading the table.
CREATE FUNCTION outbox.endpoint_destination(name text) RETURNS text
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
    SELECT outbox.destination_of('webhook', jsonb_build_object('url', e.url))
    FROM outbox.endpoints e
    WHERE e.name = endpoint_destination.name
$$;

-- What the insert trigger needs of endpoint `name`: its destination and the two header
-- names a payload may not set; all NULL when there is no such endpoint. SECURITY DEFINER,
-- as outbox.endpoint_destination: an application names an endpoint without reading the
-- table (and learns nothing here that is secret).
CREATE FUNCTION outbox.endpoint_for_insert(name text, OUT destination text, OUT auth_header text, OUT idempotency_header text) RETURNS record
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    SELECT outbox.destination_of('webhook', jsonb_build_object('url', e.url)), e.auth_header,
           e.idempotency_header
    INTO endpoint_for_insert.destination, endpoint_for_insert.auth_header,
         endpoint_for_insert.idempotency_header
    FROM outbox.endpoints e
    WHERE e.name = endpoint_for_insert.name;
END
$$;

-- The contract's enqueue: outbox.enqueue_row without the `created` flag.
--   SELECT outbox.enqueue('order-42:refund', 'webhook', '{"url": "https://…"}', held => true);
--   SELECT outbox.enqueue('order-42:shipped', 'webhook', '{"url": "https://…"}',
--                         ordering_key => 'order-42');
CREATE FUNCTION outbox.enqueue(message_key text, channel text, payload jsonb, run_after timestamp with time zone DEFAULT now(), max_attempts integer DEFAULT 3, retry_ambiguous boolean DEFAULT true, held boolean DEFAULT false, ordering_key text DEFAULT NULL::text) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    RETURN (outbox.enqueue_row(enqueue.message_key, enqueue.channel, enqueue.payload,
                               enqueue.run_after, enqueue.max_attempts,
                               enqueue.retry_ambiguous, enqueue.held,
                               enqueue.ordering_key)).id;
END
$$;

-- Many messages in one statement, with outbox.enqueue's rules for each; `ordering_key` is an
-- array like the other optional ones (NULL elements and missing ones are no ordering). The groups' locks are taken first, in one sorted
-- order, so two batches naming the same groups in different orders do not deadlock.
CREATE FUNCTION outbox.enqueue_many(message_keys text[], channels text[], payloads jsonb[], run_afters timestamp with time zone[] DEFAULT '{}'::timestamp with time zone[], max_attempts integer[] DEFAULT '{}'::integer[], retry_ambiguous boolean[] DEFAULT '{}'::boolean[], held boolean[] DEFAULT '{}'::boolean[], ordering_key text[] DEFAULT '{}'::text[]) RETURNS TABLE(id bigint, created boolean)
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

-- One message: inserts it, or returns the existing row of the same key, channel and payload
-- (`ordering_key` is checked by the insert trigger, which also waits for the group's turn).
CREATE FUNCTION outbox.enqueue_row(message_key text, channel text, payload jsonb, run_after timestamp with time zone DEFAULT now(), max_attempts integer DEFAULT 3, retry_ambiguous boolean DEFAULT true, held boolean DEFAULT false, ordering_key text DEFAULT NULL::text, OUT id bigint, OUT created boolean) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
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

-- ======================================================================================
-- The http channel's rules: one owner for each, used by the insert trigger (its fast path
-- and its named errors), outbox.validate and outbox.set_endpoint. Each returns NULL when
-- the value is fine, else ARRAY[field, one-line message] for a 22023 naming the field.
-- ======================================================================================

-- A header name as HTTP writes one (a token: RFC 9110's tchar, at most 128 characters)
-- that outboxd does not set itself: the body's type and length and the host are the
-- worker's, and the framing (hop-by-hop) headers would let a value redraw the request.
-- `auth_header` and `idempotency_header` are the endpoint's, compared without regard to case
-- (and with `_` for `-`).
CREATE FUNCTION outbox.http_header_name_problem(header text, field text, auth_header text DEFAULT NULL::text, idempotency_header text DEFAULT NULL::text) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $_$
BEGIN
    IF header IS NULL OR header !~ '^[!#$%&''*+.^_`|~0-9A-Za-z-]{1,128}$' THEN
        RETURN ARRAY[field, format('%s: %s is not a header name (1 to 128 letters, digits or !#$%%&''*+.^_`|~-)',
                                   field, coalesce(quote_literal(left(header, 64)), 'NULL'))];
    END IF;
    -- `_` compares as `-`: a CGI, WSGI or Rack server reads `Content_Type` as `Content-Type`.
    IF translate(lower(header), '_', '-') IN ('content-type', 'content-length', 'host',
                         'transfer-encoding', 'te', 'trailer', 'upgrade', 'connection',
                         'keep-alive', 'proxy-connection')
       OR translate(lower(header), '_', '-') = translate(lower(auth_header), '_', '-')
       OR translate(lower(header), '_', '-') = translate(lower(idempotency_header), '_', '-') THEN
        RETURN ARRAY[field, format('%s must not set %s: outboxd sets it (the body''s type and length, the host, the framing, the endpoint''s credential and idempotency key)',
                                   field, header)];
    END IF;
    RETURN NULL;
END
$_$;

-- Fixed or per-message headers: an object of string values (one line each, at most 8192
-- characters) whose names pass outbox.http_header_name_problem.
CREATE FUNCTION outbox.http_headers_problem(headers jsonb, field text, auth_header text DEFAULT NULL::text, idempotency_header text DEFAULT NULL::text) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_name    text;
    v_value   jsonb;
    v_problem text[];
BEGIN
    IF jsonb_typeof(headers) IS DISTINCT FROM 'object' THEN
        RETURN ARRAY[field, field || ' must be an object of header names and string values'];
    END IF;
    FOR v_name, v_value IN SELECT h.key, h.value FROM jsonb_each(headers) h LOOP
        v_problem := outbox.http_header_name_problem(v_name, field, auth_header, idempotency_header);
        IF v_problem IS NOT NULL THEN
            RETURN v_problem;
        END IF;
        IF jsonb_typeof(v_value) <> 'string' THEN
            RETURN ARRAY[field, format('%s.%s must be a string', field, v_name)];
        END IF;
        IF char_length(v_value #>> '{}') > 8192
           OR (v_value #>> '{}') ~ E'[\\u0001-\\u0008\\u000a-\\u001f\\u007f]' THEN
            RETURN ARRAY[field, format('%s.%s must be one line of at most 8192 characters without control characters',
                                       field, v_name)];
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- A request path, appended to an endpoint's URL: a string that starts with one `/` (`//`
-- would name another host), at most 2048 characters, with no control characters or spaces,
-- no backslash (read as `/` by some parsers), no `?` or `#` (a query goes in `query`), no
-- dot segment (`.` or `..`, also written `%2e`, between `/`, `%2f` or `%5c`), and `%` only
-- as a two-digit escape. It never leaves the endpoint's host, and never climbs above the
-- endpoint's base path. `{key}` is the message key's placeholder, filled by the worker.
CREATE FUNCTION outbox.http_path_problem(path jsonb, field text) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $_$
DECLARE
    p text;
BEGIN
    IF jsonb_typeof(path) IS DISTINCT FROM 'string' THEN
        RETURN ARRAY[field, field || ' must be a string starting with /'];
    END IF;
    p := path #>> '{}';
    IF char_length(p) > 2048 THEN
        RETURN ARRAY[field, format('%s must be at most 2048 characters (got %s)', field, char_length(p))];
    END IF;
    IF left(p, 1) <> '/' THEN
        RETURN ARRAY[field, field || ' must start with /'];
    END IF;
    IF left(p, 2) = '//' THEN
        RETURN ARRAY[field, field || ' must not start with // (it would name another host)'];
    END IF;
    IF p ~ E'[\\u0001-\\u0020\\u007f-\\u009f\\u00a0\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]' THEN
        RETURN ARRAY[field, field || ' must not contain spaces or control characters (percent-encode them)'];
    END IF;
    IF strpos(p, E'\\') > 0 THEN
        RETURN ARRAY[field, field || ' must not contain a backslash'];
    END IF;
    IF p ~ '[?#]' THEN
        RETURN ARRAY[field, field || ' must not contain ? or # (put the query in query)'];
    END IF;
    IF p ~* '(^|/|%2f|%5c)(\.|%2e){1,2}(/|%2f|%5c|$)' THEN
        RETURN ARRAY[field, field || ' must not contain . or .. segments'];
    END IF;
    IF p ~ '%([^0-9A-Fa-f]|[0-9A-Fa-f][^0-9A-Fa-f]|[0-9A-Fa-f]?$)' THEN
        RETURN ARRAY[field, field || ' must use % only in two-hex-digit escapes'];
    END IF;
    RETURN NULL;
END
$_$;

-- A query: an object of names and values, encoded as `form` is (nested objects and arrays
-- in bracket notation, `expand[0]=x`; null left out; `{key}` in a value is the message key).
CREATE FUNCTION outbox.http_query_problem(query jsonb, field text) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF jsonb_typeof(query) IS DISTINCT FROM 'object' THEN
        RETURN ARRAY[field, field || ' must be an object of names and values'];
    END IF;
    RETURN NULL;
END
$$;

-- An http payload's rules, given the endpoint's auth and idempotency headers (NULL when
-- unknown: the rules that need them are then checked by the insert trigger). Members:
-- endpoint (a string), method (POST, PUT, PATCH or DELETE), path, query, form (an object)
-- or json (any value), headers, store_response (a boolean), reconcile (an object: method
-- GET, path, query, found: a JSON pointer). Any other member is refused, so that a
-- webhook's `body` or `url` written by mistake is not silently dropped.
CREATE FUNCTION outbox.http_payload_problem(payload jsonb, auth_header text DEFAULT NULL::text, idempotency_header text DEFAULT NULL::text) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_bad     text;
    v_problem text[];
    v_rec     jsonb;
BEGIN
    IF jsonb_typeof(payload) IS DISTINCT FROM 'object' THEN
        RETURN ARRAY['payload', 'payload must be a JSON object'];
    END IF;
    IF jsonb_typeof(payload -> 'endpoint') IS DISTINCT FROM 'string' THEN
        RETURN ARRAY['payload.endpoint', 'payload.endpoint must be the name of an endpoint'];
    END IF;
    SELECT k INTO v_bad FROM jsonb_object_keys(payload) k
    WHERE k NOT IN ('endpoint', 'method', 'path', 'query', 'form', 'json', 'headers',
                    'store_response', 'reconcile')
    ORDER BY k LIMIT 1;
    IF v_bad IS NOT NULL THEN
        RETURN ARRAY['payload', format('payload.%s is not a member of an http payload (endpoint, method, path, query, form, json, headers, store_response, reconcile)',
                                       left(v_bad, 64))];
    END IF;
    IF payload ? 'method' AND coalesce(payload ->> 'method' NOT IN ('POST', 'PUT', 'PATCH', 'DELETE')
                                       OR jsonb_typeof(payload -> 'method') <> 'string', true) THEN
        RETURN ARRAY['payload.method', 'payload.method must be POST, PUT, PATCH or DELETE'];
    END IF;
    IF payload ? 'path' THEN
        v_problem := outbox.http_path_problem(payload -> 'path', 'payload.path');
        IF v_problem IS NOT NULL THEN RETURN v_problem; END IF;
    END IF;
    IF payload ? 'query' THEN
        v_problem := outbox.http_query_problem(payload -> 'query', 'payload.query');
        IF v_problem IS NOT NULL THEN RETURN v_problem; END IF;
    END IF;
    IF payload ? 'form' AND payload ? 'json' THEN
        RETURN ARRAY['payload.form', 'payload.form and payload.json: give at most one (the body is a form or JSON)'];
    END IF;
    IF payload ? 'form' AND jsonb_typeof(payload -> 'form') <> 'object' THEN
        RETURN ARRAY['payload.form', 'payload.form must be an object'];
    END IF;
    IF payload ? 'headers' THEN
        v_problem := outbox.http_headers_problem(payload -> 'headers', 'payload.headers',
                                                 auth_header, idempotency_header);
        IF v_problem IS NOT NULL THEN RETURN v_problem; END IF;
    END IF;
    IF payload ? 'store_response' AND jsonb_typeof(payload -> 'store_response') <> 'boolean' THEN
        RETURN ARRAY['payload.store_response', 'payload.store_response must be true or false'];
    END IF;
    IF payload ? 'reconcile' THEN
        v_rec := payload -> 'reconcile';
        IF jsonb_typeof(v_rec) <> 'object' THEN
            RETURN ARRAY['payload.reconcile', 'payload.reconcile must be an object (method, path, query, found)'];
        END IF;
        SELECT k INTO v_bad FROM jsonb_object_keys(v_rec) k
        WHERE k NOT IN ('method', 'path', 'query', 'found')
        ORDER BY k LIMIT 1;
        IF v_bad IS NOT NULL THEN
            RETURN ARRAY['payload.reconcile', format('payload.reconcile.%s is not a member of a lookup (method, path, query, found)',
                                                     left(v_bad, 64))];
        END IF;
        IF v_rec ? 'method' AND v_rec -> 'method' <> '"GET"'::jsonb THEN
            RETURN ARRAY['payload.reconcile.method', 'payload.reconcile.method must be GET (a lookup changes nothing)'];
        END IF;
        IF v_rec ? 'path' THEN
            v_problem := outbox.http_path_problem(v_rec -> 'path', 'payload.reconcile.path');
            IF v_problem IS NOT NULL THEN RETURN v_problem; END IF;
        END IF;
        IF v_rec ? 'query' THEN
            v_problem := outbox.http_query_problem(v_rec -> 'query', 'payload.reconcile.query');
            IF v_problem IS NOT NULL THEN RETURN v_problem; END IF;
        END IF;
        IF v_rec ? 'found' AND coalesce(jsonb_typeof(v_rec -> 'found') <> 'string'
                                        OR (v_rec ->> 'found') !~ '^(/([^~]|~[01])*)*$', true) THEN
            RETURN ARRAY['payload.reconcile.found', 'payload.reconcile.found must be a JSON pointer: empty, or starting with / (~ only as ~0 or ~1)'];
        END IF;
    END IF;
    RETURN NULL;
END
$$;

-- The provider's memory: when the key window of an http message closes, the start of its
-- first attempt (since its last replay) plus its endpoint's key_ttl. NULL for another
-- channel, before a first attempt (attempts = 0, also after a replay), without a key_ttl,
-- or when the endpoint is gone. The one owner of the rule: outbox.lookup, `outboxd show`
-- and outbox.replay read it here.
CREATE FUNCTION outbox.key_expires_at(channel text, payload jsonb, attempts integer, first_attempt_at timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF channel IS DISTINCT FROM 'http' OR coalesce(attempts, 0) < 1 OR first_attempt_at IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN first_attempt_at + (SELECT e.key_ttl FROM outbox.endpoints e
                               WHERE e.name = key_expires_at.payload ->> 'endpoint');
END
$$;

-- The three actions' shared first step: its errors name the actions' parameter, `ids`.
CREATE FUNCTION outbox.lock_named(message_ids bigint[], verb text) RETURNS void
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

-- What is known of one side effect, by its key: no row for an unknown key, and for an http
-- message when its provider's key window closes (outbox.key_expires_at). No payload (an
-- application role may call it, and payloads are not its to read). A key no enqueue could
-- have stored (NULL, empty, over 255 characters, control characters) raises 22023 naming
-- `message_key`, as enqueue would: a tool wrapper that built such a key has a bug to see.
-- SECURITY DEFINER: the caller needs no right on the table.
--   SELECT * FROM outbox.lookup('run-7:step-3:refund');
CREATE FUNCTION outbox.lookup(message_key text) RETURNS TABLE(id bigint, state text, attempts integer, max_attempts integer, error_class text, last_error text, response jsonb, created_at timestamp with time zone, updated_at timestamp with time zone, delivered_at timestamp with time zone, dead_at timestamp with time zone, cancelled_at timestamp with time zone, key_expires_at timestamp with time zone)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
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
           m.created_at, m.updated_at, m.delivered_at, m.dead_at, m.cancelled_at,
           outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at)
    FROM outbox.messages m
    WHERE m.message_key = lookup.message_key;
END
$$;

-- Every insert, from outbox.enqueue or a plain INSERT: the fingerprint and the checks (one
-- expression on the fast path, a named error on the slow one); a row with an ordering key
-- waits for its group's turn and takes its id after it.
CREATE FUNCTION outbox.messages_before_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_text    text := NEW.payload::text;
    v_dest    text;
    v_auth    text;
    v_idem    text;
    v_problem text[];
BEGIN
    -- An http message names an endpoint: where it goes, and the headers it may not set.
    IF NEW.channel = 'http' THEN
        SELECT e.destination, e.auth_header, e.idempotency_header INTO v_dest, v_auth, v_idem
        FROM outbox.endpoint_for_insert(NEW.payload ->> 'endpoint') e;
        v_problem := outbox.http_payload_problem(NEW.payload, v_auth, v_idem);
    END IF;
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
                    WHEN 'http' THEN
                        v_dest IS NOT NULL AND v_problem IS NULL
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
        -- outbox.validate checked the payload's shape; what needs the endpoint is here.
        IF NEW.channel = 'http' AND v_dest IS NULL THEN
            RAISE EXCEPTION 'payload.endpoint must name an endpoint of outbox.endpoints (outboxd endpoint list)'
                USING ERRCODE = '22023', COLUMN = 'payload.endpoint';
        END IF;
        IF NEW.channel = 'http' AND v_problem IS NOT NULL THEN
            RAISE EXCEPTION '%', v_problem[2] USING ERRCODE = '22023', COLUMN = v_problem[1];
        END IF;
    END IF;
    -- outbox.request_hash(channel, payload), from the text rendered above.
    NEW.request_hash := sha256(convert_to(NEW.channel || E'\n' || v_text, 'UTF8'));
    -- Where it goes, named once here: the worker's limits, breakers and pauses go by these
    -- names, and the worker sends only where they say (a URL it reads as another host is
    -- refused as invalid). A lookup is named by its own URL (enqueue made `reconcile.url`
    -- a string).
    IF NEW.channel = 'webhook' THEN
        NEW.destination := outbox.destination_of(NEW.channel, NEW.payload);
        NEW.lookup_destination := CASE WHEN NEW.payload ? 'reconcile'
            THEN outbox.destination_of(NEW.channel, NEW.payload -> 'reconcile') END;
    ELSIF NEW.channel = 'http' THEN
        -- An http message goes to its endpoint's host, its lookup too.
        NEW.destination := v_dest;
        IF NEW.destination IS NULL THEN
            RAISE EXCEPTION 'payload.endpoint must name an endpoint of outbox.endpoints (outboxd endpoint list)'
                USING ERRCODE = '22023', COLUMN = 'payload.endpoint';
        END IF;
        NEW.lookup_destination := CASE WHEN NEW.payload ? 'reconcile' THEN NEW.destination END;
    ELSE
        NEW.destination := NULL;
        NEW.lookup_destination := NULL;
    END IF;
    IF NEW.ordering_key IS NOT NULL THEN
        NEW.id := outbox.ordering_turn(NEW.ordering_key);
    END IF;
    RETURN NEW;
END
$$;

-- What a message is and where it goes are fixed when it is inserted: its key, channel and
-- payload (the fingerprint the key's deduplication compares), the destinations named from
-- them and its attempt budget's floor. The door is the insert trigger; an UPDATE naming one
-- of these columns (a person's hand-written one: the daemon's statements name none) is
-- refused unless it leaves the value as it was, with one exception: an http message's
-- destinations may become its endpoint's current one (outbox.set_endpoint moves the
-- unfinished messages of an endpoint whose host changed). To send something else, enqueue
-- it under a new key. `max_attempts` may be raised or lowered to at
-- least 1. SQLSTATE 23514, as the CHECK constraints these replace raised.
CREATE FUNCTION outbox.messages_before_update_fixed() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_column text;
BEGIN
    v_column := CASE
        WHEN NEW.message_key IS DISTINCT FROM OLD.message_key THEN 'message_key'
        WHEN NEW.channel IS DISTINCT FROM OLD.channel THEN 'channel'
        WHEN NEW.payload IS DISTINCT FROM OLD.payload THEN 'payload'
        WHEN NEW.request_hash IS DISTINCT FROM OLD.request_hash THEN 'request_hash'
        WHEN NEW.ordering_key IS DISTINCT FROM OLD.ordering_key THEN 'ordering_key'
        -- An http message follows its endpoint (outbox.set_endpoint moves the unfinished
        -- ones when the endpoint's host changes): its destinations may become the
        -- endpoint's current one, and nothing else.
        WHEN NEW.destination IS DISTINCT FROM OLD.destination
             AND NOT (NEW.channel = 'http' AND NEW.destination IS NOT NULL
                      AND NEW.destination = outbox.endpoint_destination(NEW.payload ->> 'endpoint'))
            THEN 'destination'
        WHEN NEW.lookup_destination IS DISTINCT FROM OLD.lookup_destination
             AND NOT (NEW.channel = 'http' AND OLD.lookup_destination IS NOT NULL
                      AND NEW.lookup_destination IS NOT NULL
                      AND NEW.lookup_destination = outbox.endpoint_destination(NEW.payload ->> 'endpoint'))
            THEN 'lookup_destination'
    END;
    IF v_column IS NOT NULL THEN
        RAISE EXCEPTION 'outbox.messages.% is fixed when a message is enqueued; enqueue under a new key to send something else', v_column
            USING ERRCODE = '23514', COLUMN = v_column;
    END IF;
    IF NEW.max_attempts < 1 THEN
        RAISE EXCEPTION 'max_attempts must be at least 1 (got %)', NEW.max_attempts
            USING ERRCODE = '23514', COLUMN = 'max_attempts';
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION outbox.messages_delete_history() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    -- One statement per DELETE statement, through attempts_message_idx.
    DELETE FROM outbox.attempts a USING gone g WHERE a.message_id = g.id;
    RETURN NULL;
END
$$;

-- Wake idle workers when the inserting transaction commits. Statement level, with a fixed
-- payload: PostgreSQL folds identical notifications of one transaction into one, so a
-- transaction that enqueues a thousand rows sends a single wake-up.
CREATE FUNCTION outbox.messages_notify() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF outbox.wake_needed() THEN
        PERFORM pg_notify('outbox_messages', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION outbox.messages_truncate_history() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    -- DELETE, not TRUNCATE: `TRUNCATE outbox.attempts, outbox.messages` fires this with
    -- outbox.attempts already truncated by the same statement, which a nested TRUNCATE
    -- refuses ("being used by active queries").
    DELETE FROM outbox.attempts;
    RETURN NULL;
END
$$;

-- The named rows that are not in one of `allowed`, as '17 (''k'', running), 18 (…)', or
-- NULL when every row is. (Read after outbox.lock_named, so the states are those locked.)
CREATE FUNCTION outbox.not_in_states(message_ids bigint[], allowed text[]) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    RETURN (SELECT string_agg(format('%s (%s, %s%s)', m.id, quote_literal(m.message_key), m.state,
                                     CASE WHEN m.state = 'dead' THEN ' ' || m.error_class ELSE '' END),
                              ', ' ORDER BY m.id)
            FROM outbox.messages m
            WHERE m.id = ANY(message_ids) AND m.state <> ALL(allowed));
END
$$;

-- Wait for the group's turn (the advisory lock, held until this transaction ends), then
-- draw a message id. SECURITY DEFINER: the insert trigger runs with the inserting role's
-- rights, which need not include the id sequence (an identity column's own default does not
-- check them). Open to PUBLIC as outbox.enqueue is: it only draws an id and takes a lock
-- that lasts as long as the caller's transaction.
CREATE FUNCTION outbox.ordering_turn(ordering_key text) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1869767781, hashtext(ordering_key));
    RETURN nextval(pg_get_serial_sequence('outbox.messages', 'id')::regclass);
END
$$;

-- Pause a destination by hand: none of its messages is sent until
-- outbox.resume_destination, whatever its circuit says (the circuit is kept apart and is as
-- it was on resume). Its due pending messages are parked: due at its `parked_until`, a
-- hundred years ahead, no attempt counted, no history row. Workers park the ones that come
-- due later, or that they claimed before they saw the pause, when they next claim them;
-- requests already under way finish. `host` as `outboxd destinations` lists it
-- (outbox.destination_name); one never seen gets its row, so a host may be paused before
-- its first message. The reason follows outbox.reason_problem. Pausing a paused
-- destination changes nothing (`paused` false): the first pause's who, when and why stay.
-- Recorded in outbox.destination_actions with the actor (the caller's role by default).
--   SELECT * FROM outbox.pause_destination('api.example.com', 'provider incident');
CREATE FUNCTION outbox.pause_destination(host text, reason text DEFAULT NULL::text, actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(destination text, paused boolean, held_back bigint)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_host    text := outbox.destination_name(pause_destination.host);
    v_problem text := outbox.reason_problem(reason);
    v_actor   text := coalesce(actor, session_user::text);
    v_parked  timestamptz := now() + interval '100 years';
    v_since   timestamptz;
    v_moved   bigint;
BEGIN
    IF v_host IS NULL THEN
        RAISE EXCEPTION 'host must be a destination as outboxd destinations lists it: host or host:port (ASCII letters, digits, ".", "_", "-", or an IPv6 address in brackets); nothing paused'
            USING ERRCODE = '22023', COLUMN = 'host';
    END IF;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '%; nothing paused', v_problem USING ERRCODE = '22023', COLUMN = 'reason';
    END IF;
    INSERT INTO outbox.destinations AS d (host, state) VALUES (v_host, 'closed')
        ON CONFLICT ON CONSTRAINT destinations_pkey DO NOTHING;
    SELECT d.paused_at INTO v_since FROM outbox.destinations d WHERE d.host = v_host FOR UPDATE;
    IF v_since IS NOT NULL THEN
        RETURN QUERY SELECT v_host, false, 0::bigint;
        RETURN;
    END IF;
    UPDATE outbox.destinations d SET
        paused_at = now(), paused_by = v_actor, pause_reason = reason,
        parked_until = v_parked, updated_at = now()
    WHERE d.host = v_host;
    WITH moved AS (
        UPDATE outbox.messages m SET run_after = v_parked, updated_at = now()
        WHERE m.destination = v_host AND m.state = 'pending' AND m.run_after <= now()
        RETURNING 1
    )
    SELECT count(*) INTO v_moved FROM moved;
    INSERT INTO outbox.destination_actions (host, action, actor, reason, messages)
    VALUES (v_host, 'paused', v_actor, reason, v_moved);
    RETURN QUERY SELECT v_host, true, v_moved;
END
$$;

-- Deletes finished messages older than `older_than`, in batches: delivered ones by
-- `delivered_at`, cancelled ones by `cancelled_at` (finished like a delivered one: it will
-- never be sent, and its row is only the key's dedup record), and with `include_dead` dead
-- ones by `dead_at`. Their history goes with them.
CREATE FUNCTION outbox.purge(older_than interval, include_dead boolean DEFAULT false, batch_size integer DEFAULT 1000) RETURNS bigint
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

-- An operator's reason (outbox.cancel, outbox.pause_destination), kept for the history:
-- NULL (none given) or one line of at most 500 characters, no control characters (the class
-- refused in message keys, which covers line breaks and tabs), not blank (leave it NULL
-- instead). Refused, not escaped, so that what is stored is what the operator typed.
-- Returns the problem as one line, or NULL when the reason is fine.
CREATE FUNCTION outbox.reason_problem(reason text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_bad text;
BEGIN
    IF reason IS NULL THEN
        RETURN NULL;
    END IF;
    IF btrim(reason) = '' THEN
        RETURN 'reason must not be empty (leave it out instead)';
    END IF;
    IF char_length(reason) > 500 THEN
        RETURN format('reason must be at most 500 characters (got %s)', char_length(reason));
    END IF;
    v_bad := substring(reason FROM E'[\\u0001-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]');
    IF v_bad IS NOT NULL THEN
        RETURN format('reason must be one line without control characters (U+%s at character %s)',
                      lpad(upper(to_hex(ascii(v_bad))), 4, '0'), strpos(reason, v_bad));
    END IF;
    RETURN NULL;
END
$$;

-- Removes endpoint `name`. Refused (55000, with how many) while a pending, running or held
-- message names it: those are still to be sent. Dead and finished ones may name it; a dead
-- one's replay is then refused until the endpoint is set again. Unknown name: P0002.
-- The messages' table is locked in SHARE mode for the check (as outbox.set_endpoint does
-- when it moves messages), so an enqueue naming the endpoint that is not yet committed is
-- waited for and counted, and a later one finds no endpoint (22023).
--   SELECT outbox.remove_endpoint('stripe');
CREATE FUNCTION outbox.remove_endpoint(name text) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_pending bigint;
    v_running bigint;
    v_held    bigint;
BEGIN
    PERFORM 1 FROM outbox.endpoints e WHERE e.name = remove_endpoint.name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no endpoint %; nothing removed', coalesce(quote_literal(left(remove_endpoint.name, 64)), 'NULL')
            USING ERRCODE = 'P0002';
    END IF;
    LOCK TABLE outbox.messages IN SHARE MODE;
    SELECT count(*) FILTER (WHERE m.state = 'pending'), count(*) FILTER (WHERE m.state = 'running'),
           count(*) FILTER (WHERE m.state = 'held')
    INTO v_pending, v_running, v_held
    FROM outbox.messages m
    WHERE m.channel = 'http' AND m.state IN ('pending', 'running', 'held')
      AND m.payload ->> 'endpoint' = remove_endpoint.name;
    IF v_pending + v_running + v_held > 0 THEN
        RAISE EXCEPTION 'endpoint % is named by % unfinished message(s) (% pending, % running, % held); let them finish or cancel them first; nothing removed',
            quote_literal(remove_endpoint.name), v_pending + v_running + v_held, v_pending, v_running, v_held
            USING ERRCODE = '55000';
    END IF;
    DELETE FROM outbox.endpoints e WHERE e.name = remove_endpoint.name;
END
$$;

-- Replay dead messages: dead → pending, attempts reset to 0, due now, the same key (so
-- providers still deduplicate), and a `replayed` row in each history carrying the error
-- that killed it. All or nothing: an unknown id raises P0002 (no_data_found), a message
-- that is not dead raises 55000 (object_not_in_prerequisite_state), both naming the
-- messages, and then nothing is replayed. Wakes idle workers at commit.
--
-- An http message is refused (55000) when its endpoint is gone (nothing could send it),
-- and, unless `force`, when it may have taken effect (class ambiguous) and its provider's
-- key window has closed (outbox.key_expires_at): the provider may have forgotten the key,
-- so a resend could do the side effect twice. `force` is a person's decision to send it
-- once more; its history row says so. The window then counts again from the next attempt.
--
--   SELECT * FROM outbox.replay(ARRAY[17, 18]);
--   SELECT * FROM outbox.replay(ARRAY[17], force => true);
--   SELECT * FROM outbox.replay(ARRAY(SELECT id FROM outbox.messages
--                                     WHERE state = 'dead' AND error_class = 'exhausted'));
CREATE FUNCTION outbox.replay(message_ids bigint[], actor text DEFAULT (CURRENT_USER)::text, force boolean DEFAULT false) RETURNS TABLE(id bigint, message_key text)
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_missing  text;
    v_not_dead text;
    v_gone     text;
    v_lapsed   text;
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

    SELECT string_agg(format('%s (%s, endpoint %s)', m.id, quote_literal(m.message_key),
                             quote_literal(m.payload ->> 'endpoint')), ', ' ORDER BY m.id)
    INTO v_gone
    FROM outbox.messages m
    WHERE m.id = ANY(message_ids) AND m.channel = 'http'
      AND NOT EXISTS (SELECT 1 FROM outbox.endpoints e WHERE e.name = m.payload ->> 'endpoint');
    IF v_gone IS NOT NULL THEN
        RAISE EXCEPTION 'endpoint gone, so not replayed: %; set it again (outboxd endpoint set) or cancel the message; nothing replayed', v_gone
            USING ERRCODE = '55000';
    END IF;

    IF NOT coalesce(force, false) THEN
        SELECT string_agg(format('%s (%s, endpoint %s: key window closed at %s)', m.id,
                                 quote_literal(m.message_key), quote_literal(m.payload ->> 'endpoint'),
                                 outbox.utc_text(outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at))),
                          ', ' ORDER BY m.id)
        INTO v_lapsed
        FROM outbox.messages m
        WHERE m.id = ANY(message_ids) AND m.error_class = 'ambiguous'
          AND outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at) <= now();
        IF v_lapsed IS NOT NULL THEN
            RAISE EXCEPTION 'may have taken effect and the provider may have forgotten its key, so not replayed: %; ask the provider, then confirm it if it took effect, or replay it with force (outboxd replay --force) to send it once more; nothing replayed', v_lapsed
                USING ERRCODE = '55000';
        END IF;
    END IF;

    -- The history's row records the action, not a failure: no class, and no error but for
    -- a replay forced past a closed key window, which says so. The failure it answers is
    -- on the attempt row before it.
    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error)
    SELECT m.id, m.attempts, coalesce(actor, current_user::text), now(), now(), 'replayed',
           CASE WHEN coalesce(force, false) AND m.error_class = 'ambiguous'
                     AND outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at) <= now()
                THEN format('forced: replayed after the key window closed at %s',
                            outbox.utc_text(outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at)))
           END
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

-- The two SQL-language functions become PL/pgSQL. A SQL function with a SET clause is never
-- inlined, and PostgreSQL (before 18) parses and plans a non-inlined SQL function's body
-- afresh in every statement that calls it (a single-row `SELECT outbox.enqueue(…)` would pay
-- that in every transaction); PL/pgSQL keeps the compiled body and its plans for the
-- session. Same signatures, defaults, results and volatility.
CREATE FUNCTION outbox.request_hash(channel text, payload jsonb) RETURNS bytea
    LANGUAGE plpgsql STABLE PARALLEL SAFE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    RETURN sha256(convert_to(channel || E'\n' || payload::text, 'UTF8'));
END
$$;

-- Resume a paused destination: the messages its pause parked are due at once (idle workers
-- are woken at commit), and its circuit is as it was. Found by their parked time
-- (messages_due_idx), so one whose destination moved meanwhile (outbox.set_endpoint) comes
-- back too. P0002 when no destination of that name is known; one that is not paused is left
-- as it is (`resumed` false). Recorded in outbox.destination_actions with the actor.
--   SELECT * FROM outbox.resume_destination('api.example.com');
CREATE FUNCTION outbox.resume_destination(host text, actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(destination text, resumed boolean, due_again bigint)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_host   text := outbox.destination_name(resume_destination.host);
    v_parked timestamptz;
    v_moved  bigint;
BEGIN
    IF v_host IS NULL THEN
        RAISE EXCEPTION 'host must be a destination as outboxd destinations lists it: host or host:port (ASCII letters, digits, ".", "_", "-", or an IPv6 address in brackets); nothing resumed'
            USING ERRCODE = '22023', COLUMN = 'host';
    END IF;
    SELECT d.parked_until INTO v_parked FROM outbox.destinations d WHERE d.host = v_host FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no destination % is known; nothing resumed', v_host USING ERRCODE = 'P0002';
    END IF;
    IF v_parked IS NULL THEN
        RETURN QUERY SELECT v_host, false, 0::bigint;
        RETURN;
    END IF;
    UPDATE outbox.destinations d SET
        paused_at = NULL, paused_by = NULL, pause_reason = NULL, parked_until = NULL,
        updated_at = now()
    WHERE d.host = v_host;
    WITH moved AS (
        UPDATE outbox.messages m SET run_after = now(), updated_at = now()
        WHERE m.state = 'pending' AND m.run_after = v_parked
        RETURNING 1
    )
    SELECT count(*) INTO v_moved FROM moved;
    INSERT INTO outbox.destination_actions (host, action, actor, messages)
    VALUES (v_host, 'resumed', coalesce(actor, session_user::text), v_moved);
    PERFORM pg_notify('outbox_messages', '');
    RETURN QUERY SELECT v_host, true, v_moved;
END
$$;

-- Creates or replaces endpoint `name` (the defaults are the table's), after checking each
-- value (22023 naming the field):
-- * name: ^[a-z][a-z0-9_-]{0,62}$.
-- * url: https:// or http:// (the worker refuses plain http unless private networks are
--   allowed), a host outbox.destination_of can name, an optional base path (the rules of a
--   payload's path), no user info (credentials go in auth_secret), no query or fragment; at
--   most 2048 characters. Stored without a trailing `/`, so that a payload's path joins it
--   with one.
-- * auth_header, idempotency_header (NULL: the provider takes none): header names outboxd
--   does not set otherwise, not the same one.
-- * auth_secret: the NAME of a secret (letters, digits, _; at most 64), which each worker
--   reads from OUTBOXD_SECRET_<NAME> or OUTBOXD_SECRET_<NAME>_FILE. Never its value: no
--   error repeats what was given, since it may be a value pasted by mistake.
-- * key_ttl: how long the provider remembers an idempotency key, positive (NULL: unknown).
-- * headers: fixed, non-secret headers (an object of string values), none of them the
--   auth or idempotency header or one outboxd sets.
-- When the endpoint's host or port changes (or it is set again after its removal), its
-- unfinished messages (pending, held, running, dead) follow: their destinations become the
-- new one. The messages' table is locked in SHARE mode for that, so an enqueue under way
-- with the old destination is waited for and moved too. Returns the endpoint's destination
-- and how many messages moved.
--   SELECT * FROM outbox.set_endpoint('stripe', 'https://api.stripe.com',
--                                     auth_secret => 'STRIPE', key_ttl => '24 hours',
--                                     headers => '{"Stripe-Version": "2024-06-20"}');
CREATE FUNCTION outbox.set_endpoint(name text, url text, auth_header text DEFAULT 'Authorization'::text, auth_secret text DEFAULT NULL::text, idempotency_header text DEFAULT 'Idempotency-Key'::text, key_ttl interval DEFAULT NULL::interval, headers jsonb DEFAULT '{}'::jsonb) RETURNS TABLE(destination text, moved integer)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $_$
DECLARE
    v_url       text := set_endpoint.url;
    v_authority text;
    v_path      text;
    v_dest      text;
    v_old       text;
    v_existed   boolean;
    v_moved     integer := 0;
    v_problem   text[];
BEGIN
    IF set_endpoint.name IS NULL OR set_endpoint.name !~ '^[a-z][a-z0-9_-]{0,62}$' THEN
        RAISE EXCEPTION 'name must be 1 to 63 characters: a lower-case letter, then lower-case letters, digits, _ or -'
            USING ERRCODE = '22023', COLUMN = 'name';
    END IF;

    IF v_url IS NULL OR char_length(v_url) > 2048 THEN
        RAISE EXCEPTION 'url must be the API''s base URL, at most 2048 characters'
            USING ERRCODE = '22023', COLUMN = 'url';
    END IF;
    IF v_url !~* '^https?://' THEN
        RAISE EXCEPTION 'url must start with https:// (or http://)' USING ERRCODE = '22023', COLUMN = 'url';
    END IF;
    IF v_url ~ E'[\\u0001-\\u0020\\u007f-\\u009f\\u00a0\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069\\\\]' THEN
        RAISE EXCEPTION 'url must not contain spaces, control characters or backslashes'
            USING ERRCODE = '22023', COLUMN = 'url';
    END IF;
    IF v_url ~ '[?#]' THEN
        RAISE EXCEPTION 'url must have no query or fragment (a message''s query goes in its payload)'
            USING ERRCODE = '22023', COLUMN = 'url';
    END IF;
    v_authority := substring(v_url FROM '^[A-Za-z]+://([^/]*)');
    IF strpos(v_authority, '@') > 0 THEN
        RAISE EXCEPTION 'url must have no user info (the credential is named by auth_secret)'
            USING ERRCODE = '22023', COLUMN = 'url';
    END IF;
    v_url := rtrim(v_url, '/');
    v_path := substr(v_url, length(substring(v_url FROM '^[A-Za-z]+://[^/]*')) + 1);
    IF v_path <> '' THEN
        v_problem := outbox.http_path_problem(to_jsonb(v_path), 'url');
        IF v_problem IS NOT NULL THEN
            RAISE EXCEPTION 'url''s base path: %', v_problem[2] USING ERRCODE = '22023', COLUMN = 'url';
        END IF;
    END IF;
    v_dest := outbox.destination_of('webhook', jsonb_build_object('url', v_url));
    IF v_dest IS NULL THEN
        RAISE EXCEPTION 'url must name a host: a DNS name or an IP literal, with an optional port'
            USING ERRCODE = '22023', COLUMN = 'url';
    END IF;

    v_problem := outbox.http_header_name_problem(set_endpoint.auth_header, 'auth_header');
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '%', v_problem[2] USING ERRCODE = '22023', COLUMN = 'auth_header';
    END IF;
    IF set_endpoint.idempotency_header IS NOT NULL THEN
        v_problem := outbox.http_header_name_problem(set_endpoint.idempotency_header,
                                                     'idempotency_header', set_endpoint.auth_header);
        IF v_problem IS NOT NULL THEN
            RAISE EXCEPTION '%', v_problem[2] USING ERRCODE = '22023', COLUMN = 'idempotency_header';
        END IF;
    END IF;
    -- The given text is not repeated: it may be the secret itself, pasted by mistake.
    IF set_endpoint.auth_secret IS NOT NULL AND set_endpoint.auth_secret !~ '^[A-Za-z0-9_]{1,64}$' THEN
        RAISE EXCEPTION 'auth_secret must be the NAME of a secret (1 to 64 letters, digits or _), read by each worker from OUTBOXD_SECRET_<NAME>; never the secret itself'
            USING ERRCODE = '22023', COLUMN = 'auth_secret';
    END IF;
    IF set_endpoint.key_ttl IS NOT NULL AND set_endpoint.key_ttl <= interval '0' THEN
        RAISE EXCEPTION 'key_ttl must be positive (leave it NULL when the provider''s memory is unknown)'
            USING ERRCODE = '22023', COLUMN = 'key_ttl';
    END IF;
    v_problem := outbox.http_headers_problem(coalesce(set_endpoint.headers, '{}'::jsonb), 'headers',
                                             set_endpoint.auth_header, set_endpoint.idempotency_header);
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '%', v_problem[2] USING ERRCODE = '22023', COLUMN = 'headers';
    END IF;

    SELECT outbox.destination_of('webhook', jsonb_build_object('url', e.url)) INTO v_old
    FROM outbox.endpoints e WHERE e.name = set_endpoint.name FOR UPDATE;
    v_existed := FOUND;
    IF NOT v_existed OR v_old IS DISTINCT FROM v_dest THEN
        LOCK TABLE outbox.messages IN SHARE MODE;
    END IF;

    INSERT INTO outbox.endpoints AS e
        (name, url, auth_header, auth_secret, idempotency_header, key_ttl, headers)
    VALUES (set_endpoint.name, v_url, set_endpoint.auth_header, set_endpoint.auth_secret,
            set_endpoint.idempotency_header, set_endpoint.key_ttl,
            coalesce(set_endpoint.headers, '{}'::jsonb))
    ON CONFLICT ON CONSTRAINT endpoints_pkey DO UPDATE SET
        url                = EXCLUDED.url,
        auth_header        = EXCLUDED.auth_header,
        auth_secret        = EXCLUDED.auth_secret,
        idempotency_header = EXCLUDED.idempotency_header,
        key_ttl            = EXCLUDED.key_ttl,
        headers            = EXCLUDED.headers,
        updated_at         = now();

    IF NOT v_existed OR v_old IS DISTINCT FROM v_dest THEN
        UPDATE outbox.messages m SET
            destination        = v_dest,
            lookup_destination = CASE WHEN m.lookup_destination IS NOT NULL THEN v_dest END
        WHERE m.channel = 'http' AND m.state IN ('pending', 'held', 'running', 'dead')
          AND m.payload ->> 'endpoint' = set_endpoint.name
          AND m.destination IS DISTINCT FROM v_dest;
        GET DIAGNOSTICS v_moved = ROW_COUNT;
    END IF;

    destination := v_dest;
    moved := v_moved;
    RETURN NEXT;
END
$_$;

-- A timestamp as RFC 3339 text in UTC, to the second, for error messages.
CREATE FUNCTION outbox.utc_text(t timestamp with time zone) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    RETURN to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"');
END
$$;

-- The rules a message must satisfy at the door: 22023 naming the field, nothing inserted.
CREATE FUNCTION outbox.validate(message_key text, channel text, payload jsonb, max_attempts integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_bad     text;
    v_problem text[];
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
    IF channel IS NULL OR channel NOT IN ('webhook', 'http', 'email') THEN
        RAISE EXCEPTION 'channel must be ''webhook'', ''http'' or ''email'' (got %)', coalesce(quote_literal(channel), 'NULL')
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
    ELSIF channel = 'http' THEN
        -- The shape; the endpoint's own header names are checked by the insert trigger.
        v_problem := outbox.http_payload_problem(payload);
        IF v_problem IS NOT NULL THEN
            RAISE EXCEPTION '%', v_problem[2] USING ERRCODE = '22023', COLUMN = v_problem[1];
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

-- The ordering key's rules, with the named error (22023, COLUMN = 'ordering_key'); NULL
-- passes. The control-character class is the message key's (keep the patterns equal).
CREATE FUNCTION outbox.validate_ordering_key(ordering_key text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
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

-- NOTIFY takes a cluster-wide lock at commit and holds it through the commit's WAL flush
-- (so that notifications keep commit order): notifying transactions cannot share a flush,
-- and with it enqueue throughput fell by a quarter. A worker that is busy claims again as
-- soon as a slot frees and needs no wake-up; only an idle one does. So the workers say when
-- they are idle, and an enqueueing transaction notifies only then.
--
-- Two advisory locks in the class 1869968482 ("outb"):
--
-- * (1869968482, 2), the idle mark: every idle worker holds it in share mode on its LISTEN
--   connection (it goes away with the connection if the worker dies).
-- * (1869968482, 1), the gate: every enqueueing transaction that decides not to notify
--   holds it in share mode until it ends.
--
-- An enqueueing statement first takes the gate (if a worker is waiting for it, it notifies
-- and is done), then probes the idle mark by taking it exclusively for an instant: if that
-- works, no worker is idle and it does not notify. A worker becoming idle takes the idle
-- mark, then waits until it holds the gate exclusively (every transaction that decided not
-- to notify has then ended, and its rows are visible), and only then claims once more
-- before it sleeps. Any transaction that probes after the worker took the mark notifies; any
-- transaction that probed before is seen by that last claim. No wake-up is lost, and a
-- transaction in doubt (a lock it could not take) notifies.
--
-- Other listeners of outbox_messages must hold the idle mark as a worker does:
--   SELECT pg_advisory_lock_shared(1869968482, 2); LISTEN outbox_messages;
CREATE FUNCTION outbox.wake_needed() RETURNS boolean
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(1869968482, 1) THEN
        RETURN true;
    END IF;
    IF pg_catalog.pg_try_advisory_lock(1869968482, 2) THEN
        PERFORM pg_catalog.pg_advisory_unlock(1869968482, 2);
        RETURN false;
    END IF;
    RETURN true;
END
$$;

-- Waiting for an outcome (the clients' `wait`): a session that waits for a message to
-- settle LISTENs on outbox_settled, and a transaction that changes a message's state
-- notifies there at commit, once per transaction, only while somebody waits. It is the
-- wake-up of outbox_messages (outbox.wake_needed) for the other side of the table, with
-- two locks of its own in the class 1869968482, so that the daemon's claims and
-- completions pay one call per statement and no NOTIFY while nobody waits:
--
-- * (1869968482, 3), the waiter mark: every waiting session holds it in share mode.
-- * (1869968482, 4), the settle gate: every state-changing transaction that decides not
--   to notify holds it in share mode until it ends.
--
-- A waiter LISTENs, takes the mark, then waits until it holds the gate exclusively (every
-- transaction that decided not to notify has ended and is visible), and only then looks
-- the key up; after that it looks again on each notification. A transaction that probes
-- after the mark was taken, or that meets a waiter at the gate, notifies.
--   LISTEN outbox_settled;
--   SELECT pg_advisory_lock_shared(1869968482, 3);
--   BEGIN; SELECT pg_advisory_xact_lock(1869968482, 4); COMMIT;
--   SELECT state FROM outbox.lookup('run-7:step-4:refund');  -- again on each notification
-- No privilege is needed to wait beyond outbox.lookup's: advisory locks and LISTEN are
-- open to every role, and this runs with the rights of whoever changes the row.
CREATE FUNCTION outbox.wake_waiters() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(1869968482, 4) THEN
        PERFORM pg_catalog.pg_notify('outbox_settled', '');
    ELSIF pg_catalog.pg_try_advisory_lock(1869968482, 3) THEN
        PERFORM pg_catalog.pg_advisory_unlock(1869968482, 3);
    ELSE
        PERFORM pg_catalog.pg_notify('outbox_settled', '');
    END IF;
    RETURN NULL;
END
$$;

-- ======================================================================================
-- Triggers: the fingerprint and checks of a plain INSERT, the wake-up, the history's upkeep
-- ======================================================================================

CREATE TRIGGER messages_before_insert BEFORE INSERT ON outbox.messages FOR EACH ROW EXECUTE FUNCTION outbox.messages_before_insert();

CREATE TRIGGER messages_before_update_fixed BEFORE UPDATE OF message_key, channel, payload, request_hash, ordering_key, destination, lookup_destination, max_attempts ON outbox.messages FOR EACH ROW EXECUTE FUNCTION outbox.messages_before_update_fixed();

CREATE TRIGGER messages_delete_history AFTER DELETE ON outbox.messages REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION outbox.messages_delete_history();

CREATE TRIGGER messages_notify AFTER INSERT ON outbox.messages FOR EACH STATEMENT EXECUTE FUNCTION outbox.messages_notify();

CREATE TRIGGER messages_truncate_history AFTER TRUNCATE ON outbox.messages FOR EACH STATEMENT EXECUTE FUNCTION outbox.messages_truncate_history();

-- Every change of state (claims, completions, the operators' actions) may end a wait.
CREATE TRIGGER messages_wake_waiters AFTER UPDATE OF state ON outbox.messages FOR EACH STATEMENT EXECUTE FUNCTION outbox.wake_waiters();

-- ======================================================================================
-- Privileges: the SECURITY DEFINER functions run only for the roles sql/grants.sql names
-- ======================================================================================

REVOKE ALL ON FUNCTION outbox.approve(ids bigint[], actor text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.cancel(ids bigint[], reason text, actor text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.confirm(ids bigint[], actor text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.enqueue_many(message_keys text[], channels text[], payloads jsonb[], run_afters timestamp with time zone[], max_attempts integer[], retry_ambiguous boolean[], held boolean[], ordering_key text[]) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.enqueue_row(message_key text, channel text, payload jsonb, run_after timestamp with time zone, max_attempts integer, retry_ambiguous boolean, held boolean, ordering_key text, OUT id bigint, OUT created boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.lock_named(message_ids bigint[], verb text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.lookup(message_key text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.not_in_states(message_ids bigint[], allowed text[]) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.pause_destination(host text, reason text, actor text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.remove_endpoint(name text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.resume_destination(host text, actor text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.set_endpoint(name text, url text, auth_header text, auth_secret text, idempotency_header text, key_ttl interval, headers jsonb) FROM PUBLIC;

-- Channels paused by a person (outbox.pause_channel): one row per paused channel, gone
-- on resume. Workers leave a paused channel out of their claims, so its messages stay due,
-- unsent and uncounted, until it is resumed.
CREATE TABLE outbox.paused_channels (
    channel text NOT NULL,
    paused_at timestamp with time zone DEFAULT now() NOT NULL,
    paused_by text NOT NULL,
    pause_reason text,
    CONSTRAINT paused_channels_channel_check CHECK ((channel = ANY (ARRAY['webhook'::text, 'http'::text, 'email'::text]))),
    CONSTRAINT paused_channels_pkey PRIMARY KEY (channel)
);

-- What operators did to channels (pause, resume): who, when, why. The paused channel's own
-- row keeps only its present state.
CREATE TABLE outbox.channel_actions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    channel text NOT NULL,
    action text NOT NULL,
    actor text NOT NULL,
    reason text,
    at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT channel_actions_action_check CHECK ((action = ANY (ARRAY['paused'::text, 'resumed'::text])))
);

-- The channel an operator names, or NULL when it is none of outboxd's channels.
CREATE FUNCTION outbox.channel_name(channel text) RETURNS text
    LANGUAGE sql IMMUTABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
    SELECT channel_name.channel WHERE channel_name.channel = ANY (ARRAY['webhook', 'http', 'email'])
$$;

-- Pause a whole channel by hand (a provider's incident: the SMTP relay is down): workers
-- claim none of its messages until outbox.resume_channel, so nothing is sent, no attempt
-- is counted and no history row is written; its messages stay due. Workers learn of it
-- within a poll interval; attempts already under way finish. 22023 naming `channel` for a
-- channel that is not `webhook`, `http` or `email`; the reason follows
-- outbox.reason_problem. Pausing a paused channel changes nothing (`paused` false): the
-- first pause's who, when and why stay. Recorded in outbox.channel_actions with the actor
-- (the caller's role by default).
--   SELECT * FROM outbox.pause_channel('email', 'SMTP relay down');
CREATE FUNCTION outbox.pause_channel(channel text, reason text DEFAULT NULL::text, actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(name text, paused boolean)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_channel text := outbox.channel_name(pause_channel.channel);
    v_problem text := outbox.reason_problem(reason);
    v_actor   text := coalesce(actor, session_user::text);
    v_added   int;
BEGIN
    IF v_channel IS NULL THEN
        RAISE EXCEPTION 'channel must be ''webhook'', ''http'' or ''email''; nothing paused'
            USING ERRCODE = '22023', COLUMN = 'channel';
    END IF;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '%; nothing paused', v_problem USING ERRCODE = '22023', COLUMN = 'reason';
    END IF;
    INSERT INTO outbox.paused_channels AS p (channel, paused_by, pause_reason)
    VALUES (v_channel, v_actor, reason)
    ON CONFLICT ON CONSTRAINT paused_channels_pkey DO NOTHING;
    GET DIAGNOSTICS v_added = ROW_COUNT;
    IF v_added = 0 THEN
        RETURN QUERY SELECT v_channel, false;
        RETURN;
    END IF;
    INSERT INTO outbox.channel_actions (channel, action, actor, reason)
    VALUES (v_channel, 'paused', v_actor, reason);
    RETURN QUERY SELECT v_channel, true;
END
$$;

-- Resume a paused channel: its messages are claimed again at once (idle workers are woken
-- at commit, and read the paused channels again). 22023 naming `channel` for an unknown channel; one that is not paused is
-- left as it is (`resumed` false). Recorded in outbox.channel_actions with the actor.
--   SELECT * FROM outbox.resume_channel('email');
CREATE FUNCTION outbox.resume_channel(channel text, actor text DEFAULT (CURRENT_USER)::text) RETURNS TABLE(name text, resumed boolean)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    v_channel text := outbox.channel_name(resume_channel.channel);
    v_removed int;
BEGIN
    IF v_channel IS NULL THEN
        RAISE EXCEPTION 'channel must be ''webhook'', ''http'' or ''email''; nothing resumed'
            USING ERRCODE = '22023', COLUMN = 'channel';
    END IF;
    DELETE FROM outbox.paused_channels p WHERE p.channel = v_channel;
    GET DIAGNOSTICS v_removed = ROW_COUNT;
    IF v_removed = 0 THEN
        RETURN QUERY SELECT v_channel, false;
        RETURN;
    END IF;
    INSERT INTO outbox.channel_actions (channel, action, actor)
    VALUES (v_channel, 'resumed', coalesce(actor, session_user::text));
    -- The payload tells the workers to read the paused channels again before they claim.
    PERFORM pg_notify('outbox_messages', 'channel resumed');
    RETURN QUERY SELECT v_channel, true;
END
$$;

REVOKE ALL ON FUNCTION outbox.pause_channel(channel text, reason text, actor text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox.resume_channel(channel text, actor text) FROM PUBLIC;

RESET check_function_bodies;
