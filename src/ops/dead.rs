//! Dead letters: listing them, a page of them, and the ids an action on all of them takes.

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};

use crate::model::Channel;
use crate::model::ErrorClass;
use crate::queries;

use super::stamp;

/// Filters of `dead` and `replay --all-dead`.
#[derive(Debug, Clone, Default)]
pub struct DeadFilter {
    /// Only this channel.
    pub channel: Option<Channel>,
    /// Only this error class.
    pub error_class: Option<ErrorClass>,
    /// Only those that died within this long.
    pub since: Option<Duration>,
}

impl DeadFilter {
    pub(super) fn params(&self) -> (Option<&'static str>, Option<&'static str>, Option<f64>) {
        (
            self.channel.map(Channel::as_str),
            self.error_class.map(ErrorClass::as_str),
            self.since.map(|d| d.as_secs_f64()),
        )
    }
}

/// One dead letter, as `outboxd dead --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub message_key: String,
    /// Its channel.
    pub channel: String,
    /// Attempts made.
    pub attempts: i32,
    /// Why it died.
    pub error_class: Option<String>,
    /// The last error, one line.
    pub last_error: Option<String>,
    /// When it died (RFC 3339).
    pub dead_at: String,
}

/// Dead letters matching `filter`, newest first, at most `limit`.
pub async fn dead_letters<C: GenericClient>(
    client: &C,
    filter: &DeadFilter,
    limit: i64,
) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
    let (channel, class, since) = filter.params();
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&channel, Type::TEXT),
        (&class, Type::TEXT),
        (&since, Type::FLOAT8),
        (&limit, Type::INT8),
    ];
    let rows = client.query_typed(queries::DEAD_LIST, &params).await?;
    Ok(rows.iter().map(dead_letter).collect())
}

fn dead_letter(r: &tokio_postgres::Row) -> DeadLetter {
    DeadLetter {
        id: r.get(0),
        message_key: r.get(1),
        channel: r.get(2),
        attempts: r.get(3),
        error_class: r.get(4),
        last_error: r.get(5),
        dead_at: stamp(r, 6).unwrap_or_default(),
    }
}

/// One page of [`dead_letters`] (newest first, `limit` rows after skipping `offset`) and how
/// many match the filter in all, for a pager (the console).
pub async fn dead_letters_page<C: GenericClient>(
    client: &C,
    filter: &DeadFilter,
    limit: i64,
    offset: i64,
) -> Result<(Vec<DeadLetter>, i64), tokio_postgres::Error> {
    let (channel, class, since) = filter.params();
    let params: [(&(dyn ToSql + Sync), Type); 5] = [
        (&channel, Type::TEXT),
        (&class, Type::TEXT),
        (&since, Type::FLOAT8),
        (&limit, Type::INT8),
        (&offset, Type::INT8),
    ];
    let rows = client.query_typed(queries::DEAD_PAGE, &params).await?;
    let total: i64 = client
        .query_typed_one(queries::DEAD_COUNT, &params[..3])
        .await?
        .get(0);
    Ok((rows.iter().map(dead_letter).collect(), total))
}

/// The `(id, key)` of the first `limit` dead letters matching `filter`, by id, and how many
/// match in all: what an action on "everything the filter matches" touches.
pub async fn dead_ids<C: GenericClient>(
    client: &C,
    filter: &DeadFilter,
    limit: i64,
) -> Result<(Vec<(i64, String)>, i64), tokio_postgres::Error> {
    let (channel, class, since) = filter.params();
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&channel, Type::TEXT),
        (&class, Type::TEXT),
        (&since, Type::FLOAT8),
        (&limit, Type::INT8),
    ];
    let first = client
        .query_typed(queries::DEAD_IDS_FIRST, &params)
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let total: i64 = client
        .query_typed_one(queries::DEAD_COUNT, &params[..3])
        .await?
        .get(0);
    Ok((first, total))
}
