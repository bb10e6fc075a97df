//! Human checkpoints: held messages, approve, cancel, confirm, `held`, and the
//! cancel/claim race; through the real binary, PostgreSQL and the test receiver.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::binary::{Output, outboxd, run};
use common::receiver::{Receiver, Reply};
use common::*;
use serde_json::{Value, json};

/// Runs the binary off the test's runtime (a worker may be running on it), as `alice`.
async fn cli(db: &TestDb, args: &[&str]) -> Output {
    let url = db.url();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || run(outboxd(Some(&url)).env("USER", "alice").args(&args)))
        .await
        .unwrap()
}

/// Asserts a refusal: exit `code`, one stderr line containing every `mention`, no panic.
fn assert_refused(what: &str, out: &Output, code: i32, mentions: &[&str]) {
    assert_eq!(
        out.code,
        Some(code),
        "{what}: exit code (stdout {:?}, stderr {:?})",
        out.stdout,
        out.stderr
    );
    let lines = out.stderr_lines();
    assert_eq!(lines.len(), 1, "{what}: one line, got {:?}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{what}: {:?}", out.stderr);
    for m in mentions {
        assert!(
            lines[0].contains(m),
            "{what}: {:?} should mention {m:?}",
            lines[0]
        );
    }
}

/// Everything a refused command could have changed, as text.
async fn snapshot(db: &TestDb) -> String {
    db.scalar(
        "SELECT coalesce((SELECT string_agg(m::text, E'\\n' ORDER BY m.id) FROM outbox.messages m), '') \
         || E'\\n--\\n' || \
         coalesce((SELECT string_agg(a::text, E'\\n' ORDER BY a.id) FROM outbox.attempts a), '')",
    )
    .await
}

async fn sql(db: &TestDb, statement: &str, key: &str) {
    db.client().await.execute(statement, &[&key]).await.unwrap();
}

/// Puts a message in a state as a worker would have left it.
async fn make_dead(db: &TestDb, key: &str, class: &str) {
    db.client()
        .await
        .execute(
            "UPDATE outbox.messages SET state = 'dead', attempts = 3, error_class = $2, \
             last_error = 'timed out after the request was sent', dead_at = now(), \
             response = '{\"status\": 504}' WHERE message_key = $1",
            &[&key, &class],
        )
        .await
        .unwrap();
}

async fn make_running(db: &TestDb, key: &str) {
    sql(
        db,
        "UPDATE outbox.messages SET state = 'running', attempts = 1, lease_owner = 'w', \
         lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 hour' \
         WHERE message_key = $1",
        key,
    )
    .await;
}

async fn make_delivered(db: &TestDb, key: &str) {
    sql(
        db,
        "UPDATE outbox.messages SET state = 'delivered', attempts = 1, delivered_at = now(), \
         response = '{\"status\": 200}' WHERE message_key = $1",
        key,
    )
    .await;
}

async fn enqueue_held(db: &TestDb, key: &str, url: &str) -> i64 {
    let c = db.client().await;
    let msg =
        outboxd::NewMessage::webhook(key, json!({"url": url, "body": {"key": key}})).held(true);
    outboxd::enqueue(&c, &msg).await.unwrap().id
}

