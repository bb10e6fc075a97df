//! TLS to PostgreSQL: every sslmode against a throwaway cluster with `ssl = on` and a
//! certificate made here (a CA, a server certificate for `localhost`, a client certificate),
//! and a second cluster without TLS. The cluster's pg_hba.conf admits TLS connections only
//! (`hostssl`; plain `host` is rejected), so every command that succeeds against it
//! connected with TLS.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::binary::{outboxd, run};
use common::cluster::Cluster;
use common::pki::{Pki, make_pki};
use common::receiver::Receiver;
use common::*;

/// A cluster that speaks TLS only, with the test's certificates.
fn tls_cluster() -> (Cluster, Pki) {
    let cluster = Cluster::start();
    let pki = make_pki(&cluster.dir().join("pki"));
    for f in ["server.key", "server.crt", "ca.crt"] {
        cluster.give(&pki.dir.join(f), 0o600);
    }
    cluster.give(&pki.dir, 0o755);
    cluster.reconfigure(
        &format!(
            "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\nssl_ca_file = '{}'",
            pki.path("server.crt"),
            pki.path("server.key"),
            pki.path("ca.crt"),
        ),
        "local all all trust\n\
         hostssl all certuser 127.0.0.1/32 cert\n\
         hostssl all all 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 reject\n",
    );
    (cluster, pki)
}

/// `host`, the cluster's port, and the query `q`; a password that must never be printed.
fn url(cluster: &Cluster, host: &str, user: &str, q: &str) -> String {
    format!(
        "postgres://{user}:hunter2-secret@{host}:{}/postgres?connect_timeout=5&{q}",
        cluster.port()
    )
}

fn assert_no_password(out: &common::binary::Output) {
    assert!(
        !out.stderr.contains("hunter2") && !out.stdout.contains("hunter2"),
        "the password was printed: {}",
        out.stderr
    );
}

