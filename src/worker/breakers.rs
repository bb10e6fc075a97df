//! Circuit breakers shared through the database (`outbox.destinations`).
//!
//! The completer counts each batch's webhook outcomes per destination in one statement
//! ([`queries::BREAKER_RECORD`]), skipped when nothing failed and no success concerns a host
//! known to be failing, so healthy traffic pays no write. When a host opens, its due backlog
//! is pushed past the cooldown once, off the hot path ([`queries::BREAKER_PUSH`]), so the
//! claim (unchanged) does not keep picking rows it may not send. Every worker reads the
//! non-closed hosts at most once per poll interval ([`Breakers::refresh`]); the claim loop
//! then defers (uncounted, no history row) a claimed row whose host is open, or lets one
//! row through as the probe ([`Breakers::gate`]). A successful probe closes the host and
//! brings the pushed backlog back ([`queries::BREAKER_RESTORE`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;

use super::db_call::{bounded, checkout};
use crate::model::ErrorClass;
use crate::queries;
use crate::state::Circuit;
use crate::support::lock;
use crate::text::Escaped;

/// What this worker knows of a host that is failing or not closed.
#[derive(Debug, Clone)]
struct HostView {
    circuit: Circuit,
    /// When an open circuit's cooldown ends.
    open_until: Option<Instant>,
    /// When a half-open circuit's probe window ends.
    probe_until: Option<Instant>,
    /// This worker has given a row back to come due when the cooldown ends, to be the
    /// probe; the others it claims meanwhile wait past the probe's window.
    probe_row: bool,
}

/// What the claim loop does with one claimed row.
pub(super) enum Gate {
    /// Send it (the host is closed, or this is its probe).
    Send,
    /// Give it back unsent, due again after this.
    Defer(Duration),
}

/// A row the gate let through.
struct InFlight {
    host: String,
    /// The lease token of the claim it came with: an outcome or a give-back of an earlier
    /// claim of the same row, dealt with late, must not take a later claim's entry.
    token: uuid::Uuid,
    /// Sent as the probe of a host whose cooldown had passed, not because it was closed.
    probe: bool,
    /// The ticket of the failure its task saw, until the completer has recorded it
    /// ([`Breakers::failure_seen`]).
    failure: Option<u64>,
}

/// One attempt's outcome as the breakers count it: message id, lease token, failure class.
pub(super) type Outcome = (i64, uuid::Uuid, Option<ErrorClass>);

/// Takes `id`'s entry out of `inflight` if it is the one of the claim with `token`.
fn take(inflight: &mut HashMap<i64, InFlight>, id: i64, token: uuid::Uuid) -> Option<InFlight> {
    match inflight.get(&id) {
        Some(f) if f.token == token => inflight.remove(&id),
        _ => None,
    }
}

/// The worker's breakers: settings, the cached view, and the hosts of rows in flight.
pub(super) struct Breakers {
    threshold: u32,
    cooldown: Duration,
    max_cooldown: Duration,
    /// The probe window: the webhook timeout plus the lease margin.
    window: Duration,
    view: Mutex<HashMap<String, HostView>>,
    refreshed: Mutex<Option<Instant>>,
    /// A refresh is running (the claim loop starts them in tasks of their own).
    refreshing: AtomicBool,
    /// One backlog push or restore statement at a time: several hosts opening together must
    /// not take every connection of the general pool, which the sweep, retention and the
    /// view's refresh share.
    backlog_turn: Arc<tokio::sync::Semaphore>,
    /// The destination of each claimed row in flight, by id, for the completer, and
    /// whether it goes as its host's probe.
    inflight: Mutex<HashMap<i64, InFlight>>,
    /// Failures a delivery task has seen and the completer not yet recorded: their
    /// tickets (in the order seen) by host. A ticket is taken off when its row's entry in
    /// `inflight` goes (recorded, given back, or replaced by a new claim of the same id),
    /// so none is left behind; `recorded` wakes the rows waiting in `recheck`.
    unrecorded: Mutex<HashMap<String, BTreeSet<u64>>>,
    tickets: AtomicU64,
    recorded: tokio::sync::Notify,
}

/// How long [`Breakers::recheck`] waits for failures of its host to be recorded before it
/// decides on what it knows (the completer is retrying a write, or shutting down).
const RECORD_WAIT: Duration = Duration::from_secs(1);

