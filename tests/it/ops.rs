//! Operator actions: dead letters, show, replay, purge, retention; through the library and
//! the real binary.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::receiver::{Receiver, Reply};
use common::*;
use outboxd::ops::{self, DeadFilter, ReplayError, ReplaySelection, Target};

/// Marks a message dead as a worker would have (used to set up scenarios quickly).
async fn kill(db: &TestDb, key: &str, class: &str, age: &str) {
    db.client()
        .await
        .execute(
            &format!(
                "UPDATE outbox.messages SET state = 'dead', attempts = 3, error_class = $2, \
                 last_error = 'HTTP 503 from example.com', dead_at = now() - interval '{age}' \
                 WHERE message_key = $1"
            ),
            &[&key, &class],
        )
        .await
        .unwrap();
}

async fn deliver_old(db: &TestDb, key: &str, age: &str) {
    db.client()
        .await
        .execute(
            &format!(
                "UPDATE outbox.messages SET state = 'delivered', attempts = 1, \
                 delivered_at = now() - interval '{age}' WHERE message_key = $1"
            ),
            &[&key],
        )
        .await
        .unwrap();
}

fn cli(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let out = common::binary::run(common::binary::outboxd(Some(&db.url())).args(args));
    (out.code.unwrap_or(-1), out.stdout, out.stderr)
}

#[tokio::test]
async fn dead_letters_are_listed_newest_first_with_filters() {
    let db = TestDb::new().await;
    for k in ["d:1", "d:2", "d:3", "alive"] {
        enqueue_webhook(&db, k, "https://example.com/h", 3, true).await;
    }
    kill(&db, "d:1", "exhausted", "3 hours").await;
    kill(&db, "d:2", "permanent", "30 minutes").await;
    kill(&db, "d:3", "exhausted", "1 minute").await;
    let c = db.client().await;
    let all = ops::dead_letters(&c, &DeadFilter::default(), 50)
        .await
        .unwrap();
    let keys: Vec<&str> = all.iter().map(|d| d.message_key.as_str()).collect();
    assert_eq!(keys, ["d:3", "d:2", "d:1"]);
    let exhausted = DeadFilter {
        error_class: Some(outboxd::ErrorClass::Exhausted),
        ..Default::default()
    };
    assert_eq!(
        ops::dead_letters(&c, &exhausted, 50).await.unwrap().len(),
        2
    );
    let recent = DeadFilter {
        since: Some(Duration::from_secs(3600)),
        ..Default::default()
    };
    assert_eq!(ops::dead_letters(&c, &recent, 50).await.unwrap().len(), 2);
    assert_eq!(
        ops::dead_letters(&c, &DeadFilter::default(), 1)
            .await
            .unwrap()
            .len(),
        1
    );
    let email = DeadFilter {
        channel: Some(outboxd::Channel::Email),
        ..Default::default()
    };
    assert!(ops::dead_letters(&c, &email, 50).await.unwrap().is_empty());

    // The CLI: a table by default, the contract's JSON with --json.
    let (code, out, _) = cli(&db, &["dead", "--error-class", "exhausted", "--json"]);
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let arr = json.as_array().unwrap();
    assert_eq!(arr.len(), 2);
    for field in [
        "id",
        "message_key",
        "channel",
        "attempts",
        "error_class",
        "last_error",
        "dead_at",
    ] {
        assert!(arr[0].get(field).is_some(), "missing {field}");
    }
    let (code, out, _) = cli(&db, &["dead", "--since", "1h"]);
    assert_eq!(code, 0);
    assert!(
        out.lines().next().unwrap().starts_with("id"),
        "a header row: {out}"
    );
    assert!(out.contains("d:3") && out.contains("d:2") && !out.contains("d:1"));
    let (code, _, err) = cli(&db, &["dead", "--error-class", "weird"]);
    assert_eq!(code, 2);
    assert_eq!(err.trim().lines().count(), 1);
}

