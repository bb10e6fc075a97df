//! The claim loop, as named steps: reap finished tasks, [`ClaimLoop::claim_round`] (one
//! claim per lane with room, each claimed row spawned as a delivery task), then
//! [`ClaimLoop::after_claim`] decides what comes next: claim again at once (a claim came
//! back full), wait for a slot (every lane is full), back off (the database failed), or
//! wait for a wake-up or the poll interval (idle; with `--drain`, stop when nothing is
//! left).

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use super::Shared;
use super::attempt::{Done, spawn_attempt};
use super::breakers::Gate;
use super::db_call::{Backoff, bounded, checkout};
use super::lane::Lane;
use crate::claim;
use crate::model::AttemptOutcome;
use crate::state::DeferReason;
use crate::support::lock;

/// The loop's state between rounds.
pub(super) struct ClaimLoop {
    shared: Arc<Shared>,
    /// One permit per delivery in flight (`--concurrency`).
    slots: Arc<Semaphore>,
    done_tx: mpsc::Sender<Done>,
    /// Tells the LISTEN task whether the loop is idle, so that it holds the idle mark.
    idle_tx: watch::Sender<bool>,
    /// Most delivery tasks at once: the concurrency plus up to two batches claimed ahead.
    capacity: usize,
    lanes: Vec<Lane>,
    tasks: JoinSet<()>,
    db_backoff: Backoff,
    /// When the claims' and completions' pool last threw its plans away
    /// ([`super::PLAN_REFRESH`]).
    plans_made: Instant,
}

/// What one round of claims found.
struct Round {
    /// At least one lane had room and claimed.
    claimed_any: bool,
    /// Some claim came back full: more is due.
    full: bool,
    /// Rows picked over every lane (dead-lettered ones included).
    picked: usize,
    /// Why a claim failed, if one did (the rest of the round was skipped).
    failed: Option<String>,
}

/// What the loop does after a round.
enum Next {
    /// More is due: claim again at once.
    ClaimAgain,
    /// Every lane is full: wait until a delivery finishes.
    WaitForSlot,
    /// The database failed: try again after this.
    BackOff(Duration),
    /// Idle: wait for a wake-up or the poll interval.
    Idle,
    /// `--drain` and nothing is left.
    Stop,
}

impl ClaimLoop {
    pub(super) fn new(
        shared: Arc<Shared>,
        done_tx: mpsc::Sender<Done>,
        idle_tx: watch::Sender<bool>,
    ) -> Self {
        let cfg = &shared.cfg;
        // Rows claimed ahead of free slots: each waits in its task for a slot, so a slot
        // that frees starts its next message at once instead of after a claim's round trip
        // (with a backlog, that round trip is what left slots idle). Up to two batches
        // ahead, never more than twice the concurrency: under load a claim's statement
        // shares the two cores with the deliveries, and one batch ahead ran out before the
        // next claim came back (bench/RESULTS.md, 2026-12-06: 1.13 with two). A row ahead
        // passed the breakers' gate at its claim; `Breakers::recheck` stops it before its
        // request if its host has opened since.
        let capacity = cfg.concurrency + 2 * cfg.concurrency.min(cfg.batch_size);
        ClaimLoop {
            slots: Arc::new(Semaphore::new(cfg.concurrency)),
            lanes: Lane::plan(&cfg.channels, &shared.deliverers, capacity),
            capacity,
            shared,
            done_tx,
            idle_tx,
            tasks: JoinSet::new(),
            db_backoff: Backoff::new(),
            plans_made: Instant::now(),
        }
    }

