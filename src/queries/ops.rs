//! Operator actions: the states an operator was shown, dead letters, held messages, show, the
//! checkpoints, replay, purge, and the console's pages and chart.

/// The console's confirmed actions: the named rows' states and versions ([`STATES_OF`]),
/// locked in id order (the order the checkpoint functions lock them in) until the
/// action's transaction ends.
pub const LOCK_STATES: &str = r#"
SELECT id, state, (extract(epoch FROM updated_at) * 1000000)::bigint
FROM outbox.messages WHERE id = ANY($1::bigint[]) ORDER BY id FOR UPDATE
"#;

/// The console's confirmation page: the named rows' states, as the operator sees them,
/// and their versions (`updated_at` in microseconds: every change of state sets it, so a
/// row that changed and changed back is told apart).
pub const STATES_OF: &str = r#"
SELECT id, state, (extract(epoch FROM updated_at) * 1000000)::bigint
FROM outbox.messages WHERE id = ANY($1::bigint[])
"#;

/// Dead letters, newest first, filtered: `$1` channel or NULL, `$2` error class or NULL,
/// `$3` "dead within the last N seconds" or NULL, `$4` limit.
pub const DEAD_LIST: &str = r#"
SELECT id, message_key, channel, attempts, error_class, last_error, dead_at
FROM outbox.messages
WHERE state = 'dead'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::text IS NULL OR error_class = $2::text)
  AND ($3::float8 IS NULL OR dead_at >= now() - make_interval(secs => $3::float8))
ORDER BY dead_at DESC, id DESC
LIMIT $4
"#;

/// Console: the `(id, message_key)` of the first `$4` dead letters, by id, matching the
/// filters of [`DEAD_LIST`] (`$1`..`$3`): an action on "everything the filter matches"
/// touches at most so many, and after an outage millions may match.
pub const DEAD_IDS_FIRST: &str = r#"
SELECT id, message_key
FROM outbox.messages
WHERE state = 'dead'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::text IS NULL OR error_class = $2::text)
  AND ($3::float8 IS NULL OR dead_at >= now() - make_interval(secs => $3::float8))
ORDER BY id
LIMIT $4
"#;

/// The ids of every dead letter matching the filters of [`DEAD_LIST`] (`$1`..`$3`), for
/// `replay --all-dead`, locked for the transaction that replays them: a row cancelled,
/// confirmed or purged meanwhile is left out, rather than failing the whole replay.
pub const DEAD_IDS: &str = r#"
SELECT id, message_key
FROM outbox.messages
WHERE state = 'dead'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::text IS NULL OR error_class = $2::text)
  AND ($3::float8 IS NULL OR dead_at >= now() - make_interval(secs => $3::float8))
ORDER BY id
FOR UPDATE
"#;

/// Resolves message ids (`$1`) and keys (`$2`) to `id, message_key`.
pub const RESOLVE: &str = r#"
SELECT id, message_key FROM outbox.messages
WHERE id = ANY($1::bigint[]) OR message_key = ANY($2::text[])
"#;

/// One message with every column an operator may want, by id (`$1`), when its provider's
/// key window closes (`outbox.key_expires_at`: http only, NULL otherwise), whether it
/// has closed (by the database's clock), and the paused destination that holds it back (an
/// unfinished message whose destination or lookup's destination a person paused; NULL
/// otherwise), and whether it is a pending message of a channel a person paused.
pub const SHOW_MESSAGE: &str = r#"
SELECT m.id, m.message_key, m.channel, m.state, m.attempts, m.max_attempts,
       m.retry_ambiguous, m.payload, m.run_after, m.lease_owner, m.lease_expires_at,
       m.error_class, m.last_error, m.response, m.created_at, m.updated_at, m.delivered_at,
       m.dead_at, m.cancelled_at, m.ordering_key,
       outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at),
       coalesce(outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at)
                <= now(), false),
       (SELECT d.host FROM outbox.destinations d
        WHERE m.state IN ('pending', 'running', 'held') AND d.paused_at IS NOT NULL
          AND d.host IN (m.destination, m.lookup_destination)
        ORDER BY d.host LIMIT 1) AS paused_destination,
       m.state = 'pending' AND EXISTS (SELECT 1 FROM outbox.paused_channels p
                                       WHERE p.channel = m.channel) AS paused_channel
FROM outbox.messages m WHERE m.id = $1
"#;

