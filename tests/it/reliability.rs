//! The reliability suite: crashes, contention, receiver faults, database faults.
//!
//! The promise: nothing committed is lost, nothing is delivered twice except where an
//! attempt's outcome was genuinely unknown (and then always with the same key). Every test
//! here is bounded in count and time, uses only 127.0.0.1, and writes its figures to
//! `target/reliability-figures.txt` (scripts/test prints them).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::faulty::{Fault, Faulty};
use common::receiver::Receiver;
use common::*;
use outboxd::model::ErrorClass;
use outboxd::retry::RetryPolicy;
use outboxd::state::{Budget, Transition, decide};

fn figures(line: &str) {
    println!("{line}");
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/reliability-figures.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}

async fn enqueue_bulk(db: &TestDb, prefix: &str, url: &str, n: usize) {
    let c = db.client().await;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let msgs: Vec<_> = chunk
            .iter()
            .map(|i| {
                outboxd::NewMessage::webhook(
                    format!("{prefix}:{i}"),
                    serde_json::json!({"url": url, "body": {"i": i}}),
                )
            })
            .collect();
        outboxd::enqueue_many(&c, &msgs).await.unwrap();
    }
}

async fn count_state(c: &tokio_postgres::Client, state: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM outbox.messages WHERE state = $1",
        &[&state],
    )
    .await
    .unwrap()
    .get(0)
}

fn spawn_worker(db: &TestDb, id: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "run",
            "--worker-id",
            id,
            "--concurrency",
            "16",
            "--batch-size",
            "50",
        ])
        .args([
            "--lease",
            "5s",
            "--webhook-timeout",
            "1s",
            "--poll-interval",
            "200ms",
            "--retry-base",
            "100ms",
        ])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", db.url())
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// SIGKILL a worker every second while three others run. Every message ends delivered, every
/// key arrives at least once, and only keys that a killed worker held arrive more than once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_killed_mid_batch_lose_nothing_and_duplicate_only_what_they_held() {
    const N: usize = 20_000;
    const KILLS: usize = 8;
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_bulk(&db, "crash", &rx.url("/h"), N).await;
    let c = db.client().await;
    let t0 = Instant::now();
    let mut generation = 0;
    let mut workers: Vec<(String, Child)> = (0..4)
        .map(|i| {
            let id = format!("crash-{i}-0");
            (id.clone(), spawn_worker(&db, &id))
        })
        .collect();
    let mut held_at_kill: HashSet<String> = HashSet::new();
    let mut kills = 0;
    while kills < KILLS && count_state(&c, "delivered").await < N as i64 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let victim = kills % workers.len();
        let (id, mut child) = workers.remove(victim);
        child.kill().unwrap();
        child.wait().unwrap();
        kills += 1;
        // What the dead worker held: running rows still leased to it.
        for r in c
            .query("SELECT message_key FROM outbox.messages WHERE state = 'running' AND lease_owner = $1", &[&id])
            .await
            .unwrap()
        {
            held_at_kill.insert(r.get(0));
        }
        generation += 1;
        let id = format!("crash-{victim}-{generation}");
        workers.insert(victim, (id.clone(), spawn_worker(&db, &id)));
    }
    wait_for_count(&c, "delivered", N as i64, Duration::from_secs(120)).await;
    let elapsed = t0.elapsed();
    for (_, mut child) in workers {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for r in rx.requests() {
        *per_key
            .entry(r.header("idempotency-key").unwrap())
            .or_default() += 1;
    }
    let dupes: Vec<&String> = per_key
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, _)| k)
        .collect();
    let unexplained: Vec<&&String> = dupes
        .iter()
        .filter(|k| !held_at_kill.contains(k.as_str()))
        .collect();
    figures(&format!(
        "crash: {N} messages, 4 workers, {kills} SIGKILLs in {:.1}s: {} keys received, {} more than once \
         ({} held by a killed worker), {} unexplained duplicates",
        elapsed.as_secs_f64(),
        per_key.len(),
        dupes.len(),
        held_at_kill.len(),
        unexplained.len()
    ));
    assert_eq!(per_key.len(), N, "every key received at least once");
    assert!(
        unexplained.is_empty(),
        "duplicates not held by a killed worker: {unexplained:?}"
    );
    assert!(kills >= 2, "the run was long enough to kill workers");
}

