//! Webhook delivery end to end: a real worker, a real PostgreSQL database and a real HTTP
//! receiver on loopback. Each test checks one rule of the contract (Payloads, Delivery
//! semantics, Logs).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::receiver::{Receiver, Recorded, Reply};
use common::*;
use outboxd::config::WorkerConfig;
use outboxd::deliver::webhook::settings::{DestinationPolicy, WebhookConfig, parse_webhook_secret};
use outboxd::retry::RetryPolicy;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

/// Enqueues a webhook with an arbitrary payload, committed.
async fn enqueue_payload(
    db: &TestDb,
    key: &str,
    payload: Value,
    max_attempts: i32,
    retry_ambiguous: bool,
) -> i64 {
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(key, payload)
        .max_attempts(max_attempts)
        .retry_ambiguous(retry_ambiguous);
    outboxd::enqueue(&c, &msg).await.expect("enqueue").id
}

/// Worker settings with a retry schedule of our own.
fn worker_with_retry(base: Duration, max: Duration) -> WorkerConfig {
    WorkerConfig {
        retry: RetryPolicy { base, max },
        ..test_worker_config("w")
    }
}

/// Webhook settings with a short whole-request timeout (the lease of the test worker
/// config, 10 s, stays far above timeout + 1 s).
fn short_timeout() -> WebhookConfig {
    WebhookConfig {
        timeout: Duration::from_millis(500),
        ..test_webhook_config()
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The body exactly as PostgreSQL renders the stored payload's `body`.
async fn stored_body(db: &TestDb, key: &str) -> String {
    db.client()
        .await
        .query_one(
            "SELECT (payload -> 'body')::text FROM outbox.messages WHERE message_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

type AttemptRow = (i32, String, Option<String>, Option<i32>, bool);

fn att(
    attempt: i32,
    outcome: &str,
    class: Option<&str>,
    status: Option<i32>,
    dedup: bool,
) -> AttemptRow {
    (
        attempt,
        outcome.to_owned(),
        class.map(str::to_owned),
        status,
        dedup,
    )
}

// ---------------------------------------------------------------------------------------
// Success and the request's shape
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn success_is_delivered_once_with_identity_headers_and_exact_body() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(200)]);
    let key = "order-7:paid:notify";
    // Through SQL with a literal, so the body keeps forms a JSON round trip in Rust would
    // lose (1.50, a number beyond f64, non-ASCII).
    let payload = format!(
        r#"{{"url": "{}", "headers": {{"X-Tenant": "acme", "X-Trace": "t-1"}},
            "body": {{"amount": 1.50, "big": 123456789012345678901234567890, "name": "Zoë", "items": [1, 2]}}}}"#,
        rx.url("/hook?x=1")
    );
    db.client()
        .await
        .query_one(
            "SELECT outbox.enqueue($1, 'webhook', $2::text::jsonb)",
            &[&key, &payload],
        )
        .await
        .unwrap();
    let before = unix_now();
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    let after = unix_now();
    w.stop().await;

    assert_eq!(row.attempts, 1);
    assert_eq!(row.error_class, None);
    assert_eq!(
        attempts(&db, key).await,
        vec![att(1, "delivered", None, Some(200), false)]
    );
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1, "exactly one request");
    let r = &reqs[0];
    assert_eq!(r.method, "POST");
    assert_eq!(r.uri.path(), "/hook");
    assert_eq!(r.uri.query(), Some("x=1"));
    assert_eq!(r.header("idempotency-key").as_deref(), Some(key));
    assert_eq!(r.header("webhook-id").as_deref(), Some(key));
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    let ts: u64 = r
        .header("webhook-timestamp")
        .expect("webhook-timestamp")
        .parse()
        .expect("unix seconds");
    assert!(
        ts + 1 >= before && ts <= after + 1,
        "timestamp {ts} not within [{before}, {after}]"
    );
    assert_eq!(r.header("x-tenant").as_deref(), Some("acme"));
    assert_eq!(r.header("x-trace").as_deref(), Some("t-1"));
    // Byte for byte what PostgreSQL stored, and the same JSON value.
    let stored = stored_body(&db, key).await;
    assert_eq!(std::str::from_utf8(&r.body).unwrap(), stored);
    assert!(stored.contains("1.50") && stored.contains("123456789012345678901234567890"));
    let got: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(got["name"], "Zoë");
    assert_eq!(got["items"], json!([1, 2]));
}

