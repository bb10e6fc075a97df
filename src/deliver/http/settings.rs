//! The http channel's settings: the endpoints' secrets, read once at start-up.
//!
//! An endpoint row names its secret (`auth_secret`), never its value: each worker reads the
//! value from `OUTBOXD_SECRET_<NAME>` or from the file named by `OUTBOXD_SECRET_<NAME>_FILE`.
//! The values are held as [`Secret`]s, so no `Debug` of these settings shows one, and every
//! error names the variable, never what it holds.

use std::collections::BTreeMap;

use crate::model::ConfigError;
use crate::support::Secret;

/// The prefix of an endpoint secret's variable.
pub const SECRET_PREFIX: &str = "OUTBOXD_SECRET_";

/// The suffix of the variable that names a file holding the secret.
const FILE_SUFFIX: &str = "_FILE";

/// The endpoints' secrets this worker has, by upper-case name.
#[derive(Clone, Default, Debug)]
pub struct EndpointSecrets {
    by_name: BTreeMap<String, Secret>,
}

/// A secret's name as an endpoint writes it (any case) and a variable ends: letters,
/// digits and `_`, at most 64.
pub fn is_secret_name(name: &str) -> bool {
    crate::deliver::webhook::settings::is_secret_name(name)
}

impl EndpointSecrets {
    /// From every `OUTBOXD_SECRET_*` variable, as (variable, value): `OUTBOXD_SECRET_<NAME>`
    /// holds the value, `OUTBOXD_SECRET_<NAME>_FILE` the path of a file that holds it (one
    /// trailing newline trimmed). An empty value or file, a name of other characters, both
    /// variables of one name, or a file that cannot be read stop the start, naming the
    /// variable (and the file's path), never the value.
    pub fn from_vars(vars: &[(String, Secret)]) -> Result<EndpointSecrets, ConfigError> {
        Self::from_vars_with(vars, |path| std::fs::read(path))
    }

    /// [`EndpointSecrets::from_vars`] with the files read by `read`.
    pub fn from_vars_with(
        vars: &[(String, Secret)],
        read: impl Fn(&str) -> std::io::Result<Vec<u8>>,
    ) -> Result<EndpointSecrets, ConfigError> {
        let mut by_name = BTreeMap::new();
        for (var, value) in vars {
            let shown = crate::text::stripped(var, 80);
            let rest = var.strip_prefix(SECRET_PREFIX).unwrap_or("");
            let (name, from_file) = match rest.strip_suffix(FILE_SUFFIX) {
                Some(name) => (name, true),
                None => (rest, false),
            };
            if !is_secret_name(name) || name.bytes().any(|b| b.is_ascii_lowercase()) {
                return Err(ConfigError(format!(
                    "{shown}: an endpoint secret's variable is {SECRET_PREFIX}<NAME> or {SECRET_PREFIX}<NAME>{FILE_SUFFIX}, NAME of upper-case letters, digits and _"
                )));
            }
            let secret = if from_file {
                let path = value.expose();
                if path.is_empty() {
                    return Err(ConfigError(format!("{shown} is set but empty")));
                }
                let bytes = read(path).map_err(|e| {
                    ConfigError(format!(
                        "{shown}: cannot read {}: {}",
                        crate::text::stripped(path, 200),
                        e.kind()
                    ))
                })?;
                let text = String::from_utf8(bytes).map_err(|_| {
                    ConfigError(format!(
                        "{shown}: the file is not UTF-8 text (its content is not shown)"
                    ))
                })?;
                let text = text
                    .strip_suffix("\r\n")
                    .or_else(|| text.strip_suffix('\n'))
                    .unwrap_or(&text);
                if text.is_empty() {
                    return Err(ConfigError(format!(
                        "{shown}: the file {} is empty",
                        crate::text::stripped(path, 200)
                    )));
                }
                Secret::from(text)
            } else {
                if value.expose().is_empty() {
                    return Err(ConfigError(format!("{shown} is set but empty")));
                }
                value.clone()
            };
            if !header_value_ok(secret.expose()) {
                return Err(ConfigError(format!(
                    "{shown}: the secret has control characters and cannot be sent as a header value (it is not shown)"
                )));
            }
            if by_name.insert(name.to_owned(), secret).is_some() {
                return Err(ConfigError(format!(
                    "{SECRET_PREFIX}{name} and {SECRET_PREFIX}{name}{FILE_SUFFIX} are both set; give the secret one way"
                )));
            }
        }
        Ok(EndpointSecrets { by_name })
    }

