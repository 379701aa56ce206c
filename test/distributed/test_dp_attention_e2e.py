"""DP attention and expert parallelism end to end: greedy outputs and fp32 logprobs through
``srt.Engine`` (and the HTTP server) equal the single-rank run, with the DP controller spreading
the prompts over the attention-DP groups."""

from __future__ import annotations

import httpx
import pytest
from helpers.engine_outputs import PARAMS, PROMPTS, assert_same_outputs, run_engine
from helpers.server_process import running_server

pytestmark = pytest.mark.slow  # starts processes

DP = {"enable_dp_attention": True}
# Every batch must fit the fixed-capacity buffers: the batch limits default to the capacity,
# so the longer prompts (13, 21 tokens) are prefilled in chunks of 8.
LOW_LATENCY = {"deepep_mode": "low_latency", "max_dispatch_tokens_per_rank": 8}

CONFIGS = {
    "tp2-dp2-none": dict(tp_size=2, dp_size=2, **DP),
    "tp2-dp2-none-ep2": dict(tp_size=2, dp_size=2, ep_size=2, **DP),
    "tp2-dp2-torch-normal": dict(
        tp_size=2, dp_size=2, moe_a2a_backend="torch", deepep_mode="normal", **DP
    ),
    "tp2-dp2-torch-low_latency": dict(
        tp_size=2, dp_size=2, moe_a2a_backend="torch", **LOW_LATENCY, **DP
    ),
    "tp4-dp4-torch-auto": dict(tp_size=4, dp_size=4, moe_a2a_backend="torch", **DP),
    "tp4-dp2-torch-auto-dp-lm-head": dict(
        tp_size=4, dp_size=2, moe_a2a_backend="torch", enable_dp_lm_head=True, **DP
    ),
    "tp2-torch-normal": dict(tp_size=2, moe_a2a_backend="torch", deepep_mode="normal"),
}


@pytest.fixture(scope="module")
def references(qwen3_moe_path, deepseek_v3_path) -> dict[str, list[dict]]:
    return {
        "qwen3": run_engine(qwen3_moe_path),
        "deepseek_v3": run_engine(deepseek_v3_path),
    }


@pytest.fixture(scope="module")
def paths(qwen3_moe_path, deepseek_v3_path) -> dict[str, str]:
    return {"qwen3": qwen3_moe_path, "deepseek_v3": deepseek_v3_path}


@pytest.mark.parametrize("model", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_equals_single_rank(model, config, paths, references):
    outputs, states = run_engine(paths[model], with_state=True, **CONFIGS[config])
    assert_same_outputs(outputs, references[model])
    groups = CONFIGS[config].get("dp_size", 1)
    assert [s["dp_rank"] for s in states] == list(range(groups))
    if groups > 1:  # round robin: every group served some of the prompts
        assert all(s["num_forward_steps"] > 0 for s in states)


def test_one_busy_group_and_idle_groups(qwen3_moe_path, references):
    """One request: one group works, the others run IDLE forwards to keep the collectives in
    step, and the output equals the single-rank run."""
    outputs, states = run_engine(
        qwen3_moe_path, PROMPTS[:1], with_state=True, tp_size=4, dp_size=4,
        moe_a2a_backend="torch", **DP,
    )  # fmt: skip
    assert_same_outputs(outputs, references["qwen3"][:1])
    busy = [s for s in states if s["num_forward_steps"] > 0]
    idle = [s for s in states if s["num_forward_steps"] == 0]
    assert len(busy) == 1 and len(idle) == 3
    steps = busy[0]["num_forward_steps"]
    assert all(s["num_idle_forward_steps"] == steps for s in idle)


def test_http_server_dp_attention(qwen3_moe_path, references):
    args = ("--tp", "2", "--dp", "2", "--enable-dp-attention", "--moe-a2a-backend", "torch")
    with running_server(qwen3_moe_path, *args) as server:
        response = httpx.post(
            server.url + "/generate",
            json={"input_ids": PROMPTS, "sampling_params": PARAMS},
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
    assert [out["output_ids"] for out in outputs] == [r["output_ids"] for r in references["qwen3"]]
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    assert chat.status_code == 200, chat.text