/// History rows of a message: (outcome, worker, error_class, error).
async fn history(
    db: &TestDb,
    key: &str,
) -> Vec<(String, Option<String>, Option<String>, Option<String>)> {
    db.client()
        .await
        .query(
            "SELECT a.outcome, a.worker, a.error_class, a.error FROM outbox.attempts a \
             JOIN outbox.messages m ON m.id = a.message_id WHERE m.message_key = $1 ORDER BY a.id",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_message_is_not_sent_until_approved_then_once() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let past = "2020-01-01T00:00:00Z";
    let out = cli(
        &db,
        &[
            "enqueue",
            "--key",
            "refund:42",
            "--channel",
            "webhook",
            "--payload",
            &json!({"url": rx.url("/refund"), "body": {"amount": 42}}).to_string(),
            "--run-after",
            past,
            "--held",
        ],
    )
    .await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    assert!(out.stdout.trim().ends_with("created"), "{}", out.stdout);
    assert_eq!(row(&db, "refund:42").await.state, "held");

    let worker = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    // A message enqueued after it, due later than it, is sent: the worker has claimed past
    // the held one, which is still held and was never sent.
    enqueue_webhook(&db, "after", &rx.url("/after"), 3, true).await;
    wait_for_state(&db, "after", "delivered", Duration::from_secs(10)).await;
    assert!(rx.requests_for("refund:42").is_empty());
    let held = row(&db, "refund:42").await;
    assert_eq!((held.state.as_str(), held.attempts), ("held", 0));

    let out = cli(&db, &["held", "--json"]).await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let listed: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["message_key"], "refund:42");
    assert_eq!(listed[0]["id"], held.id);
    assert_eq!(listed[0]["channel"], "webhook");
    assert!(listed[0]["created_at"].is_string());

    let out = cli(&db, &["approve", "refund:42"]).await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    assert!(
        out.stdout.contains("approved 1 message(s)"),
        "{}",
        out.stdout
    );
    wait_for_state(&db, "refund:42", "delivered", Duration::from_secs(10)).await;
    assert_eq!(rx.requests_for("refund:42").len(), 1);
    let summary = worker.stop().await;
    assert_eq!(summary.delivered, 2);
    assert_eq!(rx.requests_for("refund:42").len(), 1, "sent once");
    let h = history(&db, "refund:42").await;
    assert_eq!(h[0].0, "approved");
    assert_eq!(h[0].1.as_deref(), Some("cli:alice"));
    assert_eq!(h[1].0, "delivered");
    assert_eq!(h.len(), 2, "{h:?}");
    // Approving it again is refused: it is no longer held.
    let before = snapshot(&db).await;
    let out = cli(&db, &["approve", &held.id.to_string()]).await;
    assert_refused(
        "approve twice",
        &out,
        1,
        &["not held", "refund:42", "delivered"],
    );
    assert_eq!(snapshot(&db).await, before);
}

