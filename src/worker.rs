//! The worker loop: claim, deliver with bounded concurrency, complete in batches.
//!
//! ```text
//!   claim loop ──(Claimed)──▶ delivery tasks (≤ concurrency) ──(Done)──▶ completer
//!       ▲                                                                  │
//!       └────────────── wake: LISTEN, a freed slot, poll interval ◀────────┘
//! ```
//!
//! * The claim loop asks for as many rows as it has free slots, plus up to one batch ahead
//!   (at most `batch_size` per claim), in one short committed statement; a row claimed
//!   ahead waits in its task for a slot. No transaction is open while a message is sent.
//! * A channel that bounds its own sends (e-mail: the relay's connections) is claimed in a
//!   lane of its own, never past that bound.
//! * An attempt starts only when its whole timeout, and a margin, still fit in the lease
//!   ([`WorkerConfig::attempt_fits`]); a row that waited too long is released unsent, so a
//!   lease never runs out while its request is in flight.
//! * Each delivery runs in its own task holding a semaphore permit; its result goes through
//!   [`decide`] and then to the completer.
//! * The completer writes every completion that is waiting in one fenced statement, so
//!   batching grows with load and costs no latency when idle.
//!
//! Database errors anywhere are logged and retried with back-off; nothing is dropped.
//! A completion that cannot be written before the process exits is not lost either: the
//! row stays `running`, its lease expires, and the next claim records the attempt as
//! ambiguous.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::Pool;
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio_postgres::error::SqlState;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::claim::{self, Claimed, Completion};
use crate::config::WorkerConfig;
use crate::deliver::{Deliverers, Outgoing, Ready};
use crate::model::AttemptOutcome;
use crate::model::Channel;
use crate::model::ErrorClass;
use crate::queries;
use crate::state::{Budget, decide};
use crate::support::lock;

/// Counts of what a run did, returned when it stops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Attempts that delivered.
    pub delivered: u64,
    /// Attempts that failed and were scheduled again.
    pub retried: u64,
    /// Attempts (and expired leases) that dead-lettered a message.
    pub dead: u64,
    /// Attempts whose result was not recorded because the lease had been taken over.
    pub lease_lost: u64,
    /// Claimed messages given back unstarted at shutdown.
    pub released: u64,
}

/// Why the worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A task of the worker panicked (a bug).
    #[error("worker task failed: {0}")]
    Task(String),
    /// The lease leaves no room for a channel's attempts: none could ever start.
    #[error("the lease ({lease:?}) is too short for {channel} attempts of up to {timeout:?}")]
    LeaseTooShort {
        /// The channel.
        channel: Channel,
        /// Its attempt timeout.
        timeout: Duration,
        /// The configured lease.
        lease: Duration,
    },
}

/// What a delivery task hands to the completer.
enum Done {
    Completed(Completion, AttemptLog),
    Released(i64, Uuid),
}

/// What the attempt's log event needs beyond the completion.
struct AttemptLog {
    key: String,
    channel: Channel,
    max_attempts: i32,
    duration: Duration,
}

/// State shared by the loop, the delivery tasks and the completer.
struct Shared {
    cfg: WorkerConfig,
    pool: Pool,
    deliverers: Deliverers,
    /// Wakes the claim loop: a notification, a freed slot, a flushed completion.
    wake: Notify,
    /// Claimed and not yet completed or released (in the database's view: rows we lease).
    inflight: AtomicUsize,
    /// Set at shutdown: tasks that have not started release their row instead.
    stopping: CancellationToken,
    summary: Mutex<RunSummary>,
}

/// A worker: a pool, settings, and the channels it delivers on.
pub struct Worker {
    shared: Arc<Shared>,
    listen: Option<tokio_postgres::Config>,
}

impl Worker {
    /// A worker using `pool` for claims and completions. `listen`: connection settings for
    /// the LISTEN connection (None polls only).
    pub fn new(
        pool: Pool,
        cfg: WorkerConfig,
        deliverers: Deliverers,
        listen: Option<tokio_postgres::Config>,
    ) -> Self {
        let listen = if cfg.listen { listen } else { None };
        Worker {
            shared: Arc::new(Shared {
                cfg,
                pool,
                deliverers,
                wake: Notify::new(),
                inflight: AtomicUsize::new(0),
                stopping: CancellationToken::new(),
                summary: Mutex::new(RunSummary::default()),
            }),
            listen,
        }
    }

