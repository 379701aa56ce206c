from __future__ import annotations

import asyncio

from openai_fakes import MODEL, MODEL_PATH, FakeTokenizerManager, make_client, sse_events

from srt.entrypoints.openai.protocol import CompletionResponse
from srt.entrypoints.openai.serving_base import sse_body


def test_models(client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "srt"
    assert card["root"] == MODEL_PATH and card["max_model_len"] == 64
    assert isinstance(card["created"], int)
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["object"] == "error"


NO_CACHE = {"prompt_tokens_details": {"cached_tokens": 0}}


def test_completion(client, tm) -> None:
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 3,
        "temperature": 0,
        "seed": 7,
        "top_k": 5,
        "min_tokens": 1,
        "stop": ["zzz"],
        "user": "u",
        "unknown_field": 1,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["model"] == MODEL and isinstance(out["created"], int)
    assert out["choices"] == [
        {"index": 0, "text": "Hello world!", "logprobs": None, "finish_reason": "length"}
    ]
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        **NO_CACHE,
    }
    (obj,) = tm.requests
    assert obj.text == "Hi" and obj.input_ids is None and obj.stream is False
    assert obj.rid == out["id"] and obj.return_logprob is False
    assert obj.sampling_params == {
        "max_new_tokens": 3,
        "temperature": 0.0,
        "top_k": 5,
        "min_new_tokens": 1,
        "stop": ["zzz"],
        "sampling_seed": 7,
    }


def test_completion_defaults_and_model_path(client, tm) -> None:
    out = client.post("/v1/completions", json={"model": MODEL_PATH, "prompt": "Hi"}).json()
    assert out["model"] == MODEL_PATH
    assert tm.requests[0].sampling_params == {"max_new_tokens": 16}
    assert out["choices"][0]["text"] == "Hello world! How are you?"
    assert out["choices"][0]["finish_reason"] == "stop"  # EOS
    client.post("/v1/completions", json={"prompt": "Hi"})  # no model: the served one
    assert len(tm.requests) == 2


def test_completion_stop_string(client) -> None:
    body = {"model": MODEL, "prompt": "Hi", "stop": " How"}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "Hello world!" and choice["finish_reason"] == "stop"


def test_completion_token_ids_and_several_prompts(client, tm) -> None:
    out = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 1}).json()
    assert tm.requests[0].input_ids == [5, 6, 7, 8] and tm.requests[0].text is None
    assert out["usage"]["prompt_tokens"] == 4
    out = client.post("/v1/completions", json={"prompt": ["a", "bcd"], "max_tokens": 2}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["text"] for c in out["choices"]] == ["Hello world"] * 2
    assert out["usage"] == {
        "prompt_tokens": 2 + 4,
        "completion_tokens": 4,
        "total_tokens": 10,
        **NO_CACHE,
    }
    client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1})
    assert [r.input_ids for r in tm.requests[-2:]] == [[1, 2], [3]]
    assert len({r.rid for r in tm.requests}) == len(tm.requests)


def test_completion_logprobs(client, tm) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 2}
    logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert tm.requests[0].return_logprob and tm.requests[0].top_logprobs_num == 2
    assert logprobs["tokens"] == ["Hello", " world", "!"]
    assert logprobs["token_logprobs"] == [-0.5, -1.0, -1.5]
    assert logprobs["text_offset"] == [0, 5, 11]
    assert logprobs["top_logprobs"][0] == {"Hello": -0.5, " world": -1.5}
    assert len(logprobs["top_logprobs"]) == 3
    body["logprobs"] = 0
    logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] is None and len(logprobs["tokens"]) == 3


def test_completion_stream(client, tm) -> None:
    body = {
        "prompt": "Hi",
        "max_tokens": 3,
        "stream": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert tm.requests[0].stream is True
    assert {c["id"] for c in events[:-1]} == {usage_chunk["id"]}
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["Hello", " world", "!"]  # the finish rides the last token's chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 2 + ["length"]
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in chunks]
    assert offsets == [[0], [5], [11]]
    assert chunks[0]["choices"][0]["logprobs"]["top_logprobs"] == [{"Hello": -0.5}]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        **NO_CACHE,
    }


def test_completion_stream_sends_a_chunk_per_token(client) -> None:
    """A token whose text is held back (an incomplete UTF-8 sequence) still gets its chunk,
    empty, as vLLM sends it; its text comes with the next token's. The last token's chunk
    carries the finish reason: one chunk per token, none more."""
    events = sse_events(client, "/v1/completions", {"prompt": "held", "max_tokens": 4,
                                                    "stream": True})  # fmt: skip
    choices = [e["choices"][0] for e in events[:-1]]
    assert [c["text"] for c in choices] == ["Hello", "", " world!", " How"]
    assert [c["finish_reason"] for c in choices] == [None] * 3 + ["length"]


def test_streams_finished_by_one_step_send_their_last_tokens_before_closing() -> None:
    """One step finishes two streams (one event wakes both): each writes its last token before
    either writes [DONE], so the second stream's last token does not wait for the first's
    close."""
    writes: list[tuple[str, bytes]] = []

    async def main() -> None:
        step = asyncio.Event()

        async def chunks(name: str):
            await step.wait()
            yield CompletionResponse(id=name, created=0, model=MODEL, choices=[])

        async def stream(name: str) -> None:
            async for line in sse_body(chunks(name)):
                writes.append((name, line))

        tasks = [asyncio.create_task(stream(name)) for name in ("a", "b")]
        await asyncio.sleep(0)  # both wait for the step
        step.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    order = [(name, line.startswith(b"data: [DONE]")) for name, line in writes]
    assert order == [("a", False), ("b", False), ("a", True), ("b", True)]


def test_completion_stream_several_prompts(client) -> None:
    body = {"prompt": ["a", "b"], "max_tokens": 2, "stream": True}
    events = sse_events(client, "/v1/completions", body)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    for index in (0, 1):
        choices = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in choices) == "Hello world"
        assert choices[-1]["finish_reason"] == "length"


def test_abort_is_an_error(client) -> None:
    response = client.post("/v1/completions", json={"prompt": "please abort"})
    assert response.status_code == 400
    assert response.json() == {
        "object": "error",
        "message": "Aborted by request.",
        "type": "BadRequestError",
        "code": 400,
    }
    events = sse_events(client, "/v1/completions", {"prompt": "abort", "stream": True})
    assert events[0]["choices"][0]["text"] == "Hello"
    assert events[-2] == {
        "error": {
            "object": "error",
            "message": "Aborted by request.",
            "type": "BadRequestError",
            "code": 400,
        }
    }
    assert events[-1] == "[DONE]"


def test_token_text_from_the_runtime_is_used() -> None:
    client = make_client(FakeTokenizerManager(token_text=True))
    body = {"prompt": "Hi", "max_tokens": 2, "logprobs": 0}
    logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<0>", "<1>"] and logprobs["text_offset"] == [0, 3]


def test_n_choices_per_prompt(client, tm) -> None:
    body = {"prompt": ["a", "bcd"], "max_tokens": 2, "n": 2}
    out = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [r.text for r in tm.requests] == ["a", "a", "bcd", "bcd"]
    assert len({r.rid for r in tm.requests}) == 4
    # Each prompt counts once, each choice's tokens count.
    assert out["usage"]["prompt_tokens"] == 2 + 4 and out["usage"]["completion_tokens"] == 8


def test_echo(client, tm) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "echo": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "HiHello world"
    events = sse_events(client, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "HiHello world"
    assert events[0]["choices"][0]["text"].startswith("Hi")
