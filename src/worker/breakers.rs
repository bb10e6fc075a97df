//! Circuit breakers shared through the database (`outbox.destinations`, `sql/0014`).
//!
//! The completer counts each batch's webhook outcomes per destination in one statement
//! ([`queries::BREAKER_RECORD`]), skipped when nothing failed and no success concerns a host
//! known to be failing, so healthy traffic pays no write. When a host opens, its due backlog
//! is pushed past the cooldown once, off the hot path ([`queries::BREAKER_PUSH`]), so the
//! claim (unchanged) does not keep picking rows it may not send. Every worker reads the
//! non-closed hosts at most once per poll interval ([`Breakers::refresh`]); the claim loop
//! then defers (uncounted, no history row) a claimed row whose host is open, or lets one
//! row through as the probe ([`Breakers::gate`]). A successful probe closes the host and
//! brings the pushed backlog back ([`queries::BREAKER_RESTORE`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;

use super::db_call::{bounded, checkout};
use crate::claim::Completion;
use crate::model::ErrorClass;
use crate::queries;
use crate::state::Circuit;
use crate::support::lock;
use crate::text::Escaped;

/// What this worker knows of a host that is failing or not closed.
#[derive(Debug, Clone)]
struct HostView {
    circuit: Circuit,
    /// When an open circuit's cooldown ends.
    open_until: Option<Instant>,
    /// When a half-open circuit's probe window ends.
    probe_until: Option<Instant>,
    /// This worker has given a row back to come due when the cooldown ends, to be the
    /// probe; the others it claims meanwhile wait past the probe's window.
    probe_row: bool,
}

/// What the claim loop does with one claimed row.
pub(super) enum Gate {
    /// Send it (the host is closed, or this is its probe).
    Send,
    /// Give it back unsent, due again after this.
    Defer(Duration),
}

/// The worker's breakers: settings, the cached view, and the hosts of rows in flight.
pub(super) struct Breakers {
    threshold: u32,
    cooldown: Duration,
    max_cooldown: Duration,
    /// The probe window: the webhook timeout plus the lease margin.
    window: Duration,
    view: Mutex<HashMap<String, HostView>>,
    refreshed: Mutex<Option<Instant>>,
    /// The destination of each claimed row in flight, by id, for the completer.
    inflight: Mutex<HashMap<i64, String>>,
}

/// How close to the end of a cooldown a claimed row is sent back to be the probe.
const NEAR: Duration = Duration::from_millis(250);

/// Rows moved by one push or restore statement.
const BATCH: i64 = 5000;

impl Breakers {
    pub(super) fn new(cfg: &crate::config::WorkerConfig, webhook_timeout: Duration) -> Self {
        Breakers {
            threshold: cfg.breaker_threshold,
            cooldown: cfg.breaker_cooldown,
            max_cooldown: cfg.retry.max.max(cfg.breaker_cooldown),
            window: webhook_timeout + crate::config::LEASE_MARGIN,
            view: Mutex::new(HashMap::new()),
            refreshed: Mutex::new(None),
            inflight: Mutex::new(HashMap::new()),
        }
    }

    /// Breakers are on (`--breaker-threshold` > 0).
    pub(super) fn enabled(&self) -> bool {
        self.threshold > 0
    }

