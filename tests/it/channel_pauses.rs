//! Pausing a whole channel by hand: while paused, none of its messages is claimed (nothing
//! sent, no attempt counted, no history row; they stay due) while the other channels flow;
//! resumed, they are delivered. The CLI, the SQL functions, `status` and `--drain` agree.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common;

use common::binary::{outboxd, run};
use common::receiver::Receiver;
use common::*;
use outboxd::model::Channel;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

async fn enqueue_webhooks(db: &TestDb, prefix: &str, url: &str, n: usize) {
    let msgs: Vec<_> = (0..n)
        .map(|i| {
            outboxd::NewMessage::webhook(
                format!("{prefix}{i}"),
                json!({"url": url, "body": {"i": i}}),
            )
        })
        .collect();
    outboxd::enqueue_many(&db.client().await, &msgs)
        .await
        .unwrap();
}

async fn enqueue_http(db: &TestDb, prefix: &str, n: usize) {
    let msgs: Vec<_> = (0..n)
        .map(|i| {
            outboxd::NewMessage::http(
                format!("{prefix}{i}"),
                json!({"endpoint": "acme", "method": "POST", "path": "/v1/things",
                       "json": {"i": i}}),
            )
        })
        .collect();
    outboxd::enqueue_many(&db.client().await, &msgs)
        .await
        .unwrap();
}

async fn set_endpoint(db: &TestDb, provider: &Receiver) {
    db.client()
        .await
        .execute(
            "SELECT * FROM outbox.set_endpoint('acme', $1, auth_secret => NULL)",
            &[&provider.url("/api")],
        )
        .await
        .unwrap();
}

/// Messages whose key starts with `prefix`: (total, pending and due now, attempts
/// counted, history rows).
async fn tally(db: &TestDb, prefix: &str) -> (i64, i64, i64, i64) {
    let r = db
        .client()
        .await
        .query_one(
            "SELECT count(*), \
                    count(*) FILTER (WHERE state = 'pending' AND run_after <= now()), \
                    coalesce(sum(attempts), 0)::bigint, \
                    (SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m \
                     ON m.id = a.message_id WHERE m.message_key LIKE $1) \
             FROM outbox.messages WHERE message_key LIKE $1",
            &[&format!("{prefix}%")],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

async fn delivered(db: &TestDb, prefix: &str) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE message_key LIKE $1 \
             AND state = 'delivered'",
            &[&format!("{prefix}%")],
        )
        .await
        .unwrap()
        .get(0)
}

fn cli(db: &TestDb, args: &[&str]) -> common::binary::Output {
    run(outboxd(Some(&db.url())).args(args).env("USER", "ops-anna"))
}

