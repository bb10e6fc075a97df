//! Reconciliation end to end (contract part 2, "Reconciliation: look before sending again"):
//! a real worker, PostgreSQL and the test receiver. The first attempt is made ambiguous by
//! a receiver that accepts the request and stalls past the worker's timeout; what the next
//! attempt does depends on what the lookup (`GET reconcile.url`) answers.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use common::receiver::{Receiver, Recorded, Reply};
use common::*;
use outboxd::deliver::webhook::settings::{DestinationPolicy, WebhookConfig, parse_webhook_secret};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

/// Longer than the worker's timeout: the first request is accepted and never answered in
/// time, so its outcome is ambiguous.
const STALL: Duration = Duration::from_secs(3);

/// The lookup path, with what such URLs carry (an id and a token) to check that neither
/// reaches a log or the history.
const LOOKUP_PATH: &str = "/v1/charges/LOOKUPPATH123?token=LOOKUPQUERY456";

/// Webhook settings with a short timeout (the test worker's lease, 10 s, is far above it).
fn short_timeout() -> WebhookConfig {
    WebhookConfig {
        timeout: Duration::from_millis(500),
        ..test_webhook_config()
    }
}

/// The test worker with a retry delay of 2 s: long enough for a test to change the row
/// between two attempts.
fn slow_retry() -> outboxd::config::WorkerConfig {
    outboxd::config::WorkerConfig {
        retry: outboxd::retry::RetryPolicy {
            base: Duration::from_secs(2),
            max: Duration::from_secs(2),
        },
        ..test_worker_config("w")
    }
}

/// A webhook to `rx` that names a lookup on `rx`, with a header of its own.
fn payload(rx: &Receiver) -> Value {
    json!({
        "url": rx.url("/hook"),
        "headers": {"X-Tenant": "acme"},
        "body": {"charge": 1250},
        "reconcile": {"url": rx.url(LOOKUP_PATH)},
    })
}

async fn enqueue(db: &TestDb, key: &str, payload: Value, max_attempts: i32, retry_ambiguous: bool) {
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(key, payload)
        .max_attempts(max_attempts)
        .retry_ambiguous(retry_ambiguous);
    outboxd::enqueue(&c, &msg).await.expect("enqueue");
}

type AttemptRow = (i32, String, Option<String>, Option<i32>, bool);

fn att(attempt: i32, outcome: &str, class: Option<&str>, status: Option<i32>) -> AttemptRow {
    (
        attempt,
        outcome.to_owned(),
        class.map(str::to_owned),
        status,
        false,
    )
}

/// The requests as `METHOD path`, in order.
fn calls(rx: &Receiver) -> Vec<String> {
    rx.requests()
        .iter()
        .map(|r| format!("{} {}", r.method, r.uri.path()))
        .collect()
}

const POST: &str = "POST /hook";
const GET: &str = "GET /v1/charges/LOOKUPPATH123";

/// Runs one message to `state` against a receiver answering `script`.
async fn run(
    key: &str,
    script: Vec<Reply>,
    max_attempts: i32,
    retry_ambiguous: bool,
    state: &str,
) -> (TestDb, Receiver, Row) {
    run_with(
        short_timeout(),
        key,
        script,
        max_attempts,
        retry_ambiguous,
        state,
    )
    .await
}

/// [`run`] under webhook settings `cfg`.
async fn run_with(
    cfg: WebhookConfig,
    key: &str,
    script: Vec<Reply>,
    max_attempts: i32,
    retry_ambiguous: bool,
    state: &str,
) -> (TestDb, Receiver, Row) {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script(script);
    enqueue(&db, key, payload(&rx), max_attempts, retry_ambiguous).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), cfg);
    let row = wait_for_state(&db, key, state, WAIT).await;
    w.stop().await;
    (db, rx, row)
}

