//! The human checkpoints: approve, cancel, confirm.

use tokio_postgres::Client;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use crate::queries;

use super::seen::{Seen, changed_since_seen};
use super::{Target, resolve};

/// A person's decision about named messages: the human checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checkpoint {
    /// held → pending (`outbox.approve`).
    Approve,
    /// held, pending or dead → cancelled (`outbox.cancel`), with an optional one-line reason.
    Cancel {
        /// Kept in the history row's `error`; `outbox.cancel` checks it.
        reason: Option<String>,
    },
    /// dead with class ambiguous → delivered (`outbox.confirm`): a person checked with the
    /// provider that it took effect.
    Confirm,
}

impl Checkpoint {
    /// The past participle the messages use: `approved`, `cancelled`, `confirmed`.
    pub fn done(&self) -> &'static str {
        match self {
            Checkpoint::Approve => "approved",
            Checkpoint::Cancel { .. } => "cancelled",
            Checkpoint::Confirm => "confirmed",
        }
    }
}

/// Why a checkpoint action was refused; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Some named messages do not exist.
    #[error("no such message: {}; nothing {done}", .targets.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    Unknown {
        /// The names that matched nothing.
        targets: Vec<Target>,
        /// `approved`, `cancelled` or `confirmed`.
        done: &'static str,
    },
    /// No message was named.
    #[error("no message named; nothing {0}")]
    Empty(&'static str),
    /// Some named messages are in a state the action does not take (SQLSTATE 55000), or
    /// went away meanwhile (P0002); the database's message names them.
    #[error("{0}")]
    Refused(String),
    /// Bad input (SQLSTATE 22023: the cancel reason); the database's message names it.
    #[error("{0}")]
    Invalid(String),
    /// The database failed.
    #[error("database error: {}", crate::db::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Applies `action` to the named messages in one transaction, all or nothing, with `actor`
/// recorded in each history row. Returns `(id, key)` of each message changed, by id.
pub async fn checkpoint(
    client: &mut Client,
    action: &Checkpoint,
    targets: &[Target],
    actor: &str,
) -> Result<Vec<(i64, String)>, CheckpointError> {
    checkpoint_as_seen(client, action, targets, actor, &[]).await
}

/// [`checkpoint`], refused unless each message in `seen` is still in the state and version
/// the operator saw when they asked for it (the console's confirmation page). `cancel`
/// takes held, pending and dead rows alike, so without this a message replayed or
/// approved by someone else between the page and its button was cancelled all the same.
/// The rows are locked (in id order, as the SQL functions lock them) before the check,
/// so nothing changes between the check and the action.
pub async fn checkpoint_as_seen(
    client: &mut Client,
    action: &Checkpoint,
    targets: &[Target],
    actor: &str,
    seen: &[(i64, Seen)],
) -> Result<Vec<(i64, String)>, CheckpointError> {
    checkpoint_checked(client, action, targets, actor, seen, false).await
}

/// What [`checkpoint`] would answer, changing nothing: the SQL function runs and its
/// transaction is rolled back, so a refusal (a row in a state the action does not take) is
/// the function's own, told before an operator confirms.
pub async fn checkpoint_dry_run(
    client: &mut Client,
    action: &Checkpoint,
    targets: &[Target],
    actor: &str,
) -> Result<Vec<(i64, String)>, CheckpointError> {
    checkpoint_checked(client, action, targets, actor, &[], true).await
}

async fn checkpoint_checked(
    client: &mut Client,
    action: &Checkpoint,
    targets: &[Target],
    actor: &str,
    seen: &[(i64, Seen)],
    dry_run: bool,
) -> Result<Vec<(i64, String)>, CheckpointError> {
    if targets.is_empty() {
        return Err(CheckpointError::Empty(action.done()));
    }
    let tx = client.transaction().await?;
    let (found, unknown) = resolve(&tx, targets).await?;
    if !unknown.is_empty() {
        return Err(CheckpointError::Unknown {
            targets: unknown,
            done: action.done(),
        });
    }
    let ids: Vec<i64> = found.iter().map(|c| c.0).collect();
    if let Some(why) = changed_since_seen(&tx, &ids, seen).await? {
        return Err(CheckpointError::Refused(format!(
            "{why}; nothing {}",
            action.done()
        )));
    }
    let rows = match action {
        Checkpoint::Approve => {
            tx.query_typed(
                queries::APPROVE,
                &[(&ids, Type::INT8_ARRAY), (&actor, Type::TEXT)],
            )
            .await
        }
        Checkpoint::Cancel { reason } => {
            tx.query_typed(
                queries::CANCEL,
                &[
                    (&ids, Type::INT8_ARRAY),
                    (reason, Type::TEXT),
                    (&actor, Type::TEXT),
                ],
            )
            .await
        }
        Checkpoint::Confirm => {
            tx.query_typed(
                queries::CONFIRM,
                &[(&ids, Type::INT8_ARRAY), (&actor, Type::TEXT)],
            )
            .await
        }
    }
    .map_err(|e| match e.as_db_error() {
        Some(db)
            if *db.code() == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE
                || *db.code() == SqlState::NO_DATA_FOUND =>
        {
            CheckpointError::Refused(db.message().to_owned())
        }
        Some(db) if *db.code() == SqlState::INVALID_PARAMETER_VALUE => {
            CheckpointError::Invalid(db.message().to_owned())
        }
        Some(db) if *db.code() == SqlState::CHARACTER_NOT_IN_REPERTOIRE => {
            CheckpointError::Invalid(format!(
                "reason must not contain NUL characters; nothing {}",
                action.done()
            ))
        }
        _ => CheckpointError::Database(e),
    })?;
    let mut changed: Vec<(i64, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    changed.sort();
    if dry_run {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(changed)
}
