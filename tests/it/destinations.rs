//! Rules per destination: the name they go by
//! (`outbox.destination_of`), `--host-concurrency` and rate limits.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::receiver::{Receiver, Reply};
use common::*;
use outboxd::claim;
use outboxd::model::Channel;

/// The destination of a webhook URL, as the insert trigger names it.
async fn destination(db: &TestDb, url: &serde_json::Value) -> Option<String> {
    db.client()
        .await
        .query_one(
            "SELECT outbox.destination_of('webhook', jsonb_build_object('url', $1::jsonb))",
            &[url],
        )
        .await
        .unwrap()
        .get(0)
}

/// One name per host and port: lower case, default ports dropped, never a credential, a
/// path or a query; hostile URLs give no name (the worker refuses them).
#[tokio::test]
async fn destination_is_the_host_and_port_and_nothing_else() {
    let db = TestDb::new().await;
    let cases: &[(&str, Option<&str>)] = &[
        (
            "https://Hooks.Slack.com/services/T0/B0?token=s3cret",
            Some("hooks.slack.com"),
        ),
        ("http://a.example:80/x", Some("a.example")),
        ("https://a.example:443", Some("a.example")),
        ("http://a.example:8080/x", Some("a.example:8080")),
        ("http://a.example:00080/", Some("a.example")),
        ("https://a.example:80/", Some("a.example:80")),
        ("https://user:p%40ss@b.example/x", Some("b.example")),
        ("https://user:p@ss@b.example:9443/x", Some("b.example:9443")),
        ("http://[::1]:9000/x", Some("[::1]:9000")),
        ("http://[::1]/", Some("[::1]")),
        ("https://c.example./a", Some("c.example")),
        ("https://c.example#frag", Some("c.example")),
        ("https://c.example?q=1", Some("c.example")),
        ("HTTPS://UP.EXAMPLE:443", Some("up.example")),
        ("not a url", None),
        ("https://", None),
        ("https:///path", None),
        ("https://bad\nhost/", None),
        ("https://bad\u{7}host/", None),
        ("https://bad host/", None),
        ("https://h.example:99999999/", None),
        ("https://h.example:80x/", None),
        ("https://\u{212a}.example/", None),
        ("https://b\u{fc}cher.example/", None),
    ];
    for (url, want) in cases {
        let got = destination(&db, &serde_json::json!(url)).await;
        assert_eq!(got.as_deref(), *want, "destination of {url:?}");
    }
    // Names of at most 1000 characters (outbox.destinations' check): a longer host made
    // the breakers' update of a whole batch fail. 995 characters of labels of 63.
    let long = format!(
        "{}{}",
        format!("{}.", "a".repeat(63)).repeat(15),
        "b".repeat(35)
    );
    assert_eq!(long.len(), 995);
    for (url, want) in [
        (format!("https://{long}/x"), Some(long.clone())),
        (
            format!("https://{long}:8443/x"),
            Some(format!("{long}:8443")),
        ),
        (format!("https://{long}:65000/x"), None),
        (format!("https://{long}bbbbbb/x"), None),
    ] {
        let got = destination(&db, &serde_json::json!(url)).await;
        assert_eq!(
            got,
            want,
            "destination of a host of {} characters",
            url.len()
        );
    }
    // Not a string, and not a webhook: no name.
    assert_eq!(destination(&db, &serde_json::json!(5)).await, None);
    let email: Option<String> = db
        .scalar("SELECT outbox.destination_of('email', '{\"url\": \"https://a.example\"}')")
        .await;
    assert_eq!(email, None);
    // A very long host is read in bounded time (no backtracking blow-up), and is no name:
    // longer than outbox.destinations holds.
    let long = format!("https://{}.example/", "a".repeat(100_000));
    let got = destination(&db, &serde_json::json!(long)).await;
    assert_eq!(got, None);
}

