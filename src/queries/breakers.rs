//! The circuit breakers (`outbox.destinations`): record, push and restore a backlog, the view,
//! the probe, and the operators' listing and closing.

/// Breakers: record a batch's webhook outcomes per destination. `$1` hosts
/// (each once), `$2` whether a success (or a 4xx: the receiver answered) came in the batch,
/// `$3` the transient or ambiguous failures after the last such success, `$4` the threshold,
/// `$5` the base cooldown and `$6` the longest cooldown (seconds).
///
/// Failures add to `consecutive_failures`, a success resets them first. A closed host that
/// reaches the threshold opens for the base cooldown; a failure while `half_open` (the probe
/// failed) reopens it with the cooldown doubled, at most `$6`; failures while `open` (requests
/// that were in flight when it opened) only add to the count; a batch with only successes
/// closes the host. A host without a row gets one only when it failed. (Two workers inserting
/// the same new host at once: the second's first failures are not counted; the next batch's
/// are.) Returns the hosts whose state changed: `host, was, state, consecutive_failures,
/// cooldown_seconds, open_until, pushed_until` (the `deferred_until` before the change).
pub const BREAKER_RECORD: &str = r#"
WITH i AS (
    SELECT * FROM unnest($1::text[], $2::bool[], $3::int[]) AS i(host, reset, fails)
), changed AS (
    UPDATE outbox.destinations d SET
        state = CASE
            WHEN i.fails = 0 THEN 'closed'
            WHEN d.state IN ('open', 'half_open') AND NOT i.reset THEN 'open'
            WHEN (CASE WHEN i.reset THEN 0 ELSE d.consecutive_failures END) + i.fails >= $4::int
                THEN 'open'
            ELSE 'closed' END,
        consecutive_failures = CASE WHEN i.reset THEN 0 ELSE d.consecutive_failures END + i.fails,
        cooldown_seconds = CASE
            WHEN d.state = 'half_open' AND NOT i.reset AND i.fails > 0
                THEN least(coalesce(d.cooldown_seconds, $5::float8) * 2, $6::float8)
            WHEN d.state = 'open' AND NOT i.reset AND i.fails > 0 THEN d.cooldown_seconds
            ELSE $5::float8 END,
        open_until = CASE
            WHEN i.fails = 0 THEN NULL
            WHEN d.state = 'half_open' AND NOT i.reset THEN now() + make_interval(secs =>
                least(coalesce(d.cooldown_seconds, $5::float8) * 2, $6::float8))
            WHEN d.state = 'open' AND NOT i.reset THEN d.open_until
            WHEN (CASE WHEN i.reset THEN 0 ELSE d.consecutive_failures END) + i.fails >= $4::int
                THEN now() + make_interval(secs => $5::float8)
            END,
        probe_until = NULL,
        deferred_until = CASE WHEN i.fails = 0 THEN NULL ELSE d.deferred_until END,
        updated_at = now()
    FROM i JOIN outbox.destinations o ON o.host = i.host
    WHERE d.host = i.host
    RETURNING d.host, o.state AS was, d.state, d.consecutive_failures, d.cooldown_seconds,
              d.open_until, o.deferred_until AS pushed_until
), added AS (
    INSERT INTO outbox.destinations AS d
        (host, state, consecutive_failures, cooldown_seconds, open_until)
    SELECT i.host, CASE WHEN i.fails >= $4::int THEN 'open' ELSE 'closed' END, i.fails,
           $5::float8,
           CASE WHEN i.fails >= $4::int THEN now() + make_interval(secs => $5::float8) END
    FROM i
    WHERE i.fails > 0 AND NOT EXISTS (SELECT 1 FROM outbox.destinations x WHERE x.host = i.host)
    ON CONFLICT (host) DO NOTHING
    RETURNING d.host, 'closed'::text AS was, d.state, d.consecutive_failures, d.cooldown_seconds,
              d.open_until, NULL::timestamptz AS pushed_until
)
SELECT host, was, state, consecutive_failures, cooldown_seconds,
       greatest(extract(epoch FROM open_until - now()), 0)::float8 AS open_in, pushed_until
