"""Attention in plain PyTorch (scaled_dot_product_attention) over the paged KV cache.

Both modes make one batched SDPA call per layer (extend: one per length group), with every
index table and mask built once per forward in ``init_forward_metadata``:

- decode: each sequence's KV slots padded to the longest sequence, and a validity mask. The
  query heads that share a KV head attend as the rows of one SDPA head (``[B, Hk, H/Hk, D]``),
  so each KV head is read once for all of them: MLA's 16 or 128 heads share one latent, and
  SDPA's own ``enable_gqa`` runs one single-row product per query head;
- extend: sequences grouped by length so that padding stays small (``group_extend``); each
  group's queries are gathered into ``[b, H, Lq, D]`` (a view, without a copy, where the group
  is a run of consecutive sequences of one length), its keys into ``[b, Hk, Lk, D]`` (on CPU,
  SDPA groups the query heads itself; elsewhere the KV heads are repeated to ``H``). A group
  without cached prefixes runs SDPA's causal kernel (padded keys lie after every valid query,
  so causality alone hides them); a group with prefixes carries an explicit mask.

Rows (KV slots, queries) are gathered with ``index_select`` on tensors viewed as rows: several
times faster on CPU than indexing with a tensor.

This is plain PyTorch on every device; the C kernels that read the cache in place on CPU are
``--attention-backend cpu`` (``cpu_backend``), which falls back to this backend where they do
not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt.layers.attention.base_attn_backend import AttentionBackend, ExtendSeqs

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch

# A group may cost this many times its sequences' own attention work (padding included).
MAX_PADDING_RATIO = 1.25


@dataclass
class ExtendGroup:
    """Sequences attended in one SDPA call, padded to the group's longest."""

    kv_indices: torch.Tensor  # [b, Lk] KV slots (0, the zeroed dummy slot, past each end)
    q_rows: torch.Tensor  # [b, Lq] rows of q (padding repeats a valid row)
    src: torch.Tensor | None  # [N] valid positions in the flattened [b·Lq]; None: all valid
    dst: torch.Tensor  # [N] rows of the output they go to
    mask: torch.Tensor | None  # [b, 1, Lq, Lk] bool; None: causal
    # First row of q when the group's queries are the contiguous rows [first, first + b·Lq).
    first_row: int | None = None


@dataclass
class TorchNativeMetadata:
    # Decode: KV slot table padded to the longest sequence, and its validity mask.
    kv_indices: torch.Tensor | None = None  # [B, L]
    kv_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool
    extend_groups: list[ExtendGroup] | None = None


def group_extend(prefix_lens: list[int], new_lens: list[int]) -> list[list[int]]:
    """Sequence indices in groups of similar length: sorted by (has prefix, length), a group
    grows while its padded work stays within ``MAX_PADDING_RATIO`` of its real work."""
    order = sorted(
        range(len(new_lens)),
        key=lambda i: (prefix_lens[i] > 0, -(prefix_lens[i] + new_lens[i]), -new_lens[i]),
    )
    groups: list[list[int]] = []
    real = max_q = max_k = 0
    for i in order:
        q, k = new_lens[i], prefix_lens[i] + new_lens[i]
        if groups and (prefix_lens[groups[-1][0]] > 0) == (prefix_lens[i] > 0):
            padded = (len(groups[-1]) + 1) * max(max_q, q) * max(max_k, k)
            if padded <= MAX_PADDING_RATIO * (real + q * k):
                groups[-1].append(i)
                real, max_q, max_k = real + q * k, max(max_q, q), max(max_k, k)
                continue
        groups.append([i])
        real, max_q, max_k = q * k, q, k
    return groups


def _extend_group(batch: ForwardBatch, extend: ExtendSeqs, seqs: list[int]) -> ExtendGroup:
    """The group of sequences ``seqs`` (indices into ``extend``)."""
    device = batch.input_ids.device
    starts = extend.starts
    prefix = [extend.prefix_lens[i] for i in seqs]
    new = [extend.new_lens[i] for i in seqs]
    max_q, max_k = max(new), max(p + n for p, n in zip(prefix, new))
    index = torch.tensor(seqs, dtype=torch.int64, device=device)
    rows = batch.req_pool_indices[index]
    seq_lens = torch.tensor([p + n for p, n in zip(prefix, new)], device=device)
    kpos = torch.arange(max_k, device=device)
    kv_indices = batch.req_to_token_pool.req_to_token[rows, :max_k]
    kv_indices = torch.where(kpos[None, :] < seq_lens[:, None], kv_indices, 0)
    new_t = torch.tensor(new, device=device)
    qpos = torch.arange(max_q, device=device)
    q_valid = qpos[None, :] < new_t[:, None]  # [b, Lq]
    first = torch.tensor([starts[i] for i in seqs], device=device)
    q_rows = first[:, None] + torch.minimum(qpos[None, :], new_t[:, None] - 1)
    mask = None
    if any(prefix):
        last_key = torch.tensor(prefix, device=device)[:, None] + qpos[None, :]  # [b, Lq]
        allowed = kpos[None, None, :] <= last_key[:, :, None]  # [b, Lq, Lk]
        mask = (allowed & (kpos[None, None, :] < seq_lens[:, None, None])).unsqueeze(1)
    if all(n == max_q for n in new):
        contiguous = all(b - a == 1 for a, b in zip(seqs, seqs[1:]))
        first_row = starts[seqs[0]] if contiguous else None
        return ExtendGroup(kv_indices, q_rows, None, q_rows.flatten(), mask, first_row)
    src = q_valid.flatten().nonzero().squeeze(1)
    return ExtendGroup(kv_indices, q_rows, src, q_rows.flatten()[src], mask)


