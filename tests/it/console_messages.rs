//! The console's second round: `/messages` (every state, its filters, paging by id deep in
//! 100 000 rows, its actions on ticked rows), `/endpoints` (names of secrets, never a
//! value), relative times, the message page's key window and stored response, and pages
//! that fit a phone. The real binary on a real database, a plain HTTP client, and headless
//! Chromium for what only a browser can tell (overflow at 390 px).

use std::time::Duration;

use serde_json::json;
use tokio_postgres::types::{ToSql, Type};

use crate::common::console::{Browser, Console, TOKEN, WAIT, form, get, post_form, sign_in};
use crate::common::receiver::{Receiver, Reply};
use crate::common::{
    RunningWorker, TestDb, test_webhook_config, test_worker_config, wait_for_state,
};

/// The ids of the listed rows, in page order.
fn ids_on(page: &str) -> Vec<i64> {
    page.match_indices("<tr data-id=\"")
        .map(|(i, m)| {
            let rest = &page[i + m.len()..];
            rest[..rest.find('"').unwrap()].parse().unwrap()
        })
        .collect()
}

/// The one line of an error page.
fn error_line(page: &str) -> String {
    let start = page.find("<p id=\"error\">").expect("an error page") + "<p id=\"error\">".len();
    let end = start + page[start..].find("</p>").unwrap();
    page[start..end].to_owned()
}

/// The `href` of the link with this id, `&amp;` read back as `&`.
fn link(page: &str, id: &str) -> Option<String> {
    let at = page.find(&format!("id=\"{id}\""))?;
    let tag_start = page[..at].rfind('<')?;
    let tag = &page[tag_start..at + page[at..].find('>')?];
    let h = tag.find("href=\"")? + "href=\"".len();
    Some(tag[h..h + tag[h..].find('"')?].replace("&amp;", "&"))
}

async fn text(console: &Console, cookie: &str, path: &str) -> (u16, String) {
    let res = get(&console.url(path), cookie).await;
    let status = res.status().as_u16();
    (status, res.text().await.unwrap())
}

async fn webhook(db: &TestDb, key: &str, url: &str, held: bool) -> i64 {
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(key, json!({"url": url, "body": {"k": 1}})).held(held);
    outboxd::enqueue(&c, &msg).await.unwrap().id
}

async fn http(db: &TestDb, key: &str, endpoint: &str) -> i64 {
    let c = db.client().await;
    let msg = outboxd::NewMessage::http(key, json!({"endpoint": endpoint, "path": "/v1/refunds"}));
    outboxd::enqueue(&c, &msg).await.unwrap().id
}

/// Sets a row's state by hand, with the columns each state's constraints ask for.
async fn set_state(db: &TestDb, id: i64, state: &str) {
    let sql = match state {
        "delivered" => {
            "UPDATE outbox.messages SET state = 'delivered', attempts = 1, delivered_at = now() WHERE id = $1"
        }
        "dead" => {
            "UPDATE outbox.messages SET state = 'dead', attempts = 1, dead_at = now(), \
             error_class = 'permanent', last_error = 'HTTP 422 from api.provider.example' WHERE id = $1"
        }
        "cancelled" => {
            "UPDATE outbox.messages SET state = 'cancelled', cancelled_at = now() WHERE id = $1"
        }
        "running" => {
            "UPDATE outbox.messages SET state = 'running', attempts = 1, lease_owner = 'w1', \
             lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute' WHERE id = $1"
        }
        other => panic!("no such state here: {other}"),
    };
    db.client().await.execute(sql, &[&id]).await.unwrap();
}

async fn set_endpoint(db: &TestDb, args: &str) {
    db.client()
        .await
        .execute(&format!("SELECT outbox.set_endpoint({args})"), &[])
        .await
        .unwrap();
}

