//! Operator actions: dead letters, one message's story, replay, retention.
//!
//! The rules of replay and purge live in SQL (`outbox.replay`, `outbox.purge` in
//! `sql/0002_operations.sql`) so that psql users and the CLI get the same behaviour; this
//! module resolves names, reports, and loops.

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient};

use crate::deliver::Channel;
use crate::queries;
use crate::retry::ErrorClass;

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
    fn params(&self) -> (Option<&'static str>, Option<&'static str>, Option<f64>) {
        (
            self.channel.map(Channel::as_str),
            self.error_class.map(ErrorClass::as_str),
            self.since.map(|d| d.as_secs_f64()),
        )
    }
}

/// RFC 3339 text of a timestamp.
fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
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
    Ok(rows
        .iter()
        .map(|r| DeadLetter {
            id: r.get(0),
            message_key: r.get(1),
            channel: r.get(2),
            attempts: r.get(3),
            error_class: r.get(4),
            last_error: r.get(5),
            dead_at: r
                .get::<_, Option<time::OffsetDateTime>>(6)
                .map(rfc3339)
                .unwrap_or_default(),
        })
        .collect())
}

/// One attempt (or operator action) in a message's history.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttemptRecord {
    /// The attempt number.
    pub attempt: i32,
    /// The worker or operator.
    pub worker: Option<String>,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// When it ended (RFC 3339).
    pub finished_at: Option<String>,
    /// How it ended.
    pub outcome: String,
    /// The failure's class.
    pub error_class: Option<String>,
    /// The failure, one line.
    pub error: Option<String>,
    /// HTTP status or SMTP code.
    pub status: Option<i32>,
    /// The provider deduplicated it.
    pub deduplicated: bool,
}

/// A message and its history, as `outboxd show --json` prints it. Header values in the
/// payload are redacted (they often carry credentials).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageDetail {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub message_key: String,
    /// Its channel.
    pub channel: String,
    /// Its state.
    pub state: String,
    /// Attempts started.
    pub attempts: i32,
    /// The budget.
    pub max_attempts: i32,
    /// May an ambiguous failure be retried?
    pub retry_ambiguous: bool,
    /// The payload, header values redacted.
    pub payload: serde_json::Value,
    /// Not claimed before this.
    pub run_after: String,
    /// The worker holding it, while running.
    pub lease_owner: Option<String>,
    /// Until when, while running.
    pub lease_expires_at: Option<String>,
    /// The last failure's class.
    pub error_class: Option<String>,
    /// The last failure.
    pub last_error: Option<String>,
    /// The provider's last answer, summarised.
    pub response: Option<serde_json::Value>,
    /// Timestamps (RFC 3339).
    pub created_at: String,
    /// Last change.
    pub updated_at: String,
    /// When delivered.
    pub delivered_at: Option<String>,
    /// When it died.
    pub dead_at: Option<String>,
    /// Every attempt and operator action, oldest first.
    pub history: Vec<AttemptRecord>,
}

/// Replaces the values of `payload.headers` with `[redacted]`, and the password and query
/// of `payload.url` (where tokens and credentials usually sit); the path is kept so that an
/// operator can tell endpoints apart.
pub fn redact_payload(mut payload: serde_json::Value) -> serde_json::Value {
    if let Some(headers) = payload.get_mut("headers").and_then(|h| h.as_object_mut()) {
        for v in headers.values_mut() {
            *v = serde_json::Value::String("[redacted]".into());
        }
    }
    if let Some(serde_json::Value::String(url)) = payload.get_mut("url") {
        if let Ok(mut parsed) = url::Url::parse(url) {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("redacted"));
            }
            if parsed.query().is_some() {
                parsed.set_query(Some("redacted"));
            }
            *url = parsed.to_string();
        }
    }
    payload
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

