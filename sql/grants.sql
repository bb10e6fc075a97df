-- Least privilege for outboxd: two group roles, to be granted to your login roles.
-- Not a migration (role names are a site's choice): run it once with psql as the owner of
-- the outbox schema, after `outboxd migrate`, then e.g.
--
--   GRANT outbox_app TO shop_backend;      -- the application that enqueues
--   GRANT outbox_worker TO outboxd_daemon;  -- the daemon and the operator CLI
--
-- The migrations themselves need the schema owner (CREATE on the database).

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_app') THEN
        CREATE ROLE outbox_app NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_worker') THEN
        CREATE ROLE outbox_worker NOLOGIN;
    END IF;
END
$$;

-- The application: enqueue (held rows and ordering keys too), look up its keys' outcomes, nothing else.
-- outbox.enqueue_row and outbox.lookup run with their owner's rights, so the role needs no
-- privilege on the tables to enqueue through the functions or to ask what became of a key;
-- it cannot read payloads (its own or anyone's), nor change a message's state or history.
-- INSERT allows the plain `INSERT INTO outbox.messages (message_key, channel, payload)` path
-- (without RETURNING, which would need SELECT); its `state` column may only be `pending` or
-- `held` (the insert trigger refuses any other state, whoever inserts).
-- Waiting for a key's outcome (LISTEN outbox_settled and the advisory locks described at
-- outbox.wake_waiters) needs no grant beyond outbox.lookup.
GRANT USAGE ON SCHEMA outbox TO outbox_app;
GRANT EXECUTE ON FUNCTION
    outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean, boolean, text),
    outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean, text),
    outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[], text[]),
    outbox.lookup(text)
    TO outbox_app;
GRANT INSERT (message_key, channel, payload, run_after, max_attempts, retry_ambiguous, state,
              ordering_key)
    ON outbox.messages TO outbox_app;

-- The worker (and the operator CLI: status, dead, held, show, replay, approve, cancel,
-- confirm, purge, endpoint): claim, complete, release, replay, approve, cancel, confirm and purge
-- messages, and write their history. Only this role decides for a person (approve, cancel,
-- confirm). No DDL.
GRANT USAGE ON SCHEMA outbox TO outbox_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.messages TO outbox_worker;
GRANT SELECT, INSERT ON outbox.attempts TO outbox_worker;
GRANT SELECT ON outbox.schema_migrations TO outbox_worker;
-- Endpoints (`http` messages): every worker reads them; the operator CLI sets and removes
-- them through outbox.set_endpoint and outbox.remove_endpoint (their rules, and the move of
-- an endpoint's messages when its host changes, run with their owner's rights).
GRANT SELECT ON outbox.endpoints TO outbox_worker;
GRANT EXECUTE ON FUNCTION
    outbox.set_endpoint(text, text, text, text, text, interval, jsonb),
    outbox.remove_endpoint(text)
    TO outbox_worker;
-- Circuit breakers (sql/0014): every worker counts failures, opens, probes and closes.
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.destinations TO outbox_worker;
GRANT EXECUTE ON FUNCTION
    outbox.enqueue(text, text, jsonb, timestamptz, integer, boolean, boolean, text),
    outbox.enqueue_row(text, text, jsonb, timestamptz, integer, boolean, boolean, text),
    outbox.enqueue_many(text[], text[], jsonb[], timestamptz[], integer[], boolean[], boolean[], text[]),
    outbox.lookup(text),
    outbox.replay(bigint[], text, boolean),
    outbox.approve(bigint[], text),
    outbox.cancel(bigint[], text, text),
    outbox.confirm(bigint[], text),
    outbox.purge(interval, boolean, integer)
    TO outbox_worker;
-- The two steps approve, cancel and confirm share (sql/0009). They run with the caller's
-- rights (the lock needs UPDATE on the table, which only this role has), so the role that
-- calls the actions must be able to call them too.
GRANT EXECUTE ON FUNCTION
    outbox.lock_named(bigint[], text),
    outbox.not_in_states(bigint[], text[])
    TO outbox_worker;
-- Pausing a destination: the operator CLI and the console pause and resume through these
-- (they push and bring back the destination's messages with their owner's rights), and
-- read what operators did to destinations; closing a circuit by hand records it there.
GRANT EXECUTE ON FUNCTION
    outbox.pause_destination(text, text, text),
    outbox.resume_destination(text, text)
    TO outbox_worker;
GRANT SELECT, INSERT ON outbox.destination_actions TO outbox_worker;
-- The backlog samples: every worker records one row a minute and deletes those older than
-- a day; the console reads them.
GRANT SELECT, INSERT, DELETE ON outbox.backlog_samples TO outbox_worker;
-- Pausing a channel: the operator CLI and the console pause and resume through these, and
-- read the paused channels and what operators did to channels; every worker reads the
-- paused channels.
GRANT EXECUTE ON FUNCTION
    outbox.pause_channel(text, text, text),
    outbox.resume_channel(text, text)
    TO outbox_worker;
GRANT SELECT ON outbox.paused_channels TO outbox_worker;
GRANT SELECT ON outbox.channel_actions TO outbox_worker;
