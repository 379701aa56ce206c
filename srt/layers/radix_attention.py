"""The attention layer that models call; the work is done by the batch's backend."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from srt.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        v_head_dim: int | None = None,
        kv_from_cache: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        """``kv_from_cache``: attention whose keys and values are computed from the cached rows
        rather than cached themselves (MLA's extend: the cache holds the compressed latent,
        attention runs over the per-head keys and values it expands to). It maps gathered cache
        rows ``[..., cache heads, cache dim]`` to ``(key [..., Hk, D], value [..., Hk, Dv])``;
        ``k`` and ``v`` passed to ``forward`` are then in the cache's own layout."""
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_kv_heads
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.kv_from_cache = kv_from_cache

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q [T, H·D] or [T, H, D]; returns [T, H·Dv]."""
        q = q.reshape(-1, self.num_heads, self.head_dim)
        if self.kv_from_cache is None:
            k = k.reshape(-1, self.num_kv_heads, self.head_dim)
            v = v.reshape(-1, self.num_kv_heads, self.v_head_dim)
        out = batch.attn_backend.forward(q, k, v, self, batch, save_kv_cache)
        return out.reshape(-1, self.num_heads * self.v_head_dim)