    /// Runs until `shutdown` resolves (or, with `drain`, until nothing is left to do),
    /// then finishes in-flight attempts within the grace period.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<RunSummary, WorkerError> {
        let shared = self.shared;
        let cfg = &shared.cfg;
        // Start-up's rule (WorkerConfig::validate), for a worker built by hand: one whose
        // lease leaves an attempt no time to wait for a slot would claim and release the
        // same rows for ever.
        for &channel in &cfg.channels {
            if let Some(timeout) = shared.deliverers.timeout(channel) {
                if !cfg.attempt_fits(crate::config::LEASE_MIN_WAIT, timeout) {
                    return Err(WorkerError::LeaseTooShort {
                        channel,
                        timeout,
                        lease: cfg.lease,
                    });
                }
            }
        }
        tracing::info!(
            worker_id = %cfg.worker_id,
            channels = ?cfg.channels.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
            concurrency = cfg.concurrency,
            batch_size = cfg.batch_size,
            "worker started"
        );
        let (done_tx, done_rx) = mpsc::channel::<Done>(cfg.concurrency.max(16) * 2);
        let hard_stop = CancellationToken::new();
        let completer = tokio::spawn(completer(shared.clone(), done_rx, hard_stop.clone()));
        // Whether the loop is idle (its last claim came back short): the listener then holds
        // the idle mark, so that enqueueing transactions notify.
        let (idle_tx, idle_rx) = watch::channel(false);
        let listener = self
            .listen
            .map(|pg| tokio::spawn(listen(pg, shared.clone(), idle_rx)));

        let slots = Arc::new(Semaphore::new(cfg.concurrency));
        // Rows claimed ahead of free slots: each waits in its task for a slot, so a slot
        // that frees starts its next message at once instead of after a claim's round trip
        // (with a backlog, that round trip is what left slots idle). At most one batch
        // ahead, never more than the concurrency.
        let capacity = cfg.concurrency + cfg.concurrency.min(cfg.batch_size);
        let mut lanes = Lane::plan(&cfg.channels, &shared.deliverers, capacity);
        let mut tasks = JoinSet::new();
        let mut db_backoff = Backoff::new();
        tokio::pin!(shutdown);

