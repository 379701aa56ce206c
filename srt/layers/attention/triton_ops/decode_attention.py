"""Paged decode attention in Triton: one query per sequence against its cached keys.

Keys and values are read in place from the KV pool, slot by slot, through
``req_to_token[req_pool_indices[b], 0:seq_lens[b]]``; nothing is gathered into dense tensors.

Split-KV (flash-decoding): a decode batch has few queries, so one program per (sequence, head)
would leave most of the GPU idle on long contexts. Stage 1 cuts each sequence's keys into
``num_kv_splits`` equal ranges (``ceil(seq_len / num_kv_splits)`` keys each, computed in the
kernel from ``seq_lens`` on the device) and writes each range's normalised partial output and
its log-sum-exp to fp32 buffers; stage 2 merges the ranges with their log-sum-exps. The number
of splits is a Python int fixed by the backend, so both grids depend on shapes alone and the
launch can be captured in a CUDA graph and replayed with new lengths in the same tensors.

Grouped-query heads: a stage-1 program takes one KV head and a block of ``BLOCK_H`` of the query
heads that share it, as the rows of one ``tl.dot``, so each key tile is loaded once for all of
them. Stage-1 grid ``(B, Hk * ceil(group / BLOCK_H), splits)``; stage-2 grid ``(B, H)``.

Key widths that are not powers of two (MLA: 512 + 64) are a power-of-two main part plus a
masked remainder block (``key_blocks``); values may be narrower than keys and may be a strided
view of the key buffer (MLA's latent), so every buffer goes in with its own strides. Scores are
scaled by ``sm_scale·log2(e)`` so that the softmax runs on ``exp2``; log-sum-exps are in base 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_H = 16  # query-head rows per stage-1 program: tl.dot's smallest efficient M


def key_blocks(dim: int) -> tuple[int, int]:
    """Column blocks ``(main, rest)`` covering a key of ``dim``: the largest power of two not
    above it, and the remainder padded to a power of two (0: none). Blocks are at least 16 wide,
    the least tl.dot takes for 16-bit inputs."""
    if dim <= 16:
        return 16, 0
    main = 1 << (dim.bit_length() - 1)
    rest = dim - main
    return main, (max(16, triton.next_power_of_2(rest)) if rest else 0)


def decode_tiles(dk: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` for stage 1: the largest key tile that ptxas fits in registers
    without spilling for sm_90 (checked at compile time, not benchmarked); fp32, without
    tensor cores, holds 16 keys."""
    block_n = 16 if dtype == torch.float32 else (64 if dk <= 128 else 32)
    return block_n, (8 if dk > 256 else 4)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 pools attend in full precision; tf32 would cost them ~1e-3.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_query(ptrs, mask, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, DK: tl.constexpr):
    """Rows at ``ptrs`` (one per query row, [R, 1]) as their main block [R, BLOCK_D] and their
    remainder block [R, BLOCK_DPE] (the main block again when there is none)."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(ptrs + offs_d[None, :], mask=mask & (offs_d[None, :] < DK), other=0.0)
    q_pe = q
    if BLOCK_DPE > 0:
        offs_pe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        q_pe = tl.load(ptrs + offs_pe[None, :], mask=mask & (offs_pe[None, :] < DK), other=0.0)
    return q, q_pe


@triton.jit
def key_scores(
    q, q_pe, K, slots, kv_head, stride_kt, stride_kh,
    DK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``q · k`` [R, N] in fp32 for the keys at pool ``slots`` [N]. Masked slots are 0, the
    zeroed dummy slot, so the loads need no mask of their own."""
    base = K + slots[None, :] * stride_kt + kv_head * stride_kh
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(base + offs_d[:, None], mask=offs_d[:, None] < DK, other=0.0)
    s = tl.dot(q.to(k.dtype), k, input_precision=PRECISION)
    if BLOCK_DPE > 0:
        offs_pe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        k_pe = tl.load(base + offs_pe[:, None], mask=offs_pe[:, None] < DK, other=0.0)
        s += tl.dot(q_pe.to(k_pe.dtype), k_pe, input_precision=PRECISION)
    return s