/// Held rows from every path (SQL by name, enqueue_many, a plain INSERT, Rust) are never
/// claimed, even when their run_after has long passed; the dedup rule ignores `held`.
#[tokio::test]
async fn held_rows_from_every_path_are_never_claimed() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = "https://example.com/h";
    let id: i64 = c
        .query_one(
            "SELECT outbox.enqueue('sql', 'webhook', $1, run_after => now() - interval '1 day', held => true)",
            &[&json!({"url": url})],
        )
        .await
        .unwrap()
        .get(0);
    c.execute(
        "SELECT * FROM outbox.enqueue_many(ARRAY['many:1', 'many:2'], ARRAY['webhook', 'webhook'], \
         ARRAY[$1::jsonb, $1::jsonb], held => ARRAY[true, false])",
        &[&json!({"url": url})],
    )
    .await
    .unwrap();
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload, state, run_after) \
         VALUES ('insert', 'webhook', $1, 'held', now() - interval '1 hour')",
        &[&json!({"url": url})],
    )
    .await
    .unwrap();
    let many = outboxd::enqueue_many(
        &c,
        &[
            outboxd::NewMessage::webhook("rust:1", json!({"url": url})).held(true),
            outboxd::NewMessage::webhook("rust:2", json!({"url": url})),
        ],
    )
    .await
    .unwrap();
    assert!(many.iter().all(|e| e.created));
    let states: Vec<(String, String)> = c
        .query(
            "SELECT message_key, state FROM outbox.messages ORDER BY message_key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let want: Vec<(String, String)> = [
        ("insert", "held"),
        ("many:1", "held"),
        ("many:2", "pending"),
        ("rust:1", "held"),
        ("rust:2", "pending"),
        ("sql", "held"),
    ]
    .iter()
    .map(|(k, s)| (k.to_string(), s.to_string()))
    .collect();
    assert_eq!(states, want);

    // Same key and payload: the held row's id, whatever `held` says now; it stays held.
    let again = outboxd::enqueue(
        &c,
        &outboxd::NewMessage::webhook("sql", json!({"url": url})),
    )
    .await
    .unwrap();
    assert_eq!((again.id, again.created), (id, false));
    let conflict = outboxd::enqueue(
        &c,
        &outboxd::NewMessage::webhook("sql", json!({"url": "https://example.com/other"}))
            .held(true),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(conflict, outboxd::EnqueueError::KeyConflict { .. }),
        "{conflict:?}"
    );
    assert_eq!(row(&db, "sql").await.state, "held");

    // The claim takes the two pending rows and nothing else, however often it asks.
    for _ in 0..3 {
        let batch = outboxd::claim::claim(
            &c,
            &outboxd::model::Channel::ALL,
            100,
            "w",
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        let mut keys: Vec<String> = batch.iter().map(|m| m.key.clone()).collect();
        keys.sort();
        assert!(
            keys.is_empty() || keys == ["many:2", "rust:2"],
            "claimed {keys:?}"
        );
    }
    let held: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'held' AND attempts = 0")
        .await;
    assert_eq!(held, 4);

    let st = outboxd::status::status(&c).await.unwrap();
    assert_eq!((st.total.held, st.total.running), (4, 2));
    assert_eq!(st.by_channel["webhook"].held, 4);
    assert_eq!(st.oldest_due_seconds, 0.0, "a held row is not due");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_takes_held_pending_and_dead_and_they_are_never_sent() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_held(&db, "c:held", &rx.url("/c")).await;
    enqueue_webhook(&db, "c:pending", &rx.url("/c"), 3, true).await;
    sql(
        &db,
        "UPDATE outbox.messages SET run_after = now() + interval '1 hour' WHERE message_key = $1",
        "c:pending",
    )
    .await;
    enqueue_webhook(&db, "c:dead", &rx.url("/c"), 3, true).await;
    make_dead(&db, "c:dead", "exhausted").await;

    let out = cli(
        &db,
        &[
            "cancel",
            "c:held",
            "c:pending",
            "c:dead",
            "--reason",
            "customer withdrew the order",
        ],
    )
    .await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    assert!(
        out.stdout.contains("cancelled 3 message(s)"),
        "{}",
        out.stdout
    );
    for key in ["c:held", "c:pending", "c:dead"] {
        let r = row(&db, key).await;
        assert_eq!(r.state, "cancelled", "{key}");
        let cancelled_at: bool = db
            .client()
            .await
            .query_one(
                "SELECT cancelled_at IS NOT NULL AND dead_at IS NULL FROM outbox.messages WHERE message_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        assert!(cancelled_at, "{key}");
        let h = history(&db, key).await;
        let last = h.last().unwrap();
        assert_eq!(last.0, "cancelled");
        assert_eq!(last.1.as_deref(), Some("cli:alice"));
        assert_eq!(last.3.as_deref(), Some("customer withdrew the order"));
    }
    // The dead one keeps what killed it (for the record); its class is still there.
    assert_eq!(
        row(&db, "c:dead").await.error_class.as_deref(),
        Some("exhausted")
    );

    // Due long ago, cancelled: a worker never sends them; a replay or an approve is refused.
    db.client()
        .await
        .batch_execute("UPDATE outbox.messages SET run_after = now() - interval '1 day'")
        .await
        .unwrap();
    let worker = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    enqueue_webhook(&db, "c:after", &rx.url("/c"), 3, true).await;
    wait_for_state(&db, "c:after", "delivered", Duration::from_secs(10)).await;
    worker.stop().await;
    assert_eq!(rx.requests().len(), 1, "only c:after was sent");
    let before = snapshot(&db).await;
    for (cmd, mention) in [("replay", "not dead"), ("approve", "not held")] {
        let out = cli(&db, &[cmd, "c:dead"]).await;
        assert_refused(cmd, &out, 1, &[mention, "c:dead", "cancelled"]);
    }
    let out = cli(&db, &["cancel", "c:held"]).await;
    assert_refused(
        "cancel twice",
        &out,
        1,
        &["not held, pending or dead", "cancelled"],
    );
    assert_eq!(snapshot(&db).await, before);

    // show prints the state, cancelled_at and the outcome.
    let out = cli(&db, &["show", "c:held"]).await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    assert!(
        out.stdout.contains("state        cancelled"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("cancelled_at "), "{}", out.stdout);
    assert!(
        out.stdout.contains("customer withdrew the order"),
        "{}",
        out.stdout
    );
    let out = cli(&db, &["show", "c:held", "--json"]).await;
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(v["cancelled_at"].is_string(), "{v}");
    assert_eq!(v["history"][0]["outcome"], "cancelled");

    let out = cli(&db, &["status", "--json"]).await;
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(v["cancelled"], 3, "{v}");
    assert_eq!(v["held"], 0, "{v}");
    assert_eq!(v["delivered"], 1, "{v}");
    assert_eq!(v["by_channel"]["webhook"]["cancelled"], 3, "{v}");
    assert_eq!(v["by_channel"]["email"]["held"], 0, "{v}");
}

#[tokio::test]
async fn cancel_refuses_running_and_delivered_and_is_all_or_nothing() {
    let db = TestDb::new().await;
    let url = "https://example.com/h";
    enqueue_held(&db, "r:held", url).await;
    enqueue_webhook(&db, "r:running", url, 3, true).await;
    make_running(&db, "r:running").await;
    enqueue_webhook(&db, "r:delivered", url, 3, true).await;
    make_delivered(&db, "r:delivered").await;
    let before = snapshot(&db).await;
    let out = cli(&db, &["cancel", "r:held", "r:running"]).await;
    assert_refused(
        "running",
        &out,
        1,
        &["r:running", "running", "nothing cancelled"],
    );
    let out = cli(&db, &["cancel", "r:delivered", "r:held"]).await;
    assert_refused(
        "delivered",
        &out,
        1,
        &["r:delivered", "delivered", "nothing cancelled"],
    );
    assert_eq!(snapshot(&db).await, before, "nothing changed");
    assert_eq!(row(&db, "r:held").await.state, "held");
}

/// A refusal names every refused row (the contract), however long the line: cut to 500
/// characters like other errors, it named three of ten 100-character keys.
#[tokio::test]
async fn a_refusal_names_every_refused_row() {
    let db = TestDb::new().await;
    let keys: Vec<String> = (0..10)
        .map(|i| format!("{i:02}-{}", "k".repeat(97)))
        .collect();
    for k in &keys {
        enqueue_webhook(&db, k, "https://example.com/h", 3, true).await;
        make_running(&db, k).await;
    }
    let before = snapshot(&db).await;
    for verb in ["cancel", "approve", "confirm", "replay"] {
        let mut args = vec![verb];
        args.extend(keys.iter().map(String::as_str));
        let out = cli(&db, &args).await;
        let mut mentions: Vec<&str> = keys.iter().map(String::as_str).collect();
        mentions.push("running");
        assert_refused(verb, &out, 1, &mentions);
    }
    assert_eq!(snapshot(&db).await, before, "nothing changed");
}

#[tokio::test]
async fn confirm_takes_only_dead_ambiguous_rows() {
    let db = TestDb::new().await;
    let url = "https://example.com/h";
    for key in [
        "f:ambiguous",
        "f:exhausted",
        "f:permanent",
        "f:pending",
        "f:delivered",
    ] {
        enqueue_webhook(&db, key, url, 3, true).await;
    }
    enqueue_held(&db, "f:held", url).await;
    make_dead(&db, "f:ambiguous", "ambiguous").await;
    make_dead(&db, "f:exhausted", "exhausted").await;
    make_dead(&db, "f:permanent", "permanent").await;
    make_delivered(&db, "f:delivered").await;
    let before = snapshot(&db).await;
    for other in [
        "f:exhausted",
        "f:permanent",
        "f:pending",
        "f:held",
        "f:delivered",
    ] {
        let out = cli(&db, &["confirm", "f:ambiguous", other]).await;
        assert_refused(
            other,
            &out,
            1,
            &[other, "not dead with class ambiguous", "nothing confirmed"],
        );
    }
    assert_eq!(snapshot(&db).await, before, "nothing changed");

    let out = cli(&db, &["confirm", "f:ambiguous"]).await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    assert!(
        out.stdout.contains("confirmed 1 message(s)"),
        "{}",
        out.stdout
    );
    let r = row(&db, "f:ambiguous").await;
    assert_eq!(r.state, "delivered");
    assert_eq!(r.response, Some(json!({"status": 504, "confirmed": true})));
    assert_eq!((r.error_class, r.last_error), (None, None));
    let delivered_at: bool = db
        .scalar(
            "SELECT delivered_at IS NOT NULL AND dead_at IS NULL FROM outbox.messages WHERE message_key = 'f:ambiguous'",
        )
        .await;
    assert!(delivered_at);
    let h = history(&db, "f:ambiguous").await;
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].0, "confirmed");
    assert_eq!(h[0].1.as_deref(), Some("cli:alice"));
    // The history keeps what a person resolved.
    assert_eq!(h[0].2.as_deref(), Some("ambiguous"));
    assert_eq!(
        h[0].3.as_deref(),
        Some("timed out after the request was sent")
    );
}

