//! The command line: `outboxd migrate | run | enqueue | status`.
//!
//! Flags also read `OUTBOXD_<FLAG>` (a flag beats the variable). Exit codes: 0 success,
//! 2 bad usage or configuration (one line on stderr), 1 a runtime failure or a refusal.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};

use crate::config::{
    ConfigError, DestinationPolicy, WebhookConfig, WorkerConfig, parse_duration,
    parse_webhook_secret,
};
use crate::deliver::{Channel, Deliverers, webhook::WebhookSender};
use crate::enqueue::{EnqueueError, NewMessage};
use crate::retry::RetryPolicy;
use crate::worker::Worker;

/// outboxd: a transactional outbox worker for e-mails and webhooks on PostgreSQL.
#[derive(Debug, Parser)]
#[command(name = "outboxd", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the schema migrations (idempotent; safe to run concurrently).
    Migrate,
    /// Run the delivery daemon.
    Run(RunArgs),
    /// Enqueue one message (prints its id and `created` or `existing`).
    Enqueue(EnqueueArgs),
    /// Show message counts by state and channel, and the age of the oldest due message.
    Status(StatusArgs),
}

/// `outboxd run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Most deliveries in flight at once.
    #[arg(
        long,
        env = "OUTBOXD_CONCURRENCY",
        default_value_t = 64,
        value_name = "N"
    )]
    pub concurrency: usize,
    /// Most messages claimed by one query.
    #[arg(
        long,
        env = "OUTBOXD_BATCH_SIZE",
        default_value_t = 100,
        value_name = "N"
    )]
    pub batch_size: usize,
    /// How often to look for due messages when no notification arrives.
    #[arg(long, env = "OUTBOXD_POLL_INTERVAL", default_value = "1s", value_parser = parse_duration, value_name = "DURATION")]
    pub poll_interval: Duration,
    /// How long a claim lasts; a worker that dies loses its messages after this.
    #[arg(long, env = "OUTBOXD_LEASE", default_value = "60s", value_parser = parse_duration, value_name = "DURATION")]
    pub lease: Duration,
    /// Timeout of one webhook attempt (connect, send, response).
    #[arg(long, env = "OUTBOXD_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    pub webhook_timeout: Duration,
    /// Timeout of one SMTP attempt.
    #[arg(long, env = "OUTBOXD_SMTP_TIMEOUT", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub smtp_timeout: Duration,
    /// Delay after the first failed attempt; doubles per attempt.
    #[arg(long, env = "OUTBOXD_RETRY_BASE", default_value = "5s", value_parser = parse_duration, value_name = "DURATION")]
    pub retry_base: Duration,
    /// Longest delay between attempts (also caps Retry-After).
    #[arg(long, env = "OUTBOXD_RETRY_MAX", default_value = "15m", value_parser = parse_duration, value_name = "DURATION")]
    pub retry_max: Duration,
    /// How long delivered messages are kept (at least 24h).
    #[arg(long, env = "OUTBOXD_RETENTION", default_value = "7d", value_parser = parse_duration, value_name = "DURATION")]
    pub retention: Duration,
    /// Channels to deliver (default: webhook).
    #[arg(long, env = "OUTBOXD_CHANNELS", value_name = "LIST")]
    pub channels: Option<String>,
    /// This worker's name in leases and history (default: hostname-pid).
    #[arg(long, env = "OUTBOXD_WORKER_ID", value_name = "ID")]
    pub worker_id: Option<String>,
    /// Address for /metrics and /healthz.
    #[arg(long, env = "OUTBOXD_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// How long in-flight attempts may finish after SIGTERM or SIGINT.
    #[arg(long, env = "OUTBOXD_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub shutdown_grace: Duration,
    /// Exit once no message of this worker's channels is pending or running.
    #[arg(long, env = "OUTBOXD_DRAIN", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub drain: bool,
}

/// `outboxd enqueue`.
#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// The message key, made from durable ids (`run:step:action`).
    #[arg(long, env = "OUTBOXD_KEY")]
    pub key: String,
    /// `webhook` or `email`.
    #[arg(long, env = "OUTBOXD_CHANNEL")]
    pub channel: String,
    /// The payload: JSON text, or `@FILE` to read it from a file.
    #[arg(long, env = "OUTBOXD_PAYLOAD")]
    pub payload: String,
    /// Not before this time (RFC 3339, e.g. 2026-12-24T18:00:00Z).
    #[arg(long, env = "OUTBOXD_RUN_AFTER", value_parser = parse_rfc3339)]
    pub run_after: Option<SystemTime>,
    /// The whole attempt budget, the first attempt included.
    #[arg(long, env = "OUTBOXD_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: i32,
    /// Never retry an attempt whose outcome is unknown.
    #[arg(long, env = "OUTBOXD_NO_RETRY_AMBIGUOUS", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub no_retry_ambiguous: bool,
}

