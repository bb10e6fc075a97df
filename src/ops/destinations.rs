//! The destinations: listing them, pausing and resuming one, closing one's circuit by hand
//! and bringing its backlog back.

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;

use crate::queries;

use super::stamp;

/// A destination that is paused, or whose circuit breaker is open, half-open, or counting
/// failures (`outboxd destinations`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Destination {
    /// The destination, as `outbox.destination_of` names it (`host` or `host:port`).
    pub host: String,
    /// `paused` while a person has paused it, else its circuit's state.
    pub state: String,
    /// The circuit breaker's state: `closed`, `open` or `half_open` (paused or not).
    pub circuit: String,
    /// Transient or ambiguous failures in a row, since the last success.
    pub consecutive_failures: i32,
    /// When an open circuit lets its probe through (RFC 3339), if open.
    pub open_until: Option<String>,
    /// Since when it is paused (RFC 3339), if paused.
    pub paused_at: Option<String>,
    /// Who paused it (`cli:<login>`, `console:<name>`, or a database role).
    pub paused_by: Option<String>,
    /// Why, as the person wrote it (one line), if they said.
    pub pause_reason: Option<String>,
}

/// Destinations that are paused, open, half-open or failing: paused ones first, then open
/// ones, then by name.
pub async fn destinations<C: GenericClient>(
    client: &C,
) -> Result<Vec<Destination>, tokio_postgres::Error> {
    let rows = client.query(queries::DESTINATIONS_LIST, &[]).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let circuit: String = r.get(1);
            let paused_at = stamp(r, 4);
            Destination {
                host: r.get(0),
                state: if paused_at.is_some() {
                    "paused".to_owned()
                } else {
                    circuit.clone()
                },
                circuit,
                consecutive_failures: r.get(2),
                open_until: stamp(r, 3),
                paused_at,
                paused_by: r.get(5),
                pause_reason: r.get(6),
            }
        })
        .collect())
}

/// Why a pause or a resume was refused; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    /// A host or reason `outbox.pause_destination` does not take (SQLSTATE 22023); the
    /// database's one line names the field.
    #[error("{0}")]
    Invalid(String),
    /// No destination of that name is known (P0002, resume only).
    #[error("{0}")]
    Unknown(String),
    /// The database failed.
    #[error("database error: {}", crate::db::describe(.0))]
    Database(#[source] tokio_postgres::Error),
}

impl From<tokio_postgres::Error> for PauseError {
    fn from(e: tokio_postgres::Error) -> Self {
        let message = e.as_db_error().map(|d| d.message().to_owned());
        match (e.code(), message) {
            (Some(c), Some(m)) if *c == SqlState::INVALID_PARAMETER_VALUE => PauseError::Invalid(m),
            (Some(c), Some(m)) if *c == SqlState::NO_DATA_FOUND => PauseError::Unknown(m),
            _ => PauseError::Database(e),
        }
    }
}

/// What a pause or a resume did to one destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PauseChange {
    /// The destination, as `outbox.destination_name` wrote it.
    pub destination: String,
    /// False when there was nothing to do: already paused, or not paused.
    pub changed: bool,
    /// Messages held back by the pause, or made due again by the resume.
    pub messages: i64,
}

/// Pauses `host` (`outbox.pause_destination`), recorded as done by `actor`, with `reason`.
pub async fn pause_destination<C: GenericClient>(
    client: &C,
    host: &str,
    reason: Option<&str>,
    actor: &str,
) -> Result<PauseChange, PauseError> {
    let row = client
        .query_one(queries::PAUSE_DESTINATION, &[&host, &reason, &actor])
        .await?;
    Ok(PauseChange {
        destination: row.get(0),
        changed: row.get(1),
        messages: row.get(2),
    })
}

/// Resumes `host` (`outbox.resume_destination`), recorded as done by `actor`: the messages
/// its pause held back are due at once.
pub async fn resume_destination<C: GenericClient>(
    client: &C,
    host: &str,
    actor: &str,
) -> Result<PauseChange, PauseError> {
    let row = client
        .query_one(queries::RESUME_DESTINATION, &[&host, &actor])
        .await?;
    Ok(PauseChange {
        destination: row.get(0),
        changed: row.get(1),
        messages: row.get(2),
    })
}

/// Closes `host`'s circuit by hand, recorded as done by `actor`, and makes the backlog its
/// opening had pushed back due at once. `None` when no destination of that name was ever
/// recorded; else the rows brought back. A pause stays.
pub async fn close_destination<C: GenericClient>(
    client: &C,
    host: &str,
    actor: &str,
) -> Result<Option<i64>, tokio_postgres::Error> {
    let row = client
        .query_opt(queries::DESTINATION_CLOSE, &[&host, &actor])
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
