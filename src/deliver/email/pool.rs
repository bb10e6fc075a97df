//! The relay's connections: one slot per connection that may be open, idle connections
//! kept for reuse (checkout, checkin), and opening a new one (connect, STARTTLS, AUTH).
//!
//! Not `deadpool::managed`: its `get` waits for a slot and opens the connection in one
//! call, and the worker needs the two apart — the slot wait outside the attempt's timeout,
//! the connect inside it, and the lease-fit check between them (ARCHITECTURE.md,
//! "Decisions worth knowing").

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lettre::transport::smtp::authentication::{Credentials, Mechanism};
use lettre::transport::smtp::client::{AsyncSmtpConnection, TlsParameters};
use lettre::transport::smtp::commands::Rset;
use lettre::transport::smtp::extension::ClientId;
use tokio::sync::Semaphore;

use super::reply::{Phase, connection_error, from_smtp_error};
use crate::deliver::DeliveryError;
use crate::deliver::email::settings::SmtpTls;
use crate::model::ErrorClass;
use crate::support::lock;

/// How long an idle connection is kept for reuse. Relays close idle sessions after a few
/// minutes (Postfix: 300 s); a minute keeps most reused connections alive.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// What every clone of an [`super::EmailSender`] shares: how to reach the relay, and the pool.
pub(super) struct Inner {
    /// Host name or IP address of the relay.
    pub(super) host: String,
    /// Its port.
    pub(super) port: u16,
    /// `host:port`, for error messages.
    pub(super) relay: String,
    /// How connections are secured.
    pub(super) tls: SmtpTls,
    /// Built once: the rustls configuration with the platform's roots.
    pub(super) tls_params: Option<TlsParameters>,
    /// AUTH credentials, when the URL has them.
    pub(super) credentials: Option<Credentials>,
    /// Our name in EHLO.
    pub(super) hello: ClientId,
    /// The whole attempt's deadline.
    pub(super) timeout: Duration,
    /// `OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN`.
    pub(super) message_id_domain: Option<String>,
    /// One permit per connection in use; bounds the connections open at once.
    pub(super) slots: Semaphore,
    /// Connections between transactions, newest last.
    pub(super) idle: Mutex<Vec<IdleConnection>>,
    /// Most connections open at once, and most idle connections kept.
    pub(super) max_connections: usize,
}

/// The right to open or reuse one of the relay's connections for one attempt.
pub struct SmtpSlot<'a> {
    pub(super) _permit: tokio::sync::SemaphorePermit<'a>,
}

/// A pooled connection.
pub(super) struct IdleConnection {
    pub(super) conn: AsyncSmtpConnection,
    pub(super) since: Instant,
    /// A transaction was abandoned on it (refused recipients): it needs RSET first.
    pub(super) dirty: bool,
}

/// How one attempt's transaction ended, before the connection goes back to the pool.
pub(super) enum Ended {
    /// Keep the connection: clean, or `dirty` when a transaction was abandoned on it.
    Reusable { dirty: bool },
    /// Close it.
    Broken,
}

/// Connects to the first of `addrs` that answers, each tried in turn with its share of the
/// attempt's `timeout`. lettre tries every address of a name with the timeout it is given,
/// so with the whole timeout one address that drops packets (an IPv6 route that goes
/// nowhere, a relay taken out of service) spent the attempt and the next was never tried.
/// A share of at least a second: a SYN lost once is resent after one.
pub(super) async fn connect_any(
    addrs: &[SocketAddr],
    timeout: Duration,
    hello: &ClientId,
    implicit_tls: Option<TlsParameters>,
) -> Result<AsyncSmtpConnection, lettre::transport::smtp::Error> {
    let share = u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
    let per_address = (timeout / share).max(MIN_CONNECT_SHARE).min(timeout);
    AsyncSmtpConnection::connect_tokio1(addrs, Some(per_address), hello, implicit_tls, None).await
}

/// The least time one address of the relay is given to accept a connection.
const MIN_CONNECT_SHARE: Duration = Duration::from_secs(1);

/// Our name in EHLO: the host name, else `localhost`.
pub(super) fn hello_name() -> ClientId {
    let host = crate::support::hostname()
        .filter(|h| {
            h.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        })
        .unwrap_or_else(|| "localhost".to_owned());
    ClientId::Domain(host)
}

