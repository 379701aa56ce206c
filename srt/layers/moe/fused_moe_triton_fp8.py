"""The fused MoE's grouped GEMM on block-FP8 expert weights: ``fused_moe_triton``'s kernel with
its K loop replaced by ``fp8_triton.block_scaled_dot``.

Expert weights are e4m3 ``[E, N, K]`` with per-row float32 scales ``[E, N, ceil(K / G)]``. On
devices with fp8 tensor cores (W8A8) the activation is quantized per row and group of G
columns first, its scales read per pair row (the gated up-projection's rows are tokens, shared
by their pairs; the down-projection's are the pairs); elsewhere the weights are decoded in
registers (weight-only). Like the unquantized kernel it reads no device value on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from srt.layers.quantization.fp8_triton import (
    block_scaled_dot,
    check_fp8_weight,
    fp8_block_k,
    per_token_group_quant_fp8,
    uses_w8a8,
)

if TYPE_CHECKING:
    from srt.layers.moe.fused_moe_triton import MoEKernelConfig


@triton.jit
def fused_moe_fp8_kernel(
    a_ptr,  # [M_a, K]: e4m3 (W8A8) or 16/32-bit; row = pair // A_ROW_DIV
    a_s_ptr,  # [M_a, ceil(K / GROUP)] float32, read only when W8A8
    b_ptr,  # [E, N, K]: e4m3 (W8A8) or its bytes, used transposed
    b_s_ptr,  # [E, N, ceil(K / GROUP)] float32
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
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    GROUP: tl.constexpr,
    W8A8: tl.constexpr,
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
    b_s_ptrs = b_s_ptr + expert * stride_bse + offs_n * stride_bsn  # [BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = block_scaled_dot(
        acc, a_ptrs, a_s_ptr + a_rows * stride_asm, b_ptrs, b_s_ptrs,
        row_ok, n_ok, K, stride_ak, stride_bk, stride_ask, stride_bsk,
        GROUP, W8A8, PRECISION, BLOCK_K,
    )  # fmt: skip

    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def invoke_fused_moe_fp8_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group: int,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    config: MoEKernelConfig,
    capability: tuple[int, int] | None = None,
) -> None:
    """``invoke_fused_moe_kernel`` on fp8 experts: b [E, N, K] e4m3 with per-row scales
    ``b_scale`` [E, N, ceil(K / group)]; a [M_a, K] in c's dtype. W8A8 where ``uses_w8a8``
    (a's device or compute ``capability``), else weight-only. ``config.block_k`` gives way to
    ``fp8_block_k(group)``: a K step must not span two groups."""
    check_fp8_weight(b, b_scale, group)
    sorted_ids, expert_ids, num_post_padded = aligned
    w8a8 = uses_w8a8(a.device, capability)
    if w8a8:
        a, a_scale = per_token_group_quant_fp8(a, group)  # [M_a, K], [M_a, ceil(K / G)]
    else:
        a_scale, b = b_scale[0], b.view(torch.uint8)  # a_scale: not read
    weights = topk_weights.reshape(-1) if topk_weights is not None else sorted_ids
    grid = (expert_ids.shape[0], triton.cdiv(b.shape[1], config.block_n))
    fused_moe_fp8_kernel[grid](
        a, a_scale, b, b_scale, c, weights, sorted_ids, expert_ids, num_post_padded,
        b.shape[1], b.shape[2], c.shape[0],
        a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b.stride(1), b.stride(2), *b_scale.stride(), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=topk_weights is not None,
        GROUP=group, W8A8=w8a8,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # tf32 would cut float32
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=fp8_block_k(group),
    )  # fmt: skip
