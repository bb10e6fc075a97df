//! The command line: `outboxd migrate | run | enqueue | status`.
//!
//! Flags also read `OUTBOXD_<FLAG>` (a flag beats the variable). Exit codes: 0 success,
//! 2 bad usage or configuration (one line on stderr), 1 a runtime failure or a refusal.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};

/// `println!` that ignores a closed stdout (`outboxd dead | head` must not panic).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `print!` that ignores a closed stdout.
macro_rules! out_part {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout().lock(), $($arg)*);
    }};
}

use crate::config::{
    DestinationPolicy, EmailConfig, SmtpUrl, WebhookConfig, WorkerConfig, parse_duration,
    parse_message_id_domain, parse_webhook_secret,
};
use crate::deliver::{Deliverers, email::EmailSender, webhook::WebhookSender};
use crate::enqueue::{EnqueueError, NewMessage};
use crate::model::Channel;
use crate::model::ConfigError;
use crate::model::ErrorClass;
use crate::ops::{DeadFilter, ReplayError, ReplaySelection, Target};
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
    /// List dead letters, newest first.
    Dead(DeadArgs),
    /// Show one message and its attempt history (header values redacted).
    Show(ShowArgs),
    /// Move dead messages back to pending, with the same key (all or nothing).
    Replay(ReplayArgs),
    /// Delete finished messages older than a given age, in batches.
    Purge(PurgeArgs),
}

/// Filters shared by `dead` and `replay --all-dead`.
#[derive(Debug, Args)]
pub struct DeadFilterArgs {
    /// Only this channel (webhook or email).
    #[arg(long, env = "OUTBOXD_CHANNEL", value_parser = parse_channel)]
    pub channel: Option<Channel>,
    /// Only this error class (transient, ambiguous, permanent, invalid, exhausted).
    #[arg(long, env = "OUTBOXD_ERROR_CLASS", value_parser = parse_error_class)]
    pub error_class: Option<ErrorClass>,
    /// Only those that died within this long (e.g. 1h).
    #[arg(long, env = "OUTBOXD_SINCE", value_parser = parse_duration, value_name = "DURATION")]
    pub since: Option<Duration>,
}

impl DeadFilterArgs {
    fn filter(&self) -> DeadFilter {
        DeadFilter {
            channel: self.channel,
            error_class: self.error_class,
            since: self.since,
        }
    }
}

/// `outboxd dead`.
#[derive(Debug, Args)]
pub struct DeadArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub filter: DeadFilterArgs,
    /// Most rows to list.
    #[arg(long, env = "OUTBOXD_LIMIT", default_value_t = 50)]
    pub limit: i64,
    /// Print JSON (an array).
    #[arg(long, env = "OUTBOXD_JSON", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub json: bool,
}

/// `outboxd show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// A message id (digits only) or key.
    #[arg(value_name = "ID|KEY")]
    pub target: String,
    /// Print JSON.
    #[arg(long, env = "OUTBOXD_JSON", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub json: bool,
}

/// `outboxd replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Message ids (digits only) or keys.
    #[arg(
        value_name = "ID|KEY",
        required_unless_present = "all_dead",
        conflicts_with = "all_dead"
    )]
    pub targets: Vec<String>,
    /// Replay every dead letter matching the filters.
    #[arg(long, env = "OUTBOXD_ALL_DEAD", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub all_dead: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub filter: DeadFilterArgs,
    /// Say what would be replayed, change nothing.
    #[arg(long, env = "OUTBOXD_DRY_RUN", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub dry_run: bool,
}

/// `outboxd purge`.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Delete rows finished longer ago than this (at least 24h).
    #[arg(long, env = "OUTBOXD_OLDER_THAN", value_parser = parse_duration, value_name = "DURATION")]
    pub older_than: Duration,
    /// Also delete dead letters (by dead_at).
    #[arg(long, env = "OUTBOXD_INCLUDE_DEAD", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub include_dead: bool,
}

fn parse_channel(s: &str) -> Result<Channel, String> {
    Channel::parse(s).ok_or_else(|| format!("unknown channel {s:?} (webhook or email)"))
}

