//! Connections: the worker's pool, and single connections for the CLI and LISTEN, every
//! one of them through the TLS settings of `DATABASE_URL` ([`tls`]).

use std::net::IpAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use rand::seq::SliceRandom as _;
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tokio_postgres::config::{Host, LoadBalanceHosts, TargetSessionAttrs};
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
    /// The host of the list that took the last connection ([`open`]), shared by every
    /// connection made from these settings.
    last_good: LastGood,
}

/// Which host of the list took the last connection: its position plus one, 0 for none.
type LastGood = Arc<AtomicUsize>;

impl Database {
    /// The connection settings (host, user, …, and whether TLS is asked for).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The TLS connector for [`tokio_postgres::Config::connect`].
    pub fn tls(&self) -> MakeRustlsConnect {
        self.tls.clone()
    }

    /// Whether connections leave a host that has turned read-only
    /// (`target_session_attrs=read-write`; see `read_only`).
    pub fn leaves_read_only_hosts(&self) -> bool {
        asks_for_writes(&self.config)
    }
}

/// Whether `config` asks for a host that takes writes (`target_session_attrs=read-write`):
/// then any such host will do, and one that has turned read-only is to be left.
fn asks_for_writes(config: &tokio_postgres::Config) -> bool {
    config.get_target_session_attrs() == TargetSessionAttrs::ReadWrite
}

/// Was a connection made at `created` made before the last time one of the worker's
/// statements was refused as read-only ([`failed`])?
pub fn made_before_read_only(created: std::time::Instant) -> bool {
    read_only::made_before(created)
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
        Ok(Database {
            config,
            tls,
            last_good: LastGood::default(),
        })
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
    // A list tokio-postgres would refuse only when it connects: a bad setting (exit 2).
    if hosts(&cfg).is_none() {
        return Err(ConfigError(format!(
            "DATABASE_URL: {} hosts, {} hostaddrs and {} ports do not match (hostaddr, when given, needs one per host; port, one for all or one per host)",
            cfg.get_hosts().len(),
            cfg.get_hostaddrs().len(),
            cfg.get_ports().len()
        )));
    }
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
    Ok(Database {
        config: cfg,
        tls,
        last_good: LastGood::default(),
    })
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
            last_good: db.last_good.clone(),
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
    // Only a pool that asks for a writable host can find another by connecting again;
    // any other would reconnect to the same read-only host, again and again.
    let leave_read_only = db.leaves_read_only_hosts();
    Pool::builder(mgr)
        .pre_recycle(Hook::sync_fn(move |_, metrics| {
            if leave_read_only && read_only::made_before(metrics.created) {
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
    let (client, connection) = open(db).await?;
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
    last_good: LastGood,
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
        let (config, tls, last_good) = (config.clone(), self.tls.clone(), self.last_good.clone());
        Box::pin(async move {
            let (client, connection) = walk(config, tls, last_good).await?;
            let driver = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "database connection closed");
                }
            });
            Ok((client, driver))
        })
    }
}

/// A connection's driver, as [`open`] returns it (LISTEN polls it for notifications).
pub type Connection = tokio_postgres::Connection<
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
///
/// With `target_session_attrs=read-write` the host that took the last connection is tried
/// first: after a failover every new connection would otherwise wait out the timeout of
/// each dead host before it (10 s each by default), and the worker's own bound on a
/// statement (30 s) could cut the walk short before it reached the live one. Any host that
/// takes writes will do there, and one that has turned read-only is refused by the check
/// and the list is walked in order. Without it the list's order is a preference, and kept.
///
/// The walk runs in a task of its own, so that a caller that gives up on it (the worker's
/// 30 s bound on a checkout, with three dead hosts of 10 s ahead of the live one) does not
/// stop it: it goes on to the host that takes the connection and notes it, and the next
/// connection starts there.
pub async fn open(db: &Database) -> Result<(Client, Connection), tokio_postgres::Error> {
    walk(db.config.clone(), db.tls.clone(), db.last_good.clone()).await
}

