//! Counts for operators: `outboxd status`.

use std::collections::BTreeMap;

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::queries;
use crate::state::State;

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
}

impl Counts {
    /// The count of one state.
    pub fn get(&self, state: State) -> i64 {
        match state {
            State::Pending => self.pending,
            State::Running => self.running,
            State::Delivered => self.delivered,
            State::Dead => self.dead,
        }
    }

    fn add(&mut self, state: State, n: i64) {
        match state {
            State::Pending => self.pending += n,
            State::Running => self.running += n,
            State::Delivered => self.delivered += n,
            State::Dead => self.dead += n,
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
    /// The same counts per channel (every channel present, zeros included).
    pub by_channel: BTreeMap<String, Counts>,
}

/// Reads the status.
pub async fn status<C: GenericClient>(client: &C) -> Result<Status, tokio_postgres::Error> {
    let mut st = Status::default();
    for ch in crate::deliver::Channel::ALL {
        st.by_channel
            .insert(ch.as_str().to_owned(), Counts::default());
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
    let row = client.query_one(queries::OLDEST_DUE_SECONDS, &[]).await?;
    let secs: f64 = row.get(0);
    st.oldest_due_seconds = (secs.max(0.0) * 1000.0).round() / 1000.0;
    Ok(st)
}