    /// Reads the non-closed and failing hosts, at most once per `every`.
    pub(super) async fn refresh(&self, pool: &Pool, every: Duration) {
        if !self.enabled() {
            return;
        }
        {
            let mut last = lock(&self.refreshed);
            if last.is_some_and(|t| t.elapsed() < every) {
                return;
            }
            *last = Some(Instant::now());
        }
        let rows = match query(pool, queries::BREAKER_VIEW, &[]).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "reading circuit breakers failed");
                return;
            }
        };
        let now = Instant::now();
        let at = |secs: Option<f64>| {
            secs.map(|s| {
                if s > 0.0 {
                    now + Duration::from_secs_f64(s.min(1e9))
                } else {
                    now.checked_sub(Duration::from_secs_f64((-s).min(1e6)))
                        .unwrap_or(now)
                }
            })
        };
        let mut view = HashMap::new();
        let old = std::mem::take(&mut *lock(&self.view));
        for row in rows {
            let host: String = row.get(0);
            let Some(circuit) = Circuit::parse(row.get(1)) else {
                continue;
            };
            // Kept across refreshes of the same opening: one probe row per opening.
            let probe_row = circuit == Circuit::Open
                && old
                    .get(&host)
                    .is_some_and(|o| o.circuit == Circuit::Open && o.probe_row);
            view.insert(
                host,
                HostView {
                    circuit,
                    open_until: at(row.get(3)),
                    probe_until: at(row.get(4)),
                    probe_row,
                },
            );
        }
        *lock(&self.view) = view;
    }

    /// Whether a claimed row for `host` may be sent now; takes the probe when the cooldown
    /// has passed (one statement, only then).
    pub(super) async fn gate(&self, pool: &Pool, id: i64, host: &str) -> Gate {
        if !self.enabled() {
            return Gate::Send;
        }
        let now = Instant::now();
        let seen = lock(&self.view).get(host).cloned();
        let gate = match seen {
            None
            | Some(HostView {
                circuit: Circuit::Closed,
                ..
            }) => Gate::Send,
            Some(v) => {
                let until = match v.circuit {
                    Circuit::Open => v.open_until,
                    _ => v.probe_until,
                };
                match until {
                    // One row per opening (and the rows claimed close to its end: this
                    // view's clock may run a few milliseconds behind the database's) comes
                    // back just after the cooldown, to be the probe; the others wait past
                    // the probe's window, so a backlog is given back once per opening.
                    Some(t)
                        if t > now
                            && v.circuit == Circuit::Open
                            && (!v.probe_row || t - now <= NEAR) =>
                    {
                        if let Some(h) = lock(&self.view).get_mut(host) {
                            h.probe_row = true;
                        }
                        Gate::Defer(t - now + Duration::from_millis(5))
                    }
                    Some(t) if t > now => Gate::Defer(
                        t - now
                            + if v.circuit == Circuit::Open {
                                self.window
                            } else {
                                Duration::ZERO
                            },
                    ),
                    _ => self.take_probe(pool, host).await,
                }
            }
        };
        if matches!(gate, Gate::Send) {
            lock(&self.inflight).insert(id, host.to_owned());
        }
        gate
    }

    async fn take_probe(&self, pool: &Pool, host: &str) -> Gate {
        let window = self.window.as_secs_f64();
        let taken = query(pool, queries::BREAKER_TAKE_PROBE, &[&host, &window])
            .await
            .map(|rows| rows.into_iter().next());
        let probe_until = Some(Instant::now() + self.window);
        // Won or lost, the host is half-open for a window: the other rows wait for it.
        lock(&self.view).insert(
            host.to_owned(),
            HostView {
                circuit: Circuit::HalfOpen,
                open_until: None,
                probe_until,
                probe_row: false,
            },
        );
        match taken {
            Ok(Some(_)) => {
                tracing::info!(host = %Escaped(host), "breaker half-open: sending one probe");
                Gate::Send
            }
            Ok(None) => Gate::Defer(self.window),
            Err(e) => {
                tracing::warn!(error = %e, "taking a breaker probe failed");
                Gate::Defer(self.window)
            }
        }
    }

    /// Forgets the in-flight host of rows given back unsent.
    pub(super) fn forget(&self, ids: impl Iterator<Item = i64>) {
        if !self.enabled() {
            return;
        }
        let mut inflight = lock(&self.inflight);
        for id in ids {
            inflight.remove(&id);
        }
    }

    /// Counts a batch's webhook outcomes per destination (see [`queries::BREAKER_RECORD`]),
    /// unless nothing in it concerns a breaker; logs transitions and moves backlogs.
    pub(super) async fn record(&self, pool: &Pool, completions: &[Completion]) {
        if !self.enabled() {
            return;
        }
        // host -> (a success came, failures after the last success), in batch order.
        let mut per_host: Vec<(String, bool, i32)> = Vec::new();
        {
            let mut inflight = lock(&self.inflight);
            let view = lock(&self.view);
            for c in completions {
                let Some(host) = inflight.remove(&c.id) else {
                    continue;
                };
                let failed = match c.transition.error_class() {
                    None | Some(ErrorClass::Permanent) => false,
                    Some(ErrorClass::Transient | ErrorClass::Ambiguous | ErrorClass::Exhausted) => {
                        true
                    }
                    Some(ErrorClass::Invalid) => continue,
                };
                if !failed && !view.contains_key(&host) {
                    continue;
                }
                let slot = match per_host.iter().position(|(h, _, _)| *h == host) {
                    Some(i) => i,
                    None => {
                        per_host.push((host, false, 0));
                        per_host.len() - 1
                    }
                };
                let e = &mut per_host[slot];
                if failed {
                    e.2 += 1;
                } else {
                    e.1 = true;
                    e.2 = 0;
                }
            }
        }
        if per_host.is_empty() {
            return;
        }
        let hosts: Vec<&str> = per_host.iter().map(|(h, _, _)| h.as_str()).collect();
        let resets: Vec<bool> = per_host.iter().map(|e| e.1).collect();
        let fails: Vec<i32> = per_host.iter().map(|e| e.2).collect();
        let threshold = i32::try_from(self.threshold).unwrap_or(i32::MAX);
        let cooldown = self.cooldown.as_secs_f64();
        let max = self.max_cooldown.as_secs_f64();
        let rows = query(
            pool,
            queries::BREAKER_RECORD,
            &[&hosts, &resets, &fails, &threshold, &cooldown, &max],
        )
        .await;
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "recording breaker outcomes failed");
                return;
            }
        };
        let now = Instant::now();
        for row in rows {
            let host: String = row.get(0);
            let state: &str = row.get(2);
            let failures: i32 = row.get(3);
            let cooldown: Option<f64> = row.get(4);
            let open_in: Option<f64> = row.get(5);
            let pushed: Option<std::time::SystemTime> = row.get(6);
            match Circuit::parse(state) {
                Some(Circuit::Open) => {
                    tracing::warn!(
                        host = %Escaped(&host), failures,
                        cooldown_ms = (cooldown.unwrap_or(0.0) * 1000.0) as u64,
                        "breaker opened"
                    );
                    lock(&self.view).insert(
                        host.clone(),
                        HostView {
                            circuit: Circuit::Open,
                            open_until: Some(
                                now + Duration::from_secs_f64(open_in.unwrap_or(0.0).min(1e9)),
                            ),
                            probe_until: None,
                            probe_row: false,
                        },
                    );
                    tokio::spawn(push(pool.clone(), host, self.window));
                }
                Some(Circuit::Closed) => {
                    tracing::info!(host = %Escaped(&host), "breaker closed");
                    lock(&self.view).remove(&host);
                    if let Some(at) = pushed {
                        tokio::spawn(restore(pool.clone(), host, at));
                    }
                }
                _ => {}
            }
        }
    }
}

