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
///
/// Until the first release the schema was squashed into one baseline, the live schema as
/// one file; from the first release tag on, an applied file never changes and every change
/// is a new numbered file (a tidy test holds released files to the tag).
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "baseline",
    sql: include_str!("../sql/0001_baseline.sql"),
}];

/// The migrations a pre-release build recorded before the schema was squashed into the
/// baseline, in order. A database migrated through all of them has exactly the baseline's
/// schema; `outboxd migrate` recognises it and says how to adopt the baseline, rather than
/// guessing.
pub const PRE_BASELINE: [&str; 19] = [
    "outbox",
    "operations",
    "enqueue_many_set_based",
    "attempts_without_foreign_key",
    "wakeups_for_idle_workers",
    "cheaper_enqueue",
    "enqueue_hardening",
    "lease_expiry_rule",
    "human_checkpoints",
    "reconcile",
    "purge_cancelled",
    "ordering_keys",
    "destinations",
    "breakers",
    "enqueue_many_insert_first",
    "message_key_byte_order",
    "replay_keeps_the_unknown",
    "contract_names_and_ordered_dead",
    "replay_row_without_the_old_error",
];

/// Is `history` (`(version, name)` in version order) exactly the whole pre-release history, by number and name?
fn is_whole_pre_baseline(history: &[(i32, String)]) -> bool {
    history.len() == PRE_BASELINE.len() && begins_the_pre_baseline(history)
}

/// Is `history` (`(version, name)` in version order) the first files of the pre-release
/// history, by number and name?
fn begins_the_pre_baseline(history: &[(i32, String)]) -> bool {
    history
        .iter()
        .enumerate()
        .all(|(i, (v, n))| *v as usize == i + 1 && PRE_BASELINE.get(i) == Some(&n.as_str()))
}

/// What to say of a recorded history this build does not know: what was found and what to
/// do, in one line. `recorded` is `(version, name)` in version order.
fn unknown_history(recorded: &[(i32, String)]) -> String {
    let named = |(v, n): &(i32, String)| format!("{v:04}_{n}");
    let found = match recorded {
        [] => "no migrations".to_owned(),
        [one] => named(one),
        [first, .., last] => format!(
            "{} … {} ({} files)",
            named(first),
            named(last),
            recorded.len()
        ),
    };
    let pre_baseline = begins_the_pre_baseline(recorded);
    if is_whole_pre_baseline(recorded) {
        format!(
            "this database's outbox schema was built by a pre-release outboxd ({found}), the \
             schema this build's baseline makes: run `outboxd migrate --adopt-baseline` to \
             record it as the baseline; nothing was changed"
        )
    } else if pre_baseline {
        format!(
            "this database's outbox schema was built by a pre-release outboxd and stops at {found}; migrate it to {:04}_{} with a build from before the baseline first, then run this build's migrate again to be told how to adopt the baseline; nothing was changed",
            PRE_BASELINE.len(),
            PRE_BASELINE[PRE_BASELINE.len() - 1]
        )
    } else {
        format!(
            "this database records migrations this build does not know ({found}): it was migrated by another build of outboxd; migrate it with that build, or point this one at a database of its own; nothing was changed"
        )
    }
}

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The database records migrations this build does not know (another build's, or the
    /// pre-release history before the baseline): nothing is applied, and the message says
    /// what was found and what to do.
    #[error("{0}")]
    UnknownHistory(String),
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
    /// The pre-release history was recorded as the baseline (`--adopt-baseline`).
    pub adopted: bool,
}

/// Applies every pending migration. Safe to run concurrently and repeatedly.
pub async fn migrate(client: &mut Client) -> Result<MigrateReport, MigrateError> {
    migrate_with(client, false).await
}

/// [`migrate`]; with `adopt_baseline`, a database whose recorded history is the whole
/// pre-release one ([`PRE_BASELINE`], whose schema is the baseline's) is first recorded as
/// migrated to the baseline, in one transaction. Any other history is refused as
/// [`migrate`] refuses it.
pub async fn migrate_with(
    client: &mut Client,
    adopt_baseline: bool,
) -> Result<MigrateReport, MigrateError> {
    client.execute(queries::MIGRATE_LOCK, &[]).await?;
    let result = migrate_locked(client, adopt_baseline).await;
    // Unlock even after a failure; if the connection itself failed, the session (and its
    // lock) is gone anyway.
    let unlocked = client.execute(queries::MIGRATE_UNLOCK, &[]).await;
    let report = result?;
    unlocked?;
    Ok(report)
}

async fn migrate_locked(
    client: &mut Client,
    adopt_baseline: bool,
) -> Result<MigrateReport, MigrateError> {
    client.batch_execute(queries::MIGRATE_LEDGER).await?;
    let mut recorded: Vec<(i32, String, String)> = client
        .query(queries::MIGRATE_APPLIED, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let history: Vec<(i32, String)> = recorded.iter().map(|(v, n, _)| (*v, n.clone())).collect();
    let mut adopted = false;
    if adopt_baseline && is_whole_pre_baseline(&history) {
        let baseline = &MIGRATIONS[0];
        let checksum = baseline.checksum();
        let tx = client.transaction().await?;
        tx.execute(queries::MIGRATE_FORGET, &[]).await?;
        tx.execute(
            queries::MIGRATE_RECORD,
            &[&baseline.version, &baseline.name, &checksum],
        )
        .await?;
        tx.commit().await?;
        recorded = vec![(baseline.version, baseline.name.to_owned(), checksum)];
        adopted = true;
    }
    // Every recorded file must be one of ours, by number and name: a history this build
    // does not know is reported, never migrated over.
    let known = |(v, n, _): &(i32, String, String)| {
        MIGRATIONS.iter().any(|m| m.version == *v && m.name == n)
    };
    if !recorded.iter().all(known) {
        return Err(MigrateError::UnknownHistory(unknown_history(&history)));
    }
    let applied: Vec<(i32, String)> = recorded.into_iter().map(|(v, _, c)| (v, c)).collect();
    let mut report = MigrateReport {
        adopted,
        ..MigrateReport::default()
    };
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
    fn an_unknown_history_is_named_with_what_to_do() {
        let pre: Vec<(i32, String)> = PRE_BASELINE
            .iter()
            .enumerate()
            .map(|(i, n)| (i as i32 + 1, (*n).to_owned()))
            .collect();
        let all = unknown_history(&pre);
        assert!(
            all.contains("0001_outbox … 0019_replay_row_without_the_old_error (19 files)"),
            "{all}"
        );
        assert!(all.contains("outboxd migrate --adopt-baseline"), "{all}");
        assert!(all.len() < 500, "one line the CLI prints whole: {all}");
        assert!(!all.contains('\n'));
        let part = unknown_history(&pre[..12]);
        assert!(
            part.contains("stops at 0001_outbox … 0012_ordering_keys"),
            "{part}"
        );
        assert!(part.contains("from before the baseline"), "{part}");
        let other = unknown_history(&[(1, "baseline".into()), (2, "from_the_future".into())]);
        assert!(
            other.contains("does not know (0001_baseline … 0002_from_the_future (2 files))"),
            "{other}"
        );
    }

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
