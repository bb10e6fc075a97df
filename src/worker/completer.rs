//! The completer: writes every finished attempt and release waiting for it in one fenced
//! statement each, so batching grows with load and costs no latency when idle; then logs
//! each attempt and counts it in the run's summary. The general pool's share of that work
//! (breakers, releases, deferrals) runs beside it, in order, so that a busy general pool
//! never holds a completion up.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::attempt::{AttemptLog, Deferred, Done};
use super::db_call::{Backoff, bounded, checkout};
use super::{ALARM_MARGIN, Shared};
use crate::claim::{self, Completion};
use crate::model::{AttemptOutcome, ErrorClass};
use crate::state::{DeferReason, Transition};
use crate::support::lock;

/// Runs a database write (`$op`, an expression using `$client`, a connection of `$pool`)
/// until it succeeds, backing off between tries; gives up (None) only when `$stop` fires:
/// shutdown past its grace.
///
/// A macro, not backon's `Retryable`: the operation borrows a client checked out inside
/// each try across its await, which a closure returning a future cannot name without
/// boxing; the schedule itself is backon's ([`Backoff`]).
macro_rules! retry_db {
    ($pool:expr, $stop:expr, $what:literal, |$client:ident| $op:expr) => {{
        let mut backoff = Backoff::new();
        loop {
            // Bounded, and raced against the hard stop, so that neither a silent database
            // nor shutdown can leave the completer stuck inside a write.
            let attempt = bounded(async {
                let mut obj = checkout(&$pool).await?;
                let $client: &mut deadpool_postgres::Client = &mut obj;
                $op.await.map_err(|e| crate::db::failed(&e))
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
pub(super) const MAX_FLUSH: usize = 1024;

/// Writes completions and releases in batches: everything waiting when it gets to run.
///
/// Only the completions' own statement runs here, on the hot pool. What goes through the
/// general pool (the breakers' counting, releases, deferrals) runs in [`aside`], batch by
/// batch in the order they came: the general pool may be busy for a while (a backlog push,
/// retention, a scrape), and a completer waiting for it wrote no completion meanwhile, so
/// that the leases of attempts already delivered could run out and send them again.
pub(super) async fn completer(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Done>,
    hard_stop: CancellationToken,
) {
    // Unbounded, yet bounded by the places: a batch's failures, releases and deferrals
    // hold their places until `aside` has dealt with them, and no place, no claim.
    let (aside_tx, aside_rx) = mpsc::unbounded_channel();
    let side = tokio::spawn(aside(shared.clone(), aside_rx, hard_stop.clone()));
    let mut buf = Vec::with_capacity(MAX_FLUSH);
    loop {
        buf.clear();
        if rx.recv_many(&mut buf, MAX_FLUSH).await == 0 {
            break;
        }
        let mut completions = Vec::new();
        let mut logs = Vec::new();
        let mut batch = Aside {
            // The places this batch gives back once it is dealt with (a delivery gave its
            // own back when its task handed it over: `Done::frees_place_when_sent`).
            places: buf.iter().filter(|d| !d.frees_place_when_sent()).count(),
            ..Aside::default()
        };
        for d in buf.drain(..) {
            match d {
                Done::Completed(c, l) => {
                    completions.push(c);
                    logs.push(l);
                }
                Done::Released(id, token) => batch.releases.push((id, token)),
                Done::Deferred(d) => batch.deferrals.push(d),
            }
        }
        if !completions.is_empty() {
            // A try after a failed one runs the statement that knows the failed one may have
            // committed (its answer lost): the attempts are then not recorded twice.
            let mut again = false;
            let (worker, done) = (shared.cfg.worker_id.as_str(), completions.as_slice());
            let recorded = retry_db!(
                shared.pools.hot,
                hard_stop,
                "recording attempts",
                |client| {
                    let first = !std::mem::replace(&mut again, true);
                    async move {
                        if first {
                            claim::complete_cached(client, worker, done).await
                        } else {
                            claim::complete_again(client, worker, done).await
                        }
                    }
                }
            );
            // Counted whether or not the lease was still ours: the request was made.
            if shared.breakers.enabled() {
                batch.outcomes = completions
                    .iter()
                    .map(|c| (c.id, c.lease_token, c.transition.error_class()))
                    .collect();
            }
            match recorded {
                Some(outcomes) => log_attempts(&shared, &completions, &logs, &outcomes),
                None => tracing::error!(
                    count = completions.len(),
                    "could not record attempts before shutdown; their leases will expire and they will count as ambiguous"
                ),
            }
        }
        if aside_tx.send(batch).is_err() {
            tracing::error!(
                "the completer's breaker and release task has ended; recording no more attempts"
            );
            break;
        }
    }
    drop(aside_tx);
    if let Err(e) = side.await {
        tracing::error!(error = %e, "the completer's breaker and release task failed");
    }
}

/// One batch's share of the general pool, and the places it gives back when done.
#[derive(Default)]
struct Aside {
    /// Every completion's id, lease token and failure class, for the breakers.
    outcomes: Vec<super::breakers::Outcome>,
    releases: Vec<(i64, uuid::Uuid)>,
    deferrals: Vec<Deferred>,
    places: usize,
}

/// The general pool's side of the completer, one batch at a time: the breakers count a
/// batch's outcomes before its failures give their places back (so that a host's failures
/// open its breaker before more of its rows are claimed), then its releases and deferrals.
async fn aside(
    shared: Arc<Shared>,
    mut rx: mpsc::UnboundedReceiver<Aside>,
    hard_stop: CancellationToken,
) {
    while let Some(batch) = rx.recv().await {
        if !batch.outcomes.is_empty() {
            // Not past the hard stop: the general pool may be busy, and the stop must not
            // wait for it batch after batch.
            tokio::select! {
                biased;
                _ = hard_stop.cancelled() => {}
                _ = shared.breakers.record(&shared.pools.general, &batch.outcomes) => {}
            }
        }
        let Aside {
            releases,
            deferrals,
            places,
            ..
        } = batch;
        shared.breakers.forget(
            releases
                .iter()
                .copied()
                .chain(deferrals.iter().map(|d| (d.id, d.lease_token))),
        );
        if !releases.is_empty() {
            let released = retry_db!(
                shared.pools.general,
                hard_stop,
                "releasing messages",
                |client| { claim::release(&***client, &shared.cfg.worker_id, &releases) }
            );
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
        // A pause parks its rows with the destination's backlog; the others are due after
        // their delay.
        let (parked, deferrals): (Vec<Deferred>, Vec<Deferred>) = deferrals
            .into_iter()
            .partition(|d| d.deferral.reason == DeferReason::Paused);
        if !parked.is_empty() {
            let rows: Vec<_> = parked
                .iter()
                .map(|d| (d.id, d.lease_token, d.deferral.delay))
                .collect();
            let done = retry_db!(
                shared.pools.general,
                hard_stop,
                "parking messages of paused destinations",
                |client| { super::pauses::park(&***client, &rows) }
            );
            if let Some(ids) = done {
                // A row whose destination was resumed meanwhile is due after its delay.
                let now = std::time::Instant::now();
                for d in &parked {
                    shared.alarm(now + d.deferral.delay + ALARM_MARGIN);
                }
                log_deferrals(&shared, &parked, &ids);
            }
        }
        if !deferrals.is_empty() {
            let rows: Vec<_> = deferrals
                .iter()
                .map(|d| {
                    let breaker = d.deferral.reason == crate::state::DeferReason::Breaker;
                    (d.id, d.lease_token, d.deferral.delay, breaker)
                })
                .collect();
            let deferred = retry_db!(
                shared.pools.general,
                hard_stop,
                "deferring messages",
                |client| { claim::defer(&***client, &rows) }
            );
            if let Some(ids) = deferred {
                // Due again in the database from now on; the small margin covers the
                // difference between the two clocks' "now".
                let now = std::time::Instant::now();
                for d in &deferrals {
                    shared.alarm(now + d.deferral.delay + ALARM_MARGIN);
                }
                log_deferrals(&shared, &deferrals, &ids);
            }
        }
        shared.inflight.fetch_sub(places, Ordering::SeqCst);
        shared.wake.notify_one();
    }
}

/// One line per deferral, `deferred=<reason>`; a row whose lease was no longer ours was
/// not touched and says so.
fn log_deferrals(shared: &Shared, deferrals: &[Deferred], ids: &[i64]) {
    let ours: std::collections::HashSet<i64> = ids.iter().copied().collect();
    for d in deferrals {
        if ours.contains(&d.id) {
            crate::metrics::deferred(d.channel, d.deferral.reason);
            tracing::info!(
                message_id = d.id, key = %crate::text::Escaped(&d.key), channel = %d.channel,
                deferred = d.deferral.reason.as_str(),
                retry_in_ms = d.deferral.delay.as_millis() as u64,
                "not sent now; due again later, the attempt not counted"
            );
        } else {
            tracing::warn!(
                message_id = d.id, key = %crate::text::Escaped(&d.key), channel = %d.channel,
                deferred = d.deferral.reason.as_str(),
                "could not defer: the lease had been taken over"
            );
        }
    }
    lock(&shared.summary).deferred += ids.len() as u64;
}

pub(super) fn log_attempts(
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
            AttemptOutcome::Delivered | AttemptOutcome::Reconciled => summary.delivered += 1,
            AttemptOutcome::Retry => summary.retried += 1,
            AttemptOutcome::Dead => summary.dead += 1,
            AttemptOutcome::LeaseLost => summary.lease_lost += 1,
            // Written by operators, never by a completion. (A `reconciled` completion is a
            // delivery: the lookup found the earlier attempt had taken effect.)
            AttemptOutcome::Released
            | AttemptOutcome::Replayed
            | AttemptOutcome::Approved
            | AttemptOutcome::Cancelled
            | AttemptOutcome::Confirmed => {}
        }
        let class = c.transition.error_class().map(ErrorClass::as_str);
        let attempt = format_args!("{}/{}", c.attempt, l.max_attempts);
        let duration_ms = l.duration.as_millis() as u64;
        // A retry says when the next attempt comes: in how long, and at what time (the
        // completion wrote `run_after = now() + delay` a moment ago).
        let next = match (outcome, &c.transition) {
            (AttemptOutcome::Retry, Transition::Retry { delay, .. }) => {
                Some(NextAttempt::after(*delay))
            }
            _ => None,
        };
        match outcome {
            AttemptOutcome::Delivered | AttemptOutcome::Reconciled | AttemptOutcome::Retry => {
                tracing::info!(
                    message_id = c.id, key = %crate::text::Escaped(&l.key), channel = %l.channel, attempt = %attempt,
                    outcome = outcome.as_str(), error_class = class, status = c.status,
                    duration_ms, deduplicated = c.deduplicated, error = c.error.as_deref(),
                    next_attempt_in = next.as_ref().map(|n| tracing::field::display(&n.delay)),
                    retry_at = next.as_ref().map(|n| tracing::field::display(&n.at)),
                    "attempt finished"
                )
            }
            _ => tracing::warn!(
                message_id = c.id, key = %crate::text::Escaped(&l.key), channel = %l.channel, attempt = %attempt,
                outcome = outcome.as_str(), error_class = class, status = c.status,
                duration_ms, deduplicated = c.deduplicated, error = c.error.as_deref(),
                "attempt finished"
            ),
        }
    }
}

/// When a retried message's next attempt comes, for its log line.
struct NextAttempt {
    /// `next_attempt_in`: the delay, rounded for a person ([`Delay`]).
    delay: Delay,
    /// `retry_at`: the time, RFC 3339 in UTC to the second.
    at: String,
}

impl NextAttempt {
    fn after(delay: std::time::Duration) -> NextAttempt {
        let at = std::time::SystemTime::now() + delay;
        NextAttempt {
            delay: Delay(delay),
            at: rfc3339_seconds(at),
        }
    }
}

/// A delay as a person reads it: `850ms`, `9.7s`, `4m12s`, `2h5m`: the jittered delay's
/// milliseconds would be noise.
struct Delay(std::time::Duration);

impl std::fmt::Display for Delay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0.as_millis();
        if ms < 1_000 {
            return write!(f, "{ms}ms");
        }
        // Tenths of a second, a whole number written without `.0`; from 59.95 s on, a
        // minute.
        let tenths = (ms + 50) / 100;
        if tenths < 600 {
            return match tenths % 10 {
                0 => write!(f, "{}s", tenths / 10),
                t => write!(f, "{}.{t}s", tenths / 10),
            };
        }
        let secs = (ms + 500) / 1_000;
        if secs < 3_600 {
            return match secs % 60 {
                0 => write!(f, "{}m", secs / 60),
                s => write!(f, "{}m{s}s", secs / 60),
            };
        }
        let mins = (secs + 30) / 60;
        match mins % 60 {
            0 => write!(f, "{}h", mins / 60),
            m => write!(f, "{}h{m}m", mins / 60),
        }
    }
}

/// `2026-12-07T18:30:12Z`: `t` to the second (rounded down), in UTC; empty if it is out
/// of the calendar's range, which a retry delay capped by `--retry-max` never reaches.
fn rfc3339_seconds(t: std::time::SystemTime) -> String {
    let secs = match t.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(_) => return String::new(),
    };
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn delays_read_as_a_person_writes_them() {
        for (ms, want) in [
            (0, "0ms"),
            (850, "850ms"),
            (999, "999ms"),
            (1_000, "1s"),
            (9_734, "9.7s"),
            (9_960, "10s"),
            (59_940, "59.9s"),
            (59_960, "1m"),
            (60_000, "1m"),
            (252_400, "4m12s"),
            (900_000, "15m"),
            (3_599_600, "1h"),
            (7_500_000, "2h5m"),
        ] {
            assert_eq!(
                Delay(Duration::from_millis(ms)).to_string(),
                want,
                "{ms} ms"
            );
        }
    }

    #[test]
    fn retry_times_are_rfc3339_in_utc() {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_563_512_999);
        assert_eq!(rfc3339_seconds(t), "2026-12-06T13:25:12Z");
    }
}
