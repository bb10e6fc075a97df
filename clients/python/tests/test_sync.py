"""The sync API against a real PostgreSQL and the real daemon (conftest.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from conftest import Outbox, settle_gate, wait_until

import outboxd

Key = Callable[[str], str]


def webhook(outbox: Outbox, path: str = "/ok", **extra: Any) -> dict[str, Any]:
    return {"url": outbox.receiver.url(path), "body": {"n": 1}, **extra}


def later() -> datetime:
    return datetime.now(timezone.utc) + timedelta(hours=1)


def count(conn: psycopg.Connection[Any], key: str) -> int:
    row = conn.execute("SELECT count(*) FROM outbox.messages WHERE message_key = %s", (key,))
    got = row.fetchone()
    assert got is not None
    return int(got[0])


def test_enqueue_creates_then_returns_the_first_record(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("dedup")
    payload = webhook(outbox)
    first = outboxd.enqueue(conn, k, "webhook", payload, run_after=later())
    conn.commit()
    again = outboxd.enqueue(conn, k, "webhook", payload, run_after=later())
    conn.commit()
    assert first.created and not again.created
    assert again.id == first.id
    assert count(conn, k) == 1


def test_enqueue_never_commits_and_a_rollback_stores_nothing(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("rolled-back")
    with pytest.raises(RuntimeError), conn.transaction():
        outboxd.enqueue(conn, k, "webhook", webhook(outbox))
        raise RuntimeError("the business transaction fails")
    outboxd.enqueue(conn, unique("open"), "webhook", webhook(outbox))
    conn.rollback()
    with outbox.connect() as other:
        assert outboxd.lookup(other, k) is None
        assert outboxd.lookup(other, unique("open")) is None
        assert count(other, k) == 0


def test_another_payload_under_the_same_key_is_a_conflict(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("conflict")
    outboxd.enqueue(conn, k, "webhook", webhook(outbox), held=True)
    conn.commit()
    with pytest.raises(outboxd.KeyConflict) as err:
        outboxd.enqueue(conn, k, "webhook", webhook(outbox, body={"n": 2}), held=True)
    conn.rollback()
    assert isinstance(err.value, outboxd.OutboxError)
    assert err.value.sqlstate == "OB409" and err.value.key == k
    assert k in str(err.value)
    status = outboxd.lookup(conn, k)
    assert status is not None and status.state == "held"


@pytest.mark.parametrize(
    ("key", "channel", "payload", "field"),
    [
        ("ctl:\x1b[31mred", "webhook", {"url": "https://example.com/h"}, "message_key"),
        ("line\nbreak", "webhook", {"url": "https://example.com/h"}, "message_key"),
        ("k" * 256, "webhook", {"url": "https://example.com/h"}, "message_key"),
        ("", "webhook", {"url": "https://example.com/h"}, "message_key"),
        ("not-an-object", "webhook", ["https://example.com/h"], "payload"),
        ("string-payload", "webhook", "https://example.com/h", "payload"),
        ("no-url", "webhook", {"body": {}}, "payload.url"),
        ("bad-channel", "pigeon", {"url": "https://example.com/h"}, "channel"),
    ],
    ids=["escape", "newline", "too-long", "empty", "array", "string", "no-url", "channel"],
)
def test_bad_input_names_the_field_and_stores_nothing(
    outbox: Outbox, conn: psycopg.Connection[Any], key: str, channel: str, payload: Any, field: str
) -> None:
    with pytest.raises(outboxd.InvalidMessage) as err:
        outboxd.enqueue(conn, key, channel, payload)
    conn.rollback()
    assert err.value.field == field, str(err.value)
    assert err.value.sqlstate == "22023"
    assert count(conn, key) == 0


def test_max_attempts_below_one_names_the_field(conn: psycopg.Connection[Any], unique: Key) -> None:
    with pytest.raises(outboxd.InvalidMessage) as err:
        outboxd.enqueue(
            conn, unique("zero"), "webhook", {"url": "https://example.com/h"}, max_attempts=0
        )
    conn.rollback()
    assert err.value.field == "max_attempts"


def test_lookup_of_an_unknown_key_is_none(conn: psycopg.Connection[Any], unique: Key) -> None:
    assert outboxd.lookup(conn, unique("never")) is None
    with pytest.raises(outboxd.InvalidMessage) as err:
        outboxd.lookup(conn, "bad\x07key")
    assert err.value.field == "message_key"


def test_lookup_says_when_the_providers_key_window_closes(
    conn: psycopg.Connection[Any], unique: Key
) -> None:
    conn.execute(
        "SELECT outbox.set_endpoint('window-py', 'https://api.example.com', key_ttl => '24 hours')"
    )
    k = unique("window")
    outboxd.enqueue(conn, k, "http", {"endpoint": "window-py", "path": "/v1/x"}, held=True)
    conn.commit()
    # Before a first attempt the window has not opened.
    status = outboxd.lookup(conn, k)
    assert status is not None and status.key_expires_at is None
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    conn.execute(
        "UPDATE outbox.messages SET attempts = 1, first_attempt_at = %s WHERE message_key = %s",
        (started, k),
    )
    conn.commit()
    status = outboxd.lookup(conn, k)
    assert status is not None
    assert status.key_expires_at == started + timedelta(hours=24)


def test_wait_returns_delivered_with_the_stored_response(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("delivered")
    with conn.transaction():
        outboxd.enqueue(conn, k, "webhook", webhook(outbox, store_response=True))
    status = outboxd.wait(conn, k, timeout=30)
    assert status.state == "delivered", outbox.daemon_log()
    assert status.settled and status.attempts == 1
    assert status.response["status"] == 200
    assert status.response["body"]["id"].startswith("rcpt_")
    assert outbox.receiver.seen(k) == 1
    # The connection is given back as it was: not in autocommit, no lock, not listening.
    assert conn.autocommit is False
    assert waiters(outbox) == 0


def waiters(outbox: Outbox) -> int:
    """Sessions holding the waiter mark (outbox.wake_waiters) in the session's database."""
    with outbox.connect() as c:
        row = c.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1869968482"
            " AND objid = 3 AND objsubid = 2 AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        assert row is not None
        return int(row[0])


