//! The overview's latency and backlog charts and its refresh, on the real binaries: `outboxd
//! run` delivering to a real receiver, `outboxd console` read over HTTP and in headless
//! Chromium.

use std::process::{Child, Stdio};
use std::time::{Duration, SystemTime};

use crate::common::binary::outboxd;
use crate::common::console::{Browser, Console, TOKEN, WAIT, get, sign_in};
use crate::common::receiver::{Receiver, Reply};
use crate::common::{TestDb, enqueue_webhook, wait_for_count, wait_until};

/// `outboxd run ARGS…` on `db`, private networks allowed (the receiver is on loopback);
/// killed when dropped.
struct Daemon(Child);

impl Daemon {
    fn start(db: &TestDb, args: &[&str]) -> Daemon {
        let child = outboxd(Some(&db.url()))
            .arg("run")
            .args(args)
            .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn outboxd run");
        Daemon(child)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The markup from the element with `id` to the end of its `</svg>` (a chart) or `</p>`.
fn element<'a>(page: &'a str, id: &str, end: &str) -> &'a str {
    let start = page
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in {page}"));
    let rest = &page[start..];
    &rest[..rest
        .find(end)
        .unwrap_or_else(|| panic!("no {end} after #{id}"))
        + end.len()]
}

/// The texts of the `<title>`s of a chart.
fn titles(svg: &str) -> Vec<&str> {
    svg.split("<title>")
        .skip(1)
        .map(|t| &t[..t.find("</title>").unwrap()])
        .collect()
}

/// The `data-seconds` values in `markup`, in order.
fn seconds(markup: &str) -> Vec<f64> {
    markup
        .split("data-seconds=\"")
        .skip(1)
        .map(|s| s[..s.find('"').unwrap()].parse().unwrap())
        .collect()
}

/// A duration as the charts write it (`2.3 ms`, `340 ms`, `1.2 s`, `4.5 min`, `2.0 h`),
/// in seconds.
fn read_duration(text: &str) -> f64 {
    let (n, unit) = text.trim().split_once(' ').unwrap();
    let n: f64 = n.parse().unwrap();
    n * match unit {
        "ms" => 0.001,
        "s" => 1.0,
        "min" => 60.0,
        "h" => 3600.0,
        other => panic!("unit {other:?} in {text:?}"),
    }
}