        'run: loop {
            while tasks.try_join_next().is_some() {}
            let mut free = capacity.saturating_sub(tasks.len());
            let mut claimed_any = false;
            // Some claim came back full: more is due, claim again without waiting.
            let mut full = false;
            let mut picked_total = 0;
            let mut failed = None;
            for lane in &mut lanes {
                let room = free.min(lane.room());
                // With a backlog, wait until a useful number of slots is free so each claim
                // fetches a batch rather than one row per finished delivery; when the queue
                // is idle, any free slot takes a new message at once.
                if room < lane.threshold(cfg) {
                    continue;
                }
                let want = room.min(cfg.batch_size);
                // Taken before the claim: the lease runs from the claim's statement, so
                // this is never later than the lease's own start.
                let claimed_at = Instant::now();
                // Bounded, and raced against shutdown: a database that stops answering must
                // neither freeze the loop nor delay a SIGTERM. A claim cut off after it
                // committed leaves rows leased to us that we never saw; their leases expire
                // and the next claim takes them over (nothing was sent).
                // Shutdown is checked first: a stop that is already due never starts a claim.
                let claimed = tokio::select! {
                    biased;
                    _ = &mut shutdown => break 'run,
                    r = bounded(async {
                        let client = checkout(&shared.pool).await?;
                        claim::claim_cached(&client, &lane.channels, want, &cfg.worker_id, cfg.lease)
                            .await
                            .map_err(|e| crate::db::describe(&e))
                    }) => r,
                };
                let batch = match claimed {
                    Ok(b) => b,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                };
                claimed_any = true;
                log_gave_up(&shared, &batch.gave_up);
                // Rows dead-lettered by the claim took places in the batch too.
                let picked = batch.claimed.len() + batch.gave_up.len();
                picked_total += picked;
                free = free.saturating_sub(batch.claimed.len());
                crate::metrics::claim_batch(batch.claimed.len());
                for msg in batch.claimed {
                    spawn_attempt(&mut tasks, &shared, &slots, &done_tx, lane, msg, claimed_at);
                }
                lane.backlog = picked == want;
                full |= lane.backlog;
            }
            if let Some(e) = failed {
                let wait = db_backoff.next();
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "claim failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => continue,
                    _ = &mut shutdown => break,
                }
            }
            if !claimed_any {
                // Every lane is full: a finished delivery wakes the loop.
                tokio::select! {
                    _ = shared.wake.notified() => continue,
                    _ = &mut shutdown => break,
                }
            }
            db_backoff.reset();
            // Idle while any lane's last claim came back short: that lane needs wake-ups.
            let busy = lanes.iter().all(|l| l.backlog);
            idle_tx.send_if_modified(|idle| {
                let changed = *idle == busy;
                *idle = !busy;
                changed
            });
            if full {
                continue;
            }
            if cfg.drain && picked_total == 0 && shared.inflight.load(Ordering::SeqCst) == 0 {
                match drain_done(&shared).await {
                    Ok(true) => {
                        tracing::info!(
                            "drained: nothing pending or running on this worker's channels"
                        );
                        break;
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "drain check failed"),
                }
            }
            tokio::select! {
                _ = shared.wake.notified() => {}
                _ = tokio::time::sleep(cfg.poll_interval) => {}
                _ = &mut shutdown => break,
            }
        }

        // Shutdown: stop claiming (done), let in-flight attempts finish within the grace
        // period; attempts not started yet release their rows.
        shared.stopping.cancel();
        let deadline = tokio::time::Instant::now() + cfg.shutdown_grace;
        while tasks.try_join_next().is_some() {}
        if !tasks.is_empty() {
            tracing::info!(
                in_flight = tasks.len(),
                grace_ms = cfg.shutdown_grace.as_millis() as u64,
                "stopping: finishing in-flight attempts"
            );
        }
        let finished = tokio::time::timeout_at(deadline, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if finished.is_err() {
            tracing::warn!(
                abandoned = tasks.len(),
                "grace period over: abandoning in-flight attempts (their leases will expire and the attempts count as ambiguous)"
            );
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
        }
        drop(done_tx);
        // Give the completer until the deadline (at least a few seconds) to write what is
        // left; past that, pending writes are abandoned to lease expiry.
        let completer_deadline = deadline.max(tokio::time::Instant::now() + Duration::from_secs(5));
        let stopper = hard_stop.clone();
        let guard = tokio::spawn(async move {
            tokio::time::sleep_until(completer_deadline).await;
            stopper.cancel();
        });
        let completed = completer.await;
        guard.abort();
        if let Some(l) = listener {
            l.abort();
        }
        if let Err(e) = completed {
            return Err(WorkerError::Task(e.to_string()));
        }
        let summary = lock(&shared.summary).clone();
        tracing::info!(
            delivered = summary.delivered,
            retried = summary.retried,
            dead = summary.dead,
            lease_lost = summary.lease_lost,
            released = summary.released,
            "worker stopped"
        );
        Ok(summary)
    }
}

/// Channels claimed together under one bound on how many of their messages are in flight.
///
/// A channel that bounds its own sends (e-mail: the relay's connections) has a lane of its
/// own, capped there: rows claimed beyond that bound would only queue for a connection
/// while their leases run. The other channels share one lane, bounded by the loop's
/// capacity alone.
struct Lane {
    channels: Vec<Channel>,
    /// Most of this lane's messages in flight at once.
    cap: usize,
    /// This lane's delivery tasks that have not ended.
    inflight: Arc<AtomicUsize>,
    /// The lane's last claim came back full: more is due.
    backlog: bool,
}

impl Lane {
    fn plan(channels: &[Channel], deliverers: &Deliverers, capacity: usize) -> Vec<Lane> {
        let lane = |channels, cap| Lane {
            channels,
            cap,
            inflight: Arc::new(AtomicUsize::new(0)),
            backlog: false,
        };
        let mut lanes = Vec::new();
        let mut shared = Vec::new();
        for &c in channels {
            match deliverers.capacity(c) {
                Some(n) => lanes.push(lane(vec![c], n.clamp(1, capacity))),
                None => shared.push(c),
            }
        }
        if !shared.is_empty() {
            lanes.push(lane(shared, capacity));
        }
        lanes
    }

