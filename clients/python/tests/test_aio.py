"""outboxd.aio against a real PostgreSQL and the real daemon, with asyncio.run per test (no
plugin needed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from conftest import Outbox, settle_gate

from outboxd import _core, aio

Key = Callable[[str], str]


def later() -> datetime:
    return datetime.now(timezone.utc) + timedelta(hours=1)


def test_enqueue_dedup_conflict_and_invalid(outbox: Outbox, unique: Key) -> None:
    async def main() -> None:
        k = unique("aio-dedup")
        payload = {"url": outbox.receiver.url("/ok"), "body": {"n": 1}}
        async with await psycopg.AsyncConnection.connect(outbox.url) as conn:
            async with conn.transaction():
                first = await aio.enqueue(conn, k, "webhook", payload, held=True)
            async with conn.transaction():
                again = await aio.enqueue(conn, k, "webhook", payload, held=True)
            assert first.created and not again.created and first.id == again.id
            with pytest.raises(aio.KeyConflict):
                async with conn.transaction():
                    await aio.enqueue(conn, k, "webhook", {**payload, "body": {"n": 2}}, held=True)
            with pytest.raises(aio.InvalidMessage) as err:
                async with conn.transaction():
                    await aio.enqueue(conn, unique("aio-bad"), "webhook", {"body": {}})
            assert err.value.field == "payload.url"
            with pytest.raises(RuntimeError):
                async with conn.transaction():
                    await aio.enqueue(conn, unique("aio-rolled-back"), "webhook", payload)
                    raise RuntimeError("the business transaction fails")
            assert await aio.lookup(conn, unique("aio-rolled-back")) is None
            status = await aio.lookup(conn, k)
            assert status is not None and status.state == "held"

    asyncio.run(main())


def test_concurrent_waits_each_see_their_own_delivery(outbox: Outbox, unique: Key) -> None:
    """Eight waiters, each on a connection of its own, started before their messages are
    enqueued: each returns its own message delivered."""

    async def one(k: str) -> aio.MessageStatus:
        async with await psycopg.AsyncConnection.connect(outbox.url) as conn:
            return await aio.wait(conn, k, timeout=30)

    async def main() -> None:
        keys = [unique(f"aio-many-{i}") for i in range(8)]
        waits = [asyncio.create_task(one(k)) for k in keys]
        async with (
            await psycopg.AsyncConnection.connect(outbox.url) as conn,
            conn.transaction(),
        ):
            for k in keys:
                await aio.enqueue(conn, k, "webhook", {"url": outbox.receiver.url("/ok")})
        done = await asyncio.gather(*waits)
        assert [s.state for s in done] == ["delivered"] * len(keys)
        async with await psycopg.AsyncConnection.connect(outbox.url) as conn:
            for k, s in zip(keys, done):
                found = await aio.lookup(conn, k)
                assert found is not None and found.id == s.id

    asyncio.run(main())


def test_wait_held_at_once_and_timeout(outbox: Outbox, unique: Key) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(outbox.url, autocommit=True) as conn:
            held, pending = unique("aio-held"), unique("aio-later")
            url = outbox.receiver.url("/ok")
            await aio.enqueue(conn, held, "webhook", {"url": url}, held=True)
            await aio.enqueue(conn, pending, "webhook", {"url": url}, run_after=later())
            status = await aio.wait(conn, held, timeout=10)
            assert status.state == "held"
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await aio.wait(conn, pending, timeout=0.3)
            assert time.monotonic() - started < 5
            assert conn.autocommit is True
            # Cancelled from outside (asyncio.wait_for), the wait still lets go of its mark.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(aio.wait(conn, pending, timeout=30), 0.3)
            cur = await conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                " AND classid = 1869968482 AND objid = 3 AND objsubid = 2"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            row = await cur.fetchone()
            assert row is not None and row[0] == 0

    asyncio.run(main())


def test_wait_sees_a_key_first_enqueued_held_after_it_started(
    outbox: Outbox, unique: Key, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in the sync suite, with no notification reaching the wait (its LISTEN lost on
    the way): the backing-off look finds the key."""
    monkeypatch.setattr(_core, "LISTEN", "SELECT 'LISTEN lost on the way'")

    async def main() -> None:
        k = unique("aio-held-later")
        async with (
            await psycopg.AsyncConnection.connect(outbox.url) as waiter,
            await psycopg.AsyncConnection.connect(outbox.url, autocommit=True) as conn,
        ):
            with settle_gate(outbox) as let_through:
                waiting = asyncio.create_task(aio.wait(waiter, k, timeout=8))
                await asyncio.to_thread(let_through)
            await aio.enqueue(conn, k, "webhook", {"url": outbox.receiver.url("/ok")}, held=True)
            enqueued = time.monotonic()
            status = await waiting
            assert status.state == "held"
            assert time.monotonic() - enqueued < 4

    asyncio.run(main())


def test_call_once_under_concurrency(outbox: Outbox, unique: Key) -> None:
    """Four tasks call the same tool step at once, each on a connection of its own: one
    request is sent, the business write runs once, all four are told the same answer."""

    async def main() -> None:
        k = unique("aio-tool")
        payload = {"url": outbox.receiver.url("/ok"), "body": {"n": 1}, "store_response": True}
        writes: list[int] = []

        async def write(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute("SELECT 1")
            writes.append(1)

        async def one() -> aio.Outcome:
            async with await psycopg.AsyncConnection.connect(outbox.url) as conn:
                return await aio.call_once(conn, k, "webhook", payload, write=write, timeout=30)

        got = await asyncio.gather(*(one() for _ in range(4)))
        assert [o.kind for o in got] == ["done"] * 4, outbox.daemon_log()
        assert len({o.status.id for o in got}) == 1
        assert got[0].response["status"] == 200
        assert writes == [1]
        assert outbox.receiver.seen(k) == 1

    asyncio.run(main())
