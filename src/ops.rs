//! Operator actions: dead letters, held messages, one message's story, replay, the human
//! checkpoints (approve, cancel, confirm), purge.
//!
//! The rules of replay, purge and the checkpoints live in SQL (`outbox.replay`,
//! `outbox.purge` in `sql/0002_operations.sql`; `outbox.approve`, `outbox.cancel`,
//! `outbox.confirm` in `sql/0009_human_checkpoints.sql`) so that psql users and the CLI get
//! the same behaviour; this module resolves names, reports, and loops.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient};

use crate::model::Channel;
use crate::model::ErrorClass;
use crate::queries;

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

/// A timestamp column as RFC 3339 text, never a panic: a row may hold `infinity` or
/// `-infinity` (enqueue refuses them since sql/0007, older rows may not), written as
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

/// A message and its history, as `outboxd show --json` prints it. The payload is redacted
/// by [`redact_payload`] (header values, a URL's user info, path and query, e-mail
/// addresses, subject and bodies).
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
    /// The payload, redacted by [`redact_payload`].
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
    /// When it was cancelled.
    pub cancelled_at: Option<String>,
    /// Its ordering group, if any (`sql/0012`).
    pub ordering_key: Option<String>,
    /// Every attempt and operator action, oldest first.
    pub history: Vec<AttemptRecord>,
    /// What an operator can do about it now ([`next_steps`]): empty but for a dead letter.
    pub next_steps: Vec<NextStep>,
}

/// One thing an operator can do about a message, as `outboxd show` suggests it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NextStep {
    /// The action: `confirm`, `replay` or `cancel`.
    pub action: String,
    /// The command that does it (`outboxd replay 42`).
    pub command: String,
    /// When it is the right one.
    pub when: String,
}

/// What an operator can do about a message in `state` with `error_class`: a dead letter
/// can be replayed or cancelled, and one whose last attempt may have taken effect
/// (`ambiguous`) can also be confirmed, which a person does after asking the provider.
/// Nothing for any other state: a worker or an approval moves those on.
pub fn next_steps(id: i64, state: &str, error_class: Option<&str>) -> Vec<NextStep> {
    if state != "dead" {
        return Vec::new();
    }
    let step = |action: &str, when: &str| NextStep {
        action: action.to_owned(),
        command: format!("outboxd {action} {id}"),
        when: when.to_owned(),
    };
    if error_class == Some("ambiguous") {
        vec![
            step(
                "confirm",
                "it took effect (the provider has it): recorded as delivered",
            ),
            step(
                "replay",
                "it did not take effect: sent again, with the same key",
            ),
            step("cancel", "it must not be sent again"),
        ]
    } else {
        vec![
            step(
                "replay",
                "once the cause is fixed: sent again, with the same key",
            ),
            step("cancel", "it must not be sent again"),
        ]
    }
}