    /// How many more of this lane's messages may be claimed now.
    fn room(&self) -> usize {
        self.cap
            .saturating_sub(self.inflight.load(Ordering::SeqCst))
    }

    /// The least room worth a claim.
    fn threshold(&self, cfg: &WorkerConfig) -> usize {
        if self.backlog {
            (cfg.batch_size.min(cfg.concurrency).min(self.cap) / 4).max(1)
        } else {
            1
        }
    }
}

/// Counts a delivery task in its lane until the task ends.
struct InLane(Arc<AtomicUsize>);

impl InLane {
    fn enter(count: &Arc<AtomicUsize>) -> InLane {
        count.fetch_add(1, Ordering::SeqCst);
        InLane(count.clone())
    }
}

impl Drop for InLane {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Logs the rows a claim dead-lettered because their lease had expired.
fn log_gave_up(shared: &Shared, gave_up: &[claim::GaveUp]) {
    for g in gave_up {
        tracing::warn!(
            message_id = g.id,
            key = %crate::text::Escaped(&g.key),
            channel = %g.channel,
            attempt = %format_args!("{}/{}", g.attempt, g.max_attempts),
            outcome = "dead",
            error_class = "ambiguous",
            "lease expired while running and no retry is allowed; dead-lettered"
        );
        crate::metrics::gave_up(g.channel);
    }
    if !gave_up.is_empty() {
        lock(&shared.summary).dead += gave_up.len() as u64;
    }
}

/// One task for one claimed row: it waits for a delivery slot and for its channel, then
/// makes the attempt if it still fits in the lease, or gives the row back unsent.
fn spawn_attempt(
    tasks: &mut JoinSet<()>,
    shared: &Arc<Shared>,
    slots: &Arc<Semaphore>,
    done_tx: &mpsc::Sender<Done>,
    lane: &Lane,
    msg: Claimed,
    claimed_at: Instant,
) {
    shared.inflight.fetch_add(1, Ordering::SeqCst);
    let in_lane = InLane::enter(&lane.inflight);
    let shared = shared.clone();
    let tx = done_tx.clone();
    let slots = slots.clone();
    tasks.spawn(async move {
        // Wait for a delivery slot; at shutdown, give the row back instead.
        let permit = tokio::select! {
            p = slots.acquire_owned() => p.ok(),
            _ = shared.stopping.cancelled() => None,
        };
        let done = match permit {
            Some(_) => attempt_if_it_fits(&shared, msg, claimed_at).await,
            None => Done::Released(msg.id, msg.lease_token),
        };
        // Keep the slot until the completer has room: that is the backpressure that stops
        // claims while the database cannot keep up.
        let _ = tx.send(done).await;
        drop(permit);
        drop(in_lane);
        shared.wake.notify_one();
    });
}

/// Waits until the channel can send, then starts the attempt only if its whole timeout
/// still fits in the lease with a margin ([`WorkerConfig::attempt_fits`]): a row that
/// waited too long for a slot or a connection is given back unsent, rather than sent with a
/// lease that may run out mid-request (another worker would then send it again while this
/// request is still in flight).
async fn attempt_if_it_fits(shared: &Shared, msg: Claimed, claimed_at: Instant) -> Done {
    let ready = tokio::select! {
        r = shared.deliverers.ready(msg.channel) => r,
        _ = shared.stopping.cancelled() => return Done::Released(msg.id, msg.lease_token),
    };
    if !shared
        .cfg
        .attempt_fits(claimed_at.elapsed(), ready.timeout())
    {
        tracing::debug!(
            message_id = msg.id,
            waited_ms = claimed_at.elapsed().as_millis() as u64,
            "the attempt would not end inside its lease; giving the row back unsent"
        );
        return Done::Released(msg.id, msg.lease_token);
    }
    attempt(shared, msg, ready).await
}

/// How long one database call of the loop may take before it counts as failed.
const DB_TIMEOUT: Duration = Duration::from_secs(30);

/// One database call of the loop, bounded by [`DB_TIMEOUT`]; failures as one line.
async fn bounded<T>(call: impl Future<Output = Result<T, String>>) -> Result<T, String> {
    tokio::time::timeout(DB_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {}s", DB_TIMEOUT.as_secs())))
}

/// A pooled connection, or why there is none, as one line.
async fn checkout(pool: &Pool) -> Result<deadpool_postgres::Object, String> {
    pool.get().await.map_err(|e| crate::db::describe_pool(&e))
}

async fn drain_done(shared: &Shared) -> Result<bool, String> {
    let unfinished = bounded(async {
        let client = checkout(&shared.pool).await?;
        claim::has_unfinished(&**client, &shared.cfg.channels)
            .await
            .map_err(|e| crate::db::describe(&e))
    })
    .await?;
    Ok(!unfinished)
}

/// One attempt: send, classify, decide. Never touches the database.
async fn attempt(shared: &Shared, msg: Claimed, ready: Ready<'_>) -> Done {
    if shared.stopping.is_cancelled() {
        return Done::Released(msg.id, msg.lease_token);
    }
    let started_at = SystemTime::now();
    let t0 = Instant::now();
    let result = ready
        .send(Outgoing {
            key: &msg.key,
            payload: &msg.payload,
        })
        .await;
    let duration = t0.elapsed();
    let budget = Budget {
        attempt: msg.attempt,
        max_attempts: msg.max_attempts,
        retry_ambiguous: msg.retry_ambiguous,
    };
    let jitter: f64 = rand::random();
    let completion = match result {
        Ok(ok) => Completion {
            id: msg.id,
            lease_token: msg.lease_token,
            attempt: msg.attempt,
            transition: decide(None, budget, &shared.cfg.retry, None, jitter),
            error: None,
            status: ok.status,
            deduplicated: ok.deduplicated,
            response: Some(ok.response),
            started_at,
        },
        Err(err) => {
            let transition = decide(
                Some(err.class),
                budget,
                &shared.cfg.retry,
                err.retry_after,
                jitter,
            );
            let error = match transition.error_class() {
                Some(ErrorClass::Exhausted) => {
                    format!(
                        "{} (attempt {} of {}: retries exhausted)",
                        err.message, msg.attempt, msg.max_attempts
                    )
                }
                _ => err.message.clone(),
            };
            Completion {
                id: msg.id,
                lease_token: msg.lease_token,
                attempt: msg.attempt,
                transition,
                error: Some(error),
                status: err.status,
                deduplicated: false,
                response: err.response,
                started_at,
            }
        }
    };
    let log = AttemptLog {
        key: msg.key,
        channel: msg.channel,
        max_attempts: msg.max_attempts,
        duration,
    };
    Done::Completed(completion, log)
}

/// Runs a database write (`$op`, an expression using `$client`) until it succeeds, backing
/// off between tries; gives up (None) only when `$stop` fires: shutdown past its grace.
macro_rules! retry_db {
    ($shared:expr, $stop:expr, $what:literal, |$client:ident| $op:expr) => {{
        let mut backoff = Backoff::new();
        loop {
            // Bounded, and raced against the hard stop, so that neither a silent database
            // nor shutdown can leave the completer stuck inside a write.
            let attempt = bounded(async {
                let obj = checkout(&$shared.pool).await?;
                let $client: &deadpool_postgres::Client = &obj;
                $op.await.map_err(|e| crate::db::describe(&e))
            });
            let result = tokio::select! {
                r = attempt => r,
                _ = $stop.cancelled() => break None,
            };
            match result {
                Ok(v) => break Some(v),
                Err(e) => {
                    let wait = backoff.next();
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, concat!($what, " failed; retrying"));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = $stop.cancelled() => break None,
                    }
                }
            }
        }
    }};
}

