//! `outboxd migrate` on the histories a database may carry: none (the baseline is applied),
//! its own (nothing to do), the pre-release one it was squashed from (named, with the way
//! to adopt the baseline), and one it does not know (named, nothing changed).

use crate::common;

use common::TestDb;
use common::binary::{outboxd, run};

use outboxd::migrate::PRE_BASELINE;

/// The schema as the baseline builds it, recorded as the first `n` pre-release files.
async fn pre_release_database(n: usize) -> TestDb {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute("DELETE FROM outbox.schema_migrations")
        .await
        .unwrap();
    for (i, name) in PRE_BASELINE.iter().take(n).enumerate() {
        c.execute(
            "INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES ($1, $2, 'x')",
            &[&(i as i32 + 1), name],
        )
        .await
        .unwrap();
    }
    db
}

async fn ledger(db: &TestDb) -> Vec<(i32, String)> {
    db.client()
        .await
        .query(
            "SELECT version, name FROM outbox.schema_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn migrate(db: &TestDb, args: &[&str]) -> common::binary::Output {
    run(outboxd(Some(&db.url())).arg("migrate").args(args))
}

#[tokio::test]
async fn a_fresh_database_gets_the_baseline_and_a_second_run_changes_nothing() {
    let db = TestDb::empty().await;
    let out = migrate(&db, &[]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout.contains("applied 0001_baseline.sql"),
        "{}",
        out.stdout
    );
    let out = migrate(&db, &[]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout
            .contains("schema up to date (0 applied now, 1 already)"),
        "{}",
        out.stdout
    );
    assert_eq!(ledger(&db).await, vec![(1, "baseline".to_owned())]);
}

/// The pre-release history: `migrate` names it and the flag that adopts it, exit 2, nothing
/// changed; `--adopt-baseline` records the baseline in its place, and the data stays.
#[tokio::test]
async fn the_pre_release_history_is_named_and_adopted_only_when_asked() {
    let db = pre_release_database(PRE_BASELINE.len()).await;
    common::enqueue_webhook(&db, "kept:1", "https://example.com/h", 3, true).await;
    let before = ledger(&db).await;
    let out = migrate(&db, &[]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    let lines = out.stderr_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("0001_outbox … 0019_replay_row_without_the_old_error (19 files)")
            && lines[0].contains("outboxd migrate --adopt-baseline"),
        "{lines:?}"
    );
    assert_eq!(ledger(&db).await, before, "nothing changed");

    let out = migrate(&db, &["--adopt-baseline"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("as the baseline"), "{}", out.stdout);
    assert_eq!(ledger(&db).await, vec![(1, "baseline".to_owned())]);
    assert_eq!(common::row(&db, "kept:1").await.state, "pending");
    let out = migrate(&db, &[]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

/// A history that stops short of the baseline's schema is not adopted, even when asked.
#[tokio::test]
async fn a_partial_pre_release_history_is_never_adopted() {
    let db = pre_release_database(12).await;
    let before = ledger(&db).await;
    for args in [&[][..], &["--adopt-baseline"][..]] {
        let out = migrate(&db, args);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr);
        assert!(
            out.stderr
                .contains("stops at 0001_outbox … 0012_ordering_keys")
                && out.stderr.contains("from before the baseline"),
            "{args:?}: {}",
            out.stderr
        );
        assert_eq!(ledger(&db).await, before, "{args:?}: nothing changed");
    }
}

/// Another build's history (a file this build has never heard of): named, nothing changed.
#[tokio::test]
async fn a_history_from_another_build_is_named_and_left_alone() {
    let db = TestDb::new().await;
    db.client()
        .await
        .execute(
            "INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES (2, 'from_the_future', 'x')",
            &[],
        )
        .await
        .unwrap();
    let before = ledger(&db).await;
    let out = migrate(&db, &[]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("does not know (0001_baseline … 0002_from_the_future (2 files))"),
        "{}",
        out.stderr
    );
    assert_eq!(ledger(&db).await, before);
}