// ---------------------------------------------------------------------------------------
// What the lookup answers
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_lookup_answering_200_delivers_without_sending_again() {
    let key = "rec:200";
    let (db, rx, row) = run(
        key,
        vec![Reply::Stall(STALL), Reply::Status(200)],
        3,
        true,
        "delivered",
    )
    .await;
    assert_eq!(calls(&rx), [POST, GET], "one request, then the lookup only");
    assert_eq!(row.attempts, 2);
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None),
            att(2, "reconciled", None, Some(200)),
        ]
    );
    let response = row.response.unwrap();
    assert_eq!(response["reconciled"], json!(true), "{response}");
    assert_eq!(response["status"], json!(200), "{response}");
    assert!(
        response.get("body").is_none(),
        "no body without store_response"
    );
    assert_eq!(row.error_class, None);
    // The lookup carries the message's identity and the payload's headers, and no body.
    let get = &rx.requests_with("GET")[0];
    assert_eq!(get.uri.query(), Some("token=LOOKUPQUERY456"));
    assert_eq!(get.header("idempotency-key").as_deref(), Some(key));
    assert_eq!(get.header("webhook-id").as_deref(), Some(key));
    assert!(get.header("webhook-timestamp").is_some());
    assert_eq!(get.header("x-tenant").as_deref(), Some("acme"));
    assert!(get.body.is_empty());
    assert!(get.header("content-type").is_none());
}

async fn not_found(status: u16) {
    let key = format!("rec:{status}");
    let (db, rx, row) = run(
        &key,
        vec![
            Reply::Stall(STALL),
            Reply::Status(status),
            Reply::Status(200),
        ],
        3,
        true,
        "delivered",
    )
    .await;
    assert_eq!(calls(&rx), [POST, GET, POST], "exactly one resend");
    assert_eq!(
        attempts(&db, &key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None),
            att(2, "delivered", None, Some(200)),
        ]
    );
    // The resend is the same request: same key, same bytes.
    let posts = rx.requests_with("POST");
    assert_eq!(posts[0].body, posts[1].body);
    assert_eq!(
        posts[1].header("idempotency-key").as_deref(),
        Some(key.as_str())
    );
    let response = row.response.unwrap();
    assert!(response.get("reconciled").is_none(), "{response}");
}

#[tokio::test]
async fn a_lookup_answering_404_sends_the_request_once_more_in_the_same_attempt() {
    not_found(404).await;
}

#[tokio::test]
async fn a_lookup_answering_410_sends_the_request_once_more_in_the_same_attempt() {
    not_found(410).await;
}

#[tokio::test]
async fn a_lookup_answering_500_is_ambiguous_again_and_the_next_lookup_settles_it() {
    let key = "rec:500";
    let (db, rx, _) = run(
        key,
        vec![Reply::Stall(STALL), Reply::Status(500), Reply::Status(200)],
        3,
        true,
        "delivered",
    )
    .await;
    assert_eq!(calls(&rx), [POST, GET, GET], "never sent again");
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None),
            att(2, "retry", Some("ambiguous"), Some(500)),
            att(3, "reconciled", None, Some(200)),
        ]
    );
}

#[tokio::test]
async fn a_lookup_that_times_out_on_the_last_attempt_is_dead_ambiguous() {
    let key = "rec:timeout";
    let (db, rx, row) = run(
        key,
        vec![Reply::Stall(STALL), Reply::Stall(STALL)],
        2,
        true,
        "dead",
    )
    .await;
    assert_eq!(calls(&rx), [POST, GET]);
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(row.attempts, 2);
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None),
            att(2, "dead", Some("ambiguous"), None),
        ]
    );
    let err = row.last_error.unwrap();
    assert!(err.contains("reconciliation lookup"), "{err}");
}

#[tokio::test]
async fn a_lookup_that_cannot_connect_is_ambiguous_not_transient() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(STALL)]);
    // A port nothing listens on: the lookup's connection is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_url = format!("http://{}/l", closed.local_addr().unwrap());
    drop(closed);
    let key = "rec:refused";
    enqueue(
        &db,
        key,
        json!({"url": rx.url("/hook"), "reconcile": {"url": closed_url}}),
        2,
        true,
    )
    .await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    // Not `exhausted`: a failed lookup says nothing about the first request.
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(rx.requests().len(), 1, "the request was not sent again");
}

