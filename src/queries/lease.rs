//! The lease's statements: claim, settle expired leases, complete (fenced by the lease token),
//! release, defer, and the drain check.

/// Claim: lease up to `$2` due messages of the channels `$1` for worker `$3`, for `$4`
/// seconds, in one short committed statement.
///
/// Candidates are `pending` rows whose `run_after` has passed, in `run_after, id` order.
/// `FOR UPDATE SKIP LOCKED` lets any number of workers claim concurrently without ever
/// returning one row twice. A claimed row becomes `running` with `attempts + 1` (a first
/// attempt, the first since a replay too, records its start in `first_attempt_at`: a
/// provider's key window counts from it) and a fresh
/// random lease token, `$5`, made by the worker for this claim; every later write about
/// this attempt must present that token (see [`COMPLETE`]). The rows of one claim share
/// it: a write is fenced by the row's id and its token together, and a row claimed again
/// gets the next claim's token. (`gen_random_uuid()` per row would go through OpenSSL and
/// its fork check once for every row.)
///
/// A `running` row whose lease expired is not this statement's: the lease sweep makes
/// it `pending` again (or `dead`), and a later claim takes it like any due row. Settling in
/// every claim cost PostgreSQL 6 % of its instructions per delivery even when no lease had
/// expired, which is nearly always.
///
/// Returns one row per claimed message: `id, message_key, channel, payload (text),
/// attempts (the number of this attempt), max_attempts, retry_ambiguous, lease_token,
/// error_class` (the class the previous attempt left, as the row holds it), `destination`
/// and `lookup_destination` (where it goes and where its reconciliation lookup goes, named
/// by the insert trigger; a lookup's destination is set exactly when the payload names one),
/// and `key_expires_at` (an http message's key window, `outbox.key_expires_at`: the one
/// owner of that rule, asked for http rows only).
///
/// Ordering keys: a due row with an `ordering_key` is a candidate only when no
/// earlier (smaller id) row of its group is `pending` (due or not), `running`, `held` or
/// `dead`, so a group has at most one message in flight, and its messages go in id order.
/// The probe is one descent of `messages_ordering_idx` and is made only for rows that have
/// a key (`ordering_key IS NULL OR …` short-circuits). Concurrent claims cannot take two of
/// a group: the probe reads this statement's snapshot, and every way out of the blocking
/// states (delivered, cancelled) is a committed change that the snapshot either shows, and
/// then the earlier message really is finished, or does not, and then the later one stays
/// blocked. In particular a claim that runs while another claim is taking the group's head
/// sees the head still `pending` (the other claim has not committed) or already `running`:
/// either way it skips the next member. Within one statement the head blocks the rest of
/// its group in the same way, whatever the `LIMIT`. What the snapshot cannot show is a row
/// not yet committed with a smaller id; the insert trigger rules that out by giving a
/// keyed row its id only once its group's earlier enqueues have ended (`outbox.ordering_turn`).
///
/// Shape: ids reach the `UPDATE` as an array (`id = ANY(ARRAY(...))`), so it is an index
/// scan on the primary key whatever the table holds. (Joining an `UPDATE` to a CTE of
/// picked rows let the planner choose a hash join over a sequential scan of the whole
/// table: a claim then cost time proportional to every row ever kept.)
pub const CLAIM: &str = r#"
WITH due AS (
    SELECT id FROM outbox.messages m
    WHERE state = 'pending' AND run_after <= now() AND channel = ANY($1::text[])
      AND (m.ordering_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM outbox.messages e
          WHERE e.ordering_key = m.ordering_key AND e.id < m.id
            AND e.state IN ('pending', 'running', 'held', 'dead')))
    ORDER BY run_after, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox.messages m SET
    state = 'running', attempts = m.attempts + 1, lease_owner = $3::text,
    lease_token = $5::uuid,
    first_attempt_at = CASE WHEN m.attempts = 0 THEN now() ELSE m.first_attempt_at END,
    lease_expires_at = now() + make_interval(secs => $4::float8),
    updated_at = now()