async fn method_is_honoured(method: &str, expected: &str) {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let key = format!("method:{method}");
    enqueue_payload(
        &db,
        &key,
        json!({"url": rx.url("/m"), "method": method, "body": {"m": method}}),
        3,
        true,
    )
    .await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, &key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(row.attempts, 1);
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].method, expected);
    let body: Value = serde_json::from_slice(&reqs[0].body).unwrap();
    assert_eq!(body, json!({"m": method}));
}

#[tokio::test]
async fn method_put_is_honoured() {
    method_is_honoured("PUT", "PUT").await;
}

#[tokio::test]
async fn method_patch_is_honoured() {
    method_is_honoured("PATCH", "PATCH").await;
}

// ---------------------------------------------------------------------------------------
// Retries and status classes
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_503_then_200_is_delivered_on_attempt_two_with_the_same_identity_and_bytes() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(503), Reply::Status(200)]);
    let key = "retry:503";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(row.attempts, 2);
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("transient"), Some(503), false),
            att(2, "delivered", None, Some(200), false),
        ]
    );
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 2);
    for r in &reqs {
        assert_eq!(r.header("idempotency-key").as_deref(), Some(key));
        assert_eq!(r.header("webhook-id").as_deref(), Some(key));
    }
    assert_eq!(
        reqs[0].body, reqs[1].body,
        "byte-identical body on every attempt"
    );
    assert_eq!(
        std::str::from_utf8(&reqs[0].body).unwrap(),
        stored_body(&db, key).await
    );
}

#[tokio::test]
async fn always_503_is_dead_exhausted_after_exactly_max_attempts() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Status(503));
    let key = "retry:exhausted";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("exhausted"));
    assert_eq!(row.attempts, 3);
    assert_eq!(rx.requests().len(), 3, "exactly max_attempts requests");
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("transient"), Some(503), false),
            att(2, "retry", Some("transient"), Some(503), false),
            att(3, "dead", Some("exhausted"), Some(503), false),
        ]
    );
}

/// A status that is dead at once: class permanent, exactly one request.
async fn permanent_status(status: u16) {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Status(status));
    let key = format!("status:{status}");
    enqueue_webhook(&db, &key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, &key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("permanent"));
    assert_eq!(row.attempts, 1);
    assert_eq!(rx.requests().len(), 1, "exactly one request");
    assert_eq!(
        attempts(&db, &key).await,
        vec![att(
            1,
            "dead",
            Some("permanent"),
            Some(i32::from(status)),
            false
        )]
    );
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or("")
            .contains(&status.to_string()),
        "{:?}",
        row.last_error
    );
}

#[tokio::test]
async fn a_400_is_dead_permanent_after_one_request() {
    permanent_status(400).await;
}

#[tokio::test]
async fn a_404_is_dead_permanent_after_one_request() {
    permanent_status(404).await;
}

/// A status that is retried: attempt 1 is a transient retry, attempt 2 delivers.
async fn transient_status(status: u16) {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(status)]);
    let key = format!("status:{status}");
    enqueue_webhook(&db, &key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, &key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(row.attempts, 2);
    assert_eq!(rx.requests().len(), 2);
    assert_eq!(
        attempts(&db, &key).await,
        vec![
            att(
                1,
                "retry",
                Some("transient"),
                Some(i32::from(status)),
                false
            ),
            att(2, "delivered", None, Some(204), false),
        ]
    );
}

