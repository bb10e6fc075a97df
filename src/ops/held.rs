//! Held messages: listing them and a page of them.

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};

use crate::model::Channel;
use crate::queries;

use super::stamp;

/// Filters of `held`.
#[derive(Debug, Clone, Default)]
pub struct HeldFilter {
    /// Only this channel.
    pub channel: Option<Channel>,
    /// Only those enqueued within this long.
    pub since: Option<Duration>,
}

/// One held message, as `outboxd held --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeldMessage {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub message_key: String,
    /// Its channel.
    pub channel: String,
    /// When it was enqueued (RFC 3339).
    pub created_at: String,
}

/// Held messages matching `filter`, oldest first, at most `limit`.
pub async fn held<C: GenericClient>(
    client: &C,
    filter: &HeldFilter,
    limit: i64,
) -> Result<Vec<HeldMessage>, tokio_postgres::Error> {
    let channel = filter.channel.map(Channel::as_str);
    let since = filter.since.map(|d| d.as_secs_f64());
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&channel, Type::TEXT),
        (&since, Type::FLOAT8),
        (&limit, Type::INT8),
    ];
    let rows = client.query_typed(queries::HELD_LIST, &params).await?;
    Ok(rows.iter().map(held_message).collect())
}

fn held_message(r: &tokio_postgres::Row) -> HeldMessage {
    HeldMessage {
        id: r.get(0),
        message_key: r.get(1),
        channel: r.get(2),
        created_at: stamp(r, 3).unwrap_or_default(),
    }
}

/// One page of [`held`] (oldest first, `limit` rows after skipping `offset`) and how many
/// match the filter in all, for a pager (the console).
pub async fn held_page<C: GenericClient>(
    client: &C,
    filter: &HeldFilter,
    limit: i64,
    offset: i64,
) -> Result<(Vec<HeldMessage>, i64), tokio_postgres::Error> {
    let channel = filter.channel.map(Channel::as_str);
    let since = filter.since.map(|d| d.as_secs_f64());
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&channel, Type::TEXT),
        (&since, Type::FLOAT8),
        (&limit, Type::INT8),
        (&offset, Type::INT8),
    ];
    let rows = client.query_typed(queries::HELD_PAGE, &params).await?;
    let total: i64 = client
        .query_typed_one(queries::HELD_COUNT, &params[..2])
        .await?
        .get(0);
    Ok((rows.iter().map(held_message).collect(), total))
}
