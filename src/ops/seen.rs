//! What an operator was shown before an action, and the check that the rows are still so.

use std::collections::HashMap;

use tokio_postgres::GenericClient;

use crate::queries;

/// A row as an operator was shown it before an action: its state, and its version (its
/// `updated_at` in microseconds), which tells a row that changed and changed back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `dead`, `held`, `pending`…
    pub state: String,
    /// `updated_at`, in microseconds since the epoch.
    pub version: i64,
}

/// The states of the rows with these ids, as an operator is shown them before an action
/// ([`checkpoint_as_seen`](super::checkpoint_as_seen) holds the action to them).
pub async fn states_of<C: GenericClient>(
    client: &C,
    ids: &[i64],
) -> Result<HashMap<i64, Seen>, tokio_postgres::Error> {
    Ok(client
        .query(queries::STATES_OF, &[&ids])
        .await?
        .iter()
        .map(seen_of)
        .collect())
}

/// A row of [`queries::STATES_OF`] or [`queries::LOCK_STATES`]: id, state, version.
pub(super) fn seen_of(r: &tokio_postgres::Row) -> (i64, Seen) {
    (
        r.get(0),
        Seen {
            state: r.get(1),
            version: r.get(2),
        },
    )
}

/// Why a confirmed action must be refused: the first message in `seen` that is no longer
/// in the state and version the operator was shown, or None when all are. Locks the rows
/// (in id order, as the SQL functions lock them) first, so nothing changes between this
/// check and the action in the same transaction.
pub(super) async fn changed_since_seen(
    tx: &tokio_postgres::Transaction<'_>,
    ids: &[i64],
    seen: &[(i64, Seen)],
) -> Result<Option<String>, tokio_postgres::Error> {
    if seen.is_empty() {
        return Ok(None);
    }
    let now: HashMap<i64, Seen> = tx
        .query(queries::LOCK_STATES, &[&ids])
        .await?
        .iter()
        .map(seen_of)
        .collect();
    for (id, was) in seen {
        let why = match now.get(id) {
            Some(now) if now == was => continue,
            Some(now) if now.state == was.state => format!(
                "message {id} changed since it was shown, and is {} again",
                now.state
            ),
            now => format!(
                "message {id} is {} now, and was {} when it was shown",
                now.map_or("gone", |n| n.state.as_str()),
                crate::text::escape_truncated(&was.state, 20),
            ),
        };
        return Ok(Some(why));
    }
    Ok(None)
}
