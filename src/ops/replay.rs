//! Replay: dead letters back to pending, all or nothing.

use tokio_postgres::Client;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::queries;

use super::dead::DeadFilter;
use super::seen::{Seen, changed_since_seen};
use super::{Target, resolve};

/// What to replay.
#[derive(Debug, Clone)]
pub enum ReplaySelection {
    /// These messages; every one must exist and be dead.
    Named(Vec<Target>),
    /// Every dead letter matching the filter.
    AllDead(DeadFilter),
}

/// Why a replay was refused; nothing was replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Some named messages do not exist.
    #[error("no such message: {}; nothing replayed", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    Unknown(Vec<Target>),
    /// Some named messages are not dead, or may not be replayed: an http message whose
    /// endpoint is gone, or one that may have taken effect after its provider's key window
    /// closed, without `force` (the database's message names them).
    #[error("{0}")]
    NotDead(String),
    /// The database failed.
    #[error("database error: {}", crate::db::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Replays dead messages in one transaction: all or nothing. With `dry_run` the
/// transaction is rolled back after the checks, so the answer is what would be replayed.
/// Returns `(id, key)` of each message replayed.
pub async fn replay(
    client: &mut Client,
    selection: &ReplaySelection,
    actor: &str,
    dry_run: bool,
) -> Result<Vec<(i64, String)>, ReplayError> {
    replay_checked(client, selection, actor, dry_run, false, &[]).await
}

/// [`replay`], and with `force` also the dead letters that may have taken effect after
/// their provider's key window closed (`outboxd replay --force`: a person decided to send
/// once more; `outbox.replay` records it in the history row).
pub async fn replay_forced(
    client: &mut Client,
    selection: &ReplaySelection,
    actor: &str,
    dry_run: bool,
    force: bool,
) -> Result<Vec<(i64, String)>, ReplayError> {
    replay_checked(client, selection, actor, dry_run, force, &[]).await
}

/// [`replay`], refused unless each message in `seen` is still in the state and version the
/// operator was shown (the console's confirmation page): a dead letter replayed by someone
/// else meanwhile, and dead again for another reason, is not replayed a second time on the
/// strength of a page that showed its earlier failure.
pub async fn replay_as_seen(
    client: &mut Client,
    selection: &ReplaySelection,
    actor: &str,
    dry_run: bool,
    seen: &[(i64, Seen)],
) -> Result<Vec<(i64, String)>, ReplayError> {
    replay_checked(client, selection, actor, dry_run, false, seen).await
}

async fn replay_checked(
    client: &mut Client,
    selection: &ReplaySelection,
    actor: &str,
    dry_run: bool,
    force: bool,
    seen: &[(i64, Seen)],
) -> Result<Vec<(i64, String)>, ReplayError> {
    let tx = client.transaction().await?;
    let chosen: Vec<(i64, String)> = match selection {
        ReplaySelection::Named(targets) => {
            let (found, unknown) = resolve(&tx, targets).await?;
            if !unknown.is_empty() {
                return Err(ReplayError::Unknown(unknown));
            }
            found
        }
        ReplaySelection::AllDead(filter) => {
            let (channel, class, since) = filter.params();
            let params: [(&(dyn ToSql + Sync), Type); 3] = [
                (&channel, Type::TEXT),
                (&class, Type::TEXT),
                (&since, Type::FLOAT8),
            ];
            tx.query_typed(queries::DEAD_IDS, &params)
                .await?
                .iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect()
        }
    };
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = chosen.iter().map(|c| c.0).collect();
    if let Some(why) = changed_since_seen(&tx, &ids, seen).await? {
        return Err(ReplayError::NotDead(format!("{why}; nothing replayed")));
    }
    let rows = if force {
        tx.query_typed(
            queries::REPLAY_FORCE,
            &[
                (&ids, Type::INT8_ARRAY),
                (&actor, Type::TEXT),
                (&force, Type::BOOL),
            ],
        )
        .await
    } else {
        tx.query_typed(
            queries::REPLAY,
            &[(&ids, Type::INT8_ARRAY), (&actor, Type::TEXT)],
        )
        .await
    };
    let rows = rows.map_err(|e| match e.as_db_error() {
        Some(db) if *db.code() == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE => {
            ReplayError::NotDead(db.message().to_owned())
        }
        _ => ReplayError::Database(e),
    })?;
    let mut replayed: Vec<(i64, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    replayed.sort();
    if dry_run {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(replayed)
}