#[tokio::test]
async fn messages_lists_every_state_newest_first_and_filters_by_each_parameter() {
    let db = TestDb::new().await;
    set_endpoint(&db, "'prov', 'https://api.provider.example/v1'").await;
    set_endpoint(&db, "'other', 'https://api.other.example'").await;
    let pending = webhook(&db, "order-1:paid", "https://a.example/h", false).await;
    let held = webhook(&db, "order-2:paid", "https://b.example:8443/h", true).await;
    let delivered = webhook(&db, "order-10:paid", "https://a.example/h", false).await;
    set_state(&db, delivered, "delivered").await;
    let dead = http(&db, "refund-1", "prov").await;
    set_state(&db, dead, "dead").await;
    let other = http(&db, "refund-2", "other").await;
    let c = db.client().await;
    let mail = outboxd::NewMessage::email(
        "mail-1",
        json!({"from": "shop@example.com", "to": ["c@example.com"], "subject": "s", "text": "t"}),
    );
    let cancelled = outboxd::enqueue(&c, &mail).await.unwrap().id;
    set_state(&db, cancelled, "cancelled").await;
    // `%` and `_` are themselves in a prefix, not LIKE's wildcards.
    let running = webhook(&db, "100%_sure:1", "https://c.example/h", false).await;
    set_state(&db, running, "running").await;
    c.execute(
        "UPDATE outbox.messages SET created_at = now() - interval '3 days' WHERE id = $1",
        &[&running],
    )
    .await
    .unwrap();
    let lookalike = webhook(&db, "100x_sure", "https://c.example/h", false).await;

    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let (status, all) = text(&console, &s.cookie, "/messages").await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(
        ids_on(&all),
        vec![
            lookalike, running, cancelled, other, dead, delivered, held, pending
        ],
        "every state, newest first"
    );
    assert!(all.contains("8 messages match"), "{all}");
    for (query, want) in [
        ("state=dead", vec![dead]),
        ("state=running", vec![running]),
        ("state=held", vec![held]),
        ("state=cancelled", vec![cancelled]),
        ("channel=http", vec![other, dead]),
        ("channel=email", vec![cancelled]),
        ("q=order-1", vec![delivered, pending]),
        ("q=order-1%3Apaid", vec![pending]),
        ("q=100%25_", vec![running]),
        ("q=100", vec![lookalike, running]),
        ("q=zzz", vec![]),
        (
            "since=1d",
            vec![lookalike, cancelled, other, dead, delivered, held, pending],
        ),
        ("destination=b.example%3A8443", vec![held]),
        ("destination=a.example", vec![delivered, pending]),
        ("destination=api.provider.example", vec![dead]),
        ("endpoint=prov", vec![dead]),
        ("endpoint=other", vec![other]),
        ("endpoint=prov&state=pending", vec![]),
        ("channel=webhook&q=order-&state=pending", vec![pending]),
        (
            "state=&channel=&q=",
            vec![
                lookalike, running, cancelled, other, dead, delivered, held, pending,
            ],
        ),
    ] {
        let (status, page) = text(&console, &s.cookie, &format!("/messages?{query}")).await;
        assert_eq!(status, 200, "{query}: {page}");
        assert_eq!(ids_on(&page), want, "{query}");
        let n = want.len();
        let count = if n == 1 {
            "1 message matches".to_owned()
        } else {
            format!("{n} messages match")
        };
        assert!(page.contains(&count), "{query}: {count}");
    }
    // The form shows the filter it applied, and each row links to its message page.
    let (_, page) = text(&console, &s.cookie, "/messages?q=order-1&state=pending").await;
    assert!(page.contains("value=\"order-1\""), "{page}");
    assert!(
        page.contains("<option value=\"pending\" selected>"),
        "{page}"
    );
    assert!(page.contains(&format!("href=\"/message/{pending}\"")));
    let (status, msg) = text(&console, &s.cookie, &format!("/messages/{pending}")).await;
    assert_eq!(status, 200);
    assert!(msg.contains("order-1:paid"));
    // Only rows an action can take have a box to tick.
    assert!(all.contains(&format!("value=\"{dead}\" aria-label")));
    assert!(!all.contains(&format!("value=\"{delivered}\" aria-label")));
    // The overview's counts lead here.
    let (_, overview) = text(&console, &s.cookie, "/").await;
    assert!(
        overview.contains("href=\"/messages?state=dead\""),
        "{overview}"
    );
    assert!(
        overview.contains("href=\"/messages?state=cancelled&amp;channel=email\""),
        "{overview}"
    );
    assert!(overview.contains("href=\"/messages\""), "the nav links it");
}

