"""Overload and failure of a real server: a full queue answers 503 with Retry-After at once and
the server serves again afterwards; a rank that hangs ends the server within the watchdog
timeout, answering the request in flight with an error that names the silent rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers.server_process import (
    ServerProcess,
    assert_pool_full,
    internal_state,
    running_server,
    wait_gone,
)

pytestmark = pytest.mark.slow  # starts processes

LONG = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 1500}}
LONG["sampling_params"]["ignore_eos"] = True


def spawned_children(server: ServerProcess) -> list[int]:
    """The server's spawned children in start order: scheduler ranks first, then the rest."""

    def start_ticks(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])

    spawned = []
    for pid in server.children():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                spawned.append(pid)
    return sorted(spawned, key=lambda pid: (start_ticks(pid), pid))


@contextlib.contextmanager
def open_stream(http: httpx.Client, body: dict) -> Iterator[Iterator[str]]:
    """A streamed /generate whose first output has arrived (so it is admitted and running)."""
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        next(lines)
        yield lines


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def assert_overloaded(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    body = response.json()  # native: {"error": {...}}; OpenAI: the error object itself
    assert "--max-queued-requests" in body.get("error", body)["message"], body


def test_full_queue_answers_503_and_the_server_recovers(qwen3_moe_path: str) -> None:
    """A server that runs one request and queues one is full with two in flight. Its scheduler
    is stopped meanwhile, so they stay in flight whatever the machine's speed."""
    args = ("--max-running-requests", "1", "--max-queued-requests", "1", "--skip-server-warmup",
            "--enable-metrics")  # fmt: skip
    short = {"text": "Hi", "sampling_params": {"max_new_tokens": 3}}
    with running_server(qwen3_moe_path, *args) as server:
        scheduler = spawned_children(server)[0]
        with httpx.Client(base_url=server.url, timeout=30.0) as http:
            assert http.get("/ready").json() == {"status": "ready"}
            with open_stream(http, LONG), stopped(scheduler):
                with ThreadPoolExecutor(1) as pool:
                    # It waits for the stopped scheduler: longer than httpx's default 5 s
                    # read timeout on a slow machine.
                    queued = pool.submit(
                        httpx.post, server.url + "/generate", json=short, timeout=60.0
                    )
                    deadline = time.monotonic() + 10
                    while http.get("/ready").status_code == 200 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    assert_overloaded(http.get("/ready"))
                    assert_overloaded(http.post("/generate", json=short))
                    body = {"prompt": "Hi", "max_tokens": 2}
                    assert_overloaded(http.post("/v1/completions", json=body))
                    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                    with pytest.raises(openai.APIStatusError) as error:
                        client.chat.completions.create(
                            model=qwen3_moe_path, messages=[{"role": "user", "content": "Hi"}]
                        )
                    assert error.value.status_code == 503
                    assert http.get("/health").status_code == 200  # alive, only full
                    assert http.get("/health_generate").status_code == 503
                    os.kill(scheduler, signal.SIGCONT)
            # The stream was closed (its request aborted) and the queued request ran.
            assert queued.result().json()["meta_info"]["completion_tokens"] == 3
            assert http.get("/ready").status_code == 200
            assert http.post("/generate", json=short).json()["meta_info"]["completion_tokens"] == 3
            metrics = http.get("/metrics").text
            rejected = f'srt:num_rejected_requests_total{{model_name="{qwen3_moe_path}"}} 4.0'
            assert rejected in metrics, metrics
        assert_pool_full(internal_state(server.url))


# Dual-batch overlap on every step of two or more tokens: the rank stops inside a step whose
# micro-batches run in their threads.
DBO = ("--moe-a2a-backend", "torch", "--enable-dbo", "--dbo-decode-token-threshold", "2",
       "--dbo-prefill-token-threshold", "2")  # fmt: skip


def wait_for_dbo_decode(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not internal_state(url).get("num_dbo_steps", {}).get("decode"):
        assert time.monotonic() < deadline, "no decode step ran dual-batch overlap"
        time.sleep(0.05)


@pytest.mark.parametrize("flags, streams", [((), 1), (DBO, 2)], ids=["plain", "dbo"])
def test_hung_rank_ends_the_server_naming_it(qwen3_moe_path: str, flags, streams) -> None:
    """Rank 1 of two is stopped (SIGSTOP) mid-decode: rank 0's collective times out, the
    heartbeats name rank 1, the stream in flight ends with that error, and the server exits
    non-zero within the watchdog timeout plus 5 s, leaving no process or IPC directory. Under
    dual-batch overlap (two streams: every decode step splits) the same holds, threads and all."""
    timeout = 3.0
    server = ServerProcess(qwen3_moe_path, "--tp", "2", "--watchdog-timeout", str(timeout), *flags)
    rank1 = None
    try:
        server.wait_healthy()
        children = server.children()
        rank1 = spawned_children(server)[1]
        with contextlib.ExitStack() as stack:
            https = [stack.enter_context(httpx.Client(base_url=server.url, timeout=30.0))
                     for _ in range(streams)]  # fmt: skip
            opened = [stack.enter_context(open_stream(http, LONG)) for http in https]
            if flags:
                wait_for_dbo_decode(server.url)
            os.kill(rank1, signal.SIGSTOP)
            stopped_at = time.monotonic()
            lines = [line for line in opened[-1] if "[DONE]" not in line]
            rest = [json.loads(line[len("data: ") :]) for line in lines]
        error = rest[-1]["error"]["message"]
        assert "scheduler rank 0" in error and "silent peers: rank 1 (node 0)" in error, error
        code = server.wait_exit(timeout + 5.0 - (time.monotonic() - stopped_at))
        log = server.log()
        assert code is not None and code != 0, f"still running, or exit 0:\n{log}"
        assert "silent peers: rank 1" in log, log
        assert wait_gone(children, timeout=5.0) == [], "children left behind"
        assert not any(os.path.exists(path) for path in server.ipc_dirs), server.ipc_dirs
    finally:
        if rank1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGKILL)
        server.stop()
        server.remove_log()