WHERE m.id = ANY(ARRAY(SELECT id FROM due))
RETURNING m.id, m.message_key, m.channel, m.payload::text AS payload, m.attempts,
          m.max_attempts, m.retry_ambiguous, m.lease_token, m.error_class, m.destination,
          m.lookup_destination,
          CASE WHEN m.channel = 'http'
               THEN outbox.key_expires_at(m.channel, m.payload, m.attempts, m.first_attempt_at)
          END AS key_expires_at
"#;

/// Expired leases: up to `$2` `running` rows of the channels `$1` whose lease ran out, in
/// `run_after, id` order, with what deciding their fate needs. The daemon's lease sweep
/// reads them once per poll interval, and again at once while it comes back full
/// (`worker::sweep`); `state::decide` settles each ([`SETTLE_EXPIRED`] writes it).
///
/// A `running` row whose lease expired (its worker died or stalled) is an attempt whose
/// outcome is unknown: an ambiguous failure. No lock is taken: the write is fenced by the
/// lease token read here, so a row another sweep settled meanwhile (or that a late worker
/// completed) is left as it is.
///
/// Returns `id, message_key, channel, attempts (the attempt whose lease expired),
/// max_attempts, retry_ambiguous, reconcile (the payload names a lookup), lease_token,
/// lease_owner, started (the claim's time), key_window_closed` (an `http` message whose
/// provider may have forgotten its key by now: `outbox.key_expires_at` has passed).
pub const EXPIRED_LEASES: &str = r#"
SELECT id, message_key, channel, attempts, max_attempts, retry_ambiguous,
       lookup_destination IS NOT NULL AS reconcile, lease_token, lease_owner,
       updated_at AS started,
       coalesce(channel = 'http'
                AND outbox.key_expires_at(channel, payload, attempts, first_attempt_at) <= now(),
                false) AS key_window_closed
FROM outbox.messages
WHERE state = 'running' AND lease_expires_at <= now() AND channel = ANY($1::text[])
ORDER BY run_after, id
LIMIT $2
"#;

/// Settle expired leases as `state::decide` settled them: parallel arrays, one element per
/// row of [`EXPIRED_LEASES`]: `$1` ids, `$2` lease tokens, `$3` the next state (`dead` or
/// `pending`), `$4` the retry delay in seconds (for `pending`: due that long after the lease
/// ran out), `$5` the lease owners, `$6` the claims' times (for the history) and `$7` the
/// error each row records (`last_error` and the history's).
///
/// Each row is changed only if it still holds that lease token and is still `running` with
/// its lease expired; its history gets the attempt, outcome `dead` or `lease_lost`, class
/// `ambiguous`. Returns one row per message settled: `id, message_key, channel, attempts,
/// max_attempts, state, retry_in` (seconds until it is due, for `pending`).
pub const SETTLE_EXPIRED: &str = r#"
WITH i AS (
    SELECT * FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::float8[],
                         $5::text[], $6::timestamptz[], $7::text[])
        AS i(id, token, state, delay, owner, started, error)
), settled AS (
    UPDATE outbox.messages m SET
        state = i.state, lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        run_after = CASE WHEN i.state = 'pending'
                         THEN m.lease_expires_at + make_interval(secs => i.delay)
                         ELSE m.run_after END,
        error_class = 'ambiguous',
        last_error = i.error,
        dead_at = CASE WHEN i.state = 'dead' THEN now() END,
        updated_at = now()
    FROM i
    WHERE m.id = i.id AND m.lease_token = i.token AND m.state = 'running'
      AND m.lease_expires_at <= now()
    RETURNING m.id, m.message_key, m.channel, m.attempts, m.max_attempts, i.state,
              i.owner, i.started, i.error,
              greatest(extract(epoch FROM m.run_after - now()), 0)::float8 AS retry_in
), lost AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error)
    SELECT id, attempts, owner, started, now(),
           CASE state WHEN 'dead' THEN 'dead' ELSE 'lease_lost' END,
           'ambiguous', error
    FROM settled
)
SELECT id, message_key, channel, attempts, max_attempts, state, retry_in FROM settled
"#;