    /// Claims and spawns until `shutdown` resolves (or, with `--drain`, nothing is left).
    pub(super) async fn run(&mut self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = pin!(shutdown);
        loop {
            while let Some(ended) = self.tasks.try_join_next() {
                self.give_back_if_panicked(ended);
            }
            let Some(round) = self.claim_round(shutdown.as_mut()).await else {
                return;
            };
            let next = self.after_claim(round).await;
            let stopped = match next {
                Next::ClaimAgain => false,
                Next::Stop => true,
                Next::WaitForSlot => tokio::select! {
                    _ = self.shared.wake.notified() => false,
                    _ = shutdown.as_mut() => true,
                },
                Next::BackOff(wait) => tokio::select! {
                    _ = tokio::time::sleep(wait) => false,
                    _ = shutdown.as_mut() => true,
                },
                Next::Idle => {
                    // The poll interval, or sooner when a deferred message comes due.
                    let poll = Instant::now() + self.shared.cfg.poll_interval;
                    let until = self.shared.next_alarm().map_or(poll, |a| a.min(poll));
                    tokio::select! {
                        _ = self.shared.wake.notified() => false,
                        _ = tokio::time::sleep_until(until.into()) => false,
                        _ = shutdown.as_mut() => true,
                    }
                }
            };
            if stopped {
                return;
            }
        }
    }

    /// A delivery task that panicked sent no `Done`, so the completer will never give its
    /// place back: give it back here, or every such panic would cost the loop a place for
    /// good, until it claimed nothing at all. (Its row keeps its lease, which expires: an
    /// ambiguous attempt, settled by a later claim.)
    fn give_back_if_panicked(&self, ended: Result<(), tokio::task::JoinError>) {
        if let Err(e) = ended {
            if e.is_panic() {
                tracing::error!(
                    "a delivery task panicked; its message is settled when its lease expires"
                );
                self.shared.inflight.fetch_sub(1, Ordering::SeqCst);
                self.shared.wake.notify_one();
            }
        }
    }

    /// The delivery tasks still running, and the completer's sender, for shutdown.
    pub(super) fn into_parts(self) -> (JoinSet<()>, mpsc::Sender<Done>) {
        (self.tasks, self.done_tx)
    }

