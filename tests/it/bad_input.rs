//! Hostile enqueue calls and payloads, end to end.
//!
//! Every case ends one of two ways: refused at enqueue with a clear error
//! (`EnqueueError::Invalid` naming the field, SQLSTATE 22023 from SQL) and nothing written;
//! or, when it passes the enqueue rules, dead-lettered `invalid` by a real worker with no
//! request reaching the receiver and exactly one attempt row. Cases that are valid however
//! odd (any body, unicode keys, SQL metacharacters) are delivered byte-exact.
//!
//! Unless a test says otherwise the worker runs with private networks allowed (the
//! receivers listen on 127.0.0.1), so the payload rules are the only thing between a bad
//! payload and the receiver: a case that slipped through would show up there.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::receiver::{Receiver, Reply};
use common::*;
use outboxd::deliver::webhook::settings::{DestinationPolicy, WebhookConfig};
use outboxd::{EnqueueError, NewMessage};
use serde_json::{Value, json};
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(20);

/// (messages, attempts) rows in the database.
async fn counts(db: &TestDb) -> (i64, i64) {
    (
        db.scalar("SELECT count(*) FROM outbox.messages").await,
        db.scalar("SELECT count(*) FROM outbox.attempts").await,
    )
}

/// Waits until no message is pending or running.
async fn wait_all_final(db: &TestDb) {
    let c = db.client().await;
    wait_until(WAIT, "every message delivered or dead", || {
        let c = &c;
        async move {
            c.query_one(
                "SELECT count(*) FROM outbox.messages WHERE state IN ('pending', 'running')",
                &[],
            )
            .await
            .map(|r| r.get::<_, i64>(0) == 0)
            .unwrap_or(false)
        }
    })
    .await;
}

/// Webhook settings with the default destination policy (private networks refused).
fn default_policy() -> WebhookConfig {
    WebhookConfig {
        destinations: DestinationPolicy::default(),
        ..test_webhook_config()
    }
}

/// Enqueues through the Rust API, committed; panics if refused.
async fn enqueue_ok(c: &Client, key: &str, payload: Value) -> i64 {
    outboxd::enqueue(c, &NewMessage::webhook(key, payload))
        .await
        .unwrap_or_else(|e| panic!("{key:?} should be accepted at enqueue: {e}"))
        .id
}

/// Runs a worker over everything enqueued until all of it is final, then stops it.
async fn run_worker_until_final(db: &TestDb, webhook: WebhookConfig) {
    let w = RunningWorker::start(db, test_worker_config("w"), webhook);
    wait_all_final(db).await;
    w.stop().await;
}

/// Asserts the message is dead `invalid` after one attempt, with one `dead` attempt row,
/// a last_error containing `needle` and none of `secrets`.
async fn assert_dead_invalid(db: &TestDb, key: &str, needle: &str, secrets: &[&str]) {
    let r = row(db, key).await;
    assert_eq!(r.state, "dead", "{key:?}: {r:?}");
    assert_eq!(r.error_class.as_deref(), Some("invalid"), "{key:?}: {r:?}");
    assert_eq!(r.attempts, 1, "{key:?}");
    assert_eq!(r.response, None, "{key:?}: no provider answered");
    let err = r.last_error.clone().unwrap_or_default();
    assert!(
        err.contains(needle),
        "{key:?}: last_error {err:?} should contain {needle:?}"
    );
    for s in secrets {
        assert!(
            !err.contains(s),
            "{key:?}: last_error {err:?} repeats {s:?}"
        );
    }
    assert!(!err.contains('\n') && !err.contains('\r'), "{err:?}");
    assert_eq!(
        attempts(db, key).await,
        vec![(
            1,
            "dead".to_owned(),
            Some("invalid".to_owned()),
            None,
            false
        )],
        "{key:?}"
    );
}

