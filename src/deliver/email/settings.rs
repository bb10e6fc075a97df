//! E-mail settings: the relay's URL (`OUTBOXD_SMTP_URL`) and how it is secured, the
//! `Message-ID` domain, the timeout and the connection cap.
//!
//! The channel owns them, so that `deliver` never reaches into [`crate::config`]; the
//! worker's configuration ([`crate::config`], the CLI) assembles them at start-up. The
//! clear-text AUTH rule lives here too: the sender checks a URL built by hand as well.

use std::time::Duration;

use crate::model::ConfigError;

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
/// `Debug` and `Display` never show the password, nor the user: some relays take an API
/// token as the user name (Postmark's server token, SES's access key id).
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
            .field("user", &crate::support::Redacted(&self.user))
            .field("password", &crate::support::Redacted(&self.password))
            .finish()
    }
}

impl std::fmt::Display for SmtpUrl {
    /// `smtp://host:port?tls=…`: neither the user nor the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls == SmtpTls::Implicit {
            "smtps"
        } else {
            "smtp"
        };
        write!(f, "{scheme}://")?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // Neither the password nor the user (an API token at some relays) is shown.
        let u = SmtpUrl::parse("smtp://pm-token-42:hunter2@x.example").expect("valid");
        assert_eq!(u.to_string(), "smtp://x.example:587");
        for shown in [
            format!("{u:?}"),
            u.to_string(),
            format!("{:?}", EmailConfig::new(u.clone())),
        ] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(!shown.contains("pm-token-42"), "{shown}");
        }
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
}