def test_wait_is_woken_by_the_delivery(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    """The waiter is already waiting when the daemon delivers: the notification wakes it."""
    k = unique("woken")
    with conn.transaction():
        outboxd.enqueue(conn, k, "webhook", webhook(outbox, "/hold"))
    wait_until("the daemon's request", lambda: outbox.receiver.seen(k) == 1, timeout=20)
    got: list[outboxd.MessageStatus | BaseException] = []

    def waiter() -> None:
        try:
            got.append(outboxd.wait(conn, k, timeout=30))
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    wait_until("the waiter to hold its mark", lambda: waiters(outbox) == 1)
    released = time.monotonic()
    outbox.receiver.release()
    t.join(30)
    assert got and isinstance(got[0], outboxd.MessageStatus), got
    assert got[0].state == "delivered"
    assert time.monotonic() - released < 10


def test_wait_on_a_held_message_returns_at_once(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("held")
    outboxd.enqueue(conn, k, "webhook", webhook(outbox), held=True)
    conn.commit()
    started = time.monotonic()
    status = outboxd.wait(conn, k, timeout=10)
    assert status.state == "held"
    assert time.monotonic() - started < 5
    assert outbox.receiver.seen(k) == 0


def test_wait_returns_dead_for_a_refused_delivery(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("dead")
    with conn.transaction():
        outboxd.enqueue(conn, k, "webhook", webhook(outbox, "/reject"))
    status = outboxd.wait(conn, k, timeout=30)
    assert status.state == "dead" and status.error_class == "permanent"


def test_wait_returns_cancelled_when_an_operator_cancels(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    """A settlement through outbox.cancel (an UPDATE inside a function) wakes the waiter."""
    k = unique("cancelled")
    with conn.transaction():
        sent = outboxd.enqueue(conn, k, "webhook", webhook(outbox), run_after=later())
    got: list[outboxd.MessageStatus | BaseException] = []

    def waiter() -> None:
        with outbox.connect() as c:
            try:
                got.append(outboxd.wait(c, k, timeout=30))
            except BaseException as e:  # noqa: BLE001
                got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    wait_until("the waiter to hold its mark", lambda: waiters(outbox) == 1)
    conn.execute("SELECT * FROM outbox.cancel(ARRAY[%s]::bigint[], 'not needed')", (sent.id,))
    conn.commit()
    t.join(30)
    assert got and isinstance(got[0], outboxd.MessageStatus), got
    assert got[0].state == "cancelled"


def test_wait_times_out(outbox: Outbox, conn: psycopg.Connection[Any], unique: Key) -> None:
    k = unique("later")
    with conn.transaction():
        outboxd.enqueue(conn, k, "webhook", webhook(outbox), run_after=later())
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="still pending"):
        outboxd.wait(conn, k, timeout=0.3)
    assert 0.25 <= time.monotonic() - started < 5
    # The connection is usable afterwards and holds nothing.
    assert outboxd.lookup(conn, k) is not None
    assert waiters(outbox) == 0


def test_wait_refuses_a_connection_inside_a_transaction(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("in-tx")
    outboxd.enqueue(conn, k, "webhook", webhook(outbox), held=True)
    with pytest.raises(ValueError, match="no transaction open"):
        outboxd.wait(conn, k, timeout=1)
    conn.rollback()


def wait_in_thread(outbox: Outbox, k: str, timeout: float) -> tuple[threading.Thread, list[Any]]:
    """`wait` on a connection of its own, in a thread; the list gets its status or error."""
    got: list[Any] = []

    def waiter() -> None:
        with outbox.connect() as c:
            try:
                got.append(outboxd.wait(c, k, timeout=timeout))
            except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
                got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    return t, got


@pytest.fixture
def no_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits whose LISTEN does nothing: as through a pooler that drops it (PgBouncer in
    transaction mode), no notification reaches them, not even the daemon's idle claims'."""
    monkeypatch.setattr(outboxd._core, "LISTEN", "SELECT 'LISTEN lost on the way'")


@pytest.mark.usefixtures("no_listen")
def test_wait_without_notifications_ends_by_looking_again(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    """The backing-off look ends the wait (its pause is at most 2 s; its deadline 8 s)."""
    k = unique("unheard")
    with conn.transaction():
        sent = outboxd.enqueue(conn, k, "webhook", webhook(outbox), run_after=later())
    with settle_gate(outbox) as let_through:
        t, got = wait_in_thread(outbox, k, timeout=8)
        let_through()
    with conn.transaction():
        conn.execute("SELECT * FROM outbox.cancel(ARRAY[%s]::bigint[], 'unheard')", (sent.id,))
    cancelled = time.monotonic()
    t.join(10)
    assert got and isinstance(got[0], outboxd.MessageStatus), got
    assert got[0].state == "cancelled"
    assert time.monotonic() - cancelled < 4


@pytest.mark.usefixtures("no_listen")
def test_wait_sees_a_key_first_enqueued_held_after_it_started(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    """No UPDATE announces an INSERT that is already held: the backing-off look finds it."""
    k = unique("held-later")
    with settle_gate(outbox) as let_through:
        t, got = wait_in_thread(outbox, k, timeout=8)
        let_through()
    with conn.transaction():
        outboxd.enqueue(conn, k, "webhook", webhook(outbox), held=True)
    enqueued = time.monotonic()
    t.join(10)
    assert got and isinstance(got[0], outboxd.MessageStatus), got
    assert got[0].state == "held"
    assert time.monotonic() - enqueued < 4


def test_the_pause_between_looks_doubles_up_to_two_seconds() -> None:
    from outboxd import _core

    pauses = [_core.POLL_FIRST]
    while len(pauses) < 10:
        pauses.append(_core.next_poll(pauses[-1]))
    assert pauses[:7] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0]
    assert pauses[-1] == 2.0
