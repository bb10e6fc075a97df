//! Webhooks over https, end to end: the real `outboxd` binary delivers to a Python `ssl`
//! receiver whose certificate a test CA signed. The daemon trusts the platform's roots
//! (rustls-platform-verifier); on Linux those come from `SSL_CERT_FILE` when it is set, so
//! the test hands the daemon its CA that way, in the daemon's own environment.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::binary::{outboxd, run_within};
use common::pki::{Pki, make_pki};
use common::*;
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// The Python receiver, its port and the request lines it printed.
struct HttpsReceiver {
    port: u16,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    _child: tokio::process::Child,
}

impl HttpsReceiver {
    async fn start(pki: &Pki) -> HttpsReceiver {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/https_receiver.py");
        let python = std::env::var("OUTBOXD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut child = tokio::process::Command::new(&python)
            .args([script, &pki.path("server.crt"), &pki.path("server.key")])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("the receiver started")
            .unwrap()
            .unwrap_or_default();
        let port = first
            .strip_prefix("READY ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("the receiver said {first:?}"));
        HttpsReceiver {
            port,
            lines,
            _child: child,
        }
    }

    /// The request lines printed within `wait`.
    async fn requests(&mut self, wait: Duration) -> Vec<String> {
        let mut seen = Vec::new();
        while let Ok(Ok(Some(line))) = tokio::time::timeout(wait, self.lines.next_line()).await {
            seen.push(line);
        }
        seen
    }
}

/// Runs `outboxd run --drain` against `db`, trusting the CA in `ca_file`.
fn drain(db: &TestDb, ca_file: &str) {
    let out = run_within(
        outboxd(Some(&db.url()))
            .args(["run", "--drain", "--worker-id", "tls"])
            .env("SSL_CERT_FILE", ca_file)
            .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
            .env("RUST_LOG", "warn"),
        Duration::from_secs(60),
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

#[tokio::test]
async fn an_https_webhook_is_delivered_and_an_unknown_ca_is_a_transient_failure() {
    let dir = std::env::temp_dir().join(format!(
        "outboxd-webhook-tls-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let pki = make_pki(&dir);
    let mut rx = HttpsReceiver::start(&pki).await;
    let db = TestDb::new().await;
    // `localhost`: the name on the certificate.
    let url = format!("https://localhost:{}/hook?x=1", rx.port);

    enqueue_webhook(&db, "tls:trusted", &url, 1, true).await;
    drain(&db, &pki.path("ca.crt"));
    let trusted = row(&db, "tls:trusted").await;
    assert_eq!(
        (
            trusted.state.as_str(),
            trusted.error_class,
            trusted.last_error
        ),
        ("delivered", None, None)
    );
    let seen = rx.requests(Duration::from_secs(2)).await;
    assert_eq!(seen, ["REQ POST /hook?x=1"]);

    // The same server, trusted by no CA the daemon knows: the handshake fails before any
    // of the request is sent, so the attempt is transient (and, with one attempt allowed,
    // the message is dead as `exhausted`, never `ambiguous`).
    enqueue_webhook(&db, "tls:unknown-ca", &url, 1, true).await;
    drain(&db, &pki.path("other-ca.crt"));
    let unknown = row(&db, "tls:unknown-ca").await;
    let error = unknown.last_error.unwrap_or_default();
    assert_eq!(unknown.state, "dead");
    assert_eq!(unknown.error_class.as_deref(), Some("exhausted"), "{error}");
    assert!(error.starts_with("cannot connect to localhost"), "{error}");
    assert!(error.contains("certificate"), "{error}");
    assert!(
        !error.contains("/hook") && !error.contains("x=1"),
        "{error}"
    );
    assert!(rx.requests(Duration::from_millis(500)).await.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