#[tokio::test]
async fn show_tells_a_messages_story_with_header_values_redacted() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(503)]);
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(
        "show:1",
        serde_json::json!({"url": rx.url("/h"), "headers": {"Authorization": "Bearer TOPSECRET"}, "body": {"x": 1}}),
    );
    let id = outboxd::enqueue(&c, &msg).await.unwrap().id;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    wait_for_state(&db, "show:1", "delivered", Duration::from_secs(10)).await;
    w.stop().await;

    let by_key = ops::show(&c, &Target::Key("show:1".into()))
        .await
        .unwrap()
        .unwrap();
    let by_id = ops::show(&c, &Target::Id(id)).await.unwrap().unwrap();
    assert_eq!(by_key, by_id);
    assert_eq!(by_key.state, "delivered");
    assert_eq!(by_key.payload["headers"]["Authorization"], "[redacted]");
    let outcomes: Vec<&str> = by_key.history.iter().map(|a| a.outcome.as_str()).collect();
    assert_eq!(outcomes, ["retry", "delivered"]);
    assert_eq!(by_key.history[0].status, Some(503));
    assert!(
        ops::show(&c, &Target::Key("nope".into()))
            .await
            .unwrap()
            .is_none()
    );

    let (code, out, _) = cli(&db, &["show", "show:1"]);
    assert_eq!(code, 0);
    assert!(out.contains("delivered") && out.contains("retry") && out.contains("[redacted]"));
    assert!(!out.contains("TOPSECRET"));
    let (code, out, _) = cli(&db, &["show", &id.to_string(), "--json"]);
    assert_eq!(code, 0);
    assert!(!out.contains("TOPSECRET"));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["history"].as_array().unwrap().len(), 2);
    let (code, _, err) = cli(&db, &["show", "no-such-key"]);
    assert_eq!(code, 1);
    assert!(err.contains("no-such-key"));
}

#[tokio::test]
async fn replay_sends_a_dead_letter_again_with_the_same_key() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(410)]);
    enqueue_webhook(&db, "replay:1", &rx.url("/h"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let dead = wait_for_state(&db, "replay:1", "dead", Duration::from_secs(10)).await;
    assert_eq!(dead.error_class.as_deref(), Some("permanent"));

    // The receiver is fixed; an operator replays by key.
    let (code, out, err) = cli(&db, &["replay", "replay:1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("replayed 1"), "{out}");
    let row = wait_for_state(&db, "replay:1", "delivered", Duration::from_secs(10)).await;
    w.stop().await;
    assert_eq!(row.attempts, 1, "attempts were reset by the replay");
    assert_eq!(row.id, dead.id);
    let reqs = rx.requests_for("replay:1");
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].body, reqs[1].body);
    let outcomes: Vec<String> = attempts(&db, "replay:1")
        .await
        .into_iter()
        .map(|a| a.1)
        .collect();
    assert_eq!(outcomes, ["dead", "replayed", "delivered"]);
}

#[tokio::test]
async fn replay_is_all_or_nothing_and_refuses_by_name() {
    let db = TestDb::new().await;
    for k in ["r:1", "r:2", "r:pending"] {
        enqueue_webhook(&db, k, "https://example.com/h", 3, true).await;
    }
    kill(&db, "r:1", "exhausted", "1 hour").await;
    kill(&db, "r:2", "permanent", "1 hour").await;
    let mut c = db.client().await;
    let named = |ts: &[&str]| ReplaySelection::Named(ts.iter().map(|t| Target::parse(t)).collect());

    let err = ops::replay(&mut c, &named(&["r:1", "r:pending"]), "test", false)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ReplayError::NotDead(m) if m.contains("r:pending")),
        "{err}"
    );
    let err = ops::replay(&mut c, &named(&["r:1", "ghost", "999999"]), "test", false)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ReplayError::Unknown(t) if t.len() == 2),
        "{err}"
    );
    assert!(err.to_string().contains("ghost") && err.to_string().contains("999999"));
    let dead: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'dead'")
        .await;
    assert_eq!(dead, 2, "nothing was replayed");
    let replayed_rows: i64 = db
        .scalar("SELECT count(*) FROM outbox.attempts WHERE outcome = 'replayed'")
        .await;
    assert_eq!(replayed_rows, 0);

    // The CLI refuses the same way, with exit 1 and one line.
    let (code, _, err) = cli(&db, &["replay", "r:1", "r:pending"]);
    assert_eq!(code, 1);
    assert_eq!(err.trim().lines().count(), 1);
    assert!(err.contains("r:pending"));

    // Dry run changes nothing; --all-dead with a filter takes only the matching rows.
    let (code, out, _) = cli(
        &db,
        &[
            "replay",
            "--all-dead",
            "--error-class",
            "exhausted",
            "--dry-run",
        ],
    );
    assert_eq!(code, 0);
    assert!(out.contains("r:1") && !out.contains("r:2"), "{out}");
    let dead: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'dead'")
        .await;
    assert_eq!(dead, 2);
    let (code, out, _) = cli(&db, &["replay", "--all-dead", "--error-class", "exhausted"]);
    assert_eq!(code, 0);
    assert!(out.contains("replayed 1"), "{out}");
    assert_eq!(row(&db, "r:1").await.state, "pending");
    assert_eq!(row(&db, "r:2").await.state, "dead");
    // IDs and keys may be mixed.
    let id2 = row(&db, "r:2").await.id.to_string();
    let (code, _, err) = cli(&db, &["replay", &id2]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(row(&db, "r:2").await.state, "pending");
    // Filters without --all-dead, and no target at all, are usage errors.
    assert_eq!(cli(&db, &["replay", "r:1", "--channel", "webhook"]).0, 2);
    assert_eq!(cli(&db, &["replay"]).0, 2);
}

