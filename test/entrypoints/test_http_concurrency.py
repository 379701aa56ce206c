"""The real HTTP server under concurrent streams and client disconnects: every request finishes
or is aborted, and the KV pool is full again afterwards."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from helpers.server_process import (
    ServerProcess,
    assert_pool_full,
    internal_state,
    wait_idle,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("print_server_log")]

NUM_STREAMS = 64
LONG = 2000  # new tokens of a request that must be aborted long before it could finish
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def prompt(i: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 9))


async def one_stream(client: httpx.AsyncClient, i: int) -> tuple[int, list[str]]:
    max_new_tokens = 16 + i % 17
    body = {"text": prompt(i), "stream": True}
    body["sampling_params"] = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    async with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    return max_new_tokens, [line[len("data: ") :] for line in lines]


async def many_streams(url: str) -> list[tuple[int, list[str]]]:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, i) for i in range(NUM_STREAMS)))


def test_concurrent_streams_all_finish(server: ServerProcess) -> None:
    results = asyncio.run(many_streams(server.url))
    for max_new_tokens, payloads in results:
        assert payloads[-1] == "[DONE]"
        final = json.loads(payloads[-2])
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": max_new_tokens}
        assert final["meta_info"]["completion_tokens"] == len(final["output_ids"])
        assert len(final["output_ids"]) == max_new_tokens
    assert len({json.loads(p[-2])["meta_info"]["id"] for _, p in results}) == NUM_STREAMS
    assert_pool_full(wait_idle(server.url, timeout=10.0))


def assert_aborted(server: ServerProcess, steps_before: int) -> None:
    """Idle within a few seconds, fewer forward steps than the request would have needed to
    finish (so it was aborted, not completed), and the KV pool full again."""
    state = wait_idle(server.url, timeout=8.0)
    assert state["num_forward_steps"] - steps_before < LONG, state
    assert_pool_full(state)


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_stream_disconnect_aborts(server: ServerProcess, route: str) -> None:
    if route == "/generate":
        body = {"text": prompt(1), "stream": True}
        body["sampling_params"] = {"max_new_tokens": LONG, "ignore_eos": True}
    else:
        body = {"messages": [{"role": "user", "content": prompt(2)}], "stream": True}
        body.update(max_tokens=LONG, ignore_eos=True)
    steps_before = internal_state(server.url)["num_forward_steps"]
    log_start = server.log_size()
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        with client.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
    assert chunks == 3
    assert_aborted(server, steps_before)
    assert "Traceback" not in server.log(log_start)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_non_stream_disconnect_aborts(server: ServerProcess, route: str) -> None:
    if route == "/generate":
        body = {"text": prompt(3), "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    else:
        body = {"prompt": prompt(4), "max_tokens": LONG, "ignore_eos": True}
    steps_before = internal_state(server.url)["num_forward_steps"]
    log_start = server.log_size()
    with httpx.Client(base_url=server.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(route, json=body)
    # The server looks for a disconnected client about once a second.
    assert_aborted(server, steps_before)
    assert "Traceback" not in server.log(log_start)


def test_non_stream_batch_disconnect_aborts_every_prompt_at_once(server: ServerProcess) -> None:
    """A disconnected batch request is aborted as a whole, not one prompt per disconnect check
    (which would leave the others generating for nobody, one more second each)."""
    num_prompts, max_new_tokens = 3, 1300  # all fit in the 4096-token pool together
    body = {"text": [prompt(10 + i) for i in range(num_prompts)]}
    body["sampling_params"] = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    steps_before = internal_state(server.url)["num_forward_steps"]
    with httpx.Client(base_url=server.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json=body)
    first_abort = None
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        state = internal_state(server.url)
        running = state["num_running_reqs"] + state["num_waiting_reqs"]
        if running < num_prompts and first_abort is None:
            first_abort = time.monotonic()
        if running == 0:
            break
        time.sleep(0.05)
    assert running == 0, state
    assert state["num_forward_steps"] - steps_before < max_new_tokens, "not aborted"
    spread = time.monotonic() - first_abort
    assert spread < 0.5, f"the prompts were aborted over {spread:.1f} s, one at a time"
    assert_pool_full(wait_idle(server.url))