/// The cancel/claim race, for real: in each round a claim and a cancel of the same due row
/// start together. Either the cancel wins (the claim never returns the row), or the claim
/// wins (the cancel is refused because the row is running): never both, never neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_and_claim_race_never_both_win() {
    let db = TestDb::new().await;
    let claimer = db.client().await;
    let mut canceller = db.client().await;
    let (mut cancels, mut claims) = (0, 0);
    for round in 0..200 {
        let key = format!("race:{round}");
        let id = enqueue_webhook(&db, &key, "https://example.com/h", 3, true).await;
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
        let (b1, b2) = (barrier.clone(), barrier);
        let claimer = &claimer;
        let canceller = &mut canceller;
        let claim = async move {
            b1.wait().await;
            outboxd::claim::claim(
                claimer,
                &[outboxd::model::Channel::Webhook],
                10,
                "racer",
                Duration::from_secs(30),
            )
            .await
            .unwrap()
        };
        let cancel = async move {
            b2.wait().await;
            outboxd::ops::checkpoint(
                canceller,
                &outboxd::ops::Checkpoint::Cancel { reason: None },
                &[outboxd::ops::Target::Id(id)],
                "racer",
            )
            .await
        };
        let (batch, cancelled) = tokio::join!(claim, cancel);
        let claimed = batch.iter().any(|m| m.id == id);
        let state = row(&db, &key).await.state;
        match cancelled {
            Ok(rows) => {
                assert_eq!(rows.len(), 1);
                assert!(!claimed, "round {round}: claimed after a successful cancel");
                assert_eq!(state, "cancelled", "round {round}");
                cancels += 1;
            }
            Err(outboxd::ops::CheckpointError::Refused(m)) => {
                assert!(
                    claimed,
                    "round {round}: cancel refused ({m}) but nobody claimed it"
                );
                assert!(m.contains("running"), "round {round}: {m}");
                assert_eq!(state, "running", "round {round}");
                claims += 1;
            }
            Err(e) => panic!("round {round}: {e}"),
        }
        // Later claims never take a cancelled row.
        let later = outboxd::claim::claim(
            &db.client().await,
            &[outboxd::model::Channel::Webhook],
            10,
            "later",
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        assert!(later.iter().all(|m| m.id != id), "round {round}");
    }
    assert_eq!(cancels + claims, 200);
    eprintln!("cancel won {cancels} rounds, the claim {claims}");
}

