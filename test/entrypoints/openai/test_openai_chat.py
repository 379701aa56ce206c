from __future__ import annotations

from openai_fakes import MODEL, FakeTokenizer, FakeTokenizerManager, make_client, sse_events

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROMPT = "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


def test_chat(client, tm) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "presence_penalty": 0.1,
        "stop_token_ids": [3],
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["model"] == MODEL and isinstance(out["created"], int)
    assert out["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    prompt_ids = FakeTokenizer().encode(PROMPT, add_special_tokens=False)
    assert out["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 2,
        "total_tokens": len(prompt_ids) + 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    (obj,) = tm.requests
    assert obj.input_ids == prompt_ids and obj.text is None  # no second BOS
    assert obj.sampling_params == {
        "max_new_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "presence_penalty": 0.1,
        "stop_token_ids": [3],
    }


def test_chat_content_parts_roles_and_max_tokens(client, tm) -> None:
    messages = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "user", "content": "Hi", "name": "bob"},
    ]
    body = {"messages": messages, "max_tokens": 5, "max_completion_tokens": 1}
    out = client.post("/v1/chat/completions", json=body).json()
    assert out["choices"][0]["message"]["content"] == "Hello"
    assert tm.requests[0].input_ids == FakeTokenizer().encode(PROMPT, add_special_tokens=False)
    assert tm.requests[0].sampling_params["max_new_tokens"] == 1


def test_chat_default_length_is_the_rest_of_the_context(client, tm) -> None:
    out = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert tm.requests[0].sampling_params["max_new_tokens"] == 64 - len(PROMPT)


def test_chat_logprobs(client, tm) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    logprobs = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert tm.requests[0].return_logprob and tm.requests[0].top_logprobs_num == 2
    first, second = logprobs["content"]
    assert first == {
        "token": "Hello",
        "logprob": -0.5,
        "bytes": list(b"Hello"),
        "top_logprobs": [
            {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
            {"token": " world", "logprob": -1.5, "bytes": list(b" world")},
        ],
    }
    assert second["token"] == " world" and len(second["top_logprobs"]) == 2
    body = {"messages": MESSAGES, "max_tokens": 1, "logprobs": True}
    logprobs = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["content"][0]["top_logprobs"] == []


def test_chat_stream(client, tm) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 3,
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert {c["id"] for c in events[:-1]} == {usage_chunk["id"]}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    assert [c["delta"] for c in choices[1:]] == [
        {"content": "Hello"},
        {"content": " world"},
        {"content": "!"},
        {},
    ]
    assert [c["finish_reason"] for c in choices[1:]] == [None, None, None, "length"]
    tokens = [c["logprobs"]["content"][0]["token"] for c in choices[1:4]]
    assert tokens == ["Hello", " world", "!"] and choices[-1]["logprobs"] is None
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    total = usage_chunk["usage"]["prompt_tokens"] + 3
    assert usage_chunk["usage"]["total_tokens"] == total


def test_chat_stream_sends_a_chunk_per_token(client) -> None:
    body = {"messages": [{"role": "user", "content": "held"}], "max_tokens": 3, "stream": True}
    choices = [e["choices"][0] for e in sse_events(client, "/v1/chat/completions", body)[:-1]]
    assert [c["delta"].get("content") for c in choices] == ["", "Hello", "", " world!", None]
    assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"]


def test_chat_stream_without_usage(client) -> None:
    events = sse_events(client, "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "Hello world! How are you?"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_chat_template_of_a_real_tokenizer(qwen3_moe_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_moe_path)
    tm = FakeTokenizerManager(tokenizer=tokenizer)
    client = make_client(tm)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tm.requests[0].input_ids == tokenizer.encode(expected, add_special_tokens=False)
