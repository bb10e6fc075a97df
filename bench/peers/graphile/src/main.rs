//! bench/run's peer: the drain outboxd's benchmark times, done by graphile_worker 0.14 (the
//! Rust port of graphile-worker), so that both figures come from one run on one machine.
//!
//! Protocol with bench/run's driver (examples/bench.rs): it enqueues PEER_N jobs with
//! `add_jobs` in one batch, prints `enqueued N`, and waits for a line on stdin (the driver
//! vacuums and checkpoints meanwhile, as it does before an outboxd drain, and samples
//! PostgreSQL's CPU). Then the clock starts, the worker runs with PEER_CONCURRENCY slots,
//! each job POSTs the same body to the sink with reqwest, and when every job has left the
//! jobs table it prints one line:
//!
//!     peer: drained N jobs in S s = R/s; cpu U s user + K s sys
//!
//! Settings (environment): PEER_DATABASE_URL, PEER_SINK_URL, PEER_BODY (a file),
//! PEER_N (20000), PEER_CONCURRENCY (64), PEER_TUNED (1: a local queue of 500 and
//! completions batched every 1 ms, graphile's own throughput options; 0: its defaults).
//!
//! `probes/pg-callgrind` counts PostgreSQL's instructions for the drain alone, so it runs
//! the two halves as two processes: PEER_PHASE=enqueue adds the jobs and exits;
//! PEER_PHASE=run starts at once (no line awaited) and drains the PEER_N jobs already in
//! the table (PEER_N=0: an empty table, the connections' own cost). PEER_POLL_MS (2) is how
//! often the end is looked for in the table, a `count(*)` that PostgreSQL pays too.

use std::io::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use graphile_worker::{
    IntoTaskHandlerResult, JobSpec, LocalQueueConfig, TaskHandler, WorkerContext, WorkerOptions,
};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt as _;

static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
static DONE: AtomicUsize = AtomicUsize::new(0);

/// One webhook: where, and the body (kept as text, sent as is: outboxd sends the stored
/// body's bytes too).
#[derive(Clone, Serialize, Deserialize)]
struct Hook {
    url: String,
    body: String,
}

impl TaskHandler for Hook {
    const IDENTIFIER: &'static str = "hook";

    async fn run(self, ctx: WorkerContext) -> impl IntoTaskHandlerResult {
        let client = CLIENT.get().ok_or("no client")?;
        let resp = client
            .post(&self.url)
            .header("content-type", "application/json")
            .header("idempotency-key", ctx.job().id().to_string())
            .body(self.body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        DONE.fetch_add(1, Ordering::Relaxed);
        Ok::<(), String>(())
    }
}

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// (user, system) CPU seconds of this process, from /proc/self/stat.
fn cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = 100.0; // USER_HZ on Linux
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / tick;
    (get(11), get(12))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("PEER_DATABASE_URL").context("PEER_DATABASE_URL")?;
    let sink = env("PEER_SINK_URL", "http://127.0.0.1:18080/hook");
    let body_path = env("PEER_BODY", "../shared/bench/body.json");
    let body = std::fs::read_to_string(&body_path).with_context(|| body_path.clone())?;
    let n: usize = env("PEER_N", "20000").parse()?;
    let concurrency: usize = env("PEER_CONCURRENCY", "64").parse()?;
    let tuned = env("PEER_TUNED", "1") != "0";
    let phase = env("PEER_PHASE", "both");
    if !["both", "enqueue", "run"].contains(&phase.as_str()) {
        bail!("PEER_PHASE must be both, enqueue or run, not {phase:?}");
    }
    let poll_every = Duration::from_millis(env("PEER_POLL_MS", "2").parse()?);

    // The same client settings as outboxd's: keep-alive, no proxy.
    CLIENT
        .set(reqwest::Client::builder().no_proxy().build()?)
        .ok();

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut opts = WorkerOptions::default()
        .database_url(&url)
        .concurrency(concurrency)
        .define_job::<Hook>()
        .listen_os_shutdown_signals(false)
        .shutdown_signal(async move {
            let _ = stop_rx.await;
        });
    if tuned {
        opts = opts
            .local_queue(LocalQueueConfig::default().with_size(500))
            .complete_job_batch_delay(Duration::from_millis(1));
    }
    let worker = opts.init().await?;

    let hook = Hook {
        url: sink,
        body: body.trim_end().to_owned(),
    };
    if phase != "run" {
        let spec = JobSpec::default();
        let jobs: Vec<(Hook, &JobSpec)> = (0..n).map(|_| (hook.clone(), &spec)).collect();
        worker.create_utils().add_jobs(&jobs).await?;
        drop(jobs);
        println!("enqueued {n}");
        std::io::stdout().flush()?;
        if phase == "enqueue" {
            return Ok(());
        }
        let mut go = String::new();
        tokio::io::BufReader::new(tokio::io::stdin())
            .read_line(&mut go)
            .await?;
    }

    let poll = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await?;
    let (u0, s0) = cpu();
    let started = Instant::now();
    let worker = std::sync::Arc::new(worker);
    let runner = {
        let w = worker.clone();
        tokio::spawn(async move { w.run().await })
    };
    // Every job's task has returned, then every job has left the table (its completion
    // written): the same end as outboxd's --drain, which exits when nothing is unfinished.
    let deadline = started + Duration::from_secs(300);
    while DONE.load(Ordering::Relaxed) < n {
        if Instant::now() > deadline || runner.is_finished() {
            bail!("peer: only {} of {n} jobs ran", DONE.load(Ordering::Relaxed));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM graphile_worker._private_jobs")
            .fetch_one(&poll)
            .await?;
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("peer: {left} jobs still in the table");
        }
        tokio::time::sleep(poll_every).await;
    }
    let took = started.elapsed().as_secs_f64();
    let (u1, s1) = cpu();
    println!(
        "peer: drained {n} jobs in {took:.3} s = {:.0}/s; cpu {:.2} s user + {:.2} s sys",
        n as f64 / took,
        u1 - u0,
        s1 - s0
    );
    std::io::stdout().flush()?;
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), runner).await;
    Ok(())
}