fn parse_error_class(s: &str) -> Result<ErrorClass, String> {
    ErrorClass::parse(s).ok_or_else(|| {
        format!("unknown error class {s:?} (transient, ambiguous, permanent, invalid or exhausted)")
    })
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
    /// Channels to deliver (default: webhook, plus email when OUTBOXD_SMTP_URL is set).
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
    #[arg(long, env = "OUTBOXD_JSON", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value = "false", default_missing_value = "true")]
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
    /// `OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN`.
    pub email_message_id_domain: Option<String>,
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
            email_message_id_domain: var("OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN"),
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

/// [`runtime`] for a database error, with its SQLSTATE and message.
fn db_failed(context: &str, e: &tokio_postgres::Error) -> CliError {
    runtime(context, crate::db::describe(e))
}

/// Runs a parsed command.
pub async fn dispatch(cli: Cli, env: Env) -> Result<(), CliError> {
    match cli.command {
        Command::Migrate => migrate(&env).await,
        Command::Run(args) => run(args, &env).await,
        Command::Enqueue(args) => enqueue(args, &env).await,
        Command::Status(args) => status(args, &env).await,
        Command::Dead(args) => dead(args, &env).await,
        Command::Show(args) => show(args, &env).await,
        Command::Replay(args) => replay(args, &env).await,
        Command::Purge(args) => purge(args, &env).await,
    }
}

async fn connect(env: &Env) -> Result<tokio_postgres::Client, CliError> {
    let cfg = env.database()?;
    crate::db::connect(&cfg)
        .await
        .map_err(|e| db_failed("cannot connect to the database", &e))
}

async fn migrate(env: &Env) -> Result<(), CliError> {
    let mut client = connect(env).await?;
    let report = crate::migrate::migrate(&mut client)
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    for f in &report.applied {
        out!("applied {f}");
    }
    out!(
        "schema up to date ({} applied now, {} already)",
        report.applied.len(),
        report.already
    );
    Ok(())
}

/// Builds the worker's settings from flags and environment, validated. The e-mail
/// settings are there when `email` is among the channels.
pub fn worker_settings(
    args: &RunArgs,
    env: &Env,
) -> Result<(WorkerConfig, WebhookConfig, Option<EmailConfig>), ConfigError> {
    let channels = match &args.channels {
        None if env.smtp_url.is_some() => vec![Channel::Webhook, Channel::Email],
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
    // The relay's settings are checked whenever they are given, like the webhook secret,
    // so a bad value shows at the first start rather than when e-mail is switched on.
    let smtp = env.smtp_url.as_deref().map(SmtpUrl::parse).transpose()?;
    let message_id_domain = env
        .email_message_id_domain
        .as_deref()
        .map(parse_message_id_domain)
        .transpose()?;
    if args.smtp_timeout.is_zero() {
        return Err(ConfigError("--smtp-timeout must be positive".into()));
    }
    let email = match smtp {
        Some(smtp) if channels.contains(&Channel::Email) => Some(EmailConfig {
            timeout: args.smtp_timeout,
            message_id_domain,
            ..EmailConfig::new(smtp)
        }),
        Some(_) => None,
        None if channels.contains(&Channel::Email) => {
            return Err(ConfigError(
                "--channels email needs OUTBOXD_SMTP_URL (e.g. smtp://user:pass@smtp.example.com)"
                    .into(),
            ));
        }
        None => None,
    };
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
    // The lease must outlast the longest attempt of any channel this worker delivers.
    let longest = worker
        .channels
        .iter()
        .map(|c| match c {
            Channel::Webhook => args.webhook_timeout,
            Channel::Email => args.smtp_timeout,
        })
        .max()
        .unwrap_or(args.webhook_timeout);
    worker.validate(longest)?;
    Ok((worker, webhook, email))
}

async fn run(args: RunArgs, env: &Env) -> Result<(), CliError> {
    let stop = shutdown_signal()?;
    let (worker_cfg, webhook_cfg, email_cfg) = worker_settings(&args, env)?;
    let pg = env.database()?;
    // Connections: claims, completions, and the odd status query; LISTEN has its own.
    let pool = crate::db::pool(pg.clone(), 4)?;
    if let Some(addr) = args.metrics_addr {
        let handle = crate::metrics::install()?;
        crate::metrics::serve(addr, pool.clone(), handle).await?;
    }
    let deliverers = Deliverers {
        webhook: WebhookSender::new(&webhook_cfg)?,
        email: email_cfg.as_ref().map(EmailSender::new).transpose()?,
    };
    if let Some(cfg) = &email_cfg {
        tracing::info!(relay = %cfg.smtp, "e-mail delivery through an SMTP relay");
    }
    let retention_stop = tokio_util::sync::CancellationToken::new();
    let retention = tokio::spawn(crate::ops::retention_loop(
        pool.clone(),
        args.retention,
        Duration::from_secs(600),
        retention_stop.clone(),
    ));
    let worker = Worker::new(pool, worker_cfg, deliverers, Some(pg));
    let result = worker.run(stop.cancelled_owned()).await;
    retention_stop.cancel();
    let _ = retention.await;
    result.map_err(|e| CliError::Runtime(e.into()))?;
    Ok(())
}

/// Resolves at the first SIGTERM or SIGINT.
/// Installs the SIGTERM and SIGINT handlers now (before the first database call, so a
/// signal during start-up is a graceful stop, not the default kill) and returns a token
/// cancelled at the first of them.
fn shutdown_signal() -> Result<tokio_util::sync::CancellationToken, CliError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| runtime("cannot install a SIGTERM handler", e))?;
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| runtime("cannot install a SIGINT handler", e))?;
    let token = tokio_util::sync::CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        t.cancel();
    });
    Ok(token)
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
            out!(
                "{} {}",
                e.id,
                if e.created { "created" } else { "existing" }
            );
            Ok(())
        }
        Err(EnqueueError::KeyConflict { message, .. }) => Err(CliError::Refused(message)),
        Err(EnqueueError::Invalid { message, .. }) => Err(CliError::Usage(ConfigError(message))),
        Err(EnqueueError::Database(e)) => Err(db_failed("enqueue failed", &e)),
    }
}

