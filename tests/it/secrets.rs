//! No secret ever leaves through logs or the database: the real binary, every log line of
//! every crate (`RUST_LOG=trace`), over messages that take every failure path.
//!
//! Each message carries a secret URL path, query token and userinfo, a secret body and a
//! secret header value; the worker has a webhook signing secret and a database URL with a
//! password (trust authentication ignores it). None of them may appear in the process's
//! stdout or stderr, in `outbox.messages.last_error` or `response`, or in
//! `outbox.attempts.error`, nor in what the operator commands print.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::binary::{Output, outboxd, run_within};
use common::receiver::{Receiver, Reply};
use common::*;
use serde_json::{Value, json};

const DB_PASSWORD: &str = "DBPASSWORD123";
/// Markers planted in each message (suffixed with the message's name).
const PATH_MARK: &str = "SECRETPATH";
const QUERY_MARK: &str = "QUERYTOKEN";
const BODY_MARK: &str = "BODYMARKER";
const HEADER_MARK: &str = "HEADERVALUE";
const USERINFO_MARK: &str = "USERINFOSECRET";
/// The body of a response kept by `"store_response": true`: stored in `response.body`,
/// which is its place, and never logged (contract: "Never logged").
const RESPONSE_MARK: &str = "STOREDRESPONSEBODY";

/// The Standard Webhooks vector's secret, its base64 key, and the key bytes as Rust's
/// Debug would print them.
fn webhook_secret() -> (String, String) {
    let v: Value =
        serde_json::from_str(include_str!("../data/standard-webhooks-vector.json")).unwrap();
    let secret = v["secret"].as_str().unwrap().to_owned();
    let b64 = secret.strip_prefix("whsec_").unwrap().to_owned();
    (secret, b64)
}

/// Every string that must never be seen.
fn forbidden() -> Vec<String> {
    let (secret, b64) = webhook_secret();
    let key = outboxd::deliver::webhook::settings::parse_webhook_secret(&secret).unwrap();
    let debug_bytes = format!("{:?}", &key[..6]);
    let debug_bytes = debug_bytes.trim_end_matches(']').to_owned();
    vec![
        PATH_MARK.into(),
        QUERY_MARK.into(),
        BODY_MARK.into(),
        HEADER_MARK.into(),
        USERINFO_MARK.into(),
        DB_PASSWORD.into(),
        b64[..12].to_owned(), // any echo of the key, even a truncated one
        secret,
        b64,
        debug_bytes, // "[1, 2, 3, 4, 5, 6": the key as a byte vector
    ]
}

/// Lines of `text` containing any forbidden string, with the string found.
fn leaks(text: &str) -> Vec<String> {
    let forbidden = forbidden();
    text.lines()
        .filter_map(|l| {
            forbidden
                .iter()
                .find(|f| l.contains(f.as_str()))
                .map(|f| format!("[{f}] {l}"))
        })
        .collect()
}

/// The database URL with a password added.
fn url_with_password(db: &TestDb) -> String {
    let mut url = url::Url::parse(&db.url()).unwrap();
    if url.username().is_empty() {
        url.set_username("postgres").unwrap();
    }
    url.set_password(Some(DB_PASSWORD)).unwrap();
    url.to_string()
}

/// A payload to `base` (`http://127.0.0.1:PORT`) carrying every kind of secret.
fn secret_payload(base: &str, name: &str) -> Value {
    let url = base.replacen(
        "http://",
        &format!("http://hookuser:{USERINFO_MARK}-{name}@"),
        1,
    );
    json!({
        "url": format!("{url}/hooks/{PATH_MARK}-{name}/x?token={QUERY_MARK}-{name}&a=1"),
        "headers": {"X-Api-Key": format!("{HEADER_MARK}-{name}"), "Authorization": format!("Bearer {HEADER_MARK}-{name}-auth")},
        "body": {"secret": format!("{BODY_MARK}-{name}"), "nested": [format!("{BODY_MARK}-{name}-2")]},
    })
}

