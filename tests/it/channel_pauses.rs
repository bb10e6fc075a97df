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
        (vec!["--pause", "sms"], 1, "unknown channel \"sms\""),
        (vec!["--pause", "Webhook"], 1, "unknown channel"),
        (vec!["--pause", ""], 1, "unknown channel"),
        (
            vec!["--pause", "web\nhook"],
            1,
            "unknown channel \"web\\\\nhook\"",
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