/// Many workers, no faults: every key exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_workers_deliver_every_key_exactly_once() {
    const N: usize = 3_000;
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_bulk(&db, "many", &rx.url("/h"), N).await;
    let t0 = Instant::now();
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let cfg = outboxd::config::WorkerConfig {
                concurrency: 8,
                batch_size: 20,
                ..test_worker_config(&format!("many-{i}"))
            };
            RunningWorker::start(&db, cfg, test_webhook_config())
        })
        .collect();
    let c = db.client().await;
    wait_for_count(&c, "delivered", N as i64, Duration::from_secs(60)).await;
    let elapsed = t0.elapsed();
    let mut delivered_by = Vec::new();
    for w in workers {
        delivered_by.push(w.stop().await.delivered);
    }
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for r in rx.requests() {
        *per_key
            .entry(r.header("idempotency-key").unwrap())
            .or_default() += 1;
    }
    figures(&format!(
        "contention: {N} messages, 8 workers in {:.1}s: per-worker deliveries {delivered_by:?}; {} keys, max {} request(s) per key",
        elapsed.as_secs_f64(),
        per_key.len(),
        per_key.values().max().unwrap_or(&0)
    ));
    assert_eq!(per_key.len(), N);
    assert!(per_key.values().all(|&n| n == 1), "a key was sent twice");
    assert_eq!(delivered_by.iter().sum::<u64>(), N as u64);
}

/// A deterministic mix of faults per message. The model (the crate's own `decide`, fed the
/// class each fault must produce) predicts every message's end state, class and request
/// count; the real worker must match it exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_faults_end_in_the_right_state_with_the_right_class() {
    const N: usize = 60;
    let menu = [
        Fault::Status(200, false),
        Fault::Status(503, false),
        Fault::Status(429, true),
        Fault::Status(503, true),
        Fault::Status(400, false),
        Fault::Stall(Duration::from_millis(1500)),
        Fault::ResetBeforeBody,
        Fault::ResetAfterRequest,
    ];
    // Message i, attempt n (1-based): a fixed pseudo-random pick.
    let pick = move |i: usize, n: usize| menu[(i * 7 + n * 3 + (i * n) % 5) % menu.len()];
    let class_of = |f: Fault| -> Option<ErrorClass> {
        match f {
            Fault::Status(200, _) => None,
            Fault::Status(400, _) => Some(ErrorClass::Permanent),
            Fault::Status(_, _) => Some(ErrorClass::Transient),
            // Once the connection is up, the request bytes have left: the receiver may
            // have acted on them.
            Fault::Stall(_) | Fault::ResetBeforeBody | Fault::ResetAfterRequest => {
                Some(ErrorClass::Ambiguous)
            }
        }
    };
    let faulty = Faulty::start(move |key, nth| {
        let i: usize = key
            .rsplit(':')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        pick(i, nth)
    })
    .await;
    let db = TestDb::new().await;
    let mut expected = Vec::new();
    for i in 0..N {
        let max_attempts = (i % 3) as i32 + 1;
        let retry_ambiguous = i % 2 == 0;
        let key = format!("fault:{i}");
        enqueue_webhook(&db, &key, &faulty.url("/h"), max_attempts, retry_ambiguous).await;
        // Run the model.
        let policy = RetryPolicy::default();
        let mut n = 1;
        // Once an attempt was ambiguous the message stays unknown (there is no lookup
        // here to settle it).
        let mut unknown = false;
        let (state, class) = loop {
            let budget = Budget {
                attempt: n,
                max_attempts,
                retry_ambiguous,
                reconcile: false,
                after_ambiguous: unknown,
            };
            let ended = class_of(pick(i, n as usize));
            match decide(ended, budget, &policy, None, 0.0) {
                Transition::Delivered | Transition::Reconciled => break ("delivered", None),
                Transition::Dead { class } => break ("dead", Some(class)),
                Transition::Retry { .. } => {
                    unknown |= ended == Some(ErrorClass::Ambiguous);
                    n += 1;
                }
            }
        };
        expected.push((key, state, class.map(|c| c.as_str().to_owned()), n as usize));
    }
    let cfg = outboxd::config::WorkerConfig {
        retry: RetryPolicy {
            base: Duration::from_millis(50),
            max: Duration::from_secs(1),
        },
        lease: Duration::from_secs(5),
        ..test_worker_config("faults")
    };
    let webhook = outboxd::deliver::webhook::settings::WebhookConfig {
        timeout: Duration::from_millis(700),
        ..test_webhook_config()
    };
    let w = RunningWorker::start(&db, cfg, webhook);
    let c = db.client().await;
    wait_until(Duration::from_secs(60), "every message delivered or dead", || {
        let c = &c;
        async move {
            let open: i64 = c
                .query_one("SELECT count(*) FROM outbox.messages WHERE state IN ('pending', 'running')", &[])
                .await
                .unwrap()
                .get(0);
            open == 0
        }
    })
    .await;
    w.stop().await;
    let mut by_class: HashMap<String, usize> = HashMap::new();
    for (key, state, class, requests) in &expected {
        let r = row(&db, key).await;
        assert_eq!(r.state, *state, "{key}");
        assert_eq!(r.error_class, *class, "{key}");
        assert_eq!(faulty.count(key), *requests, "{key}: requests");
        assert!(
            *requests as i32 <= r.attempts.max(1),
            "{key}: never more requests than attempts"
        );
        *by_class
            .entry(class.clone().unwrap_or_else(|| "delivered".into()))
            .or_default() += 1;
    }
    let mut summary: Vec<_> = by_class.into_iter().collect();
    summary.sort();
    figures(&format!(
        "receiver faults: {N} messages, outcomes {summary:?}, all as the model predicts"
    ));
}

