//! Endpoints as a worker holds them: the rows of `outbox.endpoints`, read by the worker
//! (which owns the database side) and handed here as [`EndpointRow`]s, checked once per
//! refresh into [`Endpoint`]s, and shared by every attempt through [`Endpoints`].

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use hyper::header::{HeaderMap, HeaderName, HeaderValue};

use crate::deliver::DeliveryError;

/// One row of `outbox.endpoints`, as the worker read it.
#[derive(Debug, Clone)]
pub struct EndpointRow {
    /// `name`.
    pub name: String,
    /// `url`: the API's base URL.
    pub url: String,
    /// `auth_header`.
    pub auth_header: String,
    /// `auth_secret`: the NAME of a secret, never its value.
    pub auth_secret: Option<String>,
    /// `idempotency_header` (None: the provider takes none).
    pub idempotency_header: Option<String>,
    /// `key_ttl`, in seconds.
    pub key_ttl: Option<f64>,
    /// `headers`: fixed, non-secret headers.
    pub headers: serde_json::Value,
}

/// An endpoint, checked: what an attempt needs to build its request.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Its name.
    pub name: String,
    /// The base URL (no query or fragment); its path has no trailing `/`.
    pub base: url::Url,
    /// The header that carries the credential.
    pub auth_header: HeaderName,
    /// The NAME of the secret that fills it.
    pub auth_secret: Option<String>,
    /// The header that carries the message key.
    pub idempotency_header: Option<HeaderName>,
    /// How long the provider remembers a key.
    pub key_ttl: Option<Duration>,
    /// The fixed headers (values are not secret, but are shown nowhere all the same).
    pub headers: HeaderMap,
}

impl Endpoint {
    /// Checks a row; the error names the endpoint and the column, never a value.
    pub fn from_row(row: &EndpointRow) -> Result<Endpoint, String> {
        let bad = |what: &str| format!("endpoint {}: {what}", crate::text::stripped(&row.name, 64));
        let mut base = url::Url::parse(&row.url).map_err(|_| bad("url is not a valid URL"))?;
        if !matches!(base.scheme(), "http" | "https") || base.host().is_none() {
            return Err(bad("url must be http(s) with a host"));
        }
        if !base.username().is_empty() || base.password().is_some() {
            return Err(bad("url may not carry credentials (use auth_secret)"));
        }
        base.set_query(None);
        base.set_fragment(None);
        let trimmed = base.path().trim_end_matches('/').to_owned();
        base.set_path(&trimmed);
        let auth_header = HeaderName::from_bytes(row.auth_header.as_bytes())
            .map_err(|_| bad("auth_header is not a header name"))?;
        let idempotency_header = row
            .idempotency_header
            .as_deref()
            .map(|h| HeaderName::from_bytes(h.as_bytes()))
            .transpose()
            .map_err(|_| bad("idempotency_header is not a header name"))?;
        let mut headers = HeaderMap::new();
        match &row.headers {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let (Ok(name), Some(Ok(value))) = (
                        HeaderName::from_bytes(k.as_bytes()),
                        v.as_str().map(HeaderValue::from_str),
                    ) else {
                        return Err(bad(
                            "headers must be an object of valid header names and string values",
                        ));
                    };
                    headers.insert(name, value);
                }
            }
            serde_json::Value::Null => {}
            _ => return Err(bad("headers must be an object")),
        }
        Ok(Endpoint {
            name: row.name.clone(),
            base,
            auth_header,
            auth_secret: row.auth_secret.clone(),
            idempotency_header,
            key_ttl: row
                .key_ttl
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64),
            headers,
        })
    }

    /// The URL of `path` and `query` at this endpoint: the endpoint's own path kept
    /// (`https://api.example.com/v2` + `/charges` is `/v2/charges`), the query encoded.
    /// Built with the URL parser and then held to the endpoint: the same scheme, host and
    /// port, and a path under the endpoint's (no `..` or `%2e%2e` climbing out of it),
    /// however the path was written; else `invalid` (`field` names the path), and no
    /// request is made. The error shows neither path nor query.
    pub fn url_for(
        &self,
        path: &str,
        query: &[(String, String)],
        field: &str,
    ) -> Result<url::Url, DeliveryError> {
        let base_path = self.base.path().trim_end_matches('/');
        let text = format!(
            "{}{base_path}{path}",
            self.base.origin().ascii_serialization()
        );
        let leaves = || {
            DeliveryError::invalid(format!(
                "{field} leaves endpoint {}'s URL; write it as a plain path under the endpoint's",
                self.name
            ))
        };
        let mut url = url::Url::parse(&text).map_err(|_| leaves())?;
        let same = url.scheme() == self.base.scheme()
            && url.host() == self.base.host()
            && url.port_or_known_default() == self.base.port_or_known_default()
            && url.username().is_empty()
            && url.password().is_none()
            && url.query().is_none()
            && url.fragment().is_none();
        let under = url.path() == base_path
            || url
                .path()
                .strip_prefix(base_path)
                .is_some_and(|rest| rest.starts_with('/'));
        // A provider (or a proxy before it) that decodes the path before it reads it must
        // find no way out either: no `.` or `..` segment, no backslash once decoded.
        let decoded = percent_encoding::percent_decode_str(url.path()).decode_utf8_lossy();
        let climbs =
            decoded.contains('\\') || decoded.split('/').any(|seg| seg == "." || seg == "..");
        if !same || !under || climbs {
            return Err(leaves());
        }
        if !query.is_empty() {
            url.query_pairs_mut()
                .extend_pairs(query.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        }
        Ok(url)
    }
}