/// One statement of the breakers on a pooled connection, bounded in time; failures as one
/// line (the breakers never stop deliveries: a failed read or write is logged and skipped).
async fn query(
    pool: &Pool,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, String> {
    bounded(async {
        let client = checkout(pool).await?;
        client
            .query(sql, params)
            .await
            .map_err(|e| crate::db::describe(&e))
    })
    .await
}

/// Pushes an open host's backlog past its cooldown, in batches, off the hot path.
async fn push(pool: Pool, host: String, window: Duration) {
    let window = window.as_secs_f64();
    let mut total = 0i64;
    let mut after = 0i64;
    loop {
        let moved = query(
            &pool,
            queries::BREAKER_PUSH,
            &[&host, &window, &BATCH, &after],
        )
        .await;
        match moved.map(|rows| {
            rows.first().map_or((0, None), |r| {
                (r.get::<_, i64>(0), r.get::<_, Option<i64>>(1))
            })
        }) {
            Ok((n, last)) => {
                total += n;
                match last {
                    Some(last) => after = last,
                    None => break,
                }
            }
            Err(e) => {
                tracing::warn!(host = %Escaped(&host), error = %e, "pushing an open host's backlog failed");
                break;
            }
        }
    }
    tracing::info!(host = %Escaped(&host), moved = total, "open host's backlog moved past its cooldown");
}

/// Brings a closed host's pushed backlog back: due at once.
async fn restore(pool: Pool, host: String, at: std::time::SystemTime) {
    let restored = bounded(async {
        let client = checkout(&pool).await?;
        crate::ops::restore_backlog(&**client, &host, at)
            .await
            .map_err(|e| crate::db::describe(&e))
    })
    .await;
    match restored {
        Ok(n) => {
            tracing::info!(host = %Escaped(&host), moved = n, "closed host's backlog due again")
        }
        Err(e) => {
            tracing::warn!(host = %Escaped(&host), error = %e, "bringing back a closed host's backlog failed")
        }
    }
}
