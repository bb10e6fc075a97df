import os
from typing import Any

import psycopg

import outboxd

PAYMENTS = os.environ.get("PAYMENTS_URL", "https://pay.example.com")


def refund(
    conn: psycopg.Connection[Any], run_id: str, step: int, order_id: int, cents: int
) -> dict[str, Any]:
    """An agent's tool: refunds an order at most once per step of a run, however often the
    step runs again, and returns what the payment provider answered."""
    k = outboxd.key(run_id, step, "refund")  # from durable ids: the same on every retry

    def mark_order(c: psycopg.Connection[Any]) -> None:  # the business write, same transaction
        c.execute("UPDATE orders SET state = 'refunding' WHERE id = %s", (order_id,))

    outcome = outboxd.tool.call_once(
        conn,
        k,
        "webhook",
        {
            "url": f"{PAYMENTS}/refunds",
            "body": {"order": order_id, "cents": cents},
            "store_response": True,
        },
        held=cents > 10_000,  # a large refund waits for a person's approval
        write=mark_order,
        timeout=20,
    )
    # outcome.kind: "done" (outcome.response is the provider's answer), "on_its_way",
    # "needs_person" (held, or an attempt whose effect is unknown) or "failed".
    return outcome.for_agent()
