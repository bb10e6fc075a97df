//! The worker loop: claim, deliver with bounded concurrency, complete in batches.
//!
//! ```text
//!   claim loop ──(Claimed)──▶ delivery tasks (≤ concurrency) ──(Done)──▶ completer
//!       ▲                                                                  │
//!       └────────────── wake: LISTEN, a freed slot, poll interval ◀────────┘
//! ```
//!
//! * The claim loop asks for as many rows as it has free slots, plus rows ahead: what the
//!   slots start in a few claims' round trips, at most two batches per claim in flight
//!   (at most `batch_size` per claim), in one short committed statement; under a backlog a
//!   second claim runs while the first waits for its commit.
//!   A row claimed ahead waits in its task for a slot, and asks the breaker again before
//!   its request. No transaction is open while a message is sent.
//! * A channel that bounds its own sends (e-mail: the relay's connections) is claimed in a
//!   lane of its own, never past that bound.
//! * An attempt starts only when its whole timeout, and a margin, still fit in the lease
//!   ([`WorkerConfig::attempt_fits`]); a row that waited too long is released unsent, so a
//!   lease never runs out while its request is in flight.
//! * Each delivery runs in its own task holding a semaphore permit; its result goes through
//!   [`decide`](crate::state::decide) and then to the completer.
//! * The completer writes every completion that is waiting in one fenced statement, so
//!   batching grows with load and costs no latency when idle.
//!
//! The rooms: `claim_loop` (the loop's steps), `lane` (which channels a claim asks
//! for), `pace` (how many rows to claim ahead of the free slots), `attempt` (one delivery
//! task), `completer` (batched writes and the attempt log), `wakeup` (LISTEN and the idle
//! mark), `db_call` (bounded database calls, back-off), `pools` (which connections run
//! which statements, and with what settings), `sweep` (expired leases, beside the loop),
//! `alarms` (when deferred messages come due), `pauses` (destinations a person paused,
//! read every poll interval), `endpoints` (the http channel's table, read every few
//! seconds) and [`maintenance`] (retention, the watches and the backlog sampler, beside
//! the loop).
//!
//! Database errors anywhere are logged and retried with back-off; nothing is dropped.
//! A completion that cannot be written before the process exits is not lost either: the
//! row stays `running`, its lease expires, and the lease sweep ([`sweep`]) records the
//! attempt as ambiguous.

mod alarms;
mod attempt;
mod breakers;
mod claim_loop;
mod completer;
mod db_call;
mod destinations;
mod endpoints;
mod lane;
pub mod maintenance;
mod pace;
mod pauses;
mod pools;
mod sweep;
mod wakeup;

pub use pools::{PLAN_REFRESH, Pools};

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::WorkerConfig;
use crate::deliver::Deliverers;
use crate::model::Channel;
use crate::support::lock;
use attempt::Done;
use claim_loop::ClaimLoop;

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
    /// Claimed messages given back unsent to be tried later, uncounted (`state::Deferral`).
    pub deferred: u64,
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

/// State shared by the loop, the delivery tasks and the completer.
struct Shared {
    cfg: WorkerConfig,
    /// The claims' and completions' pool, and the one for everything else.
    pools: Pools,
    deliverers: Deliverers,
    /// Wakes the claim loop: a notification, a freed slot, a flushed completion.
    wake: Notify,
    /// Claimed and not yet completed or released (in the database's view: rows we lease).
    inflight: AtomicUsize,
    /// Set at shutdown: tasks that have not started release their row instead.
    stopping: CancellationToken,
    summary: Mutex<RunSummary>,
    /// The limits per destination of this process.
    gates: destinations::Gates,
    /// When deferred messages come due again ([`alarms`]).
    alarms: alarms::Alarms,
    /// Circuit breakers per destination (`--breaker-threshold`), shared through the database.
    breakers: breakers::Breakers,
    /// Destinations a person paused, as last read from the database.
    pauses: pauses::Pauses,
    /// How long a delivery task holds its slot, on average: how many rows the claim loop
    /// claims ahead follows it ([`pace`]).
    slot_time: pace::Ewma,
}

