//! Shared test harness: a fresh database per test, an HTTP receiver, a worker, waits.
//!
//! Every test gets its own database (created from `DATABASE_URL`'s server, migrated, and
//! dropped when the `TestDb` is dropped, also on panic), so tests run in parallel and leave
//! nothing behind. `scripts/test` provides `DATABASE_URL` (a throwaway cluster when unset).

#![allow(dead_code, clippy::unwrap_used)]

pub mod binary;
pub mod cluster;
pub mod console;
pub mod cutter;
pub mod faulty;
pub mod pki;
pub mod receiver;
pub mod recipes;
pub mod smtp;
pub mod standin;

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outboxd::config::WorkerConfig;
use outboxd::deliver::email::settings::EmailConfig;
use outboxd::deliver::webhook::settings::{DestinationPolicy, WebhookConfig};
use outboxd::deliver::{Deliverers, email::EmailSender, webhook::WebhookSender};
use outboxd::retry::RetryPolicy;
use outboxd::worker::{RunSummary, Worker};
use tokio_postgres::{AsyncMessage, Client, NoTls};

/// The server tests create their databases on.
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        panic!("DATABASE_URL is not set: run the tests with scripts/test (it starts a throwaway cluster)")
    })
}

/// A database of its own for one test.
pub struct TestDb {
    /// The database name.
    pub name: String,
    /// Connection settings for it.
    pub pg: tokio_postgres::Config,
    admin: tokio_postgres::Config,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl TestDb {
    /// Creates a fresh migrated database: a copy of [`template`] (migrating each test's
    /// database afresh cost more than the copy, two hundred times a run).
    pub async fn new() -> TestDb {
        let admin = admin_config();
        let template = template(&admin).await;
        TestDb::create(admin, &format!("TEMPLATE {template}")).await
    }

    /// Creates a fresh database without the schema.
    pub async fn empty() -> TestDb {
        TestDb::create(admin_config(), "").await
    }

    async fn create(admin: tokio_postgres::Config, options: &str) -> TestDb {
        let name = format!(
            "outboxd_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst),
            rand::random::<u32>()
        );
        let client = connect(&admin).await;
        client
            .batch_execute(&format!("CREATE DATABASE {name} {options}"))
            .await
            .expect("create database");
        let mut pg = admin.clone();
        pg.dbname(&name);
        TestDb { name, pg, admin }
    }

    /// A `postgres://` URL for this database (for child processes).
    pub fn url(&self) -> String {
        let mut url = url::Url::parse(&admin_url()).expect("DATABASE_URL is a postgres:// URL");
        url.set_path(&format!("/{}", self.name));
        url.to_string()
    }

    /// `host:port` of this database's server, as its URL gives it.
    pub fn server(&self) -> String {
        let url = url::Url::parse(&self.url()).expect("DATABASE_URL is a postgres:// URL");
        format!(
            "{}:{}",
            url.host_str().expect("a host"),
            url.port().unwrap_or(5432)
        )
    }

    /// The socket address of this database's server.
    pub async fn server_addr(&self) -> std::net::SocketAddr {
        tokio::net::lookup_host(self.server())
            .await
            .expect("the server's name resolves")
            .next()
            .expect("an address")
    }

    /// This database's URL with `hosts` (a `host:port`, or a list of them) for its server
    /// and `query` for its query string: the same user, password and database.
    pub fn url_at(&self, hosts: &str, query: &str) -> String {
        let url = url::Url::parse(&self.url()).expect("DATABASE_URL is a postgres:// URL");
        let password = url.password().map(|p| format!(":{p}")).unwrap_or_default();
        format!(
            "postgres://{}{password}@{hosts}{}?{query}",
            url.username(),
            url.path()
        )
    }

    /// A new connection to this database.
    pub async fn client(&self) -> Client {
        connect(&self.pg).await
    }

    /// This database as the worker connects to it (TLS as `sslmode=prefer` gives it).
    pub fn database(&self) -> outboxd::db::Database {
        outboxd::db::Database::from_config(self.pg.clone()).expect("database settings")
    }

    /// A pool on this database.
    pub fn pool(&self, size: usize) -> deadpool_postgres::Pool {
        outboxd::db::pool(&self.database(), size).expect("pool")
    }

    /// Reads one value.
    pub async fn scalar<T: for<'a> tokio_postgres::types::FromSql<'a>>(&self, sql: &str) -> T {
        self.client()
            .await
            .query_one(sql, &[])
            .await
            .expect(sql)
            .get(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = self.name.clone();
        // Drop may run inside a runtime: do the async work on a thread of its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let client = connect(&admin).await;
                let _ = client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await;
            });
        })
        .join();
    }
}

