//! Leases and fencing: concurrent workers, stale workers, dead workers, expired leases.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, SystemTime};

use common::receiver::{Receiver, Reply};
use common::*;
use outboxd::claim::{self, Completion};
use outboxd::model::AttemptOutcome;
use outboxd::model::Channel;
use outboxd::model::ErrorClass;
use outboxd::retry::RetryPolicy;
use outboxd::state::Transition;

const WEBHOOK: &[Channel] = &[Channel::Webhook];

/// One claim by `worker` of up to `n` webhooks, leased for `lease`.
async fn claim_n(
    c: &tokio_postgres::Client,
    n: usize,
    worker: &str,
    lease: Duration,
) -> Vec<claim::Claimed> {
    claim::claim(c, WEBHOOK, n, worker, lease).await.unwrap()
}

/// One lease sweep of up to `n` expired webhook leases, with no backoff.
async fn settle_n(c: &tokio_postgres::Client, n: usize) -> claim::Settled {
    claim::settle_expired(c, WEBHOOK, n, &NO_BACKOFF)
        .await
        .unwrap()
}

/// No wait before a message whose lease expired is due again: the claim after the sweep
/// that settles the expiry takes it over.
const NO_BACKOFF: RetryPolicy = RetryPolicy {
    base: Duration::ZERO,
    max: Duration::ZERO,
};

async fn enqueue_n(db: &TestDb, prefix: &str, url: &str, n: usize) {
    let c = db.client().await;
    let msgs: Vec<_> = (0..n)
        .map(|i| {
            outboxd::NewMessage::webhook(
                format!("{prefix}:{i}"),
                serde_json::json!({"url": url, "body": {"i": i}}),
            )
        })
        .collect();
    outboxd::enqueue_many(&c, &msgs).await.unwrap();
}

fn completion(c: &claim::Claimed, transition: Transition) -> Completion {
    Completion {
        id: c.id,
        lease_token: c.lease_token,
        attempt: c.attempt,
        transition,
        error: transition.error_class().map(|_| "test failure".to_owned()),
        status: Some(200),
        deduplicated: false,
        response: None,
        started_at: SystemTime::now(),
    }
}

#[tokio::test]
async fn concurrent_claims_never_return_one_row_twice() {
    let db = TestDb::new().await;
    enqueue_n(&db, "c", "https://example.com/h", 100).await;
    let (a, b) = (db.client().await, db.client().await);
    let (ra, rb) = tokio::join!(
        claim::claim(&a, WEBHOOK, 60, "wa", Duration::from_secs(60)),
        claim::claim(&b, WEBHOOK, 60, "wb", Duration::from_secs(60)),
    );
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    let mut seen = HashMap::new();
    for c in ra.iter().chain(rb.iter()) {
        assert!(
            seen.insert(c.id, ()).is_none(),
            "message {} claimed twice",
            c.id
        );
        assert_eq!(c.attempt, 1);
    }
    assert_eq!(
        seen.len(),
        100,
        "between them the two claims took every row"
    );
    let running: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'running'")
        .await;
    assert_eq!(running, 100);
}

#[tokio::test]
async fn two_workers_deliver_every_message_exactly_once() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_n(&db, "two", &rx.url("/h"), 300).await;
    let cfg = |id: &str| outboxd::config::WorkerConfig {
        concurrency: 8,
        batch_size: 10,
        ..test_worker_config(id)
    };
    let w1 = RunningWorker::start(&db, cfg("w1"), test_webhook_config());
    let w2 = RunningWorker::start(&db, cfg("w2"), test_webhook_config());
    let c = db.client().await;
    wait_for_count(&c, "delivered", 300, Duration::from_secs(30)).await;
    let (s1, s2) = (w1.stop().await, w2.stop().await);
    assert_eq!(s1.delivered + s2.delivered, 300);
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for r in rx.requests() {
        *per_key
            .entry(r.header("idempotency-key").unwrap())
            .or_default() += 1;
    }
    assert_eq!(per_key.len(), 300);
    assert!(per_key.values().all(|&n| n == 1), "some key was sent twice");
    let attempt_rows: i64 = db.scalar("SELECT count(*) FROM outbox.attempts").await;
    assert_eq!(attempt_rows, 300);
}

