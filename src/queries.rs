//! Every statement the runtime sends, in one place, each with its contract.
//!
//! Migrations live in `sql/`; these are the queries of the running system. Nothing else in
//! the crate writes SQL text (the enqueue functions, the migration runner and the worker all
//! take their statements from here), and each one is exercised against a real database by
//! the integration tests.

/// Run once on every pooled connection: JIT off. PostgreSQL compiles a statement with LLVM
/// when its estimated cost passes `jit_above_cost`; on a table holding millions of rows the
/// claim's estimate does, and compiling it took tens of milliseconds on every execution,
/// twenty times the claim itself. Short statements that touch a few dozen rows never gain
/// from JIT.
///
/// Plans stay PostgreSQL's choice here (`plan_cache_mode = auto`): this is the setup of the
/// pools that run the operators' and the maintenance's statements, whose best plan depends
/// on their arguments.
pub const SESSION_SETUP: &str = "SET jit = off";

/// Run once on each connection of the claims' and completions' pool: [`SESSION_SETUP`], and
/// generic plans.
///
/// Under `plan_cache_mode = auto` the prepared [`CLAIM`] and [`COMPLETE`] got a custom plan,
/// planned afresh, on every execution. Their best plan does not depend on their arguments
/// (index probes of the primary key and of the due index, whatever the batch), so a generic
/// plan, made once, is right for them; forcing it cut the database's CPU per delivery by
/// about a tenth (53 → 48 µs in `bench/RESULTS.md`, issue 17; a drain 1.07× as fast).
///
/// The hazard of a generic plan is the moment it is made: it sees the table as it was
/// then. Made on an empty table (a new install, a worker started before the first
/// enqueue) the claim's update of the picked ids and the completion's are sequential
/// scans, and they stay so until an `ANALYZE` invalidates the plan, which on a table that
/// grows by inserts alone can be a long time: commit-to-delivery latency doubled in the
/// benchmark that found it. The worker therefore throws its prepared statements away every
/// [`crate::worker::PLAN_REFRESH`] (`Pools::refresh_plans`): the planner reads the table's
/// real size each time it plans, so the next plan is made from the table as it is now.
/// Re-preparing costs one round trip a second.
///
/// And claims commit durably whatever the role or database says: a claim counts an attempt
/// before it is sent, and one undone by a crash of PostgreSQL (`synchronous_commit = off`)
/// or lost in a failover to a standby that never had it (`local`) puts the row back
/// `pending` with the attempt uncounted, to be sent again with no `ambiguous` mark. The
/// settings that wait for a standby (`remote_write`, `remote_apply`) are kept.
pub const CLAIM_SETUP: &str = "SET jit = off; SET plan_cache_mode = force_generic_plan; \
    SELECT set_config('synchronous_commit', \
        CASE WHEN current_setting('synchronous_commit') IN ('off', 'local') THEN 'on' \
             ELSE current_setting('synchronous_commit') END, false)";

/// Run once on each connection of the console's pool: [`SESSION_SETUP`], and bounds on
/// waiting. A page gives up after 60 s (`console::REQUEST_TIMEOUT`), but a statement it
/// leaves goes on in the server: an action waiting for rows another transaction holds
/// answered only "timed out" (its transaction rolled back once the statement ended), and
/// held one of the console's four connections all the while. So an action waits at most
/// 10 s for a row lock, and any statement ends within 50 s, before its page does: the
/// page then says which (a lock or a statement timeout) and that the database refused.
pub const CONSOLE_SETUP: &str =
    "SET jit = off; SET lock_timeout = '10s'; SET statement_timeout = '50s'";

/// Does the database hold the outbox schema (`outbox.messages`)? Read from the catalog,
/// which every role may read, so a database that was never migrated answers `false` rather
/// than failing with 42P01 or 3F000 on the first statement that names the table.
pub const SCHEMA_PRESENT: &str = r#"
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_class c
    JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'outbox' AND c.relname = 'messages'
)
"#;

/// Health probe (`GET /healthz`): succeeds while the database answers on a pooled
/// connection. Reads nothing.
pub const HEALTH_CHECK: &str = "SELECT 1";