/// Held messages, oldest first, filtered: `$1` channel or NULL, `$2` "held within the last
/// N seconds" (by `created_at`) or NULL, `$3` limit. Reads `messages_held_idx`.
pub const HELD_LIST: &str = r#"
SELECT id, message_key, channel, created_at
FROM outbox.messages
WHERE state = 'held'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::float8 IS NULL OR created_at >= now() - make_interval(secs => $2::float8))
ORDER BY created_at, id
LIMIT $3
"#;

/// Approve held messages (`$1` ids, `$2` actor) through `outbox.approve`: all or nothing.
pub const APPROVE: &str = "SELECT id, message_key FROM outbox.approve($1::bigint[], $2::text)";

/// Cancel messages (`$1` ids, `$2` reason or NULL, `$3` actor) through `outbox.cancel`: all
/// or nothing; the function checks the reason.
pub const CANCEL: &str =
    "SELECT id, message_key FROM outbox.cancel($1::bigint[], $2::text, $3::text)";

/// Confirm dead ambiguous messages (`$1` ids, `$2` actor) through `outbox.confirm`: all or
/// nothing.
pub const CONFIRM: &str = "SELECT id, message_key FROM outbox.confirm($1::bigint[], $2::text)";

/// The history of a message (`$1`), oldest first.
pub const SHOW_ATTEMPTS: &str = r#"
SELECT attempt, worker, started_at, finished_at, outcome, error_class, error, status, deduplicated
FROM outbox.attempts WHERE message_id = $1 ORDER BY id
"#;

/// Replay dead messages (`$1` ids, `$2` actor) through `outbox.replay`: all or nothing. An
/// ambiguous http message whose key window closed is refused (the console's replay).
pub const REPLAY: &str = "SELECT id, message_key FROM outbox.replay($1::bigint[], $2::text)";

/// [`REPLAY`] with `$3` force: `true` replays an ambiguous http message whose key window
/// closed too (`outboxd replay --force`, a person's decision; the history row says so).
pub const REPLAY_FORCE: &str =
    "SELECT id, message_key FROM outbox.replay($1::bigint[], $2::text, force => $3::bool)";

/// Delete one batch of finished messages through `outbox.purge`: `$1` age in seconds, `$2`
/// include dead, `$3` batch size. Returns the number deleted.
pub const PURGE_BATCH: &str =
    "SELECT outbox.purge(make_interval(secs => $1::float8), $2::bool, $3::int)";

/// Console: one page of dead letters matching the filters of [`DEAD_LIST`] (`$1`..`$3`),
/// newest first, `$4` rows after skipping `$5`. Same columns as [`DEAD_LIST`].
pub const DEAD_PAGE: &str = r#"
SELECT id, message_key, channel, attempts, error_class, last_error, dead_at
FROM outbox.messages
WHERE state = 'dead'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::text IS NULL OR error_class = $2::text)
  AND ($3::float8 IS NULL OR dead_at >= now() - make_interval(secs => $3::float8))
ORDER BY dead_at DESC, id DESC
LIMIT $4 OFFSET $5
"#;

/// Console: how many dead letters match the filters of [`DEAD_LIST`] (`$1`..`$3`), for the
/// pager and the confirmation step ("this touches N rows").
pub const DEAD_COUNT: &str = r#"
SELECT count(*)::bigint
FROM outbox.messages
WHERE state = 'dead'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::text IS NULL OR error_class = $2::text)
  AND ($3::float8 IS NULL OR dead_at >= now() - make_interval(secs => $3::float8))
"#;

/// Console: one page of held messages matching the filters of [`HELD_LIST`] (`$1`, `$2`),
/// oldest first, `$3` rows after skipping `$4`. Same columns as [`HELD_LIST`].
pub const HELD_PAGE: &str = r#"
SELECT id, message_key, channel, created_at
FROM outbox.messages
WHERE state = 'held'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::float8 IS NULL OR created_at >= now() - make_interval(secs => $2::float8))
ORDER BY created_at, id
LIMIT $3 OFFSET $4
"#;

/// Console: how many held messages match the filters of [`HELD_LIST`] (`$1`, `$2`).
pub const HELD_COUNT: &str = r#"
SELECT count(*)::bigint
FROM outbox.messages
WHERE state = 'held'
  AND ($1::text IS NULL OR channel = $1::text)
  AND ($2::float8 IS NULL OR created_at >= now() - make_interval(secs => $2::float8))
