//! The `outboxd` binary: parse, set up logging, dispatch, map errors to exit codes.

use std::process::ExitCode;

use clap::error::ErrorKind;
use outboxd::cli::{Cli, Command, Env};
use outboxd::telemetry::{self, Traces};

/// mimalloc instead of the system allocator: the delivery path allocates per message (the
/// HTTP client's request and response, the payload, the log event), and glibc's malloc and
/// free were about a seventh of the daemon's CPU in a profile of a drain.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `eprintln!` that ignores a closed stderr: the exit code still tells what happened, where
/// `eprintln!` would panic and exit 101 instead.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// The command line, parsed.
fn parse() -> Result<Cli, clap::Error> {
    use clap::Parser as _;
    Cli::try_parse()
}

fn main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(e) => {
            return match e.kind() {
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    // Named from the parser itself, so that the list cannot fall behind.
                    use clap::CommandFactory as _;
                    let names: Vec<String> = Cli::command()
                        .get_subcommands()
                        .map(|c| c.get_name().to_owned())
                        .collect();
                    say!(
                        "error: a subcommand is required ({}; see outboxd --help)",
                        names.join(", ")
                    );
                    ExitCode::from(2)
                }
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    ExitCode::SUCCESS
                }
                // clap says "invalid UTF-8 was detected in one or more arguments" also when
                // the bytes came from a flag's `OUTBOXD_*` variable: name the variable.
                ErrorKind::InvalidUtf8 if std::env::args_os().all(|a| a.to_str().is_some()) => {
                    match non_utf8_flag_variable() {
                        Some(e) => say!("error: {e} (see outboxd --help)"),
                        None => say!(
                            "{} (see outboxd --help)",
                            outboxd::text::escape(&usage_line(&e))
                        ),
                    }
                    ExitCode::from(2)
                }
                _ => {
                    // One line: clap's first line names the problem; the usage block
                    // that follows it is what --help is for. A typo keeps clap's
                    // suggestion, on the same line.
                    // clap echoes the offending argument, which may be a key holding
                    // control characters.
                    let hint = match suggestion(&e) {
                        Some(s) => format!("did you mean {s}?; "),
                        None => String::new(),
                    };
                    say!(
                        "{} ({hint}see outboxd --help)",
                        outboxd::text::escape(&usage_line(&e))
                    );
                    ExitCode::from(2)
                }
            };
        }
    };
    let env = match Env::from_process() {
        Ok(env) => env,
        Err(e) => {
            say!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let daemon = matches!(cli.command, Command::Run(_) | Command::Console(_));
    // Only the worker makes spans: other commands never start an exporter.
    let traced = matches!(cli.command, Command::Run(_));
    let (traces, _flush_logs) = match init_logging(daemon, traced) {
        Ok(logging) => logging,
        Err(e) => {
            say!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(outboxd::cli::dispatch(cli, env));
    // After a graceful stop or a drain (and after a failure): the last spans are exported
    // before the process exits. Outside the runtime: the exporter's client is blocking.
    if let Some(traces) = traces {
        traces.shutdown();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("error: {}", e.line());
            ExitCode::from(e.exit_code())
        }
    }
}

/// The `OUTBOXD_*` variable of the invoked subcommand's flags that holds bytes that are not
/// UTF-8, as an error naming it (never its value), when there is one.
fn non_utf8_flag_variable() -> Option<outboxd::support::NotUtf8> {
    use clap::CommandFactory as _;
    let name = std::env::args_os().nth(1)?;
    let cli = Cli::command();
    let sub = cli.find_subcommand(name.to_str()?)?;
    sub.get_arguments()
        .filter_map(|a| a.get_env())
        .find(|var| std::env::var_os(var).is_some_and(|v| v.to_str().is_none()))
        .map(outboxd::support::NotUtf8::of)
}

/// clap's "did you mean" for a mistyped subcommand, flag or value, quoted
/// (`'status'`, or `'approve' or 'purge'` when several are close): clap prints it on a
/// `tip:` line of its own, which [`usage_line`] leaves out. Taken from the error's context,
/// not its text, so that clap's wording can change without losing it.
fn suggestion(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    [
        ContextKind::SuggestedSubcommand,
        ContextKind::SuggestedArg,
        ContextKind::SuggestedValue,
    ]
    .into_iter()
    .find_map(|kind| {
        // clap lists several from the least to the most similar: the best first here.
        let names: Vec<&str> = match e.get(kind)? {
            ContextValue::String(s) => vec![s.as_str()],
            ContextValue::Strings(v) => v.iter().rev().map(String::as_str).collect(),
            _ => Vec::new(),
        };
        (!names.is_empty()).then(|| {
            names
                .iter()
                .map(|n| format!("'{n}'"))
                .collect::<Vec<_>>()
                .join(" or ")
        })
    })
}

/// clap's message as one line: the lines before its usage block, joined (a missing
/// argument is named on the line after "not provided:"), without clap's `tip:` lines
/// ([`suggestion`] gives the one that matters).
fn usage_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let problem: Vec<&str> = text
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
        .collect();
    if problem.is_empty() {
        "error: bad usage".to_owned()
    } else {
        problem.join(" ")
    }
}

/// Logs to stderr: text by default, JSON with `OUTBOXD_LOG_FORMAT=json`; `RUST_LOG` filters
/// (default `info` for the daemon, `warn` for one-shot commands). With `traced`, and an OTLP
/// endpoint in the environment, the attempt spans are exported too ([`outboxd::telemetry`]);
/// the logs never show those spans, so a log line reads the same with traces on or off.
///
/// Lines go through [`outboxd::log_sink`]: a stderr that is closed or full drops lines
/// (counted) instead of panicking or blocking the task that logs. The returned guard flushes
/// the queued lines when `main` ends.
fn init_logging(
    daemon: bool,
    traced: bool,
) -> anyhow::Result<(Option<Traces>, outboxd::log_sink::FlushOnDrop)> {
    use tracing_subscriber::filter::FilterExt as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _};
    let default = if daemon { "info" } else { "warn" };
    // Read with `env_var`: a value that is not UTF-8 is an error, not the default.
    let filter = match outboxd::support::env_var("RUST_LOG")? {
        Some(v) if !v.is_empty() => EnvFilter::try_new(&v)
            .map_err(|e| anyhow::anyhow!("RUST_LOG is not a valid filter: {e}"))?,
        _ => EnvFilter::new(default),
    };
    // tokio-postgres logs each prepared statement's parameters at debug (through the `log`
    // bridge tracing-subscriber installs). The completion's parameters carry the stored
    // response bodies, which are never logged, and the errors' text: so its query events
    // stop at info whatever RUST_LOG asks. A directive for the same target would replace
    // the caller's only in part: one with a field filter (`tokio_postgres::query[{message}]
    // =debug`) is matched apart from it and let them through. So [`quiet_queries`] is a
    // filter of its own, beside RUST_LOG's. Its other events (connections, prepared
    // statement texts) still follow RUST_LOG.
    let log_format = outboxd::support::env_var("OUTBOXD_LOG_FORMAT")?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (sink, flush) = outboxd::log_sink::LogSink::start()
        .map_err(|e| anyhow::anyhow!("cannot start logging: {e}"))?;
    // `log_internal_errors(false)`: tracing-subscriber would report a failed write with
    // `eprintln!`, which panics when stderr is the thing that failed. The sink never fails
    // a write; this keeps it so should that change.
    let logs = tracing_subscriber::fmt::layer()
        .with_timer(SecondCachedTime)
        .with_ansi(ansi)
        .log_internal_errors(false)
        .with_writer(sink.clone());
    let logs = match log_format.as_deref() {
        // JSON escapes control characters itself.
        Some("json") => logs.json().boxed(),
        Some("text") | None | Some("") => logs.fmt_fields(EscapedFields).boxed(),
        Some(other) => anyhow::bail!("OUTBOXD_LOG_FORMAT must be text or json (got {other:?})"),
    };
    let traces = if traced { Traces::from_env()? } else { None };
    if traces.is_none() {
        // No traces: one global filter, as before traces existed, with the attempt span
        // switched off by target whatever RUST_LOG says. A per-layer filter (below) costs
        // every event and span a check of its own: a large share of the daemon's CPU per
        // delivery in an A/B (`bench/run ab`), which a run without traces should not pay.
        let off = format!("{}=off", telemetry::SPAN_TARGET)
            .parse()
            .map_err(|e| anyhow::anyhow!("the span filter: {e}"))?;
        let global = tracing_subscriber::fmt()
            .with_timer(SecondCachedTime)
            .with_env_filter(filter.add_directive(off))
            .with_ansi(ansi)
            .log_internal_errors(false)
            .with_writer(sink);
        match log_format.as_deref() {
            Some("json") => global.json().finish().with(quiet_queries()).try_init(),
            _ => global
                .fmt_fields(EscapedFields)
                .finish()
                .with(quiet_queries())
                .try_init(),
        }
        .map_err(|e| anyhow::anyhow!("cannot start logging: {e}"))?;
        return Ok((None, flush));
    }
    // Here a filter of the log layer: the exported layer takes only the attempt spans.
    let quiet = quiet_queries().with_max_level_hint(tracing_subscriber::filter::LevelFilter::TRACE);
    let logs = logs.with_filter(filter.and(telemetry::without_trace_spans()).and(quiet));
    let exported = traces.as_ref().map(|t| t.layer());
    tracing_subscriber::registry()
        .with(logs)
        .with(exported)
        .try_init()?;
    Ok((traces, flush))
}