/// Runs `outboxd <args>` and returns its output, checked for the password.
fn cmd(database_url: &str, args: &[&str]) -> common::binary::Output {
    let out = run(outboxd(Some(database_url)).args(args));
    assert_no_password(&out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sslmode_against_a_tls_only_server() {
    let (cluster, pki) = tokio::task::spawn_blocking(tls_cluster).await.unwrap();
    let ca = format!("sslrootcert={}", pki.path("ca.crt"));
    let other = format!("sslrootcert={}", pki.path("other-ca.crt"));

    // verify-full with the right CA and the certificate's name: migrate and every operator
    // command connect (plain connections are rejected by pg_hba).
    let good = url(
        &cluster,
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&{ca}"),
    );
    for args in [
        &["migrate"][..],
        &["status", "--json"],
        &["dead"],
        &[
            "enqueue",
            "--key",
            "tls:1",
            "--channel",
            "webhook",
            "--payload",
            r#"{"url": "https://example.com/h"}"#,
        ],
    ] {
        let out = cmd(&good, args);
        assert_eq!(out.code, Some(0), "{args:?}: {}", out.stderr);
    }

    // The defaults and weaker modes connect too: prefer (the default) and require take TLS
    // when offered, without checking the certificate, as libpq does.
    for q in ["", "sslmode=prefer", "sslmode=require"] {
        let out = cmd(&url(&cluster, "127.0.0.1", "postgres", q), &["status"]);
        assert_eq!(out.code, Some(0), "{q}: {}", out.stderr);
    }
    // verify-ca checks the chain, not the name: 127.0.0.1 is not on the certificate.
    let out = cmd(
        &url(
            &cluster,
            "127.0.0.1",
            "postgres",
            &format!("sslmode=verify-ca&{ca}"),
        ),
        &["status"],
    );
    assert_eq!(out.code, Some(0), "verify-ca by address: {}", out.stderr);

    // Refusals: exit 1, one line naming the problem.
    let refused = [
        // Plain text, which this server does not accept.
        (
            url(&cluster, "127.0.0.1", "postgres", "sslmode=disable"),
            "pg_hba.conf",
        ),
        // A CA that did not sign the server's certificate.
        (
            url(
                &cluster,
                "localhost",
                "postgres",
                &format!("sslmode=verify-ca&{other}"),
            ),
            "certificate",
        ),
        (
            url(
                &cluster,
                "localhost",
                "postgres",
                &format!("sslmode=verify-full&{other}"),
            ),
            "certificate",
        ),
        // require with a CA checks the chain, as libpq does.
        (
            url(
                &cluster,
                "localhost",
                "postgres",
                &format!("sslmode=require&{other}"),
            ),
            "certificate",
        ),
        // The right CA, but a host name the certificate was not issued for.
        (
            url(
                &cluster,
                "127.0.0.1",
                "postgres",
                &format!("sslmode=verify-full&{ca}"),
            ),
            "certificate",
        ),
        // A certificate-authenticated user without a client certificate.
        (
            url(
                &cluster,
                "localhost",
                "certuser",
                &format!("sslmode=verify-full&{ca}"),
            ),
            "certificate",
        ),
    ];
    for (u, want) in &refused {
        let out = cmd(u, &["status"]);
        assert_eq!(out.code, Some(1), "{u}: {}", out.stderr);
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{u}: {lines:?}");
        assert!(
            lines[0].to_lowercase().contains(want),
            "{u}: want {want:?} in {lines:?}"
        );
    }

    // require checks the chain against ~/.postgresql/root.crt when that file exists, as
    // libpq does: here it holds a CA that did not sign the server's certificate.
    let home = pki.path("home");
    std::fs::create_dir_all(format!("{home}/.postgresql")).unwrap();
    std::fs::copy(
        pki.path("other-ca.crt"),
        format!("{home}/.postgresql/root.crt"),
    )
    .unwrap();
    let require = url(&cluster, "localhost", "postgres", "sslmode=require");
    let out = run(outboxd(Some(&require)).env("HOME", &home).args(["status"]));
    assert_eq!(out.code, Some(1), "require with root.crt: {}", out.stderr);
    assert!(out.stderr.contains("certificate"), "{}", out.stderr);
    std::fs::copy(pki.path("ca.crt"), format!("{home}/.postgresql/root.crt")).unwrap();
    let out = run(outboxd(Some(&require)).env("HOME", &home).args(["status"]));
    assert_eq!(out.code, Some(0), "require with root.crt: {}", out.stderr);

    // A client certificate accepted by the `hostssl … cert` rule (the user is the CN).
    let client = url(
        &cluster,
        "localhost",
        "certuser",
        &format!(
            "sslmode=verify-full&{ca}&sslcert={}&sslkey={}",
            pki.path("client.crt"),
            pki.path("client.key")
        ),
    );
    let admin = url(
        &cluster,
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&{ca}"),
    );
    let out = cmd(&admin, &["status"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let c = admin_client(&cluster).await;
    c.batch_execute(
        "CREATE ROLE certuser LOGIN; GRANT USAGE ON SCHEMA outbox TO certuser;
         GRANT SELECT ON ALL TABLES IN SCHEMA outbox TO certuser;",
    )
    .await
    .unwrap();
    let out = cmd(&client, &["status", "--json"]);
    assert_eq!(out.code, Some(0), "client certificate: {}", out.stderr);
    assert!(out.stdout.contains("\"pending\":1"), "{}", out.stdout);
}

/// The admin connection of the test itself, over the cluster's Unix socket (`local` is
/// trusted), so the test does not depend on the code under test.
async fn admin_client(cluster: &Cluster) -> tokio_postgres::Client {
    let mut cfg = tokio_postgres::Config::new();
    cfg.host_path(cluster.dir())
        .port(cluster.port())
        .user("postgres")
        .dbname("postgres");
    connect(&cfg).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_delivers_over_tls_with_every_connection_encrypted() {
    let (cluster, pki) = tokio::task::spawn_blocking(tls_cluster).await.unwrap();
    let good = url(
        &cluster,
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={}", pki.path("ca.crt")),
    );
    assert_eq!(cmd(&good, &["migrate"]).code, Some(0));
    let rx = Receiver::start().await;
    let payload = format!(r#"{{"url": "{}"}}"#, rx.url("/h"));
    let mut child = outboxd(Some(&good))
        .args(["run", "--poll-interval", "1h", "--worker-id", "tls-worker"])
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let c = admin_client(&cluster).await;
    // Polling once an hour: only the LISTEN connection (over TLS), holding the idle mark
    // (`outbox.wake_needed`), brings the next message in time.
    wait_until(
        Duration::from_secs(10),
        "the daemon's LISTEN connection",
        || {
            let c = &c;
            async move {
                let n: i64 = c
                    .query_one(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
                     AND classid = 1869968482 AND objid = 2 AND objsubid = 2 AND granted",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                n > 0
            }
        },
    )
    .await;
    let out = cmd(
        &good,
        &[
            "enqueue",
            "--key",
            "tls:d",
            "--channel",
            "webhook",
            "--payload",
            &payload,
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    rx.wait_for(1, Duration::from_secs(10)).await;
    let rows = c
        .query(
            "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.application_name = 'outboxd'",
            &[],
        )
        .await
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        rows.len() >= 2,
        "the pool and LISTEN: {} connections",
        rows.len()
    );
    assert!(
        rows.iter().all(|r| r.get::<_, bool>(0)),
        "a plain connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_never_falls_back_to_plain_text() {
    // A cluster without TLS (initdb's default).
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let plain = |q: &str| url(&cluster, "127.0.0.1", "postgres", q);
    let out = cmd(&plain(""), &["migrate"]);
    assert_eq!(
        out.code,
        Some(0),
        "prefer falls back, as libpq does: {}",
        out.stderr
    );
    for q in [
        "sslmode=require",
        "sslmode=verify-ca&sslrootcert=/etc/ssl/certs/ca-certificates.crt",
    ] {
        let out = cmd(&plain(q), &["status"]);
        assert_eq!(out.code, Some(1), "{q}: {}", out.stderr);
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{q}: {lines:?}");
        assert!(lines[0].contains("TLS"), "{q}: {lines:?}");
    }
}

/// Bad settings: exit 2 before any connection, one line naming the problem and not the
/// password. The URL points nowhere, so reaching the network would be another exit code.
#[test]
fn bad_tls_settings_are_usage_errors() {
    let base =
        format!("postgres://u:hunter2-secret@127.0.0.1:{CLOSED_PORT}/postgres?connect_timeout=2");
    let cases = [
        ("sslmode=bogus", "unknown sslmode `bogus`"),
        ("sslmode=allow", "sslmode=allow is not supported"),
        ("sslmode=%1b%5b2J", "unknown sslmode `\\u{1b}[2J`"),
        (
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            "sslrootcert /nonexistent/ca.pem",
        ),
        (
            "sslmode=verify-ca&sslrootcert=/etc/hostname",
            "sslrootcert /etc/hostname",
        ),
        (
            "sslmode=require&sslcert=/etc/hostname",
            "sslcert is set without sslkey",
        ),
        // The platform's roots vouch for any public certificate: libpq refuses them with
        // less than verify-full.
        (
            "sslmode=verify-ca&sslrootcert=system",
            "sslrootcert=system needs sslmode=verify-full",
        ),
        (
            "sslmode=require&sslkey=/etc/hostname",
            "sslkey is set without sslcert",
        ),
        (
            "sslmode=require&sslcert=/etc/ssl/certs/ca-certificates.crt&sslkey=/etc/hostname",
            "sslkey /etc/hostname holds no PEM private key",
        ),
    ];
    for (q, want) in cases {
        let u = format!("{base}&{q}");
        let out = run(outboxd(Some(&u)).args(["status"]));
        assert_eq!(out.code, Some(2), "{q}: {}", out.stderr);
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{q}: {lines:?}");
        assert!(lines[0].contains(want), "{q}: want {want:?} in {lines:?}");
        assert!(!out.stderr.contains("hunter2"), "{q}: {}", out.stderr);
        assert!(!out.stderr.contains('\u{1b}'), "{q}: raw escape printed");
    }
    // verify-full with no CA anywhere (HOME without ~/.postgresql/root.crt).
    let u = format!("{base}&sslmode=verify-full");
    let out = run(outboxd(Some(&u))
        .env("HOME", "/nonexistent")
        .args(["status"]));
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("needs the server's CA"),
        "{}",
        out.stderr
    );
}
