//! Counts for operators: `outboxd status`.

use std::collections::BTreeMap;

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::model::State;
use crate::queries;

/// Messages by state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Waiting (due or not).
    pub pending: i64,
    /// Claimed by a worker.
    pub running: i64,
    /// Accepted by the provider.
    pub delivered: i64,
    /// Given up on.
    pub dead: i64,
    /// Waiting for a person's approval (never claimed until then).
    pub held: i64,
    /// Withdrawn by an operator: final.
    pub cancelled: i64,
}

impl Counts {
    /// The count of one state.
    pub fn get(&self, state: State) -> i64 {
        match state {
            State::Pending => self.pending,
            State::Running => self.running,
            State::Delivered => self.delivered,
            State::Dead => self.dead,
            State::Held => self.held,
            State::Cancelled => self.cancelled,
        }
    }

    fn add(&mut self, state: State, n: i64) {
        match state {
            State::Pending => self.pending += n,
            State::Running => self.running += n,
            State::Delivered => self.delivered += n,
            State::Dead => self.dead += n,
            State::Held => self.held += n,
            State::Cancelled => self.cancelled += n,
        }
    }
}

/// The answer of `outboxd status --json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Status {
    /// All channels together.
    #[serde(flatten)]
    pub total: Counts,
    /// Seconds since the `run_after` of the oldest due pending message (0 when none).
    pub oldest_due_seconds: f64,
    /// Ordering groups with at least one message waiting behind an earlier unfinished one
    /// of its group (see [`queries::BLOCKED_GROUPS`]).
    pub blocked_groups: i64,
    /// Destinations whose circuit breaker is open or half-open (`outboxd destinations`).
    pub open_destinations: i64,
    /// Destinations a person has paused (`outboxd destinations --pause`).
    pub paused_destinations: i64,
    /// Channels a person has paused (`outboxd channels --pause`), by name: no worker
    /// claims their messages until they are resumed.
    pub paused_channels: Vec<String>,
    /// The same counts per channel (every channel present, zeros included).
    pub by_channel: BTreeMap<String, Counts>,
    /// The due messages per channel (every channel present, zeros included).
    ///
    /// `status` cannot know which channels the running workers serve (they record that
    /// nowhere), so it shows what a stuck channel looks like instead: due messages that
    /// stay, growing older. A worker that does not serve a channel warns when that
    /// channel's messages wait ([`crate::worker`]'s unserved watch).
    pub due_by_channel: BTreeMap<String, Due>,
}

/// The due messages of one channel: `pending` with `run_after` passed.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Due {
    /// How many.
    pub due: i64,
    /// Seconds since the oldest of them came due (0 when none is).
    pub oldest_due_seconds: f64,
}

/// The due messages by channel, leaving out the channels `leave_out`, among the oldest
/// `cap` due messages (`None`: all): see [`queries::DUE_BY_CHANNEL`]. Only channels with
/// a due message are returned, in name order.
pub async fn due_by_channel<C: GenericClient>(
    client: &C,
    leave_out: &[&str],
    cap: Option<i64>,
) -> Result<Vec<(String, Due)>, tokio_postgres::Error> {
    let rows = client
        .query(queries::DUE_BY_CHANNEL, &[&leave_out, &cap])
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let secs: f64 = r.get(2);
            let due = Due {
                due: r.get(1),
                oldest_due_seconds: (secs.max(0.0) * 1000.0).round() / 1000.0,
            };
            (r.get(0), due)
        })
        .collect())
}

/// Messages by state as `/metrics` reports them: exact up to a cap per state, estimated
/// beyond it, at a cost bounded by the cap (see [`queries::STATE_COUNTS_BOUNDED`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BoundedCounts {
    /// The counts; a state listed in `estimated` holds an estimate of at least the cap.
    pub counts: Counts,
    /// States whose count reached the cap and is PostgreSQL's estimate.
    pub estimated: Vec<State>,
    /// As in [`Status::oldest_due_seconds`].
    pub oldest_due_seconds: f64,
    /// As in [`Status::open_destinations`].
    pub open_destinations: i64,
    /// As in [`Status::paused_destinations`].
    pub paused_destinations: i64,
    /// How many of [`Status::paused_channels`].
    pub paused_channels: i64,
}

