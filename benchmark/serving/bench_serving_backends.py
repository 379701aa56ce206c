"""Request functions of bench_serving: one streamed or plain request per call, timed.

Each backend is data: the URL path it posts to, how it builds the body, and how it reads a
response (a streamed chunk or the whole non-streamed reply) into a `RequestOutput`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Long runs at high load keep streams open for a long time, and a 64 KiB read buffer can fill
# before the event loop reads it, so both limits are generous (as in SGLang's client).
SESSION_TIMEOUT_S = 6 * 60 * 60
READ_BUFSIZE_BYTES = 10 * 1024**2


@dataclass
class RequestInput:
    api_url: str
    prompt: str
    input_ids: list[int]
    prompt_len: int
    output_len: int
    model: str
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestOutput:
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    # None: the server did not say; counted later by re-tokenizing generated_text.
    output_len: int | None = None
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True)
class Backend:
    """How to talk to one server API.

    `read(data, out)` folds one response object (a streamed chunk, or the whole reply when not
    streaming) into `out` and returns how many new tokens it carried.
    """

    path: str
    body: Callable[[RequestInput], dict[str, Any]]
    read: Callable[[dict[str, Any], RequestOutput], int]


class ServerError(RuntimeError):
    pass


def merge_body(body: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Extra fields override the body; a dict value (sampling_params) is merged one level."""
    merged = dict(body)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _generate_body(inp: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": inp.input_ids} if inp.input_ids else {"text": inp.prompt}
    body["sampling_params"] = {
        "max_new_tokens": inp.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    body["stream"] = inp.stream
    return body


def _openai_body(inp: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": inp.model,
        "temperature": 0.0,
        "max_tokens": inp.output_len,
        "stream": inp.stream,
        "ignore_eos": True,
    }
    if inp.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _completion_body(inp: RequestInput) -> dict[str, Any]:
    return {**_openai_body(inp), "prompt": inp.prompt}


def _chat_body(inp: RequestInput) -> dict[str, Any]:
    return {**_openai_body(inp), "messages": [{"role": "user", "content": inp.prompt}]}


def _read_generate(data: dict[str, Any], out: RequestOutput) -> int:
    # /generate streams the cumulative text; meta_info counts the tokens so far.
    meta = data.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise ServerError(f"aborted: {finish.get('message', '')}")
    previous_text, previous_len = out.generated_text, out.output_len or 0
    out.generated_text = data.get("text", previous_text)
    if meta.get("completion_tokens") is not None:
        out.output_len = int(meta["completion_tokens"])
        return out.output_len - previous_len
    return int(out.generated_text != previous_text)


def _read_openai_text(out: RequestOutput, data: dict[str, Any], text: str | None) -> int:
    usage = data.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        out.output_len = int(usage["completion_tokens"])
    out.generated_text += text or ""
    return int(bool(text))


def _first_choice(data: dict[str, Any]) -> dict[str, Any]:
    choices = data.get("choices") or []
    return choices[0] if choices else {}


def _read_completion(data: dict[str, Any], out: RequestOutput) -> int:
    return _read_openai_text(out, data, _first_choice(data).get("text"))


def _read_chat(data: dict[str, Any], out: RequestOutput) -> int:
    choice = _first_choice(data)
    message = choice.get("delta") or choice.get("message") or {}
    return _read_openai_text(out, data, message.get("content"))


BACKENDS: dict[str, Backend] = {
    "sglang": Backend("/generate", _generate_body, _read_generate),
    "sglang-oai": Backend("/v1/completions", _completion_body, _read_completion),
    "sglang-oai-chat": Backend("/v1/chat/completions", _chat_body, _read_chat),
}


def make_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=SESSION_TIMEOUT_S),
        read_bufsize=READ_BUFSIZE_BYTES,
        connector=aiohttp.TCPConnector(limit=0),
    )


def _check_error(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ServerError(f"unexpected response: {str(data)[:200]}")
    if data.get("error"):
        raise ServerError(str(data["error"]))
    return data


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            return
        yield _check_error(json.loads(payload))


class _Clock:
    """Turns the arrival times of token-carrying chunks into TTFT and inter-token latencies."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = self.start
        self.is_first = True

    def tick(self, out: RequestOutput, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.perf_counter()
        if self.is_first:
            out.ttft = now - self.start
            self.is_first = False
        else:
            # A chunk carrying several tokens spreads its gap over them, as SGLang does.
            gap = (now - self.last) / num_new_tokens
            out.itl.extend([gap] * num_new_tokens)
        self.last = now

    def finish(self, out: RequestOutput) -> None:
        out.latency = time.perf_counter() - self.start
        if self.is_first:  # not streamed, or no token ever arrived
            out.ttft = out.latency
        out.success = True


async def send_request(
    session: aiohttp.ClientSession, backend: Backend, inp: RequestInput
) -> RequestOutput:
    """Send one request and time it; never raises, failures land in `error`."""
    out = RequestOutput(prompt_len=inp.prompt_len)
    body = merge_body(backend.body(inp), inp.extra_body)
    clock = _Clock()
    try:
        async with session.post(inp.api_url, json=body, headers=inp.headers) as response:
            if response.status != 200:
                text = await response.text()
                out.error = f"HTTP {response.status} {response.reason}: {text[:500]}"
                return out
            if inp.stream:
                async for data in _sse_events(response):
                    clock.tick(out, backend.read(data, out))
            else:
                backend.read(_check_error(await response.json(content_type=None)), out)
        clock.finish(out)
    except Exception as exc:  # any failure, network or protocol, fails this request only
        out.success = False
        out.error = f"{type(exc).__name__}: {exc}"
    return out
