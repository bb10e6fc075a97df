//! `outboxd run`: the delivery daemon.

use std::time::Duration;

use super::{CliError, Env, RunArgs, runtime};
use crate::config::WorkerConfig;
use crate::config::assemble::{self, RunInput};
use crate::deliver::email::settings::EmailConfig;
use crate::deliver::webhook::settings::{DestinationPolicy, WebhookConfig};
use crate::deliver::{Deliverers, email::EmailSender, http::HttpSender, webhook::WebhookSender};
use crate::model::ConfigError;
use crate::worker::Worker;

/// Builds the worker's settings from flags and environment, validated. The e-mail
/// settings are there when `email` is among the channels.
///
/// The rules themselves are in [`crate::config::assemble`]; this maps the flags and the
/// environment into its input.
pub fn worker_settings(
    args: &RunArgs,
    env: &Env,
) -> Result<(WorkerConfig, WebhookConfig, Option<EmailConfig>), ConfigError> {
    assemble::worker_settings(&run_input(args, env))
}

/// The raw values of `outboxd run`, flags and environment, as config's assembly takes them.
fn run_input(args: &RunArgs, env: &Env) -> RunInput {
    RunInput {
        concurrency: args.concurrency,
        batch_size: args.batch_size,
        poll_interval: args.poll_interval,
        lease: args.lease,
        webhook_timeout: args.webhook_timeout,
        smtp_timeout: args.smtp_timeout,
        retry_base: args.retry_base,
        retry_max: args.retry_max,
        retention: args.retention,
        channels: args.channels.clone(),
        worker_id: args.worker_id.clone(),
        drain: args.drain,
        breaker_threshold: args.breaker_threshold,
        breaker_cooldown: args.breaker_cooldown,
        shutdown_grace: args.shutdown_grace,
        smtp_url: env.smtp_url.clone(),
        webhook_secret: env.webhook_secret.clone(),
        named_webhook_secrets: env.named_webhook_secrets.clone(),
        allow_private_networks: env.allow_private_networks.clone(),
        webhook_allow_hosts: env.webhook_allow_hosts.clone(),
        email_message_id_domain: env.email_message_id_domain.clone(),
        host_concurrency: args.host_concurrency,
        webhook_rate_limits: args.webhook_rate_limits.clone(),
        endpoint_secrets: env.endpoint_secrets.clone(),
    }
}

pub(super) async fn run(args: RunArgs, env: &Env) -> Result<(), CliError> {
    let stop = shutdown_signal()?;
    let (worker_cfg, webhook_cfg, email_cfg) = worker_settings(&args, env)?;
    let secrets = assemble::endpoint_secrets(&run_input(&args, env))?;
    super::check_schema_at_start(env, true).await?;
    let pg = env.database()?;
    // Claims and completions have a pool of their own (`worker::Pools`); the general one
    // serves the rest of the worker, the metrics endpoint and retention.
    let pools = crate::worker::Pools::new(&pg, 4)?;
    let pool = pools.general.clone();
    if let Some(addr) = args.metrics_addr {
        let handle = crate::metrics::install()?;
        crate::metrics::serve(addr, pool.clone(), handle).await?;
    }
    let webhook = WebhookSender::new(&webhook_cfg)?;
    let deliverers = Deliverers {
        http: HttpSender::new(&webhook, secrets),
        webhook,
        email: email_cfg.as_ref().map(EmailSender::new).transpose()?,
    };
    if worker_cfg
        .channels
        .contains(&crate::model::Channel::Webhook)
    {
        log_destination_policy(&webhook_cfg.destinations);
    }
    if let Some(cfg) = &email_cfg {
        tracing::info!(relay = %cfg.smtp, "e-mail delivery through an SMTP relay");
    }
    let retention_stop = tokio_util::sync::CancellationToken::new();
    let retention = tokio::spawn(crate::worker::maintenance::retention(
        pool.clone(),
        args.retention,
        Duration::from_secs(600),
        retention_stop.clone(),
    ));
    let worker = Worker::new(pools, worker_cfg, deliverers, Some(pg));
    let result = worker.run(stop.cancelled_owned()).await;
    retention_stop.cancel();
    let _ = retention.await;
    result.map_err(|e| CliError::Runtime(e.into()))?;
    Ok(())
}

/// Says once, at start-up, which webhook destinations this worker may reach, and how the
/// policy is changed: a refused local receiver is then explained before its first message
/// dies. The allowed hosts are named (host names are not secret), the first few only, so
/// that the line stays short.
fn log_destination_policy(policy: &DestinationPolicy) {
    const NAMED: usize = 5;
    if policy.allow_private_networks {
        tracing::info!(
            private_networks = "allowed",
            "webhook destinations: every address may be reached (OUTBOXD_ALLOW_PRIVATE_NETWORKS=true)"
        );
        return;
    }
    let mut hosts: Vec<&str> = policy.allow_hosts.iter().map(String::as_str).collect();
    hosts.sort_unstable();
    let mut named = if hosts.is_empty() {
        "-".to_owned()
    } else {
        hosts[..hosts.len().min(NAMED)].join(",")
    };
    if hosts.len() > NAMED {
        named.push_str(&format!(",+{} more", hosts.len() - NAMED));
    }
    tracing::info!(
        private_networks = "refused",
        allowed_hosts = hosts.len(),
        hosts = %named,
        "webhook destinations: private and reserved addresses are refused but for the allowed \
         hosts (OUTBOXD_ALLOW_PRIVATE_NETWORKS=true allows all, OUTBOXD_WEBHOOK_ALLOW_HOSTS names hosts)"
    );
}

/// Resolves at the first SIGTERM or SIGINT.
/// Installs the SIGTERM and SIGINT handlers now (before the first database call, so a
/// signal during start-up is a graceful stop, not the default kill) and returns a token
/// cancelled at the first of them.
pub(super) fn shutdown_signal() -> Result<tokio_util::sync::CancellationToken, CliError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| runtime("cannot install a SIGTERM handler", e))?;
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| runtime("cannot install a SIGINT handler", e))?;
    let token = tokio_util::sync::CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        t.cancel();
    });
    Ok(token)
}
