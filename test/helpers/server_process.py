"""The end-to-end tests' srt server: ``benchmark.common.server.ServerProcess`` with the tests'
defaults (fp32, a 4096-token KV pool, a 60 s start-up), reads of its state over HTTP, and the
process helpers of ``benchmark.common.process`` the tests check a server's children with."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx

from benchmark.common import server as common
from benchmark.common.process import child_pids, free_port, ipc_dirs, is_running, wait_gone

__all__ = [
    "ServerProcess",
    "assert_pool_full",
    "child_pids",
    "free_port",
    "internal_state",
    "ipc_dirs",
    "is_running",
    "running_server",
    "server_info",
    "start_server",
    "wait_gone",
    "wait_idle",
]

TEST_ARGS = ("--dtype", "float32", "--max-total-tokens", "4096")


class ServerProcess(common.ServerProcess):
    """``python -m launch_server`` on a free loopback port with the tests' defaults; extra
    flags come after them (and win)."""

    start_timeout_s = 60.0

    def __init__(self, model_path: str, *extra_args: str):
        super().__init__(model_path, *TEST_ARGS, *extra_args)


def start_server(model_path: str, *extra_args: str) -> ServerProcess:
    """A healthy server (retried when its free port was taken meanwhile)."""
    return ServerProcess.start(model_path, *extra_args)


@contextlib.contextmanager
def running_server(model_path: str, *extra_args: str) -> Iterator[ServerProcess]:
    """A started server, stopped (and its log removed) on exit; its log printed on failure."""
    with ServerProcess.running(model_path, *extra_args) as server:
        yield server


# ------------------------------------------------------------------------------ HTTP state
def server_info(url: str, headers: dict[str, str] | None = None) -> dict:
    response = httpx.get(url + "/get_server_info", headers=headers, timeout=30.0)
    response.raise_for_status()
    return response.json()


def internal_state(url: str) -> dict:
    return server_info(url)["internal_states"][0]


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """Poll /get_server_info until no request runs or waits; returns that internal state."""
    deadline = time.monotonic() + timeout
    while True:
        state = internal_state(url)
        if state["num_running_reqs"] == state["num_waiting_reqs"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still running after {timeout} s: {state}")
        time.sleep(0.1)


def assert_pool_full(state: dict) -> None:
    """No request left and every KV slot free or evictable from the prefix cache."""
    assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0, state
    assert state["num_protected_tokens"] == 0, state
    total = state["num_free_tokens"] + state["num_evictable_tokens"]
    assert total == state["max_total_num_tokens"], state
