"""Calls of a running server's native routes, checked as they go (status 200, SSE framing)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


def generate(http: httpx.Client, **body) -> dict | list[dict]:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The payloads of the ``data:`` lines of an SSE body."""
    return (line[len("data: ") :] for line in lines if line.startswith("data: "))


def stream_generate(http: httpx.Client, **body) -> list[dict]:
    """The JSON events of a streamed /generate, after checking it ends with [DONE]."""
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = list(sse_data(response.iter_lines()))
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]