/// `outboxd status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn parse_rfc3339(s: &str) -> Result<SystemTime, String> {
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map(SystemTime::from)
        .map_err(|e| format!("not an RFC 3339 time ({e}); e.g. 2026-12-24T18:00:00Z"))
}

/// The environment the CLI reads (besides flags), read once in `main`.
#[derive(Debug, Clone, Default)]
pub struct Env {
    /// `DATABASE_URL`.
    pub database_url: Option<String>,
    /// `OUTBOXD_SMTP_URL`.
    pub smtp_url: Option<String>,
    /// `OUTBOXD_WEBHOOK_SECRET`.
    pub webhook_secret: Option<String>,
    /// `OUTBOXD_ALLOW_PRIVATE_NETWORKS`.
    pub allow_private_networks: Option<String>,
    /// `OUTBOXD_WEBHOOK_ALLOW_HOSTS`.
    pub webhook_allow_hosts: Option<String>,
}

impl Env {
    /// Reads the variables.
    pub fn from_process() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Env {
            database_url: var("DATABASE_URL"),
            smtp_url: var("OUTBOXD_SMTP_URL"),
            webhook_secret: var("OUTBOXD_WEBHOOK_SECRET"),
            allow_private_networks: var("OUTBOXD_ALLOW_PRIVATE_NETWORKS"),
            webhook_allow_hosts: var("OUTBOXD_WEBHOOK_ALLOW_HOSTS"),
        }
    }

    fn database(&self) -> Result<tokio_postgres::Config, ConfigError> {
        let url = self.database_url.as_deref().ok_or_else(|| {
            ConfigError("DATABASE_URL is not set (e.g. postgres://user@localhost/app)".into())
        })?;
        crate::db::parse_url(url)
    }
}

/// How a command failed: decides the exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad usage or configuration: exit 2.
    #[error(transparent)]
    Usage(#[from] ConfigError),
    /// A refusal (a key reused with another payload, …): exit 1.
    #[error("{0}")]
    Refused(String),
    /// A runtime failure: exit 1.
    #[error(transparent)]
    Runtime(#[from] anyhow::Error),
}

impl CliError {
    /// The process exit code.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Refused(_) | CliError::Runtime(_) => 1,
        }
    }
}

fn runtime(context: &str, e: impl std::fmt::Display) -> CliError {
    CliError::Runtime(anyhow::anyhow!("{context}: {e}"))
}

/// Runs a parsed command.
pub async fn dispatch(cli: Cli, env: Env) -> Result<(), CliError> {
    match cli.command {
        Command::Migrate => migrate(&env).await,
        Command::Run(args) => run(args, &env).await,
        Command::Enqueue(args) => enqueue(args, &env).await,
        Command::Status(args) => status(args, &env).await,
    }
}

async fn connect(env: &Env) -> Result<tokio_postgres::Client, CliError> {
    let cfg = env.database()?;
    crate::db::connect(&cfg)
        .await
        .map_err(|e| runtime("cannot connect to the database", e))
}

async fn migrate(env: &Env) -> Result<(), CliError> {
    let mut client = connect(env).await?;
    let report = crate::migrate::migrate(&mut client)
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    for f in &report.applied {
        println!("applied {f}");
    }
    println!(
        "schema up to date ({} applied now, {} already)",
        report.applied.len(),
        report.already
    );
    Ok(())
}

/// Builds the worker's settings from flags and environment, validated.
pub fn worker_settings(
    args: &RunArgs,
    env: &Env,
) -> Result<(WorkerConfig, WebhookConfig), ConfigError> {
    let channels = match &args.channels {
        None => vec![Channel::Webhook],
        Some(list) => {
            let mut out = Vec::new();
            for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let ch = Channel::parse(name).ok_or_else(|| {
                    ConfigError(format!(
                        "--channels: unknown channel {name:?} (webhook or email)"
                    ))
                })?;
                if !out.contains(&ch) {
                    out.push(ch);
                }
            }
            out
        }
    };
    if channels.contains(&Channel::Email) {
        return Err(ConfigError(if env.smtp_url.is_none() {
            "--channels email needs OUTBOXD_SMTP_URL".into()
        } else {
            "the email channel is not available in this version of outboxd".into()
        }));
    }
    if args.retention < Duration::from_secs(24 * 3600) {
        return Err(ConfigError(
            "--retention must be at least 24h: a message key's dedup record must outlive the provider's retry window"
                .into(),
        ));
    }
    let signing_key = env
        .webhook_secret
        .as_deref()
        .map(parse_webhook_secret)
        .transpose()?;
    let destinations = DestinationPolicy::from_values(
        env.allow_private_networks.as_deref(),
        env.webhook_allow_hosts.as_deref(),
    )?;
    let webhook = WebhookConfig {
        timeout: args.webhook_timeout,
        signing_key,
        destinations,
    };
    if args.webhook_timeout.is_zero() {
        return Err(ConfigError("--webhook-timeout must be positive".into()));
    }
    let worker = WorkerConfig {
        worker_id: args
            .worker_id
            .clone()
            .unwrap_or_else(crate::config::default_worker_id),
        channels,
        concurrency: args.concurrency,
        batch_size: args.batch_size,
        poll_interval: args.poll_interval,
        lease: args.lease,
        retry: RetryPolicy {
            base: args.retry_base,
            max: args.retry_max,
        },
        drain: args.drain,
        shutdown_grace: args.shutdown_grace,
        listen: true,
    };
    worker.validate(args.webhook_timeout)?;
    Ok((worker, webhook))
}