/// Whether an outcome counts towards its host's breaker: a failure that says the host is
/// unwell. A permanent failure is the receiver's answer about this message (a success for
/// the breaker); an invalid one never reached the host.
fn counts_as_failure(class: Option<ErrorClass>) -> Option<bool> {
    match class {
        None | Some(ErrorClass::Permanent) => Some(false),
        Some(ErrorClass::Transient | ErrorClass::Ambiguous | ErrorClass::Exhausted) => Some(true),
        Some(ErrorClass::Invalid) => None,
    }
}

/// How close to the end of a cooldown a claimed row is sent back to be the probe.
const NEAR: Duration = Duration::from_millis(250);

/// Rows moved by one push or restore statement.
const BATCH: i64 = 5000;

impl Breakers {
    pub(super) fn new(cfg: &crate::config::WorkerConfig, webhook_timeout: Duration) -> Self {
        Breakers {
            threshold: cfg.breaker_threshold,
            cooldown: cfg.breaker_cooldown,
            max_cooldown: cfg.retry.max.max(cfg.breaker_cooldown),
            window: webhook_timeout + crate::config::LEASE_MARGIN,
            view: Mutex::new(HashMap::new()),
            refreshed: Mutex::new(None),
            refreshing: AtomicBool::new(false),
            backlog_turn: Arc::new(tokio::sync::Semaphore::new(1)),
            inflight: Mutex::new(HashMap::new()),
            unrecorded: Mutex::new(HashMap::new()),
            tickets: AtomicU64::new(0),
            recorded: tokio::sync::Notify::new(),
        }
    }

    /// Breakers are on (`--breaker-threshold` > 0).
    pub(super) fn enabled(&self) -> bool {
        self.threshold > 0
    }

    /// Reads the non-closed and failing hosts, at most once per `every`, and waits for it.
    pub(super) async fn refresh(&self, pool: &Pool, every: Duration) {
        if self.begin_refresh(every) {
            self.run_refresh(pool).await;
        }
    }

