//! Schema migrations: the numbered files of `sql/`, embedded in the binary.
//!
//! `outboxd migrate` applies each file not yet recorded in `outbox.schema_migrations`, in
//! order, each in its own transaction, under a session advisory lock so two workers starting
//! at once do not race. A file whose text changed after it was applied is refused: the
//! database no longer matches what the file says, and silently skipping it would hide that.

use sha2::{Digest, Sha256};
use tokio_postgres::Client;

use crate::queries;

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// The number in the file name.
    pub version: i32,
    /// The rest of the file name, without `.sql`.
    pub name: &'static str,
    /// The file's text.
    pub sql: &'static str,
}

impl Migration {
    /// SHA-256 of the file's text, in hex.
    pub fn checksum(&self) -> String {
        hex::encode(Sha256::digest(self.sql.as_bytes()))
    }

    /// The file name in `sql/`.
    pub fn file_name(&self) -> String {
        format!("{:04}_{}.sql", self.version, self.name)
    }
}

/// Every migration, in order. A test checks this list against the files in `sql/`.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        sql: include_str!("../sql/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "operations",
        sql: include_str!("../sql/0002_operations.sql"),
    },
    Migration {
        version: 3,
        name: "enqueue_many_set_based",
        sql: include_str!("../sql/0003_enqueue_many_set_based.sql"),
    },
    Migration {
        version: 4,
        name: "attempts_without_foreign_key",
        sql: include_str!("../sql/0004_attempts_without_foreign_key.sql"),
    },
    Migration {
        version: 5,
        name: "wakeups_for_idle_workers",
        sql: include_str!("../sql/0005_wakeups_for_idle_workers.sql"),
    },
    Migration {
        version: 6,
        name: "cheaper_enqueue",
        sql: include_str!("../sql/0006_cheaper_enqueue.sql"),
    },
    Migration {
        version: 7,
        name: "enqueue_hardening",
        sql: include_str!("../sql/0007_enqueue_hardening.sql"),
    },
    Migration {
        version: 8,
        name: "lease_expiry_rule",
        sql: include_str!("../sql/0008_lease_expiry_rule.sql"),
    },
    Migration {
        version: 9,
        name: "human_checkpoints",
        sql: include_str!("../sql/0009_human_checkpoints.sql"),
    },
    Migration {
        version: 10,
        name: "reconcile",
        sql: include_str!("../sql/0010_reconcile.sql"),
    },
    Migration {
        version: 11,
        name: "purge_cancelled",
        sql: include_str!("../sql/0011_purge_cancelled.sql"),
    },
    Migration {
        version: 12,
        name: "ordering_keys",
        sql: include_str!("../sql/0012_ordering_keys.sql"),
    },
    Migration {
        version: 13,
        name: "destinations",
        sql: include_str!("../sql/0013_destinations.sql"),
    },
    Migration {
        version: 14,
        name: "breakers",
        sql: include_str!("../sql/0014_breakers.sql"),
    },
    Migration {
        version: 15,
        name: "enqueue_many_insert_first",
        sql: include_str!("../sql/0015_enqueue_many_insert_first.sql"),
    },
    Migration {
        version: 16,
        name: "message_key_byte_order",
        sql: include_str!("../sql/0016_message_key_byte_order.sql"),
    },
    Migration {
        version: 17,
        name: "replay_keeps_the_unknown",
        sql: include_str!("../sql/0017_replay_keeps_the_unknown.sql"),
    },
    Migration {
        version: 18,
        name: "contract_names_and_ordered_dead",
        sql: include_str!("../sql/0018_contract_names_and_ordered_dead.sql"),
    },
    Migration {
        version: 19,
        name: "replay_row_without_the_old_error",
        sql: include_str!("../sql/0019_replay_row_without_the_old_error.sql"),
    },
];

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// An applied file changed since.
    #[error(
        "migration {file} was applied with checksum {applied} but the file now has {current}; \
         restore the file or repair outbox.schema_migrations by hand"
    )]
    ChecksumMismatch {
        /// The file name.
        file: String,
        /// The recorded checksum.
        applied: String,
        /// The file's checksum now.
        current: String,
    },
    /// The database refused a statement.
    #[error("database error while migrating: {}", crate::db::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrateReport {
    /// Files applied by this run.
    pub applied: Vec<String>,
    /// Files that were already applied.
    pub already: usize,
}

/// Applies every pending migration. Safe to run concurrently and repeatedly.
pub async fn migrate(client: &mut Client) -> Result<MigrateReport, MigrateError> {
    client.execute(queries::MIGRATE_LOCK, &[]).await?;
    let result = migrate_locked(client).await;
    // Unlock even after a failure; if the connection itself failed, the session (and its
    // lock) is gone anyway.
    let unlocked = client.execute(queries::MIGRATE_UNLOCK, &[]).await;
    let report = result?;
    unlocked?;
    Ok(report)
}

async fn migrate_locked(client: &mut Client) -> Result<MigrateReport, MigrateError> {
    client.batch_execute(queries::MIGRATE_LEDGER).await?;
    let applied: Vec<(i32, String)> = client
        .query(queries::MIGRATE_APPLIED, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(2)))
        .collect();
    let mut report = MigrateReport::default();
    for m in MIGRATIONS {
        let current = m.checksum();
        if let Some((_, recorded)) = applied.iter().find(|(v, _)| *v == m.version) {
            if *recorded != current {
                return Err(MigrateError::ChecksumMismatch {
                    file: m.file_name(),
                    applied: recorded.clone(),
                    current,
                });
            }
            report.already += 1;
            continue;
        }
        let tx = client.transaction().await?;
        tx.batch_execute(m.sql).await?;
        tx.execute(queries::MIGRATE_RECORD, &[&m.version, &m.name, &current])
            .await?;
        tx.commit().await?;
        report.applied.push(m.file_name());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sql_file_is_embedded_in_order() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sql");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .expect("sql/ exists")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql") && n.as_bytes().first().is_some_and(u8::is_ascii_digit))
            .collect();
        files.sort();
        let embedded: Vec<String> = MIGRATIONS.iter().map(Migration::file_name).collect();
        assert_eq!(files, embedded);
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1, "versions are 1, 2, 3, …");
        }
    }
}