fn channels_json(db: &TestDb) -> Vec<Value> {
    let out = cli(db, &["channels", "--json"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap()
}

fn worker_config(id: &str) -> outboxd::config::WorkerConfig {
    outboxd::config::WorkerConfig {
        channels: vec![Channel::Webhook, Channel::Http],
        ..test_worker_config(id)
    }
}

/// Paused from the CLI: the webhook channel's due messages stay due and untouched (no
/// request, no attempt, no history row) while http messages, enqueued before and after
/// them, are delivered; listed as paused with who and why, in `status` too; resumed, they
/// are all delivered, once each, and both actions are recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_webhook_channel_sends_nothing_until_resumed() {
    let db = TestDb::new().await;
    let hooks = Receiver::start().await;
    let provider = Receiver::start().await;
    set_endpoint(&db, &provider).await;

    let out = cli(
        &db,
        &[
            "channels",
            "--pause",
            "webhook",
            "--reason",
            "provider incident <b>#42</b>",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout.starts_with(
            "paused webhook: none of its messages is sent until `outboxd channels --resume webhook`"
        ),
        "{}",
        out.stdout
    );
    let again = cli(
        &db,
        &["channels", "--pause", "webhook", "--reason", "other"],
    );
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert!(
        again
            .stdout
            .contains("webhook was already paused; left as it was"),
        "{}",
        again.stdout
    );
    enqueue_webhooks(&db, "w:", &hooks.url("/hook?token=s3cret"), 5).await;
    enqueue_http(&db, "h1:", 3).await;

    let listed = channels_json(&db);
    let names: Vec<&str> = listed
        .iter()
        .map(|c| c["channel"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["webhook", "email", "http"]);
    let w = &listed[0];
    assert_eq!(w["paused"], true, "{w}");
    assert_eq!(w["paused_by"], "cli:ops-anna", "{w}");
    assert_eq!(w["pause_reason"], "provider incident <b>#42</b>", "{w}");
    assert!(w["paused_at"].is_string(), "{w}");
    let e = &listed[1];
    assert_eq!(
        (
            &e["paused"],
            &e["paused_at"],
            &e["paused_by"],
            &e["pause_reason"]
        ),
        (&json!(false), &Value::Null, &Value::Null, &Value::Null),
        "{e}"
    );
    let text = cli(&db, &["channels"]);
    let lines: Vec<&str> = text.stdout.lines().collect();
    assert!(lines[0].starts_with("channel"), "{}", text.stdout);
    assert!(
        lines.iter().any(|l| l.starts_with("webhook")
            && l.contains("paused")
            && l.contains("cli:ops-anna")),
        "{}",
        text.stdout
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("email") && l.contains("running")),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout
            .contains("webhook paused: provider incident <b>#42</b>"),
        "{}",
        text.stdout
    );

    let worker = RunningWorker::start(&db, worker_config("w1"), test_webhook_config());
    provider.wait_for(3, WAIT).await;
    // Enqueued while the webhooks wait: the worker keeps claiming the other channel.
    enqueue_http(&db, "h2:", 2).await;
    provider.wait_for(5, WAIT).await;
    wait_until(WAIT, "the http messages delivered", || {
        let db = &db;
        async move { delivered(db, "h").await == 5 }
    })
    .await;
    assert_eq!(
        hooks.requests().len(),
        0,
        "nothing sent on a paused channel"
    );
    assert_eq!(
        tally(&db, "w:").await,
        (5, 5, 0, 0),
        "all due, no attempt counted, no history row"
    );

    // `show` says why a message of a paused channel waits.
    let shown = cli(&db, &["show", "--json", "w:0"]);
    let detail: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(detail["paused_channel"], true, "{detail}");
    let shown = cli(&db, &["show", "w:0"]);
    assert!(
        shown.stdout.contains(
            "channel      webhook (paused: not sent until `outboxd channels --resume webhook`)"
        ),
        "{}",
        shown.stdout
    );
    let shown = cli(&db, &["show", "--json", "h1:0"]);
    let detail: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(detail["paused_channel"], false, "{detail}");

    let status = cli(&db, &["status", "--json"]);
    let st: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(st["paused_channels"], json!(["webhook"]), "{st}");
    let text = cli(&db, &["status"]);
    assert!(
        text.stdout.contains("paused channels: webhook ("),
        "{}",
        text.stdout
    );

    let out = cli(&db, &["channels", "--resume", "webhook"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout
            .contains("resumed webhook: its messages are sent again"),
        "{}",
        out.stdout
    );
    hooks.wait_for(5, WAIT).await;
    wait_until(WAIT, "every webhook delivered", || {
        let db = &db;
        async move { delivered(db, "w:").await == 5 }
    })
    .await;
    worker.stop().await;
    assert_eq!(hooks.requests().len(), 5, "each sent once");
    assert_eq!(tally(&db, "w:").await, (5, 0, 5, 5));

    let out = cli(&db, &["channels", "--resume", "webhook"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout
            .contains("webhook was not paused; nothing to resume"),
        "{}",
        out.stdout
    );
    let status = cli(&db, &["status", "--json"]);
    let st: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(st["paused_channels"], json!([]), "{st}");
    assert!(channels_json(&db).iter().all(|c| c["paused"] == false));
    let actions: Vec<(String, String, String, Option<String>)> = db
        .client()
        .await
        .query(
            "SELECT channel, action, actor, reason FROM outbox.channel_actions ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(
        actions,
        [
            (
                "webhook".into(),
                "paused".into(),
                "cli:ops-anna".into(),
                Some("provider incident <b>#42</b>".into())
            ),
            (
                "webhook".into(),
                "resumed".into(),
                "cli:ops-anna".into(),
                None
            ),
        ],
        "the second pause changed nothing and is not recorded"
    );
}

/// Paused through SQL: an http endpoint's provider gets nothing while its messages are
/// due, the webhooks flow; resumed through SQL, an idle worker claims them at once (the
/// resume wakes it: the poll interval here is far longer than the wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_http_channel_gets_nothing_and_a_resume_wakes_the_worker() {
    let db = TestDb::new().await;
    let provider = Receiver::start().await;
    let hooks = Receiver::start().await;
    set_endpoint(&db, &provider).await;
    let c = db.client().await;
    let row = c
        .query_one(
            "SELECT name, paused FROM outbox.pause_channel('http', 'maintenance window')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, bool>(1)),
        ("http".into(), true)
    );
    enqueue_http(&db, "h:", 4).await;
    enqueue_webhooks(&db, "ok:", &hooks.url("/hook"), 3).await;

    let mut cfg = worker_config("w1");
    cfg.poll_interval = Duration::from_secs(600);
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    hooks.wait_for(3, WAIT).await;
    wait_until(WAIT, "the webhooks delivered", || {
        let db = &db;
        async move { delivered(db, "ok:").await == 3 }
    })
    .await;
    assert_eq!(
        provider.requests().len(),
        0,
        "nothing sent on a paused channel"
    );
    assert_eq!(tally(&db, "h:").await, (4, 4, 0, 0));

    let row = c
        .query_one(
            "SELECT name, resumed FROM outbox.resume_channel('http')",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(1));
    provider.wait_for(4, WAIT).await;
    wait_until(WAIT, "the http messages delivered", || {
        let db = &db;
        async move { delivered(db, "h:").await == 4 }
    })
    .await;
    worker.stop().await;
    assert!(
        provider
            .requests()
            .iter()
            .all(|r| r.uri.path() == "/api/v1/things")
    );
}

/// `--drain` does not wait for a paused channel's messages (a person must resume it): it
/// delivers the rest and stops, also when every channel it serves is paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_does_not_wait_for_a_paused_channel() {
    let db = TestDb::new().await;
    let hooks = Receiver::start().await;
    let provider = Receiver::start().await;
    set_endpoint(&db, &provider).await;
    enqueue_webhooks(&db, "w:", &hooks.url("/hook"), 3).await;
    enqueue_http(&db, "h:", 2).await;
    let out = cli(&db, &["channels", "--pause", "webhook"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let mut cfg = worker_config("w1");
    cfg.drain = true;
    RunningWorker::start(&db, cfg.clone(), test_webhook_config())
        .drained(WAIT)
        .await;
    assert_eq!(delivered(&db, "h:").await, 2);
    assert_eq!(tally(&db, "w:").await, (3, 3, 0, 0));

    // Both paused: no claim at all, and the drain still ends.
    let out = cli(&db, &["channels", "--pause", "http"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    enqueue_http(&db, "h2:", 2).await;
    RunningWorker::start(&db, cfg, test_webhook_config())
        .drained(WAIT)
        .await;
    assert_eq!(tally(&db, "h2:").await, (2, 2, 0, 0));
    assert_eq!(tally(&db, "w:").await, (3, 3, 0, 0));
    assert_eq!(hooks.requests().len(), 0);
    assert_eq!(provider.requests().len(), 2);
}

/// Hostile channel names and reasons: one line on stderr, the right exit code, nothing
/// printed on stdout and nothing paused or recorded.
#[tokio::test]
async fn hostile_channels_and_reasons_are_refused_in_one_line() {
    let db = TestDb::new().await;
    let long_channel = "w".repeat(10_000);
    let long_reason = "r".repeat(10_000);
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["--pause", "sms"],
            1,
            "unknown channel 'sms': channel must be",
        ),
        (vec!["--pause", "Webhook"], 1, "unknown channel"),
        (vec!["--pause", ""], 1, "unknown channel"),
        (
            vec!["--pause", "web\nhook"],
            1,
            "unknown channel 'web\\nhook'",
        ),
        (vec!["--pause", "web\u{1b}[31mhook"], 1, "unknown channel"),
        (vec!["--pause", &long_channel], 1, "unknown channel"),
        (
            vec!["--pause", "<script>alert(1)</script>"],
            1,
            "unknown channel",
        ),
        (
            vec!["--pause", "webhook'); DROP TABLE outbox.messages; --"],
            1,
            "unknown channel",
        ),
        (vec!["--resume", "x';--"], 1, "unknown channel"),
        (
            vec!["--pause", "email", "--reason", "two\nlines"],
            2,
            "U+000A at character 4",
        ),
        (
            vec!["--pause", "email", "--reason", "rtl\u{202e}x"],
            2,
            "U+202E",
        ),
        (
            vec!["--pause", "email", "--reason", &long_reason],
            2,
            "at most 500 characters (got 10000)",
        ),
        (
            vec!["--pause", "email", "--reason", "   "],
            2,
            "must not be empty",
        ),
        (vec!["--reason", "why"], 2, "--pause"),
        (
            vec!["--pause", "email", "--resume", "email"],
            2,
            "cannot be used with",
        ),
        (vec!["--pause", "email", "--json"], 2, "cannot be used with"),
    ];
    for (args, code, says) in &cases {
        let mut all = vec!["channels"];
        all.extend(args.iter().copied());
        let out = cli(&db, &all);
        let shown: String = format!("{args:?}").chars().take(80).collect();
        assert_eq!(out.code, Some(*code), "{shown}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{shown}: {}", out.stderr);
        assert_eq!(out.stderr_lines().len(), 1, "{shown}: {}", out.stderr);
        assert!(out.stderr.len() < 1000, "{shown}: cut");
        assert!(out.stdout.is_empty(), "{shown}: {}", out.stdout);
    }
    // Through SQL: 22023 naming the field.
    let c = db.client().await;
    for (sql, column) in [
        (
            "SELECT * FROM outbox.pause_channel(E'web\\x01hook')",
            "channel",
        ),
        ("SELECT * FROM outbox.pause_channel(NULL)", "channel"),
        ("SELECT * FROM outbox.resume_channel('sms')", "channel"),
        (
            "SELECT * FROM outbox.pause_channel('email', E'a\\tb')",
            "reason",
        ),
    ] {
        let e = c.batch_execute(sql).await.unwrap_err();
        let d = e.as_db_error().unwrap();
        assert_eq!(d.code().code(), "22023", "{sql}");
        assert_eq!(d.column(), Some(column), "{sql}");
    }
    let n: i64 = db
        .scalar("SELECT (SELECT count(*) FROM outbox.paused_channels) + (SELECT count(*) FROM outbox.channel_actions)")
        .await;
    assert_eq!(n, 0, "nothing was paused or recorded");

    // Markup in a reason is kept as typed (pages escape it).
    let out = cli(
        &db,
        &[
            "channels",
            "--pause",
            "email",
            "--reason",
            "<script>alert(1)</script>",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        channels_json(&db)[1]["pause_reason"],
        "<script>alert(1)</script>"
    );
}

/// E-mail, with an SMTP stand-in: paused, the relay is not even connected to while the
/// channel's messages are due (its lane claims nothing) and the webhooks flow; resumed
/// from the CLI, every e-mail is sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_email_channel_does_not_connect_to_the_relay_until_resumed() {
    use common::smtp::FakeSmtp;
    use outboxd::deliver::email::settings::{EmailConfig, SmtpUrl};
    let db = TestDb::new().await;
    let fake = FakeSmtp::start().await;
    let hooks = Receiver::start().await;
    let out = cli(
        &db,
        &[
            "channels",
            "--pause",
            "email",
            "--reason",
            "SMTP relay down",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let c = db.client().await;
    for i in 0..3 {
        let msg = outboxd::NewMessage::email(
            format!("m:{i}"),
            json!({"from": "shop@example.com", "to": ["a@example.com"], "subject": "Hi", "text": "hi"}),
        );
        outboxd::enqueue(&c, &msg).await.unwrap();
    }
    enqueue_webhooks(&db, "ok:", &hooks.url("/hook"), 2).await;
    let cfg = outboxd::config::WorkerConfig {
        channels: vec![Channel::Email, Channel::Webhook],
        ..test_worker_config("mailer")
    };
    let email = EmailConfig {
        timeout: Duration::from_secs(2),
        ..EmailConfig::new(SmtpUrl::parse(&fake.url()).unwrap())
    };
    let worker = RunningWorker::start_with(&db, cfg, test_webhook_config(), Some(email));
    hooks.wait_for(2, WAIT).await;
    wait_until(WAIT, "the webhooks delivered", || {
        let db = &db;
        async move { delivered(db, "ok:").await == 2 }
    })
    .await;
    assert_eq!(fake.connections(), 0, "the relay is left alone");
    assert_eq!(tally(&db, "m:").await, (3, 3, 0, 0));

    let out = cli(&db, &["channels", "--resume", "email"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    wait_until(WAIT, "the e-mails delivered", || {
        let db = &db;
        async move { delivered(db, "m:").await == 3 }
    })
    .await;
    worker.stop().await;
    assert_eq!(fake.received().len(), 3, "each sent once");
    assert_eq!(tally(&db, "m:").await, (3, 0, 3, 3));
}

/// A worker that does not serve a channel warns when its messages wait, but not for a
/// paused channel: those wait for a person. (Both are read in the same look, so the
/// warning for the unpaused one shows the paused one was looked at and left out.)
#[tokio::test]
async fn the_unserved_watch_leaves_a_paused_channel_out() {
    let (logs, _guard) = LogCapture::install();
    let db = TestDb::new().await;
    let provider = Receiver::start().await;
    set_endpoint(&db, &provider).await;
    let c = db.client().await;
    c.batch_execute("SELECT outbox.pause_channel('email', 'relay down')")
        .await
        .unwrap();
    let ten_minutes_ago = std::time::SystemTime::now() - Duration::from_secs(600);
    let mail = outboxd::NewMessage::email(
        "unserved:mail",
        json!({"from": "shop@example.com", "to": ["a@example.com"], "text": "hi"}),
    )
    .run_after(ten_minutes_ago);
    outboxd::enqueue(&c, &mail).await.unwrap();
    let call = outboxd::NewMessage::http(
        "unserved:call",
        json!({"endpoint": "acme", "method": "POST", "path": "/v1/things", "json": {}}),
    )
    .run_after(ten_minutes_ago);
    outboxd::enqueue(&c, &call).await.unwrap();
    let cfg = outboxd::config::WorkerConfig {
        channels: vec![Channel::Webhook],
        ..test_worker_config("w")
    };
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    let needle = "messages of a channel this worker does not serve are waiting";
    wait_until(WAIT, "the unserved http channel's warning", || {
        let logs = logs.clone();
        async move { logs.text().contains(needle) }
    })
    .await;
    worker.stop().await;
    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(needle)).collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains("channel=http"), "{}", lines[0]);
}

mod console {
    //! The console: the channels on the overview and on `/channels`, pause and resume
    //! through the confirmation step that the CLI then sees, the CSRF refusal, markup as
    //! text, and the page at a phone's width in a real browser.

    use super::*;
    use common::console::*;

    async fn post(
        console: &Console,
        s: &HttpSession,
        channel: &str,
        pairs: &[(&str, &str)],
    ) -> (u16, String) {
        let mut all = vec![("csrf", s.csrf.as_str())];
        all.extend_from_slice(pairs);
        let res = post_form(
            &console.url(&format!("/channels/{channel}")),
            Some(&s.cookie),
            form(&all),
        )
        .await;
        (res.status().as_u16(), res.text().await.unwrap())
    }

    fn email(db: &TestDb) -> Value {
        channels_json(db)
            .into_iter()
            .find(|c| c["channel"] == "email")
            .unwrap()
    }

    /// Signed out: sent to sign in, a POST refused. Signed in: a forged or missing CSRF
    /// token changes nothing; the pause's first step only asks, the second pauses
    /// (recorded as `console:alice`, as `outboxd channels --json` shows), a replay of it
    /// is refused (409); the overview shows the pause in red with who and why, as text;
    /// the resume goes the same way.
    #[tokio::test]
    async fn pause_and_resume_a_channel_from_the_console() {
        let db = TestDb::new().await;
        // An e-mail that waits (no worker runs here): its page says when its channel is paused.
        let mail = outboxd::NewMessage::email(
            "mail:1",
            json!({"from": "shop@example.com", "to": ["a@example.com"], "text": "hi"}),
        );
        let id = outboxd::enqueue(&db.client().await, &mail)
            .await
            .unwrap()
            .id;
        let console = Console::start(&db);
        let res = http().get(console.url("/channels")).send().await.unwrap();
        assert_eq!(res.status(), 303);
        assert_eq!(res.headers()["location"], "/signin");
        let res = post_form(
            &console.url("/channels/email"),
            None,
            form(&[("do", "pause"), ("confirmed", "yes"), ("seen", "running")]),
        )
        .await;
        assert_eq!(res.status(), 403);

        let s = sign_in(&console, "alice").await;
        for csrf in ["", &"0".repeat(64)] {
            let res = post_form(
                &console.url("/channels/email"),
                Some(&s.cookie),
                form(&[
                    ("csrf", csrf),
                    ("do", "pause"),
                    ("confirmed", "yes"),
                    ("seen", "running"),
                ]),
            )
            .await;
            assert_eq!(res.status(), 403);
        }
        assert_eq!(email(&db)["paused"], false, "nothing changed");

        let page = get(&console.url("/"), &s.cookie)
            .await
            .text()
            .await
            .unwrap();
        assert!(page.contains("href=\"/channels\""), "the nav links to it");
        assert!(page.contains("id=\"pause-email\""), "{page}");
        assert!(!page.contains("id=\"paused-channels\""), "{page}");

        let (status, page) = post(&console, &s, "email", &[("do", "pause")]).await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Pause the email channel?"), "{page}");
        assert!(page.contains("id=\"reason\""), "{page}");
        assert_eq!(
            email(&db)["paused"],
            false,
            "the confirmation page changes nothing"
        );

        let reason = "SMTP relay down <script>alert(1)</script>";
        let confirm = [
            ("do", "pause"),
            ("reason", reason),
            ("confirmed", "yes"),
            ("seen", "running"),
        ];
        let (status, page) = post(&console, &s, "email", &confirm).await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Paused email"), "{page}");
        assert!(page.contains("console:alice"), "{page}");
        let e = email(&db);
        assert_eq!(e["paused"], true, "{e}");
        assert_eq!(e["paused_by"], "console:alice", "{e}");
        assert_eq!(e["pause_reason"], reason, "{e}");
        let (status, page) = post(&console, &s, "email", &confirm).await;
        assert_eq!(status, 409, "{page}");
        assert!(page.contains("nothing changed"), "{page}");

        let page = get(&console.url("/"), &s.cookie)
            .await
            .text()
            .await
            .unwrap();
        assert!(page.contains("id=\"paused-channels\""), "{page}");
        assert!(
            page.contains("<b class=\"paused-by\">console:alice</b>"),
            "{page}"
        );
        assert!(
            page.contains("SMTP relay down &lt;script&gt;alert(1)&lt;/script&gt;"),
            "escaped: {page}"
        );
        assert!(!page.contains("<script>"), "{page}");
        assert!(page.contains("id=\"resume-email\""), "{page}");
        let page = get(&console.url(&format!("/message/{id}")), &s.cookie)
            .await
            .text()
            .await
            .unwrap();
        assert!(page.contains("id=\"paused-channel\""), "{page}");

        // A bad reason, an unknown channel or action: one line, nothing changed.
        let (status, page) = post(
            &console,
            &s,
            "webhook",
            &[
                ("do", "pause"),
                ("reason", "a\nb"),
                ("confirmed", "yes"),
                ("seen", "running"),
            ],
        )
        .await;
        assert_eq!(status, 400, "{page}");
        assert!(page.contains("U+000A"), "{page}");
        for path in ["sms", "%3Cscript%3E", "Email"] {
            let (status, page) = post(&console, &s, path, &[("do", "pause")]).await;
            assert_eq!(status, 404, "{path}: {page}");
            assert!(!page.contains("<script>"), "{page}");
        }
        let (status, _) = post(&console, &s, "http", &[("do", "<b>drop</b>")]).await;
        assert_eq!(status, 400);
        let paused: Vec<String> = channels_json(&db)
            .iter()
            .filter(|c| c["paused"] == true)
            .map(|c| c["channel"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(paused, ["email"]);

        let (status, page) = post(&console, &s, "email", &[("do", "resume")]).await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Resume the email channel?"), "{page}");
        let (status, page) = post(
            &console,
            &s,
            "email",
            &[("do", "resume"), ("confirmed", "yes"), ("seen", "paused")],
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Resumed email"), "{page}");
        assert_eq!(email(&db)["paused"], false);
        let actors: Vec<(String, String)> = db
            .client()
            .await
            .query(
                "SELECT action, actor FROM outbox.channel_actions ORDER BY id",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(
            actors,
            [
                ("paused".into(), "console:alice".into()),
                ("resumed".into(), "console:alice".into())
            ]
        );
    }

    /// In Chromium at a phone's width: the channels page, a pause through its confirmation
    /// page (with a long reason) and the overview that shows it, then the resume; no page
    /// wider than the screen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_phone_pauses_and_resumes_a_channel_in_a_browser() {
        let db = TestDb::new().await;
        let console = Console::start(&db);
        let b = Browser::start(390, 844).await;
        b.sign_in(&console, "alice", TOKEN).await;
        b.wait_for("main").await;
        let fits = |what: &'static str| {
            let b = &b;
            async move {
                let v = b
                    .client
                    .execute(
                        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth];",
                        vec![],
                    )
                    .await
                    .unwrap();
                let (scroll, client) = (v[0].as_i64().unwrap(), v[1].as_i64().unwrap());
                assert!(
                    scroll <= client,
                    "{what}: {scroll} px wide in a {client} px window"
                );
            }
        };
        b.open(&console.url("/channels"), "#pause-email").await;
        fits("the channels").await;
        b.click("#pause-email", "#touches").await;
        assert!(
            b.text("#touches")
                .await
                .contains("No email message is sent")
        );
        fits("the confirmation").await;
        b.wait_for("#reason")
            .await
            .send_keys(&"SMTP relay down, provider says an hour or so ".repeat(8))
            .await
            .unwrap();
        b.click("#do-it", "#result").await;
        assert!(b.text("#result").await.contains("Paused email"));
        assert_eq!(email(&db)["paused"], true);

        b.open(&console.url("/"), "#paused-channels").await;
        assert!(b.text("#paused-channels").await.contains("console:alice"));
        fits("the overview with a paused channel").await;
        b.click("#resume-email", "#do-it").await;
        fits("the resume's confirmation").await;
        b.click("#do-it", "#result").await;
        assert_eq!(email(&db)["paused"], false);
        b.close().await;
    }
}
