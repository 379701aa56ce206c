"""The real HTTP server end to end (``python -m launch_server`` on a loopback port): the openai
client, native /generate (single, batch, stream), parity with srt.Engine, and the other routes."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from helpers.http_client import generate, sse_data, stream_generate
from helpers.server_process import ServerProcess, assert_pool_full, wait_idle
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

import srt
from srt.model_executor.cpu_threads import OPENMP_SPIN_COUNT

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("print_server_log")]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1 2 3 4 5",
    "Hello",
]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(qwen3_moe_path: str):
    return AutoTokenizer.from_pretrained(qwen3_moe_path)


# ------------------------------------------------------------------------------ OpenAI
def test_openai_models(client: openai.OpenAI, qwen3_moe_path: str) -> None:
    assert [model.id for model in client.models.list()] == [qwen3_moe_path]


def test_openai_completion(client: openai.OpenAI, tokenizer, qwen3_moe_path: str) -> None:
    kwargs = dict(model=qwen3_moe_path, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    out = client.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    num_prompt = len(tokenizer.encode(PROMPTS[0]))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt, 8)
    assert out.usage.total_tokens == num_prompt + 8

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert len(chunks) == 8 and chunks[-1].choices[0].finish_reason == "length"  # one a token
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(out.usage)
    # The same prompt a third time: all but its last token came from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == num_prompt - 1


def counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_openai_chat(client: openai.OpenAI, tokenizer, qwen3_moe_path: str) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(model=qwen3_moe_path, messages=messages, max_tokens=10, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    num_prompt = len(tokenizer.encode(template, add_special_tokens=False))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt, 10)
    assert out.usage.total_tokens == num_prompt + 10

    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(out.usage)
    assert all(c.usage is None for c in chunks[:-1])


# ------------------------------------------------------------------------------ /generate
def assert_meta(out: dict, num_prompt: int, max_new_tokens: int) -> None:
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == num_prompt
    assert meta["completion_tokens"] == len(out["output_ids"]) == max_new_tokens
    assert meta["finish_reason"] == {"type": "length", "length": max_new_tokens}
    assert meta["e2e_latency"] > 0
    assert 0 <= meta["cached_tokens"] < num_prompt
    assert isinstance(meta["id"], str) and isinstance(out["text"], str)


def test_generate_text_and_input_ids(http: httpx.Client, tokenizer) -> None:
    assert http.post("/flush_cache").status_code == 200
    ids = tokenizer.encode(PROMPTS[2])
    params = {**GREEDY, "max_new_tokens": 12}
    by_text = generate(http, text=PROMPTS[2], sampling_params=params)
    assert_meta(by_text, len(ids), 12)
    assert by_text["meta_info"]["cached_tokens"] == 0  # the cache was just flushed
    assert by_text["text"] == tokenizer.decode(by_text["output_ids"])
    by_ids = generate(http, input_ids=ids, sampling_params=params)
    assert_meta(by_ids, len(ids), 12)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["meta_info"]["cached_tokens"] > 0  # the same prompt again: a prefix hit


def test_generate_batch(http: httpx.Client, tokenizer) -> None:
    params = [{**GREEDY, "max_new_tokens": n} for n in (3, 5, 7)]
    outs = generate(http, text=PROMPTS[:3], sampling_params=params)
    assert isinstance(outs, list) and len(outs) == 3
    for prompt, out, p in zip(PROMPTS, outs, params):
        assert_meta(out, len(tokenizer.encode(prompt)), p["max_new_tokens"])
    assert len({out["meta_info"]["id"] for out in outs}) == 3
    outs = generate(http, input_ids=[tokenizer.encode(p) for p in PROMPTS[3:]], sampling_params={})
    assert len(outs) == 2 and all(out["meta_info"]["finish_reason"] for out in outs)


def test_generate_stream(http: httpx.Client, tokenizer) -> None:
    params = {**GREEDY, "max_new_tokens": 10}
    events = stream_generate(http, text=PROMPTS[1], sampling_params=params)
    final = events[-1]
    assert_meta(final, len(tokenizer.encode(PROMPTS[1])), 10)
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])  # cumulative text
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    assert [e["meta_info"]["completion_tokens"] for e in events] == [
        len(e["output_ids"]) for e in events
    ]
    # one event per token: a stream at low load is never coalesced (the front end writes each
    # step's token before it reads the next step's message)
    assert [len(e["output_ids"]) for e in events] == list(range(1, 11))
    plain = generate(http, text=PROMPTS[1], sampling_params=params)
    assert (final["text"], final["output_ids"]) == (plain["text"], plain["output_ids"])

    batch = stream_generate(http, text=PROMPTS[:2], sampling_params={**GREEDY, "max_new_tokens": 4})
    last = {e["index"]: e for e in batch}
    assert sorted(last) == [0, 1]
    assert all(e["meta_info"]["finish_reason"]["type"] == "length" for e in last.values())


def test_generate_stop(http: httpx.Client) -> None:
    params = {**GREEDY, "max_new_tokens": 12}
    full = generate(http, text=PROMPTS[0], sampling_params=params)
    stop_id = full["output_ids"][3]
    out = generate(http, text=PROMPTS[0], sampling_params={**params, "stop_token_ids": [stop_id]})
    first = full["output_ids"].index(stop_id)
    assert out["output_ids"] == full["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["meta_info"]["completion_tokens"] == first + 1

    stop = full["text"][len(full["text"]) // 2 :][:3]
    out = generate(http, text=PROMPTS[0], sampling_params={**params, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and full["text"].startswith(out["text"])


def test_generate_matches_engine(http: httpx.Client, qwen3_moe_path: str) -> None:
    params = {**GREEDY, "max_new_tokens": 16}
    assert http.post("/flush_cache").status_code == 200
    served = [generate(http, text=p, sampling_params=params) for p in PROMPTS]
    engine = srt.Engine(model_path=qwen3_moe_path, dtype="float32", max_total_tokens=4096)
    try:
        offline = [engine.generate(p, params) for p in PROMPTS]
    finally:
        engine.shutdown()
    for s, o in zip(served, offline):
        assert (s["text"], s["output_ids"]) == (o["text"], o["output_ids"])
        assert s["meta_info"]["finish_reason"] == o["meta_info"]["finish_reason"]


# ------------------------------------------------------------------------------ other routes
def test_health_model_info_and_flush(
    http: httpx.Client, server: ServerProcess, qwen3_moe_path: str
) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["model_path"] == qwen3_moe_path and info["is_generation"] is True
    wait_idle(server.url)
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/flush_cache").status_code == 200
    assert http.get("/no_such_route").status_code == 404


def test_abort_request_ends_stream(
    http: httpx.Client, server: ServerProcess, qwen3_moe_path: str
) -> None:
    aborted = "sglang:num_aborted_requests_total"
    before = read_metrics(http, qwen3_moe_path)[aborted]
    body = {"text": PROMPTS[2], "rid": "to-abort", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 1500, "ignore_eos": True}
    events = []
    with http.stream("POST", "/generate", json=body) as response:
        payloads = sse_data(response.iter_lines())
        for payload in payloads:
            if payload == "[DONE]":
                break
            events.append(json.loads(payload))
            if len(events) == 2:
                flush = http.post("/flush_cache")  # refused while a request runs
                assert flush.status_code == 400 and "running" in flush.json()["error"]["message"]
                assert http.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
        rest = list(payloads)
    assert payload == "[DONE]" and rest == []
    reason = events[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and events[-1]["meta_info"]["id"] == "to-abort"
    assert len(events[-1]["output_ids"]) < 1500
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert_pool_full(wait_idle(server.url))
    assert read_metrics(http, qwen3_moe_path)[aborted] == before + 1


def read_metrics(http: httpx.Client, model_name: str) -> dict[str, float]:
    """/metrics parsed: sample name (its labels but model_name in braces, sorted) → value.
    Every sample carries SGLang's model_name label: the served model name."""
    response = http.get("/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == model_name, sample
            rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            values[sample.name + (f"{{{rest}}}" if rest else "")] = sample.value
    return values


def test_metrics_under_sglang_names(http: httpx.Client, qwen3_moe_path: str) -> None:
    """SGLang's metric names move by what the requests did: a streamed request, then the same
    prompt again (a prefix-cache hit)."""
    before = read_metrics(http, qwen3_moe_path)
    prompt = "Metrics count the tokens of this prompt"
    events = stream_generate(http, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 6})
    again = generate(http, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 4})
    metas = [events[-1]["meta_info"], again["meta_info"]]
    after = read_metrics(http, qwen3_moe_path)

    def grew(name: str) -> float:
        return after[name] - before[name]

    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    assert metas[1]["cached_tokens"] == metas[1]["prompt_tokens"] - 1
    assert grew("sglang:prompt_tokens_total") == prompt_tokens
    assert grew("sglang:generation_tokens_total") == 10
    assert grew("sglang:cached_tokens_total") == cached
    assert grew("sglang:num_requests_total") == 2
    assert grew("sglang:e2e_request_latency_seconds_count") == 2
    # latencies between tokens are known for the streamed request only: its 6 tokens
    assert grew("sglang:time_to_first_token_seconds_count") == 1
    assert grew("sglang:inter_token_latency_seconds_count") == 5
    assert grew("sglang:realtime_tokens_total{mode=prefill_cache}") == cached
    assert grew("sglang:realtime_tokens_total{mode=prefill_compute}") == prompt_tokens - cached
    assert grew("sglang:realtime_tokens_total{mode=decode}") == 5 + 3
    # the last prefill was the repeated prompt: all but its last token from the cache
    hit_rate = metas[1]["cached_tokens"] / metas[1]["prompt_tokens"]
    assert after["sglang:cache_hit_rate"] == pytest.approx(hit_rate)
    assert after["sglang:num_running_reqs"] == after["sglang:num_queue_reqs"] == 0
    assert after["sglang:num_used_tokens"] == after["sglang:token_usage"] == 0  # idle
    assert after["sglang:max_total_num_tokens"] == 4096
    assert after["sglang:gen_throughput"] >= 0


