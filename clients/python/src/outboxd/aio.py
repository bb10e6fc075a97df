"""The asyncio API, on `psycopg.AsyncConnection`: the same names as `outboxd`.

from outboxd import aio
async with conn.transaction():
    await aio.enqueue(conn, key, "webhook", {"url": "https://…"})
status = await aio.wait(conn, key, timeout=30)
outcome = await aio.call_once(conn, key, "webhook", {"url": "https://…"}, timeout=20)
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from . import _core
from ._core import (
    EmailPayload,
    Enqueued,
    ErrorClass,
    HttpPayload,
    InvalidMessage,
    KeyConflict,
    MessageStatus,
    OutboxError,
    State,
    WebhookPayload,
    key,
)
from .tool import Outcome, OutcomeKind, outcome_of

__all__ = [
    "EmailPayload",
    "Enqueued",
    "ErrorClass",
    "HttpPayload",
    "InvalidMessage",
    "KeyConflict",
    "MessageStatus",
    "OutboxError",
    "Outcome",
    "OutcomeKind",
    "State",
    "WebhookPayload",
    "call_once",
    "enqueue",
    "key",
    "lookup",
    "wait",
]


async def enqueue(
    conn: psycopg.AsyncConnection[Any],
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
    """`outboxd.enqueue` for an async connection: in the caller's transaction, never
    committing."""
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
        cur = await conn.execute(_core.ENQUEUE, params)
        row = await cur.fetchone()
    except psycopg.Error as err:
        mapped = _core.translate(err, key)
        if mapped is None:
            raise
        raise mapped from err
    assert row is not None
    return Enqueued(row[0], row[1])


async def lookup(conn: psycopg.AsyncConnection[Any], key: str) -> MessageStatus | None:
    """`outboxd.lookup` for an async connection."""
    try:
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(_core.LOOKUP, (key,))
            row = await cur.fetchone()
    except psycopg.Error as err:
        mapped = _core.translate(err, key)
        if mapped is None:
            raise
        raise mapped from err
    return None if row is None else _core.status_of(row)


async def wait(conn: psycopg.AsyncConnection[Any], key: str, timeout: float) -> MessageStatus:
    """`outboxd.wait` for an async connection: one wait at a time per connection (give
    each concurrent wait a connection of its own)."""
    deadline = time.monotonic() + timeout
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise _core.not_idle(status.name)
    autocommit = conn.autocommit
    await conn.set_autocommit(True)
    try:
        found = await _wait(conn, key, timeout, deadline)
    except BaseException:
        await _leave(conn, autocommit, quiet=True)
        raise
    await _leave(conn, autocommit, quiet=False)
    return found


async def _wait(
    conn: psycopg.AsyncConnection[Any], key: str, timeout: float, deadline: float
) -> MessageStatus:
    await conn.execute(_core.LISTEN)
    await conn.execute(_core.TAKE_MARK)
    found = await lookup(conn, key)
    if found is not None and found.settled:
        return found
    # As in outboxd.wait: once the gate is ours, every change made without a notification
    # is visible.
    try:
        async with conn.transaction():
            await conn.execute(_core.GATE_TIMEOUT, (_core.lock_timeout(deadline),))
            await conn.execute(_core.PASS_GATE)
    except psycopg.errors.LockNotAvailable as err:
        raise _core.timed_out(key, timeout, found) from err
    pause = _core.POLL_FIRST
    while True:
        found = await lookup(conn, key)
        if found is not None and found.settled:
            return found
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _core.timed_out(key, timeout, found)
        # A notification ends the pause early; the pause's end is the fallback look.
        async for _ in conn.notifies(timeout=min(pause, remaining), stop_after=1):
            pass
        pause = _core.next_poll(pause)


async def _leave(conn: psycopg.AsyncConnection[Any], autocommit: bool, *, quiet: bool) -> None:
    if conn.closed:
        return
    try:
        await conn.execute(_core.DROP_MARK)
        await conn.execute(_core.UNLISTEN)
        await conn.set_autocommit(autocommit)
    except psycopg.Error:
        if not quiet:
            raise


async def call_once(
    conn: psycopg.AsyncConnection[Any],
    key: str,
    channel: str,
    payload: Mapping[str, Any],
    *,
    timeout: float,
    held: bool = False,
    write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[object]] | None = None,
    max_attempts: int = 3,
    retry_ambiguous: bool = True,
    run_after: datetime.datetime | None = None,
    ordering_key: str | None = None,
) -> Outcome:
    """`outboxd.tool.call_once` for an async connection (`write` is awaited)."""
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise _core.not_idle(status.name)
    async with conn.transaction():
        found = await lookup(conn, key)
    if found is None or not found.settled:
        async with conn.transaction():
            sent = await enqueue(
                conn,
                key,
                channel,
                payload,
                run_after=run_after,
                max_attempts=max_attempts,
                retry_ambiguous=retry_ambiguous,
                held=held,
                ordering_key=ordering_key,
            )
            if sent.created and write is not None:
                await write(conn)
        try:
            found = await wait(conn, key, timeout)
        except TimeoutError:
            async with conn.transaction():
                found = await lookup(conn, key)
    assert found is not None  # committed above
    return outcome_of(found)
