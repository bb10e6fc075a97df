//! `outboxd channels`: list the channels, paused or not; `--pause` and `--resume` a whole
//! channel (a provider's incident: the SMTP relay is down).

use clap::Args;
use tokio_postgres::Client;

use super::ops::operator;
use super::{CliError, Env, connect, db_failed, esc, json_out, print_table};
use crate::model::ConfigError;
use crate::ops::ChannelPauseError;

/// `outboxd channels`.
#[derive(Debug, Args)]
pub struct ChannelsArgs {
    /// Print JSON: an array of objects with channel, paused, paused_at, paused_by and
    /// pause_reason.
    #[arg(long, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, require_equals = true, default_value = "false", default_missing_value = "true", conflicts_with_all = ["pause", "resume"])]
    pub json: bool,
    /// Pause this channel (webhook, http or email): workers claim none of its messages
    /// until --resume; attempts under way finish.
    #[arg(long, value_name = "CHANNEL", conflicts_with = "resume")]
    pub pause: Option<String>,
    /// Why, with --pause: one line, at most 500 characters, kept with the pause.
    #[arg(long, value_name = "TEXT", requires = "pause")]
    pub reason: Option<String>,
    /// Resume a paused channel: its messages are claimed again at once.
    #[arg(long, value_name = "CHANNEL")]
    pub resume: Option<String>,
}

pub(super) async fn channels(args: ChannelsArgs, env: &Env) -> Result<(), CliError> {
    let client = connect(env).await?;
    if let Some(channel) = &args.pause {
        return pause(&client, channel, args.reason.as_deref()).await;
    }
    if let Some(channel) = &args.resume {
        return resume(&client, channel).await;
    }
    list(&client, args.json).await
}

/// A refusal from `outbox.pause_channel` or `outbox.resume_channel`: an unknown channel is
/// a refusal naming it (exit 1), a bad reason bad usage (exit 2).
fn refused(channel: &str, e: ChannelPauseError) -> CliError {
    match e {
        ChannelPauseError::Unknown(m) => {
            // Named, but cut: the name is whatever was typed.
            let shown: String = channel.chars().take(40).collect();
            let more = if shown.len() < channel.len() {
                "…"
            } else {
                ""
            };
            // (A refusal's line is escaped when printed, control characters included.)
            CliError::Refused(format!("unknown channel '{shown}'{more}: {m}"))
        }
        ChannelPauseError::Invalid(m) => CliError::Usage(ConfigError(esc(&m))),
        ChannelPauseError::Database(e) => db_failed("changing the channel failed", &e),
    }
}

async fn pause(client: &Client, channel: &str, reason: Option<&str>) -> Result<(), CliError> {
    let actor = operator()?;
    let c = crate::ops::pause_channel(client, channel, reason, &actor)
        .await
        .map_err(|e| refused(channel, e))?;
    let name = esc(&c.channel);
    if c.changed {
        out!(
            "paused {name}: none of its messages is sent until `outboxd channels --resume {name}` (workers see it within a poll interval; attempts under way finish)"
        );
    } else {
        out!("{name} was already paused; left as it was (outboxd channels says by whom and why)");
    }
    Ok(())
}

async fn resume(client: &Client, channel: &str) -> Result<(), CliError> {
    let actor = operator()?;
    let c = crate::ops::resume_channel(client, channel, &actor)
        .await
        .map_err(|e| refused(channel, e))?;
    let name = esc(&c.channel);
    if c.changed {
        out!("resumed {name}: its messages are sent again");
    } else {
        out!("{name} was not paused; nothing to resume");
    }
    Ok(())
}

async fn list(client: &Client, json: bool) -> Result<(), CliError> {
    let rows = crate::ops::channels(client)
        .await
        .map_err(|e| db_failed("listing channels failed", &e))?;
    if json {
        return json_out(&rows);
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|c| {
            vec![
                esc(&c.channel),
                if c.paused { "paused" } else { "running" }.to_owned(),
                esc(c.paused_by.as_deref().unwrap_or("-")),
                c.paused_at.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    print_table(&["channel", "state", "paused_by", "since"], &table);
    // Why, one line each, escaped (the reason is free text).
    for c in rows.iter().filter(|c| c.paused) {
        if let Some(r) = &c.pause_reason {
            out!("{} paused: {}", esc(&c.channel), esc(r));
        }
    }
    Ok(())
}
