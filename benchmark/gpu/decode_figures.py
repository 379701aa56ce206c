"""What the GPU report measures a decode step with: the device's copy bandwidth, the bytes a
decode step must read (the memory floor), and torch.profiler's counts per step (kernels,
launches, host synchronisations, copies, the device-busy share)."""

from __future__ import annotations

import math
import time
from collections import Counter

import torch

from benchmark.common.static_batch import decode_step, start_decoding
from benchmark.common.weight_bytes import decode_weight_bytes

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy")
LAUNCH_CALLS = (
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaGraphLaunch",
)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int, repeat: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once and written once,
    so 2 × the tensor's size per copy), timed with CUDA events on a GPU."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages, the copy kernel loaded
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t = time.perf_counter()
        for _ in range(repeat):
            dst.copy_(src)
        seconds = time.perf_counter() - t
    return 2 * src.nbytes * repeat / seconds


def floor_bytes(runner, batch_size: int, kv_tokens: int) -> int:
    """What one decode step must read: its weights (``decode_weight_bytes``: all but the routed
    experts, of which the share the batch can touch, and of the embedding table the batch's
    rows), plus the KV cache of ``kv_tokens`` tokens."""
    weights = decode_weight_bytes(runner.model, batch_size)
    return weights + kv_tokens * runner.token_to_kv_pool.bytes_per_token()


def merged_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def step_counts(events, steps: int, wall: float) -> dict[str, float]:
    """Per step: kernels (device events but copies and memsets), launch / sync / copy calls
    (the CUDA runtime and driver calls kineto records on the host), and the device-busy share
    (device events merged ÷ wall time). All zero on CPU, busy share NaN."""
    from torch.autograd import DeviceType

    device = [
        e
        for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    kernels = sum(not e.name.startswith(("Memcpy", "Memset")) for e in device)
    calls = Counter(e.name for e in events if e.device_type == DeviceType.CPU)
    busy_us = merged_length([(e.time_range.start, e.time_range.end) for e in device])
    return {
        "kernels": kernels / steps,
        "launches": sum(calls[c] for c in LAUNCH_CALLS) / steps,
        "syncs": sum(calls[c] for c in SYNC_CALLS) / steps,
        "copies": sum(calls[c] for c in COPY_CALLS) / steps,
        "busy": busy_us / (wall * 1e6) if device else math.nan,
    }


def profile_decode(runner, ctx, inputs: list[list[int]], steps: int) -> dict[str, float]:
    """``step_counts`` over ``steps`` decode steps of ``inputs`` (prefilled, two steps warm)."""
    from torch.profiler import ProfilerActivity, profile

    batch = start_decoding(runner, ctx, inputs, steps + 2)
    for _ in range(2):
        decode_step(runner, batch)
    cuda = runner.device.type == "cuda"
    # CUDA activity alone: kineto records the runtime and driver calls with it, and leaving the
    # CPU operators out keeps the profiler's own cost off the host-bound eager steps.
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            decode_step(runner, batch)
        sync(runner.device)
        wall = time.perf_counter() - start
    return step_counts(prof.events(), steps, wall)
