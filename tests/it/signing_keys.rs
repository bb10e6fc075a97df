//! Signing keys: several secrets in `OUTBOXD_WEBHOOK_SECRET` (a rotation: each signs, in
//! order), named secrets `OUTBOXD_WEBHOOK_SECRET_<NAME>` a payload picks with `"secret"`,
//! checked with the official `standardwebhooks` verifier on what the real binary sent.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::binary::{outboxd, run_within};
use common::receiver::Receiver;
use common::*;

const OLD: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NEW: &str = "whsec_c2Vjb25kIGtleSBmb3Igcm90YXRpb24uLi4=";
const STRIPE: &str = "whsec_dGhlIHN0cmlwZSBhY2NvdW50J3Mga2V5IQ==";

/// `outboxd run --drain` with `env`, to its end.
fn drain(db: &TestDb, env: &[(&str, &str)]) -> common::binary::Output {
    let mut cmd = outboxd(Some(&db.url()));
    cmd.args(["run", "--drain", "--poll-interval", "100ms"])
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_within(&mut cmd, Duration::from_secs(30))
}

async fn enqueue(db: &TestDb, key: &str, payload: serde_json::Value) {
    let c = db.client().await;
    outboxd::enqueue(
        &c,
        &outboxd::NewMessage::webhook(key, payload).max_attempts(1),
    )
    .await
    .unwrap();
}