fn admin_config() -> tokio_postgres::Config {
    admin_url().parse().expect("DATABASE_URL parses")
}

/// The prefix of template databases; `scripts/test` drops them when it is done.
pub const TEMPLATE_PREFIX: &str = "outboxd_template_";

/// A database migrated once with this build's migrations and marked as a template:
/// `outboxd_template_` and a hash of every migration's checksum, so a tree with other
/// migrations gets a template of its own. Made once per server under an advisory lock, so
/// test binaries running at once (nextest) make it once; one that a killed run left
/// half-made (not yet marked a template) is made again.
pub async fn template(admin: &tokio_postgres::Config) -> String {
    static MADE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
    MADE.get_or_init(|| make_template(admin.clone()))
        .await
        .clone()
}

async fn make_template(admin: tokio_postgres::Config) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for m in outboxd::migrate::MIGRATIONS {
        h.update(m.checksum().as_bytes());
    }
    let name = format!("{TEMPLATE_PREFIX}{}", &hex::encode(h.finalize())[..16]);
    // On a thread of its own: the connection must outlive the test's runtime, which may be
    // the first of many to ask.
    let task_name = name.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let client = connect(&admin).await;
            client
                .batch_execute("SELECT pg_advisory_lock(7468731)")
                .await
                .unwrap();
            let ready: Option<bool> = client
                .query_opt(
                    "SELECT datistemplate FROM pg_database WHERE datname = $1",
                    &[&task_name],
                )
                .await
                .unwrap()
                .map(|r| r.get(0));
            if ready != Some(true) {
                client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {task_name} WITH (FORCE)"))
                    .await
                    .expect("drop a half-made template");
                client
                    .batch_execute(&format!("CREATE DATABASE {task_name}"))
                    .await
                    .expect("create the template database");
                let mut pg = admin.clone();
                pg.dbname(&task_name);
                {
                    let mut c = connect(&pg).await;
                    outboxd::migrate::migrate(&mut c).await.expect("migrate");
                }
                // Copies need it without sessions: the migration's own has just closed, and
                // a closed session can take a moment to leave (CREATE DATABASE waits for it).
                client
                    .batch_execute(&format!(
                        "ALTER DATABASE {task_name} WITH ALLOW_CONNECTIONS false IS_TEMPLATE true"
                    ))
                    .await
                    .expect("mark the template");
            }
            client
                .batch_execute("SELECT pg_advisory_unlock(7468731)")
                .await
                .unwrap();
        });
    })
    .join()
    .expect("template thread");
    name
}

