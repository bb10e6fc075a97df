//! The logs: the subscriber `main` sets up ([`init_logging`]), the text format's fields and
//! timestamps ([`format`]), and where the lines go ([`sink`]).

pub mod format;
pub mod sink;

use crate::telemetry::{self, Traces};

use format::{EscapedFields, SecondCachedTime};

/// Logs to stderr: text by default, JSON with `OUTBOXD_LOG_FORMAT=json`; `RUST_LOG` filters
/// (default `info` for the daemon, `warn` for one-shot commands). With `traced`, and an OTLP
/// endpoint in the environment, the attempt spans are exported too ([`crate::telemetry`]);
/// the logs never show those spans, so a log line reads the same with traces on or off.
///
/// Lines go through [`sink`]: a stderr that is closed or full drops lines
/// (counted) instead of panicking or blocking the task that logs. The returned guard flushes
/// the queued lines when `main` ends.
pub fn init_logging(
    daemon: bool,
    traced: bool,
) -> anyhow::Result<(Option<Traces>, sink::FlushOnDrop)> {
    use tracing_subscriber::filter::FilterExt as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _};
    let default = if daemon { "info" } else { "warn" };
    // Read with `env_var`: a value that is not UTF-8 is an error, not the default.
    let filter = match crate::support::env_var("RUST_LOG")? {
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
    let log_format = crate::support::env_var("OUTBOXD_LOG_FORMAT")?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (sink, flush) =
        sink::LogSink::start().map_err(|e| anyhow::anyhow!("cannot start logging: {e}"))?;
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
