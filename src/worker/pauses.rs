//! Destinations paused by a person (`outbox.pause_destination`), apart from the breakers.
//!
//! The pause itself parks the destination's due backlog far ahead, so the claim (unchanged)
//! does not pick it. Every worker reads the paused hosts at most once per poll interval
//! ([`Pauses::run_refresh`]), whether breakers are on or not; a claimed row of a paused host
//! (one that came due later, or was claimed before this worker saw the pause) is given back
//! unsent and uncounted before any breaker is asked, so no probe is taken either, and parked
//! with the rest ([`park`]). `outbox.resume_destination` makes them all due at once.
//!
//! Channels paused by a person (`outbox.pause_channel`) are read with them: the claim loop
//! leaves a paused channel out of its claims, so its messages stay due, unclaimed and
//! uncounted, until `outbox.resume_channel` (which wakes the idle workers).

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::db_call::{bounded, checkout};
use crate::model::Channel;
use crate::queries;
use crate::support::lock;

/// How long a row waits when only its lookup's host is paused: that row is not parked
/// (the resume of its own destination would not find it), so it asks again this often.
pub(super) const LOOKUP_PAUSED_WAIT: Duration = Duration::from_secs(10);

/// The paused hosts as this worker last read them.
#[derive(Default)]
pub(super) struct Pauses {
    paused: Mutex<HashSet<String>>,
    /// The paused channels as this worker last read them.
    channels: Mutex<HashSet<Channel>>,
    refreshed: Mutex<Option<Instant>>,
    /// A refresh is running (the claim loop starts them in tasks of their own).
    refreshing: AtomicBool,
}

impl Pauses {
    /// Whether `host` was paused when last read.
    pub(super) fn holds(&self, host: &str) -> bool {
        let paused = lock(&self.paused);
        !paused.is_empty() && paused.contains(host)
    }

    /// Whether `channel` was paused when last read.
    pub(super) fn holds_channel(&self, channel: Channel) -> bool {
        lock(&self.channels).contains(&channel)
    }

    /// `channels` without the ones paused when last read.
    pub(super) fn unpaused(&self, channels: &[Channel]) -> Vec<Channel> {
        let paused = lock(&self.channels);
        channels
            .iter()
            .copied()
            .filter(|c| !paused.contains(c))
            .collect()
    }

    /// The next [`Pauses::begin_refresh`] starts one, however recent the last: a channel
    /// was resumed.
    pub(super) fn mark_stale(&self) {
        *lock(&self.refreshed) = None;
    }

    /// Marked stale ([`Pauses::mark_stale`]) since the last refresh began: one that was
    /// running then may have read the pauses before the resume.
    pub(super) fn is_stale(&self) -> bool {
        lock(&self.refreshed).is_none()
    }

    /// Whether a refresh is due (at most once per `every`) and none is running; if so, it
    /// counts as begun, and [`Pauses::run_refresh`] must follow.
    pub(super) fn begin_refresh(&self, every: Duration) -> bool {
        if self.refreshing.swap(true, Ordering::SeqCst) {
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

    /// Reads the paused hosts and channels; on failure keeps what it knew (and logs one line).
    /// True when a channel paused before is paused no more: its messages are due, and the
    /// caller wakes the claim loop.
    pub(super) async fn run_refresh(&self, pool: &Pool) -> bool {
        // Ends the refresh however this future ends, dropped included.
        struct Ending<'a>(&'a AtomicBool);
        impl Drop for Ending<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _ending = Ending(&self.refreshing);
        let read = bounded(async {
            let client = checkout(pool).await?;
            let hosts = client
                .query(queries::PAUSED_VIEW, &[])
                .await
                .map_err(|e| crate::db::failed(&e))?;
            let channels = client
                .query(queries::PAUSED_CHANNELS, &[])
                .await
                .map_err(|e| crate::db::failed(&e))?;
            Ok((hosts, channels))
        })
        .await;
        match read {
            Ok((hosts, channels)) => {
                let hosts: HashSet<String> = hosts.iter().map(|r| r.get(0)).collect();
                *lock(&self.paused) = hosts;
                let channels: HashSet<Channel> = channels
                    .iter()
                    .filter_map(|r| Channel::parse(r.get(0)))
                    .collect();
                let mut known = lock(&self.channels);
                let resumed = known.iter().any(|c| !channels.contains(c));
                *known = channels;
                resumed
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading paused destinations and channels failed");
                false
            }
        }
    }

    /// Reads the paused hosts and channels now, whenever it last did (before the first claim).
    pub(super) async fn refresh(&self, pool: &Pool) {
        if self.begin_refresh(Duration::ZERO) {
            self.run_refresh(pool).await;
        }
    }
}

/// Gives back claimed rows held by a pause (`(id, lease token, delay)`), fenced by lease
/// token: parked with their destination's backlog while it is paused, else due after the
/// delay ([`queries::PARK`]). Returns the ids given back.
pub(super) async fn park<C: GenericClient>(
    client: &C,
    rows: &[(i64, Uuid, Duration)],
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let tokens: Vec<Uuid> = rows.iter().map(|r| r.1).collect();
    let delays: Vec<f64> = rows.iter().map(|r| r.2.as_secs_f64()).collect();
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&ids, Type::INT8_ARRAY),
        (&tokens, Type::UUID_ARRAY),
        (&delays, Type::FLOAT8_ARRAY),
    ];
    let rows = client.query_typed(queries::PARK, &params).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
