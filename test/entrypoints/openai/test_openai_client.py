"""The official openai client against the routes, served by uvicorn on a loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from openai_fakes import MODEL, FakeTokenizerManager

from srt.entrypoints.openai import add_openai_routes

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tm() -> FakeTokenizerManager:
    return FakeTokenizerManager()


@pytest.fixture(scope="module")
def base_url(tm: FakeTokenizerManager) -> Iterator[str]:
    app = FastAPI()
    add_openai_routes(app, tm)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "srt"


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=1)
    assert out.object == "text_completion" and out.choices[0].text == "Hello world!"
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].logprobs.tokens == ["Hello", " world", "!"]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 3)


def test_completion_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, logprobs=True, top_logprobs=1, seed=3
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == "Hello world"
    assert out.choices[0].finish_reason == "length"
    assert [t.token for t in out.choices[0].logprobs.content] == ["Hello", " world"]
    assert out.usage.completion_tokens == 2


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world! How are you?"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-4", messages=USER)
    assert info.value.status_code == 400 and "gpt-4" in info.value.message
    with pytest.raises(openai.BadRequestError, match="lora_path"):
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"lora_path": "a"})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=-1, stream=True)


def test_abort_mid_stream_raises(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="abort", stream=True)
    with pytest.raises(openai.APIError, match="Aborted by request"):
        list(stream)


def test_disconnect_mid_stream_aborts(base_url: str, tm: FakeTokenizerManager) -> None:
    body = {"model": MODEL, "prompt": "slow", "stream": True}
    with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=10) as response:
        first = next(response.iter_lines())
    assert first.startswith("data: ")
    rid = tm.requests[-1].rid
    deadline = time.monotonic() + 5
    while rid not in tm.aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