async fn run(args: RunArgs, env: &Env) -> Result<(), CliError> {
    let (worker_cfg, webhook_cfg) = worker_settings(&args, env)?;
    let pg = env.database()?;
    if args.metrics_addr.is_some() {
        tracing::warn!(
            "--metrics-addr is accepted but the metrics endpoint is not implemented yet"
        );
    }
    // Connections: claims, completions, and the odd status query; LISTEN has its own.
    let pool = crate::db::pool(pg.clone(), 4)?;
    let deliverers = Deliverers {
        webhook: WebhookSender::new(&webhook_cfg)?,
    };
    let worker = Worker::new(pool, worker_cfg, deliverers, Some(pg));
    worker
        .run(shutdown_signal())
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    Ok(())
}

/// Resolves at the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = int.recv() => tracing::info!("SIGINT: shutting down"),
            }
        }
        _ => {
            tracing::warn!("cannot install signal handlers; stop with SIGKILL");
            std::future::pending::<()>().await;
        }
    }
}

async fn enqueue(args: EnqueueArgs, env: &Env) -> Result<(), CliError> {
    let channel = Channel::parse(&args.channel).ok_or_else(|| {
        ConfigError(format!(
            "--channel must be webhook or email (got {:?})",
            args.channel
        ))
    })?;
    let text = match args.payload.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(PathBuf::from(path))
            .map_err(|e| ConfigError(format!("--payload: cannot read {path}: {e}")))?,
        None => args.payload.clone(),
    };
    let payload: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ConfigError(format!("--payload is not valid JSON: {e}")))?;
    let mut msg = NewMessage::new(args.key.clone(), channel, payload)
        .max_attempts(args.max_attempts)
        .retry_ambiguous(!args.no_retry_ambiguous);
    if let Some(at) = args.run_after {
        msg = msg.run_after(at);
    }
    let client = connect(env).await?;
    match crate::enqueue::enqueue(&client, &msg).await {
        Ok(e) => {
            println!(
                "{} {}",
                e.id,
                if e.created { "created" } else { "existing" }
            );
            Ok(())
        }
        Err(EnqueueError::KeyConflict { message, .. }) => Err(CliError::Refused(message)),
        Err(EnqueueError::Invalid { message, .. }) => Err(CliError::Usage(ConfigError(message))),
        Err(e @ EnqueueError::Database(_)) => Err(runtime("enqueue failed", e)),
    }
}

async fn status(args: StatusArgs, env: &Env) -> Result<(), CliError> {
    let client = connect(env).await?;
    let st = crate::status::status(&client)
        .await
        .map_err(|e| runtime("status failed", e))?;
    if args.json {
        let text = serde_json::to_string(&st).map_err(|e| runtime("status", e))?;
        println!("{text}");
        return Ok(());
    }
    let channels: Vec<&String> = st.by_channel.keys().collect();
    print!("{:<10} {:>10}", "state", "total");
    for c in &channels {
        print!(" {:>10}", c);
    }
    println!();
    type Column = fn(&crate::status::Counts) -> i64;
    let rows: [(&str, Column); 4] = [
        ("pending", |c| c.pending),
        ("running", |c| c.running),
        ("delivered", |c| c.delivered),
        ("dead", |c| c.dead),
    ];
    for (name, get) in rows {
        print!("{name:<10} {:>10}", get(&st.total));
        for c in &channels {
            print!(" {:>10}", st.by_channel.get(*c).map(get).unwrap_or(0));
        }
        println!();
    }
    println!("oldest due message: {:.1}s", st.oldest_due_seconds);
    Ok(())
}
