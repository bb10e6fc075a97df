//! A TCP proxy in front of PostgreSQL that loses one answer: the first time the server's
//! bytes to a client carry a marker, they are dropped and that connection is closed both
//! ways, as a network cut or a server crash right after a commit would leave it. Every
//! other connection, and every later answer, passes untouched, unless the cut is followed
//! by an outage (see [`Cutter::start`]): then, as a server restarting, every
//! connection is closed at the cut and new ones are closed at once until it ends.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

pub struct Cutter {
    pub port: u16,
    cut: Arc<Cut>,
    task: tokio::task::JoinHandle<()>,
}

/// What every relay of one proxy shares.
struct Cut {
    /// Whether the answer has been cut.
    done: AtomicBool,
    /// How long the server is away after the cut.
    outage: Duration,
    /// When the cut happened.
    at: Mutex<Option<Instant>>,
    /// Ends every relay at the cut, when there is an outage.
    all: Notify,
}

impl Cutter {
    /// Proxies 127.0.0.1:`port` to `upstream`, cutting the first answer that holds `marker`,
    /// and then, for a non-zero `outage`, the server away that long: every connection
    /// closed at the cut, and each new one closed as soon as it is accepted until the
    /// outage ends.
    pub async fn start(
        upstream: SocketAddr,
        marker: impl Into<Vec<u8>>,
        outage: Duration,
    ) -> Cutter {
        let marker: Arc<[u8]> = marker.into().into();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(Cut {
            done: AtomicBool::new(false),
            outage,
            at: Mutex::new(None),
            all: Notify::new(),
        });
        let shared = cut.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let away = shared
                    .at
                    .lock()
                    .unwrap()
                    .is_some_and(|at| at.elapsed() < shared.outage);
                if away {
                    drop(client);
                    continue;
                }
                let shared = shared.clone();
                let marker = marker.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(client, server, marker, shared).await;
                    }
                });
            }
        });
        Cutter { port, cut, task }
    }

    /// Whether the answer has been cut.
    pub fn has_cut(&self) -> bool {
        self.cut.done.load(Ordering::SeqCst)
    }
}

impl Drop for Cutter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: TcpStream, server: TcpStream, marker: Arc<[u8]>, cut: Arc<Cut>) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    };
    let down = async {
        // The last bytes of the previous read too, so that a marker split between two
        // reads is still seen.
        let mut seen: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from_server.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let keep = seen.len().saturating_sub(marker.len());
            seen.drain(..keep);
            seen.extend_from_slice(&buf[..n]);
            if !cut.done.load(Ordering::SeqCst)
                && seen.windows(marker.len()).any(|w| w == &marker[..])
                && !cut.done.swap(true, Ordering::SeqCst)
            {
                if !cut.outage.is_zero() {
                    *cut.at.lock().unwrap() = Some(Instant::now());
                    cut.all.notify_waiters();
                }
                return;
            }
            if to_client.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Whichever side ends first ends both: the halves are dropped, the sockets closed.
    let all = cut.all.notified();
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = all => {}
    }
}
