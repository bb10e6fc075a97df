//! The http channel end to end: a real worker, PostgreSQL, and HTTP listeners of the test's
//! own playing providers. A Stripe-like one reads form bodies, honours `Idempotency-Key`
//! (the same key answers the same charge, `Idempotent-Replayed: true`) and offers a
//! search; it can be told to ignore the key, and to lose the answer of the first charge
//! after making it (it answers after the worker's timeout).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use common::binary::{outboxd, run_within};
use common::*;
use outboxd::deliver::Deliverers;
use outboxd::deliver::http::HttpSender;
use outboxd::deliver::http::settings::EndpointSecrets;
use outboxd::deliver::webhook::WebhookSender;
use outboxd::deliver::webhook::settings::WebhookConfig;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

/// The API key, as the worker holds it and sends it: it must never be seen anywhere else.
const API_KEY: &str = "Bearer sk_test_APIKEYMARK4242";

/// One request as the provider saw it.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }
}

#[derive(Default)]
struct ProviderState {
    seen: Vec<Seen>,
    /// Charges made: (metadata[outbox_key], the charge).
    charges: Vec<(Option<String>, Value)>,
    /// Answers by idempotency key.
    by_key: std::collections::HashMap<String, Value>,
    /// Ignore `Idempotency-Key` (a provider that takes none).
    ignore_key: bool,
    /// Answer the first charge only after this long (its answer is lost to the worker).
    lose_first: Option<Duration>,
}

/// A Stripe-like provider on 127.0.0.1.
#[derive(Clone)]
struct Provider {
    addr: std::net::SocketAddr,
    state: Arc<Mutex<ProviderState>>,
}

