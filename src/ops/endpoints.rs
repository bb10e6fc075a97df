//! Endpoints: a provider's API that `http` messages name (`outboxd endpoint set | list |
//! remove`). The rules are `outbox.set_endpoint`'s and `outbox.remove_endpoint`'s; this
//! room binds the values and names the refusals. The table holds a secret's NAME, never
//! its value, so nothing here can show one.

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::queries;

use super::stamp;

/// One row of `outbox.endpoints`, as `outboxd endpoint list --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Endpoint {
    /// Its name, which a payload's `endpoint` gives.
    pub name: String,
    /// The API's base URL.
    pub url: String,
    /// The header that carries the credential.
    pub auth_header: String,
    /// The NAME of the secret that fills it (`OUTBOXD_SECRET_<NAME>`), if any.
    pub auth_secret: Option<String>,
    /// The header that carries the message key, if the provider takes one.
    pub idempotency_header: Option<String>,
    /// How long the provider remembers a key, as the CLI writes durations (`24h`); None
    /// when unknown.
    pub key_ttl: Option<String>,
    /// Fixed, non-secret headers.
    pub headers: serde_json::Value,
    /// When it was created (RFC 3339).
    pub created_at: String,
    /// Its last change (RFC 3339).
    pub updated_at: String,
}

/// What `outboxd endpoint set` gives `outbox.set_endpoint`.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointSpec {
    /// The endpoint's name.
    pub name: String,
    /// The API's base URL.
    pub url: String,
    /// The credential's header.
    pub auth_header: String,
    /// The secret's NAME.
    pub auth_secret: Option<String>,
    /// The idempotency header (None: the provider takes none).
    pub idempotency_header: Option<String>,
    /// How long the provider remembers a key.
    pub key_ttl: Option<Duration>,
    /// Fixed headers, in the order given.
    pub headers: Vec<(String, String)>,
}

/// What `outbox.set_endpoint` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSet {
    /// The endpoint's destination (its host, and port when not the default).
    pub destination: String,
    /// How many unfinished messages moved to it (its host changed).
    pub moved: i32,
}

/// Why an endpoint command was refused.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// A value broke a rule (22023); the message names the field.
    #[error("{0}")]
    Invalid(String),
    /// No such endpoint (P0002).
    #[error("{0}")]
    Unknown(String),
    /// Messages still name it (55000).
    #[error("{0}")]
    InUse(String),
    /// The database failed.
    #[error("database error: {}", crate::db::describe(.0))]
    Database(#[source] tokio_postgres::Error),
}

impl From<tokio_postgres::Error> for EndpointError {
    fn from(e: tokio_postgres::Error) -> Self {
        let Some(db) = e.as_db_error() else {
            return EndpointError::Database(e);
        };
        let message = db.message().to_owned();
        match db.code() {
            c if *c == SqlState::INVALID_PARAMETER_VALUE => EndpointError::Invalid(message),
            // Text cannot hold a NUL byte (22021); a command-line argument cannot either,
            // but a library caller's string can.
            c if *c == SqlState::CHARACTER_NOT_IN_REPERTOIRE => {
                EndpointError::Invalid("a value must not contain NUL characters".into())
            }
            c if *c == SqlState::NO_DATA_FOUND => EndpointError::Unknown(message),
            c if *c == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE => EndpointError::InUse(message),
            _ => EndpointError::Database(e),
        }
    }
}

/// Creates or replaces an endpoint; its unfinished messages follow a change of host.
pub async fn set_endpoint<C: GenericClient>(
    client: &C,
    spec: &EndpointSpec,
) -> Result<EndpointSet, EndpointError> {
    let mut headers = serde_json::Map::new();
    for (k, v) in &spec.headers {
        if headers
            .insert(k.clone(), serde_json::Value::String(v.clone()))
            .is_some()
        {
            return Err(EndpointError::Invalid(format!(
                "headers: {k:?} is given twice"
            )));
        }
    }
    let headers = serde_json::Value::Object(headers);
    let ttl: Option<f64> = spec.key_ttl.map(|d| d.as_secs_f64());
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&spec.name, Type::TEXT),
        (&spec.url, Type::TEXT),
        (&spec.auth_header, Type::TEXT),
        (&spec.auth_secret, Type::TEXT),
        (&spec.idempotency_header, Type::TEXT),
        (&ttl, Type::FLOAT8),
        (&headers, Type::JSONB),
    ];
    let row = client
        .query_typed_one(queries::SET_ENDPOINT, &params)
        .await?;
    Ok(EndpointSet {
        destination: row.try_get(0)?,
        moved: row.try_get(1)?,
    })
}

/// Removes an endpoint: refused while pending, running or held messages name it.
pub async fn remove_endpoint<C: GenericClient>(
    client: &C,
    name: &str,
) -> Result<(), EndpointError> {
    client
        .query_typed(queries::REMOVE_ENDPOINT, &[(&name, Type::TEXT)])
        .await?;
    Ok(())
}

/// Every endpoint, by name.
pub async fn endpoints<C: GenericClient>(client: &C) -> Result<Vec<Endpoint>, EndpointError> {
    let rows = client.query_typed(queries::LIST_ENDPOINTS, &[]).await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let ttl: Option<f64> = r.try_get(5)?;
        out.push(Endpoint {
            name: r.try_get(0)?,
            url: r.try_get(1)?,
            auth_header: r.try_get(2)?,
            auth_secret: r.try_get(3)?,
            idempotency_header: r.try_get(4)?,
            key_ttl: ttl.map(ttl_text),
            headers: r.try_get(6)?,
            created_at: stamp(r, 7).unwrap_or_default(),
            updated_at: stamp(r, 8).unwrap_or_default(),
        });
    }
    Ok(out)
}

/// A key_ttl in seconds as the CLI writes durations (`24h`, `90m`); a value no duration
/// flag could have given (a negative or fractional one, set by hand) as seconds.
fn ttl_text(secs: f64) -> String {
    if secs.is_finite() && secs > 0.0 && secs < 1e15 {
        crate::config::format_duration(Duration::from_secs_f64(secs))
    } else {
        format!("{secs}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ttls_read_as_durations() {
        assert_eq!(ttl_text(86_400.0), "1d");
        assert_eq!(ttl_text(5_400.0), "90m");
        assert_eq!(ttl_text(1.5), "1500ms");
        assert_eq!(ttl_text(-3.0), "-3s");
    }
}