/// The part of [`COMPLETE`] and [`COMPLETE_AGAIN`] before their `INSERT`: the input
/// arrays with positions (`i`) and the fenced update (`done`). A macro so that both
/// statements are one literal each, written once.
macro_rules! complete_head {
    () => {
        r#"
WITH i AS (
    SELECT * FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::float8[], $5::text[],
                         $6::text[], $7::jsonb[], $8::int[], $9::text[], $10::int[],
                         $11::bool[], $12::timestamptz[]) WITH ORDINALITY
        AS i(id, token, state, delay, error_class, error, response, attempt, outcome, status,
             deduplicated, started_at, pos)
), done AS (
    UPDATE outbox.messages m SET
        state            = i.state,
        run_after        = CASE WHEN i.state = 'pending'
                                THEN now() + make_interval(secs => i.delay)
                                ELSE m.run_after END,
        lease_owner      = NULL,
        lease_token      = NULL,
        lease_expires_at = NULL,
        error_class      = i.error_class,
        last_error       = i.error,
        response         = coalesce(i.response, m.response),
        delivered_at     = CASE WHEN i.state = 'delivered' THEN now() END,
        dead_at          = CASE WHEN i.state = 'dead' THEN now() END,
        updated_at       = now()
    FROM i
    WHERE m.id = ANY($1::bigint[]) AND m.id = i.id AND m.lease_token = i.token
    RETURNING i.pos
)"#
    };
}

/// Complete: record the end of many attempts in one statement, each fenced by its lease.
///
/// Inputs are parallel arrays, one element per finished attempt: `$1` ids, `$2` lease
/// tokens, `$3` next states (`delivered`, `pending`, `dead`), `$4` delays in seconds before
/// a retry (ignored unless pending), `$5` error classes, `$6` one-line errors, `$7` response
/// summaries, `$8` attempt numbers, `$9` attempt outcomes, `$10` status codes, `$11`
/// deduplicated flags, `$12` start times; `$13` is the worker id.
///
/// A message is changed only if it is still `running` under the same lease token: a worker
/// whose lease expired and was taken over changes nothing. Its attempt row is still written,
/// with outcome `lease_lost`, so the history shows what the stale worker saw. Returns
/// `message_id, outcome` for every attempt row written.
///
/// Shape: the arrays are unnested once, with each element's position. The `UPDATE` reads
/// the rows through `id = ANY($1)`, a probe of the primary key per element, and returns the
/// positions it applied; the `INSERT` joins on those positions, so a batch holding a stale
/// and a current completion of one message records the stale one as `lease_lost`, in time
/// linear in the batch. The fence is the token alone: a token is set exactly while the row
/// is `running` (the `messages_lease_iff_running` constraint), so it implies
/// `state = 'running'`, and not writing that condition keeps the planner off the partial
/// lease index, which it would otherwise read whole; until vacuum that index still holds an
/// entry for every row claimed since, so a completion would cost time proportional to the
/// work done before it. Only a row whose lease was lost is checked for existence (it may
/// have been purged since; its attempt row would then have nothing to refer to). `OFFSET 0`
/// keeps that check a probe of the primary key per row: without it the planner may turn
/// the `EXISTS` into a hashed subplan, which reads the whole index.
pub const COMPLETE: &str = concat!(
    complete_head!(),
    r#"
INSERT INTO outbox.attempts
    (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error, status,
     deduplicated)
SELECT i.id, i.attempt, $13::text, i.started_at, now(),
       CASE WHEN d.pos IS NOT NULL THEN i.outcome ELSE 'lease_lost' END,
       i.error_class, i.error, i.status, i.deduplicated
FROM i LEFT JOIN done d ON d.pos = i.pos
WHERE d.pos IS NOT NULL
   OR EXISTS (SELECT 1 FROM outbox.messages m WHERE m.id = i.id OFFSET 0)
RETURNING message_id, outcome
"#
);

