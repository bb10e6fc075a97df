//! `lookup`: what became of a side effect, by its key — the read an agent's tool wrapper
//! makes before it acts again (the seed's `cached = get(key)`).
//!
//! The rule lives in SQL (`outbox.lookup`, in `sql/0001_baseline.sql`): a
//! `SECURITY DEFINER` function that returns no payload, so the application role may call it
//! without any right on the table. This module binds the key and types the answer.
//!
//! An agent's tool wrapper (the README's *Agents* section): the key from durable ids, a
//! lookup before acting again, the enqueue in the business transaction.
//!
//! ```no_run
//! use outboxd::{ErrorClass, NewMessage, State, enqueue, lookup};
//! use serde_json::json;
//!
//! async fn refund(
//!     db: &mut tokio_postgres::Client,
//!     run: &str,
//!     step: u32,
//!     order: i64,
//!     cents: i64,
//! ) -> anyhow::Result<String> {
//!     let key = format!("{run}:step-{step}:refund-order-{order}");
//!     if let Some(s) = lookup(&*db, &key).await? {
//!         return Ok(match (s.state, s.error_class) {
//!             (State::Delivered, _) => format!("refund already done: {:?}", s.response),
//!             (State::Held, _) => "refund waits for a person's approval".into(),
//!             (State::Pending | State::Running, _) => "refund on its way".into(),
//!             (State::Cancelled, _) => "refund was cancelled; do not retry".into(),
//!             (State::Dead, Some(ErrorClass::Ambiguous)) => "outcome unknown; a person checks".into(),
//!             (State::Dead, _) => format!("refund failed: {}", s.last_error.unwrap_or_default()),
//!         });
//!     }
//!     let tx = db.transaction().await?;
//!     tx.execute("UPDATE orders SET refund_requested = true WHERE id = $1", &[&order])
//!         .await?;
//!     let msg = NewMessage::webhook(
//!         &key,
//!         json!({"url": "https://payments.example.com/refunds",
//!                "body": {"order": order, "amount": cents}, "store_response": true}),
//!     )
//!     .held(true);
//!     enqueue(&tx, &msg).await?;
//!     tx.commit().await?;
//!     Ok("refund requested; it waits for approval".into())
//! }
//! ```

use std::time::SystemTime;

use serde_json::Value;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use crate::model::{ErrorClass, State};
use crate::queries;

/// One message as `outbox.lookup` returns it: its state and outcome, never its payload.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageStatus {
    /// The message id.
    pub id: i64,
    /// Where it is: `Delivered` means the provider accepted it (or a person confirmed it, or
    /// a reconciliation found it done: see `response`); `Dead` with class `Ambiguous` means
    /// nobody knows yet whether it took effect.
    pub state: State,
    /// Attempts started so far.
    pub attempts: i32,
    /// The whole budget, the first attempt included.
    pub max_attempts: i32,
    /// The last failure's class, if any.
    pub error_class: Option<ErrorClass>,
    /// The last failure, one line, no secrets.
    pub last_error: Option<String>,
    /// The provider's last answer, summarised (`status`, …; `confirmed`, `reconciled`,
    /// and with `store_response` the body).
    pub response: Option<Value>,
    /// When it was enqueued.
    pub created_at: SystemTime,
    /// Its last change.
    pub updated_at: SystemTime,
    /// When it was delivered.
    pub delivered_at: Option<SystemTime>,
    /// When it died.
    pub dead_at: Option<SystemTime>,
    /// When it was cancelled.
    pub cancelled_at: Option<SystemTime>,
    /// When its provider's key window closes (an `http` message whose endpoint has a
    /// `key_ttl`, once attempted): the first attempt's start plus the `key_ttl`. After it,
    /// the provider may have forgotten the key, so a message that may have taken effect is
    /// not sent again blind.
    pub key_expires_at: Option<SystemTime>,
}

/// Why a lookup failed.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    /// The key could not name a message (empty, over 255 characters, control characters;
    /// SQLSTATE `22023`).
    #[error("{message}")]
    Invalid {
        /// The database's message, naming `message_key`.
        message: String,
    },
    /// The answer holds a value this version cannot read (a state or class added by a
    /// newer schema, a column of another type).
    #[error("unknown {what} {value:?} in outbox.lookup's answer")]
    Unexpected {
        /// `state`, `error_class` or `column`.
        what: &'static str,
        /// The value.
        value: String,
    },
    /// Any other database error (connection lost, permission denied, …).
    #[error("database error: {}", crate::support::describe(.0))]
    Database(#[source] tokio_postgres::Error),
}

/// Looks a message up by its key through `client` (a `Client` or a `Transaction`): `None`
/// when no message has that key.
pub async fn lookup<C: GenericClient>(
    client: &C,
    key: &str,
) -> Result<Option<MessageStatus>, LookupError> {
    let row = client
        .query_typed_opt(queries::LOOKUP, &[(&key, Type::TEXT)])
        .await
        .map_err(from_db)?;
    let Some(r) = row else {
        return Ok(None);
    };
    // try_get, not get: a column this version cannot read is an error, never a panic.
    fn col<'a, T: tokio_postgres::types::FromSql<'a>>(
        r: &'a tokio_postgres::Row,
        i: usize,
    ) -> Result<T, LookupError> {
        r.try_get(i).map_err(|e| LookupError::Unexpected {
            what: "column",
            value: format!("{}: {e}", r.columns().get(i).map_or("?", |c| c.name())),
        })
    }
    let state: String = col(&r, 1)?;
    let state = State::parse(&state).ok_or(LookupError::Unexpected {
        what: "state",
        value: state,
    })?;
    let error_class = match col::<Option<String>>(&r, 4)? {
        None => None,
        Some(c) => Some(ErrorClass::parse(&c).ok_or(LookupError::Unexpected {
            what: "error_class",
            value: c,
        })?),
    };
    Ok(Some(MessageStatus {
        id: col(&r, 0)?,
        state,
        attempts: col(&r, 2)?,
        max_attempts: col(&r, 3)?,
        error_class,
        last_error: col(&r, 5)?,
        response: col(&r, 6)?,
        created_at: col(&r, 7)?,
        updated_at: col(&r, 8)?,
        delivered_at: col(&r, 9)?,
        dead_at: col(&r, 10)?,
        cancelled_at: col(&r, 11)?,
        key_expires_at: col(&r, 12)?,
    }))
}

fn from_db(err: tokio_postgres::Error) -> LookupError {
    match err.as_db_error() {
        Some(db) if *db.code() == SqlState::INVALID_PARAMETER_VALUE => LookupError::Invalid {
            message: db.message().to_owned(),
        },
        // PostgreSQL text cannot hold a NUL byte (22021); a Rust string can.
        Some(db) if *db.code() == SqlState::CHARACTER_NOT_IN_REPERTOIRE => LookupError::Invalid {
            message: "message_key must not contain NUL characters".into(),
        },
        _ => LookupError::Database(err),
    }
}