#[tokio::test]
async fn bad_parameters_get_a_one_line_400_and_never_a_500() {
    let db = TestDb::new().await;
    webhook(&db, "k:1", "https://a.example/h", false).await;
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let long = "a".repeat(10_000);
    for (query, want) in [
        ("state=gone".to_owned(), "unknown state \"gone\""),
        (
            "state=%3Cscript%3E".to_owned(),
            "unknown state \"<script>\"",
        ),
        ("channel=sms".to_owned(), "unknown channel \"sms\""),
        ("since=yesterday".to_owned(), "since must be a duration"),
        ("since=-5m".to_owned(), "since must be a duration"),
        ("since=99999999d".to_owned(), "since must be a duration"),
        (
            "q=a%0Ab".to_owned(),
            "q: a key prefix has no control characters (U+000A at character 2)",
        ),
        ("q=%E2%80%AEevil".to_owned(), "(U+202E at character 1)"),
        ("q=a%00".to_owned(), "(U+0000 at character 2)"),
        (
            format!("q={long}"),
            "q: a key prefix is at most 255 characters (got 10000)",
        ),
        (
            "destination=h%1B%5B31m".to_owned(),
            "destination: a destination has no control characters",
        ),
        (
            format!("endpoint={long}"),
            "endpoint: an endpoint's name is at most 63 characters",
        ),
        ("before=abc".to_owned(), "before must be a message id"),
        ("after=-1".to_owned(), "after must be a message id"),
        (
            "before=99999999999999999999".to_owned(),
            "before must be a message id",
        ),
        (
            "before=5&after=3".to_owned(),
            "give before or after, not both",
        ),
    ] {
        let (status, page) = text(&console, &s.cookie, &format!("/messages?{query}")).await;
        assert_eq!(status, 400, "{query}: {page}");
        let line = error_line(&page);
        let shown = line
            .replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
        assert!(shown.contains(want), "{query}: {line}");
        assert!(
            !line.contains('\n') && line.len() < 300,
            "one short line: {line}"
        );
        assert!(!page.contains("<script>"), "{page}");
    }
    // Invalid percent-encoding is read as the replacement character, not a failure.
    let (status, _) = text(&console, &s.cookie, "/messages?q=%FF").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_hostile_key_and_error_are_shown_as_text() {
    let db = TestDb::new().await;
    let key = "<script>alert(1)</script>:<img src=x onerror=alert(2)>";
    let id = webhook(&db, key, "https://a.example/h", false).await;
    db.client()
        .await
        .execute(
            "UPDATE outbox.messages SET state = 'dead', attempts = 1, dead_at = now(), \
             error_class = 'permanent', last_error = $2 WHERE id = $1",
            &[
                &id,
                &"HTTP 400: <iframe src=javascript:alert(3)>\u{202e}gpj.exe\n\u{1b}[2J",
            ],
        )
        .await
        .unwrap();
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    for path in [
        "/messages",
        "/messages?state=dead",
        "/messages?q=%3Cscript%3E",
    ] {
        let (status, page) = text(&console, &s.cookie, path).await;
        assert_eq!(status, 200);
        assert_eq!(ids_on(&page), vec![id], "{path}");
        for raw in [
            "<script>alert",
            "<img src=x",
            "<iframe",
            "\u{202e}",
            "\u{1b}",
        ] {
            assert!(!page.contains(raw), "{path}: {raw:?} reached the page raw");
        }
        assert!(
            page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{page}"
        );
        assert!(
            page.contains("&lt;iframe src=javascript:alert(3)&gt;\\u{202e}gpj.exe\\n\\u{1b}[2J"),
            "{page}"
        );
    }
}

#[tokio::test]
async fn ticked_dead_rows_are_acted_on_from_messages_and_a_row_the_action_does_not_take_is_refused_first()
 {
    let db = TestDb::new().await;
    let a = webhook(&db, "tick:a", "https://a.example/h", false).await;
    let b = webhook(&db, "tick:b", "https://a.example/h", false).await;
    let done = webhook(&db, "tick:done", "https://a.example/h", false).await;
    let held = webhook(&db, "tick:held", "https://a.example/h", true).await;
    for id in [a, b] {
        set_state(&db, id, "dead").await;
    }
    set_state(&db, done, "delivered").await;
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let (_, page) = text(&console, &s.cookie, "/messages?state=dead").await;
    assert!(page.contains("name=\"from\" value=\"messages\""));
    assert!(page.contains("id=\"replay-selected\"") && !page.contains("id=\"approve-selected\""));
    let (_, page) = text(&console, &s.cookie, "/messages?state=held").await;
    assert!(page.contains("id=\"approve-selected\"") && !page.contains("id=\"replay-selected\""));

    let post = |pairs: Vec<(&'static str, String)>| {
        let url = console.url("/action");
        let cookie = s.cookie.clone();
        let csrf = s.csrf.clone();
        async move {
            let mut all: Vec<(&str, &str)> = vec![("csrf", &csrf)];
            all.extend(pairs.iter().map(|(k, v)| (*k, v.as_str())));
            let res = post_form(&url, Some(&cookie), form(&all)).await;
            let status = res.status().as_u16();
            (status, res.text().await.unwrap())
        }
    };
    let states = || async {
        db.scalar::<String>(
            "SELECT string_agg(message_key || '=' || state, ',' ORDER BY id) FROM outbox.messages",
        )
        .await
    };
    let before = states().await;

    // A delivered row ticked with dead ones: refused before the confirmation, in the SQL
    // function's words, and nothing changes.
    let (status, page) = post(vec![
        ("from", "messages".into()),
        ("do", "replay:selected".into()),
        ("id", a.to_string()),
        ("id", done.to_string()),
    ])
    .await;
    assert_eq!(status, 409, "{page}");
    let line = error_line(&page);
    assert!(
        line.contains("not dead, so not replayed") && line.contains("tick:done"),
        "{line}"
    );
    assert!(!page.contains("id=\"do-it\""));
    // Approve on a dead row, confirm on one that is not ambiguous: the same.
    let (status, page) = post(vec![
        ("from", "messages".into()),
        ("do", "approve:selected".into()),
        ("id", a.to_string()),
    ])
    .await;
    assert_eq!(status, 409);
    assert!(
        error_line(&page).contains("not held, so not approved"),
        "{page}"
    );
    let (status, page) = post(vec![
        ("from", "messages".into()),
        ("do", "confirm:selected".into()),
        ("id", b.to_string()),
    ])
    .await;
    assert_eq!(status, 409);
    assert!(
        error_line(&page).contains("not dead with class ambiguous"),
        "{page}"
    );
    // "Everything the filter matches" does not apply to this page's rows.
    let (status, page) = post(vec![
        ("from", "messages".into()),
        ("do", "cancel:filter".into()),
        ("state", "dead".into()),
    ])
    .await;
    assert_eq!(status, 400, "{page}");
    assert_eq!(states().await, before, "nothing changed");
    assert_eq!(
        db.scalar::<i64>("SELECT count(*) FROM outbox.attempts")
            .await,
        0,
        "no history row was left by the refusals"
    );

    // The two dead rows: the confirmation lists them with their state, then replays them.
    let (status, page) = post(vec![
        ("from", "messages".into()),
        ("do", "replay:selected".into()),
        ("id", a.to_string()),
        ("id", b.to_string()),
    ])
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("replays <b>2 messages</b>"), "{page}");
    let seen: Vec<(&'static str, String)> = page
        .match_indices("name=\"seen\" value=\"")
        .map(|(i, m)| {
            let rest = &page[i + m.len()..];
            ("seen", rest[..rest.find('"').unwrap()].to_owned())
        })
        .collect();
    assert_eq!(seen.len(), 2);
    let mut pairs = vec![
        ("do", "replay:selected".to_owned()),
        ("confirmed", "yes".to_owned()),
        ("id", a.to_string()),
        ("id", b.to_string()),
    ];
    pairs.extend(seen);
    let (status, page) = post(pairs).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("replayed 2 message(s)"), "{page}");
    assert_eq!(
        states().await,
        "tick:a=pending,tick:b=pending,tick:done=delivered,tick:held=held"
    );
    let actor: String = db
        .scalar("SELECT string_agg(DISTINCT worker, ',') FROM outbox.attempts WHERE outcome = 'replayed'")
        .await;
    assert_eq!(actor, "console:alice");
    let _ = held;
}