/// Runs the binary to its end (bounded), with a clean environment plus `envs`.
fn run_binary(args: &[&str], envs: &[(&str, String)], timeout: Duration) -> Output {
    let mut cmd = outboxd(None);
    cmd.args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    run_within(&mut cmd, timeout)
}

/// What one run over every failure path left behind.
struct Scenario {
    db: TestDb,
    outputs: Vec<(String, Output)>,
}

/// Enqueues one message per failure path (one of them through `outboxd enqueue`), runs
/// `outboxd run --drain` with `rust_log` (`trace` and more) until nothing is left, then
/// runs the operator commands. Checks that every path was really taken.
async fn scenario(log_format: &str, rust_log: &str) -> Scenario {
    let db = TestDb::new().await;
    let db_url = url_with_password(&db);
    let (secret, _) = webhook_secret();
    let env = |extra: &[(&'static str, String)]| -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("DATABASE_URL", db_url.clone()),
            ("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true".to_owned()),
            ("OUTBOXD_WEBHOOK_SECRET", secret.clone()),
            ("OUTBOXD_LOG_FORMAT", log_format.to_owned()),
            ("RUST_LOG", rust_log.to_owned()),
        ];
        v.extend(extra.iter().cloned());
        v
    };

    let ok = Receiver::start().await;
    let flaky = Receiver::start().await;
    flaky.script([Reply::WithHeaders(503, vec![("retry-after", "0".into())])]);
    let bad = Receiver::start().await;
    bad.set_default(Reply::Status(400));
    let stall = Receiver::start().await;
    stall.set_default(Reply::Stall(Duration::from_secs(3)));
    let stored = Receiver::start().await;
    stored.set_default(Reply::Body(
        200,
        Some("application/json"),
        format!("{{\"receipt\":\"{RESPONSE_MARK}\"}}").into_bytes(),
    ));
    let refused = format!("http://127.0.0.1:{CLOSED_PORT}");
    let base = |rx: &Receiver| format!("http://{}", rx.addr);

    let mut outputs = Vec::new();
    // Through the binary, also under RUST_LOG=trace.
    let payload = secret_payload(&base(&ok), "ok").to_string();
    let out = run_binary(
        &[
            "enqueue",
            "--key",
            "leak:ok",
            "--channel",
            "webhook",
            "--payload",
            &payload,
        ],
        &env(&[]),
        Duration::from_secs(20),
    );
    assert_eq!(out.code, Some(0), "enqueue: {}", out.stderr);
    outputs.push(("enqueue".to_owned(), out));

    let c = db.client().await;
    let msgs = [
        ("leak:503", secret_payload(&base(&flaky), "503"), 3, true),
        ("leak:400", secret_payload(&base(&bad), "400"), 3, true),
        (
            "leak:stall",
            secret_payload(&base(&stall), "stall"),
            2,
            true,
        ),
        ("leak:refused", secret_payload(&refused, "refused"), 2, true),
    ];
    let mut keep = secret_payload(&base(&stored), "stored");
    keep["store_response"] = json!(true);
    let msgs = msgs.into_iter().chain([("leak:stored", keep, 1, true)]);
    for (key, payload, max, amb) in msgs {
        let m = outboxd::NewMessage::webhook(key, payload)
            .max_attempts(max)
            .retry_ambiguous(amb);
        outboxd::enqueue(&c, &m).await.unwrap();
    }
    // Invalid payloads: a bad method, and a header value with CR/LF around the secret.
    let mut inv = secret_payload(&base(&ok), "invalid");
    inv["method"] = json!("GET");
    outboxd::enqueue(&c, &outboxd::NewMessage::webhook("leak:invalid", inv))
        .await
        .unwrap();
    let mut inj = secret_payload(&base(&ok), "crlf");
    inj["headers"]["X-Api-Key"] = json!(format!("x\r\nX-Leak: {HEADER_MARK}-crlf"));
    outboxd::enqueue(&c, &outboxd::NewMessage::webhook("leak:crlf", inj))
        .await
        .unwrap();

    let out = run_binary(
        &[
            "run",
            "--drain",
            "--webhook-timeout",
            "500ms",
            "--lease",
            "5s",
            "--retry-base",
            "100ms",
            "--retry-max",
            "1s",
            "--poll-interval",
            "100ms",
            "--worker-id",
            "leak-test",
        ],
        &env(&[]),
        Duration::from_secs(60),
    );
    assert_eq!(
        out.code,
        Some(0),
        "run --drain exit code; stderr tail {:?}",
        {
            let l: Vec<&str> = out.stderr.lines().rev().take(10).collect();
            l
        }
    );
    let run_log = out.stderr.clone();
    // RUST_LOG=trace really reached the dependencies.
    assert!(
        out.stderr.contains("TRACE") || out.stderr.contains("\"level\":\"TRACE\""),
        "no trace lines at all"
    );
    for dep in ["tokio_postgres", "hyper_util"] {
        assert!(out.stderr.contains(dep), "no {dep} lines in the trace");
    }
    let shown: Vec<&str> = run_log
        .lines()
        .filter(|l| l.contains(RESPONSE_MARK))
        .collect();
    assert!(
        shown.is_empty(),
        "a stored response body in the log: {shown:?}"
    );
    outputs.push(("run".to_owned(), out));

    // Every path was taken.
    let expect = [
        ("leak:ok", "delivered", None, 1),
        ("leak:stored", "delivered", None, 1),
        ("leak:503", "delivered", None, 2),
        ("leak:400", "dead", Some("permanent"), 1),
        ("leak:stall", "dead", Some("ambiguous"), 2),
        ("leak:refused", "dead", Some("exhausted"), 2),
        ("leak:invalid", "dead", Some("invalid"), 1),
        ("leak:crlf", "dead", Some("invalid"), 1),
    ];
    for (key, state, class, attempts) in expect {
        let r = row(&db, key).await;
        assert_eq!(
            (r.state.as_str(), r.error_class.as_deref(), r.attempts),
            (state, class, attempts),
            "{key}: {r:?}"
        );
    }
    assert_eq!(ok.requests().len(), 1);
    assert_eq!(stored.requests().len(), 1);
    // The body was kept (so the completion really carried it), and the run's trace,
    // in which tokio-postgres logs a prepared statement's parameters at debug, shows
    // none of it.
    let kept: String = db
        .scalar("SELECT response->'body'->>'receipt' FROM outbox.messages WHERE message_key = 'leak:stored'")
        .await;
    assert_eq!(kept, RESPONSE_MARK);
    assert_eq!(flaky.requests().len(), 2);
    assert_eq!(bad.requests().len(), 1);
    assert_eq!(stall.requests().len(), 2);
    // The secret was configured: the delivery is signed with the vector's key.
    let req = &ok.requests()[0];
    let (secret, _) = webhook_secret();
    let key = outboxd::deliver::webhook::settings::parse_webhook_secret(&secret).unwrap();
    let ts: u64 = req.header("webhook-timestamp").unwrap().parse().unwrap();
    assert_eq!(
        req.header("webhook-signature").unwrap(),
        outboxd::deliver::webhook::signing::sign(&key, "leak:ok", ts, &req.body)
    );
    // The userinfo was honoured as Basic auth, so it was really in play.
    assert!(req.header("authorization").is_some());

    // Operator commands over the same rows.
    for args in [
        vec!["status", "--json"],
        vec!["dead"],
        vec!["dead", "--json"],
        vec!["show", "leak:400"],
        vec!["show", "leak:crlf", "--json"],
    ] {
        let out = run_binary(&args, &env(&[]), Duration::from_secs(20));
        assert_eq!(out.code, Some(0), "{args:?}: {}", out.stderr);
        outputs.push((args.join(" "), out));
    }
    Scenario { db, outputs }
}