/// The same race against the real worker: messages are cancelled while it sends; every
/// cancel that succeeded left a message the receiver never saw, every refused one met a
/// message that was running or done.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_successful_cancel_is_never_followed_by_a_send() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Status(204));
    let worker = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let mut c = db.client().await;
    let mut cancelled = Vec::new();
    let mut refused = 0;
    for i in 0..150 {
        let key = format!("live:{i}");
        let id = enqueue_webhook(&db, &key, &rx.url("/live"), 3, true).await;
        match outboxd::ops::checkpoint(
            &mut c,
            &outboxd::ops::Checkpoint::Cancel {
                reason: Some("race".into()),
            },
            &[outboxd::ops::Target::Id(id)],
            "racer",
        )
        .await
        {
            Ok(_) => cancelled.push(key),
            Err(outboxd::ops::CheckpointError::Refused(m)) => {
                assert!(m.contains("running") || m.contains("delivered"), "{m}");
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let dc = db.client().await;
    wait_until(Duration::from_secs(20), "every message finished", || {
        let dc = &dc;
        async move {
            let n: i64 = dc
                .query_one(
                    "SELECT count(*) FROM outbox.messages WHERE state IN ('pending', 'running')",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            n == 0
        }
    })
    .await;
    worker.stop().await;
    for key in &cancelled {
        assert!(
            rx.requests_for(key).is_empty(),
            "{key} was sent after its cancel"
        );
        assert_eq!(row(&db, key).await.state, "cancelled");
        assert!(
            history(&db, key).await.iter().all(|h| h.0 == "cancelled"),
            "{key}: {:?}",
            history(&db, key).await
        );
    }
    assert_eq!(cancelled.len() + refused, 150);
    let delivered: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'delivered'")
        .await;
    assert_eq!(delivered as usize, refused);
    eprintln!("{} cancelled, {refused} refused", cancelled.len());
}

#[tokio::test]
async fn drain_does_not_wait_for_held_rows() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_held(&db, "d:held", &rx.url("/d")).await;
    enqueue_webhook(&db, "d:pending", &rx.url("/d"), 3, true).await;
    enqueue_webhook(&db, "d:cancelled", &rx.url("/d"), 3, true).await;
    let out = cli(&db, &["cancel", "d:cancelled"]).await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let url = db.url();
    let out = tokio::task::spawn_blocking(move || {
        common::binary::run_within(
            outboxd(Some(&url))
                .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
                .args(["run", "--drain", "--poll-interval", "100ms"]),
            Duration::from_secs(30),
        )
    })
    .await
    .unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(row(&db, "d:pending").await.state, "delivered");
    assert_eq!(row(&db, "d:held").await.state, "held");
    assert_eq!(row(&db, "d:cancelled").await.state, "cancelled");
    assert_eq!(rx.requests().len(), 1);
}

/// Bad input to every new command: one line, the right exit code, nothing changed.
#[tokio::test]
async fn bad_input_to_the_new_commands_changes_nothing() {
    let db = TestDb::new().await;
    let url = "https://example.com/h";
    let held = enqueue_held(&db, "b:held", url).await.to_string();
    enqueue_webhook(&db, "b:pending", url, 3, true).await;
    let before = snapshot(&db).await;
    let long = "x".repeat(501);
    let huge = "y".repeat(100_000);
    let cases: Vec<(&str, Vec<&str>, i32, &str)> = vec![
        ("approve: no target", vec!["approve"], 2, "ID|KEY"),
        (
            "cancel: no target",
            vec!["cancel", "--reason", "r"],
            2,
            "ID|KEY",
        ),
        ("confirm: no target", vec!["confirm"], 2, "ID|KEY"),
        (
            "approve: unknown id",
            vec!["approve", &held, "999999"],
            1,
            "id 999999",
        ),
        (
            "cancel: unknown key",
            vec!["cancel", &held, "no-such-key"],
            1,
            "no-such-key",
        ),
        ("confirm: unknown id", vec!["confirm", "0"], 1, "id 0"),
        (
            "approve: key with ESC",
            vec!["approve", "a\u{1b}[31mb"],
            1,
            "no such message",
        ),
        (
            "cancel: key with a newline",
            vec!["cancel", "a\nFAKE"],
            1,
            "no such message",
        ),
        (
            "approve: empty key",
            vec!["approve", ""],
            1,
            "no such message",
        ),
        ("approve: negative id", vec!["approve", "-1"], 2, "-1"),
        (
            "approve: id past i64",
            vec!["approve", "99999999999999999999"],
            1,
            "no such message",
        ),
        ("approve: non-digit id", vec!["approve", "12a"], 1, "12a"),
        (
            "cancel: reason too long",
            vec!["cancel", &held, "--reason", &long],
            2,
            "at most 500",
        ),
        (
            "cancel: huge reason",
            vec!["cancel", &held, "--reason", &huge],
            2,
            "at most 500",
        ),
        (
            "cancel: reason with a newline",
            vec!["cancel", &held, "--reason", "a\nb"],
            2,
            "control characters",
        ),
        (
            "cancel: reason with ESC",
            vec!["cancel", &held, "--reason", "a\u{1b}[2Jb"],
            2,
            "control characters",
        ),
        (
            "cancel: reason with a bidi override",
            vec!["cancel", &held, "--reason", "a\u{202e}b"],
            2,
            "control characters",
        ),
        (
            "cancel: empty reason",
            vec!["cancel", &held, "--reason", " "],
            2,
            "reason must not be empty",
        ),
        (
            "approve: pending",
            vec!["approve", "b:pending"],
            1,
            "not held",
        ),
        ("held: limit 0", vec!["held", "--limit", "0"], 2, "--limit"),
        (
            "held: bad since",
            vec!["held", "--since", "soon"],
            2,
            "since",
        ),
        (
            "held: bad channel",
            vec!["held", "--channel", "sms"],
            2,
            "channel",
        ),
        (
            "held: bad json flag",
            vec!["held", "--json=maybe"],
            2,
            "json",
        ),
        (
            "enqueue: bad held flag",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
                "--held=perhaps",
            ],
            2,
            "held",
        ),
    ];
    for (what, args, code, mention) in cases {
        let out = cli(&db, &args).await;
        assert_refused(what, &out, code, &[mention]);
        // Text output never carries a raw control character from the input.
        assert!(
            !out.stderr.contains('\u{1b}') && !out.stderr.contains('\u{202e}'),
            "{what}: {:?}",
            out.stderr
        );
        assert_eq!(snapshot(&db).await, before, "{what}: nothing changed");
    }
}

/// The SQL functions' own rules, for psql users: typed errors naming the problem, nothing
/// changed.
#[tokio::test]
async fn the_sql_functions_refuse_bad_input_with_sqlstates() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = "https://example.com/h";
    let held = enqueue_held(&db, "s:held", url).await;
    let pending = enqueue_webhook(&db, "s:pending", url, 3, true).await;
    let before = snapshot(&db).await;
    let long = "r".repeat(501);
    let cases: Vec<(String, &str, &str)> = vec![
        (
            "SELECT * FROM outbox.approve(NULL)".into(),
            "22023",
            "must not be null",
        ),
        (
            format!("SELECT * FROM outbox.approve(ARRAY[{held}, NULL])"),
            "22023",
            "must not contain null",
        ),
        (
            format!("SELECT * FROM outbox.approve(ARRAY[{held}, 424242])"),
            "P0002",
            "424242",
        ),
        (
            format!("SELECT * FROM outbox.cancel(ARRAY[424242, {held}])"),
            "P0002",
            "nothing cancelled",
        ),
        (
            format!("SELECT * FROM outbox.confirm(ARRAY[{held}])"),
            "55000",
            "s:held",
        ),
        (
            format!("SELECT * FROM outbox.approve(ARRAY[{held}, {pending}])"),
            "55000",
            "s:pending",
        ),
        (
            format!("SELECT * FROM outbox.cancel(ARRAY[{held}], '{long}')"),
            "22023",
            "at most 500",
        ),
        (
            format!("SELECT * FROM outbox.cancel(ARRAY[{held}], E'a\\rb')"),
            "22023",
            "U+000D",
        ),
        (
            format!("SELECT * FROM outbox.cancel(ARRAY[{held}], '')"),
            "22023",
            "empty",
        ),
        (
            "SELECT outbox.enqueue('k', 'webhook', '{\"url\": \"u\"}', held => NULL)".into(),
            "22023",
            "held",
        ),
        (
            "SELECT * FROM outbox.lookup(NULL)".into(),
            "22023",
            "message_key",
        ),
        (
            "SELECT * FROM outbox.lookup('')".into(),
            "22023",
            "message_key",
        ),
        (
            format!("SELECT * FROM outbox.lookup('{}')", "k".repeat(256)),
            "22023",
            "255",
        ),
        (
            "SELECT * FROM outbox.lookup(E'a\\u001bb')".into(),
            "22023",
            "U+001B",
        ),
    ];
    for (statement, code, mention) in cases {
        let err = c.batch_execute(&statement).await.expect_err(&statement);
        let dbe = err.as_db_error().expect("a database error");
        assert_eq!(dbe.code().code(), code, "{statement}: {dbe:?}");
        assert!(
            dbe.message().contains(mention),
            "{statement}: {}",
            dbe.message()
        );
        assert!(!dbe.message().contains('\n'), "{statement}: one line");
    }
    // An empty list is no work (as for ARRAY(SELECT …) that finds nothing).
    let n = c
        .query("SELECT * FROM outbox.cancel('{}'::bigint[])", &[])
        .await
        .unwrap()
        .len();
    assert_eq!(n, 0);
    assert_eq!(snapshot(&db).await, before, "nothing changed");
    // Duplicate ids are one row.
    let rows = c
        .query(
            &format!("SELECT * FROM outbox.approve(ARRAY[{held}, {held}])"),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(history(&db, "s:held").await.len(), 1);
}

/// The two webhook fields the worker reads are checked at enqueue, on every path.
#[tokio::test]
async fn enqueue_checks_reconcile_and_store_response() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let good = [
        json!({"url": "https://x.example/h", "reconcile": {"url": "https://x.example/r"}}),
        json!({"url": "https://x.example/h", "store_response": true}),
        json!({"url": "https://x.example/h", "store_response": false, "reconcile": {"url": "r", "other": 1}}),
    ];
    for (i, p) in good.iter().enumerate() {
        outboxd::enqueue(
            &c,
            &outboxd::NewMessage::webhook(format!("good:{i}"), p.clone()),
        )
        .await
        .unwrap_or_else(|e| panic!("{p}: {e}"));
    }
    // An e-mail payload may carry such names; they mean nothing there.
    outboxd::enqueue(
        &c,
        &outboxd::NewMessage::email(
            "mail",
            json!({"to": "a@x.example", "text": "t", "reconcile": 1, "store_response": "yes"}),
        ),
    )
    .await
    .unwrap();
    let before = snapshot(&db).await;
    let bad = [
        (
            json!({"url": "u", "reconcile": "https://x.example/r"}),
            "payload.reconcile",
        ),
        (json!({"url": "u", "reconcile": null}), "payload.reconcile"),
        (
            json!({"url": "u", "reconcile": ["https://x"]}),
            "payload.reconcile",
        ),
        (
            json!({"url": "u", "reconcile": {}}),
            "payload.reconcile.url",
        ),
        (
            json!({"url": "u", "reconcile": {"url": 7}}),
            "payload.reconcile.url",
        ),
        (
            json!({"url": "u", "reconcile": {"url": null}}),
            "payload.reconcile.url",
        ),
        (
            json!({"url": "u", "store_response": "true"}),
            "payload.store_response",
        ),
        (
            json!({"url": "u", "store_response": 1}),
            "payload.store_response",
        ),
        (
            json!({"url": "u", "store_response": null}),
            "payload.store_response",
        ),
    ];
    for (p, field) in bad {
        let err = outboxd::enqueue(&c, &outboxd::NewMessage::webhook("bad", p.clone()))
            .await
            .unwrap_err();
        match &err {
            outboxd::EnqueueError::Invalid { field: f, .. } => assert_eq!(f, field, "{p}"),
            other => panic!("{p}: {other:?}"),
        }
        let err = outboxd::enqueue_many(
            &c,
            &[
                outboxd::NewMessage::webhook("bad:ok", json!({"url": "u"})),
                outboxd::NewMessage::webhook("bad", p.clone()),
            ],
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, outboxd::EnqueueError::Invalid { field: f, .. } if f == field),
            "{p}: {err:?}"
        );
        let err = c
            .execute(
                "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('bad', 'webhook', $1)",
                &[&p],
            )
            .await
            .unwrap_err();
        assert_eq!(err.as_db_error().unwrap().column(), Some(field), "{p}");
    }
    assert_eq!(snapshot(&db).await, before, "nothing inserted");
}

