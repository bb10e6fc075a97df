//! Limits per destination: `--host-concurrency` and `OUTBOXD_WEBHOOK_RATE_LIMITS`.
//!
//! A destination is what `outbox.destination_of` names: a webhook URL's host in
//! lower case, with `:port` when the URL names one other than its scheme's default. Both
//! limits hold per worker process; the worker (`worker::destinations`) applies them by
//! giving a message back unsent and uncounted until it may go (`state::Deferral`).

use std::time::Duration;

use crate::model::ConfigError;

/// The variable rate limits are read from (also `--webhook-rate-limits`).
pub const RATE_LIMITS_VAR: &str = "OUTBOXD_WEBHOOK_RATE_LIMITS";

/// The limits per destination of one worker process.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DestinationLimits {
    /// Most webhook requests in flight to one destination (0: no cap below the
    /// concurrency).
    pub host_concurrency: usize,
    /// Requests per unit of time, per destination.
    pub rate_limits: RateLimits,
}

impl DestinationLimits {
    /// No limit at all: the worker then spends nothing per attempt on them.
    pub fn is_off(&self) -> bool {
        self.host_concurrency == 0 && self.rate_limits.0.is_empty()
    }
}

/// One rate: `count` requests per `per`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Requests allowed in each `per`.
    pub count: u32,
    /// One second or one minute.
    pub per: Duration,
}

impl Rate {
    /// The even spacing between two requests at this rate.
    pub fn interval(&self) -> Duration {
        self.per / self.count
    }
}

/// The configured rate limits, in the order given: `(host, rate)`, host in lower case,
/// with a port when the entry named one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RateLimits(pub Vec<(String, Rate)>);

impl RateLimits {
    /// Parses `host=N/s|N/m`, comma-separated (`hooks.slack.com=1/s,api.example.com=600/m`).
    /// Empty entries are skipped; a bad or repeated entry is an error naming it (escaped:
    /// it is the operator's text, not a secret). Hosts are written as destinations name
    /// them: lower case, a name's trailing dots dropped; port 80 or 443, which
    /// destinations leave out, is refused (write the host alone).
    pub fn parse(value: &str) -> Result<RateLimits, ConfigError> {
        let mut out: Vec<(String, Rate)> = Vec::new();
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = |why: &str| {
                ConfigError(format!(
                    "{RATE_LIMITS_VAR}: bad entry \"{}\": {why} (expected host=N/s or host=N/m, e.g. hooks.slack.com=1/s)",
                    crate::text::escape_truncated(entry, 100)
                ))
            };
            let (host, rate) = entry.split_once('=').ok_or_else(|| bad("no ="))?;
            let host = canonical(&host.trim().to_ascii_lowercase());
            check_host(&host).map_err(&bad)?;
            let (count, unit) = rate.trim().split_once('/').ok_or_else(|| bad("no /"))?;
            let per = match unit.trim() {
                "s" => Duration::from_secs(1),
                "m" => Duration::from_secs(60),
                _ => return Err(bad("the unit must be s or m")),
            };
            let count: u32 = match count.trim().parse() {
                Ok(n) if (1..=1_000_000).contains(&n) => n,
                _ => return Err(bad("the count must be a whole number from 1 to 1000000")),
            };
            // An entry is matched exactly against a destination, and destination_of
            // leaves out the URL's default port (https://h:443 is `h`): `h:443` would
            // never apply to https. Which scheme a port is meant for cannot be told here,
            // so the entry is refused with the way to write it rather than rewritten.
            let name = host_part(&host);
            if let Some(port) = host[name.len()..].strip_prefix(':') {
                let scheme = match port {
                    "443" => Some("https"),
                    "80" => Some("http"),
                    _ => None,
                };
                if let Some(scheme) = scheme {
                    return Err(bad(&format!(
                        "port {port} is {scheme}'s default, which destinations leave out, so the entry would miss the {scheme} URLs it is written for: write {name}={} (an entry without a port applies on every port of its host)",
                        rate.trim()
                    )));
                }
            }
            if out.iter().any(|(h, _)| *h == host) {
                return Err(bad("this host is already limited by an earlier entry"));
            }
            out.push((host, Rate { count, per }));
        }
        Ok(RateLimits(out))
    }

    /// The entry that applies to `destination` (its index and rate): one naming it exactly
    /// (host and port), else one naming its host without a port.
    pub fn for_destination(&self, destination: &str) -> Option<(usize, Rate)> {
        let exact = self.0.iter().position(|(h, _)| h == destination);
        let index = exact.or_else(|| {
            let host = host_part(destination);
            if host.len() == destination.len() {
                return None;
            }
            self.0.iter().position(|(h, _)| h == host)
        })?;
        Some((index, self.0[index].1))
    }
}

/// `host` (lower case, with an optional port) as `outbox.destination_of` writes a host: a
/// name without its trailing dots (`example.com.` is `example.com`, which destination_of
/// writes for both), an IPv6 literal and the port as given.
fn canonical(host: &str) -> String {
    let name = host_part(host);
    if name.starts_with('[') {
        return host.to_owned();
    }
    format!("{}{}", name.trim_end_matches('.'), &host[name.len()..])
}

/// `host` of `host:port` (an IPv6 literal keeps its brackets).
fn host_part(destination: &str) -> &str {
    match destination.rfind(':') {
        Some(i)
            if !destination[i..].contains(']')
                && destination[i + 1..].bytes().all(|b| b.is_ascii_digit()) =>
        {
            &destination[..i]
        }
        _ => destination,
    }
}

