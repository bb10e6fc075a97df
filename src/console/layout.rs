//! The frame every page shares and the error page.
//!
//! Every value is interpolated by maud, which escapes it; nothing here uses `PreEscaped`.

use axum::http::StatusCode;
use axum::response::Html;
use maud::{DOCTYPE, Markup, html};

use super::auth::Signed;

/// A page: the header (navigation, lookup, who is signed in, sign-out) and `body`.
pub(crate) fn page(title: &str, signed: Option<&Signed>, body: Markup) -> Html<String> {
    page_refreshing(title, signed, None, body)
}

/// [`page`], reloaded by the browser every `refresh` seconds when given: a
/// `<meta http-equiv="refresh">`, which needs no script, so the CSP stays as it is.
pub(crate) fn page_refreshing(
    title: &str,
    signed: Option<&Signed>,
    refresh: Option<u32>,
    body: Markup,
) -> Html<String> {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(s) = refresh {
                    meta http-equiv="refresh" content=(s);
                }
                title { (title) " · outboxd console" }
                link rel="stylesheet" href="/style.css";
            }
            body {
                header {
                    span.brand { "outboxd" }
                    @if let Some(s) = signed {
                        nav {
                            a href="/" { "Overview" }
                            a href="/dead" { "Dead letters" }
                            a href="/held" { "Held" }
                            a href="/messages" { "Messages" }
                            a href="/endpoints" { "Endpoints" }
                            a href="/destinations" { "Destinations" }
                            a href="/channels" { "Channels" }
                        }
                        form action="/lookup" method="get" role="search" {
                            input type="search" name="q" placeholder="id or key" aria-label="id or key" maxlength="255";
                            button type="submit" { "Look up" }
                        }
                        span.who { "signed in as " b { (s.name) } }
                        form action="/signout" method="post" {
                            input type="hidden" name="csrf" value=(s.csrf);
                            button.secondary type="submit" { "Sign out" }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    };
    Html(markup.into_string())
}

/// The one-line error page.
pub(crate) fn error_page(status: StatusCode, line: &str) -> Html<String> {
    let title = status.canonical_reason().unwrap_or("Error");
    page(
        title,
        None,
        html! {
            section.error {
                p id="error" { (line) }
                p { a href="/" { "Back to the overview" } }
            }
        },
    )
}

/// A pager's links: previous and next pages of `base` (a path and its query without
/// `page`), when there are any.
pub(crate) fn pager(base: &str, page: i64, total: i64, size: i64) -> Markup {
    let pages = page_count(total, size);
    html! {
        div.pager {
            @if page > 1 {
                a href=(page_href(base, page - 1)) rel="prev" { "← previous" }
            }
            span.muted { "page " (page) " of " (pages) }
            @if page < pages {
                a href=(page_href(base, page + 1)) rel="next" { "next →" }
            }
        }
    }
}

/// In place of an empty page past the last (its rows acted on or purged meanwhile): the
/// way back to the last page that has rows, or to the first.
pub(crate) fn past_the_end(base: &str, total: i64, size: i64) -> Markup {
    let last = page_count(total, size);
    html! {
        div.pager {
            a href=(page_href(base, last)) rel="prev" id="last-page" {
                "← page " (last) ", the last"
            }
        }
    }
}

/// How many pages of `size` rows `total` rows fill; one when there are none.
fn page_count(total: i64, size: i64) -> i64 {
    ((total + size - 1) / size).max(1)
}

/// `base` (a path and its query without `page`) at page `page`.
fn page_href(base: &str, page: i64) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}page={page}")
}

/// The filter form's channel picker (`name="channel"`), with `chosen` selected.
pub(crate) fn channel_select(chosen: Option<crate::model::Channel>) -> Markup {
    html! {
        label { "Channel"
            select name="channel" id="f-channel" {
                option value="" { "any" }
                @for ch in crate::model::Channel::ALL {
                    option value=(ch.as_str()) selected[chosen == Some(ch)] { (ch.as_str()) }
                }
            }
        }
    }
}

/// The filter form's age field (`name="since"`), showing `since` as [`since_text`] does.
pub(crate) fn since_input(label: &str, since: Option<std::time::Duration>) -> Markup {
    html! {
        label { (label)
            input type="text" name="since" id="f-since" size="6" maxlength="20"
                value=[since.map(since_text)];
        }
    }
}

/// An age filter as the pager, the actions and the form carry it on: in seconds when it
/// is whole seconds, else in milliseconds (`1500ms` carried on as `1s` listed one thing
/// and acted on another, and `500ms` as `0s` found nothing).
pub(crate) fn since_text(d: std::time::Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// What the filter's own parser reads back as the same age, to the millisecond.
    #[test]
    fn an_age_is_carried_on_as_it_was_given() {
        for (d, text) in [
            (Duration::from_secs(90), "90s"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_millis(500), "500ms"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(super::since_text(d), text);
            assert_eq!(crate::config::parse_duration(text), Ok(d), "{text}");
        }
    }
}