/// Most completions written by one statement.
const MAX_FLUSH: usize = 1024;

/// Writes completions and releases in batches: everything waiting when it gets to run.
async fn completer(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Done>,
    hard_stop: CancellationToken,
) {
    let mut buf = Vec::with_capacity(MAX_FLUSH);
    loop {
        buf.clear();
        if rx.recv_many(&mut buf, MAX_FLUSH).await == 0 {
            return;
        }
        let mut completions = Vec::new();
        let mut logs = Vec::new();
        let mut releases = Vec::new();
        for d in buf.drain(..) {
            match d {
                Done::Completed(c, l) => {
                    completions.push(c);
                    logs.push(l);
                }
                Done::Released(id, token) => releases.push((id, token)),
            }
        }
        let n = completions.len() + releases.len();
        if !completions.is_empty() {
            let recorded = retry_db!(shared, hard_stop, "recording attempts", |client| {
                claim::complete_cached(client, &shared.cfg.worker_id, &completions)
            });
            match recorded {
                Some(outcomes) => log_attempts(&shared, &completions, &logs, &outcomes),
                None => tracing::error!(
                    count = completions.len(),
                    "could not record attempts before shutdown; their leases will expire and they will count as ambiguous"
                ),
            }
        }
        if !releases.is_empty() {
            let released = retry_db!(shared, hard_stop, "releasing messages", |client| {
                claim::release(&***client, &shared.cfg.worker_id, &releases)
            });
            if let Some(ids) = released {
                for id in &ids {
                    tracing::info!(
                        message_id = id,
                        outcome = "released",
                        "claimed message released unstarted"
                    );
                }
                lock(&shared.summary).released += ids.len() as u64;
            }
        }
        shared.inflight.fetch_sub(n, Ordering::SeqCst);
        shared.wake.notify_one();
    }
}