/// Asserts an enqueue was refused as `Invalid` naming `field` (in the field and the
/// message).
fn assert_invalid<T: std::fmt::Debug>(what: &str, got: Result<T, EnqueueError>, field: &str) {
    match got {
        Err(EnqueueError::Invalid { field: f, message }) => {
            assert_eq!(f, field, "{what}: field (message {message:?})");
            assert!(
                message.contains(field),
                "{what}: message {message:?} should name {field:?}"
            );
        }
        other => panic!("{what}: expected Invalid naming {field}, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Refused at enqueue: nothing written
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn bad_enqueue_calls_are_refused_naming_the_field_and_write_nothing() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = "https://hooks.example/h";
    let cases: Vec<(&str, NewMessage, &str)> = vec![
        // The url must be a string: every other JSON type is refused.
        (
            "url number",
            NewMessage::webhook("k1", json!({"url": 5})),
            "payload.url",
        ),
        (
            "url float",
            NewMessage::webhook("k1", json!({"url": 1.5})),
            "payload.url",
        ),
        (
            "url bool",
            NewMessage::webhook("k1", json!({"url": true})),
            "payload.url",
        ),
        (
            "url null",
            NewMessage::webhook("k1", json!({"url": null})),
            "payload.url",
        ),
        (
            "url array",
            NewMessage::webhook("k1", json!({"url": [url]})),
            "payload.url",
        ),
        (
            "url object",
            NewMessage::webhook("k1", json!({"url": {"href": url}})),
            "payload.url",
        ),
        (
            "url missing",
            NewMessage::webhook("k1", json!({"body": {"url": url}})),
            "payload.url",
        ),
        (
            "url key in another case",
            NewMessage::webhook("k1", json!({"URL": url})),
            "payload.url",
        ),
        // The payload must be an object.
        (
            "payload array",
            NewMessage::webhook("k1", json!([{"url": url}])),
            "payload",
        ),
        (
            "payload string",
            NewMessage::webhook("k1", json!(url)),
            "payload",
        ),
        (
            "payload number",
            NewMessage::webhook("k1", json!(42)),
            "payload",
        ),
        (
            "payload null",
            NewMessage::webhook("k1", Value::Null),
            "payload",
        ),
        (
            "payload bool",
            NewMessage::webhook("k1", json!(false)),
            "payload",
        ),
        // Keys: 1..255 characters.
        (
            "empty key",
            NewMessage::webhook("", json!({"url": url})),
            "message_key",
        ),
        (
            "256-char key",
            NewMessage::webhook("k".repeat(256), json!({"url": url})),
            "message_key",
        ),
        (
            "256 multibyte chars",
            NewMessage::webhook("é".repeat(256), json!({"url": url})),
            "message_key",
        ),
        // The budget.
        (
            "max_attempts 0",
            NewMessage::webhook("k1", json!({"url": url})).max_attempts(0),
            "max_attempts",
        ),
        (
            "max_attempts negative",
            NewMessage::webhook("k1", json!({"url": url})).max_attempts(i32::MIN),
            "max_attempts",
        ),
        // E-mail shapes are checked too.
        (
            "email without to",
            NewMessage::email("k1", json!({"subject": "s", "text": "t"})),
            "payload.to",
        ),
        (
            "email to number",
            NewMessage::email("k1", json!({"to": 5, "text": "t"})),
            "payload.to",
        ),
        (
            "email to empty",
            NewMessage::email("k1", json!({"to": [], "text": "t"})),
            "payload.to",
        ),
        (
            "email to blank",
            NewMessage::email("k1", json!({"to": "  ", "text": "t"})),
            "payload.to",
        ),
    ];
    for (what, msg, field) in &cases {
        assert_invalid(what, outboxd::enqueue(&c, msg).await, field);
    }
    // A batch with one bad row in the middle: all or nothing.
    let batch = [
        NewMessage::webhook("b1", json!({"url": url})),
        NewMessage::webhook("b2", json!({"url": 7})),
        NewMessage::webhook("b3", json!({"url": url})),
    ];
    assert_invalid(
        "enqueue_many with a bad row",
        outboxd::enqueue_many(&c, &batch).await,
        "payload.url",
    );
    assert_eq!(counts(&db).await, (0, 0), "nothing half-written");
}

/// (key, channel, payload text, max_attempts, the field the error must name)
type SqlCase = (
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
    Option<i32>,
    &'static str,
);

#[tokio::test]
async fn bad_sql_enqueue_calls_raise_22023_naming_the_field() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let ok = r#"{"url": "https://hooks.example/h"}"#;
    let cases: Vec<SqlCase> = vec![
        (
            Some("k"),
            Some("webhook"),
            Some(r#"{"url": 5}"#),
            Some(3),
            "payload.url",
        ),
        (
            Some("k"),
            Some("webhook"),
            Some(r#"{"url": ["x"]}"#),
            Some(3),
            "payload.url",
        ),
        (
            Some("k"),
            Some("webhook"),
            Some(r#"{"url": {"a": 1}}"#),
            Some(3),
            "payload.url",
        ),
        (Some("k"), Some("webhook"), Some("[]"), Some(3), "payload"),
        (Some("k"), Some("webhook"), Some("null"), Some(3), "payload"),
        (
            Some("k"),
            Some("webhook"),
            Some(r#""text""#),
            Some(3),
            "payload",
        ),
        (Some("k"), Some("webhook"), None, Some(3), "payload"),
        (Some("k"), Some("sms"), Some(ok), Some(3), "channel"),
        (Some("k"), Some("WEBHOOK"), Some(ok), Some(3), "channel"),
        (
            Some("k"),
            Some("webhook'; --"),
            Some(ok),
            Some(3),
            "channel",
        ),
        (Some("k"), None, Some(ok), Some(3), "channel"),
        (Some(""), Some("webhook"), Some(ok), Some(3), "message_key"),
        (None, Some("webhook"), Some(ok), Some(3), "message_key"),
        (
            Some("k"),
            Some("webhook"),
            Some(ok),
            Some(0),
            "max_attempts",
        ),
        (Some("k"), Some("webhook"), Some(ok), None, "max_attempts"),
    ];
    for (key, channel, payload, max_attempts, field) in &cases {
        let what = format!("{key:?} {channel:?} {payload:?} {max_attempts:?}");
        let err = c
            .query_one(
                "SELECT outbox.enqueue($1, $2, $3::text::jsonb, now(), $4)",
                &[key, channel, payload, max_attempts],
            )
            .await
            .expect_err(&what);
        let db_err = err.as_db_error().unwrap_or_else(|| panic!("{what}: {err}"));
        assert_eq!(db_err.code().code(), "22023", "{what}: {db_err}");
        assert_eq!(db_err.column(), Some(*field), "{what}: {db_err}");
        assert!(
            db_err.message().contains(field),
            "{what}: {}",
            db_err.message()
        );
    }
    // A plain INSERT goes through the same rules.
    let err = c
        .execute(
            "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('k', 'webhook', '{\"url\": 1}')",
            &[],
        )
        .await
        .expect_err("plain insert with a numeric url");
    assert_eq!(err.as_db_error().unwrap().code().code(), "22023");
    assert_eq!(counts(&db).await, (0, 0), "nothing half-written");
}

// ---------------------------------------------------------------------------------------
// Payload size: 1 MiB of JSON text
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn payloads_up_to_1_mib_are_accepted_and_delivered_and_one_byte_more_is_refused() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let url = rx.url("/big");
    let payload = |n: usize| json!({"url": url, "body": "x".repeat(n)});
    // jsonb's text form of the payload without filler: its length is the overhead.
    let overhead: i32 = c
        .query_one("SELECT octet_length($1::jsonb::text)", &[&payload(0)])
        .await
        .unwrap()
        .get(0);
    let fill = 1_048_576 - usize::try_from(overhead).unwrap();
    let exact: i32 = c
        .query_one("SELECT octet_length($1::jsonb::text)", &[&payload(fill)])
        .await
        .unwrap()
        .get(0);
    assert_eq!(exact, 1_048_576, "the filler makes exactly 1 MiB");

    let over = outboxd::enqueue(&c, &NewMessage::webhook("big:over", payload(fill + 1))).await;
    assert_invalid("1 MiB + 1 byte", over, "payload");
    let huge = outboxd::enqueue(&c, &NewMessage::webhook("big:huge", payload(16 << 20))).await;
    match huge {
        Err(EnqueueError::Invalid { field, message }) => {
            assert_eq!(field, "payload");
            assert!(message.contains("1 MiB"), "{message}");
        }
        other => panic!("16 MiB: {other:?}"),
    }
    // From SQL too.
    let text = serde_json::to_string(&payload(fill + 1)).unwrap();
    let err = c
        .query_one(
            "SELECT outbox.enqueue('big:sql', 'webhook', $1::text::jsonb)",
            &[&text],
        )
        .await
        .expect_err("1 MiB + 1 from SQL");
    let db_err = err.as_db_error().unwrap();
    assert_eq!(
        (db_err.code().code(), db_err.column()),
        ("22023", Some("payload"))
    );
    assert_eq!(counts(&db).await, (0, 0), "nothing half-written");

    enqueue_ok(&c, "big:exact", payload(fill)).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let r = wait_for_state(&db, "big:exact", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(r.attempts, 1);
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(
        reqs[0].body.len(),
        fill + 2,
        "the whole body, quotes included"
    );
    assert_eq!(counts(&db).await, (1, 1));
}

// ---------------------------------------------------------------------------------------
// NUL bytes
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn nul_bytes_are_refused_by_postgresql_and_nothing_is_inserted() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = "https://hooks.example/h";
    // jsonb cannot hold U+0000: PostgreSQL refuses the `\u0000` escape (SQLSTATE 22P05)
    // before our rules run, wherever it is in the payload; the Rust API reports it as
    // invalid input naming the payload.
    for (what, payload) in [
        (
            "NUL in the body",
            json!({"url": url, "body": {"s": "a\u{0}b"}}),
        ),
        (
            "NUL in the url",
            json!({"url": "https://hooks.example/\u{0}"}),
        ),
        (
            "NUL in a header value",
            json!({"url": url, "headers": {"X-A": "\u{0}"}}),
        ),
        (
            "NUL in a header name",
            json!({"url": url, "headers": {"X-\u{0}": "v"}}),
        ),
        (
            "NUL in an object key",
            json!({"url": url, "body": {"\u{0}": 1}}),
        ),
    ] {
        let err = outboxd::enqueue(&c, &NewMessage::webhook("nul:payload", payload))
            .await
            .expect_err(what);
        assert!(
            matches!(&err, EnqueueError::Invalid { field, .. } if field == "payload"),
            "{what}: {err:?}"
        );
    }
    // A NUL in the key (a text parameter): PostgreSQL refuses the byte (22021).
    for key in ["nul:\u{0}", "\u{0}", "a\u{0}b"] {
        let err = outboxd::enqueue(&c, &NewMessage::webhook(key, json!({"url": url})))
            .await
            .expect_err("NUL in the key");
        assert!(
            matches!(&err, EnqueueError::Invalid { field, .. } if field == "message_key"),
            "{key:?}: {err:?}"
        );
    }
    // From SQL, the escape in JSON text is refused just the same.
    let err = c
        .query_one(
            r#"SELECT outbox.enqueue('nul:sql', 'webhook', '{"url": "https://x.example", "body": "\u0000"}')"#,
            &[],
        )
        .await
        .expect_err("NUL escape from SQL");
    assert_eq!(err.as_db_error().unwrap().code().code(), "22P05");
    assert_eq!(counts(&db).await, (0, 0), "nothing inserted");
}

/// What an application (or `outboxd enqueue`) prints for a refused NUL is the error's
/// Display: it names the problem, and never quotes the payload (the server's CONTEXT line,
/// "JSON data, line 1: {…", holds a slice of it). Until e132a14 it was the bare
/// "database error: db error" of tokio-postgres.
#[tokio::test]
async fn a_refused_nul_has_a_clear_display() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let err = outboxd::enqueue(
        &c,
        &NewMessage::webhook(
            "k",
            json!({"url": "https://x.example", "body": "SECRET \u{0}"}),
        ),
    )
    .await
    .expect_err("NUL");
    let text = err.to_string();
    assert!(
        text.contains("Unicode escape") || text.contains("NUL"),
        "the error says what is wrong: {text:?}"
    );
    assert!(!text.contains("SECRET"), "{text:?}");
    let err = outboxd::enqueue(
        &c,
        &NewMessage::webhook("a\u{0}b", json!({"url": "https://x.example"})),
    )
    .await
    .expect_err("NUL in the key");
    let text = err.to_string();
    assert!(
        text.contains("NUL"),
        "the error says what is wrong: {text:?}"
    );
}

/// The contract: bad input raises 22023 naming the field (`EnqueueError::Invalid`).
#[tokio::test]
async fn nul_bytes_are_invalid_naming_the_field() {
    let db = TestDb::new().await;
    let c = db.client().await;
    assert_invalid(
        "NUL in the body",
        outboxd::enqueue(
            &c,
            &NewMessage::webhook("k", json!({"url": "https://x.example", "body": "\u{0}"})),
        )
        .await,
        "payload",
    );
    assert_invalid(
        "NUL in the key",
        outboxd::enqueue(
            &c,
            &NewMessage::webhook("a\u{0}b", json!({"url": "https://x.example"})),
        )
        .await,
        "message_key",
    );
}

// ---------------------------------------------------------------------------------------
// Accepted at enqueue, dead `invalid` at the worker, nothing sent
// ---------------------------------------------------------------------------------------

/// A secret planted in header values: never in last_error.
const SECRET_VALUE: &str = "hv-s3cr3t-value";

#[tokio::test]
async fn wrong_json_types_and_bad_headers_are_dead_invalid_without_a_request() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let url = rx.url("/hook");
    let sv = SECRET_VALUE;
    let cases: Vec<(&str, Value, &str)> = vec![
        // method: a string among POST, PUT, PATCH.
        (
            "method:array",
            json!({"url": url, "method": ["POST"]}),
            "payload.method",
        ),
        (
            "method:number",
            json!({"url": url, "method": 1}),
            "payload.method",
        ),
        (
            "method:object",
            json!({"url": url, "method": {"m": "POST"}}),
            "payload.method",
        ),
        (
            "method:bool",
            json!({"url": url, "method": true}),
            "payload.method",
        ),
        (
            "method:GET",
            json!({"url": url, "method": "GET"}),
            "payload.method",
        ),
        (
            "method:DELETE",
            json!({"url": url, "method": "DELETE"}),
            "payload.method",
        ),
        (
            "method:empty",
            json!({"url": url, "method": ""}),
            "payload.method",
        ),
        (
            "method:padded",
            json!({"url": url, "method": " POST"}),
            "payload.method",
        ),
        (
            "method:crlf",
            json!({"url": url, "method": "POST\r\nX: y"}),
            "payload.method",
        ),
        // headers: an object of strings.
        (
            "headers:array",
            json!({"url": url, "headers": [["X-A", sv]]}),
            "payload.headers",
        ),
        (
            "headers:string",
            json!({"url": url, "headers": format!("X-A: {sv}")}),
            "payload.headers",
        ),
        (
            "headers:number",
            json!({"url": url, "headers": 1}),
            "payload.headers",
        ),
        (
            "headers:bool",
            json!({"url": url, "headers": false}),
            "payload.headers",
        ),
        (
            "value:object",
            json!({"url": url, "headers": {"X-A": {"v": sv}}}),
            "payload.headers.X-A",
        ),
        (
            "value:array",
            json!({"url": url, "headers": {"X-A": [sv]}}),
            "payload.headers.X-A",
        ),
        (
            "value:number",
            json!({"url": url, "headers": {"X-A": 1}}),
            "payload.headers.X-A",
        ),
        (
            "value:null",
            json!({"url": url, "headers": {"X-A": null}}),
            "payload.headers.X-A",
        ),
        (
            "value:bool",
            json!({"url": url, "headers": {"X-A": true}}),
            "payload.headers.X-A",
        ),
        // CR/LF: no header injection, in values or names.
        (
            "value:crlf",
            json!({"url": url, "headers": {"X-A": format!("a\r\nX-Injected: {sv}")}}),
            "control characters",
        ),
        (
            "value:lf",
            json!({"url": url, "headers": {"X-A": format!("{sv}\n")}}),
            "control characters",
        ),
        (
            "value:cr",
            json!({"url": url, "headers": {"X-A": format!("\r{sv}")}}),
            "control characters",
        ),
        (
            "value:esc",
            json!({"url": url, "headers": {"X-A": format!("\u{1b}[31m{sv}")}}),
            "control characters",
        ),
        (
            "value:del",
            json!({"url": url, "headers": {"X-A": format!("{sv}\u{7f}")}}),
            "control characters",
        ),
        (
            "name:crlf",
            json!({"url": url, "headers": {"X-A\r\nX-Injected": sv}}),
            "header name",
        ),
        (
            "name:space",
            json!({"url": url, "headers": {"X A": sv}}),
            "header name",
        ),
        (
            "name:colon",
            json!({"url": url, "headers": {"X-A:": sv}}),
            "header name",
        ),
        (
            "name:empty",
            json!({"url": url, "headers": {"": sv}}),
            "header name",
        ),
        (
            "name:unicode",
            json!({"url": url, "headers": {"X-Zoë": sv}}),
            "header name",
        ),
        // Headers the worker sets itself.
        (
            "reserved:idempotency-key",
            json!({"url": url, "headers": {"Idempotency-Key": sv}}),
            "set by the worker",
        ),
        (
            "reserved:webhook-signature",
            json!({"url": url, "headers": {"WEBHOOK-SIGNATURE": sv}}),
            "set by the worker",
        ),
        (
            "reserved:host",
            json!({"url": url, "headers": {"Host": "evil.example"}}),
            "set by the worker",
        ),
        (
            "reserved:content-length",
            json!({"url": url, "headers": {"Content-Length": "0"}}),
            "set by the worker",
        ),
    ];
    for (key, payload, _) in &cases {
        enqueue_ok(&c, key, payload.clone()).await;
    }
    // A key with CR/LF or another control character is refused at enqueue; one
    // stored before that rule (inserted here with the insert trigger off, as the table's
    // owner) still cannot be sent as a header.
    let crlf_keys = ["key:crlf\r\nX-Injected: 1", "key:lf\nX: 1", "key:esc\u{1b}"];
    for key in crlf_keys {
        assert_invalid(
            key,
            outboxd::enqueue(&c, &NewMessage::webhook(key, json!({"url": url}))).await,
            "message_key",
        );
    }
    c.batch_execute("ALTER TABLE outbox.messages DISABLE TRIGGER messages_before_insert")
        .await
        .unwrap();
    for key in crlf_keys {
        let payload = json!({"url": url, "body": {"k": 1}});
        c.execute(
            "INSERT INTO outbox.messages (message_key, channel, payload, request_hash, destination) \
             VALUES ($1, 'webhook', $2, outbox.request_hash('webhook', $2), \
                     outbox.destination_of('webhook', $2))",
            &[&key, &payload],
        )
        .await
        .unwrap();
    }
    c.batch_execute("ALTER TABLE outbox.messages ENABLE TRIGGER messages_before_insert")
        .await
        .unwrap();
    run_worker_until_final(&db, test_webhook_config()).await;

    for (key, _, needle) in &cases {
        assert_dead_invalid(&db, key, needle, &[SECRET_VALUE, "X-Injected: "]).await;
    }
    for key in crlf_keys {
        assert_dead_invalid(&db, key, "control characters", &["X-Injected"]).await;
    }
    assert_eq!(rx.requests().len(), 0, "no request reached the receiver");
    let n = i64::try_from(cases.len() + crlf_keys.len()).unwrap();
    assert_eq!(counts(&db).await, (n, n), "one row and one attempt each");
}

#[tokio::test]
async fn bad_urls_and_schemes_are_dead_invalid_without_a_request() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let p = rx.addr.port();
    let cases: Vec<(String, &str)> = vec![
        (format!("ftp://127.0.0.1:{p}/file"), "scheme"),
        ("file:///etc/passwd".into(), "scheme"),
        ("javascript:alert(1)".into(), "scheme"),
        (format!("gopher://127.0.0.1:{p}/_POST%20/hook"), "scheme"),
        (format!("ws://127.0.0.1:{p}/hook"), "scheme"),
        ("data:application/json,{}".into(), "scheme"),
        ("mailto:a@example.com".into(), "scheme"),
        ("http://".into(), "not a valid URL"),
        ("https://".into(), "not a valid URL"),
        ("http:".into(), "not a valid URL"),
        (format!("http://127.0.0.1:{p}:{p}/"), "not a valid URL"),
        ("http://exa mple.com/hook".into(), "not a valid URL"),
        ("http://[::1/".into(), "not a valid URL"),
        ("http://127.0.0.1:99999/".into(), "not a valid URL"),
        (format!("//127.0.0.1:{p}/hook"), "not a valid URL"),
        (format!("127.0.0.1:{p}/hook"), "not a valid URL"),
        ("/hook".into(), "not a valid URL"),
        ("not a url".into(), "not a valid URL"),
        ("".into(), "not a valid URL"),
        ("   ".into(), "not a valid URL"),
    ];
    for (i, (url, _)) in cases.iter().enumerate() {
        enqueue_ok(&c, &format!("url:{i}"), json!({"url": url})).await;
    }
    run_worker_until_final(&db, test_webhook_config()).await;
    for (i, (url, needle)) in cases.iter().enumerate() {
        let key = format!("url:{i}");
        let r = row(&db, &key).await;
        assert_eq!(r.error_class.as_deref(), Some("invalid"), "{url:?}: {r:?}");
        assert_dead_invalid(&db, &key, needle, &["/hook", "/etc/passwd", "alert"]).await;
    }
    assert_eq!(rx.requests().len(), 0, "no request reached the receiver");
    let n = i64::try_from(cases.len()).unwrap();
    assert_eq!(counts(&db).await, (n, n));
}

/// WHATWG URL parsing (the `url` crate) reads `http:///x` as `http://x/`: the extra slash
/// does not make the URL invalid, it makes the first path segment the host. With the
/// default policy `http:///127.0.0.1:PORT/` is therefore refused as a loopback destination.
#[tokio::test]
async fn a_triple_slash_url_names_a_host_and_is_checked_like_one() {
    let req = outboxd::deliver::webhook::payload::parse_payload(r#"{"url": "http:///path"}"#)
        .expect("http:///path parses");
    assert_eq!(req.url.host_str(), Some("path"));

    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let p = rx.addr.port();
    let key = "url:triple-slash";
    enqueue_ok(
        &c,
        key,
        json!({"url": format!("http:///127.0.0.1:{p}/hook")}),
    )
    .await;
    run_worker_until_final(&db, default_policy()).await;
    assert_dead_invalid(&db, key, "not allowed", &["/hook"]).await;
    assert_eq!(rx.requests().len(), 0);
}

#[tokio::test]
async fn ip_spellings_of_loopback_are_dead_invalid_under_the_default_policy() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let p = rx.addr.port();
    // Every one of these is 127.0.0.1, ::1 or 0.0.0.0 (local on Linux): a spelling that
    // got past the check would reach the receiver.
    let hosts = [
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[::FFFF:127.0.0.1]",
        "[0:0:0:0:0:ffff:127.0.0.1]",
        "[0000:0000:0000:0000:0000:ffff:7f00:0001]",
        "[::ffff:127.1.2.3]",
        "[::ffff:0.0.0.0]",
        "[::1]",
        "[0:0:0:0:0:0:0:1]",
        "2130706433",
        "0x7f000001",
        "0X7F000001",
        "0x7f.1",
        "0x7f.0x0.0x0.0x1",
        "0177.0.0.1",
        "0177.1",
        "017700000001",
        "127.000.000.001",
        "127.1",
        "127.0.1",
        "127.0.0.1.",
        "%31%32%37.0.0.1",
        "0",
        "0.0.0.0",
        "localhost",
        "LOCALHOST",
    ];
    for (i, h) in hosts.iter().enumerate() {
        enqueue_ok(
            &c,
            &format!("ip:{i}"),
            json!({"url": format!("http://{h}:{p}/hook?token=t0k3n")}),
        )
        .await;
    }
    run_worker_until_final(&db, default_policy()).await;
    for (i, h) in hosts.iter().enumerate() {
        let key = format!("ip:{i}");
        let r = row(&db, &key).await;
        assert_eq!(r.error_class.as_deref(), Some("invalid"), "{h}: {r:?}");
        assert_dead_invalid(&db, &key, "not allowed", &["/hook", "t0k3n"]).await;
    }
    assert_eq!(rx.requests().len(), 0, "no spelling reached the receiver");
}

// ---------------------------------------------------------------------------------------
// Redirects are never followed
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_redirect_to_a_private_address_is_not_followed() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // The Location points at a second receiver on 127.0.0.1 (private networks are allowed
    // for this worker: the point is that no redirect is ever followed).
    let target = Receiver::start().await;
    let codes = [301u16, 302, 303, 307, 308];
    let mut sources = Vec::new();
    for code in codes {
        let rx = Receiver::start().await;
        rx.set_default(Reply::WithHeaders(
            code,
            vec![("location", target.url("/admin?steal=1"))],
        ));
        enqueue_ok(
            &c,
            &format!("redirect:{code}"),
            json!({"url": rx.url("/hook"), "body": {"code": code}}),
        )
        .await;
        sources.push(rx);
    }
    run_worker_until_final(&db, test_webhook_config()).await;
    for (code, rx) in codes.iter().zip(&sources) {
        let key = format!("redirect:{code}");
        let r = row(&db, &key).await;
        assert_eq!(r.state, "dead", "{code}");
        assert_eq!(r.error_class.as_deref(), Some("permanent"), "{code}");
        assert_eq!(r.attempts, 1, "{code}");
        assert_eq!(r.response.as_ref().unwrap()["status"], json!(code));
        let err = r.last_error.unwrap_or_default();
        assert!(!err.contains("admin") && !err.contains("steal"), "{err}");
        assert_eq!(
            attempts(&db, &key).await,
            vec![(
                1,
                "dead".to_owned(),
                Some("permanent".to_owned()),
                Some(i32::from(*code)),
                false
            )]
        );
        assert_eq!(rx.requests().len(), 1, "{code}: one request to the source");
    }
    assert_eq!(
        target.requests().len(),
        0,
        "the Location was never requested"
    );
}