/// Connects, driving the connection on the current runtime.
pub async fn connect(cfg: &tokio_postgres::Config) -> Client {
    let (client, conn) = cfg.connect(NoTls).await.expect("connect to PostgreSQL");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Claims the due webhooks (up to 10) under a lease of 200 ms and lets it expire, as a
/// worker that died mid-request would: their outcome is unknown (ambiguous), and the next
/// attempt of one with a `reconcile` URL looks up first.
pub async fn claim_and_abandon(db: &TestDb) {
    let got = outboxd::claim::claim(
        &db.client().await,
        &[outboxd::model::Channel::Webhook],
        10,
        "w-dead",
        Duration::from_millis(200),
    )
    .await
    .unwrap();
    assert!(!got.is_empty());
    wait_for_leases_to_expire(db).await;
}

/// Waits until no running message holds a live lease.
pub async fn wait_for_leases_to_expire(db: &TestDb) {
    wait_until(Duration::from_secs(5), "the leases to expire", || async {
        let live: i64 = db
            .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'running' AND lease_expires_at > now()")
            .await;
        live == 0
    })
    .await;
}

/// A port nothing listens on, for a connection that is refused. Below the range every
/// listener of the suite binds in (port 0 gives an ephemeral port), so no other test can be
/// listening there by chance, as one could on a port bound here and released.
pub const CLOSED_PORT: u16 = 1;

/// The server process of `c`'s connection, to watch it from another one.
pub async fn backend_pid(c: &Client) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Waits (10 s at most) until backend `pid` waits on `wait_event` (`pg_stat_activity`:
/// `advisory` for an advisory lock, `transactionid` for another transaction's row), as
/// seen from `watch`, another connection.
pub async fn wait_for_backend_wait(watch: &Client, pid: i32, wait_event: &str, what: &str) {
    wait_until(Duration::from_secs(10), what, || async move {
        watch
            .query_one(
                "SELECT coalesce((SELECT wait_event = $2 FROM pg_stat_activity WHERE pid = $1), false)",
                &[&pid, &wait_event],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
}

/// Worker settings for tests: fast polls and retries, receivers on loopback allowed.
pub fn test_worker_config(id: &str) -> WorkerConfig {
    WorkerConfig {
        worker_id: id.to_owned(),
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(10),
        retry: RetryPolicy {
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
        },
        shutdown_grace: Duration::from_secs(5),
        // Breakers stay on (threshold 10) with a short cooldown: a test that fails one
        // receiver many times in a row pauses for a moment, and its outcomes must be the
        // same (a breaker changes when a message is sent, never what happens to it).
        breaker_cooldown: Duration::from_millis(200),
        ..WorkerConfig::default()
    }
}

/// Webhook settings for tests: 2 s timeout, private networks allowed (the receiver is on
/// 127.0.0.1).
pub fn test_webhook_config() -> WebhookConfig {
    WebhookConfig {
        timeout: Duration::from_secs(2),
        signing: Default::default(),
        destinations: DestinationPolicy {
            allow_private_networks: true,
            ..Default::default()
        },
    }
}

/// Makes the claim of the message keyed `key` sleep `secs` seconds inside its statement (a
/// trigger of the test's own, in its database): a claim held in flight.
pub async fn slow_claim_of(c: &tokio_postgres::Client, key: &str, secs: f64) {
    c.batch_execute(&format!(
        "CREATE FUNCTION public.slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM pg_sleep({secs}); RETURN NEW; END $$; \
         CREATE TRIGGER slow_claim BEFORE UPDATE ON outbox.messages FOR EACH ROW \
         WHEN (OLD.message_key = {key} AND NEW.state = 'running') \
         EXECUTE FUNCTION public.slow_claim();",
        key = quote_literal(key),
    ))
    .await
    .unwrap();
}

/// `s` as an SQL string literal.
fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Waits (10 s at most) until a claim slowed by [`slow_claim_of`] sleeps inside its
/// statement, in this test's database only (other tests' claims sleep too).
pub async fn wait_for_a_sleeping_claim(c: &tokio_postgres::Client) {
    wait_until(
        Duration::from_secs(10),
        "a claim to sleep in its statement",
        || async move {
            c.query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event = 'PgSleep')",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
        },
    )
    .await;
}

/// A worker running in the background of the test's runtime.
pub struct RunningWorker {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<RunSummary>,
}

impl RunningWorker {
    /// Starts a worker on `db`.
    pub fn start(db: &TestDb, cfg: WorkerConfig, webhook: WebhookConfig) -> RunningWorker {
        RunningWorker::start_with(db, cfg, webhook, None)
    }

    /// Starts a worker on `db` that can also send e-mail.
    pub fn start_with(
        db: &TestDb,
        cfg: WorkerConfig,
        webhook: WebhookConfig,
        email: Option<EmailConfig>,
    ) -> RunningWorker {
        // The pools `outboxd run` makes, so the suite runs the claims and completions with
        // the settings production gives them.
        let pools = outboxd::worker::Pools::new(&db.database(), 4).expect("pools");
        RunningWorker::start_on(db, pools, cfg, webhook, email)
    }

    /// Starts a worker on `db` whose statements go through `pools` (a test that holds a
    /// pool's connections away from it).
    pub fn start_on(
        db: &TestDb,
        pools: outboxd::worker::Pools,
        cfg: WorkerConfig,
        webhook: WebhookConfig,
        email: Option<EmailConfig>,
    ) -> RunningWorker {
        let deliverers = Deliverers::new(
            WebhookSender::new(&webhook).expect("webhook sender"),
            email.map(|e| EmailSender::new(&e).expect("email sender")),
        );
        RunningWorker::start_with_deliverers(db, pools, cfg, deliverers)
    }

    /// Starts a worker on `db` with channels built by the caller (an http test's secrets).
    pub fn start_with_deliverers(
        db: &TestDb,
        pools: outboxd::worker::Pools,
        cfg: WorkerConfig,
        deliverers: Deliverers,
    ) -> RunningWorker {
        let worker = Worker::new(pools, cfg, deliverers, Some(db.database()));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            worker
                .run(async {
                    let _ = rx.await;
                })
                .await
                .expect("worker run")
        });
        RunningWorker {
            stop: Some(tx),
            handle,
        }
    }

    /// Signals shutdown and waits for the summary.
    pub async fn stop(mut self) -> RunSummary {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), &mut self.handle)
            .await
            .expect("worker stops within 30s")
            .expect("worker task")
    }

    /// Waits for a worker started with `drain` to exit by itself.
    pub async fn drained(mut self, timeout: Duration) -> RunSummary {
        tokio::time::timeout(timeout, &mut self.handle)
            .await
            .expect("worker drains in time")
            .expect("worker task")
    }
}

