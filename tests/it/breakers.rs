//! Circuit breakers shared through the database: a host that
//! keeps failing opens for a cooldown, during which none of its messages is sent or
//! counted; then one probe; a success closes it and brings its backlog back.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common;

use common::binary::{outboxd, run};
use common::receiver::{Receiver, Reply};
use common::*;

/// How long a test waits for a state it expects.
const WAIT: Duration = Duration::from_secs(20);

/// The breaker row of `host`: state, failures in a row, cooldown (seconds).
async fn breaker(db: &TestDb, host: &str) -> Option<(String, i32, Option<f64>)> {
    db.client()
        .await
        .query_opt(
            "SELECT state, consecutive_failures, cooldown_seconds FROM outbox.destinations \
             WHERE host = $1",
            &[&host],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

/// `rx`'s destination has counted no failure: no breaker row, or a closed one at 0.
async fn assert_no_failure_counted(db: &TestDb, rx: &Receiver) {
    let b = breaker(db, &rx.addr.to_string()).await;
    assert!(
        b.as_ref()
            .is_none_or(|(state, failures, _)| state == "closed" && *failures == 0),
        "{b:?}"
    );
}

/// Attempts counted on, and history rows of attempts of, the messages whose key starts
/// with `prefix`. A `released` row is not one: it records a claimed row given back unsent
/// and uncounted (on a loaded machine, one claimed ahead may wait past its lease's room).
async fn counted(db: &TestDb, prefix: &str) -> (i64, i64) {
    let r = db
        .client()
        .await
        .query_one(
            "SELECT (SELECT coalesce(sum(attempts), 0)::bigint FROM outbox.messages \
                     WHERE message_key LIKE $1), \
                    (SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m \
                     ON m.id = a.message_id WHERE m.message_key LIKE $1 \
                     AND a.outcome <> 'released')",
            &[&format!("{prefix}%")],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

async fn enqueue_n(db: &TestDb, prefix: &str, url: &str, n: usize, max_attempts: i32) {
    let msgs: Vec<_> = (0..n)
        .map(|i| {
            outboxd::NewMessage::webhook(
                format!("{prefix}{i}"),
                serde_json::json!({"url": url, "body": {"i": i}}),
            )
            .max_attempts(max_attempts)
        })
        .collect();
    outboxd::enqueue_many(&db.client().await, &msgs)
        .await
        .unwrap();
}

fn breaker_config(id: &str, threshold: u32, cooldown: Duration) -> outboxd::config::WorkerConfig {
    let mut cfg = test_worker_config(id);
    cfg.concurrency = 1;
    cfg.breaker_threshold = threshold;
    cfg.breaker_cooldown = cooldown;
    cfg
}

/// Two workers share one breaker: after the threshold neither sends to the failing host for
/// the cooldown, then exactly one probe goes (the others wait for its answer), and its
/// success closes the circuit and lets the rest through. Deferrals count no attempt and
/// write no history; a healthy host beside it is never held up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_host_opens_for_everyone_and_one_probe_closes_it() {
    let db = TestDb::new().await;
    let bad = Receiver::start().await;
    // Slow failures: a poll interval (50 ms) is shorter than one of them, so the worker
    // that did not open the circuit reads it before its next request.
    bad.set_default(Reply::Slow(Duration::from_millis(120), 503));
    let good = Receiver::start().await;
    enqueue_n(&db, "bad:", &bad.url("/hook?token=s3cret"), 20, 30).await;
    enqueue_n(&db, "good:", &good.url("/hook"), 20, 3).await;
    let host = bad.addr.to_string();
    let cooldown = Duration::from_millis(1500);
    let w1 = RunningWorker::start(
        &db,
        breaker_config("w1", 3, cooldown),
        test_webhook_config(),
    );
    let w2 = RunningWorker::start(
        &db,
        breaker_config("w2", 3, cooldown),
        test_webhook_config(),
    );
    wait_until(Duration::from_secs(20), "the failing host open", || {
        let (db, host) = (&db, &host);
        async move { breaker(db, host).await.is_some_and(|b| b.0 == "open") }
    })
    .await;
    // Every request made so far is counted and recorded (none is still in flight): the
    // next request to the host is the probe.
    wait_until(Duration::from_secs(10), "no request in flight", || {
        let (db, bad) = (&db, &bad);
        async move {
            let (attempts, history) = counted(db, "bad:").await;
            attempts == history && history == bad.requests().len() as i64
        }
    })
    .await;
    let before = bad.requests().len();
    // Three failures open it. Each worker claims its next message as soon as a request
    // ends, before its completer has recorded the failure, and the worker that did not
    // open the circuit reads it within a poll interval: a few more go, never all 20.
    assert!(
        (3..=10).contains(&before),
        "{before} requests before the circuit opened"
    );
    bad.script([Reply::Stall(Duration::from_millis(700))]);
    bad.set_default(Reply::Status(204));
    good.wait_for(20, Duration::from_secs(10)).await;
    wait_until(
        Duration::from_secs(30),
        "every bad: message delivered",
        || {
            let db = &db;
            async move {
                db.client()
                    .await
                    .query_one(
                        "SELECT count(*) FROM outbox.messages \
                     WHERE message_key LIKE 'bad:%' AND state = 'delivered'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get::<_, i64>(0)
                    == 20
            }
        },
    )
    .await;
    let s1 = w1.stop().await;
    let s2 = w2.stop().await;
    let reqs = bad.requests();
    let last_failure = reqs[before - 1].at;
    let probe = reqs[before].at;
    let next = reqs[before + 1].at;
    eprintln!(
        "breaker: {before} requests before opening, probe {:?} after the last failure, \
         next request {:?} after the probe, {} requests in all; deferred {} + {}",
        probe - last_failure,
        next - probe,
        reqs.len(),
        s1.deferred,
        s2.deferred
    );
    // The last request before the probe may have started up to a poll interval (50 ms)
    // after the opening, by the worker that had not yet read it, and answered 120 ms later.
    assert!(
        probe - last_failure >= cooldown - Duration::from_millis(250),
        "the probe came {:?} after the last failure (cooldown {cooldown:?})",
        probe - last_failure
    );
    assert!(
        next - probe >= Duration::from_millis(650),
        "a second request {:?} after the probe, before the probe answered",
        next - probe
    );
    let (attempts, history) = counted(&db, "bad:").await;
    assert_eq!(
        attempts,
        reqs.len() as i64,
        "attempts counted = requests made (deferrals are not counted)"
    );
    assert_eq!(
        history, attempts,
        "one history row per request, none per deferral"
    );
    let (state, failures, _) = breaker(&db, &host).await.unwrap();
    assert_eq!((state.as_str(), failures), ("closed", 0));
    // Every message went with its own key, once per attempt.
    for i in 0..20 {
        assert!(!bad.requests_for(&format!("bad:{i}")).is_empty());
    }
}

/// A failed probe reopens the circuit with the cooldown doubled, at most `--retry-max`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_probe_doubles_the_cooldown_up_to_retry_max() {
    let db = TestDb::new().await;
    let bad = Receiver::start().await;
    bad.set_default(Reply::Status(503));
    enqueue_n(&db, "d:", &bad.url("/x"), 10, 100).await;
    let host = bad.addr.to_string();
    // retry max is 2 s in the test settings: 0.5 → 1 → 2 → 2.
    let mut cfg = breaker_config("w", 2, Duration::from_millis(500));
    cfg.retry.max = Duration::from_secs(2);
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<f64>::new()));
    let cooldown_seen = |want: usize| {
        let (db, host, seen) = (&db, &host, seen.clone());
        move || {
            let seen = seen.clone();
            async move {
                if let Some((_, _, Some(c))) = breaker(db, host).await {
                    let mut seen = seen.lock().unwrap();
                    if seen.last() != Some(&c) {
                        seen.push(c);
                    }
                }
                seen.lock().unwrap().len() >= want
            }
        }
    };
    wait_until(Duration::from_secs(30), "three cooldowns", cooldown_seen(3)).await;
    assert_eq!(
        seen.lock().unwrap()[..],
        [0.5, 1.0, 2.0],
        "cooldowns after the first opening and two failed probes"
    );
    // One more failed probe: the cooldown stays at --retry-max.
    let n = bad.requests().len();
    bad.wait_for(n + 1, Duration::from_secs(10)).await;
    wait_until(
        Duration::from_secs(10),
        "open again after the probe",
        || {
            let (db, host) = (&db, &host);
            async move { breaker(db, host).await.is_some_and(|b| b.0 == "open") }
        },
    )
    .await;
    w.stop().await;
    let (_, _, c) = breaker(&db, &host).await.unwrap();
    assert_eq!(c, Some(2.0), "the cooldown is capped at --retry-max");
    // The gaps between probes grow with the cooldown: one request per opening.
    let reqs = bad.requests();
    let gaps: Vec<Duration> = reqs.windows(2).map(|w| w[1].at - w[0].at).collect();
    let long: Vec<Duration> = gaps
        .iter()
        .copied()
        .filter(|g| *g >= Duration::from_millis(400))
        .collect();
    eprintln!("gaps between requests: {gaps:?}");
    assert!(long.len() >= 2, "gaps {gaps:?}");
    assert!(long[0] >= Duration::from_millis(450), "gaps {gaps:?}");
    assert!(long[1] >= Duration::from_millis(950), "gaps {gaps:?}");
    // The probes come when the cooldowns end, not a probe window later.
    assert!(long[0] < Duration::from_millis(1500), "gaps {gaps:?}");
    assert!(long[1] < Duration::from_millis(2000), "gaps {gaps:?}");
    // Only requests are counted; the stop may have cut one attempt off before its request
    // arrived (counted: it had started).
    let (attempts, _) = counted(&db, "d:").await;
    let made = reqs.len() as i64;
    assert!(
        attempts == made || attempts == made + 1,
        "{attempts} attempts counted for {made} requests"
    );
}

/// Rows claimed ahead of the free slots passed the gate while their host was closed. When
/// the host's first failures open it, those rows go back unsent (uncounted) instead of
/// making their requests: with 4 in flight, 8 claimed ahead and a threshold of 1, a host
/// that fails every request gets the first 4 (sent together), not all 12. (A first
/// delivery to a healthy host comes before: nothing is claimed ahead until the worker has
/// seen how long its slots are held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_claimed_ahead_are_not_sent_to_a_host_that_opened_meanwhile() {
    let db = TestDb::new().await;
    let good = Receiver::start().await;
    let bad = Receiver::start().await;
    bad.set_default(Reply::Status(503));
    let host = bad.addr.to_string();
    let mut cfg = breaker_config("w", 1, Duration::from_secs(3600));
    cfg.concurrency = 4;
    cfg.batch_size = 4;
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    enqueue_n(&db, "warm:", &good.url("/hook"), 1, 5).await;
    wait_for_state(&db, "warm:0", "delivered", Duration::from_secs(10)).await;
    enqueue_n(&db, "ahead:", &bad.url("/hook?token=s3cret"), 12, 5).await;
    let c = db.client().await;
    // Every row given back is due only after the cooldown, the others were sent and
    // failed. (Waiting for "all pending" alone could stop the worker while a claim of the
    // last rows was in flight, leaving them leased.)
    wait_until(Duration::from_secs(30), "the host open, the rest held back", || {
        let (c, host) = (&c, &host);
        async move {
            c.query_one(
                "SELECT (SELECT count(*) FROM outbox.messages \
                         WHERE state = 'pending' AND message_key LIKE 'ahead:%' \
                           AND run_after > now() + interval '10 minutes') \
                      + (SELECT count(*) FROM outbox.attempts a \
                         JOIN outbox.messages m ON m.id = a.message_id \
                         WHERE m.message_key LIKE 'ahead:%') >= 12 \
                    AND EXISTS (SELECT 1 FROM outbox.destinations WHERE host = $1 AND state = 'open')",
                &[host],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
        }
    })
    .await;
    w.stop().await;
    let sent = bad.requests().len();
    assert!(
        sent <= 4,
        "{sent} requests to a host that opened after its first failure"
    );
    // The rows given back spent nothing: one attempt counted per request.
    let (attempts, history) = counted(&db, "ahead:").await;
    assert_eq!((attempts, history), (sent as i64, sent as i64));
}

/// The claim does not keep picking an open host's rows: with 100 000 of them due and 100
/// for a healthy host, the opening moves the backlog out of the due index's way once, and
/// the claim reads the healthy rows (and at most the probe). `outboxd destinations` lists
/// the host, `status --json` counts it, `--close` brings the backlog back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_host_with_a_deep_backlog_does_not_make_the_claim_spin() {
    let db = TestDb::new().await;
    let bad = Receiver::start().await;
    bad.set_default(Reply::Status(503));
    let host = bad.addr.to_string();
    let c = db.client().await;
    // A plain INSERT, as an application may write: 100 000 due rows for the failing host.
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload, max_attempts) \
         SELECT 'deep:' || i, 'webhook', jsonb_build_object('url', $1::text, 'body', i), 50 \
         FROM generate_series(1, 100000) i",
        &[&bad.url("/deep?sig=s3cret")],
    )
    .await
    .unwrap();
    let w = RunningWorker::start(
        &db,
        breaker_config("w", 1, Duration::from_secs(3600)),
        test_webhook_config(),
    );
    wait_until(Duration::from_secs(120), "the backlog moved past the cooldown", || {
        let c = &c;
        async move {
            c.query_one(
                "SELECT count(*) FROM outbox.messages WHERE state = 'pending' AND run_after <= now() + interval '1 minute'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                == 0
        }
    })
    .await;
    w.stop().await;
    // The first request fails and opens the host; the row claimed ahead of it may already
    // be past its recheck. One more can go on a loaded machine: a row rechecked after the
    // failure waits for it to be recorded at most `RECORD_WAIT` (1 s), and CI saw the
    // completer take longer (3 requests). A breaker that did not hold would send
    // thousands here.
    let sent = bad.requests().len();
    assert!(sent <= 4, "{sent} requests to the open host");

    // 100 healthy rows, due now.
    let good = Receiver::start().await;
    enqueue_n(&db, "ok:", &good.url("/ok"), 100, 3).await;
    c.batch_execute("ANALYZE outbox.messages").await.unwrap();
    let plan: Vec<String> = c
        .query(
            &format!(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {}",
                outboxd::queries::CLAIM
            ),
            &[
                &vec!["webhook".to_owned()],
                &64i64,
                &"explain",
                &30.0f64,
                &uuid::Uuid::nil(),
            ],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan = plan.join("\n");
    eprintln!("claim with 100 000 rows of an open host and 100 healthy:\n{plan}");
    let claimed: Vec<String> = first_column(
        &c,
        "SELECT message_key FROM outbox.messages WHERE state = 'running'",
    )
    .await;
    assert_eq!(claimed.len(), 64, "{claimed:?}");
    assert!(claimed.iter().all(|k| k.starts_with("ok:")), "{claimed:?}");
    // The due scan stopped after the rows it took: no scan of the open host's backlog.
    let scanned: Vec<i64> = plan
        .lines()
        .filter(|l| l.contains("messages_due_idx"))
        .filter_map(|l| {
            let rows = l.split("rows=").nth(1)?;
            rows.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(!scanned.is_empty(), "the claim uses the due index:\n{plan}");
    assert!(
        scanned.iter().all(|n| *n <= 65),
        "the due index scan read {scanned:?} rows:\n{plan}"
    );

    // What operators see.
    let url = db.url();
    let h = host.clone();
    let listed = tokio::task::spawn_blocking(move || {
        run(outboxd(Some(&url)).args(["destinations", "--json"]))
    })
    .await
    .unwrap();
    assert_eq!(listed.code, Some(0), "{}", listed.stderr);
    let v: serde_json::Value = serde_json::from_str(&listed.stdout).unwrap();
    assert_eq!(v[0]["host"], serde_json::json!(h));
    assert_eq!(v[0]["state"], "open");
    assert!(v[0]["open_until"].is_string(), "{v}");
    assert!(!listed.stdout.contains("s3cret") && !listed.stdout.contains("/deep"));
    let url = db.url();
    let st =
        tokio::task::spawn_blocking(move || run(outboxd(Some(&url)).args(["status", "--json"])))
            .await
            .unwrap();
    let st: serde_json::Value = serde_json::from_str(&st.stdout).unwrap();
    assert_eq!(st["open_destinations"], 1);

    let url = db.url();
    let h = host.clone();
    let closed = tokio::task::spawn_blocking(move || {
        run(outboxd(Some(&url)).args(["destinations", "--close", &h]))
    })
    .await
    .unwrap();
    assert_eq!(closed.code, Some(0), "{}", closed.stderr);
    eprintln!("{}", closed.stdout.trim());
    let due: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE message_key LIKE 'deep:%' \
             AND state = 'pending' AND run_after <= now()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Every pushed row is due again; the few that were sent wait for their retry.
    assert!(
        due >= 100_000 - sent as i64,
        "{due} of the backlog due again"
    );
    let (state, failures, _) = breaker(&db, &host).await.unwrap();
    assert_eq!((state.as_str(), failures), ("closed", 0));
    let url = db.url();
    let unknown = tokio::task::spawn_blocking(move || {
        run(outboxd(Some(&url)).args(["destinations", "--close", "never.example"]))
    })
    .await
    .unwrap();
    assert_eq!(unknown.code, Some(1), "{}", unknown.stderr);
    assert_eq!(unknown.stderr_lines().len(), 1, "{}", unknown.stderr);
}

/// `outboxd destinations --close HOST` (the contract's words) closes a host named without
/// its port on every port it was reached at, whether or not the bare host has a row of
/// its own (here a closed one, from port 80): breakers are kept per host and port, and the
/// bare host used to be refused ("no destination 127.0.0.1 is known"). A name that only
/// begins like it is left alone.
#[tokio::test]
async fn close_with_a_bare_host_closes_it_on_every_port() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.destinations (host, state, consecutive_failures, cooldown_seconds, open_until) VALUES \
         ('127.0.0.1', 'closed', 0, 30, NULL), \
         ('127.0.0.1:18777', 'open', 10, 30, now() + interval '1 hour'), \
         ('127.0.0.1:9090', 'open', 10, 30, now() + interval '1 hour'), \
         ('127.0.0.10:18777', 'open', 10, 30, now() + interval '1 hour'), \
         ('[::1]:8443', 'open', 10, 30, now() + interval '1 hour')",
    )
    .await
    .unwrap();
    let close = |host: &'static str| {
        let url = db.url();
        tokio::task::spawn_blocking(move || {
            run(outboxd(Some(&url)).args(["destinations", "--close", host]))
        })
    };
    let out = close("127.0.0.1").await.unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stdout.contains("closed 127.0.0.1:18777"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("closed 127.0.0.1:9090"),
        "{}",
        out.stdout
    );
    let out = close("[::1]").await.unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let open: Vec<String> = first_column(
        &c,
        "SELECT host FROM outbox.destinations WHERE state = 'open' ORDER BY host",
    )
    .await;
    assert_eq!(open, ["127.0.0.10:18777"]);
    let out = close("127.0.0").await.unwrap();
    assert_eq!(out.code, Some(1), "{}", out.stderr);
}

