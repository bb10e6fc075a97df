//! Every message, filtered and paged by id (the console's `/messages`), and the database's
//! clock.

use std::time::Duration;

use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};

use crate::model::{Channel, State};
use crate::queries;

use super::stamp;

/// Which messages a listing shows; every field `None` for "any".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessageFilter {
    /// Only this state.
    pub state: Option<State>,
    /// Only this channel.
    pub channel: Option<Channel>,
    /// Only keys that start with this (compared as bytes, as the keys are ordered).
    pub key_prefix: Option<String>,
    /// Only those enqueued within this long.
    pub since: Option<Duration>,
    /// Only those going to this destination (a host, and port when not the default, as
    /// `outbox.messages.destination` stores it).
    pub destination: Option<String>,
    /// Only http messages naming this endpoint.
    pub endpoint: Option<String>,
}

/// Where a page starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cursor {
    /// The newest messages.
    Newest,
    /// The messages just older than this id.
    Before(i64),
    /// The messages just newer than this id.
    After(i64),
}

/// One listed message.
#[derive(Debug, Clone, PartialEq)]
pub struct ListedMessage {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub message_key: String,
    /// Its channel.
    pub channel: String,
    /// Its state.
    pub state: String,
    /// Attempts started.
    pub attempts: i32,
    /// The budget.
    pub max_attempts: i32,
    /// The last failure's class.
    pub error_class: Option<String>,
    /// The last failure, one line.
    pub last_error: Option<String>,
    /// Where it goes: a host (and port), never a path.
    pub destination: Option<String>,
    /// When it was enqueued (RFC 3339).
    pub created_at: String,
    /// Its last change (RFC 3339).
    pub updated_at: String,
}

/// A page of messages, newest first, and whether there are more either side.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagePage {
    /// The rows, newest first.
    pub rows: Vec<ListedMessage>,
    /// Messages newer than the first row match too.
    pub newer: bool,
    /// Messages older than the last row match too.
    pub older: bool,
}

/// The keys that start with `prefix` are those from `prefix` up to, not including, this:
/// `prefix` with its last character replaced by the next one (the character after
/// U+10FFFF does not exist, so such a last character is dropped and the one before it
/// counts up). Keys compare as UTF-8 bytes (`COLLATE "C"`), which is code point order.
/// None when every character is U+10FFFF: no upper bound then.
pub fn prefix_end(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        let next = match last as u32 + 1 {
            0xD800 => 0xE000,
            n => n,
        };
        if let Some(c) = char::from_u32(next) {
            chars.push(c);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

/// The values of `queries::MESSAGES_*`'s first seven parameters.
struct Params {
    state: Option<&'static str>,
    channel: Option<&'static str>,
    from: Option<String>,
    until: Option<String>,
    since: Option<f64>,
    destination: Option<String>,
    endpoint: Option<String>,
}

impl Params {
    fn of(f: &MessageFilter) -> Params {
        Params {
            state: f.state.map(State::as_str),
            channel: f.channel.map(Channel::as_str),
            from: f.key_prefix.clone(),
            until: f.key_prefix.as_deref().and_then(prefix_end),
            since: f.since.map(|d| d.as_secs_f64()),
            destination: f.destination.clone(),
            endpoint: f.endpoint.clone(),
        }
    }

    fn with<'a>(
        &'a self,
        extra: &'a [&'a (dyn ToSql + Sync)],
    ) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
        let mut v: Vec<(&(dyn ToSql + Sync), Type)> = vec![
            (&self.state, Type::TEXT),
            (&self.channel, Type::TEXT),
            (&self.from, Type::TEXT),
            (&self.until, Type::TEXT),
            (&self.since, Type::FLOAT8),
            (&self.destination, Type::TEXT),
            (&self.endpoint, Type::TEXT),
        ];
        v.extend(extra.iter().map(|p| (*p, Type::INT8)));
        v
    }
}

