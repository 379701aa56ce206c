"""Single-batch overlap's routed experts in two halves (``FusedMoE.up_project_blocks`` /
``down_project_block``): ``project_up`` runs the gated up-projection of every (row, slot) pair
at once, then each block's down-projection runs on the pairs of its experts only (blocks are
contiguous ranges of local experts, ``single_batch_overlap.block_ranges``), giving either each
row's weighted sum over the block (the row wire, low_latency) or each of the block's pairs'
weighted output (the pair wire, normal).

Every shape follows from the input shapes, and no kind but ``loop`` reads a device value:
- ``grouped_mm``: the pairs sorted by local expert (other ranks' and masked ones last), one
  ``torch._grouped_mm`` per projection with device offsets. A block's experts own a contiguous
  range of the sorted rows, which starts at a device offset: its down-projection runs on the
  sorted activations rotated to start there (a fixed-size gather), with the block's offsets;
  rows past the block's end are left uncomputed and masked.
- ``loop``: the same with one GEMM per expert, its rows read from the offsets on the host (CPU,
  where that waits for nothing; CUDA without Triton synchronises, as ``FusedMoE.forward`` does).
- ``triton``: ``fused_moe_triton``: the pairs grouped into row blocks by
  ``moe_align_block_size``; a block's down-projection is the same kernel with the row blocks of
  other experts marked -1, which the kernel skips.
- ``cpu_kernel`` (CPU, float32, the C kernel): the kernel fuses both projections, so nothing
  runs up front and each block runs whole (up and down) on its experts' pairs when its turn
  comes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.layers import cpu_kernels
from srt.layers.overlap.single_batch_overlap import (
    DownGemmOverlapArgs,
    RowSumOverlapArgs,
    block_ranges,
)


class _SlotProjection:
    """Subclasses give ``down(experts)``: ``[P, H]``, the weighted output of every pair
    ``p = row·top_k + slot`` whose local expert is in ``experts``, zero for the others."""

    def __init__(self, moe, hidden: torch.Tensor, topk_ids: torch.Tensor):
        self.moe = moe
        (self.num_rows, self.top_k), self.hidden_size = topk_ids.shape, hidden.shape[1]

    def down(self, experts: range) -> torch.Tensor:
        raise NotImplementedError

    def row_sums(self, experts: range) -> torch.Tensor:
        """``[R, H]``: each row's weighted outputs of ``experts`` summed."""
        slots = self.down(experts).view(self.num_rows, self.top_k, self.hidden_size)
        return slots.sum(dim=1)

    def pair_outputs(self, experts: range, rows: torch.Tensor, slots: torch.Tensor):
        """``[P_b, H]``: the weighted outputs of the pairs (``rows``, ``slots``) of ``experts``."""
        return self.down(experts).index_select(0, rows * self.top_k + slots)


class _EmptyProjection(_SlotProjection):
    """No pairs at all (a rank that received nothing)."""

    def __init__(self, moe, hidden: torch.Tensor, topk_ids: torch.Tensor):
        super().__init__(moe, hidden, topk_ids)
        self._zeros = hidden.new_zeros(0, self.hidden_size)

    def down(self, experts: range) -> torch.Tensor:
        return self._zeros


