//! The lease: claiming due messages, and fenced writes about them afterwards.
//!
//! Why a lease token and not just "the row is running": a worker can stall (a GC-like
//! pause, a frozen VM, a partition from the database) past its lease, and another worker
//! then takes the row over and sends it again. When the first worker wakes up, its view of
//! the row is stale; if its completion were applied, it could overwrite the newer attempt's
//! result (mark as dead a message the second worker delivered, or the reverse). Every write
//! after the claim therefore names the token it was given, and matches zero rows once the
//! token has changed: the stale worker's result is recorded as `lease_lost` in the history
//! and changes nothing else.

use std::time::{Duration, SystemTime};

use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use crate::model::AttemptOutcome;
use crate::model::Channel;
use crate::model::ErrorClass;
use crate::queries;
use crate::retry::RetryPolicy;
use crate::state::{Budget, Ended, KEY_WINDOW_CLOSED, Transition, decide};

/// The error a settled expired lease records: nothing is known of the attempt's outcome.
const LEASE_EXPIRED: &str = "lease expired while running: the attempt may have taken effect";

/// A message claimed by this worker for one attempt.
#[derive(Clone)]
pub struct Claimed {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub key: String,
    /// Its channel.
    pub channel: Channel,
    /// The payload, as jsonb's text form.
    pub payload: String,
    /// The number of this attempt (1 for the first).
    pub attempt: i32,
    /// The whole attempt budget.
    pub max_attempts: i32,
    /// May an ambiguous failure be retried?
    pub retry_ambiguous: bool,
    /// The lease token every later write must present.
    pub lease_token: Uuid,
    /// The class the previous attempt left on the row (`ambiguous` after a timeout, a lost
    /// connection or an expired lease), `None` before the first attempt or after a replay.
    pub previous_class: Option<ErrorClass>,
    /// The payload names a reconciliation lookup (a webhook's `reconcile`): after an
    /// ambiguous attempt the next one asks first. Read from `lookup_destination`, which the
    /// insert trigger sets exactly for such a payload whose lookup URL has a name (one
    /// without is refused as invalid before its first request).
    pub reconcile: bool,
    /// Where a webhook goes, as the insert trigger named it (`outbox.destination_of`): the
    /// key of the rules per destination. `None` for e-mail and for a URL without a name
    /// (refused before any request).
    pub destination: Option<String>,
    /// Where its reconciliation lookup goes, named the same way.
    pub lookup_destination: Option<String>,
    /// When the provider may forget the key (`outbox.key_expires_at`: the first attempt's
    /// start plus the endpoint's `key_ttl`); `None` without a `key_ttl`.
    pub key_expires_at: Option<SystemTime>,
}

impl std::fmt::Debug for Claimed {
    /// Everything but the payload, of which only its length: a payload carries URLs with
    /// tokens, header values and the body, none of which may reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimed")
            .field("id", &self.id)
            .field("key", &self.key)
            .field("channel", &self.channel)
            .field("payload_len", &self.payload.len())
            .field("attempt", &self.attempt)
            .field("max_attempts", &self.max_attempts)
            .field("retry_ambiguous", &self.retry_ambiguous)
            .field("lease_token", &self.lease_token)
            .field("previous_class", &self.previous_class)
            .field("reconcile", &self.reconcile)
            .field("destination", &self.destination)
            .field("lookup_destination", &self.lookup_destination)
            .finish()
    }
}

/// A row whose lease had expired and that may not be sent again: dead-lettered by
/// [`settle_expired`] (class `ambiguous`).
#[derive(Debug, Clone)]
pub struct GaveUp {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub key: String,
    /// Its channel.
    pub channel: Channel,
    /// The attempt whose lease expired.
    pub attempt: i32,
    /// The whole attempt budget.
    pub max_attempts: i32,
}

/// A row whose lease had expired and that may be sent again: [`settle_expired`] made it
/// `pending`, due after the retry backoff.
#[derive(Debug, Clone)]
pub struct Deferred {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub key: String,
    /// Its channel.
    pub channel: Channel,
    /// The attempt whose lease expired.
    pub attempt: i32,
    /// The whole attempt budget.
    pub max_attempts: i32,
    /// How long until it is due again.
    pub retry_in: Duration,
}

/// What one [`settle_expired`] did.
#[derive(Debug, Default)]
pub struct Settled {
    /// Messages dead-lettered because their lease expired with no retry allowed.
    pub gave_up: Vec<GaveUp>,
    /// Messages whose lease expired, back to `pending` after the retry backoff.
    pub deferred: Vec<Deferred>,
}

