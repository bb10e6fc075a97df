//! The newcomer's first run (`scripts/demo`): the real `outboxd` daemon against a real
//! PostgreSQL, delivering to webhook receivers this program starts on 127.0.0.1.
//!
//! It writes messages inside business transactions (one rolled back), lets one receiver fail
//! once (the message is retried with the same key) and another refuse (the message is
//! dead-lettered), runs `outboxd run --drain`, shows the dead letter, replays it once the
//! receiver is "fixed", and prints what happened.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};

#[path = "demo/run.rs"]
mod demo_run;
use demo_run::{Run, enqueue_orders};

type Seen = Arc<Mutex<BTreeMap<String, Vec<u16>>>>;
type Mails = Arc<Mutex<Vec<String>>>;

/// Set once the demo "fixes" the /gone receiver, before the replay.
static FIXED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

// Multi-threaded: the receivers keep answering while this thread waits for the daemon.
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| anyhow::anyhow!("DATABASE_URL is not set (scripts/demo sets it)"))?;
    let bin = std::env::var("OUTBOXD_BIN").unwrap_or_else(|_| "target/debug/outboxd".into());
    let pg = outboxd::db::parse_url(&url)?;
    let mut client = outboxd::db::connect(&pg).await?;

    step("1. migrate: outboxd migrate");
    run(Command::new(&bin).arg("migrate").env("DATABASE_URL", &url))?;

    step(
        "2. start webhook receivers on 127.0.0.1 (/orders answers 204, /flaky 503 once, /gone 410 until fixed)",
    );
    // In docker compose the receivers must be reachable from the other containers:
    // DEMO_HOST names this container, and the workers allow that host.
    let host = std::env::var("DEMO_HOST").unwrap_or_else(|_| "127.0.0.1".into());
    let bind = if host == "127.0.0.1" {
        "127.0.0.1:0"
    } else {
        "0.0.0.0:0"
    };
    let seen: Seen = Arc::default();
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let base = format!("http://{host}:{}", listener.local_addr()?.port());
    let app = axum::Router::new()
        .route("/{name}", axum::routing::post(receive))
        .with_state(seen.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mails: Mails = Arc::default();
    // DEMO_SMTP_URL (docker compose: Mailpit) replaces the built-in SMTP receiver.
    let external_smtp = std::env::var("DEMO_SMTP_URL").ok();
    let smtp_url = match &external_smtp {
        Some(url) => url.clone(),
        None => {
            let smtp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let url = format!("smtp://{}?tls=none", smtp.local_addr()?);
            tokio::spawn(smtp_sink(smtp, mails.clone()));
            url
        }
    };
    println!("   and an SMTP receiver at {smtp_url}");

    step("3. business transactions that enqueue webhooks (and a receipt e-mail)");
    let run_id = Run::start(&client).await?;
    let key = |order: u32, step: &str| run_id.key(order, step);
    enqueue_orders(&mut client, &run_id, &base).await?;

    step("4. run the daemon until the queue is drained: outboxd run --drain");
    run(Command::new(&bin)
        .args([
            "run",
            "--drain",
            "--retry-base",
            "500ms",
            "--worker-id",
            "demo-worker",
        ])
        .env("DATABASE_URL", &url)
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true") // the receivers are on 127.0.0.1
        .env("OUTBOXD_SMTP_URL", &smtp_url) // so --channels is webhook,email
        .env("RUST_LOG", "outboxd=info"))?;

    step("5. what happened");
    let rows = client
        .query(
            "SELECT message_key, state, attempts, coalesce(error_class, '-'), coalesce(last_error, '-') \
             FROM outbox.messages WHERE message_key LIKE $1 ORDER BY id",
            &[&format!("{}%", run_id.prefix())],
        )
        .await?;
    println!(
        "   {:<34} {:<10} {:>8}  {:<10} last error",
        "message key", "state", "attempts", "class"
    );
    for r in &rows {
        let (k, s, a, c, e): (String, String, i32, String, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        println!("   {k:<34} {s:<10} {a:>8}  {c:<10} {e}");
    }
    println!("\n   the receivers saw (status answered per request, by key):");
    for (k, statuses) in seen.lock().unwrap().iter() {
        println!("   {k:<34} {statuses:?}");
    }
    if external_smtp.is_some() {
        println!("\n   the receipt went to {smtp_url}: see it at http://localhost:8025 (Mailpit)");
    }
    println!("\n   the SMTP receiver got:");
    for mail in mails.lock().unwrap().iter() {
        for line in mail.lines().filter(|l| {
            l.starts_with("Subject:") || l.starts_with("Message-ID:") || l.starts_with("To:")
        }) {
            println!("   {line}");
        }
    }
    let rolled_back_sent = seen.lock().unwrap().contains_key(&key(2, "paid"));
    println!("   the rolled-back order's message was sent: {rolled_back_sent}");

    step("6. the dead letter: outboxd dead, then outboxd show");
    run(Command::new(&bin).arg("dead").env("DATABASE_URL", &url))?;
    run(Command::new(&bin)
        .args(["show", &key(4, "paid")])
        .env("DATABASE_URL", &url))?;

    step("7. the receiver is fixed; replay the dead letter (same key): outboxd replay");
    FIXED.store(true, std::sync::atomic::Ordering::SeqCst);
    run(Command::new(&bin)
        .args(["replay", &key(4, "paid")])
        .env("DATABASE_URL", &url))?;
    run(Command::new(&bin)
        .args(["run", "--drain", "--worker-id", "demo-worker"])
        .env("DATABASE_URL", &url)
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("OUTBOXD_SMTP_URL", &smtp_url)
        .env("RUST_LOG", "outboxd=info"))?;
    run(Command::new(&bin)
        .args(["show", &key(4, "paid")])
        .env("DATABASE_URL", &url))?;

    step("8. outboxd status");
    run(Command::new(&bin).arg("status").env("DATABASE_URL", &url))?;
    let replayed_state: String = client
        .query_one(
            "SELECT state FROM outbox.messages WHERE message_key = $1",
            &[&key(4, "paid")],
        )
        .await?
        .get(0);

    println!("\nWhere to look next:");
    println!("  - every attempt:   SELECT * FROM outbox.attempts ORDER BY id;");
    println!(
        "  - dead letters:    SELECT id, message_key, error_class, last_error FROM outbox.messages WHERE state = 'dead';"
    );
    println!(
        "  - docs/ for the SQL and Rust APIs, the CLI and the configuration (docs/README.md is the index); ARCHITECTURE.md for the code map."
    );
    let mails_ok = external_smtp.is_some() || mails.lock().unwrap().len() == 1;
    if rolled_back_sent || rows.len() != 4 || !mails_ok || replayed_state != "delivered" {
        anyhow::bail!("the demo did not go as expected");
    }
    Ok(())
}

/// A receiver: /orders accepts, /flaky fails once per key, /gone refuses until fixed.
async fn receive(
    State(seen): State<Seen>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?")
        .to_owned();
    let mut seen = seen.lock().unwrap();
    let history = seen.entry(key).or_default();
    let status = match name.as_str() {
        "flaky" if history.is_empty() => StatusCode::SERVICE_UNAVAILABLE,
        "gone" if !FIXED.load(std::sync::atomic::Ordering::SeqCst) => StatusCode::GONE,
        _ => StatusCode::NO_CONTENT,
    };
    history.push(status.as_u16());
    status
}

/// A minimal SMTP receiver: accepts every message and keeps its text.
async fn smtp_sink(listener: tokio::net::TcpListener, mails: Mails) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    while let Ok((stream, _)) = listener.accept().await {
        let mails = mails.clone();
        tokio::spawn(async move {
            let (r, mut w) = stream.into_split();
            let mut lines = BufReader::new(r).lines();
            let _ = w.write_all(b"220 demo ESMTP\r\n").await;
            while let Ok(Some(line)) = lines.next_line().await {
                let verb = line
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .to_ascii_uppercase();
                let reply: &[u8] = match verb.as_str() {
                    "EHLO" | "HELO" => b"250 demo\r\n",
                    "DATA" => {
                        let _ = w.write_all(b"354 go ahead\r\n").await;
                        let mut text = String::new();
                        while let Ok(Some(l)) = lines.next_line().await {
                            if l == "." {
                                break;
                            }
                            text.push_str(&l);
                            text.push('\n');
                        }
                        mails.lock().unwrap().push(text);
                        b"250 2.0.0 Ok: queued as DEMO1\r\n"
                    }
                    "QUIT" => {
                        let _ = w.write_all(b"221 bye\r\n").await;
                        return;
                    }
                    _ => b"250 ok\r\n",
                };
                if w.write_all(reply).await.is_err() {
                    return;
                }
            }
        });
    }
}

fn step(title: &str) {
    println!("\n== {title}");
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status()?;
    if !status.success() {
        anyhow::bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}
