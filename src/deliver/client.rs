//! The HTTP client of webhooks: hyper's, with nothing between it and the request.
//!
//! Why not `reqwest`: measured side by side on the same sink (`bench/probes/http-client`,
//! 40 000 POSTs of 300 B, 64 in flight), reqwest configured as the webhook sender needs it
//! cost about twice the CPU per request of hyper's client directly: reqwest's layers (its
//! redirect and retry services, two URL parses per request, a clone of the inner client
//! per request) cost more than the HTTP/1 exchange itself, and the delivery does not use
//! what they are for. What reqwest did for us is done here, each piece on purpose:
//!
//! * the destination guard on every address a name resolves to ([`GuardedResolver`], a
//!   resolver of hyper-util's connector); a literal address is checked before the request
//!   (`WebhookSender::check_literal_host`);
//! * TLS by rustls with the platform's verifier, the stack lettre uses;
//! * a connect timeout over the TCP connect and the TLS handshake together (a connect that
//!   times out sent nothing: transient), and the attempt's deadline over the request and
//!   the response's body (the caller's);
//! * no redirects (hyper follows none), no proxy (hyper knows none), no retry of a request
//!   that was written (hyper-util retries only a request that never left, on a pooled
//!   connection found closed);
//! * `user-agent` and `accept: */*` unless the payload's headers set them, and
//!   credentials in the URL sent as HTTP Basic authentication (unless the payload sets
//!   `authorization` itself), never as part of the request line; credentials that are not
//!   UTF-8 once decoded make the message `invalid` (reqwest sent such a request without
//!   them);
//! * TCP keepalive (15 s, 3 probes) and `TCP_USER_TIMEOUT` (30 s), reqwest's defaults, and
//!   ALPN `http/1.1`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::deliver::guard::GuardedResolver;
use crate::model::ConfigError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Connector = ConnectTimeout<HttpsConnector<HttpConnector<GuardedResolver>>>;

/// A response whose body has not been read yet.
pub type Response = hyper::Response<hyper::body::Incoming>;

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The request could not be built from the payload's parts (nothing was sent).
    #[error("cannot build the request: {0}")]
    Build(String),
    /// The attempt's deadline passed before the response's head arrived, after hyper had
    /// begun writing the request's body: the receiver may have the whole request.
    #[error("timed out")]
    TimedOut,
    /// The attempt's deadline passed before hyper asked for the request's body: still
    /// connecting (a lookup before it had taken most of the time), or waiting for a
    /// connection. A receiver cannot act on a request whose body it never got.
    #[error("timed out before the request was sent")]
    TimedOutUnsent,
    /// The client's error: connecting, writing or reading (the chain says which).
    #[error(transparent)]
    Client(#[from] hyper_util::client::legacy::Error),
}

/// The connect step timed out (TCP and TLS together).
#[derive(Debug, thiserror::Error)]
#[error("connect timed out after {0:?}")]
pub struct ConnectTimedOut(Duration);

/// The shared client: one keep-alive pool per destination, clones share it.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<Connector, Tracked>,
    user_agent: HeaderValue,
}