/// The default cap of [`bounded_counts`]: each state costs at most this many index entries
/// read (tens of milliseconds).
pub const COUNT_CAP: i64 = 100_000;

/// Reads the counts by state, exact up to `cap` per state (see [`BoundedCounts`]).
pub async fn bounded_counts<C: GenericClient>(
    client: &C,
    cap: i64,
) -> Result<BoundedCounts, tokio_postgres::Error> {
    let mut out = BoundedCounts::default();
    for row in client
        .query(queries::STATE_COUNTS_BOUNDED, &[&cap.max(1)])
        .await?
    {
        let state: &str = row.get(0);
        let n: i64 = row.get(1);
        let estimated: bool = row.get(2);
        let Some(state) = State::parse(state) else {
            continue;
        };
        out.counts.add(state, n);
        if estimated {
            out.estimated.push(state);
        }
    }
    out.oldest_due_seconds = oldest_due_seconds(client).await?;
    out.open_destinations = open_destinations(client).await?;
    out.paused_destinations = paused_destinations(client).await?;
    out.paused_channels = paused_channels(client).await?.len() as i64;
    Ok(out)
}

/// Destinations not closed: a small table (one row per host that ever failed).
async fn open_destinations<C: GenericClient>(client: &C) -> Result<i64, tokio_postgres::Error> {
    Ok(client
        .query_one(queries::OPEN_DESTINATIONS, &[])
        .await?
        .get(0))
}

/// Destinations paused by a person: read from the same small table.
async fn paused_destinations<C: GenericClient>(client: &C) -> Result<i64, tokio_postgres::Error> {
    Ok(client
        .query_one(queries::PAUSED_DESTINATIONS, &[])
        .await?
        .get(0))
}

/// The channels paused by a person, by name (at most three rows).
async fn paused_channels<C: GenericClient>(
    client: &C,
) -> Result<Vec<String>, tokio_postgres::Error> {
    Ok(client
        .query(queries::PAUSED_CHANNELS, &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

async fn oldest_due_seconds<C: GenericClient>(client: &C) -> Result<f64, tokio_postgres::Error> {
    let row = client.query_one(queries::OLDEST_DUE_SECONDS, &[]).await?;
    let secs: f64 = row.get(0);
    Ok((secs.max(0.0) * 1000.0).round() / 1000.0)
}

/// Reads the status, exactly: a read of the whole table (see [`bounded_counts`] for a
/// figure whose cost does not grow with the table).
pub async fn status<C: GenericClient>(client: &C) -> Result<Status, tokio_postgres::Error> {
    let mut st = Status::default();
    for ch in crate::model::Channel::ALL {
        st.by_channel
            .insert(ch.as_str().to_owned(), Counts::default());
        st.due_by_channel
            .insert(ch.as_str().to_owned(), Due::default());
    }
    for row in client.query(queries::STATUS_COUNTS, &[]).await? {
        let channel: String = row.get(0);
        let state: &str = row.get(1);
        let n: i64 = row.get(2);
        let Some(state) = State::parse(state) else {
            continue;
        };
        st.total.add(state, n);
        st.by_channel.entry(channel).or_default().add(state, n);
    }
    st.oldest_due_seconds = oldest_due_seconds(client).await?;
    st.due_by_channel
        .extend(due_by_channel(client, &[], None).await?);
    st.blocked_groups = client.query_one(queries::BLOCKED_GROUPS, &[]).await?.get(0);
    st.open_destinations = open_destinations(client).await?;
    st.paused_destinations = paused_destinations(client).await?;
    st.paused_channels = paused_channels(client).await?;
    Ok(st)
}