#[tokio::test]
async fn a_429_is_transient() {
    transient_status(429).await;
}

#[tokio::test]
async fn a_408_is_transient() {
    transient_status(408).await;
}

#[tokio::test]
async fn a_425_is_transient() {
    transient_status(425).await;
}

#[tokio::test]
async fn a_302_is_not_followed_and_is_dead_permanent() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::WithHeaders(
        302,
        vec![("location", rx.url("/redirected"))],
    )]);
    let key = "redirect:302";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("permanent"));
    assert_eq!(row.attempts, 1);
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1, "the redirect target is never requested");
    assert_eq!(reqs[0].uri.path(), "/hook");
    assert_eq!(
        attempts(&db, key).await,
        vec![att(1, "dead", Some("permanent"), Some(302), false)]
    );
}

/// Credentials in the URL go as HTTP Basic authentication, as curl and every HTTP client
/// send them, unless the payload sets `authorization` itself: never in the request line or
/// the `host` header, and never in a stored error, of a status or of a failed connection.
#[tokio::test]
async fn credentials_in_the_url_are_sent_as_basic_auth_and_nowhere_else() {
    use base64::Engine as _;
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(503), Reply::Status(204), Reply::Status(204)]);
    let with_credentials = |url: String| url.replacen("http://", "http://al%20ice:S3CRET-PW@", 1);
    let key = "basic-auth";
    enqueue_webhook(&db, key, &with_credentials(rx.url("/hook?q=1")), 3, true).await;
    // The payload's own header wins over the URL's credentials.
    let own = "basic-auth:own-header";
    let payload = json!({
        "url": with_credentials(rx.url("/own")),
        "headers": {"Authorization": "Bearer app-token"},
        "body": {},
    });
    enqueue_payload(&db, own, payload, 1, true).await;
    // A connection refused: the transport error's text is stored too.
    let refused = "basic-auth:refused";
    let url =
        format!("http://al%20ice:S3CRET-PW@127.0.0.1:{CLOSED_PORT}/SECRET-PATH?SECRET-QUERY=1");
    enqueue_webhook(&db, refused, &url, 1, true).await;

    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    wait_for_state(&db, own, "delivered", WAIT).await;
    let refused_row = wait_for_state(&db, refused, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.attempts, 2);
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("al ice:S3CRET-PW")
    );
    let reqs = rx.requests();
    let to_hook: Vec<_> = reqs.iter().filter(|r| r.uri.path() == "/hook").collect();
    assert_eq!(to_hook.len(), 2);
    for r in to_hook {
        assert_eq!(r.header("authorization").as_deref(), Some(basic.as_str()));
        assert_eq!(
            r.uri.to_string(),
            "/hook?q=1",
            "origin form, no credentials"
        );
        assert_eq!(
            r.header("host").as_deref(),
            Some(rx.addr.to_string().as_str())
        );
    }
    let to_own: Vec<_> = reqs.iter().filter(|r| r.uri.path() == "/own").collect();
    assert_eq!(to_own.len(), 1);
    assert_eq!(
        to_own[0].header("authorization").as_deref(),
        Some("Bearer app-token")
    );
    let c = db.client().await;
    let stored: Vec<String> = first_column(
        &c,
        "SELECT coalesce(a.error, '') || ' ' || coalesce(m.last_error, '')
             FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
             WHERE m.message_key LIKE 'basic-auth%'",
    )
    .await;
    assert_eq!(stored.len(), 4, "{stored:?}");
    let refused_error = refused_row.last_error.unwrap_or_default();
    assert!(
        refused_error.starts_with("cannot connect to 127.0.0.1"),
        "{refused_error}"
    );
    for e in &stored {
        for secret in [
            "S3CRET",
            "al ice",
            "al%20ice",
            "SECRET-PATH",
            "SECRET-QUERY",
        ] {
            assert!(!e.contains(secret), "{secret} in {e}");
        }
    }
}

