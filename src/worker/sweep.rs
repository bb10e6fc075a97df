//! The lease sweep, beside the claim loop: settles the leases that expired (a worker died
//! or stalled past its lease) as ambiguous attempts, once per poll interval.
//!
//! Why not in every claim: nearly always no lease has expired, and asking in every claim
//! cost PostgreSQL 6 % of its instructions per delivery all the same. The price is time: an
//! expired lease is settled up to one poll interval after it runs out, rather than at the
//! next claim. A lease is tens of seconds; the poll interval is a second by default.
//!
//! A sweep that comes back full runs again at once, so a dead worker's thousand rows are
//! settled in a few statements, not one batch per interval. A settled row that may be sent
//! again is `pending`, due after the retry backoff; the claim loop is woken, and given an
//! alarm for when it comes due, so it is claimed then rather than at the next poll.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::db_call::{Backoff, bounded, checkout};
use super::{ALARM_MARGIN, Shared};
use crate::claim;
use crate::model::AttemptOutcome;
use crate::support::lock;

/// The alarms a sweep sets are rounded up to this.
const ALARM_BUCKET: Duration = Duration::from_millis(50);

/// Most alarms one sweep sets.
const ALARMS_PER_SWEEP: usize = 32;

/// Sweeps until `stop` fires. The stop is checked between sweeps, never during one: a
/// sweep that has settled rows logs and counts them before the worker's summary is read.
/// Each sweep runs as a task of its own, so that one that panics (a bug: nothing in it
/// unwraps outside input) is logged and followed by the next, as a failed statement is,
/// instead of ending the sweeping for good (`--drain` would then wait for ever on a row
/// whose lease expired).
pub(super) async fn expired_leases(shared: Arc<Shared>, stop: CancellationToken) {
    let cfg = &shared.cfg;
    let mut backoff = Backoff::new();
    loop {
        let swept = match tokio::spawn(sweep_once(shared.clone())).await {
            Ok(swept) => swept,
            Err(e) => Err(format!("the sweep's task failed: {e}")),
        };
        let wait = match swept {
            Ok(n) => {
                backoff.reset();
                // `max(1)`: a worker built by hand with a batch of 0 must not sweep in a loop.
                if n >= cfg.batch_size.max(1) && !stop.is_cancelled() {
                    continue;
                }
                cfg.poll_interval
            }
            Err(e) => {
                let wait = backoff.next();
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "lease sweep failed; retrying");
                wait
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// One sweep: settles up to a batch of expired leases and reports them. Returns how many.
async fn sweep_once(shared: Arc<Shared>) -> Result<usize, String> {
    let cfg = &shared.cfg;
    let settled = bounded(async {
        let client = checkout(&shared.pools.general).await?;
        claim::settle_expired(&**client, &cfg.channels, cfg.batch_size, &cfg.retry)
            .await
            .map_err(|e| crate::db::failed(&e))
    })
    .await?;
    if !settled.is_empty() {
        settle(&shared, &settled);
    }
    Ok(settled.len())
}

/// Logs and counts what a sweep settled, and tells the claim loop when the rows made
/// `pending` come due.
fn settle(shared: &Shared, settled: &claim::Settled) {
    let now = Instant::now();
    for d in &settled.deferred {
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
    // One alarm per distinct due time, to the nearest ALARM_BUCKET, and no more than
    // ALARMS_PER_SWEEP: a sweep of hundreds of rows must not fill the alarms the completer's
    // deferrals need. A row beyond them is found by the next poll.
    let mut due: Vec<u128> = settled
        .deferred
        .iter()
        .filter(|d| !d.retry_in.is_zero())
        .map(|d| d.retry_in.as_millis().div_ceil(ALARM_BUCKET.as_millis()))
        .collect();
    due.sort_unstable();
    due.dedup();
    for bucket in due.into_iter().take(ALARMS_PER_SWEEP) {
        let at = ALARM_BUCKET.saturating_mul(u32::try_from(bucket).unwrap_or(u32::MAX));
        shared.alarm(now + at + ALARM_MARGIN);
    }
    for g in &settled.gave_up {
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
    if !settled.gave_up.is_empty() {
        lock(&shared.summary).dead += settled.gave_up.len() as u64;
    }
    // Rows due now are claimed at once; the loop also reads the alarms set above.
    shared.wake.notify_one();
}
