//! Operator actions: dead letters, held messages, one message's story, replay, the human
//! checkpoints (approve, cancel, confirm), purge, endpoints.
//!
//! The rules of replay, purge and the checkpoints live in SQL (`outbox.replay`,
//! `outbox.purge`, `outbox.approve`, `outbox.cancel`,
//! `outbox.confirm`, in `sql/0001_baseline.sql`) so that psql users and the CLI get
//! the same behaviour; this module resolves names, reports, and loops.
//!
//! One room per concern: `dead` letters, `held` messages, one message's story (`show`),
//! `replay`, the `checkpoint`s and the `seen`-state check they and replay share, `purge`,
//! the `destinations` (listing, pause, resume, close), the `channels` a person paused, the
//! http channel's `endpoints`, and the console's `activity` chart, its listing of every
//! message (`messages`) and its destination pages (`waiting`). This file names
//! messages ([`Target`], [`resolve`]) and holds the timestamp helpers they all print with.

use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use crate::queries;

mod activity;
mod channels;
mod checkpoint;
mod dead;
mod destinations;
mod endpoints;
mod held;
mod messages;
mod purge;
mod replay;
mod seen;
mod show;
mod waiting;

pub use activity::{
    Activity, BacklogMinute, BacklogSample, MinuteCount, MinuteLatency, Percentiles,
    activity_per_minute, backlog_per_minute, sample_backlog,
};
pub use channels::{
    ChannelChange, ChannelPause, ChannelPauseError, channels, pause_channel, paused_channels,
    resume_channel,
};
pub use checkpoint::{
    Checkpoint, CheckpointError, checkpoint, checkpoint_as_seen, checkpoint_dry_run,
};
pub use dead::{DeadFilter, DeadLetter, dead_ids, dead_letters, dead_letters_page};
pub use destinations::{
    Destination, PauseChange, PauseError, close_destination, destinations, destinations_of_host,
    pause_destination, restore_backlog, resume_destination,
};
pub use endpoints::{
    Endpoint, EndpointError, EndpointSet, EndpointSpec, endpoints, remove_endpoint, set_endpoint,
};
pub use held::{HeldFilter, HeldMessage, held, held_page};
pub use messages::{
    Cursor, ListedMessage, MessageFilter, MessagePage, count_messages, database_now, messages_page,
    prefix_end,
};
pub use purge::{purge, purge_batch};
pub use replay::{ReplayError, ReplaySelection, replay, replay_as_seen, replay_forced};
pub use seen::{Seen, states_of};
pub use show::{AttemptRecord, MessageDetail, NextStep, next_steps, redact_payload, show};
pub use waiting::{
    DestinationAction, DestinationWaiting, OUTCOMES_LOOKED_AT, RecentAttempt, WAITING_CAP,
    destination_actions, destination_outcomes, destinations_waiting,
};

/// A message named on the command line: digits only is an id, anything else a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `outbox.messages.id`.
    Id(i64),
    /// `outbox.messages.message_key`.
    Key(String),
}

impl Target {
    /// Parses an `ID|KEY` argument.
    pub fn parse(arg: &str) -> Target {
        if !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(id) = arg.parse() {
                return Target::Id(id);
            }
        }
        Target::Key(arg.to_owned())
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Id(id) => write!(f, "id {id}"),
            Target::Key(k) => write!(f, "key {k:?}"),
        }
    }
}

/// RFC 3339 text of a timestamp.
fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}

/// A timestamp column as RFC 3339 text, never a panic: a row may hold `infinity` or
/// `-infinity` (enqueue refuses them; a row changed by hand may hold one), written as
/// PostgreSQL writes them, or a year past what `time` reads, shown as such.
fn stamp(row: &tokio_postgres::Row, i: usize) -> Option<String> {
    use tokio_postgres::types::Timestamp;
    match row.try_get::<_, Option<Timestamp<time::OffsetDateTime>>>(i) {
        Ok(None) => None,
        Ok(Some(Timestamp::Value(t))) => Some(rfc3339(t)),
        Ok(Some(Timestamp::PosInfinity)) => Some("infinity".to_owned()),
        Ok(Some(Timestamp::NegInfinity)) => Some("-infinity".to_owned()),
        Err(_) => Some("(out of range)".to_owned()),
    }
}

/// Resolves targets to `(id, key)`; the ones that match nothing are returned apart.
pub async fn resolve<C: GenericClient>(
    client: &C,
    targets: &[Target],
) -> Result<(Vec<(i64, String)>, Vec<Target>), tokio_postgres::Error> {
    let ids: Vec<i64> = targets
        .iter()
        .filter_map(|t| {
            if let Target::Id(i) = t {
                Some(*i)
            } else {
                None
            }
        })
        .collect();
    let keys: Vec<&str> = targets
        .iter()
        .filter_map(|t| {
            if let Target::Key(k) = t {
                Some(k.as_str())
            } else {
                None
            }
        })
        .collect();
    let rows = client
        .query_typed(
            queries::RESOLVE,
            &[(&ids, Type::INT8_ARRAY), (&keys, Type::TEXT_ARRAY)],
        )
        .await?;
    let found: Vec<(i64, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut resolved = Vec::new();
    let mut unknown = Vec::new();
    for t in targets {
        let hit = found.iter().find(|(id, key)| match t {
            Target::Id(i) => id == i,
            Target::Key(k) => key == k,
        });
        match hit {
            Some(h) if !resolved.contains(h) => resolved.push(h.clone()),
            Some(_) => {}
            None => unknown.push(t.clone()),
        }
    }
    Ok((resolved, unknown))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(Target::parse("42"), Target::Id(42));
        assert_eq!(
            Target::parse("order-42:paid"),
            Target::Key("order-42:paid".into())
        );
        assert_eq!(Target::parse("42a"), Target::Key("42a".into()));
        assert_eq!(Target::parse("-1"), Target::Key("-1".into()));
        // Digits beyond i64 cannot be an id.
        assert_eq!(
            Target::parse("99999999999999999999"),
            Target::Key("99999999999999999999".into())
        );
    }
}
