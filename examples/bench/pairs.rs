//! The `peer` and `ab` sections: two contenders run in interleaved pairs on the same sink,
//! each drain on a fresh database, with the CPU each side and PostgreSQL spent per delivery.
//!
//! * `peer`: outboxd against graphile_worker 0.14 (bench/peers/graphile, built by bench/run;
//!   its binary in `BENCH_PEER`), `BENCH_RUNS` pairs, the order alternating from pair to pair
//!   so that a drift in the host's load favours neither; prints both rates, the ratio and the
//!   median ratio.
//! * `ab`: two outboxd builds or settings: `BENCH_A_OUTBOXD` / `BENCH_B_OUTBOXD` (default
//!   `BENCH_OUTBOXD`) and `BENCH_A_ENV` / `BENCH_B_ENV` (`NAME=value` pairs separated by
//!   spaces) — the same pairs, the ratio B ÷ A. Each side's database is migrated by its own
//!   binary; `BENCH_A_SQL` / `BENCH_B_SQL` are statements run after the migration and
//!   before the enqueue (a schema lever measured without a migration of its own).
//!
//! CPU: the daemon's from `/proc/PID/stat`, polled every 2 ms until it exits (the last read
//! of a zombie gives its totals); the peer prints its own. PostgreSQL's: the postmaster's own
//! time plus its reaped children's (`cutime`, `cstime`) plus every live child's, at the start
//! and at the end of the drain, so a backend that exits in between still counts.
//!
//! Where PostgreSQL's share goes: a sampler polls the cluster's processes every 5 ms through
//! the drain and splits what it sees into the connections' backends and the background
//! processes (WAL writer, checkpointer, background writer, autovacuum); with it, the WAL the
//! drain wrote per delivery (bytes, from the insert position). The split
//! misses up to a poll's worth of a process that exits, so it is printed beside the exact
//! total, not in place of it.

use super::*;

/// User + system seconds of one process.
fn proc_cpu(pid: u32) -> Option<f64> {
    proc_stat(pid).map(|(_, own, _)| own as f64 / clk_tck())
}

/// CPU seconds of the whole PostgreSQL cluster whose postmaster is `pm`.
///
/// The postmaster's reaped children and its live ones are read at two moments: a backend
/// reaped between them would be in neither (some drains printed PostgreSQL figures half
/// the others'). So the scan is repeated until the reaped children's total is the same
/// before and after it.
fn pg_cpu(pm: u32) -> f64 {
    // (the postmaster's own user + system, its reaped children's user + system)
    let own_and_reaped = |pm: u32| proc_stat(pm).map_or((0, 0), |(_, own, reaped)| (own, reaped));
    let mut ticks = 0u64;
    for _ in 0..20 {
        let (own, reaped) = own_and_reaped(pm);
        ticks = own + reaped + children(pm).iter().map(|(_, t)| t).sum::<u64>();
        if own_and_reaped(pm).1 == reaped {
            break;
        }
    }
    ticks as f64 / clk_tck()
}

/// What a PostgreSQL process is, from its title (`postgres: walwriter`, or `postgres: USER
/// DB HOST(PORT) STATE` for a connection's backend).
fn pg_kind(pid: u32) -> &'static str {
    let title = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let title = String::from_utf8_lossy(&title);
    if [
        "walwriter",
        "checkpointer",
        "background writer",
        "autovacuum",
        "logical replication",
        "stats",
        "logger",
        "archiver",
    ]
    .iter()
    .any(|k| title.contains(k))
    {
        "background"
    } else {
        "backends"
    }
}

/// Polls the live children of `pm` every 5 ms until told to stop; returns the CPU seconds
/// each kind ([`pg_kind`]) used while it ran.
struct PgSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<HashMap<&'static str, f64>>,
}

