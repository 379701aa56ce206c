"""benchmark/serving/bench_serving.py against the real HTTP server: 10 short random prompts per
backend, through ``run_benchmark`` in this process and through the command line."""

from __future__ import annotations

import re
import subprocess
import sys
from types import ModuleType

import pytest
from helpers.server_process import ServerProcess, assert_pool_full, wait_idle

from benchmark.serving import bench_serving as bench_serving_module

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("print_server_log")]

NUM_PROMPTS = 10


@pytest.fixture(scope="module")
def bench_serving() -> ModuleType:
    return bench_serving_module


def bench_args(server: ServerProcess, backend: str) -> list[str]:
    return [
        *("--backend", backend, "--base-url", server.url),
        *("--num-prompts", str(NUM_PROMPTS), "--random-range-ratio", "0.5"),
        *("--random-input-len", "32", "--random-output-len", "8", "--disable-tqdm"),
    ]


def assert_result_block(stdout: str, backend: str) -> None:
    assert "Serving Benchmark Result" in stdout, stdout
    assert re.search(rf"^Backend:\s+{re.escape(backend)}\s*$", stdout, re.M), stdout
    assert re.search(rf"^Successful requests:\s+{NUM_PROMPTS}\s*$", stdout, re.M), stdout
    assert "Failed requests" not in stdout, stdout


def test_run_benchmark_sglang(
    bench_serving: ModuleType, server: ServerProcess, capsys: pytest.CaptureFixture
) -> None:
    args = bench_serving.parse_args(bench_args(server, "sglang"))
    result = bench_serving.run_benchmark(args)
    stdout = capsys.readouterr().out
    assert_result_block(stdout, "sglang")
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["errors"] == [""] * NUM_PROMPTS
    # /generate gets exact token ids, and ignore_eos makes every output exactly its length.
    assert all(4 <= n <= 8 for n in result["output_lens"])
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert all(16 <= n <= 32 for n in result["input_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert all(ttft > 0 for ttft in result["ttfts"])
    assert_pool_full(wait_idle(server.url))


@pytest.mark.parametrize("backend", ["sglang-oai-chat", "sglang-oai"])
def test_command_line(server: ServerProcess, backend: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmark.serving.bench_serving", *bench_args(server, backend)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert_result_block(done.stdout, backend)
    assert_pool_full(wait_idle(server.url))