/// Keyset paging deep into 100 000 rows, and the plans that keep it cheap: a page far down
/// reads the primary key from its cursor (no sort, no offset), a key prefix reads the
/// unique index on `message_key`, and the count stops at its cap.
#[tokio::test]
async fn paging_by_id_stays_cheap_deep_into_100000_rows_and_a_key_prefix_reads_the_index() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (message_key, channel, payload) \
         SELECT 'bulk:' || lpad(g::text, 6, '0'), 'webhook', \
                jsonb_build_object('url', 'https://bulk.example/h', 'body', g) \
         FROM generate_series(1, 100000) g; \
         ANALYZE outbox.messages;",
    )
    .await
    .unwrap();
    let max: i64 = db.scalar("SELECT max(id) FROM outbox.messages").await;
    let min: i64 = db.scalar("SELECT min(id) FROM outbox.messages").await;

    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let (_, first) = text(&console, &s.cookie, "/messages").await;
    assert!(first.contains("More than 10000 messages match"), "{first}");
    assert_eq!(ids_on(&first), (max - 49..=max).rev().collect::<Vec<_>>());
    assert!(link(&first, "newer").is_none());
    let older = link(&first, "older").expect("an older page");
    assert_eq!(older, format!("/messages?before={}", max - 49));
    let (_, second) = text(&console, &s.cookie, &older).await;
    assert_eq!(
        ids_on(&second),
        (max - 99..=max - 50).rev().collect::<Vec<_>>()
    );
    // Back up: the page just newer than the second is the first.
    let newer = link(&second, "newer").expect("a newer page");
    let (_, back) = text(&console, &s.cookie, &newer).await;
    assert_eq!(ids_on(&back), ids_on(&first));
    assert!(
        link(&back, "newer").is_none(),
        "nothing newer than the newest"
    );

    // Deep down, with a filter carried along.
    let deep = format!("/messages?q=bulk%3A&before={}", min + 60);
    let (_, page) = text(&console, &s.cookie, &deep).await;
    assert_eq!(
        ids_on(&page),
        (min + 10..min + 60).rev().collect::<Vec<_>>()
    );
    let last = link(&page, "older").unwrap();
    assert_eq!(last, format!("/messages?q=bulk%3A&before={}", min + 10));
    let (_, end) = text(&console, &s.cookie, &last).await;
    assert_eq!(ids_on(&end), (min..min + 10).rev().collect::<Vec<_>>());
    assert!(
        link(&end, "older").is_none(),
        "the oldest page has no older link"
    );
    assert!(link(&end, "newest").is_some());
    // A prefix that narrows to 10 rows counts them exactly.
    let (_, narrow) = text(&console, &s.cookie, "/messages?q=bulk%3A09999").await;
    assert!(narrow.contains("10 messages match"), "{narrow}");
    assert_eq!(ids_on(&narrow).len(), 10);

    // The plans, with the values the page sends (an unnamed statement is planned with
    // them, as the console's are).
    let plan = |sql: &'static str, params: Vec<(Box<dyn ToSql + Sync + Send>, Type)>| {
        let c = &c;
        async move {
            let p: Vec<(&(dyn ToSql + Sync), Type)> = params
                .iter()
                .map(|(v, t)| (&**v as &(dyn ToSql + Sync), t.clone()))
                .collect();
            c.query_typed(&format!("EXPLAIN {sql}"), &p)
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let none = || -> Box<dyn ToSql + Sync + Send> { Box::new(None::<String>) };
    let filters = |from: Option<&str>, until: Option<&str>| {
        vec![
            (none(), Type::TEXT),
            (none(), Type::TEXT),
            (
                Box::new(from.map(str::to_owned)) as Box<dyn ToSql + Sync + Send>,
                Type::TEXT,
            ),
            (
                Box::new(until.map(str::to_owned)) as Box<dyn ToSql + Sync + Send>,
                Type::TEXT,
            ),
            (
                Box::new(None::<f64>) as Box<dyn ToSql + Sync + Send>,
                Type::FLOAT8,
            ),
            (none(), Type::TEXT),
            (none(), Type::TEXT),
        ]
    };
    let mut deep_params = filters(None, None);
    deep_params.push((Box::new(Some(min + 60)), Type::INT8));
    deep_params.push((Box::new(51i64), Type::INT8));
    let p = plan(outboxd::queries::MESSAGES_OLDER, deep_params).await;
    assert!(p.contains("Index Scan Backward using messages_pkey"), "{p}");
    assert!(p.contains("Index Cond: (id <"), "{p}");
    assert!(!p.contains("Sort") && !p.contains("Seq Scan"), "{p}");

    let end = outboxd::ops::prefix_end("bulk:09999").unwrap();
    let mut prefix_params = filters(Some("bulk:09999"), Some(&end));
    prefix_params.push((Box::new(None::<i64>), Type::INT8));
    prefix_params.push((Box::new(51i64), Type::INT8));
    let p = plan(outboxd::queries::MESSAGES_OLDER, prefix_params).await;
    assert!(p.contains("messages_message_key_key"), "{p}");
    assert!(!p.contains("Seq Scan"), "{p}");

    let mut count_params = filters(None, None);
    count_params.push((Box::new(10_001i64), Type::INT8));
    let p = plan(outboxd::queries::MESSAGES_COUNT, count_params).await;
    assert!(p.contains("Limit"), "{p}");
}