/// A server that accepts the connection and never answers the TLS handshake: the connect
/// timeout covers the handshake, so the attempt is `transient` (nothing was sent), not an
/// ambiguous whole-request timeout.
#[tokio::test]
async fn a_tls_handshake_that_never_comes_is_transient() {
    let db = TestDb::new().await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((sock, _)) = silent.accept().await {
            open.push(sock);
        }
    });
    let key = "tls:silent";
    // An address, not `localhost`: the listener is on IPv4 only.
    let url = format!("https://127.0.0.1:{port}/hook");
    enqueue_webhook(&db, key, &url, 1, true).await;
    // The test config's timeout is 2 s: the connect timeout is 1 s, and the whole request
    // would give up at 2 s (ambiguous) if the connect timeout did not cover the handshake.
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    held.abort();
    assert_eq!(row.error_class.as_deref(), Some("exhausted"));
    let c = db.client().await;
    let (class, error): (Option<String>, Option<String>) = {
        let r = c
            .query_one(
                "SELECT a.error_class, a.error FROM outbox.attempts a
                 JOIN outbox.messages m ON m.id = a.message_id WHERE m.message_key = $1",
                &[&key],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    // `exhausted`: a transient failure with no attempt left (an ambiguous one would be
    // `ambiguous`).
    assert_eq!(class.as_deref(), Some("exhausted"), "{error:?}");
    let error = error.unwrap_or_default();
    assert!(error.starts_with("cannot connect to 127.0.0.1"), "{error}");
    assert!(error.contains("connect timed out"), "{error}");
}

// ---------------------------------------------------------------------------------------
// Ambiguous outcomes (timeouts after the request was sent)
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_stalled_endpoint_is_ambiguous_and_retried_when_allowed() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(Duration::from_secs(3))]);
    let key = "stall:retry";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(row.attempts, 2);
    assert_eq!(rx.requests().len(), 2);
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None, false),
            att(2, "delivered", None, Some(204), false),
        ]
    );
}

#[tokio::test]
async fn a_stalled_endpoint_is_dead_ambiguous_when_retry_is_not_allowed() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Stall(Duration::from_secs(3)));
    let key = "stall:no-retry";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, false).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(row.attempts, 1);
    assert_eq!(rx.requests().len(), 1, "exactly one request");
    assert_eq!(
        attempts(&db, key).await,
        vec![att(1, "dead", Some("ambiguous"), None, false)]
    );
}

#[tokio::test]
async fn stalled_on_every_attempt_is_dead_ambiguous_not_exhausted() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Stall(Duration::from_secs(3)));
    let key = "stall:always";
    enqueue_webhook(&db, key, &rx.url("/hook"), 2, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(row.attempts, 2);
    assert_eq!(rx.requests().len(), 2);
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None, false),
            att(2, "dead", Some("ambiguous"), None, false),
        ]
    );
}

// ---------------------------------------------------------------------------------------
// Retry-After
// ---------------------------------------------------------------------------------------