/// [`COMPLETE`] again, for a batch whose first statement failed: it may have committed
/// before its answer was lost (a connection cut, a restart), and then the fence no longer
/// matches, and `COMPLETE` would record every attempt of the batch a second time, as
/// `lease_lost`. An attempt row this worker already wrote for the same attempt (the same
/// message, attempt number and start time; a lease sweep's rows carry the row's own time)
/// is returned as it stands and nothing is written for it. Run after
/// [`LOCK_COMPLETIONS`] in the same transaction, so that a first try still running on the
/// server has ended and what it wrote is in this statement's snapshot. Only the
/// completer's retries run this, so the hot statement is not made dearer.
pub const COMPLETE_AGAIN: &str = concat!(
    complete_head!(),
    r#", recorded AS (
    SELECT i.pos, a.outcome
    FROM i JOIN outbox.attempts a
      ON a.message_id = i.id AND a.attempt = i.attempt AND a.started_at = i.started_at
     AND a.worker = $13::text
), written AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error,
         status, deduplicated)
    SELECT i.id, i.attempt, $13::text, i.started_at, now(),
           CASE WHEN d.pos IS NOT NULL THEN i.outcome ELSE 'lease_lost' END,
           i.error_class, i.error, i.status, i.deduplicated
    FROM i LEFT JOIN done d ON d.pos = i.pos
    WHERE (d.pos IS NOT NULL
           OR EXISTS (SELECT 1 FROM outbox.messages m WHERE m.id = i.id OFFSET 0))
      AND NOT EXISTS (SELECT 1 FROM recorded r WHERE r.pos = i.pos)
    RETURNING message_id, outcome
)
SELECT message_id, outcome FROM written
UNION ALL
SELECT i.id, r.outcome FROM recorded r JOIN i ON i.pos = r.pos
"#
);

/// Release: give back claimed messages this worker will not start (shutdown), fenced by
/// lease token. The attempt is not counted (`attempts - 1`) and the row is due at once; a
/// `released` row goes into the history. `$1` ids, `$2` tokens, `$3` worker id. Returns the
/// ids released.
pub const RELEASE: &str = r#"
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::uuid[]) AS t(id, token)
), released AS (
    UPDATE outbox.messages m SET
        state = 'pending', attempts = m.attempts - 1, lease_owner = NULL, lease_token = NULL,
        lease_expires_at = NULL, updated_at = now()
    FROM input i
    WHERE m.id = i.id AND m.state = 'running' AND m.lease_token = i.token
    RETURNING m.id, m.attempts + 1 AS attempt
)
INSERT INTO outbox.attempts (message_id, attempt, worker, started_at, finished_at, outcome)
SELECT id, attempt, $3::text, now(), now(), 'released' FROM released
RETURNING message_id
"#;

/// Waits for every other transaction holding the rows of a batch of completions (`$1`
/// ids), and locks them: what [`COMPLETE_AGAIN`] runs after, in the same transaction.
pub const LOCK_COMPLETIONS: &str = r#"
SELECT id FROM outbox.messages WHERE id = ANY($1::bigint[]) ORDER BY id FOR UPDATE
"#;