/// A host written so that the request would reach another host than the one named at
/// enqueue, or one with no name at all, is never sent: dead `invalid` at its first attempt,
/// with no request, its error naming the host the parser read and never the path. Each of
/// these once went out past every rule of its host (rate limit, cap, circuit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_written_another_way_is_refused_unsent() {
    let db = TestDb::new().await;
    let receiver = Receiver::start().await;
    let port = receiver.addr.port();
    let urls = [
        format!("http://127.0.0.1:{port}\\hook-secret"),
        format!("http://localhost.\\@127.0.0.1:{port}/hook-secret"),
        format!("http://127.1:{port}/hook-secret"),
        format!("http://0x7f.1:{port}/hook-secret"),
        format!(
            "http://127.0.0.1:{p1}\t{p2}/hook-secret",
            p1 = port / 10,
            p2 = port % 10
        ),
        format!("http://loc%61lhost:{port}/hook-secret"),
        format!("http://l\u{f6}calhost:{port}/hook-secret"),
    ];
    let c = db.client().await;
    for (i, url) in urls.iter().enumerate() {
        let payload = serde_json::json!({"url": url, "body": {}});
        outboxd::enqueue(
            &c,
            &outboxd::NewMessage::webhook(format!("odd:{i}"), payload),
        )
        .await
        .unwrap();
    }
    // One ordinary message beside them, so the run shows the receiver is reachable.
    let ok = serde_json::json!({"url": receiver.url("/ok"), "body": {}});
    outboxd::enqueue(&c, &outboxd::NewMessage::webhook("plain", ok))
        .await
        .unwrap();
    let cfg = outboxd::config::WorkerConfig {
        drain: true,
        ..test_worker_config("w")
    };
    let summary = RunningWorker::start(&db, cfg, test_webhook_config())
        .drained(std::time::Duration::from_secs(30))
        .await;
    assert_eq!(summary.delivered, 1);
    let rows = c
        .query(
            "SELECT message_key, state, error_class, last_error FROM outbox.messages \
             WHERE message_key LIKE 'odd:%' ORDER BY message_key",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), urls.len());
    for r in rows {
        let key: String = r.get(0);
        let error: String = r.get(3);
        assert_eq!(r.get::<_, String>(1), "dead", "{key}: {error}");
        assert_eq!(
            r.get::<_, Option<String>>(2).as_deref(),
            Some("invalid"),
            "{key}"
        );
        assert!(error.starts_with("url: "), "{key}: {error}");
        assert!(!error.contains("hook-secret"), "{key}: {error}");
    }
    let paths: Vec<String> = receiver
        .requests()
        .iter()
        .map(|r| r.uri.path().to_owned())
        .collect();
    assert_eq!(
        paths,
        vec!["/ok".to_owned()],
        "only the plain message reached a host"
    );
}

/// The insert names each webhook's destination and its lookup's once, whatever an INSERT
/// says for them, and the claim hands them over; e-mail has none.
#[tokio::test]
async fn the_insert_names_each_destination_and_the_claim_reads_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for (key, payload) in [
        (
            "a",
            serde_json::json!({"url": "https://A.example:8443/p?q=1", "body": {}}),
        ),
        (
            "b",
            serde_json::json!({"url": "http://b.example/x", "reconcile": {"url": "https://L.example/ops?k=1"}}),
        ),
    ] {
        outboxd::enqueue(&c, &outboxd::NewMessage::webhook(key, payload))
            .await
            .unwrap();
    }
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload, destination, lookup_destination) \
         VALUES ('c', 'webhook', '{\"url\": \"https://c.example/\"}', 'elsewhere', 'x'), \
                ('e', 'email', '{\"to\": \"a@example.com\", \"text\": \"t\"}', 'elsewhere', NULL)",
        &[],
    )
    .await
    .unwrap();
    let batch = claim::claim(
        &c,
        &[Channel::Webhook, Channel::Email],
        10,
        "w",
        std::time::Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut got: Vec<_> = batch
        .iter()
        .map(|m| {
            (
                m.key.clone(),
                m.destination.clone(),
                m.lookup_destination.clone(),
                m.reconcile,
            )
        })
        .collect();
    got.sort();
    let s = |v: &str| Some(v.to_owned());
    assert_eq!(
        got,
        vec![
            ("a".into(), s("a.example:8443"), None, false),
            ("b".into(), s("b.example"), s("l.example"), true),
            ("c".into(), s("c.example"), None, false),
            ("e".into(), None, None, false),
        ]
    );
}

