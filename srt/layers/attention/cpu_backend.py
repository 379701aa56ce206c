"""Attention in the CPU kernels (``--attention-backend cpu``; SGLang's CPU backend is
``intel_amx``).

One C call per layer reads each sequence's KV slots in place from the paged cache, without
gathering them: ``cpu_kernels.decode_attention`` over the batch's own request rows and lengths,
and ``cpu_kernels.extend_attention``, causal after each cached prefix, its output written
straight into ``[T, H, Dv]``. The kernels read a float32 or bfloat16 cache (queries are
cast to it, the output back to the queries' dtype) and compute in float32; a KV cache of
another dtype, and MLA's extend (which expands keys and values from its cached latent), run on
PyTorch's SDPA (``TorchNativeAttnBackend``) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.layers import cpu_kernels
from srt.layers.attention.base_attn_backend import AttentionBackend, ExtendSeqs
from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class CpuAttnMetadata:
    """A batch the kernels attend. Extend: per sequence [request row, prefix, new tokens,
    first row of q] as the columns of ``extend_seqs`` ``[4, B]`` (``ExtendSeqs.table`` under
    the request rows); decode reads the batch's own tensors (None)."""

    extend_seqs: torch.Tensor | None = None


class CpuAttnBackend(AttentionBackend):
    """The CPU kernels where they apply, SDPA (``TorchNativeAttnBackend``) elsewhere."""

    def __init__(self):
        if not cpu_kernels.available():
            raise RuntimeError(
                "the cpu attention backend needs the CPU kernels, which are not built here "
                "(see srt.layers.cpu_kernels.build); use --attention-backend torch_native"
            )
        self.sdpa = TorchNativeAttnBackend()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        pool = batch.token_to_kv_pool
        if pool.dtype not in cpu_kernels.ACT_TYPES:
            self.sdpa.init_forward_metadata(batch)
        elif batch.forward_mode.is_decode():
            batch.attn_metadata = CpuAttnMetadata()
        elif batch.forward_mode.is_extend() and not pool.values_in_keys:
            rows = batch.req_pool_indices.to(torch.int64)[None, :]
            table = ExtendSeqs.of(batch).table()
            batch.attn_metadata = CpuAttnMetadata(torch.cat((rows, table)))
        else:  # MLA's extend (it expands its latent) and an idle batch
            self.sdpa.init_forward_metadata(batch)

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        meta = batch.attn_metadata
        if not isinstance(meta, CpuAttnMetadata):
            return self.sdpa.forward_extend(q, k, v, layer, batch, save_kv_cache)
        if layer.kv_from_cache is not None:
            raise RuntimeError("in-place extend attention reads keys as cached, not expanded")
        k_cache, v_cache = _cache(layer, batch, k, v, save_kv_cache)
        out = cpu_kernels.extend_attention(
            q.to(k_cache.dtype), k_cache, v_cache, batch.req_to_token_pool.req_to_token,
            meta.extend_seqs, layer.scaling,
        )  # fmt: skip
        return out.to(q.dtype)

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        if not isinstance(batch.attn_metadata, CpuAttnMetadata):
            return self.sdpa.forward_decode(q, k, v, layer, batch, save_kv_cache)
        k_cache, v_cache = _cache(layer, batch, k, v, save_kv_cache)
        out = cpu_kernels.decode_attention(
            q.to(k_cache.dtype), k_cache, v_cache, batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices, batch.seq_lens, layer.scaling,
        )  # fmt: skip
        return out.to(q.dtype)


def _cache(layer, batch: ForwardBatch, k, v, save_kv_cache: bool):
    """The layer's paged K and V caches, this step's keys and values written first (by the
    kernel where they are of the cache's dtype)."""
    pool, layer_id = batch.token_to_kv_pool, layer.layer_id
    k_cache, v_cache = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    if not save_kv_cache:
        return k_cache, v_cache
    values = (None, None) if pool.values_in_keys else (v, v_cache)  # MLA: in the keys
    if k.dim() == 3 and all(t is None or t.dtype == k_cache.dtype for t in (k, values[0])):
        cpu_kernels.store_kv(k, values[0], batch.out_cache_loc, k_cache, values[1])
    else:
        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
    return k_cache, v_cache
