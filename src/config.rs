//! Settings, parsed and validated once at start-up.
//!
//! The CLI (clap) reads flags and `OUTBOXD_*` variables; this module holds the typed result
//! and the rules that need more than one value (a lease shorter than a delivery timeout, a
//! retention that would let a dedup record die before the provider's retry window). A bad
//! value stops the process with one line; nothing here reads the environment twice or
//! mutates it.

use std::collections::HashSet;
use std::time::Duration;

use crate::deliver::Channel;
use crate::retry::RetryPolicy;

/// A configuration error: the message is one line naming the setting.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

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

/// Parses a boolean environment value (`true/false`, `1/0`, `yes/no`, `on/off`).
pub fn parse_bool(name: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" | "" => Ok(false),
        _ => Err(ConfigError(format!(
            "{name} must be true or false (got {value:?})"
        ))),
    }
}

/// Where webhooks may go. The default refuses private, loopback and other internal
/// addresses (see [`crate::deliver::guard`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DestinationPolicy {
    /// `OUTBOXD_ALLOW_PRIVATE_NETWORKS=true`: skip the address check entirely.
    pub allow_private_networks: bool,
    /// `OUTBOXD_WEBHOOK_ALLOW_HOSTS`: host names or IP literals (lower case, no brackets)
    /// that may be reached whatever they resolve to.
    pub allow_hosts: HashSet<String>,
}

impl DestinationPolicy {
    /// Reads `OUTBOXD_ALLOW_PRIVATE_NETWORKS` and `OUTBOXD_WEBHOOK_ALLOW_HOSTS` values.
    pub fn from_values(
        allow_private: Option<&str>,
        allow_hosts: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let allow_private_networks = match allow_private {
            Some(v) => parse_bool("OUTBOXD_ALLOW_PRIVATE_NETWORKS", v)?,
            None => false,
        };
        let mut hosts = HashSet::new();
        for raw in allow_hosts.unwrap_or("").split(',') {
            let h = raw.trim();
            if h.is_empty() {
                continue;
            }
            let h = h
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_ascii_lowercase();
            if h.contains(['/', ' ', '@'])
                || (h.contains(':') && h.parse::<std::net::Ipv6Addr>().is_err())
            {
                return Err(ConfigError(format!(
                    "OUTBOXD_WEBHOOK_ALLOW_HOSTS: {raw:?} is not a host name or IP literal (no scheme, port or path)"
                )));
            }
            hosts.insert(h);
        }
        Ok(DestinationPolicy {
            allow_private_networks,
            allow_hosts: hosts,
        })
    }
}

/// Settings of webhook delivery.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Whole-request timeout of one attempt (`--webhook-timeout`).
    pub timeout: Duration,
    /// The decoded Standard Webhooks signing key (`OUTBOXD_WEBHOOK_SECRET`, `whsec_<base64>`).
    pub signing_key: Option<Vec<u8>>,
    /// Where requests may go.
    pub destinations: DestinationPolicy,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            timeout: Duration::from_secs(10),
            signing_key: None,
            destinations: DestinationPolicy::default(),
        }
    }
}

/// Decodes a `whsec_<base64>` secret into its key bytes.
pub fn parse_webhook_secret(secret: &str) -> Result<Vec<u8>, ConfigError> {
    use base64::Engine as _;
    let b64 = secret.trim().strip_prefix("whsec_").ok_or_else(|| {
        ConfigError("OUTBOXD_WEBHOOK_SECRET must look like whsec_<base64>".into())
    })?;
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|_| {
            ConfigError("OUTBOXD_WEBHOOK_SECRET: the part after whsec_ is not valid base64".into())
        })?;
    if key.is_empty() {
        return Err(ConfigError(
            "OUTBOXD_WEBHOOK_SECRET: the key is empty".into(),
        ));
    }
    Ok(key)
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
        if self.poll_interval.is_zero() {
            return Err(ConfigError("--poll-interval must be positive".into()));
        }
        if self.retry.base.is_zero() || self.retry.max < self.retry.base {
            return Err(ConfigError(
                "--retry-base must be positive and at most --retry-max".into(),
            ));
        }
        // A lease that can expire while an attempt is still within its timeout would let a
        // second worker send the same message while the first one is still talking to the
        // provider. Require a margin.
        if self.lease <= longest_delivery + Duration::from_secs(1) {
            return Err(ConfigError(format!(
                "--lease ({}) must be longer than the delivery timeout ({}) plus 1s",
                format_duration(self.lease),
                format_duration(longest_delivery)
            )));
        }
        Ok(())
    }
}

/// `hostname-pid`: unique enough to tell workers apart in leases and history.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "outboxd".to_owned());
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
    fn secrets() {
        let key = parse_webhook_secret("whsec_AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcY");
        assert_eq!(key.ok().map(|k| k.len()), Some(24));
        assert!(parse_webhook_secret("AQID").is_err());
        assert!(parse_webhook_secret("whsec_!!!").is_err());
        assert!(parse_webhook_secret("whsec_").is_err());
    }

    #[test]
    fn destination_policy() {
        let p = DestinationPolicy::from_values(
            Some("false"),
            Some(" Hooks.Example.com ,[::1], 10.0.0.5"),
        )
        .expect("valid");
        assert!(!p.allow_private_networks);
        assert!(p.allow_hosts.contains("hooks.example.com"));
        assert!(p.allow_hosts.contains("::1"));
        assert!(p.allow_hosts.contains("10.0.0.5"));
        assert!(DestinationPolicy::from_values(Some("maybe"), None).is_err());
        assert!(DestinationPolicy::from_values(None, Some("https://x.example")).is_err());
        assert!(DestinationPolicy::from_values(None, Some("x.example:8080")).is_err());
    }

    #[test]
    fn lease_must_outlast_the_timeout() {
        let cfg = WorkerConfig {
            lease: Duration::from_secs(10),
            ..WorkerConfig::default()
        };
        assert!(cfg.validate(Duration::from_secs(10)).is_err());
        assert!(cfg.validate(Duration::from_secs(5)).is_ok());
    }
}