#[tokio::test]
async fn a_stale_worker_changes_nothing() {
    let db = TestDb::new().await;
    enqueue_webhook(&db, "stale:1", "https://example.com/h", 3, true).await;
    let c = db.client().await;
    // The stale worker claims with a short lease, then stalls past it.
    let old = claim_n(&c, 1, "w-stale", Duration::from_millis(300)).await;
    assert_eq!(old.len(), 1);
    wait_for_leases_to_expire(&db).await;
    // A claim leaves the expired lease alone; another worker's sweep settles it (back to
    // pending, due at once with no backoff), and its next claim takes the row over and
    // delivers.
    assert!(
        claim_n(&c, 1, "w-new", Duration::from_secs(60))
            .await
            .is_empty()
    );
    assert_eq!(row_state(&db, "stale:1").await, "running");
    let settled = settle_n(&c, 10).await;
    assert_eq!((settled.gave_up.len(), settled.deferred.len()), (0, 1));
    let new = claim_n(&c, 1, "w-new", Duration::from_secs(60)).await;
    assert_eq!(new.len(), 1);
    assert_eq!(new[0].attempt, 2);
    assert_ne!(new[0].lease_token, old[0].lease_token);
    let outcomes = claim::complete(&c, "w-new", &[completion(&new[0], Transition::Delivered)])
        .await
        .unwrap();
    assert_eq!(outcomes, vec![(new[0].id, AttemptOutcome::Delivered)]);
    // The stale worker wakes up and reports a permanent failure: nothing changes.
    let dead = Transition::Dead {
        class: ErrorClass::Permanent,
    };
    let outcomes = claim::complete(&c, "w-stale", &[completion(&old[0], dead)])
        .await
        .unwrap();
    assert_eq!(outcomes, vec![(old[0].id, AttemptOutcome::LeaseLost)]);
    let row = row(&db, "stale:1").await;
    assert_eq!(row.state, "delivered");
    assert_eq!(row.error_class, None);
    let history = attempts(&db, "stale:1").await;
    let outcomes: Vec<&str> = history.iter().map(|h| h.1.as_str()).collect();
    assert_eq!(outcomes, ["lease_lost", "delivered", "lease_lost"]);
    // A stale release is fenced too.
    assert!(
        claim::release(&c, "w-stale", &[(old[0].id, old[0].lease_token)])
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(row_state(&db, "stale:1").await, "delivered");
}

async fn row_state(db: &TestDb, key: &str) -> String {
    row(db, key).await.state
}

#[tokio::test]
async fn a_batch_of_completions_is_fenced_row_by_row() {
    let db = TestDb::new().await;
    enqueue_n(&db, "mix", "https://example.com/h", 2).await;
    let c = db.client().await;
    let claimed = claim_n(&c, 2, "w", Duration::from_secs(60)).await;
    let mut forged = completion(&claimed[1], Transition::Delivered);
    forged.lease_token = uuid::Uuid::from_u128(rand::random());
    let outcomes = claim::complete(
        &c,
        "w",
        &[completion(&claimed[0], Transition::Delivered), forged],
    )
    .await
    .unwrap();
    assert_eq!(outcomes.len(), 2);
    assert!(outcomes.contains(&(claimed[0].id, AttemptOutcome::Delivered)));
    assert!(outcomes.contains(&(claimed[1].id, AttemptOutcome::LeaseLost)));
    let states: Vec<String> =
        first_column(&c, "SELECT state FROM outbox.messages ORDER BY id").await;
    assert_eq!(states, ["delivered", "running"]);
}

/// The SQL writes exactly what `decide` says, for every kind of transition.
#[tokio::test]
async fn completion_sql_agrees_with_the_state_machine() {
    let db = TestDb::new().await;
    let transitions = [
        Transition::Delivered,
        Transition::Retry {
            class: ErrorClass::Transient,
            delay: Duration::from_secs(30),
        },
        Transition::Retry {
            class: ErrorClass::Ambiguous,
            delay: Duration::from_secs(30),
        },
        Transition::Dead {
            class: ErrorClass::Permanent,
        },
        Transition::Dead {
            class: ErrorClass::Invalid,
        },
        Transition::Dead {
            class: ErrorClass::Exhausted,
        },
        Transition::Dead {
            class: ErrorClass::Ambiguous,
        },
    ];
    enqueue_n(&db, "sm", "https://example.com/h", transitions.len()).await;
    let c = db.client().await;
    let mut claimed = claim_n(&c, transitions.len(), "w", Duration::from_secs(60)).await;
    claimed.sort_by_key(|m| m.id);
    let batch: Vec<Completion> = claimed
        .iter()
        .zip(transitions)
        .map(|(m, t)| completion(m, t))
        .collect();
    claim::complete(&c, "w", &batch).await.unwrap();
    for (m, t) in claimed.iter().zip(transitions) {
        let r = c
            .query_one(
                "SELECT state, error_class, run_after > now() + interval '20 seconds', \
                 delivered_at IS NOT NULL, dead_at IS NOT NULL, lease_token IS NULL FROM outbox.messages WHERE id = $1",
                &[&m.id],
            )
            .await
            .unwrap();
        let state: String = r.get(0);
        let class: Option<String> = r.get(1);
        assert_eq!(state, t.next_state().as_str(), "{t:?}");
        assert_eq!(
            class.as_deref(),
            t.error_class().map(|c| c.as_str()),
            "{t:?}"
        );
        assert_eq!(
            r.get::<_, bool>(2),
            matches!(t, Transition::Retry { .. }),
            "retry delay applied for {t:?}"
        );
        assert_eq!(r.get::<_, bool>(3), t == Transition::Delivered);
        assert_eq!(r.get::<_, bool>(4), matches!(t, Transition::Dead { .. }));
        assert!(r.get::<_, bool>(5), "lease cleared");
        let outcome: String = c
            .query_one(
                "SELECT outcome FROM outbox.attempts WHERE message_id = $1",
                &[&m.id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(outcome, t.outcome().as_str());
    }
}

/// Claims with a short lease and lets it expire, as a worker that died would.
async fn claim_and_abandon(db: &TestDb, n: usize) {
    let c = db.client().await;
    let got = claim_n(&c, n, "w-dead", Duration::from_millis(200)).await;
    assert_eq!(got.len(), n);
    wait_for_leases_to_expire(db).await;
}

#[tokio::test]
async fn an_expired_lease_on_the_last_attempt_dead_letters_as_ambiguous() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_webhook(&db, "last:1", &rx.url("/h"), 1, true).await;
    enqueue_webhook(&db, "noretry:1", &rx.url("/h"), 3, false).await;
    claim_and_abandon(&db, 2).await;
    let w = RunningWorker::start(&db, test_worker_config("w2"), test_webhook_config());
    let last = wait_for_state(&db, "last:1", "dead", Duration::from_secs(10)).await;
    let noretry = wait_for_state(&db, "noretry:1", "dead", Duration::from_secs(10)).await;
    let summary = w.stop().await;
    assert_eq!(summary.dead, 2);
    for r in [&last, &noretry] {
        assert_eq!(r.error_class.as_deref(), Some("ambiguous"));
        assert!(
            r.last_error
                .as_deref()
                .unwrap_or("")
                .contains("lease expired")
        );
        assert_eq!(r.attempts, 1, "no further attempt was started");
    }
    assert!(rx.requests().is_empty(), "nothing was sent again");
    let h = attempts(&db, "last:1").await;
    assert_eq!(
        h,
        vec![(
            1,
            "dead".to_owned(),
            Some("ambiguous".to_owned()),
            None,
            false
        )]
    );
}

/// A dead worker's many expired leases are settled by another worker's lease sweep in
/// full batches one after another, not one batch per poll interval, and each batch wakes
/// the claim loop: with a 30 s poll interval, 300 rows in batches of 40 are all delivered
/// again long before the second interval. (A sweep that waited an interval between full
/// batches would take four minutes; one that did not wake the loop would leave the rows
/// pending until the next poll.)
#[tokio::test]
async fn a_sweep_settles_a_dead_workers_leases_in_full_batches_at_once() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_n(&db, "swept", &rx.url("/h"), 300).await;
    claim_and_abandon(&db, 300).await;
    let cfg = outboxd::config::WorkerConfig {
        poll_interval: Duration::from_secs(30),
        batch_size: 40,
        ..test_worker_config("sweeper")
    };
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    let c = db.client().await;
    wait_for_count(&c, "delivered", 300, Duration::from_secs(20)).await;
    w.stop().await;
    let lost: i64 = db
        .scalar("SELECT count(*) FROM outbox.attempts WHERE outcome = 'lease_lost' AND worker = 'w-dead' AND error_class = 'ambiguous'")
        .await;
    assert_eq!(
        lost, 300,
        "each expired lease is one ambiguous attempt in the history"
    );
    assert_eq!(rx.requests().len(), 300, "each sent once, by the sweeper");
}

#[tokio::test]
async fn a_killed_worker_process_loses_its_lease_and_another_finishes() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    // The first requests stall: the worker process is mid-send when it is killed.
    rx.script((0..5).map(|_| Reply::Stall(Duration::from_secs(60))));
    enqueue_n(&db, "kill", &rx.url("/h"), 5).await;
    // The timeout leaves this test 5 s between the fifth request and the kill (a loaded
    // machine may take more than a second); the lease is the shortest start-up allows.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "run",
            "--worker-id",
            "doomed",
            "--lease",
            "8s",
            "--webhook-timeout",
            "5s",
            "--poll-interval",
            "100ms",
        ])
        .env_clear()
        .env("DATABASE_URL", db.url())
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    rx.wait_for(5, Duration::from_secs(15)).await;
    child.kill().unwrap(); // SIGKILL: no shutdown, no release
    child.wait().unwrap();
    let running: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'running'")
        .await;
    assert_eq!(running, 5, "the killed worker left its rows running");

    let w = RunningWorker::start(&db, test_worker_config("rescuer"), test_webhook_config());
    let c = db.client().await;
    wait_for_count(&c, "delivered", 5, Duration::from_secs(20)).await;
    w.stop().await;
    for i in 0..5 {
        let key = format!("kill:{i}");
        let h = attempts(&db, &key).await;
        assert_eq!(h.len(), 2, "{key}: {h:?}");
        assert_eq!(
            (h[0].0, h[0].1.as_str(), h[0].2.as_deref()),
            (1, "lease_lost", Some("ambiguous"))
        );
        assert_eq!((h[1].0, h[1].1.as_str()), (2, "delivered"));
        // Sent twice, with the same key both times: the receiver can deduplicate.
        assert_eq!(rx.requests_for(&key).len(), 2);
    }
    let workers: Vec<String> =
        first_column(&c, "SELECT DISTINCT worker FROM outbox.attempts ORDER BY 1").await;
    assert_eq!(workers, ["doomed", "rescuer"]);
}

