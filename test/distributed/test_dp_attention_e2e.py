"""DP attention and expert parallelism end to end: greedy outputs and fp32 logprobs through
``srt.Engine`` (and the HTTP server) equal the single-rank run, with the DP controller spreading
the prompts over the attention-DP groups."""

from __future__ import annotations

import httpx
import pytest
from helpers.engine_outputs import PARAMS, PROMPTS, assert_same_outputs, run_engine
from helpers.server_process import running_server

import srt

pytestmark = pytest.mark.slow  # starts processes

DP = {"enable_dp_attention": True}
# Every batch must fit the fixed-capacity buffers: the batch limits default to the capacity,
# so the longer prompts (13, 21 tokens) are prefilled in chunks of 8.
LOW_LATENCY = {"deepep_mode": "low_latency", "max_dispatch_tokens_per_rank": 8}

CONFIGS = {
    "tp2-dp2-none": dict(tp_size=2, dp_size=2, **DP),
    "tp2-dp2-none-ep2": dict(tp_size=2, dp_size=2, ep_size=2, **DP),
    "tp2-dp2-torch-low_latency": dict(
        tp_size=2, dp_size=2, moe_a2a_backend="torch", **LOW_LATENCY, **DP
    ),
    "tp4-dp4-torch-auto": dict(tp_size=4, dp_size=4, moe_a2a_backend="torch", **DP),
    "tp4-dp2-torch-auto-dp-lm-head": dict(
        tp_size=4, dp_size=2, moe_a2a_backend="torch", enable_dp_lm_head=True, **DP
    ),
    "tp2-torch-normal": dict(tp_size=2, moe_a2a_backend="torch", deepep_mode="normal"),
}
# Each layout once, with one of the two model families, so that each family runs the DP gather
# (``none``) and the all-to-all under DP attention; the numerics of every layout × family
# (logits, step by step) are test_dp_attention_model's. What the engine adds is model-blind:
# its flags, the controller's round robin, the schedulers' MLP sync and chunking. ``tp4-dp4``
# is test_one_busy_group_and_idle_groups_then_every_group's (DeepSeek-V3); tp2 dp2 with the
# normal all-to-all is test_http_server_dp_attention's (Qwen3, logprobs compared too).
CELLS = [
    ("tp2-dp2-none", "qwen3"),
    ("tp2-dp2-none", "deepseek_v3"),
    ("tp2-dp2-none-ep2", "deepseek_v3"),  # routed EP + shared experts TP over the world
    ("tp2-dp2-torch-low_latency", "deepseek_v3"),
    ("tp4-dp2-torch-auto-dp-lm-head", "qwen3"),
    ("tp2-torch-normal", "deepseek_v3"),  # shared experts replicated, no DP attention
]


@pytest.fixture(scope="module")
def references(single_rank_outputs) -> dict[str, list[dict]]:
    return {
        "qwen3": single_rank_outputs("tiny-qwen3-moe"),
        "deepseek_v3": single_rank_outputs("tiny-deepseek-v3"),
    }


@pytest.fixture(scope="module")
def paths(qwen3_moe_path, deepseek_v3_path) -> dict[str, str]:
    return {"qwen3": qwen3_moe_path, "deepseek_v3": deepseek_v3_path}


@pytest.mark.parametrize("config, model", CELLS, ids=[f"{c}-{m}" for c, m in CELLS])
def test_engine_equals_single_rank(model, config, paths, references):
    outputs, states = run_engine(paths[model], with_state=True, **CONFIGS[config])
    assert_same_outputs(outputs, references[model])
    groups = CONFIGS[config].get("dp_size", 1)
    assert [s["dp_rank"] for s in states] == list(range(groups))
    if groups > 1:  # round robin: every group served some of the prompts
        assert all(s["num_forward_steps"] > 0 for s in states)


def test_one_busy_group_and_idle_groups_then_every_group(deepseek_v3_path, references):
    """tp4 dp4 (``torch``, auto) on one engine. One request: one group works, the others run
    IDLE forwards to keep the collectives in step. Then the four prompts: the round robin gives
    each group one. Both outputs equal the single-rank run."""
    kwargs = dict(dtype="float32", max_total_tokens=1024, **CONFIGS["tp4-dp4-torch-auto"])
    engine = srt.Engine(model_path=deepseek_v3_path, **kwargs)
    logprobs = dict(sampling_params=PARAMS, return_logprob=True, logprob_start_len=0)
    try:
        one = engine.generate(input_ids=PROMPTS[:1], **logprobs)
        states = engine.get_server_info()["internal_states"]
        assert engine.flush_cache()  # the four prompts as the reference runs them: uncached
        every = engine.generate(input_ids=PROMPTS, **logprobs)
        after = engine.get_server_info()["internal_states"]
    finally:
        engine.shutdown()
    assert_same_outputs(one, references["deepseek_v3"][:1])
    busy = [s for s in states if s["num_forward_steps"] > 0]
    idle = [s for s in states if s["num_forward_steps"] == 0]
    assert len(busy) == 1 and len(idle) == 3
    steps = busy[0]["num_forward_steps"]
    assert all(s["num_idle_forward_steps"] == steps for s in idle)
    assert_same_outputs(every, references["deepseek_v3"])
    assert [s["dp_rank"] for s in after] == [0, 1, 2, 3]
    # an idle group's steps are counted apart: each group ran forwards of its own again
    assert all(a["num_forward_steps"] > s["num_forward_steps"] for a, s in zip(after, states))


def test_http_server_dp_attention(qwen3_moe_path, references):
    args = ("--tp", "2", "--dp", "2", "--enable-dp-attention", "--moe-a2a-backend", "torch")
    args += ("--deepep-mode", "normal")
    with running_server(qwen3_moe_path, *args) as server:
        response = httpx.post(
            server.url + "/generate",
            json={
                "input_ids": PROMPTS,
                "sampling_params": PARAMS,
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            timeout=60.0,
        )
        response.raise_for_status()
        outputs = response.json()
        info = httpx.get(server.url + "/get_server_info", timeout=10.0).json()
        chat = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60.0,
        )
    assert_same_outputs(outputs, references["qwen3"])
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    assert all(s["num_forward_steps"] > 0 for s in info["internal_states"])
    assert chat.status_code == 200, chat.text
