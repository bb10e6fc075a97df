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
            let h = h.trim_start_matches('[').trim_end_matches(']');
            let refused = || {
                ConfigError(format!(
                    "OUTBOXD_WEBHOOK_ALLOW_HOSTS: {raw:?} is not a host name or IP literal (no scheme, port or path)"
                ))
            };
            if h.contains(['/', ' ', '@']) {
                return Err(refused());
            }
            hosts.insert(allow_entry(h).ok_or_else(refused)?);
        }
        Ok(DestinationPolicy {
            allow_private_networks,
            allow_hosts: hosts,
        })
    }
}

/// An allow-list entry in the form the URL parser gives a URL's host, which is what it is
/// matched against ([`crate::deliver::guard::Guard::host_exempt`]), exactly: an
/// international name in its ASCII form (`bücher.example` → `xn--bcher-kva.example`),
/// lower case, an IPv6 address written the one way (`0:0:0:0:0:0:0:1` → `::1`), without
/// brackets. Written otherwise, such entries were accepted and never matched. `None` for
/// what is no host, and for an IPv4 address not written as four decimal numbers: the URL
/// parser reads `010` as octal (`192.168.010.010` is 192.168.8.8), so such an entry would
/// exempt another address than the one its writer meant.
pub(crate) fn allow_entry(h: &str) -> Option<String> {
    let host = if h.contains(':') {
        url::Host::parse(&format!("[{h}]"))
    } else {
        url::Host::parse(h)
    }
    .ok()?;
    if matches!(host, url::Host::Ipv4(_)) && h.parse::<std::net::Ipv4Addr>().is_err() {
        return None;
    }
    Some(without_brackets(&host.to_string()))
}

/// A URL's host as [`allow_entry`] keeps it: no IPv6 brackets, lower case.
pub(crate) fn without_brackets(host: &str) -> String {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase()
}

/// Settings of webhook delivery.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Whole-request timeout of one attempt (`--webhook-timeout`).
    pub timeout: Duration,
    /// The Standard Webhooks signing keys (`OUTBOXD_WEBHOOK_SECRET` and the named
    /// `OUTBOXD_WEBHOOK_SECRET_<NAME>`, each `whsec_<base64>`, several per variable).
    pub signing: SigningKeys,
    /// Where requests may go.
    pub destinations: DestinationPolicy,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            timeout: Duration::from_secs(10),
            signing: SigningKeys::default(),
            destinations: DestinationPolicy::default(),
        }
    }
}

/// The variable of the default secrets; a named one is this, `_`, and the name.
pub const SECRET_VAR: &str = "OUTBOXD_WEBHOOK_SECRET";

/// The keys a webhook is signed with: the default ones, and named sets a payload picks
/// with `"secret": "name"`. Several keys in one set all sign (Standard Webhooks' rotation:
/// the receiver accepts the request when any `v1,` signature verifies with a key it has),
/// in the order given.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SigningKeys {
    /// `OUTBOXD_WEBHOOK_SECRET`: used when the payload names no secret. Empty: unsigned.
    pub default: Vec<Vec<u8>>,
    /// `OUTBOXD_WEBHOOK_SECRET_<NAME>`, by upper-case name.
    pub named: std::collections::BTreeMap<String, Vec<Vec<u8>>>,
}

impl std::fmt::Debug for SigningKeys {
    /// How many keys each set has, never a key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeys")
            .field("default", &format_args!("{} keys", self.default.len()))
            .field(
                "named",
                &self
                    .named
                    .iter()
                    .map(|(name, keys)| (name, keys.len()))
                    .collect::<std::collections::BTreeMap<_, _>>(),
            )
            .finish()
    }
}

impl SigningKeys {
    /// One default key (tests, embedding).
    pub fn one(key: Vec<u8>) -> SigningKeys {
        SigningKeys {
            default: vec![key],
            named: Default::default(),
        }
    }

    /// From the default variable's value and every `OUTBOXD_WEBHOOK_SECRET_<NAME>`
    /// (variable name, value) pair. A malformed secret is an error naming the variable,
    /// never its value.
    pub fn from_values(
        default: Option<&str>,
        named: &[(String, crate::support::Secret)],
    ) -> Result<SigningKeys, ConfigError> {
        let default = match default {
            Some(v) => parse_secrets(SECRET_VAR, v)?,
            None => Vec::new(),
        };
        let mut keys = SigningKeys {
            default,
            named: Default::default(),
        };
        for (var, value) in named {
            let name = var
                .strip_prefix(SECRET_VAR)
                .and_then(|rest| rest.strip_prefix('_'))
                .unwrap_or("");
            if !is_secret_name(name) || name.bytes().any(|b| b.is_ascii_lowercase()) {
                return Err(ConfigError(format!(
                    "{}: a named secret's variable is {SECRET_VAR}_<NAME>, NAME of upper-case letters, digits and _",
                    crate::text::stripped(var, 80)
                )));
            }
            let parsed = parse_secrets(var, value.expose())?;
            // Two entries of one variable (an environment built by hand, or two names made
            // one by a lossy decoding): which one signs must not depend on their order.
            if keys.named.insert(name.to_owned(), parsed).is_some() {
                return Err(ConfigError(format!(
                    "{}: set more than once; give each named secret one variable (several keys go in one value, space-separated)",
                    crate::text::stripped(var, 80)
                )));
            }
        }
        Ok(keys)
    }

