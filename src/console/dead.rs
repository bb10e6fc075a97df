//! Dead letters: filters (channel, class, since), paging, and replay / cancel / confirm on
//! the selected rows or on everything the filter matches (through the confirmation step
//! of `action`).

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use maud::html;

use super::auth::Signed;
use super::{Failure, PAGE_SIZE, Shared, channel_field, client, field, layout, pairs, quoted};
use crate::model::ErrorClass;
use crate::ops::DeadFilter;

/// The listing's query: the filter and the page (1-based).
pub(crate) struct DeadQuery {
    pub filter: DeadFilter,
    pub page: i64,
}

/// Reads `channel`, `class`, `since` (a duration: `90s`, `15m`, `24h`, `7d`) and `page`;
/// empty values are absent, anything else unknown is a one-line 400.
pub(crate) fn parse_filter(q: &[(String, String)]) -> Result<DeadQuery, Failure> {
    let channel = channel_field(q)?;
    let error_class = field(q, "class")
        .map(|c| {
            ErrorClass::parse(c).ok_or_else(|| {
                Failure::BadRequest(format!(
                    "unknown error class {} (transient, ambiguous, permanent, invalid or exhausted)",
                    quoted(c)
                ))
            })
        })
        .transpose()?;
    let since = parse_since(q)?;
    Ok(DeadQuery {
        filter: DeadFilter {
            channel,
            error_class,
            since,
        },
        page: parse_page(q)?,
    })
}

pub(crate) fn parse_since(q: &[(String, String)]) -> Result<Option<std::time::Duration>, Failure> {
    field(q, "since")
        .map(|s| {
            crate::config::parse_duration(s)
                .ok()
                // Beyond a century the interval arithmetic in SQL would overflow.
                .filter(|d| d.as_secs() <= 100 * 365 * 86_400)
                .ok_or_else(|| {
                    Failure::BadRequest(format!(
                        "since must be a duration such as 90s, 15m, 24h or 7d (got {})",
                        quoted(s)
                    ))
                })
        })
        .transpose()
}

pub(crate) fn parse_page(q: &[(String, String)]) -> Result<i64, Failure> {
    match field(q, "page") {
        None => Ok(1),
        Some(p) => p
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=1_000_000).contains(n))
            .ok_or_else(|| {
                Failure::BadRequest(format!("page must be a number from 1 (got {})", quoted(p)))
            }),
    }
}

/// The filter as a query string (for the pager and the forms that carry it).
pub(crate) fn filter_query(f: &DeadFilter) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    if let Some(c) = f.channel {
        s.append_pair("channel", c.as_str());
    }
    if let Some(c) = f.error_class {
        s.append_pair("class", c.as_str());
    }
    if let Some(d) = f.since {
        s.append_pair("since", &super::layout::since_text(d));
    }
    s.finish()
}

/// `path?query`, or `path` alone when the query is empty.
pub(crate) fn with_query(path: &str, query: &str) -> String {
    if query.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{query}")
    }
}

pub(crate) async fn page(
    State(app): State<Shared>,
    signed: Signed,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let q = parse_filter(&pairs(raw.unwrap_or_default().as_bytes()))?;
    let c = client(&app).await?;
    let clock = super::time::Clock(
        crate::ops::database_now(&**c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let (rows, total) =
        crate::ops::dead_letters_page(&**c, &q.filter, PAGE_SIZE, (q.page - 1) * PAGE_SIZE)
            .await
            .map_err(|e| Failure::db(&e))?;
    let f = &q.filter;
    let body = html! {
        section {
            form.filters method="get" action="/dead" id="filters" {
                (layout::channel_select(f.channel))
                label { "Class"
                    select name="class" id="f-class" {
                        option value="" { "any" }
                        @for cl in ErrorClass::ALL {
                            option value=(cl.as_str()) selected[f.error_class == Some(cl)] { (cl.as_str()) }
                        }
                    }
                }
                (layout::since_input("Died within (e.g. 1h, 7d)", f.since))
                button type="submit" id="filter" { "Filter" }
            }
        }
        section.scroll {
            p id="match-count" { (total) " dead letter" @if total != 1 { "s" } " match." }
            @if rows.is_empty() {
                p.muted { "No dead letters" @if q.page > 1 { " on this page" } "." }
                @if q.page > 1 {
                    (layout::past_the_end(&with_query("/dead", &filter_query(f)), total, PAGE_SIZE))
                }
            } @else {
                form method="post" action="/action" id="rows" {
                    input type="hidden" name="csrf" value=(signed.csrf);
                    input type="hidden" name="from" value="dead";
                    @if let Some(c) = f.channel { input type="hidden" name="channel" value=(c.as_str()); }
                    @if let Some(c) = f.error_class { input type="hidden" name="class" value=(c.as_str()); }
                    @if let Some(d) = f.since { input type="hidden" name="since" value=(super::layout::since_text(d)); }
                    div.actions {
                        button type="submit" name="do" value="replay:selected" id="replay-selected" { "Replay selected" }
                        button.secondary type="submit" name="do" value="confirm:selected" id="confirm-selected" { "Confirm delivered" }
                        button.danger type="submit" name="do" value="cancel:selected" id="cancel-selected" { "Cancel selected" }
                    }
                    table.rows id="dead" {
                        thead { tr {
                            th { span.muted { "pick" } }
                            th.num { "id" } th { "key" } th { "channel" }
                            th.num.hide-narrow { "attempts" } th { "class" }
                            th { "dead" } th { "last error" }
                        } }
                        tbody {
                            @for d in &rows {
                                tr data-id=(d.id) {
                                    td.pick { input type="checkbox" name="id" value=(d.id) aria-label={ "select " (d.id) }; }
                                    td.num data-label="id" { a href={ "/message/" (d.id) } { (d.id) } }
                                    td.key data-label="key" { a href={ "/message/" (d.id) } { (crate::text::escape(&d.message_key)) } }
                                    td data-label="channel" { (d.channel) }
                                    td.num.hide-narrow data-label="attempts" { (d.attempts) }
                                    td data-label="class" { (d.error_class.as_deref().unwrap_or("-")) }
                                    td data-label="dead" { (clock.at(&d.dead_at)) }
                                    td.err data-label="last error" { (crate::text::escape(d.last_error.as_deref().unwrap_or("-"))) }
                                }
                            }
                        }
                    }
                    div.actions {
                        button.secondary type="submit" name="do" value="replay:filter" id="replay-all" { "Replay all " (total) " matching" }
                        button.secondary type="submit" name="do" value="cancel:filter" id="cancel-all" { "Cancel all " (total) " matching" }
                        @if f.error_class == Some(ErrorClass::Ambiguous) {
                            button.secondary type="submit" name="do" value="confirm:filter" id="confirm-all" { "Confirm all " (total) " delivered" }
                        }
                    }
                }
                (layout::pager(&with_query("/dead", &filter_query(f)), q.page, total, PAGE_SIZE))
            }
        }
    };
    Ok(layout::page("Dead letters", Some(&signed), body).into_response())
}
