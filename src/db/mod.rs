//! Connections: the worker's pool, and single connections for the CLI and LISTEN, every
//! one of them through the TLS settings of `DATABASE_URL` ([`tls`]).

use std::pin::Pin;
use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::model::ConfigError;

pub mod tls;

pub use tls::SslMode;

/// Where the database is and how to reach it: tokio-postgres's settings and the TLS
/// connector `sslmode` asks for. Every connection the binary opens is made from one.
#[derive(Clone)]
pub struct Database {
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
}

impl Database {
    /// The connection settings (host, user, …, and whether TLS is asked for).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The TLS connector for [`tokio_postgres::Config::connect`].
    pub fn tls(&self) -> MakeRustlsConnect {
        self.tls.clone()
    }
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // tokio_postgres::Config's Debug redacts the password.
        f.debug_struct("Database")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Database {
    /// Settings built in code: `sslmode` as the config says (disable, prefer or require),
    /// with no certificate checked, as libpq does without a CA.
    pub fn from_config(config: tokio_postgres::Config) -> Result<Database, ConfigError> {
        let mode = match config.get_ssl_mode() {
            tokio_postgres::config::SslMode::Disable => SslMode::Disable,
            tokio_postgres::config::SslMode::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        let opts = tls::TlsOptions {
            mode,
            ..tls::TlsOptions::default()
        };
        let (tls, _) = tls::connector(&opts)?;
        Ok(Database { config, tls })
    }
}

/// Parses `DATABASE_URL` (a `postgres://` URL or a libpq key=value string), its TLS
/// options included; every certificate file is read now.
pub fn parse_url(url: &str) -> Result<Database, ConfigError> {
    let (rest, opts) = tls::split(url)?;
    let (tls, wire) = tls::connector(&opts)?;
    let mut cfg = tokio_postgres::Config::from_str(&rest)
        .map_err(|e| ConfigError(format!("DATABASE_URL is not a valid PostgreSQL URL: {e}")))?;
    cfg.ssl_mode(wire);
    if cfg.get_application_name().is_none() {
        cfg.application_name("outboxd");
    }
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(Duration::from_secs(10));
    }
    // A database that vanishes without closing its connections (a partition, a failover
    // whose address moved) must not hold the worker for the kernel's ~15 minutes of
    // retransmissions: unacknowledged writes fail after 30 s, and idle connections are
    // probed by keepalives.
    cfg.keepalives(true);
    cfg.keepalives_idle(Duration::from_secs(30));
    cfg.keepalives_interval(Duration::from_secs(10));
    cfg.keepalives_retries(3);
    cfg.tcp_user_timeout(Duration::from_secs(30));
    Ok(Database { config: cfg, tls })
}

/// A pool of `size` connections. Broken connections (a database restart) are dropped on
/// return and replaced on the next checkout, which is how the worker reconnects. Each new
/// connection runs [`crate::queries::SESSION_SETUP`] first.
pub fn pool(db: &Database, size: usize) -> Result<Pool, ConfigError> {
    pool_with_setup(db, size, crate::queries::SESSION_SETUP)
}

/// [`pool`] whose connections each run `setup` (one of the session setups of
/// [`crate::queries`]) when they are made.
pub fn pool_with_setup(
    db: &Database,
    size: usize,
    setup: &'static str,
) -> Result<Pool, ConfigError> {
    let mgr = Manager::from_connect(
        db.config.clone(),
        EachHost {
            tls: db.tls.clone(),
        },
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    // With a connect timeout every step of a new connection is bounded per host and
    // address ([`open`]), and a bound on the whole would cut the list short: a first host
    // that never answers took all of it, and the next host was never tried.
    let create_timeout = match db.config.get_connect_timeout() {
        Some(_) => None,
        None => Some(Duration::from_secs(10)),
    };
    Pool::builder(mgr)
        .pre_recycle(Hook::sync_fn(|_, metrics| {
            if read_only::made_before(metrics.created) {
                Err(HookError::message("made before its host turned read-only"))
            } else {
                Ok(())
            }
        }))
        .post_create(Hook::async_fn(move |client, _| {
            Box::pin(async move {
                client
                    .batch_execute(setup)
                    .await
                    .map_err(HookError::Backend)
            })
        }))
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(30)))
        .create_timeout(create_timeout)
        .recycle_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|e| ConfigError(format!("cannot build the connection pool: {e}")))
}