// ---------------------------------------------------------------------------------------
// retry_ambiguous = false
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn without_retry_ambiguous_a_reconcile_url_goes_to_reconciliation_not_dead() {
    let key = "rec:no-retry:200";
    let (db, rx, _) = run(
        key,
        vec![Reply::Stall(STALL), Reply::Status(200)],
        3,
        false,
        "delivered",
    )
    .await;
    assert_eq!(calls(&rx), [POST, GET]);
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None),
            att(2, "reconciled", None, Some(200)),
        ]
    );
}

#[tokio::test]
async fn without_retry_ambiguous_the_request_is_sent_again_only_after_a_404() {
    let key = "rec:no-retry:404";
    let (_db, rx, _) = run(
        key,
        vec![
            Reply::Stall(STALL),
            Reply::Status(503),
            Reply::Status(404),
            Reply::Status(200),
        ],
        4,
        false,
        "delivered",
    )
    .await;
    assert_eq!(calls(&rx), [POST, GET, GET, POST]);
}

#[tokio::test]
async fn without_retry_ambiguous_or_a_reconcile_url_an_ambiguous_outcome_is_dead() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(STALL)]);
    let key = "rec:no-retry:none";
    enqueue(&db, key, json!({"url": rx.url("/hook")}), 3, false).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(calls(&rx), [POST]);
    assert_eq!(
        attempts(&db, key).await,
        vec![att(1, "dead", Some("ambiguous"), None)]
    );
}

