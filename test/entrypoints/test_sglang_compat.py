"""SGLang's own clients against the real server: the exact bodies that sglang.bench_serving
(native backend), the SGLang frontend (``gen``, ``select``) and bench_one_batch_server send;
/server_info and /model_info; the SGLang and OpenAI extras srt implements (n, logit_bias,
echo, stop_regex, no_stop_trim, stream_interval, return_text_in_logprobs, structured output)
and cached-token reports; every unimplemented field refused by name when set; SGLang's batch log
lines and --log-requests while benchmark/serving/bench_serving.py runs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.batch_log import decode_lines, prefill_lines
from helpers.http_client import generate, stream_generate
from helpers.server_process import ServerProcess, assert_pool_full, running_server, wait_idle

from benchmark.serving import bench_serving

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("print_server_log")]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(qwen3_moe_path: str) -> Iterator[ServerProcess]:
    """JSON constraints with at most one whitespace character in a row (a random model
    otherwise fills them with whitespace until max_new_tokens); Qwen tool calls parsed; a
    decode log line every 4 steps and every request logged without its content."""
    args = ("--constrained-json-max-whitespace-cnt", "1", "--tool-call-parser", "qwen25")
    args += ("--decode-log-interval", "4", "--log-requests", "--log-requests-level", "0")
    with running_server(qwen3_moe_path, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(qwen3_moe_path: str) -> str:
    return qwen3_moe_path


def test_bench_serving_native_request(http: httpx.Client) -> None:
    events = stream_generate(
        http,
        text=PROMPT,
        sampling_params={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
        lora_path=None,
        return_logprob=False,
        return_routed_experts=False,
        logprob_start_len=-1,
    )
    assert events[-1]["meta_info"]["completion_tokens"] == 6
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


FRONTEND_PARAMS = {  # what sgl.gen sends: SglSamplingParams.to_srt_kwargs() at its defaults
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "max_new_tokens": 5,
    "min_new_tokens": 0,
    "n": 1,
    "stop": [],
    "stop_token_ids": [],
    "stop_regex": [],
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": True,
    "regex": None,
    "json_schema": None,
}


def test_frontend_gen_and_select(http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()  # RuntimeEndpoint's first call
    assert info["model_path"]
    out = generate(http, text=PROMPT, sampling_params=FRONTEND_PARAMS)
    assert out["meta_info"]["completion_tokens"] == 5
    # select: cache the prefix, then score each choice with text in its logprobs.
    prefix = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 0})
    start = max(prefix["meta_info"]["prompt_tokens"] - 2, 0)
    outs = generate(
        http,
        text=[PROMPT + " Paris", PROMPT + " a city"],
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True,
        return_text_in_logprobs=True,
        logprob_start_len=start,
    )
    for out in outs:
        entries = out["meta_info"]["input_token_logprobs"]
        assert entries and all(isinstance(e[2], str) and e[0] is not None for e in entries)
        assert out["meta_info"]["output_token_logprobs"] == []
    assert "".join(e[2] for e in outs[0]["meta_info"]["input_token_logprobs"]).endswith(" Paris")


def test_bench_one_batch_server_request(http: httpx.Client) -> None:
    info = http.get("/server_info").json()
    state = info["internal_states"][0]
    assert info["tokenizer_path"] and info["version"]
    assert state["effective_max_running_requests_per_dp"] > 0
    assert state["memory_usage"]["token_capacity"] == state["max_total_num_tokens"]
    params = {
        "temperature": 0.0,
        "max_new_tokens": 7,
        "ignore_eos": True,
        "json_schema": None,
        "stream_interval": 3,
    }
    events = stream_generate(
        http, input_ids=[[11, 12, 13], [14, 15]], sampling_params=params, return_logprob=False
    )
    for index in (0, 1):
        counts = [e["meta_info"]["completion_tokens"] for e in events if e["index"] == index]
        # The scheduler sends the first token at once, then every 3 tokens: 1, 4, 7. Like
        # SGLang's, the tokenizer side hands a stream its latest state, so when its process is
        # descheduled while two updates arrive (a loaded machine) they reach the client as one.
        assert counts[-1] == 7 and counts == sorted(set(counts)), counts
        assert set(counts) <= {1, 4, 7}, counts
    model_info = http.get("/model_info").json()
    assert model_info["served_model_name"] and model_info["model_type"] == "qwen3_moe"


@pytest.mark.parametrize(
    "field, value",
    [
        ("lora_path", "adapter-1"),
        ("lora_path", ["adapter-1"]),
        ("return_routed_experts", True),
        ("return_hidden_states", True),
        ("image_data", "cat.png"),
        ("priority", 1),
        ("token_ids_logprob", [1, 2]),
    ],
)
def test_unimplemented_fields_are_refused_by_name(
    http: httpx.Client, field: str, value: object
) -> None:
    response = http.post("/generate", json={"text": PROMPT, field: value})
    assert response.status_code == 400 and field in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "name, value",
    [("structural_tag", "{}"), ("beam_width", 4), ("custom_params", {"a": 1})],
)
def test_unimplemented_sampling_params_are_refused_by_name(
    http: httpx.Client, name: str, value: object
) -> None:
    response = http.post("/generate", json={"text": PROMPT, "sampling_params": {name: value}})
    assert response.status_code == 400 and name in response.json()["error"]["message"]


def test_unknown_fields_stay_errors(http: httpx.Client) -> None:
    response = http.post("/generate", json={"text": PROMPT, "no_such_field": 1})
    assert response.status_code == 400 and "no_such_field" in response.text


def test_n_samples_share_the_prompt(http: httpx.Client, client: openai.OpenAI, model: str) -> None:
    prompt = PROMPT + " and the capital of Italy is"
    params = {"temperature": 1.0, "max_new_tokens": 4, "n": 3, "sampling_seed": 5}
    outs = generate(http, text=prompt, sampling_params=params)
    assert len(outs) == 3
    prompt_len = outs[0]["meta_info"]["prompt_tokens"]
    # The prompt was prefilled once; every sample found it in the prefix cache.
    assert all(o["meta_info"]["cached_tokens"] == prompt_len - 1 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # seeds 5, 6, 7
    again = generate(http, text=prompt, sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3
    )
    assert [c.index for c in chat.choices] == [0, 1]
    completion = client.completions.create(
        model=model, prompt=[prompt, "1 2 3"], n=2, max_tokens=3, temperature=0
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[0].text == completion.choices[1].text  # greedy
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens_details.cached_tokens > 0
    assert_pool_full(wait_idle(server_url(http)))


def server_url(http: httpx.Client) -> str:
    return str(http.base_url).rstrip("/")


def test_logit_bias_forces_a_token(http: httpx.Client, client: openai.OpenAI, model: str) -> None:
    token = 300
    params = {"temperature": 0, "max_new_tokens": 3, "logit_bias": {str(token): 100}}
    out = generate(http, text=PROMPT, sampling_params=params)
    assert out["output_ids"] == [token] * 3
    completion = client.completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=2, temperature=0, logit_bias={token: 100}
    )
    # echo: the prompt's text comes first; with logprobs, its tokens too.
    echoed = client.completions.create(
        model=model, prompt=[5, 6, 7, token, token], max_tokens=0, echo=True, logprobs=1
    )
    assert echoed.choices[0].text.endswith(completion.choices[0].text)
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    assert len(echoed.choices[0].logprobs.tokens) == 5


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    prompt = "A repeated prompt, long enough to be worth caching: " + "lorem ipsum " * 8
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    second = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, extra_body={"return_cached_tokens_details": True}
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    # SGLang's cache report (sglang.bench_serving --cache-report asks for it).
    details = second.to_dict()["sglext"]["cached_tokens_details"]
    assert details == {"device": first.usage.prompt_tokens - 1, "host": 0}
    assert "sglext" not in first.to_dict()
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1, stream=True,
        extra_body={"return_cached_tokens_details": True},
    )  # fmt: skip
    extensions = [c.to_dict()["sglext"] for c in chunks if "sglext" in c.to_dict()]
    assert len(extensions) == 1 and "device" in extensions[0]["cached_tokens_details"]


def test_stop_regex_and_no_stop_trim(http: httpx.Client) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    full = generate(http, text=PROMPT, sampling_params=greedy)["text"]
    stop = full[2:5]  # a piece of what greedy decoding writes
    pattern = "".join(f"[{c}]" if c.isalnum() else f"\\{c}" if not c.isspace() else c for c in stop)
    out = generate(http, text=PROMPT, sampling_params={**greedy, "stop_regex": pattern})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern, "regex": True}
    assert out["text"] == full[: full.index(stop)]
    kept = generate(
        http, text=PROMPT, sampling_params={**greedy, "stop_regex": pattern, "no_stop_trim": True}
    )
    assert kept["text"] == full[: full.index(stop) + len(stop)]
    kept = generate(
        http, text=PROMPT, sampling_params={**greedy, "stop": stop, "no_stop_trim": True}
    )
    assert kept["text"] == full[: full.index(stop) + len(stop)]
    bad = http.post("/generate", json={"text": PROMPT, "sampling_params": {"stop_regex": "("}})
    assert bad.status_code == 400 and "stop_regex" in bad.text


REGEX = r"(yes|no), [0-9]{1,3}"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["city", "rank"],
}


def _check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "rank"} and value["rank"] in range(1000), text
    assert isinstance(value["city"], str) and len(value["city"]) <= 8, text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_follow_their_grammar(http: httpx.Client, temperature: float) -> None:
    """Several prompts, each kind of constraint, batched with unconstrained requests."""
    base = {"temperature": temperature, "max_new_tokens": 48, "sampling_seed": 3}
    prompts = ["Is it raining? ", "Where do you live? ", "List digits: ", "Tell me a story"]
    params = [
        {**base, "regex": REGEX},
        {**base, "json_schema": json.dumps(SCHEMA)},
        {**base, "ebnf": 'root ::= "[" [0-9] ("," [0-9])* "]"'},
        {**base, "max_new_tokens": 8, "ignore_eos": True},
    ]
    outs = generate(http, text=prompts, sampling_params=params)
    assert re.fullmatch(REGEX, outs[0]["text"]), outs[0]["text"]
    _check_schema(outs[1]["text"])
    assert re.fullmatch(r"\[[0-9](,[0-9])*\]", outs[2]["text"]), outs[2]["text"]
    for out in outs[:3]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert outs[3]["meta_info"]["completion_tokens"] == 8
    again = generate(http, text=prompts[0], sampling_params=params[0])
    assert again["text"] == outs[0]["text"]  # greedy, or the same seed


def test_response_format_on_openai_routes(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Where is the tower?"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    for temperature in (0.0, 1.0):
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=48, temperature=temperature, seed=1,
            response_format=schema_format, n=2,
        )  # fmt: skip
        for choice in chat.choices:
            _check_schema(choice.message.content)
    completion = client.completions.create(
        model=model, prompt="Answer: ", max_tokens=16, extra_body={"regex": REGEX}
    )
    assert re.fullmatch(REGEX, completion.choices[0].text)
    obj = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: a JSON object's beginning
        assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "params, words",
    [
        ({"regex": "(a"}, ["regex is not valid"]),
        ({"json_schema": "{not json"}, ["json_schema is not valid"]),
        ({"ebnf": "root ::="}, ["ebnf is not valid"]),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, ["only one of"]),
    ],
)
def test_bad_constraints_are_400(http: httpx.Client, params: dict, words: list[str]) -> None:
    response = http.post("/generate", json={"text": PROMPT, "sampling_params": params})
    assert response.status_code == 400
    assert all(w in response.json()["error"]["message"] for w in words), response.text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}},
}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls(client: openai.OpenAI, model: str, stream: bool) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, names in (("required", {"get_weather", "now"}), (WEATHER, {"get_weather"})):
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": "get_weather"}}
        kwargs = dict(
            model=model, messages=messages, tools=[WEATHER, NOW], tool_choice=choice,
            max_tokens=150, temperature=0,
        )  # fmt: skip
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            calls = [call for d in deltas for call in d.tool_calls or ()]
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            out = client.chat.completions.create(**kwargs).choices[0]
            calls, reason = out.message.tool_calls, out.finish_reason
        assert reason == "tool_calls" and len(calls) == 1, calls
        call = calls[0]
        assert call.function.name in names and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 10
    # The call and its result go back into the conversation.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    follow_up = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER, NOW], max_tokens=4, temperature=0
    )
    assert follow_up.choices[0].message.content is not None


def test_tools_need_a_parser_or_none(http: httpx.Client, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "tools": [NOW]}
    auto = http.post("/v1/chat/completions", json={**body, "max_tokens": 3})
    assert auto.status_code == 200, auto.text
    assert auto.json()["choices"][0]["finish_reason"] in ("stop", "length")
    off = http.post("/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 3})
    assert off.status_code == 200 and "tool_calls" not in off.json()["choices"][0]["message"]


FINISH_LINE = re.compile(
    r"Finish: rid='\w+', prompt_tokens=(\d+), completion_tokens=(\d+), cached_tokens=\d+, "
    r"finish_reason=\{'type': 'length', 'length': 8\}, latency=\d+\.\d{3}$",
    re.M,
)


def test_logs_under_bench_serving(server: ServerProcess) -> None:
    """SGLang's batch lines while bench_serving runs: every prompt token computed or
    found in the cache, a decode line within 4 steps; one received and one finished line per
    request, with its token counts and no content (level 0)."""
    start = server.log_size()
    args = bench_serving.parse_args(
        [
            *("--backend", "sglang", "--base-url", server.url, "--num-prompts", "4"),
            *("--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "1"),
            *("--warmup-requests", "0", "--disable-tqdm"),
        ]
    )
    result = bench_serving.run_benchmark(args)
    assert result["completed"] == 4
    wait_idle(server.url)
    log = server.log(start)
    prefills, decodes = prefill_lines(log), decode_lines(log)
    assert sum(new + cached for _, new, cached, *_ in prefills) == result["total_input_tokens"]
    assert decodes and all(1 <= running <= 4 for running, *_ in decodes), log
    finished = sorted((int(m[1]), int(m[2])) for m in FINISH_LINE.finditer(log))
    assert finished == sorted(zip(result["input_lens"], result["output_lens"])), log
    assert log.count("Receive: rid=") == 4
    assert "input_ids=" not in log and "text=" not in log and "sampling_params=" not in log