/// Claim: lease up to `$2` due messages of the channels `$1` for worker `$3`, for `$4`
/// seconds, in one short committed statement.
///
/// Candidates are `pending` rows whose `run_after` has passed, in `run_after, id` order.
/// `FOR UPDATE SKIP LOCKED` lets any number of workers claim concurrently without ever
/// returning one row twice. A claimed row becomes `running` with `attempts + 1` and a fresh
/// random lease token, `$5`, made by the worker for this claim; every later write about
/// this attempt must present that token (see [`COMPLETE`]). The rows of one claim share
/// it: a write is fenced by the row's id and its token together, and a row claimed again
/// gets the next claim's token. (`gen_random_uuid()` per row cost the server about a
/// microsecond each, through OpenSSL and its fork check.)
///
/// A `running` row whose lease expired is not this statement's: [`SETTLE_EXPIRED`] makes
/// it `pending` again (or `dead`), and a later claim takes it like any due row. Settling in
/// every claim cost PostgreSQL 6 % of its instructions per delivery even when no lease had
/// expired, which is nearly always (bench/RESULTS.md, issue 17).
///
/// Returns one row per claimed message: `id, message_key, channel, payload (text),
/// attempts (the number of this attempt), max_attempts, retry_ambiguous, lease_token,
/// error_class` (the class the previous attempt left, as the row holds it). Whether the
/// payload names a lookup (the attempt after an ambiguous one asks first) and where it goes
/// are read from the payload by the worker (`webhook::destination::routing`, the rules of
/// `outbox.reconcilable` and `outbox.destination_of`), not here: each function call cost 5
/// to 20 µs a row.
///
/// Ordering keys (`sql/0012`): a due row with an `ordering_key` is a candidate only when no
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
/// keyed row its id only once its group's earlier enqueues have ended (`sql/0012`, 3).
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
    lease_expires_at = now() + make_interval(secs => $4::float8),
    updated_at = now()
WHERE m.id = ANY(ARRAY(SELECT id FROM due))
RETURNING m.id, m.message_key, m.channel, m.payload::text AS payload, m.attempts,
          m.max_attempts, m.retry_ambiguous, m.lease_token, m.error_class
"#;

/// Settle expired leases: up to `$2` `running` rows of the channels `$1` whose lease ran
/// out, in `run_after, id` order, in one short committed statement. The daemon runs it
/// beside the claim loop once per poll interval, and again at once while it comes back
/// full (`worker::sweep`).
///
/// A `running` row whose lease expired (its worker died or stalled) is an attempt whose
/// outcome is unknown: an ambiguous failure, recorded as such in the history, and settled by
/// `decide`'s rule for one, which `outbox.on_lease_expiry` states (`sql/0008`; since
/// `sql/0010` with the fact `outbox.reconcilable`, whether the payload names a lookup):
/// * `dead` (the message neither allows ambiguous retries nor names a lookup, or that was
///   its last attempt):
///   dead-lettered here, class `ambiguous`, history outcome `dead`, returned with
///   `action = 'gave_up'`;
/// * `pending`: it waits the retry backoff `decide` would have applied, counted from the
///   moment the lease ran out (`$3`, the schedule's delays in seconds by attempt number,
///   its last element repeated beyond; `$4`, the share the jitter may take off: both from
///   [`crate::retry::RetryPolicy`]), history outcome `lease_lost`, returned with
///   `action = 'deferred'`. A later claim sends it again, under a fresh lease. (Re-sending
///   at once, as before, hammered a receiver that was slow enough to outlast a lease.)
///
/// Returns one row per settled message: `id, message_key, channel, attempts (the number of
/// the attempt whose lease expired), max_attempts, action, retry_in` (seconds, for
/// `deferred` rows).
///
/// Shape: as [`CLAIM`]'s, ids reach each `UPDATE` as an array. The two `UPDATE`s take
/// disjoint rows (one asks the rule for `dead`, the other for `pending`), and the history
/// insert reads the expired rows as they were locked (lease owner, start).
pub const SETTLE_EXPIRED: &str = r#"
WITH expired AS (
    SELECT id, lease_owner, updated_at FROM outbox.messages
    WHERE state = 'running' AND lease_expires_at <= now() AND channel = ANY($1::text[])
    ORDER BY run_after, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), given_up AS (
    UPDATE outbox.messages m SET
        state = 'dead', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        error_class = 'ambiguous',
        last_error = 'lease expired while running: the attempt may have taken effect',
        dead_at = now(), updated_at = now()
    WHERE m.id = ANY(ARRAY(SELECT id FROM expired))
      AND outbox.on_lease_expiry(m.retry_ambiguous, m.attempts, m.max_attempts,
                                 outbox.reconcilable(m.channel, m.payload)) = 'dead'
    RETURNING m.id, m.message_key, m.channel, m.attempts, m.max_attempts
), deferred AS (
    UPDATE outbox.messages m SET
        state = 'pending', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        run_after = m.lease_expires_at + make_interval(secs =>
            ($3::float8[])[least(greatest(m.attempts, 1), cardinality($3::float8[]))]
            * (1 - $4::float8 * random())),
        error_class = 'ambiguous',
        last_error = 'lease expired while running: the attempt may have taken effect',
        updated_at = now()
    WHERE m.id = ANY(ARRAY(SELECT id FROM expired))
      AND outbox.on_lease_expiry(m.retry_ambiguous, m.attempts, m.max_attempts,
                                 outbox.reconcilable(m.channel, m.payload)) = 'pending'
    RETURNING m.id, m.message_key, m.channel, m.attempts, m.max_attempts,
              greatest(extract(epoch FROM m.run_after - now()), 0)::float8 AS retry_in
), lost AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error)
    SELECT s.id, s.attempts, e.lease_owner, e.updated_at, now(), s.outcome,
           'ambiguous', 'lease expired while running: the attempt may have taken effect'
    FROM (SELECT id, attempts, 'dead' AS outcome FROM given_up
          UNION ALL
          SELECT id, attempts, 'lease_lost' FROM deferred) s
    JOIN expired e ON e.id = s.id
)
SELECT id, message_key, channel, attempts, max_attempts, NULL::float8 AS retry_in,
       'gave_up' AS action
