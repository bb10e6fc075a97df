//! The newcomer's demo (`examples/demo.rs`): its business transactions, run twice against one
//! database as a second `docker compose up` does. In the container the demo's process id is
//! the same on every run, and its receivers listen on a new port each time, so the payloads
//! differ from the last run's.

#![allow(clippy::unwrap_used)]

use crate::common::TestDb;

#[path = "../../examples/demo/run.rs"]
mod demo_run;

/// Two runs in one process (one process id, as in the container), with the receivers on
/// two ports: the second run enqueues its own messages instead of meeting the first run's
/// keys with another payload (OB409).
#[tokio::test]
async fn the_demo_runs_again_against_the_same_database() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    let first = demo_run::Run::start(&client).await.unwrap();
    demo_run::enqueue_orders(&mut client, &first, "http://demo:40001")
        .await
        .unwrap();
    let second = demo_run::Run::start(&client).await.unwrap();
    if let Err(e) = demo_run::enqueue_orders(&mut client, &second, "http://demo:40002").await {
        panic!("the second run failed: {e:#}");
    }
    assert_ne!(first.key(1, "paid"), second.key(1, "paid"));
    for run in [&first, &second] {
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox.messages WHERE starts_with(message_key, $1)",
                &[&run.prefix()],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            n,
            4,
            "orders 1, 3 and 4, and the receipt, of {}",
            run.prefix()
        );
    }
}