    /// The keys for a payload's `secret` (None: the default set); None when the name is
    /// not configured.
    pub fn for_name(&self, name: Option<&str>) -> Option<&[Vec<u8>]> {
        match name {
            None => Some(&self.default),
            Some(n) => self.named.get(n).map(Vec::as_slice),
        }
    }
}

/// A secret's name as a payload writes it (any case) or a variable ends: letters, digits,
/// `_`, at most 64.
pub fn is_secret_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Decodes the secrets of one variable: one or more `whsec_<base64>`, separated by spaces.
pub fn parse_secrets(var: &str, value: &str) -> Result<Vec<Vec<u8>>, ConfigError> {
    let keys = value
        .split_whitespace()
        .map(|secret| parse_one(var, secret))
        .collect::<Result<Vec<_>, _>>()?;
    if keys.is_empty() {
        return Err(ConfigError(format!("{var} is set but holds no secret")));
    }
    Ok(keys)
}

/// Decodes a `whsec_<base64>` secret into its key bytes.
pub fn parse_webhook_secret(secret: &str) -> Result<Vec<u8>, ConfigError> {
    parse_one(SECRET_VAR, secret)
}

fn parse_one(var: &str, secret: &str) -> Result<Vec<u8>, ConfigError> {
    use base64::Engine as _;
    let b64 = secret
        .trim()
        .strip_prefix("whsec_")
        .ok_or_else(|| ConfigError(format!("{var} must look like whsec_<base64>")))?;
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|_| ConfigError(format!("{var}: the part after whsec_ is not valid base64")))?;
    if key.is_empty() {
        return Err(ConfigError(format!("{var}: the key is empty")));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries are kept as the URL parser writes a URL's host, which is what they are
    /// matched against; written otherwise they were accepted and never matched.
    #[test]
    fn allow_list_entries_are_written_as_url_hosts() {
        let policy = DestinationPolicy::from_values(
            None,
            Some("BÜCHER.example, 127.0.0.1, 0:0:0:0:0:0:0:1, [::FFFF:127.0.0.1], hooks.internal, Api.Example.COM, absolute.example."),
        )
        .expect("every entry is a host");
        let mut got: Vec<&str> = policy.allow_hosts.iter().map(String::as_str).collect();
        got.sort_unstable();
        assert_eq!(
            got,
            [
                "127.0.0.1",
                "::1",
                "::ffff:7f00:1",
                "absolute.example.",
                "api.example.com",
                "hooks.internal",
                "xn--bcher-kva.example"
            ]
        );
        // An IPv4 address the URL parser would read otherwise than its writer meant:
        // 010 is octal there (192.168.010.010 is 192.168.8.8), 1 is 0.0.0.1.
        for bad in [
            "a b",
            "x/y",
            "u@h",
            "1:2:3",
            "exa mple.com",
            "ex%00ample",
            "192.168.010.010",
            "127.000.000.001",
            "0x7f.1",
            "1",
            "10.0.0.09",
        ] {
            let err = DestinationPolicy::from_values(None, Some(bad)).expect_err(bad);
            assert!(
                err.0.contains("OUTBOXD_WEBHOOK_ALLOW_HOSTS"),
                "{bad}: {err}"
            );
        }
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
    fn several_and_named_secrets() {
        let a = "whsec_AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcY";
        let b = "whsec_c2Vjb25kIGtleSBmb3Igcm90YXRpb24=";
        let keys = SigningKeys::from_values(
            Some(&format!("  {a}   {b} ")),
            &[("OUTBOXD_WEBHOOK_SECRET_STRIPE_2".into(), b.into())],
        )
        .expect("valid");
        assert_eq!(keys.default.len(), 2);
        assert_eq!(keys.for_name(Some("STRIPE_2")).map(<[_]>::len), Some(1));
        assert!(keys.for_name(Some("OTHER")).is_none());
        for (default, named, var) in [
            (
                Some(" "),
                vec![],
                "OUTBOXD_WEBHOOK_SECRET is set but holds no secret",
            ),
            (
                Some(&*format!("{a} nope")),
                vec![],
                "OUTBOXD_WEBHOOK_SECRET must look like",
            ),
            (
                None,
                vec![("OUTBOXD_WEBHOOK_SECRET_X".to_owned(), "whsec_!!".into())],
                "OUTBOXD_WEBHOOK_SECRET_X: the part after whsec_",
            ),
            (
                None,
                vec![("OUTBOXD_WEBHOOK_SECRET_lower".to_owned(), a.into())],
                "NAME of upper-case letters",
            ),
            (
                None,
                vec![("OUTBOXD_WEBHOOK_SECRET_".to_owned(), a.into())],
                "NAME of upper-case letters",
            ),
            (
                None,
                vec![
                    ("OUTBOXD_WEBHOOK_SECRET_X".to_owned(), a.into()),
                    ("OUTBOXD_WEBHOOK_SECRET_X".to_owned(), b.into()),
                ],
                "OUTBOXD_WEBHOOK_SECRET_X: set more than once",
            ),
        ] {
            let err = SigningKeys::from_values(default, &named)
                .err()
                .map(|e| e.0)
                .unwrap_or_default();
            assert!(err.contains(var), "{err}");
            assert!(
                !err.contains("AQID") && !err.contains("nope"),
                "a value in {err}"
            );
        }
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
