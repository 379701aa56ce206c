"""Attention in Triton over the paged KV cache (SGLang's ``--attention-backend triton``).

Both modes read keys and values in place from the pool through ``req_to_token``
(``triton_ops``): decode with split-KV (flash-decoding) in two launches, extend with one
flash-attention launch over every sequence's prefix and new tokens.

- decode needs no metadata beyond the batch's own ``req_pool_indices`` and ``seq_lens``, and its
  launches depend only on shapes and on ``num_kv_splits``: the CUDA-graph runner can capture it
  once per batch size and replay it with new lengths written into the same tensors
  (``static_decode_metadata``);
- extend's per-sequence prefix lengths, new lengths and first query rows
  (``ExtendSeqs``) are built on the host and sent to the device in one transfer.

MLA runs both modes in the absorbed form (``absorbed_mla_extend``): MQA over the cached latent
(one KV head, keys ``kv_lora_rank + rope`` wide, values the first ``kv_lora_rank`` columns of
the same buffer). Layers that expand the latent into per-head keys (``kv_from_cache``) are not
supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.layers.attention.base_attn_backend import AttentionBackend, ExtendSeqs
from srt.layers.attention.triton_ops import decode_attention_fwd, extend_attention_fwd

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class TritonMetadata:
    # Extend only: rows (prefix lengths, new lengths, first query row) of one [3, B] int64
    # device tensor, and the longest new length (sizes the grid without a device read).
    extend_info: torch.Tensor | None = None
    max_extend_len: int = 0


class TritonAttnBackend(AttentionBackend):
    # MLA models must call extend in the absorbed form (MQA over the latent), not expanded.
    absorbed_mla_extend = True
    # Decode reads only the batch's ``req_pool_indices`` and ``seq_lens`` tensors, so a
    # captured graph stays valid when new values are copied into them.
    static_decode_metadata = True

    def __init__(
        self, num_kv_splits: int = 8, block_n: int | None = None, block_m: int | None = None
    ):
        """``num_kv_splits``: key ranges each decode sequence is cut into. More splits keep the
        GPU busy at small batch sizes and long contexts; each costs a partial output per head
        to write and merge. ``block_n`` / ``block_m``: key / query tile sizes (None: chosen
        from the head dim; small values let tests cross tiles with short sequences)."""
        self.num_kv_splits = num_kv_splits
        self.block_n, self.block_m = block_n, block_m

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.forward_mode.is_extend() or batch.batch_size == 0:
            batch.attn_metadata = TritonMetadata()
            return
        seqs = ExtendSeqs.of(batch)
        batch.attn_metadata = TritonMetadata(
            seqs.table().to(batch.req_pool_indices.device, non_blocking=True), max(seqs.new_lens)
        )

    def forward_extend(self, q, k, v, layer: RadixAttention, batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:  # fmt: skip
        _check_absorbed(layer)
        if save_kv_cache:
            batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        meta: TritonMetadata = batch.attn_metadata
        if q.shape[0] == 0 or meta.extend_info is None:
            return q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        pool = batch.token_to_kv_pool
        prefix_lens, extend_lens, qo_start = meta.extend_info
        return extend_attention_fwd(
            q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices, prefix_lens,
            extend_lens, qo_start, meta.max_extend_len, layer.scaling,
            block_m=self.block_m, block_n=self.block_n,
        )  # fmt: skip

    def forward_decode(self, q, k, v, layer: RadixAttention, batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:  # fmt: skip
        _check_absorbed(layer)
        if save_kv_cache:
            batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        if q.shape[0] == 0:
            return q.new_empty(0, layer.num_heads, layer.v_head_dim)
        pool = batch.token_to_kv_pool
        return decode_attention_fwd(
            q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
            layer.scaling, self.num_kv_splits, block_n=self.block_n,
        )  # fmt: skip


def _check_absorbed(layer: RadixAttention) -> None:
    if layer.kv_from_cache is not None:
        raise RuntimeError(
            "the triton attention backend runs MLA in the absorbed form (MQA over the cached "
            "latent, TritonAttnBackend.absorbed_mla_extend); this layer expands keys and values "
            "from the cache (kv_from_cache), which it does not support"
        )