FROM (SELECT * FROM changed UNION ALL SELECT * FROM added) c
WHERE (state = 'open' AND was <> 'open') OR (state = 'closed' AND was <> 'closed')
"#;

/// Breakers: push an open host's backlog out of the claim's way, one batch of at most `$3`
/// rows with ids above `$4` (0 for the first batch; then the last id the batch returns, so
/// each row's destination is worked out once however many batches it takes). `$1` the host,
/// `$2` the probe window (seconds): its pending rows due before `open_until + window` move
/// there, except the oldest of the first batch, left due at `open_until` (at the latest) to
/// be the probe. Only rows due now and retries move: a first attempt the application
/// scheduled for later is left where it is (moved, the restore at the close would make it
/// due at once, before its time); it is claimed when due, and deferred then if the host is
/// still open. Retries are the worker's own schedule: the probe may be one brought forward. A row already due within `$5` seconds after `open_until` stays: it is the
/// probe a worker's gate kept before the push ran (`Breakers::gate`, `NEAR`), and moving it
/// left no row due when the cooldown ended. The push time is recorded as `deferred_until`,
/// so closing brings back exactly these rows and no legitimately scheduled retry. No
/// history row, no attempt counted. Returns the rows moved and the last id looked at (NULL
/// when none: done).
pub const BREAKER_PUSH: &str = r#"
WITH d AS (
    UPDATE outbox.destinations SET
        deferred_until = open_until + make_interval(secs => $2::float8)
    WHERE host = $1::text AND state = 'open' AND open_until IS NOT NULL
    RETURNING open_until, deferred_until AS until
), cand AS (
    SELECT m.id FROM outbox.messages m, d
    WHERE m.state = 'pending' AND m.run_after < d.until
      AND (m.attempts > 0 OR m.run_after <= now())
      AND m.id > $4::bigint
      AND m.destination = $1::text
    ORDER BY m.id
    LIMIT $3::bigint
), moved AS (
    UPDATE outbox.messages m SET
        run_after = CASE WHEN $4::bigint = 0 AND m.id = (SELECT min(id) FROM cand)
                         THEN least(m.run_after, d.open_until) ELSE d.until END,
        updated_at = now()
    FROM cand c, d
    WHERE m.id = c.id AND m.state = 'pending'
      AND NOT (m.run_after >= d.open_until
               AND m.run_after <= d.open_until + make_interval(secs => $5::float8))
    RETURNING m.id
)
SELECT (SELECT count(*) FROM moved)::bigint, (SELECT max(id) FROM cand)
"#;

/// Breakers: a closed host's held-back backlog is due again at once: up to `$3` pending
/// rows of host `$1` (webhook and http alike: the destination is the stored column) not yet due and due within `$4` seconds either side of `$2`
/// (the opening's `deferred_until`): the rows the opening pushed there, and those claimed
/// and deferred while it was open (due a few milliseconds either side of it). A retry of
/// that host scheduled for the same span comes early, which is what a closed circuit
/// allows. A first attempt comes back only if the worker moved it (the push and `DEFER`
/// set `updated_at`; the application's insert leaves it at `created_at`, and an approval
/// sets it in the transaction that writes the `approved` history row, at the same
/// `now()`): one the application scheduled keeps its time, inside the span too (without
/// the lower bound, a row due in ten minutes was sent at the close; without the mark, one
/// due a minute after the cooldown).
/// Returns the rows moved.
pub const BREAKER_RESTORE: &str = r#"
WITH moved AS (
    UPDATE outbox.messages m SET run_after = now()
    WHERE m.id = ANY(ARRAY(
        SELECT s.id FROM outbox.messages s
        WHERE s.state = 'pending' AND s.run_after > now()
          AND s.run_after >= $2::timestamptz - make_interval(secs => $4::float8)
          AND s.run_after <= $2::timestamptz + make_interval(secs => $4::float8)
          AND (s.attempts > 0
               OR (s.updated_at > s.created_at
                   AND NOT EXISTS (SELECT 1 FROM outbox.attempts a
                                   WHERE a.message_id = s.id AND a.outcome = 'approved'
                                     AND a.started_at = s.updated_at)))
          AND s.destination = $1::text
        LIMIT $3::bigint))
      AND m.state = 'pending' AND m.run_after > now()
    RETURNING 1
)
SELECT count(*)::bigint FROM moved
"#;

