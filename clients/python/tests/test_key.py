"""key(): the shared vectors (clients/key-vectors.json), which the TypeScript tests read too."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import VECTORS

import outboxd
import outboxd.aio

CASES: list[dict[str, Any]] = json.loads(VECTORS.read_text(encoding="utf-8"))["vectors"]


@pytest.mark.parametrize("case", CASES, ids=[repr(c["parts"]) for c in CASES])
def test_key_vectors(case: dict[str, Any]) -> None:
    if "error" in case:
        with pytest.raises(ValueError):
            outboxd.key(*case["parts"])
    else:
        assert outboxd.key(*case["parts"]) == case["key"]


def test_parts_never_collide() -> None:
    assert outboxd.key("a:b", "c") != outboxd.key("a", "b:c")
    assert outboxd.key("a%3Ab") != outboxd.key("a:b")


def test_a_part_is_a_string_or_an_integer() -> None:
    with pytest.raises(TypeError):
        outboxd.key("a", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        outboxd.key("a", True)
    assert outboxd.aio.key is outboxd.key