// ---------------------------------------------------------------------------------------
// An expired lease is ambiguous too
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn after_an_expired_lease_the_next_attempt_looks_up_first() {
    for retry_ambiguous in [true, false] {
        let db = TestDb::new().await;
        let rx = Receiver::start().await;
        rx.script([Reply::Status(200)]);
        let key = format!("rec:lease:{retry_ambiguous}");
        enqueue(&db, &key, payload(&rx), 3, retry_ambiguous).await;
        claim_and_abandon(&db).await;
        let w = RunningWorker::start(&db, test_worker_config("w2"), short_timeout());
        let row = wait_for_state(&db, &key, "delivered", WAIT).await;
        w.stop().await;
        assert_eq!(calls(&rx), [GET], "retry_ambiguous={retry_ambiguous}");
        assert_eq!(row.response.unwrap()["reconciled"], json!(true));
        let history = attempts(&db, &key).await;
        assert_eq!(history.first().map(|a| a.1.as_str()), Some("lease_lost"));
        assert_eq!(
            history.last().map(|a| a.1.as_str()),
            Some("reconciled"),
            "{history:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Destinations, signatures, secrets
// ---------------------------------------------------------------------------------------

/// Under the default policy (private networks refused) with `allow_host` exempt, a message
/// whose reconcile URL is `reconcile_url` is dead `invalid` on its first attempt, and no
/// request reaches either receiver.
async fn refused(key: &str, allow_host: &str, url: &str, reconcile_url: &str) {
    let db = TestDb::new().await;
    enqueue(
        &db,
        key,
        json!({"url": url, "reconcile": {"url": reconcile_url}}),
        3,
        true,
    )
    .await;
    let cfg = WebhookConfig {
        timeout: Duration::from_millis(500),
        signing: Default::default(),
        destinations: DestinationPolicy {
            allow_private_networks: false,
            allow_hosts: HashSet::from([allow_host.to_owned()]),
        },
    };
    let w = RunningWorker::start(&db, test_worker_config("w"), cfg);
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("invalid"), "{row:?}");
    assert_eq!(row.attempts, 1);
    let err = row.last_error.unwrap();
    assert!(err.contains("not allowed"), "{err}");
    assert!(!err.contains("/l"), "no path in {err}");
    assert_eq!(
        attempts(&db, key).await,
        vec![att(1, "dead", Some("invalid"), None)]
    );
}

#[tokio::test]
async fn a_reconcile_url_to_a_forbidden_literal_address_is_invalid_with_no_request() {
    let rx = Receiver::start().await;
    let lookup = Receiver::start().await;
    refused(
        "rec:ssrf:literal",
        "localhost",
        &format!("http://localhost:{}/hook", rx.addr.port()),
        &format!("http://127.0.0.1:{}/l", lookup.addr.port()),
    )
    .await;
    assert_eq!(rx.requests().len(), 0, "the request was not sent");
    assert_eq!(lookup.requests().len(), 0);
    // Other spellings of a forbidden address, and the metadata endpoint.
    for (i, spelling) in [
        "127.1",
        "[::ffff:127.0.0.1]",
        "2130706433",
        "169.254.169.254",
    ]
    .iter()
    .enumerate()
    {
        refused(
            &format!("rec:ssrf:{i}"),
            "localhost",
            &format!("http://localhost:{}/hook", rx.addr.port()),
            &format!("http://{spelling}:{}/l", lookup.addr.port()),
        )
        .await;
    }
    assert_eq!(rx.requests().len() + lookup.requests().len(), 0);
}

#[tokio::test]
async fn a_reconcile_url_naming_a_host_that_resolves_to_a_forbidden_address_is_invalid_with_no_request()
 {
    let rx = Receiver::start().await;
    let lookup = Receiver::start().await;
    refused(
        "rec:ssrf:name",
        "127.0.0.1",
        &format!("http://127.0.0.1:{}/hook", rx.addr.port()),
        &format!("http://localhost:{}/l", lookup.addr.port()),
    )
    .await;
    assert_eq!(rx.requests().len(), 0, "the request was not sent");
    assert_eq!(lookup.requests().len(), 0);
}

/// The contract: a lookup that cannot be made leaves the attempt "ambiguous again", and
/// it counts. (This was `invalid` once, which said nothing was ever sent: the first
/// request was.)
#[tokio::test]
async fn a_reconcile_url_refused_at_lookup_time_is_ambiguous_again() {
    // The first attempt is sent (the reconcile host is allowed by name then); the lookup
    // goes to a host the policy refuses: the connection is never made.
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(STALL)]);
    let key = "rec:ssrf:later";
    // The message is inserted first, then its lookup URL is changed to one the guard refuses
    // (a plain UPDATE; the enqueue rules only see the INSERT): the worker must still refuse.
    enqueue(&db, key, payload(&rx), 3, true).await;
    let cfg = WebhookConfig {
        timeout: Duration::from_millis(500),
        signing: Default::default(),
        destinations: DestinationPolicy {
            allow_private_networks: false,
            allow_hosts: HashSet::from(["127.0.0.1".to_owned()]),
        },
    };
    let w = RunningWorker::start(&db, slow_retry(), cfg);
    wait_until(WAIT, "the first attempt to be ambiguous", || async {
        let n: i64 = db
            .scalar("SELECT count(*) FROM outbox.attempts WHERE error_class = 'ambiguous'")
            .await;
        n == 1
    })
    .await;
    update_past_the_door(
        &db.client().await,
        "UPDATE outbox.messages SET payload = jsonb_set(payload, '{reconcile,url}', to_jsonb($2::text)) \
         WHERE message_key = $1",
        &[&key, &format!("http://localhost:{}/l", rx.addr.port())],
    )
    .await;
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"), "{row:?}");
    assert_eq!(
        row.attempts, 3,
        "each refused lookup counts, to the end of the budget"
    );
    assert_eq!(calls(&rx), [POST], "no lookup and no resend");
}

