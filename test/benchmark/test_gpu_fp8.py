"""The GPU check's fp8 step on CPU (``benchmark/gpu_check.sh`` step 7): the tiny fp8
checkpoints against their dequantized copies (``gpu_parity.py --check fp8``), the switch to the
Triton kernels' weight-only path, and the decode figures written by one report and shown
beside another's (``gpu_report.py --figures-json / --baseline``)."""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from benchmark.common import fp8_checkpoint  # noqa: E402
from benchmark.gpu import gpu_parity, gpu_report  # noqa: E402
from srt.layers.quantization.fp8 import quantize_rows  # noqa: E402


def test_fp8_check_passes_on_cpu(capsys):
    assert gpu_parity.check_fp8(argparse.Namespace(device="cpu")) == []
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[:2] for r in rows] == [[m, "weight-only"] for m in gpu_parity.FP8_MODELS]
    for _, _, diff, same in rows:
        assert float(diff) <= 1e-4 and same == "36/36"


def test_fp8_check_fails_on_an_inexact_reference(monkeypatch, capsys):
    """A reference rounded to bf16 is no exact dequantization: weight-only must fail it."""
    real = fp8_checkpoint.dequantize_checkpoint
    rounded = lambda src, dst: real(src, dst, torch.bfloat16)  # noqa: E731
    monkeypatch.setattr(gpu_parity, "dequantize_checkpoint", rounded)
    monkeypatch.setattr(gpu_parity, "FP8_MODELS", gpu_parity.FP8_MODELS[:1])
    failures = gpu_parity.check_fp8(argparse.Namespace(device="cpu"))
    assert len(failures) == 1 and failures[0].startswith("tiny-qwen3-moe weight-only")


def test_weight_only_switch_reaches_the_kernels():
    pytest.importorskip("triton")
    from srt.layers.moe import fused_moe_triton_fp8
    from srt.layers.quantization import fp8_triton

    gen = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 64, generator=gen).to(device)
    q, scale = (t.to(device) for t in quantize_rows(torch.randn(32, 64, generator=gen)))
    w8a8 = fp8_triton.fp8_linear(x, q, scale, 128)  # the interpreter (and sm89+) default
    weight_only = fp8_triton.weight_only_fp8_matmul(x, q, scale, 128)
    assert not torch.equal(w8a8, weight_only)  # the activations' rounding shows
    with gpu_parity.weight_only_fp8():
        assert not fused_moe_triton_fp8.uses_w8a8(torch.device(device))
        assert torch.equal(fp8_triton.fp8_linear(x, q, scale, 128), weight_only)
    assert fp8_triton.uses_w8a8(torch.device(device)) == fused_moe_triton_fp8.uses_w8a8(
        torch.device(device)
    )  # restored
    assert torch.equal(fp8_triton.fp8_linear(x, q, scale, 128), w8a8)


def _runner(dtype: torch.dtype, weight_bytes: int) -> SimpleNamespace:
    model = nn.Linear(4, 4, dtype=torch.bfloat16)
    if dtype == torch.float8_e4m3fn:
        model.weight = nn.Parameter(model.weight.data.to(dtype), requires_grad=False)
    config = SimpleNamespace(dtype=torch.bfloat16)
    return SimpleNamespace(model=model, model_config=config, weight_bytes=weight_bytes)


def _figures(ms: float, floor_bytes: int) -> dict:
    return {"graph_ms": ms, "eager_ms": 2 * ms, "floor_bytes": floor_bytes, "floor_ms": ms / 4}


def test_figures_json_shown_beside_a_later_run(tmp_path, capsys):
    path = str(tmp_path / "figures.json")
    bf16 = _runner(torch.bfloat16, 6_000)
    gpu_report.write_figures(path, bf16, 1e12, {1: _figures(2.0, 1_000)})
    baseline = json.loads((tmp_path / "figures.json").read_text())
    assert baseline["weights"] == "bfloat16" and baseline["weight_bytes"] == 6_000
    fp8 = _runner(torch.float8_e4m3fn, 3_000)
    gpu_report.side_by_side(fp8, {1: _figures(1.5, 520), 64: _figures(3.0, 900)}, baseline)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines[1][:4] == ["1", "bfloat16", "2.00", "4.00"]
    assert lines[2][:4] == ["1", "fp8", "1.50", "3.00"] and lines[2][6] == "4.00"
    assert " ".join(lines[3]) == "fp8 / bfloat16: graph 0.75x, eager 0.75x, floor bytes 0.52x"
    assert lines[4] == ["64", "bfloat16", "(not", "measured)"]  # the baseline had no batch 64
    assert lines[5][:2] == ["64", "fp8"] and len(lines) == 6
