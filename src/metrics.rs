//! Metrics and health: `GET /metrics` (Prometheus text) and `GET /healthz`.
//!
//! The worker records through the `metrics` facade, which does nothing until
//! [`install`] sets the Prometheus recorder (only `outboxd run --metrics-addr` does), so
//! embedding the library costs nothing. Gauges that describe the table (messages by state,
//! oldest due age) are read from the database at scrape time, so they are true whichever
//! worker did the work; a scrape reads at most a bounded number of index entries per state,
//! however many delivered rows the table keeps (see [`crate::status::bounded_counts`]).

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use deadpool_postgres::Pool;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::model::Channel;
use crate::model::ConfigError;
use crate::model::{AttemptOutcome, State as MessageState};

/// Attempts finished, by channel and recorded outcome.
pub const DELIVERIES_TOTAL: &str = "outboxd_deliveries_total";
/// Duration of one delivery attempt (the network call), by channel.
pub const DELIVERY_DURATION: &str = "outboxd_delivery_duration_seconds";
/// Messages in the table, by state (read at scrape time; exact up to
/// [`crate::status::COUNT_CAP`], estimated beyond).
pub const MESSAGES: &str = "outboxd_messages";
/// 1 where `outboxd_messages` of that state is an estimate (the state holds more than
/// [`crate::status::COUNT_CAP`] messages), else 0.
pub const MESSAGES_ESTIMATED: &str = "outboxd_messages_estimated";
/// Seconds since the oldest due pending message became due (read at scrape time).
pub const OLDEST_DUE: &str = "outboxd_oldest_due_seconds";
/// Destinations whose circuit breaker is open or half-open (read at scrape time).
pub const DESTINATIONS_OPEN: &str = "outboxd_destinations_open";
/// Destinations a person has paused (read at scrape time).
pub const DESTINATIONS_PAUSED: &str = "outboxd_destinations_paused";
/// Channels a person has paused (read at scrape time).
pub const CHANNELS_PAUSED: &str = "outboxd_channels_paused";
/// 1 when the last scrape read the counts above from the database, 0 when it could not:
/// those gauges then keep their last values, which must not pass for a quiet queue.
pub const DATABASE_UP: &str = "outboxd_database_up";
/// Rows returned by each claim.
pub const CLAIM_BATCH_SIZE: &str = "outboxd_claim_batch_size";

/// Log lines dropped because stderr was closed, full or failing ([`crate::logging::sink`]):
/// the worker goes on delivering and recording without them.
pub const LOG_LINES_DROPPED: &str = "outboxd_log_lines_dropped_total";

/// Claimed messages given back unsent to be tried later, by channel and reason.
pub const DEFERRALS_TOTAL: &str = "outboxd_deferrals_total";

/// Records one deferral (`state::Deferral`): not an attempt, so not in
/// [`DELIVERIES_TOTAL`].
pub fn deferred(channel: Channel, reason: crate::state::DeferReason) {
    metrics::counter!(DEFERRALS_TOTAL, "channel" => channel.as_str(), "reason" => reason.as_str())
        .increment(1);
}

/// Records one finished attempt.
pub fn attempt(channel: Channel, outcome: AttemptOutcome, duration: Duration) {
    metrics::counter!(DELIVERIES_TOTAL, "channel" => channel.as_str(), "outcome" => outcome.as_str()).increment(1);
    metrics::histogram!(DELIVERY_DURATION, "channel" => channel.as_str())
        .record(duration.as_secs_f64());
}

/// Records an attempt whose lease expired, as the lease sweep settled it (`dead`, or
/// `lease_lost` when it is retried later): an outcome with no delivery duration of its own.
pub fn expired(channel: Channel, outcome: AttemptOutcome) {
    metrics::counter!(DELIVERIES_TOTAL, "channel" => channel.as_str(), "outcome" => outcome.as_str())
        .increment(1);
}

/// Records the size of one claim.
pub fn claim_batch(rows: usize) {
    metrics::histogram!(CLAIM_BATCH_SIZE).record(rows as f64);
}

