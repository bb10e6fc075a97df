//! Settings, parsed and validated once at start-up.
//!
//! The CLI (clap) reads flags and `OUTBOXD_*` variables; this module holds the typed result
//! and the rules that need more than one value (a lease shorter than a delivery timeout, a
//! retention that would let a dedup record die before the provider's retry window). A bad
//! value stops the process with one line; nothing here reads the environment twice or
//! mutates it.

pub mod assemble;

use crate::model::ConfigError;
use std::collections::HashSet;
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

/// How the connection to the SMTP relay is secured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpTls {
    /// Plain text (`smtp://…?tls=none`): only for a relay on a trusted network, such as
    /// Mailpit or a local Postfix.
    None,
    /// Plain text upgraded with STARTTLS, which the server must offer (`smtp://…`, the
    /// default, or `?tls=starttls`).
    StartTls,
    /// TLS from the first byte (`smtps://…`).
    Implicit,
}

impl SmtpTls {
    /// The name used in the URL and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            SmtpTls::None => "none",
            SmtpTls::StartTls => "starttls",
            SmtpTls::Implicit => "implicit",
        }
    }
}

/// `OUTBOXD_SMTP_URL`, parsed: `smtp://[user:pass@]host[:port][?tls=none|starttls]` or
/// `smtps://[user:pass@]host[:port]`.
///
/// `Debug` and `Display` never show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct SmtpUrl {
    /// The relay's host name or IP address (IPv6 without brackets).
    pub host: String,
    /// The port: given, or 587 (STARTTLS), 25 (`tls=none`), 465 (`smtps`).
    pub port: u16,
    /// How the connection is secured.
    pub tls: SmtpTls,
    /// The user name for AUTH, percent-decoded.
    pub user: Option<String>,
    /// The password for AUTH, percent-decoded. Never printed.
    pub password: Option<String>,
}

impl std::fmt::Debug for SmtpUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmtpUrl")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "[redacted]"))
            .finish()
    }
}

impl std::fmt::Display for SmtpUrl {
    /// `smtp://user@host:port?tls=…`: the user but never the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls == SmtpTls::Implicit {
            "smtps"
        } else {
            "smtp"
        };
        write!(f, "{scheme}://")?;
        if let Some(user) = &self.user {
            write!(f, "{user}@")?;
        }
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)?;
        } else {
            write!(f, "{}:{}", self.host, self.port)?;
        }
        if self.tls == SmtpTls::None {
            f.write_str("?tls=none")?;
        }
        Ok(())
    }
}

impl SmtpUrl {
    /// Parses the URL. Errors name the part that is wrong and never repeat the URL, which
    /// may carry a password.
    pub fn parse(raw: &str) -> Result<SmtpUrl, ConfigError> {
        const NAME: &str = "OUTBOXD_SMTP_URL";
        let err = |what: &str| ConfigError(format!("{NAME}: {what}"));
        let url = url::Url::parse(raw.trim())
            .map_err(|e| err(&format!("not a valid URL ({e}); expected smtp://[user:pass@]host[:port][?tls=none|starttls] or smtps://…")))?;
        let implicit = match url.scheme() {
            "smtp" => false,
            "smtps" => true,
            other => {
                return Err(err(&format!(
                    "scheme {other:?} is not supported (use smtp:// or smtps://)"
                )));
            }
        };
        let host = match url.host() {
            Some(url::Host::Domain(d)) if !d.is_empty() => {
                if d.contains(['%', ' ', '/', '\\']) {
                    return Err(err("the host is not a valid host name"));
                }
                d.to_ascii_lowercase()
            }
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            _ => return Err(err("the URL has no host")),
        };
        if !(url.path().is_empty() || url.path() == "/") {
            return Err(err("the URL may not have a path"));
        }
        if url.fragment().is_some() {
            return Err(err("the URL may not have a fragment"));
        }
        let mut tls = if implicit {
            SmtpTls::Implicit
        } else {
            SmtpTls::StartTls
        };
        for (name, value) in url.query_pairs() {
            match name.as_ref() {
                "tls" if implicit => {
                    return Err(err(
                        "smtps:// is always TLS; the tls parameter goes with smtp:// only",
                    ));
                }
                "tls" => {
                    tls = match value.as_ref() {
                        "none" => SmtpTls::None,
                        "starttls" => SmtpTls::StartTls,
                        _ => return Err(err("tls must be none or starttls")),
                    }
                }
                _ => {
                    let shown: String = name.chars().filter(|c| !c.is_control()).take(32).collect();
                    return Err(err(&format!(
                        "unknown parameter {shown:?} (the only one is tls=none|starttls)"
                    )));
                }
            }
        }
        let port = url.port().unwrap_or(match tls {
            SmtpTls::None => 25,
            SmtpTls::StartTls => 587,
            SmtpTls::Implicit => 465,
        });
        if port == 0 {
            return Err(err("the port must be between 1 and 65535"));
        }
        let decode = |part: &str, what: &str| -> Result<String, ConfigError> {
            percent_encoding::percent_decode_str(part)
                .decode_utf8()
                .map(|s| s.into_owned())
                .map_err(|_| {
                    err(&format!(
                        "the {what} is not valid UTF-8 once percent-decoded"
                    ))
                })
        };
        let user = match url.username() {
            "" => None,
            u => Some(decode(u, "user name")?),
        };
        let password = url.password().map(|p| decode(p, "password")).transpose()?;
        if password.is_some() && user.is_none() {
            return Err(err("a password needs a user name (smtp://user:pass@host)"));
        }
        let url = SmtpUrl {
            host,
            port,
            tls,
            user,
            password,
        };
        url.check_clear_text_auth()?;
        Ok(url)
    }

