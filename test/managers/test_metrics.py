"""/metrics without a server: SGLang's names and ``model_name`` label, request counters and
histograms from outputs, and the scheduler metrics combined over attention-DP groups."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from srt.managers.io_struct import BatchStrOutput, GenerateReqInput
from srt.managers.metrics import TokenizerMetrics
from srt.managers.request_state import ReqState

MODEL = "served-name"


def samples(body: bytes) -> dict[tuple, float]:
    """(sample name, labels but model_name) → value; every sample carries model_name."""
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            out[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return out


def group_state(**overrides) -> dict:
    state = {
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "num_used_tokens": 0,
        "max_total_num_tokens": 1000,
        "last_gen_throughput": 0.0,
        "last_prefill_cache_tokens": 0,
        "last_prefill_compute_tokens": 0,
        "new_token_ratio": 0.5,
        "num_retracted_reqs": 0,
        "num_prefill_compute_tokens": 0,
        "num_prefill_cache_tokens": 0,
        "num_decode_tokens": 0,
    }
    return {**state, **overrides}


def output(completion: int, finished: bool, prompt: int = 5, cached: int = 2) -> BatchStrOutput:
    reason = {"type": "length", "length": completion} if finished else None
    return BatchStrOutput(["r"], [reason], ["x"], [[1]], [prompt], [completion], [cached])


def test_request_metrics_follow_outputs() -> None:
    metrics = TokenizerMetrics(MODEL)
    obj = GenerateReqInput(text="hi", stream=True, sampling_params={"regex": "a+"})
    state = ReqState(obj, prompt_tokens=5)
    for i, (completion, finished) in enumerate([(1, False), (3, False), (4, True)]):
        out = output(completion, finished)
        metrics.observe(state, out, 0, now=state.created + 0.5 * (i + 1))
        state.update(out, 0)
    values = samples(metrics.render([group_state()]))
    assert values[("sglang:prompt_tokens_total", ())] == 5
    assert values[("sglang:generation_tokens_total", ())] == 4
    assert values[("sglang:cached_tokens_total", ())] == 2
    assert values[("sglang:num_requests_total", ())] == 1
    assert values[("sglang:num_so_requests_total", ())] == 1
    assert values[("sglang:time_to_first_token_seconds_count", ())] == 1
    assert values[("sglang:time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    # one observation per token after the first: 2 tokens in 0.5 s, then 1 in 0.5 s
    assert values[("sglang:inter_token_latency_seconds_count", ())] == 3
    itl_buckets = [("le", "0.2"), ("le", "0.4"), ("le", "0.6")]
    itl = [values[("sglang:inter_token_latency_seconds_bucket", (b,))] for b in itl_buckets]
    assert itl == [0, 2, 3]
    assert values[("sglang:inter_token_latency_seconds_sum", ())] == pytest.approx(1.0)
    assert values[("sglang:e2e_request_latency_seconds_count", ())] == 1
    assert values[("sglang:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.5)
    assert values[("sglang:num_aborted_requests_total", ())] == 0
    assert values[("srt:num_rejected_requests_total", ())] == 0


def test_scheduler_metrics_combine_dp_groups() -> None:
    metrics = TokenizerMetrics(MODEL)
    groups = [
        group_state(
            num_running_reqs=3,
            num_waiting_reqs=1,
            num_used_tokens=100,
            last_gen_throughput=40.0,
            last_prefill_cache_tokens=30,
            last_prefill_compute_tokens=10,
            num_retracted_reqs=2,
            num_prefill_compute_tokens=500,
            num_prefill_cache_tokens=50,
            num_decode_tokens=70,
            new_token_ratio=0.25,
        ),
        group_state(
            num_running_reqs=1,
            num_used_tokens=300,
            max_total_num_tokens=3000,
            last_gen_throughput=10.0,
            last_prefill_compute_tokens=60,
            num_prefill_compute_tokens=5,
        ),
    ]
    values = samples(metrics.render(groups))
    assert values[("sglang:num_running_reqs", ())] == 4
    assert values[("sglang:num_queue_reqs", ())] == 1
    assert values[("sglang:num_used_tokens", ())] == 400
    assert values[("sglang:max_total_num_tokens", ())] == 4000
    assert values[("sglang:token_usage", ())] == 0.1  # 400 of the groups' 4000 slots
    assert values[("sglang:gen_throughput", ())] == 50.0
    assert values[("sglang:cache_hit_rate", ())] == 0.3  # 30 of the last batches' 100 tokens
    assert values[("sglang:new_token_ratio", ())] == 0.375
    assert values[("sglang:num_retracted_requests_total", ())] == 2
    assert values[("sglang:realtime_tokens_total", (("mode", "prefill_compute"),))] == 505
    assert values[("sglang:realtime_tokens_total", (("mode", "prefill_cache"),))] == 50
    assert values[("sglang:realtime_tokens_total", (("mode", "decode"),))] == 70
    # no prefill yet: a rate of 0, not a division by zero
    assert samples(metrics.render([group_state()]))[("sglang:cache_hit_rate", ())] == 0.0


def test_overlap_metrics_stay_srt_only() -> None:
    overlap = {
        "num_steps": {"decode/off": 7},
        "estimates": {"decode": {"tbo": [{"bucket": 3, "seconds": 0.01}]}},
    }
    values = samples(TokenizerMetrics(MODEL).render([group_state(overlap=overlap)]))
    assert values[("srt:overlap_steps", (("kind", "decode"), ("mode", "off")))] == 7
    key = (("bucket", "3"), ("kind", "decode"), ("mode", "tbo"))
    assert values[("srt:overlap_step_seconds_estimate", key)] == 0.01
