//! Connections: the worker's pool, and single connections for the CLI and LISTEN, every
//! one of them through the TLS settings of `DATABASE_URL` ([`tls`]).

use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::Client;
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
    let mgr = Manager::from_config(
        db.config.clone(),
        db.tls.clone(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(mgr)
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
        .create_timeout(Some(Duration::from_secs(10)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|e| ConfigError(format!("cannot build the connection pool: {e}")))
}

/// One connection, its driver spawned on the runtime.
pub async fn connect(db: &Database) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = db.config.connect(db.tls.clone()).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "database connection closed");
        }
    });
    Ok(client)
}

/// One line about a database error: the SQLSTATE and the server's message, or the
/// connection problem. tokio-postgres's own Display says only "db error". The server's
/// DETAIL is left out on purpose: for a constraint violation it quotes the failing row,
/// payload included.
pub fn describe(err: &tokio_postgres::Error) -> String {
    if let Some(db) = err.as_db_error() {
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
