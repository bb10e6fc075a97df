//! Wake-ups: the LISTEN connection, and the idle mark it holds while the claim loop is
//! idle. This is one half of a protocol whose other half is
//! `outbox.wake_needed` in `sql/0001_baseline.sql` (enqueueing transactions notify only while some
//! worker holds the mark); that file explains why no wake-up is lost.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_postgres::error::SqlState;

use super::Shared;
use super::db_call::Backoff;
use crate::queries;

/// Keeps a LISTEN connection open, turns notifications into wake-ups, and holds the idle
/// mark while the claim loop is idle. A burst of notifications is one wake-up (Notify holds
/// at most one permit). After every (re)connect it wakes the loop once, in case something
/// was committed while it was not listening.
///
/// Enqueueing transactions notify only while some worker holds the idle mark (the protocol
/// and why it loses no wake-up are above `outbox.wake_needed` in `sql/0001_baseline.sql`): a busy
/// worker claims again whenever a slot frees and needs no notification, and notifying
/// transactions cannot share a WAL flush at commit.
pub(super) async fn listen(
    db: crate::db::Database,
    shared: Arc<Shared>,
    mut idle: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new();
    loop {
        match crate::db::open(&db).await {
            Ok((client, mut conn)) => {
                let made = std::time::Instant::now();
                let (tx, mut rx) = mpsc::unbounded_channel::<()>();
                let heard = shared.clone();
                let driver = tokio::spawn(async move {
                    loop {
                        match std::future::poll_fn(|cx| conn.poll_message(cx)).await {
                            Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                                // A resumed channel: read the pauses again before claiming.
                                if n.payload() == queries::CHANNEL_RESUMED_PAYLOAD {
                                    heard.pauses.mark_stale();
                                }
                                if tx.send(()).is_err() {
                                    return None;
                                }
                            }
                            Some(Ok(_)) => {}
                            Some(Err(e)) => return Some(e),
                            None => return None,
                        }
                    }
                });
                match client.batch_execute(queries::LISTEN_SETUP).await {
                    Ok(()) => {
                        backoff.reset();
                        tracing::debug!("listening for outbox_messages");
                        shared.wake.notify_one();
                        tokio::select! {
                            served = serve_wakeups(&client, &shared, &mut rx, &mut idle) => {
                                if let Err(e) = served {
                                    tracing::warn!(error = %e, "LISTEN connection failed");
                                }
                            }
                            () = turned_read_only(&db, made) => tracing::info!(
                                "the LISTEN connection's host has turned read-only; listening on the writable one"
                            ),
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "LISTEN failed"),
                }
                drop(client);
                if let Ok(Some(e)) = driver.await {
                    tracing::warn!(error = %e, "LISTEN connection lost; polling until it is back");
                }
                // The claim loop has stopped (its end of the idle channel is gone): nothing
                // is left to wake, and reconnecting would take the idle mark again, every
                // back-off, until the worker's shutdown ends.
                if idle.has_changed().is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot open the LISTEN connection; polling until it is back")
            }
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

/// How often a LISTEN connection asks whether its host has turned read-only.
const READ_ONLY_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// Ends once one of the worker's statements has been refused as read-only since `made`,
/// when the pools leave such hosts (`target_session_attrs=read-write`; `db::failed`). The
/// LISTEN connection writes nothing itself, so it would stay on a fenced old primary until
/// it broke, holding the idle mark there: enqueues on the new primary would not wake the
/// worker, which would fall back to polling.
async fn turned_read_only(db: &crate::db::Database, made: std::time::Instant) {
    if !db.leaves_read_only_hosts() {
        return std::future::pending().await;
    }
    loop {
        tokio::time::sleep(READ_ONLY_CHECK).await;
        if crate::db::made_before_read_only(made) {
            return;
        }
    }
}

/// Where a LISTEN connection stands with the idle mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mark {
    /// Not held: enqueuers do not notify on this worker's account.
    None,
    /// Held, but transactions that decided not to notify before it was taken may still be
    /// open: the loop cannot yet rely on wake-ups.
    Held,
    /// Held and the gate passed: every later enqueue notifies, every earlier one is
    /// visible to the claim this transition triggers.
    Armed,
}

/// Serves one LISTEN connection until it fails or the worker goes away.
pub(super) async fn serve_wakeups(
    client: &tokio_postgres::Client,
    shared: &Shared,
    notifications: &mut mpsc::UnboundedReceiver<()>,
    idle: &mut watch::Receiver<bool>,
) -> Result<(), tokio_postgres::Error> {
    let mut mark = Mark::None;
    let mut retry = Backoff::quick();
    loop {
        let want = *idle.borrow_and_update();
        let moved = match (want, mark) {
            (true, Mark::None) => take_idle_mark(client).await?.then_some(Mark::Held),
            (true, Mark::Held) => match client.batch_execute(queries::IDLE_GATE).await {
                Ok(()) => {
                    retry.reset();
                    // The claim that sees whatever was enqueued without a notification.
                    shared.wake.notify_one();
                    Some(Mark::Armed)
                }
                // lock_timeout: an enqueueing transaction is still open; try again.
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => None,
                Err(e) => return Err(e),
            },
            (false, Mark::Held | Mark::Armed) => {
                client.batch_execute(queries::IDLE_UNMARK).await?;
                Some(Mark::None)
            }
            _ => None,
        };
        if let Some(next) = moved {
            mark = next;
            continue;
        }
        // Not where the loop wants to be yet: try again shortly. Until the mark is armed
        // the loop still polls, so a slow gate delays wake-ups, never loses them.
        let retry_in = (want && mark != Mark::Armed).then(|| retry.next());
        tokio::select! {
            n = notifications.recv() => match n {
                Some(()) => shared.wake.notify_one(),
                None => return Ok(()),
            },
            changed = idle.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            _ = tokio::time::sleep(retry_in.unwrap_or_default()), if retry_in.is_some() => {}
        }
    }
}

/// [`queries::IDLE_MARK`]: true when the mark is now held by this session.
pub(super) async fn take_idle_mark(
    client: &tokio_postgres::Client,
) -> Result<bool, tokio_postgres::Error> {
    let messages = client.simple_query(queries::IDLE_MARK).await?;
    Ok(messages.iter().any(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0) == Some("t"),
        _ => false,
    }))
}