impl Inner {
    /// A new connection, secured and authenticated as configured.
    pub(super) async fn connect(&self) -> Result<AsyncSmtpConnection, DeliveryError> {
        let session = |e| from_smtp_error(Phase::Session, &self.relay, e);
        let implicit = match self.tls {
            SmtpTls::Implicit => self.tls_params.clone(),
            _ => None,
        };
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .map_err(|e| {
                let detail = format!("resolving its name: {e}");
                connection_error(Phase::Session, &self.relay, &detail, Box::new(e))
            })?
            .collect();
        let mut conn = connect_any(&addrs, self.timeout, &self.hello, implicit)
            .await
            .map_err(session)?;
        if self.tls == SmtpTls::StartTls {
            let Some(params) = self.tls_params.clone() else {
                return Err(DeliveryError::new(
                    ErrorClass::Transient,
                    "STARTTLS is configured but TLS is not set up",
                ));
            };
            if !conn.can_starttls() {
                // Refuse to go on in plain text: the URL asked for TLS.
                conn.abort().await;
                return Err(DeliveryError::new(
                    ErrorClass::Transient,
                    format!(
                        "{} does not offer STARTTLS, which OUTBOXD_SMTP_URL requires (use ?tls=none only for a relay on a trusted network)",
                        self.relay
                    ),
                ));
            }
            conn.starttls(params, &self.hello).await.map_err(session)?;
        }
        if let Some(credentials) = &self.credentials {
            conn.auth(&[Mechanism::Plain, Mechanism::Login], credentials)
                .await
                .map_err(session)?;
        }
        Ok(conn)
    }

    /// An idle connection, if one is fresh enough; one left dirty is reset first.
    pub(super) async fn checkout(&self) -> Option<AsyncSmtpConnection> {
        loop {
            let idle = lock(&self.idle).pop()?;
            if idle.since.elapsed() > IDLE_TIMEOUT || idle.conn.has_broken() {
                continue;
            }
            let mut conn = idle.conn;
            if idle.dirty && conn.command(Rset).await.is_err() {
                continue;
            }
            return Some(conn);
        }
    }

    /// Returns a connection to the pool, or closes it.
    pub(super) fn checkin(&self, conn: AsyncSmtpConnection, ended: Ended) {
        let Ended::Reusable { dirty } = ended else {
            return;
        };
        if conn.has_broken() {
            return;
        }
        let mut idle = lock(&self.idle);
        if idle.len() < self.max_connections {
            idle.push(IdleConnection {
                conn,
                since: Instant::now(),
                dirty,
            });
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::{TcpListener, TcpSocket, TcpStream};

    /// A loopback address whose connects hang: a listener that never accepts, its queue
    /// filled (Linux then drops new SYNs, as a firewall that drops packets does). Returns
    /// what must stay alive.
    async fn black_hole() -> (SocketAddr, TcpListener, Vec<TcpStream>) {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(1).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut held = Vec::new();
        for _ in 0..16 {
            match tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
                Ok(Ok(s)) => held.push(s),
                Ok(Err(e)) => panic!("connect to the filling listener: {e}"),
                Err(_) => return (addr, listener, held),
            }
        }
        panic!("the listener's queue never filled");
    }

    /// Just enough of a relay for a connect: the greeting, then 250 to EHLO.
    async fn relay() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (r, mut w) = stream.into_split();
                    w.write_all(b"220 relay.test ESMTP\r\n").await.ok();
                    let mut lines = BufReader::new(r).lines();
                    while let Ok(Some(_)) = lines.next_line().await {
                        w.write_all(b"250 relay.test\r\n").await.ok();
                    }
                });
            }
        });
        addr
    }

    /// The relay's name gives two addresses, the first dropping packets: the second is
    /// reached within the attempt's timeout, not after it.
    #[tokio::test]
    async fn an_address_that_drops_packets_leaves_time_for_the_next() {
        let (dead, _listener, _held) = black_hole().await;
        let live = relay().await;
        let timeout = Duration::from_secs(6);
        let hello = ClientId::Domain("outboxd.test".into());
        let started = Instant::now();
        let conn = tokio::time::timeout(timeout, connect_any(&[dead, live], timeout, &hello, None))
            .await
            .expect("the attempt's deadline passed on the first address")
            .expect("the second address answers");
        assert!(!conn.has_broken());
        assert!(
            started.elapsed() >= Duration::from_secs(2),
            "the first address had its share ({:?})",
            started.elapsed()
        );
    }
}
