"""No host synchronisation inside a decode forward: the PyTorch path (``SRT_CPU_KERNELS=0``, the
code a GPU runs) decodes under ``forbid_host_sync``, which fails on any tensor → Python
conversion or value-sized operation inside ``ModelRunner.forward``, for Qwen3-MoE, DeepSeek-V2
and V3: on one rank, and on two ranks with DP attention and the ``low_latency`` all-to-all,
with two-batch overlap forced on and with single-batch overlap (its fixed-shape blocked
combine), a step where one DP group is idle included. The guard itself is checked to fire on
each kind of synchronisation, and to be on in each of those paths and in graph replay: a host
read patched into the model fails the step through ``forward_step`` (the negative control)."""

from __future__ import annotations

import itertools
import os
import traceback

import pytest
import torch
from helpers.overlap_script import MODELS, server_args
from helpers.run_ranks import run_ranks
from helpers.seq_driver import SeqDriver

from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.cuda_graph_runner import CudaGraphRunner
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
    "where": lambda t: torch.where(t > 1),
    "equal": lambda t: torch.equal(t, t),
    "allclose": lambda t: torch.allclose(t, t),
    "is_nonzero": lambda t: torch.is_nonzero(t[:1]),
    "contains": lambda t: 3 in t,
    "repr": lambda t: repr(t),
    "format": lambda t: f"{t[0]:d}",
    "arange": lambda t: torch.arange(t[0]),
    "full": lambda t: torch.full((2,), t[0]),
    "narrow": lambda t: t.narrow(0, t[0], 1),
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
        torch.arange(3) + torch.full((3,), 2) + torch.zeros(3, dtype=torch.int64)
        t.narrow(0, 1, 2)
        with allow_host_sync("host tensors"):
            assert t.tolist() == [1, 3, 2]
        with pytest.raises(HostSyncError):
            t.tolist()
    assert ends.tolist() == [0, 1, 2]


EXTEND = ("extend", [[1, 2, 3, 4], [5, 6, 7], [8, 9]], None)
TBO = dict(enable_two_batch_overlap=True, tbo_decode_token_threshold=0,
           tbo_prefill_token_threshold=0)  # fmt: skip
OVERLAPS = {"tbo": TBO, "sbo": dict(enable_single_batch_overlap=True, sbo_num_blocks=3)}


def _fault_in(runner: ModelRunner) -> None:
    """The negative control: the input norm of the first layer that a split step runs split
    (Qwen3's first, DeepSeek's first MoE layer) asks the device for a value; an instance's
    method is patched, nothing of the runner's."""
    model = runner.model.model
    norm = model.layers[model.tbo_start_layer].input_layernorm
    forward = norm.forward

    def reads_a_value(x, *args):
        x.sum().item()
        return forward(x, *args)

    norm.forward = reads_a_value


def _faulted_step(runner: ModelRunner, batch) -> tuple[str, list[str]] | None:
    """One step with the fault in through ``forward_step``: the step's overlap mode and the
    source files the HostSyncError came through (None: nothing raised)."""
    try:
        runner.forward_step(batch)
    except HostSyncError as error:
        files = {os.path.basename(f.filename) for f in traceback.extract_tb(error.__traceback__)}
        return runner.step_overlap.mode, sorted(files)
    return None


def _guarded_case(runner: ModelRunner, driver: SeqDriver, idle: bool, decodes: int = 2) -> dict:
    """Extend, then ``decodes`` decode steps under the guard (from the second on, a rank with
    ``idle`` has no batch), then one with the fault in (``idle``: no batch again)."""
    runner.forward_step(driver.batch(EXTEND))
    runner.forbid_host_sync = True
    for step in range(decodes):
        runner.forward_step(None if idle and step else driver.batch(("decode",)))
    counts = dict(runner.step_counts)
    _fault_in(runner)
    fault = _faulted_step(runner, None if idle else driver.batch(("decode",)))
    return {"counts": counts, "fault": fault}


def _with_graphs(runner: ModelRunner) -> ModelRunner:
    """Decode replayed from "graphs" run eagerly over their static buffers (CPU has none).
    Only the faulted step decodes, and on GRAPH_MODEL the fault comes before any attention,
    so the attention backend's graph support never matters."""
    runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], eager=True)
    return runner


