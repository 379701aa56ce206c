"""Fixtures of the end-to-end server tests: a real server per test module, its log, and an
httpx client and an openai client of it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.server_process import ServerProcess, running_server


@pytest.fixture(scope="module")
def server(qwen3_moe_path: str) -> Iterator[ServerProcess]:
    """A server on the tiny Qwen3-MoE; a module may override it with other flags."""
    with running_server(qwen3_moe_path) as srv:
        yield srv


@pytest.fixture
def print_server_log(server: ServerProcess) -> Iterator[None]:
    """Prints the server log written during the test; pytest shows it only on failure."""
    start = server.log_size()
    yield
    print(server.log(start))


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60.0)