async fn status(args: StatusArgs, env: &Env) -> Result<(), CliError> {
    let client = connect(env).await?;
    let st = crate::status::status(&client)
        .await
        .map_err(|e| db_failed("status failed", &e))?;
    if args.json {
        let text = serde_json::to_string(&st).map_err(|e| runtime("status", e))?;
        out!("{text}");
        return Ok(());
    }
    let channels: Vec<&String> = st.by_channel.keys().collect();
    out_part!("{:<10} {:>10}", "state", "total");
    for c in &channels {
        out_part!(" {:>10}", esc(c));
    }
    out!();
    for state in crate::model::State::ALL {
        out_part!("{:<10} {:>10}", state.as_str(), st.total.get(state));
        for c in &channels {
            out_part!(" {:>10}", st.by_channel.get(*c).map_or(0, |n| n.get(state)));
        }
        out!();
    }
    out!("oldest due message: {:.1}s", st.oldest_due_seconds);
    Ok(())
}

/// Stored text (a key, an error, a payload) as text output prints it: control characters,
/// bidi overrides and the like as visible escapes ([`crate::text::escape`]).
fn esc(s: &str) -> String {
    crate::text::escape(s).into_owned()
}

/// Prints a table: a header row, then rows, columns padded to their widest cell.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}", w = *w))
            .collect();
        out!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

fn json_out<T: serde::Serialize>(value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| runtime("cannot encode JSON", e))?;
    out!("{text}");
    Ok(())
}

async fn dead(args: DeadArgs, env: &Env) -> Result<(), CliError> {
    if args.limit < 1 {
        return Err(ConfigError("--limit must be at least 1".into()).into());
    }
    let client = connect(env).await?;
    let rows = crate::ops::dead_letters(&client, &args.filter.filter(), args.limit)
        .await
        .map_err(|e| db_failed("listing dead letters failed", &e))?;
    if args.json {
        return json_out(&rows);
    }
    if rows.is_empty() {
        out!("no dead letters");
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|d| {
            vec![
                d.id.to_string(),
                esc(&d.message_key),
                esc(&d.channel),
                d.attempts.to_string(),
                esc(d.error_class.as_deref().unwrap_or_default()),
                d.dead_at.clone(),
                esc(d.last_error.as_deref().unwrap_or_default()),
            ]
        })
        .collect();
    print_table(
        &[
            "id",
            "key",
            "channel",
            "attempts",
            "class",
            "dead_at",
            "last_error",
        ],
        &table,
    );
    Ok(())
}

