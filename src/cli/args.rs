//! The clap definitions: every subcommand's flags, with their `OUTBOXD_*` variables and
//! defaults, and the value parsers they need.

use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};

use crate::config::parse_duration;
use crate::model::{Channel, ErrorClass};
use crate::ops::DeadFilter;

/// outboxd: a transactional outbox worker for e-mails, webhooks and provider APIs on PostgreSQL.
#[derive(Debug, Parser)]
#[command(
    name = "outboxd",
    version,
    about,
    long_about = None,
    after_help = environment_help(Scope::All)
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the schema migrations (idempotent; safe to run concurrently).
    Migrate(MigrateArgs),
    /// Run the delivery daemon.
    #[command(after_help = environment_help(Scope::Run))]
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
    /// List held messages (waiting for approval), oldest first.
    Held(HeldArgs),
    /// Approve held messages: held → pending, due at their run_after (all or nothing).
    Approve(TargetsArgs),
    /// Cancel held, pending or dead messages: never sent (again) (all or nothing).
    Cancel(CancelArgs),
    /// Confirm dead messages of class ambiguous that took effect: → delivered (all or nothing).
    Confirm(TargetsArgs),
    /// Delete finished messages older than a given age, in batches.
    Purge(PurgeArgs),
    /// Serve the operator console in the browser (sign in with OUTBOXD_CONSOLE_TOKEN).
    #[command(after_help = environment_help(Scope::Console))]
    Console(ConsoleArgs),
    /// List destinations whose circuit breaker is open, half-open or counting failures.
    Destinations(DestinationsArgs),
    /// Set, list or remove the provider endpoints that http messages name.
    Endpoint(EndpointArgs),
    /// List the channels, paused or not; pause or resume a whole channel.
    Channels(super::channels::ChannelsArgs),
}

/// Which command's help lists the environment: the top command lists every variable,
/// `run` and `console` the ones they read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    All,
    Run,
    Console,
}

/// A setting read only from the environment: its variable, what it means, and whether
/// `run` and `console` read it.
struct EnvSetting {
    name: &'static str,
    meaning: &'static str,
    run: bool,
    console: bool,
}

/// The settings no flag has: without them in `--help`, a newcomer found them only by
/// reading the source. A test compares this list with the variables `src/` reads.
const ENVIRONMENT: &[EnvSetting] = &[
    EnvSetting {
        name: "DATABASE_URL",
        meaning: "required: postgres://user:pass@host/db or libpq key=value, with sslmode, \
             sslrootcert, sslcert and sslkey",
        run: true,
        console: true,
    },
    EnvSetting {
        name: "OUTBOXD_SMTP_URL",
        meaning: "the e-mail relay: smtp://[user:pass@]host[:port][?tls=none|starttls] (STARTTLS \
             unless tls=none) or smtps://...; when set, run delivers the email channel too",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_WEBHOOK_SECRET",
        meaning: "whsec_<base64>: sign webhooks (Standard Webhooks); several, space-separated, \
             all sign (rotation); unset: webhooks go unsigned",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_WEBHOOK_SECRET_<NAME>",
        meaning: "a named secret (NAME: A-Z, 0-9, _): a payload's \"secret\": \"name\" signs \
             with it instead",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_SECRET_<NAME>",
        meaning: "an endpoint's credential (NAME: its auth_secret, upper-cased), the whole \
             header value (Bearer sk_...); or OUTBOXD_SECRET_<NAME>_FILE, a file holding it",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_ALLOW_PRIVATE_NETWORKS",
        meaning: "true: webhooks may go to loopback, private and reserved addresses (refused by \
             default, the message dead with class invalid)",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_WEBHOOK_ALLOW_HOSTS",
        meaning: "comma-separated host names or IP literals exempt from that check (e.g. \
             localhost,hooks.internal)",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_WEBHOOK_RATE_LIMITS",
        meaning: "requests per host, host=N/s|N/m, comma-separated (run's --webhook-rate-limits)",
        run: false,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN",
        meaning: "the domain of every Message-ID (default: the From address's)",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "OUTBOXD_CONSOLE_TOKEN",
        meaning: "the console's sign-in token, at least 16 characters; required unless the \
             console listens on loopback",
        run: false,
        console: true,
    },
    EnvSetting {
        name: "OUTBOXD_LOG_FORMAT",
        meaning: "text (default) or json, on stderr",
        run: true,
        console: true,
    },
    EnvSetting {
        name: "RUST_LOG",
        meaning: "log filter (default: info for run and console, warn otherwise)",
        run: true,
        console: true,
    },
    EnvSetting {
        name: "OTEL_EXPORTER_OTLP_ENDPOINT",
        meaning: "run exports a trace span per attempt over OTLP/HTTP when this or \
             OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set; also read: \
             OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TRACES_HEADERS, \
             OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, \
             OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, \
             OTEL_TRACES_SAMPLER_ARG, OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER",
        run: true,
        console: false,
    },
    EnvSetting {
        name: "USER",
        meaning: "who replay, approve, cancel and confirm record as acting (cli:<USER>)",
        run: false,
        console: false,
    },
];