/// [`open_with`] in a task of its own ([`open`] says why).
async fn walk(
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    last_good: LastGood,
) -> Result<(Client, Connection), tokio_postgres::Error> {
    let task = tokio::spawn(async move { open_with(&config, &tls, &last_good).await });
    match task.await {
        Ok(result) => result,
        // Only a panic inside tokio-postgres could end the task otherwise; said as
        // tokio-postgres says a connection that did not come.
        Err(_) => Err(tokio_postgres::Error::__private_api_timeout()),
    }
}

async fn open_with(
    config: &tokio_postgres::Config,
    tls: &MakeRustlsConnect,
    last_good: &AtomicUsize,
) -> Result<(Client, Connection), tokio_postgres::Error> {
    let (Some(limit), Some(mut list)) = (config.get_connect_timeout().copied(), hosts(config))
    else {
        // No timeout to give each host, or a list tokio-postgres refuses (it says why).
        return config.connect(tls.clone()).await;
    };
    let sticky =
        asks_for_writes(config) && config.get_load_balance_hosts() != LoadBalanceHosts::Random;
    if sticky {
        let good = last_good.load(Ordering::Relaxed);
        if let Some(at) = list.iter().position(|t| t.0 + 1 == good) {
            let entry = list.remove(at);
            list.insert(0, entry);
        }
    }
    let mut last = None;
    let attempt = |target: tokio_postgres::Config| async move {
        match tokio::time::timeout(limit, target.connect(tls.clone())).await {
            Ok(result) => result,
            // tokio-postgres's own error for a connection that did not come in time
            // (hidden from its documentation, but public and what its timeouts return).
            Err(_) => Err(tokio_postgres::Error::__private_api_timeout()),
        }
    };
    for (index, host, addr, port) in list {
        // A name is resolved only when its turn comes, within the timeout, so that each of
        // its addresses gets a timeout of its own; one that does not resolve is left to
        // tokio-postgres to report.
        let addrs: Vec<Option<IpAddr>> = match (host, addr) {
            (Some(Host::Tcp(name)), None) => {
                let found =
                    tokio::time::timeout(limit, tokio::net::lookup_host((name.as_str(), port)))
                        .await;
                match found {
                    Ok(Ok(found)) => {
                        let mut found: Vec<Option<IpAddr>> = found.map(|a| Some(a.ip())).collect();
                        if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
                            found.shuffle(&mut rand::rng());
                        }
                        if found.is_empty() { vec![None] } else { found }
                    }
                    _ => vec![None],
                }
            }
            (_, addr) => vec![addr],
        };
        for addr in addrs {
            match attempt(single(config, host, addr, port)).await {
                Ok(connected) => {
                    if sticky {
                        last_good.store(index + 1, Ordering::Relaxed);
                    }
                    return Ok(connected);
                }
                Err(e) => last = Some(e),
            }
        }
    }
    match last {
        Some(e) => Err(e),
        // No host at all: tokio-postgres says so in its own words.
        None => config.connect(tls.clone()).await,
    }
}

/// One entry of a host list: its position in the list, the host, its `hostaddr`, its port.
type Target<'a> = (usize, Option<&'a Host>, Option<IpAddr>, u16);

/// `config`'s hosts in the order to try them (libpq's, or shuffled with
/// `load_balance_hosts=random`): each host, its address when `hostaddr` gives one, and its
/// port. None when the counts do not match, which tokio-postgres refuses with its reason.
fn hosts(config: &tokio_postgres::Config) -> Option<Vec<Target<'_>>> {
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    let ports = config.get_ports();
    let n = hosts.len().max(addrs.len());
    if (!hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len())
        || (ports.len() > 1 && ports.len() != n)
    {
        return None;
    }
    let mut list: Vec<_> = (0..n)
        .map(|i| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            (i, hosts.get(i), addrs.get(i).copied(), port)
        })
        .collect();
    if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
        list.shuffle(&mut rand::rng());
    }
    Some(list)
}

