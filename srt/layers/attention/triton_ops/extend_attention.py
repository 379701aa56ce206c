"""Paged extend (prefill) attention in Triton: the new tokens of each sequence against its
cached prefix and, causally, against each other.

Sequence ``s`` brings ``extend_lens[s]`` query rows, at ``q[qo_start[s] : qo_start[s] +
extend_lens[s]]``; its keys and values, prefix and new tokens alike (the new tokens' are
written to the pool before the kernel runs), are read in place from the pool through
``req_to_token[req_pool_indices[s], 0 : prefix_lens[s] + extend_lens[s]]``. Query ``i`` sits at
position ``prefix_lens[s] + i`` and attends keys ``0 ..= prefix_lens[s] + i``.

Grid ``(B, H, ceil(max_extend_len / BLOCK_M))``: one program per sequence, query head and block
of ``BLOCK_M`` query rows, looping over key tiles with an online softmax (flash attention).
Programs past a sequence's own length exit at once; ``max_extend_len`` is a host int, so the
launch reads nothing from the device. A block of queries stops at its last row's last key, so
causality costs the early blocks nothing. Grouped-query heads read KV head ``h // group``;
key widths that are not powers of two, values narrower than keys and values that are a
strided view of the keys (MLA's absorbed form: one KV head over the latent) are handled as in
``decode_attention`` (whose tile helpers this kernel shares).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops.decode_attention import (
    LOG2E,
    dot_precision,
    key_blocks,
    key_scores,
    load_query,
    softmax_step,
)


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, QoStart, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_rt,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    s_idx = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_M
    new = tl.load(ExtendLens + s_idx)
    if first < new:
        prefix = tl.load(PrefixLens + s_idx)
        q_start = tl.load(QoStart + s_idx)
        table = ReqToToken + tl.load(ReqPoolIdx + s_idx) * stride_rt
        kv_head = h // GROUP
        offs_m = first + tl.arange(0, BLOCK_M)
        mask_m = offs_m < new
        q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh
        q, q_pe = load_query(q_ptrs, mask_m[:, None], BLOCK_D, BLOCK_DPE, DK)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        # Rows past the sequence (padding) see keys up to their own position, past kv_end:
        # those read slot 0, finite, and the rows are never stored.
        kv_end = prefix + tl.minimum(new, first + BLOCK_M)
        last_key = prefix + offs_m  # each row's last visible key
        for start_n in range(0, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            slots = tl.load(table + offs_n, mask=offs_n < kv_end, other=0)
            s = key_scores(q, q_pe, K, slots, kv_head, stride_kt, stride_kh,
                           DK, BLOCK_D, BLOCK_DPE, PRECISION) * qk_scale  # fmt: skip
            # Key 0 is visible to every row, so each row's max is finite after the first tile.
            s = tl.where(offs_n[None, :] <= last_key[:, None], s, float("-inf"))
            m, denom, acc = softmax_step(s, m, denom, acc, V, slots, kv_head, stride_vt,
                                         stride_vh, DV, BLOCK_DV, PRECISION)  # fmt: skip
        offs_dv = tl.arange(0, BLOCK_DV)
        o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
        o_mask = mask_m[:, None] & (offs_dv[None, :] < DV)
        tl.store(o_ptrs, (acc / denom[:, None]).to(Out.dtype.element_ty), mask=o_mask)


def extend_tiles(dk: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)``: the largest tiles that ptxas fits in registers
    without spilling for sm_90 (checked at compile time, not benchmarked). Gathered tiles
    hold a pointer per element, so they stay smaller than a dense flash attention's; wide keys
    (MLA's 576) take fewer query rows, and fp32 (no tensor cores) fewer still."""
    if dtype == torch.float32:
        return (16, 32, 4) if dk <= 128 else (16, 16, 8)
    if dk <= 192:
        return 64, 32, 8
    return (32, 32, 8) if dk <= 256 else (16, 32, 8)


def extend_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens' queries ``q`` [T, H, Dk] over their sequences' keys
    ``k_buffer`` [slots, Hk, Dk] and values ``v_buffer`` [slots, Hk, Dv] (any strides, last dim
    contiguous); ``prefix_lens``, ``extend_lens``, ``qo_start`` and ``req_pool_indices`` are
    [B] int64 on q's device. Returns [T, H, Dv] in q's dtype."""
    tokens, heads, dk = q.shape
    kv_heads, dv = k_buffer.shape[1], v_buffer.shape[-1]
    assert heads % kv_heads == 0 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = q.new_empty(tokens, heads, dv)
    batch = req_pool_indices.shape[0]
    if batch == 0 or tokens == 0 or max_extend_len == 0:
        return out
    default_m, default_n, num_warps = extend_tiles(dk, k_buffer.dtype)
    block_m = block_m or default_m
    block_d, block_dpe = key_blocks(dk)
    _extend_kernel[(batch, heads, triton.cdiv(max_extend_len, block_m))](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        qo_start, sm_scale * LOG2E, q.stride(0), q.stride(1), k_buffer.stride(0),
        k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), out.stride(0),
        out.stride(1), req_to_token.stride(0),
        GROUP=heads // kv_heads, DK=dk, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n or default_n,
        BLOCK_D=block_d, BLOCK_DPE=block_dpe,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), PRECISION=dot_precision(k_buffer.dtype),
        num_warps=num_warps, num_stages=1,
    )  # fmt: skip
    return out
