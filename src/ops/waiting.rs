//! What waits for each destination, and what happened to one: the console's destination
//! pages.

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::queries;

use super::stamp;

/// One destination as the console lists it: its circuit, its pause, and the messages that
/// wait for it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DestinationWaiting {
    /// `host` or `host:port`, as `outbox.destination_of` names it.
    pub host: String,
    /// The circuit (`closed`, `open`, `half_open`); `None` when the breakers never saw it.
    pub circuit: Option<String>,
    /// Transient or ambiguous failures in a row.
    pub consecutive_failures: i32,
    /// When an open circuit lets its probe through (RFC 3339).
    pub open_until: Option<String>,
    /// Since when it is paused (RFC 3339), if paused.
    pub paused_at: Option<String>,
    /// Who paused it.
    pub paused_by: Option<String>,
    /// Why, as written.
    pub pause_reason: Option<String>,
    /// Pending and due now (a paused destination's due ones are parked instead).
    pub due: i64,
    /// Pending and held back by the pause.
    pub parked: i64,
    /// Pending and due later (retries, schedules).
    pub later: i64,
    /// Waiting for a person's approval.
    pub held: i64,
    /// Claimed by a worker now.
    pub running: i64,
    /// The `run_after` of the oldest due message (RFC 3339).
    pub oldest_due: Option<String>,
}

impl DestinationWaiting {
    /// Whether a person has paused it.
    pub fn paused(&self) -> bool {
        self.paused_at.is_some()
    }
}

/// The most index entries one count reads: a count that reaches it means "at least".
pub const WAITING_CAP: i64 = 100_000;

/// Destinations known to the breakers or with messages waiting, at most `limit` (paused
/// ones first, then open ones, then by name), or only `only`. See
/// [`queries::DESTINATIONS_WAITING`].
pub async fn destinations_waiting<C: GenericClient>(
    client: &C,
    limit: i64,
    only: Option<&str>,
) -> Result<Vec<DestinationWaiting>, tokio_postgres::Error> {
    let rows = client
        .query(
            queries::DESTINATIONS_WAITING,
            &[&WAITING_CAP, &limit, &only],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| DestinationWaiting {
            host: r.get(0),
            circuit: r.get(1),
            consecutive_failures: r.get::<_, Option<i32>>(2).unwrap_or(0),
            open_until: stamp(r, 3),
            paused_at: stamp(r, 4),
            paused_by: r.get(5),
            pause_reason: r.get(6),
            due: r.get(7),
            parked: r.get(8),
            later: r.get(9),
            held: r.get(10),
            running: r.get(11),
            oldest_due: stamp(r, 12),
        })
        .collect())
}

/// One attempt that reached for a destination: no error text, no URL, no header.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecentAttempt {
    /// The history row's id.
    pub id: i64,
    /// The message.
    pub message_id: i64,
    /// Its attempt number.
    pub attempt: i32,
    /// `delivered`, `retry`, `dead`, `reconciled` or `lease_lost`.
    pub outcome: String,
    /// The failure's class, if it failed.
    pub error_class: Option<String>,
    /// The HTTP status, if an answer came.
    pub status: Option<i32>,
    /// When it started (RFC 3339).
    pub started_at: Option<String>,
    /// How long it took, in milliseconds.
    pub millis: Option<f64>,
}

/// How many of the newest history rows [`destination_outcomes`] looks through.
pub const OUTCOMES_LOOKED_AT: i64 = 5_000;

/// The last `n` attempts at `host` among the newest [`OUTCOMES_LOOKED_AT`] history rows.
pub async fn destination_outcomes<C: GenericClient>(
    client: &C,
    host: &str,
    n: i64,
) -> Result<Vec<RecentAttempt>, tokio_postgres::Error> {
    let rows = client
        .query(
            queries::DESTINATION_OUTCOMES,
            &[&host, &OUTCOMES_LOOKED_AT, &n],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| RecentAttempt {
            id: r.get(0),
            message_id: r.get(1),
            attempt: r.get(2),
            outcome: r.get(3),
            error_class: r.get(4),
            status: r.get(5),
            started_at: stamp(r, 6),
            millis: r.get(7),
        })
        .collect())
}

/// What an operator did to a destination.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DestinationAction {
    /// `paused`, `resumed` or `closed`.
    pub action: String,
    /// Who.
    pub actor: String,
    /// Why (a pause's reason), as written.
    pub reason: Option<String>,
    /// Messages held back (pause) or made due (resume).
    pub messages: Option<i64>,
    /// When (RFC 3339).
    pub at: Option<String>,
}

/// The last `n` operator actions on `host`, newest first.
pub async fn destination_actions<C: GenericClient>(
    client: &C,
    host: &str,
    n: i64,
) -> Result<Vec<DestinationAction>, tokio_postgres::Error> {
    let rows = client
        .query(queries::DESTINATION_ACTIONS, &[&host, &n])
        .await?;
    Ok(rows
        .iter()
        .map(|r| DestinationAction {
            action: r.get(0),
            actor: r.get(1),
            reason: r.get(2),
            messages: r.get(3),
            at: stamp(r, 4),
        })
        .collect())
}
