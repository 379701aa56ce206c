"""What an SGLang user types works: SGLang's long parallel-size flags, its spellings of
--dtype / --kv-cache-dtype / --load-balance-method values (mapped to srt's names right after
parsing, the Engine's keyword arguments too), and --enable-metrics, which gates /metrics as in
SGLang. A value srt does not implement, or an unknown flag, stays an argparse error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from launch_server import parse_args

from srt.entrypoints.http_server import add_native_routes
from srt.managers.metrics import TokenizerMetrics
from srt.server_args import ServerArgs

# no machine probe: the device and the attention backend named
PLAIN = ["--model-path", "m", "--device", "cpu", "--attention-backend", "torch_native"]


def parse(*argv: str) -> ServerArgs:
    return parse_args([*PLAIN, *argv])


def test_long_parallel_size_names_are_the_short_ones():
    long = parse("--tensor-parallel-size", "4", "--data-parallel-size", "2",
                 "--enable-dp-attention", "--expert-parallel-size", "2")  # fmt: skip
    short = parse("--tp", "4", "--dp", "2", "--enable-dp-attention", "--ep", "2")
    assert (long.tp_size, long.dp_size, long.ep_size) == (4, 2, 2)
    assert long == short


@pytest.mark.parametrize(
    "flag, value, srt_name",
    [
        ("--dtype", "half", "float16"),
        ("--dtype", "float", "float32"),
        ("--dtype", "bfloat16", "bfloat16"),
        ("--kv-cache-dtype", "bf16", "bfloat16"),
        ("--kv-cache-dtype", "float16", "float16"),
        ("--load-balance-method", "auto", "round_robin"),
        ("--load-balance-method", "total_requests", "shortest_queue"),
        ("--load-balance-method", "total_tokens", "minimum_tokens"),
        ("--load-balance-method", "shortest_queue", "shortest_queue"),
        ("--load-balance-method", "minimum_tokens", "minimum_tokens"),
    ],
)
def test_sglang_values_become_srt_names(flag, value, srt_name):
    args = parse(flag, value)
    assert getattr(args, flag[2:].replace("-", "_")) == srt_name


def test_engine_keywords_take_the_sglang_values_too():
    args = ServerArgs.from_kwargs(model_path="m", device="cpu", attention_backend="torch_native",
                                  dtype="half", load_balance_method="total_tokens")  # fmt: skip
    assert (args.dtype, args.load_balance_method) == ("float16", "minimum_tokens")
    with pytest.raises(ValueError, match="--load-balance-method: must be one of"):
        ServerArgs(model_path="m", device="cpu", load_balance_method="follow_bootstrap_room")


@pytest.mark.parametrize(
    "argv, message",
    [
        # SGLang's PD-disaggregation prefill policy: srt has no disaggregation
        (["--load-balance-method", "follow_bootstrap_room"],
         "invalid choice: 'follow_bootstrap_room'"),
        (["--kv-cache-dtype", "fp8_e4m3"], "invalid choice: 'fp8_e4m3'"),
        (["--dtype", "bf16"], "invalid choice: 'bf16'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)  # fmt: skip
def test_what_srt_does_not_implement_is_an_argparse_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def metrics_status(enable_metrics: bool) -> int:
    """GET /metrics on the native routes of a server with or without --enable-metrics."""
    args = parse(*(["--enable-metrics"] if enable_metrics else []))
    assert args.enable_metrics == enable_metrics

    async def internal_state() -> list[dict]:
        await asyncio.sleep(0)
        keys = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_retracted_reqs",
                "last_prefill_cache_tokens", "last_prefill_compute_tokens",
                "num_prefill_compute_tokens", "num_prefill_cache_tokens", "num_decode_tokens")
        gauges = {"max_total_num_tokens": 16, "last_gen_throughput": 0.0, "new_token_ratio": 0.5}
        return [{**dict.fromkeys(keys, 0), **gauges}]

    tm = SimpleNamespace(metrics=TokenizerMetrics("m"), get_internal_state=internal_state)
    app = FastAPI()
    add_native_routes(app, tm, args, {})
    response = TestClient(app).get("/metrics")
    assert response.status_code != 200 or "sglang:num_requests_total" in response.text
    return response.status_code


def test_enable_metrics_gates_the_route():
    assert metrics_status(enable_metrics=True) == 200
    assert metrics_status(enable_metrics=False) == 404