class _SortedProjection(_SlotProjection):
    """``grouped_mm`` and ``loop`` (see the module docstring)."""

    def __init__(self, moe, kind: str, hidden, topk_weights, topk_ids):
        super().__init__(moe, hidden, topk_ids)
        e, self.kind = moe.num_local_experts, kind
        local = (topk_ids - moe.start).flatten()  # [P]
        local = local.masked_fill((local < 0) | (local >= e), e)  # sorts last
        self.order = torch.argsort(local, stable=True)  # [P] the pair of each sorted row
        self.ends = moe._expert_ends(local.index_select(0, self.order))  # [E] int32
        x = hidden.index_select(0, self.order // self.top_k)  # [P, H]
        gate_up = _grouped(moe, kind, x, 0, range(e), self.ends)
        i = moe.intermediate_size
        self.act = F.silu(gate_up[:, :i]) * gate_up[:, i:]  # [P, I]; rows past the ends: anything
        self.weights = topk_weights.to(hidden.dtype).flatten()  # [P]
        self.rows = torch.arange(self.order.shape[0], device=hidden.device)

    def down(self, experts: range) -> torch.Tensor:
        p = self.order.shape[0]
        if not experts:
            return self.act.new_zeros(p, self.hidden_size)
        lo = experts.start
        first = self.ends[lo - 1 : lo] if lo else self.ends.new_zeros(1)  # [1], device
        rotation = (self.rows + first) % p  # sorted rows from the block's first one on
        offsets = self.ends[lo : experts.stop] - first  # [len(experts)] int32
        act = self.act.index_select(0, rotation)
        out = _grouped(self.moe, self.kind, act, 1, experts, offsets)  # [P, H]
        pairs = self.order.index_select(0, rotation)  # [P]
        out = out * self.weights.index_select(0, pairs).unsqueeze(1)
        out = torch.where((self.rows < offsets[-1:]).unsqueeze(1), out, 0.0)  # other blocks
        return torch.empty_like(out).index_copy_(0, pairs, out)  # back to pair order


def _grouped(moe, kind: str, x: torch.Tensor, which: int, experts: range, offsets: torch.Tensor):
    """``x`` [N, K] times the w13 (``which`` 0) or w2 (1) of ``experts``, transposed, where
    rows ``[offsets[g-1], offsets[g])`` belong to ``experts[g]``; rows past the last offset are
    left uncomputed (``grouped_mm``) or zero (``loop``)."""
    weight = (moe.w13_weight, moe.w2_weight)[which][experts.start : experts.stop]
    if kind == "grouped_mm":
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out, begin = x.new_zeros(x.shape[0], weight.shape[1]), 0
    for e, end in zip(experts, offsets.tolist()):  # the loop: offsets on the host
        if end > begin:
            out[begin:end] = moe._linear(x[begin:end], e, which)
        begin = end
    return out


class _TritonProjection(_SlotProjection):
    """``triton`` (see the module docstring)."""

    def __init__(self, moe, hidden, topk_weights, topk_ids):
        from srt.layers.moe import fused_moe_triton as kernels  # triton: imported on first use

        super().__init__(moe, hidden, topk_ids)
        e, i, p = moe.num_local_experts, moe.intermediate_size, topk_ids.numel()
        self.kernels, self.config = kernels, kernels.default_config(p, e)
        self.aligned = kernels.moe_align_block_size(topk_ids, self.config.block_m, e, moe.start)
        gate_up = hidden.new_empty(p, 2 * i)  # rows of pairs of no local expert: unwritten
        kernels.invoke_fused_moe_kernel(
            hidden, moe.w13_weight, gate_up, None, self.aligned, self.top_k, self.config
        )
        self.act = F.silu(gate_up[:, :i]) * gate_up[:, i:]  # [P, I]
        self.weights = topk_weights.float()

    def down(self, experts: range) -> torch.Tensor:
        sorted_ids, expert_ids, num_padded = self.aligned
        ours = (expert_ids >= experts.start) & (expert_ids < experts.stop)
        aligned = (sorted_ids, torch.where(ours, expert_ids, -1), num_padded)  # -1: skipped
        out = self.act.new_zeros(self.act.shape[0], self.hidden_size)
        self.kernels.invoke_fused_moe_kernel(
            self.act, self.moe.w2_weight, out, self.weights, aligned, 1, self.config
        )
        return out


class _KernelProjection:
    """``cpu_kernel`` (see the module docstring): each block runs whole, on host tensors."""

    def __init__(self, moe, hidden, topk_weights, topk_ids):
        self.moe, self.hidden, self.weights, self.ids = moe, hidden, topk_weights, topk_ids
        self.local = topk_ids - moe.start

    def _run(self, hidden, weights, ids) -> torch.Tensor:
        moe = self.moe
        return cpu_kernels.fused_experts(hidden, weights, ids, moe.start, *moe.panels)

    def row_sums(self, experts: range) -> torch.Tensor:
        ours = (self.local >= experts.start) & (self.local < experts.stop)
        return self._run(self.hidden, self.weights, self.ids.masked_fill(~ours, -1))

    def pair_outputs(self, experts: range, rows: torch.Tensor, slots: torch.Tensor):
        if rows.shape[0] == 0:
            return self.hidden.new_zeros(0, self.hidden.shape[1])
        pair = (rows, slots)  # every one of them an expert of this block
        x = self.hidden.index_select(0, rows)
        return self._run(x, self.weights[pair].unsqueeze(1), self.ids[pair].unsqueeze(1))


def project_up(moe, kind: str, hidden, topk_weights, topk_ids):
    """The up-projected pairs of ``hidden`` [R, H] (``topk_*`` [R, k], global ids, others'
    and -1 skipped) on ``moe`` (a ``FusedMoE``), by ``kind`` (see the module docstring)."""
    if topk_ids.numel() == 0:
        return _EmptyProjection(moe, hidden, topk_ids)
    if kind == "cpu_kernel":
        return _KernelProjection(moe, hidden, topk_weights, topk_ids)
    if kind == "triton":
        return _TritonProjection(moe, hidden, topk_weights, topk_ids)
    return _SortedProjection(moe, kind, hidden, topk_weights, topk_ids)


class BlockedProjection:
    """One dispatch's up-projected pairs, awaiting their down-projection block by block."""

    def __init__(self, projection, args: DownGemmOverlapArgs | RowSumOverlapArgs, num_experts):
        self.projection, self.args = projection, args
        self.ranges = block_ranges(num_experts, args.num_blocks)

    def down(self, index: int) -> torch.Tensor:
        """Block ``index``'s down-projection: ``[R, H]`` row sums (row wire) or ``[P_b, H]``
        pair outputs in the order of ``args`` (pair wire)."""
        experts, args = self.ranges[index], self.args
        if isinstance(args, RowSumOverlapArgs):
            return self.projection.row_sums(experts)
        return self.projection.pair_outputs(experts, args.pair_rows[index], args.pair_slots[index])
