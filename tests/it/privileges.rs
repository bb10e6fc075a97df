//! Least privilege: the roles of sql/grants.sql, exercised with real logins.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::receiver::Receiver;
use common::*;

/// Login roles made for one test (role names are cluster-wide, so each test gets its own),
/// dropped at the end even if the test fails.
struct Roles {
    admin: tokio_postgres::Config,
    db: String,
    names: Vec<String>,
}

impl Drop for Roles {
    fn drop(&mut self) {
        let (mut admin, db, names) = (self.admin.clone(), self.db.clone(), self.names.clone());
        admin.dbname(&db);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let c = connect(&admin).await;
                for n in names {
                    let _ = c
                        .batch_execute(&format!("DROP OWNED BY {n}; DROP ROLE IF EXISTS {n}"))
                        .await;
                }
            });
        })
        .join();
    }
}

/// Applies sql/grants.sql with unique group-role names, and makes a login for each group.
/// Returns (app login, worker login).
async fn setup(db: &TestDb) -> (Roles, tokio_postgres::Config, tokio_postgres::Config) {
    let suffix = format!("{}_{}", std::process::id(), rand::random::<u32>());
    let (app, worker) = (
        format!("outbox_app_{suffix}"),
        format!("outbox_worker_{suffix}"),
    );
    let (app_login, worker_login) = (
        format!("app_login_{suffix}"),
        format!("worker_login_{suffix}"),
    );
    let admin: tokio_postgres::Config = admin_url().parse().unwrap();
    let roles = Roles {
        admin,
        db: db.name.clone(),
        names: vec![
            app_login.clone(),
            worker_login.clone(),
            app.clone(),
            worker.clone(),
        ],
    };
    let sql = include_str!("../../sql/grants.sql")
        .replace("outbox_app", &app)
        .replace("outbox_worker", &worker);
    let c = db.client().await;
    c.batch_execute(&sql).await.unwrap();
    c.batch_execute(&format!(
        "CREATE ROLE {app_login} LOGIN IN ROLE {app}; CREATE ROLE {worker_login} LOGIN IN ROLE {worker};"
    ))
    .await
    .unwrap();
    let as_user = |user: &str| {
        let mut cfg = db.pg.clone();
        cfg.user(user);
        cfg
    };
    let (a, w) = (as_user(&app_login), as_user(&worker_login));
    (roles, a, w)
}

fn denied(e: &tokio_postgres::Error) -> bool {
    e.code().map(|c| c.code()) == Some("42501")
}

#[tokio::test]
async fn the_application_role_can_enqueue_and_nothing_else() {
    let db = TestDb::new().await;
    let (_roles, app, _) = setup(&db).await;
    enqueue_webhook(
        &db,
        "someone-else",
        "https://example.com/hooks/SECRET",
        3,
        true,
    )
    .await;

    let mut c = connect(&app).await;
    let tx = c.transaction().await.unwrap();
    let msg = outboxd::NewMessage::webhook(
        "mine:1",
        serde_json::json!({"url": "https://example.com/h"}),
    );
    let first = outboxd::enqueue(&tx, &msg).await.unwrap();
    let again = outboxd::enqueue(&tx, &msg).await.unwrap();
    assert!(first.created && !again.created && first.id == again.id);
    let many = outboxd::enqueue_many(
        &tx,
        &[outboxd::NewMessage::webhook(
            "mine:2",
            serde_json::json!({"url": "https://example.com/h"}),
        )],
    )
    .await
    .unwrap();
    assert_eq!(many.len(), 1);
    tx.commit().await.unwrap();
    c.execute("INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('mine:3', 'webhook', '{\"url\": \"https://example.com/h\"}')", &[])
        .await
        .unwrap();
    c.query_one(
        "SELECT outbox.enqueue('mine:4', 'webhook', '{\"url\": \"https://example.com/h\"}')",
        &[],
    )
    .await
    .unwrap();

    // It cannot read anyone's payloads, its own included, nor the history.
    for sql in [
        "SELECT payload FROM outbox.messages",
        "SELECT count(*) FROM outbox.messages",
        "SELECT * FROM outbox.attempts",
        "UPDATE outbox.messages SET state = 'dead', dead_at = now(), error_class = 'invalid'",
        "UPDATE outbox.messages SET run_after = now() + interval '1 year'",
        "DELETE FROM outbox.messages",
        "INSERT INTO outbox.attempts (message_id, attempt, started_at, outcome) VALUES (1, 1, now(), 'delivered')",
        "SELECT * FROM outbox.replay(ARRAY[1::bigint])",
        "SELECT outbox.purge(interval '30 days')",
    ] {
        let err = c.batch_execute(sql).await.expect_err(sql);
        assert!(denied(&err), "{sql}: {err}");
    }
    // A plain INSERT may not set the state or the lease.
    let err = c
        .batch_execute("INSERT INTO outbox.messages (message_key, channel, payload, state) VALUES ('x', 'webhook', '{\"url\": \"u\"}', 'delivered')")
        .await
        .unwrap_err();
    assert!(denied(&err), "{err}");
    let states: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'pending'")
        .await;
    assert_eq!(
        states, 5,
        "everything it wrote is pending, nothing else changed"
    );
}

