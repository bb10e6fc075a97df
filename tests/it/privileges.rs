//! Least privilege: the roles of sql/grants.sql, exercised with real logins.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::receiver::Receiver;
use common::*;

/// Login roles made for one test (role names are cluster-wide, so each test gets its own),
/// dropped at the end even if the test fails.
pub(crate) struct Roles {
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
pub(crate) async fn setup(db: &TestDb) -> (Roles, tokio_postgres::Config, tokio_postgres::Config) {
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
    // A plain INSERT may not set the lease, nor any state but pending or held (since
    // the role may insert `state`, for held rows; the insert trigger refuses the rest).
    let err = c
        .batch_execute("INSERT INTO outbox.messages (message_key, channel, payload, lease_owner) VALUES ('x', 'webhook', '{\"url\": \"u\"}', 'w')")
        .await
        .unwrap_err();
    assert!(denied(&err), "{err}");
    for state in ["delivered", "dead", "running", "cancelled"] {
        let err = c
            .execute(
                "INSERT INTO outbox.messages (message_key, channel, payload, state) VALUES ('x', 'webhook', '{\"url\": \"u\"}', $1)",
                &[&state],
            )
            .await
            .unwrap_err();
        let db = err.as_db_error().expect("a database error");
        assert_eq!(db.code().code(), "22023", "{state}: {err}");
        assert_eq!(db.column(), Some("state"), "{state}: {err}");
    }
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
    let deliverers = outboxd::deliver::Deliverers::new(
        outboxd::deliver::webhook::WebhookSender::new(&test_webhook_config()).unwrap(),
        None,
    );
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

/// The application role enqueues held rows (every path) and looks up what became of a key,
/// in every state, without any right on the table; only the worker (operator) role
/// approves, cancels and confirms.
#[tokio::test]
async fn the_application_role_enqueues_held_rows_and_looks_keys_up() {
    use outboxd::{ErrorClass, State};
    let db = TestDb::new().await;
    let (_roles, app, worker) = setup(&db).await;
    let app_c = connect(&app).await;
    let url = serde_json::json!({"url": "https://example.com/h"});
    outboxd::enqueue(
        &app_c,
        &outboxd::NewMessage::webhook("l:held", url.clone()).held(true),
    )
    .await
    .unwrap();
    app_c
        .execute(
            "INSERT INTO outbox.messages (message_key, channel, payload, state) VALUES ('l:insert', 'webhook', $1, 'held')",
            &[&url],
        )
        .await
        .unwrap();
    app_c
        .query_one(
            "SELECT outbox.enqueue('l:sql', 'webhook', $1, held => true)",
            &[&url],
        )
        .await
        .unwrap();
    app_c
        .query(
            "SELECT * FROM outbox.enqueue_many(ARRAY['l:many'], ARRAY['webhook'], ARRAY[$1::jsonb], held => ARRAY[true])",
            &[&url],
        )
        .await
        .unwrap();
    for key in [
        "l:pending",
        "l:running",
        "l:delivered",
        "l:dead",
        "l:cancelled",
        "l:confirmed",
    ] {
        outboxd::enqueue(&app_c, &outboxd::NewMessage::webhook(key, url.clone()))
            .await
            .unwrap();
    }
    let held: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'held'")
        .await;
    assert_eq!(held, 4);

    // The operator's commands are not the application's.
    let id: i64 = db
        .scalar("SELECT id FROM outbox.messages WHERE message_key = 'l:held'")
        .await;
    for sql in [
        format!("SELECT * FROM outbox.approve(ARRAY[{id}::bigint])"),
        format!("SELECT * FROM outbox.cancel(ARRAY[{id}::bigint])"),
        format!("SELECT * FROM outbox.cancel(ARRAY[{id}::bigint], 'x', 'me')"),
        format!("SELECT * FROM outbox.confirm(ARRAY[{id}::bigint])"),
        format!("SELECT outbox.lock_named(ARRAY[{id}::bigint], 'x')"),
        "SELECT cancelled_at FROM outbox.messages".into(),
        "INSERT INTO outbox.messages (message_key, channel, payload, state, cancelled_at) VALUES ('x', 'webhook', '{\"url\": \"u\"}', 'held', now())".into(),
    ] {
        let err = app_c.batch_execute(&sql).await.expect_err(&sql);
        assert!(denied(&err), "{sql}: {err}");
    }

    // The operator role moves the rows into every state.
    let mut wc = connect(&worker).await;
    let c = db.client().await;
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'running', attempts = 1, lease_owner = 'w', \
         lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 hour' WHERE message_key = 'l:running'; \
         UPDATE outbox.messages SET state = 'delivered', attempts = 1, delivered_at = now(), \
         response = '{\"status\": 201, \"body\": {\"refund\": \"re_1\"}}' WHERE message_key = 'l:delivered'; \
         UPDATE outbox.messages SET state = 'dead', attempts = 3, dead_at = now(), error_class = 'exhausted', \
         last_error = 'HTTP 503 from example.com' WHERE message_key = 'l:dead'; \
         UPDATE outbox.messages SET state = 'dead', attempts = 1, dead_at = now(), error_class = 'ambiguous', \
         last_error = 'timed out' WHERE message_key = 'l:confirmed';",
    )
    .await
    .unwrap();
    for (action, key) in [
        (outboxd::ops::Checkpoint::Approve, "l:insert"),
        (
            outboxd::ops::Checkpoint::Cancel {
                reason: Some("no longer wanted".into()),
            },
            "l:cancelled",
        ),
        (outboxd::ops::Checkpoint::Confirm, "l:confirmed"),
    ] {
        let done = outboxd::ops::checkpoint(
            &mut wc,
            &action,
            &[outboxd::ops::Target::Key(key.into())],
            "ops",
        )
        .await
        .unwrap();
        assert_eq!(done.len(), 1, "{key}");
    }

    // lookup, from the application role: every state, typed; no payload anywhere.
    let expect = [
        ("l:held", State::Held, None),
        ("l:insert", State::Pending, None),
        ("l:pending", State::Pending, None),
        ("l:running", State::Running, None),
        ("l:delivered", State::Delivered, None),
        ("l:dead", State::Dead, Some(ErrorClass::Exhausted)),
        ("l:cancelled", State::Cancelled, None),
        ("l:confirmed", State::Delivered, None),
    ];
    for (key, state, class) in expect {
        let s = outboxd::lookup(&app_c, key)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{key} found"));
        assert_eq!(s.state, state, "{key}");
        assert_eq!(s.error_class, class, "{key}");
        assert_eq!(s.max_attempts, 3, "{key}");
        assert_eq!(s.delivered_at.is_some(), state == State::Delivered, "{key}");
        assert_eq!(s.dead_at.is_some(), state == State::Dead, "{key}");
        assert_eq!(s.cancelled_at.is_some(), state == State::Cancelled, "{key}");
        assert!(s.updated_at >= s.created_at, "{key}");
    }
    let d = outboxd::lookup(&app_c, "l:delivered")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(d.attempts, 1);
    assert_eq!(
        d.response,
        Some(serde_json::json!({"status": 201, "body": {"refund": "re_1"}}))
    );
    let dead = outboxd::lookup(&app_c, "l:dead").await.unwrap().unwrap();
    assert_eq!(
        dead.last_error.as_deref(),
        Some("HTTP 503 from example.com")
    );
    let confirmed = outboxd::lookup(&app_c, "l:confirmed")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        confirmed.response,
        Some(serde_json::json!({"confirmed": true}))
    );
    // An unknown key is no row; SQL says the same, and returns no payload column.
    assert!(outboxd::lookup(&app_c, "l:nope").await.unwrap().is_none());
    let rows = app_c
        .query("SELECT * FROM outbox.lookup('l:held')", &[])
        .await
        .unwrap();
    let cols: Vec<&str> = rows[0].columns().iter().map(|c| c.name()).collect();
    assert_eq!(
        cols,
        [
            "id",
            "state",
            "attempts",
            "max_attempts",
            "error_class",
            "last_error",
            "response",
            "created_at",
            "updated_at",
            "delivered_at",
            "dead_at",
            "cancelled_at",
            "key_expires_at"
        ]
    );
    // Keys no enqueue could store: a typed, one-line error.
    for key in [
        "",
        "a\u{1b}[31mb",
        "a\nb",
        "a\u{202e}b",
        "a\0b",
        &"k".repeat(256),
    ] {
        match outboxd::lookup(&app_c, key).await {
            Err(outboxd::LookupError::Invalid { message }) => {
                assert!(message.contains("message_key"), "{key:?}: {message}");
                assert!(
                    !message.contains('\n') && !message.contains('\u{1b}'),
                    "{message}"
                );
            }
            other => panic!("{key:?}: {other:?}"),
        }
    }
}

/// The application role enqueues with an ordering key on every path (the insert trigger's
/// group lock and id draw run with the role's rights, through `outbox.ordering_turn`), and
/// the worker role claims them one per group and reads `blocked_groups`.
#[tokio::test]
async fn the_application_role_enqueues_with_ordering_keys() {
    let db = TestDb::new().await;
    let (_roles, app, worker) = setup(&db).await;
    let app_c = connect(&app).await;
    let url = serde_json::json!({"url": "https://example.com/h"});
    outboxd::enqueue(
        &app_c,
        &outboxd::NewMessage::webhook("o:rust", url.clone()).ordering_key("g"),
    )
    .await
    .unwrap();
    app_c
        .execute(
            "INSERT INTO outbox.messages (message_key, channel, payload, ordering_key) VALUES ('o:insert', 'webhook', $1, 'g')",
            &[&url],
        )
        .await
        .unwrap();
    app_c
        .query_one(
            "SELECT outbox.enqueue('o:sql', 'webhook', $1, ordering_key => 'g')",
            &[&url],
        )
        .await
        .unwrap();
    app_c
        .query(
            "SELECT * FROM outbox.enqueue_many(ARRAY['o:many'], ARRAY['webhook'], ARRAY[$1::jsonb], ordering_key => ARRAY['g'])",
            &[&url],
        )
        .await
        .unwrap();
    let wc = connect(&worker).await;
    let st = outboxd::status::status(&wc).await.unwrap();
    assert_eq!(st.blocked_groups, 1);
    let got = outboxd::claim::claim(
        &wc,
        &[outboxd::model::Channel::Webhook],
        10,
        "least",
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let keys: Vec<&str> = got.iter().map(|m| m.key.as_str()).collect();
    assert_eq!(keys, ["o:rust"], "one of the group, the first enqueued");
}

/// The worker (operator) role pauses, resumes and closes destinations and reads what the
/// console shows of them; a pause from psql is recorded as the login that made it, not as
/// the functions' owner. The application role may do none of it.
#[tokio::test]
async fn the_worker_role_pauses_and_resumes_destinations_and_the_application_role_cannot() {
    let db = TestDb::new().await;
    let (_roles, app, worker) = setup(&db).await;
    enqueue_webhook(&db, "d:1", "https://api.example.com/hooks", 3, true).await;
    let wc = connect(&worker).await;
    let paused = outboxd::ops::pause_destination(&wc, "api.example.com", Some("incident"), "ops")
        .await
        .unwrap();
    assert_eq!((paused.changed, paused.messages), (true, 1));
    let listed = outboxd::ops::destinations(&wc).await.unwrap();
    assert_eq!(listed[0].state, "paused");
    assert_eq!(listed[0].paused_by.as_deref(), Some("ops"));
    assert_eq!(
        outboxd::ops::close_destination(&wc, "api.example.com", "ops")
            .await
            .unwrap(),
        Some(0)
    );
    let waiting = outboxd::ops::destinations_waiting(&wc, 10, None)
        .await
        .unwrap();
    assert_eq!(waiting[0].parked, 1);
    outboxd::ops::destination_outcomes(&wc, "api.example.com", 5)
        .await
        .unwrap();
    let actions = outboxd::ops::destination_actions(&wc, "api.example.com", 5)
        .await
        .unwrap();
    assert_eq!(actions.len(), 2, "paused, closed");
    let resumed = outboxd::ops::resume_destination(&wc, "api.example.com", "ops")
        .await
        .unwrap();
    assert_eq!((resumed.changed, resumed.messages), (true, 1));
    // From psql, with the actor left to its default: the caller's login.
    wc.batch_execute("SELECT * FROM outbox.pause_destination('b.example')")
        .await
        .unwrap();
    let by: String = wc
        .query_one(
            "SELECT paused_by FROM outbox.destinations WHERE host = 'b.example'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(by, worker.get_user().unwrap());

    let ac = connect(&app).await;
    for sql in [
        "SELECT * FROM outbox.pause_destination('c.example')",
        "SELECT * FROM outbox.resume_destination('b.example')",
        "UPDATE outbox.destinations SET paused_at = NULL",
        "SELECT * FROM outbox.destination_actions",
    ] {
        let e = ac.batch_execute(sql).await.unwrap_err();
        assert!(denied(&e), "{sql}: {e}");
    }
}

/// The worker (operator) role pauses and resumes channels and reads them and what was
/// done to them; a pause from psql is recorded as the login that made it. The application
/// role may do none of it.
#[tokio::test]
async fn the_worker_role_pauses_and_resumes_channels_and_the_application_role_cannot() {
    let db = TestDb::new().await;
    let (_roles, app, worker) = setup(&db).await;
    let wc = connect(&worker).await;
    let paused = outboxd::ops::pause_channel(&wc, "email", Some("relay down"), "ops")
        .await
        .unwrap();
    assert!(paused.changed);
    let listed = outboxd::ops::channels(&wc).await.unwrap();
    let email = listed.iter().find(|c| c.channel == "email").unwrap();
    assert_eq!(email.paused_by.as_deref(), Some("ops"));
    let st = outboxd::status::status(&wc).await.unwrap();
    assert_eq!(st.paused_channels, ["email"]);
    let resumed = outboxd::ops::resume_channel(&wc, "email", "ops")
        .await
        .unwrap();
    assert!(resumed.changed);
    wc.batch_execute("SELECT * FROM outbox.pause_channel('webhook')")
        .await
        .unwrap();
    let by: String = wc
        .query_one(
            "SELECT paused_by FROM outbox.paused_channels WHERE channel = 'webhook'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(by, worker.get_user().unwrap());
    let n: i64 = wc
        .query_one("SELECT count(*) FROM outbox.channel_actions", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 3);

    let ac = connect(&app).await;
    for sql in [
        "SELECT * FROM outbox.pause_channel('http')",
        "SELECT * FROM outbox.resume_channel('webhook')",
        "DELETE FROM outbox.paused_channels",
        "SELECT * FROM outbox.channel_actions",
    ] {
        let e = ac.batch_execute(sql).await.unwrap_err();
        assert!(denied(&e), "{sql}: {e}");
    }
    // And the worker role cannot write the tables past the functions.
    for sql in [
        "DELETE FROM outbox.paused_channels",
        "INSERT INTO outbox.channel_actions (channel, action, actor) VALUES ('email', 'paused', 'x')",
    ] {
        let e = wc.batch_execute(sql).await.unwrap_err();
        assert!(denied(&e), "{sql}: {e}");
    }
}
