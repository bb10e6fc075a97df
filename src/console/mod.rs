//! `outboxd console`: the operator console, server-rendered HTML on axum.
//!
//! A room of its own, above `ops` and `status` (whose functions it calls, so every action
//! goes through the same SQL functions as the CLI: `outbox.replay`, `approve`, `cancel`,
//! `confirm`) and below `cli` (which parses its flags). The pages live beside this file:
//! `layout` (the frame every page shares, the error page), `auth` (sessions, tokens,
//! CSRF, the rate limit, the guard), `signin` (the sign-in page and its form), `overview`
//! (counts and the chart), `dead`, `held`, `message` (one message, and lookup),
//! `action` (the confirmation step and the change); `messages` (every message, filtered
//! and paged by id), `endpoints` (the http channel's endpoints, names of secrets only),
//! `destinations` (what waits for each destination; pause, resume, close, with their own
//! confirmation step), `charts` (the overview's latency and backlog charts), `time`
//! (the one formatter of times, relative to the database's clock) and `channels` (pause
//! and resume a whole channel, with the same confirmation step).
//!
//! Security, in one place so that it can be checked in one place:
//! * no page without a session; sign-in with `OUTBOXD_CONSOLE_TOKEN` (compared in constant
//!   time), required unless the console listens on loopback only;
//! * the session cookie is `HttpOnly`, `SameSite=Strict` (and `Secure` off loopback);
//!   sessions live in memory and expire;
//! * every POST carries the session's CSRF token, checked before anything else; no GET
//!   changes anything;
//! * a POST a browser marks as from another site (`Sec-Fetch-Site`, else `Origin` against
//!   `Host`) is refused before any handler, sign-in included; without a token, a request
//!   not addressed to a loopback name (DNS rebinding) or sent through a proxy is refused
//!   ([`auth::guard`]);
//! * the head of a request must arrive within 30 s, a request ends within 60 s, and at
//!   most 256 connections are served at once ([`accept_loop`]);
//! * every value reaches the page through maud, which escapes it; stored text is also made
//!   one line ([`crate::text::escape`]);
//! * a strict Content-Security-Policy (no script at all, the stylesheet from `/style.css`);
//! * a payload is shown as `outboxd show` shows it ([`crate::ops::redact_payload`]): no
//!   header value, no URL path or query. Logs carry the operator's name, the action and a
//!   count, never a payload.

mod action;
mod auth;
mod channels;
mod charts;
mod dead;
mod destinations;
mod held;
mod layout;
mod message;
mod overview;
mod signin;

mod endpoints;
mod messages;
mod time;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use deadpool_postgres::Pool;

use crate::model::ConfigError;
use crate::support::Secret;

/// The console's settings, validated by [`ConsoleConfig::new`]. The token is a [`Secret`],
/// so the derived `Debug` shows only whether there is one.
#[derive(Clone, Debug)]
pub struct ConsoleConfig {
    /// Where to listen.
    pub addr: SocketAddr,
    /// The sign-in token; `None` only on a loopback address.
    token: Option<Secret>,
    /// How long a session lasts after sign-in.
    pub session_ttl: Duration,
    /// The names (upper-case) of the endpoint secrets this console's environment holds,
    /// for `/endpoints` to say yes or no; `None` when they could not be read. Names only:
    /// the console never holds a secret's value.
    pub secret_names: Option<std::collections::BTreeSet<String>>,
}

/// The shortest sign-in token accepted: long enough that the rate limit makes guessing it
/// hopeless.
pub const MIN_TOKEN_LEN: usize = 16;

/// Is `ip` a loopback address (IPv4-mapped `::ffff:127.x` included)?
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

impl ConsoleConfig {
    /// Checks the settings: a token is required unless `addr` is loopback, and a token that
    /// is given must be at least [`MIN_TOKEN_LEN`] characters. A token set to nothing is
    /// refused, not taken as none: that would open the console to every local user.
    pub fn new(addr: SocketAddr, token: Option<Secret>) -> Result<ConsoleConfig, ConfigError> {
        match token.as_ref().map(Secret::expose) {
            Some("") => {
                return Err(ConfigError(
                    "OUTBOXD_CONSOLE_TOKEN is set but holds no token (unset it to run without sign-in on loopback)".into(),
                ));
            }
            None if !is_loopback(addr.ip()) => {
                return Err(ConfigError(format!(
                    "OUTBOXD_CONSOLE_TOKEN is required when the console listens on {addr}, which is not a loopback address"
                )));
            }
            Some(t) if t.chars().count() < MIN_TOKEN_LEN => {
                return Err(ConfigError(format!(
                    "OUTBOXD_CONSOLE_TOKEN must be at least {MIN_TOKEN_LEN} characters"
                )));
            }
            _ => {}
        }
        Ok(ConsoleConfig {
            addr,
            token,
            session_ttl: Duration::from_secs(8 * 3600),
            secret_names: Some(std::collections::BTreeSet::new()),
        })
    }
}