/// The gap between the first two requests for a first answer of `status` with
/// `Retry-After: retry_after`, under the given retry schedule.
async fn gap_after_retry_after(status: u16, retry_after: &str, max: Duration) -> Duration {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::WithHeaders(
        status,
        vec![("retry-after", retry_after.to_owned())],
    )]);
    let key = format!("retry-after:{status}:{retry_after}");
    enqueue_webhook(&db, &key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(
        &db,
        worker_with_retry(Duration::from_millis(100), max),
        test_webhook_config(),
    );
    let row = wait_for_state(&db, &key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(row.attempts, 2);
    let reqs: Vec<Recorded> = rx.requests();
    assert_eq!(reqs.len(), 2);
    reqs[1].at.duration_since(reqs[0].at)
}

#[tokio::test]
async fn retry_after_on_429_is_honoured() {
    let gap = gap_after_retry_after(429, "2", Duration::from_secs(10)).await;
    assert!(gap >= Duration::from_millis(1900), "retried after {gap:?}");
}

#[tokio::test]
async fn retry_after_on_503_is_honoured() {
    let gap = gap_after_retry_after(503, "2", Duration::from_secs(10)).await;
    assert!(gap >= Duration::from_millis(1900), "retried after {gap:?}");
}

#[tokio::test]
async fn a_huge_retry_after_is_capped_at_retry_max() {
    let gap = gap_after_retry_after(429, "86400", Duration::from_secs(1)).await;
    // Capped at 1 s: not the base (100 ms, Retry-After ignored), not a day.
    assert!(
        gap >= Duration::from_millis(900) && gap <= Duration::from_secs(4),
        "retried after {gap:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Provider deduplication
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn idempotent_replayed_is_recorded_as_deduplicated() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::WithHeaders(
        200,
        vec![("idempotent-replayed", "true".to_owned())],
    )]);
    let key = "dedup:1";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(
        attempts(&db, key).await,
        vec![att(1, "delivered", None, Some(200), true)]
    );
    let response = row.response.expect("response summary");
    assert_eq!(response["replayed"], json!(true), "{response}");
    assert_eq!(response["status"], json!(200), "{response}");
}

// ---------------------------------------------------------------------------------------
// Signatures
// ---------------------------------------------------------------------------------------

fn vector_secret() -> String {
    let v: Value =
        serde_json::from_str(include_str!("../data/standard-webhooks-vector.json")).unwrap();
    v["secret"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn signed_requests_verify_with_the_standard_webhooks_crate() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let secret = vector_secret();
    let key = "order-42:paid:notify";
    enqueue_payload(
        &db,
        key,
        json!({"url": rx.url("/hook"), "body": {"event": "order.paid", "order_id": 42, "amount_cents": 1299, "price": 12.5}}),
        3,
        true,
    )
    .await;
    let cfg = WebhookConfig {
        signing: outboxd::deliver::webhook::settings::SigningKeys::one(
            parse_webhook_secret(&secret).unwrap(),
        ),
        ..test_webhook_config()
    };
    let w = RunningWorker::start(&db, test_worker_config("w"), cfg);
    wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1);
    let r = &reqs[0];
    let sig = r.header("webhook-signature").expect("webhook-signature");
    assert!(sig.starts_with("v1,"), "{sig}");
    standardwebhooks::Webhook::new(&secret)
        .unwrap()
        .verify(&r.body, &r.headers)
        .expect("signature verifies with the official crate");
    // And it is a real check: another secret does not verify.
    assert!(
        standardwebhooks::Webhook::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap()
            .verify(&r.body, &r.headers)
            .is_err()
    );
}

#[tokio::test]
async fn no_signature_header_without_a_key() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let key = "unsigned:1";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].header("webhook-id").as_deref(), Some(key));
    assert!(reqs[0].header("webhook-signature").is_none());
}

// ---------------------------------------------------------------------------------------
// Log hygiene
// ---------------------------------------------------------------------------------------

const SECRETS: [&str; 4] = [
    "SECRETPATH123",
    "SECRETQUERY456",
    "SECRETBODY789",
    "SECRETHEADER000",
];
const SECRET_PATH: &str = "/hooks/SECRETPATH123?token=SECRETQUERY456";

fn secret_payload(base: &str) -> Value {
    json!({
        "url": format!("{base}{SECRET_PATH}"),
        "headers": {"X-Api-Token": "SECRETHEADER000"},
        "body": {"note": "SECRETBODY789", "n": 1},
    })
}

