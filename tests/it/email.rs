//! The e-mail channel, end to end: a worker, a real PostgreSQL, and either a real SMTP
//! server (aiosmtpd, checking the delivered bytes with Python's e-mail parser) or a
//! fault-injecting fake for what a real server will not do on demand.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::binary::{outboxd, run_within};
use common::smtp::{Answer, FakeSmtp, Plan, Sink, reply};
use common::*;
use outboxd::config::WorkerConfig;
use outboxd::deliver::email::settings::{EmailConfig, SmtpUrl};
use outboxd::model::Channel;
use serde_json::{Value, json};
use sha2::Digest as _;

const WAIT: Duration = Duration::from_secs(20);

/// E-mail settings for tests: a 2 s attempt timeout.
fn email_config(url: &str) -> EmailConfig {
    EmailConfig {
        timeout: Duration::from_secs(2),
        ..EmailConfig::new(SmtpUrl::parse(url).unwrap())
    }
}

fn email_worker_config() -> WorkerConfig {
    WorkerConfig {
        channels: vec![Channel::Email],
        ..test_worker_config("mailer")
    }
}

fn start(db: &TestDb, email: EmailConfig) -> RunningWorker {
    RunningWorker::start_with(
        db,
        email_worker_config(),
        test_webhook_config(),
        Some(email),
    )
}

/// `<H@domain>`, H the first 32 hex digits of SHA-256 of the key: computed here from the
/// contract, independently of the code under test.
fn expected_message_id(key: &str, domain: &str) -> String {
    let h = hex::encode(sha2::Sha256::digest(key.as_bytes()));
    format!("<{}@{domain}>", &h[..32])
}

fn simple(to: &[&str]) -> Value {
    json!({"from": "Shop <shop@shop.example>", "to": to, "subject": "Hello", "text": "Hi there"})
}

async fn enqueue_email(
    db: &TestDb,
    key: &str,
    payload: Value,
    max_attempts: i32,
    retry_ambiguous: bool,
) -> i64 {
    let c = db.client().await;
    let msg = outboxd::NewMessage::email(key, payload)
        .max_attempts(max_attempts)
        .retry_ambiguous(retry_ambiguous);
    outboxd::enqueue(&c, &msg).await.expect("enqueue").id
}