#[tokio::test]
async fn replay_from_sql_follows_the_same_rules() {
    let db = TestDb::new().await;
    enqueue_webhook(&db, "s:1", "https://example.com/h", 3, true).await;
    enqueue_webhook(&db, "s:2", "https://example.com/h", 3, true).await;
    kill(&db, "s:1", "ambiguous", "1 hour").await;
    let c = db.client().await;
    let err = c
        .query("SELECT * FROM outbox.replay(ARRAY[1, 2])", &[])
        .await
        .unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("55000"));
    let rows = c
        .query("SELECT id, message_key FROM outbox.replay(ARRAY[1])", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    // An ambiguous class stays on the replayed row: the next attempt comes
    // after one that may have taken effect, and looks up first when it can.
    let r = row(&db, "s:1").await;
    assert_eq!(
        (r.state.as_str(), r.attempts, r.error_class.as_deref()),
        ("pending", 0, Some("ambiguous"))
    );
    // A NULL list, or a NULL id, is refused, as by the other actions.
    for call in [
        "SELECT * FROM outbox.replay(NULL)",
        "SELECT * FROM outbox.replay(ARRAY[2, NULL]::bigint[])",
    ] {
        let err = c.query(call, &[]).await.unwrap_err();
        assert_eq!(err.code().map(|c| c.code()), Some("22023"), "{call}");
    }
    // Any other class is cleared, with its line.
    kill(&db, "s:2", "permanent", "1 hour").await;
    c.query("SELECT * FROM outbox.replay(ARRAY[2])", &[])
        .await
        .unwrap();
    let r = row(&db, "s:2").await;
    assert_eq!(
        (r.state.as_str(), r.attempts, r.error_class, r.last_error),
        ("pending", 0, None, None)
    );
}

#[tokio::test]
async fn purge_deletes_old_finished_rows_in_batches() {
    let db = TestDb::new().await;
    for i in 0..2500 {
        enqueue_webhook(&db, &format!("p:{i}"), "https://example.com/h", 3, true).await;
        if i == 0 {
            // Speed: the rest in one statement.
            db.client()
                .await
                .batch_execute(
                    "INSERT INTO outbox.messages (message_key, channel, payload) \
                     SELECT 'p:' || g, 'webhook', '{\"url\": \"https://example.com/h\"}' FROM generate_series(1, 2499) g",
                )
                .await
                .unwrap();
            break;
        }
    }
    let c = db.client().await;
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'delivered', attempts = 1, delivered_at = now() - interval '3 days'",
    )
    .await
    .unwrap();
    enqueue_webhook(&db, "fresh", "https://example.com/h", 3, true).await;
    deliver_old(&db, "fresh", "1 hour").await;
    enqueue_webhook(&db, "old-dead", "https://example.com/h", 3, true).await;
    kill(&db, "old-dead", "permanent", "3 days").await;
    // Cancelled rows are finished too: the old one goes, the recent one stays.
    for (key, ago) in [("old-cancelled", "3 days"), ("fresh-cancelled", "1 hour")] {
        enqueue_webhook(&db, key, "https://example.com/h", 3, true).await;
        c.execute(
            &format!(
                "UPDATE outbox.messages SET state = 'cancelled', cancelled_at = now() - interval '{ago}' WHERE message_key = $1"
            ),
            &[&key],
        )
        .await
        .unwrap();
    }

    let mut progress = Vec::new();
    let n = ops::purge(&c, Duration::from_secs(2 * 86_400), false, 1000, |t| {
        progress.push(t)
    })
    .await
    .unwrap();
    assert_eq!(n, 2501);
    assert_eq!(
        progress,
        [1001, 2001, 2501],
        "bounded batches, progress after each"
    );
    let left: Vec<String> =
        first_column(&c, "SELECT message_key FROM outbox.messages ORDER BY 1").await;
    assert_eq!(left, ["fresh", "fresh-cancelled", "old-dead"]);

    let (code, _, err) = cli(&db, &["purge", "--older-than", "1h"]);
    assert_eq!(code, 2, "below 24h is refused");
    assert_eq!(err.trim().lines().count(), 1);
    let (code, out, _) = cli(&db, &["purge", "--older-than", "2d", "--include-dead"]);
    assert_eq!(code, 0);
    assert!(out.contains("purged 1"), "{out}");
    let left: i64 = db.scalar("SELECT count(*) FROM outbox.messages").await;
    assert_eq!(left, 2);
    let orphans: i64 = db.scalar("SELECT count(*) FROM outbox.attempts").await;
    assert_eq!(orphans, 0);
}