/// The help's closing section: the environment-only settings of `scope`, one per entry,
/// names aligned, and where the flags' variables are shown.
fn environment_help(scope: Scope) -> String {
    use std::fmt::Write as _;
    let shown: Vec<&EnvSetting> = ENVIRONMENT
        .iter()
        .filter(|e| match scope {
            Scope::All => true,
            Scope::Run => e.run,
            Scope::Console => e.console,
        })
        .collect();
    let width = shown.iter().map(|e| e.name.len()).max().unwrap_or(0);
    let mut text = String::from(match scope {
        Scope::All => {
            "Environment (settings no flag has; every flag also reads OUTBOXD_<FLAG>, shown\n\
             in each command's --help, and a flag beats its variable):\n"
        }
        Scope::Run | Scope::Console => "Environment (besides each flag's variable above):\n",
    });
    // The meanings wrapped to end by column 100, under one another.
    let room = 100usize.saturating_sub(width + 4).max(40);
    for e in shown {
        let mut name = e.name;
        let mut line = String::new();
        for word in e.meaning.split(' ') {
            if !line.is_empty() && line.len() + 1 + word.len() > room {
                let _ = writeln!(text, "  {name:<width$}  {line}");
                name = "";
                line.clear();
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
        let _ = writeln!(text, "  {name:<width$}  {line}");
    }
    text.truncate(text.trim_end().len());
    text
}

/// `outboxd migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Record a database built by a pre-release outboxd (migrations 0001_outbox through
    /// 0019, the baseline's schema) as migrated to the baseline; refused for any other
    /// history.
    #[arg(long)]
    pub adopt_baseline: bool,
}

/// `outboxd destinations`.
#[derive(Debug, Args)]
pub struct DestinationsArgs {
    /// Print JSON.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub json: bool,
    /// Close this destination's circuit by hand (`host` or `host:port`, as listed; a host
    /// without a port is closed on every port); its held-back messages are due again at
    /// once.
    #[arg(long, value_name = "HOST", value_parser = parse_destination)]
    pub close: Option<String>,
    /// Pause this destination (named as --close does): nothing is sent to it until
    /// --resume; requests under way finish.
    #[arg(long, value_name = "HOST", value_parser = parse_destination, conflicts_with_all = ["close", "resume"])]
    pub pause: Option<String>,
    /// Why, with --pause: one line, at most 500 characters, kept with the pause.
    #[arg(long, value_name = "TEXT", requires = "pause")]
    pub reason: Option<String>,
    /// Resume a paused destination: its held-back messages are due at once.
    #[arg(long, value_name = "HOST", value_parser = parse_destination, conflicts_with = "close")]
    pub resume: Option<String>,
}

/// A destination as `outbox.destination_of` writes it: lower-cased, at most 1000
/// characters, no control characters or spaces.
fn parse_destination(s: &str) -> Result<String, String> {
    if s.is_empty() || s.chars().count() > 1000 {
        return Err("a destination is 1 to 1000 characters (host or host:port)".into());
    }
    if s.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(
            "a destination holds no spaces or control characters (host or host:port)".into(),
        );
    }
    Ok(s.to_lowercase())
}