impl PgSampler {
    fn start(pm: u32) -> PgSampler {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            // pid → (kind, ticks at first sight, ticks at last sight)
            let mut seen: HashMap<u32, (&'static str, u64, u64)> = HashMap::new();
            let mut first = true;
            loop {
                let done = flag.load(std::sync::atomic::Ordering::Relaxed);
                for (pid, ticks) in children(pm) {
                    seen.entry(pid)
                        // A process born after the first poll counts from zero.
                        .or_insert_with(|| (pg_kind(pid), if first { ticks } else { 0 }, ticks))
                        .2 = ticks;
                }
                first = false;
                if done {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let mut by_kind = HashMap::new();
            for (kind, from, to) in seen.into_values() {
                *by_kind.entry(kind).or_insert(0.0) += to.saturating_sub(from) as f64 / clk_tck();
            }
            by_kind
        });
        PgSampler { stop, thread }
    }

    fn finish(self) -> HashMap<&'static str, f64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The cluster's WAL so far, in bytes: the insert position. (`pg_stat_wal` would give
/// records and full-page images too, but each backend adds to it at most once a second, so
/// a drain's window caught part of the enqueue before it.)
async fn wal(admin: &Client) -> anyhow::Result<f64> {
    let r = admin
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8",
            &[],
        )
        .await?;
    Ok(r.get(0))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The postmaster: the parent of our own backend.
async fn postmaster(client: &Client) -> anyhow::Result<u32> {
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let (ppid, _, _) = proc_stat(pid as u32).context("cannot read our backend's /proc entry")?;
    Ok(ppid)
}

enum Side {
    Outboxd {
        label: String,
        bin: PathBuf,
        env: Vec<(String, String)>,
        /// Run after the migration, before the enqueue.
        sql: String,
    },
    Graphile {
        bin: PathBuf,
    },
}

impl Side {
    fn label(&self) -> &str {
        match self {
            Side::Outboxd { label, .. } => label,
            Side::Graphile { .. } => "graphile_worker",
        }
    }
}

struct Figures {
    rate: f64,
    /// CPU µs per delivery of the daemon (or the peer's process).
    own_us: f64,
    /// CPU µs per delivery of PostgreSQL.
    pg_us: f64,
    split: PgSplit,
}

impl std::fmt::Display for PgSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PostgreSQL as sampled: backends {:.0} µs, background {:.0} µs; WAL {:.0} bytes per delivery",
            self.backends_us, self.background_us, self.wal_bytes
        )
    }
}

/// Where PostgreSQL's share of one drain went, per delivery.
struct PgSplit {
    backends_us: f64,
    background_us: f64,
    wal_bytes: f64,
}

