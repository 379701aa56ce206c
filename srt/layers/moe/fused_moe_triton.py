"""Routed experts as Triton kernels, after SGLang's fused_moe_triton.

The (token, slot) pairs are grouped by local expert into blocks of ``block_m`` rows, and each
projection is one launch of a grouped GEMM over those blocks. Nothing here reads a device
value on the host and every shape follows from the input shapes alone, so the whole forward
runs without host synchronisation and can be captured in a CUDA graph.

Block-FP8 experts (e4m3 weights with per-row scales, ``srt.layers.quantization.fp8``) take the
same path with their scales and group: ``fused_moe_triton_fp8`` runs their projections.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from srt.layers.activation import silu_and_mul
from srt.layers.moe.fused_moe_triton_fp8 import invoke_fused_moe_fp8_kernel
from srt.layers.moe.sorted_pairs import sort_pairs


class MoEKernelConfig(NamedTuple):
    block_m: int  # rows per block; every expert's rows are padded to a multiple of it
    block_n: int
    block_k: int


def default_config(num_pairs: int, num_local_experts: int) -> MoEKernelConfig:
    """The block sizes for ``num_pairs`` (token, slot) pairs: blocks of 16 rows while experts
    see few pairs each (decode), where larger blocks would mostly multiply padding."""
    if num_pairs < 64 * num_local_experts:
        return MoEKernelConfig(16, 64, 64)
    return MoEKernelConfig(64, 64, 32)


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_local_experts: int, start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the pairs ``p = token·topk + k`` of ``topk_ids`` [T, topk] (global ids) by local
    expert ``topk_ids - start``, each expert's group padded to a multiple of ``block_size``.

    Returns ``sorted_ids`` [max_padded] int32 (padding holds the sentinel T·topk; pairs of
    other ranks' experts are left out), ``expert_ids`` [max_padded / block_size] int32 (each
    block's local expert, −1 past the end) and ``num_tokens_post_padded`` [1] int32. Only
    device ops with value-independent shapes, so no host synchronisation."""
    num_pairs, num_e, device = topk_ids.numel(), num_local_experts, topk_ids.device
    max_padded = _round_up(num_pairs + num_e * (block_size - 1), block_size)
    local, order, expert_of = sort_pairs(topk_ids, start, num_e)  # [P] each, others' last
    counts = torch.zeros(num_e + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))  # [E+1], bincount without its sync
    padded = (counts[:num_e] + block_size - 1) // block_size * block_size  # [E]
    padded_ends = padded.cumsum(0)  # [E]
    padded_starts = torch.cat([padded_ends.new_zeros(1), padded_ends])  # [E+1]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    # Other ranks' pairs all land in one extra slot past the end, cut off below.
    dest = torch.where(expert_of < num_e, padded_starts[expert_of] + rank, max_padded)  # [P]
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_size, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)  # empty ones skipped
    expert_ids = torch.where(block_expert < num_e, block_expert, -1).to(torch.int32)
    return sorted_ids[:max_padded], expert_ids, padded_ends[-1:].to(torch.int32)


@triton.jit
def fused_moe_kernel(
    a_ptr,  # [M_a, K]: hidden_states (row = pair // A_ROW_DIV) or the activation (row = pair)
    b_ptr,  # [E, N, K]: the local experts' weights, used transposed
    c_ptr,  # [T·topk, N]: one row per pair
    weights_ptr,  # [T·topk] float32 routing weights, read only when MUL_WEIGHT
    sorted_ids_ptr,  # [max_padded] int32, from moe_align_block_size
    expert_ids_ptr,  # [max_padded / BLOCK_M] int32
    num_post_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,  # T·topk, the padding sentinel
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The grid covers the worst-case padding; blocks past the real end do nothing.
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # int64: E·N·K may pass 2^31
    if expert == -1:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    row_ok = pairs < num_pairs
    a_rows = pairs // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def invoke_fused_moe_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    config: MoEKernelConfig,
) -> None:
    """c[p] = (w_p ·) a[p // a_row_div] · b[expert(p)]ᵀ for every pair p placed by ``aligned``
    (``moe_align_block_size`` with ``config.block_m``); rows of other pairs are not written.
    a [M_a, K], b [E, N, K], c [T·topk, N]; ``topk_weights`` [T, topk] float32 or None."""
    sorted_ids, expert_ids, num_post_padded = aligned
    n, k = b.shape[1], b.shape[2]
    weights = topk_weights.reshape(-1) if topk_weights is not None else sorted_ids
    grid = (expert_ids.shape[0], triton.cdiv(n, config.block_n))
    fused_moe_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_post_padded,
        n, k, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=topk_weights is not None,
        # tf32 would cost float32 its last digits; 16-bit inputs are unaffected.
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
    )  # fmt: skip