/// One connection, its driver spawned on the runtime.
pub async fn connect(db: &Database) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = open(&db.config, &db.tls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "database connection closed");
        }
    });
    Ok(client)
}

/// The pools' way to connect: [`open`].
struct EachHost {
    tls: MakeRustlsConnect,
}

impl deadpool_postgres::Connect for EachHost {
    fn connect(
        &self,
        config: &tokio_postgres::Config,
    ) -> Pin<
        Box<
            dyn Future<Output = Result<(Client, JoinHandle<()>), tokio_postgres::Error>>
                + Send
                + '_,
        >,
    > {
        let config = config.clone();
        Box::pin(async move {
            let (client, connection) = open(&config, &self.tls).await?;
            let driver = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "database connection closed");
                }
            });
            Ok((client, driver))
        })
    }
}

type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <MakeRustlsConnect as MakeTlsConnect<tokio_postgres::Socket>>::Stream,
>;

/// A connection to the first of `config`'s hosts that takes it, as libpq makes one: its
/// `connect_timeout` holds "separately to each host name or IP address", for the whole
/// connection (TCP, TLS, start-up, and the `target_session_attrs` check).
///
/// tokio-postgres tries the hosts in turn too, but bounds only each TCP connect: a host
/// that accepts the connection and never answers (a hung server, a proxy in front of a
/// dead one) held the connection forever, and the hosts after it were never tried, which
/// is the failover a list of hosts is for. So the list is walked here, one host and
/// address at a time, each given to tokio-postgres alone under the timeout.
async fn open(
    config: &tokio_postgres::Config,
    tls: &MakeRustlsConnect,
) -> Result<(Client, Connection), tokio_postgres::Error> {
    let Some(limit) = config.get_connect_timeout().copied() else {
        return config.connect(tls.clone()).await;
    };
    let mut last = None;
    for target in targets(config, limit).await {
        match tokio::time::timeout(limit, target.connect(tls.clone())).await {
            Ok(Ok(connected)) => return Ok(connected),
            Ok(Err(e)) => last = Some(e),
            // tokio-postgres's own error for a connection that did not come in time (hidden
            // from its documentation, but public and what its timeouts return).
            Err(_) => last = Some(tokio_postgres::Error::__private_api_timeout()),
        }
    }
    match last {
        Some(e) => Err(e),
        // No host at all: tokio-postgres says so in its own words.
        None => config.connect(tls.clone()).await,
    }
}

/// Every host and address of `config` to try, in libpq's order (or shuffled, with
/// `load_balance_hosts=random`), each as a configuration of one host and one address.
/// A host name is resolved here, within `limit`, so that each of its addresses gets a
/// timeout of its own; one that does not resolve is left to tokio-postgres to report.
async fn targets(config: &tokio_postgres::Config, limit: Duration) -> Vec<tokio_postgres::Config> {
    use rand::seq::SliceRandom as _;
    use tokio_postgres::config::{Host, LoadBalanceHosts};
    let random = config.get_load_balance_hosts() == LoadBalanceHosts::Random;
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    let ports = config.get_ports();
    let mut order: Vec<usize> = (0..hosts.len().max(addrs.len())).collect();
    if random {
        order.shuffle(&mut rand::rng());
    }
    let mut out = Vec::new();
    for i in order {
        let host = hosts.get(i);
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
        match (host, addrs.get(i)) {
            (_, Some(addr)) => out.push(single(config, host, Some(*addr), port)),
            (Some(Host::Tcp(name)), None) => {
                let resolved =
                    tokio::time::timeout(limit, tokio::net::lookup_host((name.as_str(), port)))
                        .await;
                match resolved {
                    Ok(Ok(found)) => {
                        let mut found: Vec<_> = found.map(|a| a.ip()).collect();
                        if random {
                            found.shuffle(&mut rand::rng());
                        }
                        if found.is_empty() {
                            out.push(single(config, host, None, port));
                        }
                        out.extend(
                            found
                                .into_iter()
                                .map(|a| single(config, host, Some(a), port)),
                        );
                    }
                    _ => out.push(single(config, host, None, port)),
                }
            }
            (host, None) => out.push(single(config, host, None, port)),
        }
    }
    out
}