"#;

/// Console charts: the last hour of activity, minute by minute, from one read of the
/// attempt history. Always 60 rows, oldest first: `minute` (unix seconds of the minute's
/// start, the database's clock, UTC), then
///
/// * `delivered`, `failed`: attempts that ended in the minute (by `finished_at`) and
///   delivered, or did not (`retry`, `dead` or `lease_lost`). Operator actions
///   (`replayed`, `approved`, …) and releases are not attempts that failed, so they count
///   in neither.
/// * `attempt_p50`, `attempt_p99`: the duration of those that delivered
///   (`finished_at − started_at`): what the receiver or provider took, the figure
///   `outboxd_delivery_duration_seconds` gives Grafana. `started_at` is the worker's clock
///   and `finished_at` the database's at the completion (a few milliseconds of batching
///   later), so a skew between the two clocks shows here; a negative difference counts as
///   0. Failed attempts are left out: the counts show them, and a timeout's duration is the
///   timeout.
/// * `messages`, `e2e_p50`, `e2e_p99`: the messages delivered in the minute (by
///   `delivered_at`), from enqueue to delivery (`delivered_at − created_at`): what the
///   application waits, retries included, and also any wait it asked for (a later
///   `run_after`) or a person caused (held until approved, dead until replayed).
///
/// Percentiles are `percentile_cont` (interpolated), in seconds, and NULL in a minute with
/// nothing to measure: a gap, not a zero. There is no index on `finished_at`: the read
/// costs a scan of the history, which the daemon's retention keeps to about `--retention`
/// of traffic (a page view, not a scrape), and the last hour of `messages_delivered_idx`.
pub const ACTIVITY_PER_MINUTE: &str = r#"
WITH m AS (
    SELECT date_trunc('minute', now(), 'UTC') - (59 - i) * interval '1 minute' AS minute
    FROM generate_series(0, 59) i
), a AS (
    SELECT date_trunc('minute', finished_at, 'UTC') AS minute,
           count(*) FILTER (WHERE outcome = 'delivered')::bigint AS delivered,
           count(*) FILTER (WHERE outcome IN ('retry', 'dead', 'lease_lost'))::bigint AS failed,
           percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
               ORDER BY greatest(extract(epoch FROM finished_at - started_at)::float8, 0))
               FILTER (WHERE outcome = 'delivered') AS p
    FROM outbox.attempts
    WHERE finished_at >= date_trunc('minute', now(), 'UTC') - interval '59 minutes'
    GROUP BY 1
), e AS (
    SELECT date_trunc('minute', delivered_at, 'UTC') AS minute, count(*)::bigint AS n,
           percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
               ORDER BY greatest(extract(epoch FROM delivered_at - created_at)::float8, 0)) AS p
    FROM outbox.messages
    WHERE state = 'delivered'
      AND delivered_at >= date_trunc('minute', now(), 'UTC') - interval '59 minutes'
    GROUP BY 1
)
SELECT extract(epoch FROM m.minute)::float8 AS minute,
       coalesce(a.delivered, 0) AS delivered, coalesce(a.failed, 0) AS failed,
       a.p[1] AS attempt_p50, a.p[2] AS attempt_p99,
       coalesce(e.n, 0) AS messages, e.p[1] AS e2e_p50, e.p[2] AS e2e_p99
FROM m LEFT JOIN a ON a.minute = m.minute LEFT JOIN e ON e.minute = m.minute
ORDER BY m.minute
"#;

/// Console chart: the backlog per minute over the last hour, as the daemon sampled it
/// (`outbox.backlog_samples`, written by the workers' backlog sampler). Always 60 rows,
/// oldest first: `minute` (unix seconds of the minute's start, UTC), `due` and
/// `oldest_due_seconds`, both NULL for a minute no worker sampled. Reads a table of at most
/// 1 441 rows (a day of minutes).
pub const BACKLOG_PER_MINUTE: &str = r#"
WITH m AS (
    SELECT date_trunc('minute', now(), 'UTC') - (59 - i) * interval '1 minute' AS minute
    FROM generate_series(0, 59) i
)
SELECT extract(epoch FROM m.minute)::float8 AS minute, s.due, s.oldest_due_seconds
FROM m LEFT JOIN outbox.backlog_samples s ON s.minute = m.minute
ORDER BY m.minute
"#;