/// `queries::BREAKER_RECORD` writes what `Circuit::after` says, on every state, count and
/// batch (and for a destination seen for the first time).
#[tokio::test]
async fn the_sql_and_the_code_agree_on_every_breaker_transition() {
    use outboxd::state::{BreakerBatch, Circuit, Cooldown};
    let db = TestDb::new().await;
    let c = db.client().await;
    let (threshold, base, max, prior_cooldown) = (3i32, 0.5f64, 2.0f64, 1.0f64);
    let batches = [
        (true, 0),
        (true, 1),
        (true, 3),
        (false, 1),
        (false, 2),
        (false, 3),
    ];
    let mut cases = 0;
    for prior in [
        None,
        Some(Circuit::Closed),
        Some(Circuit::Open),
        Some(Circuit::HalfOpen),
    ] {
        for before in [0i32, 2] {
            if prior.is_none() && before > 0 {
                continue;
            }
            for (reset, fails) in batches {
                c.batch_execute("DELETE FROM outbox.destinations")
                    .await
                    .unwrap();
                if let Some(p) = prior {
                    c.execute(
                        "INSERT INTO outbox.destinations \
                         (host, state, consecutive_failures, cooldown_seconds, open_until) \
                         VALUES ('h.example', $1, $2, $3, \
                                 CASE WHEN $1 <> 'closed' THEN now() + interval '10 s' END)",
                        &[&p.as_str(), &before, &prior_cooldown],
                    )
                    .await
                    .unwrap();
                }
                c.query(
                    outboxd::queries::BREAKER_RECORD,
                    &[
                        &vec!["h.example"],
                        &vec![reset],
                        &vec![fails],
                        &threshold,
                        &base,
                        &max,
                    ],
                )
                .await
                .unwrap();
                let got = c
                    .query_opt(
                        "SELECT state, consecutive_failures, cooldown_seconds, \
                                extract(epoch FROM open_until - now())::float8 \
                         FROM outbox.destinations WHERE host = 'h.example'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .map(|r| {
                        (
                            r.get::<_, String>(0),
                            r.get::<_, i32>(1),
                            r.get::<_, Option<f64>>(2),
                            r.get::<_, Option<f64>>(3),
                        )
                    });
                let what =
                    format!("{prior:?} with {before} failures, batch reset={reset} fails={fails}");
                let batch = BreakerBatch { reset, fails };
                let Some(from) = prior else {
                    // A destination gets a row only when it fails.
                    if fails == 0 {
                        assert_eq!(got, None, "{what}");
                        continue;
                    }
                    let (state, failures, cooldown, open_in) = got.expect(&what);
                    let want = Circuit::Closed.after(0, batch, threshold);
                    assert_eq!(state, want.circuit.as_str(), "{what}");
                    assert_eq!(failures, want.failures, "{what}");
                    assert_eq!(cooldown, Some(base), "{what}");
                    assert_eq!(open_in.is_some(), want.circuit == Circuit::Open, "{what}");
                    cases += 1;
                    continue;
                };
                let want = from.after(before, batch, threshold);
                let (state, failures, cooldown, open_in) = got.expect(&what);
                assert_eq!(Circuit::parse(&state), Some(want.circuit), "{what}");
                assert_eq!(failures, want.failures, "{what}");
                let (want_cooldown, want_open_in) = match want.cooldown {
                    Cooldown::Base => (base, base),
                    Cooldown::Kept => (prior_cooldown, 10.0),
                    Cooldown::Doubled => (
                        (prior_cooldown * 2.0).min(max),
                        (prior_cooldown * 2.0).min(max),
                    ),
                };
                assert_eq!(cooldown, Some(want_cooldown), "{what}");
                match (want.circuit, open_in) {
                    (Circuit::Open, Some(s)) => {
                        assert!((s - want_open_in).abs() < 0.5, "{what}: open for {s} s")
                    }
                    (Circuit::Open, None) => panic!("{what}: open without open_until"),
                    (_, s) => assert_eq!(s, None, "{what}"),
                }
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 41);
}

/// The breakers never make a first attempt due before the time the application gave it:
/// the push moves the host's due rows and its retries past the cooldown, and leaves a first
/// attempt scheduled for later where it is; the
/// restore at the close brings the pushed rows back, not a row the application scheduled
/// for ten minutes from now (it used to make that one due at once).
#[tokio::test]
async fn the_breakers_never_send_a_first_attempt_before_its_run_after() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Times as the database holds them (seconds since the epoch), not counted from the
    // moment of the check: a loaded machine may take seconds between two statements.
    let at = |sql: String| {
        let db = &db;
        async move {
            let s: f64 = db
                .scalar(&format!("SELECT extract(epoch FROM ({sql}))::float8"))
                .await;
            s
        }
    };
    let due_at = |key: &'static str| {
        at(format!(
            "SELECT run_after FROM outbox.messages WHERE message_key = '{key}'"
        ))
    };
    let now = || at("SELECT now()".to_owned());
    let enqueue_in = |key: &'static str, secs: i64| {
        let c = &c;
        async move {
            c.execute(
                "SELECT outbox.enqueue($1, 'webhook', '{\"url\": \"https://h.example/x\"}', \
                 now() + make_interval(secs => $2::float8))",
                &[&key, &(secs as f64)],
            )
            .await
            .unwrap();
        }
    };
    // Open for 15 minutes: a first attempt due just after the cooldown, one in ten
    // minutes, one due now, and a retry due in 100 s.
    c.batch_execute(
        "INSERT INTO outbox.destinations (host, state, consecutive_failures, cooldown_seconds, open_until) \
         VALUES ('h.example', 'open', 10, 900, now() + interval '900 s')",
    )
    .await
    .unwrap();
    enqueue_in("after-cooldown", 905).await;
    enqueue_in("in-ten-minutes", 600).await;
    enqueue_in("now", 0).await;
    enqueue_in("retry", 100).await;
    // Due now as well, behind the probe: pushed past the cooldown, and brought back.
    enqueue_in("now-too", 0).await;
    // A first attempt the application scheduled inside the restore's span around the
    // pushed time (here 912 s ± 60 s), so that only the worker's mark tells it apart.
    enqueue_in("in-the-span", 940).await;
    let in_the_span = due_at("in-the-span").await;
    // The same, held and then approved by an operator (which sets updated_at).
    c.execute(
        "SELECT outbox.enqueue('approved-in-the-span', 'webhook', \
         '{\"url\": \"https://h.example/x\"}', now() + interval '950 s', held => true)",
        &[],
    )
    .await
    .unwrap();
    c.batch_execute(
        "SELECT outbox.approve(ARRAY(SELECT id FROM outbox.messages \
         WHERE message_key = 'approved-in-the-span'), 'cli:test')",
    )
    .await
    .unwrap();
    let approved = due_at("approved-in-the-span").await;
    c.batch_execute("UPDATE outbox.messages SET attempts = 1 WHERE message_key = 'retry'")
        .await
        .unwrap();
    let after_cooldown = due_at("after-cooldown").await;
    let in_ten_minutes = due_at("in-ten-minutes").await;
    let window = 12.0f64;
    let pushed = c
        .query_one(
            outboxd::queries::BREAKER_PUSH,
            &[&"h.example", &window, &5000i64, &0i64, &0.25f64],
        )
        .await
        .unwrap();
    assert_eq!(pushed.get::<_, i64>(0), 3, "the due rows and the retry");
    // The oldest of them stays due, as the probe; the retry goes past the cooldown.
    assert!(due_at("now").await <= now().await);
    let open_until =
        at("SELECT open_until FROM outbox.destinations WHERE host = 'h.example'".to_owned()).await;
    let s = due_at("retry").await;
    assert!(
        (s - (open_until + window)).abs() < 0.001,
        "retry: due at {s}"
    );
    // The application's rows keep their times.
    assert_eq!(due_at("after-cooldown").await, after_cooldown);
    assert_eq!(due_at("in-ten-minutes").await, in_ten_minutes);
    // The host closes: the pushed rows are due at once; the application's row keeps its
    // time.
    let deferred_until: std::time::SystemTime = db
        .scalar("SELECT deferred_until FROM outbox.destinations WHERE host = 'h.example'")
        .await;
    outboxd::ops::restore_backlog(&c, "h.example", deferred_until)
        .await
        .unwrap();
    assert!(due_at("now").await <= now().await);
    assert!(due_at("retry").await <= now().await);
    assert!(due_at("now-too").await <= now().await);
    assert_eq!(due_at("in-ten-minutes").await, in_ten_minutes);
    assert_eq!(due_at("after-cooldown").await, after_cooldown);
    assert_eq!(due_at("in-the-span").await, in_the_span);
    assert_eq!(due_at("approved-in-the-span").await, approved);
}

