//! `outboxd console`: the real binary on a real database, driven by headless Chromium (what
//! an operator does) and by a plain HTTP client (what an attacker does: forged POSTs,
//! hostile input, the headers a browser relies on).

use std::time::Duration;

use crate::common::binary::{outboxd, run};
use crate::common::console::{
    Browser, Console, HttpSession, TOKEN, WAIT, form, get, http, post_form, post_with, sign_in,
};
use crate::common::receiver::{Receiver, Reply};
use crate::common::{
    RunningWorker, TestDb, enqueue_webhook, test_webhook_config, test_worker_config, wait_for_state,
};

const XSS_KEY: &str = "<script>document.title='pwned'</script>";

async fn enqueue_held(db: &TestDb, key: &str, url: &str) -> i64 {
    let c = db.client().await;
    let msg =
        outboxd::NewMessage::webhook(key, serde_json::json!({"url": url, "body": {"k": key}}))
            .held(true);
    outboxd::enqueue(&c, &msg).await.unwrap().id
}

/// The line and the response the worker stores for a recipient the relay refused: reply
/// codes and counts, never the reply's text or an address (README, "E-mail").
const REFUSED_RECIPIENT: &str = "SMTP 550 5.1.1 from smtp.example.com:587: 1 of 1 recipients refused; \
     no DATA sent (a message goes to all its recipients or to none)";

/// A dead e-mail, made by hand (no relay needed): a held row set dead, with what a refused
/// recipient leaves.
async fn dead_email(db: &TestDb, key: &str) -> i64 {
    let c = db.client().await;
    let msg = outboxd::NewMessage::email(
        key,
        serde_json::json!({"from": "Shop <shop@example.com>", "to": ["customer@example.com"],
                           "subject": "Your receipt", "text": "Thank you for your order."}),
    )
    .held(true);
    let id = outboxd::enqueue(&c, &msg).await.unwrap().id;
    c.execute(
        "UPDATE outbox.messages SET state = 'dead', attempts = 1, dead_at = now(), \
         error_class = 'permanent', last_error = $2, \
         response = '{\"status\": 550, \"phase\": \"rcpt\", \"enhanced_status\": \"5.1.1\", \
                      \"recipients\": 1, \"refused\": 1, \"deferred\": 0}' WHERE id = $1",
        &[&id, &REFUSED_RECIPIENT],
    )
    .await
    .unwrap();
    id
}

/// Everything that could change: every message's state, attempts and errors, and the count
/// of history rows.
async fn snapshot(db: &TestDb) -> (String, i64) {
    let rows: String = db
        .scalar(
            "SELECT coalesce(string_agg(id || ':' || state || ':' || attempts || ':' || \
             coalesce(error_class, '') || ':' || coalesce(last_error, ''), ',' ORDER BY id), '') \
             FROM outbox.messages",
        )
        .await;
    let history: i64 = db.scalar("SELECT count(*) FROM outbox.attempts").await;
    (rows, history)
}

/// Waits for `css` to hold `want` (the page may still be the one before a click).
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

/// The operator's path through the console, among hostile rows (a key and a destination
/// that are markup). It takes no pictures: the README's come from an ordinary day
/// ([`the_readme_pictures_show_an_ordinary_day`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_signs_in_sees_the_counts_filters_replays_and_approves_in_a_browser() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    // The first request fails, so order-1 dies (one attempt allowed); later ones succeed.
    rx.script([Reply::Status(500)]);
    let worker = RunningWorker::start(&db, test_worker_config("w1"), test_webhook_config());
    let dead_id = enqueue_webhook(
        &db,
        "order-1:notify",
        &rx.url("/hook?token=SECRET"),
        1,
        true,
    )
    .await;
    wait_for_state(&db, "order-1:notify", "dead", Duration::from_secs(15)).await;
    let mail_id = dead_email(&db, "order-1:mail").await;
    let held_id = enqueue_held(&db, "refund-7:approve", &rx.url("/refunds")).await;
    let xss_id = enqueue_held(&db, XSS_KEY, &rx.url("/x")).await;
    // Circuit breakers: one open destination, and one counting failures whose name (a row
    // an operator could write by hand) is markup.
    db.client()
        .await
        .execute(
            "INSERT INTO outbox.destinations (host, state, consecutive_failures, open_until) \
             VALUES ('api.partner.example:8443', 'open', 10, now() + interval '25 seconds'), \
                    ($1, 'closed', 3, NULL)",
            &[&XSS_KEY],
        )
        .await
        .unwrap();

    let console = Console::start(&db);
    let b = Browser::start(1280, 900).await;

    // A wrong token is refused: the form again, with the reason, and no session.
    b.sign_in(&console, "alice", "not-the-token-at-all").await;
    wait_text(&b, "#problem", "wrong token").await;
    b.client.goto(&console.url("/")).await.unwrap();
    b.wait_for("#name").await;

    b.sign_in(&console, "alice", TOKEN).await;
    b.wait_for("#counts").await;
    assert_eq!(b.text("tr[data-state=dead] td.total").await, "2");
    assert_eq!(b.text("tr[data-state=held] td.total").await, "2");
    assert_eq!(
        b.text("tr[data-state=dead] td[data-channel=email]").await,
        "1"
    );
    wait_text(&b, "#chart-summary", "1 failed").await;
    assert_eq!(b.text("#open-destinations .open-count").await, "1");
    assert_eq!(
        b.text("#open-destinations tr[data-state=open] td").await,
        "api.partner.example:8443"
    );
    assert_eq!(
        b.text(&format!(
            "#open-destinations tr[data-host=\"{XSS_KEY}\"] td"
        ))
        .await,
        XSS_KEY,
        "a destination's name is shown as text"
    );

    // Filter the dead letters: webhook only.
    b.open(&console.url("/dead"), "#filters").await;
    wait_text(&b, "#match-count", "2 dead letters match").await;
    b.wait_for("#f-channel")
        .await
        .select_by_value("webhook")
        .await
        .unwrap();
    b.wait_for("#filter").await.click().await.unwrap();
    wait_text(&b, "#match-count", "1 dead letter match").await;
    let listed = b.text("#dead tbody").await;
    assert!(
        listed.contains("order-1:notify") && !listed.contains("order-1:mail"),
        "{listed}"
    );

    // Replay it: a confirmation that says how many, then the change.
    b.wait_for(&format!("tr[data-id='{dead_id}'] input[type=checkbox]"))
        .await
        .click()
        .await
        .unwrap();
    b.click("#replay-selected", "#touches").await;
    wait_text(&b, "#touches", "replays 1 message").await;
    b.click("#do-it", "#result").await;
    wait_text(&b, "#result", "replayed 1 message(s)").await;
    wait_for_state(&db, "order-1:notify", "delivered", Duration::from_secs(15)).await;

    // Its story: the replay by alice, then the delivery.
    b.open(&console.url(&format!("/message/{dead_id}")), "#history")
        .await;
    let history = b.text("#history").await;
    assert!(
        history.contains("replayed") && history.contains("console:alice"),
        "{history}"
    );
    assert!(history.contains("delivered"), "{history}");
    let payload = b.text("#payload").await;
    assert!(
        !payload.contains("SECRET") && !payload.contains("/hook"),
        "{payload}"
    );

    // Held: the hostile key is text, not a script; approve the other one.
    b.open(&console.url("/held"), "#held").await;
    let keys = b.text("#held tbody").await;
    assert!(keys.contains(XSS_KEY), "the key is shown as text: {keys}");
    assert_ne!(b.client.title().await.unwrap(), "pwned");
    let scripts = b
        .client
        .find_all(fantoccini::Locator::Css("script"))
        .await
        .unwrap();
    assert!(scripts.is_empty(), "no script element on the page");
    b.wait_for(&format!("tr[data-id='{held_id}'] input[type=checkbox]"))
        .await
        .click()
        .await
        .unwrap();
    b.click("#approve-selected", "#touches").await;
    wait_text(&b, "#touches", "approves 1 message").await;
    b.click("#do-it", "#result").await;
    wait_text(&b, "#result", "approved 1 message(s)").await;
    wait_for_state(
        &db,
        "refund-7:approve",
        "delivered",
        Duration::from_secs(15),
    )
    .await;
    let worker_of: String = db
        .scalar(&format!(
            "SELECT worker FROM outbox.attempts WHERE message_id = {held_id} AND outcome = 'approved'"
        ))
        .await;
    assert_eq!(worker_of, "console:alice");
    // The others were not touched.
    assert_eq!(crate::common::row(&db, "order-1:mail").await.state, "dead");
    assert_eq!(crate::common::row(&db, XSS_KEY).await.state, "held");
    let _ = (mail_id, xss_id);

    b.close().await;
    worker.stop().await;
}

