"""Block-FP8 weights, DeepSeek-V3's format: each ``[N, K]`` weight stored as ``float8_e4m3fn``
with a float32 ``weight_scale_inv`` per block of ``block_n × block_k`` (128 × 128 in every
published checkpoint), the blocks at the right and bottom edges partial. The real weight is
``q · scale`` (the name says "inverse" because the quantizer divided by it).

Inside srt a layer keeps ``q`` as it came and its scales *per row*: ``scale [N, ceil(K / G)]``,
row ``n``'s scale for columns ``[g·G, (g+1)·G)``, where the group ``G`` divides ``block_k``.
Rows repeat their block's scale, so a tensor-parallel shard may start anywhere inside a block
(each row keeps its block's scale wherever the shard starts), and a stacked weight (gate | up,
q | k | v) whose parts do not fill whole blocks keeps each part's scales. A shard of the K
dimension must start on a group boundary: ``G`` is the largest power of two dividing both
``block_k`` and the shard's width (``group_for``). The kernels read this layout on CPU and GPU.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def group_for(block_k: int, k_shard: int | None = None) -> int:
    """The K group of a weight whose K dimension is split in shards of ``k_shard`` columns (None:
    not split): the largest power of two that divides ``block_k`` (and ``k_shard``)."""
    group = block_k & -block_k
    while k_shard is not None and k_shard % group:
        group //= 2
    return group


def num_groups(k: int, group: int) -> int:
    return -(-k // group)


def row_scales(
    scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int], group: int
) -> torch.Tensor:
    """A checkpoint's block scales ``[ceil(N / bn), ceil(K / bk)]`` as per-row scales ``[N,
    ceil(K / G)]`` of the full ``N × K`` weight (leading dimensions, e.g. experts, kept)."""
    block_n, block_k = block
    if block_k % group:
        raise ValueError(f"group {group} does not divide the block's {block_k} columns")
    per_row = scale_inv.repeat_interleave(block_n, dim=-2)[..., :rows, :]
    return per_row.repeat_interleave(block_k // group, dim=-1)[..., : num_groups(cols, group)]


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``q [..., N, K]`` with per-row scales ``[..., N, ceil(K / G)]`` → float32 weights, each
    element ``float(q) · scale`` rounded once (what HF's dequantization computes)."""
    k = q.shape[-1]
    return q.to(torch.float32) * scale.repeat_interleave(group, dim=-1)[..., :k]


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` → (``q`` e4m3fn, ``scale_inv [..., ceil(N / bn), ceil(K / bk)]``
    float32) as DeepSeek's quantizer writes them: each block's scale its largest magnitude ÷ 448
    (1 for an all-zero block), ``q`` the weight ÷ scale rounded to e4m3."""
    block_n, block_k = block
    *lead, n, k = weight.shape
    nb, kb = -(-n // block_n), -(-k // block_k)
    padded = weight.to(torch.float32).new_zeros(*lead, nb * block_n, kb * block_k)
    padded[..., :n, :k] = weight
    blocks = padded.view(*lead, nb, block_n, kb, block_k)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, nb * block_n, kb * block_k)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale


def quantize_rows(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantization of a loaded weight ``[..., N, K]`` to ``block``'s format, returned as
    srt keeps it: (``q``, per-row scales with group ``G``, default ``block_k``)."""
    group = group or block[1]
    q, scale_inv = quantize_blocks(weight, block)
    return q, row_scales(scale_inv, weight.shape[-2], weight.shape[-1], block, group)
