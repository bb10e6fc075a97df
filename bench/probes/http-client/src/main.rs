//! `http-client-probe MODE N CONCURRENCY URL [RATE]`: N POSTs of a 300 B JSON body with
//! outboxd's headers, CONCURRENCY at a time (and at most RATE a second when given: the
//! clients' CPU per request falls as the rate rises and more requests share each wake-up, so
//! compare them at the rate a drain runs at), through reqwest configured as outboxd's webhook
//! sender configures it (`MODE=reqwest`), through hyper-util's client directly
//! (`MODE=hyper`), or through hyper's HTTP/1 connections with no pool at all (`MODE=conn`:
//! each of the CONCURRENCY tasks opens one connection and sends all its requests on it, the
//! floor under any pool). Prints the rate and this process's CPU (user + system) per
//! request: what "hyper's client directly", then a pool of our own, could take off the
//! daemon. Plain HTTP to the nginx sink; connections kept alive.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const TIMEOUT: Duration = Duration::from_secs(10);

/// The process's user + system CPU so far, from /proc (clock ticks, 100 per second).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// The headers an outboxd webhook carries (values of the same sizes).
fn headers(i: usize) -> [(&'static str, String); 5] {
    [
        ("content-type", "application/json".into()),
        ("idempotency-key", format!("bench-{i:012}")),
        ("webhook-id", format!("msg_{i:024}")),
        ("webhook-timestamp", "1796000000".into()),
        ("webhook-signature", format!("v1,{}", "A".repeat(44))),
    ]
}

enum Sender {
    Reqwest(reqwest::Client),
    Hyper(HyperClient<HttpConnector, Full<Bytes>>),
    /// The sink's `host:port`; each task keeps its own connection.
    Conn(String),
}

/// One request on a connection of the task's own (opened on first use, opened again if
/// the server closed it).
async fn send_on_own_connection(
    conn: &mut Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>,
    authority: &str,
    url: &str,
    body: Bytes,
    i: usize,
) -> Result<u16, String> {
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        let tcp = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| e.to_string())?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        *conn = Some(sender);
    }
    let Some(sender) = conn.as_mut() else {
        return Err("no connection".into());
    };
    let path = url.split_once(authority).map(|(_, p)| p).unwrap_or("/");
    let req = hyper_post(path, Some(authority), body, i)?;
    status_of(async {
        sender.ready().await.map_err(|e| e.to_string())?;
        sender.send_request(req).await.map_err(|e| e.to_string())
    })
    .await
}

/// A POST of `body` with outboxd's headers, for hyper: `target` is the whole URL for
/// hyper-util's client, or the path with `host` for a connection of hyper's own.
fn hyper_post(
    target: &str,
    host: Option<&str>,
    body: Bytes,
    i: usize,
) -> Result<hyper::Request<Full<Bytes>>, String> {
    let mut rb = hyper::Request::post(target).header("user-agent", "outboxd/probe");
    if let Some(host) = host {
        rb = rb.header("host", host);
    }
    for (k, v) in headers(i) {
        rb = rb.header(k, v);
    }
    rb.body(Full::new(body)).map_err(|e| e.to_string())
}

/// The status of `response`, its body read to the end, all within [`TIMEOUT`].
async fn status_of(
    response: impl std::future::Future<Output = Result<hyper::Response<hyper::body::Incoming>, String>>,
) -> Result<u16, String> {
    let call = async {
        let resp = response.await?;
        let status = resp.status().as_u16();
        resp.into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        Ok::<u16, String>(status)
    };
    tokio::time::timeout(TIMEOUT, call)
        .await
        .map_err(|_| "timed out".to_string())?
}