#[tokio::test]
async fn drain_waits_for_scheduled_retries_then_exits() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(503), Reply::Status(503)]);
    enqueue_webhook(&db, "drain:1", &rx.url("/h"), 3, true).await;
    enqueue_webhook(&db, "drain:2", &rx.url("/h"), 3, true).await;
    let cfg = outboxd::config::WorkerConfig {
        drain: true,
        ..test_worker_config("drainer")
    };
    let summary = RunningWorker::start(&db, cfg, test_webhook_config())
        .drained(Duration::from_secs(20))
        .await;
    assert_eq!(summary.delivered, 2);
    assert_eq!(summary.retried, 2);
    let left: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state <> 'delivered'")
        .await;
    assert_eq!(left, 0);
}

#[tokio::test]
async fn release_gives_back_unstarted_rows_without_counting_the_attempt() {
    let db = TestDb::new().await;
    enqueue_n(&db, "rel", "https://example.com/h", 3).await;
    let c = db.client().await;
    let claimed = claim_n(&c, 3, "w", Duration::from_secs(60)).await;
    let rows: Vec<_> = claimed.iter().map(|m| (m.id, m.lease_token)).collect();
    let mut released = claim::release(&c, "w", &rows).await.unwrap();
    released.sort();
    let mut ids: Vec<i64> = claimed.iter().map(|m| m.id).collect();
    ids.sort();
    assert_eq!(released, ids);
    let r = row(&db, "rel:0").await;
    assert_eq!((r.state.as_str(), r.attempts), ("pending", 0));
    assert_eq!(
        attempts(&db, "rel:0").await,
        vec![(1, "released".to_owned(), None, None, false)]
    );
    // Claimed again, it is attempt 1 again.
    let again = claim_n(&c, 3, "w", Duration::from_secs(60)).await;
    assert!(again.iter().all(|m| m.attempt == 1));
}

/// A deferral (`state::Deferral`: an open breaker, a rate limit) is `pending` again after
/// its delay, keeps its attempt budget, key and bytes, writes no history row, and is fenced
/// like every other write: a stale worker's deferral changes nothing.
#[tokio::test]
async fn deferral_sql_agrees_with_the_state_machine() {
    use outboxd::state::{DeferReason, Deferral};
    let db = TestDb::new().await;
    enqueue_n(&db, "def", "https://example.com/h", 2).await;
    let c = db.client().await;
    let before: serde_json::Value = c
        .query_one(
            "SELECT payload FROM outbox.messages WHERE message_key = 'def:0'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let mut claimed = claim_n(&c, 2, "w", Duration::from_secs(60)).await;
    claimed.sort_by_key(|m| m.id);
    assert!(claimed.iter().all(|m| m.attempt == 1));
    for reason in DeferReason::ALL {
        let d = Deferral {
            reason,
            delay: Duration::from_secs(30),
        };
        assert_eq!(d.next_state().as_str(), "pending");
    }
    // The second row's token is stale: its deferral must not touch it.
    let rows = vec![
        (
            claimed[0].id,
            claimed[0].lease_token,
            Duration::from_secs(30),
            false,
        ),
        (
            claimed[1].id,
            uuid::Uuid::nil(),
            Duration::from_secs(30),
            false,
        ),
    ];
    let deferred = claim::defer(&c, &rows).await.unwrap();
    assert_eq!(deferred, vec![claimed[0].id]);
    let r = c
        .query_one(
            "SELECT state, attempts, run_after > now() + interval '20 seconds', \
             lease_token IS NULL, lease_owner IS NULL, payload, message_key, error_class \
             FROM outbox.messages WHERE id = $1",
            &[&claimed[0].id],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "pending");
    assert_eq!(r.get::<_, i32>(1), 0, "the attempt is not counted");
    assert!(r.get::<_, bool>(2), "due only after the delay");
    assert!(r.get::<_, bool>(3) && r.get::<_, bool>(4), "lease cleared");
    assert_eq!(r.get::<_, serde_json::Value>(5), before, "same bytes");
    assert_eq!(r.get::<_, String>(6), "def:0", "same key");
    assert_eq!(r.get::<_, Option<String>>(7), None);
    assert_eq!(
        row(&db, "def:1").await.state,
        "running",
        "stale token: untouched"
    );
    let history: i64 = c
        .query_one("SELECT count(*) FROM outbox.attempts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(history, 0, "no history row per deferral");
    // Due again (moved forward here instead of waiting), it is attempt 1 again.
    c.execute(
        "UPDATE outbox.messages SET run_after = now() WHERE message_key = 'def:0'",
        &[],
    )
    .await
    .unwrap();
    let again = claim_n(&c, 2, "w", Duration::from_secs(60)).await;
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].id, again[0].attempt), (claimed[0].id, 1));
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_attempt_finish() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Stall(Duration::from_millis(800))]);
    enqueue_webhook(&db, "grace:1", &rx.url("/h"), 3, true).await;
    let w = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    rx.wait_for(1, Duration::from_secs(10)).await;
    // Stop while the request is in flight: the worker waits for it within the grace period.
    let summary = w.stop().await;
    assert_eq!(summary.delivered, 1);
    assert_eq!(row_state(&db, "grace:1").await, "delivered");
}

