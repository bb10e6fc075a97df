//! The claim loop, as named steps: reap finished tasks, [`ClaimLoop::start_claims`] (a
//! claim for each lane that may claim, each on its own connection, up to [`MAX_CLAIMS`] in
//! flight), then wait for an event: a claim coming back ([`ClaimLoop::claimed`]: each row
//! spawned as a delivery task; a full batch arms its lane to claim again at once, a short
//! one leaves it waiting; with `--drain`, stop when nothing is left), a wake-up (a place
//! freed, new messages), the poll interval or a back-off's end.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use super::MAX_CLAIMS;
use super::Shared;
use super::attempt::{Done, Job, spawn_attempt};
use super::breakers::Gate;
use super::db_call::{Backoff, bounded, checkout};
use super::lane::Lane;
use super::pace;
use crate::claim;
use crate::state::DeferReason;

/// How long a stop waits for the claims in flight (a healthy one answers in milliseconds).
const CLAIMS_AT_SHUTDOWN: Duration = Duration::from_secs(2);

/// What a claim task ends with: its rows and how long its statement took (from a
/// connection in hand to the answer), or why it failed.
type ClaimResult = Result<(Vec<Job>, Duration), String>;

/// The loop's state between events.
pub(super) struct ClaimLoop {
    shared: Arc<Shared>,
    /// One permit per delivery in flight (`--concurrency`).
    slots: Arc<Semaphore>,
    done_tx: mpsc::Sender<Done>,
    /// Tells the LISTEN task whether the loop is idle, so that it holds the idle mark.
    idle_tx: watch::Sender<bool>,
    /// Most rows claimed ahead of the slots: two batches per claim in flight
    /// ([`MAX_CLAIMS`]). How many are claimed ahead follows the slots' pace
    /// ([`pace::ahead`]) below this.
    most_ahead: usize,
    /// The claims' round trip, on average: rows ahead cover a few of them.
    claim_time: pace::Ewma,
    lanes: Vec<Lane>,
    tasks: JoinSet<()>,
    /// The claims in flight, each a task of its own on a connection of its own.
    claims: JoinSet<ClaimResult>,
    /// What the loop knows of each claim in flight, read back when its task ends, with an
    /// answer or without.
    claim_tasks: Vec<ClaimTask>,
    db_backoff: Backoff,
    /// After a failed claim, none starts before this.
    not_before: Option<Instant>,
    /// When the claims' and completions' pool last threw its plans away
    /// ([`super::PLAN_REFRESH`]).
    plans_made: Instant,
}

/// A claim in flight.
struct ClaimTask {
    id: tokio::task::Id,
    /// Its lane, by index.
    lane: usize,
    /// How many rows it asked for (the places kept for it).
    want: usize,
    /// Taken before the claim: the lease runs from the claim's statement, so this is never
    /// later than the lease's own start.
    claimed_at: Instant,
    /// The claim's lease token, to give its rows back if its answer is lost.
    token: uuid::Uuid,
}

