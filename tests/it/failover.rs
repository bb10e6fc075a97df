//! Failover: a primary and a synchronous streaming standby, a daemon delivering a steady
//! stream through a two-host `DATABASE_URL` with `target_session_attrs=read-write`, the
//! primary stopped and the standby promoted mid-run.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::binary::{outboxd, run};
use common::cluster::Cluster;
use common::receiver::Receiver;
use common::*;

fn daemon(database_url: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "run",
            "--worker-id",
            "fo",
            "--lease",
            "5s",
            "--webhook-timeout",
            "1s",
            "--retry-base",
            "100ms",
            "--retry-max",
            "1s",
            "--poll-interval",
            "200ms",
        ])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", database_url)
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// A connection to whichever host accepts writes, retried until `deadline`.
async fn writer(cfg: &tokio_postgres::Config, deadline: Instant) -> Option<tokio_postgres::Client> {
    while Instant::now() < deadline {
        if let Ok((client, conn)) = cfg.connect(tokio_postgres::NoTls).await {
            tokio::spawn(conn);
            return Some(client);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_loses_no_message_and_resends_only_what_was_in_flight() {
    let primary = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let admin: tokio_postgres::Config = primary.url.parse().unwrap();
    let mut m = connect(&admin).await;
    outboxd::migrate::migrate(&mut m).await.unwrap();
    let p = &primary;
    let standby = tokio::task::block_in_place(|| Cluster::standby_of(p));
    // Synchronous: a committed enqueue (and completion) is on both servers.
    // (Two statements: ALTER SYSTEM refuses to run in a multi-statement batch.)
    m.batch_execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        .await
        .unwrap();
    m.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    wait_until(
        Duration::from_secs(20),
        "the standby to be synchronous",
        || {
            let m = &m;
            async move {
                let n: i64 = m
                    .query_one(
                        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                n == 1
            }
        },
    )
    .await;
    drop(m);

    let both = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        primary.port(),
        standby.port()
    );
    let rx = Receiver::start().await;
    let mut child = daemon(&both);

    // The application: one message every 10 ms, each in its own transaction. A failed
    // enqueue is retried with the same key and payload (the dedup rule makes that safe when
    // the first commit did happen); a key counts as committed once an enqueue returned.
    let committed = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop_enqueuing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let enqueuer = {
        let committed = committed.clone();
        let stop = stop_enqueuing.clone();
        let cfg: tokio_postgres::Config = both.parse().unwrap();
        let url = rx.url("/h");
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut client = writer(&cfg, deadline).await.unwrap();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
                let key = format!("fo:{i}");
                let msg = outboxd::NewMessage::webhook(
                    key.clone(),
                    serde_json::json!({"url": url, "body": {"i": i}}),
                );
                match outboxd::enqueue(&client, &msg).await {
                    Ok(_) => {
                        committed.lock().unwrap().push(key);
                        i += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(_) => {
                        if client.is_closed() {
                            if let Some(c) = writer(&cfg, deadline).await {
                                client = c;
                            }
                        } else {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            }
        })
    };

    rx.wait_for(100, Duration::from_secs(20)).await;
    let stopped_at = Instant::now();
    let p = &primary;
    tokio::task::block_in_place(|| p.stop());
    let s = &standby;
    tokio::task::block_in_place(|| s.promote());
    let promoted_at = Instant::now();
    let before = committed.lock().unwrap().len();
    // Enqueuing goes on against the new primary for two more seconds.
    wait_until(
        Duration::from_secs(30),
        "enqueues on the new primary",
        || {
            let committed = committed.clone();
            async move { committed.lock().unwrap().len() > before + 100 }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_enqueuing.store(true, std::sync::atomic::Ordering::SeqCst);
    enqueuer.await.unwrap();
    let keys = committed.lock().unwrap().clone();

    let new_primary: tokio_postgres::Config = standby.url.parse().unwrap();
    let c = connect(&new_primary).await;
    let n = keys.len() as i64;
    wait_until(
        Duration::from_secs(60),
        "every committed message delivered",
        || {
            let c = &c;
            async move {
                let delivered: i64 = c
                    .query_one(
                        "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                delivered >= n
            }
        },
    )
    .await;
    let _ = child.kill();
    let _ = child.wait();

    let mut sent: HashMap<String, Vec<Instant>> = HashMap::new();
    for r in rx.requests() {
        sent.entry(r.header("idempotency-key").unwrap())
            .or_default()
            .push(r.at);
    }
    let lost: Vec<&String> = keys.iter().filter(|k| !sent.contains_key(*k)).collect();
    let twice: Vec<(&String, &Vec<Instant>)> = sent.iter().filter(|(_, t)| t.len() > 1).collect();
    // Deliveries resumed: the first request for a message committed after the promotion.
    let resumed = keys[before..]
        .iter()
        .filter_map(|k| sent.get(k).and_then(|t| t.iter().min()))
        .min()
        .map(|at| at.duration_since(stopped_at));
    eprintln!(
        "failover: {} messages committed ({} before the primary stopped), {} lost, {} sent twice, \
         primary stopped → standby promoted in {:.1}s, deliveries resumed {:.1}s after the stop",
        keys.len(),
        before,
        lost.len(),
        twice.len(),
        promoted_at.duration_since(stopped_at).as_secs_f64(),
        resumed.map(|d| d.as_secs_f64()).unwrap_or(f64::NAN),
    );
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert!(resumed.is_some(), "no delivery after the promotion");
    // A key sent twice must be one whose first send happened before the failover: its
    // completion was in flight when the primary stopped, so the row was still running
    // under a lease on the standby, and was sent again once that lease expired.
    for (key, times) in &twice {
        let first = times.iter().min().unwrap();
        assert!(
            *first < stopped_at + Duration::from_millis(500),
            "{key} was first sent {:?} after the failover and still sent again",
            first.duration_since(stopped_at)
        );
    }
}

/// A host that takes TCP connections and never says a word: a hung server, or a proxy in
/// front of a dead one. Holds every connection it accepts until dropped.
struct SilentHost {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl SilentHost {
    async fn start() -> SilentHost {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        SilentHost { port, task }
    }
}

impl Drop for SilentHost {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `db`'s URL with a host in front of its own, and a 1 s connect timeout.
fn behind(db: &TestDb, first: &str, query: &str) -> String {
    db.url_at(
        &format!("{first},{}", db.server()),
        &format!("connect_timeout=1{query}"),
    )
}

/// A [`SilentHost`], and `db`'s URL with it first, asking for a writable host.
async fn behind_a_silent_host(db: &TestDb) -> (SilentHost, String) {
    let silent = SilentHost::start().await;
    let url = behind(
        db,
        &format!("127.0.0.1:{}", silent.port),
        "&target_session_attrs=read-write",
    );
    (silent, url)
}

/// libpq's `connect_timeout` holds "separately to each host name or IP address", for the
/// whole connection: a first host that accepts the TCP connection and never answers the
/// start-up (a hung server, a proxy before a dead one) is given up after it, and the next
/// host is tried. tokio-postgres bounds only the TCP connect, and the pools bounded the
/// whole list by 10 s: a one-shot command waited forever, and the worker never got past
/// the first host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_never_answers_is_passed_over_for_the_next() {
    let db = TestDb::new().await;
    let (_silent, url) = behind_a_silent_host(&db).await;

    // A one-shot command: one connection.
    let out = run(outboxd(Some(&url)).args(["status", "--json"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);

    // The daemon: its pools and its LISTEN connection.
    let rx = Receiver::start().await;
    enqueue_webhook(&db, "past-the-silent-host", &rx.url("/h"), 3, true).await;
    let child = Killed(daemon(&url));
    wait_for_state(
        &db,
        "past-the-silent-host",
        "delivered",
        Duration::from_secs(30),
    )
    .await;
    // The LISTEN connection got past the silent host too (the worker would also deliver
    // by polling without it): idle, the worker holds the idle mark through it.
    wait_for_idle_marks(
        &db,
        1,
        "the daemon's LISTEN connection to hold the idle mark",
    )
    .await;
    drop(child);
}

/// A daemon killed when the test ends, passed or not.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A host that turns read-only under a running worker (an old primary fenced with
/// `default_transaction_read_only`, a proxy now in front of a standby) is left for the
/// writable host the URL also lists: once a statement is refused as read-only, the pools
/// drop the connections made before, and `target_session_attrs=read-write` takes the new
/// ones past the read-only host. Before, the pools handed the old connections out again
/// as long as they were open, and every claim failed on them for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_turned_read_only_is_left_for_the_writable_one() {
    let first = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let db = TestDb::new().await;
    // The same database on the first host, migrated.
    let first_admin: tokio_postgres::Config = first.url.parse().unwrap();
    connect(&first_admin)
        .await
        .batch_execute(&format!("CREATE DATABASE {}", db.name))
        .await
        .unwrap();
    let (base, _) = first.url.rsplit_once('/').unwrap();
    let first_db = format!("{base}/{}", db.name);
    let out = run(outboxd(Some(&first_db)).args(["migrate"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let first_client = connect(&first_db.parse().unwrap()).await;

    let rx = Receiver::start().await;
    let url = behind(
        &db,
        &format!("127.0.0.1:{}", first.port()),
        "&target_session_attrs=read-write",
    );
    let child = Killed(daemon(&url));
    // The worker is on the first host.
    let on_first = outboxd::NewMessage::webhook(
        "on-the-first-host",
        serde_json::json!({"url": rx.url("/h")}),
    );
    outboxd::enqueue(&first_client, &on_first).await.unwrap();
    wait_until(Duration::from_secs(20), "the first host's message delivered", || {
        let c = &first_client;
        async move {
            c.query_opt(
                "SELECT 1 FROM outbox.messages WHERE message_key = 'on-the-first-host' AND state = 'delivered'",
                &[],
            )
            .await
            .map(|r| r.is_some())
            .unwrap_or(false)
        }
    })
    .await;

    // Fenced: every session of the first host is read-only from now on.
    for sql in [
        "ALTER SYSTEM SET default_transaction_read_only = on",
        "SELECT pg_reload_conf()",
    ] {
        first_client.batch_execute(sql).await.unwrap();
    }
    enqueue_webhook(&db, "on-the-second-host", &rx.url("/h"), 3, true).await;
    wait_for_state(
        &db,
        "on-the-second-host",
        "delivered",
        Duration::from_secs(20),
    )
    .await;
    // The LISTEN connection moved too: idle, the worker holds the idle mark on the second
    // host, so that enqueues there wake it.
    wait_for_idle_marks(&db, 1, "the idle mark on the writable host").await;
    drop(child);
}

/// A server given by its address alone (`hostaddr`, no `host`) connects under the default
/// `sslmode=prefer`, as with libpq; tokio-postgres refused it before the first byte ("no
/// hostname provided for TLS handshake").
#[tokio::test]
async fn an_address_alone_connects() {
    let db = TestDb::new().await;
    let url = url::Url::parse(&db.url()).unwrap();
    let server = db.server_addr().await;
    let (addr, port) = (server.ip(), server.port());
    let password = url
        .password()
        .map(|p| format!(" password={p}"))
        .unwrap_or_default();
    let dsn = format!(
        "hostaddr={addr} port={port} user={}{password} dbname={}",
        url.username(),
        db.name
    );
    let out = tokio::task::spawn_blocking(move || run(outboxd(Some(&dsn)).args(["status"])))
        .await
        .unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

/// With `target_session_attrs=read-write`, the host that took the last connection is tried
/// first: after a failover, a connection made later does not wait out the timeout of the
/// dead host ahead of it in the list (here 1 s; 10 s by default, per dead host).
#[tokio::test]
async fn the_host_that_took_the_last_connection_is_tried_first() {
    let db = TestDb::new().await;
    let (_silent, url) = behind_a_silent_host(&db).await;
    let database = outboxd::db::parse_url(&url).unwrap();
    let t = Instant::now();
    outboxd::db::connect(&database).await.unwrap();
    assert!(
        t.elapsed() >= Duration::from_secs(1),
        "the first connection did not try the silent host first: {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    outboxd::db::connect(&database).await.unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the second connection waited for the silent host again: {:?}",
        t.elapsed()
    );
}

/// A connection given up on while it walks the list (the worker bounds a checkout by
/// 30 s, which three dead hosts of 10 s each fill) is still made in the background, and
/// the host that took it is where the next one starts: the walk is not cut short for ever.
/// Here every try is given up on after 0.5 s, with two silent hosts of 1 s each first.
#[tokio::test]
async fn a_walk_given_up_on_still_finds_the_live_host_for_the_next_connection() {
    let db = TestDb::new().await;
    let (a, b) = (SilentHost::start().await, SilentHost::start().await);
    let url = behind(
        &db,
        &format!("127.0.0.1:{},127.0.0.1:{}", a.port, b.port),
        "&target_session_attrs=read-write",
    );
    let database = outboxd::db::parse_url(&url).unwrap();
    wait_until(Duration::from_secs(10), "a connection within 0.5 s", || {
        let database = &database;
        async move {
            tokio::time::timeout(Duration::from_millis(500), outboxd::db::connect(database))
                .await
                .is_ok_and(|c| c.is_ok())
        }
    })
    .await;
}