impl Settled {
    /// How many rows it settled.
    pub fn len(&self) -> usize {
        self.gave_up.len() + self.deferred.len()
    }

    /// True when it settled none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The parameter types of [`queries::CLAIM`].
const CLAIM_TYPES: [Type; 5] = [
    Type::TEXT_ARRAY,
    Type::INT8,
    Type::TEXT,
    Type::FLOAT8,
    Type::UUID,
];

/// Claims up to `limit` due messages of `channels` for `worker`, leased for `lease`. A
/// message whose lease expired is claimed again only once [`settle_expired`] has settled it.
pub async fn claim<C: GenericClient>(
    client: &C,
    channels: &[Channel],
    limit: usize,
    worker: &str,
    lease: Duration,
) -> Result<Vec<Claimed>, tokio_postgres::Error> {
    let args = ClaimArgs::new(channels, limit, lease, new_token());
    let params = args.params(&worker);
    let typed: Vec<(&(dyn ToSql + Sync), Type)> = params.iter().copied().zip(CLAIM_TYPES).collect();
    let rows = client.query_typed(queries::CLAIM, &typed).await?;
    Ok(claimed_rows(rows))
}

/// [`claim`] through a pooled connection, with the statement prepared once per connection
/// (parsing and planning the claim costs about as much as running it for a small batch).
pub async fn claim_cached(
    client: &deadpool_postgres::Client,
    channels: &[Channel],
    limit: usize,
    worker: &str,
    lease: Duration,
) -> Result<Vec<Claimed>, tokio_postgres::Error> {
    claim_cached_as(client, channels, limit, worker, lease, new_token()).await
}

/// A fresh lease token: random (version 4), from the thread's CSPRNG.
pub fn new_token() -> Uuid {
    uuid::Builder::from_random_bytes(rand::random()).into_uuid()
}

/// [`claim_cached`] under a lease token the caller chose, so that it can give the rows
/// back ([`release_lost_claim`]) when the claim's answer does not come back.
pub async fn claim_cached_as(
    client: &deadpool_postgres::Client,
    channels: &[Channel],
    limit: usize,
    worker: &str,
    lease: Duration,
    token: Uuid,
) -> Result<Vec<Claimed>, tokio_postgres::Error> {
    let args = ClaimArgs::new(channels, limit, lease, token);
    let params = args.params(&worker);
    let rows = cached(client, queries::CLAIM, &CLAIM_TYPES, &params).await?;
    Ok(claimed_rows(rows))
}

/// Settles up to `limit` expired leases of `channels`: each is an ambiguous attempt, and
/// [`decide`] (the one owner of that rule, as of every other attempt's end) says whether it
/// is dead-lettered or made `pending` again after `retry`'s backoff, counted from when the
/// lease ran out. Reads the rows ([`queries::EXPIRED_LEASES`]), decides, and writes the
/// decisions in one statement fenced by each row's lease token
/// ([`queries::SETTLE_EXPIRED`]): a row settled or completed meanwhile is left alone.
pub async fn settle_expired<C: GenericClient>(
    client: &C,
    channels: &[Channel],
    limit: usize,
    retry: &RetryPolicy,
) -> Result<Settled, tokio_postgres::Error> {
    let names: Vec<&str> = channels.iter().map(|c| c.as_str()).collect();
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let expired = client
        .query_typed(
            queries::EXPIRED_LEASES,
            &[(&names, Type::TEXT_ARRAY), (&limit, Type::INT8)],
        )
        .await?;
    if expired.is_empty() {
        return Ok(Settled::default());
    }
    let n = expired.len();
    let mut ids = Vec::with_capacity(n);
    let mut tokens: Vec<Uuid> = Vec::with_capacity(n);
    let mut states = Vec::with_capacity(n);
    let mut delays = Vec::with_capacity(n);
    let mut owners: Vec<Option<String>> = Vec::with_capacity(n);
    let mut started: Vec<SystemTime> = Vec::with_capacity(n);
    let mut errors: Vec<String> = Vec::with_capacity(n);
    for row in &expired {
        let key_window_closed: bool = row.get("key_window_closed");
        let budget = Budget {
            attempt: row.get("attempts"),
            max_attempts: row.get("max_attempts"),
            retry_ambiguous: row.get("retry_ambiguous"),
            reconcile: row.get("reconcile"),
            after_ambiguous: false,
        }
        .key_window(key_window_closed);
        let t = decide(
            Ended::Failed(ErrorClass::Ambiguous),
            budget,
            retry,
            None,
            rand::random(),
        );
        ids.push(row.get::<_, i64>("id"));
        tokens.push(row.get("lease_token"));
        states.push(t.next_state().as_str());
        delays.push(match t {
            Transition::Retry { delay, .. } => delay.as_secs_f64(),
            _ => 0.0,
        });
        owners.push(row.get("lease_owner"));
        started.push(row.get("started"));
        errors.push(
            if key_window_closed && !budget.reconcile && matches!(t, Transition::Dead { .. }) {
                format!("{LEASE_EXPIRED}; {KEY_WINDOW_CLOSED}")
            } else {
                LEASE_EXPIRED.to_owned()
            },
        );
    }
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&ids, Type::INT8_ARRAY),
        (&tokens, Type::UUID_ARRAY),
        (&states, Type::TEXT_ARRAY),
        (&delays, Type::FLOAT8_ARRAY),
        (&owners, Type::TEXT_ARRAY),
        (&started, Type::TIMESTAMPTZ_ARRAY),
        (&errors, Type::TEXT_ARRAY),
    ];
    let rows = client.query_typed(queries::SETTLE_EXPIRED, &params).await?;
    let mut settled = Settled::default();
    for row in rows {
        let channel: &str = row.get("channel");
        // The CHECK constraint admits only known channels; skip defensively otherwise.
        let Some(channel) = Channel::parse(channel) else {
            continue;
        };
        let state: &str = row.get("state");
        if state == crate::model::State::Dead.as_str() {
            settled.gave_up.push(GaveUp {
                id: row.get("id"),
                key: row.get("message_key"),
                channel,
                attempt: row.get("attempts"),
                max_attempts: row.get("max_attempts"),
            });
        } else {
            let secs: f64 = row.get("retry_in");
            settled.deferred.push(Deferred {
                id: row.get("id"),
                key: row.get("message_key"),
                channel,
                attempt: row.get("attempts"),
                max_attempts: row.get("max_attempts"),
                retry_in: Duration::try_from_secs_f64(secs).unwrap_or_default(),
            });
        }
    }
    Ok(settled)
}