/// The console started with a secret's value in its environment, an endpoint naming it, and
/// an http message delivered with it: `/endpoints` names the secret and says the console
/// has it; no page shows its value. The message page shows the stored response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_page_shows_a_secrets_value_and_endpoints_name_it_only() {
    const VALUE: &str = "Bearer sk_live_CONSOLE_MUST_NOT_SHOW_7d3f";
    const HEADER_VALUE: &str = "acct_FIXEDHEADER_9q";
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    rx.set_default(Reply::Body(
        200,
        Some("application/json"),
        br#"{"id": "re_123", "status": "succeeded", "note": "<b>bold</b>"}"#.to_vec(),
    ));
    set_endpoint(
        &db,
        &format!(
            "'provider', 'http://127.0.0.1:{}/v1/T0PATHSECRET', auth_secret => 'PROVIDER_KEY', \
             key_ttl => '24 hours', headers => '{{\"Provider-Account\": \"{HEADER_VALUE}\"}}'",
            rx.addr.port()
        ),
    )
    .await;
    let webhook_sender =
        outboxd::deliver::webhook::WebhookSender::new(&test_webhook_config()).unwrap();
    let secrets =
        outboxd::deliver::http::settings::EndpointSecrets::default().with("PROVIDER_KEY", VALUE);
    let deliverers = outboxd::deliver::Deliverers {
        http: outboxd::deliver::http::HttpSender::new(&webhook_sender, secrets),
        webhook: webhook_sender,
        email: None,
    };
    let pools = outboxd::worker::Pools::new(&db.database(), 4).unwrap();
    let worker = RunningWorker::start_with_deliverers(
        &db,
        pools,
        outboxd::config::WorkerConfig {
            channels: vec![outboxd::model::Channel::Http],
            ..test_worker_config("w1")
        },
        deliverers,
    );
    let id = http(&db, "refund-77:create", "provider").await;
    wait_for_state(&db, "refund-77:create", "delivered", WAIT).await;
    worker.stop().await;
    let sent = rx.requests();
    assert_eq!(
        sent[0].header("authorization").as_deref(),
        Some(VALUE),
        "the worker sent it"
    );

    let console = Console::start_with_env(
        &db,
        Some(TOKEN),
        &[
            ("OUTBOXD_SECRET_PROVIDER_KEY", VALUE),
            ("OUTBOXD_SECRET_UNUSED", "another-value-NOT-SHOWN"),
        ],
    );
    let s = sign_in(&console, "alice").await;
    let (status, endpoints) = text(&console, &s.cookie, "/endpoints").await;
    assert_eq!(status, 200);
    assert!(endpoints.contains("PROVIDER_KEY"), "{endpoints}");
    assert!(
        endpoints.contains("set in this console&#39;s environment")
            || endpoints.contains("set in this console's environment"),
        "{endpoints}"
    );
    assert!(
        endpoints.contains("Provider-Account"),
        "fixed headers by name: {endpoints}"
    );
    // The endpoint's origin, never its path (a Slack webhook's holds its credential).
    assert!(endpoints.contains(&format!("http://127.0.0.1:{}/…", rx.addr.port())));
    assert!(endpoints.contains(">1d<"), "the key window: {endpoints}");
    assert!(endpoints.contains("<time datetime="), "{endpoints}");

    let (_, message) = text(&console, &s.cookie, &format!("/message/{id}")).await;
    assert!(message.contains("id=\"response-status\">200<"), "{message}");
    assert!(
        message.contains("re_123") && message.contains("&lt;b&gt;bold&lt;/b&gt;"),
        "{message}"
    );
    for path in [
        "/endpoints".to_owned(),
        "/messages".to_owned(),
        "/messages?channel=http&endpoint=provider".to_owned(),
        format!("/message/{id}"),
        "/".to_owned(),
        "/dead".to_owned(),
        "/held".to_owned(),
    ] {
        let (status, page) = text(&console, &s.cookie, &path).await;
        assert_eq!(status, 200, "{path}");
        for secret in [
            VALUE,
            "sk_live_CONSOLE",
            "another-value-NOT-SHOWN",
            HEADER_VALUE,
            "T0PATHSECRET",
        ] {
            assert!(!page.contains(secret), "{path} shows {secret}");
        }
    }
    let log = console.log();
    assert!(
        !log.contains("sk_live") && !log.contains("NOT-SHOWN"),
        "{log}"
    );

    // A console without the variable says so, by name.
    drop(console);
    let bare = Console::start(&db);
    let s = sign_in(&bare, "alice").await;
    let (_, endpoints) = text(&bare, &s.cookie, "/endpoints").await;
    assert!(endpoints.contains("not set in this console"), "{endpoints}");
}

