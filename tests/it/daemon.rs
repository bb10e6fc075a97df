//! The real `outboxd run` process: signals, metrics, health, JSON logs, database outages.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::receiver::{Receiver, Reply};
use common::*;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `outboxd ARGS…` with a clean environment, private networks allowed, info logs, stdout
/// to /dev/null and stderr to a pipe.
fn command(database_url: &str, args: &[&str], extra_env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", database_url)
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd
}

fn daemon(database_url: &str, args: &[&str], extra_env: &[(&str, &str)]) -> Child {
    let args: Vec<&str> = std::iter::once("run").chain(args.iter().copied()).collect();
    command(database_url, &args, extra_env).spawn().unwrap()
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args(["-s", sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -s {sig}");
}

/// Waits for the process to exit (bounded) and returns (exit code, stderr).
fn wait_exit(mut child: Child, timeout: Duration) -> (Option<i32>, String) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.code(), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("outboxd did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of the first line of a Prometheus `text` that starts with `prefix`.
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut buf))
        .await
        .ok()?
        .ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_attempts_finish_then_exits_zero() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([
        Reply::Stall(Duration::from_millis(1500)),
        Reply::Stall(Duration::from_millis(1500)),
    ]);
    enqueue_webhook(&db, "term:1", &rx.url("/h"), 3, true).await;
    enqueue_webhook(&db, "term:2", &rx.url("/h"), 3, true).await;
    let child = daemon(
        &db.url(),
        &["--webhook-timeout", "5s", "--shutdown-grace", "10s"],
        &[],
    );
    rx.wait_for(2, Duration::from_secs(15)).await;
    signal(&child, "TERM");
    let (code, err) =
        tokio::task::spawn_blocking(move || wait_exit(child, Duration::from_secs(20)))
            .await
            .unwrap();
    assert_eq!(code, Some(0), "{err}");
    // Both attempts were allowed to finish and were recorded.
    for k in ["term:1", "term:2"] {
        let r = row(&db, k).await;
        assert_eq!((r.state.as_str(), r.attempts), ("delivered", 1), "{k}");
    }
    assert!(err.contains("SIGTERM"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_after_the_grace_period_abandons_the_attempt_to_its_lease() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(Duration::from_secs(30))]);
    enqueue_webhook(&db, "int:1", &rx.url("/h"), 3, true).await;
    let child = daemon(
        &db.url(),
        &[
            "--webhook-timeout",
            "20s",
            "--lease",
            "30s",
            "--shutdown-grace",
            "500ms",
        ],
        &[],
    );
    rx.wait_for(1, Duration::from_secs(15)).await;
    let t0 = Instant::now();
    signal(&child, "INT");
    let (code, err) =
        tokio::task::spawn_blocking(move || wait_exit(child, Duration::from_secs(20)))
            .await
            .unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "exited after the grace period, not after the stall"
    );
    // The attempt's outcome is unknown: the row keeps its lease, which will expire; a
    // worker's lease sweep then records the attempt as ambiguous.
    assert_eq!(row(&db, "int:1").await.state, "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_json_logs() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(503)]);
    enqueue_webhook(&db, "m:1", &rx.url("/h"), 3, true).await;
    enqueue_webhook(&db, "m:2", &rx.url("/h"), 3, true).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let child = daemon(
        &db.url(),
        &[
            "--metrics-addr",
            &addr,
            "--retry-base",
            "100ms",
            "--worker-id",
            "metered",
        ],
        &[("OUTBOXD_LOG_FORMAT", "json")],
    );
    wait_for_state(&db, "m:1", "delivered", Duration::from_secs(15)).await;
    wait_for_state(&db, "m:2", "delivered", Duration::from_secs(15)).await;
    // A held and a cancelled message (never claimed, so the daemon leaves them be).
    let c = db.client().await;
    for key in ["m:held", "m:cancelled"] {
        outboxd::enqueue(
            &c,
            &outboxd::NewMessage::webhook(key, serde_json::json!({"url": rx.url("/h")})).held(true),
        )
        .await
        .unwrap();
    }
    c.batch_execute(
        "SELECT outbox.cancel(ARRAY(SELECT id FROM outbox.messages WHERE message_key = 'm:cancelled'))",
    )
    .await
    .unwrap();

    // An open circuit for a host no message goes to (the daemon never touches its row).
    c.batch_execute(
        "INSERT INTO outbox.destinations (host, state, consecutive_failures, open_until) \
         VALUES ('down.example', 'open', 10, now() + interval '1 hour')",
    )
    .await
    .unwrap();
    // A destination paused by hand, its circuit closed: paused, not open.
    c.batch_execute("SELECT outbox.pause_destination('paused.example', 'incident')")
        .await
        .unwrap();
    // A channel paused by hand (this daemon does not serve e-mail).
    c.batch_execute("SELECT outbox.pause_channel('email', 'relay down')")
        .await
        .unwrap();
    let (status, body) = http_get(&addr, "/healthz").await.expect("healthz answers");
    assert_eq!(status, 200, "{body}");
    let (status, text) = http_get(&addr, "/metrics").await.expect("metrics answers");
    assert_eq!(status, 200);
    let value = |prefix: &str| metric(&text, prefix);
    assert_eq!(
        value("outboxd_deliveries_total{channel=\"webhook\",outcome=\"delivered\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        value("outboxd_deliveries_total{channel=\"webhook\",outcome=\"retry\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value("outboxd_delivery_duration_seconds_count{channel=\"webhook\"}"),
        Some(3.0),
        "{text}"
    );
    assert!(
        text.contains("outboxd_delivery_duration_seconds_bucket{channel=\"webhook\",le=\"0.005\"}"),
        "{text}"
    );
    assert_eq!(value("outboxd_destinations_open"), Some(1.0), "{text}");
    assert_eq!(value("outboxd_destinations_paused"), Some(1.0), "{text}");
    assert_eq!(value("outboxd_channels_paused"), Some(1.0), "{text}");
    assert_eq!(
        value("outboxd_messages{state=\"delivered\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        value("outboxd_messages{state=\"pending\"}"),
        Some(0.0),
        "{text}"
    );
    for state in ["held", "cancelled"] {
        assert_eq!(
            value(&format!("outboxd_messages{{state=\"{state}\"}}")),
            Some(1.0),
            "{text}"
        );
    }
    assert_eq!(
        value("outboxd_messages_estimated{state=\"delivered\"}"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(value("outboxd_oldest_due_seconds"), Some(0.0), "{text}");
    assert!(text.contains("outboxd_claim_batch_size_bucket"), "{text}");
    assert_eq!(value("outboxd_database_up"), Some(1.0), "{text}");

    // A scrape that cannot read the counts says so: the gauges read from the database keep
    // their last values, and a frozen `outboxd_oldest_due_seconds` must not pass for a
    // healthy queue. (The lock holds the count's read past the scrape's 2 s bound.)
    let mut locker = db.client().await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (status, text) = http_get(&addr, "/metrics").await.expect("metrics answers");
    assert_eq!(status, 200);
    let value = |prefix: &str| metric(&text, prefix);
    assert_eq!(value("outboxd_database_up"), Some(0.0), "{text}");
    tx.rollback().await.unwrap();
    let (_, text) = http_get(&addr, "/metrics").await.expect("metrics answers");
    assert!(text.contains("outboxd_database_up 1"), "{text}");

    let pid = child.id();
    signal(&child, "TERM");
    let (code, err) =
        tokio::task::spawn_blocking(move || wait_exit(child, Duration::from_secs(20)))
            .await
            .unwrap();
    assert_eq!(code, Some(0), "pid {pid}: {err}");
    // Every log line is one JSON object; the attempt events carry the contract's fields.
    let mut attempts = 0;
    for line in err.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if v["fields"]["message"] == "attempt finished" {
            attempts += 1;
            for f in [
                "message_id",
                "key",
                "channel",
                "attempt",
                "outcome",
                "duration_ms",
                "deduplicated",
            ] {
                assert!(v["fields"].get(f).is_some(), "{f} missing in {line}");
            }
        }
    }
    assert_eq!(attempts, 3);
}

async fn enqueue_range(c: &tokio_postgres::Client, keys: std::ops::Range<i32>, url: &str) {
    let msgs: Vec<_> = keys
        .map(|i| {
            outboxd::NewMessage::webhook(
                format!("restart:{i}"),
                serde_json::json!({"url": url, "body": {"i": i}}),
            )
        })
        .collect();
    outboxd::enqueue_many(c, &msgs).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_loses_nothing() {
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let admin: tokio_postgres::Config = cluster.url.parse().unwrap();
    let c = connect(&admin).await;
    let mut migrate_client = connect(&admin).await;
    outboxd::migrate::migrate(&mut migrate_client)
        .await
        .unwrap();
    drop(migrate_client);
    let rx = Receiver::start().await;
    enqueue_range(&c, 0..50, &rx.url("/h")).await;
    let addr = format!("127.0.0.1:{}", free_port());
    // Polling once an hour: only a LISTEN connection that came back after the restart can
    // pick up the new work in time.
    let child = daemon(
        &cluster.url,
        &["--metrics-addr", &addr, "--poll-interval", "1h"],
        &[],
    );
    rx.wait_for(50, Duration::from_secs(20)).await;

    // The database goes away under the running daemon.
    let cl = &cluster;
    tokio::task::block_in_place(|| cl.stop());
    wait_until(
        Duration::from_secs(10),
        "/healthz to report the outage",
        || {
            let addr = addr.clone();
            async move { matches!(http_get(&addr, "/healthz").await, Some((503, _))) }
        },
    )
    .await;
    tokio::task::block_in_place(|| cl.start_again());
    wait_until(Duration::from_secs(20), "/healthz to recover", || {
        let addr = addr.clone();
        async move { matches!(http_get(&addr, "/healthz").await, Some((200, _))) }
    })
    .await;

    // New work after the restart is picked up: the LISTEN connection came back.
    let c = connect(&admin).await;
    enqueue_range(&c, 50..80, &rx.url("/h")).await;
    wait_for_count(&c, "delivered", 80, Duration::from_secs(30)).await;
    signal(&child, "TERM");
    let (code, err) =
        tokio::task::spawn_blocking(move || wait_exit(child, Duration::from_secs(20)))
            .await
            .unwrap();
    assert_eq!(code, Some(0), "{err}");
    let stuck: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE state <> 'delivered'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stuck, 0);
    // Every key reached the receiver, none more than twice (a completion lost in the
    // outage would mean one redelivery with the same key, never a lost message).
    for i in 0..80 {
        let n = rx.requests_for(&format!("restart:{i}")).len();
        assert!((1..=2).contains(&n), "restart:{i} received {n} times");
    }
    let _ = err;
}

/// Starts `outboxd ARGS…` whose stderr is a pipe nobody reads any more: a log shipper
/// that died (`outboxd run 2>&1 | head -c 1`). Every log line then fails to be written.
fn with_closed_stderr(database_url: &str, args: &[&str], extra_env: &[(&str, &str)]) -> Child {
    let mut child = command(database_url, args, extra_env).spawn().unwrap();
    drop(child.stderr.take());
    child
}

/// Sends SIGTERM and waits (20 s at most) for the process to exit: its exit code.
async fn terminated(child: Child) -> Option<i32> {
    signal(&child, "TERM");
    tokio::task::spawn_blocking(move || exit_code_within(child, Duration::from_secs(20)))
        .await
        .unwrap()
}

/// Waits for the process to exit (bounded) and returns its exit code.
fn exit_code_within(mut child: Child, timeout: Duration) -> Option<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("outboxd did not exit within {timeout:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A log line must never cost a delivery's record or the shutdown: with stderr a closed
/// pipe, every delivered message is recorded `delivered` (none is left `running` to be
/// sent again when its lease expires), the dropped lines are counted, and SIGTERM stops the
/// worker with exit 0. In text and in JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stderr_costs_no_record_and_no_shutdown() {
    for format in ["text", "json"] {
        let db = TestDb::new().await;
        let rx = Receiver::start().await;
        enqueue_webhook(&db, "closed:1", &rx.url("/h"), 3, true).await;
        enqueue_webhook(&db, "closed:2", &rx.url("/h"), 3, true).await;
        enqueue_webhook(&db, "closed:3", &rx.url("/h"), 3, false).await;
        let addr = format!("127.0.0.1:{}", free_port());
        let child = with_closed_stderr(
            &db.url(),
            &["run", "--metrics-addr", &addr, "--lease", "60s"],
            &[("OUTBOXD_LOG_FORMAT", format)],
        );
        for key in ["closed:1", "closed:2", "closed:3"] {
            let r = wait_for_state(&db, key, "delivered", Duration::from_secs(20)).await;
            assert_eq!(r.attempts, 1, "{format}: {key}");
        }
        assert_eq!(rx.requests().len(), 3, "{format}: each sent once");
        wait_until(
            Duration::from_secs(10),
            "the metrics to count dropped lines",
            || {
                let addr = addr.clone();
                async move {
                    http_get(&addr, "/metrics")
                        .await
                        .and_then(|(_, t)| metric(&t, "outboxd_log_lines_dropped_total"))
                        .is_some_and(|n| n > 0.0)
                }
            },
        )
        .await;
        let code = terminated(child).await;
        assert_eq!(code, Some(0), "{format}: SIGTERM ends the worker cleanly");
    }
}

/// The console with a closed stderr still serves, and stops on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_with_a_closed_stderr_serves_and_stops() {
    let db = TestDb::new().await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let child = with_closed_stderr(&db.url(), &["console", "--addr", &addr], &[]);
    wait_until(Duration::from_secs(15), "the console to answer", || {
        let addr = addr.clone();
        async move { http_get(&addr, "/signin").await.is_some() }
    })
    .await;
    assert_eq!(terminated(child).await, Some(0));
}

/// A retry's log line says when the next attempt comes: `next_attempt_in` (the delay, as a
/// person reads it) and `retry_at` (the time, RFC 3339 UTC); and the next attempt does
/// come then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_log_line_says_when_the_next_attempt_comes() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(503)]);
    enqueue_webhook(&db, "retry:log", &rx.url("/hook"), 3, true).await;
    let url = db.url();
    let out = tokio::task::spawn_blocking(move || {
        common::binary::run_within(
            common::binary::outboxd(Some(&url))
                .args(["run", "--drain", "--retry-base", "2s", "--retry-max", "2s"])
                .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true"),
            Duration::from_secs(30),
        )
    })
    .await
    .unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("attempt finished") && l.contains("outcome=\"retry\""))
        .unwrap_or_else(|| panic!("no retry line in:\n{}", out.stderr));
    let field = |name: &str| -> String {
        let start = line
            .find(&format!(" {name}="))
            .unwrap_or_else(|| panic!("no {name} in {line}"))
            + name.len()
            + 2;
        line[start..]
            .split(' ')
            .next()
            .unwrap()
            .trim_matches('"')
            .to_owned()
    };
    // 2 s base, with jitter: between half of it and all of it, in tenths of a second.
    let delay = field("next_attempt_in");
    let secs: f64 = match delay.strip_suffix("ms") {
        Some(ms) => ms.parse::<f64>().unwrap() / 1000.0,
        None => delay.strip_suffix('s').unwrap().parse().unwrap(),
    };
    assert!(
        (0.5..=2.0).contains(&secs),
        "next_attempt_in={delay} in {line}"
    );
    let at = time::OffsetDateTime::parse(
        &field("retry_at"),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap_or_else(|e| panic!("retry_at is not RFC 3339 ({e}): {line}"));
    // The second attempt started at that time: `retry_at` is rounded down to the second
    // and read a moment after the database's clock set the row's `run_after` (so a second
    // of slack before it), and the worker takes the row up within its poll interval.
    let c = db.client().await;
    let second: std::time::SystemTime = c
        .query_one(
            "SELECT a.started_at FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id \
             WHERE m.message_key = 'retry:log' AND a.attempt = 2",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let second = time::OffsetDateTime::from(second);
    assert!(
        second >= at - time::Duration::seconds(1) && second <= at + time::Duration::seconds(5),
        "attempt 2 started at {second}, the log said {at}: {line}"
    );
}
