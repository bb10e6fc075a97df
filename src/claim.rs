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
use crate::state::Transition;

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
    /// The payload names a reconciliation lookup (a webhook's `reconcile.url`,
    /// `outbox.reconcilable`): after an ambiguous attempt the next one asks first.
    pub reconcile: bool,
    /// Where a webhook goes ([`destination_of`], the rules of `outbox.destination_of`): the
    /// key of the rules per destination. `None` for e-mail and for a URL without a name.
    pub destination: Option<String>,
    /// A webhook's payload of at most [`READ_ONCE_MAX`] bytes, read once here for its
    /// routing and handed to the attempt. `None` for e-mail, for a larger payload and for
    /// one that does not read (not a JSON object, or a member serde cannot hold, such as
    /// a number beyond f64): those are routed and checked from the text, as before.
    pub webhook: Option<crate::deliver::webhook::payload::Read>,
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
            .field("webhook", &self.webhook)
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

/// Settles up to `limit` expired leases of `channels` ([`queries::SETTLE_EXPIRED`]): each
/// is an ambiguous attempt, dead-lettered or made `pending` again after `retry`'s backoff.
pub async fn settle_expired<C: GenericClient>(
    client: &C,
    channels: &[Channel],
    limit: usize,
    retry: &RetryPolicy,
) -> Result<Settled, tokio_postgres::Error> {
    let channels: Vec<&str> = channels.iter().map(|c| c.as_str()).collect();
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let schedule = retry.schedule();
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&channels, Type::TEXT_ARRAY),
        (&limit, Type::INT8),
        (&schedule, Type::FLOAT8_ARRAY),
        (&RetryPolicy::JITTER, Type::FLOAT8),
    ];
    let rows = client.query_typed(queries::SETTLE_EXPIRED, &params).await?;
    let mut settled = Settled::default();
    for row in rows {
        let channel: &str = row.get("channel");
        // The CHECK constraint admits only known channels; skip defensively otherwise.
        let Some(channel) = Channel::parse(channel) else {
            continue;
        };
        let action: &str = row.get("action");
        if action == "gave_up" {
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
        let (webhook, routing) = if channel == Channel::Webhook {
            read_and_route(&payload)
        } else {
            (None, Routing::default())
        };
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
            reconcile: routing.reconcile,
            destination: routing.destination,
            webhook,
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

/// Gives back claimed messages that are not to be sent yet (`(id, token, delay)`): each is
/// `pending` again, due after its delay, its attempt not counted and no history row written
/// (`queries::DEFER`). Returns the ids deferred (those whose lease was still ours).
pub async fn defer<C: GenericClient>(
    client: &C,
    rows: &[(i64, Uuid, Duration)],
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let tokens: Vec<Uuid> = rows.iter().map(|r| r.1).collect();
    let delays: Vec<f64> = rows.iter().map(|r| r.2.as_secs_f64()).collect();
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&ids, Type::INT8_ARRAY),
        (&tokens, Type::UUID_ARRAY),
        (&delays, Type::FLOAT8_ARRAY),
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

/// What the worker reads from a claimed webhook's payload (JSON text, as jsonb renders it)
/// before sending, in one pass: its destination ([`destination_of_url`]) and whether it
/// names a reconciliation lookup. Both were once computed by the claim itself
/// (`outbox.destination_of`, `outbox.reconcilable`); a function with a pinned search_path is
/// never inlined, so each cost the database 5 to 20 µs a claimed row, against a fraction of
/// a microsecond here, on a payload the worker has fetched anyway. The rules are the SQL
/// functions' (their comments state them); `tests/it/destinations.rs` checks both agree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routing {
    /// The URL's host and port, when it has a name.
    pub destination: Option<String>,
    /// `reconcile.url` is a string (`outbox.reconcilable`).
    pub reconcile: bool,
}

/// Reads [`Routing`] from a webhook payload. A payload that is not a JSON object has none.
pub fn routing(payload: &str) -> Routing {
    use serde_json::value::RawValue;
    #[derive(serde::Deserialize)]
    struct Fields<'a> {
        #[serde(borrow, default)]
        url: Option<&'a RawValue>,
        #[serde(borrow, default)]
        reconcile: Option<&'a RawValue>,
    }
    #[derive(serde::Deserialize)]
    struct Reconcile<'a> {
        #[serde(borrow, default)]
        url: Option<&'a RawValue>,
    }
    let Ok(f) = serde_json::from_str::<Fields<'_>>(payload) else {
        return Routing::default();
    };
    let string = |raw: &RawValue| {
        serde_json::from_str::<std::borrow::Cow<'_, str>>(raw.get())
            .ok()
            .map(|s| s.into_owned())
    };
    let destination = f
        .url
        .and_then(string)
        .and_then(|url| destination_of_url(&url));
    // An object only: serde also reads a struct from an array (its members in order), and
    // `outbox.reconcilable` finds no `url` in `["https://…"]`.
    let reconcile = f
        .reconcile
        .filter(|raw| raw.get().trim_start().starts_with('{'))
        .and_then(|raw| serde_json::from_str::<Reconcile<'_>>(raw.get()).ok())
        .and_then(|r| r.url)
        .is_some_and(|u| u.get().starts_with('"'));
    Routing {
        destination,
        reconcile,
    }
}