/// What every handler shares.
pub(crate) struct App {
    pool: Pool,
    auth: auth::Auth,
    /// [`ConsoleConfig::secret_names`].
    secret_names: Option<std::collections::BTreeSet<String>>,
}

impl App {
    /// Does this console's environment hold the endpoint secret `name` (any case)? None
    /// when its secrets could not be read.
    fn has_secret(&self, name: &str) -> Option<bool> {
        self.secret_names
            .as_ref()
            .map(|names| names.contains(&name.to_ascii_uppercase()))
    }
}

type Shared = Arc<App>;

/// Most rows one action touches; an action on a larger filter takes the oldest this many
/// (the confirmation step says so) and can be repeated.
pub(crate) const MAX_ACTION_ROWS: usize = 500;

/// Rows per page of a listing.
pub(crate) const PAGE_SIZE: i64 = 50;

/// The strict policy: nothing but this origin's stylesheet, forms posting to this origin,
/// no script, no frames.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The router, for [`serve`] and for tests that drive it without a socket.
fn router(app: Shared) -> axum::Router {
    axum::Router::new()
        .route("/", get(overview::page))
        .route("/dead", get(dead::page))
        .route("/held", get(held::page))
        .route("/message/{id}", get(message::page))
        .route("/lookup", get(message::lookup))
        .route("/messages", get(messages::page))
        .route("/messages/{id}", get(message::page))
        .route("/endpoints", get(endpoints::page))
        .route("/action", post(action::post))
        .route("/destinations", get(destinations::list))
        .route(
            "/destinations/{host}",
            get(destinations::page).post(destinations::post),
        )
        .route("/channels", get(channels::page))
        .route("/channels/{channel}", post(channels::post))
        .route("/signin", get(signin::signin_page).post(signin::signin))
        .route("/signout", post(auth::signout))
        .route("/style.css", get(stylesheet))
        .fallback(not_found)
        // Forms are small; a bigger body is refused before it is read.
        .layer(DefaultBodyLimit::max(64 * 1024))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            auth::guard,
        ))
        .layer(axum::middleware::from_fn(security_headers))
        .with_state(app)
}

/// Binds the address, checks the database answers, and serves until SIGTERM or SIGINT.
/// `bound` is called with the address actually bound (port 0 picks one).
pub async fn serve(
    config: ConsoleConfig,
    pool: Pool,
    stop: tokio_util::sync::CancellationToken,
    bound: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| {
            ServeError::Config(ConfigError(format!(
                "--addr {}: cannot listen: {e}",
                config.addr
            )))
        })?;
    let local = listener
        .local_addr()
        .map_err(|e| ServeError::Config(ConfigError(format!("--addr: {e}"))))?;
    {
        let client = pool
            .get()
            .await
            .map_err(|e| ServeError::Database(crate::db::describe_pool(&e)))?;
        crate::db::ping(&client)
            .await
            .map_err(|e| ServeError::Database(crate::db::describe(&e)))?;
    }
    let secure = !is_loopback(local.ip());
    let app = Arc::new(App {
        pool,
        auth: auth::Auth::new(
            config.token.as_ref().map(Secret::expose),
            config.session_ttl,
            secure,
        ),
        secret_names: config.secret_names,
    });
    tracing::info!(addr = %local, signin_token = config.token.is_some(), "console listening");
    bound(local);
    accept_loop(listener, router(app), stop).await;
    Ok(())
}

/// Most connections served at once; past it new ones wait in the listen queue.
const MAX_CONNECTIONS: usize = 256;