/// `config` with only one host: `host` (kept for TLS's name check), reached at `addr`
/// when given, on `port`. Every other setting is copied; `single_host_copies_every_setting`
/// holds this to what tokio-postgres parses, so a setting it adds is not lost unnoticed.
fn single(
    config: &tokio_postgres::Config,
    host: Option<&tokio_postgres::config::Host>,
    addr: Option<std::net::IpAddr>,
    port: u16,
) -> tokio_postgres::Config {
    use tokio_postgres::config::Host;
    let mut c = tokio_postgres::Config::new();
    if let Some(v) = config.get_user() {
        c.user(v);
    }
    if let Some(v) = config.get_password() {
        c.password(v);
    }
    if let Some(v) = config.get_dbname() {
        c.dbname(v);
    }
    if let Some(v) = config.get_options() {
        c.options(v);
    }
    if let Some(v) = config.get_application_name() {
        c.application_name(v);
    }
    c.ssl_mode(config.get_ssl_mode());
    c.ssl_negotiation(config.get_ssl_negotiation());
    if let Some(v) = config.get_connect_timeout() {
        c.connect_timeout(*v);
    }
    if let Some(v) = config.get_tcp_user_timeout() {
        c.tcp_user_timeout(*v);
    }
    c.keepalives(config.get_keepalives());
    c.keepalives_idle(config.get_keepalives_idle());
    if let Some(v) = config.get_keepalives_interval() {
        c.keepalives_interval(v);
    }
    if let Some(v) = config.get_keepalives_retries() {
        c.keepalives_retries(v);
    }
    c.target_session_attrs(config.get_target_session_attrs());
    c.channel_binding(config.get_channel_binding());
    match (host, addr) {
        (Some(Host::Tcp(name)), _) => {
            c.host(name);
        }
        (Some(Host::Unix(path)), _) => {
            c.host_path(path);
            // libpq: "SSL … is ignored for Unix-domain socket communication";
            // tokio-postgres asked the server for TLS there and failed under `require`.
            c.ssl_mode(tokio_postgres::config::SslMode::Disable);
        }
        // An address alone: TLS still needs a name to give (tokio-postgres refused with "no
        // hostname provided", even under `prefer`), and the address is the one there is.
        (None, Some(a)) => {
            c.host(a.to_string());
        }
        (None, None) => {}
    }
    if let Some(a) = addr {
        c.hostaddr(a);
    }
    c.port(port);
    c
}

/// Connections to a host that has turned read-only under them: an old primary fenced
/// with `default_transaction_read_only`, a proxy or a virtual address now in front of a
/// standby. tokio-postgres checks `target_session_attrs` only when it connects, and the
/// pools hand a connection out again as long as it is open, so every write on it failed
/// (SQLSTATE 25006) for as long as the worker ran, and it never moved to the writable host
/// its `DATABASE_URL` also lists. So when a statement is refused as read-only ([`describe`]
/// sees every database error the daemon reports), every pooled connection made before that
/// moment is dropped at its next checkout ([`pool_with_setup`]'s `pre_recycle`), and the
/// new ones go wherever `target_session_attrs` finds a writable host. Process-wide: a
/// process's pools all point at one database.
mod read_only {
    use std::sync::LazyLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    /// Nanoseconds after [`EPOCH`] of the last refusal; 0 for never.
    static SEEN: AtomicU64 = AtomicU64::new(0);

    pub(super) fn seen() {
        let at = u64::try_from(EPOCH.elapsed().as_nanos()).unwrap_or(u64::MAX);
        SEEN.fetch_max(at.max(1), Ordering::Relaxed);
    }

    /// Was a connection made at `created` made before the last refusal?
    pub(super) fn made_before(created: Instant) -> bool {
        let seen = SEEN.load(Ordering::Relaxed);
        seen != 0
            && created
                .checked_duration_since(*EPOCH)
                .is_none_or(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX) < seen)
    }
}

/// One line about a database error: the SQLSTATE and the server's message, or the
/// connection problem. tokio-postgres's own Display says only "db error". The server's
/// DETAIL is left out on purpose: for a constraint violation it quotes the failing row,
/// payload included.
pub fn describe(err: &tokio_postgres::Error) -> String {
    if let Some(db) = err.as_db_error() {
        if *db.code() == tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION {
            read_only::seen();
        }
        return format!("{} {}: {}", db.severity(), db.code().code(), db.message());
    }
    let mut out = err.to_string();
    for e in crate::support::causes(err) {
        out.push_str(": ");
        out.push_str(&e.to_string());
    }
    out
}

