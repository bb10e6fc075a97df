-- outboxd schema, version 14: circuit breakers shared through the database (issue 18, part 2).
--
-- One row per destination (`outbox.destination_of`, sql/0013) that has failed: a small table,
-- since a healthy host never gets a row (a success for a host without one writes nothing).
-- Every worker reads the rows that are not closed (or still count failures) at most once per
-- poll interval, so an open circuit is seen by all of them within one interval.
--
-- state: `closed` (sending; consecutive_failures counts towards the threshold), `open` (not
-- sending until open_until), `half_open` (one probe in flight until probe_until).
-- cooldown_seconds: the cooldown of the current opening (doubled after each failed probe,
-- at most the worker's --retry-max). deferred_until: the run_after the opening pushed the
-- host's due backlog to, so that closing brings exactly those rows back.

CREATE TABLE outbox.destinations (
    host                 text PRIMARY KEY CHECK (length(host) BETWEEN 1 AND 1000),
    state                text NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    consecutive_failures int NOT NULL DEFAULT 0,
    open_until           timestamptz,
    cooldown_seconds     float8,
    probe_until          timestamptz,
    deferred_until       timestamptz,
    updated_at           timestamptz NOT NULL DEFAULT now()
);