fn log_attempts(
    shared: &Shared,
    completions: &[Completion],
    logs: &[AttemptLog],
    outcomes: &[(i64, AttemptOutcome)],
) {
    // One lookup per completion (a linear search per completion was quadratic in the
    // flush size).
    let by_id: std::collections::HashMap<i64, AttemptOutcome> = outcomes.iter().copied().collect();
    let mut summary = lock(&shared.summary);
    for (c, l) in completions.iter().zip(logs) {
        let outcome = by_id
            .get(&c.id)
            .copied()
            .unwrap_or(AttemptOutcome::LeaseLost);
        crate::metrics::attempt(l.channel, outcome, l.duration);
        match outcome {
            AttemptOutcome::Delivered => summary.delivered += 1,
            AttemptOutcome::Retry => summary.retried += 1,
            AttemptOutcome::Dead => summary.dead += 1,
            AttemptOutcome::LeaseLost => summary.lease_lost += 1,
            AttemptOutcome::Released | AttemptOutcome::Replayed => {}
        }
        let class = c.transition.error_class().map(ErrorClass::as_str);
        let attempt = format_args!("{}/{}", c.attempt, l.max_attempts);
        let duration_ms = l.duration.as_millis() as u64;
        match outcome {
            AttemptOutcome::Delivered | AttemptOutcome::Retry => tracing::info!(
                message_id = c.id, key = %crate::text::Escaped(&l.key), channel = %l.channel, attempt = %attempt,
                outcome = outcome.as_str(), error_class = class, status = c.status,
                duration_ms, deduplicated = c.deduplicated, error = c.error.as_deref(),
                "attempt finished"
            ),
            _ => tracing::warn!(
                message_id = c.id, key = %crate::text::Escaped(&l.key), channel = %l.channel, attempt = %attempt,
                outcome = outcome.as_str(), error_class = class, status = c.status,
                duration_ms, deduplicated = c.deduplicated, error = c.error.as_deref(),
                "attempt finished"
            ),
        }
    }
}