/// A stop under a backlog leaves no row leased. Up to two claims are in flight then, and
/// each may have committed: the loop waits for them and gives their rows back, unsent and
/// uncounted, as it does the rows claimed ahead that never got a slot. (Dropped, their
/// rows kept their leases and would later be settled as ambiguous attempts never made.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_under_a_backlog_leaves_no_row_leased() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_n(&db, "stop", &rx.url("/h"), 4000).await;
    let cfg = outboxd::config::WorkerConfig {
        concurrency: 8,
        batch_size: 16,
        ..test_worker_config("w")
    };
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    rx.wait_for(300, Duration::from_secs(20)).await;
    let summary = w.stop().await;
    let c = db.client().await;
    let running: Vec<i64> = first_column(
        &c,
        "SELECT count(*) FROM outbox.messages WHERE state = 'running'",
    )
    .await;
    assert_eq!(running, [0], "rows left leased by a stopped worker");
    // Every attempt counted was made: one request each, nothing else.
    let counted: Vec<i64> =
        first_column(&c, "SELECT sum(attempts)::bigint FROM outbox.messages").await;
    assert_eq!(counted, [rx.requests().len() as i64]);
    assert_eq!(summary.delivered, rx.requests().len() as u64);
}

/// Rows claimed ahead of the slots follow how fast the slots turn over. A row leased ahead
/// is counted and waits; if the worker is killed it is settled as an ambiguous attempt
/// that was never made (dead-lettered, for a message that allows no ambiguous retry). With
/// a receiver that takes 300 ms, 4 slots start a row every 75 ms, so a claim's round trip
/// needs a row or two ahead, not the two batches per claim a fast drain wants (16 here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_keeps_few_rows_leased_ahead() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Stall(Duration::from_millis(300)));
    enqueue_n(&db, "slow", &rx.url("/h"), 80).await;
    let cfg = outboxd::config::WorkerConfig {
        concurrency: 4,
        batch_size: 8,
        ..test_worker_config("w")
    };
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    // The worker has seen how long its slots are held.
    rx.wait_for(12, Duration::from_secs(20)).await;
    let c = db.client().await;
    let mut most = 0;
    for _ in 0..20 {
        let running: Vec<i64> = first_column(
            &c,
            "SELECT count(*) FROM outbox.messages WHERE state = 'running'",
        )
        .await;
        most = most.max(running[0]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.stop().await;
    // 4 in flight, a row or two ahead (a few more if claims are slow), a claim's rows on
    // their way, and delivered rows still `running` until the completer records them: never
    // the 20 that 4 slots and 16 places ahead allow.
    assert!(
        (4..=12).contains(&most),
        "at most {most} rows leased at once"
    );
}

/// A lease that ran out long enough ago that its backoff has passed too (a worker that died
/// a while back) is due the moment the sweep settles it: the sweep wakes the idle claim
/// loop, and the row is sent then, not at the loop's next poll. The loop's wait is kept out
/// of step with the sweep's: a message enqueued as the lease runs out wakes the loop
/// (notification, then completion), so its next poll comes about two seconds after the
/// sweep that settles the lease. Without the wake-up the row waits for that poll.
#[tokio::test]
async fn a_sweep_wakes_the_idle_loop_for_a_row_due_at_once() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_webhook(&db, "late:1", &rx.url("/h"), 3, true).await;
    let c = db.client().await;
    // A dead worker's lease, running out between the new worker's first sweep and its second.
    c.execute(
        "UPDATE outbox.messages SET state = 'running', attempts = 1, lease_owner = 'gone',
                lease_token = gen_random_uuid(), lease_expires_at = now() + interval '2 seconds'
         WHERE message_key = 'late:1'",
        &[],
    )
    .await
    .unwrap();
    let cfg = outboxd::config::WorkerConfig {
        poll_interval: Duration::from_secs(4),
        ..test_worker_config("w")
    };
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    wait_for_idle_marks(&db, 1, "the worker to LISTEN, idle").await;
    wait_until(Duration::from_secs(5), "the lease to run out", || async {
        let live: i64 = db
            .scalar("SELECT count(*) FROM outbox.messages WHERE lease_expires_at > now()")
            .await;
        live == 0
    })
    .await;
    enqueue_webhook(&db, "nudge:1", &rx.url("/h"), 3, true).await;
    wait_for_state(&db, "nudge:1", "delivered", Duration::from_secs(5)).await;
    wait_for_state(&db, "late:1", "delivered", Duration::from_secs(15)).await;
    w.stop().await;
    let waited: f64 = db
        .scalar(
            "SELECT extract(epoch FROM m.delivered_at - a.finished_at)::float8
             FROM outbox.messages m JOIN outbox.attempts a ON a.message_id = m.id
             WHERE m.message_key = 'late:1' AND a.outcome = 'lease_lost'",
        )
        .await;
    assert!(
        waited < 1.0,
        "sent {waited:.2} s after the sweep settled it (the loop's next poll, not a wake-up)"
    );
}

