"""Routed experts: stacked expert weights and their forward on CPU or GPU in plain PyTorch."""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import cpu_kernels
from srt.layers.linear import PanelWeight, copy_checked, linear, pack_weight
from srt.layers.moe.blocked_experts import BlockedProjection, project_up
from srt.layers.overlap.single_batch_overlap import DownGemmOverlapArgs, RowSumOverlapArgs

# On CPU, experts whose gate/up weight is at least this large run one GEMM each
# (``FusedMoE._grouped_kernel``).
GROUPED_MAX_EXPERT_BYTES = 1 << 20


@functools.cache
def _triton_kernels():
    """``fused_moe_triton`` where triton imports (imported on first use: CPU serving never
    needs it), else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    from srt.layers.moe import fused_moe_triton

    return fused_moe_triton


@functools.cache
def _has_grouped_mm(device: torch.device) -> bool:
    # torch's grouped GEMM kernels are built for sm90 and sm100; elsewhere it loops over the
    # groups reading their offsets on the host.
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] in (9, 10)


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
        # Set by prepare_for_cpu, once loaded: the CPU kernel with w13 and w2 in its panel layout
        # (``cpu_kernels``), or else per local expert oneDNN layouts of w13 and w2.
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def prepare_for_cpu(self) -> None:
        weights = (self.w13_weight, self.w2_weight)
        gate = self.w13_weight[:, : self.w2_weight.shape[-1]]  # its panels pair with up's
        if all(cpu_kernels.can_pack(w) for w in weights) and all(
            cpu_kernels.fills_panels(w) for w in (gate, self.w2_weight)
        ):
            self.panels = tuple(cpu_kernels.pack_panels(w) for w in weights)
            return
        packed = [
            (pack_weight(w13), pack_weight(w2)) for w13, w2 in zip(self.w13_weight, self.w2_weight)
        ]
        self.packed = packed if packed and packed[0][0] is not None else None

    def _linear(self, x: torch.Tensor, e: int, which: int) -> torch.Tensor:
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

        Ids outside this rank's range contribute nothing (they are another rank's). The
        (token, slot) pairs are sorted by expert and every expert runs on its contiguous rows:
        one grouped GEMM per projection where the device supports it, else a loop. On CPU in
        float32 all of it is one call of the C kernel."""
        if self.panels is not None and hidden_states.dtype == torch.float32:
            return cpu_kernels.fused_experts(
                hidden_states, topk_weights, topk_ids, self.start, *self.panels
            )
        num_tokens, top_k = topk_ids.shape
        if num_tokens == 0:
            return torch.zeros_like(hidden_states)
        if self._grouped_kernel(hidden_states) == "triton":
            return _triton_kernels().fused_experts_triton(
                hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.start
            )
        # Every (token, slot) pair is kept, other ranks' last: their count is the device's to
        # know, and cutting them off would synchronise with it.
        local_ids = (topk_ids - self.start).flatten()  # [T·topk]
        outside = (local_ids < 0) | (local_ids >= self.num_local_experts)
        local_ids = local_ids.masked_fill(outside, self.num_local_experts)  # sorts last
        order = torch.argsort(local_ids, stable=True)  # [T·topk]
        ends = self._expert_ends(local_ids.index_select(0, order))  # [E_local]
        # index_select: several times faster on CPU than indexing with a tensor.
        x = hidden_states.index_select(0, order // top_k)  # [T·topk, H], grouped by expert
        if self._grouped_kernel(x) == "grouped_mm":
            out = self._grouped_experts(x, ends)
        else:
            out = self._looped_experts(x, torch.diff(ends, prepend=ends.new_zeros(1)).tolist())
        # Rows past the last local expert are not computed (they may hold anything): zero them.
        out = torch.where(outside.index_select(0, order).unsqueeze(1), 0.0, out)
        slots = torch.empty_like(out).index_copy_(0, order, out)  # back to (token, slot) order
        weights = topk_weights.to(hidden_states.dtype).unsqueeze(-1)  # [T, topk, 1]
        return (slots.view(num_tokens, top_k, -1) * weights).sum(dim=1)

    def _expert_ends(self, sorted_ids: torch.Tensor) -> torch.Tensor:
        """The end row of each local expert in ``sorted_ids`` [P] (int32 [E_local]), found on
        the device: ``bincount``'s output size depends on the values, so it synchronises."""
        experts = torch.arange(1, self.num_local_experts + 1, device=sorted_ids.device)
        return torch.searchsorted(sorted_ids, experts).to(torch.int32)

    def _grouped_kernel(self, x: torch.Tensor) -> str:
        """How the experts run on ``x``'s device and dtype: ``grouped_mm`` (torch's grouped
        GEMM), ``triton`` (``fused_moe_triton``: one launch per projection) or ``loop`` (one
        GEMM per expert, after reading the counts on the host).

        GPU: ``torch._grouped_mm`` takes bf16 on sm90 and newer (12× the loop on an H100 for
        one layer's gate/up, 512 rows × 128 experts); other dtypes and devices take the Triton
        kernel. Neither synchronises with the host. CPU: the grouped GEMM, for row strides that
        are multiples of 16 bytes and experts small enough that per-op overhead, not memory,
        bounds them; large experts see a few tokens each in decode, and the loop gives those
        oneDNN's kernel on packed weights (``srt.layers.linear.pack_weight``), which streams
        them several times faster."""
        align = 16 // x.element_size()
        aligned = x.shape[1] % align == 0 and self.intermediate_size % align == 0
        if x.device.type == "cuda":
            if aligned and x.dtype == torch.bfloat16 and _has_grouped_mm(x.device):
                return "grouped_mm"
            return "triton" if _triton_kernels() is not None else "loop"
        small = self.w13_weight[0].nbytes < GROUPED_MAX_EXPERT_BYTES
        return "grouped_mm" if hasattr(torch, "_grouped_mm") and aligned and small else "loop"

    def _grouped_experts(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [P, H] sorted by expert, ``offsets`` [E] the end of each expert's rows (rows past
        the last end are left uncomputed)."""
        gate_up = torch._grouped_mm(x, self.w13_weight.transpose(1, 2), offs=offsets)
        i = self.intermediate_size
        h = F.silu(gate_up[:, :i]) * gate_up[:, i:]
        return torch._grouped_mm(h, self.w2_weight.transpose(1, 2), offs=offsets)

    def _looped_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [P, H] sorted by expert, ``counts`` the rows of each; rows past them stay zero."""
        out, begin = x.new_zeros(x.shape[0], self.w2_weight.shape[1]), 0
        for e, n in enumerate(counts):
            if n:
                out[begin : begin + n] = self._expert(e, x[begin : begin + n])
            begin += n
        return out

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
        time. No host synchronisation but in the ``loop`` kind (see ``blocked_experts``)."""
        kind = self._grouped_kernel(hidden_states)
        if self.panels is not None and hidden_states.dtype == torch.float32:
            kind = "cpu_kernel"
        projection = project_up(self, kind, hidden_states, topk_weights, topk_ids)
        return BlockedProjection(projection, args, self.num_local_experts)

    def down_project_block(self, blocks: BlockedProjection, index: int) -> torch.Tensor:
        """SBO, second half for block ``index``: with ``RowSumOverlapArgs`` (low_latency) each
        row's weighted outputs of the block's experts summed, ``[R, H]``; with
        ``DownGemmOverlapArgs`` (normal) the block's pairs' weighted outputs ``[P, H]`` in the
        block's pair order (the order its combine sends them)."""
        return blocks.down(index)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self._linear(x, e, 0)
        h = F.silu(gate_up[:, : self.intermediate_size]) * gate_up[:, self.intermediate_size :]
        return self._linear(h, e, 1)
