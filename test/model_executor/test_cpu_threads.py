"""The per-mode CPU thread choice: a small model decodes on one core fewer than it prefills
(left to the front end), a large one uses every core; --cpu-decode-threads overrides it."""

from __future__ import annotations

import os

import pytest
import torch

from srt.model_executor.cpu_threads import SMALL_MODEL_BYTES, CpuThreads
from srt.model_executor.forward_batch_info import ForwardMode
from srt.server_args import ServerArgs

CORES = len(os.sched_getaffinity(0))


def _args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="unused", device="cpu", **kwargs)


def test_small_model_leaves_a_core_to_the_front_end_in_decode():
    threads = CpuThreads.from_server_args(_args(), SMALL_MODEL_BYTES - 1)
    assert threads.extend_threads == CORES
    assert threads.decode_threads == max(1, CORES - 1)


def test_large_model_and_override_use_what_they_are_given():
    assert CpuThreads.from_server_args(_args(), SMALL_MODEL_BYTES).decode_threads == CORES
    override = CpuThreads.from_server_args(_args(cpu_decode_threads=3), 1)
    assert override.decode_threads == 3


def test_apply_switches_threads_by_mode():
    before = torch.get_num_threads()
    threads = CpuThreads(extend_threads=2, decode_threads=1)
    try:
        threads.apply(ForwardMode.DECODE)
        assert torch.get_num_threads() == 1
        threads.apply(ForwardMode.EXTEND)
        assert torch.get_num_threads() == 2
        threads.apply(ForwardMode.IDLE)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kwargs", [{"cpu_decode_threads": 0}, {"cpu_decode_threads": -2}])
def test_bad_decode_threads_are_refused(kwargs):
    with pytest.raises(ValueError, match="--cpu-decode-threads"):
        _args(**kwargs)