#[tokio::test]
async fn a_notification_wakes_an_idle_worker() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    // Poll once an hour: only LISTEN/NOTIFY can deliver the message in time.
    let cfg = outboxd::config::WorkerConfig {
        poll_interval: Duration::from_secs(3600),
        ..test_worker_config("w")
    };
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    // Listening, and idle: its LISTEN connection holds the idle mark, so commits notify.
    wait_for_idle_marks(&db, 1, "the worker to LISTEN, idle").await;
    enqueue_webhook(&db, "wake:1", &rx.url("/h"), 3, true).await;
    wait_for_state(&db, "wake:1", "delivered", Duration::from_secs(10)).await;
    w.stop().await;
}

async fn enqueue_due_ago(db: &TestDb, key: &str, ago: Duration) {
    let c = db.client().await;
    let msg =
        outboxd::NewMessage::webhook(key, serde_json::json!({"url": "https://example.com/h"}))
            .run_after(SystemTime::now() - ago);
    outboxd::enqueue(&c, &msg).await.unwrap();
}

/// The contract's claim order, `run_after, id`, holds across pending rows and expired leases:
/// a row whose lease expired is settled by the lease sweep, due again at the expiry plus the
/// backoff (none here), and then claimed in its place in that order.
#[tokio::test]
async fn claims_take_expired_leases_and_due_rows_in_run_after_order() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue_due_ago(&db, "order:expired", Duration::from_secs(3600)).await;
    let first = claim_n(&c, 1, "w-dead", Duration::from_millis(200)).await;
    assert_eq!(first[0].key, "order:expired");
    enqueue_due_ago(&db, "order:older", Duration::from_secs(7200)).await;
    wait_for_leases_to_expire(&db).await;
    let settled = settle_n(&c, 10).await;
    assert_eq!(settled.deferred[0].key, "order:expired");
    let next = claim_n(&c, 1, "w2", Duration::from_secs(60)).await;
    assert_eq!(
        next[0].key, "order:older",
        "the pending row due earlier comes first"
    );
    let then = claim_n(&c, 1, "w2", Duration::from_secs(60)).await;
    assert_eq!(
        (then[0].key.as_str(), then[0].attempt),
        ("order:expired", 2)
    );
    // Only the expired row that was taken over has a lease_lost record.
    assert_eq!(attempts(&db, "order:older").await.len(), 0);
    assert_eq!(attempts(&db, "order:expired").await.len(), 1);
}

/// A lease that ran out a second ago, settled with a 5 s backoff: the row is due 4–5 s after
/// the expiry (the jitter takes up to a fifth off), the sweep says when (`retry_in`, which the
/// worker's alarm follows), and a claim before then takes nothing.
#[tokio::test]
async fn a_settled_lease_says_when_it_is_due_and_is_not_claimed_before() {
    let db = TestDb::new().await;
    enqueue_webhook(&db, "later:1", "https://example.com/h", 3, true).await;
    let c = db.client().await;
    c.execute(
        "UPDATE outbox.messages SET state = 'running', attempts = 1, lease_owner = 'gone',
                lease_token = gen_random_uuid(), lease_expires_at = now() - interval '1 second'
         WHERE message_key = 'later:1'",
        &[],
    )
    .await
    .unwrap();
    let policy = RetryPolicy {
        base: Duration::from_secs(5),
        max: Duration::from_secs(900),
    };
    let settled = claim::settle_expired(&c, WEBHOOK, 10, &policy)
        .await
        .unwrap();
    assert_eq!((settled.gave_up.len(), settled.deferred.len()), (0, 1));
    let retry_in = settled.deferred[0].retry_in.as_secs_f64();
    assert!((2.9..=4.1).contains(&retry_in), "due in {retry_in} s");
    let due_in: f64 = db
        .scalar("SELECT extract(epoch FROM run_after - now())::float8 FROM outbox.messages WHERE message_key = 'later:1'")
        .await;
    assert!(
        (due_in - retry_in).abs() < 0.5,
        "{due_in} against {retry_in}"
    );
    assert!(
        claim_n(&c, 10, "w", Duration::from_secs(60))
            .await
            .is_empty()
    );
    assert_eq!(row_state(&db, "later:1").await, "pending");
}

/// One batch carrying a stale and a current completion of the same message (a worker that
/// took over its own expired lease) records the stale one as lease_lost.
#[tokio::test]
async fn a_stale_and_a_current_completion_in_one_batch() {
    let db = TestDb::new().await;
    enqueue_webhook(&db, "twice:1", "https://example.com/h", 3, true).await;
    let c = db.client().await;
    let old = claim_n(&c, 1, "w", Duration::from_millis(200)).await;
    wait_for_leases_to_expire(&db).await;
    // The sweep settles the expired lease; the claim takes the row over.
    let settled = settle_n(&c, 10).await;
    assert_eq!(settled.deferred.len(), 1);
    let new = claim_n(&c, 1, "w", Duration::from_secs(60)).await;
    let batch = [
        completion(
            &old[0],
            Transition::Dead {
                class: ErrorClass::Permanent,
            },
        ),
        completion(&new[0], Transition::Delivered),
    ];
    claim::complete(&c, "w", &batch).await.unwrap();
    assert_eq!(row(&db, "twice:1").await.state, "delivered");
    let h: Vec<(i32, String)> = attempts(&db, "twice:1")
        .await
        .into_iter()
        .map(|a| (a.0, a.1))
        .collect();
    assert!(h.contains(&(1, "lease_lost".to_owned())), "{h:?}");
    assert!(h.contains(&(2, "delivered".to_owned())), "{h:?}");
    assert!(
        !h.iter().any(|a| a.1 == "dead"),
        "the stale result was not recorded as dead: {h:?}"
    );
}

