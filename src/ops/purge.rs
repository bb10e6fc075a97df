//! Purge: finished messages deleted in short batches.

use std::time::Duration;

use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};

use crate::queries;

/// Deletes finished messages older than `older_than` (delivered ones; dead ones too with
/// `include_dead`) in batches of `batch`, each its own short transaction. `progress` is
/// called with the running total after each batch. Returns the total deleted.
pub async fn purge<C: GenericClient>(
    client: &C,
    older_than: Duration,
    include_dead: bool,
    batch: i32,
    mut progress: impl FnMut(i64),
) -> Result<i64, tokio_postgres::Error> {
    let mut total = 0i64;
    loop {
        let n = purge_batch(client, older_than, include_dead, batch).await?;
        if n == 0 {
            return Ok(total);
        }
        total += n;
        progress(total);
    }
}

/// Deletes one batch of [`purge`] in its own short transaction; returns how many rows.
pub async fn purge_batch<C: GenericClient>(
    client: &C,
    older_than: Duration,
    include_dead: bool,
    batch: i32,
) -> Result<i64, tokio_postgres::Error> {
    let secs = older_than.as_secs_f64();
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&secs, Type::FLOAT8),
        (&include_dead, Type::BOOL),
        (&batch, Type::INT4),
    ];
    Ok(client
        .query_typed_one(queries::PURGE_BATCH, &params)
        .await?
        .get(0))
}