    /// Whether a refresh is due (at most once per `every`) and none is running; if so, it
    /// counts as begun, and [`Breakers::run_refresh`] must follow. The claim loop runs that
    /// in a task of its own: it must not wait for the general pool, which a backlog push,
    /// retention, the sweep or a scrape may all have in use.
    pub(super) fn begin_refresh(&self, every: Duration) -> bool {
        if !self.enabled() || self.refreshing.swap(true, Ordering::SeqCst) {
            return false;
        }
        let mut last = lock(&self.refreshed);
        if last.is_some_and(|t| t.elapsed() < every) {
            self.refreshing.store(false, Ordering::SeqCst);
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// The refresh [`Breakers::begin_refresh`] began; ends it whichever way it goes.
    pub(super) async fn run_refresh(&self, pool: &Pool) {
        struct Ending<'a>(&'a AtomicBool);
        impl Drop for Ending<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _ending = Ending(&self.refreshing);
        let rows = match query(pool, queries::BREAKER_VIEW, &[]).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "reading circuit breakers failed");
                return;
            }
        };
        let now = Instant::now();
        let at = |secs: Option<f64>| {
            secs.map(|s| {
                if s > 0.0 {
                    now + Duration::from_secs_f64(s.min(1e9))
                } else {
                    now.checked_sub(Duration::from_secs_f64((-s).min(1e6)))
                        .unwrap_or(now)
                }
            })
        };
        let mut view = HashMap::new();
        let old = std::mem::take(&mut *lock(&self.view));
        for row in rows {
            let host: String = row.get(0);
            let Some(circuit) = Circuit::parse(row.get(1)) else {
                continue;
            };
            // Kept across refreshes of the same opening: one probe row per opening.
            let probe_row = circuit == Circuit::Open
                && old
                    .get(&host)
                    .is_some_and(|o| o.circuit == Circuit::Open && o.probe_row);
            view.insert(
                host,
                HostView {
                    circuit,
                    open_until: at(row.get(3)),
                    probe_until: at(row.get(4)),
                    probe_row,
                },
            );
        }
        *lock(&self.view) = view;
    }

    /// Whether a claimed row for `host` may be sent now; takes the probe when the cooldown
    /// has passed (one statement, only then).
    pub(super) async fn gate(&self, pool: &Pool, id: i64, token: uuid::Uuid, host: &str) -> Gate {
        if !self.enabled() {
            return Gate::Send;
        }
        let now = Instant::now();
        let seen = lock(&self.view).get(host).cloned();
        let probe = seen.as_ref().is_some_and(|v| v.circuit != Circuit::Closed);
        let gate = match seen {
            None
            | Some(HostView {
                circuit: Circuit::Closed,
                ..
            }) => Gate::Send,
            Some(v) => {
                let until = match v.circuit {
                    Circuit::Open => v.open_until,
                    _ => v.probe_until,
                };
                match until {
                    // One row per opening (and the rows claimed close to its end: this
                    // view's clock may run a few milliseconds behind the database's) comes
                    // back just after the cooldown, to be the probe; the others wait past
                    // the probe's window, so a backlog is given back once per opening.
                    Some(t)
                        if t > now
                            && v.circuit == Circuit::Open
                            && (!v.probe_row || t - now <= NEAR) =>
                    {
                        if let Some(h) = lock(&self.view).get_mut(host) {
                            h.probe_row = true;
                        }
                        Gate::Defer(t - now + Duration::from_millis(5))
                    }
                    Some(t) if t > now => Gate::Defer(
                        t - now
                            + if v.circuit == Circuit::Open {
                                self.window
                            } else {
                                Duration::ZERO
                            },
                    ),
                    _ => self.take_probe(pool, host).await,
                }
            }
        };
        if matches!(gate, Gate::Send) {
            let host = host.to_owned();
            let entry = InFlight {
                host,
                token,
                probe,
                failure: None,
            };
            // An entry left by an earlier claim of this row (its lease expired before its
            // result was recorded) goes now.
            let old = lock(&self.inflight).insert(id, entry);
            self.settle(old.into_iter());
        }
        gate
    }

    /// Asked again just before the request of a row the gate let through as closed: if its
    /// host has opened since (this worker recorded the failures that opened it, or read the
    /// opening from the database), the row goes back unsent like one the gate deferred, due
    /// after the cooldown and the probe's window. A row claimed ahead of the free slots
    /// passed the gate up to a batch of deliveries earlier; without this, a host that
    /// starts failing would get every such row before the opening stopped them. The probe
    /// itself, and a row of a host this worker knows nothing against, go on. Never touches
    /// the database, and makes no opening of its own: only what the gate would see.
    ///
    /// A failure of the same host that a delivery task saw before this row got here, and
    /// that the completer has not yet recorded, may be the one that opens it: the row
    /// waits for those failures (not for later ones) to be recorded first, at most
    /// [`RECORD_WAIT`], usually one completion statement. Healthy hosts have none, and their
    /// rows wait for nothing.
    pub(super) async fn recheck(&self, id: i64, host: &str) -> Option<Duration> {
        if !self.enabled() {
            return None;
        }
        let last_seen = lock(&self.unrecorded)
            .get(host)
            .and_then(|t| t.last().copied());
        if last_seen.is_none() && !lock(&self.view).contains_key(host) {
            return None;
        }
        if lock(&self.inflight).get(&id).is_none_or(|f| f.probe) {
            return None;
        }
        if let Some(last_seen) = last_seen {
            let deadline = tokio::time::Instant::now() + RECORD_WAIT;
            loop {
                // Registered before the tickets are read, so a record in between still
                // wakes it.
                let recorded = self.recorded.notified();
                let pending = lock(&self.unrecorded)
                    .get(host)
                    .and_then(|t| t.first().copied())
                    .is_some_and(|oldest| oldest <= last_seen);
                if !pending || tokio::time::timeout_at(deadline, recorded).await.is_err() {
                    break;
                }
            }
        }
        let v = lock(&self.view).get(host).cloned()?;
        let now = Instant::now();
        match v.circuit {
            Circuit::Closed => None,
            // Past the cooldown, the next claim's gate takes the probe for it.
            Circuit::Open => Some(match v.open_until {
                Some(t) if t > now => t - now + self.window,
                _ => Duration::from_millis(5),
            }),
            Circuit::HalfOpen => Some(match v.probe_until {
                Some(t) if t > now => t - now,
                _ => Duration::from_millis(5),
            }),
        }
    }

    async fn take_probe(&self, pool: &Pool, host: &str) -> Gate {
        let window = self.window.as_secs_f64();
        let taken = query(pool, queries::BREAKER_TAKE_PROBE, &[&host, &window])
            .await
            .map(|rows| rows.into_iter().next());
        let probe_until = Some(Instant::now() + self.window);
        // Won or lost, the host is half-open for a window: the other rows wait for it.
        lock(&self.view).insert(
            host.to_owned(),
            HostView {
                circuit: Circuit::HalfOpen,
                open_until: None,
                probe_until,
                probe_row: false,
            },
        );
        match taken {
            Ok(Some(_)) => {
                tracing::info!(host = %Escaped(host), "breaker half-open: sending one probe");
                Gate::Send
            }
            Ok(None) => Gate::Defer(self.window),
            Err(e) => {
                tracing::warn!(error = %e, "taking a breaker probe failed");
                Gate::Defer(self.window)
            }
        }
    }

    /// A delivery task saw attempt `id` end with `class`: if that is a failure its host's
    /// breaker counts, it is unrecorded until [`Breakers::record`] has run for it. Called
    /// before the task hands its result to the completer.
    pub(super) fn failure_seen(&self, id: i64, class: Option<ErrorClass>) {
        if !self.enabled() || counts_as_failure(class) != Some(true) {
            return;
        }
        let mut inflight = lock(&self.inflight);
        let Some(f) = inflight.get_mut(&id).filter(|f| f.failure.is_none()) else {
            return;
        };
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        f.failure = Some(ticket);
        lock(&self.unrecorded)
            .entry(f.host.clone())
            .or_default()
            .insert(ticket);
    }

    /// Takes the failure tickets of entries leaving `inflight` off their hosts.
    fn settle(&self, gone: impl Iterator<Item = InFlight>) {
        let mut unrecorded = None;
        for f in gone {
            let Some(ticket) = f.failure else { continue };
            let unrecorded = unrecorded.get_or_insert_with(|| lock(&self.unrecorded));
            if let Some(tickets) = unrecorded.get_mut(&f.host) {
                tickets.remove(&ticket);
                if tickets.is_empty() {
                    unrecorded.remove(&f.host);
                }
            }
        }
    }

    /// Forgets the in-flight host of rows given back unsent (`(id, lease token)`).
    pub(super) fn forget(&self, rows: impl Iterator<Item = (i64, uuid::Uuid)>) {
        if !self.enabled() {
            return;
        }
        let gone: Vec<InFlight> = {
            let mut inflight = lock(&self.inflight);
            rows.filter_map(|(id, token)| take(&mut inflight, id, token))
                .collect()
        };
        self.settle(gone.into_iter());
        self.recorded.notify_waiters();
    }

    /// Counts a batch's webhook outcomes per destination (see [`queries::BREAKER_RECORD`]),
    /// unless nothing in it concerns a breaker; logs transitions and moves backlogs.
    /// Then takes this batch's failures off the ones seen but unrecorded
    /// ([`Breakers::failure_seen`]) and wakes the rows waiting in [`Breakers::recheck`].
    /// `outcomes` are the batch's attempts in order: the message's id, its claim's lease
    /// token, and the class of the attempt's failure (`None` when it was delivered).
    pub(super) async fn record(&self, pool: &Pool, outcomes: &[Outcome]) {
        if !self.enabled() {
            return;
        }
        // The tickets go only now, after the view holds any opening this batch caused.
        let gone = self.record_outcomes(pool, outcomes).await;
        self.settle(gone.into_iter());
        self.recorded.notify_waiters();
    }

    /// [`Breakers::record`]'s statement and what follows from it; returns the entries it
    /// took out of `inflight`.
    async fn record_outcomes(&self, pool: &Pool, outcomes: &[Outcome]) -> Vec<InFlight> {
        let mut gone = Vec::new();
        // host -> (a success came, failures after the last success), in batch order.
        let mut per_host: Vec<(String, bool, i32)> = Vec::new();
        {
            let mut inflight = lock(&self.inflight);
            let view = lock(&self.view);
            for &(id, token, class) in outcomes {
                let Some(f) = take(&mut inflight, id, token) else {
                    continue;
                };
                let host = f.host.clone();
                gone.push(f);
                let Some(failed) = counts_as_failure(class) else {
                    continue;
                };
                if !failed && !view.contains_key(&host) {
                    continue;
                }
                let slot = match per_host.iter().position(|(h, _, _)| *h == host) {
                    Some(i) => i,
                    None => {
                        per_host.push((host, false, 0));
                        per_host.len() - 1
                    }
                };
                let e = &mut per_host[slot];
                if failed {
                    e.2 += 1;
                } else {
                    e.1 = true;
                    e.2 = 0;
                }
            }
        }
        if per_host.is_empty() {
            return gone;
        }
        let hosts: Vec<&str> = per_host.iter().map(|(h, _, _)| h.as_str()).collect();
        let resets: Vec<bool> = per_host.iter().map(|e| e.1).collect();
        let fails: Vec<i32> = per_host.iter().map(|e| e.2).collect();
        let threshold = i32::try_from(self.threshold).unwrap_or(i32::MAX);
        let cooldown = self.cooldown.as_secs_f64();
        let max = self.max_cooldown.as_secs_f64();
        let rows = query(
            pool,
            queries::BREAKER_RECORD,
            &[&hosts, &resets, &fails, &threshold, &cooldown, &max],
        )
        .await;
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "recording breaker outcomes failed");
                return gone;
            }
        };
        let now = Instant::now();
        for row in rows {
            let host: String = row.get(0);
            let state: &str = row.get(2);
            let failures: i32 = row.get(3);
            let cooldown: Option<f64> = row.get(4);
            let open_in: Option<f64> = row.get(5);
            let pushed: Option<std::time::SystemTime> = row.get(6);
            match Circuit::parse(state) {
                Some(Circuit::Open) => {
                    tracing::warn!(
                        host = %Escaped(&host), failures,
                        cooldown_ms = (cooldown.unwrap_or(0.0) * 1000.0) as u64,
                        "breaker opened"
                    );
                    lock(&self.view).insert(
                        host.clone(),
                        HostView {
                            circuit: Circuit::Open,
                            open_until: Some(
                                now + Duration::from_secs_f64(open_in.unwrap_or(0.0).min(1e9)),
                            ),
                            probe_until: None,
                            probe_row: false,
                        },
                    );
                    tokio::spawn(push(
                        pool.clone(),
                        self.backlog_turn.clone(),
                        host,
                        self.window,
                    ));
                }
                Some(Circuit::Closed) => {
                    tracing::info!(host = %Escaped(&host), "breaker closed");
                    lock(&self.view).remove(&host);
                    if let Some(at) = pushed {
                        tokio::spawn(restore(pool.clone(), self.backlog_turn.clone(), host, at));
                    }
                }
                _ => {}
            }
        }
        gone
    }
}