/// [`describe`] for a pool checkout error.
pub fn describe_pool(err: &deadpool_postgres::PoolError) -> String {
    match err {
        deadpool_postgres::PoolError::Backend(e) => describe(e),
        other => other.to_string(),
    }
}

/// Checks that the database answers on `client` ([`crate::queries::HEALTH_CHECK`]).
pub async fn ping(client: &Client) -> Result<(), tokio_postgres::Error> {
    client
        .simple_query(crate::queries::HEALTH_CHECK)
        .await
        .map(|_| ())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// [`single`] copies every setting: the copy of a host of a list reads, in
    /// tokio-postgres's own `Debug`, exactly as the same settings parsed for that host
    /// alone. A setting tokio-postgres adds and `single` misses fails here.
    #[test]
    fn single_host_copies_every_setting() {
        let settings = "user=u password=p dbname=d options='-c x=1' application_name=a \
             sslmode=require sslnegotiation=direct connect_timeout=3 tcp_user_timeout=4 \
             keepalives=0 keepalives_idle=5 keepalives_interval=6 keepalives_retries=7 \
             target_session_attrs=read-write channel_binding=require";
        let list: tokio_postgres::Config = format!(
            "host=h1,h2 hostaddr=10.0.0.1,10.0.0.2 port=5,6 {settings} load_balance_hosts=random"
        )
        .parse()
        .unwrap();
        let alone: tokio_postgres::Config = format!("host=h2 hostaddr=10.0.0.2 port=6 {settings}")
            .parse()
            .unwrap();
        let copy = single(
            &list,
            list.get_hosts().get(1),
            list.get_hostaddrs().get(1).copied(),
            6,
        );
        assert_eq!(format!("{copy:?}"), format!("{alone:?}"));
        assert_eq!(copy.get_password(), Some(&b"p"[..]));
    }

    /// libpq's rules where tokio-postgres differs: a Unix socket never asks for TLS
    /// (`sslmode` is ignored there), and an address given alone is also the name TLS is
    /// given.
    #[test]
    fn sockets_skip_tls_and_an_address_alone_names_itself() {
        use tokio_postgres::config::{Host, SslMode};
        let c: tokio_postgres::Config = "host=/run/pg user=u sslmode=require".parse().unwrap();
        let t = single(&c, c.get_hosts().first(), None, 5432);
        assert_eq!(t.get_ssl_mode(), SslMode::Disable);
        let c: tokio_postgres::Config = "hostaddr=10.0.0.1 user=u sslmode=require".parse().unwrap();
        let t = single(&c, None, c.get_hostaddrs().first().copied(), 5432);
        assert_eq!(t.get_hosts(), [Host::Tcp("10.0.0.1".into())]);
        assert_eq!(t.get_ssl_mode(), SslMode::Require);
    }

    /// The order of the hosts and addresses to try: as written, each address of a name
    /// its own target, a port per host or one for all.
    #[tokio::test]
    async fn targets_follow_the_list() {
        let c: tokio_postgres::Config = "host=127.0.0.1,localhost,/run/pg port=5,6,7 user=u"
            .parse()
            .unwrap();
        let t = targets(&c, Duration::from_secs(5)).await;
        let seen: Vec<String> = t
            .iter()
            .map(|t| {
                format!(
                    "{:?} {:?} {:?}",
                    t.get_hosts(),
                    t.get_hostaddrs(),
                    t.get_ports()
                )
            })
            .collect();
        assert_eq!(
            seen.first().map(String::as_str),
            Some(r#"[Tcp("127.0.0.1")] [127.0.0.1] [5]"#)
        );
        assert!(
            seen[1..seen.len() - 1]
                .iter()
                .all(|s| s.starts_with(r#"[Tcp("localhost")] ["#) && s.ends_with("] [6]")),
            "{seen:?}"
        );
        assert_eq!(
            seen.last().map(String::as_str),
            Some(r#"[Unix("/run/pg")] [] [7]"#)
        );
        assert!(t.iter().all(|t| t.get_user() == Some("u")));
    }
}
