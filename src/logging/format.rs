//! The text log's format: fields escaped as stored text is ([`crate::text::escape`]), and
//! timestamps written from a per-second cache.

/// The text log's fields, as tracing-subscriber's default writes them (`message` bare, then
/// `name=value`, string values quoted), but every value passed through
/// [`crate::text::escape`]: a field that displays stored text (`key = %…`, an error that
/// quotes a server's reply) can neither start a new line, which would forge a log line,
/// nor send a terminal escape (the default sanitises some escapes, not newlines).
pub(super) struct EscapedFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for EscapedFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = EscapingVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct EscapingVisitor<'w> {
    writer: tracing_subscriber::fmt::format::Writer<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl EscapingVisitor<'_> {
    /// Writes the separator and `name=` (nothing but the separator for `message`); false
    /// when the field is not shown or writing failed.
    fn start(&mut self, name: &str) -> bool {
        // Metadata of `log` records, already shown in the line's prefix.
        if self.result.is_err() || name.starts_with("log.") {
            return false;
        }
        let w = &mut self.writer;
        if !std::mem::take(&mut self.first) {
            self.result = w.write_char(' ');
        }
        if name != "message" {
            self.result = self
                .result
                .and_then(|()| w.write_str(name.strip_prefix("r#").unwrap_or(name)))
                .and_then(|()| w.write_char('='));
        }
        self.result.is_ok()
    }
}

/// Is `s` printed the same by `{:?}` inside its quotes, by `{}`, and by the escaping
/// writer? True for printable ASCII without a quote or a backslash: what the daemon's
/// own strings (outcomes, classes, hosts, most errors) are made of.
fn plain(s: &str) -> bool {
    s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

impl tracing::field::Visit for EscapingVisitor<'_> {
    // Numbers, booleans and plain strings are written directly: the same text the
    // `Debug` path below gives them, without a formatter and the escaping writer per
    // field (the per-attempt line was 17 % of the daemon's instructions).
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        if self.start(field.name()) {
            self.result = write!(self.writer, "{value}");
        }
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if self.start(field.name()) {
            self.result = write!(self.writer, "{value}");
        }
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        if self.start(field.name()) {
            self.result = self.writer.write_str(if value { "true" } else { "false" });
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        let message = field.name() == "message";
        if plain(value) {
            if self.start(field.name()) {
                let w = &mut self.writer;
                self.result = if message {
                    w.write_str(value)
                } else {
                    w.write_char('"')
                        .and_then(|()| w.write_str(value))
                        .and_then(|()| w.write_char('"'))
                };
            }
        } else if message {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if !self.start(field.name()) {
            return;
        }
        // The value streams through the escaping writer: no `String` per field (the
        // per-attempt line has a dozen fields, and the allocations showed in the profile).
        self.result = std::fmt::Write::write_fmt(
            &mut EscapingWriter(&mut self.writer),
            format_args!("{value:?}"),
        );
    }
}

/// Writes what it is given through [`crate::text::Escaped`]. Escaping works character by
/// character, and each piece a formatter writes is whole characters, so escaping the pieces
/// one by one gives what escaping the whole value would.
struct EscapingWriter<'a, 'w>(&'a mut tracing_subscriber::fmt::format::Writer<'w>);

impl std::fmt::Write for EscapingWriter<'_, '_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        // What `Escaped` itself does with such a piece, without a formatter per piece.
        if !crate::text::has_unsafe(s) {
            return self.0.write_str(s);
        }
        write!(self.0, "{}", crate::text::Escaped(s))
    }
}

/// The log's timestamps exactly as tracing-subscriber's `SystemTime` writes them
/// (`2026-12-06T13:45:12.123456Z`, UTC, microseconds), with the part up to the second
/// formatted once a second per thread: the calendar arithmetic and the six padded numbers
/// were 3 % of the daemon's instructions in a drain, one per attempt's log line
/// (BENCHMARKS.md). A time before 1970 or after 9999, which the cache does not cover,
/// is written by tracing-subscriber's own.
pub(super) struct SecondCachedTime;