/// `outboxd endpoint`.
#[derive(Debug, Args)]
pub struct EndpointArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: EndpointCommand,
}

/// `outboxd endpoint set | list | remove`.
#[derive(Debug, Subcommand)]
pub enum EndpointCommand {
    /// Create or replace an endpoint (its unfinished messages follow a change of host).
    Set(EndpointSetArgs),
    /// List the endpoints (a secret's name, never its value).
    List(EndpointListArgs),
    /// Remove an endpoint (refused while pending, running or held messages name it).
    Remove(EndpointRemoveArgs),
}

/// `outboxd endpoint set`.
#[derive(Debug, Args)]
pub struct EndpointSetArgs {
    /// The endpoint's name (a lower-case letter, then lower-case letters, digits, _ or -).
    #[arg(value_name = "NAME")]
    pub name: String,
    /// The API's base URL (https://api.example.com, or with a base path: …/v2).
    #[arg(long, value_name = "URL")]
    pub url: String,
    /// The NAME of the secret that fills the auth header: each worker reads its value from
    /// OUTBOXD_SECRET_<NAME> or the file named by OUTBOXD_SECRET_<NAME>_FILE. Never the
    /// secret itself.
    #[arg(long, value_name = "NAME")]
    pub auth_secret: Option<String>,
    /// The header that carries the credential.
    #[arg(long, value_name = "HEADER", default_value = "Authorization")]
    pub auth_header: String,
    /// The header that carries the message key (the provider's idempotency key).
    #[arg(
        long,
        value_name = "HEADER",
        default_value = "Idempotency-Key",
        conflicts_with = "no_idempotency_header"
    )]
    pub idempotency_header: String,
    /// The provider takes no idempotency key.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub no_idempotency_header: bool,
    /// How long the provider remembers a key (e.g. 24h); unknown when left out.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub key_ttl: Option<Duration>,
    /// A fixed, non-secret header, `Name: value` (repeat for more).
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
}

/// `outboxd endpoint list`.
#[derive(Debug, Args)]
pub struct EndpointListArgs {
    /// Print JSON (an array of objects with the table's columns).
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub json: bool,
}

/// `outboxd endpoint remove`.
#[derive(Debug, Args)]
pub struct EndpointRemoveArgs {
    /// The endpoint's name.
    #[arg(value_name = "NAME")]
    pub name: String,
}

/// A `--header 'Name: value'`: split at the first colon, both sides trimmed of spaces and
/// tabs; the name's rules are `outbox.set_endpoint`'s.
fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| "a header is written 'Name: value'".to_string())?;
    let name = name.trim_matches([' ', '\t']);
    if name.is_empty() {
        return Err("a header is written 'Name: value' (the name is missing)".into());
    }
    Ok((name.to_owned(), value.trim_matches([' ', '\t']).to_owned()))
}

/// `outboxd console`.
#[derive(Debug, Args)]
pub struct ConsoleArgs {
    /// Address to listen on; OUTBOXD_CONSOLE_TOKEN is required unless it is loopback.
    #[arg(
        long,
        env = "OUTBOXD_ADDR",
        default_value = "127.0.0.1:9188",
        value_name = "ADDR"
    )]
    pub addr: std::net::SocketAddr,
}

/// Filters shared by `dead` and `replay --all-dead`.
#[derive(Debug, Args)]
pub struct DeadFilterArgs {
    /// Only this channel (webhook, http or email).
    #[arg(long, value_parser = parse_channel)]
    pub channel: Option<Channel>,
    /// Only this error class (transient, ambiguous, permanent, invalid, exhausted).
    #[arg(long, value_parser = parse_error_class)]
    pub error_class: Option<ErrorClass>,
    /// Only those that died within this long (e.g. 1h).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub since: Option<Duration>,
}

