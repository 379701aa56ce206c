"""``--deepep-mode auto``: the normal dispatcher for extend batches, low_latency otherwise."""

from __future__ import annotations

from collections.abc import Callable

import torch

from srt.layers.moe.token_dispatcher.base import DispatchOutput, TokenDispatcher
from srt.layers.moe.token_dispatcher.low_latency import TorchA2ALowLatencyDispatcher
from srt.layers.moe.token_dispatcher.normal import TorchA2ANormalDispatcher
from srt.layers.overlap.single_batch_overlap import DownGemmOverlapArgs


class TorchA2AAutoDispatcher(TokenDispatcher):
    """Picks a mode per dispatch from ``is_extend``, which must be the *global* forward mode
    (is any DP rank extending?): every EP rank must pick the same mode, since the two modes
    issue different collectives. An idle rank follows the others. A decode step falls back to
    normal when ``global_max_tokens`` (the most tokens any EP rank dispatches, the same on
    every rank) exceeds the low_latency capacity, which could otherwise overflow. With
    single-batch overlap both modes combine block by block (one BlockedCombine, shared)."""

    def __init__(self, normal: TorchA2ANormalDispatcher, low_latency: TorchA2ALowLatencyDispatcher):
        self.normal, self.low_latency = normal, low_latency
        self._active: TokenDispatcher | None = None

    def dispatch_a(
        self,
        hidden_states,
        topk_weights,
        topk_ids,
        *,
        is_extend=None,
        global_max_tokens=None,
        blocked_combine=None,
    ) -> None:
        if is_extend is None:
            raise ValueError("--deepep-mode auto needs is_extend (the global forward mode)")
        if self._active is not None:
            raise RuntimeError("dispatcher dispatch_a called before the last combine_b")
        too_many = global_max_tokens is not None and global_max_tokens > self.low_latency.capacity
        self._active = self.normal if is_extend or too_many else self.low_latency
        self._active.dispatch_a(
            hidden_states,
            topk_weights,
            topk_ids,
            global_max_tokens=global_max_tokens,
            blocked_combine=blocked_combine,
        )

    @property
    def active(self) -> TokenDispatcher:
        if self._active is None:
            raise RuntimeError("dispatcher used without a dispatch_a")
        return self._active

    def dispatch_b(self) -> DispatchOutput:
        return self.active.dispatch_b()

    @property
    def overlap_args(self) -> DownGemmOverlapArgs | None:
        """Single-batch overlap: the active mode's blocked-combine layout."""
        return None if self._active is None else self._active.overlap_args

    def combine_a_block(self, index: int, block_output: torch.Tensor) -> None:
        self.active.combine_a_block(index, block_output)

    def combine_a_blocks(self, compute_block: Callable[[int], torch.Tensor]) -> None:
        self.active.combine_a_blocks(compute_block)

    def combine_a(self, expert_output) -> None:
        self.active.combine_a(expert_output)

    def combine_b(self):
        out = self.active.combine_b()
        self._active = None
        return out
