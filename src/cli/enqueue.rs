//! `outboxd enqueue`: one message, from the command line.

use std::path::PathBuf;

use serde_json::value::RawValue;

use super::{CliError, EnqueueArgs, Env, connect, db_failed};
use crate::enqueue::{EnqueueError, NewMessage};
use crate::model::{Channel, ConfigError};

pub(super) async fn enqueue(args: EnqueueArgs, env: &Env) -> Result<(), CliError> {
    let channel = Channel::parse(&args.channel).ok_or_else(|| {
        ConfigError(format!(
            "--channel must be webhook, http or email (got {:?})",
            args.channel
        ))
    })?;
    let text = match args.payload.strip_prefix('@') {
        Some(path) => read_payload_file(path)?,
        None => args.payload.clone(),
    };
    // Checked to be JSON here, and then sent as written (`enqueue_json_text` says why): a
    // `RawValue` is the text, validated, not a parsed value. Its check skips over the
    // values without recursion, so it sets no depth limit of its own: how deep a payload
    // may be is PostgreSQL's answer, the same as for `SELECT outbox.enqueue(...)`.
    let payload: Box<RawValue> = serde_json::from_str(&text)
        .map_err(|e| ConfigError(format!("--payload is not valid JSON: {e}")))?;
    refuse_numbers_out_of_range(payload.get())?;
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

/// Refuses what the raw check lets through: a number beyond a double's range (`1e400`),
/// which PostgreSQL's numeric takes and renders digit by digit, up to gigabytes of text.
/// `json` is valid JSON (the raw check passed), so a number is any token outside a string
/// that starts with `-` or a digit. One pass over the text, without recursion: a parse into
/// a `serde_json::Value` would refuse payloads nested deeper than 128 levels, which
/// PostgreSQL takes.
fn refuse_numbers_out_of_range(json: &str) -> Result<(), ConfigError> {
    let bytes = json.as_bytes();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'"' => {
                // Skip the string: up to the next quote not escaped by a backslash.
                i += 1;
                while let Some(&c) = bytes.get(i) {
                    match c {
                        b'\\' => i += 2,
                        b'"' => break,
                        _ => i += 1,
                    }
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while bytes
                    .get(i)
                    .is_some_and(|c| matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                {
                    i += 1;
                }
                let token = json.get(start..i).unwrap_or_default();
                if token.parse::<f64>().is_ok_and(|n| n.is_infinite()) {
                    let before = json.get(..start).unwrap_or_default();
                    let line = before.matches('\n').count() + 1;
                    let column = before.rfind('\n').map_or(start, |nl| start - nl - 1) + 1;
                    return Err(ConfigError(format!(
                        "--payload is not valid JSON: number out of range at line {line} \
                         column {column} (beyond a double's range)"
                    )));
                }
            }
            _ => i += 1,
        }
    }
    Ok(())
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::refuse_numbers_out_of_range as check;

    #[test]
    fn numbers_beyond_a_double_are_refused_wherever_they_stand() {
        for bad in [
            "1e400",
            "-1e400",
            r#"{"n": 1E+400}"#,
            &format!("[{}]", "9".repeat(400)),
            &format!("{}1e400{}", "[".repeat(10_000), "]".repeat(10_000)),
        ] {
            let err = check(bad).unwrap_err().0;
            assert!(err.contains("number out of range"), "{err}");
        }
        let err = check("{\n  \"a\": 1,\n  \"n\": 1e400}").unwrap_err().0;
        assert!(err.contains("line 3 column 8"), "{err}");
    }

    #[test]
    fn strings_small_numbers_and_deep_nesting_pass() {
        for good in [
            r#"{"s": "1e400", "t": "a \" 1e400 \\", "u": "\\"}"#,
            "1e-400",
            "-0.5e10",
            "12345678901234567890123",
            "[true, false, null, 1.10]",
            &format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
        ] {
            assert!(check(good).is_ok(), "{good}");
        }
    }
}