#[tokio::test]
async fn no_secret_reaches_logs_or_stored_errors_and_every_attempt_is_logged() {
    // A second, idle dispatcher kept alive for the whole test. With a single scoped
    // dispatcher registered, tracing-core (0.1.36, `Dispatchers::register_dispatch` sets
    // `has_just_one` when one is registered) computes the interest of a callsite first hit
    // on *another* test thread from that thread's default (no subscriber) and caches it
    // as "never", so this test would miss events whose callsite another test reached first.
    // With two dispatchers registered, interest is computed from all of them.
    let _idle = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let (logs, _guard) = LogCapture::install();
    let db = TestDb::new().await;
    let ok = Receiver::start().await;
    let flaky = Receiver::start().await;
    flaky.script([Reply::Status(503)]);
    let bad = Receiver::start().await;
    bad.set_default(Reply::Status(400));
    let stall = Receiver::start().await;
    stall.set_default(Reply::Stall(Duration::from_secs(3)));
    // A port nobody listens on (`CLOSED_PORT`): connection refused, transient, exhausted.

    // Receivers are reached as `localhost` (exempt); the literal 127.0.0.1 is refused.
    let via_localhost = |rx: &Receiver| format!("http://localhost:{}", rx.addr.port());
    let mut cases: Vec<(&str, Value, bool, &str)> = vec![
        (
            "log:ok",
            secret_payload(&via_localhost(&ok)),
            true,
            "delivered",
        ),
        (
            "log:retry",
            secret_payload(&via_localhost(&flaky)),
            true,
            "delivered",
        ),
        (
            "log:bad",
            secret_payload(&via_localhost(&bad)),
            true,
            "dead",
        ),
        (
            "log:stall",
            secret_payload(&via_localhost(&stall)),
            false,
            "dead",
        ),
        (
            "log:ssrf",
            secret_payload(&format!("http://127.0.0.1:{}", ok.addr.port())),
            true,
            "dead",
        ),
        (
            "log:refused",
            secret_payload(&format!("http://localhost:{CLOSED_PORT}")),
            true,
            "dead",
        ),
    ];
    let mut crlf = secret_payload(&via_localhost(&ok));
    crlf["headers"]["X-Api-Token"] = json!("SECRETHEADER000\r\nX-Injected: 1");
    cases.push(("log:crlf", crlf, true, "dead"));
    for (key, payload, retry_ambiguous, _) in &cases {
        enqueue_payload(&db, key, payload.clone(), 3, *retry_ambiguous).await;
    }

    let webhook = WebhookConfig {
        timeout: Duration::from_millis(500),
        signing: Default::default(),
        destinations: DestinationPolicy::from_values(None, Some("localhost")).unwrap(),
    };
    let w = RunningWorker::start(&db, test_worker_config("w"), webhook);
    for (key, _, _, state) in &cases {
        wait_for_state(&db, key, state, WAIT).await;
    }
    // Stopping waits for the completer, so every attempt's log event is written.
    w.stop().await;

    // The outcomes are the ones the cases are meant to exercise.
    let class = |key: &str| {
        let db = &db;
        let key = key.to_owned();
        async move { row(db, &key).await.error_class }
    };
    assert_eq!(class("log:bad").await.as_deref(), Some("permanent"));
    assert_eq!(class("log:stall").await.as_deref(), Some("ambiguous"));
    assert_eq!(class("log:ssrf").await.as_deref(), Some("invalid"));
    assert_eq!(class("log:refused").await.as_deref(), Some("exhausted"));
    assert_eq!(class("log:crlf").await.as_deref(), Some("invalid"));
    assert_eq!(
        ok.requests().len(),
        1,
        "the refused 127.0.0.1 URL never got through"
    );

    let text = logs.text();
    let c = db.client().await;
    let last_errors: Vec<String> = first_column(
        &c,
        "SELECT message_key || ': ' || coalesce(last_error, '') FROM outbox.messages",
    )
    .await;
    let attempt_errors: Vec<String> = first_column(
        &c,
        "SELECT coalesce(error, '') FROM outbox.attempts WHERE error IS NOT NULL",
    )
    .await;
    assert!(!attempt_errors.is_empty());
    for secret in SECRETS {
        assert!(
            !text.contains(secret),
            "{secret} in the logs:\n{}",
            text.lines()
                .filter(|l| l.contains(secret))
                .collect::<Vec<_>>()
                .join("\n")
        );
        for e in &last_errors {
            assert!(!e.contains(secret), "{secret} in last_error: {e}");
        }
        for e in &attempt_errors {
            assert!(!e.contains(secret), "{secret} in attempts.error: {e}");
        }
    }
    assert!(!text.contains("X-Injected"), "a header value in the logs");

    // One "attempt finished" event per attempt row, with its fields.
    let rows = c
        .query(
            "SELECT a.message_id, m.message_key, a.attempt, a.outcome, m.max_attempts \
             FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id ORDER BY a.id",
            &[],
        )
        .await
        .unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("attempt finished"))
        .collect();
    assert_eq!(
        events.len(),
        rows.len(),
        "one event per attempt; events:\n{}",
        events.join("\n")
    );
    assert_eq!(rows.len(), 10, "1 + 2 + 1 + 1 + 1 + 3 + 1 attempts");
    for r in &rows {
        let id: i64 = r.get(0);
        let key: String = r.get(1);
        let attempt: i32 = r.get(2);
        let outcome: String = r.get(3);
        let max: i32 = r.get(4);
        let found = events.iter().any(|l| {
            l.contains(&format!("message_id={id} "))
                && l.contains(&format!("key={key} "))
                && l.contains(&format!("attempt={attempt}/{max} "))
                && (l.contains(&format!("outcome=\"{outcome}\""))
                    || l.contains(&format!("outcome={outcome} ")))
                && l.contains("channel=webhook")
        });
        assert!(
            found,
            "no event for {key} attempt {attempt}/{max} ({outcome}); events:\n{}",
            events.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------
// Invalid payloads: dead at once, no request
// ---------------------------------------------------------------------------------------

async fn invalid_payload(key: &str, payload: impl FnOnce(&Receiver) -> Value, needle: &str) {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_payload(&db, key, payload(&rx), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("invalid"));
    assert_eq!(row.attempts, 1);
    assert_eq!(
        attempts(&db, key).await,
        vec![att(1, "dead", Some("invalid"), None, false)]
    );
    let err = row.last_error.unwrap_or_default();
    assert!(err.contains(needle), "last_error {err:?} lacks {needle:?}");
    assert_eq!(rx.requests().len(), 0, "no request for an invalid payload");
}

#[tokio::test]
async fn an_ftp_url_is_invalid() {
    invalid_payload(
        "invalid:ftp",
        |rx| json!({"url": format!("ftp://{}/upload", rx.addr), "body": {}}),
        "scheme",
    )
    .await;
}

#[tokio::test]
async fn an_unparseable_url_is_invalid() {
    invalid_payload(
        "invalid:url",
        |_| json!({"url": "http://exa mple.com:80/x", "body": {}}),
        "payload.url",
    )
    .await;
}

#[tokio::test]
async fn method_get_is_invalid() {
    invalid_payload(
        "invalid:get",
        |rx| json!({"url": rx.url("/hook"), "method": "GET", "body": {}}),
        "payload.method",
    )
    .await;
}

#[tokio::test]
async fn a_header_value_with_crlf_is_invalid() {
    invalid_payload(
        "invalid:crlf",
        |rx| json!({"url": rx.url("/hook"), "headers": {"X-A": "a\r\nX-Injected: 1"}, "body": {}}),
        "payload.headers",
    )
    .await;
}

#[tokio::test]
async fn a_header_that_is_not_a_string_is_invalid() {
    invalid_payload(
        "invalid:header-type",
        |rx| json!({"url": rx.url("/hook"), "headers": {"X-A": 1}, "body": {}}),
        "payload.headers",
    )
    .await;
}
