//! Wake-ups (`outbox.wake_needed`): an enqueueing transaction notifies only while a worker is idle, and
//! no wake-up is lost when a worker becomes idle while such a transaction is still open.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::receiver::{Receiver, Reply};
use common::*;
use tokio::sync::mpsc;

/// The notifications that arrive before a sentinel sent now: PostgreSQL delivers
/// notifications in commit order, so everything committed before it has arrived with it.
async fn notifications_so_far(
    db: &TestDb,
    rx: &mut mpsc::UnboundedReceiver<(String, String)>,
) -> Vec<String> {
    db.client()
        .await
        .batch_execute("NOTIFY outbox_messages, 'sentinel'")
        .await
        .unwrap();
    let mut seen = Vec::new();
    loop {
        let (_, n) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the sentinel notification within 10s")
            .expect("listener alive");
        if n == "sentinel" {
            return seen;
        }
        seen.push(n);
    }
}

async fn insert_committed(db: &TestDb, key: &str) {
    db.client()
        .await
        .execute(
            "INSERT INTO outbox.messages (message_key, channel, payload) \
             VALUES ($1, 'webhook', '{\"url\": \"https://example.com/h\"}')",
            &[&key],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn enqueueing_notifies_only_while_a_worker_holds_the_idle_mark() {
    let db = TestDb::new().await;
    let (_l, mut rx) = listener(&db).await;

    // No worker is idle: a plain INSERT and outbox.enqueue commit without a notification.
    insert_committed(&db, "quiet:1").await;
    enqueue_webhook(&db, "quiet:2", "https://example.com/h", 3, true).await;
    assert_eq!(
        notifications_so_far(&db, &mut rx).await,
        Vec::<String>::new()
    );

    // A worker's LISTEN session holds the idle mark: each enqueueing transaction notifies.
    let idle = db.client().await;
    hold_idle_mark(&idle).await;
    insert_committed(&db, "woken:1").await;
    enqueue_webhook(&db, "woken:2", "https://example.com/h", 3, true).await;
    assert_eq!(notifications_so_far(&db, &mut rx).await, ["", ""]);

    // The mark goes with the session (a worker that dies stops asking).
    drop(idle);
    wait_for_idle_marks(&db, 0, "the idle mark to be released").await;
    insert_committed(&db, "quiet:3").await;
    assert_eq!(
        notifications_so_far(&db, &mut rx).await,
        Vec::<String>::new()
    );

    // A worker waiting at the gate makes every enqueuer notify, without waiting itself.
    let gate = db.client().await;
    let app = db.client().await;
    app.batch_execute("BEGIN").await.unwrap();
    app.execute(
        "SELECT outbox.enqueue('gated:1', 'webhook', '{\"url\": \"https://example.com/h\"}')",
        &[],
    )
    .await
    .unwrap();
    // The gate's own backend, watched by its pid: counting advisory waiters in `pg_locks`
    // would also count an idle worker of another test's database waiting at its own gate.
    let gate_pid = backend_pid(&gate).await;
    let waiting = tokio::spawn(async move {
        gate.batch_execute(
            "SELECT pg_advisory_lock(1869968482, 1); SELECT pg_advisory_unlock(1869968482, 1)",
        )
        .await
        .unwrap();
    });
    wait_for_backend_wait(
        &db.client().await,
        gate_pid,
        "advisory",
        "the gate to have a waiter",
    )
    .await;
    tokio::time::timeout(Duration::from_secs(10), insert_committed(&db, "gated:2"))
        .await
        .expect("an enqueuer never waits for the gate");
    app.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the gate opens once the open enqueuer commits")
        .unwrap();
    assert_eq!(
        notifications_so_far(&db, &mut rx).await,
        [""],
        "the enqueuer that met a waiting gate notified; the one that passed it earlier did not"
    );
}

/// The race the gate closes: a transaction enqueues while the worker is busy (so it does not
/// notify), the worker then runs out of work and goes to sleep, and only then does the
/// transaction commit. Polling is an hour, so only the gate can get the message sent.
#[tokio::test]
async fn a_message_committed_after_the_worker_went_idle_is_still_sent_at_once() {
    let db = TestDb::new().await;
    let receiver = Receiver::start().await;
    // The first delivery stalls: the worker stays busy meanwhile.
    receiver.script([Reply::Stall(Duration::from_secs(3))]);
    let mut cfg = test_worker_config("gate");
    cfg.concurrency = 1;
    cfg.poll_interval = Duration::from_secs(3600);
    let mut webhook = test_webhook_config();
    // Outlasts the stall, and fits in the test's 10 s lease.
    webhook.timeout = Duration::from_secs(5);
    let worker = RunningWorker::start(&db, cfg, webhook);
    wait_for_idle_marks(&db, 1, "the idle worker to hold the mark").await;

    // Five due messages keep the worker's claims full (one slot; rows ahead once it has
    // seen a delivery end): busy.
    let c = db.client().await;
    c.batch_execute("BEGIN").await.unwrap();
    for key in ["busy:1", "busy:2", "busy:3", "busy:4", "busy:5"] {
        let msg = outboxd::NewMessage::webhook(
            key,
            serde_json::json!({"url": receiver.url("/slow"), "body": {}}),
        );
        outboxd::enqueue(&c, &msg).await.unwrap();
    }
    c.batch_execute("COMMIT").await.unwrap();
    wait_for_idle_marks(&db, 0, "the busy worker to give up the mark").await;

    // Enqueued while nobody is idle: no notification is asked for.
    let app = db.client().await;
    app.batch_execute("BEGIN").await.unwrap();
    let msg = outboxd::NewMessage::webhook(
        "late",
        serde_json::json!({"url": receiver.url("/late"), "body": {}}),
    );
    outboxd::enqueue(&app, &msg).await.unwrap();
    assert_eq!(
        idle_marks(&db).await,
        0,
        "still busy when the enqueue ran (the stall lasts 3 s)"
    );

    // The worker finishes, finds nothing (the transaction is open) and goes idle.
    let ready = db.client().await;
    wait_for_count(&ready, "delivered", 5, Duration::from_secs(20)).await;
    wait_for_idle_marks(&db, 1, "the idle worker to hold the mark again").await;
    assert!(
        receiver.requests_for("late").is_empty(),
        "nothing is sent while the enqueueing transaction is open"
    );

    app.batch_execute("COMMIT").await.unwrap();
    let r = wait_for_state(&db, "late", "delivered", Duration::from_secs(10)).await;
    assert_eq!(r.attempts, 1);
    assert_eq!(receiver.requests_for("late").len(), 1);
    worker.stop().await;
}

/// A wake-up that arrives while a claim is in flight is kept for the turn after it: the
/// claim's snapshot may be older than the commit that announced the message. Here a
/// trigger (the test's own) holds the claim of `during:a` for a second inside its
/// statement, after its snapshot; meanwhile `during:b` commits and notifies. The claim
/// comes back with `a` alone, whose request then stalls for 10 s, so no task ending wakes
/// the loop either, and polling is an hour: only the kept wake-up gets `b` sent soon.
///
/// `a` and `b` go to receivers of their own, so that only `a`'s request stalls whichever
/// arrives first; and the claim's sleep is looked for in this test's database only (other
/// tests running beside it sleep too, and `b` enqueued before the claim's snapshot would
/// be claimed with `a`, and then either request could take the stall: the likely cause of
/// this test's one failure in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_during_a_claim_is_not_lost() {
    let db = TestDb::new().await;
    let receiver = Receiver::start().await;
    receiver.script([Reply::Stall(Duration::from_secs(10))]);
    let receiver_b = Receiver::start().await;
    let c = db.client().await;
    slow_claim_of(&c, "during:a", 1.0).await;
    let mut cfg = test_worker_config("during");
    cfg.concurrency = 4;
    cfg.poll_interval = Duration::from_secs(3600);
    cfg.lease = Duration::from_secs(30);
    let mut webhook = test_webhook_config();
    // Outlasts the stall.
    webhook.timeout = Duration::from_secs(15);
    let worker = RunningWorker::start(&db, cfg, webhook);
    wait_for_idle_marks(&db, 1, "the idle worker to hold the mark").await;

    enqueue_webhook(&db, "during:a", &receiver.url("/a"), 3, true).await;
    // The claim is inside its statement, its snapshot taken.
    wait_for_a_sleeping_claim(&c).await;
    enqueue_webhook(&db, "during:b", &receiver_b.url("/b"), 3, true).await;
    // Before a's request ends (10 s after the claim) or a poll (an hour), with room for a
    // loaded machine.
    wait_for_state(&db, "during:b", "delivered", Duration::from_secs(8)).await;
    assert_eq!(receiver_b.requests_for("during:b").len(), 1);
    assert_eq!(
        receiver.requests_for("during:a").len(),
        1,
        "a's request is the one stalled"
    );
    worker.stop().await;
}

/// Sessions opened on the test's database so far (each connection counts once).
async fn sessions(c: &tokio_postgres::Client) -> i64 {
    c.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .unwrap();
    c.query_one(
        "SELECT sessions FROM pg_stat_database WHERE datname = current_database()",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Once the claim loop stops, the LISTEN connection goes and stays gone: while the worker
/// finishes an attempt in flight it does not reconnect (it used to, every back-off, taking
/// the idle mark each time, so enqueuers notified for a worker that was leaving).
#[tokio::test]
async fn a_stopping_worker_does_not_reconnect_its_listen_connection() {
    let db = TestDb::new().await;
    let receiver = Receiver::start().await;
    receiver.script([Reply::Stall(Duration::from_secs(3))]);
    let mut cfg = test_worker_config("leaving");
    cfg.poll_interval = Duration::from_secs(3600);
    let mut webhook = test_webhook_config();
    webhook.timeout = Duration::from_secs(5);
    let worker = RunningWorker::start(&db, cfg, webhook);
    wait_for_idle_marks(&db, 1, "the idle worker to hold the mark").await;
    enqueue_webhook(&db, "slow:1", &receiver.url("/slow"), 3, true).await;
    wait_until(
        Duration::from_secs(10),
        "the slow attempt to start",
        || async { !receiver.requests().is_empty() },
    )
    .await;
    // Idle again (nothing else to claim) while the attempt is in flight.
    wait_for_idle_marks(&db, 1, "the worker to go idle beside its attempt").await;
    let c = db.client().await;
    let before = sessions(&c).await;
    let summary = worker.stop().await;
    assert_eq!(summary.delivered, 1, "the attempt in flight finished");
    let opened = sessions(&c).await - before;
    assert!(
        opened <= 1,
        "{opened} sessions opened while the worker was stopping"
    );
    assert_eq!(idle_marks(&db).await, 0);
}
