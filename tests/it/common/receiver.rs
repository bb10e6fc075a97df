//! An HTTP receiver on 127.0.0.1:0 that records every request (any method: the worker's
//! reconciliation lookups are GETs) and answers from a script (Svix's TestReceiver is the
//! model): a status, extra headers, a stall, a body, or a body that floods or never ends.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A status with no body.
    Status(u16),
    /// A status with headers.
    WithHeaders(u16, Vec<(&'static str, String)>),
    /// Wait this long, then answer 200 (used to outlast the worker's timeout).
    Stall(Duration),
    /// Wait this long, then answer this status (a slow failing receiver).
    Slow(Duration, u16),
    /// A status with a body and, if given, a content type.
    Body(u16, Option<&'static str>, Vec<u8>),
    /// 200 and a body that never ends: a chunk every 20 ms, forever.
    Endless,
    /// 200 and a body of this many bytes, sent as fast as the reader takes it; the bytes
    /// actually produced are counted ([`Receiver::streamed`]).
    Flood(u64),
}

/// A recorded request.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub at: Instant,
}

impl Recorded {
    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }
}

#[derive(Default)]
struct State {
    script: VecDeque<Reply>,
    default: Option<Reply>,
    requests: Vec<Recorded>,
    /// Requests being answered now, and the most there ever were at once.
    inflight: usize,
    max_inflight: usize,
}

/// One request being answered, from its arrival until the handler has its answer (for a
/// streamed body, before the body is sent): counted in [`State::inflight`] meanwhile. The
/// worker sees the answer later still, so the receiver never counts more requests at once
/// than the worker had in flight.
struct Answering(Arc<Mutex<State>>);

impl Drop for Answering {
    fn drop(&mut self) {
        let mut s = self.0.lock().unwrap();
        s.inflight = s.inflight.saturating_sub(1);
    }
}

/// The receiver; dropped with the test's runtime.
#[derive(Clone)]
pub struct Receiver {
    pub addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    streamed: Arc<AtomicU64>,
}

impl Receiver {
    /// Starts a receiver answering 204 unless scripted otherwise.
    pub async fn start() -> Receiver {
        let state = Arc::new(Mutex::new(State::default()));
        let streamed = Arc::new(AtomicU64::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let st = state.clone();
        let count = streamed.clone();
        let app = axum::Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let st = st.clone();
                let count = count.clone();
                async move { handle(st, count, method, uri, headers, body).await }
            },
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver {
            addr,
            state,
            streamed,
        }
    }

    /// Bytes of [`Reply::Flood`] and [`Reply::Endless`] bodies produced so far (a chunk is
    /// counted when the server hands it to the connection).
    pub fn streamed(&self) -> u64 {
        self.streamed.load(Ordering::SeqCst)
    }

    /// Requests with this method.
    pub fn requests_with(&self, method: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.method.as_str() == method)
            .collect()
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Queues answers for the next requests (in order).
    pub fn script(&self, replies: impl IntoIterator<Item = Reply>) {
        self.state.lock().unwrap().script.extend(replies);
    }

    /// The answer once the script is used up (204 by default).
    pub fn set_default(&self, reply: Reply) {
        self.state.lock().unwrap().default = Some(reply);
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().unwrap().requests.clone()
    }

    /// Requests carrying this idempotency key.
    pub fn requests_for(&self, key: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.header("idempotency-key").as_deref() == Some(key))
            .collect()
    }

    /// The most requests that were being answered at once.
    pub fn max_inflight(&self) -> usize {
        self.state.lock().unwrap().max_inflight
    }

    /// Waits until at least `n` requests arrived.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Recorded> {
        let this = self.clone();
        super::wait_until(
            timeout,
            &format!("{n} requests at the receiver"),
            move || {
                let this = this.clone();
                async move { this.requests().len() >= n }
            },
        )
        .await;
        self.requests()
    }
}

async fn handle(
    st: Arc<Mutex<State>>,
    streamed: Arc<AtomicU64>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let _answering = Answering(st.clone());
    let reply = {
        let mut s = st.lock().unwrap();
        s.inflight += 1;
        s.max_inflight = s.max_inflight.max(s.inflight);
        s.requests.push(Recorded {
            method,
            uri,
            headers,
            body,
            at: Instant::now(),
        });
        s.script
            .pop_front()
            .or_else(|| s.default.clone())
            .unwrap_or(Reply::Status(204))
    };
    match reply {
        Reply::Status(code) => StatusCode::from_u16(code).unwrap().into_response(),
        Reply::WithHeaders(code, headers) => {
            let mut resp = StatusCode::from_u16(code).unwrap().into_response();
            for (k, v) in headers {
                resp.headers_mut().insert(k, v.parse().unwrap());
            }
            resp
        }
        Reply::Stall(d) => {
            tokio::time::sleep(d).await;
            StatusCode::OK.into_response()
        }
        Reply::Slow(d, code) => {
            tokio::time::sleep(d).await;
            StatusCode::from_u16(code).unwrap().into_response()
        }
        Reply::Body(code, content_type, body) => {
            let mut resp = (StatusCode::from_u16(code).unwrap(), body).into_response();
            match content_type {
                Some(ct) => {
                    resp.headers_mut()
                        .insert("content-type", ct.parse().unwrap());
                }
                None => {
                    resp.headers_mut().remove("content-type");
                }
            }
            resp
        }
        Reply::Endless => {
            let chunks = futures_util::stream::unfold(streamed, |count| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                count.fetch_add(16, Ordering::SeqCst);
                Some((
                    Ok::<_, std::io::Error>(Bytes::from_static(b"still going.....")),
                    count,
                ))
            });
            Response::new(Body::from_stream(chunks))
        }
        Reply::Flood(total) => {
            const CHUNK: u64 = 16 * 1024;
            let chunks =
                futures_util::stream::unfold((streamed, total), |(count, left)| async move {
                    if left == 0 {
                        return None;
                    }
                    let n = left.min(CHUNK);
                    count.fetch_add(n, Ordering::SeqCst);
                    let chunk = Bytes::from(vec![b'f'; n as usize]);
                    Some((Ok::<_, std::io::Error>(chunk), (count, left - n)))
                });
            Response::new(Body::from_stream(chunks))
        }
    }
}
