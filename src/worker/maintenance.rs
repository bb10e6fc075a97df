//! The daemon's maintenance, beside the claim loop: retention. It purges delivered
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
                .map_err(|e| crate::db::describe(&e))
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
