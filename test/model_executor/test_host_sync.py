"""No host synchronisation inside a decode forward: the PyTorch path (``SRT_CPU_KERNELS=0``, the
code a GPU runs) decodes under ``forbid_host_sync``, which fails on any tensor → Python
conversion or value-sized operation inside ``ModelRunner.forward``, for Qwen3-MoE, DeepSeek-V2
and V3: on one rank, and on two ranks with DP attention and the ``low_latency`` all-to-all,
with two-batch overlap forced on and with single-batch overlap (its fixed-shape blocked
combine), a step where one DP group is idle included. The guard itself is checked to fire on
each kind of synchronisation."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from helpers.overlap_script import MODELS, server_args
from helpers.run_ranks import run_ranks
from helpers.seq_driver import SeqDriver

from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.model_runner import ModelRunner
from srt.utils.sync_guard import HostSyncError, allow_host_sync, forbid_host_sync

SYNCS = {
    "item": lambda t: t[0].item(),
    "tolist": lambda t: t.tolist(),
    "int": lambda t: int(t[0]),
    "bool": lambda t: bool(t[0]),
    "float": lambda t: float(t[0]),
    "index": lambda t: [1, 2, 3, 4][t[0]],
    "nonzero": lambda t: t.nonzero(),
    "bincount": lambda t: torch.bincount(t),
    "unique": lambda t: torch.unique(t),
    "mask": lambda t: t[t > 1],
    "repeat_interleave": lambda t: torch.repeat_interleave(t, t),
}


@pytest.mark.parametrize("name", SYNCS)
def test_guard_fails_each_host_sync(name):
    t = torch.tensor([1, 3, 2])
    SYNCS[name](t)  # fine outside
    with forbid_host_sync(), pytest.raises(HostSyncError, match="host synchronisation"):
        SYNCS[name](t)


def test_guard_lets_device_work_and_allowed_reads_through():
    t = torch.tensor([1, 3, 2])
    with forbid_host_sync():
        order = torch.argsort(t, stable=True)
        ends = torch.searchsorted(t[order], torch.arange(1, 4))
        torch.repeat_interleave(t, t, output_size=6)
        torch.where(t > 1, t, 0)
        with allow_host_sync("host tensors"):
            assert t.tolist() == [1, 3, 2]
        with pytest.raises(HostSyncError):
            t.tolist()
    assert ends.tolist() == [0, 1, 2]


def _decode_guarded(runner: ModelRunner, driver: SeqDriver, idle: bool) -> dict:
    runner.forward_step(driver.batch(("extend", [[1, 2, 3, 4], [5, 6, 7], [8, 9]], None)))
    runner.forbid_host_sync = True
    for step in range(2):
        runner.forward_step(None if idle and step else driver.batch(("decode",)))
    return dict(runner.step_counts)


def sync_worker(rank: int, n: int, init_method: str, paths: dict) -> dict:
    os.environ["SRT_CPU_KERNELS"] = "0"  # a fresh process: the kernels are not loaded yet
    torch.set_num_threads(1)
    out = {}
    for name, path in paths.items():
        if rank == 0:
            runner = ModelRunner(server_args(path, 1, 1, "none"))
            out[name, "plain"] = _decode_guarded(runner, SeqDriver(runner), idle=False)
    parallel = init_parallel_state(n, rank, n, True, "torch", "gloo", init_method)
    overlaps = {
        "tbo": dict(
            enable_two_batch_overlap=True, tbo_decode_token_threshold=0,
            tbo_prefill_token_threshold=0,
        ),
        "sbo": dict(enable_single_batch_overlap=True, sbo_num_blocks=3),  # blocks of 2, 1, 1
    }  # fmt: skip
    try:
        for (name, path), (overlap, flags) in itertools.product(paths.items(), overlaps.items()):
            sa = server_args(
                path, n, n, "torch", deepep_mode="low_latency", max_dispatch_tokens_per_rank=64,
                **flags,
            )  # fmt: skip
            runner = ModelRunner(sa, parallel=parallel)
            out[name, overlap] = _decode_guarded(runner, SeqDriver(runner, rank), idle=rank == 1)
    finally:
        parallel.destroy()
    return out


@pytest.mark.slow  # starts rank processes
def test_decode_forward_has_no_host_sync(tiny_models):
    paths = {name: tiny_models[name] for name in MODELS}
    results = run_ranks(sync_worker, 2, paths, timeout=300)
    for name in MODELS:
        assert results[0][name, "plain"] == {
            (False, False, "extend"): 1,
            (False, False, "decode"): 2,
        }
        # both decode steps ran split under the guard, the idle one on rank 1 included
        assert results[0][name, "tbo"][True, False, "decode"] == 2
        assert results[1][name, "tbo"][True, False, "idle"] == 1
        # and with single-batch overlap: every step blocked, the idle one included
        assert results[0][name, "sbo"][False, True, "decode"] == 2
        assert results[1][name, "sbo"][False, True, "decode"] == 1
        assert results[1][name, "sbo"][False, True, "idle"] == 1