/// Where a message goes is fixed with it: an UPDATE of its destination (or of anything
/// the destination is named from) is refused, and the row keeps what it had.
#[tokio::test]
async fn a_messages_destination_cannot_be_changed_by_hand() {
    let db = TestDb::new().await;
    let c = db.client().await;
    outboxd::enqueue(
        &c,
        &outboxd::NewMessage::webhook("d", serde_json::json!({"url": "https://d.example/x"})),
    )
    .await
    .unwrap();
    for sql in [
        "UPDATE outbox.messages SET destination = 'other.example'",
        "UPDATE outbox.messages SET lookup_destination = 'other.example'",
        "UPDATE outbox.messages SET payload = '{\"url\": \"https://other.example/x\"}'",
    ] {
        let e = c.execute(sql, &[]).await.unwrap_err();
        assert_eq!(e.code().map(|c| c.code()), Some("23514"), "{sql}: {e:?}");
    }
    let d: Option<String> = db.scalar("SELECT destination FROM outbox.messages").await;
    assert_eq!(d.as_deref(), Some("d.example"));
}

/// Deliveries to `receiver` recorded as delivered in the database.
async fn delivered_to(db: &TestDb, prefix: &str) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE state = 'delivered' AND message_key LIKE $1",
            &[&format!("{prefix}%")],
        )
        .await
        .unwrap()
        .get(0)
}

/// Enqueues `n` webhooks to `url`, keys `{prefix}{i}`, in one call.
async fn enqueue_to(db: &TestDb, prefix: &str, url: &str, n: usize) {
    let msgs: Vec<_> = (0..n)
        .map(|i| {
            outboxd::NewMessage::webhook(
                format!("{prefix}{i}"),
                serde_json::json!({"url": url, "body": {"i": i}}),
            )
        })
        .collect();
    outboxd::enqueue_many(&db.client().await, &msgs)
        .await
        .unwrap();
}

/// Seconds until every `fast:` message is delivered, with `stalled` stalled messages ahead
/// of them in the queue (0: none), under `--host-concurrency cap`.
async fn drain_fast(
    cap: usize,
    stalled: usize,
    fast: &Receiver,
    slow: &Receiver,
) -> (f64, TestDb, outboxd::worker::RunSummary) {
    let db = TestDb::new().await;
    // The stalled host's rows come first in the queue, so without a cap they take every slot.
    enqueue_to(&db, "slow:", &slow.url("/hook?token=s3cret"), stalled).await;
    enqueue_to(&db, "fast:", &fast.url("/hook"), FAST).await;
    let mut cfg = test_worker_config("w");
    cfg.concurrency = 8;
    cfg.limits.host_concurrency = cap;
    let t0 = std::time::Instant::now();
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    wait_until(
        std::time::Duration::from_secs(120),
        "every fast message delivered",
        || {
            let db = &db;
            async move { delivered_to(db, "fast:").await == FAST as i64 }
        },
    )
    .await;
    let took = t0.elapsed().as_secs_f64();
    let summary = worker.stop().await;
    (took, db, summary)
}

const FAST: usize = 300;

