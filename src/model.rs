//! The vocabulary every room shares: the channels, the states of a message, how an
//! attempt ended, why it failed, and a bad setting. Closed enums, each with the text the
//! database stores; this module imports nothing of the crate, and everything may import it.

use std::fmt;

/// The `channel` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// An HTTP request to a URL in the payload.
    Webhook,
    /// An e-mail through the configured SMTP relay.
    Email,
    /// A call to a provider's API, through an endpoint of `outbox.endpoints` whose
    /// credentials the daemon holds.
    Http,
}

impl Channel {
    /// Every channel.
    pub const ALL: [Channel; 3] = [Channel::Webhook, Channel::Email, Channel::Http];

    /// The text stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Webhook => "webhook",
            Channel::Email => "email",
            Channel::Http => "http",
        }
    }

    /// Parses the text stored in the database or given on the command line.
    pub fn parse(s: &str) -> Option<Channel> {
        Channel::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `state` column of `outbox.messages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Waiting for `run_after`, then for a worker.
    Pending,
    /// Waiting for a person's approval (`outbox.approve`); never claimed, whatever its
    /// `run_after`.
    Held,
    /// Claimed by a worker whose lease has not expired (or whose death is not yet noticed).
    Running,
    /// The provider accepted it. Final.
    Delivered,
    /// Given up on; an operator may replay it. Final until then.
    Dead,
    /// Withdrawn by an operator (`outbox.cancel`): final, never sent again.
    Cancelled,
}

impl State {
    /// Every state, in lifecycle order.
    pub const ALL: [State; 6] = [
        State::Held,
        State::Pending,
        State::Running,
        State::Delivered,
        State::Dead,
        State::Cancelled,
    ];

    /// The text stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Held => "held",
            State::Running => "running",
            State::Delivered => "delivered",
            State::Dead => "dead",
            State::Cancelled => "cancelled",
        }
    }

    /// Parses the text stored in the database.
    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `outcome` column of `outbox.attempts`: how one attempt (or operator action) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptOutcome {
    /// The provider accepted the message.
    Delivered,
    /// It failed and another attempt is scheduled.
    Retry,
    /// It failed and the message is dead.
    Dead,
    /// The worker's lease had been taken over; its result was not recorded on the message.
    LeaseLost,
    /// Claimed but never started (shutdown); the attempt was not counted.
    Released,
    /// An operator moved a dead message back to pending.
    Replayed,
    /// An operator approved a held message (held → pending).
    Approved,
    /// An operator cancelled the message (→ cancelled); the reason is the row's `error`.
    Cancelled,
    /// An operator confirmed that a dead ambiguous message took effect (→ delivered).
    Confirmed,
    /// A reconciliation lookup found that an ambiguous attempt took effect (→ delivered).
    Reconciled,
}

impl AttemptOutcome {
    /// Every outcome.
    pub const ALL: [AttemptOutcome; 10] = [
        AttemptOutcome::Delivered,
        AttemptOutcome::Retry,
        AttemptOutcome::Dead,
        AttemptOutcome::LeaseLost,
        AttemptOutcome::Released,
        AttemptOutcome::Replayed,
        AttemptOutcome::Approved,
        AttemptOutcome::Cancelled,
        AttemptOutcome::Confirmed,
        AttemptOutcome::Reconciled,
    ];

    /// The text stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Delivered => "delivered",
            AttemptOutcome::Retry => "retry",
            AttemptOutcome::Dead => "dead",
            AttemptOutcome::LeaseLost => "lease_lost",
            AttemptOutcome::Released => "released",
            AttemptOutcome::Replayed => "replayed",
            AttemptOutcome::Approved => "approved",
            AttemptOutcome::Cancelled => "cancelled",
            AttemptOutcome::Confirmed => "confirmed",
            AttemptOutcome::Reconciled => "reconciled",
        }
    }

    /// Parses the text stored in the database.
    pub fn parse(s: &str) -> Option<AttemptOutcome> {
        AttemptOutcome::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

impl fmt::Display for AttemptOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an attempt failed: the `error_class` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Nothing took effect and another attempt may succeed: connection refused, DNS or TLS
    /// failure, HTTP 408/425/429/5xx, SMTP 4xx.
    Transient,
    /// The request may have taken effect: a timeout or a lost connection after the request
    /// was sent, or a lease that expired while running.
    Ambiguous,
    /// The provider refused it and will refuse it again: other HTTP 4xx, 3xx, SMTP 5xx.
    Permanent,
    /// The message itself is wrong (bad payload, forbidden destination); no network call
    /// was made.
    Invalid,
    /// A transient failure on the last allowed attempt.
    Exhausted,
}

impl ErrorClass {
    /// Every class.
    pub const ALL: [ErrorClass; 5] = [
        ErrorClass::Transient,
        ErrorClass::Ambiguous,
        ErrorClass::Permanent,
        ErrorClass::Invalid,
        ErrorClass::Exhausted,
    ];

    /// The text stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Ambiguous => "ambiguous",
            ErrorClass::Permanent => "permanent",
            ErrorClass::Invalid => "invalid",
            ErrorClass::Exhausted => "exhausted",
        }
    }

    /// Parses the text stored in the database.
    pub fn parse(s: &str) -> Option<ErrorClass> {
        ErrorClass::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A configuration error: the message is one line naming the setting.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);
