//! The benchmark driver behind `bench/run` (not a test: it prints figures, it asserts nothing
//! about speed). `bench/run` builds it, starts the nginx sink and a throwaway PostgreSQL
//! cluster with stock settings, and runs it with these variables:
//!
//! * `BENCH_DATABASE_URL` — the throwaway cluster (the driver creates its databases there);
//! * `BENCH_OUTBOXD` — the release `outboxd` binary;
//! * `BENCH_SINK_URL`, `BENCH_SINK_STATUS` — nginx's 204 port and its request counter;
//! * `BENCH_BODY` — the 300-byte JSON body the peers' figures used;
//! * `BENCH_OUT` — a scratch folder for daemon logs;
//! * `BENCH_ONLY` — comma-separated sections (default: all): throughput, enqueue, latency,
//!   memory, depth, ceiling, scaleout, ordering;
//! * `BENCH_PG_PIDFILE`, `BENCH_NGINX_PIDFILE` — the cluster's `postmaster.pid` and nginx's
//!   pid file, for the scale-out section's CPU accounting (from /proc);
//! * `BENCH_SCALEOUT` (`1x64,2x32,4x16,2x64,4x64,1x256`: processes × concurrency each),
//!   `BENCH_QUIET_WAIT` (180: the longest wait, in seconds, for a quieter machine before
//!   each scale-out round);
//! * sections run only when named: peer, ab (`bench/pairs.rs` says what they take:
//!   `BENCH_PEER`, `BENCH_A_*`, `BENCH_B_*`);
//! * `BENCH_SETUP_SQL` — a statement run in every fresh database after its migration;
//! * `BENCH_N` (20000), `BENCH_RUNS` (3), `BENCH_DEPTH_PENDING` (1000000),
//!   `BENCH_DEPTH_DELIVERED` (10000000), `BENCH_LATENCY_RATE` (500), `BENCH_LATENCY_SECS` (10).
//!
//! Every loop is bounded by a count or a deadline; all traffic stays on 127.0.0.1.

#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use outboxd::NewMessage;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio_postgres::{Client, NoTls};

#[path = "bench/pairs.rs"]
mod pairs;

struct Opts {
    db: String,
    outboxd: PathBuf,
    sink: String,
    sink_status: String,
    body: Value,
    out: PathBuf,
    only: Vec<String>,
    n: usize,
    runs: usize,
    depth_pending: i64,
    depth_delivered: i64,
    latency_rate: u64,
    latency_secs: u64,
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn env_num<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

impl Opts {
    fn from_env() -> anyhow::Result<Self> {
        let body_path = env_or("BENCH_BODY", "../shared/bench/body.json");
        let body = std::fs::read_to_string(&body_path).with_context(|| body_path.clone())?;
        Ok(Opts {
            db: std::env::var("BENCH_DATABASE_URL").context("BENCH_DATABASE_URL")?,
            outboxd: env_or("BENCH_OUTBOXD", "target/release/outboxd").into(),
            sink: env_or("BENCH_SINK_URL", "http://127.0.0.1:18080/hook"),
            sink_status: env_or("BENCH_SINK_STATUS", "127.0.0.1:18081"),
            body: serde_json::from_str(&body)?,
            out: env_or("BENCH_OUT", "/tmp/outboxd-bench").into(),
            only: env_or(
                "BENCH_ONLY",
                "throughput,enqueue,latency,memory,depth,ceiling,scaleout,ordering",
            )
            .split(',')
            .map(|s| s.trim().to_owned())
            .collect(),
            n: env_num("BENCH_N", 20_000),
            runs: env_num("BENCH_RUNS", 3),
            depth_pending: env_num("BENCH_DEPTH_PENDING", 1_000_000),
            depth_delivered: env_num("BENCH_DEPTH_DELIVERED", 10_000_000),
            latency_rate: env_num("BENCH_LATENCY_RATE", 500),
            latency_secs: env_num("BENCH_LATENCY_SECS", 10),
        })
    }

    fn wants(&self, section: &str) -> bool {
        self.only.iter().any(|s| s == section)
    }

    fn payload(&self, url: &str) -> Value {
        json!({"url": url, "body": self.body})
    }

    /// The URL of another database on the same cluster.
    fn db_named(&self, name: &str) -> String {
        match self.db.rfind('/') {
            Some(i) => format!("{}/{}", &self.db[..i], name),
            None => self.db.clone(),
        }
    }
}

/// One line of the final table.
struct Row {
    figure: String,
    result: String,
    target: String,
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// A fresh database `name`, migrated by the real binary.
async fn fresh_db(o: &Opts, name: &str) -> anyhow::Result<String> {
    fresh_db_by(o, name, &o.outboxd).await
}

/// A fresh database `name`, migrated by the binary `bin` (each side of an A/B by its own).
async fn fresh_db_by(o: &Opts, name: &str, bin: &std::path::Path) -> anyhow::Result<String> {
    let admin = connect(&o.db).await?;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await?;
    let url = o.db_named(name);
    let st = std::process::Command::new(bin)
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .stdout(Stdio::null())
        .status()?;
    if !st.success() {
        bail!("outboxd migrate failed");
    }
    // BENCH_SETUP_SQL: a statement run in every fresh database after its migration (a
    // schema setting measured before it is a migration of its own).
    let setup = env_or("BENCH_SETUP_SQL", "");
    if !setup.is_empty() {
        connect(&url).await?.batch_execute(&setup).await?;
    }
    Ok(url)
}

async fn reset(client: &Client) -> anyhow::Result<()> {
    client
        .batch_execute("TRUNCATE outbox.attempts, outbox.messages")
        .await?;
    client.batch_execute("CHECKPOINT").await?;
    Ok(())
}

/// `n` webhook jobs in one SQL call (`outbox.enqueue_many`), keys `prefix-1..n`.
async fn load_jobs(
    client: &Client,
    prefix: &str,
    n: usize,
    payload: &Value,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    for start in (0..n).step_by(10_000) {
        let end = (start + 10_000).min(n);
        client
            .execute(
                "SELECT count(*) FROM outbox.enqueue_many(
                    ARRAY(SELECT $1::text || g FROM generate_series($2::int, $3::int) g),
                    array_fill('webhook'::text, ARRAY[$3::int - $2::int + 1]),
                    array_fill($4::jsonb, ARRAY[$3::int - $2::int + 1]))",
                &[
                    &format!("{prefix}-"),
                    &(start as i32 + 1),
                    &(end as i32),
                    payload,
                ],
            )
            .await?;
    }
    Ok(t.elapsed())
}

/// As [`load_jobs`], with every tenth job (keys `prefix-10`, `prefix-20`, …) in one of 100
/// ordering groups (`g0` … `g99`, round robin): 10 % of the jobs, 20 per group for 20 000.
async fn load_jobs_grouped(
    client: &Client,
    prefix: &str,
    n: usize,
    payload: &Value,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    for start in (0..n).step_by(10_000) {
        let end = (start + 10_000).min(n);
        client
            .execute(
                "SELECT count(*) FROM outbox.enqueue_many(
                    ARRAY(SELECT $1::text || g FROM generate_series($2::int, $3::int) g),
                    array_fill('webhook'::text, ARRAY[$3::int - $2::int + 1]),
                    array_fill($4::jsonb, ARRAY[$3::int - $2::int + 1]),
                    ordering_key => ARRAY(SELECT CASE WHEN g % 10 = 0 THEN 'g' || (g / 10 % 100) END
                                          FROM generate_series($2::int, $3::int) g))",
                &[
                    &format!("{prefix}-"),
                    &(start as i32 + 1),
                    &(end as i32),
                    payload,
                ],
            )
            .await?;
    }
    Ok(t.elapsed())
}

/// nginx's request counter.
fn sink_requests(addr: &str) -> anyhow::Result<u64> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(b"GET /status HTTP/1.0\r\nHost: x\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    // "...server accepts handled requests\n 1 1 1 \n..."
    let line = text
        .lines()
        .skip_while(|l| !l.contains("accepts handled requests"))
        .nth(1)
        .context("no counter line in stub_status")?;
    Ok(line
        .split_whitespace()
        .nth(2)
        .context("no requests field")?
        .parse()?)
}

/// The share of CPU time the hypervisor gave to other guests (`steal` in /proc/stat) over
/// a stretch of the run: on a shared virtual machine it is what makes one run differ from
/// the next, so every section reports it beside its figures.
struct Steal {
    at_start: Option<(u64, u64)>,
}

impl Steal {
    fn start() -> Steal {
        Steal {
            at_start: cpu_steal_and_total(),
        }
    }