/// A result the reconciliation lookup settled is the lookup host's, and an attempt held
/// back after a slow 404 asked nobody: neither counts against the destination's breaker.
/// Here the lookup runs on a host of its own and answers 503 (ambiguous again), then 404
/// after 2.5 s of a 4 s attempt (held back, transient), and the destination answers the
/// last attempt. Both used to count against the destination: with a threshold of 1 it
/// opened for an hour, and the message waited for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_on_another_host_does_not_count_against_the_destination() {
    let db = TestDb::new().await;
    let dest = Receiver::start().await;
    let look = Receiver::start().await;
    look.script([
        Reply::Status(503),
        Reply::Slow(Duration::from_millis(2500), 404),
    ]);
    let key = "elsewhere";
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(
        key,
        serde_json::json!({
            "url": dest.url("/hook"),
            "body": 1,
            "reconcile": {"url": look.url("/ops/elsewhere")},
        }),
    )
    .max_attempts(4)
    .retry_ambiguous(true);
    outboxd::enqueue(&c, &msg).await.unwrap();
    claim_and_abandon(&db).await;
    let w = RunningWorker::start(
        &db,
        breaker_config("w", 1, Duration::from_secs(3600)),
        outboxd::deliver::webhook::settings::WebhookConfig {
            timeout: Duration::from_secs(4),
            ..test_webhook_config()
        },
    );
    let row = wait_for_state(&db, key, "delivered", Duration::from_secs(60)).await;
    w.stop().await;
    assert_eq!(row.attempts, 4);
    assert_eq!(look.requests().len(), 2);
    assert_eq!(dest.requests().len(), 1);
    let history: Vec<(String, Option<String>)> = db
        .client()
        .await
        .query(
            "SELECT a.outcome, a.error_class FROM outbox.attempts a \
             JOIN outbox.messages m ON m.id = a.message_id \
             WHERE m.message_key = $1 ORDER BY a.attempt",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let class = |c: &str| Some(c.to_owned());
    assert_eq!(
        history,
        [
            ("lease_lost".to_owned(), class("ambiguous")),
            ("retry".to_owned(), class("ambiguous")),
            ("retry".to_owned(), class("transient")),
            ("delivered".to_owned(), None),
        ]
    );
    assert_no_failure_counted(&db, &dest).await;
}

