//! A provider's stand-in: an HTTP/1.1 server on 127.0.0.1:0 that records every request and
//! answers it through a handler of the test's own, which plays the provider's documented
//! behaviour (its memory of idempotency keys, its lookups, its errors). Unlike the axum
//! receivers, the handler may also drop the connection after reading a whole request
//! without a byte of answer ([`Answer::Drop`]): an answer lost after the provider acted.

#![allow(dead_code, clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as the provider saw it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// The path, still percent-encoded.
    pub path: String,
    /// The query string, still encoded.
    pub query: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// When the whole request had arrived.
    pub at: Instant,
}

impl Request {
    /// A header's value (names compare without regard to case).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }

    /// The query's pairs, decoded.
    pub fn query_pairs(&self) -> Vec<(String, String)> {
        url::form_urlencoded::parse(self.query.as_deref().unwrap_or("").as_bytes())
            .into_owned()
            .collect()
    }

    /// One query parameter, decoded.
    pub fn query_param(&self, name: &str) -> Option<String> {
        self.query_pairs()
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    /// The body's form pairs, decoded.
    pub fn form(&self) -> Vec<(String, String)> {
        url::form_urlencoded::parse(&self.body)
            .into_owned()
            .collect()
    }

    /// One form field, decoded.
    pub fn form_field(&self, name: &str) -> Option<String> {
        self.form()
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    /// `METHOD /path`, for listing calls in assertions.
    pub fn call(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

/// What the stand-in does with one request.
#[derive(Debug, Clone)]
pub enum Answer {
    /// Answer with a status, a content type, extra headers and a body.
    Reply {
        status: u16,
        content_type: &'static str,
        headers: Vec<(&'static str, String)>,
        body: Vec<u8>,
    },
    /// Reset the connection without answering (after the whole request was read).
    Drop,
}

impl Answer {
    /// A JSON answer.
    pub fn json(status: u16, body: &serde_json::Value) -> Answer {
        Answer::Reply {
            status,
            content_type: "application/json",
            headers: Vec::new(),
            body: body.to_string().into_bytes(),
        }
    }

    /// A plain-text answer.
    pub fn text(status: u16, body: &str) -> Answer {
        Answer::Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    /// The same answer with one more header.
    pub fn with_header(self, name: &'static str, value: &str) -> Answer {
        match self {
            Answer::Reply {
                status,
                content_type,
                mut headers,
                body,
            } => {
                headers.push((name, value.to_owned()));
                Answer::Reply {
                    status,
                    content_type,
                    headers,
                    body,
                }
            }
            Answer::Drop => Answer::Drop,
        }
    }
}

type Handler = dyn Fn(&Request) -> Answer + Send + Sync;

/// The stand-in; it serves until the test's runtime ends.
#[derive(Clone)]
pub struct StandIn {
    pub addr: std::net::SocketAddr,
    seen: Arc<Mutex<Vec<Request>>>,
}

impl StandIn {
    /// Starts a stand-in that answers every request with `handler`.
    pub async fn start(handler: impl Fn(&Request) -> Answer + Send + Sync + 'static) -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        StandIn::serve(listener, handler)
    }

    /// Serves on `listener` (bound by the caller: a port that refused connections first).
    pub fn serve(
        listener: TcpListener,
        handler: impl Fn(&Request) -> Answer + Send + Sync + 'static,
    ) -> StandIn {
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Request>>> = Arc::default();
        let handler: Arc<Handler> = Arc::new(handler);
        let s = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(connection(stream, handler.clone(), s.clone()));
            }
        });
        StandIn { addr, seen }
    }

    /// `http://127.0.0.1:PORT`: what a recipe's `https://api.provider.com` becomes.
    pub fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<Request> {
        self.seen.lock().unwrap().clone()
    }

    /// `METHOD /path` of every request so far.
    pub fn calls(&self) -> Vec<String> {
        self.seen().iter().map(Request::call).collect()
    }

    /// Waits until at least `n` requests arrived.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Request> {
        let this = self.clone();
        super::wait_until(
            timeout,
            &format!("{n} requests at the stand-in"),
            move || {
                let this = this.clone();
                async move { this.seen().len() >= n }
            },
        )
        .await;
        self.seen()
    }
}

async fn connection(mut stream: TcpStream, handler: Arc<Handler>, seen: Arc<Mutex<Vec<Request>>>) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or("").split(' ');
        let method = first.next().unwrap_or("").to_owned();
        let target = first.next().unwrap_or("").to_owned();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let len: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = buf[head_end..head_end + len].to_vec();
        buf.drain(..head_end + len);
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
            None => (target, None),
        };
        let request = Request {
            method,
            path,
            query,
            headers,
            body,
            at: Instant::now(),
        };
        seen.lock().unwrap().push(request.clone());
        match handler(&request) {
            Answer::Drop => {
                let _ = stream.set_zero_linger();
                return;
            }
            Answer::Reply {
                status,
                content_type,
                headers,
                body,
            } => {
                let mut head = format!(
                    "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n",
                    reason(status),
                    body.len()
                );
                for (k, v) in headers {
                    head.push_str(&format!("{k}: {v}\r\n"));
                }
                head.push_str("\r\n");
                let mut out = head.into_bytes();
                out.extend_from_slice(&body);
                if stream.write_all(&out).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        409 => "Conflict",
        410 => "Gone",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}