/// The README's pictures (`OUTBOXD_CONSOLE_SCREENSHOTS=docs/console`), from what a shop's
/// operator would see on an ordinary day: orders' webhooks delivered, one partner endpoint
/// that failed and is replayed once fixed, a receipt e-mail to a refused address, refunds
/// waiting for approval, a partner's API with its circuit open. Nothing hostile: the
/// hostile keys and destinations have the test above, which takes no pictures. Each page
/// is checked before its picture, so the pictures show what the test saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_pictures_show_an_ordinary_day() {
    let db = TestDb::new().await;
    let shop = Receiver::start().await;
    let partner = Receiver::start().await;
    // The partner's endpoint is down for the first request: its message dies (one attempt
    // allowed), and is replayed once the endpoint is back.
    partner.script([Reply::Status(503)]);
    let worker = RunningWorker::start(&db, test_worker_config("worker-1"), test_webhook_config());
    let c = db.client().await;
    let paid = |key: &str, url: &str, order: u32, max_attempts: i32| {
        outboxd::NewMessage::webhook(
            key,
            serde_json::json!({"url": url, "body": {"event": "order.paid", "order": order,
                                                    "amount": "59.90", "currency": "EUR"}}),
        )
        .max_attempts(max_attempts)
    };
    let base = format!("http://localhost:{}", shop.addr.port());
    for order in 1041..=1046 {
        let key = format!("order-{order}:paid:notify");
        let msg = paid(&key, &format!("{base}/hooks/orders"), order, 5);
        outboxd::enqueue(&c, &msg).await.unwrap();
    }
    let partner_url = format!("http://localhost:{}/v2/events", partner.addr.port());
    let msg = paid("order-1047:paid:partner", &partner_url, 1047, 1);
    let dead_id = outboxd::enqueue(&c, &msg).await.unwrap().id;
    wait_for_state(&db, "order-1047:paid:partner", "dead", WAIT).await;
    for order in 1041..=1046 {
        wait_for_state(
            &db,
            &format!("order-{order}:paid:notify"),
            "delivered",
            WAIT,
        )
        .await;
    }
    dead_email(&db, "order-1045:receipt:email").await;
    enqueue_held(&db, "refund-2207:approve", &format!("{base}/hooks/refunds")).await;
    enqueue_held(&db, "payout-88:approve", &format!("{base}/hooks/payouts")).await;
    db.client()
        .await
        .execute(
            "INSERT INTO outbox.destinations (host, state, consecutive_failures, open_until) \
             VALUES ('api.partner.example:8443', 'open', 10, now() + interval '25 seconds')",
            &[],
        )
        .await
        .unwrap();

    // A provider's endpoint (its secret by name only), and a destination paused during its
    // provider's incident.
    c.batch_execute(
        "SELECT outbox.set_endpoint('stripe', 'https://api.stripe.com', \
             auth_secret => 'STRIPE_KEY', key_ttl => '24 hours', \
             headers => '{\"Stripe-Version\": \"2024-06-20\"}');
         SELECT outbox.pause_destination('api.partner.example:8443',
             'their incident INC-2291: no sends until they say so', 'console:alice');",
    )
    .await
    .unwrap();

    let console = Console::start(&db);
    let b = Browser::start(1280, 900).await;

    b.sign_in(&console, "alice", "not-the-token-at-all").await;
    wait_text(&b, "#problem", "wrong token").await;
    b.screenshot("signin").await;
    b.client.goto(&console.url("/")).await.unwrap();
    b.wait_for("#name").await;

    b.sign_in(&console, "alice", TOKEN).await;
    b.wait_for("#counts").await;
    assert_eq!(b.text("tr[data-state=delivered] td.total").await, "6");
    assert_eq!(b.text("tr[data-state=dead] td.total").await, "2");
    assert_eq!(b.text("tr[data-state=held] td.total").await, "2");
    wait_text(&b, "#chart-summary", "6 delivered").await;
    assert_eq!(b.text("#open-destinations .open-count").await, "1");
    // Tall enough for the charts under the counts.
    b.client.set_window_size(1280, 2000).await.unwrap();
    b.open(&console.url("/"), "#latency").await;
    b.screenshot("overview").await;
    b.client.set_window_size(1280, 900).await.unwrap();

    b.open(&console.url("/dead"), "#filters").await;
    wait_text(&b, "#match-count", "2 dead letters match").await;
    let listed = b.text("#dead tbody").await;
    assert!(
        listed.contains("HTTP 503 from localhost") && listed.contains("1 of 1 recipients refused"),
        "{listed}"
    );
    b.screenshot("dead").await;

    // The partner's endpoint is back: replay its message.
    b.wait_for(&format!("tr[data-id='{dead_id}'] input[type=checkbox]"))
        .await
        .click()
        .await
        .unwrap();
    b.click("#replay-selected", "#touches").await;
    wait_text(&b, "#touches", "replays 1 message").await;
    b.screenshot("confirm").await;
    b.click("#do-it", "#result").await;
    wait_text(&b, "#result", "replayed 1 message(s)").await;
    wait_for_state(&db, "order-1047:paid:partner", "delivered", WAIT).await;

    b.open(&console.url(&format!("/message/{dead_id}")), "#history")
        .await;
    let history = b.text("#history").await;
    assert!(
        history.contains("replayed") && history.contains("console:alice"),
        "{history}"
    );
    assert!(history.contains("delivered"), "{history}");
    // Tall enough for the history under the payload: the replay between the failure and
    // the delivery.
    b.client.set_window_size(1280, 1120).await.unwrap();
    b.open(&console.url(&format!("/message/{dead_id}")), "#history")
        .await;
    b.screenshot("message").await;
    b.client.set_window_size(1280, 900).await.unwrap();

    b.open(&console.url("/held"), "#held").await;
    let held = b.text("#held tbody").await;
    assert!(
        held.contains("refund-2207:approve") && held.contains("payout-88:approve"),
        "{held}"
    );
    b.screenshot("held").await;

    b.open(&console.url("/messages"), "#messages").await;
    let listed = b.text("#messages tbody").await;
    assert!(listed.contains("order-1041:paid:notify"), "{listed}");
    b.screenshot("messages").await;

    b.open(&console.url("/destinations"), "#destinations").await;
    assert_eq!(b.text("#paused-count").await, "1");
    b.screenshot("destinations").await;
    let shop_host = format!("localhost:{}", shop.addr.port());
    // Tall enough for its recent attempts under what waits.
    b.client.set_window_size(1280, 1500).await.unwrap();
    b.open(
        &console.url(&format!("/destinations/{shop_host}")),
        "#destination",
    )
    .await;
    b.screenshot("destination").await;
    b.client.set_window_size(1280, 900).await.unwrap();

    b.open(&console.url("/endpoints"), "#endpoints").await;
    assert!(b.text("#endpoints").await.contains("STRIPE_KEY"));
    b.screenshot("endpoints").await;

    // The same pages at a phone's width.
    b.client.set_window_size(390, 844).await.unwrap();
    for (path, name, css) in [
        ("/".to_owned(), "overview-phone", "#counts"),
        ("/dead".to_owned(), "dead-phone", "#dead"),
        ("/held".to_owned(), "held-phone", "#held"),
        (format!("/message/{dead_id}"), "message-phone", "#history"),
        ("/messages".to_owned(), "messages-phone", "#messages"),
        (
            "/destinations".to_owned(),
            "destinations-phone",
            "#destinations",
        ),
    ] {
        b.open(&console.url(&path), css).await;
        b.screenshot(name).await;
    }
    b.close().await;
    worker.stop().await;
}

