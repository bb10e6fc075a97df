//! The command line: `outboxd migrate | run | enqueue | status | dead | held | show | replay |
//! approve | cancel | confirm | purge | console | destinations | endpoint | channels`.
//!
//! [`dispatch`] is what `main` calls. The clap definitions are in `args`, the daemon in
//! `run`, `enqueue` in its namesake, the operator commands in `ops`, `endpoint`,
//! `destinations` and `channels` (its flags too) in their namesakes; settings are assembled
//! and validated by [`crate::config::assemble`], which this module feeds.
//!
//! Flags also read `OUTBOXD_<FLAG>` (a flag beats the variable). A variable that is set to
//! bytes that are not UTF-8 is bad configuration, named, never read as unset. Exit codes:
//! 0 success, 2 bad usage or configuration (one line on stderr), 1 a runtime failure or a
//! refusal.

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

/// Writes one line to stderr, as `eprintln!` would, but ignores a closed or failing stderr
/// (a log shipper that died): a progress or error line must not become a panic, which would
/// also replace the exit code that tells what happened. The binary's `main` writes its
/// error lines through it too.
pub fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

mod args;
mod channels;
mod console;
mod destinations;
mod endpoint;
mod enqueue;
mod ops;
mod run;

pub use args::{
    CancelArgs, Cli, Command, ConsoleArgs, DeadArgs, DeadFilterArgs, DestinationsArgs,
    EndpointArgs, EndpointCommand, EndpointListArgs, EndpointRemoveArgs, EndpointSetArgs,
    EnqueueArgs, HeldArgs, MigrateArgs, PurgeArgs, ReplayArgs, RunArgs, ShowArgs, StatusArgs,
    TargetsArgs,
};
pub use channels::ChannelsArgs;
pub use run::worker_settings;

use crate::model::ConfigError;
use crate::support::Secret;

/// The environment the CLI reads (besides flags), read once in `main`. Every value that
/// may hold a password or a token is a [`Secret`], so its `Debug` (derived) shows none of
/// them: the database and SMTP URLs, the signing secrets (the named ones show their
/// variables' names) and the console's token.
#[derive(Clone, Debug, Default)]
pub struct Env {
    /// `DATABASE_URL`.
    pub database_url: Option<Secret>,
    /// `OUTBOXD_SMTP_URL`.
    pub smtp_url: Option<Secret>,
    /// `OUTBOXD_WEBHOOK_SECRET`.
    pub webhook_secret: Option<Secret>,
    /// Every non-empty `OUTBOXD_WEBHOOK_SECRET_<NAME>`, as (variable, value); a name that is
    /// not UTF-8 is kept lossily, so that it fails validation naming the variable.
    pub named_webhook_secrets: Vec<(String, Secret)>,
    /// `OUTBOXD_ALLOW_PRIVATE_NETWORKS`.
    pub allow_private_networks: Option<String>,
    /// `OUTBOXD_WEBHOOK_ALLOW_HOSTS`.
    pub webhook_allow_hosts: Option<String>,
    /// `OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN`.
    pub email_message_id_domain: Option<String>,
    /// `OUTBOXD_CONSOLE_TOKEN`: the console's sign-in token.
    pub console_token: Option<Secret>,
    /// Every `OUTBOXD_SECRET_<NAME>` and `OUTBOXD_SECRET_<NAME>_FILE`, as (variable,
    /// value), empty ones included (refused where they are read).
    pub endpoint_secrets: Vec<(String, Secret)>,
}

