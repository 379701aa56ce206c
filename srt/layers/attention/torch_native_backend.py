"""Attention in plain PyTorch (scaled_dot_product_attention) over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class TorchNativeMetadata:
    # Decode: KV slot table padded to the longest sequence, and its validity mask.
    kv_indices: torch.Tensor | None = None  # [B, L]
    kv_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool
    # Extend: per sequence (slots of the whole sequence, first new token, prefix len, new len).
    extend_items: list[tuple[torch.Tensor, int, int, int]] | None = None


class TorchNativeAttnBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token_pool.req_to_token
        if batch.forward_mode.is_decode():
            max_len = max(batch.seq_lens_cpu) if batch.batch_size else 0
            indices = table[batch.req_pool_indices, :max_len]
            arange = torch.arange(max_len, device=indices.device)
            mask = arange[None, :] < batch.seq_lens[:, None]
            indices = torch.where(mask, indices, 0)  # padding reads the zeroed dummy slot
            batch.attn_metadata = TorchNativeMetadata(indices, mask[:, None, None, :])
        elif batch.forward_mode.is_extend():
            items, start = [], 0
            rows = batch.req_pool_indices.tolist()
            for row, prefix, new in zip(
                rows, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
            ):
                items.append((table[row, : prefix + new], start, prefix, new))
                start += new
            batch.attn_metadata = TorchNativeMetadata(extend_items=items)
        else:
            batch.attn_metadata = TorchNativeMetadata()

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        if save_kv_cache:
            batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf = batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = batch.token_to_kv_pool.get_value_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        for slots, start, prefix, new in batch.attn_metadata.extend_items:
            query = q[start : start + new].transpose(0, 1)  # [H, E, D]
            key = k_buf[slots].transpose(0, 1)  # [Hk, S, D]
            value = v_buf[slots].transpose(0, 1)  # [Hk, S, Dv]
            mask = None
            if prefix:
                pos = torch.arange(prefix + new, device=q.device)
                mask = pos[None, :] <= (pos[prefix:, None])  # [E, S]
            o = F.scaled_dot_product_attention(
                query,
                _expand_kv(key, layer, dim=0),
                _expand_kv(value, layer, dim=0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scaling,
            )
            out[start : start + new] = o.transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        if save_kv_cache:
            batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        meta: TorchNativeMetadata = batch.attn_metadata
        key = batch.token_to_kv_pool.get_key_buffer(layer.layer_id)[meta.kv_indices]
        value = batch.token_to_kv_pool.get_value_buffer(layer.layer_id)[meta.kv_indices]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            key.transpose(1, 2),  # [B, Hk, L, D]
            value.transpose(1, 2),
            attn_mask=meta.kv_mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return o.squeeze(2)  # [B, H, Dv]


def _expand_kv(x: torch.Tensor, layer, dim: int) -> torch.Tensor:
    """Repeat KV heads for grouped-query attention in extend: SDPA's own ``enable_gqa`` with a
    causal mask takes the slow math kernel on CPU instead of the fused one."""
    group = layer.num_heads // layer.num_kv_heads
    return x if group == 1 else x.repeat_interleave(group, dim=dim)
