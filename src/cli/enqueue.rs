//! `outboxd enqueue`: one message, from the command line.

use std::path::PathBuf;

use serde_json::value::RawValue;

use super::{CliError, EnqueueArgs, Env, connect, db_failed};
use crate::enqueue::{EnqueueError, NewMessage};
use crate::model::{Channel, ConfigError};

pub(super) async fn enqueue(args: EnqueueArgs, env: &Env) -> Result<(), CliError> {
    let channel = Channel::parse(&args.channel).ok_or_else(|| {
        ConfigError(format!(
            "--channel must be webhook or email (got {:?})",
            args.channel
        ))
    })?;
    let text = match args.payload.strip_prefix('@') {
        Some(path) => read_payload_file(path)?,
        None => args.payload.clone(),
    };
    // Checked to be JSON here, and then sent as written (`enqueue_json_text` says why): a
    // `RawValue` is the text, validated, not a parsed value. Parsed whole once too, for
    // what the raw check lets through: a number beyond a double's range (`1e400`), which
    // PostgreSQL's numeric takes and renders digit by digit, up to gigabytes of text.
    let bad = |e: serde_json::Error| ConfigError(format!("--payload is not valid JSON: {e}"));
    serde_json::from_str::<serde_json::Value>(&text).map_err(bad)?;
    let payload: Box<RawValue> = serde_json::from_str(&text).map_err(bad)?;
    // The message's own payload is not sent (the text above is): a placeholder.
    let mut msg = NewMessage::new(args.key.clone(), channel, serde_json::Value::Null)
        .max_attempts(args.max_attempts)
        .retry_ambiguous(!args.no_retry_ambiguous)
        .held(args.held);
    if let Some(at) = args.run_after {
        msg = msg.run_after(at);
    }
    if let Some(k) = &args.ordering_key {
        msg = msg.ordering_key(k.clone());
    }
    let client = connect(env).await?;
    match crate::enqueue::enqueue_json_text(&client, &msg, &payload).await {
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

/// The most `--payload @FILE` reads. Not the payload limit itself, which the database
/// applies to the payload as stored (`outbox.validate`: 1 MiB of jsonb's own text, without
/// the file's indentation, so a pretty-printed file well over 1 MiB can be within it): a
/// bound on memory.
const MAX_PAYLOAD_FILE: u64 = 16 * 1024 * 1024;

/// The text of `--payload @FILE`. At most [`MAX_PAYLOAD_FILE`] bytes and one more are read,
/// so a larger file is refused without being read whole: `@/dev/zero` would otherwise
/// grow the buffer until memory ran out, before any size check.
fn read_payload_file(path: &str) -> Result<String, ConfigError> {
    use std::io::Read as _;
    let cannot = |e: std::io::Error| ConfigError(format!("--payload: cannot read {path}: {e}"));
    let file = std::fs::File::open(PathBuf::from(path)).map_err(cannot)?;
    let mut bytes = Vec::new();
    file.take(MAX_PAYLOAD_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > MAX_PAYLOAD_FILE {
        return Err(ConfigError(format!(
            "--payload: {path} is larger than 16 MiB (a payload is at most 1 MiB as stored)"
        )));
    }
    String::from_utf8(bytes)
        .map_err(|_| ConfigError(format!("--payload: {path} is not UTF-8 text")))
}