    /// One claim per lane with room, each row spawned as a delivery task. None when
    /// `shutdown` resolved first.
    async fn claim_round(
        &mut self,
        mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Option<Round> {
        let shared = &self.shared;
        let cfg = &shared.cfg;
        // A claimed row holds its place until the completer has recorded its outcome, not
        // only until its task ends: what the breakers learn from an outcome (`record`, run
        // by the completer before it frees the places) is then known before the places it
        // frees are claimed again. Counting tasks instead let a fast claim loop send a
        // failing host several more requests while the first failure was still being
        // written (with `--breaker-threshold 1`, up to 30 instead of at most 2). A delivery
        // gives its place back when its task hands it over (`Done::frees_place_when_sent`):
        // it teaches the breakers nothing that must come first.
        let mut free = self
            .capacity
            .saturating_sub(shared.inflight.load(Ordering::SeqCst));
        let mut round = Round {
            claimed_any: false,
            full: false,
            picked: 0,
            failed: None,
        };
        shared
            .breakers
            .refresh(&shared.pools.general, cfg.poll_interval)
            .await;
        if self.plans_made.elapsed() >= super::PLAN_REFRESH {
            shared.pools.refresh_plans();
            self.plans_made = Instant::now();
        }
        for lane in &mut self.lanes {
            let room = free.min(lane.room());
            // With a backlog, wait until a useful number of slots is free so each claim
            // fetches a batch rather than one row per finished delivery; when the queue
            // is idle, any free slot takes a new message at once.
            if room < lane.threshold(cfg) {
                continue;
            }
            let want = room.min(cfg.batch_size);
            // Taken before the claim: the lease runs from the claim's statement, so this is
            // never later than the lease's own start.
            let claimed_at = Instant::now();
            // Bounded, and raced against shutdown: a database that stops answering must
            // neither freeze the loop nor delay a SIGTERM. A claim cut off after it
            // committed leaves rows leased to us that we never saw; their leases expire and
            // the next claim takes them over (nothing was sent). Shutdown is checked
            // first: a stop that is already due never starts a claim.
            let claimed = tokio::select! {
                biased;
                _ = shutdown.as_mut() => return None,
                r = bounded(async {
                    let client = checkout(&shared.pools.hot).await?;
                    claim::claim_cached(
                        &client,
                        &lane.channels,
                        want,
                        &cfg.worker_id,
                        cfg.lease,
                        &cfg.retry,
                    )
                        .await
                        .map_err(|e| crate::db::describe(&e))
                }) => r,
            };
            let batch = match claimed {
                Ok(b) => b,
                Err(e) => {
                    round.failed = Some(e);
                    break;
                }
            };
            round.claimed_any = true;
            log_expired(shared, &batch.gave_up, &batch.deferred);
            // Expired leases settled by the claim took places in the batch too: a full
            // batch, whatever it held, means another round may find more.
            let picked = batch.claimed.len() + batch.gave_up.len() + batch.deferred.len();
            round.picked += picked;
            free = free.saturating_sub(batch.claimed.len());
            crate::metrics::claim_batch(batch.claimed.len());
            for msg in batch.claimed {
                // An open circuit: the row goes back unsent and uncounted, without a task
                // (the delivery task never touches the database).
                if let Some(host) = &msg.destination {
                    if let Gate::Defer(delay) = shared
                        .breakers
                        .gate(&shared.pools.general, msg.id, host)
                        .await
                    {
                        shared.inflight.fetch_add(1, Ordering::SeqCst);
                        let _ = self
                            .done_tx
                            .send(Done::deferred(msg, DeferReason::Breaker, delay))
                            .await;
                        continue;
                    }
                }
                spawn_attempt(
                    &mut self.tasks,
                    shared,
                    &self.slots,
                    &self.done_tx,
                    lane,
                    msg,
                    claimed_at,
                );
            }
            lane.backlog = picked == want;
            round.full |= lane.backlog;
        }
        Some(round)
    }

    /// What comes after a round; also tells the LISTEN task whether the loop is idle.
    async fn after_claim(&mut self, round: Round) -> Next {
        if let Some(e) = round.failed {
            let wait = self.db_backoff.next();
            tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "claim failed; retrying");
            return Next::BackOff(wait);
        }
        if !round.claimed_any {
            // Every lane is full: a finished delivery wakes the loop.
            return Next::WaitForSlot;
        }
        self.db_backoff.reset();
        // Idle while any lane's last claim came back short: that lane needs wake-ups.
        let busy = self.lanes.iter().all(|l| l.backlog);
        self.idle_tx.send_if_modified(|idle| {
            let changed = *idle == busy;
            *idle = !busy;
            changed
        });
        if round.full {
            return Next::ClaimAgain;
        }
        let shared = &self.shared;
        if shared.cfg.drain && round.picked == 0 && shared.inflight.load(Ordering::SeqCst) == 0 {
            match drain_done(shared).await {
                Ok(true) => {
                    tracing::info!("drained: nothing pending or running on this worker's channels");
                    return Next::Stop;
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "drain check failed"),
            }
        }
        Next::Idle
    }
}

/// Logs the rows whose expired lease a claim settled: dead-lettered, or due again later.
fn log_expired(shared: &Shared, gave_up: &[claim::GaveUp], deferred: &[claim::Deferred]) {
    for d in deferred {
        tracing::warn!(
            message_id = d.id,
            key = %crate::text::Escaped(&d.key),
            channel = %d.channel,
            attempt = %format_args!("{}/{}", d.attempt, d.max_attempts),
            outcome = "lease_lost",
            error_class = "ambiguous",
            retry_in_ms = d.retry_in.as_millis() as u64,
            "lease expired while running; the outcome is unknown; retry scheduled"
        );
        crate::metrics::expired(d.channel, AttemptOutcome::LeaseLost);
    }
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
        crate::metrics::expired(g.channel, AttemptOutcome::Dead);
    }
    if !gave_up.is_empty() {
        lock(&shared.summary).dead += gave_up.len() as u64;
    }
}

async fn drain_done(shared: &Shared) -> Result<bool, String> {
    let unfinished = bounded(async {
        let client = checkout(&shared.pools.general).await?;
        claim::has_unfinished(&**client, &shared.cfg.channels)
            .await
            .map_err(|e| crate::db::describe(&e))
    })
    .await?;
    Ok(!unfinished)
}