/// Every `attempts.error` of a message.
async fn attempt_errors(db: &TestDb, key: &str) -> Vec<String> {
    db.client()
        .await
        .query(
            "SELECT coalesce(a.error, '') FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id \
             WHERE m.message_key = $1 ORDER BY a.id",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Asserts that nothing of `secrets` shows in the message's last_error or attempt errors.
async fn assert_no_leak(db: &TestDb, key: &str, secrets: &[&str]) {
    let r = row(db, key).await;
    let mut texts = attempt_errors(db, key).await;
    texts.extend(r.last_error);
    texts.push(r.response.map(|v| v.to_string()).unwrap_or_default());
    for t in &texts {
        for s in secrets {
            assert!(!t.contains(s), "{s:?} leaked into {t:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// A real SMTP server (aiosmtpd)
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_real_server_receives_the_headers_bodies_and_recipients() {
    let db = TestDb::new().await;
    let sink = Sink::start(&[]).await;
    let key = "order-42:paid:mail";
    let subject = "Ihre Bestellung 42 – Grüße aus Köln ✓";
    let text = "Danke für Ihre Bestellung.\nZeile zwei.\n.a line that starts with a dot";
    let html = "<p>Danke f\u{fc}r Ihre <b>Bestellung</b> – 42 €</p>";
    enqueue_email(
        &db,
        key,
        json!({
            "from": "Shop Köln <shop@shop.example>",
            "to": ["alice@example.com", "Bob Smith <bob@example.com>"],
            "cc": ["carol@example.com"],
            "bcc": ["audit@example.com"],
            "reply_to": "help@shop.example",
            "subject": subject,
            "text": text,
            "html": html,
            "headers": {"X-Campaign": "spring-sale", "List-Unsubscribe": "<mailto:unsub@shop.example>"}
        }),
        3,
        true,
    )
    .await;
    let w = start(&db, email_config(&sink.url()));
    let r = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;

    let msgs = sink.messages();
    assert_eq!(msgs.len(), 1);
    let m = &msgs[0];
    // The envelope: every recipient, Bcc included, once.
    assert_eq!(m.mail_from, "shop@shop.example");
    let mut rcpts = m.rcpt_tos.clone();
    rcpts.sort();
    assert_eq!(
        rcpts,
        [
            "alice@example.com",
            "audit@example.com",
            "bob@example.com",
            "carol@example.com"
        ]
    );
    // Headers, decoded by Python's e-mail package.
    let id = expected_message_id(key, "shop.example");
    assert_eq!(m.header("Message-ID").as_deref(), Some(id.as_str()));
    assert_eq!(m.header("Subject").as_deref(), Some(subject));
    assert_eq!(
        m.header("From").as_deref(),
        Some("Shop Köln <shop@shop.example>")
    );
    assert_eq!(
        m.header("To").as_deref(),
        Some("alice@example.com, \"Bob Smith\" <bob@example.com>")
    );
    assert_eq!(m.header("Cc").as_deref(), Some("carol@example.com"));
    assert_eq!(m.header("Reply-To").as_deref(), Some("help@shop.example"));
    assert!(
        m.headers("Bcc").is_empty(),
        "Bcc must not be in the headers"
    );
    assert!(
        !String::from_utf8_lossy(&m.raw_bytes()).contains("audit@example.com"),
        "the Bcc address must not appear anywhere in the content"
    );
    assert_eq!(m.header("X-Campaign").as_deref(), Some("spring-sale"));
    assert_eq!(
        m.header("List-Unsubscribe").as_deref(),
        Some("<mailto:unsub@shop.example>")
    );
    assert_eq!(m.header("MIME-Version").as_deref(), Some("1.0"));
    assert!(m.header("Date").is_some());
    // The raw subject is 7-bit: UTF-8 travels as encoded words.
    let raw = m.raw_bytes();
    assert!(
        common::smtp::header_of(&raw, "Subject")
            .unwrap()
            .contains("=?utf-8?"),
        "encoded word"
    );
    // multipart/alternative with both parts, decoded back to the payload's text.
    assert_eq!(m.parsed.content_type, "multipart/alternative");
    let parts: Vec<(&str, &str)> = m
        .parsed
        .parts
        .iter()
        .map(|p| (p.content_type.as_str(), p.content.trim_end()))
        .collect();
    assert_eq!(parts.len(), 2, "{parts:?}");
    assert_eq!(parts[0].0, "text/plain");
    assert_eq!(parts[0].1.replace("\r\n", "\n"), text);
    assert_eq!(parts[1].0, "text/html");
    assert_eq!(parts[1].1.replace("\r\n", "\n"), html);
    assert!(
        m.parsed
            .parts
            .iter()
            .all(|p| p.charset.as_deref() == Some("utf-8"))
    );

    // What the worker recorded: the reply code, the queue id, our Message-ID.
    let resp = r.response.unwrap();
    assert_eq!(resp["status"], 250);
    assert_eq!(resp["queue_id"], "SINK0001");
    assert_eq!(resp["message_id"], id.as_str());
    assert_eq!(
        attempts(&db, key).await,
        [(1, "delivered".into(), None, Some(250), false)]
    );
}

#[tokio::test]
async fn a_text_only_message_is_a_single_part() {
    let db = TestDb::new().await;
    let sink = Sink::start(&[]).await;
    enqueue_email(&db, "plain:1", simple(&["a@example.com"]), 3, true).await;
    enqueue_email(
        &db,
        "html:1",
        json!({"from": "shop@shop.example", "to": "a@example.com", "html": "<p>only html</p>"}),
        3,
        true,
    )
    .await;
    let w = start(&db, email_config(&sink.url()));
    wait_for_state(&db, "plain:1", "delivered", WAIT).await;
    wait_for_state(&db, "html:1", "delivered", WAIT).await;
    w.stop().await;
    let msgs = sink.messages();
    let mut types: Vec<(String, String)> = msgs
        .iter()
        .map(|m| {
            (
                m.parsed.content_type.clone(),
                m.parsed.parts[0].content.trim_end().to_owned(),
            )
        })
        .collect();
    types.sort();
    assert_eq!(
        types,
        [
            ("text/html".to_owned(), "<p>only html</p>".to_owned()),
            ("text/plain".to_owned(), "Hi there".to_owned())
        ]
    );
}

#[tokio::test]
async fn the_message_id_is_the_same_across_a_retry_on_a_real_server() {
    let db = TestDb::new().await;
    // aiosmtpd answers the first message's content with 451, then accepts.
    let sink = Sink::start(&["--fail-first", "1", "--fail-code", "451"]).await;
    let key = "invoice-7:mail";
    enqueue_email(&db, key, simple(&["a@example.com"]), 3, false).await;
    let w = start(&db, email_config(&sink.url()));
    let r = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(r.attempts, 2);
    assert_eq!(
        attempts(&db, key).await,
        [
            (
                1,
                "retry".into(),
                Some("transient".into()),
                Some(451),
                false
            ),
            (2, "delivered".into(), None, Some(250), false),
        ]
    );
    let msgs = sink.messages();
    assert_eq!(msgs.len(), 2, "both attempts reached the end of DATA");
    let ids: Vec<Option<String>> = msgs.iter().map(|m| m.header("Message-ID")).collect();
    let want = expected_message_id(key, "shop.example");
    assert_eq!(ids, [Some(want.clone()), Some(want)]);
}

#[tokio::test]
async fn the_message_id_survives_a_replay_and_the_domain_can_be_set() {
    let db = TestDb::new().await;
    let sink = Sink::start(&["--fail-first", "1", "--fail-code", "554"]).await;
    let key = "welcome:user-9";
    enqueue_email(&db, key, simple(&["a@example.com"]), 3, true).await;
    let cfg = EmailConfig {
        message_id_domain: Some("mail.outbox.test".into()),
        ..email_config(&sink.url())
    };
    let w = start(&db, cfg.clone());
    let r = wait_for_state(&db, key, "dead", WAIT).await;
    assert_eq!(r.error_class.as_deref(), Some("permanent"));
    assert_eq!(r.attempts, 1, "a 5xx is not retried");
    assert!(
        r.last_error.as_deref().unwrap().contains("SMTP 554 5.6.0"),
        "{:?}",
        r.last_error
    );

    let mut c = db.client().await;
    let replayed = outboxd::ops::replay(
        &mut c,
        &outboxd::ops::ReplaySelection::Named(vec![outboxd::ops::Target::parse(key)]),
        "test",
        false,
    )
    .await
    .unwrap();
    assert_eq!(replayed.len(), 1);
    wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    let ids: Vec<Option<String>> = sink
        .messages()
        .iter()
        .map(|m| m.header("Message-ID"))
        .collect();
    let want = expected_message_id(key, "mail.outbox.test");
    assert_eq!(ids, [Some(want.clone()), Some(want)]);
}

#[tokio::test]
async fn a_refused_recipient_on_a_real_server_stops_the_whole_message() {
    let db = TestDb::new().await;
    let sink = Sink::start(&["--refuse", "nobody@example.com"]).await;
    let key = "partial:1";
    enqueue_email(
        &db,
        key,
        simple(&["a@example.com", "nobody@example.com", "c@example.com"]),
        3,
        true,
    )
    .await;
    let w = start(&db, email_config(&sink.url()));
    let r = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(r.error_class.as_deref(), Some("permanent"));
    assert_eq!(r.attempts, 1);
    let err = r.last_error.clone().unwrap();
    assert!(
        err.contains("SMTP 550 5.1.1") && err.contains("1 of 3 recipients refused"),
        "{err}"
    );
    let resp = r.response.clone().unwrap();
    assert_eq!(
        (&resp["refused"], &resp["recipients"], &resp["status"]),
        (&json!(1), &json!(3), &json!(550))
    );
    assert!(
        sink.messages().is_empty(),
        "no recipient got it: all or none"
    );
    // The server's reply quoted the address; it is not stored anywhere.
    assert_no_leak(&db, key, &["nobody@", "a@example", "User unknown"]).await;
}

// ---------------------------------------------------------------------------------------
// The fault-injecting fake
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_451_at_mail_then_250_delivers_on_the_second_attempt() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.plan([Plan::at_mail(reply(
        "451 4.3.2 System not accepting messages",
    ))]);
    enqueue_email(&db, "m:451", simple(&["a@example.com"]), 3, false).await;
    let w = start(&db, email_config(&fake.url()));
    let r = wait_for_state(&db, "m:451", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(
        attempts(&db, "m:451").await,
        [
            (
                1,
                "retry".into(),
                Some("transient".into()),
                Some(451),
                false
            ),
            (2, "delivered".into(), None, Some(250), false),
        ]
    );
    assert_eq!(fake.received().len(), 1);
    assert_eq!(r.response.unwrap()["queue_id"], "FAKE1234");
    // A negative reply leaves the connection usable: the retry reused it.
    assert_eq!(fake.connections(), 1);
}

#[tokio::test]
async fn a_451_after_data_is_retried_with_the_same_message_id() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.plan([Plan::at_end_of_data(reply("451 4.3.0 Queue full"))]);
    enqueue_email(&db, "m:451data", simple(&["a@example.com"]), 3, false).await;
    let w = start(&db, email_config(&fake.url()));
    wait_for_state(&db, "m:451data", "delivered", WAIT).await;
    w.stop().await;
    let classes: Vec<Option<String>> = attempts(&db, "m:451data")
        .await
        .into_iter()
        .map(|a| a.2)
        .collect();
    assert_eq!(classes, [Some("transient".into()), None]);
    let got = fake.received();
    assert_eq!(got.len(), 2);
    let want = expected_message_id("m:451data", "shop.example");
    assert_eq!(got[0].header("Message-ID"), Some(want.clone()));
    assert_eq!(got[1].header("Message-ID"), Some(want));
}

#[tokio::test]
async fn a_550_is_permanent_after_one_attempt() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.plan([
        Plan::at_mail(reply("550 5.7.1 Sender rejected")),
        Plan::at_end_of_data(reply("550 5.7.1 Message content rejected")),
    ]);
    enqueue_email(&db, "m:550a", simple(&["a@example.com"]), 3, true).await;
    let w = start(&db, email_config(&fake.url()));
    let r = wait_for_state(&db, "m:550a", "dead", WAIT).await;
    enqueue_email(&db, "m:550b", simple(&["a@example.com"]), 3, true).await;
    let r2 = wait_for_state(&db, "m:550b", "dead", WAIT).await;
    w.stop().await;
    for (r, key) in [(r, "m:550a"), (r2, "m:550b")] {
        assert_eq!(r.error_class.as_deref(), Some("permanent"), "{key}");
        assert_eq!(r.attempts, 1, "{key}");
        assert_eq!(
            attempts(&db, key).await,
            [(1, "dead".into(), Some("permanent".into()), Some(550), false)]
        );
        assert!(
            r.last_error.as_deref().unwrap().contains("SMTP 550 5.7.1"),
            "{:?}",
            r.last_error
        );
        assert_no_leak(&db, key, &["rejected", "a@example.com"]).await;
    }
}

#[tokio::test]
async fn a_drop_after_the_end_of_data_is_ambiguous_and_retried_only_when_allowed() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    // The first message: retry_ambiguous = true → retried, then delivered.
    fake.plan([Plan::at_end_of_data(Answer::Drop), Plan::ok()]);
    enqueue_email(&db, "amb:yes", simple(&["a@example.com"]), 3, true).await;
    let w = start(&db, email_config(&fake.url()));
    wait_for_state(&db, "amb:yes", "delivered", WAIT).await;
    let classes: Vec<Option<String>> = attempts(&db, "amb:yes")
        .await
        .into_iter()
        .map(|a| a.2)
        .collect();
    assert_eq!(classes, [Some("ambiguous".into()), None]);
    assert_eq!(fake.received().len(), 2, "the relay got the content twice");

    // The second: retry_ambiguous = false → dead at once, class ambiguous.
    fake.plan([Plan::at_end_of_data(Answer::Drop)]);
    enqueue_email(&db, "amb:no", simple(&["a@example.com"]), 3, false).await;
    let r = wait_for_state(&db, "amb:no", "dead", WAIT).await;
    w.stop().await;
    assert_eq!(r.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(r.attempts, 1);
    let err = r.last_error.unwrap();
    assert!(
        err.contains("after the end of DATA") && err.contains("may have queued"),
        "{err}"
    );
    assert_eq!(fake.received().len(), 3);
}

#[tokio::test]
async fn no_reply_after_data_is_an_ambiguous_timeout() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.plan([Plan::at_end_of_data(Answer::Silence)]);
    enqueue_email(&db, "silent:data", simple(&["a@example.com"]), 3, false).await;
    let cfg = EmailConfig {
        timeout: Duration::from_millis(800),
        ..email_config(&fake.url())
    };
    let w = start(&db, cfg);
    let t0 = Instant::now();
    let r = wait_for_state(&db, "silent:data", "dead", WAIT).await;
    w.stop().await;
    assert!(t0.elapsed() >= Duration::from_millis(800));
    assert_eq!(r.error_class.as_deref(), Some("ambiguous"));
    assert!(
        r.last_error.as_deref().unwrap().contains("no reply"),
        "{:?}",
        r.last_error
    );
    assert_eq!(fake.received().len(), 1);
}

#[tokio::test]
async fn a_server_that_never_greets_is_a_transient_timeout() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.greet([Answer::Silence]);
    enqueue_email(&db, "silent:greet", simple(&["a@example.com"]), 3, false).await;
    let cfg = EmailConfig {
        timeout: Duration::from_millis(800),
        ..email_config(&fake.url())
    };
    let w = start(&db, cfg);
    let r = wait_for_state(&db, "silent:greet", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(r.attempts, 2);
    let a = attempts(&db, "silent:greet").await;
    assert_eq!(a[0].1, "retry");
    assert_eq!(a[0].2.as_deref(), Some("transient"), "nothing was sent");
    assert_eq!(fake.connections(), 2);
    assert!(
        !fake.commands().is_empty() && fake.commands()[0].starts_with("EHLO"),
        "the first connection never got past the greeting: {:?}",
        fake.commands()
    );
}

#[tokio::test]
async fn connection_refused_is_transient_and_exhausts_the_budget() {
    let db = TestDb::new().await;
    let port = CLOSED_PORT;
    enqueue_email(&db, "refused", simple(&["a@example.com"]), 2, false).await;
    let w = start(
        &db,
        email_config(&format!("smtp://127.0.0.1:{port}?tls=none")),
    );
    let r = wait_for_state(&db, "refused", "dead", WAIT).await;
    w.stop().await;
    assert_eq!(r.error_class.as_deref(), Some("exhausted"));
    let a = attempts(&db, "refused").await;
    assert_eq!(
        a.iter().map(|a| a.2.clone()).collect::<Vec<_>>(),
        [Some("transient".into()), Some("exhausted".into())]
    );
    assert!(
        r.last_error.as_deref().unwrap().contains("refused"),
        "{:?}",
        r.last_error
    );
}

#[tokio::test]
async fn a_relay_that_stalls_mid_content_is_a_transient_timeout() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start_narrow().await;
    // After its 354 the relay reads nothing more. The content (900 KiB, under the 1 MiB
    // payload limit) outgrows the socket buffers of a real network's connection, so our
    // write blocks before its last byte leaves: the relay cannot have the end of DATA, and
    // the timeout is transient.
    fake.plan([
        Plan {
            stall_content: true,
            ..Plan::ok()
        },
        Plan::ok(),
    ]);
    let line = "x".repeat(70) + "\n";
    let big = line.repeat(900 * 1024 / line.len());
    enqueue_email(
        &db,
        "big",
        json!({"from": "shop@shop.example", "to": ["a@example.com"], "subject": "big", "text": big}),
        3,
        false,
    )
    .await;
    let w = start(&db, email_config(&fake.url()));
    wait_for_state(&db, "big", "delivered", WAIT).await;
    w.stop().await;
    let a = attempts(&db, "big").await;
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0].2.as_deref(), Some("transient"), "{a:?}");
    let errors = attempt_errors(&db, "big").await;
    assert!(
        errors[0].contains("sending the message content"),
        "{errors:?}"
    );
    assert_eq!(fake.received().len(), 1);
    assert!(fake.received()[0].content.len() > 900 * 1000);
}