#[tokio::test]
async fn a_bad_reconcile_url_is_invalid_before_any_request() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let cases = [
        ("rec:bad:scheme", json!({"url": "file:///etc/passwd"})),
        (
            "rec:bad:gopher",
            json!({"url": "gopher://example.com/LOOKUPPATH123"}),
        ),
        ("rec:bad:nohost", json!({"url": "http://"})),
        ("rec:bad:relative", json!({"url": "/v1/LOOKUPPATH123"})),
        (
            "rec:bad:ctl",
            json!({"url": "http://exa\u{1}mple.com/LOOKUPPATH123"}),
        ),
    ];
    for (key, reconcile) in &cases {
        enqueue(
            &db,
            key,
            json!({"url": rx.url("/hook"), "reconcile": reconcile}),
            3,
            true,
        )
        .await;
    }
    // Shapes the enqueue rules refuse can only come from rows changed afterwards;
    // the worker refuses them too.
    let shapes = [
        ("rec:shape:string", json!("https://example.com/l")),
        ("rec:shape:array", json!([1])),
        ("rec:shape:url", json!({"url": 5})),
    ];
    let c = db.client().await;
    for (key, reconcile) in &shapes {
        enqueue(&db, key, json!({"url": rx.url("/hook")}), 3, true).await;
        update_past_the_door(
            &c,
            "UPDATE outbox.messages SET payload = payload || jsonb_build_object('reconcile', $2::jsonb) \
             WHERE message_key = $1",
            &[key, reconcile],
        )
        .await;
    }
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let n = (cases.len() + shapes.len()) as i64;
    wait_for_count(&c, "dead", n, WAIT).await;
    w.stop().await;
    for (key, _) in cases.iter().chain(shapes.iter()) {
        let r = row(&db, key).await;
        assert_eq!(r.error_class.as_deref(), Some("invalid"), "{key}: {r:?}");
        let err = r.last_error.unwrap();
        assert!(err.contains("reconcile"), "{key}: {err}");
        assert!(!err.contains("LOOKUPPATH"), "{key}: {err}");
    }
    assert_eq!(rx.requests().len(), 0, "nothing was sent");
}

#[tokio::test]
async fn the_lookup_is_signed_over_an_empty_body() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(STALL), Reply::Status(200)]);
    let v: Value =
        serde_json::from_str(include_str!("../data/standard-webhooks-vector.json")).unwrap();
    let secret = v["secret"].as_str().unwrap().to_owned();
    let key = "rec:signed";
    enqueue(&db, key, payload(&rx), 3, true).await;
    let cfg = WebhookConfig {
        signing: outboxd::deliver::webhook::settings::SigningKeys::one(
            parse_webhook_secret(&secret).unwrap(),
        ),
        ..short_timeout()
    };
    let w = RunningWorker::start(&db, test_worker_config("w"), cfg);
    wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    let get: Recorded = rx.requests_with("GET").remove(0);
    assert!(get.body.is_empty());
    let verifier = standardwebhooks::Webhook::new(&secret).unwrap();
    verifier
        .verify(b"", &get.headers)
        .expect("the lookup's signature verifies over the empty body");
    // It is a real check: the request's own body does not verify against the lookup's
    // signature.
    let post = rx.requests_with("POST").remove(0);
    assert!(verifier.verify(&post.body, &get.headers).is_err());
    verifier
        .verify(&post.body, &post.headers)
        .expect("the request verifies over its body");
}

#[tokio::test]
async fn the_lookup_is_its_own_log_step_and_no_path_query_or_header_value_is_kept() {
    let (logs, _guard) = LogCapture::install();
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    // Ambiguous, then a lookup that fails (500), one that times out, then one that answers.
    rx.script([
        Reply::Stall(STALL),
        Reply::Status(500),
        Reply::Stall(STALL),
        Reply::Status(200),
    ]);
    let key = "rec:logs";
    let mut p = payload(&rx);
    p["headers"] = json!({"X-Api-Token": "HEADERVALUE789"});
    enqueue(&db, key, p, 4, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(calls(&rx), [POST, GET, GET, GET]);
    let text = logs.text();
    let steps: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("step=\"reconcile\""))
        .collect();
    assert_eq!(steps.len(), 3, "one event per lookup:\n{text}");
    for (line, verdict) in steps.iter().zip(["unknown", "unknown", "happened"]) {
        assert!(line.contains(&format!("verdict=\"{verdict}\"")), "{line}");
        assert!(line.contains("host=127.0.0.1"), "{line}");
    }
    assert!(steps[0].contains("status=500"), "{}", steps[0]);
    let history: Vec<String> = first_column(&db.client().await, "SELECT coalesce(a.error, '') || ' ' || coalesce(m.last_error, '') || ' ' || coalesce(m.response::text, '') \
             FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id").await;
    for secret in ["LOOKUPPATH123", "LOOKUPQUERY456", "HEADERVALUE789"] {
        assert!(!text.contains(secret), "{secret} in the logs:\n{text}");
        for h in &history {
            assert!(!h.contains(secret), "{secret} in the history: {h}");
        }
    }
}

