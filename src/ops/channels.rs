//! The channels: which are paused (by whom, since when, why), pausing and resuming one.

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;

use crate::model::Channel;
use crate::queries;

use super::stamp;

/// One channel and its pause (`outboxd channels`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChannelPause {
    /// `webhook`, `http` or `email`.
    pub channel: String,
    /// Whether a person paused it and nobody resumed it yet.
    pub paused: bool,
    /// Since when it is paused (RFC 3339), if paused.
    pub paused_at: Option<String>,
    /// Who paused it (`cli:<login>`, `console:<name>`, or a database role).
    pub paused_by: Option<String>,
    /// Why, as the person wrote it (one line), if they said.
    pub pause_reason: Option<String>,
}

/// Every channel, in [`Channel::ALL`]'s order, paused or not.
pub async fn channels<C: GenericClient>(
    client: &C,
) -> Result<Vec<ChannelPause>, tokio_postgres::Error> {
    let paused = paused_channels(client).await?;
    Ok(Channel::ALL
        .iter()
        .map(|c| {
            paused
                .iter()
                .find(|p| p.channel == c.as_str())
                .cloned()
                .unwrap_or_else(|| ChannelPause {
                    channel: c.as_str().to_owned(),
                    paused: false,
                    paused_at: None,
                    paused_by: None,
                    pause_reason: None,
                })
        })
        .collect())
}

/// The paused channels only, by name.
pub async fn paused_channels<C: GenericClient>(
    client: &C,
) -> Result<Vec<ChannelPause>, tokio_postgres::Error> {
    let rows = client.query(queries::PAUSED_CHANNELS, &[]).await?;
    Ok(rows
        .iter()
        .map(|r| ChannelPause {
            channel: r.get(0),
            paused: true,
            paused_at: stamp(r, 1),
            paused_by: r.get(2),
            pause_reason: r.get(3),
        })
        .collect())
}

/// Why a channel's pause or resume was refused; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum ChannelPauseError {
    /// Not one of outboxd's channels (SQLSTATE 22023 naming `channel`).
    #[error("{0}")]
    Unknown(String),
    /// A reason `outbox.reason_problem` refuses (22023 naming `reason`): the database's
    /// one line.
    #[error("{0}")]
    Invalid(String),
    /// The database failed.
    #[error("database error: {}", crate::db::describe(.0))]
    Database(#[source] tokio_postgres::Error),
}

impl From<tokio_postgres::Error> for ChannelPauseError {
    fn from(e: tokio_postgres::Error) -> Self {
        let Some(db) = e.as_db_error() else {
            return ChannelPauseError::Database(e);
        };
        if *db.code() != SqlState::INVALID_PARAMETER_VALUE {
            return ChannelPauseError::Database(e);
        }
        let message = db.message().to_owned();
        if db.column() == Some("channel") {
            ChannelPauseError::Unknown(message)
        } else {
            ChannelPauseError::Invalid(message)
        }
    }
}

/// What a pause or a resume did to a channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChannelChange {
    /// The channel.
    pub channel: String,
    /// False when there was nothing to do: already paused, or not paused.
    pub changed: bool,
}

/// Pauses `channel` (`outbox.pause_channel`), recorded as done by `actor`, with `reason`.
pub async fn pause_channel<C: GenericClient>(
    client: &C,
    channel: &str,
    reason: Option<&str>,
    actor: &str,
) -> Result<ChannelChange, ChannelPauseError> {
    let row = client
        .query_one(queries::PAUSE_CHANNEL, &[&channel, &reason, &actor])
        .await?;
    Ok(ChannelChange {
        channel: row.get(0),
        changed: row.get(1),
    })
}

/// Resumes `channel` (`outbox.resume_channel`), recorded as done by `actor`: its messages
/// are claimed again at once.
pub async fn resume_channel<C: GenericClient>(
    client: &C,
    channel: &str,
    actor: &str,
) -> Result<ChannelChange, ChannelPauseError> {
    let row = client
        .query_one(queries::RESUME_CHANNEL, &[&channel, &actor])
        .await?;
    Ok(ChannelChange {
        channel: row.get(0),
        changed: row.get(1),
    })
}
