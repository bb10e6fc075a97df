//! Enqueueing from Rust, inside the application's own transaction.
//!
//! The rules are the SQL function's (`outbox.enqueue_row`, in `sql/0001_baseline.sql`, and the
//! insert trigger it fires): this
//! module only binds parameters and turns the database's answers into typed errors, so the
//! SQL and Rust paths cannot disagree.

use std::time::SystemTime;

use serde_json::Value;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::model::Channel;
use crate::queries;

/// A message to enqueue. Its `Debug` shows the payload's length, not the payload: an
/// application that logs a failed enqueue with `{:?}` would otherwise write the URL's
/// tokens, the headers' values and the body into its own logs.
#[derive(Clone, PartialEq)]
pub struct NewMessage {
    key: String,
    channel: Channel,
    payload: Value,
    run_after: Option<SystemTime>,
    max_attempts: i32,
    retry_ambiguous: bool,
    held: bool,
    ordering_key: Option<String>,
}

impl std::fmt::Debug for NewMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewMessage")
            .field("key", &self.key)
            .field("channel", &self.channel)
            .field("payload_len", &self.payload.to_string().len())
            .field("run_after", &self.run_after)
            .field("max_attempts", &self.max_attempts)
            .field("retry_ambiguous", &self.retry_ambiguous)
            .field("held", &self.held)
            .field("ordering_key", &self.ordering_key)
            .finish()
    }
}

impl NewMessage {
    /// A webhook: `{"url": …, "method": …, "headers": {…}, "body": …}`.
    pub fn webhook(key: impl Into<String>, payload: Value) -> Self {
        NewMessage::new(key, Channel::Webhook, payload)
    }

    /// An e-mail: `{"from": …, "to": […], "subject": …, "text": …, "html": …}`.
    pub fn email(key: impl Into<String>, payload: Value) -> Self {
        NewMessage::new(key, Channel::Email, payload)
    }

    /// A call to a provider's API through a named endpoint: `{"endpoint": …, "method": …,
    /// "path": …, "query": {…}, "form": {…} | "json": …, "headers": {…}, "reconcile": {…},
    /// "store_response": …}`; the endpoint must exist at enqueue.
    pub fn http(key: impl Into<String>, payload: Value) -> Self {
        NewMessage::new(key, Channel::Http, payload)
    }

    /// A message on any channel.
    pub fn new(key: impl Into<String>, channel: Channel, payload: Value) -> Self {
        NewMessage {
            key: key.into(),
            channel,
            payload,
            run_after: None,
            max_attempts: 3,
            retry_ambiguous: true,
            held: false,
            ordering_key: None,
        }
    }

    /// The whole attempt budget, the first attempt included (default 3; 1 = never retry).
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }

    /// May an attempt whose outcome is unknown be retried (default true)?
    pub fn retry_ambiguous(mut self, allow: bool) -> Self {
        self.retry_ambiguous = allow;
        self
    }

    /// Hold it for a person's approval (default false): the message is stored `held` and
    /// never sent until an operator approves it (`outboxd approve`), or cancels it. The
    /// dedup rule is unchanged: a key already stored with the same payload returns that
    /// row, whatever its state, and leaves it as it is.
    pub fn held(mut self, held: bool) -> Self {
        self.held = held;
        self
    }

    /// Send it in order with the other messages of this ordering key (default: none): a
    /// message with a key is not claimed while an earlier one (smaller id) of its group is
    /// pending (due or not), running, held or dead, so a group has one message in flight at
    /// a time, in id order, and a dead one blocks the rest until it is replayed or
    /// cancelled. Ids within a group follow commit order: the enqueue waits while another
    /// transaction that enqueued into the group is open. The key must be 1..255 characters
    /// without control characters or whitespace at either end (else
    /// [`EnqueueError::Invalid`] naming `ordering_key`). It does not enter the dedup
    /// fingerprint.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Not before this time (default: as soon as the transaction commits).
    pub fn run_after(mut self, at: SystemTime) -> Self {
        self.run_after = Some(at);
        self
    }

    /// The message key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The channel.
    pub fn channel(&self) -> Channel {
        self.channel
    }

    /// The payload.
    pub fn payload(&self) -> &Value {
        &self.payload
    }

    /// Is it enqueued held?
    pub fn is_held(&self) -> bool {
        self.held
    }
}

/// The result of an enqueue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The message's id.
    pub id: i64,
    /// False when the key already existed with the same channel and payload (nothing was
    /// inserted).
    pub created: bool,
}

