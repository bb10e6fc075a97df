//! Pausing a destination by hand: while paused, no request reaches it (no probe either)
//! and no attempt is counted, for webhooks and http messages alike; resumed, what it held
//! back is delivered. The CLI, the SQL functions, `status` and `/metrics` agree.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common;

use common::binary::{outboxd, run};
use common::receiver::{Receiver, Reply};
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

/// Messages whose key starts with `prefix`: (total, held back by a pause, attempts counted,
/// history rows).
async fn tally(db: &TestDb, prefix: &str) -> (i64, i64, i64, i64) {
    let r = db
        .client()
        .await
        .query_one(
            "SELECT count(*), \
                    count(*) FILTER (WHERE state = 'pending' \
                                     AND run_after > now() + interval '50 years'), \
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

fn destinations_json(db: &TestDb) -> Vec<Value> {
    let out = cli(db, &["destinations", "--json"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap()
}

fn worker_config(id: &str) -> outboxd::config::WorkerConfig {
    outboxd::config::WorkerConfig {
        channels: vec![Channel::Webhook, Channel::Http],
        ..test_worker_config(id)
    }
}

/// Paused from the CLI: its due messages and the ones that come due later are held back
/// (no request reaches its listener, no attempt or history row), while another host is
/// served; listed as paused with who and why; resumed, they are all delivered, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_webhook_host_gets_nothing_until_resumed() {
    let db = TestDb::new().await;
    let paused = Receiver::start().await;
    let other = Receiver::start().await;
    let host = paused.addr.to_string();
    enqueue_webhooks(&db, "p1:", &paused.url("/hook?token=s3cret"), 5).await;

    let out = cli(
        &db,
        &[
            "destinations",
            "--pause",
            &host,
            "--reason",
            "provider incident <b>#42</b>",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout
            .contains(&format!("paused {host}: 5 due messages held back")),
        "{}",
        out.stdout
    );
    // Due after the pause: the worker holds these back when it claims them.
    enqueue_webhooks(&db, "p2:", &paused.url("/hook"), 5).await;
    enqueue_webhooks(&db, "ok:", &other.url("/hook"), 5).await;

    let listed = destinations_json(&db);
    let d = listed.iter().find(|d| d["host"] == host.as_str()).unwrap();
    assert_eq!(d["state"], "paused", "{d}");
    assert_eq!(d["circuit"], "closed", "{d}");
    assert_eq!(d["paused_by"], "cli:ops-anna", "{d}");
    assert_eq!(d["pause_reason"], "provider incident <b>#42</b>", "{d}");
    assert!(d["paused_at"].is_string(), "{d}");
    let text = cli(&db, &["destinations"]);
    assert!(
        text.stdout
            .contains(&format!("{host} paused by cli:ops-anna since ")),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains(": provider incident <b>#42</b>"),
        "{}",
        text.stdout
    );

    let worker = RunningWorker::start(&db, worker_config("w1"), test_webhook_config());
    other.wait_for(5, WAIT).await;
    wait_until(WAIT, "every message of the paused host held back", || {
        let db = &db;
        async move { tally(db, "p").await.1 == 10 }
    })
    .await;
    assert_eq!(
        paused.requests().len(),
        0,
        "no request reaches a paused host"
    );
    assert_eq!(tally(&db, "p").await, (10, 10, 0, 0), "no attempt counted");

    // `show` says why a held-back message waits, rather than its parked due time.
    let shown = cli(&db, &["show", "--json", "p1:0"]);
    let detail: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(detail["paused_destination"], host.as_str(), "{detail}");
    let shown = cli(&db, &["show", "p1:0"]);
    assert!(
        shown.stdout.contains(&format!(
            "run_after    held back: destination {host} is paused"
        )),
        "{}",
        shown.stdout
    );
    let shown = cli(&db, &["show", "--json", "ok:0"]);
    let detail: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(detail["paused_destination"], Value::Null, "{detail}");

    let status = cli(&db, &["status", "--json"]);
    let st: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(st["paused_destinations"], 1, "{st}");
    assert_eq!(st["open_destinations"], 0, "{st}");
    let text = cli(&db, &["status"]);
    assert!(
        text.stdout.contains("paused destinations: 1"),
        "{}",
        text.stdout
    );

    let out = cli(&db, &["destinations", "--resume", &host]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout
            .contains(&format!("resumed {host}: 10 held-back messages due now")),
        "{}",
        out.stdout
    );
    paused.wait_for(10, WAIT).await;
    wait_until(WAIT, "every message delivered", || {
        let db = &db;
        async move { delivered(db, "p").await == 10 }
    })
    .await;
    worker.stop().await;
    assert_eq!(paused.requests().len(), 10, "each sent once");
    assert_eq!(tally(&db, "p").await, (10, 0, 10, 10));

    // Resumed, it is listed no more (closed, no failures), and both actions are recorded.
    assert!(
        destinations_json(&db)
            .iter()
            .all(|d| d["host"] != host.as_str())
    );
    let actions: Vec<(String, String, Option<i64>)> = db
        .client()
        .await
        .query(
            "SELECT action, actor, messages FROM outbox.destination_actions WHERE host = $1 \
             ORDER BY id",
            &[&host],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        actions,
        [
            ("paused".into(), "cli:ops-anna".into(), Some(5)),
            ("resumed".into(), "cli:ops-anna".into(), Some(10)),
        ]
    );
}

/// An http message's destination is its endpoint's host: paused through SQL, its
/// listener gets nothing while its messages are due, with breakers off too (the pause is
/// not a breaker); resumed, they go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_http_endpoint_host_gets_nothing_until_resumed() {
    let db = TestDb::new().await;
    let provider = Receiver::start().await;
    let other = Receiver::start().await;
    let c = db.client().await;
    c.execute(
        "SELECT * FROM outbox.set_endpoint('acme', $1, auth_secret => NULL)",
        &[&provider.url("/api")],
    )
    .await
    .unwrap();
    let host = provider.addr.to_string();
    let row = c
        .query_one(
            "SELECT destination, paused, held_back FROM outbox.pause_destination($1, 'maintenance window')",
            &[&host],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, bool>(1),
            row.get::<_, i64>(2)
        ),
        (host.clone(), true, 0)
    );
    let msgs: Vec<_> = (0..4)
        .map(|i| {
            outboxd::NewMessage::http(
                format!("h:{i}"),
                json!({"endpoint": "acme", "method": "POST", "path": "/v1/things",
                       "json": {"i": i}}),
            )
        })
        .collect();
    outboxd::enqueue_many(&c, &msgs).await.unwrap();
    enqueue_webhooks(&db, "ok:", &other.url("/hook"), 3).await;

    let mut cfg = worker_config("w1");
    cfg.breaker_threshold = 0;
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    other.wait_for(3, WAIT).await;
    wait_until(WAIT, "the http messages held back", || {
        let db = &db;
        async move { tally(db, "h:").await.1 == 4 }
    })
    .await;
    assert_eq!(
        provider.requests().len(),
        0,
        "no request reaches a paused host"
    );
    assert_eq!(tally(&db, "h:").await, (4, 4, 0, 0));

    let row = c
        .query_one(
            "SELECT destination, resumed, due_again FROM outbox.resume_destination($1)",
            &[&host],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(2), 4);
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
            .all(|r| r.uri.path() == "/api/v1/things"),
        "the endpoint's requests"
    );
}

/// A pause while requests are under way: the one in flight finishes (and counts), the
/// rest are held back once the worker has read the pause, and an open circuit under the
/// pause sends no probe until resumed; resumed, the circuit is as it was (its probe goes
/// first, and its success closes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_lets_requests_under_way_finish_and_sends_no_probe() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let host = rx.addr.to_string();
    // Failing slowly: three failures open the circuit.
    rx.set_default(Reply::Slow(Duration::from_millis(300), 503));
    enqueue_webhooks(&db, "s:", &rx.url("/hook"), 6).await;
    let mut cfg = worker_config("w1");
    cfg.concurrency = 1;
    cfg.breaker_threshold = 3;
    cfg.breaker_cooldown = Duration::from_millis(300);
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    let c = db.client().await;
    wait_until(WAIT, "the circuit open", || {
        let (c, host) = (&c, host.as_str());
        async move {
            c.query_opt(
                "SELECT 1 FROM outbox.destinations WHERE host = $1 AND state = 'open'",
                &[&host],
            )
            .await
            .unwrap()
            .is_some()
        }
    })
    .await;
    let out = cli(&db, &["destinations", "--pause", &host]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // Every message not finished is held back: none is running any more, so the request
    // that was under way has ended and been recorded.
    wait_until(WAIT, "the rest held back", || {
        let db = &db;
        async move {
            let (total, parked, ..) = tally(db, "s:").await;
            let finished: i64 = db
                .client()
                .await
                .query_one(
                    "SELECT count(*) FROM outbox.messages WHERE message_key LIKE 's:%' \
                     AND state IN ('delivered', 'dead')",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            parked + finished == total
        }
    })
    .await;
    let sent = rx.requests().len();
    let (_, parked, attempts, history) = tally(&db, "s:").await;
    assert!(parked > 0, "something held back");
    assert_eq!(attempts as usize, sent, "every request counted, no more");
    assert_eq!(history as usize, sent, "every request recorded");
    // Once the cooldown has passed, a message that comes due would be the probe of an
    // open circuit; paused, it is held back with the rest and the circuit stays open.
    wait_until(WAIT, "the cooldown passed", || {
        let c = &c;
        let host = host.as_str();
        async move {
            c.query_opt(
                "SELECT 1 FROM outbox.destinations WHERE host = $1 AND open_until < now()",
                &[&host],
            )
            .await
            .unwrap()
            .is_some()
        }
    })
    .await;
    enqueue_webhooks(&db, "s:late", &rx.url("/hook"), 1).await;
    wait_until(WAIT, "the late message held back", || {
        let db = &db;
        async move { tally(db, "s:").await.1 == parked + 1 }
    })
    .await;
    let parked = parked + 1;
    assert_eq!(rx.requests().len(), sent, "no probe while paused");
    let listed = destinations_json(&db);
    let d = listed.iter().find(|d| d["host"] == host.as_str()).unwrap();
    assert_eq!(d["state"], "paused", "{d}");
    assert_eq!(d["circuit"], "open", "no probe taken: {d}");

    rx.set_default(Reply::Status(204));
    let out = cli(&db, &["destinations", "--resume", &host]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    wait_until(WAIT, "the held-back messages delivered", || {
        let db = &db;
        async move { delivered(db, "s:").await == parked }
    })
    .await;
    worker.stop().await;
    let closed: String = db
        .client()
        .await
        .query_one(
            "SELECT state FROM outbox.destinations WHERE host = $1",
            &[&host],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(closed, "closed", "the probe's success closed the circuit");
}

/// Bad input, each a clear one-line error with nothing changed: hosts with spaces,
/// Unicode, SQL, nothing; reasons with control characters, too long or blank. An unknown
/// host is refused by `--resume` only (exit 1, named); HTML in a reason is stored as
/// typed and printed as text.
#[tokio::test]
async fn hostile_hosts_and_reasons_are_refused_in_one_line() {
    let db = TestDb::new().await;
    let long = "r".repeat(501);
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["--pause", "a b.example"],
            2,
            "no spaces or control characters",
        ),
        (vec!["--pause", ""], 2, "1 to 1000 characters"),
        (
            vec!["--pause", "bücher.example"],
            2,
            "host must be a destination",
        ),
        (
            vec!["--pause", "x';DROP_TABLE_outbox.messages;--"],
            2,
            "host must be a destination",
        ),
        (
            vec!["--pause", "a.example/path"],
            2,
            "host must be a destination",
        ),
        (
            vec!["--pause", "a.example:99999"],
            2,
            "host must be a destination",
        ),
        (
            vec!["--pause", "a.example", "--reason", "two\nlines"],
            2,
            "U+000A at character 4",
        ),
        (
            vec!["--pause", "a.example", "--reason", "bell\u{7}"],
            2,
            "U+0007",
        ),
        (
            vec!["--pause", "a.example", "--reason", "rtl\u{202e}x"],
            2,
            "U+202E",
        ),
        (
            vec!["--pause", "a.example", "--reason", &long],
            2,
            "at most 500 characters (got 501)",
        ),
        (
            vec!["--pause", "a.example", "--reason", "   "],
            2,
            "must not be empty",
        ),
        (vec!["--reason", "why"], 2, "--pause"),
        (
            vec!["--pause", "a.example", "--resume", "a.example"],
            2,
            "cannot be used with",
        ),
        (
            vec!["--pause", "a.example", "--json"],
            2,
            "do not go with --json",
        ),
        (
            vec!["--resume", "never.example"],
            1,
            "no destination never.example is known",
        ),
        (vec!["--resume", "x';--"], 2, "host must be a destination"),
    ];
    for (args, code, says) in &cases {
        let mut all = vec!["destinations"];
        all.extend(args.iter().copied());
        let out = cli(&db, &all);
        assert_eq!(out.code, Some(*code), "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
        assert_eq!(out.stderr_lines().len(), 1, "{args:?}: {}", out.stderr);
        assert!(out.stdout.is_empty(), "{args:?}: {}", out.stdout);
    }
    let n: i64 = db.scalar("SELECT count(*) FROM outbox.destinations").await;
    assert_eq!(n, 0, "nothing was paused");

    // Upper case and a trailing dot are the same destination, as messages name it.
    let out = cli(
        &db,
        &[
            "destinations",
            "--pause",
            "API.Example.com.",
            "--reason",
            "<script>alert(1)</script>",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout.starts_with("paused api.example.com: 0 due"),
        "{}",
        out.stdout
    );
    let again = cli(&db, &["destinations", "--pause", "api.example.com"]);
    assert!(
        again.stdout.contains("was already paused"),
        "{}",
        again.stdout
    );
    let listed = destinations_json(&db);
    assert_eq!(listed[0]["pause_reason"], "<script>alert(1)</script>");
    // Resuming one that is not paused changes nothing, and says so.
    cli(&db, &["destinations", "--resume", "api.example.com"]);
    let out = cli(&db, &["destinations", "--resume", "api.example.com"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("was not paused"), "{}", out.stdout);
}

/// `--drain` does not wait for what a pause holds back (a person must resume it, as a held
/// message waits for approval): it delivers the rest and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_does_not_wait_for_a_paused_destination() {
    let db = TestDb::new().await;
    let paused = Receiver::start().await;
    let other = Receiver::start().await;
    enqueue_webhooks(&db, "p:", &paused.url("/hook"), 3).await;
    enqueue_webhooks(&db, "ok:", &other.url("/hook"), 3).await;
    let out = cli(&db, &["destinations", "--pause", &paused.addr.to_string()]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // Due after the pause: claimed, then held back by the worker.
    enqueue_webhooks(&db, "q:", &paused.url("/hook"), 2).await;
    let mut cfg = worker_config("w1");
    cfg.drain = true;
    RunningWorker::start(&db, cfg, test_webhook_config())
        .drained(WAIT)
        .await;
    assert_eq!(delivered(&db, "ok:").await, 3);
    assert_eq!(tally(&db, "p:").await, (3, 3, 0, 0));
    assert_eq!(tally(&db, "q:").await, (2, 2, 0, 0));
    assert_eq!(paused.requests().len(), 0);
}