/// The payload as `outboxd show` prints it, keeping no more than the logs and
/// `outbox.attempts` do (README, "Logs"):
///
/// * every header value is `[redacted]` (the names are kept);
/// * a webhook's `url` (and its `reconcile.url`) is reduced to its scheme, host and port,
///   as errors name a destination: no user name or password, path, query or fragment
///   (tokens sit there); `/[redacted]` marks that there was more. A URL that does not parse
///   is not shown at all;
/// * an e-mail shows no address, subject or body: each field becomes a count
///   (`[redacted: 2 addresses]`, `[redacted: 42 characters]`).
///
/// A webhook's `body` and `method` are shown: an operator needs them to judge a replay;
/// so are the names the worker reads (`secret`, the signing secret's name, and
/// `store_response`). `reconcile`'s members other than its URL, and members the worker
/// does not read, are `[redacted]`.
pub fn redact_payload(channel: &str, mut payload: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let Some(fields) = payload.as_object_mut() else {
        return Value::String("[redacted]".into());
    };
    for (name, value) in fields.iter_mut() {
        *value = match (name.as_str(), value.take()) {
            ("headers", Value::Object(mut headers)) => {
                for v in headers.values_mut() {
                    *v = Value::String("[redacted]".into());
                }
                Value::Object(headers)
            }
            ("headers", Value::Null) => Value::Null,
            ("headers", _) => Value::String("[redacted]".into()),
            ("url", url) if channel == "webhook" => Value::String(redact_url(&url)),
            // The reconciliation lookup's URL carries tokens as often as the main one.
            // Its other members are the provider's settings, which may be tokens too.
            ("reconcile", Value::Object(mut r)) if channel == "webhook" => {
                for (k, v) in r.iter_mut() {
                    *v = if k == "url" {
                        Value::String(redact_url(v))
                    } else {
                        Value::String("[redacted]".into())
                    };
                }
                Value::Object(r)
            }
            // What the worker reads and an operator needs to judge a replay, in the shapes
            // the worker takes (anything else is refused as invalid, and may hold a token:
            // a reconcile URL written as a bare string). Anything else the application put
            // there is the worker's to ignore, and may be a token too.
            ("body", v) if channel == "webhook" => v,
            ("method" | "secret", v @ Value::String(_)) if channel == "webhook" => v,
            ("store_response", v @ Value::Bool(_)) if channel == "webhook" => v,
            (_, Value::Null) if channel == "webhook" => Value::Null,
            (_, _) if channel == "webhook" => Value::String("[redacted]".into()),
            (_, Value::Null) => Value::Null,
            ("from" | "to" | "cc" | "bcc" | "reply_to", v) => {
                let n = match &v {
                    Value::Array(a) => a.len(),
                    _ => 1,
                };
                Value::String(format!(
                    "[redacted: {n} address{}]",
                    if n == 1 { "" } else { "es" }
                ))
            }
            (_, Value::String(text)) => {
                let n = text.chars().count();
                Value::String(format!(
                    "[redacted: {n} character{}]",
                    if n == 1 { "" } else { "s" }
                ))
            }
            (_, _) => Value::String("[redacted]".into()),
        };
    }
    payload
}