/// Why an enqueue was refused.
#[derive(thiserror::Error)]
pub enum EnqueueError {
    /// The key already names a message with another channel or payload (SQLSTATE `OB409`).
    /// The existing row is untouched.
    #[error("{message}")]
    KeyConflict {
        /// The key.
        key: String,
        /// The database's message, naming the key.
        message: String,
    },
    /// Bad input (SQLSTATE `22023`); nothing was inserted.
    #[error("{message}")]
    Invalid {
        /// The offending field (`message_key`, `channel`, `payload.url`, `run_after`, …).
        field: String,
        /// The database's message, naming the field.
        message: String,
    },
    /// Any other database error (connection lost, permission denied, …).
    #[error("database error: {}", crate::support::describe(.0))]
    Database(#[source] tokio_postgres::Error),
}

impl EnqueueError {
    /// `nul_field` names the text parameter holding a NUL character, for 22021 (the
    /// database cannot say which one it was).
    fn from_db(err: tokio_postgres::Error, key: &str, nul_field: &str) -> Self {
        let Some(db) = err.as_db_error() else {
            return EnqueueError::Database(err);
        };
        if db.code().code() == "OB409" {
            // The function puts the key, verbatim, in DETAIL (the message quotes it).
            EnqueueError::KeyConflict {
                key: db.detail().unwrap_or(key).to_owned(),
                message: db.message().to_owned(),
            }
        } else if *db.code() == SqlState::INVALID_PARAMETER_VALUE {
            EnqueueError::Invalid {
                field: db.column().unwrap_or("").to_owned(),
                message: db.message().to_owned(),
            }
        } else if *db.code() == SqlState::UNTRANSLATABLE_CHARACTER {
            // jsonb cannot hold \u0000 (22P05): the payload is bad input, not a database fault.
            EnqueueError::Invalid {
                field: "payload".into(),
                message: "payload must not contain NUL characters (\\u0000)".into(),
            }
        } else if *db.code() == SqlState::DATETIME_FIELD_OVERFLOW {
            // PostgreSQL refuses a timestamp past its range (22008) as it reads the
            // parameters; run_after is the only timestamp an enqueue sends.
            EnqueueError::Invalid {
                field: "run_after".into(),
                message: format!("run_after is out of range: {}", db.message()),
            }
        } else if *db.code() == SqlState::CHARACTER_NOT_IN_REPERTOIRE {
            // PostgreSQL text cannot hold a NUL byte (22021); Rust strings can, in the key
            // and the ordering key.
            EnqueueError::Invalid {
                field: nul_field.into(),
                message: format!("{nul_field} must not contain NUL characters"),
            }
        } else {
            EnqueueError::Database(err)
        }
    }
}

/// Debug without the database error's internals: its DETAIL and context can quote the
/// row, payload included, and applications log errors with `{:?}`.
impl std::fmt::Debug for EnqueueError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EnqueueError::KeyConflict { key, message } => f
                .debug_struct("KeyConflict")
                .field("key", key)
                .field("message", message)
                .finish(),
            EnqueueError::Invalid { field, message } => f
                .debug_struct("Invalid")
                .field("field", field)
                .field("message", message)
                .finish(),
            EnqueueError::Database(e) => f
                .debug_tuple("Database")
                .field(&crate::support::describe(e))
                .finish(),
        }
    }
}

/// Enqueues one message through `client` (a `Client` or the caller's `Transaction`);
/// does not commit.
pub async fn enqueue<C: GenericClient>(
    client: &C,
    msg: &NewMessage,
) -> Result<Enqueued, EnqueueError> {
    enqueue_with(client, msg, &msg.payload).await
}

/// [`enqueue()`] with the payload given as JSON text and sent to PostgreSQL unchanged, in
/// place of `msg`'s own payload, which is not used: `outboxd enqueue`'s way. Through a
/// [`Value`] the numbers would be rewritten (`1.10` as `1.1`, `12345678901234567890123` as
/// `1.2345678901234568e22`), and the same payload text enqueued from SQL and then from the
/// command line would be refused as a conflict. jsonb parses the text itself, keeping
/// every digit, as the SQL path does.
#[cfg(feature = "daemon")]
pub(crate) async fn enqueue_json_text<C: GenericClient>(
    client: &C,
    msg: &NewMessage,
    payload: &serde_json::value::RawValue,
) -> Result<Enqueued, EnqueueError> {
    // A `RawValue` serialises as its text, byte for byte.
    enqueue_with(client, msg, &tokio_postgres::types::Json(payload))
        .await
        .map_err(|e| match e {
            EnqueueError::Database(err) => payload_refused(err),
            other => other,
        })
}

