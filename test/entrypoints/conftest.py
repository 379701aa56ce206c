"""Fixtures of the end-to-end server tests: a real server (one for the modules that take the
default, one per module that overrides it), its log, and an httpx client and an openai client
of it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.server_process import ServerProcess, running_server


@pytest.fixture(scope="session")
def shared_server(qwen3_moe_path: str) -> Iterator[ServerProcess]:
    """The server behind ``server``: started once for every module that takes it (with
    /metrics, which test_http_server reads)."""
    with running_server(qwen3_moe_path, "--enable-metrics") as srv:
        yield srv


def _takes_shared_server(item: pytest.Item) -> bool:
    """The test uses ``server`` and its module does not override it."""
    module = getattr(item, "module", None)
    return "server" in getattr(item, "fixturenames", ()) and not hasattr(module, "server")


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, shared_server: ServerProcess) -> Iterator[ServerProcess]:
    """A server on the tiny Qwen3-MoE with the tests' flags, shared by the modules that take
    it (one start-up for them all), stopped after the last of them; a module may override it
    with other flags."""
    yield shared_server
    items = request.session.items
    mine = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    if not any(_takes_shared_server(item) for item in items[max(mine, default=-1) + 1 :]):
        shared_server.stop()  # nothing later needs it (the session fixture's exit is a no-op)


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