#[tokio::test]
async fn a_forged_post_is_refused_with_403_and_changes_nothing() {
    let db = TestDb::new().await;
    let id = dead_email(&db, "forged:target").await;
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let before = snapshot(&db).await;
    let ids = id.to_string();
    let action = |csrf: &str| {
        let mut pairs = vec![
            ("do", "replay:selected"),
            ("id", ids.as_str()),
            ("confirmed", "yes"),
        ];
        if !csrf.is_empty() {
            pairs.push(("csrf", csrf));
        }
        form(&pairs)
    };
    // No token, a wrong one, another session's one, and no session at all.
    let other = sign_in(&console, "mallory").await;
    for (cookie, body) in [
        (Some(s.cookie.as_str()), action("")),
        (Some(s.cookie.as_str()), action(&"0".repeat(64))),
        (Some(s.cookie.as_str()), action(&other.csrf)),
        (None, action(&s.csrf)),
    ] {
        let res = post_form(&console.url("/action"), cookie, body).await;
        assert_eq!(res.status(), 403);
        let text = res.text().await.unwrap();
        assert!(text.contains("nothing changed"), "{text}");
        assert_eq!(
            snapshot(&db).await,
            before,
            "a forged POST changed something"
        );
    }
    // No state change on GET either.
    let res = get(
        &console.url(&format!(
            "/action?do=replay:selected&id={id}&confirmed=yes&csrf={}",
            s.csrf
        )),
        &s.cookie,
    )
    .await;
    assert_eq!(res.status(), 405);
    assert_eq!(snapshot(&db).await, before);
    // Signing out needs the token too.
    let res = post_form(&console.url("/signout"), Some(&s.cookie), String::new()).await;
    assert_eq!(res.status(), 403);

    // The same request with the session's token does it (so the refusals above were the
    // CSRF check, not a broken request).
    let res = post_form(&console.url("/action"), Some(&s.cookie), action(&s.csrf)).await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        crate::common::row(&db, "forged:target").await.state,
        "pending"
    );
}

