"""The routed experts' computation: one interface (``ExpertCompute``) over every kernel of
``expert_kernel.ExpertKernel``, started by ``compute_experts``. ``FusedMoE.forward`` takes its
``output()``; single-batch overlap (``blocked_experts``) takes it a block of local experts at a
time (``row_sums``, ``pair_outputs``), after the gated up-projection of every (row, slot) pair
has run at once.

Every shape follows from the input shapes, and no kernel but ``LOOP`` reads a device value:
- ``GROUPED_MM``: the pairs sorted by local expert (``sorted_pairs``; other ranks' and masked
  ones last), one ``torch._grouped_mm`` per projection with device offsets. A block's experts
  own a contiguous range of the sorted rows, which starts at a device offset: its
  down-projection runs on the sorted activations rotated to start there (a fixed-size gather),
  with the block's offsets; rows past the block's end are left uncomputed and masked.
- ``LOOP``: the same with one GEMM per expert, its rows read from the offsets on the host (CPU,
  where that waits for nothing; CUDA without Triton synchronises).
- ``TRITON``: ``fused_moe_triton``: the pairs grouped into row blocks by
  ``moe_align_block_size``; a block's down-projection is the same kernel with the row blocks of
  other experts marked -1, which the kernel skips.
- ``CPU_KERNEL`` (the C kernel): it fuses both projections, so nothing runs up front and each
  block runs whole (up and down) on its experts' pairs when its turn comes.
"""

from __future__ import annotations

import torch

from srt.layers import cpu_kernels
from srt.layers.activation import silu_and_mul
from srt.layers.moe.expert_kernel import ExpertKernel
from srt.layers.moe.sorted_pairs import expert_ends, sort_pairs


class ExpertCompute:
    """One dispatch's routed experts on ``moe`` (a ``FusedMoE``): ``hidden`` [R, H] and
    ``topk_*`` [R, top_k] (global ids; other ranks' and -1 add nothing)."""

    def __init__(self, moe, hidden: torch.Tensor, topk_weights, topk_ids: torch.Tensor):
        self.moe, self.hidden = moe, hidden
        self.topk_weights, self.topk_ids = topk_weights, topk_ids

    def output(self) -> torch.Tensor:
        """``[R, H]``: each row's weighted outputs of all local experts summed."""
        return self.row_sums(range(self.moe.num_local_experts))

    def row_sums(self, experts: range) -> torch.Tensor:
        """``[R, H]``: each row's weighted outputs of ``experts`` (local indices) summed."""
        raise NotImplementedError

    def pair_outputs(self, experts: range, rows: torch.Tensor, slots: torch.Tensor):
        """``[P_b, H]``: the weighted outputs of the pairs (``rows``, ``slots``), every one of
        them routed to one of ``experts``."""
        raise NotImplementedError


class _PairCompute(ExpertCompute):
    """A kernel that gives ``down(experts)``: ``[P, H]``, the weighted output of every pair
    ``p = row·top_k + slot`` whose local expert is in ``experts``, zero for the others."""

    def __init__(self, moe, hidden: torch.Tensor, topk_weights, topk_ids: torch.Tensor):
        super().__init__(moe, hidden, topk_weights, topk_ids)
        (self.num_rows, self.top_k), self.hidden_size = topk_ids.shape, hidden.shape[1]

    def down(self, experts: range) -> torch.Tensor:
        raise NotImplementedError

    def row_sums(self, experts: range) -> torch.Tensor:
        slots = self.down(experts).view(self.num_rows, self.top_k, self.hidden_size)
        return slots.sum(dim=1)

    def pair_outputs(self, experts: range, rows: torch.Tensor, slots: torch.Tensor):
        return self.down(experts).index_select(0, rows * self.top_k + slots)


class _EmptyCompute(_PairCompute):
    """No pairs at all (a rank that received nothing)."""

    def down(self, experts: range) -> torch.Tensor:
        return self.hidden.new_zeros(0, self.hidden_size)