/// Runs `sql` (an UPDATE of stored messages) past the door, as only the table's owner can:
/// with this session's triggers off, then naming every row's destinations again as the
/// insert trigger would have. Tests use it to store what enqueue refuses, or to change a
/// message under a running worker.
pub async fn update_past_the_door(
    c: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) {
    c.batch_execute("SET session_replication_role = replica")
        .await
        .unwrap();
    c.execute(sql, params).await.unwrap();
    c.batch_execute(
        "UPDATE outbox.messages SET destination = outbox.destination_of(channel, payload), \
             lookup_destination = CASE WHEN channel = 'webhook' AND payload ? 'reconcile' \
                 THEN outbox.destination_of(channel, payload -> 'reconcile') END; \
         RESET session_replication_role",
    )
    .await
    .unwrap();
}

/// Captures tracing output of the current thread (use with a current-thread runtime, the
/// default of `#[tokio::test]`, so spawned tasks log into it too).
#[derive(Clone, Default)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl LogCapture {
    /// Installs a TRACE-level subscriber for the current thread; keep the guard alive.
    pub fn install() -> (LogCapture, tracing::subscriber::DefaultGuard) {
        // With a single scoped dispatcher, a callsite first reached by a thread that has
        // none (another test) caches "never interested" and stays silent here. A second,
        // idle dispatcher alive for the whole process makes tracing re-ask every time.
        static IDLE: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
        IDLE.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
        let cap = LogCapture::default();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(cap.clone())
            .finish();
        let guard = tracing::subscriber::set_default(subscriber);
        (cap, guard)
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogCapture {
    type Writer = LogCapture;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// One message row as tests look at it.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: i64,
    pub state: String,
    pub attempts: i32,
    pub error_class: Option<String>,
    pub last_error: Option<String>,
    pub response: Option<serde_json::Value>,
}

/// The first column of every row `sql` returns (a query without parameters).
pub async fn first_column<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    c: &Client,
    sql: &str,
) -> Vec<T> {
    c.query(sql, &[])
        .await
        .expect(sql)
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Reads a message by key.
pub async fn row(db: &TestDb, key: &str) -> Row {
    let c = db.client().await;
    let r = c
        .query_one(
            "SELECT id, state, attempts, error_class, last_error, response FROM outbox.messages WHERE message_key = $1",
            &[&key],
        )
        .await
        .expect("message row");
    Row {
        id: r.get(0),
        state: r.get(1),
        attempts: r.get(2),
        error_class: r.get(3),
        last_error: r.get(4),
        response: r.get(5),
    }
}

/// Waits until the message with `key` is in `state`.
pub async fn wait_for_state(db: &TestDb, key: &str, state: &str, timeout: Duration) -> Row {
    let c = db.client().await;
    let what = format!("message {key} to be {state}");
    wait_until(timeout, &what, || {
        let c = &c;
        async move {
            c.query_opt(
                "SELECT 1 FROM outbox.messages WHERE message_key = $1 AND state = $2",
                &[&key, &state],
            )
            .await
            .map(|r| r.is_some())
            .unwrap_or(false)
        }
    })
    .await;
    row(db, key).await
}

/// The attempt rows of a message: (attempt, outcome, error_class, status, deduplicated).
pub async fn attempts(
    db: &TestDb,
    key: &str,
) -> Vec<(i32, String, Option<String>, Option<i32>, bool)> {
    let c = db.client().await;
    c.query(
        "SELECT a.attempt, a.outcome, a.error_class, a.status, a.deduplicated FROM outbox.attempts a \
         JOIN outbox.messages m ON m.id = a.message_id WHERE m.message_key = $1 ORDER BY a.id",
        &[&key],
    )
    .await
    .expect("attempts")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
    .collect()
}

/// Enqueues a webhook to `url` with a small body, committed.
pub async fn enqueue_webhook(
    db: &TestDb,
    key: &str,
    url: &str,
    max_attempts: i32,
    retry_ambiguous: bool,
) -> i64 {
    let c = db.client().await;
    let msg = outboxd::NewMessage::webhook(
        key,
        serde_json::json!({"url": url, "body": {"key": key, "n": 1}}),
    )
    .max_attempts(max_attempts)
    .retry_ambiguous(retry_ambiguous);
    outboxd::enqueue(&c, &msg).await.expect("enqueue").id
}

/// Waits until exactly `n` messages are in `state` (counted through `c`).
pub async fn wait_for_count(c: &Client, state: &str, n: i64, timeout: Duration) {
    let what = format!("{n} messages {state}");
    wait_until(timeout, &what, || async move {
        let got: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.messages WHERE state = $1",
                &[&state],
            )
            .await
            .map(|r| r.get(0))
            .unwrap_or(-1);
        got == n
    })
    .await;
}

