//! Enqueueing against a real PostgreSQL: `outbox.enqueue` / `outbox.enqueue_many` in SQL,
//! `outboxd::enqueue` / `outboxd::enqueue_many` in Rust, the trigger behind plain INSERTs,
//! the wake-up NOTIFY, the CHECK constraints and the migration runner.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use outboxd::migrate::{MIGRATIONS, MigrateError, migrate};
use outboxd::{EnqueueError, Enqueued, NewMessage, enqueue, enqueue_many};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn hook(url: &str) -> Value {
    json!({"url": url, "body": {"order": 42}})
}

async fn count_messages(c: &Client) -> i64 {
    c.query_one("SELECT count(*) FROM outbox.messages", &[])
        .await
        .unwrap()
        .get(0)
}

/// The SQLSTATE of a database error (panics on a non-database error).
fn sqlstate(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .unwrap_or_else(|| panic!("not a database error: {e}"))
        .code()
        .code()
        .to_owned()
}

fn db_message(e: &tokio_postgres::Error) -> String {
    e.as_db_error().unwrap().message().to_owned()
}

/// `SELECT outbox.enqueue(key, channel, payload_text::jsonb, now(), max_attempts)`.
async fn sql_enqueue(
    c: &Client,
    key: &str,
    channel: &str,
    payload: &str,
    max_attempts: i32,
) -> Result<i64, tokio_postgres::Error> {
    c.query_one(
        "SELECT outbox.enqueue($1::text, $2::text, $3::text::jsonb, now(), $4::int)",
        &[&key, &channel, &payload, &max_attempts],
    )
    .await
    .map(|r| r.get(0))
}

/// The row's fields that an enqueue must never change.
async fn snapshot(c: &Client, key: &str) -> (i64, String, Value, Vec<u8>, String, String) {
    let r = c
        .query_one(
            "SELECT id, channel, payload, request_hash, state, updated_at::text \
             FROM outbox.messages WHERE message_key = $1",
            &[&key],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5))
}

fn assert_invalid<T: std::fmt::Debug>(res: Result<T, EnqueueError>, field: &str, what: &str) {
    match res {
        Err(EnqueueError::Invalid { field: f, message }) => {
            assert_eq!(f, field, "{what}: wrong field (message: {message})");
            assert!(
                message.contains(field),
                "{what}: message {message:?} should name {field}"
            );
        }
        other => panic!("{what}: expected Invalid {{ field: {field} }}, got {other:?}"),
    }
}