#[tokio::test]
async fn invalid_payloads_are_dead_without_a_connection() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    let ok = || json!({"from": "shop@shop.example", "to": ["a@example.com"], "subject": "s", "text": "t"});
    let with = |k: &str, v: Value| {
        let mut p = ok();
        p[k] = v;
        p
    };
    let cases = [
        (
            "bad-to",
            with("to", json!(["secret-not-an-address"])),
            "payload.to[0]",
        ),
        (
            "crlf-subject",
            with("subject", json!("Hi secret\r\nBcc: victim@example.com")),
            "payload.subject",
        ),
        (
            "crlf-header",
            with(
                "headers",
                json!({"X-Tag": "secret\r\nBcc: victim@example.com"}),
            ),
            "payload.headers.X-Tag",
        ),
        (
            "crlf-to",
            with("to", json!(["a@example.com\r\nBcc: victim@example.com"])),
            "payload.to[0]",
        ),
        (
            "no-body",
            json!({"from": "shop@shop.example", "to": "a@example.com"}),
            "text, html",
        ),
        (
            "no-from",
            json!({"to": "a@example.com", "text": "secret"}),
            "payload.from",
        ),
        (
            "reserved",
            with("headers", json!({"Message-ID": "<secret@x>"})),
            "payload.headers.Message-ID",
        ),
    ];
    for (key, payload, _) in &cases {
        enqueue_email(&db, key, payload.clone(), 3, true).await;
    }
    let w = start(&db, email_config(&fake.url()));
    for (key, _, needle) in &cases {
        let r = wait_for_state(&db, key, "dead", WAIT).await;
        assert_eq!(r.error_class.as_deref(), Some("invalid"), "{key}");
        assert_eq!(r.attempts, 1, "{key}");
        let err = r.last_error.clone().unwrap();
        assert!(err.contains(needle), "{key}: {err}");
        assert_no_leak(&db, key, &["secret", "victim", "a@example.com"]).await;
    }
    w.stop().await;
    assert_eq!(
        fake.connections(),
        0,
        "no network call for an invalid payload"
    );
}

