//! Sign-in, sessions, CSRF tokens and the sign-in rate limit.
//!
//! A session is a random 256-bit id in an `HttpOnly`, `SameSite=Strict` cookie (`Secure`
//! off loopback), mapped in memory to the operator's name, its own random CSRF token and
//! an expiry. A restart signs everyone out, which is the point of keeping them in memory:
//! no session outlives the process or sits in the database. The token is compared through
//! SHA-256 digests with `subtle`, so neither its length nor its bytes show in the timing.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, header};
use axum::response::{IntoResponse, Redirect, Response};
use sha2::Digest as _;
use subtle::ConstantTimeEq as _;

use super::{Failure, Shared, field, layout, pairs};

/// The session cookie's name.
pub const COOKIE: &str = "outboxd_session";

/// Failed sign-ins allowed per client address within [`WINDOW`]; past it every attempt
/// (a right token too) is refused until the window ends.
const MAX_FAILURES: u32 = 5;
const WINDOW: Duration = Duration::from_secs(60);
/// Most sessions held at once: sign-ins past it are refused rather than let memory grow.
const MAX_SESSIONS: usize = 1000;

/// One signed-in operator.
#[derive(Clone)]
struct Session {
    name: String,
    csrf: String,
    expires: Instant,
}

/// The sign-in token, the sessions and the rate limit.
pub(crate) struct Auth {
    /// SHA-256 of the token; `None`: no token (loopback only), a name is enough.
    token: Option<[u8; 32]>,
    ttl: Duration,
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

    fn token_ok(&self, given: &str) -> bool {
        match &self.token {
            None => true,
            Some(want) => bool::from(digest(given).ct_eq(want)),
        }
    }

    /// Refuses a client address that failed too often lately.
    fn check_rate(&self, ip: IpAddr) -> Result<(), Failure> {
        let mut f = crate::support::lock(&self.failures);
        let now = Instant::now();
        f.retain(|_, (since, _)| now.duration_since(*since) < WINDOW);
        match f.get(&ip) {
            Some((_, n)) if *n >= MAX_FAILURES => Err(Failure::TooMany(
                "too many failed sign-ins from this address; try again in a minute".into(),
            )),
            _ => Ok(()),
        }
    }

    fn record_failure(&self, ip: IpAddr) {
        let mut f = crate::support::lock(&self.failures);
        let e = f.entry(ip).or_insert((Instant::now(), 0));
        e.1 += 1;
    }

    fn create(&self, name: String) -> Result<(String, Session), Failure> {
        let mut s = crate::support::lock(&self.sessions);
        let now = Instant::now();
        s.retain(|_, v| v.expires > now);
        if s.len() >= MAX_SESSIONS {
            return Err(Failure::TooMany(
                "too many open sessions; sign out elsewhere or wait for them to expire".into(),
            ));
        }
        let session = Session {
            name,
            csrf: random_hex(),
            expires: now + self.ttl,
        };
        let id = random_hex();
        s.insert(id.clone(), session.clone());
        Ok((id, session))
    }

    fn find(&self, id: &str) -> Option<Session> {
        let s = crate::support::lock(&self.sessions);
        s.get(id).filter(|v| v.expires > Instant::now()).cloned()
    }

    fn remove(&self, id: &str) {
        crate::support::lock(&self.sessions).remove(id);
    }

    fn cookie(&self, id: &str, max_age: u64) -> String {
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

pub(crate) async fn signin_page(State(app): State<Shared>) -> Response {
    layout::signin(app.auth.token.is_some(), None).into_response()
}

/// A name as history shows it: `console:<name>`. Letters, digits and `._@-`, 1 to 40.
fn check_name(name: &str) -> Result<(), Failure> {
    let ok = (1..=40).contains(&name.chars().count())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '@' | '-'));
    if ok {
        Ok(())
    } else {
        Err(Failure::BadRequest(
            "a name is 1 to 40 letters, digits, '.', '_', '@' or '-'".into(),
        ))
    }
}

pub(crate) async fn signin(
    State(app): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: axum::body::Bytes,
) -> Response {
    let form = pairs(&body);
    let ip = peer.ip();
    if let Err(f) = app.auth.check_rate(ip) {
        return f.into_response();
    }
    let token = field(&form, "token").unwrap_or_default();
    if !app.auth.token_ok(token) {
        app.auth.record_failure(ip);
        tracing::warn!(peer = %ip, "console: sign-in with a wrong token");
        let page = layout::signin(true, Some("wrong token"));
        return (axum::http::StatusCode::UNAUTHORIZED, page).into_response();
    }
    let name = field(&form, "name").unwrap_or_default();
    if let Err(f) = check_name(name) {
        return f.into_response();
    }
    let (id, session) = match app.auth.create(name.to_owned()) {
        Ok(s) => s,
        Err(f) => return f.into_response(),
    };
    tracing::info!(operator = %session.name, "console: signed in");
    let cookie = app.auth.cookie(&id, app.auth.ttl.as_secs());
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
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
        let (id, _) = auth.create("alice".into()).unwrap();
        assert!(auth.find(&id).is_none(), "expired at once");
        let cookie = auth.cookie(&id, 60);
        for flag in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/"] {
            assert!(cookie.contains(flag), "{cookie}");
        }
        let auth = Auth::new(None, Duration::from_secs(60), false);
        let (id, s) = auth.create("bob".into()).unwrap();
        assert_eq!(auth.find(&id).unwrap().csrf, s.csrf);
        assert_ne!(s.csrf, id, "the CSRF token is not the session id");
        assert!(!auth.cookie(&id, 60).contains("Secure"));
        auth.remove(&id);
        assert!(auth.find(&id).is_none());
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