fn assert_key_conflict<T: std::fmt::Debug>(res: Result<T, EnqueueError>, key: &str) {
    match res {
        Err(EnqueueError::KeyConflict { key: k, message }) => {
            assert_eq!(k, key);
            assert!(
                message.contains(key),
                "message {message:?} should name the key {key}"
            );
        }
        other => panic!("expected KeyConflict for {key}, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Commit and rollback
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn rust_enqueue_follows_the_callers_transaction() {
    let db = TestDb::new().await;
    let mut c = db.client().await;
    c.batch_execute("CREATE TABLE orders (id int PRIMARY KEY, paid boolean NOT NULL)")
        .await
        .unwrap();

    // Rolled back: neither the business row nor the message exists.
    let tx = c.transaction().await.unwrap();
    tx.execute("INSERT INTO orders VALUES (1, true)", &[])
        .await
        .unwrap();
    let e = enqueue(
        &tx,
        &NewMessage::webhook("order-1:paid:notify", hook("https://example.com/h")),
    )
    .await
    .unwrap();
    assert!(e.created);
    tx.rollback().await.unwrap();
    assert_eq!(count_messages(&c).await, 0);
    let orders: i64 = c
        .query_one("SELECT count(*) FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 0);

    // Committed: exactly one pending row, with the id enqueue returned.
    let tx = c.transaction().await.unwrap();
    tx.execute("INSERT INTO orders VALUES (2, true)", &[])
        .await
        .unwrap();
    let msg = NewMessage::webhook("order-2:paid:notify", hook("https://example.com/h"))
        .max_attempts(5)
        .retry_ambiguous(false);
    let e = enqueue(&tx, &msg).await.unwrap();
    assert!(e.created);
    tx.commit().await.unwrap();
    let rows = c
        .query(
            "SELECT id, message_key, channel, state, attempts, max_attempts, retry_ambiguous \
             FROM outbox.messages",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r.get::<_, i64>(0), e.id);
    assert_eq!(r.get::<_, String>(1), "order-2:paid:notify");
    assert_eq!(r.get::<_, String>(2), "webhook");
    assert_eq!(r.get::<_, String>(3), "pending");
    assert_eq!(r.get::<_, i32>(4), 0);
    assert_eq!(r.get::<_, i32>(5), 5);
    assert!(!r.get::<_, bool>(6));

    // run_after is stored as given.
    let later = std::time::SystemTime::now() + Duration::from_secs(3600);
    let e = enqueue(
        &c,
        &NewMessage::webhook("order-3:later", hook("https://example.com/h")).run_after(later),
    )
    .await
    .unwrap();
    let delay: f64 = c
        .query_one(
            "SELECT extract(epoch FROM run_after - now())::float8 FROM outbox.messages WHERE id = $1",
            &[&e.id],
        )
        .await
        .unwrap()
        .get(0);
    assert!((3590.0..=3600.5).contains(&delay), "run_after in {delay}s");

    // The key of the rolled-back message is free again.
    let e1 = enqueue(
        &c,
        &NewMessage::webhook("order-1:paid:notify", hook("https://example.com/other")),
    )
    .await
    .unwrap();
    assert!(e1.created);
}

#[tokio::test]
async fn sql_enqueue_follows_the_callers_transaction() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute("CREATE TABLE orders (id int PRIMARY KEY)")
        .await
        .unwrap();

    c.batch_execute(
        "BEGIN; INSERT INTO orders VALUES (1); \
         SELECT outbox.enqueue('o1', 'webhook', '{\"url\": \"https://example.com/h\"}'); \
         ROLLBACK;",
    )
    .await
    .unwrap();
    assert_eq!(count_messages(&c).await, 0);

    c.batch_execute("BEGIN").await.unwrap();
    c.execute("INSERT INTO orders VALUES (2)", &[])
        .await
        .unwrap();
    let id = sql_enqueue(
        &c,
        "o2",
        "webhook",
        r#"{"url": "https://example.com/h"}"#,
        3,
    )
    .await
    .unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    let rows = c
        .query("SELECT id, state FROM outbox.messages", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get::<_, i64>(0), id);
    assert_eq!(rows[0].get::<_, String>(1), "pending");
}

// ---------------------------------------------------------------------------------------
// Dedup and key conflicts
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn same_key_and_payload_dedups_in_every_state() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let key = "run-7:step-3:notify";
    let msg = NewMessage::webhook(key, hook("https://example.com/h"));
    let first = enqueue(&c, &msg).await.unwrap();
    assert!(first.created);

    let updates = [
        ("pending", "SELECT 1"),
        (
            "running",
            "UPDATE outbox.messages SET state = 'running', attempts = 1, lease_owner = 'w', \
             lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute'",
        ),
        (
            "delivered",
            "UPDATE outbox.messages SET state = 'delivered', delivered_at = now(), \
             lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL",
        ),
        (
            "dead",
            "UPDATE outbox.messages SET state = 'dead', delivered_at = NULL, dead_at = now(), \
             error_class = 'permanent', last_error = 'HTTP 400'",
        ),
    ];
    for (state, sql) in updates {
        c.batch_execute(sql).await.unwrap();
        let before = snapshot(&c, key).await;
        assert_eq!(before.4, state);

        let again = enqueue(&c, &msg).await.unwrap();
        assert_eq!(
            again,
            Enqueued {
                id: first.id,
                created: false
            },
            "Rust enqueue on a {state} row"
        );
        let sql_id = sql_enqueue(
            &c,
            key,
            "webhook",
            r#"{"url": "https://example.com/h", "body": {"order": 42}}"#,
            3,
        )
        .await
        .unwrap();
        assert_eq!(sql_id, first.id, "SQL enqueue on a {state} row");

        assert_eq!(count_messages(&c).await, 1);
        assert_eq!(
            snapshot(&c, key).await,
            before,
            "the {state} row is untouched"
        );
    }
}

/// Keys compare in byte order (`COLLATE "C"`): keys that a language's collation would sort
/// side by side, or that Unicode calls canonically equivalent, are as distinct as they ever
/// were, each its own message, and each dedups only against itself.
#[tokio::test]
async fn keys_are_distinct_by_their_bytes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let keys = ["order:1", "Order:1", "caf\u{e9}:1", "cafe\u{301}:1"];
    let mut ids = Vec::new();
    for key in keys {
        let got = enqueue(&c, &NewMessage::webhook(key, hook("https://example.com/h")))
            .await
            .unwrap();
        assert!(got.created, "{key:?}");
        ids.push(got.id);
    }
    // The first key again, with its payload: the same message.
    let again = enqueue(
        &c,
        &NewMessage::webhook("order:1", hook("https://example.com/h")),
    )
    .await
    .unwrap();
    assert_eq!((again.id, again.created), (ids[0], false));
    assert_eq!(count_messages(&c).await, 4);
    let collation: String = db
        .scalar(
            "SELECT collation_name FROM information_schema.columns \
             WHERE table_schema = 'outbox' AND table_name = 'messages' AND column_name = 'message_key'",
        )
        .await;
    assert_eq!(collation, "C");
}

#[tokio::test]
async fn json_key_order_and_whitespace_do_not_matter() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = sql_enqueue(
        &c,
        "k",
        "webhook",
        r#"{"url":"https://example.com/h","body":{"a":1,"b":[1,2,{"x":null,"y":"z"}]},"method":"POST"}"#,
        3,
    )
    .await
    .unwrap();
    let again = sql_enqueue(
        &c,
        "k",
        "webhook",
        "{ \"method\" : \"POST\",\n  \"body\": { \"b\": [1, 2, {\"y\": \"z\", \"x\": null}], \"a\": 1 },\n  \"url\": \"https://example.com/h\" }",
        3,
    )
    .await
    .unwrap();
    assert_eq!(again, id);

    // The Rust path agrees with the SQL path on what "the same payload" is.
    let e = enqueue(
        &c,
        &NewMessage::webhook(
            "k",
            json!({"body": {"b": [1, 2, {"y": "z", "x": null}], "a": 1}, "method": "POST", "url": "https://example.com/h"}),
        ),
    )
    .await
    .unwrap();
    assert_eq!(e, Enqueued { id, created: false });
    assert_eq!(count_messages(&c).await, 1);
}

#[tokio::test]
async fn same_key_with_other_payload_or_channel_is_a_key_conflict() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let key = "order-9:refund:notify";
    enqueue(&c, &NewMessage::webhook(key, hook("https://example.com/a")))
        .await
        .unwrap();
    let before = snapshot(&c, key).await;

    // Rust: another payload, then another channel.
    assert_key_conflict(
        enqueue(&c, &NewMessage::webhook(key, hook("https://example.com/b"))).await,
        key,
    );
    assert_key_conflict(
        enqueue(
            &c,
            &NewMessage::email(key, json!({"to": ["a@example.com"], "text": "hi"})),
        )
        .await,
        key,
    );

    // SQL: OB409, naming the key.
    let e = sql_enqueue(&c, key, "webhook", r#"{"url": "https://example.com/b"}"#, 3)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "OB409");
    assert!(db_message(&e).contains(key), "{}", db_message(&e));
    let e = sql_enqueue(&c, key, "email", r#"{"to": ["a@example.com"]}"#, 3)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "OB409");
    assert!(db_message(&e).contains(key), "{}", db_message(&e));

    // Untouched, in the caller's transaction too (the error aborts only that transaction).
    let mut c2 = db.client().await;
    let tx = c2.transaction().await.unwrap();
    assert_key_conflict(
        enqueue(
            &tx,
            &NewMessage::webhook(key, hook("https://example.com/c")),
        )
        .await,
        key,
    );
    drop(tx);
    assert_eq!(count_messages(&c).await, 1);
    assert_eq!(snapshot(&c, key).await, before);

    // A dead row is still the dedup record: a conflict too.
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'dead', dead_at = now(), error_class = 'exhausted'",
    )
    .await
    .unwrap();
    let dead = snapshot(&c, key).await;
    assert_key_conflict(
        enqueue(&c, &NewMessage::webhook(key, hook("https://example.com/d"))).await,
        key,
    );
    assert_eq!(snapshot(&c, key).await, dead);
}

