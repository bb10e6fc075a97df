//! Every message, whatever its state: filters (state, channel, key prefix, age,
//! destination, endpoint), paging by id, and the actions that fit the ticked rows (replay,
//! confirm, approve, cancel, through the confirmation step of `action`).
//!
//! Paging is by id (`before=ID`, `after=ID`), not by page number: an `OFFSET` reads every
//! row it skips, and this listing spans the whole table. The count of matches stops at
//! [`COUNT_CAP`].

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::dead::{parse_since, with_query};
use super::time::Clock;
use super::{Failure, PAGE_SIZE, Shared, channel_field, client, field, layout, pairs, quoted};
use crate::model::State as MessageState;
use crate::ops::{Cursor, ListedMessage, MessageFilter};

/// The count of matching messages stops here ("more than 10000 match").
pub(crate) const COUNT_CAP: i64 = 10_000;

/// Keys are at most 255 characters, so a longer prefix matches nothing.
const MAX_KEY: usize = 255;

/// A destination is a host name (at most 253 characters) and a port.
const MAX_DESTINATION: usize = 300;

/// An endpoint's name is at most 63 characters.
const MAX_ENDPOINT: usize = 63;

/// The listing's query: the filter and where the page starts.
pub(crate) struct MessagesQuery {
    pub filter: MessageFilter,
    pub cursor: Cursor,
}

/// A text filter: absent when empty; refused (400) when longer than `max` characters or
/// holding a control character, a line separator or a bidirectional override, none of which
/// a key, a host or an endpoint's name can hold.
fn text_filter(
    q: &[(String, String)],
    name: &str,
    what: &str,
    max: usize,
) -> Result<Option<String>, Failure> {
    let Some(v) = field(q, name) else {
        return Ok(None);
    };
    let n = v.chars().count();
    if n > max {
        return Err(Failure::BadRequest(format!(
            "{name}: {what} is at most {max} characters (got {n})"
        )));
    }
    if let Some((i, c)) = v
        .chars()
        .enumerate()
        .find(|(_, c)| crate::text::is_unsafe(*c))
    {
        return Err(Failure::BadRequest(format!(
            "{name}: {what} has no control characters (U+{:04X} at character {})",
            c as u32,
            i + 1
        )));
    }
    Ok(Some(v.to_owned()))
}

/// A cursor's id: digits only, within `bigint`.
fn cursor_id(q: &[(String, String)], name: &str) -> Result<Option<i64>, Failure> {
    field(q, name)
        .map(|v| {
            super::message::parse_id(v).map_err(|_| {
                Failure::BadRequest(format!("{name} must be a message id (got {})", quoted(v)))
            })
        })
        .transpose()
}

/// Reads `state`, `channel`, `q` (a key prefix), `since` (a duration: `90s`, `15m`, `24h`,
/// `7d`), `destination`, `endpoint`, and `before` or `after` (an id); empty values are
/// absent, anything else unknown is a one-line 400.
pub(crate) fn parse_filter(q: &[(String, String)]) -> Result<MessagesQuery, Failure> {
    let state = field(q, "state")
        .map(|s| {
            MessageState::parse(s).ok_or_else(|| {
                Failure::BadRequest(format!(
                    "unknown state {} (held, pending, running, delivered, dead or cancelled)",
                    quoted(s)
                ))
            })
        })
        .transpose()?;
    let channel = channel_field(q)?;
    let filter = MessageFilter {
        state,
        channel,
        key_prefix: text_filter(q, "q", "a key prefix", MAX_KEY)?,
        since: parse_since(q)?,
        destination: text_filter(q, "destination", "a destination", MAX_DESTINATION)?,
        endpoint: text_filter(q, "endpoint", "an endpoint's name", MAX_ENDPOINT)?,
    };
    let cursor = match (cursor_id(q, "before")?, cursor_id(q, "after")?) {
        (None, None) => Cursor::Newest,
        (Some(id), None) => Cursor::Before(id),
        (None, Some(id)) => Cursor::After(id),
        (Some(_), Some(_)) => {
            return Err(Failure::BadRequest("give before or after, not both".into()));
        }
    };
    Ok(MessagesQuery { filter, cursor })
}

/// The filter as a query string (for the pager, the state links and the forms).
pub(crate) fn filter_query(f: &MessageFilter) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    if let Some(st) = f.state {
        s.append_pair("state", st.as_str());
    }
    if let Some(c) = f.channel {
        s.append_pair("channel", c.as_str());
    }
    if let Some(k) = &f.key_prefix {
        s.append_pair("q", k);
    }
    if let Some(d) = f.since {
        s.append_pair("since", &layout::since_text(d));
    }
    if let Some(d) = &f.destination {
        s.append_pair("destination", d);
    }
    if let Some(e) = &f.endpoint {
        s.append_pair("endpoint", e);
    }
    s.finish()
}

/// `/messages` with `filter` and one more pair (a cursor).
fn href(filter: &MessageFilter, extra: Option<(&str, i64)>) -> String {
    let mut query = filter_query(filter);
    if let Some((k, id)) = extra {
        if !query.is_empty() {
            query.push('&');
        }
        query.push_str(&format!("{k}={id}"));
    }
    with_query("/messages", &query)
}

/// Which actions a row in `state` may be ticked for: the states the SQL functions take
/// (replay and confirm: dead; approve: held; cancel: held, pending and dead). The
/// functions decide; a row no action takes simply has no box.
fn tickable(state: &str) -> bool {
    matches!(state, "dead" | "held" | "pending")
}