#[tokio::test]
async fn an_encoded_line_break_in_the_reconcile_url_injects_nothing() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(STALL), Reply::Status(200)]);
    let key = "rec:crlf";
    let hostile = rx.url("/l%0d%0aX-Injected:%201?q=%0D%0AX-Other:%202");
    enqueue(
        &db,
        key,
        json!({"url": rx.url("/hook"), "reconcile": {"url": hostile}}),
        3,
        true,
    )
    .await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(row.response.unwrap()["reconciled"], json!(true));
    let get = &rx.requests_with("GET")[0];
    assert!(get.header("x-injected").is_none() && get.header("x-other").is_none());
    assert_eq!(
        get.uri.path(),
        "/l%0d%0aX-Injected:%201",
        "sent as written, encoded"
    );
}

/// An attempt after an ambiguous one that can send nothing (its destination no longer
/// allowed: a worker configured otherwise in a rolling deploy, or a name that now points
/// somewhere private) leaves the message as unknown as it found it: dead `ambiguous`, for
/// a person to check and `outboxd confirm` to settle, not `invalid`, which says nothing
/// was ever sent and invites a replay.
#[tokio::test]
async fn an_attempt_that_sends_nothing_after_an_ambiguous_one_is_dead_ambiguous() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script(vec![Reply::Stall(STALL)]);
    let key = "rec:after-ambiguous";
    enqueue(&db, key, payload(&rx), 3, true).await;
    // The first worker may reach the receiver (on 127.0.0.1): its request is accepted and
    // stalls past the timeout.
    let w = RunningWorker::start(&db, test_worker_config("w1"), short_timeout());
    wait_until(WAIT, "the first attempt to end ambiguous", || async {
        attempts(&db, key).await.len() == 1
    })
    .await;
    w.stop().await;
    // The next worker refuses private networks: it can send neither the lookup nor the
    // request.
    let refusing = WebhookConfig {
        destinations: DestinationPolicy {
            allow_private_networks: false,
            ..Default::default()
        },
        ..short_timeout()
    };
    let w = RunningWorker::start(&db, test_worker_config("w2"), refusing);
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"), "{row:?}");
    let err = row.last_error.unwrap();
    assert!(
        err.contains("earlier attempt may have taken effect"),
        "{err}"
    );
    // Without `released` rows: the first worker may have claimed the retry before its stop
    // gave it back unsent (seen on a loaded machine), which counts nothing.
    let counted: Vec<AttemptRow> = attempts(&db, key)
        .await
        .into_iter()
        .filter(|a| a.1 != "released")
        .collect();
    assert_eq!(
        counted,
        vec![
            att(1, "retry", Some("ambiguous"), None),
            att(2, "retry", Some("ambiguous"), None),
            att(3, "dead", Some("ambiguous"), None),
        ]
    );
    assert_eq!(rx.requests().len(), 1, "only the first request left");
    // `outboxd confirm` settles exactly such a row.
    let id: i64 = db
        .scalar(&format!(
            "SELECT id FROM outbox.messages WHERE message_key = '{key}'"
        ))
        .await;
    let c = db.client().await;
    c.execute("SELECT * FROM outbox.confirm(ARRAY[$1::bigint])", &[&id])
        .await
        .unwrap();
    assert_eq!(row_state_of(&db, key).await, "delivered");
}

async fn row_state_of(db: &TestDb, key: &str) -> String {
    crate::common::row(db, key).await.state
}