// ---------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn bad_input_is_refused_from_rust_naming_the_field() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let ok_url = hook("https://example.com/h");
    let cases: Vec<(&str, NewMessage, &str)> = vec![
        (
            "empty key",
            NewMessage::webhook("", ok_url.clone()),
            "message_key",
        ),
        (
            "256-char key",
            NewMessage::webhook("k".repeat(256), ok_url.clone()),
            "message_key",
        ),
        (
            "256-char key of é",
            NewMessage::webhook("é".repeat(256), ok_url.clone()),
            "message_key",
        ),
        (
            "payload an array",
            NewMessage::webhook("k1", json!([{"url": "https://example.com"}])),
            "payload",
        ),
        (
            "payload a string",
            NewMessage::webhook("k2", json!("https://example.com")),
            "payload",
        ),
        (
            "payload null",
            NewMessage::webhook("k2n", Value::Null),
            "payload",
        ),
        (
            "webhook without url",
            NewMessage::webhook("k3", json!({"body": {}})),
            "payload.url",
        ),
        (
            "webhook url a number",
            NewMessage::webhook("k4", json!({"url": 5})),
            "payload.url",
        ),
        (
            "webhook url an object",
            NewMessage::webhook("k4o", json!({"url": {"href": "https://example.com"}})),
            "payload.url",
        ),
        (
            "email without to",
            NewMessage::email("k5", json!({"from": "a@example.com", "text": "hi"})),
            "payload.to",
        ),
        (
            "email with empty to",
            NewMessage::email("k6", json!({"to": [], "text": "hi"})),
            "payload.to",
        ),
        (
            "email with to a number",
            NewMessage::email("k6n", json!({"to": 7, "text": "hi"})),
            "payload.to",
        ),
        (
            "max_attempts 0",
            NewMessage::webhook("k7", ok_url.clone()).max_attempts(0),
            "max_attempts",
        ),
        (
            "max_attempts -1",
            NewMessage::webhook("k8", ok_url.clone()).max_attempts(-1),
            "max_attempts",
        ),
    ];
    for (what, msg, field) in &cases {
        assert_invalid(enqueue(&c, msg).await, field, what);
        // The batch path applies the same rules.
        match enqueue_many(&c, std::slice::from_ref(msg)).await {
            Err(EnqueueError::Invalid { field: f, .. }) => assert_eq!(&f, field, "{what} (many)"),
            other => panic!("{what} (many): expected Invalid, got {other:?}"),
        }
    }
    assert_eq!(count_messages(&c).await, 0, "nothing was inserted");

    // An existing key does not short-cut validation: bad input is still bad input.
    enqueue(&c, &NewMessage::webhook("exists", ok_url.clone()))
        .await
        .unwrap();
    assert_invalid(
        enqueue(
            &c,
            &NewMessage::webhook("exists", ok_url.clone()).max_attempts(0),
        )
        .await,
        "max_attempts",
        "max_attempts 0 on an existing key",
    );
    assert_eq!(count_messages(&c).await, 1);
}

#[tokio::test]
async fn key_length_counts_characters_not_bytes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let ascii = "k".repeat(255);
    let accented = "é".repeat(255); // 510 bytes, 255 characters
    assert_eq!(accented.len(), 510);
    for key in [&ascii, &accented] {
        let e = enqueue(&c, &NewMessage::webhook(key, hook("https://example.com/h")))
            .await
            .unwrap();
        assert!(e.created);
        let stored: String = c
            .query_one(
                "SELECT message_key FROM outbox.messages WHERE id = $1",
                &[&e.id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(&stored, key);
    }
    let id = sql_enqueue(
        &c,
        &"ü".repeat(255),
        "webhook",
        r#"{"url": "https://x.example"}"#,
        3,
    )
    .await
    .unwrap();
    assert!(id > 0);
    let e = sql_enqueue(
        &c,
        &"ü".repeat(256),
        "webhook",
        r#"{"url": "https://x.example"}"#,
        3,
    )
    .await
    .unwrap_err();
    assert_eq!(sqlstate(&e), "22023");
    assert_eq!(count_messages(&c).await, 3);
}

#[tokio::test]
async fn bad_input_is_refused_from_sql_with_22023_naming_the_field() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = r#"{"url": "https://example.com/h"}"#;
    let k256 = "k".repeat(256);
    let cases: Vec<(&str, &str, &str, &str, i32, &str)> = vec![
        ("empty key", "", "webhook", url, 3, "message_key"),
        ("256-char key", &k256, "webhook", url, 3, "message_key"),
        ("unknown channel", "k1", "sms", url, 3, "channel"),
        ("empty channel", "k1e", "", url, 3, "channel"),
        ("payload an array", "k2", "webhook", "[1, 2]", 3, "payload"),
        (
            "payload a string",
            "k3",
            "webhook",
            r#""hello""#,
            3,
            "payload",
        ),
        ("payload a number", "k3n", "webhook", "42", 3, "payload"),
        (
            "webhook without url",
            "k4",
            "webhook",
            "{}",
            3,
            "payload.url",
        ),
        (
            "webhook url not a string",
            "k5",
            "webhook",
            r#"{"url": ["https://example.com"]}"#,
            3,
            "payload.url",
        ),
        (
            "webhook url null",
            "k5n",
            "webhook",
            r#"{"url": null}"#,
            3,
            "payload.url",
        ),
        (
            "email without to",
            "k6",
            "email",
            r#"{"subject": "s", "text": "t"}"#,
            3,
            "payload.to",
        ),
        (
            "email with empty to",
            "k7",
            "email",
            r#"{"to": [], "text": "t"}"#,
            3,
            "payload.to",
        ),
        ("max_attempts 0", "k8", "webhook", url, 0, "max_attempts"),
        ("max_attempts -1", "k9", "webhook", url, -1, "max_attempts"),
    ];
    for (what, key, channel, payload, max_attempts, field) in cases {
        let e = sql_enqueue(&c, key, channel, payload, max_attempts)
            .await
            .expect_err(what);
        let db_err = e.as_db_error().unwrap();
        assert_eq!(
            db_err.code(),
            &SqlState::INVALID_PARAMETER_VALUE,
            "{what}: {e}"
        );
        assert!(
            db_err.message().contains(field),
            "{what}: message {:?} should name {field}",
            db_err.message()
        );
        assert_eq!(db_err.column(), Some(field), "{what}: COLUMN field");
    }
    // NULLs are bad input too, not a crash or a NOT NULL violation.
    let e = c
        .query_one(
            "SELECT outbox.enqueue(NULL, 'webhook', '{\"url\": \"https://x.example\"}')",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "22023");
    let e = c
        .query_one("SELECT outbox.enqueue('kn', 'webhook', NULL)", &[])
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "22023");
    assert_eq!(count_messages(&c).await, 0, "nothing was inserted");
}