/// After an ambiguous attempt, one that can send nothing (here it names a signing secret
/// this worker does not have) is ambiguous again, for a person to settle; it asked the
/// destination nothing, so its breaker counts nothing. It used to count: with a threshold
/// of 1 the destination opened for an hour, and the message never reached its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_sends_nothing_does_not_count_against_the_destination() {
    let db = TestDb::new().await;
    let dest = Receiver::start().await;
    let key = "unsendable";
    let msg = outboxd::NewMessage::webhook(
        key,
        serde_json::json!({"url": dest.url("/hook"), "body": 1, "secret": "ROTATED"}),
    )
    .max_attempts(3)
    .retry_ambiguous(true);
    outboxd::enqueue(&db.client().await, &msg).await.unwrap();
    claim_and_abandon(&db).await;
    let w = RunningWorker::start(
        &db,
        breaker_config("w", 1, Duration::from_secs(3600)),
        test_webhook_config(),
    );
    let row = wait_for_state(&db, key, "dead", Duration::from_secs(30)).await;
    w.stop().await;
    assert_eq!(row.error_class.as_deref(), Some("ambiguous"), "{row:?}");
    assert!(dest.requests().is_empty());
    assert_no_failure_counted(&db, &dest).await;
}

/// An `http` endpoint's host has a circuit like a webhook's, and its backlog too: the
/// opening pushes its due messages out of the claim's way, and closing the circuit by hand
/// brings every one back at once (not after the cooldown, an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_endpoints_backlog_is_held_back_and_brought_back_by_its_circuit() {
    let db = TestDb::new().await;
    let provider = Receiver::start().await;
    provider.set_default(Reply::Status(503));
    let host = provider.addr.to_string();
    let c = db.client().await;
    c.execute(
        "SELECT * FROM outbox.set_endpoint('acme', $1, auth_secret => NULL)",
        &[&provider.url("/api")],
    )
    .await
    .unwrap();
    let msgs: Vec<_> = (0..40)
        .map(|i| {
            outboxd::NewMessage::http(
                format!("h:{i}"),
                serde_json::json!({"endpoint": "acme", "path": "/v1/things", "json": {"i": i}}),
            )
            .max_attempts(5)
        })
        .collect();
    outboxd::enqueue_many(&c, &msgs).await.unwrap();
    let mut cfg = breaker_config("w", 1, Duration::from_secs(3600));
    cfg.channels = vec![outboxd::model::Channel::Http];
    let w = RunningWorker::start(&db, cfg, test_webhook_config());
    // The first failure opens the circuit; the backlog moves past the cooldown.
    wait_until(WAIT, "the http backlog pushed past the cooldown", || {
        let c = &c;
        async move {
            c.query_one(
                "SELECT count(*) FROM outbox.messages
                 WHERE state IN ('pending', 'running') AND run_after <= now() + interval '30 minutes'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                == 0
        }
    })
    .await;
    assert!(provider.requests().len() <= 4, "the open circuit holds");

    // The provider is back; an operator closes the circuit: everything goes now.
    provider.set_default(Reply::Status(200));
    let url = db.url();
    let h = host.clone();
    let out = tokio::task::spawn_blocking(move || {
        run(outboxd(Some(&url)).args(["destinations", "--close", &h]))
    })
    .await
    .unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    for i in 0..40 {
        wait_for_state(&db, &format!("h:{i}"), "delivered", WAIT).await;
    }
    w.stop().await;
}