/// One page of at most `limit` messages matching `filter`, newest first, from `cursor`.
/// Keyset paging on the id: a page deep in the table costs what the first one does.
pub async fn messages_page<C: GenericClient>(
    client: &C,
    filter: &MessageFilter,
    cursor: Cursor,
    limit: i64,
) -> Result<MessagePage, tokio_postgres::Error> {
    let p = Params::of(filter);
    // One row more than shown says whether there are more beyond.
    let fetch = limit + 1;
    let (statement, at) = match cursor {
        Cursor::Newest => (queries::MESSAGES_OLDER, None),
        Cursor::Before(id) => (queries::MESSAGES_OLDER, Some(id)),
        Cursor::After(id) => (queries::MESSAGES_NEWER, Some(id)),
    };
    let mut rows: Vec<ListedMessage> = client
        .query_typed(statement, &p.with(&[&at, &fetch]))
        .await?
        .iter()
        .map(listed)
        .collect();
    let beyond = rows.len() as i64 > limit;
    rows.truncate(usize::try_from(limit).unwrap_or(0));
    Ok(match cursor {
        Cursor::Newest => MessagePage {
            rows,
            newer: false,
            older: beyond,
        },
        // Came from a newer page: the rows it showed are still newer (or were purged,
        // and that page says so).
        Cursor::Before(_) => MessagePage {
            rows,
            newer: true,
            older: beyond,
        },
        Cursor::After(_) => {
            rows.reverse();
            MessagePage {
                rows,
                newer: beyond,
                older: true,
            }
        }
    })
}

/// How many messages match `filter`, counting no further than `cap` (a count of every
/// row would read the whole table).
pub async fn count_messages<C: GenericClient>(
    client: &C,
    filter: &MessageFilter,
    cap: i64,
) -> Result<i64, tokio_postgres::Error> {
    let p = Params::of(filter);
    Ok(client
        .query_typed_one(queries::MESSAGES_COUNT, &p.with(&[&cap]))
        .await?
        .get(0))
}

fn listed(r: &tokio_postgres::Row) -> ListedMessage {
    ListedMessage {
        id: r.get(0),
        message_key: r.get(1),
        channel: r.get(2),
        state: r.get(3),
        attempts: r.get(4),
        max_attempts: r.get(5),
        error_class: r.get(6),
        last_error: r.get(7),
        destination: r.get(8),
        created_at: stamp(r, 9).unwrap_or_default(),
        updated_at: stamp(r, 10).unwrap_or_default(),
    }
}

/// The database's clock (`now()`), which relative times ("3 min ago") are counted from,
/// so that a console host whose clock drifts still says how old a row is.
pub async fn database_now<C: GenericClient>(
    client: &C,
) -> Result<time::OffsetDateTime, tokio_postgres::Error> {
    client
        .query_typed_one(queries::DATABASE_NOW, &[])
        .await?
        .try_get(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_ends_at_its_last_character_counted_up() {
        assert_eq!(prefix_end("order-4").as_deref(), Some("order-5"));
        assert_eq!(prefix_end("a%").as_deref(), Some("a&"));
        assert_eq!(prefix_end("é").as_deref(), Some("ê"));
        assert_eq!(prefix_end("a\u{d7ff}").as_deref(), Some("a\u{e000}"));
        assert_eq!(prefix_end("ab\u{10ffff}").as_deref(), Some("ac"));
        assert_eq!(prefix_end("\u{10ffff}\u{10ffff}"), None);
        // Every key with the prefix falls in [prefix, end), compared as bytes.
        for (prefix, key) in [
            ("a", "a\u{10ffff}z"),
            ("ab\u{10ffff}", "ab\u{10ffff}\u{10ffff}"),
        ] {
            let end = prefix_end(prefix).unwrap();
            assert!(key.as_bytes() >= prefix.as_bytes() && key.as_bytes() < end.as_bytes());
        }
    }
}
