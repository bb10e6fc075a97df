//! Channels paused by a person: the operators' pause and resume, the list, and every
//! worker's reading of it.

/// `channels --pause CHANNEL`: `$1` channel, `$2` reason (NULL for none), `$3` the
/// operator. Returns `name, paused` (`paused` false when it already was); raises 22023
/// naming `channel` or `reason` (see `outbox.pause_channel`).
pub const PAUSE_CHANNEL: &str =
    "SELECT name, paused FROM outbox.pause_channel($1::text, $2::text, $3::text)";

/// `channels --resume CHANNEL`: `$1` channel, `$2` the operator. Returns `name, resumed`
/// (`resumed` false when it was not paused); raises 22023 naming `channel` for an unknown
/// one (see `outbox.resume_channel`).
pub const RESUME_CHANNEL: &str =
    "SELECT name, resumed FROM outbox.resume_channel($1::text, $2::text)";

/// The paused channels (at most three rows): `channel, paused_at, paused_by,
/// pause_reason`, by name. Every worker reads it at most once per poll interval, with the
/// paused destinations; `channels`, `status` and the console list it.
pub const PAUSED_CHANNELS: &str = "SELECT channel, paused_at, paused_by, pause_reason \
     FROM outbox.paused_channels ORDER BY channel";

/// The payload of the `outbox_messages` notification `outbox.resume_channel` sends: a
/// worker that hears it reads the paused channels again at once, rather than within its
/// poll interval, and claims the resumed channel's messages.
pub const CHANNEL_RESUMED_PAYLOAD: &str = "channel resumed";