/// A webhook URL as errors and logs name its destination: `scheme://host[:port]/`, and
/// `[redacted]` after it when the URL had a path, query or fragment.
fn redact_url(url: &serde_json::Value) -> String {
    let Some(text) = url.as_str() else {
        return "[redacted: not a string]".into();
    };
    let Ok(parsed) = url::Url::parse(text) else {
        return "[redacted: not a valid URL]".into();
    };
    let Some(host) = parsed.host_str() else {
        return format!("{}:[redacted]", parsed.scheme());
    };
    let port = parsed.port().map(|p| format!(":{p}")).unwrap_or_default();
    let more = parsed.path() != "/" || parsed.query().is_some() || parsed.fragment().is_some();
    format!(
        "{}://{host}{port}/{}",
        parsed.scheme(),
        if more { "[redacted]" } else { "" }
    )
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

/// Shown in place of a JSON value that cannot be read: `jsonb` takes any depth, and
/// tokio-postgres reads it with serde_json, which stops at 128 levels (an application's
/// payload can be that deep; a stored response body no longer is).
const TOO_DEEP: &str = "(not shown: nested more than 128 levels deep)";

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
    let ts = |i: usize| stamp(&r, i);
    let mut detail = MessageDetail {
        id: r.get(0),
        message_key: r.get(1),
        channel: r.get(2),
        state: r.get(3),
        attempts: r.get(4),
        max_attempts: r.get(5),
        retry_ambiguous: r.get(6),
        payload: match r.try_get(7) {
            Ok(payload) => redact_payload(r.get(2), payload),
            Err(_) => serde_json::Value::String(TOO_DEEP.into()),
        },
        run_after: ts(8).unwrap_or_default(),
        lease_owner: r.get(9),
        lease_expires_at: ts(10),
        error_class: r.get(11),
        last_error: r.get(12),
        response: r
            .try_get(13)
            .unwrap_or_else(|_| Some(serde_json::Value::String(TOO_DEEP.into()))),
        created_at: ts(14).unwrap_or_default(),
        updated_at: ts(15).unwrap_or_default(),
        delivered_at: ts(16),
        dead_at: ts(17),
        cancelled_at: ts(18),
        ordering_key: r.get(19),
        history: Vec::new(),
        next_steps: Vec::new(),
    };
    detail.next_steps = next_steps(detail.id, &detail.state, detail.error_class.as_deref());
    for a in client
        .query_typed(queries::SHOW_ATTEMPTS, &[(id, Type::INT8)])
        .await?
    {
        detail.history.push(AttemptRecord {
            attempt: a.get(0),
            worker: a.get(1),
            started_at: stamp(&a, 2).unwrap_or_default(),
            finished_at: stamp(&a, 3),
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
    replay_as_seen(client, selection, actor, dry_run, &[]).await
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

/// Deliveries and failures in one minute of [`attempts_per_minute`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinuteCount {
    /// The minute's start, unix seconds (the database's clock).
    pub minute: i64,
    /// Attempts that delivered.
    pub delivered: i64,
    /// Attempts that failed (retried, dead, or whose lease was lost).
    pub failed: i64,
}

/// The last hour of attempts, minute by minute, oldest first (always 60 minutes).
pub async fn attempts_per_minute<C: GenericClient>(
    client: &C,
) -> Result<Vec<MinuteCount>, tokio_postgres::Error> {
    Ok(client
        .query_typed(queries::ATTEMPTS_PER_MINUTE, &[])
        .await?
        .iter()
        .map(|r| MinuteCount {
            minute: r.get::<_, f64>(0) as i64,
            delivered: r.get(1),
            failed: r.get(2),
        })
        .collect())
}

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
/// ([`checkpoint_as_seen`] holds the action to them).
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
fn seen_of(r: &tokio_postgres::Row) -> (i64, Seen) {
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
async fn changed_since_seen(
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
    tx.commit().await?;
    Ok(changed)
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
    fn payloads_are_redacted_as_the_logs_name_things() {
        let p = serde_json::json!({"url": "https://u:pw@x.example/hooks/a?token=t0k", "headers": {"Authorization": "Bearer s3cret"}, "body": 1});
        let r = redact_payload("webhook", p);
        assert_eq!(r["headers"]["Authorization"], "[redacted]");
        assert_eq!(r["url"], "https://x.example/[redacted]");
        assert_eq!(r["body"], 1);
        for (url, shown) in [
            (
                "http://TOKEN@h.example/p?q=SECRET",
                "http://h.example/[redacted]",
            ),
            ("http://h.example:8080", "http://h.example:8080/"),
            ("https://h.example/", "https://h.example/"),
            ("https://h.example/#frag", "https://h.example/[redacted]"),
            ("http://[::1]:9/x", "http://[::1]:9/[redacted]"),
            (
                "http://bad host/?token=SECRET",
                "[redacted: not a valid URL]",
            ),
            ("mailto:SECRET@h.example", "mailto:[redacted]"),
        ] {
            let r = redact_payload("webhook", serde_json::json!({ "url": url }));
            assert_eq!(r["url"], shown, "{url}");
        }
        // The lookup's settings and members the worker does not read may be tokens.
        let r = redact_payload(
            "webhook",
            serde_json::json!({"url": "https://h.example/", "method": "PUT", "secret": "billing",
                "store_response": true, "token": "SECRET", "extra": {"k": "SECRET"}, "none": null,
                "reconcile": {"url": "https://l.example/ops?t=SECRET", "token": "SECRET", "n": 5}}),
        );
        assert_eq!(
            r,
            serde_json::json!({"url": "https://h.example/", "method": "PUT", "secret": "billing",
                "store_response": true, "token": "[redacted]", "extra": "[redacted]", "none": null,
                "reconcile": {"url": "https://l.example/[redacted]", "token": "[redacted]",
                    "n": "[redacted]"}})
        );
        // In shapes the worker refuses, each is hidden too.
        let r = redact_payload(
            "webhook",
            serde_json::json!({"reconcile": "https://l.example/ops?t=SECRET",
                "method": {"t": "SECRET"}, "secret": ["SECRET"], "store_response": "SECRET"}),
        );
        assert_eq!(
            r,
            serde_json::json!({"reconcile": "[redacted]", "method": "[redacted]",
                "secret": "[redacted]", "store_response": "[redacted]"})
        );
        let r = redact_payload(
            "webhook",
            serde_json::json!({"url": {"token": "SECRET"}, "headers": "SECRET"}),
        );
        assert_eq!(
            r,
            serde_json::json!({"url": "[redacted: not a string]", "headers": "[redacted]"})
        );
        let r = redact_payload(
            "email",
            serde_json::json!({"from": "A <a@x.example>", "to": ["b@x.example", "c@x.example"],
                "cc": [], "bcc": null, "reply_to": "r@x.example", "subject": "Hi there",
                "text": "T", "html": "<p>H</p>", "headers": {"X-Trace": "SECRET"}, "other": {"k": 1}}),
        );
        assert_eq!(
            r,
            serde_json::json!({"from": "[redacted: 1 address]", "to": "[redacted: 2 addresses]",
                "cc": "[redacted: 0 addresses]", "bcc": null, "reply_to": "[redacted: 1 address]",
                "subject": "[redacted: 8 characters]", "text": "[redacted: 1 character]",
                "html": "[redacted: 8 characters]", "headers": {"X-Trace": "[redacted]"},
                "other": "[redacted]"})
        );
    }
}

/// A destination whose circuit breaker is open, half-open, or counting failures
/// (`outboxd destinations`, `sql/0014`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Destination {
    /// The destination, as `outbox.destination_of` names it (`host` or `host:port`).
    pub host: String,
    /// `closed`, `open` or `half_open`.
    pub state: String,
    /// Transient or ambiguous failures in a row, since the last success.
    pub consecutive_failures: i32,
    /// When an open circuit lets its probe through (RFC 3339), if open.
    pub open_until: Option<String>,
}

/// Destinations that are open, half-open or failing: open ones first, then by name.
pub async fn destinations<C: GenericClient>(
    client: &C,
) -> Result<Vec<Destination>, tokio_postgres::Error> {
    let rows = client.query(queries::DESTINATIONS_LIST, &[]).await?;
    Ok(rows
        .iter()
        .map(|r| Destination {
            host: r.get(0),
            state: r.get(1),
            consecutive_failures: r.get(2),
            open_until: stamp(r, 3),
        })
        .collect())
}

/// Closes `host`'s circuit by hand and makes the backlog its opening had pushed back due at
/// once. `None` when no destination of that name was ever recorded; else the rows brought
/// back.
pub async fn close_destination<C: GenericClient>(
    client: &C,
    host: &str,
) -> Result<Option<i64>, tokio_postgres::Error> {
    let row = client
        .query_opt(queries::DESTINATION_CLOSE, &[&host])
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let pushed: Option<std::time::SystemTime> = row.get(0);
    match pushed {
        Some(at) => restore_backlog(client, host, at).await.map(Some),
        None => Ok(Some(0)),
    }
}

/// The destinations of `host` (named without a port) on every port it was reached at:
/// `127.0.0.1` finds `127.0.0.1:8080` and `127.0.0.1:9090`.
pub async fn destinations_of_host<C: GenericClient>(
    client: &C,
    host: &str,
) -> Result<Vec<String>, tokio_postgres::Error> {
    Ok(client
        .query(queries::DESTINATIONS_OF_HOST, &[&host])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Rows moved per statement when a closed host's backlog comes back.
const RESTORE_BATCH: i64 = 5000;

/// How far past the pushed time a held-back row may be due and still come back: rows
/// deferred by a worker while the circuit was open are due then, give or take the worker's
/// clock.
const RESTORE_SLACK_SECONDS: f64 = 60.0;

/// Makes the rows an opening of `host` held back until `at` (its `deferred_until`) due now,
/// in batches; returns how many (see [`queries::BREAKER_RESTORE`]).
pub async fn restore_backlog<C: GenericClient>(
    client: &C,
    host: &str,
    at: std::time::SystemTime,
) -> Result<i64, tokio_postgres::Error> {
    let mut total = 0;
    loop {
        let n: i64 = client
            .query_one(
                queries::BREAKER_RESTORE,
                &[&host, &at, &RESTORE_BATCH, &RESTORE_SLACK_SECONDS],
            )
            .await?
            .get(0);
        total += n;
        if n < RESTORE_BATCH {
            return Ok(total);
        }
    }
}
