//! Sign-in, sessions, CSRF tokens and the sign-in rate limit.
//!
//! A session is a random 256-bit id in an `HttpOnly`, `SameSite=Strict` cookie (`Secure`
//! off loopback), mapped in memory to the operator's name, its own random CSRF token and
//! an expiry. A restart signs everyone out, which is the point of keeping them in memory:
//! no session outlives the process or sits in the database. The token is compared through
//! SHA-256 digests with `subtle`, so neither its length nor its bytes show in the timing.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, header};
use axum::response::{IntoResponse, Redirect, Response};
use sha2::Digest as _;
use subtle::ConstantTimeEq as _;

use super::{Failure, Shared, field, pairs};

/// The session cookie's name.
pub const COOKIE: &str = "outboxd_session";

/// Failed sign-ins allowed per client address within [`WINDOW`]; past it every attempt
/// (a right token too) is refused until the window ends.
const MAX_FAILURES: u32 = 5;
const WINDOW: Duration = Duration::from_secs(60);
/// Most client networks with failed sign-ins kept within [`WINDOW`]: bounds the table's
/// memory; past it a network that has not failed yet is refused until entries age out.
const MAX_FAILING_NETWORKS: usize = 10_000;

/// What failed sign-ins are counted by: an IPv4 address, or an IPv6 address's /64 (one
/// host usually holds a whole /64, so counting its addresses one by one gave it 2^64
/// times [`MAX_FAILURES`] guesses a minute); an IPv4-mapped IPv6 address is its IPv4.
fn client_network(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// Most sessions held at once: past it a sign-in signs the oldest session out, so that
/// memory stays bounded.
const MAX_SESSIONS: usize = 1000;

/// One signed-in operator.
#[derive(Clone)]
pub(super) struct Session {
    pub(super) name: String,
    csrf: String,
    expires: Instant,
}

/// The sign-in token, the sessions and the rate limit.
pub(crate) struct Auth {
    /// SHA-256 of the token; `None`: no token (loopback only), a name is enough.
    pub(super) token: Option<[u8; 32]>,
    pub(super) ttl: Duration,
    secure: bool,
    sessions: Mutex<HashMap<String, Session>>,
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

fn digest(s: &str) -> [u8; 32] {
    sha2::Sha256::digest(s.as_bytes()).into()
}

fn random_hex() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

impl Auth {
    pub(crate) fn new(token: Option<&str>, ttl: Duration, secure: bool) -> Auth {
        Auth {
            token: token.map(digest),
            ttl,
            secure,
            sessions: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn token_ok(&self, given: &str) -> bool {
        match &self.token {
            None => true,
            Some(want) => bool::from(digest(given).ct_eq(want)),
        }
    }

    /// Refuses a client network that failed too often lately ([`client_network`]), and
    /// every new one while [`MAX_FAILING_NETWORKS`] have failed within the window.
    pub(super) fn check_rate(&self, ip: IpAddr) -> Result<(), Failure> {
        let mut f = crate::support::lock(&self.failures);
        let now = Instant::now();
        f.retain(|_, (since, _)| now.duration_since(*since) < WINDOW);
        match f.get(&client_network(ip)) {
            Some((_, n)) if *n >= MAX_FAILURES => Err(Failure::TooMany(
                "too many failed sign-ins from this address; try again in a minute".into(),
            )),
            None if f.len() >= MAX_FAILING_NETWORKS => Err(Failure::TooMany(
                "too many failed sign-ins lately; try again in a minute".into(),
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn record_failure(&self, ip: IpAddr) {
        let mut f = crate::support::lock(&self.failures);
        let e = f.entry(client_network(ip)).or_insert((Instant::now(), 0));
        e.1 += 1;
    }

    pub(super) fn create(&self, name: String) -> (String, Session) {
        let mut s = crate::support::lock(&self.sessions);
        let now = Instant::now();
        s.retain(|_, v| v.expires > now);
        // Full: the session that expires first goes, rather than every sign-in being
        // refused for hours (which anyone who may sign in could bring about).
        if s.len() >= MAX_SESSIONS {
            let oldest = s
                .iter()
                .min_by_key(|(_, v)| v.expires)
                .map(|(id, _)| id.clone());
            if let Some(id) = oldest {
                s.remove(&id);
                tracing::warn!(
                    open = MAX_SESSIONS,
                    "console: too many open sessions; the oldest was signed out"
                );
            }
        }
        let session = Session {
            name,
            csrf: random_hex(),
            expires: now + self.ttl,
        };
        let id = random_hex();
        s.insert(id.clone(), session.clone());
        (id, session)
    }

    fn find(&self, id: &str) -> Option<Session> {
        let s = crate::support::lock(&self.sessions);
        s.get(id).filter(|v| v.expires > Instant::now()).cloned()
    }

    fn remove(&self, id: &str) {
        crate::support::lock(&self.sessions).remove(id);
    }

    pub(super) fn cookie(&self, id: &str, max_age: u64) -> String {
        format!(
            "{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{}",
            if self.secure { "; Secure" } else { "" }
        )
    }
}

/// The session id from the request's cookies.
fn session_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
        .find(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_owned)
}

/// A signed-in request: who, and the CSRF token its forms carry.
pub(crate) struct Signed {
    /// The name given at sign-in.
    pub name: String,
    /// The session's CSRF token.
    pub csrf: String,
    id: String,
}

impl Signed {
    /// Who an action is recorded as in `attempts.worker`.
    pub fn actor(&self) -> String {
        format!("console:{}", self.name)
    }

    /// Checks a form's CSRF token (constant time); a missing or wrong one changes nothing.
    pub fn check_csrf(&self, form: &[(String, String)]) -> Result<(), Failure> {
        let given = field(form, "csrf").unwrap_or_default();
        if bool::from(given.as_bytes().ct_eq(self.csrf.as_bytes())) {
            Ok(())
        } else {
            Err(Failure::Forbidden(
                "missing or wrong CSRF token; nothing changed".into(),
            ))
        }
    }
}

impl FromRequestParts<Shared> for Signed {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, app: &Shared) -> Result<Self, Self::Rejection> {
        let found = session_id(&parts.headers).and_then(|id| Some((app.auth.find(&id)?, id)));
        match found {
            Some((s, id)) => Ok(Signed {
                name: s.name,
                csrf: s.csrf,
                id,
            }),
            // A page asks the browser to sign in; a POST is refused outright.
            None if parts.method == Method::GET || parts.method == Method::HEAD => {
                Err(Redirect::to("/signin").into_response())
            }
            None => {
                Err(Failure::Forbidden("not signed in; nothing changed".into()).into_response())
            }
        }
    }
}

/// Refuses what a browser can be made to send on someone else's behalf, before any
/// handler runs:
///
/// * A POST from another site. A browser says where a request comes from: `Sec-Fetch-Site`
///   (every current browser) must be `same-origin` or `none`; failing that, `Origin` must
///   name the host the request was sent to. A request that says neither (curl, a script)
///   is not a browser's and passes. The CSRF token still guards every form; this also
///   guards sign-in, which has none (a page elsewhere could otherwise sign the operator's
///   browser in, use up the sign-in rate limit, or open sessions by the thousand).
/// * Without a sign-in token, anything not addressed to a loopback name. A console without
///   a token trusts whoever can reach the loopback address; a page on another site can
///   reach it too, by pointing its own name at 127.0.0.1 (DNS rebinding), and its requests
///   then carry that name in `Host`. A request that came through a proxy (`Forwarded`,
///   `X-Forwarded-For`) is refused too: its sender is not on this host.
///
/// The refusal names the rule, never the header's value.
pub(crate) async fn guard(
    State(app): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let h = req.headers();
    if app.auth.token.is_none() {
        if let Err(f) = loopback_only(h) {
            tracing::warn!(
                "console: refused a request not addressed to loopback (no sign-in token is set)"
            );
            return f.into_response();
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        if let Err(f) = same_origin(h) {
            tracing::warn!("console: refused a POST from another site");
            return f.into_response();
        }
    }
    next.run(req).await
}

/// Without a token: `Host` a loopback name, and no proxy's headers.
fn loopback_only(h: &HeaderMap) -> Result<(), Failure> {
    let proxied = [
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-real-ip",
    ]
    .iter()
    .any(|name| h.contains_key(*name));
    if proxied {
        return Err(Failure::Forbidden(
            "this console has no sign-in token and trusts only this host; a request through a proxy needs OUTBOXD_CONSOLE_TOKEN set".into(),
        ));
    }
    let host = h.get(header::HOST).and_then(|v| v.to_str().ok());
    if host.is_some_and(is_loopback_host) {
        Ok(())
    } else {
        Err(Failure::Forbidden(
            "this console has no sign-in token and answers only to localhost, 127.0.0.1 or [::1]"
                .into(),
        ))
    }
}

/// Is `host` (a `Host` header: a name or an address, and maybe a port) a loopback name?
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // [v6] or [v6]:port
        Some(rest) => match rest.split_once(']') {
            Some((v6, after)) if after.is_empty() || after.starts_with(':') => v6,
            _ => return false,
        },
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    if name.eq_ignore_ascii_case("localhost") || name.eq_ignore_ascii_case("localhost.") {
        return true;
    }
    // Only the usual forms: `127.1` or `2130706433` are not what a browser puts in Host.
    name.parse::<IpAddr>().is_ok_and(super::is_loopback)
}

/// A POST that a browser marks as coming from another site is refused.
fn same_origin(h: &HeaderMap) -> Result<(), Failure> {
    let refused = || {
        Err(Failure::Forbidden(
            "a request from another site; nothing changed".into(),
        ))
    };
    if let Some(site) = h.get("sec-fetch-site") {
        return match site.to_str() {
            Ok("same-origin" | "none") => Ok(()),
            _ => refused(),
        };
    }
    let Some(origin) = h.get(header::ORIGIN) else {
        return Ok(());
    };
    // `Origin: scheme://host[:port]` against `Host: host[:port]`. A browser sends no port
    // in either for its scheme's default, so the two agree whatever the scheme.
    let from = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, authority)| authority);
    let to = h.get(header::HOST).and_then(|v| v.to_str().ok());
    match (from, to) {
        (Some(from), Some(to)) if from.eq_ignore_ascii_case(to) => Ok(()),
        _ => refused(),
    }
}

pub(crate) async fn signout(
    State(app): State<Shared>,
    signed: Signed,
    body: axum::body::Bytes,
) -> Response {
    if let Err(f) = signed.check_csrf(&pairs(&body)) {
        return f.into_response();
    }
    app.auth.remove(&signed.id);
    let cookie = app.auth.cookie("", 0);
    ([(header::SET_COOKIE, cookie)], Redirect::to("/signin")).into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_session_expires_and_its_cookie_has_the_flags() {
        let auth = Auth::new(Some("a-token-of-some-length"), Duration::ZERO, true);
        let (id, _) = auth.create("alice".into());
        assert!(auth.find(&id).is_none(), "expired at once");
        let cookie = auth.cookie(&id, 60);
        for flag in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/"] {
            assert!(cookie.contains(flag), "{cookie}");
        }
        let auth = Auth::new(None, Duration::from_secs(60), false);
        let (id, s) = auth.create("bob".into());
        assert_eq!(auth.find(&id).unwrap().csrf, s.csrf);
        assert_ne!(s.csrf, id, "the CSRF token is not the session id");
        assert!(!auth.cookie(&id, 60).contains("Secure"));
        auth.remove(&id);
        assert!(auth.find(&id).is_none());
    }

    /// Failures count per IPv4 address and per IPv6 /64: the addresses of one /64 share
    /// their five tries; another /64 and another IPv4 address have their own; and the
    /// table of failing networks is bounded.
    #[test]
    fn failed_sign_ins_count_per_network() {
        let auth = Auth::new(
            Some("a-token-of-some-length"),
            Duration::from_secs(60),
            false,
        );
        let in_64 = |i: u16| IpAddr::V6(std::net::Ipv6Addr::new(0x2001, 0xdb8, 1, 2, i, i, i, i));
        for i in 0..MAX_FAILURES as u16 {
            assert!(auth.check_rate(in_64(i)).is_ok());
            auth.record_failure(in_64(i));
        }
        assert!(
            auth.check_rate(in_64(999)).is_err(),
            "another address of the /64"
        );
        let other_64 = IpAddr::V6(std::net::Ipv6Addr::new(0x2001, 0xdb8, 1, 3, 0, 0, 0, 1));
        assert!(auth.check_rate(other_64).is_ok());
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        for _ in 0..MAX_FAILURES {
            auth.record_failure(mapped);
        }
        assert!(
            auth.check_rate(v4).is_err(),
            "an IPv4-mapped address is its IPv4"
        );
        assert!(auth.check_rate("192.0.2.8".parse().unwrap()).is_ok());
        // Bounded: past MAX_FAILING_NETWORKS networks, a new one waits.
        for i in 0..MAX_FAILING_NETWORKS as u32 {
            auth.record_failure(IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i)));
        }
        assert!(auth.check_rate("198.51.100.1".parse().unwrap()).is_err());
        assert!(crate::support::lock(&auth.failures).len() <= MAX_FAILING_NETWORKS + 2);
    }

    #[test]
    fn a_full_table_signs_the_oldest_session_out() {
        let auth = Auth::new(None, Duration::from_secs(60), false);
        let (first, _) = auth.create("first".into());
        for _ in 1..MAX_SESSIONS {
            auth.create("x".into());
        }
        assert!(auth.find(&first).is_some());
        let (last, _) = auth.create("last".into());
        assert!(auth.find(&last).is_some(), "a sign-in past the limit works");
        assert!(auth.find(&first).is_none(), "the oldest made room");
        assert_eq!(crate::support::lock(&auth.sessions).len(), MAX_SESSIONS);
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn only_loopback_names_reach_a_console_without_a_token() {
        for ok in [
            "localhost",
            "localhost:9188",
            "LOCALHOST:9188",
            "127.0.0.1",
            "127.0.0.1:9188",
            "127.8.9.10:1",
            "[::1]",
            "[::1]:9188",
            "[::ffff:127.0.0.1]:9188",
        ] {
            assert!(is_loopback_host(ok), "{ok}");
            assert!(loopback_only(&headers(&[("host", ok)])).is_ok(), "{ok}");
        }
        for bad in [
            "evil.example:9188",
            "evil.example",
            "localhost.evil.example",
            "127.0.0.1.nip.io:9188",
            "10.0.0.1:9188",
            "[::2]:9188",
            "[::1",
            "[::1]x",
            "",
            "2130706433:9188",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
        assert!(loopback_only(&HeaderMap::new()).is_err(), "no Host");
        for proxy in [
            "forwarded",
            "x-forwarded-for",
            "x-forwarded-host",
            "x-real-ip",
        ] {
            let h = headers(&[("host", "127.0.0.1:9188"), (proxy, "for=203.0.113.9")]);
            assert!(loopback_only(&h).is_err(), "{proxy}");
        }
    }

    #[test]
    fn a_post_from_another_site_is_refused() {
        let host = ("host", "console.example:9188");
        for ok in [
            vec![host],
            vec![host, ("sec-fetch-site", "same-origin")],
            vec![host, ("sec-fetch-site", "none")],
            vec![host, ("origin", "http://console.example:9188")],
            vec![host, ("origin", "https://CONSOLE.example:9188")],
            // Sec-Fetch-Site is the browser's word; Origin is read only without it.
            vec![
                host,
                ("sec-fetch-site", "same-origin"),
                ("origin", "https://proxy.example"),
            ],
        ] {
            assert!(same_origin(&headers(&ok)).is_ok(), "{ok:?}");
        }
        for bad in [
            vec![host, ("sec-fetch-site", "cross-site")],
            vec![host, ("sec-fetch-site", "same-site")],
            vec![host, ("sec-fetch-site", "")],
            vec![host, ("origin", "http://evil.example:9188")],
            vec![host, ("origin", "http://console.example")],
            vec![host, ("origin", "null")],
            vec![("origin", "http://console.example:9188")],
        ] {
            assert!(same_origin(&headers(&bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tokens_compare_whole() {
        let auth = Auth::new(Some("0123456789abcdef"), Duration::from_secs(1), false);
        assert!(auth.token_ok("0123456789abcdef"));
        for wrong in [
            "",
            "0123456789abcde",
            "0123456789abcdef0",
            "0123456789ABCDEF",
        ] {
            assert!(!auth.token_ok(wrong), "{wrong}");
        }
    }

    #[test]
    fn only_a_well_formed_cookie_is_a_session_id() {
        let mut h = HeaderMap::new();
        let id = "ab".repeat(32);
        h.insert(
            header::COOKIE,
            format!("other=1; {COOKIE}=short; {COOKIE}={id}")
                .parse()
                .unwrap(),
        );
        assert_eq!(session_id(&h), Some(id));
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            format!("{COOKIE}={}", "zz".repeat(32)).parse().unwrap(),
        );
        assert_eq!(session_id(&h), None);
    }
}