/// Release the rows of a claim whose answer never came back (the connection was lost, or
/// the claim's time bound passed, when the statement may have committed): every row still
/// `running` under that claim's lease token goes back as [`RELEASE`] gives a row back. No
/// task of the worker holds them, since the rows never reached one; left alone they waited
/// for their leases to expire and counted an attempt never made, as ambiguous (dead at once
/// with `retry_ambiguous = false`). Found through the partial index of `running` rows,
/// which the token then filters. `$1` the claim's token, `$2` worker id. Returns the ids
/// released.
pub const RELEASE_LOST_CLAIM: &str = r#"
WITH released AS (
    UPDATE outbox.messages m SET
        state = 'pending', attempts = m.attempts - 1, lease_owner = NULL, lease_token = NULL,
        lease_expires_at = NULL, updated_at = now()
    WHERE m.state = 'running' AND m.lease_token = $1::uuid
    RETURNING m.id, m.attempts + 1 AS attempt
)
INSERT INTO outbox.attempts (message_id, attempt, worker, started_at, finished_at, outcome)
SELECT id, attempt, $2::text, now(), now(), 'released' FROM released
RETURNING message_id
"#;

/// Defer: give back claimed messages that are not to be sent yet (an open circuit breaker, a
/// rate limit, a busy host; `state::Deferral`), fenced by lease token. Like [`RELEASE`] the
/// attempt is not counted (`attempts - 1`); unlike it, the row is due only after its delay and
/// no history row is written: a deferral is a decision about when to send, made again and
/// again while a destination is down, and a row per decision would grow the history without
/// bound while telling an operator nothing the destination's state does not. `$1` ids, `$2`
/// tokens, `$3` delays in seconds, `$4` whether the delay waits for an open circuit.
///
/// A worker decides a breaker's deferral on its view of the breakers, read once per poll
/// interval; a circuit closed meanwhile (by hand, or by another worker's probe) has already
/// brought its backlog back, and a row deferred after that on the stale view would wait out
/// a cooldown that is over. So a breaker's deferral of a row whose destination is no longer
/// open or half-open is due within a second, by when the worker's view has caught up.
/// Returns the ids deferred.
pub const DEFER: &str = r#"
UPDATE outbox.messages m SET
    state = 'pending', attempts = m.attempts - 1,
    run_after = now() + make_interval(secs => CASE
        WHEN i.breaker AND NOT EXISTS (
            SELECT 1 FROM outbox.destinations d
            WHERE d.host = m.destination AND d.state <> 'closed')
        THEN least(i.delay, 1.0)
        ELSE i.delay END),
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = now()
FROM unnest($1::bigint[], $2::uuid[], $3::float8[], $4::bool[]) AS i(id, token, delay, breaker)
WHERE m.id = i.id AND m.state = 'running' AND m.lease_token = i.token
RETURNING m.id
"#;

/// Is there anything left for these channels (`$1`)? True while any message is `pending`
/// (due or not) or `running`: what `--drain` waits for. A message held back by a paused
/// destination waits for a person, as a held one does, and is not waited for: it is due at
/// its destination's `parked_until`, a century after the pause, and nothing else is due
/// that late. Nor is a pending message of a paused channel (`outbox.pause_channel`): the
/// workers claim none of them until a person resumes it.
///
/// One ordered `LIMIT 1` per state, so each is answered from the first entry of that
/// state's partial index (`messages_due_idx`, `messages_lease_idx`). (A plain `EXISTS` lets
/// the planner pick a sequential scan that expects to meet a match at once; in a table
/// that keeps millions of delivered rows ahead of the pending ones, it reads them all.)
pub const HAS_UNFINISHED: &str = r#"
SELECT (SELECT id FROM outbox.messages
        WHERE state = 'pending' AND channel = ANY($1::text[])
          AND NOT coalesce(run_after >= (SELECT min(d.parked_until) FROM outbox.destinations d
                                         WHERE d.paused_at IS NOT NULL), false)
          AND channel <> ALL (ARRAY(SELECT p.channel FROM outbox.paused_channels p))
        ORDER BY run_after, id LIMIT 1) IS NOT NULL
    OR (SELECT id FROM outbox.messages
        WHERE state = 'running' AND channel = ANY($1::text[])
        ORDER BY lease_expires_at LIMIT 1) IS NOT NULL
"#;