/// A lookup that takes part of the attempt's time leaves the request less: if the time
/// runs out while the request is still connecting, nothing was sent, and the attempt is
/// transient, not ambiguous (which would ask a person about a request that never left).
/// Here the lookup answers 404 after 300 ms of a 1 s attempt, and the request goes to an
/// address that accepts TCP and never completes TLS.
#[tokio::test]
async fn time_running_out_while_connecting_after_a_lookup_is_transient() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script(vec![
        Reply::Stall(STALL),
        Reply::Slow(Duration::from_millis(300), 404),
    ]);
    // Accepts connections and says nothing: a TLS handshake never ends.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_port = hole.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = hole.accept().await {
            held.push(sock);
        }
    });
    let key = "rec:late-connect";
    enqueue(&db, key, payload(&rx), 2, true).await;
    let cfg = WebhookConfig {
        timeout: Duration::from_secs(1),
        ..test_webhook_config()
    };
    let w = RunningWorker::start(&db, slow_retry(), cfg);
    wait_until(WAIT, "the first attempt to end ambiguous", || async {
        attempts(&db, key).await.len() == 1
    })
    .await;
    update_past_the_door(
        &db.client().await,
        "UPDATE outbox.messages SET payload = jsonb_set(payload, '{url}', to_jsonb($2::text)) \
         WHERE message_key = $1",
        &[&key, &format!("https://127.0.0.1:{hole_port}/hook")],
    )
    .await;
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(
        attempts(&db, key).await,
        vec![
            att(1, "retry", Some("ambiguous"), None),
            att(2, "dead", Some("exhausted"), None),
        ],
        "{row:?}"
    );
    // The connection's own timeout (TCP and TLS: half the attempt's) ends it first now
    // that a request goes only with at least half the attempt's time left.
    let err = row.last_error.unwrap();
    assert!(
        err.contains("connect timed out") || err.contains("before the request"),
        "{err}"
    );
    assert_eq!(calls(&rx), [POST, GET], "the lookup was made");
}

/// A message dead `ambiguous` and then replayed by an operator is still the message whose
/// last attempt may have taken effect: the attempt after the replay looks up first, and
/// here finds that it did (the replay used to clear the class, and the request
/// went out again without asking).
#[tokio::test]
async fn a_replayed_ambiguous_message_looks_up_before_sending_again() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script(vec![Reply::Stall(STALL), Reply::Status(200)]);
    let key = "rec:replayed";
    enqueue(&db, key, payload(&rx), 1, false).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), short_timeout());
    let dead = wait_for_state(&db, key, "dead", WAIT).await;
    assert_eq!(dead.error_class.as_deref(), Some("ambiguous"));
    let id: i64 = db
        .scalar(&format!(
            "SELECT id FROM outbox.messages WHERE message_key = '{key}'"
        ))
        .await;
    db.client()
        .await
        .execute("SELECT * FROM outbox.replay(ARRAY[$1::bigint])", &[&id])
        .await
        .unwrap();
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(calls(&rx), [POST, GET], "the lookup, and no second request");
    assert_eq!(row.response.unwrap()["reconciled"], true);
}

/// Webhook settings with a 1 s timeout: room for a lookup that answers late.
fn one_second() -> WebhookConfig {
    WebhookConfig {
        timeout: Duration::from_secs(1),
        ..test_webhook_config()
    }
}

/// A lookup that answers 404 after most of the attempt's time leaves the request too
/// little to be answered in: it is not sent, and the attempt is transient (the provider
/// has just said the earlier one did not happen), so the next attempt (after the usual
/// delay) sends with the whole timeout. Before, the request went out with 100 ms left,
/// timed out, and the message went round ambiguous, looking up again, as if nothing were
/// known.
#[tokio::test]
async fn a_lookup_that_leaves_too_little_time_is_followed_by_a_plain_attempt() {
    let key = "rec:slow-lookup";
    let script = vec![
        Reply::Stall(STALL),
        Reply::Slow(Duration::from_millis(900), 404),
        Reply::Slow(Duration::from_millis(300), 200),
        Reply::Status(200),
    ];
    let (db, rx, _) = run_with(one_second(), key, script, 3, true, "delivered").await;
    assert_eq!(calls(&rx), [POST, GET, POST]);
    let history = attempts(&db, key).await;
    assert_eq!(
        history
            .iter()
            .map(|a| (a.1.as_str(), a.2.as_deref()))
            .collect::<Vec<_>>(),
        [
            ("retry", Some("ambiguous")),
            ("retry", Some("transient")),
            ("delivered", None)
        ],
        "{history:?}"
    );
}