/// A receiver that stalls for the whole timeout holds at most `--host-concurrency` slots;
/// a fast receiver beside it keeps flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_host_holds_at_most_its_cap_and_the_others_keep_flowing() {
    let fast = Receiver::start().await;
    let slow = Receiver::start().await;
    // Longer than the 2 s webhook timeout: every request to it times out.
    slow.set_default(Reply::Stall(std::time::Duration::from_secs(60)));
    let (alone, _, _) = drain_fast(2, 0, &fast, &slow).await;
    let (mixed, db, summary) = drain_fast(2, 100, &fast, &slow).await;
    let ratio = alone / mixed;
    eprintln!(
        "fast host: {FAST} messages in {alone:.2} s alone, {mixed:.2} s beside a stalled host \
         with --host-concurrency 2 of --concurrency 8: throughput ratio {ratio:.2}"
    );
    // Never more than two requests in flight to the stalled host: each one lasts the 2 s
    // timeout, so no three start within less than that.
    let mut starts: Vec<_> = slow.requests().iter().map(|r| r.at).collect();
    starts.sort();
    assert!(!starts.is_empty(), "the stalled host was tried");
    for w in starts.windows(3) {
        let span = w[2] - w[0];
        assert!(
            span >= std::time::Duration::from_millis(1800),
            "three requests to the stalled host within {span:?}"
        );
    }
    // Without the cap the stalled host's 100 rows hold all 8 slots for 2 s each (25 s before
    // the fast ones get through); with it the fast host keeps most of its speed. The issue's
    // figure (within 20 %) is printed above; the assertion leaves room for a loaded machine.
    assert!(
        ratio >= 0.5,
        "the fast host slowed to {ratio:.2} of its speed alone"
    );
    // The deferrals cost the stalled messages nothing: every counted attempt is one with a
    // history row (a deferral makes neither), and every request was a counted attempt.
    let c = db.client().await;
    let row = c
        .query_one(
            "SELECT coalesce(sum(attempts), 0)::bigint, \
                    (SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m \
                       ON m.id = a.message_id \
                      WHERE m.message_key LIKE 'slow:%' AND a.outcome <> 'released') \
             FROM outbox.messages WHERE message_key LIKE 'slow:%'",
            &[],
        )
        .await
        .unwrap();
    let (counted, history): (i64, i64) = (row.get(0), row.get(1));
    let requests = slow.requests().len() as i64;
    assert_eq!(counted, history, "attempts counted against history rows");
    assert!(
        requests <= counted,
        "{requests} requests but {counted} attempts counted"
    );
    assert!(summary.deferred > 0, "no message was deferred: {summary:?}");
}

/// `5/s` holds within one over any 3 s, with 50 messages due at once; each message is
/// counted once and has one history row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_of_five_a_second_holds() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let other = Receiver::start().await;
    enqueue_to(&db, "r:", &rx.url("/hook"), 50).await;
    enqueue_to(&db, "o:", &other.url("/hook"), 20).await;
    let mut cfg = test_worker_config("w");
    // A poll interval longer than the rate's spacing: the deferred messages come back on
    // time because the loop wakes when they are due.
    cfg.poll_interval = std::time::Duration::from_secs(1);
    cfg.limits.rate_limits =
        outboxd::config::limits::RateLimits::parse(&format!("{}=5/s", rx.addr)).unwrap();
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    // The other host is not limited.
    other.wait_for(20, std::time::Duration::from_secs(10)).await;
    let first = rx.wait_for(1, std::time::Duration::from_secs(10)).await[0].at;
    wait_until(
        std::time::Duration::from_secs(10),
        "3.5 s after the first request",
        || async move { first.elapsed() >= std::time::Duration::from_millis(3500) },
    )
    .await;
    let got: Vec<_> = rx.requests().iter().map(|r| r.at - first).collect();
    let in_3s = got
        .iter()
        .filter(|d| **d < std::time::Duration::from_secs(3))
        .count();
    eprintln!(
        "5/s: {in_3s} requests in the first 3 s, {} in 3.5 s: {got:?}",
        got.len()
    );
    assert!((14..=16).contains(&in_3s), "{in_3s} requests in 3 s at 5/s");
    // Any 3 s window, not just the first.
    for (i, start) in got.iter().enumerate() {
        let n = got[i..]
            .iter()
            .filter(|d| **d - *start < std::time::Duration::from_secs(3))
            .count();
        assert!(n <= 16, "{n} requests in the 3 s from {start:?}");
    }
    worker.stop().await;
    let c = db.client().await;
    let row = c
        .query_one(
            "SELECT coalesce(max(attempts), 0), \
                    (SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m \
                       ON m.id = a.message_id WHERE m.message_key LIKE 'r:%' \
                       AND a.outcome <> 'released'), \
                    count(*) FILTER (WHERE state = 'delivered') \
             FROM outbox.messages WHERE message_key LIKE 'r:%'",
            &[],
        )
        .await
        .unwrap();
    // A row the stop gave back (claimed, waiting for its token) has a `released` row: not a
    // deferral's.
    let (max_attempts, history, delivered): (i32, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(max_attempts, 1, "a deferral is not an attempt");
    assert_eq!(
        history, delivered,
        "one history row per delivered message, none per deferral"
    );
}