    fn percent(&self) -> f64 {
        match (self.at_start, cpu_steal_and_total()) {
            (Some((s0, t0)), Some((s1, t1))) if t1 > t0 => {
                100.0 * (s1 - s0) as f64 / (t1 - t0) as f64
            }
            _ => f64::NAN,
        }
    }
}

/// (steal, all) ticks from the first line of /proc/stat.
fn cpu_steal_and_total() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is counted in user).
    Some((*ticks.get(7)?, ticks.iter().take(8).sum()))
}

fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

struct Daemon {
    child: tokio::process::Child,
    started: Instant,
}

fn spawn_daemon(o: &Opts, url: &str, args: &[&str], log: &str) -> anyhow::Result<Daemon> {
    let log = std::fs::File::create(o.out.join(log))?;
    let started = Instant::now();
    let child = tokio::process::Command::new(&o.outboxd)
        .arg("run")
        .args(args)
        .env("DATABASE_URL", url)
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()?;
    Ok(Daemon { child, started })
}

impl Daemon {
    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// Waits for the daemon to exit by itself (`--drain`), at most `limit`; returns the time
    /// from spawn to exit and the peak resident size seen.
    async fn wait(mut self, limit: Duration) -> anyhow::Result<(Duration, u64)> {
        let pid = self.pid();
        let mut hwm = 0;
        loop {
            if let Some(st) = self.child.try_wait()? {
                let took = self.started.elapsed();
                if !st.success() {
                    bail!("outboxd exited with {st}");
                }
                return Ok((took, hwm));
            }
            if let Some(k) = vm_hwm_kb(pid) {
                hwm = hwm.max(k);
            }
            if self.started.elapsed() > limit {
                let _ = self.child.kill().await;
                bail!("outboxd did not finish within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// SIGTERM, then wait for the exit (bounded).
    async fn stop(mut self) -> anyhow::Result<()> {
        let pid = self.pid();
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status();
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(r) => {
                r?;
            }
            Err(_) => {
                let _ = self.child.kill().await;
            }
        }
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn fmt_rate(r: f64) -> String {
    let r = r.round() as u64;
    let s = r.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// One drain run: `n` jobs enqueued in bulk, then `outboxd run --drain`; returns
/// deliveries per second and the daemon's peak resident size in kB.
async fn drain_run(
    o: &Opts,
    url: &str,
    client: &Client,
    concurrency: usize,
    tag: &str,
) -> anyhow::Result<(f64, u64)> {
    drain_run_with(o, url, client, concurrency, tag, false).await
}

/// A drain as [`drain_run`]; with `grouped`, 10 % of the jobs carry an ordering key
/// ([`load_jobs_grouped`]).
async fn drain_run_with(
    o: &Opts,
    url: &str,
    client: &Client,
    concurrency: usize,
    tag: &str,
    grouped: bool,
) -> anyhow::Result<(f64, u64)> {
    reset(client).await?;
    if grouped {
        load_jobs_grouped(client, "tp", o.n, &o.payload(&o.sink)).await?;
    } else {
        load_jobs(client, "tp", o.n, &o.payload(&o.sink)).await?;
    }
    client
        .batch_execute("VACUUM ANALYZE outbox.messages")
        .await?;
    client.batch_execute("CHECKPOINT").await?;
    let before = sink_requests(&o.sink_status)?;
    let conc = concurrency.to_string();
    let d = spawn_daemon(
        o,
        url,
        &["--drain", "--concurrency", &conc],
        &format!("{tag}.log"),
    )?;
    let steal = Steal::start();
    let (took, hwm) = d.wait(Duration::from_secs(300)).await?;
    let stolen = steal.percent();
    let sent = sink_requests(&o.sink_status)? - before;
    let delivered: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'",
            &[],
        )
        .await?
        .get(0);
    if delivered as usize != o.n {
        bail!("{tag}: {delivered} of {} delivered", o.n);
    }
    let rate = o.n as f64 / took.as_secs_f64();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "  {tag}: {} jobs in {:.3} s = {}/s (sink saw {sent}; peak RSS {} MB; steal {stolen:.0} %; loadavg {})",
        o.n,
        took.as_secs_f64(),
        fmt_rate(rate),
        hwm / 1024,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok((rate, hwm))
}

async fn throughput(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    println!("== throughput: {} jobs, outboxd run --drain", o.n);
    let url = fresh_db(o, "bench_tp").await?;
    let client = connect(&url).await?;
    for conc in [64usize, 32] {
        let mut rates = Vec::new();
        for run in 0..o.runs {
            let (r, _) = drain_run(o, &url, &client, conc, &format!("tp-c{conc}-{run}")).await?;
            rates.push(r);
        }
        rows.push(Row {
            figure: format!(
                "webhook throughput, --concurrency {conc} (median of {})",
                o.runs
            ),
            result: format!("{}/s", fmt_rate(median(rates))),
            target: if conc == 64 {
                "≥ 20 000/s".into()
            } else {
                "(peers' column: 32 in flight)".into()
            },
        });
    }
    Ok(())
}

/// Ordering keys' cost: drains of `n` jobs without any ordering key (A) and with 10 % of
/// them in 100 groups (B), interleaved A B A B … so that a change in the machine's load
/// hits both alike; median of `runs` each, and the ratio B / A.
async fn ordering(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    println!(
        "== ordering: {} jobs, outboxd run --drain --concurrency 64, without keys (A) and with 10 % in 100 groups (B), interleaved",
        o.n
    );
    let url = fresh_db(o, "bench_ordering").await?;
    let client = connect(&url).await?;
    let (mut plain, mut grouped) = (Vec::new(), Vec::new());
    for run in 0..o.runs {
        plain.push(
            drain_run_with(o, &url, &client, 64, &format!("ord-A-{run}"), false)
                .await?
                .0,
        );
        grouped.push(
            drain_run_with(o, &url, &client, 64, &format!("ord-B-{run}"), true)
                .await?
                .0,
        );
    }
    let (a, b) = (median(plain), median(grouped));
    rows.push(Row {
        figure: format!(
            "webhook throughput, no ordering keys, --concurrency 64 (median of {}, interleaved)",
            o.runs
        ),
        result: format!("{}/s", fmt_rate(a)),
        target: "(A)".into(),
    });
    rows.push(Row {
        figure: format!(
            "… 10 % of the jobs in 100 ordering groups (median of {}, interleaved)",
            o.runs
        ),
        result: format!("{}/s ({:.2} × A)", fmt_rate(b), b / a),
        target: "not slower than A".into(),
    });
    Ok(())
}

async fn memory(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    println!("== memory: peak resident size at --concurrency 256");
    let url = fresh_db(o, "bench_mem").await?;
    let client = connect(&url).await?;
    let (_, hwm) = drain_run(o, &url, &client, 256, "mem-c256").await?;
    rows.push(Row {
        figure: "daemon peak RSS (VmHWM), --concurrency 256, during a drain".into(),
        result: format!("{:.1} MB", hwm as f64 / 1024.0),
        target: "< 100 MB".into(),
    });
    Ok(())
}

/// Single-message transactions from `conns` connections for `secs` seconds.
/// What one single-message transaction writes in [`single_tx_rate`].
#[derive(Clone, Copy)]
enum Single<'a> {
    /// `outboxd::enqueue` of one webhook.
    Enqueue,
    /// A one-row `INSERT` into `bench_plain` (keys tagged so that two runs do not collide):
    /// the commit ceiling that single-message enqueues are held to.
    Plain(&'a str),
}

/// Single-message transactions (`BEGIN`, one write, `COMMIT`) from `conns` connections for
/// `secs` seconds, a new key each time; transactions per second.
async fn single_tx_rate(
    o: &Opts,
    url: &str,
    conns: usize,
    secs: u64,
    kind: Single<'_>,
) -> anyhow::Result<f64> {
    let payload = o.payload(&o.sink);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..conns {
        let mut client = connect(url).await?;
        let payload = payload.clone();
        let tag = match kind {
            Single::Enqueue => None,
            Single::Plain(tag) => Some(tag.to_owned()),
        };
        tasks.push(tokio::spawn(async move {
            let insert = match &tag {
                Some(tag) => Some((
                    tag,
                    client
                        .prepare("INSERT INTO bench_plain (k, p) VALUES ($1, $2)")
                        .await?,
                )),
                None => None,
            };
            let mut n = 0u64;
            while Instant::now() < deadline {
                let tx = client.transaction().await?;
                match &insert {
                    None => {
                        let msg = NewMessage::webhook(format!("single-{c}-{n}"), payload.clone());
                        outboxd::enqueue(&tx, &msg).await?;
                    }
                    Some((tag, insert)) => {
                        tx.execute(insert, &[&format!("plain-{tag}-{c}-{n}"), &payload])
                            .await?;
                    }
                }
                tx.commit().await?;
                n += 1;
            }
            anyhow::Ok(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / t0.elapsed().as_secs_f64())
}

/// `total` rows (`payload`, a key each) by COPY, 1000 per COPY and transaction, into
/// `bench_copy`, a bare copy of `outbox.messages` (`LIKE … INCLUDING ALL`: its columns,
/// defaults, identity, constraints and indexes, and no trigger). Rows per second.
async fn copy_bulk(client: &Client, payload: &Value, total: usize) -> anyhow::Result<f64> {
    use futures_util::SinkExt as _;
    client
        .batch_execute(
            "DROP TABLE IF EXISTS bench_copy; \
             CREATE TABLE bench_copy (LIKE outbox.messages INCLUDING ALL)",
        )
        .await?;
    // COPY's text format: backslashes doubled (the JSON text has no tab or newline).
    let json = serde_json::to_string(payload)?.replace('\\', "\\\\");
    let hash = format!("\\\\x{}", "00".repeat(32));
    let t = Instant::now();
    for b in 0..total / 1000 {
        let mut data = String::with_capacity(1000 * (json.len() + 100));
        for i in 0..1000 {
            data.push_str(&format!("copy-{b}-{i}\twebhook\t{json}\t{hash}\n"));
        }
        client.batch_execute("BEGIN").await?;
        let sink = client
            .copy_in("COPY bench_copy (message_key, channel, payload, request_hash) FROM STDIN")
            .await?;
        let mut sink = std::pin::pin!(sink);
        sink.send(bytes::Bytes::from(data)).await?;
        let n = sink.as_mut().finish().await?;
        client.batch_execute("COMMIT").await?;
        if n != 1000 {
            bail!("COPY wrote {n} rows, not 1000");
        }
    }
    Ok(total as f64 / t.elapsed().as_secs_f64())
}

async fn enqueue_bench(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    println!("== enqueue");
    let url = fresh_db(o, "bench_enq").await?;
    let client = connect(&url).await?;
    let payload = o.payload(&o.sink);

    // The same run's yardstick: one-row INSERT transactions into a plain table
    // (a primary key, a unique key, a jsonb column; no trigger), 4 connections, before and
    // after the enqueues so that a drift of the host's load shows.
    client
        .batch_execute(
            "DROP TABLE IF EXISTS bench_plain; \
             CREATE TABLE bench_plain (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                                       k text NOT NULL UNIQUE, p jsonb NOT NULL)",
        )
        .await?;
    let plain_before = single_tx_rate(o, &url, 4, 5, Single::Plain("a")).await?;
    println!(
        "  plain one-row INSERT transactions, 4 connections: {}/s",
        fmt_rate(plain_before)
    );
    // No worker is idle (none runs, as when every worker is busy): no
    // enqueue notifies.
    reset(&client).await?;
    let busy = single_tx_rate(o, &url, 4, 5, Single::Enqueue).await?;
    println!(
        "  single-message transactions, 4 connections, no idle worker: {}/s",
        fmt_rate(busy)
    );
    let plain_after = single_tx_rate(o, &url, 4, 5, Single::Plain("b")).await?;
    let plain = (plain_before + plain_after) / 2.0;
    println!(
        "  plain one-row INSERT transactions again: {}/s; enqueue ÷ plain INSERT = {:.2}",
        fmt_rate(plain_after),
        busy / plain
    );
    rows.push(Row {
        figure: "enqueue: single-message transactions ÷ plain one-row INSERT, same run".into(),
        result: format!(
            "{:.2} ({}/s against {}/s)",
            busy / plain,
            fmt_rate(busy),
            fmt_rate(plain)
        ),
        target: "≥ 0.85".into(),
    });
    // An idle worker holds the idle mark: every commit notifies. This connection holds it as a worker's LISTEN connection would.
    reset(&client).await?;
    client
        .batch_execute("SELECT pg_advisory_lock_shared(1869968482, 2)")
        .await?;
    let idle = single_tx_rate(o, &url, 4, 5, Single::Enqueue).await?;
    client
        .batch_execute("SELECT pg_advisory_unlock_shared(1869968482, 2)")
        .await?;
    println!(
        "  same, a worker idle (every commit notifies): {}/s",
        fmt_rate(idle)
    );
    rows.push(Row {
        figure: "enqueue: single-message transactions, 4 connections".into(),
        result: format!("{}/s", fmt_rate(busy)),
        target: "≥ 5 000/s".into(),
    });
    rows.push(Row {
        figure: "  (same while a worker is idle: every commit notifies)".into(),
        result: format!("{}/s", fmt_rate(idle)),
        target: "".into(),
    });

    // The bulk yardstick: COPY of the same rows, 1000 per COPY, one transaction
    // each, into a bare copy of outbox.messages (the same columns, constraints and indexes;
    // no trigger, so no fingerprint is computed: a constant one is sent).
    let total = 100_000usize;
    let copy_rate = copy_bulk(&client, &payload, total).await?;
    println!(
        "  COPY of the same rows into a bare copy of outbox.messages, 1000 per COPY: {}/s",
        fmt_rate(copy_rate)
    );

    // Bulk through SQL: outbox.enqueue_many with arrays built server-side, 1000 per call,
    // one transaction per call.
    reset(&client).await?;
    let t = Instant::now();
    for b in 0..total / 1000 {
        client
            .execute(
                "SELECT count(*) FROM outbox.enqueue_many(
                    ARRAY(SELECT 'bulk-' || $1::int || '-' || g FROM generate_series(1, 1000) g),
                    array_fill('webhook'::text, ARRAY[1000]),
                    array_fill($2::jsonb, ARRAY[1000]))",
                &[&(b as i32), &payload],
            )
            .await?;
    }
    let sql_rate = total as f64 / t.elapsed().as_secs_f64();
    println!(
        "  bulk via SQL enqueue_many, batches of 1000: {}/s",
        fmt_rate(sql_rate)
    );
    rows.push(Row {
        figure: "enqueue: bulk, SQL outbox.enqueue_many (1000 per call) ÷ COPY, same run".into(),
        result: format!(
            "{:.2} ({}/s against {}/s)",
            sql_rate / copy_rate,
            fmt_rate(sql_rate),
            fmt_rate(copy_rate)
        ),
        target: "≥ 0.8".into(),
    });

    // Bulk through the Rust batch API, 1000 per transaction, from the client side.
    reset(&client).await?;
    let mut c2 = connect(&url).await?;
    let t = Instant::now();
    for b in 0..total / 1000 {
        let msgs: Vec<NewMessage> = (0..1000)
            .map(|i| NewMessage::webhook(format!("rb-{b}-{i}"), payload.clone()))
            .collect();
        let tx = c2.transaction().await?;
        let got = outboxd::enqueue_many(&tx, &msgs).await?;
        tx.commit().await?;
        assert_eq!(got.len(), 1000);
    }
    let rust_rate = total as f64 / t.elapsed().as_secs_f64();
    println!(
        "  bulk via Rust enqueue_many, batches of 1000: {}/s",
        fmt_rate(rust_rate)
    );
    rows.push(Row {
        figure: "enqueue: bulk, Rust enqueue_many (1000 per transaction) ÷ COPY, same run".into(),
        result: format!(
            "{:.2} ({}/s against {}/s)",
            rust_rate / copy_rate,
            fmt_rate(rust_rate),
            fmt_rate(copy_rate)
        ),
        target: "≥ 0.8".into(),
    });

    // Dedup rules per row: the same batch again is all `created = false`.
    let msgs: Vec<NewMessage> = (0..1000)
        .map(|i| NewMessage::webhook(format!("rb-0-{i}"), payload.clone()))
        .collect();
    let again = outboxd::enqueue_many(&client, &msgs).await?;
    if again.iter().any(|e| e.created) {
        bail!("re-enqueueing a batch created rows");
    }
    // The same from two connections at once (each 50 batches).
    reset(&client).await?;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..2 {
        let mut conn = connect(&url).await?;
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            for b in 0..total / 2000 {
                let msgs: Vec<NewMessage> = (0..1000)
                    .map(|i| NewMessage::webhook(format!("rb2-{c}-{b}-{i}"), payload.clone()))
                    .collect();
                let tx = conn.transaction().await?;
                outboxd::enqueue_many(&tx, &msgs).await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let rust2_rate = total as f64 / t.elapsed().as_secs_f64();
    println!(
        "  bulk via Rust enqueue_many, batches of 1000, 2 connections: {}/s",
        fmt_rate(rust2_rate)
    );
    rows.push(Row {
        figure: "enqueue: bulk, Rust enqueue_many, 2 connections".into(),
        result: format!("{}/s", fmt_rate(rust2_rate)),
        target: "≥ 50 000/s".into(),
    });

    Ok(())
}

/// Receiver for the latency figure: a minimal HTTP/1.1 server that timestamps the first
/// byte of each request as it comes off the socket, answers 204 and keeps the connection.
async fn first_byte_receiver(
    seen: Arc<Mutex<HashMap<String, Instant>>>,
) -> anyhow::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let _ = sock.set_nodelay(true);
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf: Vec<u8> = Vec::with_capacity(4096);
                let mut first: Option<Instant> = None;
                let mut chunk = [0u8; 4096];
                loop {
                    let n = match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if first.is_none() {
                        first = Some(Instant::now());
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    // Handle every complete request in the buffer.
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_string();
                        let mut key = None;
                        let mut len = 0usize;
                        for line in head.lines().skip(1) {
                            if let Some((k, v)) = line.split_once(':') {
                                let k = k.trim().to_ascii_lowercase();
                                if k == "idempotency-key" {
                                    key = Some(v.trim().to_owned());
                                } else if k == "content-length" {
                                    len = v.trim().parse().unwrap_or(0);
                                }
                            }
                        }
                        if buf.len() < end + 4 + len {
                            break;
                        }
                        buf.drain(..end + 4 + len);
                        if let (Some(k), Some(at)) = (key, first) {
                            seen.lock().unwrap().entry(k).or_insert(at);
                        }
                        first = if buf.is_empty() {
                            None
                        } else {
                            Some(Instant::now())
                        };
                        if sock
                            .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            });
        }
    });
    Ok(addr)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

async fn latency(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let rate = o.latency_rate;
    let total = rate * o.latency_secs;
    println!(
        "== latency: commit → first byte at the receiver, {rate} msg/s for {total} messages, {} runs",
        o.runs
    );
    // On a shared two-core machine one run's percentiles move by a factor of two with the
    // neighbours: report the median run of several, and print every run.
    let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
    for _ in 0..o.runs {
        let (p50, p99) = latency_run(o, rate, total).await?;
        p50s.push(p50);
        p99s.push(p99);
    }
    let (p50, p99) = (median(p50s), median(p99s));
    rows.push(Row {
        figure: format!(
            "latency commit → first byte, p50 ({rate} msg/s, median of {} runs)",
            o.runs
        ),
        result: format!("{p50:.2} ms"),
        target: "≤ 1.5 ms ".into(),
    });
    rows.push(Row {
        figure: format!(
            "latency commit → first byte, p99 ({rate} msg/s, median of {} runs)",
            o.runs
        ),
        result: format!("{p99:.2} ms"),
        target: "≤ 5 ms (issue 17)".into(),
    });
    Ok(())
}

/// One latency run on a fresh database and daemon; returns (p50, p99) in milliseconds.
async fn latency_run(o: &Opts, rate: u64, total: u64) -> anyhow::Result<(f64, f64)> {
    let url = fresh_db(o, "bench_lat").await?;
    let seen: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let addr = first_byte_receiver(seen.clone()).await?;
    let payload = o.payload(&format!("http://{addr}/hook"));
    let daemon = spawn_daemon(o, &url, &["--concurrency", "64"], "latency.log")?;

    // Warm up: the daemon is up, listening, and has a connection to the receiver.
    let warm = connect(&url).await?;
    let t = Instant::now();
    outboxd::enqueue(&warm, &NewMessage::webhook("warm-0", payload.clone())).await?;
    while !seen.lock().unwrap().contains_key("warm-0") {
        if t.elapsed() > Duration::from_secs(20) {
            bail!("the daemon delivered nothing within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let steal = Steal::start();
    // Paced enqueuer: one single-message transaction per tick, on 4 connections in turn.
    let commits: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(Arc::new(tokio::sync::Mutex::new(connect(&url).await?)));
    }
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut jobs = Vec::new();
    for i in 0..total {
        tick.tick().await;
        let client = clients[(i % 4) as usize].clone();
        let commits = commits.clone();
        let msg = NewMessage::webhook(format!("lat-{i}"), payload.clone());
        jobs.push(tokio::spawn(async move {
            let mut c = client.lock().await;
            let tx = c.transaction().await?;
            outboxd::enqueue(&tx, &msg).await?;
            tx.commit().await?;
            commits
                .lock()
                .unwrap()
                .insert(msg.key().to_owned(), Instant::now());
            anyhow::Ok(())
        }));
    }
    for j in jobs {
        j.await??;
    }
    let t = Instant::now();
    while seen.lock().unwrap().len() < total as usize + 1 && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stolen = steal.percent();
    daemon.stop().await?;
    let seen = seen.lock().unwrap();
    let commits = commits.lock().unwrap();
    let mut lat: Vec<f64> = Vec::new();
    let mut early = 0;
    for (k, c) in commits.iter() {
        if let Some(r) = seen.get(k) {
            match r.checked_duration_since(*c) {
                Some(d) => lat.push(d.as_secs_f64() * 1000.0),
                None => {
                    // The receiver saw it before the client got the commit's answer.
                    early += 1;
                    lat.push(0.0);
                }
            }
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let (p50, p99, max) = (
        percentile(&lat, 0.50),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or(f64::NAN),
    );
    println!(
        "  {} of {total} received; p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms ({early} arrived before the client saw its commit; steal {stolen:.0} %)",
        lat.len()
    );
    Ok((p50, p99))
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of a 64-row claim, rolled back. Prepared and executed with
/// parameters, as the worker runs it: a generic plan, as the worker's claim pool forces.
async fn explain_claim(client: &Client) -> anyhow::Result<Vec<String>> {
    // The generic plan, as the worker's claim pool makes it (`queries::CLAIM_SETUP`).
    client
        .batch_execute("BEGIN; SET LOCAL plan_cache_mode = force_generic_plan")
        .await?;
    client
        .batch_execute(&format!(
            "PREPARE bench_claim(text[], bigint, text, float8, uuid) AS {}",
            outboxd::queries::CLAIM
        ))
        .await?;
    let rows = client
        .query(
            "EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_claim('{webhook}', 64, 'bench', 60, \
             gen_random_uuid())",
            &[],
        )
        .await?;
    client.batch_execute("ROLLBACK").await?;
    client.batch_execute("DEALLOCATE bench_claim").await?;
    Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
}

/// Deliveries per second from a backlog: the worker starts at t0, and the clock stops
/// when the sink has seen `n` requests; the worker is then stopped.
async fn window_run(o: &Opts, url: &str, tag: &str) -> anyhow::Result<f64> {
    let before = sink_requests(&o.sink_status)?;
    let d = spawn_daemon(o, url, &["--concurrency", "64"], &format!("{tag}.log"))?;
    let started = d.started;
    let mut polls = 0u64;
    loop {
        // nginx's counter includes every status request, this one included: without
        // taking them out, the clock stopped a poll per 2 ms early (about 5 % of a run).
        polls += 1;
        let seen = (sink_requests(&o.sink_status)? - before).saturating_sub(polls);
        if seen >= o.n as u64 {
            break;
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!("{tag}: only {seen} deliveries in 300 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = started.elapsed();
    d.stop().await?;
    let rate = o.n as f64 / took.as_secs_f64();
    println!(
        "  {tag}: {} deliveries in {:.3} s = {}/s",
        o.n,
        took.as_secs_f64(),
        fmt_rate(rate)
    );
    Ok(rate)
}

/// What a run cost PostgreSQL's buffer cache: blocks its database read from outside
/// `shared_buffers` (the kernel's cache or the disk), and the cluster's buffers written out
/// by backends and by the background writer to make room (not by checkpoints). The
/// written figures come from `pg_stat_bgwriter`, which PostgreSQL 17 no longer splits so;
/// there they are not printed.
struct BufferIo {
    read: i64,
    written: Option<(i64, i64)>,
}

impl BufferIo {
    async fn read(client: &Client) -> anyhow::Result<BufferIo> {
        // The daemon's backends report their counts as they exit, this connection its own
        // (a VACUUM's reads) when flushed, not up to 10 s later inside the next run.
        daemon_backends_gone(client, Duration::from_secs(5)).await?;
        flush_own_stats(client).await?;
        let version: i32 = client
            .query_one("SELECT current_setting('server_version_num')::int", &[])
            .await?
            .get(0);
        let read: i64 = client
            .query_one(
                "SELECT blks_read FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )
            .await?
            .get(0);
        let written = if version < 170000 {
            let row = client
                .query_one(
                    "SELECT buffers_backend, buffers_clean FROM pg_stat_bgwriter",
                    &[],
                )
                .await?;
            Some((row.get(0), row.get(1)))
        } else {
            None
        };
        Ok(BufferIo { read, written })
    }

    fn print_since(&self, before: &BufferIo, n: usize) {
        let per = |a: i64, b: i64| (a - b) as f64 / n as f64;
        let written = match (self.written, before.written) {
            (Some((backend, clean)), Some((backend0, clean0))) => format!(
                ", {:.2} written by backends, {:.2} by the background writer",
                per(backend, backend0),
                per(clean, clean0)
            ),
            _ => String::new(),
        };
        println!(
            "    per delivery: {:.2} blocks read into shared_buffers{written}",
            per(self.read, before.read)
        );
    }
}

async fn depth(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    println!(
        "== depth: {} pending and {} delivered rows in the table",
        o.depth_pending, o.depth_delivered
    );
    let payload = o.payload(&o.sink);

    // The small table: the same measurement on a table holding only the backlog. Its runs
    // alternate with the deep table's (below), so that a change of the host's spell between
    // loading the deep table and timing it falls on both sides alike.
    let small_url = fresh_db(o, "bench_small").await?;
    let small = connect(&small_url).await?;

    let url = fresh_db(o, "bench_depth").await?;
    let client = connect(&url).await?;
    // Loaded directly (triggers off in this session; the fingerprint computed the way the
    // trigger does), in chunks of one million rows.
    let t = Instant::now();
    client
        .batch_execute("SET session_replication_role = replica")
        .await?;
    let chunk = 1_000_000i64;
    let mut done = 0i64;
    while done < o.depth_delivered {
        let upto = (done + chunk).min(o.depth_delivered);
        client
            .execute(
                "INSERT INTO outbox.messages (message_key, channel, payload, request_hash, state,
                     attempts, run_after, created_at, updated_at, delivered_at, response)
                 SELECT 'old-' || g, 'webhook', p, outbox.request_hash('webhook', p), 'delivered',
                     1, now() - interval '2 days', now() - interval '2 days', now() - interval '2 days',
                     now() - interval '2 days', '{\"status\": 204, \"replayed\": false}'
                 FROM generate_series($1::bigint, $2::bigint) g, (SELECT $3::jsonb AS p) x",
                &[&(done + 1), &upto, &payload],
            )
            .await?;
        done = upto;
        println!(
            "  loaded {done} delivered rows ({:.0} s)",
            t.elapsed().as_secs_f64()
        );
    }
    // The backlog: due pending rows, older than anything the timed runs enqueue.
    client
        .execute(
            "INSERT INTO outbox.messages (message_key, channel, payload, request_hash, run_after)
             SELECT 'backlog-' || g, 'webhook', p, outbox.request_hash('webhook', p),
                    now() - interval '1 hour' + g * interval '1 microsecond'
             FROM generate_series(1, $1::bigint) g, (SELECT $2::jsonb AS p) x",
            &[&o.depth_pending, &payload],
        )
        .await?;
    client
        .batch_execute("RESET session_replication_role")
        .await?;
    client
        .batch_execute("VACUUM ANALYZE outbox.messages")
        .await?;
    client.batch_execute("CHECKPOINT").await?;
    let size: String = client
        .query_one(
            "SELECT pg_size_pretty(pg_total_relation_size('outbox.messages'))",
            &[],
        )
        .await?
        .get(0);
    println!(
        "  loaded in {:.0} s; outbox.messages is {size} with its indexes",
        t.elapsed().as_secs_f64()
    );

    // The claim's plan on the deep table (rolled back), in a session set up as the worker's
    // pooled connections are; run twice, the second (warm) one is shown. Then the summary
    // of the same with PostgreSQL's default, jit = on.
    client
        .batch_execute(outboxd::queries::SESSION_SETUP)
        .await?;
    explain_claim(&client).await?;
    let plan = explain_claim(&client).await?;
    std::fs::write(o.out.join("claim-plan-depth.txt"), plan.join("\n"))?;
    println!(
        "  claim plan (64 rows), as the worker runs it ({}):",
        outboxd::queries::SESSION_SETUP
    );
    for l in &plan {
        println!("    {l}");
    }
    client.batch_execute("SET jit = on").await?;
    explain_claim(&client).await?;
    let jit = explain_claim(&client).await?;
    println!("  the same claim with jit = on (PostgreSQL's default):");
    for l in jit.iter().skip_while(|l| !l.starts_with("JIT")) {
        println!("    {l}");
    }

    // Interleaved, each run after the same preparation: vacuumed and analyzed, then a
    // checkpoint, so that both sides pay the full-page images of the pages they touch first.
    let (mut small_rates, mut deep_rates) = (Vec::new(), Vec::new());
    for run in 0..o.runs {
        reset(&small).await?;
        load_jobs(&small, "w", o.n, &payload).await?;
        small
            .batch_execute("VACUUM ANALYZE outbox.messages")
            .await?;
        small.batch_execute("CHECKPOINT").await?;
        let io = BufferIo::read(&small).await?;
        small_rates.push(window_run(o, &small_url, &format!("small-{run}")).await?);
        BufferIo::read(&small).await?.print_since(&io, o.n);
        if run > 0 {
            client
                .batch_execute("VACUUM ANALYZE outbox.messages")
                .await?;
        }
        client.batch_execute("CHECKPOINT").await?;
        let io = BufferIo::read(&client).await?;
        deep_rates.push(window_run(o, &url, &format!("deep-{run}")).await?);
        BufferIo::read(&client).await?.print_since(&io, o.n);
        println!(
            "  pair {}: deep ÷ small = {:.2}",
            run + 1,
            deep_rates[run] / small_rates[run]
        );
    }
    let (small_rate, deep_rate) = (median(small_rates), median(deep_rates));
    rows.push(Row {
        figure: format!(
            "deliveries/s from a backlog, small table (median of {})",
            o.runs
        ),
        result: format!("{}/s", fmt_rate(small_rate)),
        target: "".into(),
    });
    rows.push(Row {
        figure: format!(
            "same with {} pending + {} delivered rows (median of {})",
            o.depth_pending, o.depth_delivered, o.runs
        ),
        result: format!(
            "{}/s ({:.0} %)",
            fmt_rate(deep_rate),
            100.0 * deep_rate / small_rate
        ),
        target: "≥ 90 % of small".into(),
    });
    Ok(())
}

/// The raw ceiling of the claim and completion statements: pgbench, prepared, each
/// transaction claims a batch and completes it (two autocommit statements).
async fn ceiling(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    println!("== ceiling: pgbench -M prepared, the worker's claim and completion statements");
    let url = fresh_db(o, "bench_ceiling").await?;
    let client = connect(&url).await?;
    let payload = o.payload(&o.sink);
    // The claim, as a statement whose result pgbench can \gset: its UPDATE becomes a CTE,
    // and its rows an aggregate of the arrays COMPLETE needs.
    let claim = outboxd::queries::CLAIM.trim();
    let update = claim
        .find(")\nUPDATE outbox.messages m SET")
        .context("claim shape")?;
    let claim_cte = format!(
        "{}), claimed AS ({}\n)\nSELECT coalesce(array_agg(id), '{{}}') AS ids, \
         coalesce(array_agg(lease_token), '{{}}') AS tokens, \
         coalesce(array_agg('delivered'::text), '{{}}') AS states, \
         coalesce(array_agg(0::float8), '{{}}') AS delays, \
         coalesce(array_agg(NULL::text), '{{}}') AS nulls, \
         coalesce(array_agg('{{\"status\": 204, \"replayed\": false}}'::jsonb), '{{}}') AS responses, \
         coalesce(array_agg(attempts), '{{}}') AS attempts, \
         coalesce(array_agg('delivered'::text), '{{}}') AS outcomes, \
         coalesce(array_agg(204), '{{}}') AS statuses, \
         coalesce(array_agg(false), '{{}}') AS dedups, \
         coalesce(array_agg(now()), '{{}}') AS started FROM claimed",
        &claim[..update],
        &claim[update + 1..],
    );
    // pgbench takes one statement per line: drop the SQL comments, then join the lines.
    let one_line = |s: &str| {
        s.lines()
            .map(|l| l.split_once("--").map_or(l, |(code, _)| code))
            .flat_map(str::split_whitespace)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let claim_line = one_line(&claim_cte)
        .replace("$1::text[]", "'{webhook}'::text[]")
        .replace("$2", ":batch")
        .replace("$3::text", "'pgbench'::text")
        .replace("$4::float8", "60::float8")
        // The worker makes one token per claim.
        .replace("$5::uuid", "(SELECT gen_random_uuid())");
    let complete_line = one_line(outboxd::queries::COMPLETE)
        .replace("$10", ":statuses")
        .replace("$11", ":dedups")
        .replace("$12", ":started")
        .replace("$13", "'pgbench'")
        .replace("$1", ":ids")
        .replace("$2", ":tokens")
        .replace("$3", ":states")
        .replace("$4", ":delays")
        .replace("$5", ":nulls")
        .replace("$6", ":nulls")
        .replace("$7", ":responses")
        .replace("$8", ":attempts")
        .replace("$9", ":outcomes");
    let script = o.out.join("claim-complete.pgbench");
    std::fs::write(&script, format!("{claim_line} \\gset\n{complete_line};\n"))?;
    let pgbench = std::env::var("BENCH_PGBENCH").unwrap_or_else(|_| "pgbench".into());

    // Single-message enqueue transactions, as the application sends them.
    let enqueue_script = o.out.join("enqueue.pgbench");
    std::fs::write(
        &enqueue_script,
        "\\set k random(1, 1000000000000)\nBEGIN;\n\
         SELECT outbox.enqueue('pgb-' || :client_id || '-' || :k, 'webhook', :payload::jsonb);\n\
         COMMIT;\n",
    )?;
    // The machine's commit ceiling: the same transaction shape with a plain INSERT into a
    // table with one index, no function, no trigger.
    let plain_script = o.out.join("plain-insert.pgbench");
    std::fs::write(
        &plain_script,
        "\\set k random(1, 1000000000000)\nBEGIN;\n\
         INSERT INTO bench_plain (k, p) VALUES ('pgb-' || :client_id || '-' || :k, :payload::jsonb);\n\
         COMMIT;\n",
    )?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_plain (id bigserial PRIMARY KEY, k text, p jsonb)",
        )
        .await?;
    for (what, script, idle) in [
        ("plain INSERT (commit ceiling)", &plain_script, false),
        ("outbox.enqueue, no idle worker", &enqueue_script, false),
        (
            "outbox.enqueue, a worker idle (every commit notifies)",
            &enqueue_script,
            true,
        ),
    ] {
        reset(&client).await?;
        if idle {
            client
                .batch_execute("SELECT pg_advisory_lock_shared(1869968482, 2)")
                .await?;
        }
        let out = tokio::process::Command::new(&pgbench)
            .args(["-n", "-M", "prepared", "-f"])
            .arg(script)
            .args(["-D", &format!("payload={payload}")])
            .args(["-c", "4", "-j", "4", "-T", "5"])
            .arg(&url)
            .output()
            .await?;
        if idle {
            client
                .batch_execute("SELECT pg_advisory_unlock_shared(1869968482, 2)")
                .await?;
        }
        if !out.status.success() {
            bail!("pgbench failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let tps = pgbench_tps(&String::from_utf8_lossy(&out.stdout))?;
        println!("  single-message transactions, 4 clients, {what}: {tps:.0}/s");
        rows.push(Row {
            figure: format!("pgbench ceiling: 4 clients, {what}"),
            result: format!("{}/s", fmt_rate(tps)),
            target: "".into(),
        });
    }

    for (batch, clients, secs) in [(100, 1, 10), (100, 2, 10), (100, 4, 10), (1, 1, 10)] {
        reset(&client).await?;
        let need = if batch == 1 { 60_000 } else { 600_000 };
        load_jobs(&client, "pgb", need, &payload).await?;
        client
            .batch_execute("VACUUM ANALYZE outbox.messages")
            .await?;
        client.batch_execute("CHECKPOINT").await?;
        let out = tokio::process::Command::new(&pgbench)
            .args(["-n", "-M", "prepared", "-f"])
            .arg(&script)
            // The session settings of the worker's pooled connections.
            .env("PGOPTIONS", "-c jit=off")
            .args(["-D", &format!("batch={batch}")])
            .args(["-c", &clients.to_string(), "-j", &clients.to_string()])
            .args(["-T", &secs.to_string()])
            .arg(&url)
            .output()
            .await?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!("pgbench failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let tps = pgbench_tps(&text)?;
        let delivered: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'",
                &[],
            )
            .await?
            .get(0);
        let rate = delivered as f64 / secs as f64;
        println!(
            "  batch {batch}, {clients} client(s): {tps:.0} claim+complete pairs/s, {}/s rows",
            fmt_rate(rate)
        );
        rows.push(Row {
            figure: format!(
                "pgbench ceiling: claim + complete, batch {batch}, {clients} client(s)"
            ),
            result: format!("{}/s rows", fmt_rate(rate)),
            target: "".into(),
        });
    }
    Ok(())
}

/// The `tps = N` of pgbench's report.
fn pgbench_tps(text: &str) -> anyhow::Result<f64> {
    text.lines()
        .find(|l| l.starts_with("tps"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse().ok())
        .context("no tps line in pgbench's output")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let o = Opts::from_env()?;
    std::fs::create_dir_all(&o.out)?;
    let mut rows = Vec::new();
    let mut sections = Vec::new();
    for name in [
        "throughput",
        "enqueue",
        "latency",
        "memory",
        "ceiling",
        "depth",
        "scaleout",
        "ordering",
        "peer",
        "ab",
    ] {
        if !o.wants(name) {
            continue;
        }
        let steal = Steal::start();
        match name {
            "throughput" => throughput(&o, &mut rows).await?,
            "enqueue" => enqueue_bench(&o, &mut rows).await?,
            "latency" => latency(&o, &mut rows).await?,
            "memory" => memory(&o, &mut rows).await?,
            "ceiling" => ceiling(&o, &mut rows).await?,
            "scaleout" => scaleout(&o, &mut rows).await?,
            "ordering" => ordering(&o, &mut rows).await?,
            "peer" => pairs::peer(&o, &mut rows).await?,
            "ab" => pairs::ab(&o, &mut rows).await?,
            _ => depth(&o, &mut rows).await?,
        }
        let share = steal.percent();
        println!("  ({name}: {share:.1} % of the CPU time was stolen by the hypervisor)");
        sections.push(format!("{name} {share:.1} %"));
    }
    println!();
    println!(
        "CPU time stolen by the hypervisor, by section: {}",
        sections.join(", ")
    );
    println!();
    println!("| figure | result | target |");
    println!("|---|---|---|");
    for r in rows {
        println!("| {} | {} | {} |", r.figure, r.result, r.target);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Scale-out: several `outboxd run` processes against one database.
// ---------------------------------------------------------------------------------------

/// One configuration of the scale-out section: `procs` daemons, each `--concurrency conc`.
#[derive(Clone, Copy, PartialEq)]
struct Shape {
    procs: usize,
    conc: usize,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}×{}", self.procs, self.conc)
    }
}

/// `BENCH_SCALEOUT`: comma-separated `PxC` (processes × per-process concurrency), run in
/// this order in every round. The default keeps the total in flight at 64 for 1, 2 and 4
/// processes, then keeps 64 per process (2×64, 4×64), and ends with one process at 256 (the
/// same total in flight as 4×64, so that "more processes" and "more in flight" separate).
fn scaleout_shapes() -> anyhow::Result<Vec<Shape>> {
    let spec = env_or("BENCH_SCALEOUT", "1x64,2x32,4x16,2x64,4x64,1x256");
    spec.split(',')
        .map(|s| {
            let (p, c) = s
                .trim()
                .split_once('x')
                .with_context(|| format!("BENCH_SCALEOUT: {s:?} is not PxC"))?;
            let shape = Shape {
                procs: p
                    .parse()
                    .with_context(|| format!("BENCH_SCALEOUT: {s:?}"))?,
                conc: c
                    .parse()
                    .with_context(|| format!("BENCH_SCALEOUT: {s:?}"))?,
            };
            if shape.procs == 0 || shape.procs > 16 || shape.conc == 0 {
                bail!("BENCH_SCALEOUT: {s:?}: 1..16 processes, concurrency ≥ 1");
            }
            Ok(shape)
        })
        .collect()
}

/// Clock ticks per second of /proc's CPU fields (USER_HZ; 100 on every Linux we run on),
/// asked of `getconf` once: the A/B's pollers divide by it every few milliseconds.
fn clk_tck() -> f64 {
    static TCK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TCK.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// From /proc/PID/stat: (ppid, utime + stime, cutime + cstime) in clock ticks. The
/// children's fields hold the CPU of children the process has reaped: PostgreSQL's
/// backends that exited are in the postmaster's.
fn proc_stat(pid: u32) -> Option<(u32, u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    Some((num(1)? as u32, num(11)? + num(12)?, num(13)? + num(14)?))
}

/// CPU ticks of a process tree one level deep: the root (with its reaped children) and
/// its live children. The postmaster and its backends and auxiliary processes; nginx's
/// master and worker.
fn tree_ticks(root: u32) -> u64 {
    let own = proc_stat(root).map_or(0, |(_, own, reaped)| own + reaped);
    own + children(root).iter().map(|(_, ticks)| ticks).sum::<u64>()
}

/// The live children of `parent`: (pid, their own user + system ticks).
fn children(parent: u32) -> Vec<(u32, u64)> {
    let mut found = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some((ppid, own, _)) = proc_stat(pid)
                && ppid == parent
            {
                found.push((pid, own));
            }
        }
    }
    found
}

fn own_ticks(pid: u32) -> u64 {
    proc_stat(pid).map_or(0, |(_, own, _)| own)
}

/// The first line of a pid file (postmaster.pid, nginx.pid).
fn pid_from_file(var: &str) -> Option<u32> {
    let path = std::env::var(var).ok()?;
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

/// The machine's CPU counters from /proc/stat's first line, in clock ticks summed over cores.
#[derive(Clone, Copy, Default)]
struct Machine {
    busy: u64,
    idle: u64,
    steal: u64,
}

impl Machine {
    fn now() -> Machine {
        let t: Vec<u64> = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned))
            .map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .filter_map(|v| v.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let g = |i: usize| t.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal
        Machine {
            busy: g(0) + g(1) + g(2) + g(5) + g(6),
            idle: g(3) + g(4),
            steal: g(7),
        }
    }

    fn since(&self, earlier: &Machine) -> Machine {
        Machine {
            busy: self.busy.saturating_sub(earlier.busy),
            idle: self.idle.saturating_sub(earlier.idle),
            steal: self.steal.saturating_sub(earlier.steal),
        }
    }

    fn total(&self) -> u64 {
        self.busy + self.idle + self.steal
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn load1() -> f64 {
    loadavg()
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Waits (bounded by `BENCH_QUIET_WAIT` seconds, default 180) until the machine is quiet:
/// the 1-minute load average at most 1.5 *and* other processes using at most a quarter of
/// the two cores over a 2-second probe while this benchmark runs nothing (the load average
/// lags by a minute and also counts this benchmark's own last runs; the probe alone can
/// fall into a pause of a neighbour's build). Returns the probe's busy share when it went
/// on.
async fn wait_for_quiet() -> f64 {
    let limit = Duration::from_secs(env_num("BENCH_QUIET_WAIT", 180));
    let t = Instant::now();
    loop {
        let m0 = Machine::now();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let m = Machine::now().since(&m0);
        let busy = 100.0 * m.busy as f64 / m.total().max(1) as f64;
        let steal = 100.0 * m.steal as f64 / m.total().max(1) as f64;
        let load = load1();
        let quiet = load <= 1.5 && busy <= 25.0;
        if quiet || t.elapsed() >= limit {
            let waited = t.elapsed().as_secs_f64();
            println!(
                "  quiet check: load {} , others busy {busy:.0} % and steal {steal:.0} % over 2 s{}",
                loadavg(),
                if !quiet {
                    format!(" — still busy after {waited:.0} s, going on anyway")
                } else if waited > 3.0 {
                    format!(" (waited {waited:.0} s)")
                } else {
                    String::new()
                }
            );
            return busy;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}

/// What a sampler saw of the daemons' backends in `pg_stat_activity`, every 10 ms.
#[derive(Default)]
struct Waits {
    samples: u64,
    /// Backend-samples by what an active backend was doing: "CPU" (active, no wait
    /// event), or "type:event".
    active: HashMap<String, u64>,
    /// Backend-samples idle (waiting for the daemon) or idle in transaction.
    idle: u64,
    max_conns: u64,
}

impl Waits {
    fn mean(&self, n: u64) -> f64 {
        n as f64 / self.samples.max(1) as f64
    }

    fn summary(&self) -> String {
        let mut by: Vec<(&String, &u64)> = self.active.iter().collect();
        by.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let parts: Vec<String> = by
            .iter()
            .take(5)
            .map(|(k, v)| format!("{k} {:.2}", self.mean(**v)))
            .collect();
        format!(
            "backends: {} connections, active {:.2} ({}), idle {:.2}; {} samples",
            self.max_conns,
            self.all_active(),
            parts.join(", "),
            self.mean(self.idle),
            self.samples
        )
    }

    /// Mean number of daemon backends waiting on a heavyweight lock (row, tuple,
    /// transaction id): contention on the claim would show here.
    fn lock(&self) -> f64 {
        self.mean(
            self.active
                .iter()
                .filter(|(k, _)| k.starts_with("Lock:"))
                .map(|(_, v)| v)
                .sum(),
        )
    }

    fn lwlock(&self) -> f64 {
        self.mean(
            self.active
                .iter()
                .filter(|(k, _)| k.starts_with("LWLock:"))
                .map(|(_, v)| v)
                .sum(),
        )
    }

    fn all_active(&self) -> f64 {
        self.mean(self.active.values().sum())
    }

    fn cpu(&self) -> f64 {
        self.mean(self.active.get("CPU").copied().unwrap_or(0))
    }
}

async fn sample_waits(client: Arc<Client>, stop: Arc<std::sync::atomic::AtomicBool>) -> Waits {
    let mut w = Waits::default();
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        if let Ok(rows) = client
            .query(
                "SELECT state, wait_event_type, wait_event FROM pg_stat_activity
                 WHERE application_name = 'outboxd' AND backend_type = 'client backend'",
                &[],
            )
            .await
        {
            w.samples += 1;
            w.max_conns = w.max_conns.max(rows.len() as u64);
            for r in rows {
                let state: Option<String> = r.get(0);
                let wtype: Option<String> = r.get(1);
                let event: Option<String> = r.get(2);
                if state.as_deref() == Some("active") {
                    let k = match (wtype, event) {
                        (Some(t), Some(e)) => format!("{t}:{e}"),
                        _ => "CPU".to_owned(),
                    };
                    *w.active.entry(k).or_default() += 1;
                } else {
                    w.idle += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    w
}

/// One scale-out run's figures.
struct ScaleRun {
    rate: f64,
    /// CPU seconds per delivery, in µs: the daemons together, PostgreSQL, nginx.
    daemons_us: f64,
    pg_us: f64,
    nginx_us: f64,
    /// Shares of the two cores over the clocked window, in %.
    idle: f64,
    steal: f64,
    others: f64,
    xacts_per_1000: f64,
    waits: Waits,
}

/// The connections the scale-out section keeps for itself, and the processes it accounts.
struct ScaleCtx<'a> {
    url: &'a str,
    client: &'a Client,
    /// Polls "is anything unfinished" on the benchmark database after the sink has seen
    /// every request; its backend's CPU and transactions are taken out of PostgreSQL's.
    probe: &'a Client,
    probe_pid: u32,
    /// Samples `pg_stat_activity` from the `postgres` database; its CPU is taken out too.
    sampler: Arc<Client>,
    sampler_pid: u32,
    postmaster: Option<u32>,
    nginx: Option<u32>,
    tck: f64,
}

async fn backend_pid(c: &Client) -> anyhow::Result<u32> {
    Ok(c.query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get::<_, i32>(0) as u32)
}

/// Flushes this session's pending statistics (they are flushed when the session next goes
/// idle) and drops any snapshot of them, so that the next read sees every count so far.
async fn flush_own_stats(c: &Client) -> anyhow::Result<()> {
    c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
    c.batch_execute("SELECT 1").await?;
    c.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    Ok(())
}

/// Waits (`limit` at most) until no daemon's backend is left on the cluster: a backend
/// flushes its statistics as it exits.
async fn daemon_backends_gone(c: &Client, limit: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let left: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outboxd'",
                &[],
            )
            .await?
            .get(0);
        if left == 0 || t.elapsed() > limit {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Committed and rolled-back transactions of the benchmark database, pending stats of this
/// session flushed first.
async fn db_xacts(c: &Client) -> anyhow::Result<i64> {
    flush_own_stats(c).await?;
    Ok(c.query_one(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database
             WHERE datname = current_database()",
        &[],
    )
    .await?
    .get(0))
}

async fn scaleout_run(
    o: &Opts,
    ctx: &ScaleCtx<'_>,
    shape: Shape,
    tag: &str,
) -> anyhow::Result<ScaleRun> {
    let client = ctx.client;
    reset(client).await?;
    load_jobs(client, "so", o.n, &o.payload(&o.sink)).await?;
    client
        .batch_execute("VACUUM ANALYZE outbox.messages")
        .await?;
    client.batch_execute("CHECKPOINT").await?;
    let load_at_start = loadavg();
    let xacts0 = db_xacts(client).await?;
    let sink0 = sink_requests(&o.sink_status)?;
    let pg_side = || {
        ctx.postmaster.map(|pm| {
            tree_ticks(pm).saturating_sub(own_ticks(ctx.probe_pid) + own_ticks(ctx.sampler_pid))
        })
    };
    let pg0 = pg_side();
    let ng0 = ctx.nginx.map(tree_ticks);
    let m0 = Machine::now();

    let conc = shape.conc.to_string();
    let mut daemons = Vec::new();
    for p in 0..shape.procs {
        daemons.push(spawn_daemon(
            o,
            ctx.url,
            &["--drain", "--concurrency", &conc],
            &format!("{tag}-p{p}.log"),
        )?);
    }
    let started = daemons[0].started;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = tokio::spawn(sample_waits(ctx.sampler.clone(), stop.clone()));

    // The clock stops when nothing is unfinished: first the sink has counted every request
    // (cheap to poll), then the database has no pending or running row left (completions
    // trail the requests by a flush). Not at the daemons' exit: a daemon whose claim comes
    // back empty while the others still hold rows sleeps a poll interval (1 s) before its
    // drain check, which would add up to a second to a 2-3 s run.
    let limit = Duration::from_secs(300);
    let mut polls = 0u64;
    loop {
        // nginx counts each status request too, this one included.
        polls += 1;
        let seen = (sink_requests(&o.sink_status)? - sink0).saturating_sub(polls);
        if seen >= o.n as u64 {
            break;
        }
        for d in &mut daemons {
            if let Some(st) = d.child.try_wait()? {
                bail!("{tag}: a daemon exited early ({st}) after {seen} requests");
            }
        }
        if started.elapsed() > limit {
            bail!("{tag}: only {seen} requests in {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let channels = vec!["webhook".to_owned()];
    let mut probes = 0i64;
    loop {
        let unfinished: bool = ctx
            .probe
            .query_one(outboxd::queries::HAS_UNFINISHED, &[&channels])
            .await?
            .get(0);
        probes += 1;
        if !unfinished {
            break;
        }
        if started.elapsed() > limit {
            bail!("{tag}: rows still unfinished after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let wall = started.elapsed();
    let m = Machine::now().since(&m0);
    let daemon_ticks: u64 = daemons.iter().map(|d| own_ticks(d.pid())).sum();
    let pg_ticks = pg_side().zip(pg0).map(|(a, b)| a.saturating_sub(b));
    let ng_ticks = ctx
        .nginx
        .map(tree_ticks)
        .zip(ng0)
        .map(|(a, b)| a.saturating_sub(b));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let waits = sampler.await?;

    for d in daemons {
        d.stop().await?;
    }
    daemon_backends_gone(&ctx.sampler, Duration::from_secs(10)).await?;
    let xacts = db_xacts(client).await? - xacts0 - probes;
    let sent = (sink_requests(&o.sink_status)? - sink0).saturating_sub(polls + 1);
    let delivered: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'",
            &[],
        )
        .await?
        .get(0);
    if delivered as usize != o.n {
        bail!("{tag}: {delivered} of {} delivered", o.n);
    }

    let n = o.n as f64;
    let per = |ticks: u64| ticks as f64 / ctx.tck * 1e6 / n;
    let share = |ticks: u64| 100.0 * ticks as f64 / m.total().max(1) as f64;
    let ours = daemon_ticks + pg_ticks.unwrap_or(0) + ng_ticks.unwrap_or(0);
    let run = ScaleRun {
        rate: n / wall.as_secs_f64(),
        daemons_us: per(daemon_ticks),
        pg_us: pg_ticks.map_or(f64::NAN, per),
        nginx_us: ng_ticks.map_or(f64::NAN, per),
        idle: share(m.idle),
        steal: share(m.steal),
        others: share(m.busy.saturating_sub(ours)),
        xacts_per_1000: 1000.0 * xacts as f64 / n,
        waits,
    };
    println!(
        "  {tag} ({shape}): {} jobs in {:.3} s = {}/s (sink saw {sent}); CPU per delivery: \
         daemons {:.0} µs, PostgreSQL {:.0} µs, nginx {:.0} µs; of the two cores: idle {:.0} %, \
         steal {:.0} %, others {:.0} %; {:.0} transactions per 1000; load at start {load_at_start}",
        o.n,
        wall.as_secs_f64(),
        fmt_rate(run.rate),
        run.daemons_us,
        run.pg_us,
        run.nginx_us,
        run.idle,
        run.steal,
        run.others,
        run.xacts_per_1000,
    );
    println!("      {}", run.waits.summary());
    Ok(run)
}

async fn scaleout(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let shapes = scaleout_shapes()?;
    println!(
        "== scaleout: {} jobs drained by several outboxd run processes on one database; shapes {} \
         (processes × --concurrency each), interleaved, {} rounds",
        o.n,
        shapes
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        o.runs
    );
    let url = fresh_db(o, "bench_scaleout").await?;
    let client = connect(&url).await?;
    let probe = connect(&url).await?;
    let probe_pid = backend_pid(&probe).await?;
    let sampler = connect(&o.db).await?;
    let sampler_pid = backend_pid(&sampler).await?;
    let ctx = ScaleCtx {
        url: &url,
        client: &client,
        probe: &probe,
        probe_pid,
        sampler: Arc::new(sampler),
        sampler_pid,
        postmaster: pid_from_file("BENCH_PG_PIDFILE"),
        nginx: pid_from_file("BENCH_NGINX_PIDFILE"),
        tck: clk_tck(),
    };
    if ctx.postmaster.is_none() || ctx.nginx.is_none() {
        println!(
            "  (BENCH_PG_PIDFILE / BENCH_NGINX_PIDFILE not set or unreadable: no CPU figures \
             for PostgreSQL / nginx)"
        );
    }
    let mut runs: Vec<Vec<ScaleRun>> = shapes.iter().map(|_| Vec::new()).collect();
    for round in 0..o.runs {
        println!("  round {}:", round + 1);
        wait_for_quiet().await;
        for (i, shape) in shapes.iter().enumerate() {
            let tag = format!("so-{}x{}-{round}", shape.procs, shape.conc);
            runs[i].push(scaleout_run(o, &ctx, *shape, &tag).await?);
        }
    }

    let med = |v: &[ScaleRun], f: fn(&ScaleRun) -> f64| median(v.iter().map(f).collect());
    let base = runs.first().map(|r| med(r, |x| x.rate)).unwrap_or(f64::NAN);
    println!();
    println!(
        "  scale-out, median of {} per column (each column's median on its own), ratio to {}:",
        o.runs,
        shapes.first().map(|s| s.to_string()).unwrap_or_default()
    );
    println!(
        "  | processes × concurrency | in flight | deliveries/s | ratio | runs | daemons µs | PostgreSQL µs | nginx µs | all µs | idle % | steal % | others % | xacts/1000 | active backends (CPU, LWLock, Lock) | connections |"
    );
    println!("  |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (shape, r) in shapes.iter().zip(&runs) {
        let rate = med(r, |x| x.rate);
        let all = med(r, |x| x.daemons_us + x.pg_us + x.nginx_us);
        let list: Vec<String> = r.iter().map(|x| fmt_rate(x.rate)).collect();
        println!(
            "  | {shape} | {} | {} | {:.2} | {} | {:.0} | {:.0} | {:.0} | {all:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} ({:.2}, {:.2}, {:.2}) | {} |",
            shape.procs * shape.conc,
            fmt_rate(rate),
            rate / base,
            list.join(", "),
            med(r, |x| x.daemons_us),
            med(r, |x| x.pg_us),
            med(r, |x| x.nginx_us),
            med(r, |x| x.idle),
            med(r, |x| x.steal),
            med(r, |x| x.others),
            med(r, |x| x.xacts_per_1000),
            med(r, |x| x.waits.all_active()),
            med(r, |x| x.waits.cpu()),
            med(r, |x| x.waits.lwlock()),
            med(r, |x| x.waits.lock()),
            r.iter().map(|x| x.waits.max_conns).max().unwrap_or(0),
        );
        rows.push(Row {
            figure: format!(
                "scale-out: {} process(es) × --concurrency {} (median of {})",
                shape.procs, shape.conc, o.runs
            ),
            result: format!("{}/s ({:.2}×)", fmt_rate(rate), rate / base),
            target: "".into(),
        });
    }
    Ok(())
}
