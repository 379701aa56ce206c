"""bench_step_split runs a static batch on the bundled tiny model and splits each step into its
oneDNN GEMMs and the rest."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

LINE = re.compile(
    r"prefill +([\d.]+) ms \(GEMM +([\d.]+), other +(-?[\d.]+)\) +decode step +([\d.]+) ms "
    r"\(GEMM +([\d.]+), other +(-?[\d.]+)\)"
)


@pytest.mark.slow  # runs the benchmark in a process of its own
def test_prints_a_split_per_run():
    cmd = [sys.executable, "-m", "benchmark.kernel.bench_step_split", "--dtype", "float32",
           "--batch-size", "2", "--input-len", "8", "--output-len", "3",
           "--repeat", "2"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [LINE.search(line) for line in out.splitlines()]
    rows = [tuple(map(float, m.groups())) for m in rows if m]
    assert len(rows) == 2
    for prefill, prefill_gemm, _, decode, decode_gemm, _ in rows:
        assert 0 < prefill_gemm < prefill  # the tiny model's linears are timed, not all of it
        assert 0 < decode_gemm < decode
