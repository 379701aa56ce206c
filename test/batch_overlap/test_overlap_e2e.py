"""Two- and single-batch overlap end to end: through ``srt.Engine`` and the HTTP server, greedy
outputs and fp32 logprobs with TBO (or SBO) equal the same layout without it (1e-5), and the
server's internal state counts the steps run with it; the token thresholds decide which steps
split."""

from __future__ import annotations

import re

import httpx
import pytest
from helpers.engine_outputs import PROMPTS, assert_same_outputs, run_engine
from helpers.server_process import running_server

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

pytestmark = pytest.mark.slow  # starts processes

TOLERANCE = 1e-5
DIGITS = r"[0-9]{2,6}"
ALWAYS = {"tbo_decode_token_threshold": 0, "tbo_prefill_token_threshold": 0}
DP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "moe_a2a_backend": "torch"}
CASES = {
    "qwen3-normal": ("tiny-qwen3-moe", dict(DP2, deepep_mode="normal")),
    "deepseek_v3-low_latency": (
        "tiny-deepseek-v3",
        dict(DP2, deepep_mode="low_latency", max_dispatch_tokens_per_rank=64,
             chunked_prefill_size=64, max_running_requests=32),
    ),
}  # fmt: skip
# One case per family and mode: DeepSeek-V2 (V3's layers, another router) is exact with TBO and
# SBO at model level (test_tbo_model, test_sbo_model); what the engine adds is model-blind.
# Sent twice: the second time every prompt's prefix is a radix-cache hit.
TWICE = PROMPTS + PROMPTS


@pytest.fixture(scope="module")
def unsplit(tiny_models) -> dict[str, list[dict]]:
    return {
        case: run_engine(tiny_models[model], TWICE, **kwargs)
        for case, (model, kwargs) in CASES.items()
    }


# Qwen3 normal with TBO is test_http_server_with_tbo's (the same flags, logprobs compared too).
@pytest.mark.parametrize("case", ["deepseek_v3-low_latency"])
def test_engine_with_tbo_equals_without(case, tiny_models, unsplit):
    model, kwargs = CASES[case]
    outputs, states = run_engine(
        tiny_models[model], TWICE, with_state=True, enable_two_batch_overlap=True,
        **ALWAYS, **kwargs,
    )  # fmt: skip
    assert_same_outputs(outputs, unsplit[case], TOLERANCE)
    # Which steps split depends on how the requests meet in batches (a one-token extend, or
    # groups in different modes, run unsplit); the scheduler test pins the rules down.
    assert sum(n for s in states for n in s["num_tbo_steps"].values()) > 0, states


@pytest.mark.parametrize("case", ["qwen3-normal", "deepseek_v3-low_latency"])
def test_engine_with_sbo_equals_without(case, tiny_models, unsplit):
    model, kwargs = CASES[case]
    outputs, states = run_engine(
        tiny_models[model], TWICE, with_state=True, enable_single_batch_overlap=True, **kwargs
    )
    assert_same_outputs(outputs, unsplit[case], TOLERANCE)
    for state in states:  # every forward of every group ran SBO
        assert state["num_sbo_steps"] == state["num_non_tbo_steps"], state
        assert state["num_sbo_steps"].get("extend", 0) > 0, state
        assert state["num_tbo_steps"] == {}, state


def test_http_server_with_tbo(tiny_models, unsplit):
    args = (
        "--tp", "2", "--dp", "2", "--enable-dp-attention", "--moe-a2a-backend", "torch",
        "--deepep-mode", "normal", "--enable-two-batch-overlap",
        "--tbo-decode-token-threshold", "0", "--tbo-prefill-token-threshold", "0",
        "--dtype", "float32", "--max-total-tokens", "1024",
    )  # fmt: skip
    with running_server(tiny_models["tiny-qwen3-moe"], *args) as server:
        response = httpx.post(
            server.url + "/generate",
            json={
                "input_ids": TWICE,
                "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            timeout=60.0,
        )
        response.raise_for_status()
        info = httpx.get(server.url + "/get_server_info", timeout=10.0).json()
        chat = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60.0,
        )
        # Constrained and unconstrained requests in the same split batches.
        constrained = httpx.post(
            server.url + "/generate",
            json={
                "input_ids": TWICE,
                "sampling_params": [
                    {"max_new_tokens": 12, "regex": DIGITS} if i % 2 else {"max_new_tokens": 3}
                    for i in range(len(TWICE))
                ],
            },
            timeout=60.0,
        )
    assert_same_outputs(response.json(), unsplit["qwen3-normal"], TOLERANCE)
    constrained.raise_for_status()
    for out in constrained.json()[1::2]:
        assert re.fullmatch(DIGITS, out["text"]), out["text"]
    assert sum(n for s in info["internal_states"] for n in s["num_tbo_steps"].values()) > 0
    assert chat.status_code == 200, chat.text


