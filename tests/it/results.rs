//! Stored results end to end (contract part 2, "Results"): `"store_response": true` keeps
//! the delivering response's body in `response.body`, bounded in size and in time.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::receiver::{Receiver, Reply};
use common::*;
use outboxd::deliver::webhook::settings::WebhookConfig;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);
const KIB64: usize = 64 * 1024;

/// Delivers one message whose receiver answers `reply`, and returns its `response`.
async fn stored(key: &str, store: Option<bool>, reply: Reply) -> (Value, TestDb, Receiver) {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([reply]);
    let mut payload = json!({"url": rx.url("/hook"), "body": {"n": 1}});
    if let Some(store) = store {
        payload["store_response"] = json!(store);
    }
    let c = db.client().await;
    outboxd::enqueue(&c, &outboxd::NewMessage::webhook(key, payload))
        .await
        .unwrap();
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    (row.response.unwrap(), db, rx)
}

#[tokio::test]
async fn a_json_body_is_stored_as_its_value() {
    let body = br#"{"id": "ch_1", "amount": 1250, "captured": true, "big": 18446744073709551615}"#;
    let (r, _db, _rx) = stored(
        "res:json",
        Some(true),
        Reply::Body(201, Some("application/json"), body.to_vec()),
    )
    .await;
    assert_eq!(
        r["body"],
        json!({"id": "ch_1", "amount": 1250, "captured": true, "big": 18446744073709551615u64})
    );
    assert_eq!(r["body_truncated"], json!(false));
    assert_eq!(r["content_type"], json!("application/json"));
    assert_eq!(r["status"], json!(201));
}

#[tokio::test]
async fn a_text_body_is_stored_as_a_string() {
    let (r, _db, _rx) = stored(
        "res:text",
        Some(true),
        Reply::Body(
            200,
            Some("text/plain; charset=utf-8"),
            b"accepted: ch_1 \xe2\x82\xac".to_vec(),
        ),
    )
    .await;
    assert_eq!(r["body"], json!("accepted: ch_1 €"));
    assert_eq!(r["body_truncated"], json!(false));
    assert_eq!(r["content_type"], json!("text/plain; charset=utf-8"));
}

#[tokio::test]
async fn a_body_of_exactly_64_kib_is_kept_whole() {
    let body = format!("\"{}\"", "j".repeat(KIB64 - 2));
    assert_eq!(body.len(), KIB64);
    let (r, _db, _rx) = stored(
        "res:64k",
        Some(true),
        Reply::Body(200, Some("application/json"), body.into_bytes()),
    )
    .await;
    assert_eq!(
        r["body"].as_str().map(str::len),
        Some(KIB64 - 2),
        "the JSON string value"
    );
    assert_eq!(r["body_truncated"], json!(false));
}

#[tokio::test]
async fn a_body_of_64_kib_and_one_byte_is_truncated_on_a_character_boundary() {
    // 64 KiB - 1 bytes of ASCII, then a 3-byte character that straddles the limit.
    let mut body = vec![b'a'; KIB64 - 1];
    body.extend_from_slice("€".as_bytes());
    assert!(body.len() > KIB64);
    let (r, _db, _rx) = stored(
        "res:64k+1",
        Some(true),
        Reply::Body(200, Some("text/plain"), body),
    )
    .await;
    assert_eq!(r["body_truncated"], json!(true));
    let kept = r["body"].as_str().unwrap();
    assert_eq!(kept.len(), KIB64 - 1, "the cut character is dropped whole");
    assert!(kept.bytes().all(|b| b == b'a'));

    // One byte past the limit exactly: the first 64 KiB, as a string (a JSON prefix is not
    // JSON).
    let body = format!("[\"{}\"]", "k".repeat(KIB64 - 3));
    assert_eq!(body.len(), KIB64 + 1);
    let (r, _db, _rx) = stored(
        "res:64k+1:json",
        Some(true),
        Reply::Body(200, Some("application/json"), body.clone().into_bytes()),
    )
    .await;
    assert_eq!(r["body_truncated"], json!(true));
    assert_eq!(r["body"], json!(body[..KIB64]));
}