/// What the claim keeps of a webhook payload: the payload read, when it is at most
/// [`READ_ONCE_MAX`] bytes and reads, and its routing, from the read payload or else from
/// the text.
pub fn read_and_route(payload: &str) -> (Option<crate::deliver::webhook::payload::Read>, Routing) {
    let read = if payload.len() <= READ_ONCE_MAX {
        crate::deliver::webhook::payload::read(payload).ok()
    } else {
        None
    };
    let routing = match &read {
        Some(read) => routing_of(read),
        None => routing(payload),
    };
    (read, routing)
}

/// The largest webhook payload (its text, in bytes) the claim reads whole and keeps until
/// its attempt ([`Claimed::webhook`]). Read, a payload is a tree of values that can take
/// many times its text (an array of 0s: 16 times), and the claim does the reading on its
/// own task: a bound keeps both small for the rows claimed ahead (up to 320 at 64 in
/// flight: 20 MiB at the worst). A larger payload is routed from its text and read by its
/// attempt, as every payload was before.
pub const READ_ONCE_MAX: usize = 4096;

/// [`routing`] of a payload already read ([`crate::deliver::webhook::payload::read`]),
/// without a second scan of the text. For a payload that reads, it agrees with
/// [`routing`] and with the SQL rules (`tests/it/destinations.rs` checks all three).
pub fn routing_of(read: &crate::deliver::webhook::payload::Read) -> Routing {
    Routing {
        destination: read.url().and_then(destination_of_url),
        reconcile: read.names_reconcile(),
    }
}

/// The destination of a webhook payload ([`Routing::destination`]).
pub fn destination_of(payload: &str) -> Option<String> {
    routing(payload).destination
}

/// [`destination_of`] for a URL. One allocation, the answer's: every check below is blind
/// to ASCII case, so the text is lower-cased only as it is copied out (this runs for every
/// claimed webhook; four allocations were 3 % of the daemon's instructions, issue 17).
pub fn destination_of_url(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let mut sb = scheme.bytes();
    if !sb.next()?.is_ascii_alphabetic()
        || !sb.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'.' | b'-'))
    {
        return None;
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let auth = &rest[..end];
    let auth = auth.rsplit_once('@').map_or(auth, |(_, a)| a);
    let (host, port) = if auth.starts_with('[') {
        let close = auth.find(']')?;
        let (host, after) = auth.split_at(close + 1);
        let inner = &host[1..host.len() - 1];
        if inner.is_empty()
            || !inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return None;
        }
        (host, after)
    } else {
        let colon = auth.find(':').unwrap_or(auth.len());
        let (host, after) = auth.split_at(colon);
        if host.is_empty()
            || !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return None;
        }
        (host.trim_end_matches('.'), after)
    };
    let port = match port.strip_prefix(':') {
        None if port.is_empty() => None,
        None => return None,
        Some(p) if (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()) => {
            p.parse::<u32>().ok()
        }
        Some(_) => return None,
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        Some(80) if scheme.eq_ignore_ascii_case("http") => None,
        Some(443) if scheme.eq_ignore_ascii_case("https") => None,
        p => p,
    };
    let mut name = String::with_capacity(host.len() + 6);
    name.extend(host.chars().map(|c| c.to_ascii_lowercase()));
    if let Some(p) = port {
        use std::fmt::Write as _;
        let _ = write!(name, ":{p}");
    }
    // `outbox.destinations` holds names of at most this length (no host name is longer
    // than 253): a longer one recorded beside others failed the breakers' whole update.
    (name.len() <= DESTINATION_MAX).then_some(name)
}

