//! Configuration assembly: raw values in (flags and environment, as text and durations),
//! typed, validated settings out.
//!
//! This is the one place the cross-field rules live: the lease must outlast the longest
//! attempt of the channels delivered, retention (and a purge's age) may not go under the
//! 24 h floor, naming `email` needs an SMTP URL. The module knows nothing of clap: the
//! command line maps its parsed flags into [`RunInput`], so another front end (a test, a
//! config file) can build the same settings through the same rules.

use std::time::Duration;

use crate::config::WorkerConfig;
use crate::config::limits::{DestinationLimits, RateLimits};
use crate::deliver::email::settings::{EmailConfig, SmtpUrl, parse_message_id_domain};
use crate::deliver::http::settings::EndpointSecrets;
use crate::deliver::webhook::settings::{DestinationPolicy, SigningKeys, WebhookConfig};
use crate::model::{Channel, ConfigError};
use crate::retry::RetryPolicy;
use crate::support::Secret;

/// The shortest age at which a finished message may be deleted: a message key's dedup
/// record must outlive the provider's retry window.
pub const RETENTION_FLOOR: Duration = Duration::from_secs(24 * 3600);

/// The raw values `outboxd run` is configured from, flags and environment alike. Each
/// field is named after the flag or variable it comes from; nothing here is validated yet.
/// The SMTP URL (its password) and the signing secrets are [`Secret`]s, so the derived
/// `Debug` shows none of them.
#[derive(Clone, Debug)]
pub struct RunInput {
    /// `--concurrency`: most deliveries in flight at once.
    pub concurrency: usize,
    /// `--batch-size`: most messages claimed by one query.
    pub batch_size: usize,
    /// `--poll-interval`: how often to look for due messages without a notification.
    pub poll_interval: Duration,
    /// `--lease`: how long a claim lasts.
    pub lease: Duration,
    /// `--webhook-timeout`: timeout of one webhook attempt.
    pub webhook_timeout: Duration,
    /// `--smtp-timeout`: timeout of one SMTP attempt.
    pub smtp_timeout: Duration,
    /// `--retry-base`: delay after the first failed attempt.
    pub retry_base: Duration,
    /// `--retry-max`: longest delay between attempts.
    pub retry_max: Duration,
    /// `--retention`: how long delivered messages are kept.
    pub retention: Duration,
    /// `--channels`: a comma-separated list, or `None` for the default.
    pub channels: Option<String>,
    /// `--worker-id`, or `None` for hostname-pid.
    pub worker_id: Option<String>,
    /// `--drain`: exit once nothing of this worker's channels is pending or running.
    pub drain: bool,
    /// `--shutdown-grace`: how long in-flight attempts may finish after a signal.
    pub shutdown_grace: Duration,
    /// `--breaker-threshold`: failures that open a destination's circuit (0: off).
    pub breaker_threshold: u32,
    /// `--breaker-cooldown`: how long a circuit stays open before its probe.
    pub breaker_cooldown: Duration,
    /// `OUTBOXD_SMTP_URL`.
    pub smtp_url: Option<Secret>,
    /// `OUTBOXD_WEBHOOK_SECRET`.
    pub webhook_secret: Option<Secret>,
    /// Every `OUTBOXD_WEBHOOK_SECRET_<NAME>` variable, as (name, value).
    pub named_webhook_secrets: Vec<(String, Secret)>,
    /// `OUTBOXD_ALLOW_PRIVATE_NETWORKS`.
    pub allow_private_networks: Option<String>,
    /// `OUTBOXD_WEBHOOK_ALLOW_HOSTS`.
    pub webhook_allow_hosts: Option<String>,
    /// `OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN`.
    pub email_message_id_domain: Option<String>,
    /// `--host-concurrency`: most webhook requests in flight to one destination (0: no cap).
    pub host_concurrency: usize,
    /// `--webhook-rate-limits` / `OUTBOXD_WEBHOOK_RATE_LIMITS`: `host=N/s|N/m`, comma-separated.
    pub webhook_rate_limits: Option<String>,
    /// Every `OUTBOXD_SECRET_<NAME>` and `OUTBOXD_SECRET_<NAME>_FILE` variable, as
    /// (variable, value): the endpoints' secrets ([`endpoint_secrets`]).
    pub endpoint_secrets: Vec<(String, Secret)>,
}

/// Builds the worker's settings from the raw values, validated. The e-mail settings are
/// there when `email` is among the channels.
///
/// The checks run in a fixed order (the first failure is the one reported), the same order
/// the command line has always reported them in.
pub fn worker_settings(
    input: &RunInput,
) -> Result<(WorkerConfig, WebhookConfig, Option<EmailConfig>), ConfigError> {
    let channels = channels(input)?;
    let email = email_settings(input, &channels)?;
    check_retention(input.retention)?;
    let webhook = webhook_settings(input)?;
    let rate_limits = RateLimits::parse(input.webhook_rate_limits.as_deref().unwrap_or(""))?;
    let mut worker = worker_config(input, channels);
    worker.limits = DestinationLimits {
        host_concurrency: input.host_concurrency,
        rate_limits,
    };
    worker.validate(longest_attempt(input, &worker.channels))?;
    Ok((worker, webhook, email))
}