#[tokio::test]
async fn a_refused_recipient_sends_no_data_and_a_deferred_one_retries_everyone() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.plan([Plan::at_rcpt(
        "b@example.com",
        reply("550 5.1.1 <b@example.com>: Recipient address rejected"),
    )]);
    enqueue_email(
        &db,
        "rcpt:550",
        simple(&["a@example.com", "b@example.com"]),
        3,
        true,
    )
    .await;
    let w = start(&db, email_config(&fake.url()));
    let r = wait_for_state(&db, "rcpt:550", "dead", WAIT).await;
    assert_eq!(r.error_class.as_deref(), Some("permanent"));
    assert!(
        r.last_error
            .as_deref()
            .unwrap()
            .contains("1 of 2 recipients refused"),
        "{:?}",
        r.last_error
    );
    assert!(
        !fake.commands().iter().any(|c| c == "DATA"),
        "no DATA after a refused recipient: {:?}",
        fake.commands()
    );
    assert!(fake.received().is_empty());
    assert_no_leak(
        &db,
        "rcpt:550",
        &["b@example.com", "a@example.com", "rejected"],
    )
    .await;

    // 4xx for one recipient: the whole message waits and goes to everyone once, later.
    fake.plan([
        Plan::at_rcpt("c@example.com", reply("450 4.2.0 Mailbox busy")),
        Plan::ok(),
    ]);
    enqueue_email(
        &db,
        "rcpt:450",
        simple(&["a@example.com", "c@example.com"]),
        3,
        true,
    )
    .await;
    wait_for_state(&db, "rcpt:450", "delivered", WAIT).await;
    w.stop().await;
    let a = attempts(&db, "rcpt:450").await;
    assert_eq!(
        a,
        [
            (
                1,
                "retry".into(),
                Some("transient".into()),
                Some(450),
                false
            ),
            (2, "delivered".into(), None, Some(250), false),
        ]
    );
    let got = fake.received();
    assert_eq!(got.len(), 1, "delivered once");
    assert_eq!(got[0].rcpt_to, ["a@example.com", "c@example.com"]);
    // The abandoned transactions were reset before the connection was used again.
    assert!(fake.commands().iter().any(|c| c == "RSET"));
}

/// A relay's limit of recipients per message (`452 4.5.3` once it has taken some) is met
/// again by every attempt. The contract keeps every SMTP 4xx transient, so the message is
/// retried to `exhausted`; its error names the limit and the counts, never an address.
/// The same code on the first recipient says nothing about the count.
#[tokio::test]
async fn too_many_recipients_for_the_relay_is_named_in_the_error() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    let too_many = reply("452 4.5.3 Error: too many recipients");
    let mut limit = Plan::ok();
    for a in ["c@example.com", "d@example.com"] {
        limit.rcpt.insert(a.into(), too_many.clone());
    }
    limit
        .rcpt
        .insert("e@example.com".into(), reply("450 4.2.1 Mailbox busy"));
    fake.plan([limit.clone(), limit]);
    enqueue_email(
        &db,
        "rcpt:limit",
        simple(&[
            "a@example.com",
            "b@example.com",
            "c@example.com",
            "d@example.com",
            "e@example.com",
        ]),
        2,
        true,
    )
    .await;
    let w = start(&db, email_config(&fake.url()));
    let r = wait_for_state(&db, "rcpt:limit", "dead", WAIT).await;
    assert_eq!(r.error_class.as_deref(), Some("exhausted"));
    assert_eq!(r.attempts, 2);
    let err = r.last_error.clone().unwrap();
    assert!(
        err.contains("SMTP 452 4.5.3")
            && err.contains(
                "took 2 of 5 recipients and deferred 2 as too many for one message (and 1 for other reasons)"
            ),
        "{err}"
    );
    assert!(fake.received().is_empty(), "no DATA: all or none");
    assert_no_leak(&db, "rcpt:limit", &["@example.com", "too many recipients"]).await;

    // On the first recipient the code is no count.
    fake.plan([Plan::at_rcpt("a@example.com", too_many), Plan::ok()]);
    enqueue_email(
        &db,
        "rcpt:first",
        simple(&["a@example.com", "b@example.com"]),
        3,
        true,
    )
    .await;
    wait_for_state(&db, "rcpt:first", "delivered", WAIT).await;
    w.stop().await;
    let errors = attempt_errors(&db, "rcpt:first").await;
    assert!(
        errors[0].contains("1 of 2 recipients deferred") && !errors[0].contains("too many"),
        "{errors:?}"
    );
}

#[tokio::test]
async fn connections_are_reused_and_a_dead_one_is_replaced_within_the_attempt() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    for i in 0..3 {
        let key = format!("reuse:{i}");
        enqueue_email(&db, &key, simple(&["a@example.com"]), 3, false).await;
    }
    let w = start(
        &db,
        EmailConfig {
            max_connections: 1,
            ..email_config(&fake.url())
        },
    );
    for i in 0..3 {
        wait_for_state(&db, &format!("reuse:{i}"), "delivered", WAIT).await;
    }
    assert_eq!(fake.connections(), 1, "one connection for three messages");

    // The relay closes the idle connection after the next message; the one after that
    // finds it dead at MAIL FROM and takes a fresh one, in the same attempt.
    fake.plan([
        Plan {
            close_after: true,
            ..Plan::ok()
        },
        Plan::ok(),
    ]);
    enqueue_email(&db, "reuse:closing", simple(&["a@example.com"]), 3, false).await;
    wait_for_state(&db, "reuse:closing", "delivered", WAIT).await;
    enqueue_email(&db, "reuse:after", simple(&["a@example.com"]), 3, false).await;
    let r = wait_for_state(&db, "reuse:after", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(r.attempts, 1, "a stale pooled connection costs no attempt");
    assert_eq!(fake.connections(), 2);
    assert_eq!(fake.received().len(), 5);
}

#[tokio::test]
async fn starttls_is_required_unless_the_url_says_tls_none() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    enqueue_email(&db, "tls", simple(&["a@example.com"]), 1, false).await;
    // A bare smtp:// requires STARTTLS; the fake does not offer it.
    let w = start(
        &db,
        email_config(&format!("smtp://user:hunter2@{}", fake.addr)),
    );
    let r = wait_for_state(&db, "tls", "dead", WAIT).await;
    w.stop().await;
    assert_eq!(r.error_class.as_deref(), Some("exhausted"));
    assert!(
        r.last_error.as_deref().unwrap().contains("STARTTLS"),
        "{:?}",
        r.last_error
    );
    assert!(
        !fake
            .commands()
            .iter()
            .any(|c| c.starts_with("MAIL") || c.starts_with("AUTH")),
        "nothing but EHLO in plain text: {:?}",
        fake.commands()
    );
    assert_no_leak(&db, "tls", &["hunter2"]).await;
}

