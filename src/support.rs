//! Small helpers more than one room needs, each in one copy: a mutex lock that survives
//! poisoning, this machine's host name, the walk down an error's causes, and the `Debug`
//! of a value that must not be printed (`Redacted` for a borrowed one, `Secret` for one
//! held as it was read). Nothing here knows about messages, channels or the database.

use std::error::Error;
use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data even if a thread panicked while holding it: every value kept
/// behind these mutexes (pooled connections, the worker's bookkeeping) stays consistent
/// between statements, so a panic elsewhere is no reason to stop using it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// This machine's host name (`/proc/sys/kernel/hostname`, trimmed), when it can be read and
/// is not empty.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}

/// The causes of `err`, nearest first (its `source()`, that one's, and so on); `err`
/// itself is not included.
pub fn causes<'a>(
    err: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(err.source(), |e: &&'a (dyn Error + 'static)| (*e).source())
}

/// `Debug` for a value that must never be printed (a secret, a URL that may carry a
/// password or a token): whether there is one, never what it is. The structs that hold
/// such values write their `Debug` by hand with it, so that a `{:?}` anywhere (a log line,
/// a panic message, an application's own error report) cannot show them.
pub struct Redacted<'a, T>(pub &'a Option<T>);

impl<T> std::fmt::Debug for Redacted<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Some(_) => "Some([redacted])",
            None => "None",
        })
    }
}

/// A value that must never be printed, held where it is read (a secret, or a URL that may
/// carry a password or a token). Its `Debug` says only `[redacted]`, so a struct holding it
/// can derive its own `Debug` and stay safe when a field is added; the value is read with
/// [`Secret::expose`], which makes every place that uses it visible in the code. It has
/// no `Display`, and no `PartialEq` (a token compared with `==` would be compared in time
/// that depends on where it differs).
#[derive(Clone, Default)]
pub struct Secret(String);

impl Secret {
    /// The value itself, for the one place that uses it (a parser, a connection).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Secret {
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Secret {
        Secret(value.to_owned())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

/// The text of the environment variable `name`: `None` when it is not set, [`NotUtf8`]
/// when it is set to bytes that are not UTF-8. `std::env::var(name).ok()` reads such a value
/// as unset, so a signing secret or a sign-in token that the operator did set would silently
/// be absent (unsigned webhooks, a console without a token): every variable outboxd reads
/// goes through here, or checks its value's bytes the same way.
pub fn env_var(name: &str) -> Result<Option<String>, NotUtf8> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(NotUtf8::of(std::ffi::OsStr::new(name))),
    }
}

/// An environment variable set to bytes that are not UTF-8. It shows the variable's name
/// (with visible escapes, should the name itself be odd), never its value, which may be a
/// secret.
#[derive(Debug, thiserror::Error)]
#[error("{0} is set to a value that is not valid UTF-8 (the value is not shown)")]
pub struct NotUtf8(String);

impl NotUtf8 {
    /// The error for the variable `name`.
    pub fn of(name: &std::ffi::OsStr) -> NotUtf8 {
        NotUtf8(crate::text::escape(&name.to_string_lossy()).into_owned())
    }
}

impl From<NotUtf8> for crate::model::ConfigError {
    fn from(e: NotUtf8) -> Self {
        crate::model::ConfigError(e.to_string())
    }
}

/// One line about a database error: the SQLSTATE and the server's message, or the
/// connection problem. tokio-postgres's own Display says only "db error". The server's
/// DETAIL is left out on purpose: for a constraint violation it quotes the failing row,
/// payload included.
pub fn describe(err: &tokio_postgres::Error) -> String {
    if let Some(db) = err.as_db_error() {
        return format!("{} {}: {}", db.severity(), db.code().code(), db.message());
    }
    let mut out = err.to_string();
    for e in crate::support::causes(err) {
        out.push_str(": ");
        out.push_str(&e.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Layer(&'static str, #[source] Option<Box<Layer>>);

    #[test]
    fn causes_walk_the_chain_without_the_error_itself() {
        let err = Layer(
            "a",
            Some(Box::new(Layer("b", Some(Box::new(Layer("c", None)))))),
        );
        let shown: Vec<String> = causes(&err).map(|e| e.to_string()).collect();
        assert_eq!(shown, ["b", "c"]);
    }

    #[test]
    fn a_poisoned_mutex_still_locks() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock();
            panic!("poison");
        })
        .join();
        assert_eq!(*lock(&m), 1);
    }

    #[test]
    fn redacted_says_whether_not_what() {
        let secret = Some("hunter2".to_owned());
        assert_eq!(format!("{:?}", Redacted(&secret)), "Some([redacted])");
        assert_eq!(format!("{:?}", Redacted::<String>(&None)), "None");
    }

    #[test]
    fn a_secret_prints_as_redacted_wherever_it_is_held() {
        #[derive(Debug)]
        struct Held {
            one: Option<Secret>,
            named: Vec<(String, Secret)>,
        }
        let held = Held {
            one: Some("hunter2".into()),
            named: vec![("NAME".to_owned(), Secret::from("hunter3".to_owned()))],
        };
        let shown = format!("{held:?} {held:#?}");
        assert!(!shown.contains("hunter"), "{shown}");
        assert!(
            shown.contains("Some([redacted])") && shown.contains("NAME"),
            "{shown}"
        );
        assert_eq!(held.one.as_ref().map(Secret::expose), Some("hunter2"));
        assert_eq!(held.named[0].1.expose(), "hunter3");
    }
}
