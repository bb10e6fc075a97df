//! Connection set-up, the schema and health checks, and the wake-up channel: what a pooled or
//! listening connection runs for itself.

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
/// Under `plan_cache_mode = auto` the prepared [`CLAIM`](super::CLAIM) and [`COMPLETE`](super::COMPLETE) got a custom plan,
/// planned afresh, on every execution. Their best plan does not depend on their arguments
/// (index probes of the primary key and of the due index, whatever the batch), so a generic
/// plan, made once, is right for them; forcing it cut the database's CPU per delivery by
/// about a tenth (BENCHMARKS.md).
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

/// Wake-ups: take the idle mark (advisory lock `(1869968482, 2)`, share mode, held by the
/// session) without waiting. While a worker holds it, enqueueing transactions notify (see
/// `outbox.wake_needed` in `sql/0001_baseline.sql`). False when it is held exclusively: an
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