#[tokio::test]
async fn credentials_are_percent_decoded_and_a_refused_login_is_permanent() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.require_auth(Answer::Ok);
    let url = format!("smtp://api%40key:p%40ss%20w0rd@{}?tls=none", fake.addr);
    enqueue_email(&db, "auth:ok", simple(&["a@example.com"]), 3, false).await;
    let w = start(&db, email_config(&url));
    wait_for_state(&db, "auth:ok", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(fake.auth_plain(), [b"\0api@key\0p@ss w0rd".to_vec()]);

    let fake = FakeSmtp::start().await;
    fake.require_auth(reply("535 5.7.8 Authentication credentials invalid"));
    let url = format!("smtp://user:hunter2@{}?tls=none", fake.addr);
    enqueue_email(&db, "auth:bad", simple(&["a@example.com"]), 2, false).await;
    let w = start(&db, email_config(&url));
    let r = wait_for_state(&db, "auth:bad", "dead", WAIT).await;
    w.stop().await;
    // The contract: SMTP 5xx → dead at once, in the session as at MAIL FROM (it used to
    // be retried, then exhausted).
    assert_eq!(r.error_class.as_deref(), Some("permanent"));
    assert_eq!(r.attempts, 1);
    assert!(
        r.last_error.as_deref().unwrap().contains("SMTP 535 5.7.8"),
        "{:?}",
        r.last_error
    );
    assert_no_leak(&db, "auth:bad", &["hunter2"]).await;
    assert!(!fake.commands().iter().any(|c| c.starts_with("MAIL")));
}

// ---------------------------------------------------------------------------------------
// The binary
// ---------------------------------------------------------------------------------------

#[test]
fn bad_email_settings_exit_2_with_one_line_and_no_password() {
    let unreachable =
        format!("postgres://postgres@127.0.0.1:{CLOSED_PORT}/postgres?connect_timeout=2");
    // (environment, arguments, what the one line must mention)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);
    let cases: [Case; 5] = [
        (
            &[(
                "OUTBOXD_SMTP_URL",
                "smtp://u:hunter2@mail.example?tls=maybe",
            )],
            &["run"],
            "OUTBOXD_SMTP_URL",
        ),
        (
            &[("OUTBOXD_SMTP_URL", "http://u:hunter2@mail.example")],
            &["run"],
            "OUTBOXD_SMTP_URL",
        ),
        (
            &[("OUTBOXD_SMTP_URL", "smtp://u:hunter2@mail.example")],
            &["run", "--lease", "20s", "--smtp-timeout", "30s"],
            "lease",
        ),
        (
            &[
                ("OUTBOXD_SMTP_URL", "smtp://u:hunter2@mail.example"),
                ("OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN", "not a domain"),
            ],
            &["run"],
            "OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN",
        ),
        (
            &[],
            &["run", "--channels", "webhook,email"],
            "OUTBOXD_SMTP_URL",
        ),
    ];
    for (env, args, mention) in cases {
        let mut cmd = outboxd(None);
        cmd.env("DATABASE_URL", &unreachable)
            .envs(env.iter().copied())
            .args(args);
        let out = run_within(&mut cmd, Duration::from_secs(20));
        let (code, err) = (out.code.unwrap_or(-1), out.stderr);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(code, 2, "{args:?} {env:?}: {err}");
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(lines[0].contains(mention), "{args:?}: {err}");
        assert!(!err.contains("hunter2"), "the password leaked: {err}");
    }
}

/// The settings `outboxd run` would start with, from these arguments and variables.
fn settings(
    args: &[&str],
    smtp_url: Option<&str>,
) -> Result<
    (
        WorkerConfig,
        outboxd::deliver::webhook::settings::WebhookConfig,
        Option<EmailConfig>,
    ),
    String,
> {
    use clap::Parser as _;
    let cli = outboxd::cli::Cli::try_parse_from(["outboxd", "run"].iter().chain(args))
        .map_err(|e| e.to_string())?;
    let outboxd::cli::Command::Run(run) = cli.command else {
        unreachable!("a run command");
    };
    let env = outboxd::cli::Env {
        smtp_url: smtp_url.map(Into::into),
        email_message_id_domain: Some("Mail.Outbox.Test".into()),
        ..Default::default()
    };
    outboxd::cli::worker_settings(&run, &env).map_err(|e| e.to_string())
}

#[test]
fn channels_default_to_email_when_an_smtp_url_is_set() {
    let url = Some("smtp://mail.example.com");
    let (w, _, e) = settings(&[], url).unwrap();
    assert_eq!(
        w.channels,
        [Channel::Webhook, Channel::Http, Channel::Email]
    );
    let e = e.expect("email settings");
    assert_eq!(e.timeout, Duration::from_secs(30));
    assert_eq!(e.message_id_domain.as_deref(), Some("mail.outbox.test"));
    assert_eq!(e.smtp.port, 587);

    let (w, _, e) = settings(&[], None).unwrap();
    assert_eq!(w.channels, [Channel::Webhook, Channel::Http]);
    assert!(e.is_none(), "the worker starts without an SMTP URL");

    let (w, _, e) = settings(&["--channels", "email", "--smtp-timeout", "5s"], url).unwrap();
    assert_eq!(w.channels, [Channel::Email]);
    assert_eq!(e.unwrap().timeout, Duration::from_secs(5));

    // The lease must outlast the longest timeout of the channels this worker runs.
    let err = settings(&["--lease", "20s", "--smtp-timeout", "30s"], url).unwrap_err();
    assert!(err.contains("--lease"), "{err}");
    let (_, _, e) = settings(
        &[
            "--channels",
            "webhook",
            "--lease",
            "20s",
            "--smtp-timeout",
            "30s",
        ],
        url,
    )
    .unwrap();
    assert!(
        e.is_none(),
        "email is off: its timeout does not bind the lease"
    );
    let err = settings(&["--channels", "email"], None).unwrap_err();
    assert!(err.contains("OUTBOXD_SMTP_URL"), "{err}");
}

#[tokio::test]
async fn the_daemon_sends_email_when_an_smtp_url_is_set_and_logs_no_secrets() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.require_auth(Answer::Ok);
    // The messages go out concurrently, in any order: every transaction refuses this one.
    let refuse = Plan::at_rcpt(
        "secret-rcpt@example.com",
        reply("550 5.1.1 <secret-rcpt@example.com>: no such user"),
    );
    fake.plan([refuse.clone(), refuse]);
    enqueue_email(
        &db,
        "cli:ok",
        json!({"from": "shop@shop.example", "to": ["secret-to@example.com"], "subject": "secret-subject",
               "text": "secret-body", "headers": {"X-Token": "secret-header"}}),
        3,
        true,
    )
    .await;
    enqueue_email(
        &db,
        "cli:refused",
        json!({"from": "shop@shop.example", "to": ["secret-rcpt@example.com"], "text": "secret-body"}),
        3,
        true,
    )
    .await;
    enqueue_email(
        &db,
        "cli:invalid",
        json!({"from": "shop@shop.example", "to": ["secret-to@example.com"], "subject": "secret\r\nBcc: x@y.example", "text": "secret-body"}),
        3,
        true,
    )
    .await;
    let url = format!("smtp://user:hunter2@{}?tls=none", fake.addr);
    let db_url = db.url();
    let (code, _, err) = tokio::task::spawn_blocking(move || {
        let mut cmd = outboxd(None);
        // No --channels: the default includes email because OUTBOXD_SMTP_URL is set.
        cmd.env("DATABASE_URL", db_url)
            .env("OUTBOXD_SMTP_URL", url)
            .env("OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN", "mail.outbox.test")
            .env("RUST_LOG", "trace")
            .args([
                "run",
                "--drain",
                "--poll-interval",
                "100ms",
                "--smtp-timeout",
                "5s",
            ]);
        let out = run_within(&mut cmd, Duration::from_secs(60));
        (out.code.unwrap_or(-1), out.stdout, out.stderr)
    })
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");
    let ok = row(&db, "cli:ok").await;
    assert_eq!(ok.state, "delivered", "{ok:?}");
    assert_eq!(
        row(&db, "cli:refused").await.error_class.as_deref(),
        Some("permanent")
    );
    assert_eq!(
        row(&db, "cli:invalid").await.error_class.as_deref(),
        Some("invalid")
    );
    let got = fake.received();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].header("Message-ID"),
        Some(expected_message_id("cli:ok", "mail.outbox.test"))
    );
    assert!(err.contains("attempt finished"), "{err}");
    for secret in [
        "hunter2",
        "secret-to",
        "secret-rcpt",
        "secret-subject",
        "secret-body",
        "secret-header",
        "no such user",
    ] {
        assert!(!err.contains(secret), "{secret:?} in the logs:\n{err}");
    }
}