#[tokio::test]

async fn email_with_an_empty_string_to_is_invalid() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for to in [json!(""), json!("   ")] {
        assert_invalid(
            enqueue(
                &c,
                &NewMessage::email("e1", json!({"to": to, "text": "hi"})),
            )
            .await,
            "payload.to",
            "email with to an empty string",
        );
    }
    assert_eq!(count_messages(&c).await, 0, "nothing was inserted");
}

// ---------------------------------------------------------------------------------------
// Plain INSERT
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_plain_insert_is_fingerprinted_validated_and_dedups_with_enqueue() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload) VALUES \
         ('plain-1', 'webhook', '{\"url\": \"https://example.com/h\", \"body\": {\"b\": 1, \"a\": 2}}')",
        &[],
    )
    .await
    .unwrap();
    let r = c
        .query_one(
            "SELECT id, state, request_hash, payload::text, \
                    outbox.request_hash(channel, payload) = request_hash \
             FROM outbox.messages WHERE message_key = 'plain-1'",
            &[],
        )
        .await
        .unwrap();
    let id: i64 = r.get(0);
    assert_eq!(r.get::<_, String>(1), "pending");
    let hash: Vec<u8> = r.get(2);
    assert_eq!(hash.len(), 32);
    assert!(r.get::<_, bool>(4), "equals outbox.request_hash()");
    // An independent computation: SHA-256 of "channel\n" + jsonb's canonical text.
    let canonical: String = r.get(3);
    let expected = Sha256::digest(format!("webhook\n{canonical}").as_bytes());
    assert_eq!(hash, expected.to_vec());

    // outbox.enqueue with the same key and payload (written differently) dedups to it.
    let again = sql_enqueue(
        &c,
        "plain-1",
        "webhook",
        r#"{"body":{"a":2,"b":1},"url":"https://example.com/h"}"#,
        3,
    )
    .await
    .unwrap();
    assert_eq!(again, id);
    let e = enqueue(
        &c,
        &NewMessage::webhook(
            "plain-1",
            json!({"url": "https://example.com/h", "body": {"a": 2, "b": 1}}),
        ),
    )
    .await
    .unwrap();
    assert_eq!(e, Enqueued { id, created: false });
    assert_key_conflict(
        enqueue(
            &c,
            &NewMessage::webhook("plain-1", json!({"url": "https://example.com/h"})),
        )
        .await,
        "plain-1",
    );

    // A caller cannot make the fingerprint lie.
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload, request_hash) VALUES \
         ('plain-2', 'email', '{\"to\": [\"a@example.com\"], \"text\": \"hi\"}', '\\x00')",
        &[],
    )
    .await
    .unwrap();
    let ok: bool = c
        .query_one(
            "SELECT request_hash = outbox.request_hash(channel, payload) \
             FROM outbox.messages WHERE message_key = 'plain-2'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ok);

    // And it is validated like enqueue.
    for (sql, field) in [
        (
            "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('p3', 'webhook', '{}')",
            "payload.url",
        ),
        (
            "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('p4', 'email', '{\"to\": []}')",
            "payload.to",
        ),
        (
            "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('p5', 'webhook', '[]')",
            "payload",
        ),
        (
            "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('', 'webhook', '{\"url\": \"https://x\"}')",
            "message_key",
        ),
        (
            "INSERT INTO outbox.messages (message_key, channel, payload, max_attempts) VALUES ('p6', 'webhook', '{\"url\": \"https://x\"}', 0)",
            "max_attempts",
        ),
    ] {
        let e = c.execute(sql, &[]).await.unwrap_err();
        assert_eq!(sqlstate(&e), "22023", "{sql}");
        assert!(db_message(&e).contains(field), "{sql}: {}", db_message(&e));
    }
    assert_eq!(count_messages(&c).await, 2);
}

// ---------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------

