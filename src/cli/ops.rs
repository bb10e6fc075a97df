//! The operator commands: `migrate`, `status`, `dead`, `held`, `show`, `replay`, `approve`,
//! `cancel`, `confirm`, `purge` (`destinations` has a room of its own).

use super::{
    CliError, DeadArgs, Env, HeldArgs, MigrateArgs, PurgeArgs, ReplayArgs, ShowArgs, StatusArgs,
    connect, db_failed, esc, json_out, print_table, runtime,
};
use crate::model::ConfigError;
use crate::ops::{
    AttemptRecord, Checkpoint, CheckpointError, HeldFilter, MessageDetail, ReplayError,
    ReplaySelection, Target,
};

/// Who an operator action is recorded as (`attempts.worker`): `cli:<login>`, or
/// `cli:operator` when `USER` is not set. A `USER` that is not UTF-8 is refused rather than
/// recorded as `operator`: the history would name nobody for an action somebody took.
pub(super) fn operator() -> Result<String, CliError> {
    let user = crate::support::env_var("USER").map_err(ConfigError::from)?;
    Ok(format!("cli:{}", user.unwrap_or_else(|| "operator".into())))
}

pub(super) async fn migrate(args: MigrateArgs, env: &Env) -> Result<(), CliError> {
    let mut client = super::connect_unchecked(env).await?;
    let report = crate::migrate::migrate_with(&mut client, args.adopt_baseline)
        .await
        .map_err(|e| match e {
            // Not a failure of the database: a history to sort out first (exit 2).
            crate::migrate::MigrateError::UnknownHistory(m) => CliError::Usage(ConfigError(m)),
            e => CliError::Runtime(e.into()),
        })?;
    if report.adopted {
        out!("recorded the pre-release history as the baseline (nothing else changed)");
    }
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

pub(super) async fn status(args: StatusArgs, env: &Env) -> Result<(), CliError> {
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
    // One line per channel with due messages: a channel no worker serves shows here as
    // messages that stay due, growing older.
    for (channel, due) in st.due_by_channel.iter().filter(|(_, d)| d.due > 0) {
        out!(
            "{}: {} due, oldest {}",
            esc(channel),
            due.due,
            age(due.oldest_due_seconds)
        );
    }
    out!(
        "blocked ordering groups: {} (a message waits behind an earlier unfinished one)",
        st.blocked_groups
    );
    out!(
        "open destinations: {} (outboxd destinations lists them)",
        st.open_destinations
    );
    out!(
        "paused destinations: {} (nothing is sent to them until resumed)",
        st.paused_destinations
    );
    if st.paused_channels.is_empty() {
        out!("paused channels: none");
    } else {
        out!(
            "paused channels: {} (none of their messages is sent until resumed; outboxd channels says by whom and why)",
            esc(&st.paused_channels.join(", "))
        );
    }
    Ok(())
}

/// An age for people: whole seconds up to two minutes, then minutes, hours, days.
fn age(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

pub(super) async fn dead(args: DeadArgs, env: &Env) -> Result<(), CliError> {
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

pub(super) async fn show(args: ShowArgs, env: &Env) -> Result<(), CliError> {
    let target = Target::parse(&args.target);
    let client = connect(env).await?;
    let detail = crate::ops::show(&client, &target)
        .await
        .map_err(|e| db_failed("show failed", &e))?
        .ok_or_else(|| CliError::Refused(format!("no such message: {target}")))?;
    if args.json {
        return json_out(&detail);
    }
    print_message(&detail);
    print_history(&detail.history);
    Ok(())
}

/// An absent value as `-`, a present one escaped.
fn opt(o: &Option<String>) -> String {
    o.as_deref().map_or_else(|| "-".into(), esc)
}

/// `show`'s text output, first part: the message's own fields, then a blank line.
fn print_message(detail: &MessageDetail) {
    out!("message {} ({})", detail.id, esc(&detail.message_key));
    if detail.paused_channel {
        out!(
            "  channel      {} (paused: not sent until `outboxd channels --resume {}`)",
            esc(&detail.channel),
            esc(&detail.channel)
        );
    } else {
        out!("  channel      {}", esc(&detail.channel));
    }
    out!("  state        {}", esc(&detail.state));
    out!(
        "  attempts     {}/{} (retry ambiguous: {})",
        detail.attempts,
        detail.max_attempts,
        detail.retry_ambiguous
    );
    if let Some(k) = &detail.ordering_key {
        out!("  ordering_key {}", esc(k));
    }
    match &detail.paused_destination {
        Some(host) => out!(
            "  run_after    held back: destination {} is paused (outboxd destinations --resume {})",
            esc(host),
            esc(host)
        ),
        None => out!("  run_after    {}", detail.run_after),
    }
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
    if let Some(t) = &detail.cancelled_at {
        out!("  cancelled_at {t}");
    }
    if let Some(t) = &detail.key_expires_at {
        out!("  key window   the provider remembers its key until {t}");
    }
    if detail.error_class.is_some() {
        out!(
            "  error        {}: {}",
            opt(&detail.error_class),
            opt(&detail.last_error)
        );
    }
    print_next_steps(detail);
    // serde_json escapes C0 controls in strings, not DEL, C1 or bidi overrides.
    if let Some(r) = &detail.response {
        out!("  response     {}", esc(&r.to_string()));
    }
    out!("  payload      {}", esc(&detail.payload.to_string()));
    out!();
}

/// A dead letter's way out, in one or two lines under its error: for one that may have
/// taken effect, the person who checked with the provider confirms it or replays it.
fn print_next_steps(detail: &MessageDetail) {
    let steps = &detail.next_steps;
    if steps.is_empty() {
        return;
    }
    let id = detail.id;
    if steps.iter().any(|s| s.action == "confirm") {
        out!(
            "  next steps   it may have taken effect: ask the provider, then `outboxd confirm {id}` if it did,"
        );
        let replay = steps
            .iter()
            .find(|s| s.action == "replay")
            .map_or_else(|| format!("outboxd replay {id}"), |s| s.command.clone());
        out!("               `{replay}` if it did not (same key), or `outboxd cancel {id}`");
    } else {
        out!(
            "  next steps   `outboxd replay {id}` once the cause is fixed (same key), or `outboxd cancel {id}`"
        );
    }
}

/// `show`'s text output, second part: the attempt history as a table.
fn print_history(history: &[AttemptRecord]) {
    if history.is_empty() {
        out!("no attempts yet");
        return;
    }
    let rows: Vec<Vec<String>> = history
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
}

pub(super) async fn replay(args: ReplayArgs, env: &Env) -> Result<(), CliError> {
    let selection = if args.targets.is_empty() {
        if !args.all_dead {
            return Err(ConfigError(
                "name the messages to replay (ID|KEY …) or give --all-dead".into(),
            )
            .into());
        }
        ReplaySelection::AllDead(args.filter.filter())
    } else {
        if args.all_dead {
            return Err(ConfigError(
                "name the messages to replay (ID|KEY …) or give --all-dead, not both".into(),
            )
            .into());
        }
        if args.filtered() {
            return Err(ConfigError(
                "--channel, --error-class and --since go with --all-dead".into(),
            )
            .into());
        }
        ReplaySelection::Named(args.targets.iter().map(|t| Target::parse(t)).collect())
    };
    let actor = operator()?;
    let mut client = connect(env).await?;
    let replayed =
        crate::ops::replay_forced(&mut client, &selection, &actor, args.dry_run, args.force)
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

pub(super) async fn held(args: HeldArgs, env: &Env) -> Result<(), CliError> {
    if args.limit < 1 {
        return Err(ConfigError("--limit must be at least 1".into()).into());
    }
    let client = connect(env).await?;
    let filter = HeldFilter {
        channel: args.channel,
        since: args.since,
    };
    let rows = crate::ops::held(&client, &filter, args.limit)
        .await
        .map_err(|e| db_failed("listing held messages failed", &e))?;
    if args.json {
        return json_out(&rows);
    }
    if rows.is_empty() {
        out!("no held messages");
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|h| {
            vec![
                h.id.to_string(),
                esc(&h.message_key),
                esc(&h.channel),
                h.created_at.clone(),
            ]
        })
        .collect();
    print_table(&["id", "key", "channel", "created_at"], &table);
    Ok(())
}

/// `approve`, `cancel` and `confirm`: like `replay`, all or nothing; a refused row is
/// named and nothing changes (exit 1); a bad reason is bad usage (exit 2).
pub(super) async fn checkpoint(
    action: Checkpoint,
    targets: &[String],
    env: &Env,
) -> Result<(), CliError> {
    let targets: Vec<Target> = targets.iter().map(|t| Target::parse(t)).collect();
    let actor = operator()?;
    let mut client = connect(env).await?;
    let changed = crate::ops::checkpoint(&mut client, &action, &targets, &actor)
        .await
        .map_err(|e| match e {
            CheckpointError::Database(e) => db_failed(&format!("{} failed", verb(&action)), &e),
            CheckpointError::Invalid(m) => CliError::Usage(ConfigError(esc(&m))),
            e @ CheckpointError::Empty(_) => CliError::Usage(ConfigError(e.to_string())),
            // The database's message quotes keys, which rows changed by hand may
            // hold with control characters.
            refused => CliError::Refused(esc(&refused.to_string())),
        })?;
    for (id, key) in &changed {
        out!("{} {id} {}", action.done(), esc(key));
    }
    out!("{} {} message(s)", action.done(), changed.len());
    Ok(())
}

fn verb(action: &Checkpoint) -> &'static str {
    match action {
        Checkpoint::Approve => "approve",
        Checkpoint::Cancel { .. } => "cancel",
        Checkpoint::Confirm => "confirm",
    }
}

pub(super) async fn purge(args: PurgeArgs, env: &Env) -> Result<(), CliError> {
    crate::config::assemble::check_purge_age(args.older_than)?;
    let client = connect(env).await?;
    let total = crate::ops::purge(&client, args.older_than, args.include_dead, 1000, |n| {
        super::say(format_args!("purged {n} message(s) so far"));
    })
    .await
    .map_err(|e| db_failed("purge failed", &e))?;
    out!("purged {total} message(s)");
    Ok(())
}
