//! The destination check end to end, with the default policy (private networks refused).
//!
//! The receiver listens on 127.0.0.1, so any request to a loopback spelling that got
//! through would be recorded there. The 10.x and 169.254.x cases are refused as literal
//! IPs before any connection is attempted; they never reach the network.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::receiver::Receiver;
use common::*;
use outboxd::deliver::webhook::settings::{DestinationPolicy, WebhookConfig};

const WAIT: Duration = Duration::from_secs(15);

/// Webhook settings with the given destination policy and a short timeout.
fn webhook(destinations: DestinationPolicy) -> WebhookConfig {
    WebhookConfig {
        timeout: Duration::from_millis(500),
        signing: Default::default(),
        destinations,
    }
}

/// Enqueues `url` (built from the receiver's port) under the default policy and checks it
/// is dead `invalid`, "not allowed", with no request at the receiver.
async fn refused(key: &str, url: impl FnOnce(u16) -> String) {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let url = url(rx.addr.port());
    // max_attempts 3: if the check let it through and the connection failed, it would be
    // retried (transient), not dead `invalid` at once.
    enqueue_webhook(&db, key, &url, 3, true).await;
    let w = RunningWorker::start(
        &db,
        test_worker_config("w"),
        webhook(DestinationPolicy::default()),
    );
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    assert_eq!(
        row.error_class.as_deref(),
        Some("invalid"),
        "{url}: {row:?}"
    );
    assert_eq!(row.attempts, 1, "{url}");
    let err = row.last_error.unwrap_or_default();
    assert!(err.contains("not allowed"), "{url}: last_error {err:?}");
    assert_eq!(
        attempts(&db, key).await,
        vec![(
            1,
            "dead".to_owned(),
            Some("invalid".to_owned()),
            None,
            false
        )],
        "{url}"
    );
    assert_eq!(rx.requests().len(), 0, "{url} reached the receiver");
}

#[tokio::test]
async fn loopback_literal_is_refused() {
    refused("ssrf:127.0.0.1", |p| format!("http://127.0.0.1:{p}/")).await;
}

#[tokio::test]
async fn a_name_resolving_to_loopback_is_refused() {
    refused("ssrf:localhost", |p| format!("http://localhost:{p}/")).await;
}

#[tokio::test]
async fn short_ipv4_form_is_refused() {
    refused("ssrf:127.1", |p| format!("http://127.1:{p}/")).await;
}

#[tokio::test]
async fn decimal_ipv4_form_is_refused() {
    refused("ssrf:decimal", |p| format!("http://2130706433:{p}/")).await;
}

#[tokio::test]
async fn hex_ipv4_form_is_refused() {
    refused("ssrf:hex", |p| format!("http://0x7f000001:{p}/")).await;
}

#[tokio::test]
async fn octal_ipv4_form_is_refused() {
    refused("ssrf:octal", |p| format!("http://0177.0.0.1:{p}/")).await;
}

#[tokio::test]
async fn unspecified_ipv4_is_refused() {
    // Connecting to 0.0.0.0 reaches the local host on Linux.
    refused("ssrf:0.0.0.0", |p| format!("http://0.0.0.0:{p}/")).await;
}

#[tokio::test]
async fn unspecified_ipv6_is_refused() {
    refused("ssrf:[::]", |p| format!("http://[::]:{p}/")).await;
}

#[tokio::test]
async fn ipv6_loopback_is_refused() {
    refused("ssrf:[::1]", |p| format!("http://[::1]:{p}/")).await;
}

#[tokio::test]
async fn ipv4_mapped_ipv6_loopback_is_refused() {
    refused("ssrf:mapped", |p| format!("http://[::ffff:127.0.0.1]:{p}/")).await;
}

#[tokio::test]
async fn private_network_literal_is_refused_before_connecting() {
    refused("ssrf:10.0.0.1", |_| "http://10.0.0.1/".to_owned()).await;
}

#[tokio::test]
async fn cloud_metadata_address_is_refused_before_connecting() {
    refused("ssrf:metadata", |_| {
        "http://169.254.169.254/latest/meta-data".to_owned()
    })
    .await;
}

