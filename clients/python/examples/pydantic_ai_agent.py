"""The tool wrapper in a Pydantic AI agent (pydantic-ai-slim), run by a scripted model: a
FunctionModel stands in for the LLM, so nothing leaves the machine but the daemon's own
delivery. The model asks for one refund, then tells the user what the tool returned.

The key comes from durable ids the application holds (its run's id, the order), never
from the model's tool-call id, which a new run of the same step would not repeat.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import psycopg
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import outboxd


@dataclass
class Deps:
    conn: psycopg.Connection[Any]
    run_id: str  # the application's durable id of this agent run
    payments_url: str


agent = Agent(deps_type=Deps, instructions="Refund orders with the refund tool.")


@agent.tool
def refund(ctx: RunContext[Deps], order_id: int, cents: int) -> dict[str, Any]:
    """Refunds `cents` of order `order_id` once; returns the payment provider's answer, or
    says that it is on its way or that a person must decide."""
    outcome = outboxd.tool.call_once(
        ctx.deps.conn,
        outboxd.key(ctx.deps.run_id, f"order-{order_id}", "refund"),
        "webhook",
        {
            "url": f"{ctx.deps.payments_url}/refunds",
            "body": {"order": order_id, "cents": cents},
            "store_response": True,
        },
        held=cents > 10_000,
        timeout=20,
    )
    return outcome.for_agent()


def scripted_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The fake LLM: first a call of the refund tool, then a reply quoting its result."""
    returned = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
    if not returned:
        return ModelResponse(parts=[ToolCallPart("refund", {"order_id": 42, "cents": 2_500})])
    return ModelResponse(parts=[TextPart("refund: " + json.dumps(returned[0].content))])


def run(conn: psycopg.Connection[Any], run_id: str, payments_url: str) -> str:
    """One run of the agent; its output is the fake model's reply."""
    result = agent.run_sync(
        "Please refund 25.00 on order 42.",
        deps=Deps(conn, run_id, payments_url),
        model=FunctionModel(scripted_model),
    )
    return result.output