/// How long a stop waits for a lease sweep in progress.
const SWEEP_AT_STOP: Duration = Duration::from_secs(2);

/// How long after a deferred message's due time the claim loop looks for it.
const ALARM_MARGIN: Duration = Duration::from_millis(5);

/// Most claims in flight at once, over every lane. A claim's statement waits for its
/// commit to reach the disk before it answers (an attempt is counted before it is sent),
/// and under a backlog the deliveries used up a batch claimed ahead sooner than the next
/// claim came back: the two cores sat idle a fifth of a drain while the one claim in flight
/// waited for its flush. A second claim, on its own
/// connection, runs while the first waits. More would only queue behind the same disk.
const MAX_CLAIMS: usize = 2;

impl Shared {
    /// Wakes the idle claim loop at `at`.
    fn alarm(&self, at: Instant) {
        self.alarms.set(at);
    }
}

/// A worker: a pool, settings, and the channels it delivers on.
pub struct Worker {
    shared: Arc<Shared>,
    listen: Option<crate::db::Database>,
}

impl Worker {
    /// A worker using `pools` (a [`Pools`], or one pool for everything) for its
    /// statements. `listen`: connection settings for the LISTEN connection (None polls
    /// only).
    pub fn new(
        pools: impl Into<Pools>,
        cfg: WorkerConfig,
        deliverers: Deliverers,
        listen: Option<crate::db::Database>,
    ) -> Self {
        let listen = if cfg.listen { listen } else { None };
        let pools = pools.into();
        let gates = destinations::Gates::new(cfg.limits.clone(), deliverers.webhook.timeout());
        let breakers = breakers::Breakers::new(&cfg, deliverers.webhook.timeout());
        Worker {
            shared: Arc::new(Shared {
                gates,
                alarms: alarms::Alarms::default(),
                cfg,
                pools,
                deliverers,
                wake: Notify::new(),
                inflight: AtomicUsize::new(0),
                stopping: CancellationToken::new(),
                summary: Mutex::new(RunSummary::default()),
                breakers,
                pauses: pauses::Pauses::default(),
                slot_time: pace::Ewma::default(),
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
        check_lease(&shared)?;
        let cfg = &shared.cfg;
        tracing::info!(
            worker_id = %cfg.worker_id,
            channels = ?cfg.channels.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
            concurrency = cfg.concurrency,
            batch_size = cfg.batch_size,
            "worker started"
        );
        let (done_tx, done_rx) = mpsc::channel::<Done>(cfg.concurrency.max(16) * 2);
        let hard_stop = CancellationToken::new();
        let completer = tokio::spawn(completer::completer(
            shared.clone(),
            done_rx,
            hard_stop.clone(),
        ));
        // Whether the loop is idle (its last claim came back short): the listener then holds
        // the idle mark, so that enqueueing transactions notify.
        let (idle_tx, idle_rx) = watch::channel(false);
        let listener = self
            .listen
            .map(|pg| tokio::spawn(wakeup::listen(pg, shared.clone(), idle_rx)));

        // Every 20 polls, at least each second and at most each minute.
        let watch_every =
            (cfg.poll_interval * 20).clamp(Duration::from_secs(1), Duration::from_secs(60));
        let watch_stop = CancellationToken::new();
        let watch = tokio::spawn(maintenance::ordering_watch(
            shared.pools.general.clone(),
            watch_every,
            watch_stop.clone(),
        ));
        // The backlog, minute by minute, for the console's chart.
        let sampler = tokio::spawn(maintenance::backlog_sampler(
            shared.pools.general.clone(),
            maintenance::BACKLOG_SAMPLE_EVERY,
            watch_stop.clone(),
        ));
        // Only a worker that leaves some channel out looks for that channel's waiting
        // messages.
        let unserved = crate::model::Channel::ALL
            .iter()
            .any(|c| !cfg.channels.contains(c))
            .then(|| {
                tokio::spawn(maintenance::unserved_watch(
                    shared.pools.general.clone(),
                    cfg.channels.clone(),
                    watch_every,
                    watch_stop.clone(),
                ))
            });
        // The http channel's endpoints before the first claim, then every few seconds.
        let endpoint_watch = cfg.channels.contains(&Channel::Http).then(|| {
            let pool = shared.pools.general.clone();
            let table = shared.deliverers.http.endpoints().clone();
            let stop = watch_stop.clone();
            tokio::spawn(async move {
                if let Err(e) = endpoints::refresh(&pool, &table).await {
                    tracing::warn!(error = %e, "reading outbox.endpoints failed; will try again");
                }
                endpoints::watch(pool, table, stop).await;
            })
        });
        // The breakers' view before the first claim, so that its rows meet the gate with
        // what other workers opened; later refreshes run beside the loop.
        shared
            .breakers
            .refresh(&shared.pools.general, Duration::ZERO)
            .await;
        shared.pauses.refresh(&shared.pools.general).await;
        let sweep_stop = CancellationToken::new();
        let mut sweep = tokio::spawn(sweep::expired_leases(shared.clone(), sweep_stop.clone()));
        let mut claims = ClaimLoop::new(shared.clone(), done_tx, idle_tx);
        claims.run(shutdown).await;
        // No more sweeps once the loop stops claiming: what they settled would not be claimed
        // by this worker, and one started now could hold the stop up by a database timeout.
        sweep_stop.cancel();
        // Nor wake-ups: the LISTEN connection goes now, and with it the idle mark, so that
        // enqueuers stop notifying on this worker's account while it finishes.
        if let Some(l) = &listener {
            l.abort();
        }
        let (tasks, done_tx) = claims.into_parts();

        let completed = shut_down(&shared, tasks, done_tx, completer, hard_stop).await;
        watch_stop.cancel();
        let _ = watch.await;
        let _ = sampler.await;
        if let Some(unserved) = unserved {
            let _ = unserved.await;
        }
        if let Some(endpoint_watch) = endpoint_watch {
            let _ = endpoint_watch.await;
        }
        // Before the summary is read: a sweep in progress counts what it settled first,
        // unless it is still waiting for a busy pool after SWEEP_AT_STOP (its statement,
        // if it runs, settles its rows whole; only its log lines would be missing).
        match tokio::time::timeout(SWEEP_AT_STOP, &mut sweep).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "the lease sweep failed"),
            Err(_) => {
                sweep.abort();
                tracing::warn!("stopping without waiting longer for a lease sweep in progress");
            }
        }
        completed?;
        let summary = lock(&shared.summary).clone();
        tracing::info!(
            delivered = summary.delivered,
            retried = summary.retried,
            dead = summary.dead,
            lease_lost = summary.lease_lost,
            released = summary.released,
            deferred = summary.deferred,
            "worker stopped"
        );
        Ok(summary)
    }
}

/// Start-up's rule (WorkerConfig::validate), for a worker built by hand: one whose lease
/// leaves an attempt no time to wait for a slot would claim and release the same rows for
/// ever.
fn check_lease(shared: &Shared) -> Result<(), WorkerError> {
    let cfg = &shared.cfg;
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
    Ok(())
}

/// Shutdown, once the loop has stopped claiming: let in-flight attempts finish within the
/// grace period (attempts not started yet release their rows), then give the completer
/// until the same deadline (at least a few seconds) to write what is left; past that,
/// pending writes are abandoned to lease expiry.
async fn shut_down(
    shared: &Shared,
    mut tasks: JoinSet<()>,
    done_tx: mpsc::Sender<Done>,
    completer: tokio::task::JoinHandle<()>,
    hard_stop: CancellationToken,
) -> Result<(), WorkerError> {
    let cfg = &shared.cfg;
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
    let completer_deadline = deadline.max(tokio::time::Instant::now() + Duration::from_secs(5));
    let stopper = hard_stop.clone();
    let guard = tokio::spawn(async move {
        tokio::time::sleep_until(completer_deadline).await;
        stopper.cancel();
    });
    let completed = completer.await;
    guard.abort();
    completed.map_err(|e| WorkerError::Task(e.to_string()))
}
