//! Webhook settings: the request timeout, the signing key and where requests may go.
//!
//! The channel owns them, so that `deliver` never reaches into [`crate::config`]; the
//! worker's configuration ([`crate::config`], the CLI) assembles them at start-up.

use std::collections::HashSet;
use std::time::Duration;

use crate::model::ConfigError;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