/// A slow relay: waiting for one of the pool's connections is no part of an attempt, and
/// the worker claims no more e-mails than it has connections. Before, every claimed e-mail
/// started its clock while it queued for a connection: 40 e-mails, a relay answering 3 s
/// after the end of DATA and a 5 s timeout gave 60 copies at the relay and 10 false
/// ambiguous dead letters. Scaled down: 12 e-mails, 3 connections, 1 s, 1.5 s.
#[tokio::test]
async fn a_slow_relay_gets_each_message_once() {
    const N: usize = 12;
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.plan((0..N).map(|_| Plan::at_end_of_data(Answer::Late(Duration::from_secs(1)))));
    for i in 0..N {
        enqueue_email(
            &db,
            &format!("slow:{i}"),
            simple(&["a@example.com"]),
            3,
            true,
        )
        .await;
    }
    let cfg = EmailConfig {
        timeout: Duration::from_millis(1500),
        max_connections: 3,
        ..email_config(&fake.url())
    };
    let w = start(&db, cfg);
    let c = db.client().await;
    wait_for_count(&c, "delivered", N as i64, Duration::from_secs(60)).await;
    w.stop().await;
    let received = fake.received();
    let mut ids: Vec<String> = received
        .iter()
        .map(|r| common::smtp::header_of(&r.content, "Message-ID").unwrap())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), N, "every message reached the relay");
    assert_eq!(received.len(), N, "and none twice");
    let outcomes: Vec<(String, Option<String>)> = c
        .query(
            "SELECT outcome, error_class FROM outbox.attempts ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(outcomes.len(), N, "one attempt each: {outcomes:?}");
    assert!(
        outcomes.iter().all(|(o, _)| o == "delivered"),
        "{outcomes:?}"
    );
}

// ---------------------------------------------------------------------------------------
// The bytes on the wire (RFC 5321 §2.3.8, §4.5.2; RFC 5322 §2.1, §2.2.3)
// ---------------------------------------------------------------------------------------

/// Commands a relay open to SMTP smuggling would run if the data ended early.
const SMUGGLED: &str = "MAIL FROM:<smuggler@evil.example>\r\nRCPT TO:<victim@example.com>\r\nDATA\r\nFrom: ceo@shop.example\r\nSubject: wire the money\r\n\r\nsmuggled\r\n";

/// A text body with every end-of-data look-alike of the 2023 SMTP-smuggling research
/// (a `.` line whose line breaks are lone CRs or LFs), a real `.` line, and a line that
/// starts with a dot. Every line is ASCII and short, so lettre would choose 7bit.
fn smuggling_text() -> String {
    [
        "line1\r.\r\n",
        SMUGGLED,
        ".\r\nCR-dot-CR\r.\r",
        SMUGGLED,
        ".\r\nCR-dot-LF\r.\n",
        SMUGGLED,
        ".\r\nLF-dot-LF\n.\n",
        SMUGGLED,
        ".\r\nLF-dot-CRLF\n.\r\n",
        SMUGGLED,
        ".\r\nCRLF-dot-LF\r\n.\n",
        SMUGGLED,
        ".\r\na real dot line\r\n.\r\n.starts with a dot\r\nlone CR\rlone LF\nend",
    ]
    .concat()
}

/// An HTML body that cannot go as 7bit: non-ASCII, a 1 500-octet line, lone CRs and LFs.
fn long_html() -> String {
    format!(
        "<p>Grüße\r.\r{}</p>\n.\n<p>{}</p>\r\r\n<p>€</p>",
        "x".repeat(1500),
        "Straße ".repeat(300)
    )
}

/// The body with CRLF for every lone CR and lone LF: what a recipient must decode.
fn with_crlf(s: &str) -> String {
    s.replace("\r\n", "\n")
        .replace('\r', "\n")
        .replace('\n', "\r\n")
}

/// Checks data as the relay read it, dot-stuffed, up to its end-of-data line: the line
/// rules of [`assert_crlf_lines`], and no line that is a lone `.` (or starts with one dot)
/// but the final marker: every other line that starts with a dot is dot-stuffed.
fn assert_clean_wire(wire: &[u8]) {
    assert!(wire.ends_with(b"\r\n.\r\n"), "the data ends with CRLF.CRLF");
    assert_crlf_lines(wire);
    let lines: Vec<&[u8]> = wire[..wire.len() - 2].split(|&b| b == b'\n').collect();
    let (last, lines) = lines.split_last().unwrap();
    assert_eq!(*last, b".", "the last line is the end-of-data marker");
    for (n, line) in lines.iter().enumerate() {
        assert!(
            !line.starts_with(b".") || line.starts_with(b".."),
            "line {n} starts with a dot that is not stuffed: {:?}",
            String::from_utf8_lossy(line)
        );
    }
}

/// CR only before LF, LF only after CR, and no line over 998 octets (CRLF excluded).
fn assert_crlf_lines(wire: &[u8]) {
    for (i, &b) in wire.iter().enumerate() {
        if b == b'\r' {
            assert_eq!(
                wire.get(i + 1),
                Some(&b'\n'),
                "a CR not followed by LF at octet {i}: {:?}",
                String::from_utf8_lossy(&wire[i.saturating_sub(40)..(i + 40).min(wire.len())])
            );
        }
        if b == b'\n' {
            assert!(
                i > 0 && wire[i - 1] == b'\r',
                "an LF not preceded by CR at octet {i}: {:?}",
                String::from_utf8_lossy(&wire[i.saturating_sub(40)..(i + 40).min(wire.len())])
            );
        }
    }
    for (n, line) in wire.split(|&b| b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        assert!(
            line.len() <= 998,
            "line {n} has {} octets: {:?}…",
            line.len(),
            String::from_utf8_lossy(&line[..60])
        );
    }
}

#[tokio::test]
async fn lone_cr_and_lf_in_bodies_go_out_as_crlf_and_cannot_end_the_data_early() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    // A relay that also ends the data at <CR>.<CR><LF>, <LF>.<LF> and the like: if any of
    // them reached it, it would run the smuggled commands as a second transaction.
    fake.end_data_at_any_line_break();
    let key = "wire:smuggling";
    enqueue_email(
        &db,
        key,
        json!({"from": "shop@shop.example", "to": ["a@example.com"], "subject": "Your order",
               "text": smuggling_text(), "html": long_html()}),
        1,
        false,
    )
    .await;
    let w = start(&db, email_config(&fake.url()));
    wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    // The worker closed its connections: once the fake has seen every session end, it has
    // read every byte the worker sent.
    wait_until(WAIT, "every SMTP session ended", || async {
        fake.closed() == fake.connections()
    })
    .await;

    let mails: Vec<String> = fake
        .commands()
        .into_iter()
        .filter(|c| c.to_ascii_uppercase().starts_with("MAIL"))
        .collect();
    assert_eq!(mails, ["MAIL FROM:<shop@shop.example>"], "one transaction");
    let received = fake.received();
    assert_eq!(received.len(), 1, "exactly one message");
    assert_eq!(received[0].rcpt_to, ["a@example.com"]);
    assert_clean_wire(&received[0].wire);
    // The text part went as 7bit (ASCII, short lines): its lines are the text's, CRLF.
    let content = String::from_utf8_lossy(&received[0].content);
    assert!(
        content.contains("Content-Transfer-Encoding: 7bit\r\n\r\nline1\r\n.\r\nMAIL FROM:"),
        "{content}"
    );
    assert!(content.contains(&with_crlf(&smuggling_text())), "{content}");
}

