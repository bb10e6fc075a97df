//! Small helpers more than one room needs, each in one copy: a mutex lock that survives
//! poisoning, this machine's host name, the walk down an error's causes, and the `Debug`
//! of a value that must not be printed. Nothing here knows about messages, channels or
//! the database.

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

/// The names of `(variable, value)` pairs of secrets, for a `Debug` that shows no value.
pub fn secret_names(pairs: &[(String, String)]) -> Vec<&str> {
    pairs.iter().map(|(name, _)| name.as_str()).collect()
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
}