FROM given_up
UNION ALL
SELECT id, message_key, channel, attempts, max_attempts, retry_in, 'deferred'
FROM deferred
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
/// tokens, `$3` delays in seconds. Returns the ids deferred.
pub const DEFER: &str = r#"
UPDATE outbox.messages m SET
    state = 'pending', attempts = m.attempts - 1,
    run_after = now() + make_interval(secs => i.delay),
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = now()
FROM unnest($1::bigint[], $2::uuid[], $3::float8[]) AS i(id, token, delay)
WHERE m.id = i.id AND m.state = 'running' AND m.lease_token = i.token
RETURNING m.id
"#;

/// Is there anything left for these channels (`$1`)? True while any message is `pending`
/// (due or not) or `running`: what `--drain` waits for.
///
/// One ordered `LIMIT 1` per state, so each is answered from the first entry of that
/// state's partial index (`messages_due_idx`, `messages_lease_idx`). (A plain `EXISTS` lets
/// the planner pick a sequential scan that expects to meet a match at once; in a table
/// that keeps millions of delivered rows ahead of the pending ones, it reads them all.)
pub const HAS_UNFINISHED: &str = r#"
SELECT (SELECT id FROM outbox.messages
        WHERE state = 'pending' AND channel = ANY($1::text[])
        ORDER BY run_after, id LIMIT 1) IS NOT NULL
    OR (SELECT id FROM outbox.messages
        WHERE state = 'running' AND channel = ANY($1::text[])
        ORDER BY lease_expires_at LIMIT 1) IS NOT NULL
"#;

/// Wake-ups: take the idle mark (advisory lock `(1869968482, 2)`, share mode, held by the
/// session) without waiting. While a worker holds it, enqueueing transactions notify (see
/// `sql/0005_wakeups_for_idle_workers.sql`). False when it is held exclusively: an
/// enqueuer probing it this instant, or one interrupted while probing, which then notifies
/// anyway; try again.
pub const IDLE_MARK: &str = "SELECT pg_try_advisory_lock_shared(1869968482, 2)";

