//! The worker's settings, parsed and validated once at start-up.
//!
//! The CLI (clap) reads flags and `OUTBOXD_*` variables; this module holds the typed result
//! for the worker loop (and the duration syntax every flag shares), and the rules that need
//! more than one value (a lease shorter than a delivery timeout, a retention that would let
//! a dedup record die before the provider's retry window). Each channel owns its own
//! settings (`deliver::webhook::settings`, `deliver::email::settings`). A bad value stops
//! the process with one line; nothing here reads the environment twice or mutates it.

pub mod assemble;
pub mod limits;

use crate::model::ConfigError;
use std::time::Duration;

use crate::model::Channel;
use crate::retry::RetryPolicy;

/// Parses a duration written `100ms`, `5s`, `15m`, `24h` or `7d` (an integer and one unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "invalid duration {s:?}: expected a number and a unit (100ms, 5s, 15m, 24h, 7d)"
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: number too large"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => {
            return Err(format!(
                "invalid duration {s:?}: missing unit (ms, s, m, h or d)"
            ));
        }
        _ => {
            return Err(format!(
                "invalid duration {s:?}: unknown unit {unit:?} (use ms, s, m, h or d)"
            ));
        }
    };
    // Ten years is longer than any lease, timeout, retry delay or retention makes sense
    // for, and keeps every `now() + d` inside PostgreSQL's timestamp range.
    const MAX_MS: u64 = 3650 * 86_400_000;
    match n.checked_mul(unit_ms) {
        Some(ms) if ms <= MAX_MS => Ok(Duration::from_millis(ms)),
        _ => Err(format!("invalid duration {s:?}: at most 3650d")),
    }
}

/// Formats a duration the way [`parse_duration`] reads it (largest exact unit).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000u128),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms > 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Settings of the worker loop.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Names this worker in leases and attempt rows (`--worker-id`).
    pub worker_id: String,
    /// The channels this worker claims.
    pub channels: Vec<Channel>,
    /// Most deliveries in flight at once.
    pub concurrency: usize,
    /// Most rows claimed by one statement.
    pub batch_size: usize,
    /// How often to look for due rows when no notification arrives.
    pub poll_interval: Duration,
    /// How long a claim is valid; a worker that dies loses its rows after this.
    pub lease: Duration,
    /// The retry schedule.
    pub retry: RetryPolicy,
    /// Exit once nothing of our channels is pending or running.
    pub drain: bool,
    /// How long in-flight attempts may finish after a shutdown signal.
    pub shutdown_grace: Duration,
    /// LISTEN for `outbox_messages` notifications (polling stays as the fallback).
    pub listen: bool,
    /// Limits per destination (`--host-concurrency`, rate limits).
    pub limits: limits::DestinationLimits,
    /// Consecutive transient or ambiguous failures that open a destination's circuit
    /// (`--breaker-threshold`); 0 turns breakers off.
    pub breaker_threshold: u32,
    /// How long a circuit stays open before its probe (`--breaker-cooldown`); doubled after
    /// each failed probe, at most the retry schedule's longest delay.
    pub breaker_cooldown: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            worker_id: default_worker_id(),
            channels: vec![Channel::Webhook],
            concurrency: 64,
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            lease: Duration::from_secs(60),
            retry: RetryPolicy::default(),
            drain: false,
            shutdown_grace: Duration::from_secs(30),
            listen: true,
            limits: limits::DestinationLimits::default(),
            breaker_threshold: 10,
            breaker_cooldown: Duration::from_secs(30),
        }
    }
}