/// What woke the loop.
enum Event {
    /// A claim came back.
    Claimed(ClaimTask, ClaimResult),
    /// A delivery freed a place, or the LISTEN task saw new messages.
    Woken,
    /// The poll interval, a deferred message's due time, or the end of a back-off.
    Timer,
    /// `shutdown` resolved.
    Shutdown,
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
        // (with a backlog, that round trip is what left slots idle). At most two batches
        // ahead for each claim that may be in flight: the places of a claim in flight are
        // kept for it from its start, and with two in flight and two batches in all, each
        // came back with a fraction of a batch and the cores sat as idle as with one claim.
        // Fewer when the slots turn over slowly
        // ([`pace`]). A row ahead passed the breakers' gate at its claim;
        // `Breakers::recheck` stops it before its request if its host has opened since.
        let most_ahead = 2 * MAX_CLAIMS * cfg.concurrency.min(cfg.batch_size);
        ClaimLoop {
            slots: Arc::new(Semaphore::new(cfg.concurrency)),
            lanes: Lane::plan(
                &cfg.channels,
                &shared.deliverers,
                cfg.concurrency + most_ahead,
            ),
            most_ahead,
            claim_time: pace::Ewma::default(),
            shared,
            done_tx,
            idle_tx,
            tasks: JoinSet::new(),
            claims: JoinSet::new(),
            claim_tasks: Vec::new(),
            db_backoff: Backoff::new(),
            not_before: None,
            plans_made: Instant::now(),
        }
    }

    /// Claims and spawns until `shutdown` resolves (or, with `--drain`, nothing is left).
    ///
    /// Each turn starts every claim that may start ([`ClaimLoop::start_claims`]), then waits
    /// for the next event: a claim coming back (its rows are spawned as delivery tasks), a
    /// wake-up (a place freed, new messages), a timer, or the shutdown.
    pub(super) async fn run(&mut self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = pin!(shutdown);
        loop {
            while let Some(ended) = self.tasks.try_join_next() {
                self.give_back_if_panicked(ended);
            }
            if self.not_before.is_some_and(|t| t <= Instant::now()) {
                self.not_before = None;
            }
            if self.not_before.is_none() {
                self.start_claims().await;
            }
            // The poll interval, or sooner when a deferred message comes due, or the end of
            // a back-off.
            let poll = Instant::now() + self.shared.cfg.poll_interval;
            let until = match self.not_before {
                Some(t) => t,
                None => self.shared.alarms.next().map_or(poll, |a| a.min(poll)),
            };
            let event = tokio::select! {
                // A stop that is already due starts nothing more; then a claim that came
                // back: its rows are what the slots wait for.
                biased;
                _ = shutdown.as_mut() => Event::Shutdown,
                Some(done) = self.claims.join_next_with_id(), if !self.claims.is_empty() => {
                    match done {
                        Ok((id, result)) => match self.take_claim_task(id) {
                            Some(task) => Event::Claimed(task, result),
                            None => Event::Woken,
                        },
                        Err(e) => {
                            self.lost_claim(e.id());
                            Event::Woken
                        }
                    }
                }
                _ = self.shared.wake.notified() => Event::Woken,
                _ = tokio::time::sleep_until(until.into()) => Event::Timer,
            };
            match event {
                Event::Shutdown => {
                    // First, so that no row waiting for a slot starts a request while the
                    // claims in flight are awaited (up to CLAIMS_AT_SHUTDOWN): from here on
                    // such rows are given back unsent. `shut_down` cancels it again.
                    self.shared.stopping.cancel();
                    self.give_back_claims_in_flight().await;
                    return;
                }
                Event::Claimed(task, result) => {
                    if self.claimed(task, result).await {
                        return;
                    }
                }
                // Anything may be due again: every lane may claim.
                Event::Woken | Event::Timer => {
                    self.shared.alarms.served(Instant::now());
                    for lane in &mut self.lanes {
                        lane.armed = true;
                    }
                    // With every lane's channels paused no claim comes back to ask.
                    if matches!(event, Event::Timer)
                        && self
                            .lanes
                            .iter()
                            .all(|l| self.shared.pauses.unpaused(&l.channels).is_empty())
                        && self.drained().await
                    {
                        return;
                    }
                }
            }
        }
    }

    /// A delivery task that panicked sent no `Done`, so the completer will never give its
    /// place back: give it back here, or every such panic would cost the loop a place for
    /// good, until it claimed nothing at all. (Its row keeps its lease, which expires: an
    /// ambiguous attempt, settled by the lease sweep.)
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

    /// A claim task that ended without an answer (it panicked: a bug, as nothing in it
    /// unwraps outside input): its places are given back and its lane may claim again
    /// after a back-off, as after a failed claim. Rows it may have taken keep their leases,
    /// which expire (nothing was sent).
    fn lost_claim(&mut self, id: tokio::task::Id) {
        let wait = self.db_backoff.next();
        tracing::error!(
            retry_in_ms = wait.as_millis() as u64,
            "a claim task failed; claiming again"
        );
        self.not_before = Some(Instant::now() + wait);
        // Its rows are not given back (`release_lost_claim`): a claim that panics once its
        // statement has committed may well panic on the same rows again, and given back
        // uncounted they would go round for ever; left to their leases they are counted,
        // and dead-lettered in the end.
        let Some(task) = self.take_claim_task(id) else {
            return;
        };
        if let Some(lane) = self.lanes.get_mut(task.lane) {
            lane.claim_ended(task.want);
            lane.armed = true;
        }
    }

    /// What the loop knew of the claim task `id`, which has ended.
    fn take_claim_task(&mut self, id: tokio::task::Id) -> Option<ClaimTask> {
        let i = self.claim_tasks.iter().position(|t| t.id == id)?;
        Some(self.claim_tasks.swap_remove(i))
    }

    /// At shutdown: the claims still in flight may have committed, and their rows are
    /// leased to us; waiting briefly for them and giving their rows back (uncounted, due at
    /// once, as `claim::release` does) saves each row a lease expiry, which would count an
    /// attempt never made and could dead-letter it as ambiguous. Bounded by
    /// [`CLAIMS_AT_SHUTDOWN`]: a database that stops answering must not delay a SIGTERM;
    /// a claim cut off then leaves rows whose leases expire.
    async fn give_back_claims_in_flight(&mut self) {
        let shared = self.shared.clone();
        let collect = async {
            while let Some(done) = self.claims.join_next().await {
                let Ok(Ok((batch, _))) = done else {
                    continue;
                };
                for msg in batch {
                    shared.inflight.fetch_add(1, Ordering::SeqCst);
                    let _ = self
                        .done_tx
                        .send(Done::Released(msg.id, msg.lease_token))
                        .await;
                }
            }
        };
        if tokio::time::timeout(CLAIMS_AT_SHUTDOWN, collect)
            .await
            .is_err()
        {
            tracing::warn!(
                "a claim did not come back before the stop; its rows are settled when their leases expire"
            );
        }
    }

    /// The delivery tasks still running, and the completer's sender, for shutdown. Claims
    /// still in flight after [`ClaimLoop::give_back_claims_in_flight`] are dropped.
    pub(super) fn into_parts(self) -> (JoinSet<()>, mpsc::Sender<Done>) {
        (self.tasks, self.done_tx)
    }

    /// Starts a claim on every lane that may claim now: armed (its last claim came back
    /// full, or something happened since it came back short), with fewer claims in flight
    /// than it may have (two under a backlog, one otherwise, [`MAX_CLAIMS`] in all), and
    /// with room for a useful batch once the places of the claims in flight are kept.
    async fn start_claims(&mut self) {
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
        // Every turn, as the old round did, whether or not a claim can start: a worker whose
        // places are all taken by slow requests still learns that another worker opened a
        // host, before its rows claimed ahead ask `recheck`. (Both are rate-limited.) In a
        // task of its own: the loop must not wait for the general pool, which may be busy
        // (the first refresh, before the first claim, is awaited in `Worker::run`).
        if shared.breakers.begin_refresh(cfg.poll_interval) {
            let s = shared.clone();
            tokio::spawn(async move { s.breakers.run_refresh(&s.pools.general).await });
        }
        if shared.pauses.begin_refresh(cfg.poll_interval) {
            let s = shared.clone();
            tokio::spawn(async move {
                // A channel resumed: the claim that started with this refresh left it out.
                // Marked stale while this refresh ran: the loop starts another at once.
                if s.pauses.run_refresh(&s.pools.general).await || s.pauses.is_stale() {
                    s.wake.notify_one();
                }
            });
        }
        if self.plans_made.elapsed() >= super::PLAN_REFRESH {
            shared.pools.refresh_plans();
            self.plans_made = Instant::now();
        }
        if self.claims.len() >= MAX_CLAIMS {
            return;
        }
        // A claimed row holds its place until the completer has recorded its outcome, not
        // only until its task ends: what the breakers learn from an outcome (`record`, run
        // by the completer before it frees the places) is then known before the places it
        // frees are claimed again. Counting tasks instead let a fast claim loop send a
        // failing host several more requests while the first failure was still being
        // written (with `--breaker-threshold 1`, up to 30 instead of at most 2). A delivery
        // gives its place back when its task hands it over (`Done::frees_place_when_sent`):
        // it teaches the breakers nothing that must come first.
        let ahead = pace::ahead(
            cfg.concurrency,
            self.most_ahead,
            shared.slot_time.get(),
            pace::horizon(self.claim_time.get()),
        );
        let reserved: usize = self.lanes.iter().map(|l| l.reserved).sum();
        let mut free = (cfg.concurrency + ahead)
            .saturating_sub(shared.inflight.load(Ordering::SeqCst))
            .saturating_sub(reserved);
        for (index, lane) in self.lanes.iter_mut().enumerate() {
            if self.claims.len() >= MAX_CLAIMS {
                break;
            }
            // Paused channels are left out of the claim; a lane whose channels are all
            // paused claims nothing, as if it had found nothing (for `--drain`), and stays
            // armed for the resume.
            let channels = shared.pauses.unpaused(&lane.channels);
            if channels.is_empty() {
                lane.backlog = false;
                lane.last_picked = Some(0);
                continue;
            }
            // With a backlog, wait until a useful number of slots is free so each claim
            // fetches a batch rather than one row per finished delivery; when the queue
            // is idle, any free slot takes a new message at once.
            if !lane.may_claim(free, ahead, cfg) {
                continue;
            }
            let want = free.min(lane.room()).min(cfg.batch_size);
            free -= want;
            lane.claim_started(want);
            // A lane whose claims come back short is not asked again until something
            // happens; one with a backlog may start its second claim at once.
            lane.armed = lane.backlog;
            let shared = shared.clone();
            let claimed_at = Instant::now();
            let token = claim::new_token();
            // Bounded: a database that stops answering must not hold the lane's places
            // for ever. A stop waits for it only briefly
            // ([`ClaimLoop::give_back_claims_in_flight`]).
            let task = self.claims.spawn(async move {
                let cfg = &shared.cfg;
                bounded(async {
                    let client = checkout(&shared.pools.hot).await?;
                    let t = Instant::now();
                    let batch = claim::claim_cached_as(
                        &client,
                        &channels,
                        want,
                        &cfg.worker_id,
                        cfg.lease,
                        token,
                    )
                    .await
                    .map_err(|e| crate::db::failed(&e))?;
                    let took = t.elapsed();
                    Ok((batch.into_iter().map(Job::new).collect(), took))
                })
                .await
            });
            self.claim_tasks.push(ClaimTask {
                id: task.id(),
                lane: index,
                want,
                claimed_at,
                token,
            });
        }
    }

    /// A claim came back: its rows become delivery tasks, its places are no longer kept,
    /// and the lane learns whether more is due. True when the loop should stop (`--drain`
    /// and nothing left).
    async fn claimed(&mut self, task: ClaimTask, result: ClaimResult) -> bool {
        let shared = self.shared.clone();
        let ClaimTask {
            lane: index,
            want,
            claimed_at,
            token,
            ..
        } = task;
        let Some(lane) = self.lanes.get_mut(index) else {
            return false;
        };
        lane.claim_ended(want);
        let batch = match result {
            Ok((b, took)) => {
                self.claim_time.record(took);
                b
            }
            Err(e) => {
                let wait = self.db_backoff.next();
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "claim failed; retrying");
                self.not_before = Some(Instant::now() + wait);
                lane.armed = true;
                release_lost_claim(shared, token, claimed_at);
                return false;
            }
        };
        self.db_backoff.reset();
        let picked = batch.len();
        crate::metrics::claim_batch(picked);
        for msg in batch {
            // A paused channel (claimed before this worker saw the pause), a paused
            // destination or an open circuit: the row goes back unsent and uncounted,
            // without a task (the delivery task never touches the database). The pauses
            // are asked first: a paused host takes no probe.
            let held = if shared.pauses.holds_channel(msg.channel) {
                Some((DeferReason::Paused, Duration::ZERO))
            } else if let Some(host) = &msg.destination {
                if shared.pauses.holds(host) {
                    Some((DeferReason::Paused, Duration::ZERO))
                } else if let Gate::Defer(delay) = shared
                    .breakers
                    .gate(&shared.pools.general, msg.id, msg.lease_token, host)
                    .await
                {
                    Some((DeferReason::Breaker, delay))
                } else {
                    None
                }
            } else {
                None
            };
            if let Some((reason, delay)) = held {
                shared.inflight.fetch_add(1, Ordering::SeqCst);
                let _ = self
                    .done_tx
                    .send(Done::deferred(msg.msg, reason, delay))
                    .await;
                continue;
            }
            spawn_attempt(
                &mut self.tasks,
                &shared,
                &self.slots,
                &self.done_tx,
                lane,
                msg,
                claimed_at,
            );
        }
        lane.backlog = picked == want;
        // A wake-up that came while the claim ran (new messages, a freed place, the
        // listener's "claim once more" after it took the idle mark) still counts: the
        // claim's snapshot may be older than what it announced.
        lane.armed |= lane.backlog;
        lane.last_picked = Some(picked);
        // Idle while any lane's last claim came back short: that lane needs wake-ups.
        let busy = self.lanes.iter().all(|l| l.backlog);
        self.idle_tx.send_if_modified(|idle| {
            let changed = *idle == busy;
            *idle = !busy;
            changed
        });
        self.drained().await
    }

    /// With `--drain`: true when every lane's last claim found nothing (a lane whose
    /// channels are all paused counts as such), nothing is in flight and nothing is left
    /// for this worker's channels ([`drain_done`]).
    async fn drained(&self) -> bool {
        let shared = &self.shared;
        shared.cfg.drain
            && self.claims.is_empty()
            && self.lanes.iter().all(|l| l.last_picked == Some(0))
            && shared.inflight.load(Ordering::SeqCst) == 0
            && match drain_done(shared).await {
                Ok(done) => {
                    if done {
                        tracing::info!(
                            "drained: nothing pending or running on this worker's channels"
                        );
                    }
                    done
                }
                Err(e) => {
                    tracing::warn!(error = %e, "drain check failed");
                    false
                }
            }
    }
}