// ---------------------------------------------------------------------------------------
// Odd but valid: delivered exactly
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn any_json_body_is_delivered_byte_exact() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let url = rx.url("/body");
    // Literal JSON text through SQL, so the stored form is PostgreSQL's own.
    let bodies = [
        "1",
        "-0.000",
        "1.50",
        "123456789012345678901234567890.000001",
        r#""a string""#,
        r#""""#,
        "true",
        "null",
        "[]",
        "{}",
        r#"[1, "two", null, {"three": [3]}]"#,
        r#"{"nested": {"deeper": {"deepest": [[[[]]]]}}}"#,
        r#""\u2028\u2029 \" \\ \/ \b\f\n\r\t é ✓ 🎉""#,
        r#""</script><script>alert(1)</script>""#,
        r#"{"url": "http://10.0.0.1/", "headers": {"Host": "x"}, "method": "GET"}"#,
    ];
    for (i, b) in bodies.iter().enumerate() {
        let payload = format!(r#"{{"url": "{url}", "body": {b}}}"#);
        c.query_one(
            "SELECT outbox.enqueue($1, 'webhook', $2::text::jsonb)",
            &[&format!("body:{i}"), &payload],
        )
        .await
        .unwrap_or_else(|e| panic!("{b}: {e}"));
    }
    // method null, headers null and no body at all are the defaults.
    enqueue_ok(
        &c,
        "body:defaults",
        json!({"url": url, "method": null, "headers": null}),
    )
    .await;
    run_worker_until_final(&db, test_webhook_config()).await;

    for (i, b) in bodies.iter().enumerate() {
        let key = format!("body:{i}");
        let r = row(&db, &key).await;
        assert_eq!((r.state.as_str(), r.attempts), ("delivered", 1), "{}", b);
        let stored: String = c
            .query_one(
                "SELECT (payload -> 'body')::text FROM outbox.messages WHERE message_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        let reqs = rx.requests_for(&key);
        assert_eq!(reqs.len(), 1, "{}", b);
        assert_eq!(std::str::from_utf8(&reqs[0].body).unwrap(), stored, "{}", b);
        assert_eq!(
            reqs[0].header("content-type").as_deref(),
            Some("application/json")
        );
    }
    let reqs = rx.requests_for("body:defaults");
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].method, "POST");
    assert_eq!(&reqs[0].body[..], b"null");
}