impl Sender {
    async fn send(&self, url: &str, body: Bytes, i: usize) -> Result<u16, String> {
        match self {
            Sender::Reqwest(c) => {
                let mut rb = c.post(url);
                for (k, v) in headers(i) {
                    rb = rb.header(k, v);
                }
                let resp = rb.body(body).send().await.map_err(|e| e.to_string())?;
                let status = resp.status().as_u16();
                resp.bytes().await.map_err(|e| e.to_string())?;
                Ok(status)
            }
            Sender::Hyper(c) => {
                let req = hyper_post(url, None, body, i)?;
                status_of(async { c.request(req).await.map_err(|e| e.to_string()) }).await
            }
            Sender::Conn(_) => Err("a connection of the task's own: see the task loop".into()),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: http-client-probe reqwest|hyper|conn N CONCURRENCY URL [RATE]";
    let (mode, n, conc, url, rate) = match args.as_slice() {
        [_, mode, n, conc, url] => (mode, n, conc, url, None),
        [_, mode, n, conc, url, rate] => (mode, n, conc, url, Some(rate)),
        _ => return Err(usage.into()),
    };
    let rate: Option<f64> = match rate {
        Some(r) => Some(r.parse().map_err(|_| usage.to_string())?),
        None => None,
    };
    let n: usize = n.parse().map_err(|_| usage.to_string())?;
    let conc: usize = conc.parse().map_err(|_| usage.to_string())?;
    let sender = match mode.as_str() {
        // As src/deliver/webhook/mod.rs builds it (its DNS resolver aside: the sink is an
        // address literal, which reqwest does not resolve).
        "reqwest" => Sender::Reqwest(
            reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .retry(reqwest::retry::never().max_retries_per_request(0))
                .no_proxy()
                .timeout(TIMEOUT)
                .connect_timeout(TIMEOUT / 2)
                .pool_idle_timeout(Duration::from_secs(30))
                .tcp_nodelay(true)
                .user_agent("outboxd/probe")
                .build()
                .map_err(|e| e.to_string())?,
        ),
        "hyper" => {
            let mut conn = HttpConnector::new();
            conn.set_nodelay(true);
            conn.set_connect_timeout(Some(TIMEOUT / 2));
            Sender::Hyper(
                HyperClient::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(30))
                    .build(conn),
            )
        }
        "conn" => {
            let authority = url
                .strip_prefix("http://")
                .and_then(|rest| rest.split('/').next())
                .ok_or("conn: the URL must be http://HOST:PORT/…")?;
            Sender::Conn(authority.to_string())
        }
        _ => return Err(usage.into()),
    };
    let sender = Arc::new(sender);
    let body = Bytes::from(format!(
        r#"{{"event":"bench","pad":"{}"}}"#,
        "x".repeat(272)
    ));
    let next = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    // Warm the pool: one round of CONCURRENCY requests outside the clock.
    let run = |count: usize| {
        let mut tasks = tokio::task::JoinSet::new();
        next.store(0, Ordering::SeqCst);
        let start = tokio::time::Instant::now();
        for _ in 0..conc {
            let (sender, body, next, failed, url) = (
                sender.clone(),
                body.clone(),
                next.clone(),
                failed.clone(),
                url.clone(),
            );
            tasks.spawn(async move {
                let mut own = None;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    if let Some(rate) = rate {
                        let at = start + Duration::from_secs_f64(i as f64 / rate);
                        tokio::time::sleep_until(at).await;
                    }
                    let sent = match &*sender {
                        Sender::Conn(authority) => {
                            send_on_own_connection(&mut own, authority, &url, body.clone(), i).await
                        }
                        other => other.send(&url, body.clone(), i).await,
                    };
                    if !matches!(sent, Ok(s) if s < 300) {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        tasks
    };
    run(conc).join_all().await;
    let (t0, c0) = (Instant::now(), cpu_seconds());
    run(n).join_all().await;
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    println!(
        "{mode}: {n} requests in {wall:.2} s, {:.0}/s, {:.1} µs CPU per request, {} failed",
        n as f64 / wall,
        cpu * 1e6 / n as f64,
        failed.load(Ordering::SeqCst)
    );
    Ok(())
}