/// The endpoints' secrets, each read from its variable or its file, checked: an empty
/// value or file, or both variables of one name, stop the start (exit 2) naming the
/// variable, never the value.
pub fn endpoint_secrets(input: &RunInput) -> Result<EndpointSecrets, ConfigError> {
    EndpointSecrets::from_vars(&input.endpoint_secrets)
}

/// The channels to deliver: the list given, deduplicated in order, or by default the
/// webhook and http channels plus e-mail when an SMTP URL is set.
fn channels(input: &RunInput) -> Result<Vec<Channel>, ConfigError> {
    let Some(list) = &input.channels else {
        return Ok(if input.smtp_url.is_some() {
            vec![Channel::Webhook, Channel::Http, Channel::Email]
        } else {
            vec![Channel::Webhook, Channel::Http]
        });
    };
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let ch = Channel::parse(name).ok_or_else(|| {
            ConfigError(format!(
                "--channels: unknown channel {name:?} (webhook, http or email)"
            ))
        })?;
        if !out.contains(&ch) {
            out.push(ch);
        }
    }
    Ok(out)
}

/// The e-mail settings, when `email` is delivered; naming `email` without an SMTP URL is a
/// configuration error.
fn email_settings(
    input: &RunInput,
    channels: &[Channel],
) -> Result<Option<EmailConfig>, ConfigError> {
    // The relay's settings are checked whenever they are given, like the webhook secret,
    // so a bad value shows at the first start rather than when e-mail is switched on.
    let smtp = input
        .smtp_url
        .as_ref()
        .map(|url| SmtpUrl::parse(url.expose()))
        .transpose()?;
    let message_id_domain = input
        .email_message_id_domain
        .as_deref()
        .map(parse_message_id_domain)
        .transpose()?;
    if input.smtp_timeout.is_zero() {
        return Err(ConfigError("--smtp-timeout must be positive".into()));
    }
    match smtp {
        Some(smtp) if channels.contains(&Channel::Email) => Ok(Some(EmailConfig {
            timeout: input.smtp_timeout,
            message_id_domain,
            ..EmailConfig::new(smtp)
        })),
        Some(_) => Ok(None),
        None if channels.contains(&Channel::Email) => Err(ConfigError(
            "--channels email needs OUTBOXD_SMTP_URL (e.g. smtp://user:pass@smtp.example.com)"
                .into(),
        )),
        None => Ok(None),
    }
}

/// The retention floor for `--retention`.
fn check_retention(retention: Duration) -> Result<(), ConfigError> {
    if retention < RETENTION_FLOOR {
        return Err(ConfigError(
            "--retention must be at least 24h: a message key's dedup record must outlive the provider's retry window"
                .into(),
        ));
    }
    Ok(())
}

/// The retention floor for `outboxd purge --older-than`.
pub fn check_purge_age(older_than: Duration) -> Result<(), ConfigError> {
    if older_than < RETENTION_FLOOR {
        return Err(ConfigError(
            "--older-than must be at least 24h: a message key's dedup record must outlive the provider's retry window"
                .into(),
        ));
    }
    Ok(())
}

/// The webhook settings: signing key, destination policy, timeout.
fn webhook_settings(input: &RunInput) -> Result<WebhookConfig, ConfigError> {
    let signing = SigningKeys::from_values(
        input.webhook_secret.as_ref().map(Secret::expose),
        &input.named_webhook_secrets,
    )?;
    let destinations = DestinationPolicy::from_values(
        input.allow_private_networks.as_deref(),
        input.webhook_allow_hosts.as_deref(),
    )?;
    if input.webhook_timeout.is_zero() {
        return Err(ConfigError("--webhook-timeout must be positive".into()));
    }
    Ok(WebhookConfig {
        timeout: input.webhook_timeout,
        signing,
        destinations,
    })
}

/// The worker's own settings (not yet validated: see [`WorkerConfig::validate`]).
fn worker_config(input: &RunInput, channels: Vec<Channel>) -> WorkerConfig {
    WorkerConfig {
        worker_id: input
            .worker_id
            .clone()
            .unwrap_or_else(crate::config::default_worker_id),
        channels,
        concurrency: input.concurrency,
        batch_size: input.batch_size,
        poll_interval: input.poll_interval,
        lease: input.lease,
        retry: RetryPolicy {
            base: input.retry_base,
            max: input.retry_max,
        },
        drain: input.drain,
        shutdown_grace: input.shutdown_grace,
        listen: true,
        limits: DestinationLimits::default(),
        breaker_threshold: input.breaker_threshold,
        breaker_cooldown: input.breaker_cooldown,
    }
}

/// The longest attempt of any channel this worker delivers: the lease must outlast it.
fn longest_attempt(input: &RunInput, channels: &[Channel]) -> Duration {
    channels
        .iter()
        .map(|c| match c {
            Channel::Webhook | Channel::Http => input.webhook_timeout,
            Channel::Email => input.smtp_timeout,
        })
        .max()
        .unwrap_or(input.webhook_timeout)
}