/// `n` connections enqueue `payloads[i % len]` under `key` at the same moment, each in its
/// own transaction that commits when the enqueue succeeded.
async fn race(
    db: &TestDb,
    key: &str,
    payloads: &[Value],
    n: usize,
) -> Vec<Result<Enqueued, EnqueueError>> {
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut handles = Vec::new();
    for i in 0..n {
        let mut client = db.client().await;
        let barrier = barrier.clone();
        let msg = NewMessage::webhook(key, payloads[i % payloads.len()].clone());
        handles.push(tokio::spawn(async move {
            let tx = client.transaction().await.unwrap();
            // Every transaction is open (has a snapshot) before any of them enqueues.
            tx.query_one("SELECT 1", &[]).await.unwrap();
            barrier.wait().await;
            let res = enqueue(&tx, &msg).await;
            if res.is_ok() {
                tx.commit().await.unwrap();
            }
            res
        }));
    }
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_same_payload_enqueues_share_one_row() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for round in 0..5 {
        let key = format!("race-same-{round}");
        let results = race(&db, &key, &[hook("https://example.com/h")], 8).await;
        let ok: Vec<Enqueued> = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("round {round}: unexpected error {e:?}")))
            .collect();
        assert_eq!(ok.iter().filter(|e| e.created).count(), 1, "{ok:?}");
        let id = ok[0].id;
        assert!(ok.iter().all(|e| e.id == id), "{ok:?}");
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.messages WHERE message_key = $1 AND id = $2",
                &[&key, &id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1);
    }
    assert_eq!(count_messages(&c).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_different_payloads_one_wins_others_key_conflict() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for round in 0..5 {
        let key = format!("race-diff-{round}");
        let payloads: Vec<Value> = (0..8)
            .map(|i| hook(&format!("https://example.com/{i}")))
            .collect();
        let results = race(&db, &key, &payloads, 8).await;
        let mut winners = Vec::new();
        for r in results {
            match r {
                Ok(e) => winners.push(e),
                Err(EnqueueError::KeyConflict { key: k, .. }) => assert_eq!(k, key),
                Err(other) => panic!("round {round}: expected KeyConflict, got {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
        assert!(winners[0].created);
        let stored: i64 = c
            .query_one(
                "SELECT id FROM outbox.messages WHERE message_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(stored, winners[0].id);
    }
    assert_eq!(count_messages(&c).await, 5);
}

// ---------------------------------------------------------------------------------------
// enqueue_many
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn enqueue_many_returns_results_in_order_and_dedups() {
    let db = TestDb::new().await;
    let c = db.client().await;
    assert_eq!(enqueue_many(&c, &[]).await.unwrap(), vec![]);

    let existing = enqueue(
        &c,
        &NewMessage::webhook("m0", hook("https://example.com/0")),
    )
    .await
    .unwrap();
    let msgs = vec![
        NewMessage::webhook("m1", hook("https://example.com/1")),
        NewMessage::email("m2", json!({"to": ["a@example.com"], "text": "hi"})).max_attempts(7),
        NewMessage::webhook("m0", hook("https://example.com/0")),
        NewMessage::webhook("m3", hook("https://example.com/3")).retry_ambiguous(false),
        NewMessage::webhook("m1", hook("https://example.com/1")),
    ];
    let out = enqueue_many(&c, &msgs).await.unwrap();
    assert_eq!(out.len(), 5);
    let created: Vec<bool> = out.iter().map(|e| e.created).collect();
    assert_eq!(created, vec![true, true, false, true, false]);
    assert_eq!(out[2].id, existing.id);
    assert_eq!(out[4].id, out[0].id, "a duplicate inside the batch dedups");
    for (msg, e) in msgs.iter().zip(&out) {
        let r = c
            .query_one(
                "SELECT message_key, channel, payload FROM outbox.messages WHERE id = $1",
                &[&e.id],
            )
            .await
            .unwrap();
        assert_eq!(r.get::<_, String>(0), msg.key());
        assert_eq!(r.get::<_, String>(1), msg.channel().as_str());
        assert_eq!(&r.get::<_, Value>(2), msg.payload());
    }
    let r = c
        .query_one(
            "SELECT (SELECT max_attempts FROM outbox.messages WHERE message_key = 'm2'), \
                    (SELECT retry_ambiguous FROM outbox.messages WHERE message_key = 'm3')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, i32>(0), 7);
    assert!(!r.get::<_, bool>(1));
    assert_eq!(count_messages(&c).await, 4);

    // A batch of new keys only (answered without probing the stored rows):
    // every row created, the ids in array order, whatever the keys' order.
    let msgs: Vec<NewMessage> = ["n-z", "n-a", "n-m", "n-b"]
        .iter()
        .map(|k| NewMessage::webhook(*k, hook("https://example.com/n")))
        .collect();
    let out = enqueue_many(&c, &msgs).await.unwrap();
    assert!(out.iter().all(|e| e.created));
    for (msg, e) in msgs.iter().zip(&out) {
        let key: String = c
            .query_one(
                "SELECT message_key FROM outbox.messages WHERE id = $1",
                &[&e.id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(key, msg.key());
    }
}

#[tokio::test]
async fn enqueue_many_is_all_or_nothing() {
    let db = TestDb::new().await;
    let c = db.client().await;

    // A bad row in the middle.
    let msgs = vec![
        NewMessage::webhook("a1", hook("https://example.com/1")),
        NewMessage::email("a2", json!({"to": [], "text": "hi"})),
        NewMessage::webhook("a3", hook("https://example.com/3")),
    ];
    assert_invalid(
        enqueue_many(&c, &msgs).await,
        "payload.to",
        "bad row in the middle",
    );
    assert_eq!(count_messages(&c).await, 0);

    // A key conflict inside the batch.
    let msgs = vec![
        NewMessage::webhook("b1", hook("https://example.com/1")),
        NewMessage::webhook("b2", hook("https://example.com/2")),
        NewMessage::webhook("b1", hook("https://example.com/other")),
    ];
    assert_key_conflict(enqueue_many(&c, &msgs).await, "b1");
    assert_eq!(count_messages(&c).await, 0);

    // A conflict with a committed row: the batch's new rows are not inserted either.
    enqueue(
        &c,
        &NewMessage::webhook("c0", hook("https://example.com/0")),
    )
    .await
    .unwrap();
    let msgs = vec![
        NewMessage::webhook("c1", hook("https://example.com/1")),
        NewMessage::webhook("c0", hook("https://example.com/changed")),
    ];
    assert_key_conflict(enqueue_many(&c, &msgs).await, "c0");
    assert_eq!(count_messages(&c).await, 1);
}

/// Every row of a batch is validated before the dedup rules apply, as for one message: the
/// first invalid row in array order is reported, wherever a conflict is; a valid batch
/// reports its first conflicting row. Nothing of a refused batch is stored.
#[tokio::test]
async fn enqueue_many_reports_the_first_invalid_row_then_the_first_conflict() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(
        &c,
        &NewMessage::webhook("x0", hook("https://example.com/0")),
    )
    .await
    .unwrap();
    // A conflict before a bad row: 22023.
    let msgs = vec![
        NewMessage::webhook("p1", hook("https://example.com/1")),
        NewMessage::webhook("x0", hook("https://example.com/changed")),
        NewMessage::email("p3", json!({"to": [], "text": "hi"})),
    ];
    assert_invalid(
        enqueue_many(&c, &msgs).await,
        "payload.to",
        "bad row after a conflict",
    );
    // Two conflicts, with the stored row and with a repeat inside the batch: the first.
    let msgs = vec![
        NewMessage::webhook("r1", hook("https://example.com/1")),
        NewMessage::webhook("r1", hook("https://example.com/other")),
        NewMessage::webhook("x0", hook("https://example.com/changed")),
    ];
    assert_key_conflict(enqueue_many(&c, &msgs).await, "r1");
    let msgs = vec![
        NewMessage::webhook("r2", hook("https://example.com/1")),
        NewMessage::webhook("x0", hook("https://example.com/changed")),
        NewMessage::webhook("r2", hook("https://example.com/other")),
    ];
    assert_key_conflict(enqueue_many(&c, &msgs).await, "x0");
    // A bad row before a conflict: 22023.
    let msgs = vec![
        NewMessage::webhook("q1", hook("https://example.com/1")),
        NewMessage::email("q2", json!({"to": [], "text": "hi"})),
        NewMessage::webhook("x0", hook("https://example.com/changed")),
    ];
    assert_invalid(
        enqueue_many(&c, &msgs).await,
        "payload.to",
        "bad row before a conflict",
    );
    // The conflicting row is itself bad: 22023 (validation comes first, as for one row).
    let msgs = vec![NewMessage::webhook("x0", hook("https://example.com/0")).max_attempts(0)];
    assert_invalid(
        enqueue_many(&c, &msgs).await,
        "max_attempts",
        "bad row with an existing key",
    );
    assert_eq!(count_messages(&c).await, 1);
}

/// A batch's arrays have one dimension. A 2x2 batch was read as two rows by the length
/// check and four by the insert; with a repeated key it could store the key twice over
/// (or accept one key with two payloads).
#[tokio::test]
async fn enqueue_many_refuses_arrays_of_more_than_one_dimension() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let err = c
        .query(
            "SELECT * FROM outbox.enqueue_many('{{a,b},{a,b}}', '{{webhook,webhook},{webhook,webhook}}', \
             ARRAY[ARRAY['{\"url\": \"https://example.com/1\"}'::jsonb, '{\"url\": \"https://example.com/1\"}'], \
                   ARRAY['{\"url\": \"https://example.com/2\"}'::jsonb, '{\"url\": \"https://example.com/2\"}']])",
            &[],
        )
        .await
        .expect_err("a two-dimensional batch");
    let db_err = err.as_db_error().expect("a database error");
    assert_eq!(
        db_err.code(),
        &SqlState::INVALID_PARAMETER_VALUE,
        "{db_err:?}"
    );
    assert!(db_err.message().contains("one dimension"), "{db_err:?}");
    // An optional array of two dimensions too.
    let err = c
        .query(
            "SELECT * FROM outbox.enqueue_many('{a}', '{webhook}', \
             ARRAY['{\"url\": \"https://example.com/1\"}'::jsonb], max_attempts => '{{1},{2}}')",
            &[],
        )
        .await
        .expect_err("a two-dimensional max_attempts");
    assert_eq!(
        err.as_db_error().map(|e| e.code().clone()),
        Some(SqlState::INVALID_PARAMETER_VALUE)
    );
    assert_eq!(count_messages(&c).await, 0);
}

/// A stored row purged while a batch waits on another transaction's row: the batch's
/// insert skipped its key (it was stored), and by its second statement the row is gone. The
/// row is enqueued again, created, as `outbox.enqueue_row` does (its answer is read into one
/// record: PL/pgSQL does not read it into two array elements).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_many_enqueues_again_a_row_purged_while_it_waited() {
    let db = TestDb::new().await;
    let c1 = db.client().await;
    enqueue(
        &c1,
        &NewMessage::webhook("k", hook("https://example.com/k")),
    )
    .await
    .unwrap();
    // Another transaction holds a new row of key k0, uncommitted.
    let c3 = db.client().await;
    c3.batch_execute("BEGIN").await.unwrap();
    enqueue(
        &c3,
        &NewMessage::webhook("k0", hook("https://example.com/k0")),
    )
    .await
    .unwrap();
    // The batch: k (stored, skipped by the insert) and k0 (waits for the other transaction).
    let c2 = db.client().await;
    let pid = backend_pid(&c2).await;
    let batch = tokio::spawn(async move {
        let msgs = vec![
            NewMessage::webhook("k", hook("https://example.com/k")),
            NewMessage::webhook("k0", hook("https://example.com/k0")),
        ];
        enqueue_many(&c2, &msgs).await
    });
    wait_for_backend_wait(&c1, pid, "transactionid", "the batch to wait for k0").await;
    // Purged meanwhile, then the other transaction gives k0 up.
    c1.execute("DELETE FROM outbox.messages WHERE message_key = 'k'", &[])
        .await
        .unwrap();
    c3.batch_execute("ROLLBACK").await.unwrap();
    let out = batch.await.unwrap().expect("the batch succeeds");
    assert_eq!(
        out.iter().map(|e| e.created).collect::<Vec<_>>(),
        [true, true],
        "k enqueued again, k0 new"
    );
    let keys: Vec<String> = first_column(
        &c1,
        "SELECT message_key FROM outbox.messages ORDER BY message_key",
    )
    .await;
    assert_eq!(keys, ["k", "k0"]);
}

#[tokio::test]

async fn enqueue_many_key_conflict_names_keys_with_quotes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for key in ["o'brien:42:notify", r"path\to:notify"] {
        enqueue(&c, &NewMessage::webhook(key, hook("https://example.com/1")))
            .await
            .unwrap();
        // The single-message path reports the key it was given (its message shows the key
        // as an SQL literal, quotes doubled).
        match enqueue(&c, &NewMessage::webhook(key, hook("https://example.com/2"))).await {
            Err(EnqueueError::KeyConflict { key: k, .. }) => assert_eq!(k, key),
            other => panic!("expected KeyConflict, got {other:?}"),
        }
        let msgs = vec![
            NewMessage::webhook("fresh", hook("https://example.com/1")),
            NewMessage::webhook(key, hook("https://example.com/2")),
        ];
        match enqueue_many(&c, &msgs).await {
            Err(EnqueueError::KeyConflict { key: k, .. }) => {
                assert_eq!(k, key, "the batch's KeyConflict names the key")
            }
            other => panic!("expected KeyConflict, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn sql_enqueue_many() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let rows = c
        .query(
            "SELECT id, created FROM outbox.enqueue_many(\
               ARRAY['s1', 's2', 's1'], ARRAY['webhook', 'email', 'webhook'], \
               ARRAY['{\"url\": \"https://example.com\"}', '{\"to\": [\"a@example.com\"]}', \
                     '{\"url\":\"https://example.com\"}']::jsonb[], \
               max_attempts => ARRAY[NULL, 9]::int[])",
            &[],
        )
        .await
        .unwrap();
    let out: Vec<(i64, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(out.len(), 3);
    assert_eq!(
        out.iter().map(|o| o.1).collect::<Vec<_>>(),
        vec![true, true, false]
    );
    assert_eq!(out[2].0, out[0].0);
    let r = c
        .query_one(
            "SELECT (SELECT id FROM outbox.messages WHERE message_key = 's1'), \
                    (SELECT id FROM outbox.messages WHERE message_key = 's2'), \
                    (SELECT max_attempts FROM outbox.messages WHERE message_key = 's1'), \
                    (SELECT max_attempts FROM outbox.messages WHERE message_key = 's2')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, i64>(0), out[0].0);
    assert_eq!(r.get::<_, i64>(1), out[1].0);
    assert_eq!(r.get::<_, i32>(2), 3);
    assert_eq!(r.get::<_, i32>(3), 9);

    // A bad row in the middle: 22023 and nothing inserted.
    let e = c
        .query(
            "SELECT * FROM outbox.enqueue_many(ARRAY['t1', 't2', 't3'], \
               ARRAY['webhook', 'webhook', 'webhook'], \
               ARRAY['{\"url\": \"https://example.com\"}', '{}', '{\"url\": \"https://example.com\"}']::jsonb[])",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "22023");
    assert!(db_message(&e).contains("payload.url"));
    // A conflicting row: OB409, nothing inserted.
    let e = c
        .query(
            "SELECT * FROM outbox.enqueue_many(ARRAY['u1', 's2'], ARRAY['webhook', 'webhook'], \
               ARRAY['{\"url\": \"https://example.com\"}', '{\"url\": \"https://example.com\"}']::jsonb[])",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "OB409");
    assert!(db_message(&e).contains("s2"));
    // Arrays of different lengths are bad input.
    let e = c
        .query(
            "SELECT * FROM outbox.enqueue_many(ARRAY['v1', 'v2'], ARRAY['webhook'], \
               ARRAY['{\"url\": \"https://example.com\"}']::jsonb[])",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "22023");
    // Empty arrays: no rows.
    let rows = c
        .query(
            "SELECT * FROM outbox.enqueue_many('{}'::text[], '{}'::text[], '{}'::jsonb[])",
            &[],
        )
        .await
        .unwrap();
    assert!(rows.is_empty());
    assert_eq!(count_messages(&c).await, 2);
}

// ---------------------------------------------------------------------------------------
// NOTIFY
// ---------------------------------------------------------------------------------------

async fn next_notification(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(String, String)>,
) -> (String, String) {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a notification within 5s")
        .expect("listener alive")
}

#[tokio::test]
async fn a_committed_enqueue_notifies_and_a_rolled_back_one_does_not() {
    let db = TestDb::new().await;
    let (listen, mut rx) = listener(&db).await;
    // As an idle worker's LISTEN connection does (without it nobody is waiting, and
    // enqueueing transactions do not notify: tests/wakeups.rs).
    hold_idle_mark(&listen).await;
    let mut c = db.client().await;

    // Rolled back, from Rust and from SQL.
    let tx = c.transaction().await.unwrap();
    enqueue(
        &tx,
        &NewMessage::webhook("n1", hook("https://example.com/h")),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    c.batch_execute(
        "BEGIN; SELECT outbox.enqueue('n2', 'webhook', '{\"url\": \"https://example.com\"}'); ROLLBACK;",
    )
    .await
    .unwrap();

    // Absence is the one thing a deadline cannot prove. Rather than waiting a fixed time
    // for nothing to arrive, commit a marker notification on the same channel afterwards:
    // PostgreSQL delivers notifications in commit order, so if either rolled-back enqueue
    // had notified, its notification would arrive before the marker.
    c.batch_execute("NOTIFY outbox_messages, 'marker'")
        .await
        .unwrap();
    assert_eq!(
        next_notification(&mut rx).await,
        ("outbox_messages".to_owned(), "marker".to_owned()),
        "no notification for a rolled-back enqueue"
    );

    // Committed, from Rust.
    let tx = c.transaction().await.unwrap();
    enqueue(
        &tx,
        &NewMessage::webhook("n3", hook("https://example.com/h")),
    )
    .await
    .unwrap();
    // Nothing is sent before the commit: the marker committed now arrives first.
    {
        let c2 = db.client().await;
        c2.batch_execute("NOTIFY outbox_messages, 'before-commit'")
            .await
            .unwrap();
    }
    assert_eq!(next_notification(&mut rx).await.1, "before-commit");
    tx.commit().await.unwrap();
    let (channel, _) = next_notification(&mut rx).await;
    assert_eq!(channel, "outbox_messages");

    // Committed, from SQL and from a plain INSERT.
    sql_enqueue(&c, "n4", "webhook", r#"{"url": "https://example.com"}"#, 3)
        .await
        .unwrap();
    assert_eq!(next_notification(&mut rx).await.0, "outbox_messages");
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload) \
         VALUES ('n5', 'webhook', '{\"url\": \"https://example.com\"}')",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(next_notification(&mut rx).await.0, "outbox_messages");
}

// ---------------------------------------------------------------------------------------
// CHECK constraints
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn check_constraints_reject_impossible_states() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(
        &c,
        &NewMessage::webhook("c1", hook("https://example.com/h")),
    )
    .await
    .unwrap()
    .id;
    let before = snapshot(&c, "c1").await;
    let bad = [
        "UPDATE outbox.messages SET state = 'running'",
        "UPDATE outbox.messages SET state = 'running', lease_owner = 'w'",
        "UPDATE outbox.messages SET lease_owner = 'w', lease_token = gen_random_uuid(), \
         lease_expires_at = now() + interval '1 minute'",
        "UPDATE outbox.messages SET state = 'delivered'",
        "UPDATE outbox.messages SET delivered_at = now()",
        "UPDATE outbox.messages SET state = 'dead', dead_at = now()",
        "UPDATE outbox.messages SET state = 'dead', error_class = 'permanent'",
        "UPDATE outbox.messages SET state = 'bogus'",
        "UPDATE outbox.messages SET error_class = 'oops'",
        "UPDATE outbox.messages SET attempts = -1",
        "UPDATE outbox.messages SET max_attempts = 0",
        "UPDATE outbox.messages SET channel = 'sms'",
        "UPDATE outbox.messages SET payload = '[]'",
        "UPDATE outbox.messages SET request_hash = '\\x00'",
        "UPDATE outbox.messages SET message_key = ''",
    ];
    for sql in bad {
        let e = c.execute(sql, &[]).await.unwrap_err();
        assert_eq!(e.code(), Some(&SqlState::CHECK_VIOLATION), "{sql}: {e:?}");
    }
    assert_eq!(snapshot(&c, "c1").await, before);

    // The possible states are accepted.
    c.execute(
        "UPDATE outbox.messages SET state = 'running', lease_owner = 'w', \
         lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute' \
         WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    c.execute(
        "UPDATE outbox.messages SET state = 'delivered', delivered_at = now(), lease_owner = NULL, \
         lease_token = NULL, lease_expires_at = NULL WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
}

// ---------------------------------------------------------------------------------------
// Migrations
// ---------------------------------------------------------------------------------------

/// The ledger every migration run must leave: one row per file of `sql/`, with the SHA-256
/// of the file as it is on disk.
fn expected_ledger() -> Vec<(i32, String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sql");
    MIGRATIONS
        .iter()
        .map(|m| {
            let text = std::fs::read(dir.join(m.file_name())).unwrap();
            (
                m.version,
                m.name.to_owned(),
                hex::encode(Sha256::digest(text)),
            )
        })
        .collect()
}

fn all_files() -> Vec<String> {
    MIGRATIONS.iter().map(|m| m.file_name()).collect()
}

async fn ledger(c: &Client) -> Vec<(i32, String, String)> {
    c.query(
        "SELECT version, name, checksum FROM outbox.schema_migrations ORDER BY version",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

#[tokio::test]
async fn migrate_applies_once_and_records_the_checksum() {
    let db = TestDb::empty().await;
    let mut c = db.client().await;
    let exists: bool = c
        .query_one("SELECT to_regclass('outbox.messages') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!exists);

    let report = migrate(&mut c).await.unwrap();
    assert_eq!(report.applied, all_files());
    assert!(report.applied.contains(&"0001_baseline.sql".to_owned()));
    assert_eq!(report.already, 0);
    assert_eq!(ledger(&c).await, expected_ledger());
    // The schema works.
    enqueue(&c, &NewMessage::webhook("m", hook("https://example.com")))
        .await
        .unwrap();

    let report = migrate(&mut c).await.unwrap();
    assert!(report.applied.is_empty());
    assert_eq!(report.already, MIGRATIONS.len());
    assert_eq!(ledger(&c).await, expected_ledger());
    assert_eq!(count_messages(&c).await, 1, "re-running keeps the data");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_are_safe() {
    for _ in 0..3 {
        let db = TestDb::empty().await;
        let mut a = db.client().await;
        let mut b = db.client().await;
        let (ra, rb) = tokio::join!(
            tokio::spawn(async move { migrate(&mut a).await.map(|r| (r, a)) }),
            tokio::spawn(async move { migrate(&mut b).await.map(|r| (r, b)) }),
        );
        let (ra, a) = ra.unwrap().expect("first migrate");
        let (rb, _b) = rb.unwrap().expect("second migrate");
        // Each file is applied by exactly one of the two runs, and recorded once.
        let mut applied = [ra.applied.clone(), rb.applied.clone()].concat();
        applied.sort();
        assert_eq!(applied, all_files(), "{ra:?} {rb:?}");
        assert_eq!(ra.already + rb.already, MIGRATIONS.len());
        assert_eq!(ledger(&a).await, expected_ledger());
    }
}

#[tokio::test]
async fn a_changed_checksum_is_refused() {
    let db = TestDb::new().await;
    let mut c = db.client().await;
    c.batch_execute("UPDATE outbox.schema_migrations SET checksum = 'x' WHERE version = 1")
        .await
        .unwrap();
    match migrate(&mut c).await {
        Err(MigrateError::ChecksumMismatch {
            file,
            applied,
            current,
        }) => {
            assert_eq!(file, "0001_baseline.sql");
            assert_eq!(applied, "x");
            assert_eq!(current, expected_ledger()[0].2);
        }
        other => panic!("expected ChecksumMismatch, got {other:?}"),
    }
    // The failed run released its advisory lock: another session is refused the same way
    // (promptly, not after waiting for the lock) while the first session is still open.
    let mut other = db.client().await;
    let res = tokio::time::timeout(Duration::from_secs(5), migrate(&mut other))
        .await
        .expect("the migration lock was released");
    assert!(
        matches!(res, Err(MigrateError::ChecksumMismatch { .. })),
        "{res:?}"
    );
    assert_eq!(ledger(&c).await[0].2, "x", "the ledger is not rewritten");
    // Repaired by hand, the next run succeeds again.
    c.execute(
        "UPDATE outbox.schema_migrations SET checksum = $1 WHERE version = 1",
        &[&expected_ledger()[0].2],
    )
    .await
    .unwrap();
    migrate(&mut c).await.unwrap();
}