class _SortedCompute(_PairCompute):
    """``GROUPED_MM`` and ``LOOP`` (see the module docstring)."""

    def __init__(self, moe, kernel: ExpertKernel, hidden, topk_weights, topk_ids):
        super().__init__(moe, hidden, topk_weights, topk_ids)
        self.kernel, e = kernel, moe.num_local_experts
        self.pairs = sort_pairs(topk_ids, moe.start, e)
        self.ends = expert_ends(self.pairs.sorted_local, e)  # [E] int32
        # index_select: several times faster on CPU than indexing with a tensor.
        x = hidden.index_select(0, self.pairs.order // self.top_k)  # [P, H], grouped by expert
        self.act = _gated_up(moe, kernel, x, self.ends)  # [P, I]; rows past the ends: anything

    def output(self) -> torch.Tensor:
        order, e = self.pairs.order, self.moe.num_local_experts
        out = _down(self.moe, self.kernel, self.act, range(e), self.ends)  # [P, H]
        # Rows past the last local expert are not computed (they may hold anything): zero them.
        out = torch.where((self.pairs.sorted_local == e).unsqueeze(1), 0.0, out)
        slots = torch.empty_like(out).index_copy_(0, order, out)  # back to (row, slot) order
        weights = self.topk_weights.to(out.dtype).unsqueeze(-1)  # [R, top_k, 1]
        return (slots.view(self.num_rows, self.top_k, -1) * weights).sum(dim=1)

    def down(self, experts: range) -> torch.Tensor:
        p, order = self.act.shape[0], self.pairs.order
        if not experts:
            return self.act.new_zeros(p, self.hidden_size)
        lo, rows = experts.start, torch.arange(p, device=self.act.device)
        first = self.ends[lo - 1 : lo] if lo else self.ends.new_zeros(1)  # [1], device
        rotation = (rows + first) % p  # sorted rows from the block's first one on
        offsets = self.ends[lo : experts.stop] - first  # [len(experts)] int32
        out = _down(self.moe, self.kernel, self.act.index_select(0, rotation), experts, offsets)
        pairs = order.index_select(0, rotation)  # [P]
        weights = self.topk_weights.to(self.hidden.dtype).flatten()  # [P]
        out = out * weights.index_select(0, pairs).unsqueeze(1)
        out = torch.where((rows < offsets[-1:]).unsqueeze(1), out, 0.0)  # other blocks
        return torch.empty_like(out).index_copy_(0, pairs, out)  # back to pair order


def _gated_up(moe, kernel: ExpertKernel, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """silu(gate·x) * (up·x) of ``x`` [P, H], sorted by local expert with ``ends`` [E] the end
    of each expert's rows: ``[P, I]``, rows past the last end left uncomputed
    (``GROUPED_MM``) or zero (``LOOP``)."""
    if kernel is ExpertKernel.GROUPED_MM:
        return silu_and_mul(torch._grouped_mm(x, moe.w13_weight.transpose(1, 2), offs=ends))
    out, begin = x.new_zeros(x.shape[0], moe.intermediate_size), 0
    for e, end in enumerate(ends.tolist()):  # the loop: offsets on the host
        if end > begin:
            out[begin:end] = silu_and_mul(moe.expert_linear(x[begin:end], e, 0))
        begin = end
    return out


def _down(moe, kernel: ExpertKernel, act, experts: range, offsets: torch.Tensor):
    """``act`` [N, I] times the w2 of ``experts``, transposed, where rows
    ``[offsets[g-1], offsets[g])`` belong to ``experts[g]``: ``[N, H]``, rows past the last
    offset left uncomputed (``GROUPED_MM``) or zero (``LOOP``)."""
    if kernel is ExpertKernel.GROUPED_MM:
        weight = moe.w2_weight[experts.start : experts.stop]
        return torch._grouped_mm(act, weight.transpose(1, 2), offs=offsets)
    out, begin = act.new_zeros(act.shape[0], moe.w2_weight.shape[1]), 0
    for e, end in zip(experts, offsets.tolist()):  # the loop: offsets on the host
        if end > begin:
            out[begin:end] = moe.expert_linear(act[begin:end], e, 1)
        begin = end
    return out


class _TritonCompute(_PairCompute):
    """``TRITON`` (see the module docstring)."""

    def __init__(self, moe, hidden, topk_weights, topk_ids):
        from srt.layers.moe import fused_moe_triton as kernels  # triton: imported on first use

        super().__init__(moe, hidden, topk_weights, topk_ids)
        e = moe.num_local_experts
        self.kernels, self.config = kernels, kernels.default_config(topk_ids.numel(), e)
        self.aligned = kernels.moe_align_block_size(topk_ids, self.config.block_m, e, moe.start)
        # fp8 experts: their per-row scales and K groups (``srt.layers.quantization.fp8``).
        self.fp8 = [
            None if scale is None else kernels.Fp8Scales(scale, group)
            for scale, group in zip(moe.scales, moe.groups)
        ]
        self.act = kernels.gated_up_triton(
            hidden, moe.w13_weight, self.aligned, self.top_k, self.config, self.fp8[0]
        )  # [P, I]
        self.weights = topk_weights.float()

    def output(self) -> torch.Tensor:
        return self._down(self.aligned).view(self.num_rows, self.top_k, -1).sum(dim=1)

    def down(self, experts: range) -> torch.Tensor:
        sorted_ids, expert_ids, num_padded = self.aligned
        ours = (expert_ids >= experts.start) & (expert_ids < experts.stop)
        return self._down((sorted_ids, torch.where(ours, expert_ids, -1), num_padded))  # -1: skip

    def _down(self, aligned) -> torch.Tensor:
        w2 = self.moe.w2_weight
        return self.kernels.down_triton(
            self.act, w2, self.weights, aligned, self.config, self.fp8[1]
        )


class _CpuKernelCompute(ExpertCompute):
    """``CPU_KERNEL`` (see the module docstring): each block runs whole, on host tensors."""

    def _run(self, hidden, weights, ids) -> torch.Tensor:
        moe, x = self.moe, hidden
        if x.dtype not in cpu_kernels.ACT_TYPES:
            x = x.to(torch.float32)
        return cpu_kernels.fused_experts(x, weights, ids, moe.start, *moe.panels).to(hidden.dtype)

    def output(self) -> torch.Tensor:
        return self._run(self.hidden, self.topk_weights, self.topk_ids)

    def row_sums(self, experts: range) -> torch.Tensor:
        local = self.topk_ids - self.moe.start
        ours = (local >= experts.start) & (local < experts.stop)
        return self._run(self.hidden, self.topk_weights, self.topk_ids.masked_fill(~ours, -1))

    def pair_outputs(self, experts: range, rows: torch.Tensor, slots: torch.Tensor):
        if rows.shape[0] == 0:
            return self.hidden.new_zeros(0, self.hidden.shape[1])
        pair = (rows, slots)  # every one of them an expert of this block
        x = self.hidden.index_select(0, rows)
        return self._run(x, self.topk_weights[pair].unsqueeze(1), self.topk_ids[pair].unsqueeze(1))


def compute_experts(
    moe, kernel: ExpertKernel, hidden: torch.Tensor, topk_weights, topk_ids
) -> ExpertCompute:
    """The routed experts of ``hidden`` [R, H] (``topk_*`` [R, top_k], global ids) on ``moe``
    (a ``FusedMoE``) by ``kernel``, their gated up-projections run (see the module
    docstring)."""
    if topk_ids.numel() == 0:
        return _EmptyCompute(moe, hidden, topk_weights, topk_ids)
    if kernel is ExpertKernel.CPU_KERNEL:
        return _CpuKernelCompute(moe, hidden, topk_weights, topk_ids)
    if kernel is ExpertKernel.TRITON:
        return _TritonCompute(moe, hidden, topk_weights, topk_ids)
    return _SortedCompute(moe, kernel, hidden, topk_weights, topk_ids)
