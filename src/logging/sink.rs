//! Where log lines go: stderr, through a bounded queue and a thread of its own, so that a
//! log line can never cost a delivery's record or the shutdown.
//!
//! Writing to stderr straight from the task that logs has two ways to hurt the daemon. A
//! stderr that is a closed pipe (a log shipper that died, `| head -c 1`) fails every write,
//! and tracing-subscriber then reports the failure with `eprintln!`, which panics on the same
//! closed stderr: inside the task that was about to record an outcome or handle SIGTERM.
//! A stderr that is a full pipe (a shipper that stopped reading) blocks the writing task,
//! and with it a runtime thread. Here the task only formats its line and offers it to a
//! queue ([`Line`]); one thread ([`LogSink::start`]) writes the queue to stderr. A line the
//! queue has no room for, or that stderr refuses, is dropped and counted
//! ([`dropped`], the metric `outboxd_log_lines_dropped_total`), never retried and never
//! reported on stderr itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Duration;

/// How many formatted lines may wait for the writer thread. A burst beyond it (or a stderr
/// that stopped reading) drops lines rather than slowing the worker.
const QUEUE_LINES: usize = 4096;

/// How long [`FlushOnDrop`] waits, at exit, for the queued lines to reach stderr. A stderr
/// that blocks for longer loses them: the process exits on time.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// Log lines dropped since the process started: the queue was full or stderr refused the
/// write. Process-wide because stderr is: there is one per process, whichever subscriber or
/// test writes to it.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Log lines dropped so far (the queue was full, or stderr refused the write).
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

fn count_dropped() {
    DROPPED.fetch_add(1, Ordering::Relaxed);
}

enum Msg {
    Line(Vec<u8>),
    /// Answered once every line queued before it was written (or dropped).
    Flush(SyncSender<()>),
}

/// The `MakeWriter` for tracing-subscriber's fmt layer: each event gets a [`Line`], which
/// hands its bytes to the writer thread when the event is formatted.
#[derive(Clone)]
pub struct LogSink {
    tx: SyncSender<Msg>,
}

/// Flushes the queue when dropped (at the end of `main`), waiting at most [`FLUSH_WAIT`].
pub struct FlushOnDrop {
    tx: SyncSender<Msg>,
}

impl LogSink {
    /// Starts the writer thread for stderr.
    pub fn start() -> std::io::Result<(LogSink, FlushOnDrop)> {
        Self::start_with(std::io::stderr())
    }

    /// Starts the writer thread for `out` (stderr in the binary; a test's own writer).
    pub fn start_with<W: std::io::Write + Send + 'static>(
        out: W,
    ) -> std::io::Result<(LogSink, FlushOnDrop)> {
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE_LINES);
        std::thread::Builder::new()
            .name("outboxd-log".into())
            .spawn(move || write_lines(rx, out))?;
        Ok((LogSink { tx: tx.clone() }, FlushOnDrop { tx }))
    }
}

/// The writer thread: every line to `out`; a failed write drops that line and counts it.
/// Ends when every sender is gone.
fn write_lines<W: std::io::Write>(rx: Receiver<Msg>, mut out: W) {
    for msg in rx {
        match msg {
            Msg::Line(bytes) => {
                if out.write_all(&bytes).and_then(|()| out.flush()).is_err() {
                    count_dropped();
                }
            }
            Msg::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel(1);
        // `send` would block on a full queue behind a blocked stderr: offer it, and give
        // up if there is no room within the wait either.
        let deadline = std::time::Instant::now() + FLUSH_WAIT;
        let mut msg = Msg::Flush(done_tx);
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Disconnected(_)) => return,
                Err(TrySendError::Full(m)) => {
                    if std::time::Instant::now() >= deadline {
                        return;
                    }
                    msg = m;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        // Answered, timed out or the thread gone: either way the process goes on exiting.
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let _ = done_rx.recv_timeout(left);
    }
}

/// One event's bytes, queued for the writer thread when the event is done with it.
pub struct Line {
    buf: Vec<u8>,
    tx: SyncSender<Msg>,
}

impl std::io::Write for Line {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let bytes = std::mem::take(&mut self.buf);
        if self.tx.try_send(Msg::Line(bytes)).is_err() {
            count_dropped();
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogSink {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line {
            buf: Vec::with_capacity(256),
            tx: self.tx.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::sync::{Arc, Mutex};

    /// A writer that fails every write, as a closed pipe does.
    struct Closed;
    impl std::io::Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
    }

    #[derive(Clone, Default)]
    struct Kept(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Kept {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::ErrorKind::Other)?
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn log_through(sink: LogSink, lines: usize) {
        use tracing_subscriber::fmt::MakeWriter as _;
        for i in 0..lines {
            let mut w = sink.make_writer();
            let _ = writeln!(w, "line {i}");
        }
    }

    #[test]
    fn lines_reach_the_writer_in_order_and_a_flush_waits_for_them() {
        let kept = Kept::default();
        let (sink, flush) = LogSink::start_with(kept.clone()).expect("start");
        log_through(sink, 3);
        drop(flush);
        let text = String::from_utf8(kept.0.lock().expect("lock").clone()).expect("utf-8");
        assert_eq!(text, "line 0\nline 1\nline 2\n");
    }

    #[test]
    fn a_closed_writer_drops_and_counts_lines_without_panicking() {
        let before = dropped();
        let (sink, flush) = LogSink::start_with(Closed).expect("start");
        log_through(sink, 5);
        drop(flush);
        // Other tests may drop lines too: at least these five were counted.
        assert!(dropped() >= before + 5, "{} -> {}", before, dropped());
    }
}