/// The longest destination name (`outbox.destinations.host`'s check, sql/0014).
pub const DESTINATION_MAX: usize = 1000;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deliver::webhook::payload::read;

    /// The claim routes a webhook from its payload read once ([`routing_of`]); that must be
    /// [`routing`]'s answer from the text, which `tests/it/destinations.rs` holds to
    /// `outbox.destination_of` and `outbox.reconcilable`.
    #[test]
    fn routing_of_a_read_payload_is_routing_of_its_text() {
        let urls = [
            r#""http://a.example/hook""#,
            r#""HTTP://User:Pw@A.Example:80/p?q=1#f""#,
            r#""https://a.example:443""#,
            r#""https://a.example:8443/x""#,
            r#""http://[::1]:8080/""#,
            r#""http://a.example./""#,
            r#""http:\/\/a.example\/escaped""#,
            r#""http://\u212Aelvin.example/""#,
            r#""ftp://a.example/""#,
            r#""http://a example/""#,
            r#""http://a.example:99999/""#,
            r#""not a url""#,
            r#""""#,
            "5",
            "null",
            "{}",
            r#"["http://a.example"]"#,
        ];
        let reconciles = [
            None,
            Some(r#"{"url": "http://b.example/lookup"}"#),
            Some(r#"{"url": 5}"#),
            Some(r#"{"other": "x"}"#),
            Some(r#""http://b.example""#),
            Some("null"),
            Some(r#"[{"url": "http://b.example"}]"#),
        ];
        let mut payloads = vec![
            "[]".to_owned(),
            r#""text""#.to_owned(),
            "5".to_owned(),
            "null".to_owned(),
            "{}".to_owned(),
            r#"{"url": "http://a.example", "url": "http://b.example"}"#.to_owned(),
            r#"{"url": "http://a.example""#.to_owned(),
        ];
        for url in urls {
            for reconcile in reconciles {
                let mut p = format!(r#"{{"body": {{"n": [1, "x\"y"]}}, "url": {url}"#);
                if let Some(r) = reconcile {
                    p.push_str(&format!(r#", "reconcile": {r}"#));
                }
                p.push('}');
                payloads.push(p);
            }
        }
        for p in &payloads {
            match read(p) {
                Ok(read) => assert_eq!(routing_of(&read), routing(p), "{p}"),
                // Not read: the claim routes it from the text.
                Err(_) => assert!(
                    !p.starts_with(r#"{"body""#),
                    "every object of the corpus reads: {p}"
                ),
            }
        }
        // What does not read is routed from its text, as before: a number beyond f64 (jsonb
        // renders 1e400 as 401 digits), a member nested deeper than serde's limit.
        let big = format!("1{}", "0".repeat(400));
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for p in [
            format!(
                r#"{{"url": "http://a.example/", "reconcile": {{"url": "http://b.example/", "n": {big}}}}}"#
            ),
            format!(r#"{{"url": "http://a.example/", "method": {deep}}}"#),
        ] {
            assert!(read(&p).is_err(), "{p}");
            let r = routing(&p);
            assert_eq!(r.destination.as_deref(), Some("a.example"), "{p}");
        }
    }
}