/// Runs a statement prepared once per connection. On an error the connection's cache is
/// emptied, so a statement invalidated by a schema change is prepared afresh next time.
async fn cached(
    client: &deadpool_postgres::Client,
    sql: &str,
    types: &[Type],
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let result = async {
        let stmt = client.prepare_typed_cached(sql, types).await?;
        client.query(&stmt, params).await
    }
    .await;
    if result.is_err() {
        client.statement_cache.clear();
    }
    result
}

/// The claim's arguments in the types the statement takes.
struct ClaimArgs<'a> {
    channels: Vec<&'a str>,
    limit: i64,
    lease_secs: f64,
    /// This claim's lease token ([`new_token`]).
    token: Uuid,
}

impl<'a> ClaimArgs<'a> {
    fn new(channels: &'a [Channel], limit: usize, lease: Duration, token: Uuid) -> Self {
        ClaimArgs {
            channels: channels.iter().map(|c| c.as_str()).collect(),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            lease_secs: lease.as_secs_f64(),
            token,
        }
    }

    fn params<'b>(&'b self, worker: &'b &str) -> [&'b (dyn ToSql + Sync); 5] {
        [
            &self.channels,
            &self.limit,
            worker,
            &self.lease_secs,
            &self.token,
        ]
    }
}

fn claimed_rows(rows: Vec<tokio_postgres::Row>) -> Vec<Claimed> {
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        let channel: &str = row.get("channel");
        // The CHECK constraint admits only known channels; skip defensively otherwise.
        let Some(channel) = Channel::parse(channel) else {
            continue;
        };
        let previous_class: Option<&str> = row.get("error_class");
        let payload: String = row.get("payload");
        let lookup_destination: Option<String> = row.get("lookup_destination");
        claimed.push(Claimed {
            id: row.get("id"),
            key: row.get("message_key"),
            channel,
            payload,
            attempt: row.get("attempts"),
            max_attempts: row.get("max_attempts"),
            retry_ambiguous: row.get("retry_ambiguous"),
            lease_token: row.get("lease_token"),
            previous_class: previous_class.and_then(ErrorClass::parse),
            reconcile: lookup_destination.is_some(),
            destination: row.get("destination"),
            lookup_destination,
            key_expires_at: row.get("key_expires_at"),
        });
    }
    claimed
}