def _single_rank_cases(paths: dict) -> dict:
    out = {}
    for name, path in paths.items():
        runner = ModelRunner(server_args(path, 1, 1, "none"))
        out[name, "plain"] = _guarded_case(runner, SeqDriver(runner), idle=False)
    runner = _with_graphs(ModelRunner(server_args(paths[GRAPH_MODEL], 1, 1, "none")))
    out[GRAPH_MODEL, "graph"] = _guarded_case(runner, SeqDriver(runner), False, decodes=0)
    return out


def _dp_args(path: str, n: int, flags: dict):
    return server_args(
        path, n, n, "torch", deepep_mode="low_latency", max_dispatch_tokens_per_rank=64, **flags
    )


def sync_worker(rank: int, n: int, init_method: str, paths: dict) -> dict:
    os.environ["SRT_CPU_KERNELS"] = "0"  # a fresh process: the kernels are not loaded yet
    torch.set_num_threads(1)
    out = _single_rank_cases(paths) if rank == 0 else {}
    parallel = init_parallel_state(n, rank, n, True, "torch", "gloo", init_method)
    try:
        for (name, path), (overlap, flags) in itertools.product(paths.items(), OVERLAPS.items()):
            runner = ModelRunner(_dp_args(path, n, flags), parallel=parallel)
            out[name, overlap] = _guarded_case(runner, SeqDriver(runner, rank), idle=rank == 1)
        runner = _with_graphs(ModelRunner(_dp_args(paths[GRAPH_MODEL], n, TBO), parallel=parallel))
        out[GRAPH_MODEL, "dp-graph"] = _guarded_case(runner, SeqDriver(runner, rank), rank == 1, 0)
    finally:
        parallel.destroy()
    return out


GRAPH_MODEL = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def results(tiny_models) -> list[dict]:
    """Every rank's cases: one launch of the two ranks for both tests."""
    return run_ranks(sync_worker, 2, {name: tiny_models[name] for name in MODELS}, timeout=300)


@pytest.mark.slow  # starts rank processes
def test_decode_forward_has_no_host_sync(results):
    for name in MODELS:
        assert results[0][name, "plain"]["counts"] == {("off", "extend"): 1, ("off", "decode"): 2}
        # both decode steps ran split under the guard, the idle one on rank 1 included
        assert results[0][name, "tbo"]["counts"]["tbo", "decode"] == 2
        assert results[1][name, "tbo"]["counts"]["tbo", "idle"] == 1
        # and with single-batch overlap: every step blocked, the idle one included
        assert results[0][name, "sbo"]["counts"]["sbo", "decode"] == 2
        assert results[1][name, "sbo"]["counts"]["sbo", "decode"] == 1
        assert results[1][name, "sbo"]["counts"]["sbo", "idle"] == 1


# (rank, case): (the step's overlap mode, a source file the error must have come through)
FAULTS = {
    (0, "plain"): ("off", "model_runner.py"),
    (0, "tbo"): ("tbo", "two_batch_overlap.py"),
    (1, "tbo"): ("tbo", "two_batch_overlap.py"),  # idle
    (0, "sbo"): ("sbo", "model_runner.py"),
    (1, "sbo"): ("sbo", "model_runner.py"),  # idle
}
GRAPH_FAULTS = {
    (0, "graph"): ("off", "cuda_graph_runner.py"),
    (0, "dp-graph"): ("tbo", "cuda_graph_runner.py"),
    (1, "dp-graph"): ("tbo", "cuda_graph_runner.py"),  # idle: padding rows only
}


@pytest.mark.slow  # starts rank processes
def test_guard_is_on_in_every_forward_path(results):
    """The negative control: a host read patched into the model fails the step through
    ``forward_step`` on the plain path, split by TBO, blocked by SBO, on an idle DP rank and
    replayed from graphs (one rank, and DP with an idle rank), each path's own code in the
    error's traceback."""
    cases = [(name, key) for name in MODELS for key in FAULTS]
    cases += [(GRAPH_MODEL, key) for key in GRAPH_FAULTS]
    for name, (rank, case) in cases:
        mode, source = (FAULTS | GRAPH_FAULTS)[rank, case]
        fault = results[rank][name, case]["fault"]
        assert fault is not None, f"{name} rank {rank} {case}: the host read went through"
        assert fault[0] == mode and source in fault[1], (name, rank, case, fault)
