//! The worker's own database calls: each bounded in time, failures as one line, retried
//! with back-off.

use std::time::Duration;

use deadpool_postgres::Pool;

/// How long one database call of the loop may take before it counts as failed.
pub(super) const DB_TIMEOUT: Duration = Duration::from_secs(30);

/// One database call of the loop, bounded by [`DB_TIMEOUT`]; failures as one line.
pub(super) async fn bounded<T>(call: impl Future<Output = Result<T, String>>) -> Result<T, String> {
    tokio::time::timeout(DB_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {}s", DB_TIMEOUT.as_secs())))
}

/// A pooled connection, or why there is none, as one line.
pub(super) async fn checkout(pool: &Pool) -> Result<deadpool_postgres::Object, String> {
    pool.get().await.map_err(|e| crate::db::describe_pool(&e))
}

/// Exponential back-off for the worker's own database retries: 100 ms doubling to 10 s,
/// with jitter (backon's schedule).
pub(super) struct Backoff {
    builder: backon::ExponentialBuilder,
    iter: Option<backon::ExponentialBackoff>,
}

impl Backoff {
    pub(super) fn new() -> Self {
        use backon::BackoffBuilder as _;
        let builder = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(10))
            .with_jitter()
            .without_max_times();
        Backoff {
            iter: Some(builder.build()),
            builder,
        }
    }

    /// 1 ms doubling to 100 ms: retries on a healthy connection that wait for another
    /// transaction, not for the database to come back.
    pub(super) fn quick() -> Self {
        use backon::BackoffBuilder as _;
        let builder = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(1))
            .with_max_delay(Duration::from_millis(100))
            .without_max_times();
        Backoff {
            iter: Some(builder.build()),
            builder,
        }
    }

    pub(super) fn next(&mut self) -> Duration {
        use backon::BackoffBuilder as _;
        let builder = self.builder;
        self.iter
            .get_or_insert_with(|| builder.build())
            .next()
            .unwrap_or(Duration::from_secs(10))
    }

    pub(super) fn reset(&mut self) {
        self.iter = None;
    }
}