/// One statement of the breakers on a pooled connection, bounded in time; failures as one
/// line (the breakers never stop deliveries: a failed read or write is logged and skipped).
async fn query(
    pool: &Pool,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, String> {
    bounded(async {
        let client = checkout(pool).await?;
        client
            .query(sql, params)
            .await
            .map_err(|e| crate::db::failed(&e))
    })
    .await
}

/// Pushes an open host's backlog past its cooldown, in batches, off the hot path.
async fn push(pool: Pool, turn: Arc<tokio::sync::Semaphore>, host: String, window: Duration) {
    let window = window.as_secs_f64();
    let near = NEAR.as_secs_f64();
    let mut total = 0i64;
    let mut after = 0i64;
    loop {
        // Per statement: hosts that opened together take turns, batch by batch.
        let Ok(_turn) = turn.acquire().await else {
            return;
        };
        let moved = query(
            &pool,
            queries::BREAKER_PUSH,
            &[&host, &window, &BATCH, &after, &near],
        )
        .await;
        match moved.map(|rows| {
            rows.first().map_or((0, None), |r| {
                (r.get::<_, i64>(0), r.get::<_, Option<i64>>(1))
            })
        }) {
            Ok((n, last)) => {
                total += n;
                match last {
                    Some(last) => after = last,
                    None => break,
                }
            }
            Err(e) => {
                tracing::warn!(host = %Escaped(&host), error = %e, "pushing an open host's backlog failed");
                break;
            }
        }
    }
    tracing::info!(host = %Escaped(&host), moved = total, "open host's backlog moved past its cooldown");
}

/// Brings a closed host's pushed backlog back: due at once.
async fn restore(
    pool: Pool,
    turn: Arc<tokio::sync::Semaphore>,
    host: String,
    at: std::time::SystemTime,
) {
    let Ok(_turn) = turn.acquire().await else {
        return;
    };
    let restored = bounded(async {
        let client = checkout(&pool).await?;
        crate::ops::restore_backlog(&**client, &host, at)
            .await
            .map_err(|e| crate::db::failed(&e))
    })
    .await;
    match restored {
        Ok(n) => {
            tracing::info!(host = %Escaped(&host), moved = n, "closed host's backlog due again")
        }
        Err(e) => {
            tracing::warn!(host = %Escaped(&host), error = %e, "bringing back a closed host's backlog failed")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breakers() -> (Breakers, Pool) {
        let cfg = crate::config::WorkerConfig::default();
        // Never connected: a closed host's gate and the recheck do not touch the database.
        let db = crate::db::parse_url("postgres://outboxd@127.0.0.1:1/none").expect("url");
        let pool = crate::db::pool(&db, 1).expect("pool");
        (Breakers::new(&cfg, Duration::from_secs(1)), pool)
    }

    fn tickets(b: &Breakers, host: &str) -> usize {
        lock(&b.unrecorded).get(host).map_or(0, |t| t.len())
    }

    /// A failure seen by a task is held against its host until its row's entry leaves the
    /// in-flight map, whichever way it leaves: given back, or replaced by a new claim of
    /// the same row (its lease expired before its result was recorded). A ticket left
    /// behind would make every later row of that host wait a second in its slot.
    #[tokio::test]
    async fn a_failure_seen_is_held_until_its_row_leaves_whichever_way() {
        let (b, pool) = breakers();
        let failed = Some(ErrorClass::Transient);
        let token = |n: u128| uuid::Uuid::from_u128(n);
        assert!(matches!(
            b.gate(&pool, 1, token(1), "h:443").await,
            Gate::Send
        ));
        b.failure_seen(1, failed);
        b.failure_seen(1, failed);
        assert_eq!(tickets(&b, "h:443"), 1, "one ticket per attempt");
        b.forget([(1, token(99))].into_iter());
        assert_eq!(
            tickets(&b, "h:443"),
            1,
            "another claim's give-back takes nothing"
        );
        b.forget([(1, token(1))].into_iter());
        assert_eq!(tickets(&b, "h:443"), 0, "given back");

        assert!(matches!(
            b.gate(&pool, 2, token(2), "h:443").await,
            Gate::Send
        ));
        b.failure_seen(2, failed);
        assert!(matches!(
            b.gate(&pool, 2, token(3), "h:443").await,
            Gate::Send
        ));
        assert_eq!(tickets(&b, "h:443"), 0, "claimed again");

        // A success, a permanent refusal or an invalid message says nothing against the host.
        for class in [None, Some(ErrorClass::Permanent), Some(ErrorClass::Invalid)] {
            b.failure_seen(2, class);
        }
        assert_eq!(tickets(&b, "h:443"), 0);
        // Nothing held against the host, nothing in the view: no wait, and it goes.
        let t = std::time::Instant::now();
        assert_eq!(b.recheck(2, "h:443").await, None);
        assert!(t.elapsed() < RECORD_WAIT / 2);

        // Recorded: taken off even when the breaker's own write fails (here the database
        // cannot be reached), since the completer has dealt with the result.
        assert!(matches!(
            b.gate(&pool, 3, token(4), "h:443").await,
            Gate::Send
        ));
        b.failure_seen(3, failed);
        assert_eq!(tickets(&b, "h:443"), 1);
        // An earlier claim's outcome, recorded late, leaves the later claim's entry be.
        b.record(&pool, &[(3, token(2), Some(ErrorClass::Transient))])
            .await;
        assert_eq!(tickets(&b, "h:443"), 1, "a late outcome of another claim");
        b.record(&pool, &[(3, token(4), Some(ErrorClass::Transient))])
            .await;
        assert_eq!(tickets(&b, "h:443"), 0, "recorded");
    }
}
