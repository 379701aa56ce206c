"""StepOverlap: which overlap each step runs, for the ModelRunner.

A fixed ``--overlap-mode`` runs its mode on every step (TBO and DBO only where the batch splits:
below the thresholds, or where a DP group cannot split, the step runs unsplit). Under ``auto`` an
``OverlapPolicy`` chooses per step; every rank must choose the same (the modes issue different
collectives), so the policy is fed the same numbers on every rank: the step's kind and tokens
as the MLP sync agreed them, and each step's time and all-to-all time, maxed over the ranks.
Those ride on the next step's MLP sync (two more ints per row) under DP attention; without it,
one small all-gather per step carries them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from srt.batch_overlap.overlap_policy import OverlapPolicy
from srt.distributed.communication_op import all_gather_ints
from srt.distributed.parallel_state import ParallelState
from srt.layers.moe.token_dispatcher.base import CommMeter
from srt.model_executor.forward_batch_info import SPLIT_MODES, ForwardMode

_US = 1e6


class _Step(NamedTuple):
    kind: str
    mode: str
    tokens: int


class StepOverlap:
    def __init__(
        self,
        overlap_mode: str,
        modes: tuple[str, ...],
        comm_meter: CommMeter,
        device: torch.device,
    ):
        self.overlap_mode = overlap_mode
        self.policy = OverlapPolicy(modes) if overlap_mode == "auto" else None
        self.comm_meter = comm_meter
        comm_meter.enabled = self.policy is not None
        self.device = device
        self.mode = "off" if overlap_mode == "auto" else overlap_mode  # of the coming forward
        self._step: _Step | None = None  # the last forward's, until its measurement is shared
        self._measured = (0, 0)  # its microseconds: the step, the dispatchers' share
        self._start = 0.0
        self.all_to_all = {"bytes": 0, "seconds": 0.0}  # this rank's, over the run (auto)

    @property
    def measurement(self) -> list[int]:
        """This rank's ints for the sync: the last forward's time and all-to-all time (µs)."""
        return list(self._measured) if self.policy is not None else []

    def fixed_mode(self, can_split: bool) -> str:
        """A fixed ``--overlap-mode``'s mode for a step: a split mode (TBO, DBO) runs only where
        the step can split."""
        fixed = self.overlap_mode
        return "off" if fixed in SPLIT_MODES and not can_split else fixed

    def choose(
        self, mode: ForwardMode, tokens: int, can_split: bool, shared: list[int] | None
    ) -> str:
        """The overlap of the coming step of global ``mode``, ``tokens`` (the most of any
        DP group), and whether it can split (agreed under DP attention); ``shared``:
        ``measurement`` maxed over the ranks (auto). Sets ``mode`` and returns it."""
        if self.policy is None:
            self.mode = self.fixed_mode(can_split)
            return self.mode
        if self._step is not None and shared:
            seconds, comm = (value / _US for value in shared)
            self.policy.observe(*self._step, seconds, comm)
        self._step = None
        if mode.is_idle():  # nothing runs anywhere (the caller skips the forward)
            self.mode = "off"
            return self.mode
        kind = "prefill" if mode.is_extend() else "decode"
        allowed = {"off", "sbo", *(["tbo"] if can_split else [])}
        self.mode = self.policy.choose(kind, tokens, allowed)
        self._step = _Step(kind, self.mode, tokens)
        return self.mode

    def share(self, parallel: ParallelState) -> list[int] | None:
        """Without DP attention: the measurement maxed over the ranks, by its own all-gather."""
        if self.policy is None:
            return None
        rows = all_gather_ints(parallel.world, self.measurement)
        return [max(column) for column in zip(*rows)]

    def start(self) -> None:
        if self.policy is not None:
            self.comm_meter.take()
            self._start = time.perf_counter()

    def finish(self) -> None:
        if self.policy is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time, not its launch
        seconds = time.perf_counter() - self._start
        comm, nbytes = self.comm_meter.take()
        self.all_to_all["bytes"] += nbytes
        self.all_to_all["seconds"] += comm
        self._measured = (round(seconds * _US), round(comm * _US))

    def info(self) -> dict:
        out: dict = {"overlap_mode": self.overlap_mode}
        if self.policy is not None:
            out.update(self.policy.info())
        return out