/// The filter that stops tokio-postgres' query events above `info` (they carry the
/// statements' parameters), whatever RUST_LOG asks. A `FilterFn` decides once per callsite;
/// the `log` bridge's records, which share a few callsites, ask per record (a comparison
/// of their target). Without a level hint: as a layer of its own it must not lift the
/// logs' maximum level above RUST_LOG's.
fn quiet_queries() -> tracing_subscriber::filter::FilterFn<fn(&tracing::Metadata<'_>) -> bool> {
    let keep: fn(&tracing::Metadata<'_>) -> bool = |meta| {
        *meta.level() <= tracing::Level::INFO
            || !meta
                .target()
                .strip_prefix("tokio_postgres::query")
                .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    };
    tracing_subscriber::filter::filter_fn(keep)
}

/// The text log's fields, as tracing-subscriber's default writes them (`message` bare, then
/// `name=value`, string values quoted), but every value passed through
/// [`outboxd::text::escape`]: a field that displays stored text (`key = %…`, an error that
/// quotes a server's reply) can neither start a new line, which would forge a log line,
/// nor send a terminal escape (the default sanitises some escapes, not newlines).
struct EscapedFields;

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

/// Writes what it is given through [`outboxd::text::Escaped`]. Escaping works character by
/// character, and each piece a formatter writes is whole characters, so escaping the pieces
/// one by one gives what escaping the whole value would.
struct EscapingWriter<'a, 'w>(&'a mut tracing_subscriber::fmt::format::Writer<'w>);

impl std::fmt::Write for EscapingWriter<'_, '_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        // What `Escaped` itself does with such a piece, without a formatter per piece.
        if !outboxd::text::has_unsafe(s) {
            return self.0.write_str(s);
        }
        write!(self.0, "{}", outboxd::text::Escaped(s))
    }
}

/// The log's timestamps exactly as tracing-subscriber's `SystemTime` writes them
/// (`2026-12-06T13:45:12.123456Z`, UTC, microseconds), with the part up to the second
/// formatted once a second per thread: the calendar arithmetic and the six padded numbers
/// were 3 % of the daemon's instructions in a drain, one per attempt's log line. A time
/// before 1970 or after 9999, which the cache does not cover, is written by
/// tracing-subscriber's own.
struct SecondCachedTime;

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