class TorchNativeAttnBackend(AttentionBackend):
    """Paged attention in PyTorch's SDPA (see the module's docstring)."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode():
            table = batch.req_to_token_pool.req_to_token
            max_len = max(batch.seq_lens_cpu) if batch.batch_size else 0
            indices = table[batch.req_pool_indices, :max_len]
            arange = torch.arange(max_len, device=indices.device)
            mask = arange[None, :] < batch.seq_lens[:, None]
            indices = torch.where(mask, indices, 0)  # padding reads the zeroed dummy slot
            batch.attn_metadata = TorchNativeMetadata(indices, mask[:, None, None, :])
        elif batch.forward_mode.is_extend() and batch.batch_size:
            extend = ExtendSeqs.of(batch)
            groups = group_extend(extend.prefix_lens, extend.new_lens)
            groups = [_extend_group(batch, extend, seqs) for seqs in groups]
            batch.attn_metadata = TorchNativeMetadata(extend_groups=groups)
        else:
            batch.attn_metadata = TorchNativeMetadata(extend_groups=[])

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        if save_kv_cache:
            batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf = batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = batch.token_to_kv_pool.get_value_buffer(layer.layer_id)
        meta: TorchNativeMetadata = batch.attn_metadata
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        # On CPU, SDPA's fused kernel takes grouped KV heads as they are (same bits, no copy).
        gqa = q.device.type == "cpu"
        for group in meta.extend_groups:
            key = gather_slots(k_buf, group.kv_indices)
            if layer.kv_from_cache is not None:
                key, value = _expanded_kv(key, layer)
            else:
                value = _value_like_key(key, batch.token_to_kv_pool, v_buf, group.kv_indices, layer)
            key, value = key.transpose(1, 2), value.transpose(1, 2)  # [b, Hk, Lk, D]
            if not gqa:
                key, value = _expand_kv(key, layer), _expand_kv(value, layer)
            o = F.scaled_dot_product_attention(
                _group_queries(q, group).transpose(1, 2),  # [b, H, Lq, D]
                key,
                value,
                attn_mask=group.mask,
                is_causal=group.mask is None,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            o = o[..., : layer.v_head_dim].transpose(1, 2)
            if group.first_row is not None:
                rows = o.shape[0] * o.shape[1]
                out[group.first_row : group.first_row + rows] = o.reshape(rows, *o.shape[2:])
                continue
            o = o.reshape(-1, layer.num_heads, layer.v_head_dim)  # [b·Lq, H, Dv]
            out[group.dst] = o if group.src is None else o.index_select(0, group.src)
        return out

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        if save_kv_cache:
            batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        meta: TorchNativeMetadata = batch.attn_metadata
        pool = batch.token_to_kv_pool
        key = gather_slots(pool.get_key_buffer(layer.layer_id), meta.kv_indices)
        v_buf = pool.get_value_buffer(layer.layer_id)
        value = _value_like_key(key, pool, v_buf, meta.kv_indices, layer)
        num_tokens, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        o = F.scaled_dot_product_attention(
            q.reshape(num_tokens, layer.num_kv_heads, group, q.shape[-1]),  # [B, Hk, H/Hk, D]
            key.transpose(1, 2),  # [B, Hk, L, D]
            value.transpose(1, 2),
            attn_mask=meta.kv_mask,  # [B, 1, 1, L]: the same keys for every row
            scale=layer.scaling,
        )
        return o.reshape(num_tokens, layer.num_heads, -1)[..., : layer.v_head_dim]  # [B, H, Dv]


def gather_slots(buf: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``buf[indices]`` for a pool buffer ``[slots, ...]`` and an index of any shape."""
    rows = buf.view(buf.shape[0], -1).index_select(0, indices.flatten())
    return rows.view(*indices.shape, *buf.shape[1:])


def _group_queries(q: torch.Tensor, group: ExtendGroup) -> torch.Tensor:
    """The group's queries ``[b, Lq, H, D]``."""
    if group.first_row is None:
        return gather_slots(q, group.q_rows)
    b, lq = group.q_rows.shape
    return q[group.first_row : group.first_row + b * lq].view(b, lq, *q.shape[1:])


def _value_like_key(key, pool, v_buf, indices: torch.Tensor, layer) -> torch.Tensor:
    """The gathered values, as wide as the keys. SDPA's fused CPU kernel needs one head dim;
    values narrower than keys (MLA: the latent without its rope part) would send it to the
    math kernel, which copies K and V per head (8× slower at batch 32). The output columns past
    ``v_head_dim`` are dropped by the caller, and each output column depends on its value
    column alone, so they may hold anything: where the pool's values are the first columns of
    its keys (MLA), the gathered keys serve as values as they are; otherwise zeros pad them."""
    if layer.v_head_dim != layer.head_dim and pool.values_in_keys:
        return key
    return _as_wide_as(gather_slots(v_buf, indices), key)


def _expanded_kv(rows: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values computed from gathered cache rows (``layer.kv_from_cache``), values as
    wide as the keys (see ``_value_like_key``)."""
    key, value = layer.kv_from_cache(rows)
    return key, _as_wide_as(value, key)


def _as_wide_as(value: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    width = key.shape[-1] - value.shape[-1]
    return F.pad(value, (0, width)) if width else value


def _expand_kv(x: torch.Tensor, layer) -> torch.Tensor:
    """Repeat KV heads (dim 1) for grouped-query attention in extend, off CPU (where SDPA's
    ``enable_gqa`` may not reach the fused kernels)."""
    group = layer.num_heads // layer.num_kv_heads
    return x if group == 1 else x.repeat_interleave(group, dim=1)