/// An attempt starts only while its whole timeout, and a margin, still fit in the lease.
/// Here the second row, claimed ahead of the only slot, waits 3.5 s; the old rule (start
/// anything claimed less than half a lease ago) sent it with 4.5 s of an 8 s lease left and
/// a 4.8 s response to come: the lease ran out mid-request, the row was claimed and sent
/// again, and the first success was recorded `lease_lost`. Now it is given back unsent and
/// sent once, under a fresh lease. (A first, quick delivery comes before: nothing is
/// claimed ahead until the worker has seen how long its slots are held.)
#[tokio::test]
async fn a_row_that_waited_too_long_for_a_slot_is_released_not_sent_twice() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([
        Reply::Status(200),
        Reply::Stall(Duration::from_millis(3500)),
        Reply::Stall(Duration::from_millis(4800)),
    ]);
    let cfg = outboxd::config::WorkerConfig {
        concurrency: 1,
        batch_size: 2,
        lease: Duration::from_secs(8),
        ..test_worker_config("fit")
    };
    let webhook = outboxd::deliver::webhook::settings::WebhookConfig {
        timeout: Duration::from_secs(5),
        ..test_webhook_config()
    };
    // A pairing that start-up accepts.
    cfg.validate(webhook.timeout)
        .expect("lease 8s, timeout 5s is allowed");
    let w = RunningWorker::start(&db, cfg, webhook);
    enqueue_webhook(&db, "fit:0", &rx.url("/h"), 3, true).await;
    wait_for_state(&db, "fit:0", "delivered", Duration::from_secs(10)).await;
    enqueue_webhook(&db, "fit:1", &rx.url("/h"), 3, true).await;
    enqueue_webhook(&db, "fit:2", &rx.url("/h"), 3, true).await;
    for key in ["fit:1", "fit:2"] {
        wait_for_state(&db, key, "delivered", Duration::from_secs(40)).await;
    }
    let summary = w.stop().await;
    for key in ["fit:0", "fit:1", "fit:2"] {
        assert_eq!(rx.requests_for(key).len(), 1, "{key} was sent once");
    }
    assert_eq!(summary.lease_lost, 0, "{summary:?}");
    assert_eq!(summary.delivered, 3, "{summary:?}");
    let mut outcomes: Vec<String> = Vec::new();
    for key in ["fit:1", "fit:2"] {
        outcomes.extend(attempts(&db, key).await.into_iter().map(|a| a.1));
    }
    outcomes.sort();
    assert_eq!(outcomes, ["delivered", "delivered", "released"]);
}

/// A worker built by hand with a lease no attempt fits in refuses to run, instead of
/// claiming and releasing the same rows for ever.
#[tokio::test]
async fn a_worker_whose_lease_fits_no_attempt_refuses_to_run() {
    let db = TestDb::new().await;
    let cfg = outboxd::config::WorkerConfig {
        lease: Duration::from_secs(3),
        ..test_worker_config("short")
    };
    let deliverers = outboxd::deliver::Deliverers::new(
        outboxd::deliver::webhook::WebhookSender::new(&test_webhook_config()).unwrap(),
        None,
    );
    let worker = outboxd::worker::Worker::new(db.pool(2), cfg, deliverers, None);
    let err = worker.run(std::future::pending()).await.unwrap_err();
    assert!(
        matches!(
            err,
            outboxd::worker::WorkerError::LeaseTooShort {
                channel: Channel::Webhook,
                ..
            }
        ),
        "{err}"
    );
}

