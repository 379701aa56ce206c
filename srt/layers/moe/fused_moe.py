"""Routed experts: stacked expert weights, laid out and run by the kernel that
``expert_kernel.choose_expert_kernel`` picks for them (``expert_compute``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from srt.layers import cpu_kernels
from srt.layers.linear import copy_checked, linear, pack_weight
from srt.layers.moe.blocked_experts import BlockedProjection
from srt.layers.moe.expert_compute import compute_experts
from srt.layers.moe.expert_kernel import ExpertKernel, choose_expert_kernel
from srt.layers.overlap.single_batch_overlap import DownGemmOverlapArgs, RowSumOverlapArgs
from srt.layers.quantization import fp8


class ExpertPanels(NamedTuple):
    """w13 and w2 in the C kernel's panels, with fp8's packed scales and K groups."""

    w13: torch.Tensor
    w2: torch.Tensor
    scales: tuple[torch.Tensor | None, torch.Tensor | None]
    groups: tuple[int, int]


class FusedMoE(nn.Module):
    """Experts ``[start, start + num_local)`` of ``num_experts`` (with EPLB: expert slots,
    each holding the checkpoint expert ``local_experts`` names), weights stacked:
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
        local_experts: list[int] | None = None,
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
        # EPLB: the checkpoint's expert each local slot holds (None: expert start + slot)
        self.local_experts = local_experts
        self.tp_rank, self.tp_size = tp_rank, tp_size
        intermediate_size //= tp_size
        self.intermediate_size = intermediate_size
        e, i, h = self.num_local_experts, intermediate_size, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2_weight = nn.Parameter(torch.empty(e, h, i))
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        # fp8 (``use_fp8``, ``quantize_loaded``): per-row scales of w13 and w2, their K groups.
        self.w13_weight_scale_inv: nn.Parameter | None = None
        self.w2_weight_scale_inv: nn.Parameter | None = None
        self.groups = (0, 0)
        self.fp8_block: tuple[int, int] | None = None
        # Set by prepare_for_cpu, once loaded: w13 and w2 in the C kernel's panels (``cpu_kernels``)
        # or, for the loop, per local expert in the panels or oneDNN's layout.
        self.panels: ExpertPanels | None = None
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

    @property
    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.w13_weight_scale_inv, self.w2_weight_scale_inv

    def prepare_for_cpu(self) -> None:
        """Once loaded, on CPU: the weights in the layout their kernel reads, the C kernel's
        panels or, for the loop, per expert (``pack_weight``)."""
        self.packed_kernel = self._choose_kernel(in_panels=True)
        weights = (self.w13_weight, self.w2_weight)
        if self.packed_kernel is ExpertKernel.CPU_KERNEL:
            scales = tuple(None if s is None else cpu_kernels.pack_scales(s) for s in self.scales)
            self.panels = ExpertPanels(*map(cpu_kernels.pack_panels, weights), scales, self.groups)
        elif self.packed_kernel is ExpertKernel.LOOP:
            packed = [
                tuple(pack_weight(w[e], *self._scale_of(i, e)) for i, w in enumerate(weights))
                for e in range(self.num_local_experts)
            ]
            self.packed = packed if packed and packed[0][0] is not None else None

    def expert_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a row per local expert (weights, fp8 scales): what EPLB moves."""
        return [t.data for t in (self.w13_weight, self.w2_weight, *self.scales) if t is not None]

    def repack(self) -> None:
        """After the weights changed in place (EPLB): their CPU layout again, if they had one."""
        if self.packed_kernel is not None:
            self.prepare_for_cpu()

    def _scale_of(self, which: int, e: int) -> tuple[torch.Tensor | None, int]:
        scale = self.scales[which]
        return (None, 0) if scale is None else (scale[e], self.groups[which])

    def expert_linear(self, x: torch.Tensor, e: int, which: int) -> torch.Tensor:
        """x times expert ``e``'s w13 (``which`` 0) or w2 (1), transposed."""
        weight = (self.w13_weight, self.w2_weight)[which][e]
        packed = None if self.packed is None else self.packed[e][which]
        return linear(x, weight, None, packed, *self._scale_of(which, e))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: str, expert_id: int
    ) -> None:
        """One expert's gate (``w1``), up (``w3``) or down (``w2``) projection, or its per-row
        scales: this rank's slice of it, sized by the parameter's shape."""
        if self.local_experts is not None:
            for local, held in enumerate(self.local_experts):
                if held == expert_id:  # every local copy of it
                    self._load_local(param, loaded, name, shard_id, local)
            return
        local = expert_id - self.start
        if 0 <= local < self.num_local_experts:  # else another rank's expert
            self._load_local(param, loaded, name, shard_id, local)

    def _load_local(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: str, local: int
    ) -> None:
        dim = 1 if shard_id == "w2" else 0  # w1/w3 [I, H], w2 [H, I] (scales: [., K / G])
        i = param.shape[2] if shard_id == "w2" else param.shape[1] // 2
        if self.tp_size > 1 and loaded.shape[dim] == i * self.tp_size:
            loaded = loaded.narrow(dim, self.tp_rank * i, i)
        dst = {"w1": lambda p: p[:i], "w3": lambda p: p[i:], "w2": lambda p: p}[shard_id](
            param.data[local]
        )
        copy_checked(dst, loaded, name)

    # ------------------------------------------------------------------------------ fp8
    def _groups(self, block_k: int) -> tuple[int, int]:
        # w13's K (hidden) is never split; w2's (intermediate) is under expert TP.
        inter_shard = self.intermediate_size if self.tp_size > 1 else None
        return fp8.group_for(block_k), fp8.group_for(block_k, inter_shard)

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Before loading an fp8 checkpoint: the experts' weights as e4m3 with per-row scales
        (``srt.layers.quantization.fp8``), expanded from the checkpoint's blocks as they load."""
        self.fp8_block, self.groups = block, self._groups(block[1])
        for name, group in zip(("w13_weight", "w2_weight"), self.groups):
            w = getattr(self, name)
            q = torch.empty(w.shape, dtype=fp8.FP8_DTYPE, device=w.device)
            scale = torch.empty(*w.shape[:2], fp8.num_groups(w.shape[2], group), device=w.device)
            self._set_fp8(name, q, scale)
            getattr(self, f"{name}_scale_inv").weight_loader = self.scale_loader

    def _set_fp8(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        setattr(self, name, nn.Parameter(q, requires_grad=False))
        getattr(self, name).weight_loader = self.weight_loader
        setattr(self, f"{name}_scale_inv", nn.Parameter(scale.float(), requires_grad=False))

    def scale_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: str, expert_id: int
    ) -> None:
        """One expert's block scales → its per-row scales, loaded as the weight's rows go."""
        hidden, inter = self.w2_weight.shape[1], self.intermediate_size * self.tp_size
        rows, cols = (hidden, inter) if shard_id == "w2" else (inter, hidden)
        (bn, bk), group = self.fp8_block, self.groups[shard_id == "w2"]
        grid = (-(-rows // bn), -(-cols // bk))
        if tuple(loaded.shape) != grid:
            raise ValueError(
                f"{name} has a scale grid {tuple(loaded.shape)}, expected {grid} "
                f"for a [{rows}, {cols}] weight in {bn}×{bk} blocks"
            )
        per_row = fp8.row_scales(loaded, rows, cols, self.fp8_block, group)
        self.weight_loader(param, per_row, name, shard_id, expert_id)

    def finish_fp8(self) -> None:
        """Once an fp8 checkpoint is loaded: nothing, the experts' kernels read e4m3."""

    def quantize_loaded(self, block: tuple[int, int]) -> None:
        """Online fp8 (``--quantization fp8``): the loaded experts quantized in ``block``'s
        format, this rank's shard of the gate, the up and the down projection each on its own
        (on one rank, the blocks an fp8 checkpoint of the same weights holds)."""
        self.fp8_block, self.groups = block, self._groups(block[1])
        for name, group in zip(("w13_weight", "w2_weight"), self.groups):
            w = getattr(self, name).data
            parts = w.chunk(2, dim=1) if name == "w13_weight" else (w,)
            quantized = [fp8.quantize_rows(part, block, group) for part in parts]
            self._set_fp8(name, *(torch.cat(t, dim=1) for t in zip(*quantized)))

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