/// `show` keeps a reconciliation URL's path and query out of its output, as it does the
/// main URL's (tokens sit there).
#[tokio::test]
async fn show_redacts_the_reconcile_url() {
    let db = TestDb::new().await;
    let c = db.client().await;
    outboxd::enqueue(
        &c,
        &outboxd::NewMessage::webhook(
            "rec",
            json!({"url": "https://x.example/h?token=SECRET1", "reconcile": {"url": "https://y.example/orders/42?token=SECRET2"}}),
        ),
    )
    .await
    .unwrap();
    for args in [&["show", "rec"][..], &["show", "rec", "--json"]] {
        let out = cli(&db, args).await;
        assert_eq!(out.code, Some(0), "{:?}", out.stderr);
        assert!(!out.stdout.contains("SECRET"), "{}", out.stdout);
        assert!(
            out.stdout.contains("https://y.example/[redacted]"),
            "{}",
            out.stdout
        );
    }
}

/// `enqueue --held` again with the same payload is the same row,
/// still held; `status` prints the new states; a very long key is just unknown.
#[tokio::test]
async fn enqueue_held_from_the_cli_keeps_the_dedup_rule() {
    let db = TestDb::new().await;
    let payload = json!({"url": "https://example.com/h"}).to_string();
    let args = [
        "enqueue",
        "--key",
        "k:1",
        "--channel",
        "webhook",
        "--payload",
        &payload,
    ];
    let first = cli(&db, &[&args[..], &["--held"]].concat()).await;
    assert_eq!(first.code, Some(0), "{:?}", first.stderr);
    let url = db.url();
    let a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let again =
        tokio::task::spawn_blocking(move || run(outboxd(Some(&url)).args(&a).arg("--held")))
            .await
            .unwrap();
    assert_eq!(again.code, Some(0), "{:?}", again.stderr);
    let id = first.stdout.split_whitespace().next().unwrap().to_owned();
    assert_eq!(again.stdout.trim(), format!("{id} existing"));
    // Without --held, the same payload is still that held row.
    let plain = cli(&db, &args).await;
    assert_eq!(plain.stdout.trim(), format!("{id} existing"));
    assert_eq!(row(&db, "k:1").await.state, "held");

    let out = cli(&db, &["status"]).await;
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let line = |state: &str| {
        out.stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(state))
            .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
    };
    assert_eq!(line("held").as_deref(), Some("1 0 0 1"), "{}", out.stdout);
    assert_eq!(
        line("cancelled").as_deref(),
        Some("0 0 0 0"),
        "{}",
        out.stdout
    );

    let before = snapshot(&db).await;
    let long = "k".repeat(100_000);
    let out = cli(&db, &["approve", &long]).await;
    assert_refused("a 100 KB key", &out, 1, &["no such message"]);
    assert_eq!(snapshot(&db).await, before);
}