#[tokio::test]
async fn pages_carry_a_strict_csp_and_the_cookie_is_httponly_and_samesite_strict() {
    let db = TestDb::new().await;
    let console = Console::start(&db);
    let res = post_form(
        &console.url("/signin"),
        None,
        form(&[("name", "alice"), ("token", TOKEN)]),
    )
    .await;
    let cookie = res.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.starts_with("outboxd_session="), "{cookie}");
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(cookie.contains(flag), "{flag} in {cookie}");
    }
    assert!(
        !cookie.contains("Secure"),
        "no Secure on loopback (plain HTTP): {cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_owned();
    for path in [
        "/",
        "/dead",
        "/held",
        "/signin",
        "/style.css",
        "/message/1",
        "/nope",
    ] {
        let res = get(&console.url(path), &session).await;
        let h = res.headers();
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("style-src 'self'"),
            "{path}: {csp}"
        );
        assert!(
            !csp.contains("unsafe-inline") && !csp.contains("script-src"),
            "{path}: {csp}"
        );
        assert_eq!(h["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(h["x-frame-options"], "DENY", "{path}");
    }
    // No page without a session: to the sign-in form.
    let res = http().get(console.url("/dead")).send().await.unwrap();
    assert_eq!(res.status(), 303);
    assert_eq!(res.headers()["location"], "/signin");
    // A session id that is not one is no session.
    let res = get(
        &console.url("/"),
        &format!("outboxd_session={}", "a".repeat(64)),
    )
    .await;
    assert_eq!(res.status(), 303);
}

#[tokio::test]
async fn a_wrong_token_is_refused_and_sign_in_is_rate_limited() {
    let db = TestDb::new().await;
    let console = Console::start(&db);
    for _ in 0..5 {
        let res = post_form(
            &console.url("/signin"),
            None,
            form(&[("name", "eve"), ("token", "guess-guess-guess-guess")]),
        )
        .await;
        assert_eq!(res.status(), 401);
        assert!(res.headers().get("set-cookie").is_none());
    }
    // Past five failures, even the right token waits.
    let res = post_form(
        &console.url("/signin"),
        None,
        form(&[("name", "alice"), ("token", TOKEN)]),
    )
    .await;
    assert_eq!(res.status(), 429);
    assert!(res.headers().get("set-cookie").is_none());
}

/// The body's error line (`<p id="error">…</p>`), which must be one line.
fn error_line(page: &str) -> String {
    let start = page.find("<p id=\"error\">").expect("an error page") + "<p id=\"error\">".len();
    let end = start + page[start..].find("</p>").unwrap();
    page[start..end].to_owned()
}

#[tokio::test]
async fn hostile_input_gets_a_one_line_error_page_and_changes_nothing() {
    let db = TestDb::new().await;
    let dead = dead_email(&db, "hostile:dead").await;
    let held = enqueue_held(&db, "hostile:held", "https://h.example/").await;
    let console = Console::start(&db);
    let HttpSession { cookie, csrf } = sign_in(&console, "alice").await;
    let before = snapshot(&db).await;
    let long = "k".repeat(100_000);
    let long_reason = "r".repeat(501);
    let gets: Vec<(String, u16)> = vec![
        ("/message/abc".into(), 400),
        ("/message/-1".into(), 400),
        ("/message/99999999999999999999".into(), 400),
        ("/message/%00".into(), 400),
        ("/message/%3Cscript%3E".into(), 400),
        ("/message/424242".into(), 404),
        ("/lookup?q=".into(), 400),
        (format!("/lookup?q={}", "k".repeat(300)), 400),
        (
            "/lookup?q=%1B%5B31m%3Cscript%3Ealert(1)%3C%2Fscript%3E%0Aforged".into(),
            404,
        ),
        ("/lookup?q=%FF%FE".into(), 404),
        // Not a database error (503, which reads as an outage): no key holds a NUL.
        ("/lookup?q=k%00ey".into(), 400),
        ("/dead?channel=%3Cscript%3E".into(), 400),
        ("/dead?class=fatal%0D%0Aline".into(), 400),
        ("/dead?since=999999999999d".into(), 400),
        ("/dead?since=-1h".into(), 400),
        ("/dead?page=0".into(), 400),
        ("/dead?page=1e9".into(), 400),
        ("/held?channel=sms".into(), 400),
    ];
    for (path, status) in &gets {
        let res = get(&console.url(path), &cookie).await;
        assert_eq!(res.status().as_u16(), *status, "{path}");
        let page = res.text().await.unwrap();
        let line = error_line(&page);
        assert!(
            !line.contains('\n') && !line.contains('<') && !line.contains('\u{1b}'),
            "{path}: {line:?}"
        );
        assert!(!page.contains("<script>"), "{path}: rendered as text");
        assert!(line.chars().count() < 300, "{path}: {line}");
    }
    let dead_s = dead.to_string();
    let held_s = held.to_string();
    let many: Vec<(&str, &str)> = std::iter::repeat_n(("id", dead_s.as_str()), 501).collect();
    let posts: Vec<(Vec<(&str, &str)>, u16)> = vec![
        (
            vec![
                ("do", "replay:selected"),
                ("id", "1e5"),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (
            vec![
                ("do", "replay:selected"),
                ("id", "\0"),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (
            vec![
                ("do", "replay:selected"),
                ("id", "-3"),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (vec![("do", "replay:selected"), ("confirmed", "yes")], 400),
        (
            vec![
                ("do", "explode:selected"),
                ("id", &dead_s),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (
            vec![("do", "<script>"), ("id", &dead_s), ("confirmed", "yes")],
            400,
        ),
        (
            vec![
                ("do", "replay:selected"),
                ("id", "987654"),
                ("confirmed", "yes"),
            ],
            404,
        ),
        // The wrong state: all or nothing, named, nothing changed.
        (
            vec![
                ("do", "replay:selected"),
                ("id", &dead_s),
                ("id", &held_s),
                ("confirmed", "yes"),
            ],
            409,
        ),
        (
            vec![
                ("do", "approve:selected"),
                ("id", &dead_s),
                ("confirmed", "yes"),
            ],
            409,
        ),
        (
            vec![
                ("do", "confirm:selected"),
                ("id", &dead_s),
                ("confirmed", "yes"),
            ],
            409,
        ),
        (
            vec![
                ("do", "cancel:selected"),
                ("id", &held_s),
                ("reason", "two\nlines"),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (
            vec![
                ("do", "cancel:selected"),
                ("id", &held_s),
                ("reason", &long_reason),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (
            vec![
                ("do", "cancel:selected"),
                ("id", &held_s),
                ("reason", "nul\0byte"),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (
            vec![
                ("do", "approve:filter"),
                ("from", "dead"),
                ("confirmed", "yes"),
            ],
            400,
        ),
        (
            vec![
                ("do", "replay:filter"),
                ("from", "dead"),
                ("channel", "x\u{202e}y"),
            ],
            400,
        ),
        (vec![("do", "replay:filter"), ("from", "nowhere")], 400),
    ];
    let mut bodies: Vec<String> = posts
        .iter()
        .map(|(pairs, _)| {
            let mut p = pairs.clone();
            p.push(("csrf", &csrf));
            form(&p)
        })
        .collect();
    let mut statuses: Vec<u16> = posts.iter().map(|(_, s)| *s).collect();
    let mut p = many.clone();
    p.extend([("do", "replay:selected"), ("csrf", csrf.as_str())]);
    bodies.push(form(&p));
    statuses.push(400);
    for (body, status) in bodies.into_iter().zip(statuses) {
        let shown: String = body.chars().take(120).collect();
        let res = post_form(&console.url("/action"), Some(&cookie), body).await;
        assert_eq!(res.status().as_u16(), status, "{shown}");
        let page = res.text().await.unwrap();
        let line = error_line(&page);
        assert!(line.contains("nothing"), "{shown}: {line}");
        assert!(
            !line.contains('\n') && !line.contains('<'),
            "{shown}: {line:?}"
        );
        assert_eq!(snapshot(&db).await, before, "{shown} changed something");
    }
    // A body past the limit is refused before it is read.
    let res = post_form(
        &console.url("/action"),
        Some(&cookie),
        format!("csrf={csrf}&do=replay:selected&id={dead}&confirmed=yes&pad={long}"),
    )
    .await;
    assert_eq!(res.status(), 413);
    // Bad names at sign-in.
    for name in ["", "a\nb", "<b>x</b>", &"n".repeat(41), "al ice", "ålice"] {
        let res = post_form(
            &console.url("/signin"),
            None,
            form(&[("name", name), ("token", TOKEN)]),
        )
        .await;
        assert_eq!(res.status(), 400, "{name:?}");
        assert!(res.headers().get("set-cookie").is_none());
    }
    assert_eq!(snapshot(&db).await, before);
}

#[tokio::test]
async fn the_filter_scope_confirms_how_many_rows_and_touches_exactly_those() {
    let db = TestDb::new().await;
    let a = dead_email(&db, "scope:a").await;
    let b = dead_email(&db, "scope:b").await;
    let console = Console::start(&db);
    let s = sign_in(&console, "bob").await;
    let before = snapshot(&db).await;
    // Step one changes nothing and names both.
    let res = post_form(
        &console.url("/action"),
        Some(&s.cookie),
        form(&[
            ("csrf", &s.csrf),
            ("do", "cancel:filter"),
            ("from", "dead"),
            ("channel", "email"),
        ]),
    )
    .await;
    assert_eq!(res.status(), 200);
    let page = res.text().await.unwrap();
    assert!(page.contains("cancels <b>2 messages</b>"), "{page}");
    assert!(page.contains("scope:a") && page.contains("scope:b"));
    assert_eq!(snapshot(&db).await, before);
    // A third appears meanwhile: the confirmed action touches the two it showed.
    let c = dead_email(&db, "scope:c").await;
    let (ids, _) = (format!("{a}"), format!("{b}"));
    let b_s = b.to_string();
    let res = post_form(
        &console.url("/action"),
        Some(&s.cookie),
        form(&[
            ("csrf", &s.csrf),
            ("do", "cancel:selected"),
            ("id", &ids),
            ("id", &b_s),
            ("reason", "duplicate order"),
            ("confirmed", "yes"),
        ]),
    )
    .await;
    assert_eq!(res.status(), 200);
    for (key, state) in [
        ("scope:a", "cancelled"),
        ("scope:b", "cancelled"),
        ("scope:c", "dead"),
    ] {
        assert_eq!(crate::common::row(&db, key).await.state, state, "{key}");
    }
    let reason: String = db
        .scalar(&format!("SELECT error || ' by ' || worker FROM outbox.attempts WHERE message_id = {a} AND outcome = 'cancelled'"))
        .await;
    assert_eq!(reason, "duplicate order by console:bob");
    let _ = c;
}

#[test]
fn start_up_refuses_a_non_loopback_address_without_a_token() {
    // The refusal comes before any database call or bind: the URL leads nowhere.
    let url = crate::common::binary::UNREACHABLE_URL;
    for (args, env, needle) in [
        (
            vec!["console", "--addr", "0.0.0.0:9188"],
            vec![],
            "OUTBOXD_CONSOLE_TOKEN is required",
        ),
        (
            vec!["console"],
            vec![("OUTBOXD_ADDR", "[::]:9188")],
            "OUTBOXD_CONSOLE_TOKEN is required",
        ),
        (
            vec!["console", "--addr", "192.0.2.1:9188"],
            vec![("OUTBOXD_CONSOLE_TOKEN", "")],
            "OUTBOXD_CONSOLE_TOKEN is set but holds no token",
        ),
        // On loopback too: a token set to nothing never opens the console.
        (
            vec!["console", "--addr", "127.0.0.1:9188"],
            vec![("OUTBOXD_CONSOLE_TOKEN", "")],
            "OUTBOXD_CONSOLE_TOKEN is set but holds no token",
        ),
        (
            vec!["console", "--addr", "0.0.0.0:9188"],
            vec![("OUTBOXD_CONSOLE_TOKEN", "short")],
            "at least 16",
        ),
        (
            vec!["console", "--addr", "not-an-address"],
            vec![],
            "invalid",
        ),
    ] {
        let mut cmd = outboxd(Some(url));
        cmd.args(&args);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let out = run(&mut cmd);
        assert_eq!(out.code, Some(2), "{args:?} {env:?}: {}", out.stderr);
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains(needle), "{lines:?}");
        assert!(!out.stderr.contains("short"), "the token is never echoed");
    }
}

#[tokio::test]
async fn on_loopback_without_a_token_a_name_signs_in() {
    let db = TestDb::new().await;
    let console = Console::start_with(&db, None);
    let page = http()
        .get(console.url("/signin"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!page.contains("name=\"token\""), "no token field");
    let res = post_form(&console.url("/signin"), None, form(&[("name", "carol")])).await;
    assert_eq!(res.status(), 303);
    assert!(
        res.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("HttpOnly")
    );
    // Still a session, and a CSRF token for every change.
    let cookie = res.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let page = get(&console.url("/"), &cookie).await.text().await.unwrap();
    assert!(page.contains("signed in as <b>carol</b>"), "{page}");
    let res = post_form(&console.url("/signout"), Some(&cookie), String::new()).await;
    assert_eq!(res.status(), 403);
}

#[tokio::test]
async fn no_token_header_value_url_path_or_query_reaches_a_page_or_the_log() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(
        "secret:carrier",
        serde_json::json!({"url": "https://user:PASSWORD@h.example/hooks/PATHSECRET?token=QUERYSECRET",
            "headers": {"Authorization": "Bearer HEADERSECRET"}, "body": {"visible": true}}),
    )
    .held(true);
    let id = outboxd::enqueue(&c, &msg).await.unwrap().id;
    let console = Console::start(&db);
    // A wrong sign-in first: the attempt is logged, the token tried is not.
    let wrong = "WRONGTOKENSECRET-0123";
    post_form(
        &console.url("/signin"),
        None,
        form(&[("name", "eve"), ("token", wrong)]),
    )
    .await;
    let s = sign_in(&console, "alice").await;
    let page = get(&console.url(&format!("/message/{id}")), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("https://h.example/[redacted]") && page.contains("visible"),
        "{page}"
    );
    for secret in [
        "PASSWORD",
        "PATHSECRET",
        "QUERYSECRET",
        "HEADERSECRET",
        TOKEN,
    ] {
        assert!(!page.contains(secret), "{secret} on the page");
    }
    // An action, so the log has something to say about it.
    let res = post_form(
        &console.url("/action"),
        Some(&s.cookie),
        form(&[
            ("csrf", &s.csrf),
            ("do", "cancel:selected"),
            ("id", &id.to_string()),
            ("confirmed", "yes"),
        ]),
    )
    .await;
    assert_eq!(res.status(), 200);
    let deadline = tokio::time::Instant::now() + WAIT;
    while !console.log().contains("console: action") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no action logged: {}",
            console.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = console.log();
    assert!(
        log.contains("alice") && log.contains("wrong token"),
        "{log}"
    );
    for secret in [
        "PASSWORD",
        "PATHSECRET",
        "QUERYSECRET",
        "HEADERSECRET",
        TOKEN,
        wrong,
        &s.csrf,
    ] {
        assert!(!log.contains(secret), "{secret} in the log: {log}");
    }
    let session_id = s.cookie.trim_start_matches("outboxd_session=");
    assert!(!log.contains(session_id), "the session id in the log");
}

#[tokio::test]
async fn dead_letters_page_by_fifty_and_filter_by_class_and_age() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for i in 0..60 {
        dead_email(&db, &format!("page:{i:02}")).await;
    }
    // One ambiguous, two days old.
    let old = dead_email(&db, "page:old").await;
    c.execute(
        "UPDATE outbox.messages SET error_class = 'ambiguous', dead_at = now() - interval '2 days' WHERE id = $1",
        &[&old],
    )
    .await
    .unwrap();
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let rows = |page: &str| page.matches("<tr data-id=").count();
    let p1 = get(&console.url("/dead"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(p1.contains("61 dead letters match"), "{p1}");
    assert_eq!(rows(&p1), 50);
    assert!(
        p1.contains("page 1 of 2") && p1.contains("href=\"/dead?page=2\""),
        "{p1}"
    );
    let p2 = get(&console.url("/dead?page=2"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(rows(&p2), 11);
    // A page past the last (its rows acted on meanwhile) leads back to the last one.
    let p5 = get(&console.url("/dead?page=5&class=permanent"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(rows(&p5), 0);
    assert!(
        p5.contains("No dead letters on this page")
            && p5.contains("href=\"/dead?class=permanent&amp;page=2\""),
        "{p5}"
    );
    let p5 = get(&console.url("/dead?page=5"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(p5.contains("href=\"/dead?page=2\""), "{p5}");
    let amb = get(&console.url("/dead?class=ambiguous"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        amb.contains("1 dead letter match") && amb.contains("page:old"),
        "{amb}"
    );
    // Only an ambiguous filter offers "confirm all".
    assert!(amb.contains("id=\"confirm-all\"") && !p1.contains("id=\"confirm-all\""));
    let recent = get(&console.url("/dead?since=1h&channel=email"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(recent.contains("60 dead letters match") && !recent.contains("page:old"));
    let none = get(&console.url("/dead?channel=webhook"), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    assert!(none.contains("0 dead letters match"));
    // Lookup by key and by id lands on the message.
    let res = get(&console.url("/lookup?q=page%3Aold"), &s.cookie).await;
    assert_eq!(res.status(), 303);
    assert_eq!(
        res.headers()["location"],
        format!("/message/{old}").as_str()
    );
    let res = get(&console.url(&format!("/lookup?q={old}")), &s.cookie).await;
    assert_eq!(
        res.headers()["location"],
        format!("/message/{old}").as_str()
    );
    // A key of digits only (an order number): digits name an id first, and when no
    // message has that id, a key. (It could not be looked up at all before.)
    let digits = dead_email(&db, "202612070042").await;
    let res = get(&console.url("/lookup?q=202612070042"), &s.cookie).await;
    assert_eq!(res.status(), 303);
    assert_eq!(
        res.headers()["location"],
        format!("/message/{digits}").as_str()
    );
    let res = get(&console.url("/lookup?q=202612070043"), &s.cookie).await;
    assert_eq!(res.status(), 404);
}

/// Without a token the console trusts loopback; a page elsewhere must not borrow that
/// trust. A site that points its own name at 127.0.0.1 (DNS rebinding) sends that name in
/// `Host`; a proxy in front says so in its headers: both are refused, reading as well as
/// signing in, and nothing is changed or handed out.
#[tokio::test]
async fn without_a_token_only_requests_addressed_to_loopback_are_served() {
    let db = TestDb::new().await;
    let held = enqueue_held(&db, "rebind:held", "https://h.example/").await;
    let console = Console::start_with(&db, None);
    let port = console.base.rsplit(':').next().unwrap().to_owned();
    let evil = format!("evil.example:{port}");
    let before = snapshot(&db).await;
    for headers in [
        vec![("host", evil.as_str())],
        vec![("x-forwarded-for", "203.0.113.9")],
        vec![("forwarded", "for=203.0.113.9;proto=https")],
    ] {
        let res = post_with(
            &console.url("/signin"),
            None,
            form(&[("name", "mallory")]),
            &headers,
        )
        .await;
        assert_eq!(res.status(), 403, "{headers:?}");
        assert!(res.headers().get("set-cookie").is_none(), "{headers:?}");
        let page = res.text().await.unwrap();
        assert!(!page.contains("evil.example"), "no header value echoed");
        let mut req = http().get(console.url("/held"));
        for (k, v) in &headers {
            req = req.header(*k, *v);
        }
        assert_eq!(req.send().await.unwrap().status(), 403, "{headers:?}");
    }
    // With a signed-in operator's cookie too: the page at evil.example has none, but its
    // requests must not work even if it had.
    let res = post_form(&console.url("/signin"), None, form(&[("name", "carol")])).await;
    assert_eq!(res.status(), 303);
    let cookie = res.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let page = get(&console.url("/held"), &cookie)
        .await
        .text()
        .await
        .unwrap();
    let csrf = crate::common::console::csrf_of(&page);
    let ids = held.to_string();
    let approve = form(&[
        ("csrf", &csrf),
        ("do", "approve:selected"),
        ("id", &ids),
        ("confirmed", "yes"),
    ]);
    let res = post_with(
        &console.url("/action"),
        Some(&cookie),
        approve.clone(),
        &[("host", &evil)],
    )
    .await;
    assert_eq!(res.status(), 403);
    assert_eq!(snapshot(&db).await, before, "nothing changed");
    // Every name of loopback works.
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}")] {
        let res = http()
            .get(console.url("/signin"))
            .header("host", &host)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{host}");
    }
    let res = post_form(&console.url("/action"), Some(&cookie), approve).await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        crate::common::row(&db, "rebind:held").await.state,
        "pending"
    );
}

/// A page on another site can make the operator's browser POST to the console. Its
/// requests are marked (`Sec-Fetch-Site`, `Origin`) and refused before anything runs: no
/// action even with a valid session and CSRF token, no sign-in, and no use of the sign-in
/// rate limit (five such posts do not lock the operator out).
#[tokio::test]
async fn a_post_from_another_site_is_refused_before_anything_runs() {
    let db = TestDb::new().await;
    let id = dead_email(&db, "xsite:target").await;
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let before = snapshot(&db).await;
    let ids = id.to_string();
    let replay = form(&[
        ("csrf", &s.csrf),
        ("do", "replay:selected"),
        ("id", &ids),
        ("confirmed", "yes"),
    ]);
    let cross = [
        vec![("sec-fetch-site", "cross-site")],
        vec![("sec-fetch-site", "same-site")],
        vec![("origin", "https://evil.example")],
        vec![("origin", "null")],
    ];
    for headers in &cross {
        let res = post_with(
            &console.url("/action"),
            Some(&s.cookie),
            replay.clone(),
            headers,
        )
        .await;
        assert_eq!(res.status(), 403, "{headers:?}");
        assert!(res.text().await.unwrap().contains("another site"));
        assert_eq!(snapshot(&db).await, before, "{headers:?}");
    }
    for headers in cross.iter().cycle().take(6) {
        let res = post_with(
            &console.url("/signin"),
            None,
            form(&[("name", "eve"), ("token", "guess-guess-guess-guess")]),
            headers,
        )
        .await;
        assert_eq!(res.status(), 403, "{headers:?}");
        assert!(res.headers().get("set-cookie").is_none());
    }
    // The operator signs in as a browser would, from the console's own page.
    let res = post_with(
        &console.url("/signin"),
        None,
        form(&[("name", "alice"), ("token", TOKEN)]),
        &[("sec-fetch-site", "same-origin"), ("origin", &console.base)],
    )
    .await;
    assert_eq!(res.status(), 303, "not locked out by the posts above");
    let res = post_with(
        &console.url("/action"),
        Some(&s.cookie),
        replay,
        &[("origin", &console.base)],
    )
    .await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        crate::common::row(&db, "xsite:target").await.state,
        "pending"
    );
}

/// "Everything the filter matches" after an outage: the confirmation says how many match
/// in all, not how many were fetched, and the action touches the oldest 500.
#[tokio::test]
async fn an_action_on_a_large_filter_says_how_many_match_and_takes_the_oldest_500() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for (state, n) in [("dead", 620), ("held", 610)] {
        c.batch_execute(&format!(
            "SELECT outbox.enqueue('big:{state}:' || g, 'webhook',
                 jsonb_build_object('url', 'https://h.example/'), held => true)
             FROM generate_series(1, {n}) g;
             UPDATE outbox.messages SET state = 'dead', dead_at = now(),
                 error_class = 'permanent', last_error = '410 gone'
             WHERE message_key LIKE 'big:dead:%';"
        ))
        .await
        .unwrap();
    }
    let console = Console::start(&db);
    let s = sign_in(&console, "ops").await;
    for (from, verb, n, after) in [
        ("dead", "replay:filter", 620, "pending"),
        ("held", "approve:filter", 610, "pending"),
    ] {
        let step = |confirmed: bool| {
            let mut p = vec![("csrf", s.csrf.as_str()), ("do", verb), ("from", from)];
            if confirmed {
                p.push(("confirmed", "yes"));
            }
            form(&p)
        };
        let res = post_form(&console.url("/action"), Some(&s.cookie), step(false)).await;
        assert_eq!(res.status(), 200);
        let page = res.text().await.unwrap();
        assert!(
            page.contains(&format!("The filter matches {n};")),
            "{from}: {}",
            error_line_or_all(&page)
        );
        let res = post_form(&console.url("/action"), Some(&s.cookie), step(true)).await;
        assert_eq!(res.status(), 200);
        let moved: i64 = db
            .scalar(&format!(
                "SELECT count(*) FROM outbox.messages WHERE message_key LIKE 'big:{from}:%' AND state = '{after}'"
            ))
            .await;
        assert_eq!(moved, 500, "{from}");
        let oldest_left: bool = db
            .scalar(&format!(
                "SELECT min(id) FILTER (WHERE state <> '{after}') > max(id) FILTER (WHERE state = '{after}')
                 FROM outbox.messages WHERE message_key LIKE 'big:{from}:%'"
            ))
            .await;
        assert!(oldest_left, "{from}: the oldest 500 were taken");
    }
}

fn error_line_or_all(page: &str) -> String {
    page.find("<p id=\"error\">")
        .map(|_| error_line(page))
        .unwrap_or_else(|| page.chars().take(2000).collect())
}

/// A client that opens a connection and never finishes its request is let go: the
/// console does not hold connections (and file descriptors) for whoever cares to open them.
#[tokio::test]
async fn a_request_head_that_never_ends_is_cut_off() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let db = TestDb::new().await;
    let console = Console::start(&db);
    let addr = console.base.trim_start_matches("http://").to_owned();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
    sock.write_all(b"GET /signin HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    let mut buf = [0u8; 512];
    let closed = tokio::time::timeout(Duration::from_secs(50), async {
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "still open after 50 s");
    assert!(t0.elapsed() >= Duration::from_secs(20), "closed too early");
    // The console still answers.
    let res = http().get(console.url("/signin")).send().await.unwrap();
    assert_eq!(res.status(), 200);
}

/// A payload's text with a bidirectional override (or a line separator) is shown escaped:
/// the page must not show text other than what is stored. JSON leaves those characters as
/// they are; the payload's and the response's lines go through the console's escaping.
#[tokio::test]
async fn a_payload_with_bidi_overrides_is_shown_escaped() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(
        "bidi:1",
        serde_json::json!({"url": "https://h.example/", "body": {"note": "pay \u{202e}0001$ to\u{2028}x"}}),
    )
    .held(true);
    let id = outboxd::enqueue(&c, &msg).await.unwrap().id;
    c.execute(
        "UPDATE outbox.messages SET response = '{\"status\": 200, \"body\": \"\u{2066}ok\"}' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let console = Console::start(&db);
    let s = sign_in(&console, "ops").await;
    let page = get(&console.url(&format!("/message/{id}")), &s.cookie)
        .await
        .text()
        .await
        .unwrap();
    for raw in ['\u{202e}', '\u{2028}', '\u{2066}'] {
        assert!(!page.contains(raw), "{:?} reached the page", raw);
    }
    assert!(page.contains("pay \\u{202e}0001$ to\\u{2028}x"), "{page}");
    assert!(page.contains("\\u{2066}ok"), "{page}");
}

/// The confirmed action holds each row to the state the confirmation page showed: a dead
/// letter replayed by someone else between the page and its button is not cancelled (the
/// SQL function takes pending rows too, and used to), nor one replayed and dead again (a
/// different failure), and the page says why.
#[tokio::test]
async fn a_row_that_changed_state_after_the_confirmation_page_is_not_touched() {
    let db = TestDb::new().await;
    let a = dead_email(&db, "seen:a").await;
    let b = dead_email(&db, "seen:b").await;
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    // The confirmation page's own form, field by field, as the browser would post it.
    let confirm = |pairs: Vec<(&'static str, String)>| {
        let console = &console;
        let s = &s;
        async move {
            let mut all: Vec<(&str, &str)> = vec![("csrf", s.csrf.as_str())];
            all.extend(pairs.iter().map(|(k, v)| (*k, v.as_str())));
            let page = post_form(&console.url("/action"), Some(&s.cookie), form(&all))
                .await
                .text()
                .await
                .unwrap();
            let mut fields: Vec<(String, String)> = page
                .split("<input type=\"hidden\" ")
                .skip(1)
                .filter_map(|tag| {
                    let name = tag.split("name=\"").nth(1)?.split('"').next()?;
                    let value = tag.split("value=\"").nth(1)?.split('"').next()?;
                    Some((name.to_owned(), value.to_owned()))
                })
                .collect();
            fields.push(("reason".into(), "not needed".into()));
            fields
        }
    };
    let fields = confirm(vec![
        ("do", "cancel:filter".into()),
        ("from", "dead".into()),
    ])
    .await;
    let seen: Vec<&str> = fields
        .iter()
        .filter(|(k, _)| k == "seen")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(seen.len(), 2, "{fields:?}");
    assert!(seen[0].starts_with(&format!("{a}:dead:")), "{seen:?}");
    assert!(seen[1].starts_with(&format!("{b}:dead:")), "{seen:?}");
    let post = |fields: Vec<(String, String)>| {
        let console = &console;
        let s = &s;
        async move {
            let pairs: Vec<(&str, &str)> = fields
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            post_form(&console.url("/action"), Some(&s.cookie), form(&pairs)).await
        }
    };
    // Another operator replays one of them meanwhile.
    let mut c = db.client().await;
    let replay = |id: i64| outboxd::ops::ReplaySelection::Named(vec![outboxd::ops::Target::Id(id)]);
    outboxd::ops::replay(&mut c, &replay(a), "cli:bob", false)
        .await
        .unwrap();
    let refused = |fields: Vec<(String, String)>, want: String| {
        let post = &post;
        let db = &db;
        async move {
            let before = snapshot(db).await;
            let res = post(fields).await;
            assert_eq!(res.status(), 409);
            let line = error_line(&res.text().await.unwrap());
            assert!(line.contains(&want), "{line}");
            assert_eq!(snapshot(db).await, before);
        }
    };
    refused(
        fields,
        format!("message {a} is pending now, and was dead when it was shown; nothing cancelled"),
    )
    .await;
    assert_eq!(crate::common::row(&db, "seen:a").await.state, "pending");
    assert_eq!(crate::common::row(&db, "seen:b").await.state, "dead");

    // Replayed and dead again between the page and the button: another failure, another
    // decision. Cancel holds to what it showed, and so does replay: shown dead `permanent`,
    // replayed from the CLI meanwhile and dead `ambiguous` now, it is not replayed (and
    // sent) once more.
    for (verb, class_now, done) in [
        ("cancel", "permanent", "cancelled"),
        ("replay", "ambiguous", "replayed"),
    ] {
        let fields = confirm(vec![
            ("do", format!("{verb}:selected")),
            ("id", b.to_string()),
        ])
        .await;
        outboxd::ops::replay(&mut c, &replay(b), "cli:bob", false)
            .await
            .unwrap();
        c.execute(
            "UPDATE outbox.messages SET state = 'dead', dead_at = now(), updated_at = now(), \
             error_class = $2 WHERE id = $1",
            &[&b, &class_now],
        )
        .await
        .unwrap();
        refused(
            fields,
            format!("message {b} changed since it was shown, and is dead again; nothing {done}"),
        )
        .await;
    }
    let before = snapshot(&db).await;

    // A forged state is a bad request, and changes nothing either.
    for forged in ["x:dead:1", "1:dead", "1:dead:x"] {
        let res = post(vec![
            ("csrf".into(), s.csrf.clone()),
            ("do".into(), "cancel:selected".into()),
            ("id".into(), b.to_string()),
            ("seen".into(), forged.into()),
            ("confirmed".into(), "yes".into()),
        ])
        .await;
        assert_eq!(res.status(), 400, "{forged}");
    }
    // A hostile state is named escaped and cut short, never as markup.
    let hostile = format!(
        "{b}:<script>alert(1)</script>\u{1b}[2J{}:1",
        "x".repeat(5000)
    );
    let res = post(vec![
        ("csrf".into(), s.csrf.clone()),
        ("do".into(), "cancel:selected".into()),
        ("id".into(), b.to_string()),
        ("seen".into(), hostile),
        ("confirmed".into(), "yes".into()),
    ])
    .await;
    assert_eq!(res.status(), 409);
    let page = res.text().await.unwrap();
    assert!(!page.contains("<script>alert"), "{page}");
    assert!(!page.contains('\u{1b}'), "{page}");
    assert!(!page.contains(&"x".repeat(100)), "{}", error_line(&page));
    assert_eq!(snapshot(&db).await, before);
}

/// An action on rows another transaction holds gives up within the console's lock timeout
/// (10 s) with an error page that says so, and changes nothing, then or later. Before, it
/// waited past the page's own 60 s and answered "timed out", its statement still waiting
/// in the server and holding one of the console's connections.
#[tokio::test]
async fn an_action_on_rows_held_elsewhere_gives_up_and_changes_nothing() {
    let db = TestDb::new().await;
    let id = dead_email(&db, "locked:target").await;
    let console = Console::start(&db);
    let s = sign_in(&console, "alice").await;
    let before = snapshot(&db).await;
    let mut holder = db.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM outbox.messages WHERE id = $1 FOR UPDATE",
        &[&id],
    )
    .await
    .unwrap();
    let ids = id.to_string();
    let body = form(&[
        ("do", "replay:selected"),
        ("id", ids.as_str()),
        ("confirmed", "yes"),
        ("csrf", s.csrf.as_str()),
    ]);
    // Longer than the 10 s the shared client waits: the answer is expected after 10 s.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(45))
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let res = client
        .post(console.url("/action"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("cookie", s.cookie.as_str())
        .body(body)
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(res.status(), 503);
    let page = res.text().await.unwrap();
    assert!(page.contains("lock timeout"), "{}", error_line(&page));
    assert!(took < Duration::from_secs(30), "answered after {took:?}");
    // Nothing waits in the server any more: letting the rows go changes nothing.
    let waiting: i64 = db
        .scalar(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND wait_event_type = 'Lock'",
            db.name
        ))
        .await;
    assert_eq!(waiting, 0);
    tx.rollback().await.unwrap();
    assert_eq!(snapshot(&db).await, before);
    assert_eq!(crate::common::row(&db, "locked:target").await.state, "dead");
}
