//! The application's statements: enqueue one or many, and look a key up.

/// Enqueue one message; the rules are those of `outbox.enqueue_row` (in
/// `sql/0001_baseline.sql`); `$7` held, `$8` ordering key or NULL.
/// Returns `id, created`.
pub const ENQUEUE: &str = r#"
SELECT id, created FROM outbox.enqueue_row($1::text, $2::text, $3::jsonb,
    coalesce($4::timestamptz, now()), $5::int, $6::bool, $7::bool, $8::text)
"#;

/// Enqueue many messages in one statement, all or nothing; the rules are those of
/// `outbox.enqueue_many`. Returns `id, created` per message, in input order.
pub const ENQUEUE_MANY: &str = r#"
SELECT id, created FROM outbox.enqueue_many($1::text[], $2::text[], $3::jsonb[],
    $4::timestamptz[], $5::int[], $6::bool[], $7::bool[], $8::text[])
"#;

/// What is known of one message by its key (`$1`), without its payload, through
/// `outbox.lookup` (callable by the application role): no row for an unknown key.
pub const LOOKUP: &str = r#"
SELECT id, state, attempts, max_attempts, error_class, last_error, response, created_at,
       updated_at, delivered_at, dead_at, cancelled_at, key_expires_at
FROM outbox.lookup($1::text)
"#;
