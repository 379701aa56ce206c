"""The weight bytes a decode step reads, and a read bandwidth to set them against: what
bench_one_batch's effective-bandwidth figures and the GPU report's memory floor are made of.

The bytes are this process's weights as the loaded model stores them (float32 4 bytes a
weight, bf16 2, fp8 1 plus its float32 scales), counted from its parameters by
``WeightBytes.of`` at each dtype's own size. (The CPU thread choice counts the same weights in
float32 bytes on purpose, for the work its kernels do; this counts the bytes memory serves.)
"""

from __future__ import annotations

import time

import torch
from torch import nn

from srt.model_executor.weight_bytes import WeightBytes


def decode_weight_bytes(model: nn.Module, batch_size: int) -> int:
    """The weight bytes a decode step of ``batch_size`` sequences reads: every weight outside
    the routed experts (attention, dense MLPs, shared experts, routers, norms, the LM head), of
    the routed experts ``batch_size × top_k`` experts' share per MoE layer, at most all of this
    rank's (``WeightBytes.read_by``), and of the embedding table only the batch's rows (the
    whole table where the LM head reads it too)."""
    read = WeightBytes.of(model).read_by(batch_size)
    embed = model.model.embed_tokens.weight
    if getattr(model.lm_head, "weight", None) is not embed:
        read -= embed.nbytes - min(batch_size, embed.shape[0]) * embed[0].nbytes
    return read


def read_bandwidth(
    device: torch.device, gib: float = 1.0, repeat: int = 5, threads: int | None = None
) -> float:
    """Bytes per second a ``torch.sum`` over a float32 tensor of ``gib`` GiB reads (each byte
    once), best of ``repeat``; on CPU with ``threads`` intra-op threads (the caller's count is
    restored after), on a GPU timed with CUDA events."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=device)
    previous = torch.get_num_threads()
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        x.sum()  # warm-up: the reduction's kernel and threads started
        return x.nbytes / min(_seconds(lambda: x.sum(), device) for _ in range(repeat))
    finally:
        torch.set_num_threads(previous)


def _seconds(fn, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3