/// After a lookup has said the earlier attempt did not happen (404), a request the guard
/// refuses (its name now resolves to a private address) is `invalid`, dead at once, as
/// for any message: nothing is unknown. Before, it counted as ambiguous, and the message
/// went round looking up again, to end dead `ambiguous`, for a person to settle what the
/// provider had already answered.
#[tokio::test]
async fn a_refused_request_after_a_404_lookup_is_invalid_not_ambiguous() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script(vec![Reply::Status(404)]);
    let key = "rec:404-refused";
    let port = rx.addr.port();
    enqueue(
        &db,
        key,
        json!({
            "url": format!("http://localhost:{port}/hook"),
            "reconcile": {"url": format!("http://127.0.0.1:{port}{LOOKUP_PATH}")},
        }),
        3,
        true,
    )
    .await;
    claim_and_abandon(&db).await;
    let cfg = WebhookConfig {
        timeout: Duration::from_millis(500),
        signing: Default::default(),
        destinations: DestinationPolicy {
            allow_private_networks: false,
            allow_hosts: HashSet::from(["127.0.0.1".to_owned()]),
        },
    };
    let w = RunningWorker::start(&db, test_worker_config("w"), cfg);
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("invalid"), "{row:?}");
    assert_eq!(row.attempts, 2, "the abandoned attempt and this one");
    assert_eq!(calls(&rx), [GET], "one lookup, and no request");
}

/// On the last attempt there is no next one to leave the request to: after a late 404 it
/// is sent in the time left (here a fast answer, delivered), not given up unsent as
/// `exhausted`.
#[tokio::test]
async fn on_the_last_attempt_a_late_404_still_sends() {
    let script = vec![
        Reply::Stall(STALL),
        Reply::Slow(Duration::from_millis(900), 404),
        Reply::Status(200),
    ];
    let (_db, rx, _) = run_with(
        one_second(),
        "rec:slow-lookup-last",
        script,
        2,
        true,
        "delivered",
    )
    .await;
    assert_eq!(calls(&rx), [POST, GET, POST]);
}

/// Once an attempt may have taken effect, a later failure proves nothing about it: attempt
/// 1 reaches the receiver and times out (ambiguous), attempt 2, the last, finds the port
/// closed (connection refused, which alone would be transient). The message ends dead
/// `ambiguous`, not `exhausted`: `confirm` takes it, and a replay of exhausted dead
/// letters (a blind resend) does not.
#[tokio::test]
async fn a_refused_connection_after_an_ambiguous_attempt_leaves_the_message_unknown() {
    let db = TestDb::new().await;
    // Accepts one connection, reads the request and never answers; then nothing listens.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/h", listener.local_addr().unwrap());
    let first = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let _ = tokio::io::AsyncReadExt::read(&mut sock, &mut buf).await;
        sock
    });
    let key = "sticky:1";
    enqueue_webhook(&db, key, &url, 2, true).await;
    let cfg = outboxd::config::WorkerConfig {
        retry: outboxd::retry::RetryPolicy {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
        },
        ..test_worker_config("w1")
    };
    let w = RunningWorker::start(&db, cfg, short_timeout());
    // The listener is gone once the first request was read: attempt 2 is refused.
    let _held_open = first.await.unwrap();
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    let history = attempts(&db, key).await;
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(history[0].2.as_deref(), Some("ambiguous"), "{history:?}");
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"), "{row:?}");
    let err = row.last_error.unwrap_or_default();
    assert!(
        err.contains("earlier attempt may have taken effect"),
        "{err}"
    );
    // Not among the exhausted dead letters a blind replay would pick.
    let exhausted: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'dead' AND error_class = 'exhausted'")
        .await;
    assert_eq!(exhausted, 0);
    // A person who checked with the provider can confirm it.
    let c = db.client().await;
    c.execute(
        "SELECT outbox.confirm(ARRAY(SELECT id FROM outbox.messages WHERE message_key = $1))",
        &[&key],
    )
    .await
    .unwrap();
    assert_eq!(row_of(&db, key).await, "delivered");
}

async fn row_of(db: &TestDb, key: &str) -> String {
    common::row(db, key).await.state
}