// ---------------------------------------------------------------------------------------
// Reconciliation lookups under the limits: a lookup is a request to its own host
// ---------------------------------------------------------------------------------------

/// Enqueues one webhook per URL in `urls` (keys `{prefix}{i}`), each naming the lookup
/// `lookup`, and leaves them as an ambiguous first attempt would (one attempt counted,
/// class `ambiguous`): the worker's next attempt of each asks the lookup first.
async fn enqueue_after_ambiguous(db: &TestDb, prefix: &str, urls: &[String], lookup: &str) {
    let msgs: Vec<_> = urls
        .iter()
        .enumerate()
        .map(|(i, url)| {
            outboxd::NewMessage::webhook(
                format!("{prefix}{i}"),
                serde_json::json!({"url": url, "body": {"i": i}, "reconcile": {"url": lookup}}),
            )
        })
        .collect();
    let c = db.client().await;
    outboxd::enqueue_many(&c, &msgs).await.unwrap();
    c.execute(
        "UPDATE outbox.messages SET attempts = 1, error_class = 'ambiguous', \
                last_error = 'timed out' WHERE message_key LIKE $1",
        &[&format!("{prefix}%")],
    )
    .await
    .unwrap();
}

/// Waits until every message of `prefix` (`n` of them) is delivered.
async fn wait_delivered(db: &TestDb, prefix: &str, n: i64) {
    wait_until(
        std::time::Duration::from_secs(30),
        &format!("{n} {prefix} messages delivered"),
        || async move { delivered_to(db, prefix).await == n },
    )
    .await;
}

/// The arrival times of `requests`, in order.
fn arrivals(requests: &[common::receiver::Recorded]) -> Vec<std::time::Instant> {
    let mut at: Vec<_> = requests.iter().map(|r| r.at).collect();
    at.sort();
    at
}

/// A lookup takes a token of its own host's rate limit, not of the webhook's: four
/// messages whose lookups are due at once, to a lookup service limited to `1/s` (the
/// webhooks' host has no limit), do not send four lookups within a second. They were all
/// sent within milliseconds, under the webhooks' host's (absent) limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_lookups_keep_their_own_hosts_rate_limit() {
    let db = TestDb::new().await;
    let hooks = Receiver::start().await;
    let lookups = Receiver::start().await;
    // Found: each message is reconciled and no webhook is sent again.
    lookups.set_default(Reply::Status(200));
    let urls: Vec<String> = (0..4).map(|_| hooks.url("/hook")).collect();
    enqueue_after_ambiguous(&db, "rl:", &urls, &lookups.url("/lookup")).await;
    let mut cfg = test_worker_config("w");
    cfg.limits.rate_limits =
        outboxd::config::limits::RateLimits::parse(&format!("{}=1/s", lookups.addr)).unwrap();
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    wait_delivered(&db, "rl:", 4).await;
    worker.stop().await;
    assert!(
        hooks.requests().is_empty(),
        "every lookup found its operation"
    );
    let at = arrivals(&lookups.requests());
    eprintln!(
        "lookups at 1/s: {:?}",
        at.iter().map(|t| *t - at[0]).collect::<Vec<_>>()
    );
    assert_eq!(at.len(), 4, "one lookup per message");
    // At 1/s a request may come early by less than one interval, so any three span more
    // than a second and four more than two; the margins are for a loaded machine.
    for w in at.windows(3) {
        let span = w[2] - w[0];
        assert!(
            span >= std::time::Duration::from_millis(600),
            "three lookups within {span:?}"
        );
    }
    let span = at[3] - at[0];
    assert!(
        span >= std::time::Duration::from_millis(1500),
        "four lookups within {span:?}"
    );
}