impl WorkerConfig {
    /// Checks the rules that involve more than one setting.
    pub fn validate(&self, longest_delivery: Duration) -> Result<(), ConfigError> {
        if self.worker_id.is_empty() || self.worker_id.len() > 200 {
            return Err(ConfigError("--worker-id must be 1..200 characters".into()));
        }
        if self.channels.is_empty() {
            return Err(ConfigError(
                "--channels must name at least one channel".into(),
            ));
        }
        if self.concurrency == 0 || self.concurrency > 10_000 {
            return Err(ConfigError(
                "--concurrency must be between 1 and 10000".into(),
            ));
        }
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(ConfigError(
                "--batch-size must be between 1 and 10000".into(),
            ));
        }
        if self.limits.host_concurrency > 10_000 {
            return Err(ConfigError(
                "--host-concurrency must be between 0 (no cap) and 10000".into(),
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(ConfigError("--poll-interval must be positive".into()));
        }
        if self.retry.base.is_zero() || self.retry.max < self.retry.base {
            return Err(ConfigError(
                "--retry-base must be positive and at most --retry-max".into(),
            ));
        }
        if self.breaker_threshold > 1_000_000 {
            return Err(ConfigError(
                "--breaker-threshold must be between 0 (off) and 1000000".into(),
            ));
        }
        if self.breaker_threshold > 0 && self.breaker_cooldown.is_zero() {
            return Err(ConfigError("--breaker-cooldown must be positive".into()));
        }
        // A lease that can expire while an attempt is still within its timeout would let a
        // second worker send the same message while the first one is still talking to the
        // provider. The loop starts an attempt only while its timeout and LEASE_MARGIN still
        // fit in the lease; this asks for a lease where a freshly claimed row can also wait
        // LEASE_MIN_WAIT for a slot.
        let needed = longest_delivery + LEASE_MARGIN + LEASE_MIN_WAIT;
        if self.lease < needed {
            return Err(ConfigError(format!(
                "--lease ({}) must be at least the delivery timeout ({}) plus {}s, so that every attempt ends inside its lease",
                format_duration(self.lease),
                format_duration(longest_delivery),
                (LEASE_MARGIN + LEASE_MIN_WAIT).as_secs()
            )));
        }
        Ok(())
    }

    /// Whether an attempt with this `timeout` may start, `since_claim` after the claim that
    /// leased its row: its whole timeout plus [`LEASE_MARGIN`] must fit in what is left of
    /// the lease. Otherwise the lease could expire mid-attempt, and another worker (or this
    /// one) would send the message again while the first request is still in flight.
    pub fn attempt_fits(&self, since_claim: Duration, timeout: Duration) -> bool {
        self.lease.saturating_sub(since_claim) >= timeout + LEASE_MARGIN
    }
}

/// What an attempt must have left of its lease beyond its timeout when it starts: time to
/// hand its result to the completer and write it before anyone may take the row over.
pub const LEASE_MARGIN: Duration = Duration::from_secs(2);

/// How long, at the shortest lease start-up allows, a claimed row may wait for a slot and
/// still start.
pub const LEASE_MIN_WAIT: Duration = Duration::from_secs(1);

/// `hostname-pid`: unique enough to tell workers apart in leases and history.
pub fn default_worker_id() -> String {
    let host = crate::support::hostname().unwrap_or_else(|| "outboxd".to_owned());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        for bad in [
            "",
            "5",
            "s",
            "5x",
            "-5s",
            "1.5s",
            "5 s",
            "99999999999999999999s",
            "18446744073709551615d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(format_duration(Duration::from_secs(900)), "15m");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn lease_must_outlast_the_timeout() {
        let cfg = WorkerConfig {
            lease: Duration::from_secs(10),
            ..WorkerConfig::default()
        };
        assert!(cfg.validate(Duration::from_secs(10)).is_err());
        assert!(cfg.validate(Duration::from_secs(5)).is_ok());
        // The pairing: a 10 s timeout under a 12 s lease left a second worker room
        // to send the message again while the first request was still waiting.
        let tight = WorkerConfig {
            lease: Duration::from_secs(12),
            ..WorkerConfig::default()
        };
        assert!(tight.validate(Duration::from_secs(10)).is_err());
        assert!(tight.validate(Duration::from_secs(9)).is_ok());
        // The defaults pass for both channels (webhook 10 s, e-mail 30 s).
        let defaults = WorkerConfig::default();
        assert!(defaults.validate(Duration::from_secs(30)).is_ok());
    }

    #[test]
    fn an_attempt_starts_only_if_its_timeout_fits_in_the_lease() {
        let cfg = WorkerConfig {
            lease: Duration::from_secs(60),
            ..WorkerConfig::default()
        };
        let t = Duration::from_secs(30);
        assert!(cfg.attempt_fits(Duration::ZERO, t));
        assert!(cfg.attempt_fits(Duration::from_secs(28), t));
        assert!(!cfg.attempt_fits(Duration::from_millis(28_001), t));
        // The old rule started anything claimed less than half a lease ago.
        assert!(!cfg.attempt_fits(Duration::from_secs(29), t));
        assert!(!cfg.attempt_fits(Duration::from_secs(600), t));
    }
}
