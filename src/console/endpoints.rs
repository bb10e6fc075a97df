//! The http channel's endpoints, as `outboxd endpoint list` shows them, with no secret: the
//! table holds a secret's NAME only, and the page says whether this console's own
//! environment has a variable of that name (yes or no, never its value). Fixed headers
//! are shown by name: they are meant to be non-secret, but an operator may have put an
//! account id there, and the page has no need of it.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::time::Clock;
use super::{Failure, Shared, client, layout};
use crate::ops::Endpoint;

pub(crate) async fn page(State(app): State<Shared>, signed: Signed) -> Result<Response, Failure> {
    let c = client(&app).await?;
    let clock = Clock(
        crate::ops::database_now(&**c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let endpoints = crate::ops::endpoints(&**c).await.map_err(|e| match e {
        crate::ops::EndpointError::Database(e) => Failure::db(&e),
        other => Failure::Database(other.to_string()),
    })?;
    let body = html! {
        section {
            p.muted {
                "The providers' APIs that " code { "http" } " messages name. A secret is named here, "
                "never shown: each worker reads its value from " code { "OUTBOXD_SECRET_<NAME>" }
                " (or " code { "…_FILE" } "). Change them with " code { "outboxd endpoint set" } "."
            }
            @if endpoints.is_empty() {
                p.muted id="no-endpoints" { "No endpoint is set." }
            } @else {
                table.rows id="endpoints" {
                    thead { tr {
                        th { "name" } th { "base URL" } th { "credential" }
                        th { "idempotency header" } th { "key window" } th { "fixed headers" } th { "changed" }
                    } }
                    tbody {
                        @for e in &endpoints { (row(e, &app, &clock)) }
                    }
                }
            }
        }
    };
    Ok(layout::page("Endpoints", Some(&signed), body).into_response())
}

fn row(e: &Endpoint, app: &super::App, clock: &Clock) -> Markup {
    let t = |s: &str| crate::text::escape(s).into_owned();
    let header_names: Vec<String> = e
        .headers
        .as_object()
        .map(|m| m.keys().map(|k| t(k)).collect())
        .unwrap_or_default();
    html! {
        tr data-name=(e.name) {
            td.key data-label="name" {
                a href={ "/messages?channel=http&endpoint=" (urlencode(&e.name)) } { (t(&e.name)) }
            }
            td.key data-label="base URL" { (origin_of(&e.url)) }
            td data-label="credential" {
                @match &e.auth_secret {
                    Some(name) => {
                        code { (t(&e.auth_header)) } " from " code.secret { (t(name)) }
                        br;
                        span.muted.secret-here {
                            @match app.has_secret(name) {
                                Some(true) => "set in this console's environment",
                                Some(false) => "not set in this console's environment",
                                None => "this console could not read its secrets (see its log)",
                            }
                        }
                    }
                    None => span.muted { "none sent" },
                }
            }
            td data-label="idempotency header" {
                @match &e.idempotency_header {
                    Some(h) => code { (t(h)) },
                    None => span.muted { "none" },
                }
            }
            td data-label="key window" {
                @match &e.key_ttl {
                    Some(ttl) => (t(ttl)),
                    None => span.muted { "unknown" },
                }
            }
            td data-label="fixed headers" {
                @if header_names.is_empty() {
                    span.muted { "none" }
                } @else {
                    (header_names.join(", "))
                }
            }
            td data-label="changed" { (clock.at(&e.updated_at)) }
        }
    }
}

/// An endpoint's URL as a page may show it: scheme, host and port, and `/…` for a path,
/// which may hold a credential (a Slack incoming webhook's does) and, like every URL path,
/// stays off the console's pages. `outboxd endpoint list` shows it whole to the operator.
fn origin_of(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) if u.has_host() => {
            let origin = u.origin().ascii_serialization();
            // Nothing after the origin but the root: nothing to hide.
            if u.as_str().strip_prefix(origin.as_str()) == Some("/") {
                origin
            } else {
                format!("{origin}/…")
            }
        }
        _ => "(not a URL)".to_owned(),
    }
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::origin_of;

    #[test]
    fn a_page_shows_an_endpoints_origin_and_never_its_path() {
        assert_eq!(
            origin_of("https://api.stripe.com"),
            "https://api.stripe.com"
        );
        assert_eq!(
            origin_of("https://api.example.com:8443/v2"),
            "https://api.example.com:8443/…"
        );
        assert_eq!(
            origin_of("https://hooks.slack.com/services/T0/B0/SECRET?x=1"),
            "https://hooks.slack.com/…"
        );
        assert_eq!(origin_of("not a url"), "(not a URL)");
    }
}