#[tokio::test]
async fn the_daemon_purges_delivered_rows_past_retention() {
    let db = TestDb::new().await;
    enqueue_webhook(&db, "ret:old", "https://example.com/h", 3, true).await;
    enqueue_webhook(&db, "ret:new", "https://example.com/h", 3, true).await;
    deliver_old(&db, "ret:old", "8 days").await;
    deliver_old(&db, "ret:new", "1 day").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(outboxd::worker::maintenance::retention(
        db.pool(1),
        Duration::from_secs(7 * 86_400),
        Duration::from_secs(3600),
        stop.clone(),
    ));
    let c = db.client().await;
    wait_until(
        Duration::from_secs(10),
        "the old delivered row to be purged",
        || {
            let c = &c;
            async move {
                c.query_opt(
                    "SELECT 1 FROM outbox.messages WHERE message_key = 'ret:old'",
                    &[],
                )
                .await
                .unwrap()
                .is_none()
            }
        },
    )
    .await;
    stop.cancel();
    task.await.unwrap();
    assert_eq!(row(&db, "ret:new").await.state, "delivered");
}

/// Retention stops between batches when the daemon stops: here the stop comes after the
/// first batch, and the rest waits for the next run.
#[tokio::test]
async fn retention_stops_between_batches() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (message_key, channel, payload) \
         SELECT 'rb:' || i, 'webhook', '{\"url\": \"https://example.com/h\"}' \
         FROM generate_series(1, 25) i",
    )
    .await
    .unwrap();
    for i in 1..=25 {
        deliver_old(&db, &format!("rb:{i}"), "8 days").await;
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let mut batches = Vec::new();
    let deleted = outboxd::worker::maintenance::purge_delivered(
        &db.pool(1),
        Duration::from_secs(7 * 86_400),
        10,
        &stop,
        |total| {
            batches.push(total);
            stop.cancel();
        },
    )
    .await
    .unwrap();
    assert_eq!((deleted, batches), (10, vec![10]));
    let left: i64 = db.scalar("SELECT count(*) FROM outbox.messages").await;
    assert_eq!(left, 15);
    // Not stopped: everything old goes, a batch at a time.
    let again = outboxd::worker::maintenance::purge_delivered(
        &db.pool(1),
        Duration::from_secs(7 * 86_400),
        10,
        &tokio_util::sync::CancellationToken::new(),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(again, 15);
}

/// Deleting a message deletes its history (a trigger, not a foreign key).
#[tokio::test]
async fn a_message_history_goes_with_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (message_key, channel, payload) \
         SELECT k, 'webhook', '{\"url\": \"https://example.com/h\"}' \
         FROM unnest(ARRAY['h:1', 'h:2', 'h:3', 'h:keep']) k",
    )
    .await
    .unwrap();
    c.batch_execute(
        "INSERT INTO outbox.attempts (message_id, attempt, worker, started_at, finished_at, outcome) \
         SELECT id, 1, 'w', now(), now(), 'retry' FROM outbox.messages",
    )
    .await
    .unwrap();
    let history = |key: &'static str| {
        let db = &db;
        async move {
            db.client()
                .await
                .query_one(
                    "SELECT count(*) FROM outbox.attempts a \
                     WHERE a.message_id = (SELECT id FROM outbox.messages WHERE message_key = $1) \
                        OR NOT EXISTS (SELECT 1 FROM outbox.messages m WHERE m.id = a.message_id)",
                    &[&key],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(history("h:1").await, 1);

    // A plain DELETE.
    c.execute("DELETE FROM outbox.messages WHERE message_key = 'h:1'", &[])
        .await
        .unwrap();
    assert_eq!(history("h:1").await, 0, "no orphaned history");

    // outbox.purge.
    deliver_old(&db, "h:2", "3 days").await;
    let purged: i64 = c
        .query_one("SELECT outbox.purge(interval '2 days')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(purged, 1);
    assert_eq!(history("h:2").await, 0, "no orphaned history");
    assert_eq!(history("h:keep").await, 1, "other histories stay");

    // TRUNCATE of the messages alone, and of both together.
    c.batch_execute("TRUNCATE outbox.messages").await.unwrap();
    assert_eq!(
        db.scalar::<i64>("SELECT count(*) FROM outbox.attempts")
            .await,
        0
    );
    enqueue_webhook(&db, "h:4", "https://example.com/h", 3, true).await;
    c.batch_execute("TRUNCATE outbox.attempts, outbox.messages")
        .await
        .unwrap();
    assert_eq!(
        db.scalar::<i64>("SELECT count(*) FROM outbox.messages")
            .await,
        0
    );
}

/// The counts `/metrics` reports: exact below the cap, PostgreSQL's estimate (flagged) at or
/// above it, so that a scrape costs the same on a table of ten rows or ten million.
#[tokio::test]
async fn bounded_counts_are_exact_below_the_cap_and_estimated_above() {
    let db = TestDb::new().await;
    for i in 0..5 {
        enqueue_webhook(&db, &format!("p:{i}"), "http://127.0.0.1:9/x", 3, false).await;
    }
    for i in 0..2 {
        let key = format!("d:{i}");
        enqueue_webhook(&db, &key, "http://127.0.0.1:9/x", 3, false).await;
        deliver_old(&db, &key, "1 hour").await;
    }
    enqueue_webhook(&db, "x:0", "http://127.0.0.1:9/x", 3, false).await;
    kill(&db, "x:0", "permanent", "1 minute").await;
    let c = db.client().await;

    let exact = outboxd::status::bounded_counts(&c, 10).await.unwrap();
    assert_eq!(
        (
            exact.counts.pending,
            exact.counts.running,
            exact.counts.delivered,
            exact.counts.dead
        ),
        (5, 0, 2, 1)
    );
    assert!(exact.estimated.is_empty(), "{exact:?}");

    // Five pending rows against a cap of 3: the pending figure is an estimate, and never
    // below the cap, even before statistics exist; the others stay exact.
    let capped = outboxd::status::bounded_counts(&c, 3).await.unwrap();
    assert_eq!(capped.estimated, vec![outboxd::model::State::Pending]);
    assert!(capped.counts.pending >= 3, "{capped:?}");
    assert_eq!((capped.counts.delivered, capped.counts.dead), (2, 1));

    // With fresh statistics (autovacuum's ANALYZE), the estimate is the index's size.
    c.batch_execute("ANALYZE outbox.messages").await.unwrap();
    let analyzed = outboxd::status::bounded_counts(&c, 3).await.unwrap();
    assert_eq!(analyzed.counts.pending, 5, "{analyzed:?}");
    assert_eq!(analyzed.estimated, vec![outboxd::model::State::Pending]);

    // The exact count agrees where both are exact.
    let full = outboxd::status::status(&c).await.unwrap();
    assert_eq!(full.total, exact.counts);
}

/// A forged log line and terminal escapes planted in message keys (as rows inserted before
/// enqueue refused control characters may hold): the daemon's log and the operator
/// commands' text output print them as visible escapes, never raw, so no line of output
/// begins with the forged text and the terminal receives no ESC, BEL, C1 or bidi override;
/// `--json` still carries the exact key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_keys_are_escaped_in_logs_and_text_output() {
    const FORGED: &str = "FORGED 2026-12-03T00:00:00.000000Z  INFO outboxd::worker: attempt finished outcome=\"delivered\"";
    let db = TestDb::new().await;
    let first_key = format!("ctl:1\n{FORGED}\x1b]0;pwned\x07");
    let dead_key = format!("ctl:2\r\n{FORGED}\x1b[2J\u{9b}31m\u{202e}\x7f");
    // Bypass the insert trigger (and whatever it may refuse): the rows are old ones.
    let c = db.client().await;
    c.batch_execute("ALTER TABLE outbox.messages DISABLE TRIGGER USER")
        .await
        .unwrap();
    // Such a key cannot go into an Idempotency-Key header: the worker dead-letters the
    // message `invalid` before any request (port 9 on loopback is never reached).
    for key in [&first_key, &dead_key] {
        let payload = serde_json::json!({"url": "http://127.0.0.1:9/h", "body": {"n": 1}});
        c.execute(
            "INSERT INTO outbox.messages (message_key, channel, payload, request_hash) \
             VALUES ($1, 'webhook', $2, outbox.request_hash('webhook', $2))",
            &[key, &payload],
        )
        .await
        .unwrap();
    }
    c.batch_execute("ALTER TABLE outbox.messages ENABLE TRIGGER USER")
        .await
        .unwrap();

    let run = common::binary::run_within(
        common::binary::outboxd(Some(&db.url()))
            .args(["run", "--drain", "--poll-interval", "100ms"])
            .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true"),
        Duration::from_secs(30),
    );
    assert_eq!(run.code, Some(0), "run --drain: {}", run.stderr);
    assert_eq!(row(&db, &first_key).await.state, "dead");
    let dead = row(&db, &dead_key).await;
    assert_eq!(
        (dead.state.as_str(), dead.error_class.as_deref()),
        ("dead", Some("invalid"))
    );
    // The attempts were logged, with the keys escaped.
    assert!(
        run.stderr.contains(r"ctl:1\nFORGED") && run.stderr.contains(r"ctl:2\r\nFORGED"),
        "{}",
        run.stderr
    );

    let unsafe_chars = ['\x1b', '\x07', '\r', '\u{9b}', '\u{202e}', '\x7f'];
    let check = |what: &str, text: &str| {
        for ch in unsafe_chars {
            assert!(!text.contains(ch), "{what}: raw {ch:?} in {text:?}");
        }
        for line in text.lines() {
            assert!(
                !line.trim_start().starts_with("FORGED"),
                "{what}: a line begins with the forged text: {text:?}"
            );
        }
    };
    check("run stderr", &run.stderr);

    let (code, out, err) = cli(&db, &["dead"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(r"ctl:2\r\nFORGED"), "{out}");
    check("dead stdout", &out);
    check("dead stderr", &err);
    for target in [dead.id.to_string(), dead_key.clone()] {
        let (code, out, err) = cli(&db, &["show", &target]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(r"ctl:2\r\nFORGED"), "{out}");
        check("show stdout", &out);
        check("show stderr", &err);
    }
    let (code, out, err) = cli(&db, &["replay", &dead_key, "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(r"would replay 2 ctl:2\r\nFORGED"), "{out}");
    check("replay stdout", &out);
    check("replay stderr", &err);
    // A usage error echoes the argument: escaped too.
    let (code, _, err) = cli(&db, &["replay", &format!("--dry-run={dead_key}")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ctl:2"), "the argument is echoed: {err}");
    check("usage error stderr", &err);
    // A refusal names the key on stderr: escaped too.
    c.execute(
        "UPDATE outbox.messages SET state = 'pending', dead_at = NULL WHERE message_key = $1",
        &[&first_key],
    )
    .await
    .unwrap();
    let (code, out, err) = cli(&db, &["replay", &first_key]);
    assert_eq!(code, 1, "{out}");
    check("refused replay stderr", &err);

    // JSON is escaped by the encoder and carries the exact key.
    let (code, out, _) = cli(&db, &["show", &dead.id.to_string(), "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["message_key"].as_str(), Some(dead_key.as_str()));
    let (code, out, _) = cli(&db, &["dead", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["message_key"].as_str(), Some(dead_key.as_str()));
    assert_eq!(v.as_array().map(Vec::len), Some(1));
}

/// A payload nested deeper than serde_json reads (128 levels; PostgreSQL's `jsonb` takes
/// it) is shown as a note in its place, by the library, the CLI and so the console: `show`
/// panicked on it.
#[tokio::test]
async fn show_survives_a_payload_nested_too_deep_to_read() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute(
        "SELECT outbox.enqueue('deep', 'webhook', \
           ('{\"url\": \"https://example.com/h\", \"body\": ' || repeat('[', 130) || repeat(']', 130) || '}')::jsonb)",
        &[],
    )
    .await
    .unwrap();
    let shown = ops::show(&c, &Target::Key("deep".into()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        shown.payload,
        serde_json::json!("(not shown: nested more than 128 levels deep)")
    );
    for args in [&["show", "deep"][..], &["show", "deep", "--json"]] {
        let (code, stdout, stderr) = cli(&db, args);
        assert_eq!(code, 0, "{args:?}: {stderr}");
        assert!(stdout.contains("not shown: nested"), "{stdout}");
    }
}

/// `replay --all-dead` locks the dead letters as it reads them: a dead letter an operator
/// is cancelling at that moment is waited for, then left out, and the rest are replayed.
/// Read without the lock, the row was still dead in the replay's snapshot, and the replay
/// itself then met it cancelled and refused the whole batch.
#[tokio::test]
async fn replay_all_dead_waits_for_a_concurrent_cancel_and_leaves_its_row_out() {
    let db = TestDb::new().await;
    for k in ["all:1", "all:2", "all:3"] {
        enqueue_webhook(&db, k, "https://example.com/h", 3, true).await;
        kill(&db, k, "exhausted", "1 minute").await;
    }
    // An operator's cancel of all:2, not yet committed.
    let mut operator = db.client().await;
    let cancel = operator.transaction().await.unwrap();
    cancel
        .execute(
            "SELECT outbox.cancel(ARRAY(SELECT id FROM outbox.messages WHERE message_key = 'all:2'))",
            &[],
        )
        .await
        .unwrap();

    let mut replayer = db.client().await;
    let pid = backend_pid(&replayer).await;
    let replay = tokio::spawn(async move {
        ops::replay(
            &mut replayer,
            &ReplaySelection::AllDead(DeadFilter::default()),
            "alice",
            false,
        )
        .await
        .map(|r| r.into_iter().map(|(_, k)| k).collect::<Vec<_>>())
    });
    let watch = db.client().await;
    wait_for_backend_wait(
        &watch,
        pid,
        "transactionid",
        "the replay to wait for the cancel",
    )
    .await;
    cancel.commit().await.unwrap();

    let replayed = replay.await.unwrap();
    assert_eq!(
        replayed.as_deref().map_err(|e| e.to_string()),
        Ok(&["all:1".to_owned(), "all:3".to_owned()][..])
    );
    assert_eq!(row(&db, "all:2").await.state, "cancelled");
    for k in ["all:1", "all:3"] {
        assert_eq!(row(&db, k).await.state, "pending");
    }
}

/// One-shot commands read their flags from the command line only (the contract): a
/// selection variable exported for another purpose (`OUTBOXD_CHANNEL`, `OUTBOXD_ALL_DEAD`,
/// `OUTBOXD_DRY_RUN`) changes nothing about what `replay` or `dead` does. Typed beside
/// named messages, the selection flags are still refused.
#[tokio::test]
async fn one_shot_commands_ignore_exported_flag_variables() {
    let db = TestDb::new().await;
    for k in ["env:1", "env:2"] {
        enqueue_webhook(&db, k, "https://example.com/h", 3, true).await;
        kill(&db, k, "exhausted", "1 minute").await;
    }
    let run = |env: &[(&str, &str)], args: &[&str]| {
        let mut cmd = common::binary::outboxd(Some(&db.url()));
        for (k, v) in env {
            cmd.env(k, v);
        }
        common::binary::run(cmd.env("USER", "alice").args(args))
    };
    let exported = [
        ("OUTBOXD_CHANNEL", "email"),
        ("OUTBOXD_ALL_DEAD", "true"),
        ("OUTBOXD_DRY_RUN", "true"),
        ("OUTBOXD_JSON", "true"),
    ];
    // Not a dry run, not every dead letter: exactly the one named.
    let out = run(&exported, &["replay", "env:1"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(row(&db, "env:1").await.state, "pending");
    assert_eq!(row(&db, "env:2").await.state, "dead");
    // Nothing named and no --all-dead typed: a usage error, whatever is exported.
    let out = run(&exported, &["replay"]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert_eq!(row(&db, "env:2").await.state, "dead");

    let out = run(&[], &["replay", "env:2", "--channel", "webhook"]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    let out = run(&[], &["replay", "env:2", "--all-dead"]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);

    // `dead` lists every channel, as text, with OUTBOXD_CHANNEL and OUTBOXD_JSON exported.
    let out = run(&exported, &["dead"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("env:2"), "{}", out.stdout);
    assert!(!out.stdout.trim_start().starts_with('['), "{}", out.stdout);
}

/// A true/false flag takes a value only after `=`: typed before an id or key
/// (`outboxd show --json KEY`, `outboxd replay --dry-run ID`), it used to take the id or
/// key as its value (exit 2, "invalid value 'order:1' for '--json'").
#[tokio::test]
async fn a_flag_before_an_id_or_key_does_not_take_it_as_its_value() {
    let db = TestDb::new().await;
    enqueue_webhook(&db, "flag:1", "https://example.com/h", 3, true).await;
    kill(&db, "flag:1", "permanent", "1 hour").await;
    let id: i64 = db
        .scalar("SELECT id FROM outbox.messages WHERE message_key = 'flag:1'")
        .await;
    let (code, out, err) = cli(&db, &["show", "--json", "flag:1"]);
    assert_eq!(code, 0, "{err}");
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["message_key"], "flag:1");
    let (code, out, err) = cli(&db, &["replay", "--dry-run", &id.to_string()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains('1'), "{out}");
    assert_eq!(common::row(&db, "flag:1").await.state, "dead", "a dry run");
    // A value still goes after `=`.
    let (code, out, err) = cli(&db, &["show", "--json=false", "flag:1"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        serde_json::from_str::<serde_json::Value>(&out).is_err(),
        "{out}"
    );
    let (code, _, err) = cli(&db, &["replay", "--dry-run=maybe", "flag:1"]);
    assert_eq!(code, 2, "{err}");
}

/// A replay's history row records the action, not a failure: no class, no error, in the
/// database and in `show`; the failure it answered stays on the attempt before it.
#[tokio::test]
async fn a_replay_row_reads_as_a_replay_not_a_failure() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(410)]);
    enqueue_webhook(&db, "replay:row", &rx.url("/h"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    wait_for_state(&db, "replay:row", "dead", Duration::from_secs(10)).await;
    w.stop().await;
    let (code, _, err) = cli(&db, &["replay", "replay:row"]);
    assert_eq!(code, 0, "{err}");
    let history = attempts(&db, "replay:row").await;
    assert_eq!(
        history
            .iter()
            .map(|a| (a.1.as_str(), a.2.as_deref()))
            .collect::<Vec<_>>(),
        [("dead", Some("permanent")), ("replayed", None)]
    );
    let error: Option<String> = db
        .scalar("SELECT error FROM outbox.attempts WHERE outcome = 'replayed'")
        .await;
    assert_eq!(error, None);

    let (code, out, err) = cli(&db, &["show", "replay:row"]);
    assert_eq!(code, 0, "{err}");
    let replayed = out
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("replayed"))
        .unwrap_or_else(|| panic!("no replayed row in:\n{out}"));
    // Its class and status columns are empty (a substring check of the whole line would
    // also meet the digits of its timestamp).
    let fields: Vec<&str> = replayed.split_whitespace().collect();
    assert_eq!(
        fields.get(2..4),
        Some(&["-", "-"][..]),
        "the replay reads as a failure: {replayed}"
    );
    let (_, out, _) = cli(&db, &["show", "replay:row", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let row = &v["history"][1];
    assert_eq!(row["outcome"], "replayed");
    assert_eq!(
        (&row["error_class"], &row["error"]),
        (&serde_json::Value::Null, &serde_json::Value::Null)
    );
}

/// `show` of a dead letter says what a person can do: for one that may have taken effect,
/// confirm it (it did), replay it (it did not; same key) or cancel it; in `--json` too,
/// as `next_steps`. A message that is not dead gets none.
#[tokio::test]
async fn show_of_a_dead_letter_says_what_can_be_done() {
    let db = TestDb::new().await;
    for k in ["steps:ambiguous", "steps:permanent", "steps:pending"] {
        enqueue_webhook(&db, k, "https://example.com/h", 3, true).await;
    }
    kill(&db, "steps:ambiguous", "ambiguous", "1 minute").await;
    kill(&db, "steps:permanent", "permanent", "1 minute").await;
    let id = row(&db, "steps:ambiguous").await.id;

    let (code, out, err) = cli(&db, &["show", "steps:ambiguous"]);
    assert_eq!(code, 0, "{err}");
    let steps: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("next steps"))
        .take_while(|l| l.starts_with("  ") && !l.trim_start().starts_with("response"))
        .take_while(|l| !l.trim_start().starts_with("payload"))
        .collect();
    assert!(
        (1..=2).contains(&steps.len()),
        "one or two lines of next steps:\n{out}"
    );
    let steps = steps.join(" ");
    for want in [
        "may have taken effect",
        &format!("outboxd confirm {id}"),
        &format!("outboxd replay {id}"),
        &format!("outboxd cancel {id}"),
        "same key",
    ] {
        assert!(steps.contains(want), "{want:?} in {steps:?}");
    }
    let (_, out, _) = cli(&db, &["show", "steps:ambiguous", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let actions: Vec<&str> = v["next_steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["confirm", "replay", "cancel"]);
    // Following the first one works: the message is delivered, confirmed.
    let (code, _, err) = cli(&db, &["confirm", &id.to_string()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(row(&db, "steps:ambiguous").await.state, "delivered");
    let (_, out, _) = cli(&db, &["show", "steps:ambiguous"]);
    assert!(!out.contains("next steps"), "{out}");

    let (_, out, _) = cli(&db, &["show", "steps:permanent"]);
    let steps = out
        .lines()
        .find(|l| l.trim_start().starts_with("next steps"))
        .unwrap_or_else(|| panic!("no next steps in:\n{out}"));
    assert!(
        steps.contains("outboxd replay") && !steps.contains("confirm"),
        "{steps}"
    );
    let (_, out, _) = cli(&db, &["show", "steps:permanent", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let actions: Vec<&str> = v["next_steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["replay", "cancel"]);
    assert!(
        v["next_steps"][0]["command"]
            .as_str()
            .unwrap()
            .starts_with("outboxd replay ")
    );

    let (_, out, _) = cli(&db, &["show", "steps:pending", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["next_steps"], serde_json::json!([]));
    assert_eq!(v["state"], "pending", "the rest of the JSON as before");
}