impl HttpClient {
    /// A client whose connections resolve names through `resolver` and give up connecting
    /// after `connect_timeout`.
    pub fn new(resolver: GuardedResolver, connect_timeout: Duration) -> Result<Self, ConfigError> {
        use rustls_platform_verifier::BuilderVerifierExt as _;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_platform_verifier())
            .map_err(|e| ConfigError(format!("cannot set up TLS for webhooks: {e}")))?
            .with_no_client_auth();
        // Offered as reqwest offered it (HTTP/1 only): a server that requires ALPN, or
        // knows its clients by their handshake, sees the same ClientHello.
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut http = HttpConnector::new_with_resolver(resolver);
        // The TLS layer above takes https URIs through this connector.
        http.enforce_http(false);
        http.set_nodelay(true);
        // Per address (hyper-util splits it among a name's addresses, so one that drops
        // packets does not take the whole budget); the wrapper below bounds TCP and TLS
        // together.
        http.set_connect_timeout(Some(connect_timeout));
        // reqwest's defaults: a pooled connection that died (a NAT or a firewall forgot it)
        // is found by the keepalive probes while it is idle, not by the next request after
        // it was written (which would be ambiguous).
        http.set_keepalive(Some(Duration::from_secs(15)));
        http.set_keepalive_interval(Some(Duration::from_secs(15)));
        http.set_keepalive_retries(Some(3));
        #[cfg(target_os = "linux")]
        http.set_tcp_user_timeout(Some(Duration::from_secs(30)));
        // Plain http through the inner connector, https with TLS (not forced).
        let https = HttpsConnector::from((http, tls));
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_timer(TokioTimer::new())
            .build(ConnectTimeout {
                inner: https,
                timeout: connect_timeout,
            });
        Ok(HttpClient {
            inner,
            user_agent: HeaderValue::from_static(concat!("outboxd/", env!("CARGO_PKG_VERSION"))),
        })
    }

    /// Sends one request and waits for its response's head until `deadline`.
    pub async fn send(
        &self,
        method: Method,
        url: &url::Url,
        mut headers: HeaderMap,
        body: Bytes,
        deadline: tokio::time::Instant,
    ) -> Result<Response, SendError> {
        let (uri, basic) = target(url)?;
        // The payload's own `authorization`, if it has one, wins (as with curl and
        // reqwest).
        if let Some(auth) = basic {
            headers.entry(header::AUTHORIZATION).or_insert(auth);
        }
        headers
            .entry(header::USER_AGENT)
            .or_insert_with(|| self.user_agent.clone());
        headers
            .entry(header::ACCEPT)
            .or_insert_with(|| HeaderValue::from_static("*/*"));
        // An empty body is never asked for, and a head too large for hyper's write buffer
        // is flushed before the body is asked for (a receiver could act on a head alone):
        // neither can tell sent from unsent, so such a request times out as sent (the
        // careful side).
        let head_len: usize = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum();
        let can_tell = !body.is_empty() && head_len + url.as_str().len() < SMALL_HEAD;
        let asked = Arc::new(AtomicBool::new(false));
        let mut req = hyper::Request::new(Tracked {
            inner: Full::new(body),
            asked: asked.clone(),
        });
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        match tokio::time::timeout_at(deadline, self.inner.request(req)).await {
            Ok(r) => Ok(r?),
            Err(_) if can_tell && !asked.load(Ordering::Acquire) => Err(SendError::TimedOutUnsent),
            Err(_) => Err(SendError::TimedOut),
        }
    }
}

/// A request head this much smaller than hyper's write buffer (400 KiB) is buffered whole
/// before the body is asked for.
const SMALL_HEAD: usize = 64 * 1024;

/// The request's body, which notes when hyper first asks for it. hyper's HTTP/1 client
/// asks for the body only on a connection it is writing the request to, before it flushes
/// anything but (for a very large head) the head: until then the receiver cannot hold the
/// whole request, so a deadline passed before is a request never sent (transient), where
/// one passed after may have been acted on (ambiguous).
#[derive(Debug)]
pub struct Tracked {
    inner: Full<Bytes>,
    asked: Arc<AtomicBool>,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.asked.store(true, Ordering::Release);
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The request's URI (scheme, host, port, path and query: no credentials, no fragment),
/// and the credentials of the URL, if any, as a Basic `authorization` value (percent-
/// decoded, as curl and reqwest send them).
fn target(url: &url::Url) -> Result<(Uri, Option<HeaderValue>), SendError> {
    let credentials = !url.username().is_empty() || url.password().is_some();
    let text: std::borrow::Cow<'_, str> = if credentials {
        format!(
            "{}://{}",
            url.scheme(),
            &url[url::Position::BeforeHost..url::Position::AfterQuery]
        )
        .into()
    } else {
        // Without credentials the URL's own text up to its query is that text already:
        // no copy to make (every webhook request comes here).
        url[..url::Position::AfterQuery].into()
    };
    let uri = Uri::try_from(text.as_ref())
        .map_err(|e| SendError::Build(format!("the URL is not a valid request target ({e})")))?;
    if !credentials {
        return Ok((uri, None));
    }
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| SendError::Build("the URL's credentials are not UTF-8".into()))
    };
    let user = decode(url.username())?;
    let password = url.password().map(decode).transpose()?;
    use base64::Engine as _;
    let plain = format!("{user}:{}", password.unwrap_or_default());
    let mut value = HeaderValue::try_from(format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(plain)
    ))
    .map_err(|_| SendError::Build("the URL's credentials cannot be sent".into()))?;
    value.set_sensitive(true);
    Ok((uri, Some(value)))
}

