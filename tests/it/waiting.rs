//! Waiting for an outcome (`outbox.wake_waiters`, what the clients' `wait` stands on): a
//! change of state notifies `outbox_settled` only while a session holds the waiter mark, and
//! no change is missed by a waiter that arrives while the change's transaction is open.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::receiver::Receiver;
use common::*;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};

/// A session of `cfg` that LISTENs on `outbox_settled`, and what it hears (payloads).
async fn settled_listener(
    cfg: &tokio_postgres::Config,
) -> (tokio_postgres::Client, mpsc::UnboundedReceiver<String>) {
    let (client, mut conn) = cfg.connect(NoTls).await.expect("connect to PostgreSQL");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(msg) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
            match msg {
                Ok(AsyncMessage::Notification(n)) if n.channel() == "outbox_settled" => {
                    let _ = tx.send(n.payload().to_owned());
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    client.batch_execute("LISTEN outbox_settled").await.unwrap();
    (client, rx)
}

/// The notifications heard before a sentinel sent now: PostgreSQL delivers notifications in
/// commit order, so everything committed before it has arrived with it.
async fn heard_so_far(db: &TestDb, rx: &mut mpsc::UnboundedReceiver<String>) -> Vec<String> {
    db.client()
        .await
        .batch_execute("NOTIFY outbox_settled, 'sentinel'")
        .await
        .unwrap();
    let mut heard = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the sentinel notification within 10s")
            .expect("listener alive");
        if n == "sentinel" {
            return heard;
        }
        heard.push(n);
    }
}

const TAKE_MARK: &str = "SELECT pg_advisory_lock_shared(1869968482, 3)";
const DROP_MARK: &str = "SELECT pg_advisory_unlock_shared(1869968482, 3)";

#[tokio::test]
async fn a_state_change_notifies_only_while_a_waiter_holds_the_mark() {
    let db = TestDb::new().await;
    let receiver = Receiver::start().await;
    let worker = RunningWorker::start(&db, test_worker_config("settle"), test_webhook_config());
    let (waiter, mut rx) = settled_listener(&db.pg).await;

    // Nobody waits: a delivery (its claim and its completion) and the worker's polls
    // meanwhile commit without a notification.
    enqueue_webhook(&db, "quiet:1", &receiver.url("/q"), 3, true).await;
    wait_for_state(&db, "quiet:1", "delivered", Duration::from_secs(10)).await;
    assert_eq!(heard_so_far(&db, &mut rx).await, Vec::<String>::new());

    // A waiter holds the mark: the delivery by the worker is heard.
    waiter.batch_execute(TAKE_MARK).await.unwrap();
    enqueue_webhook(&db, "heard:1", &receiver.url("/h"), 3, true).await;
    wait_for_state(&db, "heard:1", "delivered", Duration::from_secs(10)).await;
    let heard = heard_so_far(&db, &mut rx).await;
    assert!(!heard.is_empty(), "the delivery notified the waiter");
    assert!(heard.iter().all(|n| n.is_empty()), "{heard:?}");
    worker.stop().await;
    heard_so_far(&db, &mut rx).await;

    // So are the operators' actions, which settle rows inside SQL functions.
    let c = db.client().await;
    let held = outboxd::NewMessage::webhook(
        "held:1",
        serde_json::json!({"url": "https://example.com/h"}),
    )
    .held(true);
    let id = outboxd::enqueue(&c, &held).await.unwrap().id;
    assert_eq!(
        heard_so_far(&db, &mut rx).await,
        Vec::<String>::new(),
        "an insert is no change of state"
    );
    c.query("SELECT * FROM outbox.cancel(ARRAY[$1::bigint])", &[&id])
        .await
        .unwrap();
    assert_eq!(heard_so_far(&db, &mut rx).await, [""]);

    // The mark dropped, nothing more is sent.
    waiter.batch_execute(DROP_MARK).await.unwrap();
    let other = outboxd::NewMessage::webhook(
        "held:2",
        serde_json::json!({"url": "https://example.com/h"}),
    )
    .held(true);
    let id = outboxd::enqueue(&c, &other).await.unwrap().id;
    c.query("SELECT * FROM outbox.approve(ARRAY[$1::bigint])", &[&id])
        .await
        .unwrap();
    assert_eq!(heard_so_far(&db, &mut rx).await, Vec::<String>::new());
}

/// The race the settle gate closes: a transaction changes a state while nobody waits (so it
/// does not notify), a waiter then arrives and looks, and only then does the transaction
/// commit. The waiter, an application login of sql/grants.sql, waits at the gate until the
/// transaction has ended, so its look comes after the commit; a transaction that meets a
/// waiter at the gate notifies without waiting itself.
#[tokio::test]
async fn a_change_committed_after_the_waiter_arrived_is_not_missed() {
    let db = TestDb::new().await;
    let (_roles, app, _worker) = crate::privileges::setup(&db).await;
    let c = db.client().await;
    let url = serde_json::json!({"url": "https://example.com/h"});
    let a = outboxd::enqueue(
        &c,
        &outboxd::NewMessage::webhook("gate:a", url.clone()).held(true),
    )
    .await
    .unwrap()
    .id;
    let b = outboxd::enqueue(&c, &outboxd::NewMessage::webhook("gate:b", url).held(true))
        .await
        .unwrap()
        .id;

    // Cancelled in a transaction still open: nobody waited, so it holds the gate.
    let ops = db.client().await;
    ops.batch_execute("BEGIN").await.unwrap();
    ops.query("SELECT * FROM outbox.cancel(ARRAY[$1::bigint])", &[&a])
        .await
        .unwrap();

    // The waiter, as the application role: listen, the mark, then the gate.
    let (waiter, mut rx) = settled_listener(&app).await;
    waiter.batch_execute(TAKE_MARK).await.unwrap();
    let pid = backend_pid(&waiter).await;
    let at_gate = tokio::spawn(async move {
        waiter
            .batch_execute("BEGIN; SELECT pg_advisory_xact_lock(1869968482, 4); COMMIT")
            .await
            .unwrap();
        let state: String = waiter
            .query_one("SELECT state FROM outbox.lookup('gate:a')", &[])
            .await
            .unwrap()
            .get(0);
        (waiter, state)
    });
    wait_for_backend_wait(&c, pid, "advisory", "the waiter to wait at the gate").await;

    // Meanwhile another change meets the waiter at the gate: it notifies, and does not wait.
    tokio::time::timeout(
        Duration::from_secs(10),
        c.query("SELECT * FROM outbox.cancel(ARRAY[$1::bigint])", &[&b]),
    )
    .await
    .expect("a change never waits for the gate")
    .unwrap();
    ops.batch_execute("COMMIT").await.unwrap();
    let (_waiter, state) = tokio::time::timeout(Duration::from_secs(10), at_gate)
        .await
        .expect("the gate opens once the open transaction commits")
        .unwrap();
    assert_eq!(
        state, "cancelled",
        "the waiter's look comes after the commit"
    );
    // The change that met the waiter at the gate notified; the waiter hears it once its own
    // transaction at the gate has ended (notifications arrive between transactions).
    let heard = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the change that met the waiter notified")
        .unwrap();
    assert_eq!(heard, "");
}
