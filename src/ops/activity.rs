//! The last hour of attempts, minute by minute (the console's overview).

use tokio_postgres::GenericClient;

use crate::queries;

/// Deliveries and failures in one minute of [`attempts_per_minute`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinuteCount {
    /// The minute's start, unix seconds (the database's clock).
    pub minute: i64,
    /// Attempts that delivered.
    pub delivered: i64,
    /// Attempts that failed (retried, dead, or whose lease was lost).
    pub failed: i64,
}

/// The last hour of attempts, minute by minute, oldest first (always 60 minutes).
pub async fn attempts_per_minute<C: GenericClient>(
    client: &C,
) -> Result<Vec<MinuteCount>, tokio_postgres::Error> {
    Ok(client
        .query_typed(queries::ATTEMPTS_PER_MINUTE, &[])
        .await?
        .iter()
        .map(|r| MinuteCount {
            minute: r.get::<_, f64>(0) as i64,
            delivered: r.get(1),
            failed: r.get(2),
        })
        .collect())
}
