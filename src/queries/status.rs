//! Counts for `outboxd status` and `/metrics`, and the ordering and due-row watches.

/// Status: message counts by channel and state, exact (a read of the whole table: for
/// `outboxd status`, not for a scrape; see [`STATE_COUNTS_BOUNDED`]).
pub const STATUS_COUNTS: &str = r#"
SELECT channel, state, count(*)::bigint AS n
FROM outbox.messages
GROUP BY channel, state
"#;

/// Metrics: messages by state, exact up to `$1` per state and estimated beyond, in time
/// bounded by `$1` whatever the table holds. Returns `state, n, estimated`.
///
/// `STATUS_COUNTS` reads the whole table; a queue keeps its delivered rows for the
/// retention period (millions of them), so a scrape every few seconds would keep a core of
/// the database busy, and the scrape's timeout would not stop it (the server finishes the
/// query). Each state here is counted from the head of its own partial index, at most `$1`
/// entries (the `ORDER BY` keeps the planner on that index: a sequential scan with a `LIMIT`
/// may read every delivered row before it meets a pending one). Past `$1`, the figure is the
/// index's size as of the last `ANALYZE` or `VACUUM` (autovacuum does both), and never less
/// than `$1`.
pub const STATE_COUNTS_BOUNDED: &str = r#"
SELECT s.state,
       CASE WHEN s.n < $1 THEN s.n
            ELSE greatest(s.n, (SELECT c.reltuples::bigint FROM pg_class c WHERE c.oid = s.idx))
       END AS n,
       s.n >= $1 AS estimated
FROM (VALUES
    ('pending',   (SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'pending'
                                         ORDER BY run_after, id LIMIT $1) x),
                  'outbox.messages_due_idx'::regclass),
    ('running',   (SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'running'
                                         ORDER BY lease_expires_at LIMIT $1) x),
                  'outbox.messages_lease_idx'::regclass),
    ('delivered', (SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'delivered'
                                         ORDER BY delivered_at LIMIT $1) x),
                  'outbox.messages_delivered_idx'::regclass),
    ('dead',      (SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'dead'
                                         ORDER BY dead_at LIMIT $1) x),
                  'outbox.messages_dead_idx'::regclass),
    ('held',      (SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'held'
                                         ORDER BY created_at, id LIMIT $1) x),
                  'outbox.messages_held_idx'::regclass),
    ('cancelled', (SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'cancelled'
                                         ORDER BY cancelled_at LIMIT $1) x),
                  'outbox.messages_cancelled_idx'::regclass)
) AS s(state, n, idx)
"#;

/// Status: the number of blocked ordering groups: ordering keys with at least one message
/// waiting behind an earlier unfinished one (two or more of the group `pending`, `running`,
/// `held` or `dead`: every one but the first waits). A group flowing normally counts while
/// it has a backlog; one whose head is dead or held counts until the head is replayed,
/// cancelled or approved and the backlog drains. Read from `messages_ordering_idx`, which
/// holds exactly those rows, so it costs the backlog of keyed messages, not the table.
pub const BLOCKED_GROUPS: &str = r#"
SELECT count(*)::bigint FROM (
    SELECT ordering_key FROM outbox.messages
    WHERE ordering_key IS NOT NULL AND state IN ('pending', 'running', 'held', 'dead')
    GROUP BY ordering_key
    HAVING count(*) > 1
) g
"#;

/// The worker's ordering watch: up to `$1` ordering groups held up by their head (the
/// earliest unfinished message of the group) being `dead`, `held` or `pending` and not yet
/// due (a retry waiting): the group's key, how many wait behind the head, the head's key,
/// its state and seconds until it is due (NULL unless pending). Read from
/// `messages_ordering_idx`, like [`BLOCKED_GROUPS`]; a group merely flowing (its head due
/// or running) is not listed.
pub const ORDERING_HELD_UP: &str = r#"
SELECT g.ordering_key, g.waiting, h.message_key, h.state,
       CASE WHEN h.state = 'pending'
            THEN extract(epoch FROM h.run_after - now())::float8 END AS due_in
FROM (
    SELECT ordering_key, min(id) AS head, (count(*) - 1)::bigint AS waiting
    FROM outbox.messages
    WHERE ordering_key IS NOT NULL AND state IN ('pending', 'running', 'held', 'dead')
    GROUP BY ordering_key
    HAVING count(*) > 1
) g
JOIN outbox.messages h ON h.id = g.head
WHERE h.state IN ('dead', 'held') OR (h.state = 'pending' AND h.run_after > now())
ORDER BY g.head
LIMIT $1
"#;