/// A lookup takes a place of its own host under `--host-concurrency`: with a cap of 1,
/// lookups are never in flight together to the lookup service, although each message's
/// webhook goes to a destination of its own (a port nothing listens on: every lookup finds
/// its operation, so no webhook is sent). The lookups took their webhooks' places, and all
/// four were in flight at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_lookups_keep_their_own_hosts_concurrency_cap() {
    let db = TestDb::new().await;
    let lookups = Receiver::start().await;
    lookups.set_default(Reply::Slow(std::time::Duration::from_millis(300), 200));
    let urls: Vec<String> = (1..=4)
        .map(|port| format!("http://127.0.0.1:{port}/hook"))
        .collect();
    enqueue_after_ambiguous(&db, "cap:", &urls, &lookups.url("/lookup")).await;
    let mut cfg = test_worker_config("w");
    cfg.limits.host_concurrency = 1;
    let worker = RunningWorker::start(&db, cfg, test_webhook_config());
    wait_delivered(&db, "cap:", 4).await;
    worker.stop().await;
    assert_eq!(lookups.requests().len(), 4, "one lookup per message");
    assert_eq!(
        lookups.max_inflight(),
        1,
        "lookups in flight together to one host under --host-concurrency 1"
    );
}

/// A lookup and the request it lets through (it answered 404: the earlier attempt did not
/// take effect) each take a token: under `127.0.0.1=1/s`, which covers both the lookup
/// service and the webhooks' receiver (any port), three such messages make six requests,
/// and six requests at 1/s span at least four seconds. Sharing one token, a lookup and its
/// request went out together, and the six took two seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_and_the_request_after_it_each_take_a_token() {
    let db = TestDb::new().await;
    let hooks = Receiver::start().await;
    let lookups = Receiver::start().await;
    lookups.set_default(Reply::Status(404));
    hooks.set_default(Reply::Status(200));
    let urls: Vec<String> = (0..3).map(|_| hooks.url("/hook")).collect();
    enqueue_after_ambiguous(&db, "tok:", &urls, &lookups.url("/lookup")).await;
    let mut cfg = test_worker_config("w");
    cfg.limits.rate_limits = outboxd::config::limits::RateLimits::parse("127.0.0.1=1/s").unwrap();
    // A timeout of 5 s: the request after a lookup waits for its token inside the attempt,
    // for up to half the timeout.
    let webhook = outboxd::deliver::webhook::settings::WebhookConfig {
        timeout: std::time::Duration::from_secs(5),
        ..test_webhook_config()
    };
    let worker = RunningWorker::start(&db, cfg, webhook);
    wait_delivered(&db, "tok:", 3).await;
    worker.stop().await;
    for i in 0..3 {
        let key = format!("tok:{i}");
        let (asked, sent) = (lookups.requests_for(&key), hooks.requests_for(&key));
        assert_eq!(
            (asked.len(), sent.len()),
            (1, 1),
            "{key}: one lookup, one request"
        );
        assert!(
            sent[0].at >= asked[0].at,
            "{key}: the request after the lookup"
        );
    }
    let mut all = lookups.requests();
    all.extend(hooks.requests());
    let at = arrivals(&all);
    eprintln!(
        "lookups and requests at 1/s: {:?}",
        at.iter().map(|t| *t - at[0]).collect::<Vec<_>>()
    );
    // Request k comes at least k - 2 intervals after the first (one may come early by
    // less than an interval): six span four seconds; half a second of margin.
    let span = at[5] - at[0];
    assert!(
        span >= std::time::Duration::from_millis(3500),
        "six requests at 1/s within {span:?}"
    );
}