/// One message and its history, or None when the target matches nothing.
pub async fn show<C: GenericClient>(
    client: &C,
    target: &Target,
) -> Result<Option<MessageDetail>, tokio_postgres::Error> {
    let (found, _) = resolve(client, std::slice::from_ref(target)).await?;
    let Some((id, _)) = found.first() else {
        return Ok(None);
    };
    let Some(r) = client
        .query_typed_opt(queries::SHOW_MESSAGE, &[(id, Type::INT8)])
        .await?
    else {
        return Ok(None);
    };
    let ts = |i: usize| r.get::<_, Option<time::OffsetDateTime>>(i).map(rfc3339);
    let mut detail = MessageDetail {
        id: r.get(0),
        message_key: r.get(1),
        channel: r.get(2),
        state: r.get(3),
        attempts: r.get(4),
        max_attempts: r.get(5),
        retry_ambiguous: r.get(6),
        payload: redact_payload(r.get(7)),
        run_after: ts(8).unwrap_or_default(),
        lease_owner: r.get(9),
        lease_expires_at: ts(10),
        error_class: r.get(11),
        last_error: r.get(12),
        response: r.get(13),
        created_at: ts(14).unwrap_or_default(),
        updated_at: ts(15).unwrap_or_default(),
        delivered_at: ts(16),
        dead_at: ts(17),
        history: Vec::new(),
    };
    for a in client
        .query_typed(queries::SHOW_ATTEMPTS, &[(id, Type::INT8)])
        .await?
    {
        detail.history.push(AttemptRecord {
            attempt: a.get(0),
            worker: a.get(1),
            started_at: a
                .get::<_, Option<time::OffsetDateTime>>(2)
                .map(rfc3339)
                .unwrap_or_default(),
            finished_at: a.get::<_, Option<time::OffsetDateTime>>(3).map(rfc3339),
            outcome: a.get(4),
            error_class: a.get(5),
            error: a.get(6),
            status: a.get(7),
            deduplicated: a.get(8),
        });
    }
    Ok(Some(detail))
}

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
    /// Some named messages are not dead (the database's message names them).
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
    let rows = tx
        .query_typed(
            queries::REPLAY,
            &[(&ids, Type::INT8_ARRAY), (&actor, Type::TEXT)],
        )
        .await
        .map_err(|e| match e.as_db_error() {
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
    let secs = older_than.as_secs_f64();
    let mut total = 0i64;
    loop {
        let params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&secs, Type::FLOAT8),
            (&include_dead, Type::BOOL),
            (&batch, Type::INT4),
        ];
        let n: i64 = client
            .query_typed_one(queries::PURGE_BATCH, &params)
            .await?
            .get(0);
        if n == 0 {
            return Ok(total);
        }
        total += n;
        progress(total);
    }
}

/// The daemon's retention: purges delivered messages older than `retention` now and every
/// `every` after, until `stop` fires. Dead letters are kept for an operator to look at
/// (`outboxd purge --include-dead` removes them).
pub async fn retention_loop(
    pool: deadpool_postgres::Pool,
    retention: Duration,
    every: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        match pool.get().await {
            Ok(client) => match purge(&**client, retention, false, 1000, |_| {}).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "retention: purged delivered messages"),
                Err(e) => {
                    tracing::warn!(error = %crate::db::describe(&e), "retention purge failed; will try again")
                }
            },
            Err(e) => {
                tracing::warn!(error = %crate::db::describe_pool(&e), "retention purge: no database connection; will try again")
            }
        }

        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
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

    #[test]
    fn header_values_are_redacted() {
        let p = serde_json::json!({"url": "https://u:pw@x.example/hooks/a?token=t0k", "headers": {"Authorization": "Bearer s3cret"}, "body": 1});
        let r = redact_payload(p);
        assert_eq!(r["headers"]["Authorization"], "[redacted]");
        assert_eq!(r["url"], "https://u:redacted@x.example/hooks/a?redacted");
        assert_eq!(r["body"], 1);
    }
}