#[tokio::test]
async fn an_allowed_host_is_exempt_but_only_by_its_own_name() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let port = rx.addr.port();
    enqueue_webhook(
        &db,
        "allow:name",
        &format!("http://localhost:{port}/ok"),
        3,
        true,
    )
    .await;
    enqueue_webhook(
        &db,
        "allow:ip",
        &format!("http://127.0.0.1:{port}/no"),
        3,
        true,
    )
    .await;
    let policy = DestinationPolicy::from_values(None, Some("localhost")).unwrap();
    let w = RunningWorker::start(&db, test_worker_config("w"), webhook(policy));
    let ok = wait_for_state(&db, "allow:name", "delivered", WAIT).await;
    let no = wait_for_state(&db, "allow:ip", "dead", WAIT).await;
    w.stop().await;
    assert_eq!(ok.attempts, 1);
    assert_eq!(no.error_class.as_deref(), Some("invalid"));
    assert!(
        no.last_error
            .as_deref()
            .unwrap_or("")
            .contains("not allowed"),
        "{:?}",
        no.last_error
    );
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1, "only the exempt host got through");
    assert_eq!(reqs[0].uri.path(), "/ok");
    assert_eq!(
        reqs[0].header("idempotency-key").as_deref(),
        Some("allow:name")
    );
}

/// An allow-list entry is matched against the URL's host as the URL parser writes it:
/// `LOCALHOST` is the host of `http://localhost/`, and `0:0:0:0:0:0:0:1` that of
/// `http://[::1]/`. Such entries used to be accepted at start-up and never match (the
/// message dead `invalid`). An IPv4 entry the parser would read as another address
/// (`127.000.000.010` is 127.0.0.8: `010` is octal to it) is refused at start-up instead.
#[tokio::test]
async fn allow_list_entries_match_however_the_host_is_written() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let port = rx.addr.port();
    enqueue_webhook(
        &db,
        "allow:upper",
        &format!("http://localhost:{port}/upper"),
        3,
        true,
    )
    .await;
    let policy = DestinationPolicy::from_values(None, Some("LOCALHOST, 0:0:0:0:0:0:0:1")).unwrap();
    assert!(
        policy.allow_hosts.contains("::1"),
        "{:?}",
        policy.allow_hosts
    );
    let w = RunningWorker::start(&db, test_worker_config("w"), webhook(policy));
    wait_for_state(&db, "allow:upper", "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(rx.requests().len(), 1);
    let err = DestinationPolicy::from_values(None, Some("127.000.000.010")).unwrap_err();
    assert!(err.0.contains("127.000.000.010"), "{err}");
}

#[tokio::test]
async fn allow_private_networks_lets_loopback_through() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    let key = "allow:private";
    enqueue_webhook(&db, key, &rx.url("/hook"), 3, true).await;
    let policy = DestinationPolicy {
        allow_private_networks: true,
        ..Default::default()
    };
    let w = RunningWorker::start(&db, test_worker_config("w"), webhook(policy));
    let row = wait_for_state(&db, key, "delivered", WAIT).await;
    w.stop().await;
    assert_eq!(row.attempts, 1);
    assert_eq!(rx.requests().len(), 1);
}

