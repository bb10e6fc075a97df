//! The daemon's maintenance, beside the claim loop: retention, and the ordering watch.
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
