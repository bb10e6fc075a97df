//! The http channel's endpoints, read from `outbox.endpoints` at start and every
//! [`REFRESH`] after, beside the loop, and again before an attempt whose endpoint the last
//! reading did not hold (one made since): a change is seen within a few seconds, without a
//! restart. The channel checks the rows ([`crate::deliver::http::endpoint`]); this reads
//! them.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use super::db_call::{bounded, checkout};
use crate::deliver::http::endpoint::{EndpointRow, Endpoints};

/// How often the endpoints are read again.
pub(super) const REFRESH: Duration = Duration::from_secs(2);

/// Reads every endpoint and replaces the channel's table; a row that does not check is
/// logged (its name and column, never a value) and its messages die saying why.
pub(super) async fn refresh(pool: &Pool, endpoints: &Endpoints) -> Result<(), String> {
    let rows = bounded(async {
        let client = checkout(pool).await?;
        client
            .query(crate::queries::ENDPOINTS, &[])
            .await
            .map_err(|e| crate::db::failed(&e))
    })
    .await?;
    // By position, in the statement's order (some column names are also payload members,
    // which only the channel names).
    let rows: Vec<EndpointRow> = rows
        .iter()
        .map(|r| EndpointRow {
            name: r.get(0),
            url: r.get(1),
            auth_header: r.get(2),
            auth_secret: r.get(3),
            idempotency_header: r.get(4),
            key_ttl: r.get(5),
            headers: r.get(6),
        })
        .collect();
    for error in endpoints.replace(&rows) {
        tracing::warn!(error = %crate::text::Escaped(&error), "an endpoint cannot be used");
    }
    Ok(())
}

/// Refreshes the endpoints every [`REFRESH`] until `stop`.
pub(super) async fn watch(pool: Pool, endpoints: Endpoints, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(REFRESH) => {}
            _ = stop.cancelled() => return,
        }
        if let Err(e) = refresh(&pool, &endpoints).await {
            tracing::warn!(error = %e, "reading outbox.endpoints failed; will try again");
        }
    }
}