#[tokio::test]
async fn the_worker_role_runs_the_daemon_and_the_operator_commands() {
    let db = TestDb::new().await;
    let (_roles, _, worker) = setup(&db).await;
    let rx = Receiver::start().await;
    rx.script([common::receiver::Reply::Status(400)]);
    enqueue_webhook(&db, "w:1", &rx.url("/h"), 3, true).await;
    enqueue_webhook(&db, "w:2", &rx.url("/h"), 3, true).await;

    let worker = outboxd::db::Database::from_config(worker.clone()).unwrap();
    let pool = outboxd::db::pool(&worker, 2).unwrap();
    let deliverers = outboxd::deliver::Deliverers {
        webhook: outboxd::deliver::webhook::WebhookSender::new(&test_webhook_config()).unwrap(),
        email: None,
    };
    let w = outboxd::worker::Worker::new(
        pool,
        test_worker_config("least"),
        deliverers,
        Some(worker.clone()),
    );
    let (tx, rxs) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(w.run(async {
        let _ = rxs.await;
    }));
    let c = db.client().await;
    wait_until(Duration::from_secs(10), "both messages finished", || {
        let c = &c;
        async move {
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM outbox.messages WHERE state IN ('delivered', 'dead')",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            n == 2
        }
    })
    .await;
    // The operator commands work with the same role.
    let mut wc = connect(worker.config()).await;
    let dead = outboxd::ops::dead_letters(&wc, &outboxd::ops::DeadFilter::default(), 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    let sel = outboxd::ops::ReplaySelection::Named(vec![outboxd::ops::Target::Id(dead[0].id)]);
    assert_eq!(
        outboxd::ops::replay(&mut wc, &sel, "ops", false)
            .await
            .unwrap()
            .len(),
        1
    );
    wait_for_count(&c, "delivered", 2, Duration::from_secs(10)).await;
    // Purging takes the history along, though the role may not delete history rows itself.
    c.batch_execute(
        "UPDATE outbox.messages SET delivered_at = now() - interval '3 days' WHERE message_key = 'w:1'",
    )
    .await
    .unwrap();
    let purged = outboxd::ops::purge(&wc, Duration::from_secs(86_400), true, 100, |_| {})
        .await
        .unwrap();
    assert_eq!(purged, 1);
    let orphans: i64 = db
        .scalar(
            "SELECT count(*) FROM outbox.attempts a \
             WHERE NOT EXISTS (SELECT 1 FROM outbox.messages m WHERE m.id = a.message_id)",
        )
        .await;
    assert_eq!(orphans, 0);
    assert!(
        wc.batch_execute("DELETE FROM outbox.attempts")
            .await
            .is_err(),
        "the worker role may not delete history directly"
    );
    outboxd::status::status(&wc).await.unwrap();
    // What /metrics reads (partial indexes, pg_class) is open to the worker role too.
    outboxd::status::bounded_counts(&wc, outboxd::status::COUNT_CAP)
        .await
        .unwrap();
    let _ = tx.send(());
    let summary = run.await.unwrap().unwrap();
    assert_eq!(summary.delivered, 2);
    // But no DDL.
    let err = wc
        .batch_execute("DROP TABLE outbox.attempts")
        .await
        .unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("42501"));
}