/// Installs the Prometheus recorder for this process (once).
pub fn install() -> Result<PrometheusHandle, ConfigError> {
    let duration_buckets = [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    let batch_buckets = [
        0.0, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(DELIVERY_DURATION.into()), &duration_buckets)
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(CLAIM_BATCH_SIZE.into()), &batch_buckets)
        })
        .map_err(|e| ConfigError(format!("metrics: {e}")))?
        .install_recorder()
        .map_err(|e| ConfigError(format!("metrics: {e}")))?;
    metrics::describe_counter!(
        DELIVERIES_TOTAL,
        "Delivery attempts finished, by channel and outcome."
    );
    metrics::describe_counter!(
        DEFERRALS_TOTAL,
        "Claimed messages given back unsent to be tried later (not attempts), by channel and reason."
    );
    metrics::describe_histogram!(
        DELIVERY_DURATION,
        metrics::Unit::Seconds,
        "Duration of one delivery attempt."
    );
    metrics::describe_gauge!(
        MESSAGES,
        format!(
            "Messages in outbox.messages, by state (exact up to {}, estimated beyond).",
            crate::status::COUNT_CAP
        )
    );
    metrics::describe_gauge!(
        MESSAGES_ESTIMATED,
        "1 where outboxd_messages of that state is PostgreSQL's estimate, else 0."
    );
    metrics::describe_gauge!(
        OLDEST_DUE,
        metrics::Unit::Seconds,
        "Age of the oldest due pending message."
    );
    metrics::describe_gauge!(
        DESTINATIONS_OPEN,
        "Destinations whose circuit breaker is open or half-open."
    );
    metrics::describe_gauge!(
        DESTINATIONS_PAUSED,
        "Destinations a person has paused (outboxd destinations --pause)."
    );
    metrics::describe_gauge!(
        CHANNELS_PAUSED,
        "Channels a person has paused (outboxd channels --pause)."
    );
    metrics::describe_gauge!(
        DATABASE_UP,
        "1 when this scrape read the message counts from the database, 0 when it could not (they keep their last values)."
    );
    metrics::describe_histogram!(CLAIM_BATCH_SIZE, "Rows returned by each claim.");
    metrics::describe_counter!(
        LOG_LINES_DROPPED,
        "Log lines dropped because stderr was closed, full or failing."
    );
    Ok(handle)
}

#[derive(Clone)]
struct AppState {
    pool: Pool,
    handle: PrometheusHandle,
}

/// Binds `addr` and serves /metrics and /healthz until the process ends. Returns the bound
/// address (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    pool: Pool,
    handle: PrometheusHandle,
) -> Result<SocketAddr, ConfigError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| ConfigError(format!("--metrics-addr {addr}: cannot listen: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| ConfigError(format!("--metrics-addr: {e}")))?;
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(metrics_route))
        .route("/healthz", axum::routing::get(healthz))
        .with_state(AppState { pool, handle });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    tracing::info!(addr = %bound, "serving /metrics and /healthz");
    Ok(bound)
}

/// A bounded wait for the database, so a scrape or a probe never hangs on an outage.
const DB_TIMEOUT: Duration = Duration::from_secs(2);

async fn metrics_route(State(st): State<AppState>) -> impl IntoResponse {
    let status = tokio::time::timeout(DB_TIMEOUT, async {
        let client = st.pool.get().await.map_err(|e| e.to_string())?;
        crate::status::bounded_counts(&**client, crate::status::COUNT_CAP)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let up = matches!(status, Ok(Ok(_)));
    match status {
        Ok(Ok(s)) => {
            for state in MessageState::ALL {
                metrics::gauge!(MESSAGES, "state" => state.as_str())
                    .set(s.counts.get(state) as f64);
                let estimated = if s.estimated.contains(&state) {
                    1.0
                } else {
                    0.0
                };
                metrics::gauge!(MESSAGES_ESTIMATED, "state" => state.as_str()).set(estimated);
            }
            metrics::gauge!(OLDEST_DUE).set(s.oldest_due_seconds);
            metrics::gauge!(DESTINATIONS_OPEN).set(s.open_destinations as f64);
            metrics::gauge!(DESTINATIONS_PAUSED).set(s.paused_destinations as f64);
            metrics::gauge!(CHANNELS_PAUSED).set(s.paused_channels as f64);
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "metrics: cannot read message counts"),
        Err(_) => tracing::warn!("metrics: reading message counts timed out"),
    }
    metrics::gauge!(DATABASE_UP).set(if up { 1.0 } else { 0.0 });
    metrics::counter!(LOG_LINES_DROPPED).absolute(crate::logging::sink::dropped());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        st.handle.render(),
    )
}

async fn healthz(State(st): State<AppState>) -> impl IntoResponse {
    let ok = tokio::time::timeout(DB_TIMEOUT, async {
        let client = st.pool.get().await.ok()?;
        client.simple_query(crate::queries::HEALTH_CHECK).await.ok()
    })
    .await;
    match ok {
        Ok(Some(_)) => (StatusCode::OK, "ok\n"),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "database unreachable\n"),
    }
}