/// The endpoints a worker knows, shared by every attempt and replaced whole at each
/// refresh. A row that does not check is kept as its error, so that its messages die
/// saying why rather than as unknown.
#[derive(Clone, Default)]
pub struct Endpoints {
    inner: Arc<RwLock<Arc<Table>>>,
}

/// One refresh's endpoints.
#[derive(Default)]
struct Table {
    by_name: HashMap<String, Result<Arc<Endpoint>, String>>,
    /// Whether a refresh has happened (before it, an unknown name says nothing).
    loaded: bool,
}

impl std::fmt::Debug for Endpoints {
    /// The names known, nothing of their rows.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let table = self.snapshot();
        let mut names: Vec<&String> = table.by_name.keys().collect();
        names.sort();
        f.debug_struct("Endpoints").field("names", &names).finish()
    }
}

/// What a name is, in the table.
pub enum Known {
    /// Usable.
    Yes(Arc<Endpoint>),
    /// Its row does not check: the error.
    Broken(String),
    /// Not in the table.
    No,
}

impl Endpoints {
    fn snapshot(&self) -> Arc<Table> {
        match self.inner.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Replaces the table with `rows`; returns the errors of rows that did not check.
    pub fn replace(&self, rows: &[EndpointRow]) -> Vec<String> {
        let mut errors = Vec::new();
        let by_name = rows
            .iter()
            .map(|row| {
                let e = Endpoint::from_row(row).map(Arc::new);
                if let Err(msg) = &e {
                    errors.push(msg.clone());
                }
                (row.name.clone(), e)
            })
            .collect();
        let table = Arc::new(Table {
            by_name,
            loaded: true,
        });
        match self.inner.write() {
            Ok(mut g) => *g = table,
            Err(p) => *p.into_inner() = table,
        }
        errors
    }

    /// The endpoint named `name`.
    pub fn get(&self, name: &str) -> Known {
        match self.snapshot().by_name.get(name) {
            Some(Ok(e)) => Known::Yes(e.clone()),
            Some(Err(msg)) => Known::Broken(msg.clone()),
            None => Known::No,
        }
    }

    /// Whether a refresh has filled the table yet.
    pub fn loaded(&self) -> bool {
        self.snapshot().loaded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(url: &str) -> Endpoint {
        Endpoint::from_row(&EndpointRow {
            name: "api".into(),
            url: url.into(),
            auth_header: "Authorization".into(),
            auth_secret: None,
            idempotency_header: Some("Idempotency-Key".into()),
            key_ttl: Some(86400.0),
            headers: serde_json::json!({"Stripe-Version": "2024-06-20"}),
        })
        .expect("a valid row")
    }

    #[test]
    fn paths_are_joined_under_the_endpoint() {
        let e = endpoint("https://api.example.com/v2/");
        let q = [("query".to_owned(), "metadata['k']:'a b&c'".to_owned())];
        let u = e.url_for("/charges", &q, "path").expect("joined");
        assert_eq!(
            u.as_str(),
            "https://api.example.com/v2/charges?query=metadata%5B%27k%27%5D%3A%27a+b%26c%27"
        );
        let root = endpoint("http://127.0.0.1:8080");
        assert_eq!(
            root.url_for("/v1/x", &[], "path").expect("joined").as_str(),
            "http://127.0.0.1:8080/v1/x"
        );
    }

    #[test]
    fn hostile_paths_never_leave_the_endpoint() {
        let e = endpoint("https://api.example.com/v2");
        for path in [
            "/../admin",
            "/%2e%2e/admin",
            "/%2E%2E/admin",
            "/.%2e/admin",
            "/x/../../admin",
            "/..%2F../admin",
            "/%2e%2E%2fadmin",
            "/a%5C..%5Cadmin",
        ] {
            let err = e.url_for(path, &[], "path").expect_err(path);
            assert_eq!(err.class, crate::model::ErrorClass::Invalid, "{path}");
            assert!(!err.message.contains("admin"), "{}", err.message);
        }
        // Written to look like another host, these stay on the endpoint's, as paths.
        for path in [
            "//evil.example/x",
            "/@evil.example",
            "/%2F%2Fevil.example",
            "/:80@evil",
        ] {
            let u = e.url_for(path, &[], "path").expect(path);
            assert_eq!(u.host_str(), Some("api.example.com"), "{path}");
            assert_eq!(u.port_or_known_default(), Some(443), "{path}");
            assert!(u.path().starts_with("/v2/"), "{path}: {u}");
        }
    }

    #[test]
    fn rows_that_do_not_check_say_which_column() {
        let mut row = EndpointRow {
            name: "bad".into(),
            url: "ftp://x.example".into(),
            auth_header: "Authorization".into(),
            auth_secret: None,
            idempotency_header: None,
            key_ttl: None,
            headers: serde_json::json!({}),
        };
        assert!(
            Endpoint::from_row(&row)
                .expect_err("refused")
                .contains("url")
        );
        row.url = "https://u:p@x.example".into();
        assert!(
            Endpoint::from_row(&row)
                .expect_err("refused")
                .contains("credentials")
        );
        row.url = "https://x.example".into();
        row.auth_header = "Bad Header".into();
        assert!(
            Endpoint::from_row(&row)
                .expect_err("refused")
                .contains("auth_header")
        );
    }
}