    /// One secret (tests, embedding): `name` is upper-cased.
    pub fn with(mut self, name: &str, value: &str) -> EndpointSecrets {
        self.by_name
            .insert(name.to_ascii_uppercase(), Secret::from(value));
        self
    }

    /// The secret named `name` (any case), when this worker has it.
    pub fn get(&self, name: &str) -> Option<&Secret> {
        self.by_name.get(&name.to_ascii_uppercase())
    }

    /// The names this worker has (for the start-up log line; names are not secret).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}

/// Whether `v` can be a header value: visible ASCII, spaces and tabs, or other bytes
/// above 0x7f, as `HeaderValue::from_str` takes them.
fn header_value_ok(v: &str) -> bool {
    hyper::header::HeaderValue::from_str(v).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, Secret)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Secret::from(*v)))
            .collect()
    }

    fn files(path: &str) -> std::io::Result<Vec<u8>> {
        match path {
            "/run/stripe" => Ok(b"Bearer sk_file_MARK\n".to_vec()),
            "/run/empty" => Ok(b"\n".to_vec()),
            "/run/two" => Ok(b"tok_MARK\n\n".to_vec()),
            _ => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        }
    }

    #[test]
    fn secrets_from_variables_and_files() {
        let s = EndpointSecrets::from_vars_with(
            &vars(&[
                ("OUTBOXD_SECRET_STRIPE_FILE", "/run/stripe"),
                ("OUTBOXD_SECRET_RESEND", "re_MARK"),
            ]),
            files,
        )
        .expect("valid");
        assert_eq!(
            s.get("stripe").map(Secret::expose),
            Some("Bearer sk_file_MARK")
        );
        assert_eq!(s.get("RESEND").map(Secret::expose), Some("re_MARK"));
        assert!(s.get("other").is_none());
        // Only one newline is trimmed: the other is refused, as a header value can hold none.
        let two =
            EndpointSecrets::from_vars_with(&vars(&[("OUTBOXD_SECRET_T_FILE", "/run/two")]), files)
                .expect_err("a newline left");
        assert!(two.0.contains("control characters"), "{}", two.0);
        let shown = format!("{s:?} {s:#?}");
        assert!(!shown.contains("MARK"), "{shown}");
    }

    #[test]
    fn refusals_name_the_variable_never_the_value() {
        for (pairs, needle) in [
            (
                vec![("OUTBOXD_SECRET_A", "")],
                "OUTBOXD_SECRET_A is set but empty",
            ),
            (
                vec![("OUTBOXD_SECRET_A_FILE", "/run/empty")],
                "OUTBOXD_SECRET_A_FILE: the file /run/empty is empty",
            ),
            (
                vec![("OUTBOXD_SECRET_A_FILE", "/run/none")],
                "OUTBOXD_SECRET_A_FILE: cannot read /run/none",
            ),
            (
                vec![
                    ("OUTBOXD_SECRET_A", "x_MARK"),
                    ("OUTBOXD_SECRET_A_FILE", "/run/stripe"),
                ],
                "are both set",
            ),
            (
                vec![("OUTBOXD_SECRET_lower", "x_MARK")],
                "NAME of upper-case",
            ),
            (vec![("OUTBOXD_SECRET_", "x_MARK")], "NAME of upper-case"),
            (
                vec![("OUTBOXD_SECRET_A", "Bearer x_MARK\r\nX: y")],
                "control characters",
            ),
        ] {
            let err = EndpointSecrets::from_vars_with(&vars(&pairs), files)
                .expect_err(needle)
                .0;
            assert!(err.contains(needle), "{err}");
            assert!(!err.contains("MARK"), "{err}");
        }
    }
}