    /// Refuses credentials over a plain-text connection (`?tls=none` with a user name) to
    /// any host but this machine's loopback (127.0.0.0/8, `::1`, `localhost`): AUTH PLAIN
    /// and LOGIN would carry the password in clear text across the network. The message
    /// names the problem, never the password.
    pub fn check_clear_text_auth(&self) -> Result<(), ConfigError> {
        if self.tls == SmtpTls::None && self.user.is_some() && !is_loopback_host(&self.host) {
            return Err(ConfigError(
                "OUTBOXD_SMTP_URL: ?tls=none with a user name would send the password in clear text to a host that is not loopback; use smtp:// (STARTTLS) or smtps://, or drop the credentials"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Whether a relay's host is this machine: `localhost`, 127.0.0.0/8, `::1` (or `::1`'s
/// IPv4-mapped form of 127.0.0.0/8). Other names are not resolved: a name that happens to
/// point at 127.0.0.1 today is still a name someone else's DNS answers for.
fn is_loopback_host(host: &str) -> bool {
    if host.eq_ignore_ascii_case("localhost") || host.eq_ignore_ascii_case("localhost.") {
        return true;
    }
    match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) => ip.is_loopback(),
        Ok(std::net::IpAddr::V6(ip)) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

/// Checks `OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN`: a plain ASCII domain (letters, digits,
/// hyphens, dots), because it goes verbatim into every `Message-ID`.
pub fn parse_message_id_domain(raw: &str) -> Result<String, ConfigError> {
    let d = raw.trim().trim_end_matches('.').to_ascii_lowercase();
    let ok = !d.is_empty()
        && d.len() <= 253
        && d.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    if ok {
        Ok(d)
    } else {
        Err(ConfigError(
            "OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN must be a domain name such as mail.example.com".into(),
        ))
    }
}

/// Settings of e-mail delivery.
#[derive(Debug, Clone)]
pub struct EmailConfig {
    /// The relay (`OUTBOXD_SMTP_URL`).
    pub smtp: SmtpUrl,
    /// Whole-attempt timeout: connect, TLS, AUTH, the SMTP transaction and the reply
    /// (`--smtp-timeout`).
    pub timeout: Duration,
    /// The right-hand side of every `Message-ID` (`OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN`); the
    /// From address's domain when unset.
    pub message_id_domain: Option<String>,
    /// Most SMTP connections open at once; also the most kept idle for reuse. Relays limit
    /// connections per client (Postfix: 50), so this stays well below `--concurrency`.
    pub max_connections: usize,
}

impl EmailConfig {
    /// Settings for a relay with the defaults: a 30 s timeout, the From domain in
    /// `Message-ID`, at most 10 connections.
    pub fn new(smtp: SmtpUrl) -> Self {
        EmailConfig {
            smtp,
            timeout: Duration::from_secs(30),
            message_id_domain: None,
            max_connections: 10,
        }
    }
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
    fn smtp_urls() {
        let u = SmtpUrl::parse("smtp://mail.example.com").expect("bare");
        assert_eq!(
            (u.host.as_str(), u.port, u.tls, u.user.as_deref()),
            ("mail.example.com", 587, SmtpTls::StartTls, None)
        );
        let u = SmtpUrl::parse("smtp://mailpit:1025?tls=none").expect("local relay");
        assert_eq!((u.port, u.tls), (1025, SmtpTls::None));
        let u = SmtpUrl::parse("smtp://relay.local?tls=none").expect("default port 25");
        assert_eq!(u.port, 25);
        let u = SmtpUrl::parse("smtp://relay.local?tls=starttls").expect("explicit");
        assert_eq!((u.port, u.tls), (587, SmtpTls::StartTls));
        let u = SmtpUrl::parse("smtps://apikey:p%40ss%3Aw%2Frd@SMTP.Example.com")
            .expect("implicit with credentials");
        assert_eq!(
            (
                u.host.as_str(),
                u.port,
                u.tls,
                u.user.as_deref(),
                u.password.as_deref()
            ),
            (
                "smtp.example.com",
                465,
                SmtpTls::Implicit,
                Some("apikey"),
                Some("p@ss:w/rd")
            )
        );
        let u = SmtpUrl::parse("smtp://[::1]:2525?tls=none").expect("IPv6");
        assert_eq!((u.host.as_str(), u.port), ("::1", 2525));
        assert_eq!(u.to_string(), "smtp://[::1]:2525?tls=none");
    }

    #[test]
    fn smtp_url_errors_never_show_the_password() {
        for (bad, needle) in [
            ("http://u:hunter2@x.example", "scheme"),
            ("smtp://u:hunter2@x.example?tls=maybe", "tls must be"),
            ("smtps://u:hunter2@x.example?tls=none", "smtps"),
            (
                "smtp://u:hunter2@x.example?pass=hunter2",
                "unknown parameter",
            ),
            ("smtp://u:hunter2@x.example/path", "path"),
            ("smtp://u:hunter2@x.example:99999", "valid URL"),
            ("smtp://u:hunter2@", "host"),
            ("smtp://:hunter2@x.example", "user name"),
            ("smtp://u:%FFhunter2@x.example", "password"),
            ("not a url hunter2", "valid URL"),
        ] {
            let e = SmtpUrl::parse(bad).expect_err(bad).0;
            assert!(e.starts_with("OUTBOXD_SMTP_URL"), "{bad}: {e}");
            assert!(e.contains(needle), "{bad}: {e}");
            assert!(!e.contains("hunter2"), "{bad}: the password leaked: {e}");
        }
        let u = SmtpUrl::parse("smtp://u:hunter2@x.example").expect("valid");
        assert!(!format!("{u:?}").contains("hunter2"));
        assert!(!u.to_string().contains("hunter2"));
        assert!(!format!("{:?}", EmailConfig::new(u)).contains("hunter2"));
    }

    #[test]
    fn credentials_in_clear_text_only_to_loopback() {
        for bad in [
            "smtp://user:hunter2@mail.example.com:25?tls=none",
            "smtp://user@mail.example.com?tls=none",
            "smtp://user:hunter2@10.0.0.5?tls=none",
            "smtp://user:hunter2@[2001:db8::1]?tls=none",
            "smtp://user:hunter2@localhost.example.com?tls=none",
            "smtp://user:hunter2@128.0.0.1?tls=none",
        ] {
            let e = SmtpUrl::parse(bad).expect_err(bad).0;
            assert!(e.contains("clear text"), "{bad}: {e}");
            assert!(!e.contains("hunter2"), "{bad}: the password leaked: {e}");
            assert_eq!(e.lines().count(), 1, "{bad}: {e}");
        }
        for ok in [
            "smtp://user:hunter2@127.0.0.1:1025?tls=none",
            "smtp://user:hunter2@127.1.2.3?tls=none",
            "smtp://user:hunter2@LOCALHOST:1025?tls=none",
            "smtp://user:hunter2@[::1]:1025?tls=none",
            "smtp://user:hunter2@[::ffff:127.0.0.1]?tls=none",
            "smtp://mail.example.com?tls=none",
            "smtp://user:hunter2@mail.example.com",
            "smtps://user:hunter2@mail.example.com",
        ] {
            SmtpUrl::parse(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        // A URL built by hand (the library's callers) is checked by the sender too.
        let by_hand = SmtpUrl {
            host: "mail.example.com".into(),
            port: 25,
            tls: SmtpTls::None,
            user: Some("user".into()),
            password: Some("hunter2".into()),
        };
        assert!(by_hand.check_clear_text_auth().is_err());
    }

    #[test]
    fn message_id_domains() {
        assert_eq!(
            parse_message_id_domain("Mail.Example.com.").ok().as_deref(),
            Some("mail.example.com")
        );
        for bad in [
            "",
            "a..b",
            "-a.example",
            "a b",
            "ex\u{e4}mple.com",
            "a@b",
            "<x>",
        ] {
            assert!(parse_message_id_domain(bad).is_err(), "{bad:?}");
        }
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
