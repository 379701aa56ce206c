"""Bad requests and failure paths of the real HTTP server: a 400 with a JSON message naming the
problem, and the server keeps serving (each error is followed by a request that succeeds)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.server_process import (
    ServerProcess,
    assert_pool_full,
    internal_state,
    running_server,
    server_info,
    wait_idle,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("print_server_log")]

MAX_RUNNING = 2  # so that a request can be held in the scheduler's queue
LONG = 2000  # new tokens of a request that is aborted long before it could finish
OK_BODY = {"text": "Hello there", "sampling_params": {"max_new_tokens": 2}}
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(qwen3_moe_path: str) -> Iterator[ServerProcess]:
    with running_server(qwen3_moe_path, "--max-running-requests", str(MAX_RUNNING)) as srv:
        yield srv


def post(http: httpx.Client, route: str, body: dict | list | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(route, content=body, headers={"content-type": "application/json"})
    return http.post(route, json=body)


def assert_400(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    message = body["error"]["message"] if "error" in body else body["message"]
    for word in words:
        assert word.lower() in message.lower(), (word, message)


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post("/generate", json=OK_BODY)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["finish_reason"]["type"] == "length"


def sampling(**params) -> dict:
    return {"text": "Hello", "sampling_params": params}


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"text": "Hello",', ["malformed JSON"]),
        (b"\xff\xfe", ["malformed JSON"]),
        ([1, 2], ["JSON object"]),
        ({}, ["text", "input_ids"]),
        ({"sampling_params": {"max_new_tokens": 2}}, ["text", "input_ids"]),
        ({"text": "Hello", "input_ids": [1, 2]}, ["text", "input_ids"]),
        ({"text": 5}, ["text"]),
        ({"text": []}, ["text"]),
        ({"text": ""}, ["empty"]),
        ({"input_ids": "1 2 3"}, ["input_ids"]),
        ({"input_ids": [1, 2.5]}, ["input_ids"]),
        ({"text": "Hello", "sampling_params": "x"}, ["sampling_params"]),
        ({"text": ["a", "b"], "sampling_params": [{}]}, ["sampling_params"]),
        ({"text": "Hello", "stream": "yes"}, ["stream"]),
        ({"text": "Hello", "rid": 5}, ["rid"]),
        ({"text": "Hello", "foo": 1}, ["unknown", "foo"]),
        (sampling(max_new_tokens="5"), ["max_new_tokens"]),
        (sampling(max_new_tokens=-1), ["max_new_tokens"]),
        (sampling(max_new_tokens=100_000), ["max_new_tokens", "context"]),
        (sampling(temperature=-1), ["temperature"]),
        (sampling(top_p=1.5), ["top_p"]),
        (sampling(top_p=0), ["top_p"]),
        (sampling(top_k=0), ["top_k"]),
        (sampling(min_p=2), ["min_p"]),
        (sampling(repetition_penalty=0), ["repetition_penalty"]),
        (sampling(frequency_penalty=3), ["frequency_penalty"]),
        (sampling(stop=5), ["stop"]),
        (sampling(stop_token_ids=[1_000_000]), ["stop_token_ids"]),
        (sampling(max_new_token=5), ["unknown", "max_new_token"]),
        ({"input_ids": [1, 1_000_000]}, ["input_ids", "1000000"]),
        ({"input_ids": [-1]}, ["input_ids"]),
        ({"input_ids": [[1, 2], [3, 1_000_000]]}, ["input_ids"]),
        ({"text": ["Hello", ""]}, ["empty"]),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, ["rid"]),
        ({"text": "Hello", "return_logprob": "yes"}, ["return_logprob"]),
    ],
)
def test_generate_bad_input(http: httpx.Client, body: dict | list | bytes, words: list) -> None:
    assert_400(post(http, "/generate", body), *words)
    if isinstance(body, dict) and "stream" not in body:
        # The same mistake in a streamed request: a 400, not a 200 stream.
        assert_400(post(http, "/generate", {**body, "stream": True}), *words)
    assert_still_serving(http)


def test_prompt_longer_than_max_req_input_len(http: httpx.Client, server: ServerProcess) -> None:
    max_len = server_info(server.url)["max_req_input_len"]
    too_long = {"input_ids": [7] * (max_len + 1), "sampling_params": {"max_new_tokens": 1}}
    assert_400(post(http, "/generate", too_long), str(max_len + 1), str(max_len))
    assert_still_serving(http)
    longest = {"input_ids": [7] * max_len, "sampling_params": {"max_new_tokens": 1}}
    response = post(http, "/generate", longest)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["prompt_tokens"] == max_len


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"model": ', ["malformed JSON"]),
        ({"model": "no-such-model"}, ["no-such-model"]),
        ({"n": 0}, ["n"]),
        ({"max_tokens": "5"}, ["max_tokens"]),
        ({"temperature": -1}, ["temperature"]),
        ({"max_tokens": 100_000}, ["context"]),
    ],
)
def test_openai_bad_input(
    http: httpx.Client, route: str, body: dict | bytes, words: list[str]
) -> None:
    if isinstance(body, dict):
        prompt = {"messages": CHAT} if "chat" in route else {"prompt": "Hi"}
        body = {**prompt, **body}
    assert_400(post(http, route, body), *words)
    if isinstance(body, dict):
        assert_400(post(http, route, {**body, "stream": True}), *words)
    assert_still_serving(http)


def test_rid_of_a_running_request(http: httpx.Client, server: ServerProcess) -> None:
    body = {"text": "Hello", "rid": "dup", "stream": True}
    body["sampling_params"] = {"max_new_tokens": LONG, "ignore_eos": True}
    with http.stream("POST", "/generate", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert_400(post(http, "/generate", {**OK_BODY, "rid": "dup"}), "rid", "running")
        assert http.post("/abort_request", json={"rid": "dup"}).status_code == 200
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert_pool_full(wait_idle(server.url))
    assert_still_serving(http)


def wait_for_state(url: str, ready: Callable[[dict], bool], timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while not ready(state := internal_state(url)):
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


def test_stream_disconnect_while_queued(server: ServerProcess) -> None:
    """A streamed request whose client leaves while it still waits in the queue (no output yet)
    is dropped quietly: aborted, no error in the server's log, nothing leaked."""
    rids = [f"blocker-{i}" for i in range(MAX_RUNNING)]
    blockers = {"text": [f"Blocker {i}" for i in range(MAX_RUNNING)], "rid": rids}
    blockers["sampling_params"] = {"max_new_tokens": LONG, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, server.url + "/generate", json=blockers, timeout=60.0)
        wait_for_state(server.url, lambda s: s["num_running_reqs"] == MAX_RUNNING)
        log_start = server.log_size()
        victim = {"text": "victim", "stream": True, "sampling_params": {"max_new_tokens": 4}}
        with httpx.stream("POST", server.url + "/generate", json=victim, timeout=5.0) as r:
            assert r.status_code == 200  # the status line goes out before the first output
        state = wait_for_state(server.url, lambda s: s["num_waiting_reqs"] == 0)
        assert state["num_running_reqs"] == MAX_RUNNING  # the victim left the queue, aborted
        for rid in rids:
            assert httpx.post(server.url + "/abort_request", json={"rid": rid}).status_code == 200
        outs = future.result(timeout=30.0).json()
    assert [out["meta_info"]["finish_reason"]["type"] for out in outs] == ["abort"] * MAX_RUNNING
    assert_pool_full(wait_idle(server.url))
    log = server.log(log_start)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_unknown_routes_and_bad_abort(http: httpx.Client) -> None:
    for route in ("/no_such_route", "/v1/no_such_route", "/generate/x"):
        assert http.get(route).status_code == 404
        assert http.post(route, json={}).status_code == 404
    assert http.get("/v1/models/no-such-model").status_code == 404
    assert_400(post(http, "/abort_request", b"{bad"), "rid")
    assert_400(post(http, "/abort_request", {}), "rid")
    assert_still_serving(http)


def test_nothing_leaked(server: ServerProcess) -> None:
    assert_pool_full(wait_idle(server.url))