/// Breakers: every worker's view, read at most once per poll interval: hosts not closed or
/// still counting failures, with seconds until `open_until` and `probe_until` (negative when
/// passed, NULL when unset).
pub const BREAKER_VIEW: &str = r#"
SELECT host, state, consecutive_failures,
       extract(epoch FROM open_until - now())::float8 AS open_in,
       extract(epoch FROM probe_until - now())::float8 AS probe_in
FROM outbox.destinations
WHERE state <> 'closed' OR consecutive_failures > 0
LIMIT 10000
"#;

/// Breakers: take host `$1`'s probe: an open host whose cooldown passed, or a half-open one
/// whose prober died (its `probe_until` passed), becomes `half_open` for `$2` seconds. Only
/// one caller gets a row back.
pub const BREAKER_TAKE_PROBE: &str = r#"
UPDATE outbox.destinations SET
    state = 'half_open', probe_until = now() + make_interval(secs => $2::float8),
    updated_at = now()
WHERE host = $1::text
  AND ((state = 'open' AND open_until <= now())
    OR (state = 'half_open' AND probe_until <= now()))
RETURNING host
"#;

/// `outboxd destinations`: hosts paused, open, half-open or failing; paused ones first, then
/// open ones. `host, state, consecutive_failures, open_until, paused_at, paused_by,
/// pause_reason`.
pub const DESTINATIONS_LIST: &str = r#"
SELECT host, state, consecutive_failures, open_until, paused_at, paused_by, pause_reason
FROM outbox.destinations
WHERE state <> 'closed' OR consecutive_failures > 0 OR paused_at IS NOT NULL
ORDER BY paused_at IS NULL, state = 'closed', host
"#;

/// `outboxd destinations --close HOST`: closes host `$1` by hand, recorded in
/// `outbox.destination_actions` as done by `$2`. Returns the push time to bring back
/// (`deferred_until`, possibly NULL); no row when the host is unknown. A pause is left as
/// it is.
pub const DESTINATION_CLOSE: &str = r#"
WITH o AS (SELECT host, deferred_until FROM outbox.destinations WHERE host = $1::text FOR UPDATE),
closed AS (
    UPDATE outbox.destinations d SET
        state = 'closed', consecutive_failures = 0, open_until = NULL, probe_until = NULL,
        deferred_until = NULL, updated_at = now()
    FROM o WHERE d.host = o.host
    RETURNING o.host, o.deferred_until
), recorded AS (
    INSERT INTO outbox.destination_actions (host, action, actor)
    SELECT host, 'closed', $2::text FROM closed
)
SELECT deferred_until FROM closed
"#;

/// `destinations --close HOST` given a host without a port: the destinations of that host
/// on any port (`host:port`, as the breakers name them), by name.
pub const DESTINATIONS_OF_HOST: &str = r#"
SELECT host FROM outbox.destinations
WHERE starts_with(host, $1::text || ':') AND substr(host, length($1::text) + 2) ~ '^[0-9]{1,5}$'
ORDER BY host
"#;

/// Status and metrics: destinations whose circuit is not closed.
pub const OPEN_DESTINATIONS: &str =
    "SELECT count(*)::bigint FROM outbox.destinations WHERE state <> 'closed'";
