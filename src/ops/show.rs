//! One message's story (`outboxd show`, the console's message page), its payload redacted
//! to what the logs keep, and the next steps an operator can take.

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use crate::queries;

use super::{Target, resolve, stamp};

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
    /// Its ordering group, if any.
    pub ordering_key: Option<String>,
    /// When its provider's key window closes (RFC 3339): the first attempt's start plus
    /// its endpoint's `key_ttl`. None but for an http message attempted at least once
    /// whose endpoint has a `key_ttl`.
    pub key_expires_at: Option<String>,
    /// The paused destination that holds it back, while it is unfinished and a person has
    /// paused its destination (or its lookup's): it is not sent until they resume it.
    pub paused_destination: Option<String>,
    /// It is pending and a person paused its channel (`outbox.pause_channel`): no worker
    /// claims it until they resume the channel.
    pub paused_channel: bool,
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

/// The payload as `outboxd show` prints it: as its channel redacts it
/// ([`crate::deliver::redact_payload`]); a channel this build does not know shows nothing.
pub fn redact_payload(channel: &str, payload: serde_json::Value) -> serde_json::Value {
    match crate::model::Channel::parse(channel) {
        Some(channel) => crate::deliver::redact_payload(channel, payload),
        None => serde_json::Value::String("[redacted]".into()),
    }
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
        key_expires_at: ts(20),
        paused_destination: r.get(22),
        paused_channel: r.get(23),
        history: Vec::new(),
        next_steps: Vec::new(),
    };
    detail.next_steps = next_steps(detail.id, &detail.state, detail.error_class.as_deref());
    // After the provider's key window, a replay of a message that may have taken effect is
    // refused unless forced (`outbox.replay`): say so where the step is offered.
    if r.try_get::<_, bool>(21).unwrap_or(false)
        && detail.error_class.as_deref() == Some("ambiguous")
    {
        for step in detail
            .next_steps
            .iter_mut()
            .filter(|s| s.action == "replay")
        {
            step.command.push_str(" --force");
            step.when = "it did not take effect, and a person decides to send it once more: \
                         the provider may have forgotten the key"
                .to_owned();
        }
    }
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
