"""Plain tensor parallelism (``--tp-size N``, ``--moe-a2a-backend none``, no DP attention):
greedy outputs and fp32 logprobs through ``srt.Engine`` and the HTTP server equal the
single-rank run."""

from __future__ import annotations

import httpx
import pytest
from helpers.engine_outputs import PARAMS, PROMPTS, assert_same_outputs
from helpers.engine_outputs import run_engine as run_tp_engine
from helpers.server_process import running_server

import srt

pytestmark = pytest.mark.slow  # starts processes


def run_engine(path: str, tp_size: int, prompts: list[list[int]] = PROMPTS) -> list[dict]:
    return run_tp_engine(path, prompts, tp_size=tp_size)


@pytest.fixture(scope="module")
def qwen3_reference(single_rank_outputs) -> list[dict]:
    return single_rank_outputs("tiny-qwen3-moe")


def test_qwen3_moe_tp4_equals_single_rank(qwen3_moe_path, qwen3_reference):
    # 4 ranks for 2 KV heads: KV heads replicated; 8 experts' intermediate split in 4.
    assert_same_outputs(run_engine(qwen3_moe_path, 4, PROMPTS[:2]), qwen3_reference[:2])


def test_deepseek_v3_tp2_equals_single_rank(deepseek_v3_path, single_rank_outputs):
    assert_same_outputs(run_engine(deepseek_v3_path, 2), single_rank_outputs("tiny-deepseek-v3"))


def test_http_server_tp2_equals_single_rank(qwen3_moe_path, qwen3_reference):
    """Qwen3-MoE at tp=2 (the engine's TP path: tp4 and DeepSeek-V3 above), through the HTTP
    server: the same greedy outputs and fp32 logprobs as the single-rank engine."""
    with running_server(qwen3_moe_path, "--tp", "2") as server:
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
    assert_same_outputs(outputs, qwen3_reference)


def test_tp_flag_and_alias_parse():
    import argparse

    from srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--tp", "2"]).tp_size == 2
    assert parser.parse_args(["--tp-size", "4"]).tp_size == 4


def test_invalid_tp_size_is_refused_naming_the_flag(qwen3_moe_path, deepseek_v3_path):
    with pytest.raises(ValueError, match="--tp-size: must be"):
        srt.Engine(model_path=qwen3_moe_path, tp_size=0)
    with pytest.raises(ValueError, match="--tp-size 16: more ranks than experts"):
        srt.Engine(model_path=qwen3_moe_path, tp_size=16)
    with pytest.raises(ValueError, match="--tp-size 3: .*not divisible by 3"):
        srt.Engine(model_path=deepseek_v3_path, tp_size=3)
