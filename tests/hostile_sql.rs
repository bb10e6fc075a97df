//! Issue 13: hostile callers of the SQL interface.
//!
//! - A row that holds an infinite `run_after` (which enqueue accepted until now) does not
//!   break `outboxd status` nor the counts `/metrics` reads.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use serde_json::{Value, json};
use tokio_postgres::Client;

/// Stores a row the way an older install could have, before enqueue refused an infinite
/// `run_after`: with the insert trigger off (as the table's owner).
async fn insert_legacy(c: &Client, key: &str, run_after: &str, created_ago_secs: f64) {
    c.batch_execute("ALTER TABLE outbox.messages DISABLE TRIGGER messages_before_insert")
        .await
        .unwrap();
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload, request_hash, run_after, created_at) \
         VALUES ($1, 'webhook', '{\"url\": \"https://example.com/h\"}', \
                 outbox.request_hash('webhook', '{\"url\": \"https://example.com/h\"}'), \
                 $2::text::timestamptz, now() - make_interval(secs => $3))",
        &[&key, &run_after, &created_ago_secs],
    )
    .await
    .unwrap();
    c.batch_execute("ALTER TABLE outbox.messages ENABLE TRIGGER messages_before_insert")
        .await
        .unwrap();
}

#[tokio::test]
async fn status_and_the_metrics_counts_survive_rows_with_an_infinite_run_after() {
    let db = TestDb::new().await;
    let c = db.client().await;
    insert_legacy(&c, "legacy:-inf", "-infinity", 3600.0).await;
    insert_legacy(&c, "legacy:+inf", "infinity", 7200.0).await;
    c.query_one(
        "SELECT outbox.enqueue('due:10s', 'webhook', '{\"url\": \"https://example.com/h\"}', now() - interval '10 seconds')",
        &[],
    )
    .await
    .unwrap();

    // A `-infinity` row is due since it was enqueued (an hour ago); `infinity` is never due.
    let st = outboxd::status::status(&c).await.unwrap();
    assert_eq!(st.total.pending, 3, "{st:?}");
    assert!((3600.0..3700.0).contains(&st.oldest_due_seconds), "{st:?}");
    let b = outboxd::status::bounded_counts(&c, outboxd::status::COUNT_CAP)
        .await
        .unwrap();
    assert_eq!(b.counts.pending, 3, "{b:?}");
    assert!((3600.0..3700.0).contains(&b.oldest_due_seconds), "{b:?}");

    // Only the `infinity` row: nothing is due.
    c.batch_execute("DELETE FROM outbox.messages WHERE message_key <> 'legacy:+inf'")
        .await
        .unwrap();
    let st = outboxd::status::status(&c).await.unwrap();
    assert_eq!(
        (st.total.pending, st.oldest_due_seconds),
        (1, 0.0),
        "{st:?}"
    );

    // The operator's command, as run from a shell.
    insert_legacy(&c, "legacy:-inf:2", "-infinity", 60.0).await;
    let out = binary::run(binary::outboxd(Some(&db.url())).args(["status", "--json"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["pending"], json!(2), "{v}");
    let oldest = v["oldest_due_seconds"].as_f64().unwrap();
    assert!((60.0..160.0).contains(&oldest), "{v}");
}