/// Wake-ups: pass the gate (advisory lock `(1869968482, 1)`): wait until no transaction that
/// decided not to notify is still open, then let go at once. Bounded by the `lock_timeout`
/// of [`LISTEN_SETUP`], so that a long application transaction does not keep the LISTEN
/// connection (and the notifications it delivers) busy; the caller tries again.
pub const IDLE_GATE: &str =
    "SELECT pg_advisory_lock(1869968482, 1); SELECT pg_advisory_unlock(1869968482, 1)";

/// Wake-ups: give the idle mark back (the worker is busy; enqueuers stop notifying).
pub const IDLE_UNMARK: &str = "SELECT pg_advisory_unlock_shared(1869968482, 2)";

/// Run once on the LISTEN connection: subscribe, and bound [`IDLE_GATE`]'s wait.
pub const LISTEN_SETUP: &str = "SET lock_timeout = '20ms'; LISTEN outbox_messages";

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

/// Status: seconds since the `run_after` of the oldest due pending message; 0 when none is
/// due.
///
/// Enqueue refuses an infinite `run_after` (`sql/0007`), but rows stored before may hold one,
/// and `now() - '-infinity'` raises 22008: the difference is taken between epochs instead,
/// and a `-infinity` row counts as due since its `created_at` (an `infinity` row is never
/// due). Both subqueries read `messages_due_idx`: the first its first finite due entry, the
/// second only the `-infinity` entries.
pub const OLDEST_DUE_SECONDS: &str = r#"
SELECT coalesce(extract(epoch FROM now()) - extract(epoch FROM least(
    (SELECT min(run_after) FROM outbox.messages
     WHERE state = 'pending' AND run_after > '-infinity' AND run_after <= now()),
    (SELECT min(created_at) FROM outbox.messages
     WHERE state = 'pending' AND run_after = '-infinity' AND isfinite(created_at))
)), 0)::float8
"#;

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

/// Enqueue one message; the rules are those of `outbox.enqueue_row` (see
/// `sql/0001_outbox.sql`, `sql/0009` and `sql/0012`); `$7` held, `$8` ordering key or NULL.
/// Returns `id, created`.
pub const ENQUEUE: &str = r#"
SELECT id, created FROM outbox.enqueue_row($1::text, $2::text, $3::jsonb,
    coalesce($4::timestamptz, now()), $5::int, $6::bool, $7::bool, $8::text)
"#;

/// Enqueue many messages in one statement, all or nothing; the rules are those of
/// `outbox.enqueue_many`. Returns `id, created` per message, in input order.
pub const ENQUEUE_MANY: &str = r#"
SELECT id, created FROM outbox.enqueue_many($1::text[], $2::text[], $3::jsonb[],
    $4::timestamptz[], $5::int[], $6::bool[], $7::bool[], $8::text[])
"#;

/// Migrations: the lock that serialises concurrent `outboxd migrate` runs (a session-level
/// advisory lock on a fixed key, "outbox" in ASCII).
pub const MIGRATE_LOCK: &str = "SELECT pg_advisory_lock(111542170367864)";

/// Migrations: release [`MIGRATE_LOCK`].
pub const MIGRATE_UNLOCK: &str = "SELECT pg_advisory_unlock(111542170367864)";

/// Migrations: the ledger, created before the first file runs.
pub const MIGRATE_LEDGER: &str = r#"
CREATE SCHEMA IF NOT EXISTS outbox;
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"#;

/// Migrations: what has been applied (`version, name, checksum`).
pub const MIGRATE_APPLIED: &str =
    "SELECT version, name, checksum FROM outbox.schema_migrations ORDER BY version";

/// Migrations: record one applied file (`$1` version, `$2` name, `$3` checksum).
pub const MIGRATE_RECORD: &str =
    "INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)";

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

/// One message with every column an operator may want, by id (`$1`).
pub const SHOW_MESSAGE: &str = r#"
SELECT id, message_key, channel, state, attempts, max_attempts, retry_ambiguous, payload,
       run_after, lease_owner, lease_expires_at, error_class, last_error, response,
       created_at, updated_at, delivered_at, dead_at, cancelled_at, ordering_key
FROM outbox.messages WHERE id = $1
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

/// What is known of one message by its key (`$1`), without its payload, through
/// `outbox.lookup` (callable by the application role): no row for an unknown key.
pub const LOOKUP: &str = r#"
SELECT id, state, attempts, max_attempts, error_class, last_error, response, created_at,
       updated_at, delivered_at, dead_at, cancelled_at
