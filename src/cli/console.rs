//! `outboxd console`: the operator console in the browser (see [`crate::console`]).

use super::{CliError, ConsoleArgs, Env, runtime};
use crate::console::{ConsoleConfig, ServeError};

pub(super) async fn console(args: ConsoleArgs, env: &Env) -> Result<(), CliError> {
    let config = ConsoleConfig::new(args.addr, env.console_token.clone())?;
    super::check_schema_at_start(env, false).await?;
    let db = env.database()?;
    let pool = crate::db::pool_with_setup(&db, 4, crate::queries::CONSOLE_SETUP)?;
    let stop = super::run::shutdown_signal()?;
    crate::console::serve(config, pool, stop, |addr| {
        out!("outboxd console: http://{addr}/");
    })
    .await
    .map_err(|e| match e {
        ServeError::Config(c) => CliError::Usage(c),
        ServeError::Database(m) => runtime("console", m),
    })
}