/// A connector that gives up after `timeout`: hyper-util's own connect timeout covers the
/// TCP connect only, not the TLS handshake after it.
#[derive(Clone, Debug)]
pub struct ConnectTimeout<C> {
    inner: C,
    timeout: Duration,
}

impl<C> tower_service::Service<Uri> for ConnectTimeout<C>
where
    C: tower_service::Service<Uri, Error = BoxError>,
    C::Future: Send + 'static,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let timeout = self.timeout;
        let connecting = self.inner.call(dst);
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(r) => r,
                Err(_) => Err(Box::new(ConnectTimedOut(timeout)) as BoxError),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_target_has_no_credentials_and_no_fragment() {
        let url = url::Url::parse("https://Al%20ice:p%40ss@Example.com:8443/a/b?x=1&y=%20#frag")
            .expect("valid");
        let (uri, auth) = target(&url).expect("target");
        assert_eq!(uri.to_string(), "https://example.com:8443/a/b?x=1&y=%20");
        let auth = auth.expect("credentials");
        assert!(auth.is_sensitive());
        use base64::Engine as _;
        let encoded = auth.to_str().expect("ascii").trim_start_matches("Basic ");
        let plain = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .expect("base64");
        assert_eq!(plain, b"Al ice:p@ss");

        let (uri, auth) = target(&url::Url::parse("http://[::1]/h").expect("valid")).expect("v6");
        assert_eq!(uri.to_string(), "http://[::1]/h");
        assert!(auth.is_none());
        let (_, auth) = target(&url::Url::parse("http://u@h.example/").expect("valid")).expect("u");
        assert!(auth.is_some(), "a user without a password is still sent");

        // Without credentials the URL's own text is used: the same target the copy gave.
        for text in [
            "http://@h.example/p",
            "http://:@h.example/p?q",
            "HTTPS://H.Example:443/a/../b?c=%20#f",
            "http://[::FFFF:1.2.3.4]:80/",
            "http://bücher.example/p?€=€",
            "https://h.example",
        ] {
            let url = url::Url::parse(text).expect("valid");
            let (uri, auth) = target(&url).expect("target");
            assert!(auth.is_none(), "{text}");
            let copied = format!(
                "{}://{}",
                url.scheme(),
                &url[url::Position::BeforeHost..url::Position::AfterQuery]
            );
            assert_eq!(
                uri.to_string(),
                copied.parse::<Uri>().expect("uri").to_string(),
                "{text}"
            );
        }
    }

    /// Hostile URLs the payload rules accept: every one gives a target or a one-line
    /// `Build` error, never a panic, and no target carries credentials, whitespace or a
    /// control character (the request line cannot be split or smuggled through).
    #[test]
    fn hostile_urls_give_a_clean_target_or_an_error() {
        let long = format!("https://h.example/{}", "a".repeat(70_000));
        let urls = [
            "http://h.example/a|b^c[d]e{f}g`h\\i",
            "http://h.example/?q=\"x\"&r=<s>&t='u'",
            "http://h.example/\t\r\nX-Injected: 1",
            "http://h.example/%0d%0aX-Injected:%201",
            "http://h.example/\u{0}\u{1b}[31m\u{202e}",
            "http://h.example:65535/",
            "http://xn--bcher-kva.example/p?€=€",
            "http://bücher.example/p",
            "http://[::ffff:1.2.3.4]:81/",
            "http://u%0d%0a:p%0aX@h.example/",
            "http://:@h.example/",
            long.as_str(),
        ];
        for raw in urls {
            let Ok(url) = url::Url::parse(raw) else {
                continue;
            };
            match target(&url) {
                Ok((uri, auth)) => {
                    let s = uri.to_string();
                    assert!(
                        !s.chars().any(|c| c.is_whitespace() || c.is_control()),
                        "{s:?}"
                    );
                    assert!(!s.contains('@'), "{s:?}");
                    if let Some(a) = auth {
                        assert!(a.to_str().is_ok_and(|v| v.starts_with("Basic ")));
                    }
                }
                Err(SendError::Build(why)) => {
                    assert!(!why.contains('\n') && !why.contains("h.example"), "{why}");
                }
                Err(other) => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn credentials_that_are_not_text_are_refused_not_sent() {
        let url = url::Url::parse("http://%ff:x@h.example/").expect("valid");
        assert!(matches!(target(&url), Err(SendError::Build(_))));
    }
}