impl DeadFilterArgs {
    pub(super) fn filter(&self) -> DeadFilter {
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
    #[arg(long, default_value_t = 50)]
    pub limit: i64,
    /// Print JSON (an array).
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub json: bool,
}

/// `outboxd show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// A message id (digits only) or key.
    #[arg(value_name = "ID|KEY")]
    pub target: String,
    /// Print JSON.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub json: bool,
}

/// `outboxd replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Message ids (digits only) or keys.
    // `cli::ops::replay` checks the named messages against `--all-dead` and the filters,
    // with a message that names the conflict.
    #[arg(value_name = "ID|KEY")]
    pub targets: Vec<String>,
    /// Replay every dead letter matching the filters.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub all_dead: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub filter: DeadFilterArgs,
    /// Say what would be replayed, change nothing.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub dry_run: bool,
    /// Also replay an http message that may have taken effect after its provider's key
    /// window closed (the provider may have forgotten the key: a person's decision to send
    /// once more, recorded in its history).
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub force: bool,
}

impl ReplayArgs {
    /// Whether any of the selection's filters (`--channel`, `--error-class`, `--since`) was
    /// given.
    pub fn filtered(&self) -> bool {
        self.filter.channel.is_some()
            || self.filter.error_class.is_some()
            || self.filter.since.is_some()
    }
}

/// `outboxd held`.
#[derive(Debug, Args)]
pub struct HeldArgs {
    /// Only this channel (webhook, http or email).
    #[arg(long, value_parser = parse_channel)]
    pub channel: Option<Channel>,
    /// Only those enqueued within this long (e.g. 1h).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub since: Option<Duration>,
    /// Most rows to list.
    #[arg(long, default_value_t = 50)]
    pub limit: i64,
    /// Print JSON (an array).
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub json: bool,
}

/// `outboxd approve` and `outboxd confirm`: the messages to act on.
#[derive(Debug, Args)]
pub struct TargetsArgs {
    /// Message ids (digits only) or keys.
    #[arg(value_name = "ID|KEY", required = true)]
    pub targets: Vec<String>,
}

/// `outboxd cancel`.
#[derive(Debug, Args)]
pub struct CancelArgs {
    /// Message ids (digits only) or keys.
    #[arg(value_name = "ID|KEY", required = true)]
    pub targets: Vec<String>,
    /// Why, for the history (one line, at most 500 characters).
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
}

/// `outboxd purge`.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Delete rows finished longer ago than this (at least 24h).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub older_than: Duration,
    /// Also delete dead letters (by dead_at).
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub include_dead: bool,
}

fn parse_channel(s: &str) -> Result<Channel, String> {
    Channel::parse(s).ok_or_else(|| format!("unknown channel {s:?} (webhook, http or email)"))
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
    /// How often to look for due messages when no notification arrives, and for expired
    /// leases (a dead worker's messages) in any case.
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
    /// Channels to deliver (default: webhook,http, plus email when OUTBOXD_SMTP_URL is set).
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
    /// Most webhook requests in flight to one host and port (0: no cap below --concurrency).
    #[arg(
        long,
        env = "OUTBOXD_HOST_CONCURRENCY",
        default_value_t = 0,
        value_name = "N"
    )]
    pub host_concurrency: usize,
    /// Requests per second or minute to a host: host=N/s|N/m, comma-separated
    /// (hooks.slack.com=1/s,api.example.com=600/m). A host alone applies on every port,
    /// host:PORT on that port only; ports 80 and 443 are refused (destinations leave the
    /// default port out: write the host alone), a trailing dot is dropped.
    #[arg(long, env = "OUTBOXD_WEBHOOK_RATE_LIMITS", value_name = "LIST")]
    pub webhook_rate_limits: Option<String>,
    /// Exit once no message of this worker's channels is pending or running.
    #[arg(long, env = "OUTBOXD_DRAIN", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub drain: bool,
    /// Consecutive transient or ambiguous failures to one host that open its circuit (0: off).
    #[arg(
        long,
        env = "OUTBOXD_BREAKER_THRESHOLD",
        default_value_t = 10,
        value_name = "N"
    )]
    pub breaker_threshold: u32,
    /// How long an open circuit waits before its probe (doubles per failed probe).
    #[arg(long, env = "OUTBOXD_BREAKER_COOLDOWN", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub breaker_cooldown: Duration,
}