/// A breaker's deferral decided on a worker's stale view (the circuit closed meanwhile, so
/// its backlog was already brought back) is due within a second, not after the cooldown;
/// one whose circuit is still open keeps its delay, and so does any other deferral.
#[tokio::test]
async fn a_breakers_deferral_after_the_circuit_closed_is_not_held_for_the_cooldown() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue_n(&db, "open:", "http://open.example/h", 1, 3).await;
    enqueue_n(&db, "closed:", "http://closed.example/h", 2, 3).await;
    c.batch_execute(
        "INSERT INTO outbox.destinations (host, state, consecutive_failures, cooldown_seconds, open_until) VALUES \
         ('open.example', 'open', 5, 3600, now() + interval '1 hour'), \
         ('closed.example', 'closed', 0, 3600, NULL)",
    )
    .await
    .unwrap();
    let claimed = outboxd::claim::claim(
        &c,
        &[outboxd::model::Channel::Webhook],
        10,
        "w",
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(claimed.len(), 3);
    let hour = Duration::from_secs(3600);
    let rows: Vec<_> = claimed
        .iter()
        .map(|m| {
            // The last `closed:` row is a rate limit's deferral, not the breaker's.
            let breaker = m.key != "closed:1";
            (m.id, m.lease_token, hour, breaker)
        })
        .collect();
    outboxd::claim::defer(&c, &rows).await.unwrap();
    let due: Vec<(String, bool)> = c
        .query(
            "SELECT message_key, run_after <= now() + interval '1 second' FROM outbox.messages \
             WHERE state = 'pending' ORDER BY message_key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        due,
        [
            ("closed:0".to_owned(), true),
            ("closed:1".to_owned(), false),
            ("open:0".to_owned(), false),
        ]
    );
}
