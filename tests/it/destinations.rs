//! Rules per destination (issue 18, parts 1 and 3): the name they go by
//! (`outbox.destination_of`, `sql/0013`), `--host-concurrency` and rate limits.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;
use outboxd::claim;
use outboxd::model::Channel;

/// The destination of a webhook URL, as the claim and an operator see it.
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
/// path or a query; hostile URLs give no name (the worker refuses them itself).
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
    ];
    for (url, want) in cases {
        let got = destination(&db, &serde_json::json!(url)).await;
        assert_eq!(got.as_deref(), *want, "destination of {url:?}");
    }
    // Not a string, and not a webhook: no name.
    assert_eq!(destination(&db, &serde_json::json!(5)).await, None);
    let email: Option<String> = db
        .scalar("SELECT outbox.destination_of('email', '{\"url\": \"https://a.example\"}')")
        .await;
    assert_eq!(email, None);
    // A long host is still one name, read in bounded time (no backtracking blow-up).
    let long = format!("https://{}.example/", "a".repeat(100_000));
    let got = destination(&db, &serde_json::json!(long)).await;
    assert_eq!(got.map(|h| h.len()), Some(100_000 + ".example".len()));
}

/// The claim hands each webhook its destination; e-mail has none.
#[tokio::test]
async fn the_claim_names_each_messages_destination() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for (key, url) in [
        ("a", "https://A.example:8443/p?q=1"),
        ("b", "http://b.example/x"),
    ] {
        outboxd::enqueue(
            &c,
            &outboxd::NewMessage::webhook(key, serde_json::json!({"url": url, "body": {}})),
        )
        .await
        .unwrap();
    }
    let batch = claim::claim(
        &c,
        &[Channel::Webhook],
        10,
        "w",
        std::time::Duration::from_secs(30),
        &outboxd::retry::RetryPolicy::default(),
    )
    .await
    .unwrap();
    let mut got: Vec<_> = batch
        .claimed
        .iter()
        .map(|m| (m.key.clone(), m.destination.clone()))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("a".into(), Some("a.example:8443".into())),
            ("b".into(), Some("b.example".into())),
        ]
    );
}