/// Asserts no forbidden string in the database's error and response columns.
async fn assert_database_clean(db: &TestDb) {
    let c = db.client().await;
    let mut found = Vec::new();
    for sql in [
        "SELECT message_key, coalesce(last_error, '') FROM outbox.messages",
        "SELECT message_key, coalesce(response::text, '') FROM outbox.messages",
        "SELECT m.message_key, coalesce(a.error, '') FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id",
    ] {
        for r in c.query(sql, &[]).await.unwrap() {
            let key: String = r.get(0);
            let text: String = r.get(1);
            for l in leaks(&text) {
                found.push(format!("{sql}: {key}: {l}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "secrets in the database:\n{}",
        found.join("\n")
    );
    // The columns were written at all (the check is not vacuous).
    let errors: i64 = db
        .scalar("SELECT count(*) FROM outbox.attempts WHERE error IS NOT NULL")
        .await;
    assert!(errors >= 6, "{errors} attempt errors recorded");
}

fn assert_outputs_clean(s: &Scenario, skip: &[&str]) {
    let mut found = Vec::new();
    for (what, out) in &s.outputs {
        if skip.contains(&what.as_str()) {
            continue;
        }
        for (stream, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            for l in leaks(text) {
                let mut l = l;
                l.truncate(400);
                found.push(format!("{what} {stream}: {l}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "{} leaking lines:\n{}",
        found.len(),
        found.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_in_trace_logs_text_or_in_the_database() {
    let s = scenario("text", "trace").await;
    assert_database_clean(&s.db).await;
    // `show` prints a webhook's body to the operator on purpose; its header values and the
    // URL's user info, path and query are redacted, which is checked below.
    assert_outputs_clean(&s, &["show leak:400", "show leak:crlf --json"]);
    for (what, out) in &s.outputs {
        if what.starts_with("show") {
            // Header values, the URL's user info, path and query are redacted.
            for mark in [HEADER_MARK, USERINFO_MARK, QUERY_MARK, PATH_MARK] {
                assert!(
                    !out.stdout.contains(mark),
                    "{what}: {mark} in {}",
                    out.stdout
                );
            }
            assert!(!out.stdout.contains(DB_PASSWORD), "{what}");
            assert!(out.stdout.contains("[redacted]"), "{what}: {}", out.stdout);
            // The operator sees the body on purpose; that the detector finds it there
            // shows it would find it anywhere else.
            assert!(
                !leaks(&out.stdout).is_empty(),
                "{what}: detector self-check"
            );
        }
    }
}

/// Also with a directive that names a field: more specific than the one outboxd adds for
/// tokio-postgres' query events, it used to let their parameters (stored bodies) through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_in_trace_logs_json() {
    let s = scenario("json", "trace,tokio_postgres::query[{message}]=trace").await;
    assert_database_clean(&s.db).await;
    assert_outputs_clean(&s, &["show leak:400", "show leak:crlf --json"]);
}

/// (arguments, environment, expected exit code)
type ConfigCase = (Vec<&'static str>, Vec<(&'static str, String)>, i32);

/// Failing commands echo neither the database password nor the webhook secret.
#[test]
fn configuration_errors_do_not_echo_secrets() {
    let (secret, _) = webhook_secret();
    let cases: Vec<ConfigCase> = vec![
        (
            vec!["status"],
            vec![(
                "DATABASE_URL",
                format!("postgres://postgres:{DB_PASSWORD}@127.0.0.1:notaport/db"),
            )],
            2,
        ),
        (
            vec!["status"],
            vec![(
                "DATABASE_URL",
                format!(
                    "postgres://postgres:{DB_PASSWORD}@127.0.0.1:{CLOSED_PORT}/db?connect_timeout=2"
                ),
            )],
            1,
        ),
        (
            vec!["status"],
            vec![(
                "DATABASE_URL",
                format!(
                    "postgres://postgres:{DB_PASSWORD}@127.0.0.1:{CLOSED_PORT}/db?connect_timeout=2&sslmode=bogus"
                ),
            )],
            2,
        ),
        (
            vec!["run"],
            vec![
                (
                    "DATABASE_URL",
                    format!("postgres://postgres:{DB_PASSWORD}@127.0.0.1:{CLOSED_PORT}/db"),
                ),
                // A secret one character short of valid base64.
                (
                    "OUTBOXD_WEBHOOK_SECRET",
                    secret[..secret.len() - 1].to_owned(),
                ),
            ],
            2,
        ),
        (
            vec!["run"],
            vec![
                (
                    "DATABASE_URL",
                    format!("postgres://postgres:{DB_PASSWORD}@127.0.0.1:{CLOSED_PORT}/db"),
                ),
                // The base64 key without its prefix.
                (
                    "OUTBOXD_WEBHOOK_SECRET",
                    secret["whsec_".len()..].to_owned(),
                ),
            ],
            2,
        ),
    ];
    for (args, mut envs, code) in cases {
        envs.push(("RUST_LOG", "trace".to_owned()));
        let out = run_binary(&args, &envs, Duration::from_secs(20));
        assert_eq!(out.code, Some(code), "{args:?} {envs:?}: {}", out.stderr);
        let found: Vec<String> = leaks(&out.stderr)
            .into_iter()
            .chain(leaks(&out.stdout))
            .collect();
        assert!(found.is_empty(), "{args:?}: {found:?}");
    }
}

/// `outboxd show` (text and `--json`) and `outboxd dead` print a webhook URL as the logs
/// name it (scheme, host and port: no user name, password, path or query), an unparseable
/// URL not at all, and nothing of an e-mail's addresses, subject or body (counts only).
#[tokio::test]
async fn show_and_dead_print_no_url_userinfo_path_or_query_and_no_email_content() {
    const MARKS: [&str; 13] = [
        "USERNAMETOKEN",
        "URLPATHSECRET",
        "URLQUERYSECRET",
        "UNPARSEABLESECRET",
        "FROMSECRET",
        "TOSECRET",
        "CCSECRET",
        "BCCSECRET",
        "REPLYSECRET",
        "SUBJECTSECRET",
        "TEXTSECRET",
        "HTMLSECRET",
        "EMAILHEADERSECRET",
    ];
    let db = TestDb::new().await;
    let c = db.client().await;
    let messages = [
        outboxd::NewMessage::webhook(
            "redact:userinfo",
            json!({"url": "http://USERNAMETOKEN@hooks.example.com:8443/p/URLPATHSECRET?q=URLQUERYSECRET#URLPATHSECRET", "body": {"n": 1}}),
        ),
        outboxd::NewMessage::webhook(
            "redact:unparseable",
            json!({"url": "http://hooks example.com/x?token=UNPARSEABLESECRET", "body": {"n": 2}}),
        ),
        outboxd::NewMessage::email(
            "redact:email",
            json!({
                "from": "Shop <FROMSECRET@example.com>",
                "to": ["TOSECRET@example.org", "Other <TOSECRET2@example.net>"],
                "cc": ["CCSECRET@example.org"],
                "bcc": ["BCCSECRET@example.org"],
                "reply_to": "REPLYSECRET@example.com",
                "subject": "Your order SUBJECTSECRET",
                "text": "Hello TEXTSECRET",
                "html": "<p>HTMLSECRET</p>",
                "headers": {"X-Trace": "EMAILHEADERSECRET"},
            }),
        ),
    ];
    let mut ids = Vec::new();
    for m in &messages {
        ids.push(outboxd::enqueue(&c, m).await.unwrap().id);
    }
    // Dead, as a worker would have left them, so that `dead` lists them.
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'dead', attempts = 1, error_class = 'invalid', \
         last_error = 'payload rejected', dead_at = now()",
    )
    .await
    .unwrap();

    let mut runs = vec![
        vec!["dead".to_owned()],
        vec!["dead".into(), "--json".into()],
    ];
    for (m, id) in messages.iter().zip(&ids) {
        for target in [m.key().to_owned(), id.to_string()] {
            runs.push(vec!["show".into(), target.clone()]);
            runs.push(vec!["show".into(), target, "--json".into()]);
        }
    }
    let mut shown = String::new();
    for args in &runs {
        let out = run_binary(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &[("DATABASE_URL", db.url())],
            Duration::from_secs(20),
        );
        assert_eq!(out.code, Some(0), "{args:?}: {}", out.stderr);
        for mark in MARKS {
            assert!(
                !out.stdout.contains(mark) && !out.stderr.contains(mark),
                "{args:?}: {mark} printed:\n{}{}",
                out.stdout,
                out.stderr
            );
        }
        if args[0] == "show" {
            shown.push_str(&out.stdout);
        }
    }
    // What an operator still sees: the destination's host and port, and that there was
    // more (redacted), so the check above is not vacuous.
    assert!(shown.contains("http://hooks.example.com:8443/"), "{shown}");
    assert!(shown.contains("[redacted"), "{shown}");
    assert!(shown.contains("redact:email"), "{shown}");
}

/// `{:?}` of every value that holds a secret, a payload or a webhook URL: an application
/// or a later log line may print one, so none may show what it holds. Each also shows
/// something (a host, a header's name, a length), so the check is not vacuous.
#[test]
fn debug_of_what_holds_secrets_shows_none() {
    use outboxd::deliver::webhook::{payload, settings, urls::UrlCache};
    const SMTP_PASSWORD: &str = "SMTPPASSWORD42";
    const CONSOLE_TOKEN: &str = "CONSOLETOKEN-0123456789abcdef";
    let (secret, _) = webhook_secret();
    let db_url = format!("postgres://app:{DB_PASSWORD}@db.example/app");
    let smtp_url = format!("smtp://mailer:{SMTP_PASSWORD}@smtp.example:587");
    let named = vec![(
        "OUTBOXD_WEBHOOK_SECRET_BILLING".to_owned(),
        outboxd::support::Secret::from(secret.as_str()),
    )];
    let text = secret_payload("http://hooks.example.com:8443", "debug").to_string();

    let env = outboxd::cli::Env {
        database_url: Some(db_url.into()),
        smtp_url: Some(smtp_url.as_str().into()),
        webhook_secret: Some(secret.as_str().into()),
        named_webhook_secrets: named.clone(),
        console_token: Some(CONSOLE_TOKEN.into()),
        ..Default::default()
    };
    let input = outboxd::config::assemble::RunInput {
        concurrency: 64,
        batch_size: 100,
        poll_interval: Duration::from_secs(1),
        lease: Duration::from_secs(60),
        webhook_timeout: Duration::from_secs(10),
        smtp_timeout: Duration::from_secs(30),
        retry_base: Duration::from_secs(5),
        retry_max: Duration::from_secs(900),
        retention: Duration::from_secs(7 * 86400),
        channels: None,
        worker_id: None,
        drain: false,
        shutdown_grace: Duration::from_secs(30),
        breaker_threshold: 5,
        breaker_cooldown: Duration::from_secs(30),
        smtp_url: Some(smtp_url.into()),
        webhook_secret: Some(secret.as_str().into()),
        named_webhook_secrets: named.clone(),
        allow_private_networks: None,
        webhook_allow_hosts: None,
        email_message_id_domain: None,
        host_concurrency: 0,
        webhook_rate_limits: None,
        endpoint_secrets: Vec::new(),
    };
    let keys = settings::SigningKeys::from_values(Some(&secret), &named).unwrap();
    let urls = UrlCache::default();
    let read = payload::read(&text).unwrap();
    urls.parse(read.url().unwrap()).unwrap();
    let request = payload::check(&read, None).unwrap();
    let webhook = Some(payload::read(&text).unwrap());
    let claimed = outboxd::claim::Claimed {
        id: 1,
        key: "order-1".into(),
        channel: outboxd::model::Channel::Webhook,
        payload: text.clone(),
        attempt: 1,
        max_attempts: 3,
        retry_ambiguous: true,
        lease_token: uuid::Uuid::nil(),
        previous_class: None,
        reconcile: false,
        destination: Some("hooks.example.com:8443".into()),
        lookup_destination: None,
        key_expires_at: None,
    };

    let outgoing = outboxd::deliver::Outgoing {
        key: "order-1",
        payload: &text,
        webhook: webhook.as_ref(),
        destination: claimed.destination.as_deref(),
        lookup_destination: None,
        previous: None,
        last_attempt: false,
        limits: None,
        key_window_closed: false,
    };
    let email_text = json!({
        "from": "Shop <shop@example.com>",
        "to": [format!("{USERINFO_MARK}@example.com")],
        "bcc": [format!("{HEADER_MARK}@example.com")],
        "subject": format!("{BODY_MARK}-subject"),
        "text": format!("{BODY_MARK}-text"),
    })
    .to_string();
    let email = outboxd::deliver::email::payload::parse_payload(
        &email_text,
        "order-1",
        Some("example.com"),
    )
    .unwrap();

    let smtp = outboxd::deliver::email::settings::SmtpUrl::parse(&format!(
        "smtp://{CONSOLE_TOKEN}:{SMTP_PASSWORD}@smtp.example:587"
    ))
    .unwrap();
    let database =
        outboxd::db::parse_url(&format!("postgres://app:{DB_PASSWORD}@db.example/app")).unwrap();
    let new_message = outboxd::NewMessage::webhook("order-1", serde_json::from_str(&text).unwrap());
    // A failure whose cause quotes what a relay said (an address) and whose response holds
    // a stored body.
    let failure = outboxd::deliver::DeliveryError {
        status: Some(550),
        response: Some(json!({"body": format!("{BODY_MARK}-response")})),
        source: Some(format!("550 5.1.1 <{USERINFO_MARK}@example.com> unknown").into()),
        ..outboxd::deliver::DeliveryError::new(
            outboxd::model::ErrorClass::Permanent,
            "SMTP 550 at RCPT TO",
        )
    };

    let shown = [
        ("Env", format!("{env:?}"), "OUTBOXD_WEBHOOK_SECRET_BILLING"),
        (
            "RunInput",
            format!("{input:?}"),
            "OUTBOXD_WEBHOOK_SECRET_BILLING",
        ),
        ("SigningKeys", format!("{keys:?}"), "BILLING"),
        ("UrlCache", format!("{urls:?}"), "len: 1"),
        ("Read", format!("{read:?}"), "body_len"),
        (
            "Request",
            format!("{request:?}"),
            "http://hooks.example.com:8443",
        ),
        ("Claimed", format!("{claimed:?}"), "order-1"),
        ("Outgoing", format!("{outgoing:?}"), "payload_len"),
        ("Email", format!("{email:?}"), "recipients: 2"),
        // The user is a token at some relays (here the console's canary stands for one).
        ("SmtpUrl", format!("{smtp:?}"), "smtp.example"),
        (
            "SmtpUrl as logged",
            smtp.to_string(),
            "smtp://smtp.example:587",
        ),
        ("Database", format!("{database:?}"), "db.example"),
        ("NewMessage", format!("{new_message:?}"), "payload_len"),
        (
            "DeliveryError",
            format!("{failure:?}"),
            "SMTP 550 at RCPT TO",
        ),
    ];
    for (what, debug, expected) in &shown {
        let mut found = leaks(debug);
        found.extend(
            [SMTP_PASSWORD, CONSOLE_TOKEN, "hookuser"]
                .iter()
                .filter(|m| debug.contains(*m))
                .map(|m| format!("[{m}]")),
        );
        assert!(found.is_empty(), "{what}: {found:?} in {debug}");
        assert!(
            debug.contains(expected),
            "{what}: {expected} not in {debug}"
        );
    }
    // The request's headers show their names, the claimed row its payload's length.
    assert!(shown[5].1.contains("x-api-key"), "{}", shown[5].1);
    assert!(shown[6].1.contains(&format!("payload_len: {}", text.len())));
}

/// `outboxd enqueue --help` must not show a payload from the environment (clap prints a set
/// variable's value for a flag that reads one; enqueue's flags read none).
#[test]
fn help_does_not_print_the_payload_from_the_environment() {
    let payload = format!(r#"{{"url": "https://h.example/{PATH_MARK}", "body": "{BODY_MARK}"}}"#);
    let out = run_binary(
        &["enqueue", "--help"],
        &[("OUTBOXD_PAYLOAD", payload)],
        Duration::from_secs(10),
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(!out.stdout.contains("OUTBOXD_PAYLOAD"), "{}", out.stdout);
    assert!(leaks(&out.stdout).is_empty(), "{}", out.stdout);
}
