//! The console's destinations: `/destinations` and `/destinations/{host}` behind the same
//! sign-in as every page, pause and resume through a confirmation page that the CLI then
//! sees, hostile reasons and host names shown as text, and the pages at a phone's width
//! in a real browser.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common;

use common::binary::{outboxd, run};
use common::console::*;
use common::*;
use serde_json::Value;

/// A destination nothing listens on: messages to it wait (no worker runs here).
const HOST: &str = "127.0.0.1:9";

async fn enqueue_waiting(db: &TestDb, prefix: &str, n: usize) {
    let msgs: Vec<_> = (0..n)
        .map(|i| {
            outboxd::NewMessage::webhook(
                format!("{prefix}{i}"),
                serde_json::json!({"url": format!("http://{HOST}/hook?token=s3cret"), "body": {}}),
            )
        })
        .collect();
    outboxd::enqueue_many(&db.client().await, &msgs)
        .await
        .unwrap();
}

/// The pause as the CLI lists it (`None` when the destination is not listed).
fn listed(db: &TestDb, host: &str) -> Option<Value> {
    let out = run(outboxd(Some(&db.url())).args(["destinations", "--json"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let rows: Vec<Value> = serde_json::from_str(&out.stdout).unwrap();
    rows.into_iter().find(|d| d["host"] == host)
}

/// Messages due now (not held back) for [`HOST`].
async fn due(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox.messages WHERE state = 'pending' AND run_after <= now()")
        .await
}

async fn post(
    console: &Console,
    s: &HttpSession,
    host_path: &str,
    pairs: &[(&str, &str)],
) -> (u16, String) {
    let mut all = vec![("csrf", s.csrf.as_str())];
    all.extend_from_slice(pairs);
    let res = post_form(
        &console.url(&format!("/destinations/{host_path}")),
        Some(&s.cookie),
        form(&all),
    )
    .await;
    (res.status().as_u16(), res.text().await.unwrap())
}

/// Signed out, both pages send the browser to sign in and a POST is refused; signed in,
/// the listing shows what waits; a pause goes through its confirmation page (which
/// changes nothing), is then seen by `outboxd destinations --json` with the operator and
/// the reason, and is refused when replayed against a state that changed; resume the same
/// way makes the messages due again.
#[tokio::test]
async fn pause_and_resume_from_the_console_are_what_the_cli_sees() {
    let db = TestDb::new().await;
    enqueue_waiting(&db, "w:", 3).await;
    let console = Console::start(&db);
    for path in ["/destinations", &format!("/destinations/{HOST}")] {
        let res = http().get(console.url(path)).send().await.unwrap();
        assert_eq!(res.status(), 303, "{path}");
        assert_eq!(res.headers()["location"], "/signin");
    }
    let res = post_form(
        &console.url(&format!("/destinations/{HOST}")),
        None,
        form(&[("do", "pause"), ("confirmed", "yes"), ("seen", "running")]),
    )
    .await;
    assert_eq!(res.status(), 403);

    let s = sign_in(&console, "alice").await;
    let page = get(&console.url("/destinations"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(&format!("data-host=\"{HOST}\" data-state=\"closed\"")),
        "{page}"
    );
    assert!(page.contains("<td class=\"num due\">3</td>"), "{page}");
    assert!(
        page.contains("href=\"/destinations\""),
        "the nav links to it"
    );
    assert!(
        page.contains("id=\"limits\""),
        "says where the limits are set"
    );
    // A destination named in the form opens its page, known or not; a bad name is refused.
    let res = get(
        &console.url("/destinations?host=New.Example%3A8443"),
        &s.cookie,
    )
    .await;
    assert_eq!(res.status(), 303);
    assert_eq!(res.headers()["location"], "/destinations/new.example:8443");
    let page = get(&console.url("/destinations/new.example:8443"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(page.contains("id=\"unknown\""), "{page}");
    assert!(page.contains("id=\"pause\""), "{page}");
    let res = get(&console.url("/destinations?host=%3Cb%3E"), &s.cookie).await;
    assert_eq!(res.status(), 404);

    // A forged or missing CSRF token changes nothing.
    for csrf in ["", &"0".repeat(64)] {
        let res = post_form(
            &console.url(&format!("/destinations/{HOST}")),
            Some(&s.cookie),
            form(&[
                ("csrf", csrf),
                ("do", "pause"),
                ("confirmed", "yes"),
                ("seen", "running"),
            ]),
        )
        .await;
        assert_eq!(res.status(), 403);
    }
    assert!(listed(&db, HOST).is_none());

    // The first step only asks.
    let (status, page) = post(
        &console,
        &s,
        HOST,
        &[("do", "pause"), ("reason", "provider incident")],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(&format!("Pause {HOST}?")), "{page}");
    assert!(page.contains("value=\"provider incident\""), "{page}");
    assert!(
        listed(&db, HOST).is_none(),
        "the confirmation page changes nothing"
    );
    assert_eq!(due(&db).await, 3);

    let confirm = [
        ("do", "pause"),
        ("reason", "provider incident"),
        ("confirmed", "yes"),
        ("seen", "running"),
    ];
    let (status, page) = post(&console, &s, HOST, &confirm).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("3 messages held back"), "{page}");
    assert!(page.contains("console:alice"), "{page}");
    let d = listed(&db, HOST).unwrap();
    assert_eq!(d["state"], "paused", "{d}");
    assert_eq!(d["paused_by"], "console:alice", "{d}");
    assert_eq!(d["pause_reason"], "provider incident", "{d}");
    assert_eq!(due(&db).await, 0);

    // The same confirmation again: the destination is no longer as it was shown.
    let (status, page) = post(&console, &s, HOST, &confirm).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("nothing changed"), "{page}");

    let page = get(&console.url(&format!("/destinations/{HOST}")), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(page.contains("<dd id=\"state\">paused</dd>"), "{page}");
    assert!(
        page.contains("<dd id=\"paused-by\">console:alice</dd>"),
        "{page}"
    );
    assert!(page.contains("<dd class=\"parked\">3</dd>"), "{page}");
    assert!(page.contains("id=\"resume\""), "{page}");
    assert!(
        page.contains("data-action=\"paused\""),
        "the history: {page}"
    );
    assert!(
        !page.contains("s3cret") && !page.contains("/hook"),
        "no URL path or query"
    );
    // A held-back message's page says why it waits, and links to the destination.
    let id: i64 = db
        .client()
        .await
        .query_one(
            "SELECT id FROM outbox.messages WHERE message_key = 'w:0'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let page = get(&console.url(&format!("/message/{id}")), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(&format!(
            "held back: <a href=\"/destinations/{HOST}\">{HOST}</a> is paused"
        )),
        "{page}"
    );

    let (status, page) = post(&console, &s, HOST, &[("do", "resume")]).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(&format!("Resume {HOST}?")), "{page}");
    let (status, page) = post(
        &console,
        &s,
        HOST,
        &[("do", "resume"), ("confirmed", "yes"), ("seen", "paused")],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("3 held-back messages due now"), "{page}");
    assert!(listed(&db, HOST).is_none(), "resumed: not listed");
    assert_eq!(due(&db).await, 3);
    let actors: Vec<String> = db
        .client()
        .await
        .query(
            "SELECT actor FROM outbox.destination_actions ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(actors, ["console:alice", "console:alice"]);
}

/// Markup in a reason and in host names is shown as text; a reason the SQL function
/// refuses, and a host that is no destination, get one line and change nothing.
#[tokio::test]
async fn markup_in_a_reason_or_a_host_is_text_and_bad_input_changes_nothing() {
    let db = TestDb::new().await;
    enqueue_waiting(&db, "x:", 1).await;
    // A row written by hand whose name is markup (no message could be named so).
    db.client()
        .await
        .execute(
            "INSERT INTO outbox.destinations (host, state, consecutive_failures) \
             VALUES ('<img src=x onerror=alert(1)>', 'closed', 2)",
            &[],
        )
        .await
        .unwrap();
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let xss = "<script>alert(1)</script>\"><img src=x onerror=alert(2)>";
    let (status, page) = post(
        &console,
        &s,
        HOST,
        &[
            ("do", "pause"),
            ("reason", xss),
            ("confirmed", "yes"),
            ("seen", "running"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    for path in ["/destinations".to_owned(), format!("/destinations/{HOST}")] {
        let page = get(&console.url(&path), &s.cookie)
            .await
            .text()
            .await
            .unwrap();
        assert!(!page.contains("<script>alert"), "{path}: {page}");
        assert!(!page.contains("<img src=x"), "{path}: {page}");
        assert!(
            page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{path}: {page}"
        );
    }
    let page = get(&console.url("/destinations"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "{page}"
    );
    assert!(
        page.contains("href=\"/destinations/%3Cimg%20src%3Dx%20onerror%3Dalert%281%29%3E\""),
        "{page}"
    );

    let before = db
        .scalar::<String>("SELECT string_agg(host || coalesce(pause_reason, ''), ',' ORDER BY host) FROM outbox.destinations")
        .await;
    let long = "r".repeat(501);
    for (pairs, want_status, says) in [
        (
            vec![("reason", "two\nlines")],
            400,
            "one line without control characters",
        ),
        (
            vec![("reason", long.as_str())],
            400,
            "at most 500 characters",
        ),
        (vec![("reason", "x\u{202e}y")], 400, "U+202E"),
    ] {
        let mut all = vec![("do", "pause"), ("confirmed", "yes"), ("seen", "running")];
        all.extend(pairs);
        let (status, page) = post(&console, &s, "other.example", &all).await;
        assert_eq!(status, want_status, "{page}");
        assert!(page.contains(says), "{page}");
        let error = page
            .split("<p id=\"error\">")
            .nth(1)
            .and_then(|p| p.split("</p>").next())
            .unwrap();
        assert!(!error.contains('\n'), "one line: {error}");
    }
    for hostile in [
        "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
        "a%20b",
        "b%C3%BCcher.example",
        "x'%3B--",
        "%00",
    ] {
        let res = get(&console.url(&format!("/destinations/{hostile}")), &s.cookie).await;
        assert_eq!(res.status(), 404, "{hostile}");
        let page = res.text().await.unwrap();
        assert!(!page.contains("<script>alert"), "{page}");
        let (status, _) = post(
            &console,
            &s,
            hostile,
            &[("do", "pause"), ("confirmed", "yes"), ("seen", "running")],
        )
        .await;
        assert_eq!(status, 404, "{hostile}");
    }
    let after = db
        .scalar::<String>("SELECT string_agg(host || coalesce(pause_reason, ''), ',' ORDER BY host) FROM outbox.destinations")
        .await;
    assert_eq!(before, after, "nothing changed");
}

/// In Chromium at a phone's width: the listing, one destination, the pause through its
/// confirmation page and the resume, none wider than the screen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phone_pauses_and_resumes_a_destination_in_a_browser() {
    let db = TestDb::new().await;
    enqueue_waiting(&db, "p:", 2).await;
    // A long name and a long reason must wrap, not widen the page.
    let long_host = format!("{}.example", "very-long-label".repeat(6));
    db.client()
        .await
        .execute(
            "SELECT * FROM outbox.pause_destination($1, $2, 'cli:bob')",
            &[&long_host, &"a reason that goes on and on ".repeat(10)],
        )
        .await
        .unwrap();
    let console = Console::start(&db);
    let b = Browser::start(390, 844).await;
    b.sign_in(&console, "alice", TOKEN).await;
    b.wait_for("main").await;

    let fits = |what: &'static str| {
        let b = &b;
        async move {
            let v = b
                .client
                .execute(
                    "return [document.documentElement.scrollWidth, document.documentElement.clientWidth];",
                    vec![],
                )
                .await
                .unwrap();
            let (scroll, client) = (v[0].as_i64().unwrap(), v[1].as_i64().unwrap());
            assert!(
                scroll <= client,
                "{what}: {scroll} px wide in a {client} px window"
            );
        }
    };
    b.open(&console.url("/destinations"), "#destinations").await;
    let row = b.text(&format!("tr[data-host='{HOST}']")).await;
    assert!(row.contains("closed"), "{row}");
    fits("the listing").await;
    b.click(&format!("tr[data-host='{HOST}'] a"), "#pause")
        .await;
    fits("one destination").await;
    b.wait_for("#reason")
        .await
        .send_keys("deploy freeze")
        .await
        .unwrap();
    b.click("#pause", "#touches").await;
    assert!(b.text("#touches").await.contains("Nothing is sent to"));
    fits("the confirmation").await;
    b.click("#do-it", "#result").await;
    assert!(b.text("#result").await.contains("2 messages held back"));
    let d = listed(&db, HOST).unwrap();
    assert_eq!(d["state"], "paused");
    assert_eq!(d["pause_reason"], "deploy freeze");

    b.open(&console.url(&format!("/destinations/{HOST}")), "#resume")
        .await;
    assert_eq!(b.text("#pause-reason").await, "deploy freeze");
    fits("a paused destination").await;
    b.click("#resume", "#do-it").await;
    b.click("#do-it", "#result").await;
    assert!(listed(&db, HOST).is_none());

    b.open(
        &console.url(&format!("/destinations/{long_host}")),
        "#resume",
    )
    .await;
    fits("a long name and reason").await;
    b.close().await;
    // Messages are due again, and nothing was sent (no worker ran).
    wait_until(Duration::from_secs(5), "the messages due again", || {
        let db = &db;
        async move { due(db).await == 2 }
    })
    .await;
}
