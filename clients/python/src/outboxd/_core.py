"""What the sync and async APIs share: the types, the errors, `key`, and the SQL text.

Everything here is a thin layer over the SQL functions of the `outbox` schema: the rules
(what a valid message is, what a conflict is) live in the database, and the errors the
database raises are only given Python names here.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypedDict

import psycopg

__all__ = [
    "EmailPayload",
    "Enqueued",
    "ErrorClass",
    "HttpPayload",
    "InvalidMessage",
    "KeyConflict",
    "MessageStatus",
    "OutboxError",
    "State",
    "WebhookPayload",
    "key",
]

State = Literal["pending", "running", "delivered", "dead", "held", "cancelled"]
"""A message's state, as `outbox.messages.state` holds it."""

ErrorClass = Literal["transient", "ambiguous", "permanent", "invalid", "exhausted"]
"""The class of a message's last failure."""

JsonValue = None | bool | int | float | str | list[Any] | dict[str, Any]


class WebhookPayload(TypedDict, total=False):
    """A `webhook` payload (docs/webhooks.md). `url` is required."""

    url: str
    method: Literal["POST", "PUT", "PATCH"]
    headers: dict[str, str]
    body: JsonValue
    secret: str
    store_response: bool
    reconcile: dict[str, str]


# The functional form, because `from` is a Python keyword.
EmailPayload = TypedDict(
    "EmailPayload",
    {
        "from": str,
        "to": str | list[str],
        "cc": list[str],
        "bcc": list[str],
        "reply_to": str,
        "subject": str,
        "text": str,
        "html": str,
        "headers": dict[str, str],
    },
    total=False,
)
"""An `email` payload (docs/email.md). `from` and `to` are required; so is one of `text`
and `html`."""


class HttpPayload(TypedDict, total=False):
    """An `http` payload: a call to a provider's API through a named endpoint, whose
    credentials the daemon holds. `endpoint` and `path` are required; at most one of
    `form` and `json`."""

    endpoint: str
    method: Literal["POST", "PUT", "PATCH", "DELETE"]
    path: str
    query: dict[str, JsonValue]
    form: dict[str, JsonValue]
    json: JsonValue
    headers: dict[str, str]
    reconcile: dict[str, JsonValue]
    store_response: bool


class Enqueued(NamedTuple):
    """What `enqueue` did: the message's id, and whether this call created it (False when
    the key already existed with the same channel and payload)."""

    id: int
    created: bool


@dataclass(frozen=True)
class MessageStatus:
    """What is known of one message: the columns of `outbox.lookup` (no payload)."""

    id: int
    state: State
    attempts: int
    max_attempts: int
    error_class: ErrorClass | None
    last_error: str | None
    response: Any
    created_at: datetime.datetime
    updated_at: datetime.datetime
    delivered_at: datetime.datetime | None
    dead_at: datetime.datetime | None
    cancelled_at: datetime.datetime | None
    # When the provider's memory of the key ends: an http message's first attempt plus its
    # endpoint's key_ttl; None before a first attempt or without a key_ttl.
    key_expires_at: datetime.datetime | None

    @property
    def settled(self) -> bool:
        """True when `wait` would return this status: delivered, dead, cancelled or held
        (held waits for a person, not for the daemon)."""
        return self.state in SETTLED


SETTLED: frozenset[str] = frozenset({"delivered", "dead", "cancelled", "held"})