/// The message page says when the provider's key window closes (or closed) on a dead,
/// held or ambiguous message, relative to the database's clock, with the exact time in
/// `datetime`; a long stored body is cut with a note.
#[tokio::test]
async fn the_message_page_tells_the_key_window_and_cuts_a_long_body() {
    let db = TestDb::new().await;
    set_endpoint(
        &db,
        "'prov', 'https://api.provider.example', key_ttl => '24 hours'",
    )
    .await;
    let open = http(&db, "window:open", "prov").await;
    let closed = http(&db, "window:closed", "prov").await;
    let c = db.client().await;
    c.execute(
        "UPDATE outbox.messages SET state = 'dead', attempts = 1, dead_at = now(), \
         error_class = 'ambiguous', last_error = 'timed out', \
         first_attempt_at = now() - interval '20 hours 30 minutes' WHERE id = $1",
        &[&open],
    )
    .await
    .unwrap();
    c.execute(
        "UPDATE outbox.messages SET state = 'dead', attempts = 1, dead_at = now(), \
         error_class = 'ambiguous', last_error = 'timed out', \
         first_attempt_at = now() - interval '3 days' WHERE id = $1",
        &[&closed],
    )
    .await
    .unwrap();
    let long = webhook(&db, "long:body", "https://a.example/h", false).await;
    let body = format!("{}{}", "x".repeat(5000), "TAIL-NOT-SHOWN");
    c.execute(
        "UPDATE outbox.messages SET state = 'delivered', attempts = 1, delivered_at = now(), \
         response = jsonb_build_object('status', 200, 'body', $2::text, 'body_truncated', true, \
                                       'content_type', 'text/plain') WHERE id = $1",
        &[&long, &body],
    )
    .await
    .unwrap();
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let (_, page) = text(&console, &s.cookie, &format!("/message/{open}")).await;
    let window = &page[page.find("id=\"key-window\"").expect("a key window")..];
    assert!(
        window.contains("closes <time datetime=\"") && window.contains(">in 3 h</time>"),
        "{window}"
    );
    let (_, page) = text(&console, &s.cookie, &format!("/message/{closed}")).await;
    let window = &page[page.find("id=\"key-window\"").expect("a key window")..];
    assert!(
        window.contains("closed <time") && window.contains(">2 days ago</time>"),
        "{window}"
    );
    assert!(window.contains("forgotten the key"), "{window}");
    // The exact time: RFC 3339, UTC, whole seconds.
    let at = window.find("datetime=\"").unwrap() + "datetime=\"".len();
    let stamp = &window[at..at + 20];
    assert!(
        stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T',
        "{stamp}"
    );

    let (_, page) = text(&console, &s.cookie, &format!("/message/{long}")).await;
    assert!(page.contains("Stored response"), "{page}");
    assert!(page.contains("id=\"response-cut\""), "{page}");
    assert!(
        page.contains("Showing the first 4096 of 5014 characters"),
        "{page}"
    );
    assert!(!page.contains("TAIL-NOT-SHOWN"));
    assert!(page.contains("stored cut"), "{page}");
}

