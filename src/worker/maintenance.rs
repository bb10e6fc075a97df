//! The daemon's maintenance, beside the claim loop: retention, the ordering watch, the
//! watch for channels no worker serves, and the backlog sampler.
//!
//! Retention purges delivered
//! messages older than `--retention` now and every `every` after, a batch at a time, each
//! batch its own short transaction, and it stops between batches when the daemon stops (a
//! purge of millions of rows must not hold a SIGTERM up). Dead letters are kept for an
//! operator (`outboxd purge --include-dead` removes them).

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use super::db_call::{bounded, checkout};

/// Rows deleted per statement.
const BATCH: i32 = 1000;

/// Runs retention until `stop` fires.
pub async fn retention(pool: Pool, retention: Duration, every: Duration, stop: CancellationToken) {
    loop {
        match purge_delivered(&pool, retention, BATCH, &stop, |_| {}).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "retention: purged delivered messages"),
            Err(e) => tracing::warn!(error = %e, "retention purge failed; will try again"),
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Purges delivered messages older than `older_than`, `batch` rows a statement, until none
/// is left or `stop` fires (checked between batches and raced against each); `progress`
/// sees the running total after each batch. Returns how many rows were deleted.
pub async fn purge_delivered(
    pool: &Pool,
    older_than: Duration,
    batch: i32,
    stop: &CancellationToken,
    mut progress: impl FnMut(i64),
) -> Result<i64, String> {
    let mut total = 0;
    while !stop.is_cancelled() {
        let one = bounded(async {
            let client = checkout(pool).await?;
            crate::ops::purge_batch(&**client, older_than, false, batch)
                .await
                .map_err(|e| crate::db::failed(&e))
        });
        let n = tokio::select! {
            n = one => n?,
            _ = stop.cancelled() => break,
        };
        if n == 0 {
            break;
        }
        total += n;
        progress(total);
    }
    Ok(total)
}

/// Groups named per round of the ordering watch.
const ORDERING_LOGGED: i64 = 20;

/// The ordering watch: a message waiting for an earlier one of its ordering group is never
/// claimed (the claim skips it), so it has no attempt to log its deferral with. Every
/// `every` this logs, as `deferred=ordering`, the groups held up by a head that is `dead`,
/// `held` or waiting for its retry (at most [`ORDERING_LOGGED`] a round, oldest first): the
/// group's key, how many wait, the head's key and state. A flowing group is not logged.
pub async fn ordering_watch(pool: Pool, every: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
        let read = bounded(async {
            let client = checkout(&pool).await?;
            client
                .query(crate::queries::ORDERING_HELD_UP, &[&ORDERING_LOGGED])
                .await
                .map_err(|e| crate::db::failed(&e))
        });
        // A stop does not wait for a busy pool.
        let rows = tokio::select! {
            rows = read => rows,
            _ = stop.cancelled() => return,
        };
        match rows {
            Ok(rows) => {
                for r in rows {
                    let group: String = r.get(0);
                    let waiting: i64 = r.get(1);
                    let head: String = r.get(2);
                    let state: String = r.get(3);
                    let due_in: Option<f64> = r.get(4);
                    tracing::info!(
                        deferred = "ordering",
                        ordering_key = %crate::text::Escaped(&group),
                        waiting,
                        head = %crate::text::Escaped(&head),
                        head_state = %state,
                        head_due_in_ms = due_in.map(|s| (s.max(0.0) * 1000.0) as u64),
                        "ordering group waits for its head"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "ordering watch: reading held-up groups failed"),
        }
    }
}

/// How long the oldest due message of a channel this worker does not serve waits before the
/// worker warns: a channel served by other workers has its messages due for a moment only,
/// so only one whose messages stay due this long looks unserved.
pub const UNSERVED_AFTER: Duration = Duration::from_secs(30);

/// At most one warning per channel this often, however often the watch looks.
pub const UNSERVED_WARN_EVERY: Duration = Duration::from_secs(300);

/// Due messages the unserved watch reads at most per round (of `messages_due_idx`, oldest
/// first): its cost stays bounded under any backlog. A channel's messages behind that many
/// others due are seen once the backlog before them shrinks.
const UNSERVED_READ: i64 = 10_000;

/// Which channels' warnings are due now: one per channel per [`UNSERVED_WARN_EVERY`].
#[derive(Debug, Default)]
pub struct WarnThrottle {
    last: std::collections::HashMap<String, std::time::Instant>,
}

impl WarnThrottle {
    /// Should `channel` be warned about at `now`? True the first time, then again once
    /// [`UNSERVED_WARN_EVERY`] has passed since the last warning.
    pub fn allow(&mut self, channel: &str, now: std::time::Instant) -> bool {
        match self.last.get(channel) {
            Some(at) if now.saturating_duration_since(*at) < UNSERVED_WARN_EVERY => false,
            _ => {
                self.last.insert(channel.to_owned(), now);
                true
            }
        }
    }
}

/// The unserved watch: a message of a channel no running worker serves (e-mail enqueued
/// while every worker runs without `OUTBOXD_SMTP_URL`) would wait silently. Now and every
/// `every`, this worker looks for due messages of the channels it does not serve (nor a
/// person paused: `outbox.pause_channel`) whose oldest has been due for
/// [`UNSERVED_AFTER`], and warns, per channel at most once per [`UNSERVED_WARN_EVERY`]:
/// how many are due and for how long. Workers record nowhere
/// which channels they serve, so a worker cannot tell an unserved channel from one whose
/// workers are far behind; the warning asks, and `outboxd status` shows each channel's due
/// messages and the age of the oldest.
pub async fn unserved_watch(
    pool: Pool,
    served: Vec<crate::model::Channel>,
    every: Duration,
    stop: CancellationToken,
) {
    let served_names: Vec<&str> = served.iter().map(|c| c.as_str()).collect();
    let served_list = served_names.join(",");
    let mut throttle = WarnThrottle::default();
    loop {
        let read = bounded(async {
            let client = checkout(&pool).await?;
            // A paused channel's messages wait for a person, not for a worker.
            let paused: Vec<String> = client
                .query(crate::queries::PAUSED_CHANNELS, &[])
                .await
                .map_err(|e| crate::db::failed(&e))?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let mut leave_out = served_names.clone();
            leave_out.extend(paused.iter().map(String::as_str));
            crate::status::due_by_channel(&**client, &leave_out, Some(UNSERVED_READ))
                .await
                .map_err(|e| crate::db::failed(&e))
        });
        // A stop does not wait for a busy pool.
        let due = tokio::select! {
            due = read => due,
            _ = stop.cancelled() => return,
        };
        match due {
            Ok(due) => {
                let now = std::time::Instant::now();
                for (channel, d) in due {
                    if d.oldest_due_seconds < UNSERVED_AFTER.as_secs_f64()
                        || !throttle.allow(&channel, now)
                    {
                        continue;
                    }
                    tracing::warn!(
                        channel = %crate::text::Escaped(&channel),
                        due = d.due,
                        oldest_due_seconds = d.oldest_due_seconds as u64,
                        served = %served_list,
                        "messages of a channel this worker does not serve are waiting: is a \
                         worker serving it running? (outboxd run --channels; email needs \
                         OUTBOXD_SMTP_URL)"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "unserved watch: reading due messages failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// How often the backlog sampler looks: twice a minute, so that every minute has a look in
/// it (the spacing is this plus one statement's time, well under a minute).
pub const BACKLOG_SAMPLE_EVERY: Duration = Duration::from_secs(30);

/// The backlog sampler: now and every `every`, records the backlog of this minute (how many
/// messages are due and how long the oldest has waited) in `outbox.backlog_samples`, for
/// the console's backlog chart, unless a worker already recorded it.
///
/// Why a sample rather than a reconstruction from `outbox.messages` when the page is
/// read: the figure at a past minute is not in the table. A retry overwrites `run_after`,
/// a deferral moves it, a held message waits for a person without being due, and a
/// claimed one is no longer waiting, so "the oldest due at 12:03" could only be guessed,
/// and the guess (every minute of the hour against every message that waited in it) took
/// seconds (6.5 s on a busy two-core machine) with 100 000 waiting and 100 000 delivered
/// messages, where reading 60 samples takes milliseconds. A sample costs one statement per
/// worker per look ([`crate::queries::BACKLOG_SAMPLE`]: the first look of a minute counts
/// up to 100 000 entries of the due index, tens of milliseconds under a deep backlog; the
/// others probe the primary key) and one row per minute, kept for a day. A minute no worker ran in has
/// no sample, and the chart shows the gap.
pub async fn backlog_sampler(pool: Pool, every: Duration, stop: CancellationToken) {
    let mut failing = false;
    loop {
        let sample = bounded(async {
            let client = checkout(&pool).await?;
            crate::ops::sample_backlog(&**client)
                .await
                .map_err(|e| crate::db::failed(&e))
        });
        // A stop does not wait for a busy pool.
        let sampled = tokio::select! {
            sampled = sample => sampled,
            _ = stop.cancelled() => return,
        };
        match sampled {
            Ok(_) if failing => {
                failing = false;
                tracing::info!("backlog sampler: recording again");
            }
            Ok(_) => {}
            // Once per outage, not every look.
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "backlog sampler: recording the backlog failed; will try again");
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A channel is warned about once, then not again until the interval has passed,
    /// however often the watch looks; channels are throttled each on its own.
    #[test]
    fn one_warning_per_channel_per_interval() {
        let mut t = WarnThrottle::default();
        let t0 = Instant::now();
        assert!(t.allow("email", t0));
        assert!(!t.allow("email", t0 + Duration::from_secs(1)));
        assert!(t.allow("webhook", t0 + Duration::from_secs(1)));
        assert!(!t.allow("email", t0 + UNSERVED_WARN_EVERY - Duration::from_millis(1)));
        assert!(t.allow("email", t0 + UNSERVED_WARN_EVERY));
        assert!(!t.allow("email", t0 + UNSERVED_WARN_EVERY + Duration::from_secs(60)));
    }
}