/// A body nested far deeper than serde_json's default recursion limit (128) is still just
/// a body: the worker sends it untouched (it never parses the body, only skips over it).
#[tokio::test]
async fn a_deeply_nested_body_is_delivered() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let depth = 5000;
    let body = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let payload = format!(r#"{{"url": "{}", "body": {body}}}"#, rx.url("/deep"));
    c.query_one(
        "SELECT outbox.enqueue('deep', 'webhook', $1::text::jsonb)",
        &[&payload],
    )
    .await
    .unwrap();
    run_worker_until_final(&db, test_webhook_config()).await;
    let r = row(&db, "deep").await;
    assert_eq!((r.state.as_str(), r.attempts), ("delivered", 1), "{r:?}");
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].body.len(), 2 * depth);
    assert!(reqs[0].body.starts_with(b"[[") && reqs[0].body.ends_with(b"]]"));
}

#[tokio::test]
async fn unicode_keys_are_accepted_and_sent_byte_exact() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let keys = vec![
        "order-ü:支付:通知".to_owned(),
        "ключ:🎉:😀".to_owned(),
        "مفتاح:١٢٣".to_owned(),
        "e\u{301}:combining".to_owned(),
        "\u{200b}zero-width\u{feff}".to_owned(),
        // (A tab inside a key, a C0 control, is refused: tests/it/hostile_sql.rs.)
        "inner  spaces".to_owned(),
        "🎉".repeat(255), // 255 characters, 1020 bytes
        "é".repeat(255),
    ];
    for k in &keys {
        enqueue_ok(&c, k, json!({"url": rx.url("/u"), "body": {"k": k}})).await;
    }
    run_worker_until_final(&db, test_webhook_config()).await;
    let reqs = rx.requests();
    assert_eq!(reqs.len(), keys.len(), "one request per key");
    for k in &keys {
        let r = row(&db, k).await;
        assert_eq!(
            (r.state.as_str(), r.attempts),
            ("delivered", 1),
            "{k:?}: {r:?}"
        );
        let stored: String = c
            .query_one(
                "SELECT message_key FROM outbox.messages WHERE id = $1",
                &[&r.id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(&stored, k);
        let sent: Vec<_> = reqs
            .iter()
            .filter(|q| {
                q.headers.get("idempotency-key").map(|v| v.as_bytes()) == Some(k.as_bytes())
            })
            .collect();
        assert_eq!(sent.len(), 1, "{k:?} sent byte-exact as Idempotency-Key");
        assert_eq!(
            sent[0].headers.get("webhook-id").map(|v| v.as_bytes()),
            Some(k.as_bytes()),
            "{k:?}: webhook-id"
        );
        let body: Value = serde_json::from_slice(&sent[0].body).unwrap();
        assert_eq!(body["k"], json!(k));
    }
}

#[tokio::test]
async fn sql_metacharacters_are_stored_and_echoed_verbatim() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let nasty = [
        "'; DROP TABLE outbox.messages; --",
        "$$; DROP TABLE outbox.attempts; $$",
        "$1 $2 $body$ $$",
        "back\\slash \\\\ \\' \\x00 \\u0000",
        "quote' \"double\" `tick`",
        "E'\\n' %_* /* comment */ -- end",
        "Robert'); DELETE FROM outbox.messages WHERE ('1' = '1",
    ];
    // Each string enqueued three ways: the Rust API, outbox.enqueue with parameters, and
    // a plain INSERT; as the key, a header value and a body.
    let mut expected = Vec::new();
    for (i, s) in nasty.iter().enumerate() {
        let payload = |via: &str| {
            json!({
                "url": format!("{}?q={}", rx.url("/meta"), i),
                "headers": {"X-Meta": s},
                "body": {"s": s, "via": via, "arr": [s, {"k": s}]},
            })
        };
        let k_api = format!("{s}#api");
        let k_sql = format!("{s}#sql");
        let k_ins = format!("{s}#insert");
        enqueue_ok(&c, &k_api, payload("api")).await;
        c.query_one(
            "SELECT outbox.enqueue($1, 'webhook', $2)",
            &[&k_sql, &payload("sql")],
        )
        .await
        .unwrap();
        c.execute(
            "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ($1, 'webhook', $2)",
            &[&k_ins, &payload("insert")],
        )
        .await
        .unwrap();
        // The same key with another payload: OB409, the key given back verbatim.
        match outboxd::enqueue(&c, &NewMessage::webhook(&k_api, payload("other"))).await {
            Err(EnqueueError::KeyConflict { key, message }) => {
                assert_eq!(key, k_api, "the conflicting key, verbatim");
                assert!(!message.is_empty());
            }
            other => panic!("{k_api:?}: expected KeyConflict, got {other:?}"),
        }
        expected.push((k_api, s, payload("api")));
        expected.push((k_sql, s, payload("sql")));
        expected.push((k_ins, s, payload("insert")));
    }
    run_worker_until_final(&db, test_webhook_config()).await;

    let tables: i64 = db
        .scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'outbox' AND tablename IN ('messages', 'attempts')")
        .await;
    assert_eq!(tables, 2, "both tables still exist");
    let n = i64::try_from(expected.len()).unwrap();
    assert_eq!(
        counts(&db).await,
        (n, n),
        "every row is still there, one attempt each"
    );
    for (key, s, payload) in &expected {
        let stored = c
            .query_one(
                "SELECT payload, state FROM outbox.messages WHERE message_key = $1",
                &[key],
            )
            .await
            .unwrap_or_else(|e| panic!("{key:?} stored verbatim: {e}"));
        assert_eq!(&stored.get::<_, Value>(0), payload, "{key:?}");
        assert_eq!(stored.get::<_, String>(1), "delivered", "{key:?}");
        let reqs = rx.requests_for(key);
        assert_eq!(reqs.len(), 1, "{key:?}");
        assert_eq!(reqs[0].header("x-meta").as_deref(), Some(**s), "{key:?}");
        let body: Value = serde_json::from_slice(&reqs[0].body).unwrap();
        assert_eq!(body, payload["body"], "{key:?}");
    }
}

/// HTTP strips leading and trailing whitespace (SP, HTAB) from a field value, so a key
/// " k" reaches the receiver as "k": two distinct messages, " k" and "k", look like one
/// to a receiver that deduplicates on the key, and the second is dropped as a replay.
#[tokio::test]
async fn keys_with_edge_whitespace_are_never_sent_altered() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    let keys = [" lead", "trail ", "\ttab", "tab\t"];
    let mut accepted = Vec::new();
    for k in keys {
        match outboxd::enqueue(&c, &NewMessage::webhook(k, json!({"url": rx.url("/ws")}))).await {
            Ok(_) => accepted.push(k),
            Err(e) => assert_invalid(k, Err::<(), _>(e), "message_key"),
        }
    }
    run_worker_until_final(&db, test_webhook_config()).await;
    for k in accepted {
        let r = row(&db, k).await;
        assert_eq!(
            (r.state.as_str(), r.error_class.as_deref()),
            ("dead", Some("invalid")),
            "{k:?} was sent as {:?}",
            rx.requests()
                .iter()
                .map(|q| q.header("idempotency-key"))
                .collect::<Vec<_>>()
        );
    }
    assert_eq!(rx.requests().len(), 0);
}