/// jsonb refuses some text that serde_json's check lets through: a lone surrogate escape
/// (`"\ud800"`: 22P02), a number beyond numeric's range (22003), or nesting deeper than
/// the server's stack allows (54001, "stack depth limit exceeded": the check sets no depth
/// limit, so the database's answer is the one `SELECT outbox.enqueue(...)` gets). In
/// [`enqueue_json_text`] the payload is the only value PostgreSQL parses from text (the
/// other parameters are bound in binary, and the SQL checks raise 22023), so these are the
/// payload's fault: bad input naming it, without the database's DETAIL and CONTEXT, which
/// quote the payload.
#[cfg(feature = "daemon")]
fn payload_refused(err: tokio_postgres::Error) -> EnqueueError {
    let Some(db) = err.as_db_error() else {
        return EnqueueError::Database(err);
    };
    if *db.code() == SqlState::INVALID_TEXT_REPRESENTATION
        || *db.code() == SqlState::NUMERIC_VALUE_OUT_OF_RANGE
        || *db.code() == SqlState::STATEMENT_TOO_COMPLEX
    {
        EnqueueError::Invalid {
            field: "payload".into(),
            message: format!(
                "payload is not JSON that PostgreSQL accepts: {}",
                db.message()
            ),
        }
    } else {
        EnqueueError::Database(err)
    }
}

/// [`enqueue()`] with `payload` bound as the jsonb parameter.
async fn enqueue_with<C: GenericClient>(
    client: &C,
    msg: &NewMessage,
    payload: &(dyn ToSql + Sync),
) -> Result<Enqueued, EnqueueError> {
    let channel = msg.channel.as_str();
    // query_typed sends parse, bind and execute together: one round trip, no prepare.
    let params: [(&(dyn ToSql + Sync), Type); 8] = [
        (&msg.key, Type::TEXT),
        (&channel, Type::TEXT),
        (payload, Type::JSONB),
        (&msg.run_after, Type::TIMESTAMPTZ),
        (&msg.max_attempts, Type::INT4),
        (&msg.retry_ambiguous, Type::BOOL),
        (&msg.held, Type::BOOL),
        (&msg.ordering_key, Type::TEXT),
    ];
    let rows = client
        .query_typed(queries::ENQUEUE, &params)
        .await
        .map_err(|e| EnqueueError::from_db(e, &msg.key, nul_field(std::slice::from_ref(msg))))?;
    let row = rows.first().ok_or_else(|| EnqueueError::Invalid {
        field: String::new(),
        message: "outbox.enqueue_row returned no row".into(),
    })?;
    Ok(Enqueued {
        id: row.get(0),
        created: row.get(1),
    })
}

/// Enqueues many messages in one statement (one round trip), all or nothing, with the rules
/// of [`enqueue()`] for each, in order. Returns one [`Enqueued`] per message. Does not commit.
pub async fn enqueue_many<C: GenericClient>(
    client: &C,
    msgs: &[NewMessage],
) -> Result<Vec<Enqueued>, EnqueueError> {
    if msgs.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<&str> = msgs.iter().map(|m| m.key.as_str()).collect();
    let channels: Vec<&str> = msgs.iter().map(|m| m.channel.as_str()).collect();
    let payloads: Vec<&Value> = msgs.iter().map(|m| &m.payload).collect();
    let run_afters: Vec<Option<SystemTime>> = msgs.iter().map(|m| m.run_after).collect();
    let max_attempts: Vec<i32> = msgs.iter().map(|m| m.max_attempts).collect();
    let retry_ambiguous: Vec<bool> = msgs.iter().map(|m| m.retry_ambiguous).collect();
    let held: Vec<bool> = msgs.iter().map(|m| m.held).collect();
    let ordering_keys: Vec<Option<&str>> = msgs.iter().map(|m| m.ordering_key.as_deref()).collect();
    let params: [(&(dyn ToSql + Sync), Type); 8] = [
        (&keys, Type::TEXT_ARRAY),
        (&channels, Type::TEXT_ARRAY),
        (&payloads, Type::JSONB_ARRAY),
        (&run_afters, Type::TIMESTAMPTZ_ARRAY),
        (&max_attempts, Type::INT4_ARRAY),
        (&retry_ambiguous, Type::BOOL_ARRAY),
        (&held, Type::BOOL_ARRAY),
        (&ordering_keys, Type::TEXT_ARRAY),
    ];
    let rows = client
        .query_typed(queries::ENQUEUE_MANY, &params)
        .await
        .map_err(|e| EnqueueError::from_db(e, "", nul_field(msgs)))?;
    Ok(rows
        .iter()
        .map(|r| Enqueued {
            id: r.get(0),
            created: r.get(1),
        })
        .collect())
}

/// Which text parameter of these messages holds a NUL character: `message_key` unless only
/// an ordering key does.
fn nul_field(msgs: &[NewMessage]) -> &'static str {
    let in_key = msgs.iter().any(|m| m.key.contains('\0'));
    let in_ordering_key = msgs
        .iter()
        .any(|m| m.ordering_key.as_deref().is_some_and(|k| k.contains('\0')));
    if in_ordering_key && !in_key {
        "ordering_key"
    } else {
        "message_key"
    }
}
