//! `outboxd destinations`: list the destinations that are paused, open or failing; `--close`
//! a circuit, `--pause` and `--resume` a destination.

use tokio_postgres::Client;

use super::ops::operator;
use super::{CliError, DestinationsArgs, Env, connect, db_failed, esc, json_out, print_table};
use crate::model::ConfigError;
use crate::ops::PauseError;

pub(super) async fn destinations(args: DestinationsArgs, env: &Env) -> Result<(), CliError> {
    // An action changes one destination and prints a line, `--json` lists: one or the other.
    let acting = args.close.is_some() || args.pause.is_some() || args.resume.is_some();
    if acting && args.json {
        return Err(ConfigError(
            "--close, --pause and --resume do not go with --json (each changes a destination and prints a line)"
                .into(),
        )
        .into());
    }
    let client = connect(env).await?;
    if let Some(host) = &args.close {
        return close(&client, host).await;
    }
    if let Some(host) = &args.pause {
        return pause(&client, host, args.reason.as_deref()).await;
    }
    if let Some(host) = &args.resume {
        return resume(&client, host).await;
    }
    list(&client, args.json).await
}

/// The destinations `host` names: itself, and for a host named without its port (the
/// contract's `HOST`) every destination of that host on another port the breakers know:
/// they are kept per host and port, and the row of the bare host, from a default port, may
/// well not be the one meant.
async fn named(client: &Client, host: &str, doing: &str) -> Result<Vec<String>, CliError> {
    let ports = crate::ops::destinations_of_host(client, host)
        .await
        .map_err(|e| db_failed(&format!("{doing} the destination failed"), &e))?;
    Ok(std::iter::once(host.to_owned()).chain(ports).collect())
}

async fn close(client: &Client, host: &str) -> Result<(), CliError> {
    let actor = operator()?;
    let mut known = false;
    for name in named(client, host, "closing").await? {
        // A port's row gone meanwhile (closed by another operator and forgotten):
        // nothing to do.
        let closed = crate::ops::close_destination(client, &name, &actor)
            .await
            .map_err(|e| db_failed("closing the destination failed", &e))?;
        if let Some(n) = closed {
            known = true;
            out!("closed {}: {n} held-back messages due again", esc(&name));
        }
    }
    if !known {
        return Err(unknown(host));
    }
    Ok(())
}

fn unknown(host: &str) -> CliError {
    CliError::Refused(format!(
        "no destination {} is known (outboxd destinations lists them)",
        esc(host)
    ))
}

/// A refusal from `outbox.pause_destination` or `outbox.resume_destination`.
fn refused(e: PauseError) -> CliError {
    match e {
        PauseError::Invalid(m) => CliError::Usage(ConfigError(esc(&m))),
        PauseError::Unknown(m) => CliError::Refused(esc(&m)),
        PauseError::Database(e) => db_failed("changing the destination failed", &e),
    }
}

async fn pause(client: &Client, host: &str, reason: Option<&str>) -> Result<(), CliError> {
    let actor = operator()?;
    // A destination never seen may be paused (before its first message): the name as
    // given always is, and its known ports with it.
    for name in named(client, host, "pausing").await? {
        let c = crate::ops::pause_destination(client, &name, reason, &actor)
            .await
            .map_err(refused)?;
        let d = esc(&c.destination);
        if c.changed {
            out!(
                "paused {d}: {} due messages held back; nothing is sent to it until `outboxd destinations --resume {d}`",
                c.messages
            );
        } else {
            out!(
                "{d} was already paused; left as it was (outboxd destinations says by whom and why)"
            );
        }
    }
    Ok(())
}

async fn resume(client: &Client, host: &str) -> Result<(), CliError> {
    let actor = operator()?;
    let mut known = false;
    for name in named(client, host, "resuming").await? {
        match crate::ops::resume_destination(client, &name, &actor).await {
            Ok(c) => {
                known = true;
                let d = esc(&c.destination);
                if c.changed {
                    out!("resumed {d}: {} held-back messages due now", c.messages);
                } else {
                    out!("{d} was not paused; nothing to resume");
                }
            }
            // The bare name may be unknown while its ports are not: said once, below.
            Err(PauseError::Unknown(_)) => {}
            Err(e) => return Err(refused(e)),
        }
    }
    if !known {
        return Err(unknown(host));
    }
    Ok(())
}

async fn list(client: &Client, json: bool) -> Result<(), CliError> {
    let rows = crate::ops::destinations(client)
        .await
        .map_err(|e| db_failed("listing destinations failed", &e))?;
    if json {
        return json_out(&rows);
    }
    if rows.is_empty() {
        out!("no destination is paused, open or failing");
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|d| {
            vec![
                esc(&d.host),
                d.state.clone(),
                d.circuit.clone(),
                d.consecutive_failures.to_string(),
                d.open_until.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    print_table(
        &["destination", "state", "circuit", "failures", "open_until"],
        &table,
    );
    // Who paused what, when and why: one line each, escaped (the reason is free text).
    for d in rows.iter().filter(|d| d.paused_at.is_some()) {
        out!(
            "{} paused by {} since {}{}",
            esc(&d.host),
            esc(d.paused_by.as_deref().unwrap_or("?")),
            d.paused_at.as_deref().unwrap_or("?"),
            d.pause_reason
                .as_deref()
                .map(|r| format!(": {}", esc(r)))
                .unwrap_or_default()
        );
    }
    Ok(())
}
