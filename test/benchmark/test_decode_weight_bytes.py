"""benchmark.common.weight_bytes: the weight bytes a decode step reads, as the loaded model
stores them, equal a count by hand from the tiny Qwen3-MoE's config in float32, bf16 and as a
block-FP8 checkpoint; bench_one_batch sets them against a read bandwidth in its JSON lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from benchmark.common.fp8_checkpoint import quantize_checkpoint
from benchmark.common.static_batch import make_runner
from benchmark.common.weight_bytes import decode_weight_bytes, read_bandwidth
from benchmark.offline import bench_one_batch
from srt.server_args import ServerArgs


def by_hand(cfg: dict, batch: int, dense: int, fp8: bool) -> int:
    """A decode step's weight bytes: ``dense`` bytes a weight outside the quantized linears;
    an fp8 linear 1 byte a weight plus one float32 scale per row (every input width here is at
    most 128, one group of the 128 × 128 blocks)."""
    h, v, hd, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"], 3
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    e, k, i = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]

    def linear(rows: int, cols: int) -> int:
        return rows * cols + 4 * rows if fp8 else rows * cols * dense

    attention = linear(q + 2 * kv, h) + linear(h, q)
    small = (2 * hd + 2 * h + e * h) * dense  # q and k norms, the two layer norms, the router
    expert = linear(2 * i, h) + linear(h, i)
    routed = min(batch * k, e) * expert  # top_k experts a token, at most all of them
    lm_head, final_norm, embedding_rows = v * h * dense, h * dense, batch * h * dense
    return layers * (attention + small + routed) + lm_head + final_norm + embedding_rows


@pytest.mark.parametrize(
    "dtype,fp8,dense", [("float32", False, 4), ("bfloat16", False, 2), ("float32", True, 4)]
)
def test_decode_weight_bytes_equal_a_count_by_hand(qwen3_moe_path, tmp_path, dtype, fp8, dense):
    cfg = json.loads((Path(qwen3_moe_path) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["num_experts"] == 8  # what by_hand assumes
    path = quantize_checkpoint(qwen3_moe_path, str(tmp_path / "fp8")) if fp8 else qwen3_moe_path
    runner, _ = make_runner(ServerArgs(model_path=path, device="cpu", dtype=dtype), 1, 16)
    stored = {p.dtype for p in runner.model.parameters()}
    assert (torch.float8_e4m3fn in stored) == fp8
    for batch in (1, 2, 8):  # 8 × top_k is past the 8 experts: all of them, once
        assert decode_weight_bytes(runner.model, batch) == by_hand(cfg, batch, dense, fp8)


def test_read_bandwidth_keeps_the_callers_threads():
    threads = torch.get_num_threads()
    assert read_bandwidth(torch.device("cpu"), gib=1 / 256, repeat=2, threads=1) > 0
    assert torch.get_num_threads() == threads


def test_bench_one_batch_writes_the_effective_bandwidth(qwen3_moe_path, tmp_path, monkeypatch):
    out = tmp_path / "result.jsonl"
    argv = ["bench_one_batch.py", "--model-path", qwen3_moe_path, "--device", "cpu",
            "--dtype", "bfloat16", "--input-len", "4", "--output-len", "4",
            "--result-filename", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(bench_one_batch, "read_bandwidth", lambda device, threads: 1e10)
    bench_one_batch.main()
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = json.loads((Path(qwen3_moe_path) / "config.json").read_text())
    assert row["dtype"] == "bfloat16" and row["decode_weight_bytes"] == by_hand(cfg, 1, 2, False)
    effective = row["decode_weight_bytes"] / row["median_decode_latency"]
    assert row["decode_weight_gbps"] == pytest.approx(effective / 1e9)
    assert row["read_gbps"] == 10.0 and row["read_fraction"] == pytest.approx(effective / 1e10)
    assert row["read_threads"] >= 1
