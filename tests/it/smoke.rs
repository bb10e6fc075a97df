//! The shortest path through the system: enqueue, run, delivered.

use crate::common;

use std::time::Duration;

use common::receiver::Receiver;
use common::*;

#[tokio::test]
async fn a_committed_webhook_is_delivered_once_with_its_key() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_webhook(&db, "order-1:paid:notify", &rx.url("/hook"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w1"), test_webhook_config());
    let row = wait_for_state(
        &db,
        "order-1:paid:notify",
        "delivered",
        Duration::from_secs(10),
    )
    .await;
    let summary = w.stop().await;
    assert_eq!(summary.delivered, 1);
    assert_eq!(row.attempts, 1);
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(
        reqs[0].header("idempotency-key").as_deref(),
        Some("order-1:paid:notify")
    );
}