def test_http_server_with_auto_overlap(tiny_models, unsplit):
    """--overlap-mode auto: each step runs the overlap its measurements favour; outputs equal
    the plain run's, every DP group's policy agrees, and /get_server_info and /metrics show
    the choices and the estimates. (Which modes serving runs depends on this machine's timings:
    test_auto_overlap_model forces every switch.)"""
    args = (
        "--tp", "2", "--dp", "2", "--enable-dp-attention", "--moe-a2a-backend", "torch",
        "--deepep-mode", "normal", "--overlap-mode", "auto", "--dtype", "float32",
        "--max-total-tokens", "1024", "--enable-metrics",
    )  # fmt: skip
    request = {
        "input_ids": TWICE,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    with running_server(tiny_models["tiny-qwen3-moe"], *args) as server:
        responses = [
            httpx.post(server.url + "/generate", json=request, timeout=60.0) for _ in range(3)
        ]
        info = httpx.get(server.url + "/get_server_info", timeout=10.0).json()
        metrics = httpx.get(server.url + "/metrics", timeout=10.0).text
    for response in responses:
        response.raise_for_status()
        assert_same_outputs(response.json(), unsplit["qwen3-normal"], TOLERANCE)
    overlaps = [state["overlap"] for state in info["internal_states"]]
    assert all(overlap.pop("all_to_all_this_rank")["bytes"] > 0 for overlap in overlaps)
    assert all(overlap == overlaps[0] for overlap in overlaps), overlaps  # unanimous
    overlap = overlaps[0]
    assert overlap["overlap_mode"] == "auto" and overlap["modes"] == ["off", "tbo", "sbo"]
    # calibrated at start-up: every step size it serves here was measured before
    assert overlap["num_calibration_steps"] > 0 and overlap["estimates"]["decode"]["off"]
    assert overlap["estimates"]["prefill"]["off"]
    served = sum(overlap["num_steps"].values())
    assert served == sum(n for key in ("num_tbo_steps", "num_non_tbo_steps")
                         for n in info["internal_states"][0][key].values()), info  # fmt: skip
    model = f'model_name="{tiny_models["tiny-qwen3-moe"]}"'  # labels in name order
    assert f'srt:overlap_steps{{kind="decode",mode="off",{model}}}' in metrics
    assert "srt:overlap_step_seconds_estimate{bucket=" in metrics


def _run_scheduler(path: str, prefill_threshold: int, decode_threshold: int) -> dict:
    """Four prompts (40 tokens) added at once: one prefill step of 40 tokens, then two decode
    steps of 4; one rank with the torch all-to-all (EP of 1)."""
    args = ServerArgs(
        model_path=path, dtype="float32", max_total_tokens=256, moe_a2a_backend="torch",
        enable_two_batch_overlap=True, tbo_prefill_token_threshold=prefill_threshold,
        tbo_decode_token_threshold=decode_threshold,
    )  # fmt: skip
    scheduler = Scheduler(args)
    for i, n in enumerate((6, 9, 12, 13)):
        params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
        params.normalize(None)
        ids = [(7 * i + j) % 400 + 3 for j in range(n)]
        scheduler.add_request(TokenizedGenerateReqInput(f"r{i}", ids, params))
    for _ in range(10):
        scheduler.step()
    assert scheduler.is_idle()
    state = scheduler.get_internal_state()
    return {"tbo": state["num_tbo_steps"], "plain": state["num_non_tbo_steps"]}


@pytest.mark.parametrize(
    "prefill_threshold, decode_threshold, expected",
    [
        (41, 5, {"tbo": {}, "plain": {"extend": 1, "decode": 2}}),  # both below
        (40, 4, {"tbo": {"extend": 1, "decode": 2}, "plain": {}}),  # both at the threshold
        (40, 5, {"tbo": {"extend": 1}, "plain": {"decode": 2}}),
        (512, 32, {"tbo": {}, "plain": {"extend": 1, "decode": 2}}),  # the defaults
    ],
)
def test_token_thresholds(qwen3_moe_path, prefill_threshold, decode_threshold, expected):
    assert _run_scheduler(qwen3_moe_path, prefill_threshold, decode_threshold) == expected
