"""Routed experts: stacked expert weights, laid out and run by the kernel that
``expert_kernel.choose_expert_kernel`` picks for them (``expert_compute``)."""

from __future__ import annotations

import torch
from torch import nn

from srt.layers import cpu_kernels
from srt.layers.linear import PanelWeight, copy_checked, linear, pack_weight
from srt.layers.moe.blocked_experts import BlockedProjection
from srt.layers.moe.expert_compute import compute_experts
from srt.layers.moe.expert_kernel import ExpertKernel, choose_expert_kernel
from srt.layers.overlap.single_batch_overlap import DownGemmOverlapArgs, RowSumOverlapArgs


class FusedMoE(nn.Module):
    """Experts ``[start, start + num_local)`` of ``num_experts``, weights stacked:
    ``w13_weight`` [E_local, 2·I, H] (gate | up) and ``w2_weight`` [E_local, H, I].

    Expert TP (``tp_size > 1``): each rank holds the ``I / tp_size`` slice ``tp_rank`` of every
    local expert's intermediate dimension, so its output is a partial sum; the caller reduces
    it over the MoE-TP (and EP) ranks."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        ep_rank: int = 0,
        ep_size: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over {ep_size} ranks")
        if intermediate_size % tp_size:
            raise ValueError(
                f"moe intermediate size {intermediate_size} cannot be split over {tp_size} ranks"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.start = ep_rank * self.num_local_experts
        self.tp_rank, self.tp_size = tp_rank, tp_size
        intermediate_size //= tp_size
        self.intermediate_size = intermediate_size
        e, i, h = self.num_local_experts, intermediate_size, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2_weight = nn.Parameter(torch.empty(e, h, i))
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        # Set by prepare_for_cpu, once loaded: w13 and w2 in the C kernel's panels (``cpu_kernels``)
        # or, for the loop, per local expert in oneDNN's layout.
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.packed_kernel: ExpertKernel | None = None

    @property
    def kernel(self) -> ExpertKernel:
        """The kernel that runs these experts (``choose_expert_kernel``): once ``prepare_for_cpu``
        ran, the one it laid the weights out for (kept: asking costs 3-5 µs a call, reading it
        0.3); before, one that reads torch's layout."""
        if self.packed_kernel is not None:
            return self.packed_kernel
        return self._choose_kernel(in_panels=False)

    def _choose_kernel(self, in_panels: bool) -> ExpertKernel:
        w = self.w13_weight
        return choose_expert_kernel(
            w.device, w.dtype, w.shape[-1], self.intermediate_size, in_panels
        )

    def prepare_for_cpu(self) -> None:
        """Once loaded, on CPU: the weights in the layout their kernel reads, the C kernel's
        panels or, for the loop, oneDNN's per expert (``pack_weight``)."""
        self.packed_kernel = self._choose_kernel(in_panels=True)
        if self.packed_kernel is ExpertKernel.CPU_KERNEL:
            self.panels = tuple(
                cpu_kernels.pack_panels(w) for w in (self.w13_weight, self.w2_weight)
            )
        elif self.packed_kernel is ExpertKernel.LOOP:
            packed = [
                (pack_weight(w13), pack_weight(w2))
                for w13, w2 in zip(self.w13_weight, self.w2_weight)
            ]
            self.packed = packed if packed and packed[0][0] is not None else None

    def expert_linear(self, x: torch.Tensor, e: int, which: int) -> torch.Tensor:
        """x times expert ``e``'s w13 (``which`` 0) or w2 (1), transposed."""
        weight = (self.w13_weight, self.w2_weight)[which][e]
        if self.panels is not None:
            return linear(x, weight, packed=PanelWeight(self.panels[which][e]))
        return linear(x, weight, packed=None if self.packed is None else self.packed[e][which])

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: str, expert_id: int
    ) -> None:
        local = expert_id - self.start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        i = self.intermediate_size
        dim = 1 if shard_id == "w2" else 0  # w1/w3 [I, H], w2 [H, I]
        if self.tp_size > 1 and loaded.shape[dim] == i * self.tp_size:
            loaded = loaded.narrow(dim, self.tp_rank * i, i)
        dst = {"w1": lambda p: p[:i], "w3": lambda p: p[i:], "w2": lambda p: p}[shard_id](
            param.data[local]
        )
        copy_checked(dst, loaded, name)

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [T, H]; topk_* [T, topk] with global ids → Σ_k w·expert(x), [T, H].
        Ids outside this rank's range contribute nothing (they are another rank's)."""
        compute = compute_experts(self, self.kernel, hidden_states, topk_weights, topk_ids)
        return compute.output()

    # ---------------------------------------------------------------- single-batch overlap
    def up_project_blocks(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        args: DownGemmOverlapArgs | RowSumOverlapArgs,
    ) -> BlockedProjection:
        """SBO, first half: the gated up-projection of every (row, slot) pair of this rank's
        experts (with the C kernel, nothing yet); ``down_project_block`` finishes one block at a
        time. No host synchronisation but with the ``LOOP`` kernel (see ``expert_compute``)."""
        compute = compute_experts(self, self.kernel, hidden_states, topk_weights, topk_ids)
        return BlockedProjection(compute, args, self.num_local_experts)

    def down_project_block(self, blocks: BlockedProjection, index: int) -> torch.Tensor:
        """SBO, second half for block ``index``: with ``RowSumOverlapArgs`` (low_latency) each
        row's weighted outputs of the block's experts summed, ``[R, H]``; with
        ``DownGemmOverlapArgs`` (normal) the block's pairs' weighted outputs ``[P, H]`` in the
        block's pair order (the order its combine sends them)."""
        return blocks.down(index)