def _check_dtypes(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"dtypes differ: {a.dtype}, {b.dtype}")


class Fp8Scales(NamedTuple):
    """How to read fp8 expert weights ``[E, N, K]`` e4m3: their per-row ``scale``
    ``[E, N, ceil(K / group)]`` float32, the K ``group``, and the compute ``capability`` that
    picks W8A8 or weight-only (None: the device's own, ``fp8_triton.uses_w8a8``)."""

    scale: torch.Tensor
    group: int
    capability: tuple[int, int] | None = None


def _invoke(a, b, c, topk_weights, aligned, a_row_div, config, fp8: Fp8Scales | None) -> None:
    """``invoke_fused_moe_kernel``, or its fp8 twin when ``fp8`` holds b's scales."""
    if fp8 is None:
        _check_dtypes(a, b)
        invoke_fused_moe_kernel(a, b, c, topk_weights, aligned, a_row_div, config)
    else:
        scale, group, capability = fp8
        invoke_fused_moe_fp8_kernel(
            a, b, scale, group, c, topk_weights, aligned, a_row_div, config, capability
        )


def gated_up_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    config: MoEKernelConfig,
    fp8: Fp8Scales | None = None,
) -> torch.Tensor:
    """silu(gate·x) * (up·x) of every pair placed by ``aligned``, ``[T·topk, I]``; the rows of
    other ranks' pairs hold anything (nothing reads them). hidden_states [T, H]; w13
    [E_local, 2·I, H] (gate rows then up rows), e4m3 with ``fp8``'s scales if given."""
    num_pairs = hidden_states.shape[0] * top_k
    gate_up = hidden_states.new_empty(num_pairs, w13.shape[1])  # [T·topk, 2I]
    _invoke(hidden_states, w13, gate_up, None, aligned, top_k, config, fp8)
    return silu_and_mul(gate_up)


def down_triton(
    act: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    config: MoEKernelConfig,
    fp8: Fp8Scales | None = None,
) -> torch.Tensor:
    """Each pair placed by ``aligned`` weighted by ``topk_weights`` [T, topk] (float32) times
    w2 · its ``act`` row, ``[T·topk, H]``; zero for the pairs ``aligned`` leaves out (other
    ranks', or blocks marked -1). act [T·topk, I]; w2 [E_local, H, I], e4m3 with ``fp8``'s
    scales if given."""
    out = act.new_zeros(act.shape[0], w2.shape[1])
    _invoke(act, w2, out, topk_weights, aligned, 1, config, fp8)
    return out


def fused_experts_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    start: int,
    block_size: int | None = None,
    config: MoEKernelConfig | None = None,
    w13_fp8: Fp8Scales | None = None,
    w2_fp8: Fp8Scales | None = None,
) -> torch.Tensor:
    """Σ_k w_k · w2 · (silu(gate·x) * (up·x)) over the local experts of each token, [T, H].

    hidden_states [T, H]; w13 [E_local, 2·I, H] (gate rows then up rows); w2 [E_local, H, I];
    topk_weights [T, topk] float32; topk_ids [T, topk] global ids, local ones in
    ``[start, start + E_local)``, the rest contributing nothing. ``config`` overrides the
    block sizes, ``block_size`` only the rows per block. ``w13_fp8`` and ``w2_fp8``: the scales
    of e4m3 w13 and w2 (each its own group). No host synchronisation."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden_states.shape[1])
    config = config or default_config(num_tokens * top_k, w13.shape[0])
    if block_size is not None:
        config = config._replace(block_m=block_size)
    aligned = moe_align_block_size(topk_ids, config.block_m, w13.shape[0], start)
    act = gated_up_triton(hidden_states, w13, aligned, top_k, config, w13_fp8)  # [T·topk, I]
    out = down_triton(act, w2, topk_weights.float(), aligned, config, w2_fp8)  # [T·topk, H]
    return out.view(num_tokens, top_k, -1).sum(dim=1)