/// A host name, IPv4 or bracketed IPv6 literal, with an optional port: what
/// `outbox.destination_of` can produce.
fn check_host(host: &str) -> Result<(), &'static str> {
    if host.is_empty() || host.len() > 260 {
        return Err("the host must be 1 to 260 characters");
    }
    let name = host_part(host);
    if name.len() < host.len() {
        let port = &host[name.len() + 1..];
        match port.parse::<u32>() {
            Ok(p) if (1..=65_535).contains(&p) && !port.starts_with('0') => {}
            _ => return Err("the port must be 1 to 65535"),
        }
    }
    let ok = if let Some(inner) = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        !inner.is_empty()
            && inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
    } else {
        !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
    };
    if ok {
        Ok(())
    } else {
        Err("the host may hold only letters, digits, '.', '-' and '_' (or be an [IPv6] literal)")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rate_limits_parse() {
        let l = RateLimits::parse(" hooks.slack.com=1/s, API.example.com:8443=600/m ,").unwrap();
        assert_eq!(
            l.0,
            vec![
                (
                    "hooks.slack.com".to_owned(),
                    Rate {
                        count: 1,
                        per: Duration::from_secs(1)
                    }
                ),
                (
                    "api.example.com:8443".to_owned(),
                    Rate {
                        count: 600,
                        per: Duration::from_secs(60)
                    }
                ),
            ]
        );
        assert_eq!(l.0[1].1.interval(), Duration::from_millis(100));
        assert_eq!(RateLimits::parse("").unwrap(), RateLimits::default());
    }

    #[test]
    fn bad_rate_limits_name_the_entry() {
        for (bad, says) in [
            ("hooks.slack.com", "no ="),
            ("h=5", "no /"),
            ("h=5/h", "unit"),
            ("h=0/s", "count"),
            ("h=-1/s", "count"),
            ("h=1.5/s", "count"),
            ("h=99999999999/s", "count"),
            ("=5/s", "host"),
            ("h/x=5/s", "host"),
            ("h:0=5/s", "port"),
            ("h:99999=5/s", "port"),
            ("h=1/s,H=2/s", "already"),
            ("bad\u{1b}[31mhost=1/s", "host"),
        ] {
            let e = RateLimits::parse(bad).unwrap_err().0;
            assert!(e.starts_with(RATE_LIMITS_VAR), "{e}");
            assert!(e.contains(says), "{bad:?}: {e}");
            assert!(!e.contains('\u{1b}') && !e.contains('\n'), "{e:?}");
        }
        let long = format!("{}=1/s", "a".repeat(5000));
        let e = RateLimits::parse(&long).unwrap_err().0;
        assert!(e.len() < 400, "{}", e.len());
    }

    /// An entry is matched exactly against what `outbox.destination_of` names (the worker
    /// sends only where that name says), so an entry written another way for the same
    /// host never applied. A trailing dot is dropped as destination_of drops it; a default
    /// port, which destination_of drops only for its own scheme, is refused with the way
    /// to write it.
    #[test]
    fn entries_are_written_as_destinations_name_them() {
        let l = RateLimits::parse("Example.COM.=1/s,b.example.:8443=2/s").unwrap();
        let hosts: Vec<&str> = l.0.iter().map(|(h, _)| h.as_str()).collect();
        assert_eq!(hosts, ["example.com", "b.example:8443"]);
        for (url, index) in [
            ("https://example.com./hook", Some(0)),
            ("https://EXAMPLE.com:443/hook", Some(0)),
            ("http://example.com:80/hook", Some(0)),
            ("https://example.com:8443/hook", Some(0)),
            ("https://b.example.:8443/hook", Some(1)),
            ("https://b.example/hook", None),
        ] {
            let destination =
                crate::deliver::webhook::destination::name_of(&url::Url::parse(url).unwrap())
                    .unwrap();
            assert_eq!(
                l.for_destination(&destination).map(|x| x.0),
                index,
                "{url} ({destination})"
            );
        }
        for (bad, says) in [
            ("api.example.com:443=10/s", "write api.example.com=10/s"),
            ("api.example.com:80=10/s", "write api.example.com=10/s"),
            ("API.example.com.:443=10/s", "write api.example.com=10/s"),
            ("[::1]:443=1/s", "write [::1]=1/s"),
            ("example.com.=1/s,example.com=2/s", "already"),
            ("...=1/s", "host"),
        ] {
            let e = RateLimits::parse(bad).unwrap_err().0;
            assert!(e.contains(says), "{bad:?}: {e}");
            assert!(!e.contains('\n'), "{e:?}");
        }
    }

    #[test]
    fn an_entry_applies_to_its_host_on_any_port_unless_it_names_one() {
        let l = RateLimits::parse("a.example=1/s,b.example:8443=2/s,[::1]=3/s").unwrap();
        assert_eq!(l.for_destination("a.example").map(|x| x.0), Some(0));
        assert_eq!(l.for_destination("a.example:8080").map(|x| x.0), Some(0));
        assert_eq!(l.for_destination("b.example:8443").map(|x| x.0), Some(1));
        assert_eq!(l.for_destination("b.example"), None);
        assert_eq!(l.for_destination("b.example:9000"), None);
        assert_eq!(l.for_destination("[::1]:9000").map(|x| x.0), Some(2));
        assert_eq!(l.for_destination("[::1]").map(|x| x.0), Some(2));
        assert_eq!(l.for_destination("c.example"), None);
    }
}