/// A special-purpose address that is not globally reachable, written as a literal, is
/// refused by the guard's literal check: dead `invalid` on the first attempt with the
/// guard's own message (the one written before any connection is made — a connection that
/// had been tried would have failed as `transient` or `ambiguous` and been retried), and
/// the same message in the attempt's history.
async fn refused_before_connecting(key: &str, url: &str, host: &str) {
    let db = TestDb::new().await;
    enqueue_webhook(&db, key, url, 3, true).await;
    let w = RunningWorker::start(
        &db,
        test_worker_config("w"),
        webhook(DestinationPolicy::default()),
    );
    let row = wait_for_state(&db, key, "dead", WAIT).await;
    w.stop().await;
    let expected = format!(
        "destination not allowed: {host} is a private or reserved address ({})",
        outboxd::deliver::guard::HOW_TO_ALLOW
    );
    assert_eq!(
        (
            row.error_class.as_deref(),
            row.attempts,
            row.last_error.as_deref()
        ),
        (Some("invalid"), 1, Some(expected.as_str())),
        "{url}: {row:?}"
    );
    assert_eq!(
        attempts(&db, key).await,
        vec![(
            1,
            "dead".to_owned(),
            Some("invalid".to_owned()),
            None,
            false
        )],
        "{url}"
    );
    let stored: Option<String> = db
        .client()
        .await
        .query_one(
            "SELECT a.error FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id \
             WHERE m.message_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored.as_deref(), Some(expected.as_str()), "{url}");
}

#[tokio::test]
async fn ipv4_documentation_literal_is_refused_before_connecting() {
    refused_before_connecting("ssrf:192.0.2.1", "http://192.0.2.1/hook", "192.0.2.1").await;
}

#[tokio::test]
async fn ipv6_documentation_literal_is_refused_before_connecting() {
    refused_before_connecting(
        "ssrf:[2001:db8::1]",
        "http://[2001:db8::1]/hook",
        "[2001:db8::1]",
    )
    .await;
}

/// A newcomer's first message to a receiver on their own machine is refused; the refusal
/// (in `last_error`, one line) names the settings that lift it, for a literal address and
/// for a name that resolves to loopback, and `outboxd run` says its destination policy once
/// at start-up. Neither shows the URL's path or query.
#[tokio::test]
async fn a_refused_local_receiver_is_told_the_settings_that_allow_it() {
    use common::binary::{outboxd, run};
    let db = TestDb::new().await;
    let url = db.url();
    for (key, to) in [
        (
            "local:literal",
            "http://127.0.0.1:9/hooks/private-path?token=s3cret",
        ),
        (
            "local:name",
            "http://localhost:9/hooks/private-path?token=s3cret",
        ),
    ] {
        enqueue_webhook(&db, key, to, 3, true).await;
    }
    let out = run(outboxd(Some(&url)).args(["run", "--drain"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let starts: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("webhook destinations"))
        .collect();
    assert_eq!(starts.len(), 1, "one policy line: {}", out.stderr);
    for part in [
        "private_networks=\"refused\"",
        "allowed_hosts=0 hosts=-",
        "OUTBOXD_ALLOW_PRIVATE_NETWORKS=true",
        "OUTBOXD_WEBHOOK_ALLOW_HOSTS",
    ] {
        assert!(starts[0].contains(part), "{part} in {}", starts[0]);
    }
    for key in ["local:literal", "local:name"] {
        let row = row(&db, key).await;
        assert_eq!(
            (row.state.as_str(), row.error_class.as_deref(), row.attempts),
            ("dead", Some("invalid"), 1),
            "{key}: {row:?}"
        );
        let err = row.last_error.unwrap_or_default();
        assert!(err.starts_with("destination not allowed: "), "{key}: {err}");
        for part in [
            "OUTBOXD_ALLOW_PRIVATE_NETWORKS=true",
            "OUTBOXD_WEBHOOK_ALLOW_HOSTS",
        ] {
            assert!(err.contains(part), "{key}: {part} in {err}");
        }
        assert!(!err.contains('\n'), "{key}: {err}");
        assert!(
            !err.contains("private-path") && !err.contains("s3cret"),
            "{key}: {err}"
        );
    }
    assert!(
        !out.stderr.contains("private-path") && !out.stderr.contains("s3cret"),
        "{}",
        out.stderr
    );

    // With an allow-list, the line counts and names the hosts (in name order).
    let out = run(outboxd(Some(&url))
        .args(["run", "--drain"])
        .env("OUTBOXD_WEBHOOK_ALLOW_HOSTS", "hooks.internal,10.0.0.5"));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("webhook destinations"))
        .unwrap_or_else(|| panic!("a policy line: {}", out.stderr));
    assert!(
        line.contains("allowed_hosts=2") && line.contains("hosts=10.0.0.5,hooks.internal"),
        "{line}"
    );
    let out = run(outboxd(Some(&url))
        .args(["run", "--drain"])
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true"));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr
            .lines()
            .any(|l| l.contains("webhook destinations")
                && l.contains("private_networks=\"allowed\"")),
        "{}",
        out.stderr
    );
}
