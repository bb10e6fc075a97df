//! The `outboxd` binary: parse, set up logging, dispatch, map errors to exit codes.

use std::process::ExitCode;

use clap::error::ErrorKind;
use outboxd::cli::{Cli, Command, Env};
use outboxd::logging::init_logging;

/// mimalloc instead of the system allocator: the delivery path allocates per message (the
/// HTTP client's request and response, the payload, the log event), and glibc's malloc and
/// free were about a seventh of the daemon's CPU in a profile of a drain (BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `eprintln!` through [`outboxd::cli::say`]: a closed stderr is ignored, so the exit code
/// still tells what happened.
macro_rules! say {
    ($($arg:tt)*) => {
        outboxd::cli::say(format_args!($($arg)*))
    };
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
                    // A command with subcommands of its own (`outboxd endpoint`) names
                    // those.
                    use clap::CommandFactory as _;
                    let top = Cli::command();
                    let first = std::env::args_os().nth(1);
                    let (path, cmd) = match first
                        .as_deref()
                        .and_then(|a| a.to_str())
                        .and_then(|a| top.find_subcommand(a))
                        .filter(|c| c.has_subcommands())
                    {
                        Some(c) => (format!("outboxd {}", c.get_name()), c),
                        None => ("outboxd".to_owned(), &top),
                    };
                    let names: Vec<String> = cmd
                        .get_subcommands()
                        .map(|c| c.get_name().to_owned())
                        .collect();
                    say!(
                        "error: a subcommand is required ({}; see {path} --help)",
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