/// A connection LISTENing on `outbox_messages`, its notifications (channel, payload)
/// forwarded to a channel in commit order. The connection is driven by `poll_message`, which
/// is what delivers asynchronous notifications. It does not hold the idle mark (`outbox.wake_needed`):
/// enqueueing transactions notify only while some session does.
pub async fn listener(
    db: &TestDb,
) -> (
    Client,
    tokio::sync::mpsc::UnboundedReceiver<(String, String)>,
) {
    let (client, mut conn) = db.pg.connect(NoTls).await.expect("connect to PostgreSQL");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(msg) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
            match msg {
                Ok(AsyncMessage::Notification(n)) => {
                    let _ = tx.send((n.channel().to_owned(), n.payload().to_owned()));
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    client
        .batch_execute("LISTEN outbox_messages")
        .await
        .expect("LISTEN");
    (client, rx)
}

/// Takes the idle mark (`outbox.wake_needed`) on `client`'s session, as an idle worker's LISTEN
/// connection does: from then on, every enqueueing transaction notifies at commit.
pub async fn hold_idle_mark(client: &Client) {
    client
        .batch_execute("SELECT pg_advisory_lock_shared(1869968482, 2)")
        .await
        .expect("take the idle mark");
}

/// How many sessions hold the idle mark (`outbox.wake_needed`): an idle worker's LISTEN connection takes
/// it once it is listening and its claims come back short.
pub async fn idle_marks(db: &TestDb) -> i64 {
    db.scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND classid = 1869968482 AND objid = 2 AND objsubid = 2 AND granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .await
}

/// Waits until exactly `n` sessions hold the idle mark (see [`idle_marks`]).
pub async fn wait_for_idle_marks(db: &TestDb, n: i64, what: &str) {
    wait_until(Duration::from_secs(10), what, || async move {
        idle_marks(db).await == n
    })
    .await;
}

/// The files under `dir` whose name ends in `.ext`, at any depth, in path order (the tidy
/// and docs tests read the tree with it).
pub fn files_under(dir: &std::path::Path, ext: &str) -> Vec<std::path::PathBuf> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    let mut out = Vec::new();
    for p in entries {
        if p.is_dir() {
            out.extend(files_under(&p, ext));
        } else if p.extension().is_some_and(|e| e == ext) {
            out.push(p);
        }
    }
    out
}