/// Keeps a LISTEN connection open, turns notifications into wake-ups, and holds the idle
/// mark while the claim loop is idle. A burst of notifications is one wake-up (Notify holds
/// at most one permit). After every (re)connect it wakes the loop once, in case something
/// was committed while it was not listening.
///
/// Enqueueing transactions notify only while some worker holds the idle mark (the protocol
/// and why it loses no wake-up are in `sql/0005_wakeups_for_idle_workers.sql`): a busy
/// worker claims again whenever a slot frees and needs no notification, and notifying
/// transactions cannot share a WAL flush at commit.
async fn listen(pg: tokio_postgres::Config, shared: Arc<Shared>, mut idle: watch::Receiver<bool>) {
    let mut backoff = Backoff::new();
    loop {
        match pg.connect(tokio_postgres::NoTls).await {
            Ok((client, mut conn)) => {
                let (tx, mut rx) = mpsc::unbounded_channel::<()>();
                let driver = tokio::spawn(async move {
                    loop {
                        match std::future::poll_fn(|cx| conn.poll_message(cx)).await {
                            Some(Ok(tokio_postgres::AsyncMessage::Notification(_))) => {
                                if tx.send(()).is_err() {
                                    return None;
                                }
                            }
                            Some(Ok(_)) => {}
                            Some(Err(e)) => return Some(e),
                            None => return None,
                        }
                    }
                });
                match client.batch_execute(queries::LISTEN_SETUP).await {
                    Ok(()) => {
                        backoff.reset();
                        tracing::debug!("listening for outbox_messages");
                        shared.wake.notify_one();
                        if let Err(e) = serve_wakeups(&client, &shared, &mut rx, &mut idle).await {
                            tracing::warn!(error = %e, "LISTEN connection failed");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "LISTEN failed"),
                }
                drop(client);
                if let Ok(Some(e)) = driver.await {
                    tracing::warn!(error = %e, "LISTEN connection lost; polling until it is back");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot open the LISTEN connection; polling until it is back")
            }
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

/// Where a LISTEN connection stands with the idle mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// Not held: enqueuers do not notify on this worker's account.
    None,
    /// Held, but transactions that decided not to notify before it was taken may still be
    /// open: the loop cannot yet rely on wake-ups.
    Held,
    /// Held and the gate passed: every later enqueue notifies, every earlier one is
    /// visible to the claim this transition triggers.
    Armed,
}

/// Serves one LISTEN connection until it fails or the worker goes away.
async fn serve_wakeups(
    client: &tokio_postgres::Client,
    shared: &Shared,
    notifications: &mut mpsc::UnboundedReceiver<()>,
    idle: &mut watch::Receiver<bool>,
) -> Result<(), tokio_postgres::Error> {
    let mut mark = Mark::None;
    let mut retry = Backoff::quick();
    loop {
        let want = *idle.borrow_and_update();
        let moved = match (want, mark) {
            (true, Mark::None) => take_idle_mark(client).await?.then_some(Mark::Held),
            (true, Mark::Held) => match client.batch_execute(queries::IDLE_GATE).await {
                Ok(()) => {
                    retry.reset();
                    // The claim that sees whatever was enqueued without a notification.
                    shared.wake.notify_one();
                    Some(Mark::Armed)
                }
                // lock_timeout: an enqueueing transaction is still open; try again.
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => None,
                Err(e) => return Err(e),
            },
            (false, Mark::Held | Mark::Armed) => {
                client.batch_execute(queries::IDLE_UNMARK).await?;
                Some(Mark::None)
            }
            _ => None,
        };
        if let Some(next) = moved {
            mark = next;
            continue;
        }
        // Not where the loop wants to be yet: try again shortly. Until the mark is armed
        // the loop still polls, so a slow gate delays wake-ups, never loses them.
        let retry_in = (want && mark != Mark::Armed).then(|| retry.next());
        tokio::select! {
            n = notifications.recv() => match n {
                Some(()) => shared.wake.notify_one(),
                None => return Ok(()),
            },
            changed = idle.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            _ = tokio::time::sleep(retry_in.unwrap_or_default()), if retry_in.is_some() => {}
        }
    }
}

/// [`queries::IDLE_MARK`]: true when the mark is now held by this session.
async fn take_idle_mark(client: &tokio_postgres::Client) -> Result<bool, tokio_postgres::Error> {
    let messages = client.simple_query(queries::IDLE_MARK).await?;
    Ok(messages.iter().any(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0) == Some("t"),
        _ => false,
    }))
}

/// Exponential back-off for the worker's own database retries: 100 ms doubling to 10 s,
/// with jitter (backon's schedule).
struct Backoff {
    builder: backon::ExponentialBuilder,
    iter: Option<backon::ExponentialBackoff>,
}

impl Backoff {
    fn new() -> Self {
        use backon::BackoffBuilder as _;
        let builder = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(10))
            .with_jitter()
            .without_max_times();
        Backoff {
            iter: Some(builder.build()),
            builder,
        }
    }

    /// 1 ms doubling to 100 ms: retries on a healthy connection that wait for another
    /// transaction, not for the database to come back.
    fn quick() -> Self {
        use backon::BackoffBuilder as _;
        let builder = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(1))
            .with_max_delay(Duration::from_millis(100))
            .without_max_times();
        Backoff {
            iter: Some(builder.build()),
            builder,
        }
    }

    fn next(&mut self) -> Duration {
        use backon::BackoffBuilder as _;
        let builder = self.builder;
        self.iter
            .get_or_insert_with(|| builder.build())
            .next()
            .unwrap_or(Duration::from_secs(10))
    }

    fn reset(&mut self) {
        self.iter = None;
    }
}