/// `config` with only one host: `host` (kept for TLS's name check), reached at `addr`
/// when given, on `port`. Every other setting is copied; `single_host_copies_every_setting`
/// holds this to what tokio-postgres parses, so a setting it adds is not lost unnoticed.
fn single(
    config: &tokio_postgres::Config,
    host: Option<&Host>,
    addr: Option<IpAddr>,
    port: u16,
) -> tokio_postgres::Config {
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
        (Some(Host::Unix(path)), addr) => {
            c.host_path(path);
            // libpq: "SSL … is ignored for Unix-domain socket communication";
            // tokio-postgres asked the server for TLS there and failed under `require`.
            // With an address beside the path the connection goes over TCP to it, and TLS
            // stays as asked.
            if addr.is_none() {
                c.ssl_mode(tokio_postgres::config::SslMode::Disable);
            }
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
/// its `DATABASE_URL` also lists. So when one of the worker's statements is refused as
/// read-only ([`failed`]), every connection made before that moment by a pool asking for
/// `target_session_attrs=read-write` is dropped at its next checkout ([`pool_with_setup`]'s
/// `pre_recycle`), and the new ones go wherever a writable host is. Process-wide: a
/// process's pools all point at one database. Connections made after a refusal were found
/// writable when made, so a host that stays read-only costs one round of reconnects, not
/// one per error.
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

pub use crate::support::describe;

/// [`describe`] for a statement of the worker's that failed; one refused because its
/// session is read-only also tells the pools to move (`read_only`). Kept apart from
/// `describe`, which operators' commands and an embedding application's errors go through:
/// their read-only transactions say nothing about the host the worker writes to.
pub fn failed(err: &tokio_postgres::Error) -> String {
    if err
        .as_db_error()
        .is_some_and(|db| *db.code() == tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION)
    {
        read_only::seen();
    }
    describe(err)
}

/// [`describe`] for a pool checkout error.
pub fn describe_pool(err: &deadpool_postgres::PoolError) -> String {
    match err {
        deadpool_postgres::PoolError::Backend(e) => describe(e),
        other => other.to_string(),
    }
}

/// Does the database hold the outbox schema ([`crate::queries::SCHEMA_PRESENT`])? False
/// for a database that was never migrated.
pub async fn has_schema(client: &Client) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(crate::queries::SCHEMA_PRESENT, &[])
        .await?
        .get(0))
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
        // A path and an address: the connection goes over TCP to the address, and TLS
        // stays as asked.
        let c: tokio_postgres::Config = "host=/run/pg hostaddr=10.0.0.1 user=u sslmode=require"
            .parse()
            .unwrap();
        let t = single(
            &c,
            c.get_hosts().first(),
            c.get_hostaddrs().first().copied(),
            5432,
        );
        assert_eq!(t.get_ssl_mode(), SslMode::Require);
        let c: tokio_postgres::Config = "hostaddr=10.0.0.1 user=u sslmode=require".parse().unwrap();
        let t = single(&c, None, c.get_hostaddrs().first().copied(), 5432);
        assert_eq!(t.get_hosts(), [Host::Tcp("10.0.0.1".into())]);
        assert_eq!(t.get_ssl_mode(), SslMode::Require);
    }

    /// The order of the hosts to try, with the address and port of each; a list whose
    /// counts do not match is left to tokio-postgres, which refuses it with its reason.
    #[test]
    fn hosts_follow_the_list() {
        let c: tokio_postgres::Config = "host=db1,db2,/run/pg port=5,6,7 user=u".parse().unwrap();
        let seen: Vec<String> = hosts(&c)
            .unwrap()
            .iter()
            .map(|(_, h, a, p)| format!("{h:?} {a:?} {p}"))
            .collect();
        assert_eq!(
            seen,
            [
                r#"Some(Tcp("db1")) None 5"#,
                r#"Some(Tcp("db2")) None 6"#,
                r#"Some(Unix("/run/pg")) None 7"#
            ]
        );
        let c: tokio_postgres::Config = "host=a,b hostaddr=10.0.0.1,10.0.0.2 port=5"
            .parse()
            .unwrap();
        let seen: Vec<String> = hosts(&c)
            .unwrap()
            .iter()
            .map(|(_, h, a, p)| format!("{h:?} {a:?} {p}"))
            .collect();
        assert_eq!(
            seen,
            [
                r#"Some(Tcp("a")) Some(10.0.0.1) 5"#,
                r#"Some(Tcp("b")) Some(10.0.0.2) 5"#
            ]
        );
        for bad in ["host=a,b hostaddr=10.0.0.1", "host=a,b,c port=1,2"] {
            let c: tokio_postgres::Config = bad.parse().unwrap();
            assert!(hosts(&c).is_none(), "{bad}");
        }
    }
}