/// Real deliveries, each taking the receiver 400 ms, one of them enqueued 90 s before the
/// worker ran: the attempt chart shows what the receiver took, the end-to-end chart what
/// the application waited, and the minutes without deliveries are gaps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_attempt_and_end_to_end_latency_of_real_deliveries() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.script((0..4).map(|_| Reply::Slow(Duration::from_millis(400), 200)));
    for i in 0..4 {
        enqueue_webhook(&db, &format!("lat:{i}"), &rx.url("/h"), 3, true).await;
    }
    db.client()
        .await
        .execute(
            "UPDATE outbox.messages SET created_at = created_at - interval '90 seconds' \
             WHERE message_key = 'lat:0'",
            &[],
        )
        .await
        .unwrap();
    let daemon = Daemon::start(&db, &[]);
    wait_for_count(&db.client().await, "delivered", 4, WAIT).await;
    drop(daemon);

    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let page = get(&console.url("/"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();

    let attempt = element(&page, "latency-attempt", "</svg>");
    let deliveries: i64 = titles(attempt)
        .iter()
        .filter_map(|t| t.split_once(" (").map(|(_, n)| n))
        .map(|n| n.split(' ').next().unwrap().parse::<i64>().unwrap())
        .sum();
    assert_eq!(deliveries, 4, "{attempt}");
    assert!(
        titles(attempt)
            .iter()
            .filter(|t| t.ends_with(": no deliveries"))
            .count()
            >= 58,
        "the quiet minutes are gaps: {attempt}"
    );
    let [a50, a99] = seconds(element(&page, "latency-attempt-summary", "</p>"))[..] else {
        panic!("{page}")
    };
    assert!(
        (0.4..5.0).contains(&a50) && a50 <= a99 && a99 < 5.0,
        "the receiver took 400 ms: p50 {a50}, p99 {a99}"
    );

    let e2e = element(&page, "latency-e2e", "</svg>");
    let [e50, e99] = seconds(element(&page, "latency-e2e-summary", "</p>"))[..] else {
        panic!("{page}")
    };
    assert!(
        e50 >= a50 && e99 >= a99,
        "end to end includes the attempt: {e50} {e99} vs {a50} {a99}"
    );
    // The message that waited 90 s: interpolated with the others of its minute, or alone.
    let worst = titles(e2e)
        .iter()
        .filter_map(|t| t.split_once("p99 "))
        .map(|(_, rest)| read_duration(rest.split(" (").next().unwrap()))
        .fold(0.0, f64::max);
    assert!((80.0..300.0).contains(&worst), "{e2e}");
    assert!(
        titles(attempt)
            .iter()
            .filter_map(|t| t.split_once("p99 "))
            .all(|(_, rest)| read_duration(rest.split(" (").next().unwrap()) < 5.0),
        "the attempt never includes the wait: {attempt}"
    );
    // The deliveries-and-failures chart reads the same history.
    assert!(
        element(&page, "chart-summary", "</p>").contains("4 delivered"),
        "{page}"
    );
}

/// Messages due 150 s ago that no running worker serves: the page says so now (read live),
/// with no sample while no worker runs; once a worker that serves another channel runs, its
/// sampler records the minute, and the chart shows the age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_chart_shows_the_age_of_what_waits() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let due = SystemTime::now() - Duration::from_secs(150);
    for i in 0..3 {
        let msg = outboxd::NewMessage::webhook(
            format!("wait:{i}"),
            serde_json::json!({"url": "http://127.0.0.1:9/h", "body": {}}),
        )
        .run_after(due);
        outboxd::enqueue(&c, &msg).await.unwrap();
    }
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;

    let page = get(&console.url("/"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    let now = element(&page, "backlog-now", "</p>");
    assert!(seconds(now)[0] >= 150.0, "{now}");
    assert!(now.contains("<b class=\"due-count\">3</b>"), "{now}");
    let chart = element(&page, "backlog-chart", "</svg>");
    assert!(
        titles(chart)
            .iter()
            .all(|t| t.ends_with("no sample (no worker was running)")),
        "{chart}"
    );
    assert!(!chart.contains("class=\"backlog\""), "{chart}");

    // A worker for http only: the webhooks stay where they are, and it samples them.
    let daemon = Daemon::start(&db, &["--channels", "http"]);
    wait_until(WAIT, "a backlog sample", || {
        let c = &c;
        async move {
            let n: i64 = c
                .query_one("SELECT count(*) FROM outbox.backlog_samples", &[])
                .await
                .unwrap()
                .get(0);
            n > 0
        }
    })
    .await;
    let page = get(&console.url("/"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    drop(daemon);
    let chart = element(&page, "backlog-chart", "</svg>");
    let sampled: Vec<&str> = titles(chart)
        .into_iter()
        .filter(|t| t.contains("oldest due"))
        .collect();
    assert!(!sampled.is_empty(), "{chart}");
    for t in &sampled {
        let (_, rest) = t.split_once("oldest due ").unwrap();
        let (age, count) = rest.split_once(", ").unwrap();
        // Written to a tenth of a minute: at most 3 s off.
        assert!(read_duration(age) >= 147.0, "{t}");
        assert_eq!(count, "3 due", "{t}");
    }
    assert!(chart.contains("class=\"backlog\""), "{chart}");
    assert!(
        element(&page, "backlog-summary", "</p>").contains(" of 60 minutes sampled"),
        "{page}"
    );
    let state: String = db
        .scalar("SELECT string_agg(DISTINCT state, ',') FROM outbox.messages")
        .await;
    assert_eq!(state, "pending");
}

/// What a sample costs: one row a minute however many workers look and however often, and
/// no row older than a day, as the least-privileged worker role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_samples_are_one_row_a_minute_and_a_day_at_most() {
    let db = TestDb::new().await;
    let (_roles, _, worker) = crate::privileges::setup(&db).await;
    // Two days of old samples, as if the table had been left alone.
    db.client()
        .await
        .execute(
            "INSERT INTO outbox.backlog_samples (minute, due, oldest_due_seconds) \
             SELECT date_trunc('minute', now(), 'UTC') - i * interval '1 minute', 0, 0 \
             FROM generate_series(1, 2880) i",
            &[],
        )
        .await
        .unwrap();
    let worker = outboxd::db::Database::from_config(worker).unwrap();
    let pool = outboxd::db::pool(&worker, 4).unwrap();
    // Four workers, each looking five times.
    let mut looks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let pool = pool.clone();
        looks.spawn(async move {
            let c = pool.get().await.unwrap();
            let mut recorded = Vec::new();
            for _ in 0..5 {
                recorded.extend(outboxd::ops::sample_backlog(&**c).await.unwrap());
            }
            recorded
        });
    }
    let mut recorded: Vec<i64> = Vec::new();
    while let Some(r) = looks.join_next().await {
        recorded.extend(r.unwrap());
    }
    recorded.sort();
    let now: f64 = db
        .scalar("SELECT extract(epoch FROM date_trunc('minute', now(), 'UTC'))::float8")
        .await;
    // One minute, or two if the looks straddled a minute's end: one row each.
    assert!(
        (1..=2).contains(&recorded.len()) && recorded.windows(2).all(|w| w[0] < w[1]),
        "{recorded:?}"
    );
    assert_eq!(*recorded.last().unwrap(), now as i64);
    let (rows, oldest): (i64, f64) = {
        let r = db
            .client()
            .await
            .query_one(
                "SELECT count(*), extract(epoch FROM now() - min(minute))::float8 \
                 FROM outbox.backlog_samples",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert!(rows <= 24 * 60 + 2, "{rows} rows");
    assert!(oldest <= 86_400.0 + 120.0, "the oldest is {oldest} s old");
    // The console reads them with the same role.
    let c = pool.get().await.unwrap();
    let hour = outboxd::ops::backlog_per_minute(&**c).await.unwrap();
    assert_eq!(hour.len(), 60);
    assert!(hour.iter().all(|m| m.sample.is_some()), "{hour:?}");
}

/// The refresh is off unless asked for, takes only its listed values, and changes nothing
/// of the page's security headers.
#[tokio::test]
async fn the_refresh_is_a_meta_tag_only_when_asked_and_the_csp_stays() {
    let db = TestDb::new().await;
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let csp = outboxd::console::CONTENT_SECURITY_POLICY;
    for (path, meta) in [
        ("/", None),
        ("/?refresh=", None),
        ("/?refresh=10", Some("10")),
        ("/?refresh=30", Some("30")),
        ("/?refresh=60&page=2", Some("60")),
    ] {
        let res = get(&console.url(path), &s.cookie).await;
        assert_eq!(res.status(), 200, "{path}");
        assert_eq!(res.headers()["content-security-policy"], csp, "{path}");
        let page = res.text().await.unwrap();
        assert_eq!(
            page.matches("http-equiv").count(),
            meta.is_some() as usize,
            "{path}"
        );
        if let Some(n) = meta {
            assert!(
                page.contains(&format!("<meta http-equiv=\"refresh\" content=\"{n}\">")),
                "{path}: {page}"
            );
            assert!(
                page.contains(&format!("<b aria-current=\"true\">every {n} s</b>")),
                "{path}"
            );
        }
        assert!(!page.contains("<script"), "{path}");
    }
    let long = "9".repeat(20_000);
    for bad in [
        "7".to_owned(),
        "0".into(),
        "030".into(),
        "30s".into(),
        "-30".into(),
        "30;url=https://evil.example".into(),
        "30%0d%0aRefresh:%201".into(),
        "%3Cscript%3Ealert(1)%3C/script%3E".into(),
        "%FF%FE".into(),
        long,
    ] {
        let res = get(&console.url(&format!("/?refresh={bad}")), &s.cookie).await;
        assert_eq!(res.status(), 400, "{bad:.40}");
        assert_eq!(res.headers()["content-security-policy"], csp);
        assert!(res.headers().get("refresh").is_none());
        let page = res.text().await.unwrap();
        assert!(!page.contains("http-equiv"), "{bad:.40}");
        assert!(!page.contains("<script>"), "{page}");
        let line = element(&page, "error", "</p>");
        assert!(
            line.contains("refresh must be 10, 30 or 60 (seconds), or absent for none"),
            "{line}"
        );
        assert!(line.len() < 300, "the value is cut short: {line}");
    }
}

/// At a phone's width the overview, charts and all, fits without scrolling sideways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_with_its_charts_fits_a_phone() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    for i in 0..3 {
        enqueue_webhook(&db, &format!("phone:{i}"), &rx.url("/h"), 3, true).await;
    }
    let daemon = Daemon::start(&db, &[]);
    wait_for_count(&db.client().await, "delivered", 3, WAIT).await;
    let dbr = &db;
    wait_until(WAIT, "a backlog sample", || async move {
        dbr.scalar::<i64>("SELECT count(*) FROM outbox.backlog_samples")
            .await
            > 0
    })
    .await;
    drop(daemon);

    let console = Console::start(&db);
    let b = Browser::start(390, 844).await;
    b.sign_in(&console, "alice", TOKEN).await;
    b.wait_for("#counts").await;
    for path in ["/", "/?refresh=60"] {
        b.open(&console.url(path), "#backlog-chart").await;
        b.wait_for("#latency-attempt rect.p50").await;
        b.wait_for("#backlog-chart rect.backlog").await;
        let widths = b
            .client
            .execute(
                "return [document.documentElement.scrollWidth, document.documentElement.clientWidth];",
                vec![],
            )
            .await
            .unwrap();
        let widths: Vec<i64> = serde_json::from_value(widths).unwrap();
        assert!(
            widths[0] <= widths[1],
            "{path}: scrollWidth {} > clientWidth {}",
            widths[0],
            widths[1]
        );
    }
    b.close().await;
}
