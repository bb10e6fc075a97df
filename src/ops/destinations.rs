//! The breakers' destinations: listing them, closing one by hand, bringing its backlog back.

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::queries;

use super::stamp;

/// A destination whose circuit breaker is open, half-open, or counting failures
/// (`outboxd destinations`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Destination {
    /// The destination, as `outbox.destination_of` names it (`host` or `host:port`).
    pub host: String,
    /// `closed`, `open` or `half_open`.
    pub state: String,
    /// Transient or ambiguous failures in a row, since the last success.
    pub consecutive_failures: i32,
    /// When an open circuit lets its probe through (RFC 3339), if open.
    pub open_until: Option<String>,
}

/// Destinations that are open, half-open or failing: open ones first, then by name.
pub async fn destinations<C: GenericClient>(
    client: &C,
) -> Result<Vec<Destination>, tokio_postgres::Error> {
    let rows = client.query(queries::DESTINATIONS_LIST, &[]).await?;
    Ok(rows
        .iter()
        .map(|r| Destination {
            host: r.get(0),
            state: r.get(1),
            consecutive_failures: r.get(2),
            open_until: stamp(r, 3),
        })
        .collect())
}

/// Closes `host`'s circuit by hand and makes the backlog its opening had pushed back due at
/// once. `None` when no destination of that name was ever recorded; else the rows brought
/// back.
pub async fn close_destination<C: GenericClient>(
    client: &C,
    host: &str,
) -> Result<Option<i64>, tokio_postgres::Error> {
    let row = client
        .query_opt(queries::DESTINATION_CLOSE, &[&host])
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let pushed: Option<std::time::SystemTime> = row.get(0);
    match pushed {
        Some(at) => restore_backlog(client, host, at).await.map(Some),
        None => Ok(Some(0)),
    }
}

/// The destinations of `host` (named without a port) on every port it was reached at:
/// `127.0.0.1` finds `127.0.0.1:8080` and `127.0.0.1:9090`.
pub async fn destinations_of_host<C: GenericClient>(
    client: &C,
    host: &str,
) -> Result<Vec<String>, tokio_postgres::Error> {
    Ok(client
        .query(queries::DESTINATIONS_OF_HOST, &[&host])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Rows moved per statement when a closed host's backlog comes back.
const RESTORE_BATCH: i64 = 5000;

/// How far past the pushed time a held-back row may be due and still come back: rows
/// deferred by a worker while the circuit was open are due then, give or take the worker's
/// clock.
const RESTORE_SLACK_SECONDS: f64 = 60.0;

/// Makes the rows an opening of `host` held back until `at` (its `deferred_until`) due now,
/// in batches; returns how many (see [`queries::BREAKER_RESTORE`]).
pub async fn restore_backlog<C: GenericClient>(
    client: &C,
    host: &str,
    at: std::time::SystemTime,
) -> Result<i64, tokio_postgres::Error> {
    let mut total = 0;
    loop {
        let n: i64 = client
            .query_one(
                queries::BREAKER_RESTORE,
                &[&host, &at, &RESTORE_BATCH, &RESTORE_SLACK_SECONDS],
            )
            .await?
            .get(0);
        total += n;
        if n < RESTORE_BATCH {
            return Ok(total);
        }
    }
}