fn verifies(secret: &str, r: &common::receiver::Recorded) -> bool {
    standardwebhooks::Webhook::new(secret)
        .unwrap()
        .verify(&r.body, &r.headers)
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_rotation_a_receiver_with_either_secret_accepts_every_request() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    for i in 0..3 {
        enqueue(
            &db,
            &format!("rot:{i}"),
            serde_json::json!({"url": rx.url("/h"), "body": {"i": i}}),
        )
        .await;
    }
    let both = format!("{OLD}  {NEW}");
    let out = drain(&db, &[("OUTBOXD_WEBHOOK_SECRET", &both)]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 3);
    for r in &reqs {
        // A receiver that has only the old secret, and one that has only the new one.
        assert!(verifies(OLD, r), "old secret");
        assert!(verifies(NEW, r), "new secret");
        assert!(!verifies(STRIPE, r), "a real check");
        let sig = r.header("webhook-signature").unwrap();
        let parts: Vec<&str> = sig.split(' ').collect();
        assert_eq!(parts.len(), 2, "{sig}");
        assert!(parts.iter().all(|p| p.starts_with("v1,")), "{sig}");
        // In the order given: the old key's signature first.
        let old_only = standardwebhooks::Webhook::new(OLD).unwrap();
        let mut h = r.headers.clone();
        h.insert("webhook-signature", parts[0].parse().unwrap());
        assert!(
            old_only.verify(&r.body, &h).is_ok(),
            "first is the old key's"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_picks_a_named_secret_and_an_unknown_name_sends_nothing() {
    let db = TestDb::new().await;
    let rx = Receiver::start().await;
    enqueue(
        &db,
        "named:stripe",
        serde_json::json!({"url": rx.url("/s"), "secret": "stripe"}),
    )
    .await;
    enqueue(
        &db,
        "named:default",
        serde_json::json!({"url": rx.url("/d")}),
    )
    .await;
    enqueue(
        &db,
        "named:unknown",
        serde_json::json!({"url": rx.url("/u"), "secret": "billing"}),
    )
    .await;
    let hostile = [
        serde_json::json!("a b"),
        serde_json::json!("../etc"),
        serde_json::json!("x\u{1b}[2J"),
        serde_json::json!("s".repeat(65)),
        serde_json::json!(""),
        serde_json::json!(7),
        serde_json::json!({"name": "stripe"}),
    ];
    for (i, s) in hostile.iter().enumerate() {
        enqueue(
            &db,
            &format!("named:bad:{i}"),
            serde_json::json!({"url": rx.url("/b"), "secret": s}),
        )
        .await;
    }
    let out = drain(
        &db,
        &[
            ("OUTBOXD_WEBHOOK_SECRET", OLD),
            ("OUTBOXD_WEBHOOK_SECRET_STRIPE", STRIPE),
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let stripe = rx.requests_for("named:stripe");
    assert_eq!(stripe.len(), 1);
    assert!(verifies(STRIPE, &stripe[0]), "signed with the named secret");
    assert!(!verifies(OLD, &stripe[0]), "and only with it");
    let default = rx.requests_for("named:default");
    assert!(verifies(OLD, &default[0]));
    assert_eq!(
        rx.requests().len(),
        2,
        "nothing sent for unknown or bad names"
    );

    let unknown = row(&db, "named:unknown").await;
    assert_eq!(unknown.state, "dead");
    assert_eq!(unknown.error_class.as_deref(), Some("invalid"));
    let err = unknown.last_error.unwrap_or_default();
    assert!(err.contains("BILLING is not configured"), "{err}");
    for i in 0..hostile.len() {
        let r = row(&db, &format!("named:bad:{i}")).await;
        assert_eq!(r.state, "dead", "{i}");
        assert_eq!(r.error_class.as_deref(), Some("invalid"), "{i}");
        let err = r.last_error.unwrap_or_default();
        assert!(err.contains("payload.secret must be a name"), "{i}: {err}");
        assert!(!err.contains('\u{1b}'), "{i}: {err}");
    }
    assert!(!out.stderr.contains("dGhlIHN0cmlwZ"), "a key in the log");
}

/// A malformed secret: exit 2 at start-up, one line naming the variable, never the value.
#[test]
fn malformed_secrets_are_usage_errors() {
    let cases: [(&[(&str, &str)], &str); 8] = [
        // Set but empty or blank: refused, never taken as unset (which would send unsigned).
        (
            &[("OUTBOXD_WEBHOOK_SECRET", "")],
            "OUTBOXD_WEBHOOK_SECRET is set but holds no secret",
        ),
        (
            &[("OUTBOXD_WEBHOOK_SECRET", " ")],
            "OUTBOXD_WEBHOOK_SECRET is set but holds no secret",
        ),
        (
            &[("OUTBOXD_WEBHOOK_SECRET_STRIPE", "")],
            "OUTBOXD_WEBHOOK_SECRET_STRIPE is set but holds no secret",
        ),
        (
            &[("OUTBOXD_WEBHOOK_SECRET", "whsec_MfKQ9r8G secretvalue1")],
            "OUTBOXD_WEBHOOK_SECRET must look like whsec_",
        ),
        (
            &[("OUTBOXD_WEBHOOK_SECRET", "whsec_!!secretvalue1")],
            "OUTBOXD_WEBHOOK_SECRET: the part after whsec_",
        ),
        (
            &[("OUTBOXD_WEBHOOK_SECRET_STRIPE", "secretvalue1")],
            "OUTBOXD_WEBHOOK_SECRET_STRIPE must look like",
        ),
        (
            &[("OUTBOXD_WEBHOOK_SECRET_Stripe", OLD)],
            "NAME of upper-case letters",
        ),
        (
            &[("OUTBOXD_WEBHOOK_SECRET_A-B", OLD)],
            "NAME of upper-case letters",
        ),
    ];
    for (env, want) in cases {
        let mut cmd = outboxd(Some(common::binary::UNREACHABLE_URL));
        cmd.args(["run"]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = run_within(&mut cmd, Duration::from_secs(20));
        assert_eq!(out.code, Some(2), "{env:?}: {}", out.stderr);
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{env:?}: {lines:?}");
        assert!(
            lines[0].contains(want),
            "{env:?}: want {want:?} in {lines:?}"
        );
        assert!(
            !out.stderr.contains("secretvalue1"),
            "{env:?}: the value was printed"
        );
        assert!(
            !out.stderr.contains("MfKQ9r8GKY"),
            "{env:?}: the value was printed"
        );
    }
}
