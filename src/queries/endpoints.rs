//! Endpoints: the operators' commands (set, list, remove; the rules are the SQL functions'
//! `outbox.set_endpoint` and `outbox.remove_endpoint`, these statements bind and read) and
//! the worker's reading of the table.

/// Creates or replaces an endpoint through `outbox.set_endpoint`: `$1` name, `$2` url,
/// `$3` auth header, `$4` auth secret's NAME or NULL, `$5` idempotency header or NULL,
/// `$6` key_ttl in seconds or NULL, `$7` fixed headers (a JSON object). Returns the
/// endpoint's destination and how many unfinished messages moved to it. 22023 names the
/// field refused.
pub const SET_ENDPOINT: &str = r#"
SELECT destination, moved
FROM outbox.set_endpoint($1::text, $2::text, $3::text, $4::text, $5::text,
                         make_interval(secs => $6::float8), $7::jsonb)
"#;

/// Removes an endpoint through `outbox.remove_endpoint` (`$1` name): P0002 when there is
/// none, 55000 while pending, running or held messages name it.
pub const REMOVE_ENDPOINT: &str = "SELECT outbox.remove_endpoint($1::text)";

/// Every endpoint, by name, with the table's columns (`key_ttl` in seconds, NULL when
/// unknown). No secret is read: the table holds only a secret's name.
pub const LIST_ENDPOINTS: &str = r#"
SELECT name, url, auth_header, auth_secret, idempotency_header,
       extract(epoch FROM key_ttl)::float8, headers, created_at, updated_at
FROM outbox.endpoints
ORDER BY name
"#;

/// Every endpoint, as the http channel reads it: `name, url, auth_header, auth_secret`
/// (the NAME of a secret, never a value), `idempotency_header` (NULL: none), `key_ttl`
/// in seconds (NULL: unknown), and `headers` (jsonb). Read at start and every few seconds,
/// so a change is seen without a restart.
pub const ENDPOINTS: &str = r#"
SELECT name, url, auth_header, auth_secret, idempotency_header,
       extract(epoch FROM key_ttl)::float8 AS key_ttl, headers
FROM outbox.endpoints
"#;