class OutboxError(Exception):
    """An error the outbox's SQL functions raised about a message."""

    def __init__(self, message: str, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class KeyConflict(OutboxError):
    """SQLSTATE OB409: the key was already used with a different channel or payload. The
    stored message is untouched."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message, "OB409")
        self.key = key


class InvalidMessage(OutboxError):
    """SQLSTATE 22023: bad input; `field` names it (`message_key`, `payload`, `url`, …).
    Nothing was stored."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message, "22023")
        self.field = field


def translate(err: psycopg.Error, message_key: str) -> OutboxError | None:
    """The outbox's name for a database error, or None when it is not one of its own."""
    text = err.diag.message_primary or str(err)
    if err.sqlstate == "OB409":
        return KeyConflict(text, message_key)
    if err.sqlstate == "22023":
        return InvalidMessage(text, err.diag.column_name)
    return None


def key(*parts: str | int) -> str:
    """A message key from durable ids: the parts joined with ``:``, each part's ``%``
    written ``%25`` and its ``:`` written ``%3A``, so that different parts never make the
    same key. ``key("run-1", "step:2", "refund") == "run-1:step%3A2:refund"``.

    Integers are written in decimal. An empty part (or no part at all) raises ValueError.
    """
    if not parts:
        raise ValueError("key() needs at least one part")
    out = []
    for i, part in enumerate(parts):
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise TypeError(f"key() part {i} must be a str or an int, not {type(part).__name__}")
        text = str(part)
        if text == "":
            raise ValueError(f"key() part {i} is empty")
        out.append(text.replace("%", "%25").replace(":", "%3A"))
    return ":".join(out)


# --- SQL -------------------------------------------------------------------------------
# The casts pick the one signature of each function whatever Python types the values have.

ENQUEUE = (
    "SELECT id, created FROM outbox.enqueue_row(%s::text, %s::text, %s::jsonb,"
    " %s::timestamptz, %s::int, %s::boolean, %s::boolean, %s::text)"
)
LOOKUP = "SELECT * FROM outbox.lookup(%s::text)"

# `wait`, as sql/0001_baseline.sql describes at outbox.wake_waiters: listen, take the
# waiter mark, pass the settle gate once, then look the key up on each notification.
LISTEN = "LISTEN outbox_settled"
UNLISTEN = "UNLISTEN outbox_settled"
TAKE_MARK = "SELECT pg_advisory_lock_shared(1869968482, 3)"
DROP_MARK = "SELECT pg_advisory_unlock_shared(1869968482, 3)"
GATE_TIMEOUT = "SELECT set_config('lock_timeout', %s, true)"
PASS_GATE = "SELECT pg_advisory_xact_lock(1869968482, 4)"

# Between notifications, `wait` looks the key up again after a pause that starts at
# POLL_FIRST and doubles up to POLL_MAX: the notification is the quick path, the look the
# fallback for one that never comes (a pooler that drops LISTEN, as PgBouncer's transaction
# mode does; a key first enqueued already held, which no UPDATE announces).
POLL_FIRST = 0.05
POLL_MAX = 2.0


def next_poll(interval: float) -> float:
    """The pause after `interval`: twice as long, at most POLL_MAX seconds."""
    return min(interval * 2, POLL_MAX)


def status_of(row: dict[str, Any]) -> MessageStatus:
    return MessageStatus(
        id=row["id"],
        state=row["state"],
        attempts=row["attempts"],
        max_attempts=row["max_attempts"],
        error_class=row["error_class"],
        last_error=row["last_error"],
        response=row["response"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        delivered_at=row["delivered_at"],
        dead_at=row["dead_at"],
        cancelled_at=row["cancelled_at"],
        key_expires_at=row["key_expires_at"],
    )


def lock_timeout(deadline: float) -> str:
    """`lock_timeout` for the time left (at least 1 ms: 0 would mean no limit)."""
    return f"{max(1, int((deadline - time.monotonic()) * 1000))}ms"


def timed_out(message_key: str, timeout: float, status: MessageStatus | None) -> TimeoutError:
    where = f"still {status.state}" if status is not None else "not found"
    return TimeoutError(f"message {message_key!r} is {where} after {timeout:g}s")


def not_idle(conn_status: object) -> ValueError:
    return ValueError(
        "wait() needs a connection with no transaction open (notifications arrive only"
        f" between transactions); this one is {conn_status}"
    )
