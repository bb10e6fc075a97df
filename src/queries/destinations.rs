//! Destinations paused by a person (`outbox.pause_destination`): the operators' pause and
//! resume, the workers' view of paused hosts and their parking of claimed rows, and the
//! console's destination pages.

/// `destinations --pause HOST`: `$1` host, `$2` reason (NULL: none), `$3` the operator.
/// Returns `destination, paused, held_back` (`paused` false when it already was; see
/// `outbox.pause_destination`).
pub const PAUSE_DESTINATION: &str = "SELECT destination, paused, held_back \
     FROM outbox.pause_destination($1::text, $2::text, $3::text)";

/// `destinations --resume HOST`: `$1` host, `$2` the operator. Returns `destination,
/// resumed, due_again`; raises P0002 for a host never seen (see `outbox.resume_destination`).
pub const RESUME_DESTINATION: &str = "SELECT destination, resumed, due_again \
     FROM outbox.resume_destination($1::text, $2::text)";

/// Every worker's view of the paused destinations, read at most once per poll interval.
pub const PAUSED_VIEW: &str = r#"
SELECT host FROM outbox.destinations WHERE paused_at IS NOT NULL LIMIT 10000
"#;

/// Gives back claimed rows of a paused destination (`$1` ids, `$2` lease tokens, fenced as
/// `DEFER` is): `pending` again, the attempt not counted, no history row, parked at their
/// destination's `parked_until`, where `outbox.resume_destination` finds them. A row whose
/// destination is no longer paused is due after its delay (`$3`, seconds) instead. The
/// destinations' rows are locked in share mode first, so a resume either waits for this
/// statement (and then finds the rows it parked) or has committed before it (and the rows
/// are not parked). Returns the ids given back.
pub const PARK: &str = r#"
WITH p AS (
    SELECT d.host, d.parked_until FROM outbox.destinations d
    WHERE d.paused_at IS NOT NULL
      AND d.host IN (SELECT s.destination FROM outbox.messages s WHERE s.id = ANY($1::bigint[]))
    FOR SHARE OF d
)
UPDATE outbox.messages m SET
    state = 'pending', attempts = m.attempts - 1,
    run_after = coalesce((SELECT p.parked_until FROM p WHERE p.host = m.destination),
                         now() + make_interval(secs => i.delay)),
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = now()
FROM unnest($1::bigint[], $2::uuid[], $3::float8[]) AS i(id, token, delay)
WHERE m.id = i.id AND m.state = 'running' AND m.lease_token = i.token
RETURNING m.id
"#;

/// Status and metrics: destinations paused by a person.
pub const PAUSED_DESTINATIONS: &str =
    "SELECT count(*)::bigint FROM outbox.destinations WHERE paused_at IS NOT NULL";

/// The console's destinations, at most `$2`: every one `outbox.destinations` knows and every
/// one a `pending` or `held` message waits for (one index probe per destination, over
/// `messages_destination_idx`), or only `$3` when it is not NULL. Per destination: its
/// circuit (`state`, `consecutive_failures`, `open_until`; NULL when it has no row), its
/// pause (`paused_at`, `paused_by`, `pause_reason`), and what waits: pending messages due
/// now, parked by its pause, and due later; held; running; the oldest due `run_after`. Each
/// count reads at most `$1` index entries (a count of `$1` means "at least"). Paused ones
/// first, then open ones, then by name.
pub const DESTINATIONS_WAITING: &str = r#"
WITH RECURSIVE waiting(host) AS (
    (SELECT m.destination FROM outbox.messages m
     WHERE m.destination IS NOT NULL AND m.state IN ('pending', 'held') AND $3::text IS NULL
     ORDER BY m.destination LIMIT 1)
    UNION ALL
    SELECT (SELECT m.destination FROM outbox.messages m
            WHERE m.destination > w.host AND m.state IN ('pending', 'held')
            ORDER BY m.destination LIMIT 1)
    FROM waiting w WHERE w.host IS NOT NULL
), hosts AS (
    SELECT host FROM waiting WHERE host IS NOT NULL
    UNION
    SELECT host FROM outbox.destinations WHERE $3::text IS NULL
    UNION
    SELECT $3::text WHERE $3::text IS NOT NULL
), running AS (
    SELECT destination, count(*)::bigint AS n FROM outbox.messages
    WHERE state = 'running' AND destination IS NOT NULL
    GROUP BY destination
)
SELECT h.host, d.state, d.consecutive_failures, d.open_until,
       d.paused_at, d.paused_by, d.pause_reason,
       (SELECT count(*) FROM (SELECT 1 FROM outbox.messages m
            WHERE m.destination = h.host AND m.state = 'pending' AND m.run_after <= now()
            LIMIT $1::bigint) x)::bigint AS due,
       (SELECT count(*) FROM (SELECT 1 FROM outbox.messages m
            WHERE m.destination = h.host AND m.state = 'pending' AND m.run_after = d.parked_until
            LIMIT $1::bigint) x)::bigint AS parked,
       (SELECT count(*) FROM (SELECT 1 FROM outbox.messages m
            WHERE m.destination = h.host AND m.state = 'pending' AND m.run_after > now()
              AND m.run_after IS DISTINCT FROM d.parked_until
            LIMIT $1::bigint) x)::bigint AS later,
       (SELECT count(*) FROM (SELECT 1 FROM outbox.messages m
            WHERE m.destination = h.host AND m.state = 'held'
            LIMIT $1::bigint) x)::bigint AS held,
       coalesce(r.n, 0) AS running,
       (SELECT min(m.run_after) FROM outbox.messages m
            WHERE m.destination = h.host AND m.state = 'pending'
              AND m.run_after <= now()) AS oldest_due
FROM hosts h
LEFT JOIN outbox.destinations d ON d.host = h.host
LEFT JOIN running r ON r.destination = h.host
ORDER BY d.paused_at IS NULL, coalesce(d.state, 'closed') = 'closed', h.host
LIMIT $2::bigint
"#;

/// The console's page of one destination: its last `$3` attempts that reached for it
/// (delivered, retry, dead, reconciled, lease lost), among the last `$2` attempts recorded
/// (a bound on the cost: the history has no index by destination). `id, message_id,
/// attempt, outcome, error_class, status, started_at, milliseconds` (NULL while unfinished).
/// Never the error text: it may quote a receiver's answer.
pub const DESTINATION_OUTCOMES: &str = r#"
SELECT a.id, a.message_id, a.attempt, a.outcome, a.error_class, a.status, a.started_at,
       (extract(epoch FROM a.finished_at - a.started_at) * 1000)::float8 AS ms
FROM (SELECT * FROM outbox.attempts ORDER BY id DESC LIMIT $2::bigint) a
JOIN outbox.messages m ON m.id = a.message_id
WHERE m.destination = $1::text
  AND a.outcome IN ('delivered', 'retry', 'dead', 'reconciled', 'lease_lost')
ORDER BY a.id DESC
LIMIT $3::bigint
"#;

/// What operators did to destination `$1` (pause, resume, close), newest first, at most `$2`.
pub const DESTINATION_ACTIONS: &str = r#"
SELECT action, actor, reason, messages, at FROM outbox.destination_actions
WHERE host = $1::text
ORDER BY id DESC
LIMIT $2::bigint
"#;
