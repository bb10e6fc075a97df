//! Where a webhook goes. The insert trigger names a message's destination once
//! (`outbox.destination_of`: the URL's host, lower case, and its port when not the scheme's
//! default) and stores it with the row, with its reconciliation lookup's; the limits, the
//! breakers and the pauses go by those names. The worker names nothing: it only checks,
//! before any request, that the host the URL parser will connect to is the one named
//! ([`check`]). A URL the two read differently (a host in Unicode, percent-escapes, a
//! backslash for the path's slash, IPv4 in a short form) is refused as `invalid`, so no
//! spelling of a host escapes the rules that go by its name.

use crate::deliver::DeliveryError;

/// The largest webhook payload (its text, in bytes) the claim reads whole and keeps until
/// its attempt (`claim::Claimed::webhook`). Read, a payload is a tree of values that can take
/// many times its text (an array of 0s: 16 times), and the claim does the reading on its
/// own task: a bound keeps both small for the rows claimed ahead (up to 320 at 64 in
/// flight: 20 MiB at the worst). A larger payload is read by its attempt.
pub const READ_ONCE_MAX: usize = 4096;

/// The name the URL parser's reading of `url` has, written as `outbox.destination_of`
/// writes names: the host (IDNA-mapped, lower case, IPv4 dotted, without trailing dots) and
/// the port when it is not the scheme's default.
pub fn name_of(url: &url::Url) -> Option<String> {
    let host = url.host_str()?.trim_end_matches('.');
    if host.is_empty() {
        return None;
    }
    Some(match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_owned(),
    })
}

/// Whether the request to `url` goes to `named`, the destination the insert trigger stored
/// for it. `field` names the URL in the error (`url`, `reconcile.url`). The error shows the
/// host the parser read, never the URL's path or query.
pub fn check(url: &url::Url, named: Option<&str>, field: &str) -> Result<(), DeliveryError> {
    let read = name_of(url);
    if read.is_some() && read.as_deref() == named {
        return Ok(());
    }
    let host = crate::text::Escaped(read.as_deref().unwrap_or(""));
    Err(DeliveryError::invalid(match named {
        Some(named) => format!(
            "{field}: the request would go to {host}, not to {} as the URL was named at \
             enqueue; write the URL's host plainly (no backslash or escapes)",
            crate::text::Escaped(named)
        ),
        None => format!(
            "{field}: its host {host} has no destination name; write it in plain ASCII \
             (an international name in its xn-- form, IPv4 as four decimal parts)"
        ),
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parsed(s: &str) -> url::Url {
        url::Url::parse(s).unwrap()
    }

    #[test]
    fn names_hosts_as_the_insert_trigger_writes_them() {
        for (url, name) in [
            ("https://A.Example/hook", "a.example"),
            ("https://a.example:443/x", "a.example"),
            ("http://a.example:80/x", "a.example"),
            ("https://a.example:8443/x", "a.example:8443"),
            ("http://a.example.:8080/", "a.example:8080"),
            ("http://user:pw@a.example/", "a.example"),
            ("http://[::1]:8080/", "[::1]:8080"),
            ("http://127.0.0.1/", "127.0.0.1"),
        ] {
            assert_eq!(name_of(&parsed(url)).as_deref(), Some(name), "{url}");
            assert!(check(&parsed(url), Some(name), "url").is_ok(), "{url}");
        }
    }

    #[test]
    fn refuses_a_url_read_as_another_host_than_its_name() {
        // What outbox.destination_of names each (it reads the text; the parser connects).
        for (url, named) in [
            (r"http://evil.example\@good.example/", Some("good.example")),
            ("http://127.1/", Some("127.1")),
            ("http://b\u{fc}cher.example/", None),
            ("http://ex%61mple.com/", None),
        ] {
            let e = check(&parsed(url), named, "url").unwrap_err();
            assert_eq!(e.class, crate::model::ErrorClass::Invalid, "{url}");
            assert!(e.message.starts_with("url: "), "{}", e.message);
        }
        let e = check(
            &parsed("https://a.example/secret-path?token=t"),
            Some("b.example"),
            "reconcile.url",
        )
        .unwrap_err();
        assert!(!e.message.contains("secret") && !e.message.contains("token"));
    }
}