fn parse_env(spec: &str) -> Vec<(String, String)> {
    spec.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

async fn run_side(o: &Opts, side: &Side, tag: &str, pm: u32) -> anyhow::Result<Figures> {
    let load = loadavg();
    let steal = Steal::start();
    let admin = connect(&o.db).await?;
    // `split`: the sampler and the WAL, started where the PostgreSQL clock starts (`pg0`),
    // read where it stops.
    let (took, own, pg, split) = match side {
        Side::Outboxd { bin, env, sql, .. } => {
            let url = fresh_db_by(o, &format!("bench_{tag}"), bin).await?;
            let client = connect(&url).await?;
            client.batch_execute(sql).await?;
            load_jobs(&client, "tp", o.n, &o.payload(&o.sink)).await?;
            client
                .batch_execute("VACUUM ANALYZE outbox.messages")
                .await?;
            client.batch_execute("CHECKPOINT").await?;
            let log = std::fs::File::create(o.out.join(format!("{tag}.log")))?;
            let (sampler, wal0) = (PgSampler::start(pm), wal(&admin).await?);
            let pg0 = pg_cpu(pm);
            let started = Instant::now();
            let mut child = tokio::process::Command::new(bin)
                .args(["run", "--drain", "--concurrency", "64"])
                .env("DATABASE_URL", &url)
                .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
                .envs(env.iter().map(|(k, v)| (k, v)))
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()?;
            let pid = child.id().unwrap_or(0);
            let mut cpu = 0.0;
            loop {
                if let Some(c) = proc_cpu(pid) {
                    cpu = c;
                }
                if let Some(st) = child.try_wait()? {
                    if !st.success() {
                        bail!("{tag}: outboxd exited with {st}");
                    }
                    break;
                }
                if started.elapsed() > Duration::from_secs(300) {
                    let _ = child.kill().await;
                    bail!("{tag}: outboxd did not finish within 300 s");
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let took = started.elapsed().as_secs_f64();
            let pg = pg_cpu(pm) - pg0;
            let split = (sampler.finish(), wal(&admin).await? - wal0);
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
            (took, cpu, pg, split)
        }
        Side::Graphile { bin } => {
            let name = format!("bench_{tag}");
            let admin = connect(&o.db).await?;
            admin
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .await?;
            admin
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .await?;
            let url = o.db_named(&name);
            let log = std::fs::File::create(o.out.join(format!("{tag}.log")))?;
            let mut child = tokio::process::Command::new(bin)
                .env("PEER_DATABASE_URL", &url)
                .env("PEER_SINK_URL", &o.sink)
                .env(
                    "PEER_BODY",
                    env_or("BENCH_BODY", "../shared/bench/body.json"),
                )
                .env("PEER_N", o.n.to_string())
                .env("PEER_CONCURRENCY", "64")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()?;
            let mut stdin = child.stdin.take().context("peer stdin")?;
            let mut lines =
                tokio::io::BufReader::new(child.stdout.take().context("peer stdout")?).lines();
            let first = tokio::time::timeout(Duration::from_secs(300), lines.next_line())
                .await
                .context("peer: no `enqueued` line within 300 s")??
                .context("peer exited before enqueueing")?;
            if !first.starts_with("enqueued") {
                bail!("peer said {first:?}");
            }
            let client = connect(&url).await?;
            client
                .batch_execute("VACUUM ANALYZE graphile_worker._private_jobs")
                .await?;
            client.batch_execute("CHECKPOINT").await?;
            let (sampler, wal0) = (PgSampler::start(pm), wal(&admin).await?);
            let pg0 = pg_cpu(pm);
            let sink0 = sink_requests(&o.sink_status)?;
            stdin.write_all(b"go\n").await?;
            stdin.flush().await?;
            let line = tokio::time::timeout(Duration::from_secs(300), lines.next_line())
                .await
                .context("peer: no result within 300 s")??
                .context("peer exited without a result")?;
            let pg = pg_cpu(pm) - pg0;
            let split = (sampler.finish(), wal(&admin).await? - wal0);
            // Every job must have made its POST: a peer that drained its queue without
            // reaching the sink would otherwise look fast.
            let sent = sink_requests(&o.sink_status)? - sink0;
            if sent < o.n as u64 {
                bail!("peer: the sink saw {sent} requests for {} jobs", o.n);
            }
            // "peer: drained N jobs in S s = R/s; cpu U s user + K s sys"
            let num_after = |marker: &str| -> anyhow::Result<f64> {
                let rest = line
                    .split_once(marker)
                    .with_context(|| format!("peer said {line:?}"))?
                    .1;
                Ok(rest
                    .split_whitespace()
                    .next()
                    .context("no number")?
                    .parse()?)
            };
            let took = num_after(" jobs in ")?;
            let cpu = num_after("; cpu ")? + num_after(" user + ")?;
            drop(stdin);
            let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
            (took, cpu, pg, split)
        }
    };
    let n = o.n as f64;
    let (by_kind, bytes) = split;
    let f = Figures {
        rate: n / took,
        own_us: own * 1e6 / n,
        pg_us: pg * 1e6 / n,
        split: PgSplit {
            backends_us: by_kind.get("backends").copied().unwrap_or(0.0) * 1e6 / n,
            background_us: by_kind.get("background").copied().unwrap_or(0.0) * 1e6 / n,
            wal_bytes: bytes / n,
        },
    };
    println!(
        "  {tag} {}: {} jobs in {took:.3} s = {}/s; CPU per delivery: own {:.0} µs, PostgreSQL {:.0} µs; steal {:.0} %; load before {load}",
        side.label(),
        o.n,
        fmt_rate(f.rate),
        f.own_us,
        f.pg_us,
        steal.percent(),
    );
    println!("      {}", f.split);
    Ok(f)
}

/// `BENCH_RUNS` interleaved pairs of `a` and `b`; the ratio is b ÷ a.
async fn pairs(o: &Opts, a: &Side, b: &Side, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let admin = connect(&o.db).await?;
    let pm = postmaster(&admin).await?;
    let mut ratios = Vec::new();
    let (mut ra, mut rb) = (Vec::new(), Vec::new());
    let (mut own_a, mut own_b, mut pg_a, mut pg_b) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut split_a, mut split_b) = (Vec::new(), Vec::new());
    for pair in 0..o.runs {
        // a b, b a, a b, …: neither side always runs first.
        let (fa, fb) = if pair % 2 == 0 {
            let fa = run_side(o, a, &format!("p{pair}_a"), pm).await?;
            let fb = run_side(o, b, &format!("p{pair}_b"), pm).await?;
            (fa, fb)
        } else {
            let fb = run_side(o, b, &format!("p{pair}_b"), pm).await?;
            let fa = run_side(o, a, &format!("p{pair}_a"), pm).await?;
            (fa, fb)
        };
        let ratio = fb.rate / fa.rate;
        println!(
            "  pair {}: {} {}/s, {} {}/s: {} ÷ {} = {ratio:.2}",
            pair + 1,
            a.label(),
            fmt_rate(fa.rate),
            b.label(),
            fmt_rate(fb.rate),
            b.label(),
            a.label()
        );
        ratios.push(ratio);
        ra.push(fa.rate);
        rb.push(fb.rate);
        own_a.push(fa.own_us);
        own_b.push(fb.own_us);
        pg_a.push(fa.pg_us);
        pg_b.push(fb.pg_us);
        split_a.push(fa.split);
        split_b.push(fb.split);
    }
    let runs = o.runs;
    rows.push(Row {
        figure: format!(
            "{} ÷ {}, 64 in flight, median of {runs} pairs",
            b.label(),
            a.label()
        ),
        result: format!(
            "{:.2} ({} {}/s, {} {}/s)",
            median(ratios),
            a.label(),
            fmt_rate(median(ra)),
            b.label(),
            fmt_rate(median(rb))
        ),
        target: "".into(),
    });
    for (side, own, pg, split) in [(a, own_a, pg_a, split_a), (b, own_b, pg_b, split_b)] {
        rows.push(Row {
            figure: format!("CPU per delivery, {} (median of {runs})", side.label()),
            result: format!(
                "own process {:.0} µs, PostgreSQL {:.0} µs",
                median(own),
                median(pg)
            ),
            target: "".into(),
        });
        let m = |f: fn(&PgSplit) -> f64| median(split.iter().map(f).collect());
        rows.push(Row {
            figure: format!("  {}: PostgreSQL split, WAL (medians)", side.label()),
            result: PgSplit {
                backends_us: m(|s| s.backends_us),
                background_us: m(|s| s.background_us),
                wal_bytes: m(|s| s.wal_bytes),
            }
            .to_string(),
            target: "".into(),
        });
    }
    Ok(())
}

pub(super) async fn peer(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    println!(
        "== peer: outboxd and graphile_worker 0.14, {} jobs each, 64 in flight, {} interleaved pairs",
        o.n, o.runs
    );
    let a = Side::Outboxd {
        label: "outboxd".into(),
        bin: o.outboxd.clone(),
        env: Vec::new(),
        sql: String::new(),
    };
    let b = Side::Graphile {
        bin: std::env::var("BENCH_PEER")
            .context("BENCH_PEER (the peer's binary; bench/run builds it)")?
            .into(),
    };
    // The ratio the issue asks for is outboxd ÷ peer: run the pairs with outboxd as `b`.
    pairs(o, &b, &a, rows).await
}

pub(super) async fn ab(o: &Opts, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let side = |which: &str| Side::Outboxd {
        label: which.to_owned(),
        bin: std::env::var(format!("BENCH_{which}_OUTBOXD"))
            .map(PathBuf::from)
            .unwrap_or_else(|_| o.outboxd.clone()),
        env: parse_env(&env_or(&format!("BENCH_{which}_ENV"), "")),
        sql: env_or(&format!("BENCH_{which}_SQL"), ""),
    };
    let (a, b) = (side("A"), side("B"));
    for (name, s) in [("A", &a), ("B", &b)] {
        if let Side::Outboxd { bin, env, sql, .. } = s {
            println!("  {name}: {} {env:?} {sql:?}", bin.display());
        }
    }
    println!(
        "== ab: {} jobs each, 64 in flight, {} interleaved pairs",
        o.n, o.runs
    );
    pairs(o, &a, &b, rows).await
}
