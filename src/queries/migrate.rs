//! The migration runner's lock and ledger.

/// Migrations: the lock that serialises concurrent `outboxd migrate` runs (a session-level
/// advisory lock on a fixed key, "outbox" in ASCII).
pub const MIGRATE_LOCK: &str = "SELECT pg_advisory_lock(111542170367864)";

/// Migrations: release [`MIGRATE_LOCK`].
pub const MIGRATE_UNLOCK: &str = "SELECT pg_advisory_unlock(111542170367864)";

/// Migrations: the ledger, created before the first file runs.
pub const MIGRATE_LEDGER: &str = r#"
CREATE SCHEMA IF NOT EXISTS outbox;
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"#;

/// Migrations: what has been applied (`version, name, checksum`).
pub const MIGRATE_APPLIED: &str =
    "SELECT version, name, checksum FROM outbox.schema_migrations ORDER BY version";

/// Migrations: forget the recorded history, inside the transaction that records the
/// baseline in its place (`outboxd migrate --adopt-baseline`).
pub const MIGRATE_FORGET: &str = "DELETE FROM outbox.schema_migrations";

/// Migrations: record one applied file (`$1` version, `$2` name, `$3` checksum).
pub const MIGRATE_RECORD: &str =
    "INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)";
