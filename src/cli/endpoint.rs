//! `outboxd endpoint set | list | remove`: the provider endpoints that http messages name.
//! The rules are the SQL functions'; a value they refuse is bad usage (exit 2, the line
//! naming the field), a removal refused while messages name the endpoint, or of an unknown
//! one, is a refusal (exit 1).

use super::{
    CliError, EndpointArgs, EndpointCommand, EndpointListArgs, EndpointRemoveArgs, EndpointSetArgs,
    Env, connect, db_failed, esc, json_out, print_table,
};
use crate::model::ConfigError;
use crate::ops::{EndpointError, EndpointSpec};

pub(super) async fn endpoint(args: EndpointArgs, env: &Env) -> Result<(), CliError> {
    match args.command {
        EndpointCommand::Set(a) => set(a, env).await,
        EndpointCommand::List(a) => list(a, env).await,
        EndpointCommand::Remove(a) => remove(a, env).await,
    }
}

/// An endpoint command's refusal, as the CLI reports it.
fn refused(context: &str, e: EndpointError) -> CliError {
    match e {
        EndpointError::Invalid(m) => CliError::Usage(ConfigError(esc(&m))),
        EndpointError::Unknown(m) | EndpointError::InUse(m) => CliError::Refused(m),
        EndpointError::Database(e) => db_failed(context, &e),
    }
}

async fn set(args: EndpointSetArgs, env: &Env) -> Result<(), CliError> {
    let spec = EndpointSpec {
        name: args.name,
        url: args.url,
        auth_header: args.auth_header,
        auth_secret: args.auth_secret,
        idempotency_header: (!args.no_idempotency_header).then_some(args.idempotency_header),
        key_ttl: args.key_ttl,
        headers: args.headers,
    };
    let client = connect(env).await?;
    let done = crate::ops::set_endpoint(&client, &spec)
        .await
        .map_err(|e| refused("setting the endpoint failed", e))?;
    out!(
        "endpoint {} set: {}",
        esc(&spec.name),
        esc(&done.destination)
    );
    if done.moved > 0 {
        out!(
            "{} unfinished message(s) now go to {}",
            done.moved,
            esc(&done.destination)
        );
    }
    Ok(())
}

async fn list(args: EndpointListArgs, env: &Env) -> Result<(), CliError> {
    let client = connect(env).await?;
    let rows = crate::ops::endpoints(&client)
        .await
        .map_err(|e| refused("listing endpoints failed", e))?;
    if args.json {
        return json_out(&rows);
    }
    if rows.is_empty() {
        out!("no endpoints (outboxd endpoint set NAME --url URL makes one)");
        return Ok(());
    }
    let dash = |o: &Option<String>| o.as_deref().map_or_else(|| "-".into(), esc);
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|e| {
            vec![
                esc(&e.name),
                esc(&e.url),
                esc(&e.auth_header),
                dash(&e.auth_secret),
                dash(&e.idempotency_header),
                dash(&e.key_ttl),
                esc(&e.headers.to_string()),
            ]
        })
        .collect();
    print_table(
        &[
            "name",
            "url",
            "auth_header",
            "auth_secret",
            "idempotency_header",
            "key_ttl",
            "headers",
        ],
        &table,
    );
    Ok(())
}

async fn remove(args: EndpointRemoveArgs, env: &Env) -> Result<(), CliError> {
    let client = connect(env).await?;
    crate::ops::remove_endpoint(&client, &args.name)
        .await
        .map_err(|e| refused("removing the endpoint failed", e))?;
    out!("endpoint {} removed", esc(&args.name));
    Ok(())
}