impl Provider {
    async fn start(ignore_key: bool, lose_first: Option<Duration>) -> Provider {
        let state = Arc::new(Mutex::new(ProviderState {
            ignore_key,
            lose_first,
            ..Default::default()
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let st = state.clone();
        let app = axum::Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let st = st.clone();
                async move { answer(st, method, uri, headers, body).await }
            },
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Provider { addr, state }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    fn charges(&self) -> usize {
        self.state.lock().unwrap().charges.len()
    }
}

async fn answer(
    st: Arc<Mutex<ProviderState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let (status, value, replayed, delay) = {
        let mut s = st.lock().unwrap();
        s.seen.push(Seen {
            method: method.clone(),
            uri: uri.clone(),
            headers: headers.clone(),
            body: body.clone(),
        });
        let authorized =
            headers.get("authorization").and_then(|v| v.to_str().ok()) == Some(API_KEY);
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if !authorized {
            (401, json!({"error": "no api key"}), false, None)
        } else if method == Method::GET && uri.path().ends_with("/charges/search") {
            let query: String = url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
                .find(|(k, _)| k == "query")
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default();
            let data: Vec<Value> = s
                .charges
                .iter()
                .filter(|(k, _)| {
                    k.as_ref()
                        .is_some_and(|k| query == format!("metadata['outbox_key']:'{k}'"))
                })
                .map(|(_, c)| c.clone())
                .collect();
            (
                200,
                json!({"object": "search_result", "data": data}),
                false,
                None,
            )
        } else if method == Method::POST && uri.path().ends_with("/charges") {
            match key
                .as_ref()
                .filter(|_| !s.ignore_key)
                .and_then(|k| s.by_key.get(k))
            {
                Some(v) => (200, v.clone(), true, None),
                None => {
                    let form: std::collections::HashMap<String, String> =
                        url::form_urlencoded::parse(&body).into_owned().collect();
                    let n = s.charges.len() + 1;
                    let charge = json!({"id": format!("ch_{n}"), "object": "charge",
                        "amount": form.get("amount"), "currency": form.get("currency")});
                    s.charges
                        .push((form.get("metadata[outbox_key]").cloned(), charge.clone()));
                    if let Some(k) = key.filter(|_| !s.ignore_key) {
                        s.by_key.insert(k, charge.clone());
                    }
                    let delay = if n == 1 { s.lose_first } else { None };
                    (200, charge, false, delay)
                }
            }
        } else if method == Method::DELETE && uri.path().starts_with("/v1/customers/") {
            (200, json!({"id": "cus_1", "deleted": true}), false, None)
        } else {
            (404, json!({"error": "not found"}), false, None)
        }
    };
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    let mut h = HeaderMap::new();
    h.insert("content-type", "application/json".parse().unwrap());
    if replayed {
        h.insert("idempotent-replayed", "true".parse().unwrap());
    }
    (StatusCode::from_u16(status).unwrap(), h, value.to_string()).into_response()
}

/// Adds endpoint `name` at `url`, its credential from secret STRIPE.
async fn add_endpoint(db: &TestDb, name: &str, url: &str, secret: Option<&str>) {
    let c = db.client().await;
    c.execute(
        "INSERT INTO outbox.endpoints (name, url, auth_secret, key_ttl, headers) \
         VALUES ($1, $2, $3, interval '24 hours', '{\"Stripe-Version\": \"2024-06-20\"}')",
        &[&name, &url, &secret],
    )
    .await
    .unwrap();
}

fn webhook_config(timeout: Duration) -> WebhookConfig {
    WebhookConfig {
        timeout,
        ..test_webhook_config()
    }
}

/// A worker with the STRIPE secret, on the http channel.
fn start(db: &TestDb, timeout: Duration) -> RunningWorker {
    start_with(db, timeout, test_worker_config("w"))
}

/// [`start`] with worker settings of the test's own.
fn start_with(db: &TestDb, timeout: Duration, cfg: outboxd::config::WorkerConfig) -> RunningWorker {
    let webhook = WebhookSender::new(&webhook_config(timeout)).unwrap();
    let secrets = EndpointSecrets::default().with("stripe", API_KEY);
    let deliverers = Deliverers {
        http: HttpSender::new(&webhook, secrets),
        webhook,
        email: None,
    };
    let cfg = outboxd::config::WorkerConfig {
        channels: vec![outboxd::model::Channel::Http],
        ..cfg
    };
    let pools = outboxd::worker::Pools::new(&db.database(), 4).unwrap();
    RunningWorker::start_with_deliverers(db, pools, cfg, deliverers)
}

async fn enqueue(db: &TestDb, key: &str, payload: Value) -> Result<i64, outboxd::EnqueueError> {
    let c = db.client().await;
    outboxd::enqueue(&c, &outboxd::NewMessage::http(key, payload))
        .await
        .map(|e| e.id)
}

fn charge(key: &str) -> Value {
    json!({"endpoint": "stripe", "path": "/v1/charges",
        "query": {"expand": ["customer"]},
        "headers": {"X-Tenant": "acme"},
        "form": {"amount": 2000, "currency": "eur", "capture": true, "description": null,
                 "metadata": {"order": 42, "outbox_key": key}},
        "reconcile": {"path": "/v1/charges/search",
                      "query": {"query": "metadata['outbox_key']:'{key}'"}, "found": "/data/0"}})
}

/// Everything the database holds about messages and attempts, as text.
async fn stored_text(db: &TestDb) -> String {
    let c = db.client().await;
    let m: Vec<String> = first_column(
        &c,
        "SELECT concat_ws(' ', last_error, response::text, payload::text) FROM outbox.messages",
    )
    .await;
    let a: Vec<String> =
        first_column(&c, "SELECT row_to_json(a)::text FROM outbox.attempts a").await;
    let e: Vec<String> =
        first_column(&c, "SELECT row_to_json(e)::text FROM outbox.endpoints e").await;
    format!("{m:?} {a:?} {e:?}")
}

fn assert_no_key(what: &str, text: &str) {
    assert!(
        !text.contains("APIKEYMARK"),
        "the API key in {what}: {text}"
    );
}

#[tokio::test]
async fn a_form_charge_carries_the_key_and_the_credential_and_keeps_the_answer() {
    let (logs, _guard) = LogCapture::install();
    let db = TestDb::new().await;
    let p = Provider::start(false, None).await;
    add_endpoint(&db, "stripe", &p.url("/api/"), Some("stripe")).await;
    enqueue(&db, "order-42:charge", charge("order-42:charge"))
        .await
        .unwrap();
    let w = start(&db, Duration::from_secs(2));
    let row = wait_for_state(&db, "order-42:charge", "delivered", WAIT).await;
    w.stop().await;

    let seen = p.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let req = &seen[0];
    assert_eq!(req.method, Method::POST);
    // The endpoint's own path kept, the query in bracket notation.
    assert_eq!(req.uri.path(), "/api/v1/charges");
    assert_eq!(req.uri.query(), Some("expand%5B0%5D=customer"));
    assert_eq!(
        req.header("content-type").as_deref(),
        Some("application/x-www-form-urlencoded")
    );
    assert_eq!(
        std::str::from_utf8(&req.body).unwrap(),
        "amount=2000&capture=true&currency=eur&metadata[order]=42\
         &metadata[outbox_key]=order-42%3Acharge"
    );
    assert_eq!(req.header("authorization").as_deref(), Some(API_KEY));
    assert_eq!(
        req.header("idempotency-key").as_deref(),
        Some("order-42:charge")
    );
    assert_eq!(req.header("stripe-version").as_deref(), Some("2024-06-20"));
    assert_eq!(req.header("x-tenant").as_deref(), Some("acme"));
    assert!(req.header("webhook-signature").is_none());
    // store_response is on by default: the provider's object is kept.
    let response = row.response.unwrap();
    assert_eq!(response["body"]["id"], "ch_1", "{response}");
    assert_eq!(response["status"], 200);

    // The same key again (a replay by an operator): the provider answers the same charge.
    let c = db.client().await;
    c.execute(
        "UPDATE outbox.messages SET state = 'pending', attempts = 0, delivered_at = NULL, \
         run_after = now() WHERE message_key = 'order-42:charge'",
        &[],
    )
    .await
    .unwrap();
    let w = start(&db, Duration::from_secs(2));
    wait_until(WAIT, "the second request", || async { p.seen().len() == 2 }).await;
    let row = wait_for_state(&db, "order-42:charge", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(p.charges(), 1, "the key protected the charge");
    assert_eq!(row.response.unwrap()["replayed"], true);

    assert_no_key("the database", &stored_text(&db).await);
    assert_no_key("the logs", &logs.text());
}

#[tokio::test]
async fn an_answer_lost_after_the_effect_is_found_by_the_lookup() {
    for ignore_key in [false, true] {
        let db = TestDb::new().await;
        let p = Provider::start(ignore_key, Some(Duration::from_secs(2))).await;
        add_endpoint(&db, "stripe", &p.url(""), Some("stripe")).await;
        let key = "order 7/charge";
        enqueue(&db, key, charge(key)).await.unwrap();
        let w = start(&db, Duration::from_millis(700));
        let row = wait_for_state(&db, key, "delivered", WAIT).await;
        w.stop().await;
        // One charge, whether or not the provider honours the key: the lookup found it.
        assert_eq!(p.charges(), 1, "ignore_key={ignore_key}");
        let seen = p.seen();
        let calls: Vec<String> = seen
            .iter()
            .map(|s| format!("{} {}", s.method, s.uri.path()))
            .collect();
        assert_eq!(
            calls,
            ["POST /v1/charges", "GET /v1/charges/search"],
            "{calls:?}"
        );
        let lookup = &seen[1];
        // {key} percent-encoded where it landed, the credential and the key sent along.
        assert_eq!(
            lookup.uri.query(),
            Some("query=metadata%5B%27outbox_key%27%5D%3A%27order+7%2Fcharge%27")
        );
        assert_eq!(lookup.header("authorization").as_deref(), Some(API_KEY));
        assert_eq!(lookup.header("idempotency-key").as_deref(), Some(key));
        let response = row.response.unwrap();
        assert_eq!(response["reconciled"], true, "{response}");
        // `found` keeps the provider's object, not the search page.
        assert_eq!(response["body"]["id"], "ch_1", "{response}");
        let history: Vec<String> = attempts(&db, key).await.into_iter().map(|a| a.1).collect();
        assert_eq!(history, ["retry", "reconciled"], "{history:?}");
    }
}

#[tokio::test]
async fn a_search_that_finds_nothing_sends_the_request() {
    let db = TestDb::new().await;
    let p = Provider::start(false, None).await;
    add_endpoint(&db, "stripe", &p.url(""), Some("stripe")).await;
    enqueue(&db, "k-1", charge("k-1")).await.unwrap();
    // As if an earlier attempt had ended ambiguous without reaching the provider.
    db.client()
        .await
        .execute(
            "UPDATE outbox.messages SET error_class = 'ambiguous' WHERE message_key = 'k-1'",
            &[],
        )
        .await
        .unwrap();
    let w = start(&db, Duration::from_secs(2));
    let row = wait_for_state(&db, "k-1", "delivered", WAIT).await;
    w.stop().await;
    let calls: Vec<String> = p
        .seen()
        .iter()
        .map(|s| format!("{} {}", s.method, s.uri.path()))
        .collect();
    assert_eq!(calls, ["GET /v1/charges/search", "POST /v1/charges"]);
    assert_eq!(p.charges(), 1);
    assert!(row.response.unwrap().get("reconciled").is_none());
}

#[tokio::test]
async fn delete_and_json_bodies() {
    let db = TestDb::new().await;
    let p = Provider::start(false, None).await;
    add_endpoint(&db, "stripe", &p.url(""), Some("stripe")).await;
    enqueue(
        &db,
        "del-1",
        json!({"endpoint": "stripe", "method": "DELETE", "path": "/v1/customers/cus_1"}),
    )
    .await
    .unwrap();
    enqueue(
        &db,
        "json-1",
        json!({"endpoint": "stripe", "method": "PUT", "path": "/v1/things",
        "json": {"amount": 1.50, "items": [1, 2]}, "store_response": false}),
    )
    .await
    .unwrap();
    let w = start(&db, Duration::from_secs(2));
    let del = wait_for_state(&db, "del-1", "delivered", WAIT).await;
    let put = wait_for_state(&db, "json-1", "dead", WAIT).await;
    w.stop().await;
    assert_eq!(del.response.unwrap()["body"]["deleted"], true);
    // The provider has no /v1/things: 404 is permanent, and no body was kept.
    assert_eq!(put.error_class.as_deref(), Some("permanent"));
    let seen = p.seen();
    let d = seen.iter().find(|s| s.method == Method::DELETE).unwrap();
    assert!(d.body.is_empty() && d.header("content-type").is_none());
    let j = seen.iter().find(|s| s.method == Method::PUT).unwrap();
    assert_eq!(
        j.header("content-type").as_deref(),
        Some("application/json")
    );
    let body: Value = serde_json::from_slice(&j.body).unwrap();
    assert_eq!(body, json!({"amount": 1.50, "items": [1, 2]}));
}

#[tokio::test]
async fn hostile_paths_never_leave_the_endpoint() {
    let db = TestDb::new().await;
    let p = Provider::start(false, None).await;
    add_endpoint(&db, "stripe", &p.url("/api"), Some("stripe")).await;
    let paths = [
        "//evil.example/x",
        "/\\evil.example/x",
        "/@evil.example",
        "/%2e%2e/admin",
        "/..%2F../admin",
        "/../admin",
        "/a\u{1}b",
        "/a\nHost: evil.example",
        "/a?token=x",
        "/a#frag",
        "evil.example",
    ];
    let mut enqueued = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let key = format!("hostile-{i}");
        match enqueue(&db, &key, json!({"endpoint": "stripe", "path": path})).await {
            Ok(_) => enqueued.push((key, *path)),
            // Refused at the door is as good: nothing will ever be sent.
            Err(outboxd::EnqueueError::Invalid { .. }) => {}
            Err(e) => panic!("{path:?}: {e}"),
        }
    }
    assert!(!enqueued.is_empty());
    let w = start(&db, Duration::from_secs(2));
    let mut refused = Vec::new();
    for (key, path) in &enqueued {
        let row = wait_for_state(&db, key, "dead", WAIT).await;
        if row.error_class.as_deref() == Some("invalid") {
            refused.push(*path);
            assert_eq!(attempts(&db, key).await[0].3, None, "{path:?}: no answer");
        } else {
            // What stays a path under the endpoint's reaches the provider, which has no
            // such thing: 404.
            assert_eq!(row.error_class.as_deref(), Some("permanent"), "{path:?}");
        }
    }
    w.stop().await;
    let seen = p.seen();
    for s in &seen {
        assert!(
            s.uri.path().starts_with("/api/"),
            "a request left the endpoint's path: {}",
            s.uri
        );
        assert!(!s.uri.path().contains("admin"), "{}", s.uri);
        assert!(s.uri.query().is_none(), "{}", s.uri);
    }
    // Every path that would climb out, carry a query, or hide a character is refused
    // before any request (by the door or by the worker).
    for path in [
        "/%2e%2e/admin",
        "/..%2F../admin",
        "/../admin",
        "/a\u{1}b",
        "/a?token=x",
    ] {
        assert!(
            !enqueued.iter().any(|(_, p)| *p == path) || refused.contains(&path),
            "{path:?} was sent"
        );
    }
    assert!(seen.len() <= 3, "{seen:?}");
}

#[tokio::test]
async fn a_secret_this_worker_lacks_kills_the_message_naming_it_and_sends_nothing() {
    let (logs, _guard) = LogCapture::install();
    let db = TestDb::new().await;
    let p = Provider::start(false, None).await;
    add_endpoint(&db, "resend", &p.url(""), Some("resend_key")).await;
    enqueue(
        &db,
        "mail-1",
        json!({"endpoint": "resend", "path": "/emails", "json": {"to": "a@x.example"}}),
    )
    .await
    .unwrap();
    let w = start(&db, Duration::from_secs(2));
    let row = wait_for_state(&db, "mail-1", "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("invalid"));
    let error = row.last_error.unwrap();
    assert!(error.contains("RESEND_KEY"), "{error}");
    assert!(error.contains("OUTBOXD_SECRET_RESEND_KEY"), "{error}");
    assert!(p.seen().is_empty());
    assert_no_key("the database", &stored_text(&db).await);
    assert_no_key("the logs", &logs.text());
}

#[tokio::test]
async fn endpoint_changes_are_seen_without_a_restart() {
    let db = TestDb::new().await;
    let p = Provider::start(false, None).await;
    let w = start(&db, Duration::from_secs(2));
    // Made after the worker started: its first message is not refused as unknown.
    add_endpoint(&db, "stripe", &p.url(""), Some("stripe")).await;
    enqueue(&db, "late-1", charge("late-1")).await.unwrap();
    wait_for_state(&db, "late-1", "delivered", WAIT).await;
    // A fixed header changed: within a few seconds every request carries the new one.
    db.client()
        .await
        .execute(
            "UPDATE outbox.endpoints SET headers = '{\"Stripe-Version\": \"2025-01-01\"}', \
             updated_at = now() WHERE name = 'stripe'",
            &[],
        )
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    loop {
        n += 1;
        let key = format!("later-{n}");
        enqueue(&db, &key, charge(&key)).await.unwrap();
        wait_for_state(&db, &key, "delivered", WAIT).await;
        let last = p.seen().last().cloned().unwrap();
        if last.header("stripe-version").as_deref() == Some("2025-01-01") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the change was not seen within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Moved to another provider: the next message goes there, not refused as misnamed.
    let q = Provider::start(false, None).await;
    db.client()
        .await
        .execute(
            "UPDATE outbox.endpoints SET url = $1 WHERE name = 'stripe'",
            &[&q.url("")],
        )
        .await
        .unwrap();
    enqueue(&db, "moved-1", charge("moved-1")).await.unwrap();
    wait_for_state(&db, "moved-1", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(q.seen().len(), 1);
}

/// The daemon's start: an empty secret, an empty file, or both ways of one name stop it
/// with exit 2 and one line naming the variable, never the value.
#[tokio::test]
async fn bad_secrets_stop_the_start() {
    let db = TestDb::new().await;
    let dir = std::env::temp_dir().join(format!("outboxd-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty");
    std::fs::write(&empty, "\n").unwrap();
    let full = dir.join("full");
    std::fs::write(&full, format!("{API_KEY}\n")).unwrap();
    let empty = empty.to_str().unwrap().to_owned();
    let full = full.to_str().unwrap().to_owned();
    for (env, needle) in [
        (
            vec![("OUTBOXD_SECRET_STRIPE", "")],
            "OUTBOXD_SECRET_STRIPE is set but empty",
        ),
        (
            vec![("OUTBOXD_SECRET_STRIPE_FILE", empty.as_str())],
            "OUTBOXD_SECRET_STRIPE_FILE: the file",
        ),
        (
            vec![
                ("OUTBOXD_SECRET_STRIPE", API_KEY),
                ("OUTBOXD_SECRET_STRIPE_FILE", full.as_str()),
            ],
            "are both set",
        ),
    ] {
        let mut cmd = outboxd(Some(&db.url()));
        cmd.args(["run", "--drain"]);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let out = run_within(&mut cmd, Duration::from_secs(20));
        assert_eq!(out.code, Some(2), "{env:?}: {}", out.stderr);
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains(needle), "{lines:?}");
        assert_no_key("stderr", &out.stderr);
    }
    // From a file, the daemon starts, sends a charge with the key read from it, and
    // drains; its every log line at trace level holds no trace of the key.
    let p = Provider::start(false, None).await;
    add_endpoint(&db, "stripe", &p.url(""), Some("stripe")).await;
    enqueue(&db, "bin-1", charge("bin-1")).await.unwrap();
    let mut cmd = outboxd(Some(&db.url()));
    cmd.args(["run", "--drain"])
        .env("OUTBOXD_SECRET_STRIPE_FILE", &full)
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("RUST_LOG", "trace");
    // The provider answers on this thread's runtime: the daemon is waited for on another.
    let out = tokio::task::spawn_blocking(move || run_within(&mut cmd, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(row(&db, "bin-1").await.state, "delivered");
    assert_eq!(
        p.seen()[0].header("authorization").as_deref(),
        Some(API_KEY)
    );
    assert_no_key(
        "the daemon's output",
        &format!("{}{}", out.stdout, out.stderr),
    );
    assert_no_key("the database", &stored_text(&db).await);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `{:?}` of what holds the secret, and `show`'s redaction of an http payload.
#[test]
fn debug_and_show_keep_the_secret_and_the_values_out() {
    let secrets = EndpointSecrets::default().with("stripe", API_KEY);
    let webhook = WebhookSender::new(&test_webhook_config()).unwrap();
    let sender = HttpSender::new(&webhook, secrets.clone());
    for shown in [
        format!("{secrets:?}"),
        format!("{sender:?}"),
        format!("{sender:#?}"),
    ] {
        assert_no_key("a Debug", &shown);
    }
    let payload = json!({"endpoint": "stripe", "method": "POST", "path": "/v1/customers/cus_PATHMARK",
        "query": {"q": "QUERYMARK"}, "form": {"card": "FORMMARK"}, "headers": {"X-Token": "HEADERMARK"}});
    let shown =
        outboxd::deliver::redact_payload(outboxd::model::Channel::Http, payload).to_string();
    for mark in ["PATHMARK", "QUERYMARK", "FORMMARK", "HEADERMARK"] {
        assert!(!shown.contains(mark), "{shown}");
    }
    assert!(
        shown.contains("stripe") && shown.contains("X-Token"),
        "{shown}"
    );
}

/// After an ambiguous attempt, once the endpoint's `key_ttl` has passed since the first
/// attempt, a message without a lookup is not sent again: the provider may have forgotten
/// the key. It is dead, class `ambiguous`, its error naming the key window.
#[tokio::test]
async fn no_blind_resend_once_the_key_window_has_closed() {
    let db = TestDb::new().await;
    let p = Provider::start(false, Some(Duration::from_secs(2))).await;
    add_endpoint(&db, "stripe", &p.url(""), Some("stripe")).await;
    db.client()
        .await
        .execute(
            "UPDATE outbox.endpoints SET key_ttl = interval '1 second'",
            &[],
        )
        .await
        .unwrap();
    let mut payload = charge("ttl-1");
    payload.as_object_mut().unwrap().remove("reconcile");
    enqueue(&db, "ttl-1", payload).await.unwrap();
    // The retry comes after the window (1 s) has closed.
    let cfg = outboxd::config::WorkerConfig {
        retry: outboxd::retry::RetryPolicy {
            base: Duration::from_millis(1500),
            max: Duration::from_millis(1500),
        },
        ..test_worker_config("w")
    };
    let w = start_with(&db, Duration::from_millis(700), cfg);
    let row = wait_for_state(&db, "ttl-1", "dead", WAIT).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"));
    let error = row.last_error.unwrap();
    assert!(error.contains("key window"), "{error}");
    assert_eq!(p.seen().len(), 1, "one request, never a blind second");
    let history: Vec<(String, Option<String>)> = attempts(&db, "ttl-1")
        .await
        .into_iter()
        .map(|a| (a.1, a.2))
        .collect();
    assert_eq!(
        history,
        [
            ("retry".to_owned(), Some("ambiguous".to_owned())),
            ("dead".to_owned(), Some("ambiguous".to_owned()))
        ]
    );
}

/// `found` on a webhook's lookup: a search page that answers 200 with an empty list means
/// "it did not happen", and the request is sent in the same attempt; one that names the
/// operation settles it, and `response.body` keeps the operation, not the page.
#[tokio::test]
async fn a_webhook_lookup_with_found_reads_the_answer_not_the_status() {
    use common::receiver::{Receiver, Reply};
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let c = db.client().await;
    for (key, page, settled) in [
        ("wh-empty", json!({"data": []}), false),
        ("wh-found", json!({"data": [{"id": "op_1"}]}), true),
    ] {
        let payload = json!({"url": rx.url("/hook"), "body": {"n": 1}, "store_response": true,
            "reconcile": {"url": rx.url("/search"), "found": "/data/0"}});
        outboxd::enqueue(&c, &outboxd::NewMessage::webhook(key, payload))
            .await
            .unwrap();
        c.execute(
            "UPDATE outbox.messages SET error_class = 'ambiguous' WHERE message_key = $1",
            &[&key],
        )
        .await
        .unwrap();
        rx.script([Reply::Body(
            200,
            Some("application/json"),
            page.to_string().into_bytes(),
        )]);
        let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
        let row = wait_for_state(&db, key, "delivered", WAIT).await;
        w.stop().await;
        let response = row.response.unwrap();
        let calls: Vec<String> = rx
            .requests_for(key)
            .iter()
            .map(|r| format!("{} {}", r.method, r.uri.path()))
            .collect();
        if settled {
            assert_eq!(response["reconciled"], true, "{response}");
            assert_eq!(response["body"], json!({"id": "op_1"}), "{response}");
            assert_eq!(calls, ["GET /search"]);
        } else {
            assert!(response.get("reconciled").is_none(), "{response}");
            assert_eq!(calls, ["GET /search", "POST /hook"]);
        }
    }
}