/// The end of one attempt, ready to be written.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The message id.
    pub id: i64,
    /// The lease token from the claim.
    pub lease_token: Uuid,
    /// The number of this attempt.
    pub attempt: i32,
    /// What [`crate::state::decide`] made of the result.
    pub transition: Transition,
    /// One safe line, when it failed.
    pub error: Option<String>,
    /// HTTP status or SMTP code.
    pub status: Option<i32>,
    /// The provider deduplicated it.
    pub deduplicated: bool,
    /// Summary of the provider's answer.
    pub response: Option<serde_json::Value>,
    /// When the attempt started.
    pub started_at: SystemTime,
}

/// The parameter types of [`queries::COMPLETE`].
const COMPLETE_TYPES: [Type; 13] = [
    Type::INT8_ARRAY,
    Type::UUID_ARRAY,
    Type::TEXT_ARRAY,
    Type::FLOAT8_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::JSONB_ARRAY,
    Type::INT4_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT4_ARRAY,
    Type::BOOL_ARRAY,
    Type::TIMESTAMPTZ_ARRAY,
    Type::TEXT,
];

/// Writes many completions in one statement; returns the outcome recorded for each
/// message id (`lease_lost` where the lease had been taken over).
pub async fn complete<C: GenericClient>(
    client: &C,
    worker: &str,
    batch: &[Completion],
) -> Result<Vec<(i64, AttemptOutcome)>, tokio_postgres::Error> {
    let args = CompleteArgs::new(batch);
    let params = args.params(&worker);
    let typed: Vec<(&(dyn ToSql + Sync), Type)> =
        params.iter().copied().zip(COMPLETE_TYPES).collect();
    let rows = client.query_typed(queries::COMPLETE, &typed).await?;
    Ok(outcomes(&rows))
}

/// [`complete`] through a pooled connection, with the statement prepared once per
/// connection.
pub async fn complete_cached(
    client: &deadpool_postgres::Client,
    worker: &str,
    batch: &[Completion],
) -> Result<Vec<(i64, AttemptOutcome)>, tokio_postgres::Error> {
    let args = CompleteArgs::new(batch);
    let params = args.params(&worker);
    let rows = cached(client, queries::COMPLETE, &COMPLETE_TYPES, &params).await?;
    Ok(outcomes(&rows))
}

/// [`complete_cached`] for a batch whose first statement failed, and may have committed
/// before its answer was lost ([`queries::COMPLETE_AGAIN`]): an attempt already recorded is
/// returned as recorded, not written again as `lease_lost`.
pub async fn complete_again(
    client: &mut tokio_postgres::Client,
    worker: &str,
    batch: &[Completion],
) -> Result<Vec<(i64, AttemptOutcome)>, tokio_postgres::Error> {
    let args = CompleteArgs::new(batch);
    let params = args.params(&worker);
    let typed: Vec<(&(dyn ToSql + Sync), Type)> =
        params.iter().copied().zip(COMPLETE_TYPES).collect();
    let tx = client.transaction().await?;
    // A failed try may still be running on the server (its answer lost, not its work):
    // its rows stay locked until it ends, and what it wrote is then in the snapshot of
    // the statement after this one (READ COMMITTED takes one per statement).
    tx.query_typed(queries::LOCK_COMPLETIONS, &[(&args.ids, Type::INT8_ARRAY)])
        .await?;
    let rows = tx.query_typed(queries::COMPLETE_AGAIN, &typed).await?;
    tx.commit().await?;
    Ok(outcomes(&rows))
}

/// The completion arrays, one element per finished attempt.
struct CompleteArgs<'a> {
    ids: Vec<i64>,
    tokens: Vec<Uuid>,
    states: Vec<&'static str>,
    delays: Vec<f64>,
    classes: Vec<Option<&'static str>>,
    errors: Vec<Option<&'a str>>,
    responses: Vec<Option<&'a serde_json::Value>>,
    attempts: Vec<i32>,
    outcomes: Vec<&'static str>,
    statuses: Vec<Option<i32>>,
    dedup: Vec<bool>,
    started: Vec<SystemTime>,
}