pub(crate) async fn page(
    State(app): State<Shared>,
    signed: Signed,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let q = parse_filter(&pairs(raw.unwrap_or_default().as_bytes()))?;
    let c = client(&app).await?;
    let now = crate::ops::database_now(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let clock = Clock(now);
    let page = crate::ops::messages_page(&**c, &q.filter, q.cursor, PAGE_SIZE)
        .await
        .map_err(|e| Failure::db(&e))?;
    let total = crate::ops::count_messages(&**c, &q.filter, COUNT_CAP + 1)
        .await
        .map_err(|e| Failure::db(&e))?;
    let f = &q.filter;
    let any_tickable = page.rows.iter().any(|m| tickable(&m.state));
    let body = html! {
        section {
            form.filters method="get" action="/messages" id="filters" {
                label { "State"
                    select name="state" id="f-state" {
                        option value="" { "any" }
                        @for st in MessageState::ALL {
                            option value=(st.as_str()) selected[f.state == Some(st)] { (st.as_str()) }
                        }
                    }
                }
                (layout::channel_select(f.channel))
                label { "Key starts with"
                    input type="search" name="q" id="f-q" maxlength="255" value=[f.key_prefix.as_deref()];
                }
                (layout::since_input("Enqueued within (e.g. 1h, 7d)", f.since))
                label { "Destination"
                    input type="text" name="destination" id="f-destination" size="16" maxlength="300"
                        placeholder="host or host:port" value=[f.destination.as_deref()];
                }
                label { "Endpoint"
                    input type="text" name="endpoint" id="f-endpoint" size="10" maxlength="63"
                        value=[f.endpoint.as_deref()];
                }
                button type="submit" id="filter" { "Filter" }
            }
        }
        section {
            p id="match-count" {
                @if total > COUNT_CAP {
                    "More than " (COUNT_CAP) " messages match."
                } @else {
                    (total) " message" @if total != 1 { "s" } " match" @if total == 1 { "es" } "."
                }
                @if q.cursor != Cursor::Newest { " " a href=(href(f, None)) id="newest" { "Back to the newest" } }
            }
            @if page.rows.is_empty() {
                p.muted { "No messages" @if q.cursor != Cursor::Newest { " on this page" } "." }
            } @else {
                form method="post" action="/action" id="rows" {
                    input type="hidden" name="csrf" value=(signed.csrf);
                    input type="hidden" name="from" value="messages";
                    @if any_tickable { (actions(f.state)) }
                    table.rows id="messages" {
                        thead { tr {
                            th { span.muted { "pick" } }
                            th.num { "id" } th { "key" } th { "state" } th.hide-narrow { "channel" }
                            th.num.hide-narrow { "attempts" } th.hide-narrow { "destination" }
                            th { "enqueued" } th.hide-narrow { "changed" } th { "last error" }
                        } }
                        tbody {
                            @for m in &page.rows { (row(m, &clock)) }
                        }
                    }
                }
            }
            (pager(f, &page))
        }
    };
    Ok(layout::page("Messages", Some(&signed), body).into_response())
}

/// The buttons for the ticked rows: those that fit the state filtered on (all of them
/// without one).
fn actions(state: Option<MessageState>) -> Markup {
    let dead = matches!(state, None | Some(MessageState::Dead));
    let held = matches!(state, None | Some(MessageState::Held));
    html! {
        div.actions {
            @if dead {
                button type="submit" name="do" value="replay:selected" id="replay-selected" { "Replay selected" }
                button.secondary type="submit" name="do" value="confirm:selected" id="confirm-selected" { "Confirm delivered" }
            }
            @if held {
                button type="submit" name="do" value="approve:selected" id="approve-selected" { "Approve selected" }
            }
            button.danger type="submit" name="do" value="cancel:selected" id="cancel-selected" { "Cancel selected" }
        }
    }
}

fn row(m: &ListedMessage, clock: &Clock) -> Markup {
    let link = format!("/message/{}", m.id);
    html! {
        tr data-id=(m.id) data-state=(m.state) {
            td.pick {
                @if tickable(&m.state) {
                    input type="checkbox" name="id" value=(m.id) aria-label={ "select " (m.id) };
                }
            }
            td.num data-label="id" { a href=(link) { (m.id) } }
            td.key data-label="key" { a href=(link) { (crate::text::escape(&m.message_key)) } }
            td.state data-label="state" { (m.state) }
            td.hide-narrow data-label="channel" { (m.channel) }
            td.num.hide-narrow data-label="attempts" { (m.attempts) " / " (m.max_attempts) }
            td.host.hide-narrow data-label="destination" { (m.destination.as_deref().map_or_else(|| "-".into(), crate::text::escape)) }
            td data-label="enqueued" { (clock.at(&m.created_at)) }
            td.hide-narrow data-label="changed" { (clock.at(&m.updated_at)) }
            td.err data-label="last error" {
                @if let Some(class) = &m.error_class { b { (crate::text::escape(class)) } ": " }
                (crate::text::escape(m.last_error.as_deref().unwrap_or("-")))
            }
        }
    }
}

/// Newer and older pages, by id.
fn pager(f: &MessageFilter, page: &crate::ops::MessagePage) -> Markup {
    let first = page.rows.first().map(|m| m.id);
    let last = page.rows.last().map(|m| m.id);
    html! {
        div.pager {
            @if let (true, Some(id)) = (page.newer, first) {
                a href=(href(f, Some(("after", id)))) rel="prev" id="newer" { "← newer" }
            }
            @if let (true, Some(id)) = (page.older, last) {
                a href=(href(f, Some(("before", id)))) rel="next" id="older" { "older →" }
            }
        }
    }
}
