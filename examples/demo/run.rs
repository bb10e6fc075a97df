//! One run of the demo: the keys of its messages, and the business transactions that
//! enqueue them. Apart from `demo.rs` so that a test (`tests/it/demo.rs`) runs them too.

use outboxd::{NewMessage, enqueue};
use serde_json::json;

/// A run of the demo, named by its number: every key it enqueues starts `demo-run-<n>:`.
pub struct Run {
    id: i64,
}

impl Run {
    /// A new run against the database `client` is connected to: the next number of the
    /// database's `demo_runs`. A key is made from durable ids, as an application makes
    /// its own: a process id is not one (in a container it is the same on every run), and
    /// the receivers' port changes from run to run, so a second run that reused the first
    /// run's keys met them with another payload and was refused (OB409).
    pub async fn start(client: &tokio_postgres::Client) -> anyhow::Result<Run> {
        client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS demo_runs \
                 (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, started_at timestamptz NOT NULL DEFAULT now())",
            )
            .await?;
        let id = client
            .query_one("INSERT INTO demo_runs DEFAULT VALUES RETURNING id", &[])
            .await?
            .get(0);
        Ok(Run { id })
    }

    /// The key of an order's step, made from durable ids: `demo-run-<n>:order-<m>:<step>`.
    pub fn key(&self, order: u32, step: &str) -> String {
        format!("demo-run-{}:order-{order}:{step}", self.id)
    }

    /// What every key of this run starts with.
    pub fn prefix(&self) -> String {
        format!("demo-run-{}:", self.id)
    }
}

/// Step 3: business transactions that enqueue webhooks to `base` (and a receipt e-mail
/// with order 1); order 2 is rolled back. Then order 1 is enqueued again with its key, which
/// returns the first record.
pub async fn enqueue_orders(
    client: &mut tokio_postgres::Client,
    run: &Run,
    base: &str,
) -> anyhow::Result<()> {
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS demo_orders (id bigint PRIMARY KEY, state text NOT NULL); TRUNCATE demo_orders")
        .await?;
    for (order, path, commit) in [
        (1, "orders", true),
        (2, "orders", false),
        (3, "flaky", true),
        (4, "gone", true),
    ] {
        let tx = client.transaction().await?;
        tx.execute(
            "INSERT INTO demo_orders VALUES ($1, 'paid')",
            &[&i64::from(order)],
        )
        .await?;
        let msg = NewMessage::webhook(
            run.key(order, "paid"),
            json!({"url": format!("{base}/{path}"), "body": {"order": order, "event": "order.paid"}}),
        );
        let e = enqueue(&tx, &msg).await?;
        if order == 1 {
            // The same transaction also writes the customer's receipt.
            let receipt = NewMessage::email(
                run.key(order, "receipt"),
                json!({"from": "Shop <shop@example.com>", "to": ["alice@example.com"],
                       "subject": "Your order №1 is paid ✓", "text": "Thank you!",
                       "html": "<p>Thank you!</p>"}),
            );
            enqueue(&tx, &receipt).await?;
        }
        if commit {
            tx.commit().await?;
            println!(
                "   order {order}: committed, message {} enqueued (key {})",
                e.id,
                run.key(order, "paid")
            );
        } else {
            tx.rollback().await?;
            println!("   order {order}: ROLLED BACK: its message must never be sent");
        }
    }
    // Enqueueing the same key again is a no-op that returns the first record.
    let again = enqueue(
        &*client,
        &NewMessage::webhook(
            run.key(1, "paid"),
            json!({"url": format!("{base}/orders"), "body": {"order": 1, "event": "order.paid"}}),
        ),
    )
    .await?;
    println!(
        "   order 1 enqueued again with the same key: created = {} (deduplicated)",
        again.created
    );
    Ok(())
}
