"""examples/pydantic_ai_agent.py against the real daemon. pydantic-ai-slim is installed by
scripts/test-clients (the package's `examples` extra, pinned); without it this file fails
to import, and the suite fails: it is never skipped."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from conftest import Outbox

import outboxd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pydantic_ai_agent

Key = Callable[[str], str]


def test_the_agent_refunds_once_across_two_runs_of_the_same_step(
    outbox: Outbox, conn: psycopg.Connection[Any], unique: Key
) -> None:
    run_id = unique("agent-run")
    first = pydantic_ai_agent.run(conn, run_id, outbox.receiver.base)
    assert first.startswith("refund: "), first
    told = json.loads(first.removeprefix("refund: "))
    assert told["outcome"] == "done", (told, outbox.daemon_log())
    assert told["response"]["status"] == 200
    assert told["response"]["body"]["id"].startswith("rcpt_")
    # The same step of the same run again (a retry, a resumed run): one request in all, and
    # the agent is told the same answer.
    again = pydantic_ai_agent.run(conn, run_id, outbox.receiver.base)
    assert again == first
    assert outbox.receiver.seen(outboxd.key(run_id, "order-42", "refund")) == 1