/// The expression of [`OLDEST_DUE_SECONDS`], written once: [`BACKLOG_SAMPLE`] records the
/// same figure.
macro_rules! oldest_due_seconds {
    () => {
        r#"coalesce(extract(epoch FROM now()) - extract(epoch FROM least(
    (SELECT min(run_after) FROM outbox.messages
     WHERE state = 'pending' AND run_after > '-infinity' AND run_after <= now()),
    (SELECT min(created_at) FROM outbox.messages
     WHERE state = 'pending' AND run_after = '-infinity' AND isfinite(created_at))
)), 0)::float8
"#
    };
}

/// Status: seconds since the `run_after` of the oldest due pending message; 0 when none is
/// due.
///
/// Enqueue refuses an infinite `run_after`, but a row changed by hand may hold one,
/// and `now() - '-infinity'` raises 22008: the difference is taken between epochs instead,
/// and a `-infinity` row counts as due since its `created_at` (an `infinity` row is never
/// due). Both subqueries read `messages_due_idx`: the first its first finite due entry, the
/// second only the `-infinity` entries.
pub const OLDEST_DUE_SECONDS: &str = concat!("SELECT ", oldest_due_seconds!());

/// Due messages by channel: `channel, due, oldest_due_seconds` for every channel with a
/// `pending` message whose `run_after` has passed, leaving out the channels `$1`, among the
/// oldest `$2` due messages (NULL: all of them).
///
/// `outboxd status` reads all (it reads the whole table anyway); the daemon's watch for
/// channels it does not serve reads at most `$2` entries of `messages_due_idx`, so its cost
/// is bounded whatever the backlog. The age is taken as in [`OLDEST_DUE_SECONDS`]: between
/// epochs, a `-infinity` row counting from its `created_at`.
pub const DUE_BY_CHANNEL: &str = r#"
SELECT d.channel, count(*)::bigint,
       coalesce(extract(epoch FROM now()) - extract(epoch FROM min(d.since)), 0)::float8
FROM (
    SELECT channel,
           CASE WHEN isfinite(run_after) THEN run_after
                WHEN isfinite(created_at) THEN created_at END AS since
    FROM outbox.messages
    WHERE state = 'pending' AND run_after <= now()
    ORDER BY run_after, id
    LIMIT $2::bigint
) d
WHERE d.channel <> ALL($1::text[])
GROUP BY d.channel
ORDER BY d.channel
"#;

/// Most due messages a backlog sample counts (`$1` of [`BACKLOG_SAMPLE`]): a count that
/// stops there reads at most so many entries of `messages_due_idx`.
pub const BACKLOG_COUNT_CAP: i64 = 100_000;

/// The daemon's backlog sample: adds this minute's row to `outbox.backlog_samples` (the
/// minute's start by the database's clock, in UTC; how many messages are due, counted up
/// to `$1`; and [`OLDEST_DUE_SECONDS`]'s figure), unless a worker already added it, and
/// deletes the rows older than a day. Returns the minute's start (unix seconds) when this
/// call added the row, no row otherwise.
///
/// Cost: a probe of the primary key; when the minute has no row yet, the two reads of
/// `messages_due_idx` that [`OLDEST_DUE_SECONDS`] makes and a count of at most `$1` of its
/// entries; and the delete of the one row that fell out of the day, found through the
/// primary key. With many workers the first of each minute does the work; the others stop
/// at the probe (a race between two ends in `ON CONFLICT DO NOTHING`).
pub const BACKLOG_SAMPLE: &str = concat!(
    r#"
WITH gone AS (
    DELETE FROM outbox.backlog_samples
    WHERE minute < date_trunc('minute', now(), 'UTC') - interval '1 day'
)
INSERT INTO outbox.backlog_samples (minute, due, oldest_due_seconds)
SELECT date_trunc('minute', now(), 'UTC'),
       (SELECT count(*) FROM (SELECT 1 FROM outbox.messages
                              WHERE state = 'pending' AND run_after <= now()
                              ORDER BY run_after, id LIMIT $1::bigint) d)::bigint,
       greatest("#,
    oldest_due_seconds!(),
    r#", 0)
WHERE NOT EXISTS (SELECT 1 FROM outbox.backlog_samples
                  WHERE minute = date_trunc('minute', now(), 'UTC'))
ON CONFLICT (minute) DO NOTHING
RETURNING extract(epoch FROM minute)::float8
"#
);