/// The lease sweep settles each expired lease as `decide` settles an ambiguous failure (it
/// asks `decide`): dead-lettered, or `pending` and due at the lease's expiry plus the delay
/// `decide` gives, for each kind of expired row.
#[tokio::test]
async fn the_lease_sweep_writes_what_decide_says() {
    use outboxd::retry::RetryPolicy;
    use outboxd::state::{Budget, decide};
    let db = TestDb::new().await;
    let client = db.client().await;
    let policy = RetryPolicy {
        base: Duration::from_secs(5),
        max: Duration::from_secs(900),
    };
    // A retried one is due at its lease's expiry plus the delay decide gives, within the
    // jitter (the expiry is pinned to a past instant, so the difference is exact).
    let plain = r#"{"url": "https://example.com/"}"#;
    let reconciling =
        r#"{"url": "https://example.com/", "reconcile": {"url": "https://example.com/l"}}"#;
    let cases = [
        (true, 1, 3, plain),
        (false, 1, 3, plain),
        (true, 3, 3, plain),
        (true, 2, 3, plain),
        (true, 4, 6, plain),
        (true, 20, 30, plain),
        (false, 1, 3, reconciling),
        (false, 3, 3, reconciling),
        (true, 2, 3, reconciling),
    ];
    for (i, (retry_ambiguous, attempts, max_attempts, payload)) in cases.iter().enumerate() {
        let key = format!("expiry-{i}");
        client
            .execute(
                "INSERT INTO outbox.messages (message_key, channel, payload, max_attempts, retry_ambiguous)
                 VALUES ($1, 'webhook', $4::text::jsonb, $2, $3)",
                &[&key, max_attempts, retry_ambiguous, payload],
            )
            .await
            .unwrap();
        client
            .execute(
                "UPDATE outbox.messages SET state = 'running', attempts = $2, lease_owner = 'gone',
                        lease_token = gen_random_uuid(),
                        lease_expires_at = timestamptz '2026-01-01 00:00:00+00'
                 WHERE message_key = $1",
                &[&key, attempts],
            )
            .await
            .unwrap();
        let batch = claim::settle_expired(&client, &[Channel::Webhook], 10, &policy)
            .await
            .unwrap();
        let budget = Budget {
            attempt: *attempts,
            max_attempts: *max_attempts,
            retry_ambiguous: *retry_ambiguous,
            reconcile: *payload == reconciling,
            after_ambiguous: false,
        };
        let want = decide(Some(ErrorClass::Ambiguous), budget, &policy, None, 0.0);
        match want {
            Transition::Dead { .. } => {
                assert_eq!(batch.gave_up.len(), 1, "{budget:?}");
                assert_eq!(row_state(&db, &key).await, "dead", "{budget:?}");
            }
            Transition::Retry { delay, .. } => {
                assert_eq!(batch.deferred.len(), 1, "{budget:?}");
                let r = client
                    .query_one(
                        "SELECT state, attempts,
                                extract(epoch FROM run_after - timestamptz '2026-01-01 00:00:00+00')::float8
                         FROM outbox.messages WHERE message_key = $1",
                        &[&key],
                    )
                    .await
                    .unwrap();
                let (state, n, waited): (String, i32, f64) = (r.get(0), r.get(1), r.get(2));
                assert_eq!((state.as_str(), n), ("pending", *attempts), "{budget:?}");
                let shortest = decide(Some(ErrorClass::Ambiguous), budget, &policy, None, 1.0);
                let Transition::Retry { delay: low, .. } = shortest else {
                    panic!("{shortest:?}");
                };
                assert!(
                    waited >= low.as_secs_f64() - 0.001 && waited <= delay.as_secs_f64() + 0.001,
                    "{budget:?}: due {waited}s after the expiry, want {low:?}..={delay:?}"
                );
                client
                    .execute("UPDATE outbox.messages SET state = 'delivered', delivered_at = now() WHERE message_key = $1", &[&key])
                    .await
                    .unwrap();
            }
            Transition::Delivered | Transition::Reconciled => panic!("{budget:?}"),
        }
    }
    // Once due, the claim tells the worker the previous attempt was ambiguous and whether
    // the payload names a lookup (the reconciling rows above were delivered by hand; one
    // more of each kind, due now).
    for (i, payload) in [plain, reconciling].iter().enumerate() {
        let key = format!("due-after-expiry-{i}");
        client
            .execute(
                "INSERT INTO outbox.messages (message_key, channel, payload)
                 VALUES ($1, 'webhook', $2::text::jsonb)",
                &[&key, payload],
            )
            .await
            .unwrap();
        client
            .execute(
                "UPDATE outbox.messages SET attempts = 1, error_class = 'ambiguous' WHERE message_key = $1",
                &[&key],
            )
            .await
            .unwrap();
        let batch = claim::claim(
            &client,
            &[Channel::Webhook],
            10,
            "w3",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        assert_eq!(batch.len(), 1, "{key}");
        assert_eq!(batch[0].previous_class, Some(ErrorClass::Ambiguous));
        assert_eq!(batch[0].reconcile, *payload == reconciling, "{key}");
    }
}

/// At a stop, rows claimed ahead give themselves back before the loop waits for a claim in
/// flight (up to 2 s): none starts a request after the stop. Here one slot is busy with a
/// request that ends after the stop, a row waits for the slot, and a claim is held inside
/// its statement (a trigger sleeps) when the stop comes. The waiting row used to take the
/// freed slot and send during that wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_row_claimed_ahead_starts_a_request_after_the_stop() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script([Reply::Status(200), Reply::Stall(Duration::from_millis(800))]);
    let c = db.client().await;
    slow_claim_of(&c, "ahead:slow", 1.5).await;
    let cfg = outboxd::config::WorkerConfig {
        concurrency: 1,
        poll_interval: Duration::from_secs(3600),
        ..test_worker_config("w")
    };
    let mut webhook = test_webhook_config();
    webhook.timeout = Duration::from_secs(5);
    let w = RunningWorker::start(&db, cfg, webhook);
    wait_for_idle_marks(&db, 1, "the worker to LISTEN, idle").await;
    // A quick delivery first: rows are claimed ahead only once the slots' pace is known.
    enqueue_webhook(&db, "ahead:warm", &rx.url("/h"), 3, true).await;
    wait_for_state(&db, "ahead:warm", "delivered", Duration::from_secs(10)).await;
    wait_for_idle_marks(&db, 1, "the worker to go idle again").await;
    // One claim takes both: the first stalls in the slot, the second waits for it.
    c.batch_execute("BEGIN").await.unwrap();
    for key in ["ahead:busy", "ahead:waiting"] {
        let msg = outboxd::NewMessage::webhook(key, serde_json::json!({"url": rx.url("/h")}));
        outboxd::enqueue(&c, &msg).await.unwrap();
    }
    c.batch_execute("COMMIT").await.unwrap();
    rx.wait_for(2, Duration::from_secs(10)).await;
    // Both leased: one in the slot (its request stalls), the other claimed ahead of it.
    for key in ["ahead:busy", "ahead:waiting"] {
        assert_eq!(row_state(&db, key).await, "running", "{key}");
    }
    // A third, whose claim sleeps inside its statement.
    enqueue_webhook(&db, "ahead:slow", &rx.url("/h"), 3, true).await;
    wait_for_a_sleeping_claim(&c).await;
    w.stop().await;
    let sent: Vec<String> = rx
        .requests()
        .iter()
        .filter_map(|r| r.header("idempotency-key"))
        .collect();
    assert_eq!(sent.len(), 2, "a request started after the stop: {sent:?}");
    // Whichever of the two got the slot was sent; the other was given back unsent.
    let unsent = if sent[1] == "ahead:busy" {
        "ahead:waiting"
    } else {
        "ahead:busy"
    };
    assert_eq!(row_state(&db, unsent).await, "pending");
}

/// The worker's pools on `db` through a [`Cutter`] that loses the first answer holding
/// `marker`, in plain text so that the proxy can read it (the machine's server may offer
/// TLS), and then lets no connection through for `outage` (zero: none).
async fn pools_behind_a_cutter(
    db: &TestDb,
    marker: Vec<u8>,
    outage: Duration,
) -> (outboxd::worker::Pools, common::cutter::Cutter) {
    let cutter = common::cutter::Cutter::start(db.server_addr().await, marker, outage).await;
    let proxied = db.url_at(&format!("127.0.0.1:{}", cutter.port), "sslmode=disable");
    let pools = outboxd::worker::Pools::new(&outboxd::db::parse_url(&proxied).unwrap(), 4).unwrap();
    (pools, cutter)
}

/// What a lost claim leaves once its row is delivered: the cut happened, the row was given
/// back uncounted (`released`) and then delivered by one attempt, one request in all.
async fn assert_given_back_then_sent_once(
    db: &TestDb,
    key: &str,
    row: &Row,
    cutter: &common::cutter::Cutter,
    rx: &Receiver,
) {
    assert!(
        cutter.has_cut(),
        "no answer was cut: this test showed nothing"
    );
    assert_eq!(row.attempts, 1, "the lost claim's attempt was not counted");
    let outcomes: Vec<(i32, String)> = attempts(db, key)
        .await
        .into_iter()
        .map(|a| (a.0, a.1))
        .collect();
    assert_eq!(
        outcomes,
        [(1, "released".to_owned()), (1, "delivered".to_owned())]
    );
    assert_eq!(rx.requests().len(), 1);
}