/// `outboxd enqueue`. Its `Debug` shows the payload's length, not the payload.
#[derive(Args)]
pub struct EnqueueArgs {
    /// The message key, made from durable ids (`run:step:action`).
    #[arg(long)]
    pub key: String,
    /// `webhook`, `http` or `email`.
    #[arg(long)]
    pub channel: String,
    /// The payload: JSON text, or `@FILE` to read it from a file (at most 1 MiB); stored
    /// as written (numbers keep every digit, as from SQL).
    #[arg(long)]
    pub payload: String,
    /// Not before this time (RFC 3339, e.g. 2026-12-24T18:00:00Z).
    #[arg(long, value_parser = parse_rfc3339)]
    pub run_after: Option<SystemTime>,
    /// The whole attempt budget, the first attempt included.
    #[arg(long, default_value_t = 3)]
    pub max_attempts: i32,
    /// Never retry an attempt whose outcome is unknown.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub no_retry_ambiguous: bool,
    /// Hold it for a person's approval (`outboxd approve`); not sent until then.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub held: bool,
    /// Send it in order with the other messages of this ordering key: one at a time, in id
    /// order (1..255 characters, no control characters).
    #[arg(long)]
    pub ordering_key: Option<String>,
}

impl std::fmt::Debug for EnqueueArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnqueueArgs")
            .field("key", &self.key)
            .field("channel", &self.channel)
            .field("payload_len", &self.payload.len())
            .field("run_after", &self.run_after)
            .field("max_attempts", &self.max_attempts)
            .field("no_retry_ambiguous", &self.no_retry_ambiguous)
            .field("held", &self.held)
            .field("ordering_key", &self.ordering_key)
            .finish()
    }
}

/// `outboxd status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true")]
    pub json: bool,
}

fn parse_rfc3339(s: &str) -> Result<SystemTime, String> {
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map(SystemTime::from)
        .map_err(|e| format!("not an RFC 3339 time ({e}); e.g. 2026-12-24T18:00:00Z"))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// The contract: the settings of the long-running commands (`run`, `console`) read
    /// `OUTBOXD_<FLAG>` too (upper case, hyphens as underscores); the flags of one-shot
    /// commands are read from the command line only, so that a variable exported for one
    /// run (`OUTBOXD_CLOSE`, `OUTBOXD_ALL_DEAD`) never changes what a later command does.
    /// Every long flag of every subcommand, so that a new one cannot forget.
    #[test]
    fn settings_read_their_variable_and_one_shot_flags_none() {
        let cli = super::Cli::command();
        let mut wrong = Vec::new();
        // Nested commands too (`endpoint set`): one-shot like their parent.
        let nested: Vec<&clap::Command> = cli
            .get_subcommands()
            .flat_map(|s| std::iter::once(s).chain(s.get_subcommands()))
            .collect();
        for sub in nested {
            let long_running = matches!(sub.get_name(), "run" | "console");
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else {
                    continue;
                };
                let env = arg.get_env().and_then(|e| e.to_str());
                let want = format!("OUTBOXD_{}", long.to_uppercase().replace('-', "_"));
                match (long_running, env) {
                    (true, Some(e)) if e == want => {}
                    (false, None) => {}
                    (true, _) => wrong.push(format!("{} --{long}: want {want}", sub.get_name())),
                    (false, Some(e)) => {
                        wrong.push(format!("{} --{long}: reads {e}", sub.get_name()))
                    }
                }
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}
