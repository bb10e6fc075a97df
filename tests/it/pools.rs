//! The worker's connections (`worker::Pools`): the session settings each pool runs its
//! statements with, and the claim's generic plan, remade from the table as it is now.

use std::time::Duration;

use outboxd::model::Channel;
use outboxd::worker::Pools;

use crate::common::*;

/// `plan_cache_mode`, `synchronous_commit` and `jit` of one connection of `pool`.
async fn settings(pool: &deadpool_postgres::Pool) -> (String, String, String) {
    let c = pool.get().await.unwrap();
    let row = c
        .query_one(
            "SELECT current_setting('plan_cache_mode'), current_setting('synchronous_commit'), \
             current_setting('jit')",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Claims and completions run on generic plans; every pool commits durably (claims count an
/// attempt before it is sent, and a completion once seen must not be undone by a crash of
/// PostgreSQL); operators' and maintenance statements keep every default but JIT.
#[tokio::test]
async fn every_pool_commits_durably_and_only_claims_and_completions_use_generic_plans() {
    let db = TestDb::new().await;
    // The server's default, whatever the test cluster runs with (new connections read it).
    db.client()
        .await
        .batch_execute("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET synchronous_commit = on', current_database()); END $$")
        .await
        .unwrap();
    let pools = Pools::new(&db.database(), 2).unwrap();
    let s = |a: &str| (a.to_owned(), "on".to_owned(), "off".to_owned());
    assert_eq!(settings(&pools.hot).await, s("force_generic_plan"));
    assert_eq!(settings(&pools.general).await, s("auto"));
}

/// Claims commit durably even where the database's or role's settings say otherwise
/// (`off`, or `local` beside a synchronous standby): a claim undone by a crash or a
/// failover would put its row back with the attempt uncounted, to be sent again unmarked.
/// A stricter setting is kept, and the general pool follows the database.
#[tokio::test]
async fn claims_commit_durably_whatever_the_database_says() {
    let db = TestDb::new().await;
    for (set, hot) in [
        ("off", "on"),
        ("local", "on"),
        ("remote_apply", "remote_apply"),
    ] {
        db.client()
            .await
            .batch_execute(&format!(
                "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET synchronous_commit = {set}', current_database()); END $$"
            ))
            .await
            .unwrap();
        let pools = Pools::new(&db.database(), 2).unwrap();
        assert_eq!(settings(&pools.hot).await.1, hot, "database says {set}");
        assert_eq!(settings(&pools.general).await.1, set, "database says {set}");
    }
}

/// The plan that one connection of the hot pool holds for the prepared claim.
async fn claim_plan(client: &deadpool_postgres::Client) -> String {
    let name: String = client
        .query_one(
            "SELECT name FROM pg_prepared_statements \
             WHERE statement LIKE '%WITH due AS%' AND statement NOT LIKE '%pg_prepared%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    client
        .query(
            &format!(
                "EXPLAIN (COSTS OFF) EXECUTE {name}('{{webhook}}', 64, 'w', 30, \
                 '00000000-0000-4000-8000-000000000000')"
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A generic plan is made once, from the table as it was then: made on an empty table
/// (a new install, a worker started before the first enqueue) the claim reads the whole
/// table once it has grown. `Pools::refresh_plans` (which the claim loop calls every
/// `PLAN_REFRESH`) makes the next plan from the table as it is.
#[tokio::test]
async fn the_claims_generic_plan_is_remade_after_the_table_has_grown() {
    let db = TestDb::new().await;
    let pools = Pools::new(&db.database(), 1).unwrap();
    let claims = pools.hot.get().await.unwrap();
    let claim = |c| async move {
        outboxd::claim::claim_cached(c, &[Channel::Webhook], 64, "w", Duration::from_secs(30))
            .await
            .unwrap()
    };
    assert!(claim(&claims).await.is_empty());

    // The table grows by inserts alone (no ANALYZE): 50 000 delivered messages, 10 due.
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (message_key, channel, payload) \
           SELECT 'old:' || i, 'webhook', jsonb_build_object('url', 'https://example.com/', 'body', i) \
           FROM generate_series(1, 50000) i; \
         UPDATE outbox.messages SET state = 'delivered', delivered_at = now(); \
         INSERT INTO outbox.messages (message_key, channel, payload) \
           SELECT 'new:' || i, 'webhook', jsonb_build_object('url', 'https://example.com/', 'body', i) \
           FROM generate_series(1, 10) i;",
    )
    .await
    .unwrap();
    let stale = claim_plan(&claims).await;

    pools.refresh_plans();
    let batch = claim(&claims).await;
    assert_eq!(batch.len(), 10);
    let fresh = claim_plan(&claims).await;
    assert!(
        !fresh.contains("Seq Scan on messages"),
        "after the refresh the claim still reads the whole table:\n{fresh}\n(the plan made on the empty table:\n{stale})"
    );
    assert_ne!(stale, fresh, "the plan was not made again");
}

/// Whether `pool`'s connection still has `query` in its statement cache. The cache can only
/// be asked by taking the statement out, so a statement found is prepared into it again.
async fn still_cached(pool: &deadpool_postgres::Pool, query: &str) -> bool {
    let c = pool.get().await.unwrap();
    let cached = c.statement_cache.remove(query, &[]).is_some();
    if cached {
        c.prepare_cached(query).await.unwrap();
    }
    cached
}

/// An application that embeds the worker with a pool of its own keeps its prepared
/// statements: the worker throws away only the statements of the pool it made itself
/// (`Pools::new`), not every second the cache of a pool the application also uses. Both
/// kinds run side by side for three refresh periods; the worker's own pool is the control
/// that shows the window was long enough for a refresh.
#[tokio::test]
async fn an_applications_own_pool_keeps_its_prepared_statements() {
    let db = TestDb::new().await;
    // One connection each, so the statement prepared here is in the cache the worker uses.
    let app_pool = db.pool(1);
    let own = Pools::new(&db.database(), 1).unwrap();
    let own_hot = own.hot.clone();
    let app_query = "SELECT 42 AS the_applications_statement";
    let own_query = "SELECT 43 AS prepared_on_the_workers_own_pool";
    for (pool, query) in [(&app_pool, app_query), (&own_hot, own_query)] {
        pool.get()
            .await
            .unwrap()
            .prepare_cached(query)
            .await
            .unwrap();
        assert!(still_cached(pool, query).await);
    }

    let deliverers = || {
        outboxd::deliver::Deliverers::new(
            outboxd::deliver::webhook::WebhookSender::new(&test_webhook_config()).unwrap(),
            None,
        )
    };
    let window = outboxd::worker::PLAN_REFRESH * 3;
    let embedded = outboxd::worker::Worker::new(
        app_pool.clone(),
        test_worker_config("embedded"),
        deliverers(),
        None,
    );
    let standalone =
        outboxd::worker::Worker::new(own, test_worker_config("standalone"), deliverers(), None);
    let (a, b) = tokio::join!(
        embedded.run(tokio::time::sleep(window)),
        standalone.run(tokio::time::sleep(window))
    );
    a.unwrap();
    b.unwrap();

    assert!(
        !still_cached(&own_hot, own_query).await,
        "the worker's own pool kept its statements for {window:?}: no refresh ran, so this test shows nothing"
    );
    assert!(
        still_cached(&app_pool, app_query).await,
        "the worker emptied the statement cache of the application's pool"
    );
}

/// A worker whose general pool has one connection, which the test then takes and holds.
/// The worker has started (its first view of the breakers is read before it claims) once
/// a first message, to `url` with a budget of `budget`, has ended `end`; only then is the
/// connection taken.
async fn worker_with_its_general_pool_held(
    db: &TestDb,
    cfg: outboxd::config::WorkerConfig,
    url: &str,
    budget: i32,
    end: &str,
) -> (RunningWorker, deadpool_postgres::Object) {
    let pools = Pools::new(&db.database(), 1).unwrap();
    let general = pools.general.clone();
    let w = RunningWorker::start_on(db, pools, cfg, test_webhook_config(), None);
    enqueue_webhook(db, "first", url, budget, true).await;
    wait_for_state(db, "first", end, Duration::from_secs(10)).await;
    (w, general.get().await.unwrap())
}

/// The general pool can be busy for a while (a breaker's backlog pushed, retention, the
/// lease sweep, a scrape all use it). The claim loop must not wait for it: here its one
/// connection is held by someone else throughout, and due messages still go at once. (The
/// loop used to read the breakers' view inline every turn, and waited up to 30 s for a
/// connection each time.)
#[tokio::test]
async fn a_busy_general_pool_does_not_hold_the_deliveries_up() {
    use crate::common::receiver::Receiver;
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let (w, held) = worker_with_its_general_pool_held(
        &db,
        test_worker_config("w"),
        &rx.url("/h"),
        3,
        "delivered",
    )
    .await;
    for i in 0..5 {
        let key = format!("busy:{i}");
        enqueue_webhook(&db, &key, &rx.url("/h"), 3, true).await;
        wait_for_state(&db, &key, "delivered", Duration::from_secs(5)).await;
    }
    drop(held);
    w.stop().await;
}

/// Nor does a busy general pool hold up the recording of attempts. A failed attempt is
/// counted against its host's breaker through the general pool; while that waits, later
/// attempts, delivered meanwhile, must still be written as delivered. (The completer used
/// to count the breakers inline and recorded nothing more until it had: up to 30 s a
/// batch, long enough for a lease to expire and a delivered message to be sent again.)
#[tokio::test]
async fn a_busy_general_pool_does_not_hold_up_the_recording_of_deliveries() {
    use crate::common::receiver::{Receiver, Reply};
    let db = TestDb::new().await;
    let failing = Receiver::start().await;
    failing.set_default(Reply::Status(500));
    let rx = Receiver::start().await;
    let (w, held) = worker_with_its_general_pool_held(
        &db,
        test_worker_config("w"),
        &rx.url("/h"),
        3,
        "delivered",
    )
    .await;
    // Its failure is recorded (dead at once: a budget of one), then waits to be counted.
    enqueue_webhook(&db, "failing", &failing.url("/h"), 1, true).await;
    wait_for_state(&db, "failing", "dead", Duration::from_secs(10)).await;
    for i in 0..3 {
        let key = format!("after:{i}");
        enqueue_webhook(&db, &key, &rx.url("/h"), 3, true).await;
        wait_for_state(&db, &key, "delivered", Duration::from_secs(5)).await;
    }
    drop(held);
    w.stop().await;
}

/// A stop is not held up by a busy general pool either: the completer's breaker
/// counting, the lease sweep and the ordering watch give up on it at the stop. Here the
/// pool's only connection is held throughout and a failed delivery is being counted when
/// the worker is told to stop with a 1 s grace period.
#[tokio::test]
async fn a_busy_general_pool_does_not_hold_a_stop_up() {
    use crate::common::receiver::{Receiver, Reply};
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Status(500));
    let cfg = outboxd::config::WorkerConfig {
        shutdown_grace: Duration::from_secs(1),
        ..test_worker_config("w")
    };
    let (w, held) = worker_with_its_general_pool_held(&db, cfg, &rx.url("/h"), 1, "dead").await;
    enqueue_webhook(&db, "failing", &rx.url("/h"), 1, true).await;
    wait_for_state(&db, "failing", "dead", Duration::from_secs(10)).await;
    // Its failure is now being counted, waiting for the general pool.
    let t0 = std::time::Instant::now();
    w.stop().await;
    let took = t0.elapsed();
    drop(held);
    assert!(
        took < Duration::from_secs(15),
        "the stop took {took:?} (grace 1 s, then at most 5 s for the completer)"
    );
}