/// The `OUTBOXD_WEBHOOK_SECRET_<NAME>` variables among `vars` that are not empty, sorted by
/// name. A name that is not UTF-8 is kept lossily, so that it fails validation naming the
/// variable; a value that is not UTF-8 is refused here, naming it.
fn named_secrets(
    vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<(String, Secret)>, ConfigError> {
    prefixed(
        vars,
        &format!("{}_", crate::deliver::webhook::settings::SECRET_VAR),
    )
}

/// The variables among `vars` whose names start with `prefix`, sorted by name, as
/// [`named_secrets`] reads them.
fn prefixed(
    vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
    prefix: &str,
) -> Result<Vec<(String, Secret)>, ConfigError> {
    use std::os::unix::ffi::OsStrExt as _;
    let mut found: Vec<(String, Secret)> = Vec::new();
    for (k, v) in vars {
        // Bytes, not text: a name that is not UTF-8 is still one of ours by its prefix.
        // An empty value is kept: set but empty is refused where the keys are read, never
        // taken as unset (which would send unsigned).
        if !k.as_bytes().starts_with(prefix.as_bytes()) {
            continue;
        }
        let value = v
            .into_string()
            .map_err(|_| crate::support::NotUtf8::of(&k))?;
        found.push((k.to_string_lossy().into_owned(), Secret::from(value)));
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

impl Env {
    /// Reads the variables. A set variable whose value is not UTF-8 is an error naming it
    /// (exit 2), whichever command runs: taken as unset, a secret or token the operator did
    /// set would silently be missing.
    pub fn from_process() -> Result<Self, ConfigError> {
        let var = |k: &str| -> Result<Option<String>, ConfigError> {
            Ok(crate::support::env_var(k)?.filter(|v| !v.is_empty()))
        };
        let secret =
            |k: &str| -> Result<Option<Secret>, ConfigError> { Ok(var(k)?.map(Secret::from)) };
        // A protection's secret is read as set even when empty: set but empty is refused
        // where it is checked (exit 2), where taking it as unset would switch the
        // protection off (unsigned webhooks, an open console).
        let protection = |k: &str| -> Result<Option<Secret>, ConfigError> {
            Ok(crate::support::env_var(k)?.map(Secret::from))
        };
        Ok(Env {
            database_url: secret("DATABASE_URL")?,
            smtp_url: secret("OUTBOXD_SMTP_URL")?,
            webhook_secret: protection("OUTBOXD_WEBHOOK_SECRET")?,
            named_webhook_secrets: named_secrets(std::env::vars_os())?,
            allow_private_networks: var("OUTBOXD_ALLOW_PRIVATE_NETWORKS")?,
            webhook_allow_hosts: var("OUTBOXD_WEBHOOK_ALLOW_HOSTS")?,
            email_message_id_domain: var("OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN")?,
            console_token: protection("OUTBOXD_CONSOLE_TOKEN")?,
            endpoint_secrets: prefixed(
                std::env::vars_os(),
                crate::deliver::http::settings::SECRET_PREFIX,
            )?,
        })
    }

    fn database(&self) -> Result<crate::db::Database, ConfigError> {
        let url = self
            .database_url
            .as_ref()
            .map(Secret::expose)
            .ok_or_else(|| {
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
    /// The one line printed after `error: `. A refusal is printed whole: it names every
    /// row refused (the contract), where cut to 500 characters, as other errors are
    /// ([`crate::deliver::one_line`]), ten 100-character keys named three. It is escaped
    /// all the same ([`crate::text::escape`]: a key's control characters, a newline
    /// included, are visible escapes), so it stays one line of inert text.
    pub fn line(&self) -> String {
        match self {
            CliError::Refused(m) => crate::text::escape(m.trim_end()).into_owned(),
            other => crate::deliver::one_line(&format!("{other:#}")),
        }
    }

    /// The process exit code.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Refused(_) | CliError::Runtime(_) => 1,
        }
    }
}

pub(super) fn runtime(context: &str, e: impl std::fmt::Display) -> CliError {
    CliError::Runtime(anyhow::anyhow!("{context}: {e}"))
}

/// [`runtime`] for a database error, with its SQLSTATE and message.
pub(super) fn db_failed(context: &str, e: &tokio_postgres::Error) -> CliError {
    runtime(context, crate::db::describe(e))
}

/// Runs a parsed command.
pub async fn dispatch(cli: Cli, env: Env) -> Result<(), CliError> {
    match cli.command {
        Command::Migrate(args) => ops::migrate(args, &env).await,
        Command::Run(args) => run::run(args, &env).await,
        Command::Enqueue(args) => enqueue::enqueue(args, &env).await,
        Command::Status(args) => ops::status(args, &env).await,
        Command::Dead(args) => ops::dead(args, &env).await,
        Command::Show(args) => ops::show(args, &env).await,
        Command::Replay(args) => ops::replay(args, &env).await,
        Command::Held(args) => ops::held(args, &env).await,
        Command::Approve(args) => {
            ops::checkpoint(crate::ops::Checkpoint::Approve, &args.targets, &env).await
        }
        Command::Cancel(args) => {
            let action = crate::ops::Checkpoint::Cancel {
                reason: args.reason,
            };
            ops::checkpoint(action, &args.targets, &env).await
        }
        Command::Confirm(args) => {
            ops::checkpoint(crate::ops::Checkpoint::Confirm, &args.targets, &env).await
        }
        Command::Purge(args) => ops::purge(args, &env).await,
        Command::Console(args) => console::console(args, &env).await,
        Command::Destinations(args) => destinations::destinations(args, &env).await,
        Command::Endpoint(args) => endpoint::endpoint(args, &env).await,
        Command::Channels(args) => channels::channels(args, &env).await,
    }
}

/// A connection for a command that works on messages: every command but `migrate` comes
/// through here (`run` and `console` through [`check_schema_at_start`]), after its
/// arguments are checked. A database without the outbox schema is refused here, once for
/// all of them, as bad configuration (exit 2) with the remedy: each command's first
/// statement would otherwise fail with 42P01 or 3F000, and the daemon would log that
/// forever.
pub(super) async fn connect(env: &Env) -> Result<tokio_postgres::Client, CliError> {
    let client = connect_unchecked(env).await?;
    match crate::db::has_schema(&client).await {
        Ok(true) => Ok(client),
        Ok(false) => Err(ConfigError(NO_SCHEMA.into()).into()),
        Err(e) => Err(db_failed("cannot read the database's schema", &e)),
    }
}

/// What a command says of a database that was never migrated.
const NO_SCHEMA: &str =
    "the database has no outbox schema (it was never migrated): run `outboxd migrate` first";

/// A connection to the database as it is, for `migrate`, which makes the schema.
pub(super) async fn connect_unchecked(env: &Env) -> Result<tokio_postgres::Client, CliError> {
    let cfg = env.database()?;
    crate::db::connect(&cfg)
        .await
        .map_err(|e| db_failed("cannot connect to the database", &e))
}

/// [`connect`]'s check for the long-running commands, made once before they start: a
/// database without the schema stops the start (exit 2). A database that does not answer
/// within the time a pool gives a new connection stops the console (exit 1, as its own
/// check did), but not the daemon when `wait_for_database`: the daemon reconnects until it
/// answers, so a start during an outage waits for the database.
pub(super) async fn check_schema_at_start(
    env: &Env,
    wait_for_database: bool,
) -> Result<(), CliError> {
    const WITHIN: std::time::Duration = std::time::Duration::from_secs(10);
    let unchecked = match tokio::time::timeout(WITHIN, connect(env)).await {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e @ CliError::Usage(_))) => return Err(e),
        Ok(Err(e)) => e,
        Err(_) => runtime("cannot connect to the database", "no answer within 10s"),
    };
    if !wait_for_database {
        return Err(unchecked);
    }
    tracing::warn!(error = %unchecked.line(), "cannot check the database's schema at start-up");
    Ok(())
}

/// Stored text (a key, an error, a payload) as text output prints it: control characters,
/// bidi overrides and the like as visible escapes ([`crate::text::escape`]).
pub(super) fn esc(s: &str) -> String {
    crate::text::escape(s).into_owned()
}

/// Prints a table: a header row, then rows, columns padded to their widest cell.
pub(super) fn print_table(header: &[&str], rows: &[Vec<String>]) {
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

pub(super) fn json_out<T: serde::Serialize>(value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| runtime("cannot encode JSON", e))?;
    out!("{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_printed_whole_on_one_line_and_other_errors_are_cut() {
        let long = format!("not dead: {}\nerror: forged", "k".repeat(2000));
        let line = CliError::Refused(long.clone()).line();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.ends_with("\\nerror: forged"), "{line}");
        let line = CliError::Runtime(anyhow::anyhow!(long)).line();
        assert!(
            !line.contains('\n') && line.chars().count() <= 500,
            "{line}"
        );
    }

    /// A caller that parses without noting where values came from (only `main` notes it)
    /// gets the careful reading: every selection flag given counts as typed, so `replay ID`
    /// beside `--all-dead` or a filter is still refused, never silently narrowed.
    #[tokio::test]
    async fn replay_without_noted_sources_refuses_flags_beside_named_messages() {
        use clap::Parser as _;
        for args in [
            &["outboxd", "replay", "5", "--all-dead"][..],
            &["outboxd", "replay", "5", "--channel", "email"],
        ] {
            let cli = Cli::try_parse_from(args).expect("parses");
            let err = dispatch(cli, Env::default()).await.expect_err("refused");
            assert!(
                matches!(&err, CliError::Usage(e) if e.0.contains("--all-dead")),
                "{args:?}: {err}"
            );
        }
    }
}
