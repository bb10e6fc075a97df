-- outboxd schema, version 5: wake-ups only while a worker is idle.
--
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

CREATE OR REPLACE FUNCTION outbox.messages_notify() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF outbox.wake_needed() THEN
        PERFORM pg_notify('outbox_messages', '');
    END IF;
    RETURN NULL;
END
$$;
