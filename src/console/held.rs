//! Held messages (waiting for a person's approval): filters (channel, since), paging, and
//! approve / cancel on the selected rows or on everything the filter matches.

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use maud::html;

use super::auth::Signed;
use super::dead::{parse_page, parse_since, with_query};
use super::{Failure, PAGE_SIZE, Shared, channel_field, client, layout, pairs};
use crate::ops::HeldFilter;

/// Reads `channel` and `since`; empty values are absent.
pub(crate) fn parse_filter(q: &[(String, String)]) -> Result<HeldFilter, Failure> {
    let channel = channel_field(q)?;
    Ok(HeldFilter {
        channel,
        since: parse_since(q)?,
    })
}

fn filter_query(f: &HeldFilter) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    if let Some(c) = f.channel {
        s.append_pair("channel", c.as_str());
    }
    if let Some(d) = f.since {
        s.append_pair("since", &super::layout::since_text(d));
    }
    s.finish()
}

pub(crate) async fn page(
    State(app): State<Shared>,
    signed: Signed,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let q = pairs(raw.unwrap_or_default().as_bytes());
    let f = parse_filter(&q)?;
    let page = parse_page(&q)?;
    let c = client(&app).await?;
    let clock = super::time::Clock(
        crate::ops::database_now(&**c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let (rows, total) = crate::ops::held_page(&**c, &f, PAGE_SIZE, (page - 1) * PAGE_SIZE)
        .await
        .map_err(|e| Failure::db(&e))?;
    let body = html! {
        section {
            form.filters method="get" action="/held" id="filters" {
                (layout::channel_select(f.channel))
                (layout::since_input("Enqueued within (e.g. 1h, 7d)", f.since))
                button type="submit" id="filter" { "Filter" }
            }
        }
        section.scroll {
            p id="match-count" { (total) " held message" @if total != 1 { "s" } " match." }
            @if rows.is_empty() {
                p.muted { "No held messages" @if page > 1 { " on this page" } "." }
                @if page > 1 {
                    (layout::past_the_end(&with_query("/held", &filter_query(&f)), total, PAGE_SIZE))
                }
            } @else {
                form method="post" action="/action" id="rows" {
                    input type="hidden" name="csrf" value=(signed.csrf);
                    input type="hidden" name="from" value="held";
                    @if let Some(c) = f.channel { input type="hidden" name="channel" value=(c.as_str()); }
                    @if let Some(d) = f.since { input type="hidden" name="since" value=(super::layout::since_text(d)); }
                    div.actions {
                        button type="submit" name="do" value="approve:selected" id="approve-selected" { "Approve selected" }
                        button.danger type="submit" name="do" value="cancel:selected" id="cancel-selected" { "Cancel selected" }
                    }
                    table.rows id="held" {
                        thead { tr {
                            th { span.muted { "pick" } }
                            th.num { "id" } th { "key" } th { "channel" } th { "enqueued" }
                        } }
                        tbody {
                            @for h in &rows {
                                tr data-id=(h.id) {
                                    td.pick { input type="checkbox" name="id" value=(h.id) aria-label={ "select " (h.id) }; }
                                    td.num data-label="id" { a href={ "/message/" (h.id) } { (h.id) } }
                                    td.key data-label="key" { a href={ "/message/" (h.id) } { (crate::text::escape(&h.message_key)) } }
                                    td data-label="channel" { (h.channel) }
                                    td data-label="enqueued" { (clock.at(&h.created_at)) }
                                }
                            }
                        }
                    }
                    div.actions {
                        button.secondary type="submit" name="do" value="approve:filter" id="approve-all" { "Approve all " (total) " matching" }
                        button.secondary type="submit" name="do" value="cancel:filter" id="cancel-all" { "Cancel all " (total) " matching" }
                    }
                }
                (layout::pager(&with_query("/held", &filter_query(&f)), page, total, PAGE_SIZE))
            }
        }
    };
    Ok(layout::page("Held messages", Some(&signed), body).into_response())
}
