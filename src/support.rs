//! Small helpers more than one room needs, each in one copy: a mutex lock that survives
//! poisoning, this machine's host name, and the walk down an error's causes. Nothing here
//! knows about messages, channels or the database.

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
}
