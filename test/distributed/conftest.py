"""Fixtures of the multi-rank end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers.engine_outputs import run_engine


@pytest.fixture(scope="session")
def single_rank_outputs(tiny_models: dict[str, str]) -> Callable[[str], list[dict]]:
    """``run_engine``'s outputs on one rank (the PROMPTS, greedy, with fp32 logprobs) of a tiny
    model by name: the reference of the multi-rank runs, computed once for every module."""
    cache: dict[str, list[dict]] = {}

    def outputs(name: str) -> list[dict]:
        if name not in cache:
            cache[name] = run_engine(tiny_models[name])
        return cache[name]

    return outputs
