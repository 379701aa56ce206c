"""Every refused request is a 400 with OpenAI's error object, streaming or not, and reaches the
TokenizerManager only when the refusal is the TokenizerManager's own."""

from __future__ import annotations

import pytest
from openai_fakes import MODEL, make_client

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def assert_400(response, *words: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"object", "message", "type", "code"}
    assert body["object"] == "error" and body["type"] == "BadRequestError"
    assert body["code"] == 400
    for word in words:
        assert word in body["message"], body["message"]


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("content", [b"{bad json", b"", b"[1, 2]", b'"text"'])
def test_malformed_body(client, tm, url: str, content: bytes) -> None:
    response = client.post(url, content=content, headers={"content-type": "application/json"})
    assert_400(response)
    assert not tm.requests


@pytest.mark.parametrize(
    "url, body, words",
    [
        (COMPLETIONS, {"max_tokens": 3}, ["prompt", "Field required"]),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, ["max_tokens", "integer"]),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, ["max_tokens"]),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, ["temperature"]),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, ["stream"]),
        (COMPLETIONS, {"prompt": [1, "a"]}, ["prompt"]),
        (COMPLETIONS, {"prompt": [True]}, ["prompt"]),
        (COMPLETIONS, {"prompt": "x", "stop": 5}, ["stop"]),
        (CHAT, {"messages": "Hi"}, ["messages"]),
        (CHAT, {"messages": [{"content": "Hi"}]}, ["messages.0.role", "Field required"]),
        (CHAT, {"messages": USER, "logprobs": 1}, ["logprobs"]),
        (CHAT, {"messages": USER, "stream_options": {"include_usage": "y"}}, ["include_usage"]),
    ],
)
def test_wrong_types(client, tm, url: str, body: dict, words: list[str]) -> None:
    assert_400(client.post(url, json=body), *words)
    assert not tm.requests


@pytest.mark.parametrize(
    "url, body, words",
    [
        (COMPLETIONS, {"prompt": "x", "n": 0}, ["n must be at least 1"]),
        (CHAT, {"messages": USER, "session_id": "s1"}, ["not supported", "session_id"]),
        (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, ["schema"]),
        (CHAT, {"messages": USER, "response_format": {"type": "grammar"}}, ["grammar"]),
        (
            COMPLETIONS,
            {"prompt": "x", "json_schema": "{}", "response_format": {"type": "json_object"}},
            ["response_format and json_schema"],
        ),
        (
            COMPLETIONS,
            {"prompt": "x", "lora_path": "a", "return_hidden_states": True},
            ["lora_path, return_hidden_states"],
        ),
        (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, ["gpt-4", MODEL]),
        (CHAT, {"messages": USER, "model": "gpt-4", "stream": True}, ["gpt-4"]),
        (COMPLETIONS, {"prompt": "x", "suffix": "y"}, ["suffix"]),
        (COMPLETIONS, {"prompt": "x", "best_of": 3}, ["best_of"]),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, ["logprobs"]),
        (COMPLETIONS, {"prompt": ""}, ["prompt must not be empty"]),
        (COMPLETIONS, {"prompt": []}, ["prompt must not be empty"]),
        (COMPLETIONS, {"prompt": ["a", ""]}, ["prompt must not be empty"]),
        (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, ["tools"]),
        (CHAT, {"messages": USER, "tool_choice": "required"}, ["tools"]),
        (CHAT, {"messages": USER, "functions": [{"name": "f"}]}, ["function"]),
        (CHAT, {"messages": USER, "top_logprobs": 2}, ["top_logprobs requires logprobs"]),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 99}, ["top_logprobs"]),
        (CHAT, {"messages": []}, ["messages must not be empty"]),
        (CHAT, {"messages": [{"role": "function", "content": "1"}]}, ["messages[0].role"]),
        (CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": named("other")}, ["other"]),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            ["messages[0].content", "image_url"],
        ),
    ],
)
def test_unsupported(client, tm, url: str, body: dict, words: list[str]) -> None:
    assert_400(client.post(url, json=body), *words)
    assert not tm.requests


@pytest.mark.parametrize("bias", [{"x": 1.0}, {"5": 101}, {"-1": 1}])
def test_bad_logit_bias(client, bias: dict) -> None:
    assert_400(client.post(COMPLETIONS, json={"prompt": "x", "logit_bias": bias}), "logit_bias")


def test_supported_neighbours_of_refused_values(client) -> None:
    """What OpenAI accepts next to a refused feature is still accepted."""
    bodies = [
        (CHAT, {"messages": USER, "tool_choice": "none", "tools": []}),
        (CHAT, {"messages": USER, "response_format": {"type": "text"}, "logit_bias": {}}),
        (COMPLETIONS, {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "suffix": ""}),
        # SGLang's extras at the values that leave them unused, as its clients send them.
        (CHAT, {"messages": USER, "regex": None, "lora_path": None, "separate_reasoning": True}),
        (COMPLETIONS, {"prompt": "x", "return_hidden_states": False, "json_schema": None}),
    ]
    for url, body in bodies:
        assert client.post(url, json=body).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "url, body, words",
    [
        (COMPLETIONS, {"prompt": "x", "temperature": -1}, ["temperature"]),
        (COMPLETIONS, {"prompt": [5, 99999]}, ["input_ids", "99999"]),
        (COMPLETIONS, {"prompt": "x" * 100}, ["prompt has 101 tokens"]),
        (COMPLETIONS, {"prompt": ["ok", "x" * 100]}, ["prompt has 101 tokens"]),
        (CHAT, {"messages": USER, "top_p": 0}, ["top_p"]),
        (CHAT, {"messages": USER, "min_tokens": 9, "max_tokens": 2}, ["min_new_tokens"]),
    ],
)
def test_value_error_from_tokenizer_manager(
    client, tm, url: str, body: dict, words: list[str], stream: bool
) -> None:
    """Streaming or not, the TokenizerManager's ValueError is a 400 before any SSE line."""
    response = client.post(url, json={**body, "stream": stream})
    assert_400(response, *words)
    assert response.headers["content-type"] == "application/json"
    assert tm.requests


def test_chat_prompt_longer_than_the_context(client, tm) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 80}], "stream": True}
    assert_400(client.post(CHAT, json=body), "no room", "64")


def test_chat_template_failure(tm) -> None:
    class NoTemplate:
        def apply_chat_template(self, *args, **kwargs) -> str:
            raise ValueError("this tokenizer has no chat template")

    tm.tokenizer = NoTemplate()
    response = make_client(tm).post(CHAT, json={"messages": USER})
    assert_400(response, "chat template", "no chat template")


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_one_refused_aborts_the_others(client, tm, stream: bool) -> None:
    body = {"prompt": ["fine", "fine too", "x" * 100], "stream": stream}
    assert_400(client.post(COMPLETIONS, json=body), "prompt has 101 tokens")
    assert len(tm.requests) == 3
    assert sorted(tm.aborted) == sorted(r.rid for r in tm.requests[:2])


def test_forced_tool_choice_and_another_grammar(client) -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "regex": "a"}
    assert_400(client.post(CHAT, json=body), "tool_choice", "grammar")