async fn show(args: ShowArgs, env: &Env) -> Result<(), CliError> {
    let target = Target::parse(&args.target);
    let client = connect(env).await?;
    let detail = crate::ops::show(&client, &target)
        .await
        .map_err(|e| db_failed("show failed", &e))?
        .ok_or_else(|| CliError::Refused(format!("no such message: {target}")))?;
    if args.json {
        return json_out(&detail);
    }
    let opt = |o: &Option<String>| o.as_deref().map_or_else(|| "-".into(), esc);
    out!("message {} ({})", detail.id, esc(&detail.message_key));
    out!("  channel      {}", esc(&detail.channel));
    out!("  state        {}", esc(&detail.state));
    out!(
        "  attempts     {}/{} (retry ambiguous: {})",
        detail.attempts,
        detail.max_attempts,
        detail.retry_ambiguous
    );
    out!("  run_after    {}", detail.run_after);
    out!("  created_at   {}", detail.created_at);
    out!("  updated_at   {}", detail.updated_at);
    if detail.lease_owner.is_some() {
        out!(
            "  lease        {} until {}",
            opt(&detail.lease_owner),
            opt(&detail.lease_expires_at)
        );
    }
    if let Some(t) = &detail.delivered_at {
        out!("  delivered_at {t}");
    }
    if let Some(t) = &detail.dead_at {
        out!("  dead_at      {t}");
    }
    if detail.error_class.is_some() {
        out!(
            "  error        {}: {}",
            opt(&detail.error_class),
            opt(&detail.last_error)
        );
    }
    // serde_json escapes C0 controls in strings, not DEL, C1 or bidi overrides.
    if let Some(r) = &detail.response {
        out!("  response     {}", esc(&r.to_string()));
    }
    out!("  payload      {}", esc(&detail.payload.to_string()));
    out!();
    if detail.history.is_empty() {
        out!("no attempts yet");
        return Ok(());
    }
    let rows: Vec<Vec<String>> = detail
        .history
        .iter()
        .map(|a| {
            vec![
                a.attempt.to_string(),
                esc(&a.outcome),
                opt(&a.error_class),
                a.status
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| "-".into()),
                if a.deduplicated {
                    "yes".into()
                } else {
                    "no".into()
                },
                opt(&a.worker),
                a.started_at.clone(),
                opt(&a.error),
            ]
        })
        .collect();
    print_table(
        &[
            "attempt",
            "outcome",
            "class",
            "status",
            "dedup",
            "worker",
            "started_at",
            "error",
        ],
        &rows,
    );
    Ok(())
}

async fn replay(args: ReplayArgs, env: &Env) -> Result<(), CliError> {
    let selection = if args.all_dead {
        ReplaySelection::AllDead(args.filter.filter())
    } else {
        if args.filter.channel.is_some()
            || args.filter.error_class.is_some()
            || args.filter.since.is_some()
        {
            return Err(ConfigError(
                "--channel, --error-class and --since go with --all-dead".into(),
            )
            .into());
        }
        ReplaySelection::Named(args.targets.iter().map(|t| Target::parse(t)).collect())
    };
    let mut client = connect(env).await?;
    let actor = format!(
        "cli:{}",
        std::env::var("USER").unwrap_or_else(|_| "operator".into())
    );
    let replayed = crate::ops::replay(&mut client, &selection, &actor, args.dry_run)
        .await
        .map_err(|e| match e {
            ReplayError::Database(e) => db_failed("replay failed", &e),
            refused => CliError::Refused(refused.to_string()),
        })?;
    for (id, key) in &replayed {
        out!(
            "{} {id} {}",
            if args.dry_run {
                "would replay"
            } else {
                "replayed"
            },
            esc(key)
        );
    }
    if args.dry_run {
        out!(
            "dry run: {} message(s) would be replayed; nothing changed",
            replayed.len()
        );
    } else {
        out!("replayed {} message(s)", replayed.len());
    }
    Ok(())
}

async fn purge(args: PurgeArgs, env: &Env) -> Result<(), CliError> {
    if args.older_than < Duration::from_secs(24 * 3600) {
        return Err(ConfigError(
            "--older-than must be at least 24h: a message key's dedup record must outlive the provider's retry window"
                .into(),
        )
        .into());
    }
    let client = connect(env).await?;
    let total = crate::ops::purge(&client, args.older_than, args.include_dead, 1000, |n| {
        eprintln!("purged {n} message(s) so far");
    })
    .await
    .map_err(|e| db_failed("purge failed", &e))?;
    out!("purged {total} message(s)");
    Ok(())
}