FROM outbox.lookup($1::text)
"#;

/// The history of a message (`$1`), oldest first.
pub const SHOW_ATTEMPTS: &str = r#"
SELECT attempt, worker, started_at, finished_at, outcome, error_class, error, status, deduplicated
FROM outbox.attempts WHERE message_id = $1 ORDER BY id
"#;

/// Replay dead messages (`$1` ids, `$2` actor) through `outbox.replay`: all or nothing.
pub const REPLAY: &str = "SELECT id, message_key FROM outbox.replay($1::bigint[], $2::text)";

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

/// Console chart: deliveries and failures per minute over the last hour, from the attempt
/// history. Always 60 rows, oldest first: `minute` (unix seconds of the minute's start, the
/// database's clock), `delivered` (attempts whose outcome is `delivered`), `failed`
/// (`retry`, `dead` or `lease_lost`: attempts that did not deliver). Operator actions
/// (`replayed`, `approved`, …) and releases are not attempts that failed, so they count in
/// neither. There is no index on `finished_at`: the read costs a scan of the history,
/// which the daemon's retention keeps to about `--retention` of traffic (a page view, not
/// a scrape).
pub const ATTEMPTS_PER_MINUTE: &str = r#"
WITH m AS (
    SELECT generate_series(date_trunc('minute', now()) - interval '59 minutes',
                           date_trunc('minute', now()), interval '1 minute') AS minute
), a AS (
    SELECT date_trunc('minute', finished_at) AS minute, outcome
    FROM outbox.attempts
    WHERE finished_at >= date_trunc('minute', now()) - interval '59 minutes'
)
SELECT extract(epoch FROM m.minute)::float8 AS minute,
       count(a.outcome) FILTER (WHERE a.outcome = 'delivered')::bigint AS delivered,
       count(a.outcome) FILTER (WHERE a.outcome IN ('retry', 'dead', 'lease_lost'))::bigint AS failed
FROM m LEFT JOIN a ON a.minute = m.minute
GROUP BY m.minute
ORDER BY m.minute
"#;

/// Breakers (`sql/0014`): record a batch's webhook outcomes per destination. `$1` hosts
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
    WHERE m.state = 'pending' AND m.channel = 'webhook' AND m.run_after < d.until
      AND (m.attempts > 0 OR m.run_after <= now())
      AND m.id > $4::bigint
      AND outbox.destination_of(m.channel, m.payload) = $1::text
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
/// webhook rows of host `$1` not yet due and due within `$4` seconds either side of `$2`
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
        WHERE s.state = 'pending' AND s.channel = 'webhook' AND s.run_after > now()
          AND s.run_after >= $2::timestamptz - make_interval(secs => $4::float8)
          AND s.run_after <= $2::timestamptz + make_interval(secs => $4::float8)
          AND (s.attempts > 0
               OR (s.updated_at > s.created_at
                   AND NOT EXISTS (SELECT 1 FROM outbox.attempts a
                                   WHERE a.message_id = s.id AND a.outcome = 'approved'
                                     AND a.started_at = s.updated_at)))
          AND outbox.destination_of(s.channel, s.payload) = $1::text
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

/// `outboxd destinations`: hosts open, half-open or failing, open ones first.
pub const DESTINATIONS_LIST: &str = r#"
SELECT host, state, consecutive_failures, open_until
FROM outbox.destinations
WHERE state <> 'closed' OR consecutive_failures > 0
ORDER BY state = 'closed', host
"#;

/// `outboxd destinations --close HOST`: closes host `$1` by hand. Returns the push time to
/// bring back (`deferred_until`, possibly NULL); no row when the host is unknown.
pub const DESTINATION_CLOSE: &str = r#"
WITH o AS (SELECT host, deferred_until FROM outbox.destinations WHERE host = $1::text FOR UPDATE)
UPDATE outbox.destinations d SET
    state = 'closed', consecutive_failures = 0, open_until = NULL, probe_until = NULL,
    deferred_until = NULL, updated_at = now()
FROM o WHERE d.host = o.host
RETURNING o.deferred_until
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