thread_local! {
    /// The second last written (Unix seconds) and its text up to and including the `.`.
    static SECOND: std::cell::RefCell<(u64, String)> = const {
        std::cell::RefCell::new((u64::MAX, String::new()))
    };
}

impl tracing_subscriber::fmt::time::FormatTime for SecondCachedTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match write_cached(std::time::SystemTime::now(), w) {
            Some(written) => written,
            // Outside the cache's years, or its thread-local gone (an event from another
            // thread-local's destructor) or busy: tracing-subscriber's own timer.
            None => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// [`SecondCachedTime`]'s text for `now`, or `None` (nothing written) when the cache cannot
/// give it: a time before 1970 or after 9999, or the thread-local not available.
fn write_cached(
    now: std::time::SystemTime,
    w: &mut impl std::fmt::Write,
) -> Option<std::fmt::Result> {
    let since = now.duration_since(std::time::UNIX_EPOCH).ok()?;
    let secs = since.as_secs();
    SECOND
        .try_with(|cached| {
            let mut cached = cached.try_borrow_mut().ok()?;
            if cached.0 != secs {
                *cached = (secs, second_prefix(secs)?);
            }
            // Six digits, zero-padded, then `Z`: what `{:06}Z` gives, without a formatter.
            let mut micros = since.subsec_micros();
            let mut digits = *b"000000Z";
            for d in digits[..6].iter_mut().rev() {
                *d = b'0' + (micros % 10) as u8;
                micros /= 10;
            }
            let digits = std::str::from_utf8(&digits).ok()?;
            Some(w.write_str(&cached.1).and_then(|()| w.write_str(digits)))
        })
        .ok()
        .flatten()
}

/// `YYYY-MM-DDTHH:MM:SS.` of a Unix second, for years 1970 to 9999.
fn second_prefix(secs: u64) -> Option<String> {
    let t = time::OffsetDateTime::from_unix_timestamp(i64::try_from(secs).ok()?).ok()?;
    if t.year() > 9999 {
        return None;
    }
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    use tracing_subscriber::fmt::format::Writer;
    use tracing_subscriber::fmt::time::FormatTime as _;

    fn ours(t: SystemTime) -> String {
        let mut s = String::new();
        write_cached(t, &mut s).expect("cached").expect("writes");
        s
    }

    #[test]
    fn timestamps_are_tracing_subscribers_own() {
        // The same second from both timers, read a moment apart: equal up to the
        // microseconds, which differ by the moment. Retried if a second turned between.
        for _ in 0..100 {
            let mut theirs = String::new();
            let before = SystemTime::now();
            tracing_subscriber::fmt::time::SystemTime
                .format_time(&mut Writer::new(&mut theirs))
                .expect("writes");
            let mine = ours(before);
            if theirs[..20] != mine[..20] {
                continue;
            }
            assert_eq!(mine.len(), theirs.len(), "{mine} {theirs}");
            assert!(mine.ends_with('Z') && mine[20..26].bytes().all(|b| b.is_ascii_digit()));
            return;
        }
        panic!("the two timers never agreed on a second");
    }

    #[test]
    fn timestamps_of_known_moments() {
        let at =
            |secs: u64, micros: u64| UNIX_EPOCH + Duration::from_micros(secs * 1_000_000 + micros);
        for (t, want) in [
            (at(0, 0), "1970-01-01T00:00:00.000000Z"),
            (at(951_782_399, 999_999), "2000-02-28T23:59:59.999999Z"),
            (at(951_782_400, 7), "2000-02-29T00:00:00.000007Z"),
            (at(1_796_563_512, 123_456), "2026-12-06T13:25:12.123456Z"),
            (at(253_402_300_799, 500_000), "9999-12-31T23:59:59.500000Z"),
        ] {
            assert_eq!(ours(t), want);
            // Twice: the second time from the cache.
            assert_eq!(ours(t), want);
        }
        // Past 9999 and before 1970 the cache writes nothing and tracing-subscriber's own
        // timer writes the time instead.
        let mut s = String::new();
        assert!(write_cached(at(253_402_300_800, 0), &mut s).is_none());
        assert!(write_cached(UNIX_EPOCH - Duration::from_secs(1), &mut s).is_none());
        assert_eq!(s, "");
    }
}