def _server_children(server: ServerProcess) -> list[int]:
    """The server's child processes but multiprocessing's resource tracker: its scheduler
    rank and its detokenizer."""
    pids = [int(p) for p in os.popen(f"pgrep -P {server.proc.pid}").read().split()]
    return [p for p in pids if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]


def test_front_end_never_preempts_a_rank_on_wakeup(server: ServerProcess) -> None:
    """The tiny model decodes on one core fewer than there are: the HTTP process and the
    detokenizer (every thread) run under SCHED_BATCH, the scheduler rank under the normal
    policy."""
    if not hasattr(os, "SCHED_BATCH") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("no SCHED_BATCH here, or one core: no core for the front end")
    main = server.proc.pid
    policies = {}
    for pid in [main, *_server_children(server)]:
        tids = os.listdir(f"/proc/{pid}/task")
        policies[pid] = {os.sched_getscheduler(int(t)) for t in tids}
    assert policies.pop(main) == {os.SCHED_BATCH}
    # the rest: the scheduler rank and the detokenizer, one policy for all their threads each
    assert sorted(map(tuple, policies.values())) == [(os.SCHED_OTHER,), (os.SCHED_BATCH,)]


def test_rank_starts_with_a_short_openmp_spin(server: ServerProcess) -> None:
    """The CPU rank's libgomp spins briefly before it sleeps (GOMP_SPINCOUNT from
    ``cpu_threads.limit_openmp_spin``), unless the server's environment chose a spin."""
    chosen = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    environs = []
    for pid in _server_children(server):
        raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
        environs.append(dict(v.split("=", 1) for v in raw.split("\0") if "=" in v))
    assert len(environs) == 2  # the scheduler rank and the detokenizer
    for environ in environs:
        if chosen:
            assert {k: environ.get(k) for k in chosen} == chosen
        else:
            assert environ.get("GOMP_SPINCOUNT") == OPENMP_SPIN_COUNT