/// A claim whose answer is lost after its statement committed (here the connection is cut
/// as the claimed rows come back) leaves rows leased to this worker that no task holds.
/// They go back at once, uncounted, and are claimed and sent again; before, they waited for
/// their leases to expire and counted an attempt never made, as ambiguous: with
/// `retry_ambiguous = false`, dead `ambiguous` though nothing had been sent.
#[tokio::test]
async fn a_claim_whose_answer_is_lost_gives_its_rows_back() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    // The key is in the claim's answer (its rows) and in no other answer the worker gets
    // through the proxy; the test enqueues on its own connection.
    let key = "lost-answer:1";
    let (pools, cutter) = pools_behind_a_cutter(&db, key.as_bytes().to_vec(), Duration::ZERO).await;
    enqueue_webhook(&db, key, &rx.url("/h"), 3, false).await;
    let w = RunningWorker::start_on(
        &db,
        pools,
        test_worker_config("w"),
        test_webhook_config(),
        None,
    );
    // Well inside the 10 s lease: the rows came back at once, not at the lease's end.
    let row = wait_for_state(&db, key, "delivered", Duration::from_secs(6)).await;
    w.stop().await;
    assert_given_back_then_sent_once(&db, key, &row, &cutter, &rx).await;
}

/// The same, when the database stays away longer than the first tries (a restart or a
/// failover after the claim committed): the rows are given back once it answers again,
/// within the lease (here 60 s, against an 8 s outage). Before, three tries within 6 s all
/// failed, and the rows waited for their leases: an attempt counted though nothing was
/// sent, and with `retry_ambiguous = false` a dead `ambiguous` letter.
#[tokio::test]
async fn a_lost_claims_rows_come_back_after_an_outage_longer_than_the_first_tries() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let key = "lost-answer:outage";
    let (pools, cutter) =
        pools_behind_a_cutter(&db, key.as_bytes().to_vec(), Duration::from_secs(8)).await;
    enqueue_webhook(&db, key, &rx.url("/h"), 3, false).await;
    let w = RunningWorker::start_on(
        &db,
        pools,
        outboxd::config::WorkerConfig {
            lease: Duration::from_secs(60),
            ..test_worker_config("w")
        },
        test_webhook_config(),
        None,
    );
    // Given back within the 60 s lease, after the outage (the first tries failed in it);
    // the claim loop's own backoff then decides when it is claimed again.
    wait_until(
        Duration::from_secs(50),
        &format!("{key} released before its lease ended"),
        || async { attempts(&db, key).await.iter().any(|a| a.1 == "released") },
    )
    .await;
    let row = wait_for_state(&db, key, "delivered", Duration::from_secs(60)).await;
    w.stop().await;
    assert_given_back_then_sent_once(&db, key, &row, &cutter, &rx).await;
}

/// A completion whose answer is lost after it committed is tried again; the second try
/// finds the attempt recorded and leaves it be. Before, the fence no longer matched and
/// every attempt of the batch was recorded a second time, as `lease_lost`: in the history,
/// in the log and in `outboxd_deliveries_total`, for a delivery that went well.
#[tokio::test]
async fn a_completion_whose_answer_is_lost_is_recorded_once() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let key = "lost-completion:1";
    let id = enqueue_webhook(&db, key, &rx.url("/h"), 3, true).await;
    // The completion's answer row: (message_id int8, outcome text), in binary.
    let mut marker = id.to_be_bytes().to_vec();
    marker.extend_from_slice(&9i32.to_be_bytes());
    marker.extend_from_slice(b"delivered");
    let (pools, cutter) = pools_behind_a_cutter(&db, marker, Duration::ZERO).await;
    let w = RunningWorker::start_on(
        &db,
        pools,
        test_worker_config("w"),
        test_webhook_config(),
        None,
    );
    wait_for_state(&db, key, "delivered", Duration::from_secs(10)).await;
    // The stop waits for the completer, which tries again after the cut.
    wait_until(
        Duration::from_secs(10),
        "the completion's answer cut",
        || {
            let cut = cutter.has_cut();
            async move { cut }
        },
    )
    .await;
    let summary = w.stop().await;
    let outcomes: Vec<(i32, String)> = attempts(&db, key)
        .await
        .into_iter()
        .map(|a| (a.0, a.1))
        .collect();
    assert_eq!(outcomes, [(1, "delivered".to_owned())]);
    assert_eq!(summary.lease_lost, 0, "{summary:?}");
    assert_eq!(summary.delivered, 1, "{summary:?}");
    assert_eq!(rx.requests().len(), 1);
}

/// The completer's try after a failed one may meet the failed one still running on the
/// server (its answer lost, not its work: a cut connection, a bound that gave up while a
/// commit waited). `complete_again` waits for it, then finds what it recorded: the attempt
/// stays recorded once, as delivered. (Read in the snapshot its statement began with, the
/// first try's rows were not there yet, and the attempt was recorded again as `lease_lost`.)
#[tokio::test]
async fn a_completion_tried_again_waits_for_the_first_try_still_running() {
    let db = TestDb::new().await;
    enqueue_webhook(&db, "again:1", "https://example.com/h", 3, true).await;
    let mut first = db.client().await;
    let claimed = claim_n(&first, 1, "w", Duration::from_secs(60)).await;
    let done = [completion(&claimed[0], Transition::Delivered)];

    // The first try, committed only later.
    let tx = first.transaction().await.unwrap();
    let outcome = claim::complete(&tx, "w", &done).await.unwrap();
    assert_eq!(outcome, [(claimed[0].id, AttemptOutcome::Delivered)]);

    let mut second = db.client().await;
    let pid = backend_pid(&second).await;
    let again = tokio::spawn(async move {
        let done = done;
        claim::complete_again(&mut second, "w", &done)
            .await
            .unwrap()
    });
    let watch = db.client().await;
    wait_for_backend_wait(
        &watch,
        pid,
        "transactionid",
        "the second try to wait for the first",
    )
    .await;
    tx.commit().await.unwrap();

    assert_eq!(
        again.await.unwrap(),
        [(claimed[0].id, AttemptOutcome::Delivered)]
    );
    let outcomes: Vec<String> = attempts(&db, "again:1")
        .await
        .into_iter()
        .map(|a| a.1)
        .collect();
    assert_eq!(outcomes, ["delivered"]);
}
