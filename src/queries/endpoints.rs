//! The worker's statements about endpoints.

/// Every endpoint, as the http channel reads it: `name, url, auth_header, auth_secret`
/// (the NAME of a secret, never a value), `idempotency_header` (NULL: none), `key_ttl`
/// in seconds (NULL: unknown), and `headers` (jsonb). Read at start and every few seconds,
/// so a change is seen without a restart.
pub const ENDPOINTS: &str = r#"
SELECT name, url, auth_header, auth_secret, idempotency_header,
       extract(epoch FROM key_ttl)::float8 AS key_ttl, headers
FROM outbox.endpoints
"#;