async fn drain_done(shared: &Shared) -> Result<bool, String> {
    let unfinished = bounded(async {
        let client = checkout(&shared.pools.general).await?;
        claim::has_unfinished(&**client, &shared.cfg.channels)
            .await
            .map_err(|e| crate::db::failed(&e))
    })
    .await?;
    Ok(!unfinished)
}

/// Gives back the rows a claim may have taken when its answer did not come back: the
/// statement may have committed before the connection was lost, or may still commit after
/// the claim's time bound gave up on it. No task holds those rows, and left to their leases
/// they would count an attempt never made, as ambiguous. So every row still leased under
/// the claim's token goes back uncounted (`claim::release_lost_claim`), now and twice more
/// within a few seconds, for a statement that commits late. A pass that fails (the
/// database restarting or failing over, which is when answers get lost) is tried again on
/// the worker's database [`Backoff`] until one gets through or the claim's lease has run
/// out, when the rows are the lease sweep's anyway: three fixed tries within 6 s lost them
/// to a restart that took longer. (Each failed claim of an outage has such a task; the
/// claim loop's own backoff spaces them, and the jitter spreads their tries.)
/// Through the general pool: the hot pool's connection may be what was lost.
fn release_lost_claim(shared: Arc<Shared>, token: uuid::Uuid, claimed_at: Instant) {
    tokio::spawn(async move {
        let give_up = claimed_at + shared.cfg.lease;
        let mut passes = [Duration::from_secs(1), Duration::from_secs(5)].into_iter();
        let mut wait = Duration::ZERO;
        let mut retry = Backoff::new();
        loop {
            tokio::time::sleep(wait).await;
            let released = bounded(async {
                let client = checkout(&shared.pools.general).await?;
                claim::release_lost_claim(&**client, &shared.cfg.worker_id, token)
                    .await
                    .map_err(|e| crate::db::failed(&e))
            })
            .await;
            match released {
                Ok(ids) => {
                    for id in &ids {
                        tracing::info!(
                            message_id = id,
                            outcome = "released",
                            "claimed message released unstarted: its claim's answer was lost"
                        );
                    }
                    crate::support::lock(&shared.summary).released += ids.len() as u64;
                    match passes.next() {
                        Some(next) => wait = next,
                        None => return,
                    }
                }
                Err(e) => {
                    wait = retry.next();
                    if Instant::now() + wait < give_up {
                        tracing::debug!(error = %e, "could not give back the rows of a lost claim yet; trying again");
                        continue;
                    }
                    tracing::warn!(
                        error = %e,
                        "could not give back the rows of a lost claim; they are settled when their leases expire"
                    );
                    return;
                }
            }
        }
    });
}