#[tokio::test]
async fn an_endless_body_is_cut_at_the_timeout_and_the_message_is_delivered() {
    let started = Instant::now();
    let (r, db, rx) = stored("res:endless", Some(true), Reply::Endless).await;
    let took = started.elapsed();
    // The status line was 2xx: delivered, with what arrived before the timeout (2 s).
    assert_eq!(r["status"], json!(200));
    assert_eq!(r["body_truncated"], json!(true));
    let kept = r["body"].as_str().unwrap();
    assert!(kept.starts_with("still going"), "{kept:.40}");
    assert!(kept.len() <= KIB64);
    // The clock includes the database's creation and the worker's start: the slack is for
    // a loaded machine. An uncut body (16 bytes every 20 ms) would take over a minute to fill
    // the 64 KiB kept.
    assert!(
        took < test_webhook_config().timeout + Duration::from_secs(8),
        "bounded by the timeout: {took:?}"
    );
    assert_eq!(rx.requests().len(), 1, "not sent again");
    assert_eq!(
        attempts(&db, "res:endless").await,
        vec![(1, "delivered".to_owned(), None, Some(200), false)]
    );
}

#[tokio::test]
async fn a_gigabyte_body_costs_at_most_64_kib_and_is_not_read_to_its_end() {
    let started = Instant::now();
    let (r, _db, rx) = stored("res:flood", Some(true), Reply::Flood(1 << 30)).await;
    assert_eq!(r["body_truncated"], json!(true));
    assert_eq!(r["body"].as_str().map(str::len), Some(KIB64));
    // The worker stopped reading past 64 KiB: the server produced only what the socket
    // buffers took, not the gigabyte.
    let produced = rx.streamed();
    assert!(
        produced < 64 << 20,
        "the receiver produced {produced} bytes"
    );
    assert!(started.elapsed() < WAIT);
}

