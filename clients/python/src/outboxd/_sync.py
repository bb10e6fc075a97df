"""The synchronous API, on `psycopg.Connection`."""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from . import _core
from ._core import Enqueued, MessageStatus


def enqueue(
    conn: psycopg.Connection[Any],
    key: str,
    channel: str,
    payload: Mapping[str, Any],
    *,
    run_after: datetime.datetime | None = None,
    max_attempts: int = 3,
    retry_ambiguous: bool = True,
    held: bool = False,
    ordering_key: str | None = None,
) -> Enqueued:
    """Enqueues one message in the connection's current transaction (`outbox.enqueue`'s
    rules). It never commits: nothing is sent unless the caller's transaction commits.

    The same key with the same channel and payload returns the existing message's id with
    ``created=False``, whatever its state. Raises `KeyConflict` for the same key with
    another channel or payload, `InvalidMessage` (naming the field) for bad input.
    """
    params = (
        key,
        channel,
        Jsonb(payload),
        run_after,
        max_attempts,
        retry_ambiguous,
        held,
        ordering_key,
    )
    try:
        row = conn.execute(_core.ENQUEUE, params).fetchone()
    except psycopg.Error as err:
        mapped = _core.translate(err, key)
        if mapped is None:
            raise
        raise mapped from err
    assert row is not None
    return Enqueued(row[0], row[1])


def lookup(conn: psycopg.Connection[Any], key: str) -> MessageStatus | None:
    """What is known of the message with this key (`outbox.lookup`), or None for a key
    never enqueued. Raises `InvalidMessage` for a key no enqueue could have stored."""
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(_core.LOOKUP, (key,)).fetchone()
    except psycopg.Error as err:
        mapped = _core.translate(err, key)
        if mapped is None:
            raise
        raise mapped from err
    return None if row is None else _core.status_of(row)


def wait(conn: psycopg.Connection[Any], key: str, timeout: float) -> MessageStatus:
    """Waits until the message with this key is delivered, dead, cancelled or held, and
    returns its status; raises `TimeoutError` if it is not within `timeout` seconds.

    The connection LISTENs on ``outbox_settled`` and looks the key up again on each
    notification; between notifications it also looks again after a pause that starts at
    50 ms and doubles up to 2 s, so that a lost notification (a pooler that drops LISTEN)
    or a key first enqueued already held still ends the wait. The connection must have no
    transaction open; it is used in autocommit mode meanwhile and given back as it was. A
    key not yet enqueued (or not yet committed) is waited for like a pending one.
    """
    deadline = time.monotonic() + timeout
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise _core.not_idle(status.name)
    autocommit = conn.autocommit
    conn.autocommit = True
    try:
        found = _wait(conn, key, timeout, deadline)
    except BaseException:
        _leave(conn, autocommit, quiet=True)
        raise
    _leave(conn, autocommit, quiet=False)
    return found


def _wait(
    conn: psycopg.Connection[Any], key: str, timeout: float, deadline: float
) -> MessageStatus:
    conn.execute(_core.LISTEN)
    conn.execute(_core.TAKE_MARK)
    found = lookup(conn, key)
    if found is not None and found.settled:
        return found
    # Every transaction that changed a state without notifying (it saw no waiter) has
    # ended once the gate is ours: what it did is visible to the lookups from here on.
    try:
        with conn.transaction():
            conn.execute(_core.GATE_TIMEOUT, (_core.lock_timeout(deadline),))
            conn.execute(_core.PASS_GATE)
    except psycopg.errors.LockNotAvailable as err:
        raise _core.timed_out(key, timeout, found) from err
    pause = _core.POLL_FIRST
    while True:
        found = lookup(conn, key)
        if found is not None and found.settled:
            return found
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _core.timed_out(key, timeout, found)
        # A notification ends the pause early; the pause's end is the fallback look.
        for _ in conn.notifies(timeout=min(pause, remaining), stop_after=1):
            pass
        pause = _core.next_poll(pause)


def _leave(conn: psycopg.Connection[Any], autocommit: bool, *, quiet: bool) -> None:
    """Drops the waiter mark and stops listening; `quiet` while another error is on its way
    (the connection may be what failed)."""
    if conn.closed:
        return
    try:
        conn.execute(_core.DROP_MARK)
        conn.execute(_core.UNLISTEN)
        conn.autocommit = autocommit
    except psycopg.Error:
        if not quiet:
            raise
