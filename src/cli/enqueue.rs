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
        Some(path) => std::fs::read_to_string(PathBuf::from(path))
            .map_err(|e| ConfigError(format!("--payload: cannot read {path}: {e}")))?,
        None => args.payload.clone(),
    };
    // Checked to be JSON here, and then sent as written (`enqueue_json_text` says why): a
    // `RawValue` is the text, validated, not a parsed value.
    let payload: Box<RawValue> = serde_json::from_str(&text)
        .map_err(|e| ConfigError(format!("--payload is not valid JSON: {e}")))?;
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