/// Backends of the worker killed with pg_terminate_backend while they run a statement
/// (claims and completions): nothing is lost, nothing stays running beyond one lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_database_connections_lose_nothing() {
    const N: usize = 2_000;
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue_bulk(&db, "term", &rx.url("/h"), N).await;
    let mut pg = db.pg.clone();
    pg.application_name("outboxd-victim");
    let pg = outboxd::db::Database::from_config(pg).unwrap();
    let pool = outboxd::db::pool(&pg, 4).unwrap();
    let deliverers = outboxd::deliver::Deliverers::new(
        // A timeout that fits in the short lease with the margin an attempt needs to start.
        outboxd::deliver::webhook::WebhookSender::new(
            &outboxd::deliver::webhook::settings::WebhookConfig {
                timeout: Duration::from_millis(500),
                ..test_webhook_config()
            },
        )
        .unwrap(),
        None,
    );
    let cfg = outboxd::config::WorkerConfig {
        lease: Duration::from_secs(4),
        concurrency: 16,
        batch_size: 25,
        ..test_worker_config("victim")
    };
    let worker = outboxd::worker::Worker::new(pool, cfg, deliverers, Some(pg));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run(async {
        let _ = stop_rx.await;
    }));
    let killer = db.client().await;
    let c = db.client().await;
    // Fault injection: every statement that writes history (each completion, and each claim
    // through its lease-expiry step) lasts at least 10 ms, so the killer below, which looks
    // every 2 ms, meets both kinds even on a loaded machine (a bare completion takes well
    // under a millisecond, and racing it made this test depend on the machine's load).
    c.batch_execute(
        "CREATE FUNCTION public.slow_statement() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(0.01); RETURN NULL; END $$; \
         CREATE TRIGGER slow_statement AFTER INSERT ON outbox.attempts \
         FOR EACH STATEMENT EXECUTE FUNCTION public.slow_statement();",
    )
    .await
    .unwrap();
    let t0 = Instant::now();
    // Kill claims and completions while they run, until both kinds were hit several times
    // (bounded in time).
    let (mut claims_killed, mut completions_killed) = (0i64, 0i64);
    let kill = |pattern: &'static str| {
        let killer = &killer;
        async move {
            let n: i64 = killer
                .query_one(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name = 'outboxd-victim' \
                     AND state = 'active' AND query LIKE $1",
                    &[&pattern],
                )
                .await
                .unwrap()
                .get(0);
            n
        }
    };
    // Completions only run while messages flow: when the worker has delivered everything,
    // another wave is enqueued (a completion is short, and the worker is quick enough to
    // finish one wave before the killer has met one).
    let mut total = N;
    while (claims_killed < 5 || completions_killed < 5) && t0.elapsed() < Duration::from_secs(20) {
        // Each kind only until it has been hit enough: killing every claim would stop the
        // worker from ever completing anything.
        if claims_killed < 5 {
            claims_killed += kill("%WITH due AS%").await;
            // The lease sweep's statement, when one is running (once per poll interval).
            claims_killed += kill("%WITH expired AS%").await;
        }
        if completions_killed < 5 {
            completions_killed += kill("%), done AS (%").await;
        }
        if completions_killed < 5 && count_state(&c, "delivered").await == total as i64 {
            enqueue_bulk(&db, &format!("term-{total}"), &rx.url("/h"), 500).await;
            total += 500;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let terminated = claims_killed + completions_killed;
    wait_for_count(&c, "delivered", total as i64, Duration::from_secs(60)).await;
    let _ = stop_tx.send(());
    run.await.unwrap().unwrap();
    let lease_lost: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.attempts WHERE outcome = 'lease_lost'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let keys: HashSet<String> = rx
        .requests()
        .iter()
        .map(|r| r.header("idempotency-key").unwrap())
        .collect();
    figures(&format!(
        "database faults: {total} messages, {terminated} backends terminated mid-statement ({claims_killed} in a claim, \
         {completions_killed} in a completion) in {:.1}s; \
         all delivered, {lease_lost} attempt(s) recovered after lease expiry, {} requests for {} keys",
        t0.elapsed().as_secs_f64(),
        rx.requests().len(),
        keys.len()
    ));
    assert_eq!(keys.len(), total);
    assert_eq!(count_state(&c, "running").await, 0);
    assert!(claims_killed > 0, "a claim was terminated mid-statement");
    assert!(
        completions_killed > 0,
        "a completion was terminated mid-statement"
    );
}
