//! `outboxd console`: the operator console in the browser (see [`crate::console`]).

use super::{CliError, ConsoleArgs, Env, runtime};
use crate::console::{ConsoleConfig, ServeError};

pub(super) async fn console(args: ConsoleArgs, env: &Env) -> Result<(), CliError> {
    let mut config = ConsoleConfig::new(args.addr, env.console_token.clone())?;
    // Which endpoint secrets this console has, by name, for `/endpoints`: read as a worker
    // reads them, then every value dropped. A variable the worker would refuse does not
    // stop the console (it sends nothing); the page then says it could not tell.
    config.secret_names =
        match crate::deliver::http::settings::EndpointSecrets::from_vars(&env.endpoint_secrets) {
            Ok(secrets) => Some(secrets.names().map(str::to_owned).collect()),
            Err(e) => {
                tracing::warn!(error = %e, "console: the endpoint secrets cannot be read");
                None
            }
        };
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