#[tokio::test]
async fn without_store_response_no_body_is_kept() {
    for (key, store) in [("res:none", None), ("res:false", Some(false))] {
        let (r, _db, _rx) = stored(
            key,
            store,
            Reply::Body(200, Some("application/json"), br#"{"id": "ch_1"}"#.to_vec()),
        )
        .await;
        assert_eq!(r, json!({"status": 200, "replayed": false}), "{key}");
    }
}

#[tokio::test]
async fn no_content_type_is_null() {
    let (r, _db, _rx) = stored(
        "res:no-ct",
        Some(true),
        Reply::Body(200, None, b"ok".to_vec()),
    )
    .await;
    assert_eq!(r["body"], json!("ok"));
    assert_eq!(r["content_type"], Value::Null);
}

#[tokio::test]
async fn hostile_bodies_are_stored_without_breaking_the_completion() {
    // U+0000 cannot be stored in jsonb: a body holding it must not make the completion
    // statement fail (it would fail again on every retry of the write).
    let cases: [(&str, &[u8], Value); 4] = [
        (
            "res:nul-json",
            br#"{"a": "x\u0000y"}"#,
            json!(r#"{"a": "x\u0000y"}"#),
        ),
        ("res:nul-text", b"a\0b", json!("a\u{FFFD}b")),
        ("res:not-utf8", b"ok \xff end", json!("ok \u{FFFD} end")),
        (
            "res:deep",
            &[b'['; 200],
            json!(String::from_utf8(vec![b'['; 200]).unwrap()),
        ),
    ];
    for (key, body, want) in cases {
        let (r, _db, _rx) = stored(
            key,
            Some(true),
            Reply::Body(200, Some("application/json"), body.to_vec()),
        )
        .await;
        assert_eq!(r["body"], want, "{key}");
        assert_eq!(r["body_truncated"], json!(false), "{key}");
    }
    // A content type with bytes that are not UTF-8 or ASCII controls is kept as text.
    let (r, _db, _rx) = stored(
        "res:ct",
        Some(true),
        Reply::WithHeaders(200, vec![("content-type", "text/plain;\tx=1".to_owned())]),
    )
    .await;
    assert_eq!(r["content_type"], json!("text/plain;x=1"));
}

#[tokio::test]
async fn a_reconciled_delivery_keeps_the_lookups_body() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([
        Reply::Stall(Duration::from_secs(3)),
        Reply::Body(
            200,
            Some("application/json"),
            br#"{"id": "ch_9", "status": "succeeded"}"#.to_vec(),
        ),
    ]);
    let key = "res:reconciled";
    let c = db.client().await;
    let payload = json!({
        "url": rx.url("/hook"),
        "store_response": true,
        "reconcile": {"url": rx.url("/lookup")},
    });
    outboxd::enqueue(&c, &outboxd::NewMessage::webhook(key, payload))
        .await
        .unwrap();
    let cfg = WebhookConfig {
        timeout: Duration::from_millis(500),
        ..test_webhook_config()
    };
    let w = RunningWorker::start(&db, test_worker_config("w"), cfg);
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    let r = row.response.unwrap();
    assert_eq!(r["reconciled"], json!(true));
    assert_eq!(r["body"], json!({"id": "ch_9", "status": "succeeded"}));
}

#[tokio::test]
async fn the_body_is_never_logged() {
    let (logs, _guard) = LogCapture::install();
    let (r, _db, _rx) = stored(
        "res:logs",
        Some(true),
        Reply::Body(
            200,
            Some("application/json"),
            br#"{"token": "BODYSECRET42"}"#.to_vec(),
        ),
    )
    .await;
    assert_eq!(r["body"]["token"], json!("BODYSECRET42"));
    let text = logs.text();
    assert!(text.contains("attempt finished"), "the attempt was logged");
    assert!(!text.contains("BODYSECRET42"), "{text}");
}

/// A JSON body nested deeper than a reader of `response` can take back (serde_json, which
/// tokio-postgres reads `jsonb` with, stops at 128 levels, and the body sits one level down
/// in `response`) is kept as its text: `lookup`, `show` and the console can then read the
/// row. Kept as a value, it made `show` panic and every `lookup` of the key fail, so the
/// caller could never learn that the effect had happened.
#[tokio::test]
async fn a_json_body_nested_too_deep_to_read_back_is_stored_as_its_text() {
    let body = format!("{}{}", "[".repeat(127), "]".repeat(127));
    let (r, db, _rx) = stored(
        "res:deep",
        Some(true),
        Reply::Body(200, Some("application/json"), body.clone().into_bytes()),
    )
    .await;
    assert_eq!(r["body"], json!(body));
    assert_eq!(r["body_truncated"], json!(false));

    let c = db.client().await;
    let status = outboxd::lookup(&c, "res:deep").await.unwrap().unwrap();
    assert_eq!(status.response.unwrap()["body"], json!(body));
    let out = {
        let url = db.url();
        tokio::task::spawn_blocking(move || {
            common::binary::run(common::binary::outboxd(Some(&url)).args(["show", "res:deep"]))
        })
        .await
        .unwrap()
    };
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

/// A body is kept as the provider sent it: a number serde_json would round (a tracking
/// number beyond 64 bits) keeps the body as its text, not a rounded value; and a whole
/// body whose text had to be cut (bytes that are not UTF-8 grow threefold as U+FFFD) says
/// so. Both were stored silently changed before.
#[tokio::test]
async fn a_body_is_never_stored_changed_without_saying_so() {
    let (r, _db, _rx) = stored(
        "res:tracking",
        Some(true),
        Reply::Body(200, Some("text/plain"), b"9400111899223856925311".to_vec()),
    )
    .await;
    assert_eq!(r["body"], json!("9400111899223856925311"));
    assert_eq!(r["body_truncated"], json!(false));
    let (r, _db, _rx) = stored(
        "res:latin1",
        Some(true),
        Reply::Body(200, Some("text/plain"), vec![0xe9; 40_000]),
    )
    .await;
    assert_eq!(r["body_truncated"], json!(true));
    assert!(r["body"].as_str().unwrap().len() <= 64 * 1024);
}
