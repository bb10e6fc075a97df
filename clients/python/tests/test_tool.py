"""The tool wrapper (outboxd.tool) and the README's first example, which is
examples/refund_tool.py, run against the real daemon."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from conftest import Outbox

import outboxd
from outboxd.tool import call_once, outcome_of

Key = Callable[[str], str]
HERE = Path(__file__).resolve().parents[1]


def first_python_block(markdown: Path) -> str:
    found = re.search(r"```python\n(.*?)```", markdown.read_text(), re.DOTALL)
    assert found is not None, f"no python block in {markdown}"
    return found.group(1)


def test_the_readme_and_the_docs_open_with_the_example_file() -> None:
    example = (HERE / "examples/refund_tool.py").read_text()
    assert first_python_block(HERE / "README.md") == example
    assert first_python_block(HERE.parents[1] / "docs/clients.md") == example


@pytest.fixture
def example(outbox: Outbox, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("PAYMENTS_URL", outbox.receiver.base)
    spec = importlib.util.spec_from_file_location("refund_tool", HERE / "examples/refund_tool.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def order(conn: psycopg.Connection[Any], state: str = "paid") -> int:
    with conn.transaction():
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, state text)")
        row = conn.execute("INSERT INTO orders (state) VALUES (%s) RETURNING id", (state,))
        got = row.fetchone()
    assert got is not None
    return int(got[0])


def order_state(conn: psycopg.Connection[Any], order_id: int) -> str:
    with conn.transaction():
        row = conn.execute("SELECT state FROM orders WHERE id = %s", (order_id,)).fetchone()
    assert row is not None
    return str(row[0])


def test_the_example_refunds_once_and_returns_the_answer(
    outbox: Outbox, conn: psycopg.Connection[Any], example: ModuleType, unique: Key
) -> None:
    run = unique("run")
    oid = order(conn)
    first = example.refund(conn, run, 4, oid, 2_500)
    assert first["outcome"] == "done", (first, outbox.daemon_log())
    assert first["response"]["status"] == 200
    assert first["response"]["body"]["id"].startswith("rcpt_")
    assert order_state(conn, oid) == "refunding"
    # The step runs again (the agent retried it): nothing is sent or written again.
    with conn.transaction():
        conn.execute("UPDATE orders SET state = 'refunded' WHERE id = %s", (oid,))
    again = example.refund(conn, run, 4, oid, 2_500)
    assert again == first
    assert outbox.receiver.seen(outboxd.key(run, 4, "refund")) == 1
    assert order_state(conn, oid) == "refunded"


def test_the_example_holds_a_large_refund_for_a_person(
    outbox: Outbox, conn: psycopg.Connection[Any], example: ModuleType, unique: Key
) -> None:
    run = unique("run")
    oid = order(conn)
    got = example.refund(conn, run, 1, oid, 50_000)
    assert got["outcome"] == "needs_person" and got["state"] == "held"
    assert outbox.receiver.seen(outboxd.key(run, 1, "refund")) == 0
    assert order_state(conn, oid) == "refunding"


def test_a_failed_business_write_sends_nothing(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("write-fails")

    def write(c: psycopg.Connection[Any]) -> None:
        raise RuntimeError("the order is gone")

    with pytest.raises(RuntimeError):
        call_once(conn, k, "webhook", {"url": outbox.receiver.url("/ok")}, write=write, timeout=5)
    assert outboxd.lookup(conn, k) is None


def test_not_settled_by_the_deadline_is_on_its_way(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("slow")
    soon = datetime.now(timezone.utc) + timedelta(hours=1)
    payload = {"url": outbox.receiver.url("/ok")}
    got = call_once(conn, k, "webhook", payload, run_after=soon, timeout=0.5)
    assert got.kind == "on_its_way" and got.status.state == "pending"
    assert got.for_agent()["outcome"] == "on_its_way"
    assert outbox.receiver.seen(k) == 0


def test_a_refusal_failed_and_another_payload_conflicts(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    k = unique("refused")
    got = call_once(conn, k, "webhook", {"url": outbox.receiver.url("/reject")}, timeout=20)
    assert got.kind == "failed" and got.status.error_class == "permanent"
    assert "error" in got.for_agent()
    # A settled key answers what happened, without looking at the payload again.
    assert call_once(conn, k, "webhook", {"url": outbox.receiver.url("/ok")}, timeout=1) == got
    # One still on its way is enqueued again, which checks the payload.
    later = unique("later")
    soon = datetime.now(timezone.utc) + timedelta(hours=1)
    first = call_once(
        conn, later, "webhook", {"url": outbox.receiver.url("/ok")}, run_after=soon, timeout=0.1
    )
    assert first.kind == "on_its_way"
    with pytest.raises(outboxd.KeyConflict):
        call_once(conn, later, "webhook", {"url": outbox.receiver.url("/x")}, timeout=0.1)


def test_outcome_of_each_state() -> None:
    now = datetime.now(timezone.utc)
    base = outboxd.MessageStatus(
        1, "pending", 0, 3, None, None, None, now, now, None, None, None, None
    )

    def kind(state: Any, error_class: Any = None) -> str:
        return outcome_of(dataclasses.replace(base, state=state, error_class=error_class)).kind

    assert kind("delivered") == "done"
    assert kind("held") == "needs_person"
    assert kind("dead", "ambiguous") == "needs_person"
    assert kind("dead", "permanent") == "failed"
    assert kind("dead", "exhausted") == "failed"
    assert kind("cancelled") == "failed"
    assert kind("pending") == kind("running") == "on_its_way"
