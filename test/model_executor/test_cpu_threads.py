"""The per-step CPU thread choice: a decode step that reads few weights runs on one core fewer
than prefill (left to the front end), one that reads many uses every core; a mixture of
experts counts only the experts its sequences can reach; --cpu-decode-threads overrides it.
A prefill of little work (tokens × the weight bytes a token reads) leaves that core too.
And the ranks' OpenMP spin, short unless the environment chose one."""

from __future__ import annotations

import os

import pytest
import torch

from srt.model_executor.cpu_threads import (
    OPENMP_SPIN_COUNT,
    SMALL_EXTEND_WORK,
    SMALL_MODEL_BYTES,
    CpuThreads,
    limit_openmp_spin,
)
from srt.model_executor.forward_batch_info import ForwardMode
from srt.model_executor.weight_bytes import WeightBytes
from srt.server_args import ServerArgs

CORES = len(os.sched_getaffinity(0))
LEAN = max(1, CORES - 1)
MIB = 1 << 20


def _args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="unused", device="cpu", **kwargs)


def _threads(weights: WeightBytes, **kwargs) -> CpuThreads:
    return CpuThreads.from_server_args(_args(**kwargs), weights)


def test_small_model_leaves_a_core_to_the_front_end_in_decode():
    threads = _threads(WeightBytes(SMALL_MODEL_BYTES - 1))
    assert threads.threads_for(ForwardMode.EXTEND, 8, 1024) == CORES
    assert threads.threads_for(ForwardMode.DECODE, 1) == LEAN
    assert threads.threads_for(ForwardMode.DECODE, 256) == LEAN


def test_large_dense_model_decodes_on_every_core():
    threads = _threads(WeightBytes(SMALL_MODEL_BYTES))
    assert threads.threads_for(ForwardMode.DECODE, 1) == CORES
    assert not threads.leaves_front_end_a_core(1)


@pytest.mark.skipif(CORES < 2, reason="one core: nothing to leave")
def test_front_end_core_only_when_every_decode_step_leaves_it():
    assert _threads(WeightBytes(SMALL_MODEL_BYTES - 1)).leaves_front_end_a_core(256)
    moe = _threads(WeightBytes(20 * MIB, 96 * MIB, num_experts=32, top_k=6))
    assert moe.leaves_front_end_a_core(2) and not moe.leaves_front_end_a_core(3)
    assert _threads(WeightBytes(1), cpu_decode_threads=CORES - 1).leaves_front_end_a_core(1)


def test_mixture_of_experts_counts_the_experts_its_sequences_reach():
    # 32 experts top-6 (96 MiB in all), 20 MiB outside the experts
    weights = WeightBytes(20 * MIB, 96 * MIB, num_experts=32, top_k=6)
    assert weights.read_by(1) == 20 * MIB + 18 * MIB
    assert weights.read_by(6) == 20 * MIB + 96 * MIB  # 36 picks ≥ 32 experts: all of them
    threads = _threads(weights)
    assert [threads.threads_for(ForwardMode.DECODE, n) for n in (1, 2, 3, 8)] == [
        LEAN,
        LEAN,
        CORES,
        CORES,
    ]


def test_small_prefill_leaves_a_core_to_the_front_end():
    # a token reads 1 MiB outside the experts and 3 of 12 experts of 1 MiB each: 4 MiB
    weights = WeightBytes(1 * MIB, 12 * MIB, num_experts=12, top_k=3)
    threads = _threads(weights)
    under = SMALL_EXTEND_WORK // (4 * MIB) - 1
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        assert threads.threads_for(mode, 16, under) == LEAN
        assert threads.threads_for(mode, 16, under + 1) == CORES
    # one that reads many weights keeps every core, however few its tokens
    assert _threads(WeightBytes(SMALL_MODEL_BYTES)).threads_for(ForwardMode.EXTEND, 1, 1) == CORES


def test_decode_threads_flag_overrides_every_decode_step():
    threads = _threads(WeightBytes(1 * MIB), cpu_decode_threads=3)
    assert threads.threads_for(ForwardMode.DECODE, 1) == 3
    assert threads.threads_for(ForwardMode.DECODE, 512) == 3
    assert threads.threads_for(ForwardMode.EXTEND, 1, 1) == LEAN
    assert threads.threads_for(ForwardMode.EXTEND, 1, 512) == CORES


def test_apply_switches_threads_by_step():
    before = torch.get_num_threads()
    weights = WeightBytes(20 * MIB, 96 * MIB, num_experts=32, top_k=6)
    threads = CpuThreads(
        extend_threads=2,
        decode_threads=2,
        lean_extend_threads=1,
        lean_decode_threads=1,
        weights=weights,
    )
    try:
        threads.apply(ForwardMode.DECODE, 1)
        assert torch.get_num_threads() == 1
        threads.apply(ForwardMode.DECODE, 8)
        assert torch.get_num_threads() == 2
        threads.apply(ForwardMode.IDLE, 0)
        assert torch.get_num_threads() == 1
        threads.apply(ForwardMode.EXTEND, 1, 64)  # 64 tokens × 38 MiB
        assert torch.get_num_threads() == 2
        threads.apply(ForwardMode.EXTEND, 1, 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kwargs", [{"cpu_decode_threads": 0}, {"cpu_decode_threads": -2}])
def test_bad_decode_threads_are_refused(kwargs):
    with pytest.raises(ValueError, match="--cpu-decode-threads"):
        _args(**kwargs)


def test_openmp_spin_is_limited_unless_the_environment_chose():
    environ = {"PATH": "/bin"}
    assert limit_openmp_spin(environ) and environ["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        environ = dict(chosen)
        assert not limit_openmp_spin(environ) and environ == chosen
