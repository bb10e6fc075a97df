//! The last hour, minute by minute (the console's overview): attempts, latency, backlog;
//! and the daemon's backlog sample that the backlog chart reads.

use tokio_postgres::GenericClient;

use crate::queries;

/// Deliveries and failures in one minute of [`activity_per_minute`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinuteCount {
    /// The minute's start, unix seconds (the database's clock).
    pub minute: i64,
    /// Attempts that delivered.
    pub delivered: i64,
    /// Attempts that failed (retried, dead, or whose lease was lost).
    pub failed: i64,
}

/// The 50th and 99th percentiles of durations, in seconds (`percentile_cont`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// The median.
    pub p50: f64,
    /// The 99th percentile.
    pub p99: f64,
}

/// Delivery latency in one minute of [`activity_per_minute`], two ways (see
/// [`queries::ACTIVITY_PER_MINUTE`] for exactly what each measures).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MinuteLatency {
    /// The minute's start, unix seconds (the database's clock).
    pub minute: i64,
    /// Attempts that delivered in the minute.
    pub attempts: i64,
    /// Their durations (what the receiver took); `None` when there were none.
    pub attempt: Option<Percentiles>,
    /// Messages delivered in the minute.
    pub messages: i64,
    /// Their time from enqueue to delivery (what the application waited); `None` when
    /// there were none.
    pub end_to_end: Option<Percentiles>,
}

/// The last hour of attempts: counts and latency, oldest first, 60 minutes each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Activity {
    /// Deliveries and failures per minute.
    pub counts: Vec<MinuteCount>,
    /// Latency per minute.
    pub latency: Vec<MinuteLatency>,
}

/// The last hour of attempts, minute by minute, in one read of the history.
pub async fn activity_per_minute<C: GenericClient>(
    client: &C,
) -> Result<Activity, tokio_postgres::Error> {
    let rows = client
        .query_typed(queries::ACTIVITY_PER_MINUTE, &[])
        .await?;
    let mut out = Activity::default();
    for r in &rows {
        let minute = r.get::<_, f64>(0) as i64;
        out.counts.push(MinuteCount {
            minute,
            delivered: r.get(1),
            failed: r.get(2),
        });
        out.latency.push(MinuteLatency {
            minute,
            attempts: r.get(1),
            attempt: percentiles(r.get(3), r.get(4)),
            messages: r.get(5),
            end_to_end: percentiles(r.get(6), r.get(7)),
        });
    }
    Ok(out)
}

fn percentiles(p50: Option<f64>, p99: Option<f64>) -> Option<Percentiles> {
    Some(Percentiles {
        p50: p50?,
        p99: p99?,
    })
}

/// One minute of the backlog as a worker sampled it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BacklogSample {
    /// Messages due then, counted up to [`queries::BACKLOG_COUNT_CAP`].
    pub due: i64,
    /// The count stopped at the cap: at least `due` were due.
    pub capped: bool,
    /// How long the oldest of them had been due, in seconds; 0 when none was.
    pub oldest_due_seconds: f64,
}

/// One minute of [`backlog_per_minute`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BacklogMinute {
    /// The minute's start, unix seconds (the database's clock).
    pub minute: i64,
    /// The sample taken in it; `None` when no worker was running to take one.
    pub sample: Option<BacklogSample>,
}

/// The last hour of backlog samples, oldest first (always 60 minutes).
pub async fn backlog_per_minute<C: GenericClient>(
    client: &C,
) -> Result<Vec<BacklogMinute>, tokio_postgres::Error> {
    Ok(client
        .query_typed(queries::BACKLOG_PER_MINUTE, &[])
        .await?
        .iter()
        .map(|r| {
            let due: Option<i64> = r.get(1);
            let oldest: Option<f64> = r.get(2);
            BacklogMinute {
                minute: r.get::<_, f64>(0) as i64,
                sample: due
                    .zip(oldest)
                    .map(|(due, oldest_due_seconds)| BacklogSample {
                        due,
                        capped: due >= queries::BACKLOG_COUNT_CAP,
                        oldest_due_seconds,
                    }),
            }
        })
        .collect())
}

/// Records this minute's backlog sample unless a worker already did
/// ([`queries::BACKLOG_SAMPLE`]), and forgets the samples older than a day. Returns the
/// minute's start (unix seconds) when this call recorded it.
pub async fn sample_backlog<C: GenericClient>(
    client: &C,
) -> Result<Option<i64>, tokio_postgres::Error> {
    Ok(client
        .query_opt(queries::BACKLOG_SAMPLE, &[&queries::BACKLOG_COUNT_CAP])
        .await?
        .map(|r| r.get::<_, f64>(0) as i64))
}
