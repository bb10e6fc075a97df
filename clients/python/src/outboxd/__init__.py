"""outboxd's client: enqueue side effects in your own transaction, look their keys up, and
wait for their outcome. Thin over the SQL functions of the `outbox` schema (psycopg 3).

    import psycopg, outboxd
    with psycopg.connect(url) as conn:
        k = outboxd.key("run-7", "step-4", "refund")
        with conn.transaction():
            outboxd.enqueue(conn, k, "webhook", {"url": "https://…", "body": {}})
        status = outboxd.wait(conn, k, timeout=30)

The same names, for `psycopg.AsyncConnection`, are in `outboxd.aio`.
"""

from . import tool
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
from ._sync import enqueue, lookup, wait

__version__ = "0.1.0"

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
    "enqueue",
    "key",
    "lookup",
    "tool",
    "wait",
]