@triton.jit
def softmax_step(s, m, denom, acc, V, slots, kv_head, stride_vt, stride_vh,
                 DV: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Fold one tile of base-2 scores ``s`` [R, N] (-inf where masked; every row holds a finite
    running max after the first tile) and its values into the running max ``m``, sum ``denom`` and
    unnormalised output ``acc``."""
    offs_dv = tl.arange(0, BLOCK_DV)
    v_ptrs = V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :]
    v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit
def _split_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, qk_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    split = tl.program_id(2)
    local = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = local < GROUP
    heads = kv_head * GROUP + local
    seq_len = tl.load(SeqLens + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if end > start:  # an empty range writes nothing; stage 2 skips it the same way
        table = ReqToToken + tl.load(ReqPoolIdx + b) * stride_rt
        q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh
        q, q_pe = load_query(q_ptrs, mask_h[:, None], BLOCK_D, BLOCK_DPE, DK)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            slots = tl.load(table + offs_n, mask=offs_n < end, other=0)
            s = key_scores(q, q_pe, K, slots, kv_head, stride_kt, stride_kh,
                           DK, BLOCK_D, BLOCK_DPE, PRECISION) * qk_scale  # fmt: skip
            s = tl.where((offs_n < end)[None, :], s, float("-inf"))
            m, denom, acc = softmax_step(s, m, denom, acc, V, slots, kv_head, stride_vt,
                                         stride_vh, DV, BLOCK_DV, PRECISION)  # fmt: skip
        offs_dv = tl.arange(0, BLOCK_DV)
        o_ptrs = MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms
        o_mask = mask_h[:, None] & (offs_dv[None, :] < DV)
        tl.store(o_ptrs + offs_dv[None, :], acc / denom[:, None], mask=o_mask)
        lse_ptrs = MidLse + b * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, m + tl.log2(denom), mask=mask_h)


@triton.jit
def _merge_kernel(
    MidO, MidLse, SeqLens, Out,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = offs_dv < DV
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for split in range(NUM_SPLITS):
        start = split * split_len
        if tl.minimum(start + split_len, seq_len) > start:
            lse = tl.load(MidLse + b * stride_lb + h * stride_lh + split)
            o_ptrs = MidO + b * stride_mb + h * stride_mh + split * stride_ms + offs_dv
            o = tl.load(o_ptrs, mask=mask, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + w * o
            total = total * alpha + w
            m = m_new
    out = tl.where(total > 0, acc / total, 0.0)  # a sequence of no keys (padding) gives zeros
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=mask)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [B, H, Dk] over each sequence's cached keys ``k_buffer`` [slots, Hk,
    Dk] and values ``v_buffer`` [slots, Hk, Dv] (any strides, last dim contiguous); returns
    [B, H, Dv] in q's dtype. Reads no device value on the host: graph-capturable."""
    batch, heads, dk = q.shape
    kv_heads, dv = k_buffer.shape[1], v_buffer.shape[-1]
    assert heads % kv_heads == 0 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = q.new_empty(batch, heads, dv)
    if batch == 0:
        return out
    group = heads // kv_heads
    mid_o = torch.empty(batch, heads, num_kv_splits, dv, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, num_kv_splits, dtype=torch.float32, device=q.device)
    block_d, block_dpe = key_blocks(dk)
    head_blocks = triton.cdiv(group, BLOCK_H)
    block_dv = max(16, triton.next_power_of_2(dv))
    default_n, num_warps = decode_tiles(dk, k_buffer.dtype)
    _split_kernel[(batch, kv_heads * head_blocks, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale * LOG2E, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        *mid_o.stride()[:3], *mid_lse.stride()[:2],
        GROUP=group, HEAD_BLOCKS=head_blocks, NUM_SPLITS=num_kv_splits, DK=dk, DV=dv,
        BLOCK_H=BLOCK_H, BLOCK_N=block_n or default_n, BLOCK_D=block_d, BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv, PRECISION=dot_precision(k_buffer.dtype), num_warps=num_warps,
        num_stages=2,
    )  # fmt: skip
    _merge_kernel[(batch, heads)](
        mid_o, mid_lse, seq_lens, out, *mid_o.stride()[:3], *mid_lse.stride()[:2],
        out.stride(0), out.stride(1), NUM_SPLITS=num_kv_splits, DV=dv, BLOCK_DV=block_dv,
        num_warps=4,
    )  # fmt: skip
    return out