#[tokio::test]
async fn a_real_server_decodes_the_bodies_with_crlf_line_breaks() {
    let db = TestDb::new().await;
    let sink = Sink::start(&[]).await;
    let key = "wire:decoded";
    let (text, html) = (smuggling_text(), long_html());
    enqueue_email(
        &db,
        key,
        json!({"from": "shop@shop.example", "to": ["a@example.com"], "subject": "Your order",
               "text": text, "html": html}),
        1,
        false,
    )
    .await;
    let w = start(&db, email_config(&sink.url()));
    wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    let msgs = sink.messages();
    assert_eq!(msgs.len(), 1, "exactly one message");
    assert_eq!(msgs[0].mail_from, "shop@shop.example");
    assert_eq!(msgs[0].rcpt_tos, ["a@example.com"]);
    // aiosmtpd keeps the content without its transparency dots; the line rules hold.
    assert_crlf_lines(&msgs[0].raw_bytes());
    let parts: Vec<(&str, &str)> = msgs[0]
        .parsed
        .parts
        .iter()
        .map(|p| (p.content_type.as_str(), p.content.as_str()))
        .collect();
    assert_eq!(parts.len(), 2, "{parts:?}");
    assert_eq!(parts[0].0, "text/plain");
    assert_eq!(
        parts[0].1.strip_suffix("\r\n").unwrap_or(parts[0].1),
        with_crlf(&text)
    );
    assert_eq!(parts[1].0, "text/html");
    assert_eq!(
        parts[1].1.strip_suffix("\r\n").unwrap_or(parts[1].1),
        with_crlf(&html)
    );
}

/// The header section's lines (up to the first empty line) of raw message bytes.
fn header_lines(raw: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(raw);
    let head = text.split("\r\n\r\n").next().unwrap();
    head.split("\r\n").map(str::to_owned).collect()
}

#[tokio::test]
async fn long_headers_are_folded_and_a_real_server_reads_them_back_exactly() {
    let db = TestDb::new().await;
    let sink = Sink::start(&[]).await;
    let key = "wire:headers";
    // 5 000 characters: a word too long for any line, non-ASCII words, plain words.
    let subject = format!(
        "{} {} {}",
        "x".repeat(1500),
        "Grüße aus Köln ✓".repeat(120),
        "word ".repeat(400).trim_end()
    );
    assert!(subject.chars().count() >= 5000);
    // 1 000 recipients in To, 50 in Cc, with every kind of display name.
    let names = [
        "".to_owned(),
        "Bob Smith".to_owned(),
        "Jörg Müller-Lüdenscheidt".to_owned(),
        "Bob \"The Builder\" O'Neil, Jr.".to_owned(),
        "n".repeat(300),
        "A Very Long Display Name ".repeat(12).trim_end().to_owned(),
        "Иванов Иван Иванович ".repeat(10).trim_end().to_owned(),
    ];
    let mailbox = |i: usize, domain: &str| {
        let name = &names[i % names.len()];
        let addr = format!("user{i}@{domain}");
        let shown = if name.is_empty() {
            addr.clone()
        } else {
            let quoted = name.replace('\\', "\\\\").replace('"', "\\\"");
            format!("\"{quoted}\" <{addr}>")
        };
        (name.clone(), addr, shown)
    };
    let to: Vec<(String, String, String)> = (0..1000).map(|i| mailbox(i, "example.com")).collect();
    let cc: Vec<(String, String, String)> = (0..50).map(|i| mailbox(i, "cc.example")).collect();
    let from_name = format!("Shop {} Köln", "Verkauf ".repeat(40).trim_end());
    let reply_name = "Kundendienst für Bestellungen und Rücksendungen ".repeat(6);
    let reply_name = reply_name.trim_end();
    let campaign = "spring sale ".repeat(250).trim_end().to_owned();
    let unsubscribe = format!(
        "<https://shop.example/unsubscribe?token={}>",
        "t".repeat(400)
    );
    let note = "Grüße ".repeat(200).trim_end().to_owned();
    enqueue_email(
        &db,
        key,
        json!({
            "from": format!("\"{from_name}\" <shop@shop.example>"),
            "to": to.iter().map(|m| m.2.clone()).collect::<Vec<_>>(),
            "cc": cc.iter().map(|m| m.2.clone()).collect::<Vec<_>>(),
            "reply_to": format!("\"{reply_name}\" <help@shop.example>"),
            "subject": subject,
            "text": "Hi",
            "headers": {"X-Campaign": campaign, "List-Unsubscribe": unsubscribe, "X-Note": note}
        }),
        1,
        false,
    )
    .await;
    // 1 050 RCPT TO take longer than the usual test timeout, under a lease that leaves
    // room for it. On a loaded machine each of those round trips waits for both
    // processes to be scheduled (30 s was seen not to be enough under a heavy load): the
    // bound is generous, it is not what is tested.
    let cfg = EmailConfig {
        timeout: Duration::from_secs(90),
        ..email_config(&sink.url())
    };
    let worker = WorkerConfig {
        lease: Duration::from_secs(120),
        ..email_worker_config()
    };
    let w = RunningWorker::start_with(&db, worker, test_webhook_config(), Some(cfg));
    // One attempt: delivered, or dead (a relay may refuse lines over its limit).
    wait_until(
        Duration::from_secs(150),
        "the message delivered or dead",
        || async { matches!(row(&db, key).await.state.as_str(), "delivered" | "dead") },
    )
    .await;
    w.stop().await;
    let r = row(&db, key).await;
    assert_eq!(r.state, "delivered", "{:?}", r.last_error);
    let msgs = sink.messages();
    assert_eq!(msgs.len(), 1);
    let m = &msgs[0];
    assert_eq!(m.rcpt_tos.len(), 1050);

    // Every header line within 78 octets, but for the one unbreakable URL, within 998.
    let lines = header_lines(&m.raw_bytes());
    let mut in_unsubscribe = false;
    for line in &lines {
        if !line.starts_with([' ', '\t']) {
            in_unsubscribe = line.starts_with("List-Unsubscribe:");
        }
        assert!(line.len() <= 998, "{} octets: {line:?}", line.len());
        if !in_unsubscribe {
            assert!(line.len() <= 78, "{} octets: {line:?}", line.len());
        }
        assert!(
            !line.trim().is_empty(),
            "a folded line of whitespace only: {lines:?}"
        );
    }
    let unsub: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("unsubscribe?token="))
        .collect();
    assert!(unsub[0].len() > 78, "the URL is one token");

    // Python's e-mail package reads back every value exactly.
    let decoded = |name: &str| -> String {
        let all: Vec<&String> = m
            .parsed
            .decoded
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
            .collect();
        assert_eq!(all.len(), 1, "{name} appears {} times", all.len());
        all[0].clone()
    };
    assert_eq!(decoded("Subject"), subject);
    assert_eq!(decoded("X-Campaign"), campaign);
    assert_eq!(decoded("List-Unsubscribe"), unsubscribe);
    assert_eq!(decoded("X-Note"), note);
    let addresses = |h: &str| m.parsed.addresses[h].clone();
    let want = |list: &[(String, String, String)]| -> Vec<(String, String)> {
        list.iter()
            .map(|(n, a, _)| (n.clone(), a.clone()))
            .collect()
    };
    assert_eq!(addresses("to"), want(&to));
    assert_eq!(addresses("cc"), want(&cc));
    assert_eq!(
        addresses("from"),
        [(from_name.clone(), "shop@shop.example".to_owned())]
    );
    assert_eq!(
        addresses("reply-to"),
        [(reply_name.to_owned(), "help@shop.example".to_owned())]
    );
}

