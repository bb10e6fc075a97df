"""The tool wrapper: an agent's side effect, asked for once, whose answer the tool returns.

    outcome = outboxd.tool.call_once(conn, key, "webhook", payload, timeout=20)

looks the key up; if the message is known and settled, returns what happened without
asking again; else enqueues it (in a transaction of its own, with the caller's business
write, if any, in the same transaction) and commits; then waits for the outcome, up to
`timeout` seconds. Built only of `lookup`, `enqueue` and `wait`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.pq import TransactionStatus

from . import _core
from ._core import MessageStatus
from ._sync import enqueue, lookup, wait

__all__ = ["Outcome", "OutcomeKind", "call_once", "outcome_of"]

OutcomeKind = Literal["done", "failed", "on_its_way", "needs_person"]
"""What a tool can tell the agent:

* ``done``: delivered; ``response`` is the provider's answer as stored.
* ``failed``: it did not take effect (refused by the provider, invalid, out of attempts,
  or cancelled by a person); asking again under the same key returns the same.
* ``on_its_way``: not settled within the deadline (pending or running); ask again later
  under the same key, which never sends it twice.
* ``needs_person``: held for a person's approval, or dead with an ambiguous last attempt
  (it may or may not have taken effect; a person must look before anything is sent again).
"""


@dataclass(frozen=True)
class Outcome:
    """What became of one call: its kind and the message's status."""

    kind: OutcomeKind
    status: MessageStatus

    @property
    def response(self) -> Any:
        """The provider's last answer as stored (``status``, ``body`` with
        ``store_response``), or None."""
        return self.status.response

    def for_agent(self) -> dict[str, Any]:
        """A JSON-able summary to return to a model: the kind, the state, the answer or the
        error, and a sentence saying what to do next."""
        out: dict[str, Any] = {"outcome": self.kind, "state": self.status.state}
        if self.status.response is not None:
            out["response"] = self.status.response
        if self.kind != "done" and self.status.last_error is not None:
            out["error"] = self.status.last_error
        out["note"] = NOTES[self.kind]
        return out


NOTES: dict[OutcomeKind, str] = {
    "done": "It took effect; the provider's answer is in response.",
    "failed": "It did not take effect.",
    "on_its_way": "Not finished yet; asking again later returns the outcome, never a second send.",
    "needs_person": "A person must decide (approve it, or check whether it took effect).",
}


def outcome_of(status: MessageStatus) -> Outcome:
    """The kind of outcome a message's status tells."""
    if status.state == "delivered":
        return Outcome("done", status)
    if status.state == "held":
        return Outcome("needs_person", status)
    if status.state == "dead":
        kind: OutcomeKind = "needs_person" if status.error_class == "ambiguous" else "failed"
        return Outcome(kind, status)
    if status.state == "cancelled":
        return Outcome("failed", status)
    return Outcome("on_its_way", status)


def call_once(
    conn: psycopg.Connection[Any],
    key: str,
    channel: str,
    payload: Mapping[str, Any],
    *,
    timeout: float,
    held: bool = False,
    write: Callable[[psycopg.Connection[Any]], object] | None = None,
    max_attempts: int = 3,
    retry_ambiguous: bool = True,
    run_after: datetime.datetime | None = None,
    ordering_key: str | None = None,
) -> Outcome:
    """Asks for one side effect under `key` at most once, and returns its outcome.

    A key already known and settled returns at once, without enqueueing or writing. A key
    not known is enqueued with `held`, `max_attempts`, … in a transaction that also runs
    `write(conn)` (the business write: an order marked refunding, an audit row), and
    committed; `write` runs only in the call that created the message, so two racing calls
    write once. Then it waits up to `timeout` seconds (`wait`) and returns the outcome; a
    message not settled by then is ``on_its_way``.

    `conn` must have no transaction open (what it commits is its own). Raises what
    `enqueue` raises (`KeyConflict` for the key with another payload, `InvalidMessage`),
    and what `write` raises, after rolling back both.
    """
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise _core.not_idle(status.name)
    with conn.transaction():
        found = lookup(conn, key)
    if found is None or not found.settled:
        with conn.transaction():
            sent = enqueue(
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
                write(conn)
        try:
            found = wait(conn, key, timeout)
        except TimeoutError:
            with conn.transaction():
                found = lookup(conn, key)
    assert found is not None  # committed above, and never deleted while it is young
    return outcome_of(found)
