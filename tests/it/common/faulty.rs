//! A fault-injecting HTTP/1.1 server on 127.0.0.1:0 for what a real receiver will not do on
//! demand: reset the connection before or after reading the request, or stall. Each request
//! is answered by a script function of (idempotency key, how many requests that key has
//! made so far, counting from 1).

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the server does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status (and `Retry-After: 1` for 429 and 503 when `retry_after`).
    Status(u16, bool),
    /// Read the request, then wait this long before answering 200.
    Stall(Duration),
    /// Read only the request line, then reset the connection (RST).
    ResetBeforeBody,
    /// Read the whole request, then reset the connection without answering.
    ResetAfterRequest,
}

type Script = dyn Fn(&str, usize) -> Fault + Send + Sync;

/// The server.
#[derive(Clone)]
pub struct Faulty {
    pub addr: std::net::SocketAddr,
    counts: Arc<Mutex<HashMap<String, usize>>>,
}

impl Faulty {
    /// Starts the server with its script.
    pub async fn start(script: impl Fn(&str, usize) -> Fault + Send + Sync + 'static) -> Faulty {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let script: Arc<Script> = Arc::new(script);
        let c = counts.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, script.clone(), c.clone()));
            }
        });
        Faulty { addr, counts }
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Requests seen per key (a reset-before-body request counts too).
    pub fn count(&self, key: &str) -> usize {
        self.counts.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

async fn serve(
    mut stream: TcpStream,
    script: Arc<Script>,
    counts: Arc<Mutex<HashMap<String, usize>>>,
) {
    let mut buf = Vec::new();
    loop {
        // Read the head.
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let header = |name: &str| {
            head.lines()
                .find_map(|l| {
                    l.split_once(':')
                        .filter(|(k, _)| k.trim().eq_ignore_ascii_case(name))
                })
                .map(|(_, v)| v.trim().to_owned())
        };
        let key = header("idempotency-key").unwrap_or_default();
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let nth = {
            let mut c = counts.lock().unwrap();
            let n = c.entry(key.clone()).or_default();
            *n += 1;
            *n
        };
        let fault = script(&key, nth);
        if fault == Fault::ResetBeforeBody {
            let _ = stream.set_zero_linger();
            return;
        }
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_end + len);
        let response = match fault {
            Fault::ResetAfterRequest => {
                let _ = stream.set_zero_linger();
                return;
            }
            Fault::Stall(d) => {
                tokio::time::sleep(d).await;
                "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_owned()
            }
            Fault::Status(code, retry_after) => {
                let extra = if retry_after && (code == 429 || code == 503) {
                    "retry-after: 1\r\n"
                } else {
                    ""
                };
                format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\n{extra}\r\n")
            }
            Fault::ResetBeforeBody => unreachable!(),
        };
        if stream.write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