/// A Reply-To address that is not ASCII is written as it is into the header (no encoding
/// can carry it), which only SMTPUTF8 allows: the transaction asks for it although the
/// envelope's own addresses are ASCII. (It used to be sent as raw UTF-8 without.)
#[tokio::test]
async fn a_non_ascii_reply_to_asks_for_smtputf8() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    let mut payload = simple(&["a@example.com"]);
    payload["reply_to"] = json!("jörg@bücher.example");
    enqueue_email(&db, "utf8:reply-to", payload, 3, true).await;
    let w = start(&db, email_config(&fake.url()));
    wait_for_state(&db, "utf8:reply-to", "delivered", WAIT).await;
    w.stop().await;
    let mail: Vec<String> = fake
        .commands()
        .into_iter()
        .filter(|c| c.to_ascii_uppercase().starts_with("MAIL FROM"))
        .collect();
    assert_eq!(mail.len(), 1, "{mail:?}");
    assert!(mail[0].contains("SMTPUTF8"), "{mail:?}");
}

/// An address at an international domain names the same mailbox as its ASCII form, which
/// needs no SMTPUTF8: to a relay that does not offer it, `kunde@bücher.example` goes as
/// `kunde@xn--bcher-kva.example`, in the envelope and in the header. (It used to be dead
/// `permanent` there, "does not support SMTPUTF8".) A local part that is not ASCII has no
/// such form: that one still needs SMTPUTF8, and is refused by such a relay.
#[tokio::test]
async fn an_international_domain_goes_in_ascii_to_a_relay_without_smtputf8() {
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    fake.without_smtputf8();
    let mut payload = simple(&["Kunde <kunde@bücher.example>"]);
    payload["from"] = json!("shop@straße.example");
    enqueue_email(&db, "idn:domain", payload, 3, true).await;
    let mut payload = simple(&["jörg@example.com"]);
    payload["from"] = json!("shop@example.com");
    enqueue_email(&db, "idn:local-part", payload, 3, true).await;
    let w = start(&db, email_config(&fake.url()));
    wait_for_state(&db, "idn:domain", "delivered", WAIT).await;
    wait_for_state(&db, "idn:local-part", "dead", WAIT).await;
    w.stop().await;

    let commands = fake.commands();
    let envelope: Vec<&String> = commands
        .iter()
        .filter(|c| {
            let c = c.to_ascii_uppercase();
            c.starts_with("MAIL FROM") || c.starts_with("RCPT TO")
        })
        .collect();
    assert_eq!(
        envelope,
        [
            "MAIL FROM:<shop@xn--strae-oqa.example>",
            "RCPT TO:<kunde@xn--bcher-kva.example>"
        ],
        "{commands:?}"
    );
    let got = fake.received();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].header("To").as_deref(),
        Some("Kunde <kunde@xn--bcher-kva.example>")
    );
    assert_eq!(
        got[0].header("From").as_deref(),
        Some("shop@xn--strae-oqa.example")
    );
    assert!(got[0].content.is_ascii());
    let r = row(&db, "idn:local-part").await;
    assert_eq!(r.error_class.as_deref(), Some("permanent"), "{r:?}");
    assert!(
        r.last_error.as_deref().unwrap_or("").contains("SMTPUTF8"),
        "{r:?}"
    );
}

/// A subject whose whitespace runs are longer than a line reaches a real server intact:
/// aiosmtpd refuses a line over 998 octets (`500 Line too long`), as a subject of
/// `"a" + 1 500 spaces + "b"` used to make, and the message was dead `permanent`.
#[tokio::test]
async fn a_subject_with_long_whitespace_runs_is_delivered_exactly() {
    let db = TestDb::new().await;
    let sink = Sink::start(&[]).await;
    let subjects = [
        format!("a{}b", " ".repeat(1500)),
        format!("{}lead and trail{}", " ".repeat(1200), "\t".repeat(1100)),
    ];
    for (i, subject) in subjects.iter().enumerate() {
        let mut payload = simple(&["a@example.com"]);
        payload["subject"] = json!(subject);
        enqueue_email(&db, &format!("ws:{i}"), payload, 1, false).await;
    }
    let w = start(&db, email_config(&sink.url()));
    for i in 0..subjects.len() {
        let key = format!("ws:{i}");
        wait_until(WAIT, "the message delivered or dead", || async {
            matches!(row(&db, &key).await.state.as_str(), "delivered" | "dead")
        })
        .await;
        let r = row(&db, &key).await;
        assert_eq!(r.state, "delivered", "{key}: {:?}", r.last_error);
    }
    w.stop().await;
    let msgs = sink.messages();
    assert_eq!(msgs.len(), subjects.len());
    let mut got: Vec<String> = msgs
        .iter()
        .map(|m| {
            for line in header_lines(&m.raw_bytes()) {
                assert!(line.len() <= 78, "{} octets: {line:?}", line.len());
            }
            m.parsed
                .decoded
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("Subject"))
                .map(|(_, v)| v.clone())
                .unwrap()
        })
        .collect();
    got.sort();
    let mut want = subjects.to_vec();
    want.sort();
    assert_eq!(got, want);
}

/// An e-mail enqueued while no worker serves the `email` channel does not wait silently: a
/// worker that serves only webhooks warns, once, that the channel's messages are waiting,
/// how many and for how long, and what serves them. It never sends them.
#[tokio::test]
async fn a_worker_warns_when_a_channel_it_does_not_serve_has_waiting_messages() {
    let (logs, _guard) = LogCapture::install();
    let db = TestDb::new().await;
    let c = db.client().await;
    let ten_minutes_ago = std::time::SystemTime::now() - Duration::from_secs(600);
    for key in ["unserved:1", "unserved:2"] {
        let msg = outboxd::NewMessage::email(
            key,
            json!({"from": "shop@example.com", "to": ["a@example.com"], "text": "hi"}),
        )
        .run_after(ten_minutes_ago);
        outboxd::enqueue(&c, &msg).await.unwrap();
    }
    let worker = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let needle = "messages of a channel this worker does not serve are waiting";
    wait_until(WAIT, "the unserved channel's warning", || {
        let logs = logs.clone();
        async move { logs.text().contains(needle) }
    })
    .await;
    worker.stop().await;
    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(needle)).collect();
    assert_eq!(lines.len(), 1, "warned once: {lines:#?}");
    for part in [
        "WARN",
        "channel=email",
        "due=2",
        "served=webhook",
        "OUTBOXD_SMTP_URL",
    ] {
        assert!(lines[0].contains(part), "{part} in {}", lines[0]);
    }
    let oldest: u64 = lines[0]
        .split("oldest_due_seconds=")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("oldest_due_seconds in {}", lines[0]));
    assert!((600..700).contains(&oldest), "{}", lines[0]);
    assert_eq!(row(&db, "unserved:1").await.state, "pending");
}