impl<'a> CompleteArgs<'a> {
    fn new(batch: &'a [Completion]) -> Self {
        let n = batch.len();
        let mut a = CompleteArgs {
            ids: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            states: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            classes: Vec::with_capacity(n),
            errors: Vec::with_capacity(n),
            responses: Vec::with_capacity(n),
            attempts: Vec::with_capacity(n),
            outcomes: Vec::with_capacity(n),
            statuses: Vec::with_capacity(n),
            dedup: Vec::with_capacity(n),
            started: Vec::with_capacity(n),
        };
        for c in batch {
            a.ids.push(c.id);
            a.tokens.push(c.lease_token);
            a.states.push(c.transition.next_state().as_str());
            a.delays.push(match c.transition {
                Transition::Retry { delay, .. } => delay.as_secs_f64(),
                _ => 0.0,
            });
            a.classes
                .push(c.transition.error_class().map(ErrorClass::as_str));
            a.errors.push(c.error.as_deref());
            a.responses.push(c.response.as_ref());
            a.attempts.push(c.attempt);
            a.outcomes.push(c.transition.outcome().as_str());
            a.statuses.push(c.status);
            a.dedup.push(c.deduplicated);
            a.started.push(c.started_at);
        }
        a
    }

    fn params<'b>(&'b self, worker: &'b &str) -> [&'b (dyn ToSql + Sync); 13] {
        [
            &self.ids,
            &self.tokens,
            &self.states,
            &self.delays,
            &self.classes,
            &self.errors,
            &self.responses,
            &self.attempts,
            &self.outcomes,
            &self.statuses,
            &self.dedup,
            &self.started,
            worker,
        ]
    }
}

fn outcomes(rows: &[tokio_postgres::Row]) -> Vec<(i64, AttemptOutcome)> {
    rows.iter()
        .map(|r| {
            let outcome: &str = r.get(1);
            let outcome = AttemptOutcome::parse(outcome).unwrap_or(AttemptOutcome::LeaseLost);
            (r.get(0), outcome)
        })
        .collect()
}

/// Gives back claimed messages this worker will not start (`released`, attempt not
/// counted). Returns the ids released (those whose lease was still ours).
pub async fn release<C: GenericClient>(
    client: &C,
    worker: &str,
    rows: &[(i64, Uuid)],
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let tokens: Vec<Uuid> = rows.iter().map(|r| r.1).collect();
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&ids, Type::INT8_ARRAY),
        (&tokens, Type::UUID_ARRAY),
        (&worker, Type::TEXT),
    ];
    let rows = client.query_typed(queries::RELEASE, &params).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Gives back every row still leased under `token`, a claim whose answer was lost
/// ([`queries::RELEASE_LOST_CLAIM`]). Returns the ids released.
pub async fn release_lost_claim<C: GenericClient>(
    client: &C,
    worker: &str,
    token: Uuid,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&token, Type::UUID), (&worker, Type::TEXT)];
    let rows = client
        .query_typed(queries::RELEASE_LOST_CLAIM, &params)
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Gives back claimed messages that are not to be sent yet (`(id, token, delay, breaker)`,
/// `breaker` when the delay waits for an open circuit): each is `pending` again, due after
/// its delay, its attempt not counted and no history row written (`queries::DEFER`, which
/// also shortens a breaker's delay whose circuit has closed meanwhile). Returns the ids
/// deferred (those whose lease was still ours).
pub async fn defer<C: GenericClient>(
    client: &C,
    rows: &[(i64, Uuid, Duration, bool)],
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let tokens: Vec<Uuid> = rows.iter().map(|r| r.1).collect();
    let delays: Vec<f64> = rows.iter().map(|r| r.2.as_secs_f64()).collect();
    let breaker: Vec<bool> = rows.iter().map(|r| r.3).collect();
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&ids, Type::INT8_ARRAY),
        (&tokens, Type::UUID_ARRAY),
        (&delays, Type::FLOAT8_ARRAY),
        (&breaker, Type::BOOL_ARRAY),
    ];
    let rows = client.query_typed(queries::DEFER, &params).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// True while anything of `channels` is pending or running.
pub async fn has_unfinished<C: GenericClient>(
    client: &C,
    channels: &[Channel],
) -> Result<bool, tokio_postgres::Error> {
    let channels: Vec<&str> = channels.iter().map(|c| c.as_str()).collect();
    let row = client
        .query_typed_one(queries::HAS_UNFINISHED, &[(&channels, Type::TEXT_ARRAY)])
        .await?;
    Ok(row.get(0))
}