/// How long a client may take to send a request's head, and how long an idle kept-alive
/// connection stays open.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one request may take in all: its body, the database's answers, the page.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a stop waits for requests in progress.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves connections until `stop`. Not `axum::serve`: it sets no timer, so hyper reads a
/// request's head for as long as the client cares to send it, and it takes every
/// connection offered; a client that opened connections and sent a byte now and then could
/// then hold the console (and its file descriptors) without signing in. Here the head must
/// come within [`HEADER_READ_TIMEOUT`], a request ends within [`REQUEST_TIMEOUT`], and at
/// most [`MAX_CONNECTIONS`] are served at once.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    stop: tokio_util::sync::CancellationToken,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: wait a moment rather than spin.
                    tracing::warn!(error = %e, "console: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let app = app.clone();
        let service =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut()
                    .insert(axum::extract::ConnectInfo(peer));
                let mut app = app.clone();
                async move {
                    let req = req.map(axum::body::Body::new);
                    // A Router is always ready: no poll_ready needed.
                    let call = tower_service::Service::call(&mut app, req);
                    match tokio::time::timeout(REQUEST_TIMEOUT, call).await {
                        Ok(res) => res,
                        Err(_) => Ok(timed_out()),
                    }
                }
            });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A client that goes away mid-request is no error of ours.
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("console: stopping with requests still in progress");
    }
}

/// The answer to a request that ran past [`REQUEST_TIMEOUT`].
fn timed_out() -> Response {
    let status = StatusCode::SERVICE_UNAVAILABLE;
    let line = "the request took too long; try again";
    let mut res = (status, layout::error_page(status, line)).into_response();
    // Made outside the router, so its headers are added here.
    add_security_headers(&mut res);
    res
}

/// Why the console could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Bad settings (exit 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The database or the server failed (exit 1).
    #[error("{0}")]
    Database(String),
}

/// Headers on every answer, error pages included.
async fn security_headers(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let mut res = next.run(req).await;
    add_security_headers(&mut res);
    res
}

fn add_security_headers(res: &mut Response) {
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
}

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        include_str!("style.css"),
    )
        .into_response()
}

async fn not_found() -> Response {
    Failure::NotFound("no such page".into()).into_response()
}

/// Why a request failed: a status and one line, rendered as the error page. The line is
/// escaped twice over: made one line of visible text ([`crate::text::escape`]) and
/// HTML-escaped by the template.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Bad input (400).
    BadRequest(String),
    /// A missing or wrong CSRF token (403).
    Forbidden(String),
    /// No such message or page (404).
    NotFound(String),
    /// The action was refused: a row in the wrong state (409).
    Refused(String),
    /// Too many sign-in attempts (429).
    TooMany(String),
    /// The database failed (503).
    Database(String),
}

impl Failure {
    fn db(e: &tokio_postgres::Error) -> Failure {
        Failure::Database(format!("database error: {}", crate::db::describe(e)))
    }

    fn pool(e: &deadpool_postgres::PoolError) -> Failure {
        Failure::Database(format!(
            "database unavailable: {}",
            crate::db::describe_pool(e)
        ))
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let (status, line) = match self {
            Failure::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            Failure::Forbidden(m) => (StatusCode::FORBIDDEN, m),
            Failure::NotFound(m) => (StatusCode::NOT_FOUND, m),
            Failure::Refused(m) => (StatusCode::CONFLICT, m),
            Failure::TooMany(m) => (StatusCode::TOO_MANY_REQUESTS, m),
            Failure::Database(m) => (StatusCode::SERVICE_UNAVAILABLE, m),
        };
        let line = crate::text::escape(&crate::deliver::one_line(&line)).into_owned();
        (status, layout::error_page(status, &line)).into_response()
    }
}

/// A pooled connection, or the error page.
async fn client(app: &App) -> Result<deadpool_postgres::Object, Failure> {
    app.pool.get().await.map_err(|e| Failure::pool(&e))
}

/// A value quoted in an error line: escaped, at most 40 characters (a hostile megabyte
/// comes back as its start).
pub(crate) fn quoted(s: &str) -> String {
    let short: String = s.chars().take(40).collect();
    let more = if s.chars().count() > 40 { "…" } else { "" };
    format!("{:?}{more}", crate::text::escape(&short))
}

/// The pairs of a query string or a form body (`application/x-www-form-urlencoded`).
pub(crate) fn pairs(raw: &[u8]) -> Vec<(String, String)> {
    url::form_urlencoded::parse(raw)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// The `channel` of a query or form, when given: one of the channels, else a one-line 400.
pub(crate) fn channel_field(
    q: &[(String, String)],
) -> Result<Option<crate::model::Channel>, Failure> {
    field(q, "channel")
        .map(|c| {
            crate::model::Channel::parse(c).ok_or_else(|| {
                Failure::BadRequest(format!(
                    "unknown channel {} (webhook, http or email)",
                    quoted(c)
                ))
            })
        })
        .transpose()
}

/// An action refused before it changed anything: a one-line 400 that says so.
pub(crate) fn bad(m: &str) -> Failure {
    Failure::BadRequest(format!("{m}; nothing changed"))
}

/// The first value of `name` among `pairs`, empty values as absent.
pub(crate) fn field<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}