/// Waits for `css` to hold `want` (the page may still be the one before a click, or be
/// replaced while it is read).
async fn wait_text(b: &Browser, css: &str, want: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Ok(e) = b.client.find(fantoccini::Locator::Css(css)).await {
            if let Ok(t) = e.text().await {
                if t.contains(want) {
                    return;
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {css} to contain {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What an operator with a phone sees: no page is wider than 390 px, tables included
/// (their rows stack); at a desktop's width `/messages` is a table with every column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_page_is_wider_than_a_phone_and_messages_reads_at_both_widths() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Long unbroken tokens: a key, an error with a URL-like run, a host.
    let long_key = format!(
        "tenant-{}:invoice-{}:notify",
        "a".repeat(60),
        "9".repeat(40)
    );
    let dead = webhook(
        &db,
        &long_key,
        "https://a-very-long-host-name-for-a-receiver.example.com/h",
        false,
    )
    .await;
    c.execute(
        "UPDATE outbox.messages SET state = 'dead', attempts = 3, dead_at = now(), \
         error_class = 'permanent', last_error = $2, \
         response = jsonb_build_object('status', 422, 'body', $3::text) WHERE id = $1",
        &[
            &dead,
            &format!("HTTP 422 from a-very-long-host-name-for-a-receiver.example.com: {}", "z".repeat(120)),
            &"{\"error\":{\"message\":\"invalid_request_error_with_a_very_long_code_name_that_goes_on\"}}",
        ],
    )
    .await
    .unwrap();
    c.execute(
        "INSERT INTO outbox.attempts (message_id, attempt, worker, started_at, finished_at, outcome, error_class, error, status) \
         VALUES ($1, 1, 'worker-on-a-host-with-a-long-name-0123456789', now() - interval '5 minutes', now() - interval '5 minutes', 'dead', 'permanent', $2, 422)",
        &[&dead, &format!("HTTP 422: {}", "q".repeat(150))],
    )
    .await
    .unwrap();
    webhook(
        &db,
        &format!("held:{}", "h".repeat(100)),
        "https://b.example/h",
        true,
    )
    .await;
    for i in 0..5 {
        webhook(
            &db,
            &format!("order-{i}:paid:notify"),
            "https://a.example/h",
            false,
        )
        .await;
    }
    set_endpoint(&db, "'stripe', 'https://api.stripe.com/v1', auth_secret => 'STRIPE', key_ttl => '24 hours', headers => '{\"Stripe-Version\": \"2024-06-20\"}'").await;

    let console = Console::start(&db);
    let b = Browser::start(1280, 900).await;
    b.sign_in(&console, "alice", TOKEN).await;
    b.wait_for("#counts").await;
    b.open(&console.url("/messages"), "#messages").await;
    let rows = b
        .client
        .find_all(fantoccini::Locator::Css("#messages tbody tr"))
        .await
        .unwrap();
    assert_eq!(rows.len(), 7);
    let head = b.text("#messages thead").await;
    for column in [
        "key",
        "state",
        "channel",
        "destination",
        "enqueued",
        "last error",
    ] {
        assert!(head.contains(column), "{head}");
    }
    let first = b.text("#messages tbody tr:last-child").await;
    assert!(
        first.contains("ago") || first.contains("just now"),
        "{first}"
    );
    // Filter through the form.
    b.wait_for("#f-state")
        .await
        .select_by_value("dead")
        .await
        .unwrap();
    b.click("#filter", "#match-count").await;
    wait_text(&b, "#match-count", "1 message matches").await;
    let listed = b.text("#messages tbody").await;
    assert!(
        listed.contains("tenant-") && !listed.contains("order-0"),
        "{listed}"
    );

    b.client.set_window_size(390, 844).await.unwrap();
    let fits = "const d = document.documentElement; \
                const wide = [...document.querySelectorAll('main *')] \
                  .filter(e => !['INPUT', 'SELECT', 'OPTION', 'BUTTON'].includes(e.tagName)) \
                  .filter(e => e.getBoundingClientRect().right > d.clientWidth + 1 \
                            || e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible') \
                  .map(e => e.tagName + (e.id ? '#' + e.id : '') + '.' + e.className); \
                return [d.scrollWidth <= d.clientWidth, d.scrollWidth, d.clientWidth, wide.slice(0, 5)];";
    for (path, css) in [
        ("/messages".to_owned(), "#messages"),
        ("/dead".to_owned(), "#dead"),
        ("/held".to_owned(), "#held"),
        (format!("/message/{dead}"), "#history"),
        ("/".to_owned(), "#counts"),
        ("/endpoints".to_owned(), "#endpoints"),
    ] {
        b.open(&console.url(&path), css).await;
        let r = b.client.execute(fits, vec![]).await.unwrap();
        assert_eq!(r[0], json!(true), "{path} is wider than 390 px: {r}");
        assert_eq!(
            r[3],
            json!([]),
            "{path}: elements past the edge or scrolling: {r}"
        );
    }
    b.close().await;
}
